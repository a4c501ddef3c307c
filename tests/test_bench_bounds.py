"""The hindsight bounds of benchmarks/simulate.py (``--bounds``): the README's account of where the gap to the
oracle comes from rests on them, so they are checked against brute force on small cases. Also the bookkeeping of
benchmarks/variants.py's survival model, behind one of the README's "Tried and not built" entries, and
the per-suite summary of benchmarks/run.py that the issue targets are read from."""

import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load_benchmark(name: str):
    """benchmarks/NAME.py as a module (the benchmarks import each other by name, so their folder is on the path
    while it loads)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def simulate():
    return _load_benchmark("simulate")


def _brute_lengths(prior, prompt, answer, limit, ngram):
    seq = [*prior, -1, *prompt, *answer]
    base = len(prior) + 1 + len(prompt)
    out = []
    for i in range(len(answer)):
        q = base + i
        best = 0
        for s in range(q):
            if ngram and (s == 0 or seq[s - 1] != seq[q - 1]):
                continue
            k = 0
            while k < limit and q + k < len(seq) and seq[s + k] == seq[q + k]:
                k += 1
            best = max(best, k)
        out.append(best)
    return out


def _brute_schedule(lengths, cost, max_draft):
    """Cheapest cost from the second token on, by trying every draft length and every number of right tokens up
    to what the copy allows, at every pass."""
    n = len(lengths)

    @functools.cache
    def rest(i):
        if i >= n:
            return 0.0
        top = min(max_draft, n - i - 1)
        return min(cost(d) + rest(i + a + 1) for d in range(top + 1) for a in range(min(d, int(lengths[i])) + 1))

    return rest(1)


def test_copy_lengths_examples(simulate):
    # The answer copies 1 2 3 from the prompt, then writes 9; an n-gram copy needs the token before to match too.
    assert simulate._copy_lengths([], [1, 2, 3, 4], [1, 2, 3, 9], 32, False).tolist() == [3, 2, 1, 0]
    assert simulate._copy_lengths([], [1, 2, 3, 4], [1, 2, 3, 9], 32, True).tolist() == [0, 2, 1, 0]
    # A loop copies from the text it is writing (an overlapping copy), capped at the limit.
    assert simulate._copy_lengths([], [7], [5, 6, 5, 6, 5, 6, 5], 3, False).tolist() == [0, 0, 3, 3, 3, 2, 1]
    # Earlier outputs (the cross-request cache) are copyable, but a copy stops at the separator before the prompt
    # (joined without it, "9 1" would be a 2-token copy at the first position).
    assert simulate._copy_lengths([8, 9], [1], [9, 1], 32, False).tolist() == [1, 1]
    assert simulate._copy_lengths([8, 9], [1], [8, 9], 32, False).tolist() == [2, 1]


def test_copy_lengths_match_brute_force(simulate):
    rng = np.random.default_rng(0)
    for _ in range(40):
        prior, prompt, answer = (rng.integers(0, 4, rng.integers(0, 12)).tolist() for _ in range(3))
        prompt = prompt or [0]
        for ngram in (False, True):
            got = simulate._copy_lengths(prior, prompt, answer, 5, ngram).tolist()
            assert got == _brute_lengths(prior, prompt, answer, 5, ngram)


def test_hindsight_is_the_cheapest_schedule(simulate):
    """The DP equals an exhaustive search over every sequence of passes, with a jagged cost curve where a longer
    draft can be the cheaper pass."""
    costs = [1.0, 1.6, 2.0, 1.5, 1.7]

    def cost(d):
        return costs[min(d, len(costs) - 1)]

    rng = np.random.default_rng(1)
    for _ in range(30):
        lengths = rng.integers(0, 5, rng.integers(1, 9))
        assert simulate._hindsight(lengths, cost, 4) == pytest.approx(cost(0) + _brute_schedule(lengths, cost, 4))
    # Nothing to copy: every token costs a plain step.
    assert simulate._hindsight(np.zeros(6, dtype=int), cost, 4) == pytest.approx(6.0)
    # Everything copyable: 3-token drafts are the cheapest per token here (4 tokens for 1.5).
    assert simulate._hindsight(np.full(9, 4), cost, 4) == pytest.approx(1.0 + 2 * 1.5)
    # Two right tokens at each pass: drafting 3 (one of them wrong) is cheaper than drafting the 2 right ones.
    assert simulate._hindsight(np.full(8, 2), cost, 4) == pytest.approx(1.0 + 2 * 1.5 + 1.0)
    # No draft runs past the end: 3 tokens after the prefill take one 2-token draft (3.0), not a 3-token one (2.5).
    assert simulate._hindsight(np.full(4, 4), cost, 4) == pytest.approx(1.0 + 2.0)
    # A worse copy can land somewhere better: 1 right token from position 1 reaches position 3, where a 3-token
    # draft is fully right (1.5 + 1.5); taking all 3 right tokens at once lands on 5 and ends with 1.6.
    assert simulate._hindsight(np.array([2, 3, 2, 3, 1, 1, 0]), cost, 4) == pytest.approx(1.0 + 1.5 + 1.5)


def test_bounds_hold_for_the_drafters_they_bound(simulate):
    """On small repetitive texts, lookupdec's replay never beats the n-gram bound (every draft it makes copies from
    a place that shares the last token), nor do its per-pass-best-length and first-token-known replays, and any
    copy beats the n-gram bound."""
    from lookupdec.drafter import DrafterConfig

    costs = [1.0, 1.6, 2.0, 1.5, 1.7, 1.8, 1.9]

    def cost(d):
        return costs[min(d, len(costs) - 1)]

    max_draft = DrafterConfig().max_draft
    rng = np.random.default_rng(2)
    for _ in range(15):
        factory, best_length, first_known = (simulate._LookupFactory(cost, 99, shared=True, calibrate=False)
                                             for _ in range(3))
        prior = []
        for _ in range(3):  # three requests per drafter, so the rolling cache has earlier outputs to offer
            prompt = rng.integers(0, 5, 40).tolist()
            answer = (prompt[5:20] + rng.integers(0, 5, 10).tolist() + prompt[25:35])[: rng.integers(8, 36)]
            ngram = simulate._hindsight(simulate._copy_lengths(prior, prompt, answer, max_draft, True), cost, max_draft)
            anywhere = simulate._hindsight(simulate._copy_lengths(prior, prompt, answer, max_draft, False), cost,
                                           max_draft)
            ours = simulate.replay(factory, prompt, answer, cost, 99)["time"]
            per_pass = simulate._best_length_replay(best_length, prompt, answer, cost)["time"]
            knowing_first = simulate._first_known_replay(first_known, prompt, answer, cost)["time"]
            assert anywhere <= ngram + 1e-9
            assert ngram <= per_pass + 1e-9
            assert ngram <= ours + 1e-9
            assert ngram <= knowing_first + 1e-9
            prior += [-1, *prompt[-factory.drafter.cache.max_n:], *answer]


@pytest.fixture(scope="module")
def variants():
    return _load_benchmark("variants")


def test_survival_model_counts_positions_at_risk_and_breaks(variants):
    from types import SimpleNamespace

    from lookupdec.drafter import Offer, PassCost, best_draft_length

    model, bucket, keep = variants._Survival(), ("index", 2), variants._SURVIVAL_KEEP
    bins = len(variants._SURVIVAL_EDGES) - 1

    def at(*positions):  # counts per bin of the given draft positions
        return np.bincount(model._bins(np.array(positions)), minlength=bins)

    assert model._bins(np.array([1, 2, 3, 4, 5, 6, 8, 9, 64, 200])).tolist() == [0, 1, 2, 3, 3, 4, 4, 5, 10, 10]
    model.update(bucket, 3, 5)  # tokens 1-3 right, 4 wrong: positions 2-4 were at risk, 4 broke
    risk, broke = model.counts[bucket]
    assert risk.tolist() == at(2, 3, 4).tolist() and broke.tolist() == at(4).tolist()
    model.update(bucket, 5, 5)  # all right: positions 2-5 at risk, nothing broke; the old counts are forgotten
    risk, broke = model.counts[bucket]
    assert risk == pytest.approx(keep * at(2, 3, 4) + at(2, 3, 4, 5)) and broke == pytest.approx(keep * at(4))
    before = [c.copy() for c in model.counts[bucket]]
    model.update(bucket, 0, 5)  # wrong at the first token: that is the drafter's first-token estimate, not ours
    model.update(bucket, 0, 0)  # nothing drafted
    assert all((a == b).all() for a, b in zip(model.counts[bucket], before))

    # With no counts every bin holds its prior hazard 1 - then: the geometric model, so the same length as ours.
    cost = PassCost()
    cost.use_profile([1.0, 1.6, 2.0, 1.5, 1.7, 1.75, 1.9, 1.8, 2.0, 2.1, 2.2])
    tokens = np.arange(10, dtype=np.int32)
    for first, then in ((0.9, 0.95), (0.5, 0.8), (0.2, 0.6)):
        session = SimpleNamespace(_offered=(("cursor", 8), -1, tokens), _drafter=SimpleNamespace(cost=cost))
        assert variants._Survival().length(session, Offer(tokens, first, then)) == \
            best_draft_length(first, then, cost.costs(tokens.size))


def test_run_summary_pools_the_copy_heavy_suites():
    # The speed issue's copy-heavy targets are medians over the yaml and code prompts together: run.py's summary
    # adds that row, each route's ratio to prompt lookup taken per prompt, then the median.
    run = _load_benchmark("run")

    def record(suite, name, seconds):
        runs = [{"system": s, "seconds": t, "new_tokens": 10, "passes": 5, "identical": True, "draft_seconds": 0.0,
                 "accepted_per_position": [], "drafted_per_position": []} for s, t in seconds.items()]
        return {"suite": suite, "name": name, "prompt_tokens": 5, "runs": runs}

    records = [record("yaml", "a", {"greedy": 8, "pld": 4, "lookupdec": 2, "lookupdec_hf": 4}),
               record("yaml", "b", {"greedy": 8, "pld": 4, "lookupdec": 1, "lookupdec_hf": 2}),
               record("code", "c", {"greedy": 6, "pld": 3, "lookupdec": 3, "lookupdec_hf": 3}),
               record("qa", "d", {"greedy": 6, "pld": 6, "lookupdec": 3, "lookupdec_hf": 6})]
    systems = ["greedy", "pld", "lookupdec", "lookupdec_hf"]
    rows, suites = run.summarize(records, systems)
    by = {r["suite"]: r for r in suites}
    assert list(by) == ["yaml", "code", "qa", "yaml + code"]
    assert by["yaml + code"]["prompts"] == 3
    assert by["yaml + code"]["vs_pld"] == 2.0  # per prompt 2, 4, 1
    assert by["yaml + code"]["vs_pld_hf"] == 1.0  # per prompt 1, 2, 1
    assert by["yaml"]["vs_pld"] == 3.0 and by["qa"]["vs_pld_hf"] == 1.0
    meta = {"date": "d", "machine": "m", "model": "x", "mode": "greedy", "max_new_tokens": 10, "reps": 1,
            "pld_tuned": None}
    table = run.markdown(rows, suites, systems, meta)
    assert "| yaml + code | 3 | 2.00 | 4.00 | 2.00 | 2.00 | - | 1.00 |" in table  # pld, ours, hf: x greedy
    _, alone = run.summarize(records[:2], systems)
    assert [r["suite"] for r in alone] == ["yaml"]  # no pooled row without both suites
