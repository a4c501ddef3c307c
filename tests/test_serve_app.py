"""The web layer's side of a request, on the engine without HTTP: what the rolling cache learns is what the client
was sent. A client that leaves mid-stream leaves only the tokens whose text it was sent; one that leaves a request
that does not stream, nothing; an answer sent whole, all of it (before the response leaves the server).
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_exactness import _prompts
from test_serve_engine import _engine, _ids, _req

pytest.importorskip("fastapi")

from lookupdec import batch as batch_module  # noqa: E402
from lookupdec.serve import app  # noqa: E402 - needs the serve extra, checked above
from lookupdec.serve.engine import Ticket  # noqa: E402


class _Letters:
    """A tokenizer for the tiny models: token ``i`` reads ``<i>``."""

    def decode(self, ids, **kwargs):
        return "".join(f"<{i}>" for i in ids)


class _Client:
    """What ``_collect`` asks of the request: whether the client left (once ``leave`` is set)."""

    def __init__(self):
        self.left = asyncio.Event()

    async def is_disconnected(self):
        return self.left.is_set()


async def _learnt(cache, before: int, timeout: float = 30) -> list:
    """The sequences the rolling cache learnt since it held ``before``, once the engine has settled."""
    deadline = asyncio.get_running_loop().time() + timeout
    while cache.num_sequences == before and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    return [seq.tolist() for seq in cache.sequences()[before:]]


def _output(learnt: list, tokens: list, max_n: int) -> int:
    """How many of ``tokens`` (the row's output) the learnt sequence ends with: a little prompt, then the output."""
    n = next(n for n in range(len(tokens), -1, -1) if learnt[len(learnt) - n:] == tokens[:n])
    assert len(learnt) <= n + max_n
    return n


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield pool


def test_a_client_that_leaves_mid_stream_leaves_only_what_it_was_sent(tiny_model, pool):
    prompt = _prompts(tiny_model, count=1, seed=71)[0]

    async def main(engine):
        cache = engine.drafter.cache
        before = cache.num_sequences
        ticket = Ticket(_req(stream=True), _ids(prompt), None, 300, asyncio.get_running_loop())
        engine.submit(ticket)
        stream = app._stream(ticket, _Letters(), pool)
        received = [await stream.__anext__() for _ in range(3)]
        while ticket.row.generated < 60 and ticket.row.finish_reason is None:  # the engine runs ahead (or ends)
            await asyncio.sleep(0.002)
        await stream.aclose()  # the client left: the server closes the stream at its last yield
        return received, ticket.row.tokens.tolist(), await _learnt(cache, before)

    with _engine(tiny_model) as engine:
        received, tokens, learnt = asyncio.run(main(engine))
    # Each chunk is one pass's text; the last one read may not have reached the client when it left.
    texts = [json.loads(event.removeprefix("data: "))["choices"][0]["text"] for event in received]
    text, acknowledged = "".join(texts), "".join(texts[:-1])
    assert len(learnt) == 1
    n = _output(learnt[0], tokens, engine.drafter.cache.max_n)
    assert "".join(f"<{t}>" for t in tokens[:n]) == acknowledged  # the text the client was sent, whole tokens
    assert len(text) > len(acknowledged) > 0 and n < len(tokens)


def test_a_client_that_leaves_a_request_that_does_not_stream_leaves_nothing(tiny_model, pool, monkeypatch):
    prompt = _prompts(tiny_model, count=1, seed=73)[0]
    gate = threading.Event()  # the engine's passes wait here while it is clear: the row is still running when
    gate.set()  # the client leaves, whatever this machine's speed
    real = batch_module.target_forward

    def forward(*args, **kwargs):
        gate.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(batch_module, "target_forward", forward)
    monkeypatch.setattr(app, "_DISCONNECT_POLL_S", 0.01)

    async def main(engine):
        cache = engine.drafter.cache
        before = cache.num_sequences
        client = _Client()
        ticket = Ticket(_req(), _ids(prompt), None, 300, asyncio.get_running_loop())
        engine.submit(ticket)
        collecting = asyncio.ensure_future(app._collect(ticket, client, _Letters(), pool))
        while ticket.row is None or ticket.row.generated < 20:
            await asyncio.sleep(0.002)
        gate.clear()
        client.left.set()
        with pytest.raises(app.APIError) as caught:
            await collecting
        gate.set()
        while engine.busy:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        return caught.value, ticket, cache.num_sequences - before

    with _engine(tiny_model) as engine:
        error, ticket, learnt = asyncio.run(main(engine))
    assert error.status == 499 and ticket.row.finish_reason == "cancelled" and ticket.row.generated >= 20
    assert learnt == 0  # the client was sent nothing


def test_an_answer_sent_whole_is_learnt_before_the_response_leaves(tiny_model, pool):
    prompt = _prompts(tiny_model, count=1, seed=75)[0]

    async def main(engine):
        cache = engine.drafter.cache
        before = cache.num_sequences
        ticket = Ticket(_req(), _ids(prompt), None, 30, asyncio.get_running_loop())
        engine.submit(ticket)
        answer = await app._collect(ticket, _Client(), _Letters(), pool)
        return answer, ticket, [seq.tolist() for seq in cache.sequences()[before:]]  # no wait: learnt already

    with _engine(tiny_model) as engine:
        answer, ticket, learnt = asyncio.run(main(engine))
    tokens = ticket.row.tokens.tolist()
    assert answer["choices"][0]["text"] == "".join(f"<{t}>" for t in tokens)
    assert len(learnt) == 1 and _output(learnt[0], tokens, engine.drafter.cache.max_n) == len(tokens)
