"""What an operator sees of the server: an id on every answer, one log line per request, and Prometheus metrics.

- **Request ids.** Every answer, errors included, carries ``x-request-id``: the client's own when it sent one that
  is a plain token (at most :data:`MAX_REQUEST_ID` characters among letters, digits and ``._-:/+=@~``; anything
  else is ignored, never echoed), else the completion's id (``chatcmpl-...``, ``cmpl-...``, the ``id`` of the
  answer), else, on routes that make no completion, one of the server's own (``req-...``).
- **Access log.** One line per request on the logger ``lookupdec.access`` (:data:`ACCESS_LOG`), logfmt, the same
  request id first: method, path, HTTP status, the finish reason, the usage (prompt and completion tokens, target
  passes, drafted and accepted tokens, prediction tokens accepted), seconds in all and to the first token. At
  INFO; ``/health`` and ``/metrics``, which probes and scrapers poll, at DEBUG.
- **Metrics** (:class:`Metrics`), in a registry of the app's own (two apps in one process do not collide), served
  at ``/metrics`` in Prometheus' text format (or OpenMetrics when the scraper asks for it). What vLLM measures
  too is named as vLLM 0.32 names it, with its labels (``model_name``: the first served name; ``engine``: ``"0"``,
  this server's one engine), so a vLLM dashboard reads this server; what only lookupdec measures is named
  ``lookupdec:...`` (:class:`Metrics` declares each, with what it counts).

Nothing here runs on the decoding thread, and a request costs O(1) here whatever its size: a handful of counter
increments and two histogram observations, on the event loop, when its answer is done. The queue and batch
gauges are read from the engine when ``/metrics`` is scraped, not kept up to date per step.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from .protocol import APIError

ACCESS_LOG = "lookupdec.access"
_access = logging.getLogger(ACCESS_LOG)
_log = logging.getLogger(__name__)

MAX_REQUEST_ID = 128
_REQUEST_ID = re.compile(r"[A-Za-z0-9._\-:/+=@~]{1,%d}" % MAX_REQUEST_ID)
_PLAIN = re.compile(r"[A-Za-z0-9._\-:/+=@~{}]{1,200}")  # a log value written as it is; others are quoted
_QUIET_PATHS = ("/health", "/metrics")  # polled: logged at DEBUG, left out of http_requests_total (as vLLM does)
SCOPE_KEY = "lookupdec.exchange"  # where the middleware leaves a request's Exchange in the ASGI scope

# vLLM 0.32's finish reasons (vllm.v1.engine.FinishReason) that this server has: stop and length answer the
# request; abort: the client left, or the request was cut (a shutdown, a cancel); error: it failed in the engine.
FINISHED_REASONS = ("stop", "length", "abort", "error")
# vLLM 0.32's buckets (vllm/v1/metrics/buckets.py), so that histograms compare bucket by bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
# lookupdec's prediction counters, (name, help), on this server's /metrics and on vLLM's (lookupdec.vllm.middleware).
PREDICTION_ACCEPTED = ("lookupdec:prediction_accepted_tokens", "Prediction tokens that appear in the answer "
                       "(usage.completion_tokens_details.accepted_prediction_tokens).")
PREDICTION_REJECTED = ("lookupdec:prediction_rejected_tokens", "Prediction tokens that do not appear in the answer "
                       "(usage.completion_tokens_details.rejected_prediction_tokens).")


def client_request_id(value: str | None) -> str | None:
    """The client's ``x-request-id`` if it is one this server passes on (see the module's docstring), else None."""
    if value is not None and _REQUEST_ID.fullmatch(value):
        return value
    return None


class Exchange:
    """One HTTP request as the operator sees it, filled in by the middleware (arrival, status, end) and by the
    completion routes (the completion's id, the first token, the finish reason and usage)."""

    def __init__(self, method: str = "", path: str = "", client_id: str | None = None, client: str | None = None):
        self.method, self.path, self.client = method, path, client
        self.client_id = client_id  # the client's own x-request-id, checked
        self.completion_id: str | None = None
        self._own: str | None = None
        self.started = time.perf_counter()
        self.status: int | None = None  # the HTTP status sent
        self.submitted = False  # the request reached the engine
        self.first_token: float | None = None  # perf_counter() when its first tokens reached the web layer
        self.finish_reason: str | None = None  # one of FINISHED_REASONS once the engine's part is over
        self.usage: dict | None = None  # the answer's usage object (answered requests only)
        self.complete = False  # the response's last byte was handed to the server
        self.done = False

    @property
    def request_id(self) -> str:
        if self.client_id is not None:
            return self.client_id
        if self.completion_id is not None:
            return self.completion_id
        if self._own is None:
            self._own = "req-" + uuid.uuid4().hex[:24]
        return self._own

    def first_tokens(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def answered(self, finish_reason: str, usage: dict) -> None:
        self.finish_reason, self.usage = finish_reason, usage

    def ended(self, finish_reason: str) -> None:
        """The engine's part ended without an answer (``"abort"`` or ``"error"``); a first verdict stays."""
        if self.finish_reason is None:
            self.finish_reason = finish_reason


def failure_reason(err: APIError) -> str:
    """The finish reason of a request the engine ended with ``err``: a cut or a cancel is an abort."""
    return "abort" if err.code in ("server_shutting_down", "request_cancelled", "client_closed_request") else "error"


class _Load:
    """``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, read from the engine at each scrape."""

    def __init__(self, load, labels: dict):
        self.load, self.labels = load, labels

    def _families(self, values=None):
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=list(self.labels))
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=list(self.labels))
        if values is not None:
            running.add_metric(list(self.labels.values()), values[0])
            waiting.add_metric(list(self.labels.values()), values[1])
        return [running, waiting]

    def describe(self):
        return self._families()

    def collect(self):
        return self._families(self.load())


class Metrics:
    """The server's Prometheus metrics, in :attr:`registry` (the app's own). ``load()``: (running, waiting)."""

    def __init__(self, model_name: str, load):
        self.registry = CollectorRegistry(auto_describe=True)
        vllm = {"model_name": model_name, "engine": "0"}
        ours = {"model_name": model_name}
        names, values = list(vllm), list(vllm.values())

        def counter(name, doc, labels=None):
            labels = vllm if labels is None else labels
            return Counter(name, doc, list(labels), registry=self.registry).labels(*labels.values())

        self.registry.register(_Load(load, vllm))
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=self.registry)
        self.success = {reason: success.labels(*values, reason) for reason in FINISHED_REASONS}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              names, buckets=TTFT_BUCKETS, registry=self.registry).labels(*values)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             names, buckets=LATENCY_BUCKETS, registry=self.registry).labels(*values)
        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.passes = counter("lookupdec:target_passes", "Target forward passes of answered requests (their "
                              "prefill included).", ours)
        self.prediction_accepted = counter(*PREDICTION_ACCEPTED, ours)
        self.prediction_rejected = counter(*PREDICTION_REJECTED, ours)
        self.cache_drafted = counter("lookupdec:cache_drafted_tokens", "Drafted tokens copied from earlier "
                                     "answers (the rolling cache).", ours)
        # As prometheus-fastapi-instrumentator names it on vLLM's server, with the status code itself (not 2xx).
        self.http = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                            ["handler", "method", "status"], registry=self.registry)

    def observe(self, ex: Exchange, handler: str) -> None:
        """Count one finished HTTP request: O(1)."""
        if ex.path not in _QUIET_PATHS:
            self.http.labels(handler, ex.method, str(ex.status)).inc()
        if not ex.submitted:
            return
        self.success[ex.finish_reason or "abort"].inc()
        self.e2e.observe(time.perf_counter() - ex.started)
        if ex.first_token is not None:
            self.ttft.observe(ex.first_token - ex.started)
        usage = ex.usage
        if usage is None:  # the token counters count answered requests, from their usage
            return
        details, lookup = usage.get("completion_tokens_details") or {}, usage.get("lookup") or {}
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.generation_tokens.inc(usage["completion_tokens"])
        self.passes.inc(lookup.get("passes", 0))
        self.drafts.inc(lookup.get("drafts", 0))
        self.draft_tokens.inc(lookup.get("drafted_tokens", 0))
        self.accepted_tokens.inc(lookup.get("accepted_tokens", 0))
        self.cache_drafted.inc(lookup.get("cache_drafted_tokens", 0))
        self.prediction_accepted.inc(details.get("accepted_prediction_tokens", 0))
        self.prediction_rejected.inc(details.get("rejected_prediction_tokens", 0))

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The metrics as the scraper asked for them (its ``Accept``): Prometheus' text format by default."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


def _value(value) -> str:
    text = str(value)
    return text if _PLAIN.fullmatch(text) else json.dumps(text[:200])


def access_line(ex: Exchange) -> str:
    """The request's access-log line (logfmt)."""
    fields = [("request_id", ex.request_id)]
    if ex.completion_id is not None and ex.completion_id != ex.request_id:
        fields.append(("completion_id", ex.completion_id))
    fields += [("method", ex.method), ("path", ex.path), ("status", ex.status)]
    if ex.submitted:
        fields.append(("finish_reason", ex.finish_reason or "abort"))
    usage = ex.usage
    if usage is not None:
        lookup = usage.get("lookup") or {}
        details = usage.get("completion_tokens_details") or {}
        fields += [("prompt_tokens", usage["prompt_tokens"]), ("completion_tokens", usage["completion_tokens"]),
                   ("passes", lookup.get("passes", 0)), ("drafted_tokens", lookup.get("drafted_tokens", 0)),
                   ("accepted_tokens", lookup.get("accepted_tokens", 0)),
                   ("prediction_accepted_tokens", details.get("accepted_prediction_tokens", 0))]
    fields.append(("seconds", f"{time.perf_counter() - ex.started:.3f}"))
    if ex.first_token is not None:
        fields.append(("ttft", f"{ex.first_token - ex.started:.3f}"))
    if ex.client:
        fields.append(("client", ex.client))
    return " ".join(f"{key}={_value(value)}" for key, value in fields)


class Observe:
    """ASGI middleware around the app's routes: each request's :class:`Exchange` (left in the scope under
    :data:`SCOPE_KEY` for the routes to fill in), ``x-request-id`` on its answer, and at its end its metrics and
    access-log line. A fault that escapes the routes is answered here, as a 500 in OpenAI's shape that carries the
    id too (the traceback goes to the log only)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        ex = Exchange(scope.get("method", ""), scope.get("path", ""),
                      client_request_id(_header(scope, b"x-request-id")), client[0] if client else None)
        scope[SCOPE_KEY] = ex

        async def sending(message):
            if message["type"] == "http.response.start":
                ex.status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", ex.request_id.encode())]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ex.complete = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as err:
            if ex.status is not None:  # the answer has begun: nothing to send instead
                raise
            _log.error("unexpected error serving %s", ex.path, exc_info=err)
            error = APIError(500, "internal server error", type="server_error", code="internal_error")
            body = json.dumps(error.body()).encode()
            await sending({"type": "http.response.start", "status": 500,
                           "headers": [(b"content-type", b"application/json"),
                                       (b"content-length", str(len(body)).encode())]})
            await sending({"type": "http.response.body", "body": body})
        finally:
            self._finish(ex, scope)

    def _finish(self, ex: Exchange, scope) -> None:
        if ex.done:
            return
        ex.done = True
        if ex.submitted and ex.finish_reason is None:  # the client left before the engine's part ended
            ex.finish_reason = "abort"
        route = scope.get("route")
        try:
            self.metrics.observe(ex, getattr(route, "path", None) or "none")
        except Exception:  # a metric must never cost a request its answer
            _log.exception("could not record a request's metrics")
        level = logging.DEBUG if ex.path in _QUIET_PATHS else logging.INFO
        if _access.isEnabledFor(level):
            _access.log(level, "%s", access_line(ex))


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return None
