"""benchmarks/serve.py: its load loops and per-request ratios on a stand-in send (no server): the closed loop keeps
`level` requests in flight and times each from its send; the open loop (``--interval``) sends on a clock, whatever
the server does, and times each request from its arrival, waiting for a slot included; each class of request gets
its median, 10th percentile and worst speed. Then a whole run, lookupdec against itself without drafting, on real
servers over a tiny model.

Tests of the tools, not of the product (``python -m pytest -q benchmarks research``). Times are real sleeps, so the
checks are lower bounds and orderings, which a slow machine cannot break."""

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from benchmarks import serve
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


def test_each_class_of_request_gets_its_median_tail_and_worst():
    # Speeds against the reference (its latency over the server's): edits 4, 2, 1, 0.5; the open one 1.
    results = [_result("ref", f"e{i}", "edit", 4.0) for i in range(4)] + [_result("ref", "o", "open", 2.0)]
    results += [_result("srv", f"e{i}", "edit", t) for i, t in enumerate((1.0, 2.0, 4.0, 8.0))]
    results += [_result("srv", "o", "open", 2.0)]
    walls = {("ref", 4, 0): 10.0, ("srv", 4, 0): 10.0}
    speeds = summarize(results, walls, ["ref", "srv"], [4], "ref")["ratios"][4]["srv"]["speeds"]
    assert speeds["edit"] == {"n": 4, "median": 1.5, "p10": 0.5, "worst": 0.5, "worst_name": "e3, rep 0"}
    assert speeds["open"]["n"] == 1 and speeds["open"]["worst"] == 1.0


def test_each_open_ended_request_gets_its_own_speed_against_the_reference_slowest_first():
    results = [_result("vllm", "e", "edit", 4.0), _result("vllm", "o1", "open", 2.0),
               _result("vllm", "o2", "open", 3.0),
               _result("vllm-lookupdec", "e", "edit", 1.0), _result("vllm-lookupdec", "o1", "open", 4.0),
               _result("vllm-lookupdec", "o2", "open", 2.0, text="other")]
    walls = {("vllm", 4, 0): 5.0, ("vllm-lookupdec", 4, 0): 4.0}
    ratios = summarize(results, walls, ["vllm", "vllm-lookupdec"], [4], "vllm")["ratios"][4]["vllm-lookupdec"]
    assert ratios["open_speeds"] == [0.5, 1.5]  # o1 took twice as long, o2 two thirds
    assert ratios["median_edit_latency"] == 0.25 and ratios["identical"] == 2 and ratios["pairs"] == 3


def test_each_open_ended_request_counts_the_prompts_sent_while_it_ran_here_and_on_the_reference():
    def timed(server, name, kind, sent, done, prompt, seconds=None, **lookup):
        return Result(server, 4, 0, name, kind, seconds or done - sent, "same", 3, 3, prompt_tokens=prompt,
                      sent_at=sent, done_at=done, **lookup)

    # The open request runs 0-10 s on both; here two edits are sent while it runs (one before it, one after it
    # ended do not count), on the reference one.
    results = [timed("ref", "o", "open", 0.0, 10.0, 50), timed("ref", "e1", "edit", 2.0, 12.0, 200),
               timed("ref", "e0", "edit", -1.0, 1.0, 999), timed("ref", "e2", "edit", 12.0, 13.0, 400),
               timed("srv", "o", "open", 0.0, 10.0, 50, seconds=12.5, others_prefill_s=2.25, draft_excess_steps=1.5),
               timed("srv", "e1", "edit", 2.0, 4.0, 200),
               timed("srv", "e0", "edit", -1.0, 1.0, 999), timed("srv", "e2", "edit", 4.0, 11.0, 400)]
    walls = {("ref", 4, 0): 13.0, ("srv", 4, 0): 11.0}
    summary = summarize(results, walls, ["ref", "srv"], [4], "ref")
    [o] = summary["ratios"][4]["srv"]["open_beside"]
    assert o == {"name": "o, rep 0", "speed": 0.8, "prompt_tokens_beside": 600, "reference_prompt_tokens_beside": 200,
                 "others_prefill_s": 2.25, "reference_others_prefill_s": None, "draft_excess_steps": 1.5}
    table = serve.markdown(summary, {"servers": {"ref": {}, "srv": {}}, "threads": 1, "keep_cache": False,
                                     "edits": 3, "opens": 1, "date": "d", "machine": "m", "model": "x",
                                     "requests": 4, "max_tokens": 8, "reps": 1, "seconds": 1})
    assert "| 4 | srv | o, rep 0 | 0.80 | 600 | 200 | 2.25 | - | 1.5 |" in table
    # A request sent beside it that failed, or one without times (an older record): no count rather than a wrong one.
    results[5].prompt_tokens = None
    assert serve.prompt_tokens_beside(results, results[4]) is None
    results[5].prompt_tokens, results[6].sent_at = 200, None
    assert serve.prompt_tokens_beside(results, results[4]) is None
    assert serve.prompt_tokens_beside(results, results[0]) == 200  # the reference's records are whole


def test_the_placebo_cuts_only_edits_and_counts_a_cut_edit_identical_when_it_begins_the_answer():
    reqs = [serve.Request("e", "edit", "u", "p", 96), serve.Request("o", "open", "u", None, 96),
            serve.Request("s", "edit", "u", "p", 8)]
    assert [r.max_tokens for r in serve.placebo(reqs, 40)] == [40, 96, 8]
    assert [r.max_tokens for r in reqs] == [96, 96, 8]  # the run's requests are left as they were
    results = [_result("ref", "e", "edit", 4.0, "key: 1\nname: x\n"), _result("ref", "f", "edit", 4.0, "abc"),
               _result("ref", "o", "open", 4.0, "whole answer"),
               _result("lookupdec-placebo", "e", "edit", 2.0, "key: 1\n"),
               _result("lookupdec-placebo", "f", "edit", 2.0, "abd"),
               _result("lookupdec-placebo", "o", "open", 4.0, "whole")]
    walls = {("ref", 4, 0): 10.0, ("lookupdec-placebo", 4, 0): 8.0}
    r = summarize(results, walls, ["ref", "lookupdec-placebo"], [4], "ref")["ratios"][4]["lookupdec-placebo"]
    # The cut edit that begins the reference's answer is identical; one that departs from it is not, and an
    # open-ended request, never cut, must match whole.
    assert r["identical"] == 1 and [d["name"] for d in r["differences"]] == ["f", "o"]


def test_lookupdec_against_its_own_engine_without_drafting(served, tmp_path):
    # Two real servers on a tiny model: lookupdec, and lookupdec-plain whose every request says "lookup": false.
    # lookupdec-plain is the reference by default; greedy texts must agree, and only lookupdec drafts.
    code = serve.main(["--servers", "lookupdec", "lookupdec-plain", "--levels", "2", "--reps", "1", "--requests",
                       "4", "--max-tokens", "8", *served])
    assert code == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    assert data["summary"]["reference"] == "lookupdec-plain"
    rows = data["summary"]["servers"]
    assert rows["lookupdec@2"]["errors"] == rows["lookupdec-plain@2"]["errors"] == 0
    assert rows["lookupdec-plain@2"]["drafted"] == 0 < rows["lookupdec@2"]["drafted"]
    ratios = data["summary"]["ratios"]["2"]["lookupdec"]
    assert ratios["identical"] == ratios["pairs"] == 4
    assert set(ratios["speeds"]) == {"edit", "open"} and ratios["speeds"]["edit"]["n"] == 3
    table = (tmp_path / "serve.md").read_text()
    assert "| 2 | lookupdec | edit | 3 |" in table and "lookupdec-plain sent \"lookup\": false" in table


def test_the_throughput_first_servers_run_without_the_per_request_bound(tmp_path):
    from types import SimpleNamespace

    from benchmarks import servers as srv

    args = SimpleNamespace(device="cpu", dtype="default", model=None, max_batch=4, max_queue=None,
                           out=tmp_path, startup_timeout=None, vllm_python=__file__)
    argv = srv.lookupdec_server(args, {}, "lookupdec-throughput").base_argv
    assert argv[-2:] == ["--max-slowdown", "none"]
    assert "--max-slowdown" not in srv.lookupdec_server(args, {}, "lookupdec").base_argv
    vllm = srv.vllm_server(args, "vllm-lookupdec-throughput", {}, source="")
    assert vllm.base_argv[-2:] == ["--max-slowdown", "none"] and "--engine" in vllm.base_argv


def test_the_a_a_controls_are_the_plain_servers_under_a_second_name(tmp_path):
    # An A/A control is worth something only if it is the reference server again: same command, same requests.
    from benchmarks import servers as srv

    args = SimpleNamespace(device="cpu", dtype="fp32", model=None, max_batch=4, max_queue=None,
                           out=tmp_path, startup_timeout=None, vllm_python=__file__)
    again = srv.lookupdec_server(args, {}, "lookupdec-plain-again")
    assert again.base_argv == srv.lookupdec_server(args, {}, "lookupdec-plain").base_argv
    assert srv.vllm_server(args, "vllm-again", {}, source="F").base_argv == \
        srv.vllm_server(args, "vllm", {}, source="F").base_argv
    sent = []

    class Client:
        class chat:
            class completions:
                @staticmethod
                async def create(**kw):
                    sent.append(kw)
                    raise RuntimeError("no server")

    req = serve.Request("e", "edit", "fix it", "key: 1\n", 8)
    for name in ("lookupdec-plain", "lookupdec-plain-again"):
        server = SimpleNamespace(name=name, model_id="m")
        asyncio.run(serve._send(Client, server, req, 1, 0, tokenizer=None))
    assert sent[0] == sent[1] and sent[1]["extra_body"] == {"lookup": False} and "prediction" not in sent[1]


def test_every_vllm_server_starts_each_turn_with_an_empty_prefix_cache(monkeypatch):
    # A vLLM server that keeps running would find the prompts of earlier turns computed; one restarted would not.
    calls = []

    class Fake:
        def __init__(self, name):
            self.name, self.ready_s = name, 0.0

        def reset_prefix_cache(self):
            calls.append(("reset", self.name))

        def cpu_seconds(self):
            return None

        def stop(self):
            calls.append(("stop", self.name))

        def start(self):
            pass

        def wait_ready(self):
            pass

    monkeypatch.setattr(serve, "warm_up", lambda *a: None)
    monkeypatch.setattr(serve, "drive", lambda server, *a: (calls.append(("drive", server.name)) or ([], 1.0)))
    args = SimpleNamespace(levels=[4], reps=2, keep_cache=False, interval=None)
    servers = {name: Fake(name) for name in ("vllm", "vllm-lookupdec", "lookupdec")}
    serve.benchmark(args, servers, [], None)
    for name in ("vllm", "vllm-lookupdec"):
        drives = [i for i, c in enumerate(calls) if c == ("drive", name)]
        assert len(drives) == 2 and all(calls[i - 1] == ("reset", name) for i in drives)
    assert ("reset", "lookupdec") not in calls  # lookupdec's own engine has no such cache to empty


def test_every_level_runs_each_server_first_as_often_as_last(monkeypatch):
    # Two levels, two repetitions: alternating by turn alone put the same server first at c=4 in both repetitions.
    runs = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def cpu_seconds(self):
            return None

    monkeypatch.setattr(serve, "warm_up", lambda *a: None)
    monkeypatch.setattr(serve, "drive", lambda server, sent, level, rep, *a: (runs.append((level, rep, server.name))
                                                                              or ([], 1.0)))
    args = SimpleNamespace(levels=[4, 8], reps=2, keep_cache=True, interval=None)
    serve.benchmark(args, {name: Fake(name) for name in ("plain", "lookupdec-plain-again", "other")}, [], None)
    for level in (4, 8):
        firsts = [next(name for lvl, r, name in runs if lvl == level and r == rep) for rep in (0, 1)]
        assert firsts == ["plain", "other"] if level == 4 else firsts == ["other", "plain"]


def test_resetting_a_prefix_cache_the_server_refuses_stops_the_run(tmp_path):
    import http.server
    import threading

    from benchmarks.servers import BenchError, Server

    answers = iter([200, 404])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            code = next(answers)
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b"{}" if code == 200 else b'{"detail": "Not Found"}')

        def log_message(self, *a):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = Server("vllm", [], {}, tmp_path / "log")
        server.port = httpd.server_address[1]
        server.reset_prefix_cache()  # 200: emptied
        with pytest.raises(BenchError, match="reset_prefix_cache answered HTTP 404"):
            server.reset_prefix_cache()
    finally:
        httpd.shutdown()


def test_prefill_threads_reach_every_lookupdec_server_and_only_when_given(tmp_path):
    from benchmarks import servers as srv

    args = SimpleNamespace(device="cpu", dtype="fp32", model=None, max_batch=None, max_queue=None,
                           out=tmp_path, startup_timeout=None, prefill_threads=None)
    assert "--prefill-threads" not in srv.lookupdec_server(args, {}, "lookupdec").base_argv
    args.prefill_threads = "0"
    for name in ("lookupdec", "lookupdec-plain", "lookupdec-throughput"):
        argv = srv.lookupdec_server(args, {}, name).base_argv
        assert argv[argv.index("--prefill-threads") + 1] == "0"
