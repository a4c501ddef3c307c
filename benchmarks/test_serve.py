"""benchmarks/serve.py's load loops and its per-request ratios, on a stand-in send (no server): the closed loop
keeps `level` requests in flight and times each from its send; the open loop (``--interval``) sends on a clock,
whatever the server does, and times each request from its arrival, waiting for a slot included.

Tests of the tools, not of the product (``python -m pytest -q benchmarks``). Times are real sleeps, so the checks
are lower bounds and orderings, which a slow machine cannot break."""

import asyncio
import time

from benchmarks.serve import Result, schedule, summarize


def _loop(requests, level, interval, hold):
    """Each request holds its slot `hold` seconds; returns (request, start given, send time, end time) rows."""
    async def send(req, start):
        sent = time.perf_counter()
        await asyncio.sleep(hold)
        return req, start, sent, time.perf_counter()

    return asyncio.run(schedule(requests, level, interval, send))


def test_the_closed_loop_keeps_level_requests_in_flight_and_times_from_the_send():
    rows, wall = _loop(list(range(4)), level=2, interval=None, hold=0.05)
    assert [r[0] for r in rows] == [0, 1, 2, 3]  # results in request order
    assert all(start is None for _, start, _, _ in rows)  # latency counts from the send
    sends = sorted(sent for _, _, sent, _ in rows)
    assert sends[2] - sends[0] >= 0.045  # the third waits for a slot
    assert wall >= 0.095  # two rounds of two


def test_the_open_loop_sends_on_a_clock_and_times_from_arrival_waits_included():
    rows, _ = _loop(list(range(3)), level=8, interval=0.1, hold=0.01)
    arrivals = [start for _, start, _, _ in rows]
    assert arrivals[1] - arrivals[0] >= 0.095 and arrivals[2] - arrivals[0] >= 0.195  # on the clock, not on answers
    # One slot and arrivals closer than a request takes: the third waits for two, and its latency says so.
    rows, _ = _loop(list(range(3)), level=1, interval=0.0, hold=0.05)
    _, start, sent, end = rows[2]
    assert sent - start >= 0.095 and end - start >= 0.145


def _result(server, name, kind, seconds, text="same"):
    return Result(server, 4, 0, name, kind, seconds, text, 3, 3)


def test_each_open_ended_request_gets_its_own_speed_against_the_reference_slowest_first():
    results = [_result("vllm", "e", "edit", 4.0), _result("vllm", "o1", "open", 2.0),
               _result("vllm", "o2", "open", 3.0),
               _result("vllm-lookupdec", "e", "edit", 1.0), _result("vllm-lookupdec", "o1", "open", 4.0),
               _result("vllm-lookupdec", "o2", "open", 2.0, text="other")]
    walls = {("vllm", 4, 0): 5.0, ("vllm-lookupdec", 4, 0): 4.0}
    ratios = summarize(results, walls, ["vllm", "vllm-lookupdec"], [4], "vllm")["ratios"][4]["vllm-lookupdec"]
    assert ratios["open_speeds"] == [0.5, 1.5]  # o1 took twice as long, o2 two thirds
    assert ratios["median_edit_latency"] == 0.25 and ratios["identical"] == 2 and ratios["pairs"] == 3
