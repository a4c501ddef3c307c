"""The server's engine without HTTP: an :class:`~lookupdec.serve.engine.Engine` on a tiny model (or SmolLM2, or
Gemma 3), tickets submitted from an asyncio loop, their events read.

Long prompts prefilled in chunks between the running requests' steps give plain greedy answers; a request's own
failure is its alone (an OpenAI-shaped 500) and its neighbours' answers do not change, while a failed batch pass
fails the running requests and the engine goes on; a cancel is never lost, whenever it lands; a shutdown answers
what it cuts with a 503; sliding-window models are served one request at a time; a tiny temperature is greedy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from test_batch import _long_prompt, _raising_from, _sliding_model
from test_exactness import _plain, _prompts

from lookupdec import batch as batch_module
from lookupdec.drafter import Drafter, DrafterConfig
from lookupdec.serve import scheduler
from lookupdec.serve.engine import Engine, Ticket
from lookupdec.serve.protocol import APIError, Request
from lookupdec.serve.scheduler import PrefillScheduler


@pytest.fixture(autouse=True)
def _chunk_small_prompts(monkeypatch):
    """The tests' "long" prompts are a few hundred tokens (the tiny models' context); a real server prefills such
    prompts whole (``WHOLE_PROMPT``), so the chunking is exercised on them by lowering that bound."""
    monkeypatch.setattr(scheduler, "WHOLE_PROMPT", 32)


def _req(**kw) -> Request:
    kw.setdefault("temperature", 0.0)
    return Request(kind="completion", model="test", prompt="(token ids given)", **kw)


def _ids(prompt) -> list:
    return prompt[0].tolist() if isinstance(prompt, torch.Tensor) else list(prompt)


async def _outcome(ticket: Ticket) -> tuple:
    """``(tokens, "done" or "error", summary or APIError)``: what the ticket's events said, in full."""
    tokens = []
    while True:
        kind, payload = await ticket.events.get()
        if kind == "tokens":
            tokens += payload
        else:
            return tokens, kind, payload


def _ask(engine: Engine, jobs: list, *, ticket_class=Ticket, between=None, timeout: float = 300) -> list:
    """Submit one ticket per job ``(prompt, max_tokens, request fields)``, in order, all at once, or, with
    ``between(i, tickets)`` (a coroutine), each after it ran. Returns each ticket's :func:`_outcome`."""
    async def main():
        loop = asyncio.get_running_loop()
        tickets = [ticket_class(_req(**fields), _ids(prompt), None, budget, loop) for prompt, budget, fields in jobs]
        outcomes = []
        if between is None:
            # All queued before the engine takes any: the first does not run alone for as long as the thread
            # switch to this one takes (a request can finish within it), whatever this machine's timings.
            with engine._cond:
                for ticket in tickets:
                    engine.submit(ticket)
        for i, ticket in enumerate(tickets):
            if between is not None:
                await between(i, tickets)
                engine.submit(ticket)
            outcomes.append(asyncio.ensure_future(_outcome(ticket)))
        return await asyncio.wait_for(asyncio.gather(*outcomes), timeout)

    return asyncio.run(main())


@contextmanager
def _engine(model, tokenizer=None, **kw):
    """A started engine; its prompts prefilled between the steps unless ``prefill_threads`` says otherwise."""
    kw.setdefault("prefill_threads", 0)
    engine = Engine(model, tokenizer, Drafter(DrafterConfig(calibrate=False)), **kw)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop(timeout=5)


def _greedy(model, prompt, budget) -> list:
    prompt = torch.tensor([_ids(prompt)])
    return _plain(model, prompt, max_new_tokens=budget)[0, prompt.shape[1]:].tolist()


def _chunks(monkeypatch) -> list:
    """Record every prefill pass as (prompt length, tokens, rows running)."""
    seen = []
    real = batch_module.BatchRun.prefill_chunk

    def spy(self, row, n):
        seen.append((row.prompt_len, n, len(self.rows)))
        return real(self, row, n)

    monkeypatch.setattr(batch_module.BatchRun, "prefill_chunk", spy)
    return seen


def _small_chunks(monkeypatch, lone: int, busy: int) -> None:
    """Fixed prefill budgets, whatever the passes' timings."""
    monkeypatch.setattr(PrefillScheduler, "lone_budget", lambda self: lone)
    monkeypatch.setattr(PrefillScheduler, "busy_budget", lambda self: busy)


async def _first_tokens(ticket: Ticket) -> None:
    """Wait until ``ticket``'s row has committed tokens."""
    while ticket.row is None or ticket.row.generated == 0:
        await asyncio.sleep(0.002)


# ---------------------------------------------------------------------------------------------------------------
# Chunked prefill


def test_a_long_prompt_in_chunks_alone_and_beside_running_requests_is_plain_greedy(tiny_model, monkeypatch):
    _small_chunks(monkeypatch, lone=40, busy=24)
    chunks = _chunks(monkeypatch)
    short = _prompts(tiny_model, count=2, seed=51)
    long = _long_prompt(tiny_model, seed=2)
    jobs = [(short[0], 80, {}), (short[1], 80, {}), (long, 40, {})]

    async def after_the_short_ones_decode(i, tickets):
        if i == 2:
            await _first_tokens(tickets[0])
            await _first_tokens(tickets[1])

    with _engine(tiny_model) as engine:
        alone = _ask(engine, [(long, 40, {})])
        together = _ask(engine, jobs, between=after_the_short_ones_decode)
    expected = _greedy(tiny_model, long, 40)
    assert alone == [(expected, "done", alone[0][2])] and alone[0][2]["finish_reason"] in ("stop", "length")
    for (tokens, kind, summary), (prompt, budget, _) in zip(together, jobs):
        assert kind == "done" and tokens == _greedy(tiny_model, prompt, budget)
        assert summary["completion_tokens"] == len(tokens)
    n = long.shape[1]
    alone_chunks = -(-n // 40)
    assert [c[1] for c in chunks if c[0] == n][: alone_chunks] == [40] * (n // 40) + [n % 40] * (n % 40 > 0)
    beside = [c for c in chunks if c[0] == n][alone_chunks:]
    assert len(beside) >= 5 and any(rows > 0 and tokens == 24 for _, tokens, rows in beside)


def test_a_prefill_worker_serves_plain_greedy_and_holds_running_requests_only_for_joins(tiny_model, monkeypatch):
    # The same requests on an engine whose worker prefills beside the steps: the same answers, the long prompt's
    # passes run on the worker's thread, and the request decoding meanwhile is held only while rows join (the
    # first token and the cache appended), much less than the long prompt's passes took.
    monkeypatch.setattr(PrefillScheduler, "lone_budget", lambda self: 40)
    threads = []
    real = batch_module.BatchRun.prefill_pass

    def spy(self, row, n):
        threads.append((row.prompt_len, threading.current_thread().name))
        return real(self, row, n)

    monkeypatch.setattr(batch_module.BatchRun, "prefill_pass", spy)
    beside = []
    join = batch_module.BatchRun.join_prefilled

    def joined(self, row, logits):
        beside.append((row.prompt_len, [other.owner for other in self.rows]))
        return join(self, row, logits)

    monkeypatch.setattr(batch_module.BatchRun, "join_prefilled", joined)
    short = _prompts(tiny_model, count=2, seed=51)
    long = _long_prompt(tiny_model, seed=2)
    jobs = [(short[0], 200, {"lookup": False}), (short[1], 80, {}), (long, 40, {})]
    tickets = []

    class Kept(Ticket):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            tickets.append(self)

    async def after_the_short_ones_decode(i, tickets):
        if i == 2:
            await _first_tokens(tickets[0])
            await _first_tokens(tickets[1])

    with _engine(tiny_model, prefill_threads=1) as engine:
        assert engine.scheduler.threads == 1
        together = _ask(engine, jobs, between=after_the_short_ones_decode, ticket_class=Kept)
    for (tokens, kind, summary), (prompt, budget, _) in zip(together, jobs):
        assert kind == "done" and tokens == _greedy(tiny_model, prompt, budget)
    n = long.shape[1]
    assert [name for length, name in threads if length == n] == ["lookupdec-prefill"] * -(-n // 40)
    [running] = [owners for length, owners in beside if length == n]
    assert running  # a short request still decoded when the long one joined: it was beside the long prefill
    for ticket in running:
        summary = together[tickets.index(ticket)][2]
        assert summary["others_prefill_seconds"] < tickets[2].row.prefill_seconds / 2


def test_each_request_is_told_the_prefills_run_beside_it_and_what_drafts_cost_it(tiny_model, monkeypatch):
    # A request decoding while another's long prompt is prefilled (in chunks) and joins is told how long that
    # held it: at least the joining prompt's own passes, at most the time it ran. The joining request, and one
    # alone, are told nothing. The drafts' net cost (the ledger's excess, in plain steps) comes with it.
    _small_chunks(monkeypatch, lone=40, busy=24)
    short = _prompts(tiny_model, count=1, seed=52)[0]
    long = _long_prompt(tiny_model, seed=3)

    async def after_the_first_decodes(i, tickets):
        if i == 1:
            await _first_tokens(tickets[0])

    with _engine(tiny_model) as engine:
        [(_, _, alone)] = _ask(engine, [(short, 20, {})])
        started = time.perf_counter()
        tickets = []

        class Kept(Ticket):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                tickets.append(self)

        # The first without drafts: one token a step, so it is still decoding while the long prompt's 12 or so
        # chunks go in, however many tokens drafts would have given it a pass.
        (_, _, first), (_, _, joined) = _ask(engine, [(short, 200, {"lookup": False}), (long, 8, {})],
                                             ticket_class=Kept, between=after_the_first_decodes)
        ran = time.perf_counter() - started
    assert alone["others_prefill_seconds"] == 0.0 and joined["others_prefill_seconds"] == 0.0
    long_prefill = tickets[1].row.prefill_seconds
    assert 0 < long_prefill <= first["others_prefill_seconds"] < ran
    # What drafts cost each request net, in plain steps: its ledger's account, a plain float in the answer.
    for summary, ticket in ((first, tickets[0]), (joined, tickets[1])):
        assert type(summary["draft_excess_steps"]) is float
        assert summary["draft_excess_steps"] == pytest.approx(float(ticket.row.session.ledger.excess))


@pytest.mark.slow
def test_smollm2_long_prompt_in_chunks_is_plain_greedy(smollm2, monkeypatch):
    model, tokenizer = smollm2
    _small_chunks(monkeypatch, lone=300, busy=96)
    chunks = _chunks(monkeypatch)
    lines = "\n".join(f"  - name: service-{i}\n    port: {8000 + i}\n    replicas: {i % 5 + 1}" for i in range(50))
    long = tokenizer.encode(f"services:\n{lines}\n\nThe same list, with every port increased by one:\nservices:\n")
    assert len(long) > 1000
    short = [tokenizer.encode(text) for text in ("One, two, three, four,", "The capital of France is")]
    jobs = [(short[0], 64, {}), (short[1], 64, {}), (long, 32, {})]

    async def after_the_short_ones_decode(i, tickets):
        if i == 2:
            await _first_tokens(tickets[0])

    with _engine(model, tokenizer) as engine:
        alone = _ask(engine, [(long, 32, {})])
        together = _ask(engine, jobs, between=after_the_short_ones_decode)
    expected = _greedy(model, long, 32)
    assert alone[0][:2] == (expected, "done")
    for (tokens, kind, _), (prompt, budget, _) in zip(together, jobs):
        assert kind == "done" and tokens == _greedy(model, prompt, budget)
    beside = [c for c in chunks if c[0] == len(long)][-(-len(long) // 300):]
    assert any(rows > 0 for _, _, rows in beside)  # the long prompt was prefilled while others decoded


# ---------------------------------------------------------------------------------------------------------------
# Failures


def _is_500(payload) -> bool:
    return isinstance(payload, APIError) and payload.status == 500 and \
        payload.body()["error"]["type"] == "server_error" and payload.code == "internal_error"


def test_a_requests_failure_is_its_own_and_the_others_answers_do_not_change(tiny_factory, monkeypatch):
    model = tiny_factory("llama")
    prompts = _prompts(model, count=3, seed=53)
    real_row = Engine._row

    def faulty_row(self, ticket):  # the second request's session fails at its third commit
        row = real_row(self, ticket)
        if ticket.prompt_ids == _ids(prompts[1]):
            row.session.commit = _raising_from(3, row.session.commit)
        return row

    monkeypatch.setattr(Engine, "_row", faulty_row)
    with _engine(model) as engine:
        outcomes = _ask(engine, [(p, 40, {}) for p in prompts])
        assert engine.busy is False
    for i in (0, 2):
        assert outcomes[i][:2] == (_greedy(model, prompts[i], 40), "done")
    tokens, kind, error = outcomes[1]
    assert kind == "error" and _is_500(error) and len(tokens) >= 2


def test_a_failed_batch_pass_fails_the_running_requests_and_the_engine_goes_on(tiny_factory, monkeypatch):
    model = tiny_factory("llama")
    prompts = _prompts(model, count=3, seed=57)
    real = batch_module.target_forward
    failed = []

    def forward(model, ids, *args, **kwargs):
        if ids.shape[0] > 1 and not failed:  # the first pass of two rows together
            failed.append(True)
            raise RuntimeError("injected")
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(batch_module, "target_forward", forward)
    with _engine(model) as engine:
        first = _ask(engine, [(prompts[0], 60, {}), (prompts[1], 60, {})])
        after = _ask(engine, [(prompts[2], 40, {}), (prompts[0], 40, {})])
    assert failed and [kind for _, kind, _ in first] == ["error", "error"] and all(_is_500(e) for *_, e in first)
    for (tokens, kind, _), prompt in zip(after, (prompts[2], prompts[0])):
        assert kind == "done" and tokens == _greedy(model, prompt, 40)


def test_a_request_that_cannot_start_fails_alone(tiny_model):
    prompts = _prompts(tiny_model, count=2, seed=59)
    with _engine(tiny_model) as engine:
        outcomes = _ask(engine, [(prompts[0], 30, {}), ([10 ** 6] * 5, 30, {}), (prompts[1], 30, {})])
    assert outcomes[1][1] == "error" and _is_500(outcomes[1][2])
    for i, prompt in ((0, prompts[0]), (2, prompts[1])):
        assert outcomes[i][:2] == (_greedy(tiny_model, prompt, 30), "done")


# ---------------------------------------------------------------------------------------------------------------
# Cancels


class _CancelledOnTheWay(Ticket):
    """A ticket its client cancels (having been sent ``used_on_cancel`` tokens) just before the engine hands it its
    row: the cancel reads ``row`` while it is still None, so only the ticket's flag can tell the engine."""

    used_on_cancel = None

    @property
    def row(self):
        return self.__dict__.get("_row")

    @row.setter
    def row(self, value):
        if value is not None:
            self.cancel(used=self.used_on_cancel)
        self.__dict__["_row"] = value


def test_a_cancel_landing_while_the_row_is_made_is_not_lost(tiny_model, monkeypatch):
    prompt = _prompts(tiny_model, count=1, seed=61)[0]
    rows = []
    real_row = Engine._row

    def spy(self, ticket):
        rows.append(real_row(self, ticket))
        return rows[-1]

    monkeypatch.setattr(Engine, "_row", spy)
    class Unsent(_CancelledOnTheWay):
        used_on_cancel = 0

    with _engine(tiny_model) as engine:
        (tokens, kind, summary), = _ask(engine, [(prompt, 200, {})], ticket_class=_CancelledOnTheWay)
        assert (tokens, kind, summary["finish_reason"], summary["completion_tokens"]) == ([], "done", "cancelled", 0)
        assert rows[-1].cancelled and rows[-1].used is None
        (tokens, kind, summary), = _ask(engine, [(prompt, 200, {})], ticket_class=Unsent)
        assert kind == "done" and summary["finish_reason"] == "cancelled" and rows[-1].used == 0

        # A cancel while the row is being made (its drafting session started) is caught the same way.
        real_start = engine.drafter.start
        tickets = []

        def start(*args, **kwargs):
            tickets[-1].cancel()
            return real_start(*args, **kwargs)

        class Remembered(Ticket):
            def __init__(self, *args):
                super().__init__(*args)
                tickets.append(self)

        monkeypatch.setattr(engine.drafter, "start", start)
        (tokens, kind, summary), = _ask(engine, [(prompt, 200, {})], ticket_class=Remembered)
        assert (tokens, kind, summary["finish_reason"]) == ([], "done", "cancelled")


def test_ticket_cancel_used_reaches_the_running_row(tiny_model):
    prompt = _prompts(tiny_model, count=1, seed=63)[0]

    async def main(engine):
        loop = asyncio.get_running_loop()
        ticket = Ticket(_req(), _ids(prompt), None, 400, loop)
        engine.submit(ticket)
        await _first_tokens(ticket)
        ticket.cancel(used=1)
        ticket.cancel()  # the web layer's cleanup: does not widen what was used
        outcome = await _outcome(ticket)
        return ticket, outcome

    with _engine(tiny_model) as engine:
        ticket, (tokens, kind, summary) = asyncio.run(main(engine))
    assert ticket.used == 1 and ticket.row.used == 1
    assert kind == "done" and (summary["finish_reason"] == "cancelled" or summary["completion_tokens"] == 400)


def test_a_row_that_ended_by_itself_joins_the_rolling_cache_as_far_as_the_client_got_it(tiny_model):
    # The web layer learns what the client got after the tokens were committed (a stop string in the last tokens,
    # a client that left before the last text reached it): the row may have ended by itself by then. Its session
    # waits for the web layer's release and honours the count it was given; without one the whole output joins.
    prompts = _prompts(tiny_model, count=2, seed=65)

    async def main(engine):
        cache = engine.drafter.cache
        loop = asyncio.get_running_loop()
        learnt = []
        for prompt, fields, used in ((prompts[0], {}, None), (prompts[1], {"stop": ["never in these tokens"]}, 5)):
            before = cache.num_sequences
            ticket = Ticket(_req(**fields), _ids(prompt), None, 20, loop)
            engine.submit(ticket)
            tokens, kind, summary = await _outcome(ticket)
            assert kind == "done" and summary["finish_reason"] in ("stop", "length") and len(tokens) > 5
            await asyncio.sleep(0.1)
            assert cache.num_sequences == before  # waiting for the web layer's verdict
            ticket.cancel(used=used)  # e.g. a stop string in the last tokens: the client got the first 5
            await asyncio.sleep(0.05)
            assert cache.num_sequences == before  # a cancel after the end finishes nothing
            ticket.release()  # the web layer is done: does not widen what was used
            while cache.num_sequences == before:
                await asyncio.sleep(0.002)
            learnt.append((tokens, cache.sequences()[-1]))
        return learnt

    with _engine(tiny_model) as engine:
        (whole, learnt_whole), (cut, learnt_cut) = asyncio.run(main(engine))
    max_n = engine.drafter.cache.max_n
    assert learnt_whole[-len(whole):].tolist() == whole and len(learnt_whole) <= len(whole) + max_n
    assert learnt_cut[-5:].tolist() == cut[:5] and len(learnt_cut) <= 5 + max_n


# ---------------------------------------------------------------------------------------------------------------
# Shutdown


def test_shutdown_answers_what_it_cuts_with_a_503(tiny_factory, monkeypatch):
    model = tiny_factory("llama")
    _small_chunks(monkeypatch, lone=8, busy=8)
    real = batch_module.target_forward

    def slow(*args, **kwargs):  # every pass takes 20 ms: the requests are still running when the drain ends
        time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(batch_module, "target_forward", slow)
    short = _prompts(model, count=1, seed=67)[0]
    long = _long_prompt(model, seed=3)
    engine = Engine(model, None, Drafter(DrafterConfig(calibrate=False)), max_batch=2, max_queue=8)
    engine.start()

    async def main():
        loop = asyncio.get_running_loop()
        running = Ticket(_req(lookup=False), _ids(short), None, 400, loop)  # one token per pass: 8 s of passes
        prefilling = Ticket(_req(), _ids(long), None, 40, loop)  # 35 chunks of 8 tokens, a step after each
        waiting = Ticket(_req(), _ids(short), None, 40, loop)  # the batch is full (max_batch 2)
        left = Ticket(_req(), _ids(short), None, 40, loop)  # its client goes away while it waits
        engine.submit(running)
        outcomes = [asyncio.ensure_future(_outcome(running))]
        await _first_tokens(running)
        for ticket in (prefilling, waiting, left):
            engine.submit(ticket)
            outcomes.append(asyncio.ensure_future(_outcome(ticket)))
        while not (engine.scheduler.joining and engine.scheduler.joining[0].prefilled > 0):
            await asyncio.sleep(0.005)
        left.cancel()
        await loop.run_in_executor(None, engine.stop, 0.2)
        with pytest.raises(RuntimeError):
            engine.submit(Ticket(_req(), _ids(short), None, 4, loop))
        return [prefilling, waiting], await asyncio.wait_for(asyncio.gather(*outcomes), 30)

    (prefilling, waiting), outcomes = asyncio.run(main())
    for tokens, kind, error in outcomes[:3]:
        assert kind == "error" and isinstance(error, APIError)
        assert (error.status, error.type, error.code) == (503, "server_error", "server_shutting_down")
        assert error.message == "the server shut down before this request finished"
    assert 0 < len(outcomes[0][0]) < 400  # cut mid-answer
    assert 0 < prefilling.row.prefilled < prefilling.row.prompt_len  # cut mid-prefill
    assert waiting.row is None  # cut before it started
    assert outcomes[3][1] == "done" and outcomes[3][2]["finish_reason"] == "cancelled"  # the client's own cancel
    assert not engine.busy and not engine._thread.is_alive()
    engine.stop(timeout=1)  # again: nothing left to do


# ---------------------------------------------------------------------------------------------------------------
# Sliding-window models; sampling


def _served_one_at_a_time(model, prompts, budget, caplog):
    with caplog.at_level(logging.WARNING, logger="lookupdec.serve.engine"):
        engine = Engine(model, None, Drafter(DrafterConfig(calibrate=False)), max_batch=8)
    assert engine.max_batch == 1
    warnings = [r for r in caplog.records if "sliding-window" in r.getMessage()]
    assert len(warnings) == 1 and "one request at a time" in warnings[0].getMessage()
    engine.start()
    try:
        outcomes = _ask(engine, [(p, budget, {}) for p in prompts])
    finally:
        engine.stop(timeout=5)
    for (tokens, kind, _), prompt in zip(outcomes, prompts):
        assert kind == "done" and tokens == _greedy(model, prompt, budget)


def test_a_sliding_window_model_is_served_one_request_at_a_time(caplog):
    model = _sliding_model()
    _served_one_at_a_time(model, _prompts(model, count=2, seed=71), 40, caplog)


@pytest.mark.slow
def test_gemma3_is_served_one_request_at_a_time(gemma3, caplog):
    model, tokenizer = gemma3
    prompts = [tokenizer.encode(text) for text in (
        "Here is a list: apples, pears, plums, cherries. The same list in reverse order:",
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")]
    _served_one_at_a_time(model, prompts, 32, caplog)


def test_a_tiny_temperature_gives_the_greedy_answer(tiny_model):
    prompts = _prompts(tiny_model, count=2, seed=73)
    with _engine(tiny_model) as engine:
        outcomes = _ask(engine, [(p, 40, {"temperature": 1e-40, "seed": 5}) for p in prompts])
    for (tokens, kind, _), prompt in zip(outcomes, prompts):
        assert kind == "done" and tokens == _greedy(tiny_model, prompt, 40)


def test_load_counts_the_requests_being_prefilled(tiny_model, monkeypatch):
    _small_chunks(monkeypatch, lone=8, busy=8)
    real = batch_module.target_forward

    def slow(*args, **kwargs):
        time.sleep(0.01)
        return real(*args, **kwargs)

    monkeypatch.setattr(batch_module, "target_forward", slow)
    long = _long_prompt(tiny_model, seed=4)
    loads = []

    async def watch(i, tickets):
        if i == 1:
            while not engine.scheduler.joining:
                await asyncio.sleep(0.002)
            loads.append(engine.load)

    with _engine(tiny_model, max_batch=4) as engine:
        outcomes = _ask(engine, [(long, 8, {}), (long, 8, {})], between=watch)
    assert loads and loads[0][0] >= 1
    assert [kind for _, kind, _ in outcomes] == ["done", "done"]
