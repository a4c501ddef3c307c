"""OpenAI's ``prediction`` field on vLLM's server: ``vllm serve ... --middleware
lookupdec.vllm.middleware.PredictedOutputs``.

vLLM's OpenAI server accepts ``prediction`` and drops it. This ASGI middleware, in front of vLLM's routes:

- checks the field (``{"type": "content", "content": <string or text parts>}``; ``type`` may be left out, as
  Relace's API allows; a bad one is a 400 in OpenAI's error shape, as is ``n`` above 1 with a prediction, which
  OpenAI refuses too), tokenizes the prediction with the served model's tokenizer, and hands the ids to the
  request's proposer session as ``vllm_xargs`` (:data:`lookupdec.vllm.PREDICTION_ARG`); a prediction longer than
  the model's context (or, before tokenizing, 16 characters per context token) is a 400 ``prediction_too_large``,
  as on ``lookupdec serve``;
- hands a request's OpenAI ``user`` to the proposer as its client (:data:`lookupdec.vllm.CLIENT_ARG`), which
  scopes the rolling cache of earlier answers (``cache_scope``);
- refuses (400, naming the field) a request that sets a ``vllm_xargs`` key lookupdec owns (``lookupdec_*``)
  itself, in ``vllm_xargs`` or in ``sampling_params.extra_args`` (vLLM's token-in route), on every JSON route,
  with or without a prediction: only the middleware sets them. Every JSON body it read is handed on as it parsed
  it, so vLLM reads exactly what was checked (JSON with duplicate keys cannot carry a second value past it);
- fills ``usage.completion_tokens_details.accepted_prediction_tokens`` / ``rejected_prediction_tokens`` in the
  response, in OpenAI's meaning (the prediction's tokens that appear in the answer, matched in order:
  :func:`lookupdec.serve.protocol.prediction_usage`, on the answer's text tokenized again), in a plain response
  and in a stream's usage chunk (``stream_options: {"include_usage": true}``), and adds them to the counters
  ``lookupdec:prediction_accepted_tokens_total`` / ``lookupdec:prediction_rejected_tokens_total`` (label
  ``model_name``, the answer's model) on vLLM's own ``/metrics`` (:func:`_prediction_counters`).

Requests without ``prediction`` are otherwise vLLM's own. The proposer must be lookupdec's
(:class:`~lookupdec.vllm.proposer.LookupProposer`) for the prediction to be drafted from; the counts are filled
either way. The middleware refuses to start on a vLLM lookupdec does not support.
"""

from __future__ import annotations

import json
import threading

from ..serve.protocol import prediction_usage
from . import CLIENT_ARG, OWNED_PREFIX, PREDICTION_ARG

_PATHS = ("/v1/chat/completions", "/v1/completions")
_MAX_BODY = 64 * 1024 * 1024  # vLLM's own limits apply after this; this bounds what the middleware buffers
_CHARS_PER_TOKEN = 16  # a prediction over 16 characters per context token is refused before it is tokenized


class _Refused(Exception):
    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def _prediction_text(body: dict) -> str | None:
    """The prediction's text, None when the request has none; :class:`_Refused` for a malformed one."""
    prediction = body.get("prediction")
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or prediction.get("type", "content") != "content" \
            or set(prediction) - {"type", "content"}:
        raise _Refused('prediction must be {"type": "content", "content": ...}', "prediction")
    content = prediction.get("content")
    if isinstance(content, list) and content and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            and set(part) == {"type", "text"} for part in content):
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise _Refused("prediction.content must be a string or a non-empty array of text parts",
                       "prediction.content")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:
        raise _Refused("prediction.content is not valid Unicode (a lone surrogate)", "prediction.content") from None
    n = body.get("n", 1)
    if n not in (None, 1):
        raise _Refused("n must be 1 when a prediction is given", "n")
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise _Refused("vllm_xargs must be an object", "vllm_xargs")
    return content


def _owned_key(body: dict) -> str | None:
    """The first field of ``body`` that sets a ``vllm_xargs`` key lookupdec owns (dotted, for the error's
    ``param``), or None. Looked for wherever vLLM takes extra arguments: ``vllm_xargs`` (the OpenAI routes and
    Anthropic's) and ``sampling_params.extra_args`` (vLLM's token-in route)."""
    places = [("vllm_xargs", body.get("vllm_xargs"))]
    params = body.get("sampling_params")
    if isinstance(params, dict):
        places.append(("sampling_params.extra_args", params.get("extra_args")))
    for name, args in places:
        if isinstance(args, dict):
            for key in args:
                if isinstance(key, str) and key.startswith(OWNED_PREFIX):
                    return f"{name}.{key}"
    return None


class _Tokenizers:
    """The served model's tokenizer, loaded once per path (transformers', as vLLM loads it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loaded: dict = {}

    def get(self, app) -> tuple:
        """``(tokenizer, context length)`` of the served model."""
        from . import _internals

        path, context = _internals.served_model(app)
        with self._lock:
            if path not in self._loaded:
                from transformers import AutoTokenizer

                self._loaded[path] = AutoTokenizer.from_pretrained(path)
            return self._loaded[path], context


_TOKENIZERS = _Tokenizers()
_COUNTERS: tuple | None = None
_COUNTERS_LOCK = threading.Lock()


def _prediction_counters() -> tuple:
    """``(accepted, rejected)``: lookupdec's counters on vLLM's ``/metrics``, made once per process in
    prometheus_client's default registry, the one vLLM serves from its API-server process. With several API
    servers (``--api-server-count``) vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts them; prometheus_client
    then keeps these counters in that folder's files, which vLLM's ``/metrics`` sums over the processes."""
    global _COUNTERS
    with _COUNTERS_LOCK:
        if _COUNTERS is None:
            from prometheus_client import Counter

            from ..serve.observe import PREDICTION_ACCEPTED, PREDICTION_REJECTED

            _COUNTERS = (Counter(*PREDICTION_ACCEPTED, ["model_name"]), Counter(*PREDICTION_REJECTED, ["model_name"]))
        return _COUNTERS


def _ids(tokenizer, text: str) -> list:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class PredictedOutputs:
    """The ASGI middleware (a class, as vLLM's ``--middleware`` takes it)."""

    def __init__(self, app):
        from . import _internals

        _internals.check_version()  # a vLLM lookupdec does not support: the server does not start
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or not _json(scope):
            await self.app(scope, receive, send)
            return
        raw, more = await _read(receive)
        if more:  # it could set lookupdec's arguments unseen: refused, as vLLM would refuse what it cannot parse
            await _error(send, 413, f"the request body is larger than {_MAX_BODY} bytes", None, "request_too_large")
            return
        import anyio

        try:
            body = await anyio.to_thread.run_sync(json.loads, raw)  # off the event loop: bodies can be megabytes
        except (ValueError, RecursionError):  # not JSON (or nested past the parser): vLLM's own error
            body = None
        if not isinstance(body, dict):
            await self.app(scope, _replay(raw, receive), send)
            return
        owned = _owned_key(body)
        if owned is not None:
            await _error(send, 400, f"{owned} is set by lookupdec's middleware only: send OpenAI's prediction "
                                    "field instead", owned)
            return
        completion = scope.get("path", "").rstrip("/").endswith(_PATHS)
        try:
            text = _prediction_text(body) if completion else None
        except _Refused as err:
            await _error(send, 400, str(err), err.param)
            return
        user = body.get("user") if completion else None
        if isinstance(user, str) and user and isinstance(body.get("vllm_xargs", {}), (dict, type(None))):
            body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), CLIENT_ARG: user}
        if text is None:
            # Handed on as parsed (and checked): JSON that a laxer or stricter parser reads otherwise (duplicate
            # keys) cannot carry past the check what the check did not see.
            raw = json.dumps(body).encode()
            await self.app(_with_body(scope, raw), _replay(raw, receive), send)
            return
        tokenizer, context = await anyio.to_thread.run_sync(_TOKENIZERS.get, scope["app"])
        # What a prediction may cost is bounded before tokenizing (its characters) and after (its tokens): it is
        # drafted from, so one longer than the model's context cannot help, and tokenizing it is paid by everyone.
        if len(text) > _CHARS_PER_TOKEN * context:
            await _error(send, 400, f"the prediction is {len(text)} characters; at most {_CHARS_PER_TOKEN * context} "
                                    f"(the model's context is {context} tokens)", "prediction", "prediction_too_large")
            return
        prediction = await anyio.to_thread.run_sync(_ids, tokenizer, text)
        if len(prediction) > context:
            await _error(send, 400, f"the prediction is {len(prediction)} tokens; at most {context} (the model's "
                                    "context)", "prediction", "prediction_too_large")
            return
        body.pop("prediction")
        body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), PREDICTION_ARG: prediction}
        raw = json.dumps(body).encode()
        scope = _with_body(scope, raw)
        chat = scope["path"].rstrip("/").endswith("/chat/completions")
        if body.get("stream"):
            await self.app(scope, _replay(raw, receive), _StreamCounts(send, tokenizer, prediction, chat).send)
        else:
            await self.app(scope, _replay(raw, receive), _WholeCounts(send, tokenizer, prediction, chat).send)


def _json(scope) -> bool:
    """Whether the request's body is JSON (or says nothing of its type, as some clients do)."""
    for key, value in scope.get("headers") or ():
        if key.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() in (b"application/json", b"")
    return True


def _with_body(scope, raw: bytes) -> dict:
    """``scope`` with its content length set for the body ``raw``."""
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    return {**scope, "headers": headers + [(b"content-length", str(len(raw)).encode())]}


async def _read(receive) -> tuple:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if not message.get("more_body"):
            return b"".join(chunks), False
        if size > _MAX_BODY:
            return b"".join(chunks), True


def _replay(raw: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


async def _error(send, status: int, message: str, param: str | None, code: str | None = None) -> None:
    payload = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                    "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _details(usage: dict, tokenizer, prediction: list, text: str, model) -> None:
    accepted, rejected = prediction_usage(prediction, _ids(tokenizer, text))
    details = usage.get("completion_tokens_details") or {}
    details.update(accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected)
    usage["completion_tokens_details"] = details
    counted_accepted, counted_rejected = _prediction_counters()
    name = model if isinstance(model, str) else ""
    counted_accepted.labels(name).inc(accepted)
    counted_rejected.labels(name).inc(rejected)


def _text(choice: dict, chat: bool, delta: bool = False) -> str:
    if not chat:
        return choice.get("text") or ""
    message = choice.get("delta" if delta else "message") or {}
    return message.get("content") or ""


class _WholeCounts:
    """Buffers a plain response and adds the prediction counts to its usage."""

    def __init__(self, send, tokenizer, prediction, chat):
        self._send, self._tokenizer, self._prediction, self._chat = send, tokenizer, prediction, chat
        self._start, self._body = None, []

    async def send(self, message):
        if message["type"] == "http.response.start":
            self._start = message
            return
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        self._body.append(message.get("body", b""))
        if message.get("more_body"):
            return
        raw = b"".join(self._body)
        try:
            payload = json.loads(raw)
            if self._start["status"] == 200 and isinstance(payload.get("usage"), dict):
                text = _text(payload["choices"][0], self._chat) if payload.get("choices") else ""
                _details(payload["usage"], self._tokenizer, self._prediction, text, payload.get("model"))
                raw = json.dumps(payload).encode()
        except (ValueError, KeyError, TypeError, IndexError):
            pass  # not a completion: forwarded as it came
        headers = [(k, v) for k, v in self._start["headers"] if k.lower() != b"content-length"]
        await self._send({**self._start, "headers": headers + [(b"content-length", str(len(raw)).encode())]})
        await self._send({"type": "http.response.body", "body": raw})


class _StreamCounts:
    """Passes a stream's events through, collecting the answer's text, and adds the prediction counts to the
    usage chunk."""

    def __init__(self, send, tokenizer, prediction, chat):
        self._send, self._tokenizer, self._prediction, self._chat = send, tokenizer, prediction, chat
        self._pending, self._text = b"", []

    async def send(self, message):
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        data = self._pending + message.get("body", b"")
        events = data.split(b"\n\n")
        self._pending = events.pop()  # an event not yet complete
        out = [self._event(event) for event in events]
        body = b"".join(event + b"\n\n" for event in out)
        if not message.get("more_body"):
            body += self._pending
            self._pending = b""
        if body or not message.get("more_body"):
            await self._send({**message, "body": body})

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or event.strip() == b"data: [DONE]":
            return event
        try:
            payload = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(payload, dict):
            return event
        for choice in payload.get("choices") or []:
            if isinstance(choice, dict):
                self._text.append(_text(choice, self._chat, delta=True))
        if isinstance(payload.get("usage"), dict) and not payload.get("choices"):
            _details(payload["usage"], self._tokenizer, self._prediction, "".join(self._text), payload.get("model"))
            return b"data: " + json.dumps(payload).encode()
        return event
