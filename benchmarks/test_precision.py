"""benchmarks/precision.py on a tiny random model: the measurement of one prompt (plain and lookupdec, the replay
of lookupdec's passes, the gaps in ulps), the two modes that decide near-ties as plain decoding does, and the
report. Tests of the tools, not of the product (``python -m pytest -q benchmarks research``)."""

import copy
from dataclasses import asdict

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lookupdec
from benchmarks import precision
from benchmarks.test_run import _tiny
from lookupdec import LookupDrafter

IDS = torch.tensor([[5, 9, 4, 17, 5, 9, 4, 17, 5, 9, 33, 8]])


def _drafter():
    # The tiny model's pass cost is no one's question here, nor the slowdown bound: a random model rejects its first
    # drafts, and the bound would then stop drafting before any verification pass kept a token.
    return LookupDrafter(calibrate=False, max_slowdown=None)


def test_ulp_is_the_spacing_of_the_dtype():
    assert precision.ulp(20.0, torch.bfloat16) == 0.125  # [16, 32) in bf16: 2^(4 - 7)
    assert precision.ulp(-1.5, torch.float16) == 2.0 ** -10
    assert precision.spacing(torch.tensor([0.3, -20.0, 5.0]), torch.bfloat16) == 0.125  # at the largest |logit|


def test_one_prompt_in_fp32_is_identical_and_its_replay_faithful():
    model = _tiny()
    rec = precision.measure(model, IDS, 16, drafter=_drafter(), suite="s", name="p")
    assert rec.identical and rec.matched == rec.plain_tokens == rec.lookup_tokens == 16
    assert rec.divergence is None and rec.replay_faithful
    assert len(rec.plain_gaps_ulps) == 16 and len(rec.gap_change_ulps) == len(rec.perturbation_ulps) == 16
    assert all(g >= 0 for g in rec.plain_gaps_ulps + rec.gap_change_ulps)


def _bf16_model():
    """A random Llama wide enough that a verification pass in bf16 rounds some rows otherwise than a one-row step
    does on a CPU (oneDNN's products of several rows), so lookupdec's bf16 output parts from plain's on some
    prompts."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    model.generation_config.pad_token_id = 0
    return model


def _repeating_prompt(seed):
    base = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(seed))
    return torch.cat([base, base, base[:, :6]], dim=1)  # something to copy: drafts, so verification passes


def test_onerow_gives_plain_tokens_and_a_divergence_sits_at_a_near_tie():
    # Whether lookupdec's bf16 output parts from plain's depends on the CPU's kernels: where it does (after 16
    # tokens on this project's machine), plain's top two were within the bound there; either way the onerow mode,
    # every row computed as a one-row step, gives plain's tokens.
    model, ids = _bf16_model(), _repeating_prompt(11)
    rec = precision.measure(model, ids, 20, drafter=_drafter())
    assert rec.replay_faithful and rec.accepted_tokens > 0  # it drafted: verification passes ran
    if not rec.identical:
        assert rec.divergence.within and rec.divergence.plain_gap <= precision.BOUND_ULPS * rec.divergence.ulp
    with torch.inference_mode():
        plain = precision.plain_greedy(model, ids, 20)[0]
        rows = lookupdec.generate(precision.onerow_model(model), ids, torch.ones_like(ids), max_new_tokens=20,
                                  drafter=_drafter())
    assert rows.sequences[0, ids.shape[1]:].tolist() == plain


def test_the_recheck_prototype_runs_and_rechecks_near_ties():
    # Not exact (its one-row step reads keys and values of multi-row passes): it runs, and decides near-ties apart.
    tokens, passes, rechecks = precision.recheck_generate(_bf16_model(), _repeating_prompt(11), 20,
                                                          precision.BOUND_ULPS, drafter=_drafter())
    assert len(tokens) == 20 and passes < 20 and rechecks > 0


def test_the_report_renders_records_and_timing():
    model = _tiny()
    rec = asdict(precision.measure(model, IDS, 8, drafter=_drafter(), suite="yaml", name="p"))
    low = copy.deepcopy(rec) | {"dtype": "bf16", "identical": False, "matched": 3,
                                "divergence": {"plain_token": 1, "lookup_token": 2, "top": 2.0, "largest": 20.0,
                                               "ulp": 0.125, "bound": 1.0, "plain_gap": 0.25,
                                               "plain_choice_gap": 0.25, "verify_gap": 0.1,
                                               "verify_choice_gap": 0.1, "recheck_token": 1, "within": True}}
    timing = [{"name": "p", "new_tokens": 8, "seconds": {"plain": 1.0, "lookupdec": 0.5, "onerow": 2.0},
               "identical": {"plain": True, "lookupdec": False, "onerow": True},
               "matched": {"plain": 8, "lookupdec": 3, "onerow": 8},
               "extra": {"plain": {}, "lookupdec": {"tokens_per_pass": 2.0}, "onerow": {"tokens_per_pass": 1.5}}}]
    meta = {"dtype": "bf16", "bound_ulps": 8, "command": "c", "date": "d", "machine": "m", "model": "x",
            "max_new_tokens": 8, "seconds": 1.0, "reps": 1}
    text = precision.markdown({"meta": meta, "records": [low, rec], "timing": timing})
    assert "| yaml | bf16 | 1 | 0 | 1 | 3, 3 | 1/1 | 2 |" in text  # plain's gap at the divergence: 2 u
    assert "| yaml | fp32 | 1 | 1 | 0 | - | 0/0 | - |" in text
    assert "| speed vs plain | 2.00x | 0.50x |" in text and "| identical to plain | 0/1 | 1/1 |" in text
