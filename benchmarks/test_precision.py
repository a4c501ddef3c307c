"""benchmarks/precision.py on a tiny random model: the measurement of one prompt (plain and lookupdec, the replay
of lookupdec's passes, the gaps in ulps), the two modes that decide near-ties as plain decoding does, and the
report. Tests of the tools, not of the product (``python -m pytest -q benchmarks research``)."""

import copy
from dataclasses import asdict

import torch

import lookupdec
from benchmarks import precision
from benchmarks.test_run import _tiny
from lookupdec import LookupDrafter

IDS = torch.tensor([[5, 9, 4, 17, 5, 9, 4, 17, 5, 9, 33, 8]])


def _drafter():
    return LookupDrafter(calibrate=False)  # the tiny model's pass cost is no one's question here


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


def test_the_modes_give_plain_decodings_tokens():
    # onerow: every verification row computed as a one-row step, so plain's logits; recheck: near-ties decided by a
    # one-row step. On this model in bf16 both must give plain's tokens.
    model = _tiny().to(torch.bfloat16)
    with torch.inference_mode():
        plain = model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=16, do_sample=False)
        plain = plain[0, IDS.shape[1]:].tolist()
        onerow = lookupdec.generate(precision.onerow_model(model), IDS, torch.ones_like(IDS), max_new_tokens=16,
                                    drafter=_drafter())
    assert onerow.sequences[0, IDS.shape[1]:].tolist() == plain
    tokens, passes, _ = precision.recheck_generate(model, IDS, 16, precision.BOUND_ULPS, drafter=_drafter())
    assert tokens == plain and passes <= 16


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
