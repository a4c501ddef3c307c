"""The hindsight bounds of research/simulate.py (``--bounds``): the design notes' account of where the gap to the
oracle comes from rests on them, so they are checked against brute force on small cases. Also its cost curves
(``--cost-file``, ``--flat-cost``), and that its replayed drafters keep to lookupdec's driver.

Tests of the studies, not of the product: the product suite (``python -m pytest`` from the repository root, whose
``testpaths`` is ``tests``) does not collect them; CI runs them after it. From the repository root::

    python -m pytest -q benchmarks research
"""

import functools
import json

import numpy as np
import pytest

from benchmarks.oracle import protocol_mismatches
from lookupdec.drafter import DraftSession
from research import simulate


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


def test_copy_lengths_examples():
    # The answer copies 1 2 3 from the prompt, then writes 9; an n-gram copy needs the token before to match too.
    assert simulate._copy_lengths([], [1, 2, 3, 4], [1, 2, 3, 9], 32, False).tolist() == [3, 2, 1, 0]
    assert simulate._copy_lengths([], [1, 2, 3, 4], [1, 2, 3, 9], 32, True).tolist() == [0, 2, 1, 0]
    # A loop copies from the text it is writing (an overlapping copy), capped at the limit.
    assert simulate._copy_lengths([], [7], [5, 6, 5, 6, 5, 6, 5], 3, False).tolist() == [0, 0, 3, 3, 3, 2, 1]
    # Earlier outputs (the cross-request cache) are copyable, but a copy stops at the separator before the prompt
    # (joined without it, "9 1" would be a 2-token copy at the first position).
    assert simulate._copy_lengths([8, 9], [1], [9, 1], 32, False).tolist() == [1, 1]
    assert simulate._copy_lengths([8, 9], [1], [8, 9], 32, False).tolist() == [2, 1]


def test_copy_lengths_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(40):
        prior, prompt, answer = (rng.integers(0, 4, rng.integers(0, 12)).tolist() for _ in range(3))
        prompt = prompt or [0]
        for ngram in (False, True):
            got = simulate._copy_lengths(prior, prompt, answer, 5, ngram).tolist()
            assert got == _brute_lengths(prior, prompt, answer, 5, ngram)


def test_hindsight_is_the_cheapest_schedule():
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


def test_bounds_hold_for_the_drafters_they_bound():
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
        factory, best_length, first_known = (simulate._LookupFactory(cost, shared=True, calibrate=False)
                                             for _ in range(3))
        prior = []
        for _ in range(3):  # three requests per drafter, so the rolling cache has earlier outputs to offer
            prompt = rng.integers(0, 5, 40).tolist()
            answer = (prompt[5:20] + rng.integers(0, 5, 10).tolist() + prompt[25:35])[: rng.integers(8, 36)]
            ngram = simulate._hindsight(simulate._copy_lengths(prior, prompt, answer, max_draft, True), cost, max_draft)
            anywhere = simulate._hindsight(simulate._copy_lengths(prior, prompt, answer, max_draft, False), cost,
                                           max_draft)
            ours = simulate.replay(factory(), prompt, answer, cost, 99)["time"]
            per_pass = simulate._best_length_replay(best_length(), prompt, answer, cost, 99)["time"]
            knowing_first = simulate._first_known_replay(first_known(), prompt, answer, cost, 99)["time"]
            assert anywhere <= ngram + 1e-9
            assert ngram <= per_pass + 1e-9
            assert ngram <= ours + 1e-9
            assert ngram <= knowing_first + 1e-9
            prior += [-1, *prompt[-factory.drafter.cache.max_n:], *answer]


def test_the_replayed_drafters_follow_the_drivers_protocol():
    # Each replayed drafter is a stand-in on lookupdec's driver: the same start() and Session as lookupdec's.
    assert protocol_mismatches(simulate._PromptLookupDrafter, simulate._PromptLookupSession) == []
    assert protocol_mismatches(simulate._HindsightDrafter, DraftSession) == []


# ---- cost curves from a file, or assumed (--cost-file, --flat-cost) -----------------------------------------


def test_flat_cost_is_the_curve_it_says():
    cost = simulate.flat_cost(0.002)
    assert cost(0) == 1.0
    assert cost(1) == pytest.approx(1.002) and cost(64) == pytest.approx(1.128)
    assert cost(400) == pytest.approx(1.8)  # past the curve's end: the same straight line
    assert "assumed" in simulate._cost_text(cost) and "d=64 1.13" in simulate._cost_text(cost)
    with pytest.raises(ValueError, match="SLOPE"):
        simulate.flat_cost(-0.1)


def test_measured_curves_extrapolate_like_the_drafter():
    # A tree pass can verify more nodes than a curve covers: past its end the cost grows by the slope of its last
    # quarter, as lookupdec's PassCost extrapolates a profile, instead of staying at the last value.
    from lookupdec.policy import PassCost

    profile = [1.0, 1.6, 2.0, 1.5, 1.7, 1.9, 2.1, 2.3, 2.5]
    cost = simulate.MeasuredCost(profile)
    model = PassCost()
    model.use_profile(profile)
    assert [cost(d) for d in range(20)] == pytest.approx(model.costs(19).tolist())
    assert cost(12) == pytest.approx(2.5 + 4 * 0.2)


def _write(path, data):
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_cost_file_gives_the_curve_in_it(tmp_path):
    curve = [1.0] + [1.0 + 0.01 * d for d in range(1, 129)]
    cost = simulate.load_cost_file(_write(tmp_path / "list.json", curve))
    assert [cost(d) for d in range(129)] == pytest.approx(curve)
    assert "list.json" in simulate._cost_text(cost)
    # The device check's json: the curve of the named model, its device and dtype in the caption.
    report = {"cost_curves": {"0.5B": {"profile": curve, "device": "cuda:0", "dtype": "bfloat16"},
                              "7B": {"profile": [1.0] + [2.0] * 128, "device": "cuda:0", "dtype": "bfloat16"},
                              "1.5B": {"error": "OutOfMemoryError: ..."}}}
    path = _write(tmp_path / "device_check.json", report)
    seven = simulate.load_cost_file(path, "7B")
    assert seven(0) == 1.0 and seven(5) == 2.0 and seven.profile.size == 129
    assert "7B measured by device_check (cuda:0, bfloat16)" in simulate._cost_text(seven)
    one = _write(tmp_path / "one.json", {"cost_curves": {"0.5B": report["cost_curves"]["0.5B"]}})
    assert simulate.load_cost_file(one)(10) == pytest.approx(1.1)  # one curve: no name needed


@pytest.mark.parametrize("data, curve, message", [
    ("[1.0, 1.2", None, "is not JSON"),
    ({"a": 1}, None, "expected a JSON list of costs, or device_check.json"),
    ([1.0, "x"] + [1.0] * 70, None, "a JSON list of numbers"),
    ([1.0] * 10, None, r"the curve has 10 costs \(draft lengths 0..9\); the replay needs 0..64"),
    ([2.0] + [3.0] * 70, None, "cost\\[0\\] must be 1 .* got 2"),
    ([1.0, -1.0] + [1.0] * 70, None, "every cost must be a positive number"),
    ([1.0] * 70, "7B", "--cost-curve applies to device_check.json only"),
    ({"cost_curves": {"7B": {"profile": [1.0] * 70}, "0.5B": {"profile": [1.0] * 70}}}, None,
     "name a curve with --cost-curve, one of: 7B, 0.5B"),
    ({"cost_curves": {"7B": {"profile": [1.0] * 70}}}, "3B", "has no curve '3B'; it has: 7B"),
    ({"cost_curves": {"7B": {"error": "OutOfMemoryError"}}}, "7B", "curve '7B' was not measured \\(OutOfMemoryError"),
])
def test_bad_cost_files_say_what_is_wrong(tmp_path, data, curve, message):
    with pytest.raises(ValueError, match=message):
        simulate.load_cost_file(_write(tmp_path / "costs.json", data), curve)


def test_cost_options_on_the_command_line(tmp_path, capsys):
    # A bad file stops the script before the model loads, with one line naming the option and the reason.
    with pytest.raises(SystemExit) as stop:
        simulate.main(["--cost-file", str(tmp_path / "missing.json")])
    assert stop.value.code == 2
    assert "--cost-file / --flat-cost: cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate.main(["--cost-curve", "7B"])
    assert "--cost-curve needs --cost-file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate.main(["--flat-cost", "0.002", "--measure-cost"])
    assert "not allowed with argument" in capsys.readouterr().err
