"""research/serve_sim.py's simulated engine: the step arithmetic and the closed loop, on small made-up requests (no
model), so that the bounds docs/vllm.md draws from it rest on a loop that counts what it says.

Tests of a study, not of the product (``python -m pytest -q research``)."""

import math

import pytest

from research.serve_sim import Job, compare, matched_interval, run

BASE, PER = 0.05, 0.002


def _job(name, kind="edit", prompt=20, answer=None, prediction=None, max_tokens=64):
    answer = list(range(100, 140)) if answer is None else answer
    return Job(name, kind, list(range(prompt)), answer, prediction, max_tokens)


def test_plain_decoding_pays_one_step_per_token_and_the_prefill_once():
    job = _job("a")
    got = run([job], eos=0, concurrency=1, policy=None, base=BASE, per_token=PER)
    want = (BASE + PER * 20) + 39 * (BASE + PER * 1)  # the prefill yields the first token, then one per step
    assert got["latency"]["a"] == pytest.approx(want)
    assert got["wall"] == pytest.approx(want) and got["tokens"] == 40


def test_a_perfect_draft_of_n_tokens_commits_n_plus_one_a_step_and_is_charged_per_token():
    job = _job("a")
    got = run([job], eos=0, concurrency=1, policy="oracle:7", base=BASE, per_token=PER)
    # 39 tokens after the prefill, 8 a step: four full steps and one that drafts the last 6 and adds the 7th.
    steps = math.ceil(39 / 8)
    drafted = 4 * 7 + 6
    want = (BASE + PER * 20) + steps * BASE + PER * (steps + drafted)
    assert got["latency"]["a"] == pytest.approx(want)
    assert got["tokens"] == 40


def test_the_closed_loop_sends_the_next_request_when_a_client_is_free():
    jobs = [_job("a"), _job("b"), _job("c")]
    one = run(jobs, eos=0, concurrency=1, policy=None, base=BASE, per_token=PER)
    alone = (BASE + PER * 20) + 39 * (BASE + PER)
    assert one["wall"] == pytest.approx(3 * alone)  # one after another
    assert all(v == pytest.approx(alone) for v in one["latency"].values())  # latency counts from admission
    two = run(jobs, eos=0, concurrency=2, policy=None, base=BASE, per_token=PER)
    assert two["latency"]["c"] == pytest.approx(alone)  # c runs alone, after a and b
    assert two["latency"]["a"] > alone  # a and b share their steps


def test_lookup_drafts_from_the_prediction_speed_edits_and_an_open_row_pays_for_the_others_going_faster():
    copy = list(range(100, 160))
    edits = [_job(f"edit{i}", prompt=20 + i, answer=copy, prediction=copy, max_tokens=60) for i in range(3)]
    free = _job("open", kind="open", answer=list(range(300, 360)), max_tokens=60)
    jobs = [edits[0], free, edits[1], edits[2]]
    lookup, oracle = compare(jobs, eos=0, concurrency=2, policies=["unbounded", "oracle-edits"], base=BASE,
                             per_token=PER)
    assert lookup["edit_median"] > 2.0  # the edits copy their prediction
    assert oracle["edit_median"] >= lookup["edit_median"]  # nothing drafts better than the answer itself
    # The open row gets no draft. On plain decoding it shares its steps with one edit; here the edits finish
    # sooner, so all three (and their prefills) pass through the steps it shares, each token at a price.
    assert oracle["open"][0] < 0.95
    alone = compare([edits[0], free], eos=0, concurrency=2, policies=["oracle-edits"], base=BASE, per_token=PER)
    assert alone[0]["open"][0] == pytest.approx(1.0)  # one edit, no waste: the same tokens, in fewer steps
    free_tokens = compare(jobs, eos=0, concurrency=2, policies=["oracle-edits"], base=BASE, per_token=0.0)
    assert free_tokens[0]["open"][0] >= 1.0  # where a token costs nothing, it loses nothing


def test_unknown_policies_are_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        run([_job("a")], eos=0, concurrency=1, policy="fastest", base=BASE, per_token=PER)


def test_the_open_loop_sends_requests_on_a_clock_and_counts_latency_from_arrival():
    alone = (BASE + PER * 20) + 39 * (BASE + PER)
    jobs = [_job("a"), _job("b"), _job("c")]
    # Arrivals further apart than a request takes: each runs alone, the engine idles in between.
    spaced = run(jobs, eos=0, concurrency=8, policy=None, base=BASE, per_token=PER, interval=10 * alone)
    assert all(v == pytest.approx(alone) for v in spaced["latency"].values())
    assert spaced["wall"] == pytest.approx(20 * alone + alone)
    assert spaced["rows"] == pytest.approx(1.0)
    # All at once, one row at a time: the third waits for two, and its latency counts that wait.
    queued = run(jobs, eos=0, concurrency=1, policy=None, base=BASE, per_token=PER, interval=0.0)
    assert queued["latency"]["c"] == pytest.approx(3 * alone)


def test_at_the_same_offered_load_an_open_row_loses_nothing_to_edits_that_waste_no_token():
    copy = list(range(100, 160))
    edits = [_job(f"edit{i}", prompt=20 + i, answer=copy, prediction=copy, max_tokens=60) for i in range(3)]
    free = _job("open", kind="open", answer=list(range(300, 360)), max_tokens=60)
    jobs = [edits[0], free, edits[1], edits[2]]
    interval = matched_interval(jobs, eos=0, like=2, base=BASE, per_token=PER)
    # The closed loop of the test above leaves the open row below 0.95x; here the arrivals do not speed up when
    # the edits finish sooner, so the open row shares its steps with the same tokens, in fewer steps.
    row, = compare(jobs, eos=0, concurrency=8, policies=["oracle-edits"], base=BASE, per_token=PER,
                   interval=interval)
    assert row["open"][0] >= 1.0 and row["edit_median"] > 2.0
    assert row["rows"] < row["plain_rows"]
