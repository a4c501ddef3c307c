"""benchmarks/decompose.py: the figures it derives from timed runs and a trace. Tests of the tool, not of the
product; run them from the repository root: ``python -m pytest -q benchmarks``."""

import pytest
import torch

from benchmarks import decompose
from benchmarks.test_run import _tiny


def _record(steps, *, plain_s=10.0, prefill_s=1.0, plain_tokens=10, lookupdec_s=8.0, price=(1.0, 1.5, 2.0, 2.5)):
    return {"plain_s": plain_s, "prefill_s": prefill_s, "plain_tokens": plain_tokens, "lookupdec_s": lookupdec_s,
            "identical": True, "steps": steps, "price": list(price)}


def test_figures_from_one_prompt():
    # plain: 1 s prefill, then 9 tokens in 9 s (a plain step of 1 s). lookupdec: the prefill pass, two plain passes
    # of 1.1 s, one pass with 3 drafted tokens taking 2 s that kept 4 tokens, one with 1 drafted taking 1.5 s that
    # kept 1 (the draft was wrong).
    steps = [(0, 0, 1, 1.0), (0, 0, 1, 1.1), (0, 0, 1, 1.1), (3, 3, 4, 2.0), (1, 0, 1, 1.5)]
    row = decompose.decompose([_record(steps)])
    assert row["speedup"] == pytest.approx(10 / 8)
    assert row["prefill_share_of_plain"] == pytest.approx(0.1)
    assert row["decode_speedup"] == pytest.approx(9 / 7)
    assert row["undrafted_passes"] == 2 and row["undrafted_vs_plain_step"] == pytest.approx(1.1)
    assert row["drafted_passes"] == 2 and row["mean_draft"] == pytest.approx(2.0)
    assert row["tokens_per_drafted_pass"] == pytest.approx(2.5)
    assert row["drafted_vs_plain_time"] == pytest.approx(3.5 / 5)  # 5 tokens would have taken plain 5 s
    assert row["drafted_vs_price"] == pytest.approx(3.5 / (2.5 + 1.5))  # priced at price[3] and price[1] steps
    assert row["outside_passes_share"] == pytest.approx((8 - 6.7) / 8)


def test_each_prompt_is_compared_with_its_own_plain_step():
    # Two prompts whose plain steps differ by 2x, each lookupdec pass as slow as its own prompt's plain step.
    fast = _record([(0, 0, 1, 0.5), (0, 0, 1, 0.5)], plain_s=5.0, prefill_s=0.5, plain_tokens=10)
    slow = _record([(0, 0, 1, 2.0), (0, 0, 1, 2.0)], plain_s=19.0, prefill_s=1.0, plain_tokens=10)
    assert decompose.decompose([fast, slow])["undrafted_vs_plain_step"] == pytest.approx(1.0)


def test_measure_runs_both_systems_and_checks_the_output():
    model = _tiny()
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    rec = decompose.measure(model, ids, max_new_tokens=12, reps=1)
    assert rec["identical"]
    assert rec["steps"][0][0] == 0  # the prefill pass checks no draft
    assert sum(kept for _d, _a, kept, _s in rec["steps"]) == rec["plain_tokens"]
    row = decompose.decompose([rec])
    assert row["prompts"] == 1 and row["identical"] == 1
