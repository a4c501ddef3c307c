"""The HTTP layer: FastAPI routes in OpenAI's shape over the :class:`~lookupdec.serve.engine.Engine`.

Every refusal is a 4xx with OpenAI's error body (:class:`~lookupdec.serve.protocol.APIError`), a fault of the
server a 500 with the same body and the traceback in the log only. Text is decoded incrementally from the tokens
the engine commits; stop strings are found in that text, cut from the answer, and end the request's row.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from . import protocol
from .engine import Engine, QueueFull, Ticket
from .protocol import APIError

_log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused (413)
_DISCONNECT_POLL_S = 0.5  # how often a request that does not stream checks whether its client is still there


def create_app(engine: Engine, model_name: str, *, api_key: str | None = None, on_shutdown=None,
               max_body_bytes: int = MAX_BODY_BYTES, shutdown_timeout: float = 30.0) -> FastAPI:
    """The application serving ``engine`` under ``model_name``. ``api_key``: required as ``Authorization: Bearer``
    on every ``/v1`` route. ``on_shutdown()`` runs after the engine has stopped (the CLI saves the rolling cache
    there)."""

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop, shutdown_timeout)
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="lookupdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    expected_key = api_key.encode() if api_key else None

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return JSONResponse(APIError(err.status_code, str(err.detail), code=code).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _fault(request, err: Exception):
        _log.exception("unexpected error serving %s", request.url.path)
        return JSONResponse(APIError(500, "internal server error", type="server_error", code="internal_error").body(),
                            status_code=500)

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

    @app.get("/health")
    async def health():
        running, waiting = engine.load
        return {"status": "ok", "model": model_name, "running": running, "waiting": waiting}

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "lookupdec"}]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: HTTPRequest):
        authorize(request)
        if name != model_name:
            raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return {"id": model_name, "object": "model", "created": created, "owned_by": "lookupdec"}

    async def serve(request: HTTPRequest, kind: str):
        authorize(request)
        req = protocol.parse(await _json_body(request, max_body_bytes), kind, [model_name])
        ticket = _ticket(engine, req)
        try:
            engine.submit(ticket)
        except QueueFull:
            raise APIError(429, "the server is busy: too many requests are waiting; retry shortly",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except RuntimeError as err:
            raise APIError(503, str(err), type="server_error", code="unavailable") from None
        if req.stream:
            return StreamingResponse(_stream(ticket, engine.tokenizer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await _collect(ticket, request, engine.tokenizer))

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        return await serve(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await serve(request, "completion")

    app.state.engine = engine
    return app


async def _json_body(request: HTTPRequest, limit: int):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        chunks.append(part)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def _ticket(engine: Engine, req: protocol.Request) -> Ticket:
    """Tokenize ``req`` (the model's chat template for chat) and check it fits the model's context."""
    tokenizer = engine.tokenizer
    if req.kind == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages",
                           code="no_chat_template")
        text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(req.prompt)
    param = "messages" if req.kind == "chat" else "prompt"
    room = engine.context - len(prompt_ids)
    if not prompt_ids:
        raise protocol.invalid("the prompt is empty once tokenized", param=param)
    if req.max_tokens is not None and req.max_tokens > room or room < 1:
        raise APIError(400, f"This model's maximum context length is {engine.context} tokens. However, you "
                       f"requested {len(prompt_ids) + (req.max_tokens or 1)} tokens ({len(prompt_ids)} in the "
                       f"{param}, {req.max_tokens or 1} for the completion).", param=param,
                       code="context_length_exceeded")
    prediction = None
    if req.prediction:
        prediction = tokenizer.encode(req.prediction, add_special_tokens=False)
    return Ticket(req, prompt_ids, prediction, req.max_tokens or room, asyncio.get_running_loop())


class _Text:
    """Incremental detokenization with stop strings: :meth:`add` takes committed tokens and returns the text that
    is safe to send (complete characters, and never a prefix of a stop string that may still complete)."""

    def __init__(self, tokenizer, stops: list):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list = []
        self.text = ""  # decoded so far
        self.sent = 0  # characters of text already handed out
        self.stopped = False
        self._hold = max((len(s) for s in stops), default=1) - 1

    def add(self, tokens: list) -> str:
        self.tokens += tokens
        if self.stopped:  # tokens of the pass that was running when the stop string appeared
            return ""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            return ""
        self.text = text
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if not self.stopped:
            hits = [i for i in (self.text.find(s, max(0, self.sent - self._hold)) for s in self.stops) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[: min(hits)], True
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self._hold)
        out, self.sent = self.text[self.sent: end], end
        return out


def _usage(ticket: Ticket, summary: dict) -> dict:
    out = protocol.usage(len(ticket.prompt_ids), summary.get("completion_tokens", 0),
                         summary.get("accepted_prediction_tokens", 0), summary.get("rejected_prediction_tokens", 0))
    out["lookup"] = {key: summary.get(key, 0) for key in ("passes", "drafted_tokens", "accepted_tokens")}
    return out


async def _events(ticket: Ticket, text: _Text):
    """``("text", str)`` as text becomes safe to send, then ``("done", finish_reason, usage)``; raises the
    engine's APIError. A stop string cancels the row and ends the answer there."""
    while True:
        event = await ticket.events.get()
        if event[0] == "tokens":
            piece = text.add(event[1])
            if piece:
                yield ("text", piece)
            if text.stopped:
                ticket.cancel()
        elif event[0] == "error":
            raise event[1]
        else:
            summary = event[1]
            piece = text.finish()
            if piece:
                yield ("text", piece)
            reason = "stop" if text.stopped else summary.get("finish_reason")
            yield ("done", "stop" if reason == "cancelled" else reason, _usage(ticket, summary))
            return


async def _collect(ticket: Ticket, request: HTTPRequest, tokenizer) -> dict:
    text = _Text(tokenizer, ticket.req.stop)
    events = _events(ticket, text)
    parts = []
    try:
        while True:
            task = asyncio.ensure_future(events.__anext__())
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    break
                if await request.is_disconnected():
                    task.cancel()
                    ticket.cancel()
                    raise APIError(499, "the client closed the request", code="client_closed_request")
            try:
                event = task.result()
            except StopAsyncIteration:
                break
            if event[0] == "text":
                parts.append(event[1])
            else:
                _, reason, usage = event
                return protocol.completion(ticket.req, protocol.new_id(ticket.req.kind), "".join(parts), reason, usage)
    finally:
        ticket.cancel()  # a no-op once the row is done
    raise APIError(500, "the request ended without an answer", type="server_error", code="internal_error")


async def _stream(ticket: Ticket, tokenizer):
    req = ticket.req
    rid, created = protocol.new_id(req.kind), int(time.time())
    text = _Text(tokenizer, req.stop)

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    try:
        if req.kind == "chat":
            yield sse(protocol.chunk(req, rid, created, first=True))
        try:
            async for event in _events(ticket, text):
                if event[0] == "text":
                    yield sse(protocol.chunk(req, rid, created, event[1]))
                else:
                    _, reason, usage = event
                    yield sse(protocol.chunk(req, rid, created, finish_reason=reason))
                    if req.include_usage:
                        yield sse(protocol.chunk(req, rid, created, usage_=usage))
        except APIError as err:  # headers are gone: the error travels as an event, as OpenAI's streams do
            yield sse(err.body())
        yield "data: [DONE]\n\n"
    finally:
        ticket.cancel()  # the client left (or the stream ended): free the row
