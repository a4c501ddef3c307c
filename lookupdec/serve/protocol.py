"""The OpenAI wire format: request bodies checked and turned into a :class:`Request`, responses and errors as the
official clients expect them. No model, no torch: everything here is plain data.

What is accepted is declared once, field by field, as pydantic models mirroring OpenAI's schema (:class:`ChatBody`,
:class:`CompletionBody`), strict where OpenAI is strict: no ``"1"`` for an integer, no ``1`` for a boolean, no
boolean for a number, no NaN or infinity, and no string that is not valid Unicode (a lone surrogate, which JSON can
spell as ``"\\ud800"``). A field OpenAI defines that this server does not implement is refused by name
(:data:`UNSUPPORTED`, code ``unsupported_parameter``), and so is a field nobody defines (``unknown_parameter``), as
OpenAI's own API does: a request never silently loses what its sender asked for. :func:`parse` turns the first
violation into one :class:`APIError` (400, or 404 for an unknown model) whose ``param`` is the field's path
(``messages[0].role``, ``prediction.content``, ``stop``) and whose message is one line.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

MAX_STOP = 4  # stop sequences per request, as OpenAI allows
INT64 = (-2**63, 2**63 - 1)  # OpenAI's bounds for `seed`; the engine keys its sampler on 64 bits of it


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error body (:meth:`body`)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        # A message or param may quote what the client sent; a lone surrogate there would make the error body itself
        # unencodable as UTF-8 (a 500 while refusing), so it is spelled out as `\ud800`.
        message, param = _encodable(message), _encodable(param)
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
    user: str | None = None  # OpenAI's end-user id: names the client whose rolling cache the request uses

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# ------------------------------------------------------------------------------------------------ request bodies

# Fields OpenAI defines that this server does not implement: refused by name.
UNSUPPORTED = frozenset({
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio", "modalities",
    "logit_bias", "top_logprobs", "response_format", "web_search_options", "reasoning_effort", "service_tier",
    "best_of", "echo", "suffix", "verbosity", "prompt_cache_key", "safety_identifier",
})
# Fields OpenAI defines on a chat message beside role and content. `name` cannot be carried by chat templates in
# general (most drop it without a word), tool calls and audio are not implemented: refused, never dropped.
UNSUPPORTED_IN_MESSAGES = frozenset({"name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio"})
ROLES = ("system", "developer", "user", "assistant")

METADATA = (16, 64, 512)  # OpenAI's limits on `metadata`: pairs, characters in a key, characters in a value


def _is_unicode(text: str) -> bool:
    # JSON may spell a lone surrogate ("\ud800"), which Python's json decodes into a str that no tokenizer (nor any
    # UTF-8 output) can take. isascii() is O(1); the UTF-8 encode runs in C at GB/s, so 8 MB costs milliseconds.
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _valid_unicode(text: str) -> str:
    if not _is_unicode(text):
        raise PydanticCustomError("lone_surrogate", "is not valid Unicode: it contains a lone surrogate")
    return text


_FIELDS: dict[type, frozenset] = {}  # a model's field names (pydantic's `model_fields` is slow to read)


def _known_fields(model: type[BaseModel], data: Any) -> Any:
    """Refuse the first field ``model`` does not declare, before reading anything else. pydantic's own
    ``extra="forbid"`` (kept as the backstop) reports every unknown field: a million of them take seconds."""
    fields = _FIELDS.get(model) or _FIELDS.setdefault(model, frozenset(model.model_fields))
    if isinstance(data, dict) and not data.keys() <= fields:  # the common case, checked in C
        for key in data:
            if key not in fields:
                name = str(key)
                if not _is_unicode(name):
                    raise PydanticCustomError("field_name_unicode", "has a field name that is not valid Unicode: it "
                                              "contains a lone surrogate")
                raise PydanticCustomError("unknown_field", "has no field {field}", {"field": name})
    return data


class _Strict(BaseModel):
    """OpenAI's strictness: no unknown field, no "1" for an integer, no 1 for a boolean, no boolean for a number."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:
        return _known_fields(cls, data)


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
Number = Annotated[float, Field(allow_inf_nan=False)]  # strict: an int is a number, a bool is not


def _by_json_type(value: Any) -> str | None:
    """The tag of a string-or-array field (see :data:`_TAGS`); None (refused) for any other JSON type."""
    return "<string>" if isinstance(value, str) else "<array>" if isinstance(value, list) else None


_TAGS = frozenset({"<string>", "<array>"})  # union members in pydantic's error locations; not part of a path


class TextPart(_Strict):
    """``{"type": "text", "text": ...}``, the one content part this server reads."""

    type: Literal["text"] = Field(description='must be "text" (only text content is supported)')
    text: Text = Field(description="must be a string")

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:  # replaces _Strict's: the part's type is named before its other fields
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "text":  # name the part, not its `type`: the whole part is refused
            raise PydanticCustomError("unsupported_content", "must be {\"type\": \"text\", \"text\": string} "
                                      "('{kind}' content is not supported)", {"kind": _encodable(_short(kind))})
        return _known_fields(cls, data)


Content = Annotated[
    Union[Annotated[Text, Tag("<string>")],
          Annotated[list[TextPart], Field(min_length=1, fail_fast=True), Tag("<array>")]],
    Discriminator(_by_json_type, custom_error_type="content_type",
                  custom_error_message="must be a string or a non-empty array of text parts"),
]


class Message(_Strict):
    role: Literal[ROLES] = Field(description=f"must be one of {', '.join(map(repr, ROLES))}")
    content: Content = Field(description="must be a string or a non-empty array of text parts")


class Prediction(_Strict):
    """Predicted Outputs: the text the answer is expected to resemble (what the drafter copies from). ``type`` may
    be left out, as Relace's API allows and clients built for it send (Goose's editor); left out, it is
    ``"content"``, the one type there is. Given, it must be ``"content"`` (``null`` too is refused)."""

    type: Literal["content"] = Field("content", description='must be "content"')
    content: Content = Field(description="must be a string or a non-empty array of text parts")


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="must be a boolean")


Stop = Annotated[
    Union[Annotated[NonEmptyText, Tag("<string>")],
          Annotated[list[NonEmptyText], Field(max_length=MAX_STOP), Tag("<array>")]],
    Discriminator(_by_json_type, custom_error_type="stop_type", custom_error_message=(
        f"must be a non-empty string or an array of at most {MAX_STOP} of them")),
]
Prompt = Annotated[
    Union[Annotated[NonEmptyText, Tag("<string>")],
          Annotated[list[NonEmptyText], Field(min_length=1, max_length=1), Tag("<array>")]],
    Discriminator(_by_json_type, custom_error_type="prompt_type", custom_error_message=(
        "must be a non-empty string (one prompt per request)")),
]


Metadata = dict[Annotated[str, Field(max_length=METADATA[1])], Annotated[str, Field(max_length=METADATA[2])]]


def _unsupported(message: str):
    return PydanticCustomError("unsupported_parameter", message)


class _Body(_Strict):
    """The fields both endpoints share. Each field's ``description`` is what its error message says it must be.
    Arrays stop at their first bad element (``fail_fast``): an 8 MB body of bad elements is one error, not millions."""

    model: NonEmptyText = Field(description="must be a non-empty string")
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="must be an integer >= 1")
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = Field(
        None, description="must be a number between 0 and 2")
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = Field(
        None, description="must be a number greater than 0 and at most 1")
    seed: Annotated[int, Field(ge=INT64[0], le=INT64[1])] | None = Field(
        None, description="must be an integer that fits in 64 bits (-2**63 to 2**63 - 1)")
    stop: Stop | None = Field(None, description=f"must be a non-empty string or an array of at most {MAX_STOP} of them")
    stream: bool | None = Field(None, description="must be a boolean")
    stream_options: StreamOptions | None = Field(None, description='must be {"include_usage": boolean}')
    n: int | None = Field(None, description="must be an integer (only n = 1 is supported)")
    frequency_penalty: Number | None = Field(None, description="must be a number (only 0 is supported)")
    presence_penalty: Number | None = Field(None, description="must be a number (only 0 is supported)")
    store: bool | None = Field(None, description="must be a boolean (only false is supported)")
    user: Text | None = Field(None, description="must be a string")
    metadata: Metadata | None = Field(None, description=(
        f"must be an object of at most {METADATA[0]} string values (keys of at most {METADATA[1]} characters, "
        f"values of at most {METADATA[2]})"))
    prediction: Prediction | None = Field(
        None, description='must be {"type": "content" (may be left out), "content": string or array of text parts}')
    lookup: bool = Field(True, description="must be a boolean (our extension: false turns drafting off)")

    @field_validator("model")
    @classmethod
    def _served(cls, model: str, info: ValidationInfo) -> str:
        models = (info.context or {}).get("models")
        if models is not None and model not in models:
            raise PydanticCustomError("model_not_found", "The model '{model}' does not exist; this server has: "
                                      "{models}", {"model": _short(model), "models": ", ".join(models)})
        return model

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise _unsupported("must be 1: only n = 1 is supported")
        return n

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise _unsupported("is not supported by this server (only 0)")
        return value

    @field_validator("store")
    @classmethod
    def _not_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise _unsupported("is not supported by this server (only false)")
        return value

    @field_validator("metadata", mode="before")
    @classmethod
    def _few_pairs(cls, value: Any) -> Any:  # before reading them: pydantic checks a dict's size after its items
        if isinstance(value, dict) and len(value) > METADATA[0]:
            raise PydanticCustomError("too_many_pairs", f"must have at most {METADATA[0]} key-value pairs")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_text(cls, value: dict | None) -> dict | None:
        for item in (value or {}).items():
            for text in item:
                _valid_unicode(text)
        return value


def _no_logprobs(value):
    """``logprobs`` in either endpoint's type: only its "off" value (false, 0) is served."""
    if value:
        raise _unsupported("is not supported by this server")
    return value


class ChatBody(_Body):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1, fail_fast=True)] = Field(
        description="must be a non-empty array")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="must be an integer >= 1")
    logprobs: Annotated[bool | None, AfterValidator(_no_logprobs)] = Field(
        None, description="must be a boolean (only false is supported)")


class CompletionBody(_Body):
    """``POST /v1/completions``."""

    prompt: Prompt = Field(description="must be a non-empty string (one prompt per request)")
    logprobs: Annotated[int | None, AfterValidator(_no_logprobs)] = Field(
        None, description="must be an integer (only 0 is supported)")


BODIES: dict[str, type[_Body]] = {"chat": ChatBody, "completion": CompletionBody}
CHAT_FIELDS = frozenset(ChatBody.model_fields)
COMPLETION_FIELDS = frozenset(CompletionBody.model_fields)
_TEXT_FIELD = {"chat": "messages", "completion": "prompt"}


def parse(body, kind: str, models: list[str]) -> Request:
    """Check a decoded JSON body for ``kind`` ("chat" or "completion"); :class:`APIError` (4xx) on anything this
    server cannot honour exactly. ``models``: the names this server answers to; the request may name any of them,
    and its answer carries the first (as vLLM's does with several ``--served-model-name``)."""
    try:
        checked = BODIES[kind].model_validate(body, context={"models": list(models)})
    except ValidationError as err:
        raise _refusal(err, kind, body) from None
    if checked.stream_options is not None and not checked.stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    limits = [value for value in (checked.max_tokens, getattr(checked, "max_completion_tokens", None))
              if value is not None]
    req = Request(
        kind=kind, model=models[0] if models else checked.model,
        max_tokens=min(limits) if limits else None,  # both given: the smaller one binds
        temperature=1.0 if checked.temperature is None else checked.temperature + 0.0,  # -0.0 becomes 0.0
        top_p=1.0 if checked.top_p is None else float(checked.top_p),
        seed=checked.seed,
        stop=[checked.stop] if isinstance(checked.stop, str) else list(checked.stop or []),
        stream=bool(checked.stream),
        include_usage=checked.stream_options is not None and checked.stream_options.include_usage,
        lookup=checked.lookup,
        user=checked.user or None,
        prediction=None if checked.prediction is None else _joined(checked.prediction.content),
    )
    if kind == "chat":
        req.messages = [{"role": "system" if m.role == "developer" else m.role, "content": _joined(m.content)}
                        for m in checked.messages]
    else:
        req.prompt = checked.prompt if isinstance(checked.prompt, str) else checked.prompt[0]
    return req


def _joined(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


# ------------------------------------------------------------------------------- validation errors -> one APIError


def _descriptions(model: type[BaseModel], prefix: str = "", out: dict | None = None) -> dict[str, str]:
    """``{"messages.content.text": "must be a string", ...}``: each field's description by its dotted name (list
    indices left out), nested models included."""
    out = {} if out is None else out
    for name, info in model.model_fields.items():
        out[prefix + name] = info.description
        for inner in _models_in(info.annotation):
            _descriptions(inner, f"{prefix}{name}.", out)
    return out


def _models_in(annotation) -> list[type[BaseModel]]:
    """The models inside an annotation (``list[Message] | None`` -> ``[Message]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models_in(arg)]


_DESCRIBED = {kind: _descriptions(body) for kind, body in BODIES.items()}
_REQUIRED = {kind: {name for name, info in body.model_fields.items() if info.is_required()}
             for kind, body in BODIES.items()}
# What an array element must be, by the error pydantic reports at that element.
_ELEMENT = {"model_type": "must be an object", "string_type": "must be a string",
            "string_too_short": "must not be empty"}
# Errors raised by our own validators (and discriminators): their message already says what is wrong.
_OWN = {"lone_surrogate", "unsupported_content", "unsupported_parameter", "model_not_found", "content_type",
        "stop_type", "prompt_type", "too_many_pairs"}


def _refusal(err: ValidationError, kind: str, body) -> APIError:
    """The first of pydantic's errors as OpenAI's: unknown and unsupported top-level fields first (as OpenAI
    reports them), then the model, then the messages or prompt, then the rest in declaration order."""
    errors = err.errors(include_url=False)
    text_field = _TEXT_FIELD[kind]

    def rank(error) -> int:
        loc = error["loc"]
        if len(loc) == 1 and error["type"] == "extra_forbidden":
            return 0
        return 1 if loc[:1] == ("model",) else 2 if loc[:1] == (text_field,) else 3

    return _api_error(min(errors, key=rank), kind, body)


def _api_error(error: dict, kind: str, body) -> APIError:
    kind_of, described = error["type"], _DESCRIBED[kind]
    loc = [part for i, part in enumerate(error["loc"])
           if part not in _TAGS or (i == len(error["loc"]) - 1 and kind_of == "extra_forbidden")]
    if kind_of == "unknown_field":  # ours (_known_fields), found at the object: the same as pydantic's own
        kind_of, loc = "extra_forbidden", [*loc, error["ctx"]["field"]]
    if not loc and kind_of == "model_type":
        return invalid("the request body must be a JSON object")
    # The path as the client wrote it (`messages[0].content[1].text`); it stops at a key of a free-form object
    # (`metadata`), whose keys are not fields.
    path, pattern, at_element = "", "", False
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path, at_element = f"{path}[{part}]", True
            continue
        name = f"{pattern}.{part}" if pattern else part
        last_extra = i == len(loc) - 1 and kind_of == "extra_forbidden"
        if name not in described and not last_extra:
            break
        path, pattern, at_element = f"{path}.{part}" if path else part, name, False
    top = len(loc) == 1
    if kind_of == "field_name_unicode" or kind_of == "string_unicode" and not isinstance(_at(body, loc), str):
        # A key, not a value: pydantic checks keys as it reads them.
        where = f"'{path}'" if path else "the request body"
        return invalid(f"{where} has a field name that is not valid Unicode: it contains a lone surrogate",
                       param=path or None)

    if kind_of == "extra_forbidden":
        field_name = loc[-1]
        if top and (field_name in UNSUPPORTED or field_name in set(_TEXT_FIELD.values()) - {_TEXT_FIELD[kind]}):
            return invalid(f"'{field_name}' is not supported by this server", param=path,
                           code="unsupported_parameter")
        if pattern.startswith("messages.") and pattern.count(".") == 1 and field_name in UNSUPPORTED_IN_MESSAGES:
            why = (": the chat template cannot carry participant names, and this server never drops a field"
                   if field_name == "name" else "")
            return invalid(f"'{_short(path)}' is not supported by this server{why}", param=path,
                           code="unsupported_parameter")
        return invalid(f"Unrecognized request argument supplied: {_short(path)}", param=_short(path, 256),
                       code="unknown_parameter")
    if kind_of == "model_not_found":
        return APIError(404, error["msg"], param="model", code="model_not_found")
    if kind_of == "missing" or (top and path in _REQUIRED[kind] and error.get("input", 0) is None):
        if top:
            return invalid(f"you must provide a {path} parameter", param=path, code="missing_required_parameter")
        return invalid(f"'{path}' is required: it {described.get(pattern, 'must be given')}", param=path,
                       code="missing_required_parameter")
    if kind_of == "string_unicode":  # a lone surrogate, found by pydantic before our own check
        return invalid(f"'{path}' is not valid Unicode: it contains a lone surrogate", param=path)
    if kind_of in _OWN:
        code = "unsupported_parameter" if kind_of == "unsupported_parameter" else None
        return invalid(f"'{path}' {error['msg']}", param=path, code=code)
    description = _ELEMENT.get(kind_of) if at_element else described.get(pattern)
    if pattern == "messages.role" and not at_element and error.get("input") in ("tool", "function"):
        description += " (tool messages are not supported)"
    return invalid(f"'{path}' {description or error['msg'].lower()}", param=path)


def _at(body, loc: list):
    """What ``loc`` points at in ``body`` (None when it cannot be followed)."""
    for part in loc:
        try:
            body = body[part]
        except (KeyError, IndexError, TypeError):
            return None
    return body


def _short(name: str, limit: int = 64) -> str:
    """A client-supplied name, cut to a size fit for an error message."""
    return name if len(name) <= limit else name[:limit] + "..."


def _encodable(text: str | None) -> str | None:
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# ---------------------------------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, accepted: int, rejected: int) -> dict:
    """OpenAI's usage object. ``accepted`` / ``rejected``: Predicted Outputs' ``accepted_prediction_tokens`` /
    ``rejected_prediction_tokens`` in OpenAI's meaning, the prediction's tokens that do / do not appear in the
    completion (:func:`prediction_usage`); what the drafter proposed and the model kept is ours, not these."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected, "reasoning_tokens": 0}}


def prediction_usage(prediction_ids: Sequence[int], completion_ids: Sequence[int]) -> tuple[int, int]:
    """``(accepted, rejected)`` in OpenAI's meaning: how many of the prediction's tokens appear in the completion,
    matched in order, and how many do not; ``accepted + rejected == len(prediction_ids)``.

    Matched in order means the longest common subsequence: each completion token matches at most one prediction
    token, and matches do not cross (``[1, 2, 3]`` against ``[3, 1, 2]`` accepts 2, not 3). Computed exactly with
    the bit-parallel LCS of Allison and Dix (1986), in Hyyro's form (2004): one bit per prediction token, a few
    big-integer operations per completion token, so ``O(len(completion) * len(prediction) / 64)`` machine words
    whatever the inputs repeat (two 8192-token sequences: tens of milliseconds). difflib's matching blocks are
    neither an LCS nor bounded: on repetitive inputs they take seconds.
    """
    prediction = prediction_ids.tolist() if hasattr(prediction_ids, "tolist") else list(prediction_ids)
    completion = completion_ids.tolist() if hasattr(completion_ids, "tolist") else completion_ids
    where: dict[int, int] = {}  # token -> bit i set where prediction[i] is that token
    for i, token in enumerate(prediction):
        where[token] = where.get(token, 0) | (1 << i)
    everything = (1 << len(prediction)) - 1
    # Bit i of `open_` is cleared once the LCS of prediction[:i+1] and the completion read so far grows at i: the
    # count of cleared bits is that LCS's length.
    open_ = everything
    for token in completion:
        match = where.get(token)
        if match:
            hits = open_ & match
            open_ = ((open_ + hits) | (open_ - hits)) & everything
    accepted = len(prediction) - open_.bit_count()
    return accepted, len(prediction) - accepted


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
