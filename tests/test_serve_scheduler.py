"""The server's scheduler of joins: requests queue to join a running batch, and their prompts are prefilled between
its steps, in chunks sized by time (``lookupdec.serve.scheduler``). Every row still gives what single-sequence
``model.generate`` gives on that row alone; the budgets are fixed by hand where a test counts chunks, so that no
verdict depends on this machine's timings.
"""

import threading
import time

import pytest
import torch
from test_batch import _long_prompt, _row, _singles, _sliding_model
from test_exactness import _prompts

from lookupdec import LookupDrafter
from lookupdec.batch import BatchRun
from lookupdec.serve import scheduler
from lookupdec.serve.scheduler import PrefillScheduler


@pytest.fixture(autouse=True)
def _chunk_small_prompts(monkeypatch):
    """The tests' "long" prompts are a few hundred tokens (the tiny models' context); a real server prefills such
    prompts whole (``WHOLE_PROMPT``), so the chunking is exercised on them by lowering that bound."""
    monkeypatch.setattr(scheduler, "WHOLE_PROMPT", 32)


def _drive(run):
    """Turns of the server's loop (a round of prefill, then a step) until nothing runs or waits; the rows that
    ended, in order. ``run``: a :class:`PrefillScheduler`."""
    ended = []
    while run.rows or run.joining:
        ended += run.prefill_pending()
        if run.rows:
            ended += run.step()
    return ended


def _scheduler(model, drafter) -> PrefillScheduler:
    return PrefillScheduler(BatchRun(model, drafter))


def _budgets(monkeypatch, lone, busy):
    """Fixed prefill budgets (tokens; lone None: whole prompts), whatever the passes' timings."""
    monkeypatch.setattr(PrefillScheduler, "lone_budget", lambda self: lone)
    monkeypatch.setattr(PrefillScheduler, "busy_budget", lambda self: busy)


def _record(run, monkeypatch):
    """Record the run's prefill passes ("chunk", row, tokens) and decoding passes ("step",) in order."""
    events = []
    prefill, pass_ = run.run.prefill_chunk, run.run._pass

    def chunk(row, n):
        events.append(("chunk", row, n, len(run.rows)))
        return prefill(row, n)

    def step():
        events.append(("step",))
        return pass_()

    monkeypatch.setattr(run.run, "prefill_chunk", chunk)
    monkeypatch.setattr(run.run, "_pass", step)
    return events


def test_a_long_prompt_prefilled_alone_in_chunks_matches_single_sequence_greedy(tiny_model, monkeypatch):
    _budgets(monkeypatch, lone=37, busy=24)
    prompt = _long_prompt(tiny_model)
    drafter = LookupDrafter()
    run = _scheduler(tiny_model, drafter)
    events = _record(run, monkeypatch)
    row = _row(tiny_model, drafter, prompt, 40)
    with torch.inference_mode():
        run.enqueue(row)
        assert _drive(run) == [row]
    chunks = [e[2] for e in events if e[0] == "chunk"]
    assert chunks == [37] * (prompt.shape[1] // 37) + [prompt.shape[1] % 37]
    assert row.tokens.tolist() == _singles(tiny_model, [prompt], 40)[0]
    assert row.stats.target_passes == len([e for e in events if e[0] == "step"]) + 1  # the prefill counts once


def test_a_long_prompt_prefilled_between_steps_matches_single_sequence_greedy(tiny_model, monkeypatch):
    # Two rows decode; a long prompt and a short one arrive. The long one is prefilled a chunk per turn (the budget
    # held small here), between the running rows' steps, and every row gives what it gives alone.
    _budgets(monkeypatch, lone=None, busy=24)
    prompts = _prompts(tiny_model, count=3, seed=21)
    long = _long_prompt(tiny_model, seed=1)
    budgets = [60, 50, 30, 40]
    drafter = LookupDrafter()
    run = _scheduler(tiny_model, drafter)
    events = _record(run, monkeypatch)
    rows = [_row(tiny_model, drafter, p, b) for p, b in zip(prompts[:2] + [long, prompts[2]], budgets)]
    with torch.inference_mode():
        run.run.join(rows[0])
        run.run.join(rows[1])
        run.step()
        run.step()
        run.enqueue(rows[2])
        run.enqueue(rows[3])
        ended = _drive(run)
    assert sorted(map(id, ended)) == sorted(map(id, rows))
    expected = [_singles(tiny_model, [p], b)[0] for p, b in zip(prompts[:2] + [long, prompts[2]], budgets)]
    assert [row.tokens.tolist() for row in rows] == expected
    chunks = [i for i, e in enumerate(events) if e[0] == "chunk" and e[1] is rows[2]]
    busy = [i for i in chunks if events[i][3] > 0]
    assert len(chunks) >= 2 and len(busy) >= 5  # ~280 tokens, 24 per turn while rows decode
    for a, b in zip(chunks, chunks[1:]):  # a step between two chunks while rows decode: they kept decoding
        assert events[b][3] == 0 or any(e[0] == "step" for e in events[a:b])
    # No round of prefill that began while rows were decoding spent more than the budget (once none is left,
    # the rest is prefilled in large chunks).
    spent, busy = 0, False
    for e in events:
        if e[0] == "step":
            spent = 0
        else:
            busy = e[3] > 0 if spent == 0 else busy
            spent += e[2]
            assert spent <= 24 or not busy
    assert any(e[0] == "chunk" and e[3] == 0 and e[2] > 24 for e in events)


def test_a_shorter_prompt_goes_first_and_a_joined_row_ends_the_lone_budget(tiny_model, monkeypatch):
    # With nothing running, a prompt within the lone budget is prefilled in one pass. Two arriving together: the
    # shorter is prefilled first and starts decoding; the longer is then prefilled a chunk per step.
    _budgets(monkeypatch, lone=None, busy=24)
    long, short = _long_prompt(tiny_model, seed=5), _prompts(tiny_model, count=1, seed=7)[0]
    drafter = LookupDrafter()
    run = _scheduler(tiny_model, drafter)
    events = _record(run, monkeypatch)
    rows = [_row(tiny_model, drafter, prompt, 30) for prompt in (long, long, short)]
    with torch.inference_mode():
        run.enqueue(rows[0])
        _drive(run)
        assert [e[1:3] for e in events if e[0] == "chunk"] == [(rows[0], long.shape[1])]
        events.clear()
        run.enqueue(rows[1])
        run.enqueue(rows[2])
        _drive(run)
    chunks = [(e[1], e[2]) for e in events if e[0] == "chunk"]
    assert chunks[0] == (rows[2], short.shape[1]) and events[1] == ("step",)
    assert {n for row, n in chunks[1:-1]} == {24} and all(row is rows[1] for row, n in chunks[1:])
    for row, prompt in zip(rows, (long, long, short)):
        assert row.tokens.tolist() == _singles(tiny_model, [prompt], 30)[0]


def test_a_prompt_within_whole_prompt_joins_in_one_pass_beside_running_rows(tiny_model, monkeypatch):
    # Chunks are for long prompts: one of at most WHOLE_PROMPT tokens is prefilled in one pass even when the busy
    # budget is smaller (step-sized chunks of it would each read every weight again).
    _budgets(monkeypatch, lone=None, busy=24)
    long, short = _long_prompt(tiny_model, seed=6), _prompts(tiny_model, count=1, seed=8)[0]
    monkeypatch.setattr(scheduler, "WHOLE_PROMPT", long.shape[1])
    drafter = LookupDrafter()
    run = _scheduler(tiny_model, drafter)
    events = _record(run, monkeypatch)
    rows = [_row(tiny_model, drafter, prompt, 30) for prompt in (short, long)]
    with torch.inference_mode():
        run.enqueue(rows[0])
        run.prefill_pending()
        run.step()  # rows[0] decodes: the busy budget applies from here
        run.enqueue(rows[1])
        _drive(run)
    assert [(e[1], e[2]) for e in events if e[0] == "chunk"] == [(rows[0], short.shape[1]), (rows[1], long.shape[1])]
    for row, prompt in zip(rows, (short, long)):
        assert row.tokens.tolist() == _singles(tiny_model, [prompt], 30)[0]


def test_prefill_budgets_follow_the_measured_rates(tiny_model, monkeypatch):
    run = _scheduler(tiny_model, LookupDrafter())
    assert run.busy_budget() == scheduler._CHUNK_FIRST and run.lone_budget() == scheduler._LONE_FIRST
    run.rate = 1000.0  # 1,000 prompt tokens a second
    assert run.lone_budget() == int(1000 * scheduler.LONE_CHUNK_S)
    # Beside decoding rows: what the steps' credit pays for, nothing under CHUNK_MIN tokens.
    run.credit = 0.0
    assert run.busy_budget() == 0
    run.credit = (scheduler.CHUNK_MIN - 1) / 1000
    assert run.busy_budget() == 0
    run.credit = 0.05
    assert run.busy_budget() == 50
    run.rate = 10.0  # a prefill too slow for CHUNK_MIN tokens within the credit's cap still moves
    run.credit = scheduler.BUSY_CHUNK_S
    assert run.busy_budget() == scheduler.CHUNK_MIN
    run.rate = 1e9  # an accelerator: capped per round; a lone prompt is whole
    assert run.busy_budget() == scheduler.CHUNK_MAX and run.lone_budget() > 10 ** 6
    monkeypatch.setattr(scheduler, "LONE_CHUNK_S", None)
    assert run.lone_budget() is None


def test_steps_pay_for_the_chunks_beside_them(tiny_model, monkeypatch):
    # Each step beside a long prefill earns BUSY_STEP_SHARE of its time; a chunk spends what it took. The passes
    # are real, their times set (a step 10 ms; a chunk 4 ms, the fixed cost of a pass, plus 20 us a token), so the
    # accounting is exact: the chunks' time is within that share of the steps' (plus one chunk's overrun).
    monkeypatch.setattr(PrefillScheduler, "lone_budget", lambda self: None)
    long, short = _long_prompt(tiny_model, seed=9, head=40, cont=30), _prompts(tiny_model, count=1, seed=10)[0]
    drafter = LookupDrafter()
    run = _scheduler(tiny_model, drafter)
    rows = [_row(tiny_model, drafter, short, 200), _row(tiny_model, drafter, long, 10)]
    spent = {"step": 0.0, "chunk": 0.0}
    real_forward = BatchRun._timed_forward  # every pass's time comes from here: steps' and chunks'

    def timed(self, ids, n_logits, cache, mask=None, positions=None):
        logits, _ = real_forward(self, ids, n_logits, cache, mask, positions)
        chunk = cache is rows[1].prefill_cache
        seconds = 0.004 + 2e-5 * ids.shape[1] if chunk else 0.010
        if self.rows and rows[1] in run.joining:
            spent["chunk" if chunk else "step"] += seconds
        return logits, seconds

    monkeypatch.setattr(BatchRun, "_timed_forward", timed)
    with torch.inference_mode():
        run.enqueue(rows[0])
        run.prefill_pending()
        run.enqueue(rows[1])
        credits, chunks = [], 0
        while rows[1] in run.joining and run.rows:
            credits.append(run.credit)
            before = rows[1].prefilled
            run.prefill_pending()
            chunks += rows[1].prefilled > before
            run.step()
        assert rows[1] not in run.joining, "the long prompt joins while the short row decodes"
        _drive(run)
    assert chunks >= 3 and 0 < max(credits) <= scheduler.BUSY_CHUNK_S
    assert spent["chunk"] <= scheduler.BUSY_STEP_SHARE * spent["step"] + 0.002
    for row, prompt, n in zip(rows, (short, long), (200, 10)):
        assert row.tokens.tolist() == _singles(tiny_model, [prompt], n)[0]


def test_a_cancelled_row_stops_prefilling_at_once(tiny_model, monkeypatch):
    _budgets(monkeypatch, lone=50, busy=24)
    drafter = LookupDrafter()
    run = _scheduler(tiny_model, drafter)
    row = _row(tiny_model, drafter, _long_prompt(tiny_model), 40)
    with torch.inference_mode():
        run.enqueue(row)
        assert run.prefill_pending() == []
        assert row.prefilled == 50 and row.prefill_cache is not None
        row.cancel()
        assert run.prefill_pending() == [row]
    assert row.finish_reason == "cancelled" and row.prefilled == 50 and row.prefill_cache is None
    assert not run.rows and not run.joining


def test_a_sliding_window_model_is_prefilled_one_row_at_a_time():
    model = _sliding_model()
    prompts = _prompts(model, count=2, seed=43)  # longer than the window
    drafter = LookupDrafter()
    run = _scheduler(model, drafter)
    assert run.run.one_at_a_time and run.lone_budget() is None  # nothing else to run meanwhile: whole prompts
    rows = [_row(model, drafter, p, 40) for p in prompts]
    with torch.inference_mode():
        for row in rows:
            run.enqueue(row)
            with pytest.raises(RuntimeError, match="one row at a time"):
                run.enqueue(_row(model, drafter, prompts[0], 4))
            assert _drive(run) == [row]
    for row, prompt in zip(rows, prompts):
        assert row.tokens.tolist() == _singles(model, [prompt], 40)[0]


# ---------------------------------------------------------------------- a prefill worker beside the steps


def _worker(model, drafter, monkeypatch, lone=37):
    """A scheduler whose prompts a worker thread prefills (one torch thread), its chunk budget fixed."""
    monkeypatch.setattr(PrefillScheduler, "lone_budget", lambda self: lone)
    return PrefillScheduler(BatchRun(model, drafter), threads=1)


def _drive_until(run, done, timeout=120.0):
    """The engine's turns (collect what the worker finished, then a step) until ``done()``; the rows that ended."""
    ended, deadline = [], time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the rows did not finish in time"
        ended += run.prefill_pending()
        if run.rows:
            ended += run.step()
        else:
            time.sleep(0.001)
    return ended


def _wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "waited in vain"
        time.sleep(0.01)


def _gate(run, row):
    """Hold the worker's passes for ``row`` until the returned event is set (each waits at most a minute, so a
    scheduler that runs them on the caller's thread fails the test instead of hanging it); the threads those
    passes ran on are recorded in the returned list."""
    gate, threads, prefill = threading.Event(), [], run.run.prefill_pass

    def held(r, n):
        if r is row:
            threads.append(threading.current_thread().name)
            if not gate.wait(60):
                raise TimeoutError("the gate was never opened")
        return prefill(r, n)

    run.run.prefill_pass = held
    return gate, threads


def test_a_prefill_worker_prefills_beside_the_steps_and_every_row_is_single_sequence_greedy(tiny_model, monkeypatch):
    # Two rows decode while a long prompt's prefill is held in the worker: they finish meanwhile, which a scheduler
    # that prefills between the steps cannot do. Then the long prompt (chunked) and a short one join, and every row
    # gives what it gives alone.
    prompts = _prompts(tiny_model, count=3, seed=41)
    long = _long_prompt(tiny_model, seed=2)
    budgets = [20, 25, 30, 40]
    drafter = LookupDrafter()
    run = _worker(tiny_model, drafter, monkeypatch)
    rows = [_row(tiny_model, drafter, p, b) for p, b in zip(prompts[:2] + [long, prompts[2]], budgets)]
    gate, threads = _gate(run, rows[2])
    with torch.inference_mode():
        run.enqueue(rows[0])
        run.enqueue(rows[1])
        ended = _drive_until(run, lambda: len(run.rows) == 2)
        run.enqueue(rows[2])
        ended += _drive_until(run, lambda: not run.rows)  # the first two end; the long prompt is still held
        assert threads and rows[2] in run.joining and rows[2].prefilled == 0
        gate.set()
        run.enqueue(rows[3])
        ended += _drive_until(run, lambda: not run.rows and not run.joining)
    run.stop_worker()
    assert sorted(map(id, ended)) == sorted(map(id, rows))
    expected = [_singles(tiny_model, [p], b)[0] for p, b in zip(prompts[:2] + [long, prompts[2]], budgets)]
    assert [row.tokens.tolist() for row in rows] == expected
    assert set(threads) == {"lookupdec-prefill"} and len(threads) == -(-long.shape[1] // 37)  # in chunks
    # Its prefill passes count once, in the batch's figures, when it joins.
    assert rows[2].prefill_passes == len(threads) and rows[2].stats.target_passes >= 1


def test_the_worker_ends_a_cancelled_row_and_a_failed_one_and_the_others_go_on(tiny_model, monkeypatch):
    prompts = _prompts(tiny_model, count=4, seed=43)
    drafter = LookupDrafter()
    run = _worker(tiny_model, drafter, monkeypatch)
    rows = [_row(tiny_model, drafter, p, 20) for p in prompts]
    held, waiting, failing, fine = rows
    gate, threads = _gate(run, held)
    prefill = run.run.prefill_pass

    def fails(row, n):
        if row is failing:
            raise RuntimeError("the prefill's pass fails")
        return prefill(row, n)

    run.run.prefill_pass = fails
    with torch.inference_mode():
        run.enqueue(held)
        _wait_for(lambda: threads)  # the worker is in held's pass...
        run.enqueue(waiting)  # ...so these wait behind it
        run.enqueue(failing)
        run.enqueue(fine)
        waiting.cancel()
        held.cancel()  # cancelled during its own pass: it ends after the pass, and never joins
        gate.set()
        ended = _drive_until(run, lambda: not run.joining and not run.rows)
    run.stop_worker()
    assert sorted(map(id, ended)) == sorted(map(id, rows))
    assert held.finish_reason == waiting.finish_reason == "cancelled" and waiting.prefill_passes == 0
    assert failing.finish_reason == "error" and isinstance(failing.error, RuntimeError)
    assert fine.tokens.tolist() == _singles(tiny_model, [prompts[3]], 20)[0]
    assert all(row.prefill_cache is None for row in rows)


def test_cut_stops_the_worker_and_returns_the_rows_it_held(tiny_model, monkeypatch):
    prompts = _prompts(tiny_model, count=2, seed=47)
    drafter = LookupDrafter()
    run = _worker(tiny_model, drafter, monkeypatch)
    rows = [_row(tiny_model, drafter, p, 20) for p in prompts]
    gate, threads = _gate(run, rows[0])
    with torch.inference_mode():
        run.enqueue(rows[0])
        run.enqueue(rows[1])
        _wait_for(lambda: threads)  # the worker is in rows[0]'s pass
        worker = run._worker
        threading.Timer(0.2, gate.set).start()  # the pass in flight ends; cut waits for it
        cut = run.cut()
    assert sorted(map(id, cut)) == sorted(map(id, rows)) and not run.joining and not run.ready
    assert not worker.is_alive() and all(row.prefill_cache is None for row in rows)


@pytest.mark.parametrize(("device", "cores", "steps", "expected"), [
    ("cpu", 2, 1, 1), ("cpu", 2, 2, 0), ("cpu", 16, 8, 8), ("cpu", 16, 12, 4), ("cpu", 1, 1, 0),
    ("cuda", 16, 4, 0),
])
def test_the_default_worker_gets_the_cores_the_steps_leave_free(tiny_model, monkeypatch, device, cores, steps,
                                                                 expected):
    run = BatchRun(tiny_model, LookupDrafter())
    run.device = torch.device(device)
    monkeypatch.setattr(scheduler.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(scheduler.torch, "get_num_threads", lambda: steps)
    assert scheduler.default_prefill_threads(run) == expected


def test_a_sliding_window_model_has_no_prefill_worker():
    model = _sliding_model()
    run = BatchRun(model, LookupDrafter())
    assert scheduler.default_prefill_threads(run) == 0
    with pytest.raises(ValueError, match="one row at a time"):
        PrefillScheduler(run, threads=1)


class _Death(BaseException):
    """Not a row's own failure (a row's is an Exception): what kills the worker's thread."""


def test_a_worker_that_dies_fails_the_rows_it_held_and_the_next_prompt_gets_a_new_one(tiny_model, monkeypatch):
    prompts = _prompts(tiny_model, count=3, seed=53)
    drafter = LookupDrafter()
    run = _worker(tiny_model, drafter, monkeypatch)
    rows = [_row(tiny_model, drafter, p, 20) for p in prompts]
    entered, go, prefill = threading.Event(), threading.Event(), run.run.prefill_pass

    def dies(row, n):
        if row is rows[0]:
            entered.set()
            go.wait(60)
            raise _Death("the worker's thread dies")
        return prefill(row, n)

    run.run.prefill_pass = dies
    with torch.inference_mode():
        run.enqueue(rows[0])
        assert entered.wait(60)
        run.enqueue(rows[1])  # waits behind rows[0]'s pass, which kills the worker
        go.set()
        ended = _drive_until(run, lambda: not run.joining, timeout=20)
        assert sorted(map(id, ended)) == sorted(map(id, rows[:2]))
        assert all(row.finish_reason == "error" and isinstance(row.error, _Death) for row in rows[:2])
        run.run.prefill_pass = prefill
        run.enqueue(rows[2])
        ended = _drive_until(run, lambda: not run.joining and not run.rows)
    run.stop_worker()
    assert ended == [rows[2]] and rows[2].tokens.tolist() == _singles(tiny_model, [prompts[2]], 20)[0]


def test_a_model_whose_passes_rewrite_its_rotary_embedding_has_no_prefill_worker():
    # Dynamic RoPE writes new frequencies to the module in a pass: a prefill beside a step would race with it.
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=128)
    plain = BatchRun(LlamaForCausalLM(LlamaConfig(**config)).eval(), LookupDrafter())
    dynamic = BatchRun(LlamaForCausalLM(LlamaConfig(**config, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})).eval(), LookupDrafter())
    assert plain.stateless_passes and not dynamic.stateless_passes
    assert scheduler.no_prefill_worker(plain) is None
    with pytest.raises(ValueError, match="dynamic RoPE"):
        PrefillScheduler(dynamic, threads=1)


@pytest.mark.parametrize(("given", "expected"), [([], None), (["--prefill-threads", "auto"], None),
                                                 (["--prefill-threads", "0"], 0), (["--prefill-threads", "2"], 2)])
def test_the_cli_hands_prefill_threads_to_the_server(monkeypatch, given, expected):
    from click.testing import CliRunner

    from lookupdec import cli
    from lookupdec.serve import run as serve_run

    seen = []
    monkeypatch.setattr(serve_run, "serve", lambda options, say: seen.append(options))
    result = CliRunner().invoke(cli.main, ["serve", *given], catch_exceptions=False)
    assert result.exit_code == 0 and seen[0].prefill_threads == expected


@pytest.mark.parametrize("bad", ["-1", "two", "1.5"])
def test_the_cli_refuses_a_bad_prefill_thread_count(bad):
    from click.testing import CliRunner

    from lookupdec import cli

    result = CliRunner().invoke(cli.main, ["serve", "--prefill-threads", bad])
    assert result.exit_code == 2 and "is not a number of threads (0 to 1024) or auto" in result.stderr
