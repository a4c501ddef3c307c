"""The server's engine: one thread owns the model and one :class:`~lookupdec.batch.BatchRun`; requests join it
between steps (up to ``max_batch`` rows, the rest wait in a bounded queue) and leave when done or cancelled.

A request's output is what it would be alone: greedy rows are token-identical to plain greedy decoding, and a
sampled row draws its token at output position ``t`` at a uniform fixed by ``(seed, t)``
(:func:`lookupdec.verify.verify_keyed`), so a seed gives one output whatever else runs.

Each turn of the engine's loop takes waiting requests into the prefill queue, runs one round of prefill work (a
long prompt is prefilled in chunks paid for by the decoding steps, a quarter of their time, so it slows the running
requests by about a quarter: :class:`~lookupdec.serve.scheduler.PrefillScheduler`), then one decoding step. On a
CPU with cores the steps leave free, a worker thread prefills beside the steps instead, and a turn adds the rows it
has finished (``prefill_threads``).
A failure that belongs to one request (its prefill, its verification, its drafting, its callback) ends that
request with a 500 and the others go on; only a failed forward pass of the whole batch ends every running request.

The web layer talks to a request through its :class:`Ticket`: the engine thread puts events on the ticket's
asyncio queue (thread-safely), and the web layer calls :meth:`Ticket.cancel` (a stop string was reached, or the
client left) and, once it is done with the request, :meth:`Ticket.release` with how many tokens the client was
sent. Only those join the rolling cache: a cancelled row's session learns the count it was cancelled with, and a
row that ended by itself keeps its session open until the release, since the web layer learns what the client got
(a stop string in the last tokens, a client that left before the last text reached it) after the row has ended.
At shutdown (:meth:`Engine.stop`) what is still running after the drain time is answered with a 503
``server_shutting_down`` error, never with an answer that looks finished; what such a row generated joins the
rolling cache (saved at exit).

A fault the loop cannot contain (one raised while it recovers from a failed turn, or a ``BaseException``) ends
the engine's thread: the engine then says so (:attr:`Engine.failure`), refuses new requests
(:class:`EngineFailed`), and answers every request it held, waiting or running, with a 503 ``engine_failed``,
so that no request waits for a thread that is gone and ``/health`` can tell a process manager to restart it.

Models with sliding-window attention layers (Gemma 3) are served one request at a time: a batch's cache has masked
holes, which a window that counts slots cannot skip.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import secrets
import threading
import time
import weakref
from collections import deque

import numpy as np
import torch

from .._transformers import resolve_generation
from ..batch import BatchRun, Row
from ..cache import CACHE_SCOPES
from ..calibration import calibrate_or_warn
from ..drafter import Drafter, NoDrafts
from ..verify import verify_greedy, verify_keyed
from .protocol import APIError, Request
from .scheduler import PrefillScheduler, default_prefill_threads, no_prefill_worker

_log = logging.getLogger(__name__)


# Seconds between two returns of freed heap memory to the system, checked after each decoding step: often enough
# that little freed memory stays resident, rarely enough that the trims cost about 1% of the time (docs/design.md,
# "The server").
_TRIM_PERIOD_S = 1.0
_JOIN_TIMEOUT_S = 10.0  # how long stop() waits for the engine thread once it has been told to cut


class QueueFull(Exception):
    pass


class EngineFailed(RuntimeError):
    """The engine's thread has died (:attr:`Engine.failure`): it takes no request any more."""


def _trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``). Prefill caches of ever-different
    sizes, freed in the engine thread's glibc arena, fragment it, so glibc keeps more and more free memory there,
    and without trims the server's resident size creeps up (docs/design.md, "The server"). Elsewhere (no glibc)
    nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def shutdown_error() -> APIError:
    """What a request still running when the server stops is answered with."""
    return APIError(503, "the server shut down before this request finished", type="server_error",
                    code="server_shutting_down")


def _failure(err: BaseException) -> APIError:
    return APIError(500, f"generation failed: {type(err).__name__}", type="server_error", code="internal_error")


def engine_failed_error(err: BaseException) -> APIError:
    """What a request gets once the engine's thread has died (held, or sent after)."""
    return APIError(503, f"the server's decoding engine stopped after an internal error ({type(err).__name__}); "
                    "the server must be restarted", type="server_error", code="engine_failed")


class Ticket:
    """One request on its way through the engine. Events on :attr:`events`: ``("tokens", [ids])`` as they are
    committed, then ``("done", summary)`` (``summary["finish_reason"]``: ``"stop"``, ``"length"``, or
    ``"cancelled"`` after :meth:`cancel`) or ``("error", APIError)``."""

    def __init__(self, req: Request, prompt_ids: list, prediction_ids: list | None, max_tokens: int,
                 loop: asyncio.AbstractEventLoop):
        self.req = req
        self.prompt_ids = prompt_ids
        self.prediction_ids = prediction_ids
        self.max_tokens = max_tokens
        self.seed = req.seed if req.seed is not None else secrets.randbits(63)
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.ended = False  # a last event ("done" or "error") was sent
        self.used: int | None = None  # cancel(used=n): the client was sent the first n generated tokens only
        self.row: Row | None = None
        self.submitted = time.perf_counter()
        self._lock = threading.Lock()
        self.released = False
        self._settle = None  # finishes the session of a row that ended by itself, at the release

    def cancel(self, used: int | None = None) -> None:
        """End this request at the engine's next step (its row leaves the batch); safe and cheap from any thread,
        the event loop's included. After the end it ends nothing, but still says how much of the output the
        client got: ``used``, only the first ``used`` generated tokens (a stop string ended the answer, or the
        client left), so only they join the rolling cache; several calls keep the smallest."""
        # Order matters (see Engine._admit): the count, then the flag, then the row is read.
        if used is not None:
            self.used = used if self.used is None else min(self.used, used)
        self.cancelled = True
        row = self.row
        if row is not None:
            row.cancel(self.used)

    def release(self, used: int | None = None) -> None:
        """The web layer is done with this request, whose client was sent its first ``used`` generated tokens
        (None: all of them): :meth:`cancel`, and a row that ended by itself has its session finished here, in the
        calling thread (the rolling cache learns the tokens the client was sent), so call it off the event loop.
        Later calls do nothing more."""
        self.cancel(used)
        with self._lock:
            self.released = True
            settle, self._settle = self._settle, None
        if settle is not None:
            settle()

    def _hold(self, settle) -> None:
        """The row ended by itself: ``settle()`` finishes its session, at the :meth:`release` (now, on the
        engine's thread, if it came already)."""
        with self._lock:
            if not self.released:
                self._settle = settle
                return
        settle()

    def _emit(self, *event) -> None:
        if event[0] != "tokens":
            self.ended = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Engine:
    """Runs every request on one batched loop in a thread of its own (:meth:`start`, :meth:`stop`)."""

    def __init__(self, model, tokenizer, drafter: Drafter, *, max_batch: int = 8, max_queue: int = 64,
                 cache_scope: str = "user", prefill_threads: int | None = None):
        """``prefill_threads``: the torch threads of a worker that prefills prompts beside the decoding steps; 0:
        between the steps, on the engine's thread; None: on a CPU, the cores the steps leave free, up to as many
        as they use (:func:`~lookupdec.serve.scheduler.default_prefill_threads`)."""
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"need max_batch >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        if cache_scope not in CACHE_SCOPES:
            raise ValueError(f"cache_scope must be one of {', '.join(CACHE_SCOPES)}, got {cache_scope!r}")
        # Whose earlier answers a request drafts from: its client's (OpenAI's `user`; requests without one share),
        # everyone's, or nobody's (docs/vllm.md, "Whose earlier answers a request drafts from").
        self.cache_scope = cache_scope
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.run = BatchRun(model, drafter)
        self._cond = threading.Condition()
        threads = default_prefill_threads(self.run) if prefill_threads is None else prefill_threads
        why = no_prefill_worker(self.run)
        if threads and why:
            _log.warning("prompts are prefilled between the steps (prefill threads 0 instead of %d): %s", threads, why)
            threads = 0
        self.scheduler = PrefillScheduler(self.run, threads, wake=self._wake)
        if self.run.one_at_a_time and max_batch > 1:
            _log.warning("%s has sliding-window attention layers, which a batch's cache cannot hold (a window "
                         "counts cache slots, and a batch leaves masked holes between a row's slots): serving one "
                         "request at a time (max_batch 1 instead of %d)", type(model).__name__, max_batch)
            max_batch = 1
        self.max_batch, self.max_queue = max_batch, max_queue
        text = model.config.get_text_config()
        self.context = int(getattr(text, "max_position_embeddings", None) or 1 << 20)
        self._waiting: deque[Ticket] = deque()
        self._accepting = False
        self._stop = False
        self._thread: threading.Thread | None = None
        # Every ticket submitted and not yet collected: the ones a dying thread must still answer, wherever they
        # were (waiting, admitted, prefilling, running, ended but not yet reported).
        self._tickets: weakref.WeakSet[Ticket] = weakref.WeakSet()
        self.failure: BaseException | None = None  # what ended the engine's thread, if anything did
        self._admitting = 0  # tickets taken from the queue and not yet in the batch's prefill queue
        self.completed = 0
        self._trimmed = time.monotonic()  # when _trim_heap last ran

    # ------------------------------------------------------------------ life cycle

    def calibrate(self, on_measure=None) -> None:
        """Measure the pass cost for one row and for every batch bucket up to ``max_batch`` (once per machine:
        cached on disk), so that no request waits for a measurement."""
        rows = 1
        while True:
            calibrate_or_warn(self.drafter, self.model, on_measure, rows=rows)
            if rows >= self.max_batch:
                break
            rows = min(rows * 2, self.drafter.batch_rows(self.max_batch))

    def start(self) -> None:
        # One pass from this thread first: torch's CPU thread pool, first used from the engine's thread instead,
        # runs every pass several times slower (docs/design.md, "The server").
        with torch.inference_mode():
            self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.run.device))
        self._accepting, self._stop = True, False
        self._thread = threading.Thread(target=self._run, name="lookupdec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting; let the running and waiting requests finish for up to ``timeout`` seconds, then cut
        what is left: each such request gets a 503 ``server_shutting_down`` error (a request its client cancelled
        still ends as cancelled). Safe to call more than once."""
        with self._cond:
            self._accepting = False
            self._cond.notify_all()
        thread = self._thread
        deadline = time.monotonic() + timeout
        while self.busy and thread is not None and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if thread is not None and thread.is_alive():
            thread.join(timeout=_JOIN_TIMEOUT_S)
            if thread.is_alive():
                _log.warning("the engine thread did not stop within %.0f s (a long pass?); its requests are "
                             "answered when it does", _JOIN_TIMEOUT_S)
                return
        if self.failure is not None:  # the dying thread answered every request it held
            return
        self._cut()  # no engine thread (never started, or gone): nothing else touches the batch now

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or bool(self._admitting) or bool(self.run.rows) or bool(self.scheduler.joining)

    @property
    def load(self) -> tuple:
        """(running rows, counting those being prefilled; waiting requests); none once the engine's thread has
        died (every request it held was answered)."""
        if self.failure is not None:
            return 0, 0
        return len(self.run.rows) + len(self.scheduler.joining), len(self._waiting)

    # ------------------------------------------------------------------ requests

    def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket``; :class:`QueueFull` when ``max_queue`` requests already wait, :class:`EngineFailed`
        when the engine's thread has died, ``RuntimeError`` when the engine is stopping."""
        with self._cond:
            if self.failure is not None:
                raise EngineFailed(engine_failed_error(self.failure).message)
            if not self._accepting:
                raise RuntimeError("the server is shutting down")
            room = max(0, self.max_batch - len(self.run.rows) - len(self.scheduler.joining))
            if len(self._waiting) >= self.max_queue + room:
                raise QueueFull
            self._waiting.append(ticket)
            self._tickets.add(ticket)
            self._cond.notify()

    def _run(self) -> None:
        """The engine's thread: :meth:`_loop`, and if anything escapes it, :meth:`_die`."""
        try:
            self._loop()
        except BaseException as err:  # whatever ends the thread, its requests must hear of it
            self._die(err)

    def _die(self, err: BaseException) -> None:
        """The loop has ended by a fault: take no more requests, and answer every one still held with a 503.
        The batch's state is unknown, so nothing more runs on it; its rows are dropped."""
        _log.critical("the engine's thread died: the server answers 503 from now on and must be restarted",
                      exc_info=err)
        try:
            self.scheduler.stop_worker()
        except BaseException:  # the requests must still be answered
            pass
        with self._cond:
            self.failure = err
            self._accepting = False
            self._waiting.clear()
            tickets = list(self._tickets)
        self._admitting = 0
        error = engine_failed_error(err)
        for ticket in tickets:
            if not ticket.ended:
                ticket._emit("error", error)

    def _wake(self) -> None:
        """The prefill worker has finished a row: a loop waiting for work collects it."""
        with self._cond:
            self._cond.notify_all()

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._waiting or self.run.rows or self.scheduler.ready or self._stop):
                        self._cond.wait()
                    if self._stop:
                        self._cut()
                        return
                    admitted = []
                    while self._waiting and \
                            len(self.run.rows) + len(self.scheduler.joining) + len(admitted) < self.max_batch:
                        admitted.append(self._waiting.popleft())
                    self._admitting = len(admitted)
                try:
                    self._turn(admitted)
                except Exception as err:  # a fault outside any one request: end them, keep serving
                    _log.error("the engine's loop failed; ending the requests in the batch")
                    self._admitting = 0
                    rows = self.run.abandon() + self.scheduler.cut()
                    for row in rows:
                        row._fail(err)
                    self._report(rows)

    def _turn(self, admitted: list[Ticket]) -> None:
        """One turn: the admitted tickets queue for prefill, one round of prefill, one decoding step."""
        for ticket in admitted:
            self._admit(ticket)
            self._admitting -= 1
        ended = self.scheduler.prefill_pending()
        if self.run.rows:
            ended += self._step()
        self._report(ended)
        # Often enough that little freed memory stays resident, and once more as the batch empties so that an idle
        # server holds no more than it needs.
        if ended and not self.run.rows or time.monotonic() - self._trimmed >= _TRIM_PERIOD_S:
            _trim_heap()
            self._trimmed = time.monotonic()

    def _admit(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            ticket._emit("done", {"finish_reason": "cancelled", "completion_tokens": 0})
            return
        try:
            row = self._row(ticket)
            # The row is published first and the ticket's flag read after: a cancel that came before this
            # assignment set the flag (read here), one that comes after finds the row (Ticket.cancel).
            ticket.row = row
            if ticket.cancelled:
                row.cancel(ticket.used)
            self.scheduler.enqueue(row)
        except Exception as err:  # this request fails, the others go on
            _log.exception("request failed to start")
            ticket.row = None
            ticket._emit("error", APIError(500, f"the request could not be started: {type(err).__name__}",
                                           type="server_error", code="internal_error"))

    def _step(self) -> list[Row]:
        try:
            return self.scheduler.step()
        except Exception as err:  # a fault in the batch: fail its requests, keep serving
            _log.error("a decoding step failed; ending the requests in the batch")
            rows = self.run.abandon()
            for row in rows:
                row._fail(err)
            return rows

    def _report(self, rows: list[Row]) -> None:
        """Tell the owners of the rows that ended how they did."""
        logged = set()
        for row in rows:
            ticket = row.owner
            if row.error is not None:
                if id(row.error) not in logged:  # a failed batch pass ends every row with one error: logged once
                    logged.add(id(row.error))
                    _log.error("a request failed: %s", type(row.error).__name__, exc_info=row.error)
                ticket._emit("error", _failure(row.error))
                continue
            self.completed += 1
            if row.held:
                ticket._hold(functools.partial(self._finish, row, ticket))
            ticket._emit("done", self._summary(row))

    @staticmethod
    def _finish(row: Row, ticket: Ticket) -> None:
        """Finish a held row's session, its output cut to what the ticket says the client was sent. Any thread:
        the row is out of the batch, and the rolling cache takes adds from several threads."""
        try:
            row.limit_used(ticket.used)
            row.finish_session()
        except Exception:  # the rolling cache misses this output; serving goes on
            _log.exception("could not add a finished request to the rolling cache")

    @staticmethod
    def _summary(row: Row) -> dict:
        session = row.session
        return {
            "finish_reason": row.finish_reason,
            "completion_tokens": row.generated,
            "accepted_prediction_tokens": getattr(session, "prediction_accepted", 0),
            "rejected_prediction_tokens": getattr(session, "prediction_rejected", 0),
            "passes": row.stats.target_passes,
            "drafted_tokens": row.stats.drafted_tokens,
            "accepted_tokens": row.stats.accepted_tokens,
            # Passes that verified a draft of at least one token (vLLM's "drafts"): drafts that had a token at
            # position 0.
            "drafts": row.stats.drafted_per_position[0] if row.stats.drafted_per_position else 0,
            "cache_drafted_tokens": getattr(session, "cache_drafted", 0),
            # Where its time went beyond plain decoding of it: other requests' prefills run once its own prompt was
            # in, and what the drafts of its passes (its own and its neighbours') cost it net, in plain steps.
            "others_prefill_seconds": float(row.others_prefill_seconds),
            "draft_excess_steps": float(getattr(getattr(session, "ledger", None), "excess", 0.0)),
        }

    def _cut(self) -> None:
        """End everything still waiting, being prefilled or running: a 503 each (the server is shutting down),
        or ``"cancelled"`` for a request its client had cancelled already."""
        with self._cond:
            tickets = list(self._waiting)
            self._waiting.clear()
        rows = self.scheduler.cut()
        for ticket in tickets + [row.owner for row in rows]:
            if ticket is None:
                continue
            if ticket.cancelled:
                row = ticket.row
                summary = {"finish_reason": "cancelled", "completion_tokens": 0} if row is None else \
                    {**self._summary(row), "finish_reason": "cancelled"}
                ticket._emit("done", summary)
            else:
                ticket._emit("error", shutdown_error())

    def _row(self, ticket: Ticket) -> Row:
        req = ticket.req
        prompt = torch.tensor([ticket.prompt_ids], dtype=torch.long, device=self.run.device)
        overrides = {"do_sample": False} if req.greedy else \
            {"do_sample": True, "temperature": req.temperature, "top_p": req.top_p, "top_k": 0}
        # stable_temperature: the API takes any temperature in (0, 2]; transformers' warper overflows near 0.
        resolved = resolve_generation(self.model, prompt, max_new_tokens=ticket.max_tokens, generation_config=None,
                                      logits_processor=None, stopping_criteria=None, stable_temperature=True,
                                      **overrides)
        if req.lookup:
            session = self.drafter.start(np.asarray(ticket.prompt_ids, dtype=np.int32), eos_ids=resolved.eos_ids,
                                         prediction=ticket.prediction_ids,
                                         client=req.user if self.cache_scope == "user" else None,
                                         use_cache=self.cache_scope != "off")
        else:
            session = NoDrafts(self.drafter.drafter_config.max_slowdown)
        if resolved.do_sample:
            seed = ticket.seed

            def pick(logits, draft, process, position):
                return verify_keyed(logits, draft, process, seed, position)
        else:
            def pick(logits, draft, process, position):
                return verify_greedy(logits, draft, process)

        def on_commit(tokens, done):
            if tokens:
                ticket._emit("tokens", list(tokens))

        row = Row(prompt, resolved, session, ticket.max_tokens, pick, on_commit=on_commit, owner=ticket)
        # The web layer learns what the client got after the row committed it (a stop string in the last tokens, a
        # client that left before the last text reached it): a row that ends by itself keeps its session open for
        # the web layer's verdict (Ticket.release), so that only tokens the client was sent join the rolling cache.
        row.hold_session = True
        return row
