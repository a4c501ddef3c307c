"""The OpenAI wire format: request bodies checked and turned into a :class:`Request`, responses and errors as the
official clients expect them. No model, no torch: everything here is plain data.

What is accepted is listed field by field (:data:`CHAT_FIELDS`, :data:`COMPLETION_FIELDS`); a field OpenAI
defines that this server does not implement is refused by name (:data:`UNSUPPORTED`), and so is a field nobody
defines, as OpenAI's own API does: a request never silently loses what its sender asked for.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

MAX_STOP = 4  # stop sequences per request, as OpenAI allows


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error body (:meth:`body`)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class Request:
    """One generation request, whichever endpoint it came through."""

    kind: str  # "chat" or "completion"
    model: str
    messages: list | None = None  # chat: [{"role", "content": str}]
    prompt: str | None = None  # completion
    prediction: str | None = None
    max_tokens: int | None = None  # None: up to the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    lookup: bool = True  # False: no drafting for this request

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# Fields OpenAI defines that this server does not implement: refused by name.
UNSUPPORTED = {
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio", "modalities",
    "logit_bias", "top_logprobs", "response_format", "web_search_options", "reasoning_effort", "service_tier",
    "best_of", "echo", "suffix", "verbosity", "prompt_cache_key", "safety_identifier",
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
           "prediction", "lookup", "user", "metadata", "store", "frequency_penalty", "presence_penalty", "logprobs"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = _COMMON | {"prompt"}
ROLES = {"system", "developer", "user", "assistant"}


def parse(body, kind: str, models: list[str]) -> Request:
    """Check a decoded JSON body for ``kind`` ("chat" or "completion"); :class:`APIError` (4xx) on anything this
    server cannot honour exactly. ``models``: the names this server answers to."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    allowed = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    for key in body:
        if key in UNSUPPORTED or (key == "messages" and kind != "chat") or (key == "prompt" and kind != "completion"):
            raise invalid(f"'{key}' is not supported by this server", param=key, code="unsupported_parameter")
        if key not in allowed:
            raise invalid(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("you must provide a model parameter", param="model", code="missing_required_parameter")
    if model not in models:
        raise APIError(404, f"The model '{model}' does not exist; this server has: {', '.join(models)}",
                       param="model", code="model_not_found")
    req = Request(kind=kind, model=model)
    if kind == "chat":
        req.messages = _messages(body.get("messages"))
    else:
        req.prompt = _prompt(body.get("prompt"))

    n = body.get("n", 1)
    if n is not None and (not _is_int(n) or n != 1):
        raise invalid("only n = 1 is supported", param="n", code="unsupported_parameter")
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if value is not None and (not _is_number(value) or value != 0):
            raise invalid(f"'{name}' is not supported by this server (only 0)", param=name,
                          code="unsupported_parameter")
    if body.get("logprobs") not in (None, False, 0):
        raise invalid("'logprobs' is not supported by this server", param="logprobs", code="unsupported_parameter")
    if body.get("store") not in (None, False):
        raise invalid("'store' is not supported by this server", param="store", code="unsupported_parameter")

    limits = [(name, body.get(name)) for name in ("max_tokens", "max_completion_tokens") if body.get(name) is not None]
    for name, value in limits:
        if not _is_int(value) or value < 1:
            raise invalid(f"'{name}' must be an integer >= 1", param=name)
    if limits:
        req.max_tokens = min(value for _, value in limits)
    req.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if req.top_p == 0.0:
        raise invalid("'top_p' must be > 0", param="top_p")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise invalid("'seed' must be an integer", param="seed")
    req.seed = seed
    req.stop = _stop(body.get("stop"))
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", param="stream")
    req.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"} \
                or not isinstance(options.get("include_usage", False), bool):
            raise invalid("'stream_options' must be {\"include_usage\": bool}", param="stream_options")
        if not req.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        req.include_usage = options.get("include_usage", False)
    lookup = body.get("lookup", True)
    if not isinstance(lookup, bool):
        raise invalid("'lookup' must be a boolean", param="lookup")
    req.lookup = lookup
    req.prediction = _prediction(body.get("prediction"))
    return req


def _messages(messages) -> list:
    if messages is None:
        raise invalid("you must provide a messages parameter", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty array", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"'{where}' must be an object", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"'{where}.role' must be one of {sorted(ROLES)}" +
                          (" (tool messages are not supported)" if role in ("tool", "function") else ""),
                          param=f"{where}.role")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise invalid(f"'{where}.{sorted(extra)[0]}' is not supported by this server",
                          param=f"{where}.{sorted(extra)[0]}", code="unsupported_parameter")
        content = _text(message.get("content"), f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _text(content, where: str) -> str:
    """A string, or OpenAI's array of text parts; other part types (images, audio, files) are refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else None
                raise invalid(f"'{where}[{j}]' must be {{\"type\": \"text\", \"text\": string}}" +
                              (f" ('{kind}' content is not supported)" if kind and kind != "text" else ""),
                              param=f"{where}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"'{where}' must be a string or a non-empty array of text parts", param=where)


def _prompt(prompt) -> str:
    if prompt is None:
        raise invalid("you must provide a prompt parameter", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("'prompt' must be a string (one prompt per request)", param="prompt")
    if not prompt:
        raise invalid("'prompt' must not be empty", param="prompt")
    return prompt


def _prediction(prediction) -> str | None:
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or prediction.get("type") != "content" or set(prediction) - {"type", "content"}:
        raise invalid("'prediction' must be {\"type\": \"content\", \"content\": string or array of text parts}",
                      param="prediction")
    return _text(prediction.get("content"), "prediction.content")


def _stop(stop) -> list:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise invalid(f"'stop' must be a non-empty string or an array of at most {MAX_STOP} of them", param="stop")
    return stops


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not low <= value <= high:
        raise invalid(f"'{name}' must be a number between {low:g} and {high:g}", param=name)
    return float(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


# ---------------------------------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, accepted: int, rejected: int) -> dict:
    """OpenAI's usage object; ``accepted`` / ``rejected``: drafted tokens copied from the prediction that the
    model kept or did not (Predicted Outputs' ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected, "reasoning_tokens": 0}}


def completion(req: Request, rid: str, text: str, finish_reason: str, usage_: dict) -> dict:
    """The whole response of a request that does not stream."""
    created = int(time.time())
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                  "logprobs": None, "finish_reason": finish_reason}
        return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": [choice], "usage": usage_, "system_fingerprint": None}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "choices": [choice], "usage": usage_, "system_fingerprint": None}


def chunk(req: Request, rid: str, created: int, text: str | None = None, *, first: bool = False,
          finish_reason: str | None = None, usage_: dict | None = None) -> dict:
    """One server-sent event of a streamed response: text, the end (``finish_reason``), or the usage chunk."""
    if req.kind == "chat":
        if usage_ is not None:
            choices = []
        else:
            delta = {"role": "assistant", "content": ""} if first else {"content": text} if text else {}
            choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
               "choices": choices, "system_fingerprint": None}
    else:
        choices = [] if usage_ is not None else [{"index": 0, "text": text or "", "logprobs": None,
                                                  "finish_reason": finish_reason}]
        out = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
               "choices": choices, "system_fingerprint": None}
    if req.include_usage:
        out["usage"] = usage_
    return out
