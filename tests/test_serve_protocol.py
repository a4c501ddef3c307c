"""The wire format alone (lookupdec.serve.protocol): bodies in, a Request or one OpenAI-shaped APIError out, and the
Predicted Outputs counts. No server, no model: these run in seconds."""

import copy
import json
import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookupdec.serve import protocol
from lookupdec.serve.protocol import APIError, Request, parse, prediction_usage

M = "smollm2"
CHAT = {"model": M, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": M, "prompt": "hi"}


def refusal(body, kind="chat") -> APIError:
    with pytest.raises(APIError) as caught:
        parse(body, kind, [M])
    err = caught.value
    # What Starlette's JSONResponse does with the body: it must encode (no lone surrogate leaks into the error).
    json.dumps(err.body(), ensure_ascii=False, allow_nan=False).encode("utf-8")
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    message = err.message
    assert message and "\n" not in message and len(message) < 400, message  # one line, no pydantic dump
    assert "Input should" not in message and "validation error" not in message, message
    return err


# ------------------------------------------------------------------------------------------ valid bodies


def test_what_the_openai_client_sends_for_a_streamed_chat_with_a_prediction():
    body = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Fix it"}],
            "model": M, "max_completion_tokens": 64, "prediction": {"type": "content", "content": "def f(): pass"},
            "seed": 7, "stop": "\n\n", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    assert parse(body, "chat", [M]) == Request(
        kind="chat", model=M, messages=[{"role": "system", "content": "Be brief."},  # developer is system to a template
                                        {"role": "user", "content": "Fix it"}],
        prediction="def f(): pass", max_tokens=64, temperature=0.0, seed=7, stop=["\n\n"], stream=True,
        include_usage=True)


def test_text_parts_are_joined_and_nulls_mean_the_defaults():
    # LiteLLM and others send null for what they leave unset; null asks for the default, loses nothing.
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = {**CHAT, "messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": ""}],
            "prediction": {"type": "content", "content": parts},
            "max_tokens": None, "temperature": None, "top_p": None, "seed": None, "stop": None, "stream": None,
            "stream_options": None, "n": None, "frequency_penalty": None, "presence_penalty": None, "logprobs": None,
            "store": None, "user": None, "metadata": None, "max_completion_tokens": None}
    req = parse(body, "chat", [M])
    assert req.messages == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]
    assert req.prediction == "ab"
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.stop, req.stream, req.include_usage,
            req.lookup) == (None, 1.0, 1.0, None, [], False, False, True)


def test_the_neutral_values_of_unsupported_knobs_and_our_lookup_extension_are_accepted():
    body = {**CHAT, "n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": False, "store": False,
            "user": "u-1", "metadata": {"k": "v"}, "lookup": False, "top_p": 1, "stop": ["a", "b", "c", "d"]}
    req = parse(body, "chat", [M])
    assert req.lookup is False and req.stop == ["a", "b", "c", "d"]
    assert req.top_p == 1.0 and isinstance(req.top_p, float)


def test_completions_take_one_prompt_as_a_string_or_an_array_of_one():
    assert parse({**COMPLETION, "prompt": ["x"], "logprobs": 0, "max_tokens": 3}, "completion", [M]) == Request(
        kind="completion", model=M, prompt="x", max_tokens=3)
    assert parse({**COMPLETION, "prediction": {"type": "content", "content": "p"}}, "completion", [M]).prediction == "p"


def test_the_smaller_of_max_tokens_and_max_completion_tokens_binds():
    assert parse({**CHAT, "max_tokens": 9, "max_completion_tokens": 4}, "chat", [M]).max_tokens == 4
    assert parse({**CHAT, "max_tokens": 4, "max_completion_tokens": 9}, "chat", [M]).max_tokens == 4
    # A huge limit is well formed; the app compares it with the model's context.
    assert parse(json.loads('{"model": "smollm2", "prompt": "x", "max_tokens": 1000000000}'), "completion",
                 [M]).max_tokens == 10**9


@pytest.mark.parametrize("raw, temperature, greedy", [
    ("0", 0.0, True), ("-0.0", 0.0, True), ("0.0", 0.0, True),
    ("1e-40", 1e-40, False),  # tiny but positive: accepted, the engine makes it exact (greedy in effect)
    ("5e-324", 5e-324, False), ("1", 1.0, False), ("2", 2.0, False), ("2.0", 2.0, False),
])
def test_every_temperature_in_0_to_2_is_accepted_and_only_zero_is_greedy(raw, temperature, greedy):
    req = parse(json.loads(f'{{"model": "smollm2", "prompt": "x", "temperature": {raw}}}'), "completion", [M])
    assert req.temperature == temperature and isinstance(req.temperature, float) and req.greedy is greedy
    assert math.copysign(1.0, req.temperature) == 1.0  # -0.0 is normalised


def test_seed_spans_exactly_the_64_bit_range():
    for seed in (-2**63, -1, 0, 2**63 - 1):
        assert parse({**CHAT, "seed": seed}, "chat", [M]).seed == seed
    for seed in (-2**63 - 1, 2**63, 10**400):
        err = refusal({**CHAT, "seed": seed})
        assert err.param == "seed" and "64 bits" in err.message


# ------------------------------------------------------------------------------------------ golden refusals


@pytest.mark.parametrize("body, kind, status, param, code", [
    ([1, 2], "chat", 400, None, None),
    ("{}", "chat", 400, None, None),
    ({**CHAT, "model": "gpt-9"}, "chat", 404, "model", "model_not_found"),
    ({"messages": CHAT["messages"]}, "chat", 400, "model", "missing_required_parameter"),
    ({**CHAT, "model": None}, "chat", 400, "model", "missing_required_parameter"),
    ({"model": M}, "chat", 400, "messages", "missing_required_parameter"),
    ({"model": M}, "completion", 400, "prompt", "missing_required_parameter"),
    ({**CHAT, "messages": []}, "chat", 400, "messages", None),
    ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "chat", 400, "messages[0].role", None),
    ({**CHAT, "messages": [{"role": "user"}]}, "chat", 400, "messages[0].content", "missing_required_parameter"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "chat",
     400, "messages[0].content[0]", None),
    ({**CHAT, "messages": [{"role": "user", "content": []}]}, "chat", 400, "messages[0].content", None),
    ({**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "chat", 400,
     "messages[0].tool_calls", "unsupported_parameter"),
    ({**CHAT, "messages": [{"role": "user", "content": "x", "colour": "red"}]}, "chat", 400, "messages[0].colour",
     "unknown_parameter"),
    ({**CHAT, "n": 2}, "chat", 400, "n", "unsupported_parameter"),
    ({**CHAT, "frequency_penalty": 0.5}, "chat", 400, "frequency_penalty", "unsupported_parameter"),
    ({**CHAT, "presence_penalty": -1}, "chat", 400, "presence_penalty", "unsupported_parameter"),
    ({**CHAT, "logprobs": True}, "chat", 400, "logprobs", "unsupported_parameter"),
    ({**COMPLETION, "logprobs": 2}, "completion", 400, "logprobs", "unsupported_parameter"),
    ({**CHAT, "store": True}, "chat", 400, "store", "unsupported_parameter"),
    ({**CHAT, "tools": [{"type": "function"}]}, "chat", 400, "tools", "unsupported_parameter"),
    ({**CHAT, "audio": {"voice": "alloy"}}, "chat", 400, "audio", "unsupported_parameter"),
    ({**COMPLETION, "echo": True}, "completion", 400, "echo", "unsupported_parameter"),
    ({**CHAT, "prompt": "x"}, "chat", 400, "prompt", "unsupported_parameter"),
    ({**COMPLETION, "messages": CHAT["messages"]}, "completion", 400, "messages", "unsupported_parameter"),
    ({**COMPLETION, "max_completion_tokens": 3}, "completion", 400, "max_completion_tokens", "unknown_parameter"),
    ({**CHAT, "frobnicate": 1}, "chat", 400, "frobnicate", "unknown_parameter"),
    ({**CHAT, "stream": True, "stream_options": {"include_usage": True, "x": 1}}, "chat", 400, "stream_options.x",
     "unknown_parameter"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "chat", 400, "stream_options", None),
    ({**CHAT, "stream": False, "stream_options": {"include_usage": True}}, "chat", 400, "stream_options", None),
    ({**CHAT, "prediction": "just text"}, "chat", 400, "prediction", None),
    ({**CHAT, "prediction": {"type": "text", "content": "x"}}, "chat", 400, "prediction.type", None),
    ({**CHAT, "prediction": {"type": "content", "content": 5}}, "chat", 400, "prediction.content", None),
    ({**CHAT, "prediction": {"type": "content"}}, "chat", 400, "prediction.content", "missing_required_parameter"),
    ({**CHAT, "temperature": 3}, "chat", 400, "temperature", None),
    ({**CHAT, "temperature": -0.1}, "chat", 400, "temperature", None),
    ({**CHAT, "top_p": 0}, "chat", 400, "top_p", None),
    ({**CHAT, "top_p": 1.01}, "chat", 400, "top_p", None),
    ({**CHAT, "max_tokens": 0}, "chat", 400, "max_tokens", None),
    ({**CHAT, "max_completion_tokens": -1}, "chat", 400, "max_completion_tokens", None),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "chat", 400, "stop", None),
    ({**CHAT, "stop": ""}, "chat", 400, "stop", None),
    ({**CHAT, "stop": ["a", ""]}, "chat", 400, "stop[1]", None),
    ({**COMPLETION, "prompt": ""}, "completion", 400, "prompt", None),
    ({**COMPLETION, "prompt": ["a", "b"]}, "completion", 400, "prompt", None),
    ({**COMPLETION, "prompt": [1, 2, 3]}, "completion", 400, "prompt", None),  # token ids: not supported
    ({**COMPLETION, "prompt": [1]}, "completion", 400, "prompt[0]", None),
    ({**CHAT, "metadata": {str(i): "v" for i in range(17)}}, "chat", 400, "metadata", None),  # OpenAI's limits
    ({**CHAT, "metadata": {"k" * 65: "v"}}, "chat", 400, "metadata", None),
    ({**CHAT, "metadata": {"k": "v" * 513}}, "chat", 400, "metadata", None),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}]}, "chat", 400,
     "messages[0].content[0].cache", "unknown_parameter"),
])
def test_bad_bodies_get_one_openai_error_naming_the_field(body, kind, status, param, code):
    err = refusal(body, kind)
    assert (err.status, err.param, err.code) == (status, param, code), err.body()


def test_unknown_and_unsupported_fields_are_reported_before_anything_else():
    # As OpenAI does: a field the server does not take is named first, whatever else is wrong.
    err = refusal({"model": "gpt-9", "temperature": 9, "logit_bias": {}})
    assert (err.param, err.code) == ("logit_bias", "unsupported_parameter")
    # Then the model (404 before a bad message), then the messages, then the rest.
    assert refusal({"model": "gpt-9", "messages": [], "temperature": 9}).status == 404
    assert refusal({"model": M, "messages": [], "temperature": 9}).param == "messages"


def test_messages_refuse_a_role_of_the_wrong_type_with_a_400_not_a_crash():
    # These raised TypeError (unhashable) in the hand-written check: a 500.
    for role in (["user"], {"a": 1}, None, 1, True, "tool"):
        err = refusal({**CHAT, "messages": [CHAT["messages"][0], {"role": role, "content": "x"}]})
        assert (err.status, err.param) == (400, "messages[1].role")
    err = refusal({**CHAT, "messages": [{"role": "tool", "content": "x"}]})
    assert "tool messages are not supported" in err.message


@pytest.mark.parametrize("name", ["bob", "", None, 5, {"a": 1}, ["x"]])
def test_a_message_name_is_refused_by_name_never_dropped(name):
    # Chat templates cannot carry `name` in general; accepting it would silently lose it.
    err = refusal({**CHAT, "messages": [{"role": "user", "content": "hi", "name": name}]})
    assert (err.param, err.code) == ("messages[0].name", "unsupported_parameter") and "names" in err.message


SURROGATE = "hi \ud800 there"  # what json.loads makes of "hi \ud800 there"


@pytest.mark.parametrize("body, kind, param", [
    ({**CHAT, "messages": [{"role": "user", "content": SURROGATE}]}, "chat", "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]}, "chat",
     "messages[0].content[0].text"),
    ({**CHAT, "prediction": {"type": "content", "content": SURROGATE}}, "chat", "prediction.content"),
    ({**CHAT, "prediction": {"type": "content", "content": [{"type": "text", "text": SURROGATE}]}}, "chat",
     "prediction.content[0].text"),
    ({**COMPLETION, "prompt": SURROGATE}, "completion", "prompt"),
    ({**COMPLETION, "prompt": [SURROGATE]}, "completion", "prompt[0]"),
    ({**CHAT, "stop": SURROGATE}, "chat", "stop"),
    ({**CHAT, "stop": ["ok", SURROGATE]}, "chat", "stop[1]"),
    ({**CHAT, "model": SURROGATE}, "chat", "model"),
    ({**CHAT, "user": SURROGATE}, "chat", "user"),
    ({**CHAT, "metadata": {"k": SURROGATE}}, "chat", "metadata"),
    ({**CHAT, "metadata": {SURROGATE: "v"}}, "chat", "metadata"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(body, kind, param):
    # The tokenizer raised on these: a 500. Found from the raw JSON too, as the server reads it.
    assert json.loads(json.dumps(body)) == body
    err = refusal(body, kind)
    assert (err.status, err.param) == (400, param) and "lone surrogate" in err.message


def test_a_lone_surrogate_in_a_field_name_is_refused_and_the_error_stays_encodable():
    for body, param in [({**CHAT, "x\ud800": 1}, None), ({**CHAT, "messages": [{"role": "user", "content": "x",
                                                                               "\udc00": 1}]}, "messages[0]")]:
        err = refusal(body)
        assert err.status == 400 and err.param == param and "lone surrogate" in err.message


def test_an_8_mb_string_is_checked_for_surrogates_in_well_under_a_second():
    big = "é" * (8 << 20)  # not ASCII: the slow path
    for content, refused in ((big, False), (big + "\ud800", True), ("\ud800" + big, True)):
        start = time.perf_counter()
        try:
            parse({**CHAT, "messages": [{"role": "user", "content": content}]}, "chat", [M])
            outcome = False
        except APIError as err:
            outcome = err.param == "messages[0].content"
        assert outcome is refused and time.perf_counter() - start < 0.5


@pytest.mark.parametrize("body, param", [
    ({"model": M, "messages": [5] * 1_000_000}, "messages[0]"),
    ({"model": M, "messages": [{"role": "user", "content": [{}] * 1_000_000}]}, "messages[0].content[0].type"),
    ({**CHAT, "stop": [5] * 1_000_000}, "stop"),
    ({**CHAT, "metadata": {str(i): i for i in range(1_000_000)}}, "metadata"),
    ({**CHAT, **{f"k{i}": 1 for i in range(1_000_000)}}, "k0"),
    ({"model": M, "messages": [{"role": "user", "content": "x", **{f"k{i}": 1 for i in range(1_000_000)}}]},
     "messages[0].k0"),
])
def test_a_body_of_a_million_faults_is_refused_at_the_first_one_quickly(body, param):
    # pydantic alone reports every bad element and every unknown key: seconds for an 8 MB body, on the event loop.
    start = time.perf_counter()
    err = refusal(body)
    assert err.param == param and time.perf_counter() - start < 0.5


@pytest.mark.parametrize("raw, field", [
    ('"temperature": NaN', "temperature"), ('"temperature": Infinity', "temperature"),
    ('"temperature": 1e400', "temperature"), ('"top_p": -Infinity', "top_p"), ('"top_p": NaN', "top_p"),
    ('"frequency_penalty": NaN', "frequency_penalty"), ('"presence_penalty": 1e400', "presence_penalty"),
    ('"temperature": true', "temperature"), ('"top_p": false', "top_p"), ('"temperature": "1"', "temperature"),
    ('"max_tokens": 10.0', "max_tokens"), ('"max_tokens": 1e9', "max_tokens"), ('"max_tokens": true', "max_tokens"),
    ('"max_tokens": "10"', "max_tokens"), ('"max_completion_tokens": 5.5', "max_completion_tokens"),
    ('"seed": 1.0', "seed"), ('"seed": true', "seed"), ('"seed": "1"', "seed"),
    ('"seed": 100000000000000000000000000000', "seed"), ('"n": true', "n"), ('"n": 1.0', "n"),
    ('"stream": 1', "stream"), ('"stream": "true"', "stream"), ('"lookup": 0', "lookup"), ('"lookup": null', "lookup"),
    ('"logprobs": 0', "logprobs"), ('"store": 0', "store"),
])
def test_numbers_and_booleans_are_strict_as_in_openais_schema(raw, field):
    # Python's json accepts NaN and Infinity and turns 1e400 into inf; none is a number OpenAI takes. 1e9 is a JSON
    # float: an integer field refuses it, as OpenAI does.
    err = refusal(json.loads('{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], %s}' % raw))
    assert (err.status, err.param, err.code) == (400, field, None)  # a wrong type, not an unsupported value


# ------------------------------------------------------------------------------------------ type fuzzing

# The JSON types each field takes, stated from OpenAI's schema (plus our `lookup`), independently of the models.
# Every field the models accept must be listed here (see the test below), so a new field is fuzzed too.
TOP = {
    "model": {"string"}, "max_tokens": {"null", "int"}, "temperature": {"null", "int", "float"},
    "top_p": {"null", "int", "float"}, "seed": {"null", "int"}, "stop": {"null", "string", "array"},
    "stream": {"null", "bool"}, "stream_options": {"null", "object"}, "n": {"null", "int"},
    "frequency_penalty": {"null", "int", "float"}, "presence_penalty": {"null", "int", "float"},
    "store": {"null", "bool"}, "user": {"null", "string"}, "metadata": {"null", "object"},
    "prediction": {"null", "object"}, "lookup": {"bool"},
}
ACCEPTS = {
    "chat": {**TOP, "messages": {"array"}, "max_completion_tokens": {"null", "int"}, "logprobs": {"null", "bool"},
             "messages[0]": {"object"}, "messages[0].role": {"string"}, "messages[0].content": {"string", "array"},
             "messages[1].content[0]": {"object"}, "messages[1].content[0].type": {"string"},
             "messages[1].content[0].text": {"string"}, "prediction.type": {"string"},
             "prediction.content": {"string", "array"}, "prediction.content[0].text": {"string"},
             "stream_options.include_usage": {"bool"}, "stop[0]": {"string"}, "metadata.k": {"string"}},
    "completion": {**TOP, "prompt": {"string", "array"}, "logprobs": {"null", "int"}, "prompt[0]": {"string"}},
}
# A body where every fuzzed path exists and holds a valid value.
FULL = {
    "chat": {"model": M, "messages": [{"role": "user", "content": "hi"},
                                      {"role": "user", "content": [{"type": "text", "text": "x"}]}],
             "prediction": {"type": "content", "content": [{"type": "text", "text": "p"}]}, "stream": True,
             "stream_options": {"include_usage": True}, "stop": ["s"], "metadata": {"k": "v"}},
    "completion": {"model": M, "prompt": ["hi"]},
}


def _deep(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


WRONG = [None, True, False, 0, 1, -1, 2**70, 1.5, 10.0, -0.0, float("inf"), float("nan"), "", "1", "x", "\ud800",
         [], [1], ["x"], [None], [[["x"]]], _deep(500), {}, {"a": 1}, {"type": "text", "text": "x"}, {"a": _deep(500)}]


def _json_type(value) -> str:
    return {type(None): "null", bool: "bool", int: "int", float: "float", str: "string", list: "array",
            dict: "object"}[type(value)]


def _set(body: dict, path: str, value) -> dict:
    body = copy.deepcopy(body)
    parts = path.replace("]", "").replace("[", ".").split(".")
    target = body
    for part in parts[:-1]:
        target = target[int(part)] if part.isdigit() else target[part]
    last = parts[-1]
    target[int(last) if last.isdigit() else last] = value
    return body


def test_every_accepted_field_is_fuzzed():
    for kind, body in protocol.BODIES.items():
        assert set(body.model_fields) == {path for path in ACCEPTS[kind] if path.isidentifier()}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_field_refuses_every_wrong_json_type_with_a_4xx_naming_it(kind):
    assert parse(FULL[kind], kind, [M])  # the base is valid: any refusal below is the fuzzed value's
    for path, types in ACCEPTS[kind].items():
        for value in WRONG:
            body = _set(FULL[kind], path, value)
            if path == "stream":  # stream_options needs a stream: fuzz `stream` alone
                body.pop("stream_options", None)
            try:
                parse(body, kind, [M])
            except APIError as err:
                assert err.status in (400, 404), (path, value, err.body())
                # The field itself, or something inside it (`stop[1]`, `messages[0].role`); a content part of another
                # type than text is refused as a whole (`messages[1].content[0]`: 'image_url' content...).
                # A value in `metadata` is named by its object: its keys are the client's, not fields.
                field_path = "metadata" if path == "metadata.k" else path
                named = err.param == field_path or err.param.startswith((path + ".", path + "["))
                assert named or path.endswith("content[0].type") and err.param == path[:-len(".type")], (
                    path, value, err.param)
                refusal(body, kind)  # one line, encodable
                continue
            except Exception as err:  # any other exception is a 500 at the server
                raise AssertionError(f"{kind} {path}={value!r:.40}: {type(err).__name__}: {err}"[:300]) from None
            assert _json_type(value) in types, f"{kind} {path} accepted {value!r:.40}"
            assert not (isinstance(value, float) and not math.isfinite(value)), (path, value)


def test_a_wrong_refusal_would_be_caught():
    # The fuzz's own premise: a value of a type the field takes is accepted, so "accepted" really is checked.
    assert parse(_set(FULL["chat"], "temperature", 1.5), "chat", [M]).temperature == 1.5
    assert parse(_set(FULL["chat"], "messages[1].content[0].text", ""), "chat", [M]).messages[1]["content"] == ""


# ------------------------------------------------------------------------------------------ prediction usage


def _lcs(a, b) -> int:
    """The length of a longest common subsequence, by the textbook table."""
    previous = [0] * (len(b) + 1)
    for x in a:
        row = [0]
        for j, y in enumerate(b):
            row.append(previous[j] + 1 if x == y else max(previous[j + 1], row[j]))
        previous = row
    return previous[-1]


@pytest.mark.parametrize("prediction, completion, counts", [
    ([1, 2, 3], [1, 2, 3], (3, 0)),  # the prediction came back whole
    ([1, 2, 3], [], (0, 3)),  # nothing came back: every prediction token is rejected
    ([], [1, 2], (0, 0)),  # no prediction, nothing to count
    ([1, 2, 3, 4], [1, 2, 9, 9, 9, 3, 4], (4, 0)),  # insertions in the completion reject nothing
    ([1, 2, 3, 4, 5], [1, 5], (2, 3)),  # a deleted span is rejected, token for token
    ([1, 2, 3, 4], [1, 7, 3, 8], (2, 2)),  # a substitution rejects the replaced tokens
    ([1, 2, 3], [3, 1, 2], (2, 1)),  # in order: [1, 2] matches, 3 before them cannot also match. Not (3, 0)
    ([5, 5, 5], [5], (1, 2)),  # one completion token matches one prediction token
    ([5], [5, 5, 5], (1, 0)),
])
def test_prediction_tokens_count_as_accepted_when_they_appear_in_the_completion_in_order(prediction, completion,
                                                                                         counts):
    assert prediction_usage(prediction, completion) == counts


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=30), st.lists(st.integers(0, 4), max_size=30))
def test_prediction_usage_is_the_longest_common_subsequence(prediction, completion):
    accepted, rejected = prediction_usage(prediction, completion)
    assert accepted == _lcs(prediction, completion) and accepted + rejected == len(prediction)


def test_prediction_usage_takes_any_integer_sequence():
    assert prediction_usage((1, 2, 3), range(1, 3)) == (2, 1)


@pytest.mark.parametrize("case", ["scattered edits", "one repeated token", "periods 2 and 3", "random bits"])
def test_prediction_usage_is_fast_on_8192_tokens_even_when_repetitive(case):
    # The app caps a prediction at the context (8192 tokens); difflib's matching blocks take seconds on repeats.
    n, rng = 8192, random.Random(0)
    if case == "scattered edits":
        a = [rng.randrange(50_000) for _ in range(n)]
        b = list(a)
        for i in rng.sample(range(n), 300):
            b[i] = 50_000 + i  # a token the prediction does not have
        expected = (n - 300, 300)
    elif case == "one repeated token":
        a, b, expected = [7] * n, [7] * (n - 1), (n - 1, 1)
    elif case == "periods 2 and 3":
        a, b, expected = [1, 2] * (n // 2), [1, 2, 3] * (n // 3 + 1), None
    else:
        a, b, expected = [rng.randrange(2) for _ in range(n)], [rng.randrange(2) for _ in range(n)], None
    start = time.perf_counter()
    counts = prediction_usage(a, b)
    assert time.perf_counter() - start < 0.2
    assert counts == expected or expected is None and sum(counts) == n


def test_usage_reports_the_counts_under_openais_names():
    out = protocol.usage(10, 4, *prediction_usage([1, 2, 3], [1, 3, 9, 9]))
    assert out == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                   "completion_tokens_details": {"accepted_prediction_tokens": 2, "rejected_prediction_tokens": 1,
                                                 "reasoning_tokens": 0}}
