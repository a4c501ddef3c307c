"""``/metrics`` on ``lookupdec serve``, read with Prometheus' own text parser: the families vLLM has too carry
vLLM's names, types and labels; after one known request each family moves by what that request's usage says; the
queue and batch gauges show a request running and one waiting; two apps in one process keep their counts apart;
``/metrics`` answers without the API key, as ``/health`` does.

On the tiny peaky model (its prompt is its own greedy cycle, so drafts are made and accepted) behind a tokenizer of
one character per token, with pass costs set by hand (helpers_costs), so that the counts do not depend on this
machine's speed.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import pytest
from helpers_costs import fixed_costs
from helpers_serve import CharTokenizer, gated_passes, running_app, text_of, wait_for_load

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")

from lookupdec.drafter import Drafter, DrafterConfig  # noqa: E402
from lookupdec.serve.app import create_app  # noqa: E402
from lookupdec.serve.engine import Engine  # noqa: E402

VLLM = {"model_name": "tiny", "engine": "0"}
OURS = {"model_name": "tiny"}
# name -> (type, label names), as vLLM 0.32 declares the vllm: ones (vllm/v1/metrics/loggers.py,
# vllm/v1/spec_decode/metrics.py) and prometheus-fastapi-instrumentator http_requests_total.
FAMILIES = {
    "vllm:num_requests_running": ("gauge", set(VLLM)),
    "vllm:num_requests_waiting": ("gauge", set(VLLM)),
    "vllm:prompt_tokens": ("counter", set(VLLM)),
    "vllm:generation_tokens": ("counter", set(VLLM)),
    "vllm:request_success": ("counter", set(VLLM) | {"finished_reason"}),
    "vllm:time_to_first_token_seconds": ("histogram", set(VLLM)),
    "vllm:e2e_request_latency_seconds": ("histogram", set(VLLM)),
    "vllm:spec_decode_num_drafts": ("counter", set(VLLM)),
    "vllm:spec_decode_num_draft_tokens": ("counter", set(VLLM)),
    "vllm:spec_decode_num_accepted_tokens": ("counter", set(VLLM)),
    "lookupdec:target_passes": ("counter", set(OURS)),
    "lookupdec:prediction_accepted_tokens": ("counter", set(OURS)),
    "lookupdec:prediction_rejected_tokens": ("counter", set(OURS)),
    "lookupdec:cache_drafted_tokens": ("counter", set(OURS)),
    "http_requests": ("counter", {"handler", "method", "status"}),
}


@contextmanager
def serving(peaky, *, names=("tiny",), max_batch=8, api_key=None):
    model, _ = peaky
    engine = Engine(model, CharTokenizer(), fixed_costs(Drafter(DrafterConfig(calibrate=False))), max_batch=max_batch)
    with running_app(create_app(engine, list(names), api_key=api_key, drain_timeout=5)) as url:
        yield url, engine


def scrape(url: str) -> tuple[dict, dict]:
    """``({(sample name, labels): value}, {family name: (type, label names)})`` from ``url``/metrics."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples, families = {}, {}
    for family in parser.text_string_to_metric_families(r.text):
        labels = set()
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
            labels |= set(sample.labels) - {"le"}
        families[family.name] = (family.type, labels)
    return samples, families


def _prompt(peaky) -> str:
    return text_of(peaky[1][0].tolist())


def _known(url: str, peaky, **extra) -> dict:
    """One request whose usage says what the metrics must count."""
    prompt = peaky[1][0].tolist()
    body = {"model": "tiny", "prompt": text_of(prompt), "max_tokens": 30, "temperature": 0,
            "prediction": {"content": text_of(prompt[8:38])}, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_family_has_vllms_name_type_and_labels(peaky):
    with serving(peaky) as (url, _):
        _, families = scrape(url)
        _known(url, peaky)  # the labelled families get their first sample
        _, families = scrape(url)
    assert {name: families.get(name) for name in FAMILIES} == FAMILIES


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_one_known_request_moves_each_family_by_what_its_usage_says(peaky):
    with serving(peaky) as (url, _):
        _known(url, peaky, max_tokens=20)  # an earlier answer, for the rolling cache to draft from
        before, _ = scrape(url)
        started = time.perf_counter()
        answer = _known(url, peaky)
        took = time.perf_counter() - started
        after, _ = scrape(url)
    usage, details, lookup = answer["usage"], answer["usage"]["completion_tokens_details"], answer["usage"]["lookup"]
    # Drafts were made and accepted, and the prediction was used: the counts below are not all zeros.
    assert lookup["drafts"] > 0 and lookup["accepted_tokens"] > 0 and details["accepted_prediction_tokens"] > 0
    d = lambda name, **labels: _delta(before, after, name, **labels)  # noqa: E731
    assert d("vllm:prompt_tokens_total", **VLLM) == usage["prompt_tokens"] == 40
    assert d("vllm:generation_tokens_total", **VLLM) == usage["completion_tokens"] == 30
    reasons = {reason: d("vllm:request_success_total", **VLLM, finished_reason=reason)
               for reason in ("stop", "length", "abort", "error")}
    assert reasons == {"stop": 0, "length": 1, "abort": 0, "error": 0} and answer["choices"][0]["finish_reason"] == \
        "length"
    assert d("vllm:spec_decode_num_drafts_total", **VLLM) == lookup["drafts"]
    assert d("vllm:spec_decode_num_draft_tokens_total", **VLLM) == lookup["drafted_tokens"]
    assert d("vllm:spec_decode_num_accepted_tokens_total", **VLLM) == lookup["accepted_tokens"]
    assert d("lookupdec:target_passes_total", **OURS) == lookup["passes"]
    assert d("lookupdec:prediction_accepted_tokens_total", **OURS) == details["accepted_prediction_tokens"]
    assert d("lookupdec:prediction_rejected_tokens_total", **OURS) == details["rejected_prediction_tokens"]
    assert d("lookupdec:cache_drafted_tokens_total", **OURS) == lookup["cache_drafted_tokens"]
    assert d("http_requests_total", handler="/v1/completions", method="POST", status="200") == 1
    # One observation each; the first token came before the end, and both within the client's own wait.
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert d(f"{name}_count", **VLLM) == 1
        assert d(f"{name}_bucket", **VLLM, le="+Inf") == 1
    ttft, e2e = d("vllm:time_to_first_token_seconds_sum", **VLLM), d("vllm:e2e_request_latency_seconds_sum", **VLLM)
    assert 0 < ttft <= e2e <= took
    # Scrapes and probes are left out of http_requests_total, as on vLLM's server.
    assert not any(name == "http_requests_total" and dict(labels)["handler"] in ("/metrics", "/health")
                   for name, labels in after)


def test_a_streamed_request_and_refusals_are_counted(peaky):
    with serving(peaky) as (url, _):
        before, _ = scrape(url)
        prompt = _prompt(peaky)
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        usage = json.loads(lines[-1][6:])["usage"]
        assert httpx.post(url + "/v1/completions", json={"model": "gpt-4o", "prompt": prompt},
                          timeout=10).status_code == 404
        assert httpx.post(url + "/v1/completions", content=b"{", timeout=10).status_code == 400
        after, _ = scrape(url)
    d = lambda name, **labels: _delta(before, after, name, **labels)  # noqa: E731
    assert d("vllm:generation_tokens_total", **VLLM) == usage["completion_tokens"] == 12
    assert d("vllm:request_success_total", **VLLM, finished_reason="length") == 1
    assert d("vllm:time_to_first_token_seconds_count", **VLLM) == 1
    assert d("http_requests_total", handler="/v1/completions", method="POST", status="200") == 1
    assert d("http_requests_total", handler="/v1/completions", method="POST", status="404") == 1
    assert d("http_requests_total", handler="/v1/completions", method="POST", status="400") == 1
    # A refusal never reached the engine: no finish reason, no latency.
    assert d("vllm:e2e_request_latency_seconds_count", **VLLM) == 1


def test_the_gauges_show_the_running_and_the_waiting_requests(peaky, monkeypatch):
    gate = gated_passes(monkeypatch)  # the engine's passes wait while it is clear
    with serving(peaky, max_batch=1) as (url, engine):
        body = {"model": "tiny", "prompt": _prompt(peaky), "max_tokens": 8, "temperature": 0}
        gate.clear()
        answers = []
        workers = [threading.Thread(target=lambda: answers.append(
            httpx.post(url + "/v1/completions", json=body, timeout=60))) for _ in range(2)]
        for worker in workers:
            worker.start()
        wait_for_load(engine, (1, 1))
        during, _ = scrape(url)
        gate.set()
        for worker in workers:
            worker.join(timeout=60)
        after, _ = scrape(url)
    key = lambda name: (name, frozenset(VLLM.items()))  # noqa: E731
    assert (during[key("vllm:num_requests_running")], during[key("vllm:num_requests_waiting")]) == (1, 1)
    assert (after[key("vllm:num_requests_running")], after[key("vllm:num_requests_waiting")]) == (0, 0)
    assert [r.status_code for r in answers] == [200, 200]


def test_two_apps_in_one_process_keep_their_counts_apart(peaky):
    with serving(peaky) as (first, _), serving(peaky) as (second, _):
        _known(first, peaky)
        one, _ = scrape(first)
        other, _ = scrape(second)
    key = ("vllm:prompt_tokens_total", frozenset(VLLM.items()))
    assert one[key] == 40 and other[key] == 0


def test_metrics_and_health_answer_without_the_api_key_and_the_api_does_not(peaky):
    with serving(peaky, api_key="s3cret") as (url, _):
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        samples, _ = scrape(url)
        assert ("vllm:num_requests_running", frozenset(VLLM.items())) in samples
        # The first served name labels the metrics, whichever name a request used.
        with serving(peaky, names=("tiny", "gpt-4.1-mini")) as (named, _):
            answer = _known(named, peaky, model="gpt-4.1-mini")
            counted, _ = scrape(named)
    assert answer["model"] == "tiny"
    assert counted["vllm:prompt_tokens_total", frozenset(VLLM.items())] == 40


def test_an_openmetrics_scraper_gets_openmetrics(peaky):
    with serving(peaky) as (url, _):
        r = httpx.get(url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"},
                      timeout=10)
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")
