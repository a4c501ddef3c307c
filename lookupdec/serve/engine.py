"""The server's engine: one thread owns the model and one :class:`~lookupdec.batch.BatchRun`; requests join it
between steps (up to ``max_batch`` rows, the rest wait in a bounded queue) and leave when done or cancelled.

A request's output is what it would be alone: greedy rows are token-identical to plain greedy decoding, and a
sampled row draws its token at output position ``t`` at a uniform fixed by ``(seed, t)``
(:func:`lookupdec.verify.verify_keyed`), so a seed gives one output whatever else runs.

The web layer talks to a request through its :class:`Ticket`: the engine thread puts events on the ticket's
asyncio queue (thread-safely), and the web layer sets ``cancelled`` (a stop string was reached, or the client left).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import secrets
import threading
import time
from collections import deque

import numpy as np
import torch

from .._transformers import resolve_generation
from ..batch import BatchRun, Row
from ..calibration import calibrate_or_warn
from ..drafter import Drafter, NoDrafts
from ..verify import verify_greedy, verify_keyed
from .protocol import APIError, Request

_log = logging.getLogger(__name__)


# Seconds between two returns of freed heap memory to the system, checked after each decoding step. A trim cost
# about 10 ms on the 2-core benchmark machine (1% of a second); every 16 finished requests instead (20-30 s apart
# under load) left 250-500 MiB of freed memory resident between trims, and more as the heap fragmented.
_TRIM_PERIOD_S = 1.0


class QueueFull(Exception):
    pass


def _trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``). Every decoding step reallocates
    each layer's keys and values one step longer (the cache grows by concatenation), in the engine thread's glibc
    arena: freed blocks of ever-different sizes fragment it, so glibc keeps more and more free memory there (its free
    space grew from 240 to 490 MiB over a 10-minute soak while the memory in use stayed at 320 MiB), and without
    trims the server's resident size crept up. Elsewhere (no glibc) nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Ticket:
    """One request on its way through the engine. Events on :attr:`events`: ``("tokens", [ids])`` as they are
    committed, then ``("done", summary)`` or ``("error", APIError)``."""

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
        self.row: Row | None = None
        self.submitted = time.perf_counter()

    def cancel(self) -> None:
        """End this request at the engine's next step (its row leaves the batch); safe from any thread."""
        self.cancelled = True
        row = self.row
        if row is not None:
            row.cancelled = True

    def _emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Engine:
    """Runs every request on one batched loop in a thread of its own (:meth:`start`, :meth:`stop`)."""

    def __init__(self, model, tokenizer, drafter: Drafter, *, max_batch: int = 8, max_queue: int = 64):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"need max_batch >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.max_batch, self.max_queue = max_batch, max_queue
        text = model.config.get_text_config()
        self.context = int(getattr(text, "max_position_embeddings", None) or 1 << 20)
        self._waiting: deque[Ticket] = deque()
        self._cond = threading.Condition()
        self._accepting = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._joining = 0  # tickets taken from the queue and being prefilled
        self.run = BatchRun(model, drafter)
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
        # ran every pass several times slower on the benchmark machine (4.4 s against 17 s for one request).
        with torch.inference_mode():
            self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.run.device))
        self._accepting, self._stop = True, False
        self._thread = threading.Thread(target=self._loop, name="lookupdec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting; let the running and waiting requests finish for up to ``timeout`` seconds, then cancel
        what is left."""
        with self._cond:
            self._accepting = False
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._cond:
            self._stop = True
            for ticket in list(self._waiting) + [row.owner for row in self.run.rows]:
                ticket.cancel()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or bool(self._joining) or bool(self.run.rows)

    @property
    def load(self) -> tuple:
        """(running rows, waiting requests)."""
        return len(self.run.rows), len(self._waiting)

    # ------------------------------------------------------------------ requests

    def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket``; :class:`QueueFull` when ``max_queue`` requests already wait, ``RuntimeError`` when
        the engine is stopping."""
        with self._cond:
            if not self._accepting:
                raise RuntimeError("the server is shutting down")
            if len(self._waiting) >= self.max_queue + max(0, self.max_batch - len(self.run.rows)):
                raise QueueFull
            self._waiting.append(ticket)
            self._cond.notify()

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._waiting and not self.run.rows and not self._stop:
                        self._cond.wait()
                    if self._stop and not self.run.rows and not self._waiting:
                        return
                    joining = []
                    while self._waiting and len(self.run.rows) + len(joining) < self.max_batch:
                        joining.append(self._waiting.popleft())
                    self._joining = len(joining)
                for ticket in joining:
                    self._join(ticket)
                self._joining = 0
                if self.run.rows:
                    self._step()
                    # Often enough that little freed memory stays resident, and once more as the batch empties so
                    # that an idle server holds no more than it needs.
                    if not self.run.rows or time.monotonic() - self._trimmed >= _TRIM_PERIOD_S:
                        _trim_heap()
                        self._trimmed = time.monotonic()

    def _join(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            ticket._emit("done", {"finish_reason": "cancelled"})
            return
        try:
            row = self._row(ticket)
            ticket.row = row
            self.run.join(row)
        except Exception as err:  # noqa: BLE001 - this request fails, the others go on
            _log.exception("request failed to start")
            ticket.row = None
            ticket._emit("error", APIError(500, f"the request could not be started: {type(err).__name__}",
                                           type="server_error", code="internal_error"))

    def _step(self) -> None:
        try:
            finished = self.run.step()
        except Exception as err:  # noqa: BLE001 - a fault in the batch: fail its requests, keep serving
            _log.exception("a decoding step failed; ending the requests in the batch")
            rows, self.run = self.run.rows, BatchRun(self.model, self.drafter)
            for row in rows:
                row.owner._emit("error", APIError(500, f"generation failed: {type(err).__name__}",
                                                  type="server_error", code="internal_error"))
            return
        for row in finished:
            self.completed += 1
            session = row.session
            row.owner._emit("done", {
                "finish_reason": row.finish_reason,
                "completion_tokens": row.generated,
                "accepted_prediction_tokens": getattr(session, "prediction_accepted", 0),
                "rejected_prediction_tokens": getattr(session, "prediction_rejected", 0),
                "passes": row.stats.target_passes,
                "drafted_tokens": row.stats.drafted_tokens,
                "accepted_tokens": row.stats.accepted_tokens,
            })

    def _row(self, ticket: Ticket) -> Row:
        req = ticket.req
        prompt = torch.tensor([ticket.prompt_ids], dtype=torch.long, device=self.run.device)
        overrides = {"do_sample": False} if req.greedy else \
            {"do_sample": True, "temperature": req.temperature, "top_p": req.top_p, "top_k": 0}
        resolved = resolve_generation(self.model, prompt, max_new_tokens=ticket.max_tokens, generation_config=None,
                                      logits_processor=None, stopping_criteria=None, **overrides)
        if req.lookup:
            session = self.drafter.start(np.asarray(ticket.prompt_ids, dtype=np.int32), eos_ids=resolved.eos_ids,
                                         prediction=ticket.prediction_ids)
        else:
            session = NoDrafts()
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
        row.cancelled = ticket.cancelled
        return row
