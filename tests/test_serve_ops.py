"""What an operator relies on, on ``lookupdec serve``: an ``x-request-id`` on every answer (the client's own when
it is a plain token, else the completion's id, errors included) and the same id in one access-log line per request;
and a ``/health`` that tells the truth when the engine's thread has died: 503, every request it held answered with
a 503, and new ones refused with a 503, never left waiting.

On the tiny peaky model behind a tokenizer of one character per token (helpers_serve), and on the engine alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest
from helpers_costs import fixed_costs
from helpers_serve import CharTokenizer, gated_passes, running_app, text_of, wait_for_load
from test_serve_engine import _ids, _outcome, _req

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from lookupdec.drafter import Drafter, DrafterConfig  # noqa: E402
from lookupdec.serve import app as app_module  # noqa: E402
from lookupdec.serve import observe  # noqa: E402
from lookupdec.serve.app import create_app  # noqa: E402
from lookupdec.serve.engine import Engine, EngineFailed, Ticket  # noqa: E402
from lookupdec.serve.run import access_log  # noqa: E402


@pytest.fixture(scope="module")
def server(peaky):
    model, _ = peaky
    engine = Engine(model, CharTokenizer(), fixed_costs(Drafter(DrafterConfig(calibrate=False))))
    with running_app(create_app(engine, "tiny", api_key="k", drain_timeout=5)) as url:
        yield url


KEY = {"Authorization": "Bearer k"}


def _body(peaky, **extra) -> dict:
    prompt = peaky[1][0].tolist()
    return {"model": "tiny", "prompt": text_of(prompt), "max_tokens": 16, "temperature": 0,
            "prediction": {"content": text_of(prompt[8:24])}, **extra}


def _access_lines(caplog, *ids: str, timeout: float = 10.0) -> list[str]:
    """The access-log lines captured so far, waiting up to ``timeout`` seconds for a line of each request id in
    ``ids``: the server logs a request's line once its answer is sent, so the client can read the answer first."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == observe.ACCESS_LOG]
        if all(_line_of(lines, i) for i in ids) or time.monotonic() > deadline:
            return lines
        time.sleep(0.01)


def _line_of(lines: list[str], request_id: str) -> list[str]:
    return [line for line in lines if line.startswith(f"request_id={request_id} ")]


# --------------------------------------------------------------------------------------------- request ids


def test_the_clients_request_id_comes_back_and_names_the_access_line(server, peaky, caplog):
    caplog.set_level(logging.INFO, logger=observe.ACCESS_LOG)
    r = httpx.post(server + "/v1/completions", json=_body(peaky), headers={**KEY, "X-Request-Id": "trace-42.a:b/c"},
                   timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42.a:b/c"
    answer = r.json()
    usage, lookup = answer["usage"], answer["usage"]["lookup"]
    [line] = _line_of(_access_lines(caplog, "trace-42.a:b/c"), "trace-42.a:b/c")
    assert line.startswith(f"request_id=trace-42.a:b/c completion_id={answer['id']} method=POST "
                           "path=/v1/completions status=200 finish_reason=length ")
    assert (f" prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']} "
            f"passes={lookup['passes']} drafted_tokens={lookup['drafted_tokens']} "
            f"accepted_tokens={lookup['accepted_tokens']} "
            f"prediction_accepted_tokens={usage['completion_tokens_details']['accepted_prediction_tokens']} ") in line
    assert " seconds=" in line and " ttft=" in line and line.endswith(" client=127.0.0.1")
    # Alone on the engine: no other request's prefill held it; what drafts cost it comes through the JSON as a
    # float (its value against the ledger: tests/test_serve_engine.py).
    assert lookup["others_prefill_seconds"] == 0.0 and isinstance(lookup["draft_excess_steps"], float)


def test_without_a_request_id_the_answer_carries_the_completions_id_streamed_or_not(server, peaky):
    r = httpx.post(server + "/v1/completions", json=_body(peaky), headers=KEY, timeout=60)
    assert r.headers["x-request-id"] == r.json()["id"] and r.json()["id"].startswith("cmpl-")
    with httpx.stream("POST", server + "/v1/completions", json=_body(peaky, stream=True), headers=KEY,
                      timeout=60) as streamed:
        first = next(line for line in streamed.iter_lines() if line.startswith("data: {"))
        assert streamed.headers["x-request-id"] in first  # the chunks' id


@pytest.mark.parametrize("given", ["x" * (observe.MAX_REQUEST_ID + 1), "a b", 'a"b', "a\\b", "é", ""])
def test_a_request_id_that_is_not_a_plain_token_is_replaced_never_echoed(server, peaky, given):
    r = httpx.post(server + "/v1/completions", json=_body(peaky, max_tokens=1), timeout=60,
                   headers={**KEY, "X-Request-Id": given.encode("utf-8")})
    assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"]


def test_errors_carry_a_request_id_too(server, peaky, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=observe.ACCESS_LOG)
    answers = {
        "unauthorized": httpx.post(server + "/v1/completions", json=_body(peaky), timeout=10),
        "bad body": httpx.post(server + "/v1/completions", content=b"{", headers=KEY, timeout=10),
        "unknown model": httpx.post(server + "/v1/completions", json=_body(peaky, model="gpt-4o"), headers=KEY,
                                    timeout=10),
        "unknown route": httpx.get(server + "/v2/nothing", headers={"X-Request-Id": "mine"}, timeout=10),
    }

    def fault(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "_prepare", fault)  # a fault of the server, outside every guard of a route
    answers["fault"] = httpx.post(server + "/v1/completions", json=_body(peaky), headers=KEY, timeout=10)
    statuses = {name: r.status_code for name, r in answers.items()}
    assert statuses == {"unauthorized": 401, "bad body": 400, "unknown model": 404, "unknown route": 404,
                        "fault": 500}
    for name, r in answers.items():
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, name
    ids = {name: r.headers["x-request-id"] for name, r in answers.items()}
    assert ids["unknown route"] == "mine"
    assert all(ids[name].startswith("cmpl-") for name in ("unauthorized", "bad body", "unknown model", "fault"))
    assert answers["fault"].json()["error"]["code"] == "internal_error"
    lines = _access_lines(caplog, *ids.values())
    for name, r in answers.items():  # one line each, under its id, with its status
        [line] = _line_of(lines, ids[name])
        assert f" status={r.status_code} " in line
    assert any(line.startswith("request_id=mine method=GET path=/v2/nothing status=404 ") for line in lines)


def test_health_and_metrics_are_logged_at_debug_only(server, caplog):
    caplog.set_level(logging.INFO, logger=observe.ACCESS_LOG)
    assert httpx.get(server + "/health", timeout=10).status_code == 200
    assert httpx.get(server + "/metrics", timeout=10).status_code == 200
    # A request logged at INFO after them: once its line is in, theirs would be too.
    assert httpx.get(server + "/v2/nothing", headers={"X-Request-Id": "marker"}, timeout=10).status_code == 404
    lines = _access_lines(caplog, "marker")
    assert _line_of(lines, "marker") and not [line for line in lines if " path=/health " in line or
                                              " path=/metrics " in line]
    caplog.set_level(logging.DEBUG, logger=observe.ACCESS_LOG)
    r = httpx.get(server + "/health", timeout=10)
    [line] = _line_of(_access_lines(caplog, r.headers["x-request-id"]), r.headers["x-request-id"])
    assert line.startswith(f"request_id={r.headers['x-request-id']} method=GET path=/health status=200 ")
    assert r.headers["x-request-id"].startswith("req-")


def test_the_access_log_goes_off_with_no_access_log():
    logger = logging.getLogger(observe.ACCESS_LOG)
    level, propagate, handlers = logger.level, logger.propagate, list(logger.handlers)
    try:
        access_log(True)
        access_log(True)  # once
        ours = [h for h in logger.handlers if getattr(h, "_lookupdec", False)]
        assert len(ours) == 1 and logger.isEnabledFor(logging.INFO)
        access_log(False)
        assert not logger.isEnabledFor(logging.INFO)
    finally:
        logger.setLevel(level)
        logger.propagate = propagate
        logger.handlers[:] = handlers


def test_an_unsafe_path_is_quoted_in_the_access_line():
    ex = observe.Exchange("GET", '/v1/x y"\nrequest_id=forged', None, "127.0.0.1")
    ex.status = 404
    line = observe.access_line(ex)
    assert "\n" not in line and line.count("request_id=") == 2  # ours, and the forged one inside the quotes
    assert 'path="/v1/x y\\"\\nrequest_id=forged"' in line


# ------------------------------------------------------------------------------------------- a dead engine


class _Fatal(BaseException):
    """Not an Exception: passes every `except Exception` guard of the engine's loop."""


def _kill(engine: Engine, how: str, monkeypatch) -> None:
    """Make the engine's thread die at its next step: a BaseException from the step, or an Exception from the
    reporting that the loop's own recovery calls too (outside any request's guard)."""
    if how == "base exception":
        def step():
            raise _Fatal("the step")

        monkeypatch.setattr(engine.scheduler, "step", step)
    else:
        def report(rows):
            raise RuntimeError("the report")

        monkeypatch.setattr(engine, "_report", report)


@pytest.mark.parametrize("how", ["base exception", "failed recovery"])
def test_a_dead_engine_answers_what_it_held_and_takes_nothing_more(peaky, monkeypatch, how):
    model, prompt = peaky
    gate = gated_passes(monkeypatch)
    engine = Engine(model, None, Drafter(DrafterConfig(calibrate=False)), max_batch=1)
    engine.start()

    async def main():
        loop = asyncio.get_running_loop()
        tickets = [Ticket(_req(), _ids(prompt), None, 30, loop) for _ in range(2)]
        gate.clear()
        for ticket in tickets:
            engine.submit(ticket)
        while engine.load != (1, 1):  # one running (its pass held at the gate), one waiting
            await asyncio.sleep(0.005)
        _kill(engine, how, monkeypatch)
        gate.set()
        return await asyncio.wait_for(asyncio.gather(*[_outcome(t) for t in tickets]), 30)

    try:
        outcomes = asyncio.run(main())
        for _, kind, error in outcomes:
            assert kind == "error" and (error.status, error.code) == (503, "engine_failed")
        engine._thread.join(timeout=10)  # it answers its requests, then returns: not necessarily before they read it
        assert engine.failure is not None and not engine._thread.is_alive() and engine.load == (0, 0)
        with pytest.raises(EngineFailed):
            engine.submit(Ticket(_req(), _ids(prompt), None, 30, None))
    finally:
        gate.set()
        engine.stop(timeout=5)


def test_health_says_503_and_every_request_gets_an_openai_503_once_the_engine_died(peaky, monkeypatch):
    model, _ = peaky
    gate = gated_passes(monkeypatch)
    engine = Engine(model, CharTokenizer(), Drafter(DrafterConfig(calibrate=False)), max_batch=1)
    with running_app(create_app(engine, "tiny", drain_timeout=5)) as url:
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
        gate.clear()
        held = {}

        def ask(name, **extra):
            held[name] = httpx.post(url + "/v1/completions", json=_body(peaky, **extra), timeout=60)

        workers = [threading.Thread(target=ask, args=("plain",)),
                   threading.Thread(target=ask, args=("streamed",), kwargs={"stream": True})]
        for worker in workers:
            worker.start()
        wait_for_load(engine, (1, 1))
        _kill(engine, "base exception", monkeypatch)
        gate.set()
        for worker in workers:
            worker.join(timeout=60)
        health = httpx.get(url + "/health", timeout=10)
        later = httpx.post(url + "/v1/completions", json=_body(peaky), timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert later.status_code == 503 and later.json()["error"]["code"] == "engine_failed"
    assert later.json()["error"]["type"] == "server_error" and later.headers["x-request-id"].startswith("cmpl-")
    answers = [held[name] for name in ("plain", "streamed")]
    errors = [r.json()["error"] if r.headers["content-type"].startswith("application/json") else
              json.loads([line for line in r.text.splitlines() if line.startswith("data: {")][-1][6:])["error"]
              for r in answers]
    assert [e["code"] for e in errors] == ["engine_failed", "engine_failed"]
    assert held["plain"].status_code == 503 and held["streamed"].text.rstrip().endswith("data: [DONE]")
