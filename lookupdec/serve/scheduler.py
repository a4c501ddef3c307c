"""The server's prefill scheduler: requests queue to join a running :class:`~lookupdec.batch.BatchRun`, and their
prompts are prefilled between its decoding steps, in chunks sized by time, so that a long prompt neither stalls the
running requests for its whole prefill nor waits for them to finish.

A pass pays a fixed part whatever its width (on a CPU, reading every weight once, and attending over the context
already cached: ~0.05-0.1 s for SmolLM2-135M in fp32 on 2 cores, more than a step of a short request), so chunks
are sized by time, from the last prefill pass's rate (its tokens per second); docs/design.md, "Chunked prefill",
has the measurements behind each rule:

- While rows decode, a long prompt is prefilled on credit: each decoding step earns :data:`BUSY_STEP_SHARE` of
  its own time, and a chunk runs once the credit pays for :data:`CHUNK_MIN` tokens at that rate, spending what the
  chunk measured (a chunk that overruns leaves a debt). The running requests so decode at about
  ``1 + BUSY_STEP_SHARE`` times their pace alone, however dear a pass is (a chunk after every step would cost each
  step a whole pass's fixed part). The credit starts at zero when rows start decoding and holds at most
  :data:`BUSY_CHUNK_S`, so a chunk never delays a step by much more than that.
- While none does, :data:`LONE_CHUNK_S` seconds' worth, and at least :data:`LONE_CHUNK_MIN` tokens: a request that
  arrives meanwhile waits about that long, not for the whole prompt, and a prompt that fits (every prompt on a GPU;
  on a CPU a few hundred tokens) is prefilled in one pass. The floor is there because the fixed part grows with the
  context a pass attends to: late in a long prompt, chunks cut to the time budget would shrink to a handful of
  tokens, each paying the whole fixed part.
- A prompt of at most :data:`WHOLE_PROMPT` tokens is prefilled in one pass whatever the budget, and needs no
  credit: its neighbours wait one pass. Cut into step-sized chunks, each a pass that reads every weight, such
  prompts would cost far more than they save.

Chunking changes no output (``batch.py``): a chunk's queries see the keys before it and its own causally, as in
one pass.

On a CPU with cores the decoding steps do not use, prompts are prefilled **beside** the steps instead, by a worker
thread of its own (``threads`` > 0, :func:`default_prefill_threads`): the running rows then wait for a join
(picking the first token, appending the cache), not for the prefill passes. The worker takes the shortest
remaining prompt first, a prompt of at most :data:`WHOLE_PROMPT` tokens in one pass and a longer one in chunks of
:meth:`PrefillScheduler.lone_budget` (so that a shorter prompt, or a cancel, waits one chunk, not a whole
prompt); the engine's thread adds each row it finished to the batch between two steps. The worker's passes are
the same passes on the same caches, so outputs do not change (docs/design.md, "Prefill beside the steps").
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from ..batch import BatchRun, Row

_log = logging.getLogger(__name__)

CHUNK_MIN = 16
CHUNK_MAX = 512
BUSY_STEP_SHARE = 0.25
BUSY_CHUNK_S = 0.2
WHOLE_PROMPT = 512
LONE_CHUNK_S: float | None = 0.25  # None: whole prompts (one that arrives meanwhile waits for the whole prefill)
LONE_CHUNK_MIN = 48
_CHUNK_FIRST = 128  # the budgets before any prefill pass was timed
_LONE_FIRST = 512


def default_prefill_threads(run: BatchRun) -> int:
    """The threads a prefill worker beside ``run``'s steps gets by default: on a CPU, as many as the decoding
    steps use (torch's threads), or fewer if fewer cores are left beside them; 0 (prefill between the steps) on
    other devices, where no core is left, and where a worker cannot run (:func:`no_prefill_worker`)."""
    if run.device.type != "cpu" or no_prefill_worker(run):
        return 0
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    steps = torch.get_num_threads()
    return max(0, min(steps, cores - steps))


def no_prefill_worker(run: BatchRun) -> str | None:
    """Why ``run``'s prompts cannot be prefilled beside its steps, or None."""
    if run.one_at_a_time:
        return "it holds one row at a time"
    if run.static_slots is not None:
        return "it takes its rows at the start"
    if not run.stateless_passes:
        return "the model's passes change its rotary embedding (dynamic RoPE)"
    return None


def _remaining(row: Row) -> int:
    """Prompt tokens of ``row`` not prefilled yet (the shortest remainder goes first)."""
    return row.prompt_len - row.prefilled


def _whole(row: Row, budget: int | None) -> bool:
    """Whether ``row``'s prompt goes in one pass whatever ``budget`` (None: no budget), as a prompt of at most
    :data:`WHOLE_PROMPT` tokens does."""
    return budget is None or (row.prefilled == 0 and row.prompt_len <= WHOLE_PROMPT)


class PrefillScheduler:
    """The rows waiting to join ``run`` (:meth:`enqueue`), and the prefill work done for them between steps
    (:meth:`prefill_pending`), or by a worker thread beside the steps, whose finished rows :meth:`prefill_pending`
    adds to the batch; :meth:`step` steps the run and earns the credit that pays for chunks beside it."""

    def __init__(self, run: BatchRun, threads: int = 0, wake=None):
        """``threads`` > 0: prompts are prefilled by a worker thread with that many torch threads, beside the steps
        (refused where :func:`no_prefill_worker` says why not). ``wake()`` is called from the worker when it has
        finished a row, so that an engine waiting for one can collect it."""
        if threads < 0:
            raise ValueError(f"threads must be 0 or more, got {threads}")
        why = no_prefill_worker(run) if threads else None
        if why:
            raise ValueError(f"this run's prompts are prefilled between its steps (threads=0): {why}")
        self.run = run
        self.threads = threads
        self.wake = wake or (lambda: None)
        self.joining: list[Row] = []  # rows whose prompt is being prefilled, oldest first
        self.credit = 0.0  # seconds of prefill the decoding steps have paid for (busy_budget)
        self.rate: float | None = None  # prompt tokens per second of the last prefill pass
        # The worker (threads > 0): rows it has finished (prefilled, failed or cancelled) for the engine's thread
        # to collect, its thread, and which worker may run (a stopped one that is still in a pass must not go on
        # after it); all three, and joining, under _lock.
        self._lock = threading.Condition()
        self._finished: list[Row] = []
        self._worker: threading.Thread | None = None
        self._generation = 0

    @property
    def rows(self) -> list[Row]:
        """The running rows."""
        return self.run.rows

    def enqueue(self, row: Row) -> None:
        """Queue ``row`` to be prefilled by :meth:`prefill_pending`, which adds it to the batch once its prompt is
        in."""
        self.run.check_room(row, self.joining)
        with self._lock:
            self.joining.append(row)
            if self.threads:
                self._start_worker()
                self._lock.notify_all()

    @property
    def ready(self) -> bool:
        """Whether :meth:`prefill_pending` has something to do now: with a worker, a row it finished; without, any
        row waiting to be prefilled."""
        return bool(self._finished) if self.threads else bool(self.joining)

    def busy_budget(self) -> int:
        """Prompt tokens a round of prefill may spend while rows decode: what the credit the steps earned pays
        for at the last prefill pass's rate, or 0 while that is under :data:`CHUNK_MIN` tokens (a pass that
        reads every weight for a handful of tokens would cost the running rows more than it moves the prompt)."""
        if self.rate is None:
            return _CHUNK_FIRST
        n = int(min(self.credit * self.rate, CHUNK_MAX))
        if n >= CHUNK_MIN or self.credit >= BUSY_CHUNK_S:  # the second: a prefill slower than CHUNK_MIN
            return max(n, CHUNK_MIN)  # tokens per BUSY_CHUNK_S still moves
        return 0

    def lone_budget(self) -> int | None:
        """Prompt tokens a round of prefill may spend while no row decodes (:data:`LONE_CHUNK_S`); None: all of
        them (also for a run that holds one row at a time, which has nothing else to run meanwhile)."""
        if self.run.one_at_a_time or self.run.static_slots is not None or LONE_CHUNK_S is None:
            return None
        if self.rate is None:
            return _LONE_FIRST
        return int(max(self.rate * LONE_CHUNK_S, LONE_CHUNK_MIN))

    def prefill_pending(self) -> list[Row]:
        """One round of prefill work, to run between two steps. A cancelled row stops prefilling at once. Then the
        queued prompts, the shortest remainder first (the oldest first among equals), get passes until the round's
        budget is spent: :meth:`busy_budget` while rows decode (it may be 0: the steps have not yet paid for a
        chunk), else :meth:`lone_budget` (until a row joins). A prompt of at most :data:`WHOLE_PROMPT` tokens
        goes in one pass whatever the budget. No tail chunk under :data:`CHUNK_MIN` tokens runs after another
        pass of the round. A prompt whose prefill completes joins the batch, its first token picked as a
        single-row generation picks it.

        Returns the rows that ended here: cancelled ones (``finish_reason`` ``"cancelled"``) and failed ones
        (:attr:`Row.error` set; the batch is as it was)."""
        if self.threads:
            return self._collect()
        ended = []
        for row in [row for row in self.joining if row.cancelled]:
            self._unqueue(row)
            row.finish_reason = "cancelled"
            ended.append(row)
        if not self.run.rows:
            self.credit = 0.0  # credit is earned by steps beside a prefill, from when they start
        spent = 0
        for row in sorted(self.joining, key=_remaining):
            remaining = _remaining(row)
            busy = bool(self.run.rows)
            budget = self.busy_budget() if busy else self.lone_budget()
            whole = _whole(row, budget)
            n = remaining if whole else min(remaining, budget - spent)
            if n <= 0 or (spent and n < min(remaining, CHUNK_MIN)):
                continue  # a whole prompt later in the order still goes
            try:
                joined = self.run.prefill_chunk(row, n)
            except Exception as err:  # the joining row's own failure: the batch goes on
                self._unqueue(row)
                row._fail(err)
                ended.append(row)
                continue
            seconds = self.run.last_pass_seconds
            if seconds > 0:
                self.rate = n / seconds
            if joined:
                self.joining.remove(row)
            spent += n
            if busy and not whole:
                self.credit -= seconds  # what the chunk took, overrun included
        return ended

    def step(self) -> list[Row]:
        """:meth:`BatchRun.step`; a decoding pass beside a prompt being prefilled earns :data:`BUSY_STEP_SHARE` of
        its time as credit (:meth:`busy_budget`)."""
        passes = self.run.stats.target_passes
        ended = self.run.step()
        if self.run.stats.target_passes != passes:  # a decoding pass ran (none when every row ended)
            self.credit = min(self.credit + BUSY_STEP_SHARE * self.run.last_pass_seconds, BUSY_CHUNK_S) \
                if self.joining else 0.0
        return ended

    def cut(self) -> list[Row]:
        """End every row, running or being prefilled, and return them (the server is shutting down): what the
        running rows generated joins the rolling cache (:meth:`BatchRun.cut`)."""
        self.stop_worker()
        with self._lock:
            joining, self.joining, self._finished = self.joining, [], []
        for row in joining:
            row.prefill_cache = None
        return self.run.cut() + joining

    def stop_worker(self, timeout: float = 30.0) -> None:
        """Stop the prefill worker, after the pass it is running (a row it holds stays in :attr:`joining`); the
        next :meth:`enqueue` starts a new one."""
        with self._lock:
            worker, self._worker = self._worker, None
            self._generation += 1
            self._lock.notify_all()
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)
            if worker.is_alive():
                _log.warning("the prefill worker did not stop within %.0f s (a long pass?)", timeout)

    def _unqueue(self, row: Row) -> None:
        with self._lock:
            self.joining.remove(row)
        row.prefill_cache = None

    # ------------------------------------------------------------------ the worker (threads > 0)

    def _collect(self) -> list[Row]:
        """The engine's side of the worker: add each row it prefilled to the batch, and end those it failed or
        found cancelled (returned, as :meth:`prefill_pending` returns them)."""
        with self._lock:
            finished, self._finished = self._finished, []
            for row in finished:
                self.joining.remove(row)
        ended = []
        for row in finished:
            logits, row.prefill_logits = row.prefill_logits, None
            if row.error is None and not row.cancelled:
                try:
                    self.run.join_prefilled(row, logits)
                    continue
                except Exception as err:  # the joining row's own failure: the batch is as it was
                    row._fail(err)
            elif row.error is None:
                row.finish_reason = "cancelled"
            row.prefill_cache = None
            ended.append(row)
        return ended

    def _start_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, args=(self._generation,), name="lookupdec-prefill",
                                            daemon=True)
            self._worker.start()

    def _next(self, generation: int) -> tuple[Row, int] | None:
        """(row, tokens) for the worker's next pass, the shortest remaining prompt first; None once this worker
        was stopped. A cancelled row is finished unprefilled on the way. Waits, under the lock, while there is
        nothing to do."""
        while True:
            if generation != self._generation:
                return None
            pending = self._held()
            for row in [row for row in pending if row.cancelled]:
                self._finish(row)
            pending = [row for row in pending if not row.cancelled]
            if pending:
                row = min(pending, key=_remaining)
                budget = self.lone_budget()
                return row, _remaining(row) if _whole(row, budget) else min(_remaining(row), budget)
            self._lock.wait()

    def _held(self) -> list[Row]:
        """The rows waiting to join that the worker has not finished (under the lock)."""
        finished = set(map(id, self._finished))
        return [row for row in self.joining if id(row) not in finished]

    def _finish(self, row: Row) -> None:
        self._finished.append(row)
        self.wake()

    def _work(self, generation: int) -> None:
        """The worker's thread: prefill passes on the rows' own caches (:meth:`BatchRun.prefill_pass`), beside the
        engine's steps, until stopped. Should it die of anything but a row's own failure, the rows it holds fail
        (the engine answers them; the next :meth:`enqueue` starts a new worker)."""
        try:
            self._prefill_passes(generation)
        except BaseException as err:
            _log.error("the prefill worker failed; ending the requests it was prefilling", exc_info=err)
            with self._lock:
                if generation == self._generation:
                    self._worker = None
                    for row in self._held():
                        row._fail(err)
                        self._finish(row)

    def _prefill_passes(self, generation: int) -> None:
        torch.set_num_threads(self.threads)  # this thread's own (OpenMP's count is per thread)
        with torch.inference_mode():
            while True:
                with self._lock:
                    job = self._next(generation)
                    if job is None:
                        return
                    row, n = job
                try:
                    logits, err = self.run.prefill_pass(row, n), None
                except Exception as failure:  # this row's own failure: the others go on
                    logits, err = None, failure
                with self._lock:
                    if row not in self.joining:  # cut meanwhile (the server is shutting down)
                        continue
                    if err is not None:
                        row._fail(err)
                    elif row.pass_seconds > 0:
                        self.rate = n / row.pass_seconds
                    if err is not None or logits is not None or row.cancelled:
                        row.prefill_logits = logits
                        self._finish(row)
