"""lookupdec.generate called as people call model.generate: its arguments, its padding and pad token, what it
returns (finish reasons, per-row stats), the errors it raises, and the one loop behind one row and many."""

import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import lookupdec
from lookupdec import Drafter, DrafterConfig, LookupDrafter, RollingCache, generate, models

# --- arguments as model.generate takes them ------------------------------------------------------------------


def _padded(prompt: list, pad: int, width: int) -> tuple:
    ids = torch.tensor([[pad] * (width - len(prompt)) + prompt])
    mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt)])
    return ids, mask


@pytest.mark.parametrize("pad", [3, 12])  # 12: a token the answer repeats, so penalising it would change it
def test_a_repetition_penalty_on_left_padded_input_matches_model_generate(peaky, pad):
    # transformers' repetition penalty skips a row's left padding (it reads the attention mask); processors built
    # without the mask but shown the padding would penalise the pad token (pad == eos here), and answer otherwise.
    model, prompt = peaky
    one, mask = _padded(prompt[0, :12].tolist(), pad, 20)
    two = torch.cat([one, prompt[:, 4:24]])
    masks = torch.cat([mask, torch.ones((1, 20), dtype=torch.long)])
    args = dict(max_new_tokens=24, do_sample=False, repetition_penalty=1.8, eos_token_id=pad, pad_token_id=pad)
    for ids, m in ((one, mask), (two, masks)):
        plain = model.generate(ids, attention_mask=m, **args)
        ours = generate(model, ids, m, drafter=LookupDrafter(), **args)
        assert ours.sequences.tolist() == plain.tolist()


def test_processors_that_read_the_padding_see_it_as_in_model_generate(peaky):
    # no_repeat_ngram_size reads the whole row, left padding included, in model.generate: a run of pad tokens is
    # an n-gram it bans. A loop that strips the padding answers otherwise for some pad token; find one, then
    # check lookupdec answers as model.generate does, alone and in a batch.
    model, prompt = peaky
    head = prompt[0, :12].tolist()
    args = dict(max_new_tokens=24, do_sample=False, no_repeat_ngram_size=2)
    bare = model.generate(prompt[:, :12], attention_mask=torch.ones((1, 12), dtype=torch.long), **args)[0, 12:]
    telling = None
    for pad in range(model.config.vocab_size):
        one, mask = _padded(head, pad, 20)
        if model.generate(one, attention_mask=mask, pad_token_id=pad, **args)[0, 20:].tolist() != bare.tolist():
            telling = pad
            break
    assert telling is not None
    one, mask = _padded(head, telling, 20)
    two = torch.cat([one, prompt[:, 4:24]])
    masks = torch.cat([mask, torch.ones((1, 20), dtype=torch.long)])
    for ids, m in ((one, mask), (two, masks)):
        plain = model.generate(ids, attention_mask=m, pad_token_id=telling, **args)
        ours = generate(model, ids, m, pad_token_id=telling, **args)
        assert ours.sequences.tolist() == plain.tolist()


def test_generation_config_fields_pass_as_keywords(peaky):
    model, prompt = peaky
    eos = int(prompt[0, 10])
    for extra in (dict(eos_token_id=eos), dict(eos_token_id=eos, min_new_tokens=12), dict(no_repeat_ngram_size=3),
                  dict(min_p=0.2, do_sample=True)):
        if extra.get("do_sample"):
            out = generate(model, prompt, max_new_tokens=16, generator=torch.Generator().manual_seed(0), **extra)
            assert out.sequences.shape[1] <= prompt.shape[1] + 16
            continue
        plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False,
                               **extra)
        ours = generate(model, prompt, max_new_tokens=30, do_sample=False, **extra)
        assert ours.sequences.tolist() == plain.tolist(), extra
    with pytest.raises(TypeError, match="unexpected generation arguments"):
        generate(model, prompt, max_new_tokens=4, not_a_field=1)
    with pytest.raises(NotImplementedError, match="output_scores"):
        generate(model, prompt, max_new_tokens=4, output_scores=True)


def test_max_new_tokens_may_come_from_the_generation_config(peaky):
    from transformers import GenerationConfig

    model, prompt = peaky
    out = generate(model, prompt, generation_config=GenerationConfig(max_new_tokens=7, do_sample=False))
    assert out.sequences.shape[1] == prompt.shape[1] + 7
    with pytest.raises(ValueError, match="max_new_tokens is required"):
        generate(model, prompt)
    assert generate(model, prompt, max_new_tokens=np.int64(3)).sequences.shape[1] == prompt.shape[1] + 3
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
            generate(model, prompt, max_new_tokens=bad)


def test_finished_rows_are_padded_with_the_first_eos_id_in_the_configs_order(peaky):
    # transformers pads with eos_token_id[0] when there is no pad token; sorting the EOS ids would pick another.
    model, prompt = peaky
    ids = torch.cat([prompt[:, :8], prompt[:, 21:29]])
    free = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)[:, 8:]
    stop = int(free[0, 0])  # row 0 stops at once; row 1 later, or never
    assert int(free[1, 0]) != stop
    other = max(set(range(model.config.vocab_size)) - set(free.flatten().tolist()))  # never generated, > stop
    assert other > stop
    gen_config = model.generation_config
    saved = gen_config.pad_token_id
    gen_config.pad_token_id = None
    try:
        args = dict(max_new_tokens=20, do_sample=False, eos_token_id=[other, stop])
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), **args)
        ours = generate(model, ids, **args)
    finally:
        gen_config.pad_token_id = saved
    assert ours.sequences.tolist() == plain.tolist()
    assert ours.sequences[0, 9:].tolist() == [other] * (ours.sequences.shape[1] - 9)  # padded with eos[0]


# --- what it returns -------------------------------------------------------------------------------------------


def test_finish_reasons_and_per_row_stats_for_one_row_and_many(peaky):
    model, prompt = peaky
    stop = int(prompt[0, 6])
    one = generate(model, prompt[:, :8], max_new_tokens=40, eos_token_id=stop)
    assert one.finish_reasons == ["stop"] and one.sequences[0, -1].item() == stop
    assert len(one.stats.rows) == 1 and one.stats.rows[0].new_tokens == one.stats.new_tokens
    two = generate(model, torch.cat([prompt[:, :8], prompt[:, 8:16]]), max_new_tokens=3)
    assert two.finish_reasons == ["length", "length"] and len(two.stats.rows) == 2


def test_the_last_pass_of_a_single_row_reaches_the_rolling_cache(peaky):
    # A batch of one runs the batch loop: its session is committed on the last pass too, then finished, so the
    # whole output joins the rolling cache (the old single-row loop stopped before its last commit).
    model, prompt = peaky
    drafter = LookupDrafter()
    out = generate(model, prompt[:, :8], max_new_tokens=30, drafter=drafter)
    generated = out.sequences[0, 8:].tolist()
    stored = drafter.cache.sequences()
    assert len(stored) == 1 and stored[0][-len(generated):].tolist() == generated


# --- errors ----------------------------------------------------------------------------------------------------


def test_errors_share_one_base_exported_from_the_package_root():
    assert issubclass(lookupdec.ModelLoadError, lookupdec.LookupdecError)
    assert issubclass(lookupdec.CacheFileError, lookupdec.LookupdecError)
    assert issubclass(lookupdec.CacheFileError, ValueError)  # callers that caught ValueError still do
    assert {"LookupdecError", "ModelLoadError", "CacheFileError"} <= set(lookupdec.__all__)
    with pytest.raises(lookupdec.LookupdecError, match="no such file"):
        lookupdec.load_model("/no/such/model.gguf")


@pytest.mark.parametrize("field, value", [("max_draft", 16.0), ("max_draft", True), ("min_n", "2"),
                                          ("cache_tokens", 1e4)])
def test_drafter_config_refuses_the_wrong_types(field, value):
    with pytest.raises(TypeError, match=f"{field} must be an int"):
        DrafterConfig(**{field: value})


def test_a_cache_with_use_cache_false_is_refused_not_dropped():
    with pytest.raises(ValueError, match="use_cache=False"):
        Drafter(cache=RollingCache(), use_cache=False)
    with pytest.raises(TypeError, match="DrafterConfig"):
        Drafter({"max_draft": 8})


# --- load_model ------------------------------------------------------------------------------------------------


def test_load_model_passes_placement_and_hub_options_to_transformers(tmp_path, monkeypatch, smollm2,
                                                                      tiny_factory):
    # A bf16 checkpoint: dtype="auto" keeps it (transformers' meaning), the default loads fp32 on the CPU.
    folder = tmp_path / "model"
    tiny_factory("llama").to(torch.bfloat16).save_pretrained(folder)
    smollm2[1].save_pretrained(folder)
    seen = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    model, _ = models.load_model(str(folder), dtype="auto", device="cpu")
    assert model.dtype == torch.bfloat16 and seen[-1]["device_map"] == "cpu" and seen[-1]["dtype"] == "auto"
    model, _ = models.load_model(str(folder))
    assert model.dtype == torch.float32
    models.load_model(str(folder), device_map={"": "cpu"}, trust_remote_code=True)
    assert seen[-1]["device_map"] == {"": "cpu"} and seen[-1]["trust_remote_code"] is True
    with pytest.raises(lookupdec.ModelLoadError, match="revision applies to a hub id"):
        models.load_model(str(folder), revision="main")
    with pytest.raises(ValueError, match="device or device_map"):
        models.load_model(str(folder), device="cpu", device_map="auto")
    shutil.rmtree(folder)


def test_a_streamer_needs_a_batch_of_one(peaky):
    from transformers import TextStreamer

    model, prompt = peaky

    class Seen(TextStreamer):
        def __init__(self):
            self.puts = []

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.puts.append("end")

    with pytest.raises(ValueError, match="a streamer needs a batch of one"):
        generate(model, prompt.repeat(2, 1), max_new_tokens=4, streamer=Seen())
    seen = Seen()
    out = generate(model, prompt[:, :8], max_new_tokens=12, streamer=seen)
    assert seen.puts[0] == prompt[:, :8].tolist() and seen.puts[-1] == "end"
    assert sum(seen.puts[1:-1], []) == out.sequences[0, 8:].tolist()  # every committed token, once, in order
