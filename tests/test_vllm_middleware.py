"""The Predicted Outputs middleware for vLLM's server, without vLLM: driven as an ASGI app in front of a stand-in
for vLLM's routes (which echoes what reaches it and answers like vLLM's chat route). Refusals, the prediction
handed on as ``vllm_xargs``, and OpenAI's counts in plain and streamed answers. The real server is tested in
``tests/test_vllm.py``."""

import asyncio
import json
import sys
from types import ModuleType, SimpleNamespace

import pytest

from lookupdec.serve.protocol import prediction_usage
from lookupdec.vllm import CLIENT_ARG, PREDICTION_ARG
from lookupdec.vllm.middleware import PredictedOutputs

ANSWER = "name: web\nport: 9090\n"
PREDICTION = "name: web\nport: 8080\n"


@pytest.fixture(autouse=True)
def _vllm_032(monkeypatch):
    """A stand-in for vLLM 0.32's package, which this environment does not have (the middleware checks the
    version it runs beside)."""
    monkeypatch.setitem(sys.modules, "vllm", ModuleType("vllm"))
    monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.32.0", raising=False)


@pytest.fixture(scope="module")
def tokenizer_path():
    from lookupdec.models import ModelLoadError, model_folder

    try:
        return model_folder()
    except ModelLoadError as err:
        pytest.skip(f"the embedded model is not available: {err}")


class _Routes:
    """vLLM's side: records the body it got; answers ANSWER, plain or as a stream with a usage chunk."""

    def __init__(self):
        self.bodies, self.raw = [], []

    async def __call__(self, scope, receive, send):
        message = await receive()
        self.raw.append(message["body"])
        body = json.loads(message["body"])
        self.bodies.append(body)
        usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        if body.get("stream"):
            events = [{"model": body["model"], "choices": [{"index": 0, "delta": {"content": ANSWER[:7]}}]},
                      {"model": body["model"], "choices": [{"index": 0, "delta": {"content": ANSWER[7:]}}]},
                      {"model": body["model"], "choices": [], "usage": usage}]
            for event in events:  # split mid-event, as a network would
                data = f"data: {json.dumps(event)}\n\n".encode()
                await send({"type": "http.response.body", "body": data[:5], "more_body": True})
                await send({"type": "http.response.body", "body": data[5:], "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        else:
            answer = {"model": body["model"], "choices": [{"index": 0, "message": {"role": "assistant",
                                                                                 "content": ANSWER}}], "usage": usage}
            await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


def _call(app, body, tokenizer_path, context=8192, path="/v1/chat/completions", chunks=1):
    """Send ``body`` (a dict, or raw bytes) through the middleware to ``app``, in ``chunks`` pieces; returns the
    status and the body of the answer."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    state = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(tokenizer=tokenizer_path,
                                                                                     max_model_len=context)))
    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-length", str(len(raw)).encode()), (b"content-type", b"application/json")],
             "app": SimpleNamespace(state=state)}
    sent = []
    size = -(-len(raw) // chunks)
    pieces = [raw[i:i + size] for i in range(0, len(raw), size)] or [b""]

    async def receive():
        piece = pieces.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

    async def send(message):
        sent.append(message)

    asyncio.run(PredictedOutputs(app)(scope, receive, send))
    status = sent[0]["status"]
    return status, b"".join(m.get("body", b"") for m in sent[1:])


def _body(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "Set the port to 9090."}], **extra}


def test_a_prediction_reaches_vllm_as_token_ids_and_the_answer_carries_openais_counts(tokenizer_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    ids = tokenizer(PREDICTION, add_special_tokens=False)["input_ids"]
    expected = prediction_usage(ids, tokenizer(ANSWER, add_special_tokens=False)["input_ids"])
    assert 0 < expected[0] < len(ids)
    routes = _Routes()
    status, raw = _call(routes, _body(prediction={"type": "content", "content": [{"type": "text", "text": PREDICTION}]},
                                      vllm_xargs={"other": 1}), tokenizer_path)
    assert status == 200
    assert "prediction" not in routes.bodies[0]
    assert routes.bodies[0]["vllm_xargs"] == {"other": 1, PREDICTION_ARG: ids}
    details = json.loads(raw)["usage"]["completion_tokens_details"]
    assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == expected

    status, raw = _call(routes, _body(prediction={"type": "content", "content": PREDICTION}, stream=True),
                        tokenizer_path)
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"]["content"] for e in events if e["choices"]) == ANSWER
    details = events[-1]["usage"]["completion_tokens_details"]
    assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == expected
    assert raw.endswith(b"data: [DONE]\n\n")


def test_without_a_prediction_the_request_passes_untouched(tokenizer_path):
    routes = _Routes()
    status, raw = _call(routes, _body(max_tokens=5), tokenizer_path)
    assert status == 200 and routes.bodies == [_body(max_tokens=5)]
    assert "completion_tokens_details" not in json.loads(raw)["usage"]


@pytest.mark.parametrize("extra, param, code", [
    ({"prediction": {"type": "text", "content": "x"}}, "prediction", None),
    ({"prediction": {"type": "content", "content": 5}}, "prediction.content", None),
    ({"prediction": {"type": "content", "content": []}}, "prediction.content", None),
    ({"prediction": {"type": "content", "content": "x", "extra": 1}}, "prediction", None),
    ({"prediction": {"type": "content", "content": "x"}, "n": 2}, "n", None),
    ({"prediction": {"type": "content", "content": "x"}, "vllm_xargs": [1]}, "vllm_xargs", None),
    ({"prediction": {"type": "content", "content": "hi \ud800"}}, "prediction.content", None),
    ({"prediction": {"type": "content", "content": "port: 1\n" * 100}}, "prediction", "prediction_too_large"),  # tokens
    ({"prediction": {"type": "content", "content": "x" * 2000}}, "prediction", "prediction_too_large"),
])
def test_bad_predictions_get_a_400_in_openais_shape_and_never_reach_vllm(tokenizer_path, extra, param, code):
    routes = _Routes()
    status, raw = _call(routes, _body(**extra), tokenizer_path, context=64)  # 64 tokens: 1,024 characters at most
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and error["code"] == code and error["message"]
    assert error["type"] == "invalid_request_error" and not routes.bodies


# ---------------------------------------------------------------------------------------------------------------
# lookupdec's own vllm_xargs keys are the middleware's to set, on every route; a client's user becomes its client


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"vllm_xargs": {PREDICTION_ARG: [2147483648]}}, f"vllm_xargs.{PREDICTION_ARG}"),
    ("/v1/chat/completions", {"vllm_xargs": {CLIENT_ARG: "alice"}, "prediction": {"type": "content", "content": "x"}},
     f"vllm_xargs.{CLIENT_ARG}"),
    ("/v1/completions", {"vllm_xargs": {"lookupdec_future": 1}}, "vllm_xargs.lookupdec_future"),
    ("/v1/responses", {"vllm_xargs": {CLIENT_ARG: "alice"}}, f"vllm_xargs.{CLIENT_ARG}"),
    ("/inference/v1/generate", {"sampling_params": {"extra_args": {PREDICTION_ARG: [-1]}}},
     f"sampling_params.extra_args.{PREDICTION_ARG}"),
])
def test_a_client_cannot_set_lookupdecs_own_arguments(tokenizer_path, path, extra, param):
    routes = _Routes()
    status, raw = _call(routes, _body(**extra), tokenizer_path, path=path)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert not routes.bodies


def test_escaped_or_repeated_keys_do_not_slip_past(tokenizer_path):
    routes = _Routes()
    # The underscore written as a JSON escape:
    escaped = b'{"model": "m", "messages": [], "vllm_xargs": {"lookupdec\\u005fprediction": [1]}}'
    status, _ = _call(routes, escaped, tokenizer_path)
    assert status == 400 and not routes.bodies
    # Python's JSON keeps the last of repeated keys; vLLM is handed the body as the middleware read it, so a parser
    # that kept the first could not see the hidden one.
    repeated = b'{"model": "m", "messages": [], "vllm_xargs": {"%s": [7]}, "vllm_xargs": {"a": 1}}' % \
        PREDICTION_ARG.encode()
    status, _ = _call(routes, repeated, tokenizer_path)
    assert status == 200 and routes.bodies == [{"model": "m", "messages": [], "vllm_xargs": {"a": 1}}]
    assert routes.raw[0].count(b"vllm_xargs") == 1


def test_a_body_too_large_to_check_is_refused(tokenizer_path, monkeypatch):
    from lookupdec.vllm import middleware

    monkeypatch.setattr(middleware, "_MAX_BODY", 1000)
    routes = _Routes()
    status, raw = _call(routes, _body(padding="x" * 3000), tokenizer_path, chunks=4)
    assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large" and not routes.bodies


def test_the_users_name_reaches_the_proposer_as_its_client(tokenizer_path):
    routes = _Routes()
    status, _ = _call(routes, _body(user="alice", vllm_xargs={"other": 1}), tokenizer_path)
    assert status == 200 and routes.bodies[0]["vllm_xargs"] == {"other": 1, CLIENT_ARG: "alice"}
    status, _ = _call(routes, _body(user="bob", prediction={"content": PREDICTION}), tokenizer_path)
    assert status == 200 and routes.bodies[1]["vllm_xargs"][CLIENT_ARG] == "bob"
    assert PREDICTION_ARG in routes.bodies[1]["vllm_xargs"]
    status, _ = _call(routes, _body(), tokenizer_path)
    assert status == 200 and "vllm_xargs" not in routes.bodies[2]


def test_a_prediction_without_type_is_content(tokenizer_path):
    routes = _Routes()
    status, _ = _call(routes, _body(prediction={"content": PREDICTION}), tokenizer_path)
    assert status == 200 and routes.bodies[0]["vllm_xargs"][PREDICTION_ARG]
    status, raw = _call(routes, _body(prediction={"type": None, "content": PREDICTION}), tokenizer_path)
    assert status == 400 and json.loads(raw)["error"]["param"] == "prediction"


def test_the_counts_join_vllms_metrics(tokenizer_path):
    # prometheus_client's default registry, which vLLM serves from its API-server process (tests/test_vllm_metrics.py
    # reads it through vLLM's own route).
    from prometheus_client import REGISTRY
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    expected = prediction_usage(tokenizer(PREDICTION, add_special_tokens=False)["input_ids"],
                                tokenizer(ANSWER, add_special_tokens=False)["input_ids"])

    def counted():
        return tuple(REGISTRY.get_sample_value(f"lookupdec:prediction_{kind}_tokens_total", {"model_name": "m"}) or 0
                     for kind in ("accepted", "rejected"))

    before = counted()
    for stream in (False, True):
        extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        status, _ = _call(_Routes(), _body(prediction={"content": PREDICTION}, **extra), tokenizer_path)
        assert status == 200
    _call(_Routes(), _body(), tokenizer_path)  # no prediction: nothing counted
    after = counted()
    assert (after[0] - before[0], after[1] - before[1]) == (2 * expected[0], 2 * expected[1])
