"""The HTTP layer: FastAPI routes in OpenAI's shape over the :class:`~lookupdec.serve.engine.Engine`.

Every refusal is a 4xx with OpenAI's error body (:class:`~lookupdec.serve.protocol.APIError`), a fault of the
server a 500 with the same body and the traceback in the log only. Nothing slow runs on the event loop: a request's
JSON, checks and tokenization run in worker threads (large bodies in a pool of their own, so a 7 MB prompt never
delays a short one), and the answer is decoded incrementally as the engine commits tokens
(:class:`~lookupdec.serve.text.Detokenizer`); stop strings are found in that text, cut from the answer, and end
the request's row.

Life cycle: ``/health`` answers from the first moment, ``"starting"`` (503) while the pass cost is measured, then
``"ok"``; ``"failed"`` (503) if the engine's thread has died, and then every request gets a 503 ``engine_failed``
(:class:`~lookupdec.serve.engine.EngineFailed`) until the server is restarted. A shutdown (:meth:`drain`, called
by the server on SIGTERM or Ctrl-C) stops taking requests, lets the running ones finish for ``drain_timeout``
seconds, and answers what is still running then with an OpenAI-shaped 503 (a stream: an error event, then
``[DONE]``), never with a cut connection or a truncated answer posing as complete.

``/health`` and ``/metrics`` answer without the API key: probes and scrapers (Kubernetes, a load balancer,
Prometheus) ask without one, as on vLLM's server, and neither says anything of a request's content (the model's
name, the load, counts and timings). Every answer carries ``x-request-id``, and each request leaves one line in the
access log (:mod:`~lookupdec.serve.observe`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from . import protocol
from .engine import Engine, EngineFailed, QueueFull, Ticket, engine_failed_error
from .observe import SCOPE_KEY, Exchange, Metrics, Observe, failure_reason
from .protocol import APIError
from .text import Detokenizer, chat_prompt_ids

_log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused (413)
# A prediction longer than the model's context cannot be used (no answer is longer), and its tokenization and index
# cost time in proportion to its size: refused, before tokenizing when its text is longer than this many
# characters per context token (no real text averages more per token), after when its tokens outnumber the context.
PREDICTION_CHARS_PER_TOKEN = 16
_LARGE_BODY_BYTES = 256 << 10  # bodies from this size are parsed and tokenized in a pool of their own
_DISCONNECT_POLL_S = 0.5  # how often a request that does not stream checks whether its client is still there


def create_app(engine: Engine, model_names, *, api_key: str | None = None, on_shutdown=None,
               max_body_bytes: int = MAX_BODY_BYTES, drain_timeout: float = 30.0, startup=None) -> FastAPI:
    """The application serving ``engine`` under ``model_names`` (one name, or several: requests may name any of
    them, ``/v1/models`` lists them all, answers carry the first, as on vLLM). ``api_key``: required as
    ``Authorization: Bearer`` on every ``/v1`` route. ``startup()``, when given, runs in a worker thread before
    the engine starts (the CLI measures the pass cost there) while ``/health`` answers ``"starting"``.
    ``drain_timeout``: seconds the requests in flight get to finish at shutdown. ``on_shutdown()`` runs after the
    engine has stopped (the CLI saves the rolling cache there)."""
    names = [model_names] if isinstance(model_names, str) else list(dict.fromkeys(model_names))
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"model_names must be one or more non-empty names, got {model_names!r}")
    model_name = names[0]
    status = {"value": "starting"}
    # Small bodies and large ones are prepared in separate pools: six 7.9 MB prompts (several seconds of
    # tokenizing each) queue behind each other, never in front of a short request.
    small = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lookupdec-request")
    large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lookupdec-large-request")

    async def start() -> None:
        if startup is not None:
            await asyncio.get_running_loop().run_in_executor(None, startup)
        if status["value"] == "starting":
            engine.start()
            status["value"] = "ok"

    @asynccontextmanager
    async def lifespan(app):
        # With nothing to measure the engine is running before the first connection is taken; otherwise it
        # starts once the measurement, in a worker thread, is done.
        starting = asyncio.ensure_future(start())
        if startup is None:
            await starting
        try:
            yield
        finally:
            status["value"] = "stopping"
            await drain()
            if not starting.done():  # stopped while measuring: the measurement finishes in its thread, unused
                starting.cancel()
            small.shutdown(wait=False, cancel_futures=True)
            large.shutdown(wait=False, cancel_futures=True)
            if on_shutdown is not None:
                on_shutdown()

    async def drain() -> None:
        """Stop taking requests; the running ones get ``drain_timeout`` seconds, then a 503 each. Idempotent."""
        await asyncio.get_running_loop().run_in_executor(None, engine.stop, drain_timeout)

    app = FastAPI(title="lookupdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.drain = drain
    metrics = Metrics(model_name, lambda: engine.load)
    app.state.metrics = metrics
    # Outside the exception handlers, so that it sees (and marks with the request id) every answer, and answers
    # a fault that escapes the routes itself.
    app.add_middleware(Observe, metrics=metrics)
    created = int(time.time())
    expected_key = api_key.encode() if api_key else None

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return JSONResponse(APIError(err.status_code, str(err.detail), code=code).body(), status_code=err.status_code)

    def authorize(request: HTTPRequest) -> None:
        if expected_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        # compare_digest takes as long whatever the given key shares with the right one.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected_key):
            raise APIError(401, "Incorrect API key provided." if header else
                           "You didn't provide an API key (Authorization: Bearer KEY).",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def state() -> str:
        return "failed" if engine.failure is not None else status["value"]

    @app.get("/health")
    async def health():
        running, waiting = engine.load
        body = {"status": state(), "model": model_name, "running": running, "waiting": waiting}
        return JSONResponse(body, status_code=200 if state() == "ok" else 503)

    @app.get("/metrics")
    async def metrics_route(request: HTTPRequest):
        payload, content_type = metrics.exposition(request.headers.get("accept"))
        return Response(payload, media_type=content_type)

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "lookupdec"}

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        authorize(request)
        return {"object": "list", "data": [card(name) for name in names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: HTTPRequest):
        authorize(request)
        if name not in names:
            raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return card(name)

    async def serve(request: HTTPRequest, kind: str):
        ex: Exchange = request.scope.get(SCOPE_KEY) or Exchange()
        ex.completion_id = protocol.new_id(kind)
        authorize(request)
        if engine.failure is not None:
            raise engine_failed_error(engine.failure)
        if status["value"] != "ok":
            raise APIError(503, "the server is starting (measuring the model's pass cost); retry shortly"
                           if status["value"] == "starting" else "the server is shutting down",
                           type="server_error", code="server_starting" if status["value"] == "starting"
                           else "server_shutting_down", headers={"Retry-After": "5"})
        raw = await _read_body(request, max_body_bytes)
        loop = asyncio.get_running_loop()
        pool = large if len(raw) >= _LARGE_BODY_BYTES else small
        req, prompt_ids, prediction_ids, max_tokens = await loop.run_in_executor(
            pool, _prepare, raw, kind, names, engine)
        ticket = Ticket(req, prompt_ids, prediction_ids, max_tokens, loop)
        try:
            engine.submit(ticket)
        except QueueFull:
            raise APIError(429, "the server is busy: too many requests are waiting; retry shortly",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except EngineFailed:
            raise engine_failed_error(engine.failure) from None
        except RuntimeError as err:
            raise APIError(503, str(err), type="server_error", code="server_shutting_down") from None
        ex.submitted = True
        if req.stream:
            return StreamingResponse(_stream(ticket, engine.tokenizer, small, rid=ex.completion_id, exchange=ex),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(await _collect(ticket, request, engine.tokenizer, small, rid=ex.completion_id,
                                           exchange=ex))

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        return await serve(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await serve(request, "completion")

    return app


async def _read_body(request: HTTPRequest, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        chunks.append(part)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def _prepare(raw: bytes, kind: str, model_names: list, engine: Engine) -> tuple:
    """In a worker thread: the body checked (:func:`protocol.parse`) and tokenized (the model's chat template for
    chat), checked against the model's context. Returns ``(request, prompt ids, prediction ids or None,
    max_tokens)``; :class:`APIError` for what the server refuses."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    req = protocol.parse(body, kind, model_names)
    tokenizer, context = engine.tokenizer, engine.context
    if req.prediction is not None and len(req.prediction) > PREDICTION_CHARS_PER_TOKEN * context:
        raise _prediction_too_large(f"{len(req.prediction)} characters", context)
    if req.kind == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages",
                           code="no_chat_template")
        prompt_ids = chat_prompt_ids(tokenizer, req.messages)
    else:
        prompt_ids = tokenizer.encode(req.prompt)
    param = "messages" if req.kind == "chat" else "prompt"
    room = context - len(prompt_ids)
    if not prompt_ids:
        raise protocol.invalid("the prompt is empty once tokenized", param=param)
    if req.max_tokens is not None and req.max_tokens > room or room < 1:
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you "
                       f"requested {len(prompt_ids) + (req.max_tokens or 1)} tokens ({len(prompt_ids)} in the "
                       f"{param}, {req.max_tokens or 1} for the completion).", param=param,
                       code="context_length_exceeded")
    prediction = None
    if req.prediction:
        prediction = tokenizer.encode(req.prediction, add_special_tokens=False)
        if len(prediction) > context:
            raise _prediction_too_large(f"{len(prediction)} tokens", context)
    return req, prompt_ids, prediction, req.max_tokens or room


def _prediction_too_large(size: str, context: int) -> APIError:
    return APIError(400, f"the prediction is too large ({size}): this server takes predictions of at most {context} "
                    f"tokens (the model's context) and {PREDICTION_CHARS_PER_TOKEN * context} characters",
                    param="prediction.content", code="prediction_too_large")


def _usage(ticket: Ticket, summary: dict, completion_ids: list) -> dict:
    """OpenAI's usage object: ``completion_tokens`` are the answer's tokens (up to a stop string); the prediction
    counts in OpenAI's meaning (the prediction's tokens that do / do not appear in the answer); ``lookup``: this
    server's own figures (passes, the passes that verified a draft, drafted and accepted tokens, the drafted tokens
    copied from the prediction that the model kept or refused, the drafted tokens copied from earlier answers, and
    where the request's time went beyond plain decoding of it: the seconds of other requests' prefills run once
    its own prompt was in, and the plain steps the drafts of its passes, its own and its neighbours', cost it net,
    negative where they saved)."""
    accepted, rejected = protocol.prediction_usage(ticket.prediction_ids, completion_ids) \
        if ticket.prediction_ids else (0, 0)
    out = protocol.usage(len(ticket.prompt_ids), len(completion_ids), accepted, rejected)
    out["lookup"] = {key: summary.get(key, 0) for key in ("passes", "drafts", "drafted_tokens", "accepted_tokens")}
    out["lookup"]["prediction_drafts_accepted"] = summary.get("accepted_prediction_tokens", 0)
    out["lookup"]["prediction_drafts_rejected"] = summary.get("rejected_prediction_tokens", 0)
    out["lookup"]["cache_drafted_tokens"] = summary.get("cache_drafted_tokens", 0)
    out["lookup"]["others_prefill_seconds"] = round(summary.get("others_prefill_seconds", 0.0), 4)
    out["lookup"]["draft_excess_steps"] = round(summary.get("draft_excess_steps", 0.0), 3)
    return out


async def _events(ticket: Ticket, text: Detokenizer, pool, exchange: Exchange):
    """``("text", str)`` as text becomes safe to send, then ``("done", finish_reason, usage)``; raises the
    engine's APIError. A stop string cancels the row and ends the answer there; a row ended by anything but its
    own finish (a stop string, EOS, the budget) is an error, never an answer that looks complete. ``exchange``
    learns when the first tokens came and how the request ended."""
    ids = []
    while True:
        event = await ticket.events.get()
        if event[0] == "tokens":
            exchange.first_tokens()
            if not text.stopped:
                ids += event[1]
            piece = text.add(event[1])
            if piece:
                yield ("text", piece)
            if text.stopped:
                ticket.cancel(used=text.answer_tokens)
        elif event[0] == "error":
            exchange.ended(failure_reason(event[1]))
            raise event[1]
        else:
            summary = event[1]
            piece = text.finish()
            if piece:
                yield ("text", piece)
            if text.stopped:  # found only now: the row ended by itself with the stop string in its last pass
                ticket.cancel(used=text.answer_tokens)
            reason = "stop" if text.stopped else summary.get("finish_reason")
            if reason not in ("stop", "length"):
                exchange.ended("abort")
                raise APIError(503, "the request was cancelled before it finished", type="server_error",
                               code="request_cancelled")
            usage = await asyncio.get_running_loop().run_in_executor(
                pool, _usage, ticket, summary, ids[: text.answer_tokens])
            exchange.answered(reason, usage)
            yield ("done", reason, usage)
            return


async def _collect(ticket: Ticket, request: HTTPRequest, tokenizer, pool, *, rid: str | None = None,
                   exchange: Exchange | None = None) -> dict:
    """The answer of a request that does not stream, whose id is ``rid`` (a new one when None): the streamed
    events joined. The client is sent the whole answer or nothing; the rolling cache learns the answer before it
    is sent (:meth:`Ticket.release`), or nothing when the client left."""
    exchange = exchange if exchange is not None else Exchange()
    text = Detokenizer(tokenizer, ticket.req.stop)
    events = _events(ticket, text, pool, exchange)
    parts = []
    released = False
    try:
        while True:
            task = asyncio.ensure_future(events.__anext__())
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    break
                if await request.is_disconnected():
                    task.cancel()
                    exchange.ended("abort")
                    raise APIError(499, "the client closed the request", code="client_closed_request")
            try:
                event = task.result()
            except StopAsyncIteration:
                break
            if event[0] == "text":
                parts.append(event[1])
            else:
                _, reason, usage = event
                await asyncio.get_running_loop().run_in_executor(pool, ticket.release, text.answer_tokens)
                released = True
                return protocol.completion(ticket.req, rid or protocol.new_id(ticket.req.kind), "".join(parts), reason,
                                           usage)
    finally:
        if not released:  # the client gets no answer: frees the row, and the rolling cache learns nothing
            _release(ticket, 0, pool)
    raise APIError(500, "the request ended without an answer", type="server_error", code="internal_error")


def _release(ticket: Ticket, used: int, pool) -> None:
    """:meth:`Ticket.release` without waiting for it: the row is cancelled at once, and a session to finish is
    finished in ``pool`` (off the event loop, which may be closing the request)."""
    ticket.cancel(used)
    try:
        pool.submit(ticket.release, used)
    except RuntimeError:  # the pool is shut down: the server is stopping, and nothing else waits here
        ticket.release(used)


async def _stream(ticket: Ticket, tokenizer, pool, *, rid: str | None = None, exchange: Exchange | None = None):
    """The answer as server-sent events, whose id is ``rid`` (a new one when None). A piece of text counts as
    sent once the server asks for the next one (the transport took it); when the client leaves, only the tokens
    whose text was sent join the rolling cache."""
    req = ticket.req
    exchange = exchange if exchange is not None else Exchange()
    rid, created = rid or protocol.new_id(req.kind), int(time.time())
    text = Detokenizer(tokenizer, req.stop)
    sent = 0  # characters of the answer the client was sent

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    try:
        if req.kind == "chat":
            yield sse(protocol.chunk(req, rid, created, first=True))
        try:
            async for event in _events(ticket, text, pool, exchange):
                if event[0] == "text":
                    yield sse(protocol.chunk(req, rid, created, event[1]))
                    sent = text.sent
                else:
                    _, reason, usage = event
                    yield sse(protocol.chunk(req, rid, created, finish_reason=reason))
                    if req.include_usage:
                        yield sse(protocol.chunk(req, rid, created, usage_=usage))
        except APIError as err:  # headers are gone: the error travels as an event, as OpenAI's streams do
            yield sse(err.body())
        except Exception:  # a fault of the server: said in the stream, the traceback in the log
            _log.exception("unexpected error while streaming")
            exchange.ended("error")
            yield sse(APIError(500, "internal server error", type="server_error", code="internal_error").body())
        yield "data: [DONE]\n\n"
    finally:  # the client left (or the stream ended): free the row; the rolling cache learns what was sent
        _release(ticket, text.tokens_within(sent), pool)
