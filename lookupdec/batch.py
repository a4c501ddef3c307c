"""A running batch: rows of a lookup decoding that share one target pass per step.

Each step is draft -> one target forward -> verify -> commit, cropping the KV cache on rejection. Invariant
between steps: the KV cache holds every committed token of a row except its last one, ``last``. A step feeds
``[last, x_0 .. x_{d-1}]`` (``d + 1`` tokens) per row and gets ``d + 1`` rows of logits back: row ``pos`` predicts
the token after draft position ``pos - 1``. The verifier keeps ``accepted`` drafted tokens and adds one target
token; the cache drops the ``d - accepted`` rejected positions, and that target token becomes the new ``last``.
Drafting goes through the drafter's propose/commit driver (``Drafter.propose``, ``DraftSession.commit``),
verification through ``verify.py``.

Model-agnostic: it needs a transformers causal LM whose cache can be cropped (``DynamicCache``), and nothing
about its architecture. Sliding-window layers keep their past while a draft is pending (transformers'
``activate_past_recording``), so cropping restores them too. On a ``StaticCache`` (``cache_implementation=
"static"``) a pass writes in place and cropping moves the write position back: the rejected slots lie after every
later query's position, so they are masked until the next pass overwrites them.

Rows are ragged: ``input_ids`` [B, L], left-padded, with ``attention_mask``. The drafter's driver picks one draft
length for the batch (``Drafter.propose``: the pass is as wide as its longest draft, so every row may fill that
width) and shorter drafts are padded with masked filler. Rows accept different numbers of tokens, and
``DynamicCache`` appends the same number of slots to every row, so the cache keeps, per step, as many new slots
as the row that accepted most needs; the other rows' extra slots stay behind as *holes*, masked out in the 2-D
attention mask, and each row's ``position_ids`` count only its real tokens, so a row sees exactly the keys, at
exactly the positions, it would see alone::

    slot:        0  1  2  3  4  5  6  7
    row 0:       .  p  p  p  l  a  a  l'    . = left padding or a hole (masked out)
    row 1:       p  p  p  p  l  .  .  l'    p = prompt, a = accepted draft, l = a step's last token

    (step 1 fed [l, x0, x1, x2] at slots 4-7 for both rows; row 0 accepted 2 drafted tokens, row 1 none. Slots
    4-6 were kept, slot 7 was dropped, and row 1's slots 5-6 became holes; step 2 starts at slot 7.)

Holes are squeezed out (``_compact``: a gather that moves each row's tokens to the right end) once they outnumber
the real tokens, so memory stays proportional to the longest row. Finished rows (EOS, budget, stopping criteria)
leave the batch (``batch_select_indices``) and cost nothing more. Per row, outputs are token-identical to
single-sequence generation, and sampling uses the exact rule per row (one generator, drawn row after row:
independent draws). One row whose cache holds no hole or padding runs *unmasked*: its passes are a single-sequence
generation's (no mask, no positions).

:class:`BatchRun` holds a running batch: :func:`lookupdec.generate` (``loop.py``) prefills its rows together and
steps until all are done; ``lookupdec serve`` (``serve/scheduler.py``) lets requests join between steps and leave
when done or cancelled, each with its own settings (greedy, or sampling with its own seed):

- **Joining.** A request's prompt is prefilled alone, on a cache of its own, exactly as a single-row generation
  prefills it (in one pass, :meth:`BatchRun.join`, or in chunks, :meth:`BatchRun.prefill_chunk`); its first token
  is picked from the last pass, and its cache rows are appended to the batch's (the shorter side left-padded with
  masked slots). Chunking changes no output: a chunk's queries see the keys before it and its own causally, as in
  one pass (the tests compare greedy outputs with plain ``generate``, on tiny models and SmolLM2).
- **Failures are the row's own.** A join that fails leaves the batch as it was. An exception that belongs to one
  row (its verification or logits processors, its drafting session, its ``on_commit`` callback) ends that row
  (:attr:`Row.error`) and removes it from the batch; the others go on, unchanged. Only a failure of what the rows
  share (the forward pass, the cache) fails the batch.
- **Sliding-window models** (a window counts cache slots, and holes would shrink it) run one row at a time
  (:attr:`BatchRun.one_at_a_time`), on a cache that can roll back (:func:`~lookupdec._transformers.rollback_cache`),
  as a single-row generation runs them; :func:`lookupdec.generate` runs them only as a batch of one.

On a **static cache** (``cache_implementation="static"``: transformers' ``StaticCache``, preallocated, written in
place at one write position for all rows) the same bookkeeping holds: the holes stay where they are (they cost no
memory there) and are squeezed out in place only when the next pass might not fit; passes and masks have fixed
shapes (:data:`STATIC_WIDTHS`, all the cache's slots), for a compiled forward. Its rows start together: nothing joins
a running one.
"""


from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import torch

from ._device import host_buffer, input_device, synchronize
from ._transformers import (
    append_cache_rows,
    batch_cache,
    crop_cache,
    forward_params,
    gather_cache_slots,
    rollback_cache,
    select_cache_rows,
    stateless_passes,
    static_cache,
    target_forward,
)
from .drafter import EMPTY
from .policy import padded_width
from .stats import GenerationStats
from .verify import greedy_verdict

# Masked holes tolerated beyond the longest row's tokens before compacting: a quarter of them plus this many. Holes
# are not free: every pass still reads them (`python -m benchmarks.holes`, SmolLM2 on a 2-core CPU, 4 rows of 300
# tokens: a step over 664 slots took 1.11x, a 9-token pass 1.15x, one over 300), and a compaction costs about a
# third of a step, so they are squeezed out after some tens of drafted passes, not when they double the cache.
_COMPACT_SLACK = 16
_COMPACT_SHARE = 4  # holes beyond longest // _COMPACT_SHARE + _COMPACT_SLACK are compacted

# Pass widths on a static cache (draft + 1 tokens, padded up to the next of these): a compiled forward keeps a
# graph per width, and on a GPU a CUDA graph per width, so few widths and always the same; powers of two waste at
# most half a pass's tokens on filler. A draft longer than 63 tokens (max_draft up to 256) pads to 128 or 256.
STATIC_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def static_width(span: int, room: int) -> int:
    """The width of a pass of ``span`` tokens on a static cache with ``room`` free slots: the next of
    :data:`STATIC_WIDTHS`, or ``span`` itself where the padding would not fit (the last passes of a full cache)."""
    width = padded_width(span, STATIC_WIDTHS)
    return width if width <= room else span



class Row:
    """One request of a batch: its prompt, settings, drafting session, committed tokens and figures.

    ``pick(logits, draft, process, position) -> Verdict`` verifies its drafts (``position``: how many tokens it
    has generated before this pass). ``on_commit(tokens, done)``, when given, is told each pass's committed
    tokens (a list) and whether the row is done. :meth:`cancel` (or setting ``cancelled``) ends the row at the
    next step, or at once while its prompt is being prefilled.

    Once done, :attr:`finish_reason` says why: ``"stop"`` (EOS or a stopping criterion), ``"length"``,
    ``"cancelled"``, or ``"error"`` (then :attr:`error` holds the exception, and the row's session is left
    unfinished: nothing of a failed row joins the rolling cache). A done row finishes its session (its output
    joins the rolling cache, all of it or the first :attr:`used` tokens), except one that ended by itself while
    :attr:`hold_session` is set: its owner then calls :meth:`finish_session` once it knows how much of the output
    it used (the server: once the client was sent the answer, or left).
    """

    def __init__(self, prompt: torch.Tensor, resolved, session, max_new_tokens: int, pick: Callable, *,
                 index: int = 0, trace=None, on_commit: Callable | None = None, owner=None,
                 padding: torch.Tensor | None = None):
        self.index = index  # row in the caller's input_ids
        self.prompt = prompt  # [1, prompt_len] on the input device
        self.prompt_len = prompt.shape[1]
        self.resolved = resolved
        self.session = session
        self.max_new_tokens = max_new_tokens
        self.pick = pick
        self.trace = trace
        self.on_commit = on_commit
        self.owner = owner  # the caller's handle on this row (the server's request)
        self.cancelled = False
        self.used: int | None = None  # only the first ``used`` generated tokens reached the caller (None: all)
        self.hold_session = False
        self.held = False  # the row ended by itself with hold_session set: its session awaits finish_session()
        self.finish_reason = None
        self.error: BaseException | None = None
        # seq: [padding, prompt, generated tokens] (and, during a pass, the draft). The model never sees the
        # padding; the logits processors and stopping criteria read prefixes of seq, so they see what
        # model.generate's see in a left-padded batch (no_repeat_ngram_size counts pad tokens there; a
        # repetition penalty skips them, told by the mask the processors were built with).
        pad = 0 if padding is None else padding.shape[1]
        self.start = pad + self.prompt_len  # where the generated tokens begin in seq
        self.seq = torch.empty((1, self.start + max_new_tokens), dtype=torch.long, device=prompt.device)
        if pad:
            self.seq[:, :pad] = padding
        self.seq[:, pad: self.start] = prompt
        self.cur = self.start
        self.stats = GenerationStats()
        self.process = self._process if len(resolved.processors) else None
        self.plain_greedy = not resolved.do_sample and self.process is None
        self.step_tokens: list = []
        self.draft = EMPTY
        self.pass_seconds = 0.0
        # Prefill in chunks: the row's own cache and how many prompt tokens it holds, until the row joins.
        self.prefill_cache = None
        self.prefilled = 0
        self.prefill_seconds = 0.0
        self.prefill_passes = 0
        self.prefill_logits = None  # a prefill worker's last logits of the prompt, until the row joins
        # Seconds of other rows' prefills (their passes and their joining) run while this row was in the batch:
        # time it waited that plain decoding of it alone would not have (the server reports it per request).
        self.others_prefill_seconds = 0.0
        if trace is not None:
            trace.start(prompt[0].tolist())

    @property
    def generated(self) -> int:
        return self.cur - self.start

    @property
    def tokens(self) -> torch.Tensor:
        """The tokens generated so far [n]."""
        return self.seq[0, self.start: self.cur]

    def cancel(self, used: int | None = None) -> None:
        """End this row at the next step (safe from any thread). ``used``: only the first ``used`` generated
        tokens reached the caller (a stop string ended the answer there, or the client left), so only they join
        the rolling cache; several calls keep the smallest (:meth:`limit_used`)."""
        self.limit_used(used)
        self.cancelled = True

    def limit_used(self, used: int | None) -> None:
        """Only the first ``used`` generated tokens reached the caller (None: no limit); the smallest limit given
        holds."""
        if used is not None:
            self.used = used if self.used is None else min(self.used, used)

    def verdict(self, logits: torch.Tensor, draft: np.ndarray):
        return self.pick(logits, draft, self.process, self.generated)

    def _process(self, pos: int, row: torch.Tensor) -> torch.Tensor:
        return self.resolved.processors(self.seq[:, : self.cur + pos].to(row.device), row[None, :].float())[0]

    def _commit(self) -> bool:
        """Commit the last pass's tokens (the accepted ones are in ``seq`` already, the target's follows);
        ``True`` when the row is done."""
        cancelled = self.cancelled  # read once: another thread may set it meanwhile
        if cancelled:
            done, kept, self.finish_reason = True, 0, "cancelled"
        else:
            n_new = len(self.step_tokens)
            self.seq[0, self.cur + n_new - 1] = self.step_tokens[-1]
            done, kept = self.resolved.stop(self.step_tokens, self.seq, self.cur, self.max_new_tokens - self.generated)
        committed = self.step_tokens[:kept]
        self.cur += kept
        if done and self.finish_reason is None:
            self.finish_reason = "stop" if self._stopped(committed) else "length"
        self.stats.new_tokens += kept
        if self.trace is not None and not cancelled:
            self.trace.step(self.draft.tolist(), len(self.step_tokens) - 1, self.step_tokens[-1], kept,
                            self.pass_seconds)
        if self.on_commit is not None:
            self.on_commit(committed, done)
        # Only what was kept: not the tokens a pass produced after an EOS or past the budget (its time: the batch's).
        if committed:
            self.session.commit(np.asarray(committed, dtype=np.int32))
        if done:
            if cancelled or not self.hold_session:
                self.finish_session()
            else:
                self.held = True
        return done

    def finish_session(self) -> None:
        """End the session: its output joins the rolling cache, all of it or the first :attr:`used` tokens."""
        if self.used is not None and self.used < self.generated:
            self.session.finish(max(self.used, 0))
        else:
            self.session.finish()

    def _fail(self, err: BaseException) -> None:
        self.error, self.finish_reason = err, "error"

    def _stopped(self, committed: list) -> bool:
        """Whether the row's last committed token ended it by itself (EOS, a stopping criterion), not the budget."""
        if not committed:
            return False
        if committed[-1] in self.resolved.eos_ids:
            return True
        return self.resolved.criteria_hit(self.seq[:, : self.cur])


class BatchRun:
    """A running batch on one model and drafter: rows join (:meth:`prefill` for a starting set; :meth:`join` one
    at a time between steps, or :meth:`prefill_chunk` for a prompt prefilled in chunks), each :meth:`step` commits
    the last pass's tokens, lets finished rows go, and runs the next pass for the rest.

    :attr:`one_at_a_time`: the run holds one row at a time and refuses a second: the model has sliding-window
    layers (its cache is one that can roll back).

    ``static_slots``: the rows run on a preallocated cache of that many slots per row
    (:func:`~lookupdec._transformers.static_cache`, ``cache_implementation="static"``), each pass is padded to a
    width of :data:`STATIC_WIDTHS` (the filler after the draft is computed and thrown away) and its mask to the
    cache's slots, so that a compiled forward sees a few shapes, always the same ones, instead of a new one at every
    pass. Such a run takes its rows at the start (:meth:`prefill`, or one :meth:`join` into the empty run) and
    refuses later joins. Its holes are squeezed out only when the next pass might not fit (:meth:`step`), in place.
    """

    def __init__(self, model, drafter, *, static_slots: int | None = None):
        self.model, self.drafter = model, drafter
        self.device = input_device(model)  # drafts go where the model reads its input; logits are read where they are
        self.params = forward_params(model)
        if "position_ids" not in self.params:
            raise NotImplementedError(f"{type(model).__name__}.forward takes no position_ids; batches need them")
        self.static_slots = static_slots
        if static_slots is not None:
            static_cache(model, 1)  # refuses sliding-window models before anything runs
            self.one_at_a_time = False
        else:
            try:
                batch_cache(model)
                self.one_at_a_time = False
            except NotImplementedError:  # sliding-window layers
                self.one_at_a_time = True
        # Whether a prompt may be prefilled (prefill_pass) while a step runs: the model's passes share no state.
        self.stateless_passes = stateless_passes(model)
        self.rows: list[Row] = []  # running rows, in cache order
        self.stats = GenerationStats()  # passes and model time of the whole batch
        # Cache bookkeeping: ``kv_mask[i, slot]`` says whether a cache slot holds one of row i's tokens;
        # ``counts[i]`` how many do, which is also the position of its last committed token, the one not yet in
        # the cache. Both live on the host too (counts as numpy), so that sizing a step never waits for the device.
        self.cache = None
        self.kv_mask = None
        self.counts = np.zeros(0, dtype=np.int64)
        self._feed = host_buffer(0, self.device)
        self.last_pass_seconds = 0.0  # the forward time of the last pass (a step's, a prefill's or a chunk's)
        # One row whose cache holds no hole or padding: its passes run as a single-row generation's do, without a
        # mask or positions (which would make the model build a full attention mask every step).
        self._unmasked = False

    def __len__(self) -> int:
        return len(self.rows)

    def prefill(self, rows: list[Row], input_ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        """Start an empty batch with ``rows`` prefilled in one pass, as plain batched generate does it: their
        prompts are ``input_ids`` [B, L], left padding masked out by ``mask``, positions counted from each row's
        start."""
        if self.rows:
            raise RuntimeError("prefill starts an empty batch; use join() to add to a running one")
        if self.one_at_a_time:
            raise NotImplementedError("a sliding-window model runs one row at a time; use join()")
        static = self.static_slots is not None
        cache = static_cache(self.model, self.static_slots) if static else batch_cache(self.model)
        mask = mask.to(self.device)
        positions = mask.long().cumsum(-1) - 1
        positions.masked_fill_(~mask, 1)
        ids = input_ids.to(self.device)
        logits = self._forward(ids, 1, cache, self._pass_mask(mask), positions)  # [batch, 1, vocab]
        for row in rows:
            row.prefilled, row.prefill_seconds = row.prompt_len, self.last_pass_seconds
        self._first_tokens(rows, logits)
        self.cache, self.rows = cache, list(rows)
        self.kv_mask = mask
        self.counts = lengths.cpu().numpy().astype(np.int64)
        self._unmasked = False

    # ------------------------------------------------------------------ joining

    def join(self, row: Row) -> None:
        """Add ``row`` to the batch before the next step: its prompt is prefilled alone in one pass (the pass a
        single-row generation runs), and its cache slots are appended to the batch's, the shorter side
        left-padded with masked slots. All or nothing: when this raises, the batch is as it was."""
        self.check_room(row)
        try:
            self.prefill_chunk(row, row.prompt_len - row.prefilled)
        except BaseException:
            row.prefill_cache, row.prefilled, row.prefill_seconds, row.prefill_passes = None, 0, 0.0, 0
            raise

    def check_room(self, row: Row, waiting=()) -> None:
        """Raise unless ``row`` may join this run beside its running rows and the rows ``waiting`` to join."""
        if self.one_at_a_time and (self.rows or waiting):
            raise RuntimeError("this run holds one row at a time (a sliding-window model)")
        if self.static_slots is not None and (self.rows or waiting):
            raise RuntimeError("a run on a static cache takes its rows at the start; it cannot join a running one")
        if row in self.rows or row in waiting:
            raise ValueError("the row is in the batch already")

    def prefill_chunk(self, row: Row, n: int) -> bool:
        """Prefill the next ``n`` prompt tokens of ``row`` on its own cache; at the prompt's end, pick its first
        token and add it to the batch (``True``). The row's cache is made at its first chunk; a row that will not
        join after all drops it (``row.prefill_cache = None``)."""
        with self._holding():
            logits = self.prefill_pass(row, n)
            self.last_pass_seconds = row.pass_seconds
            self._count(row.pass_seconds, 1)
            if logits is None:
                return False
            self._first_tokens([row], logits)
            self._attach(row)
            return True

    def prefill_pass(self, row: Row, n: int) -> torch.Tensor | None:
        """Run the next ``n`` prompt tokens of ``row`` through the model on the row's own cache (made at its first
        chunk), and return the prompt's last logits once it is all in (else None); :attr:`Row.pass_seconds` is the
        pass's time. It reads the model and writes only the row, so the server's prefill worker runs it in a
        thread of its own beside the batch's steps; :meth:`join_prefilled` then adds the row to the batch."""
        if row.prefill_cache is None:
            if self.static_slots is not None:
                row.prefill_cache = static_cache(self.model, self.static_slots)
            else:
                row.prefill_cache = rollback_cache(self.model) if self.one_at_a_time else batch_cache(self.model)
        start = row.prefilled
        chunk = row.prompt[:, start: start + n].to(self.device)  # a caller's CPU prompt beside a GPU model
        logits, row.pass_seconds = self._timed_forward(chunk, 1, row.prefill_cache)  # [1, 1, vocab]
        row.prefilled += n
        row.prefill_seconds += row.pass_seconds
        row.prefill_passes += 1
        return logits if row.prefilled >= row.prompt_len else None

    def join_prefilled(self, row: Row, logits: torch.Tensor) -> None:
        """Add ``row``, whose whole prompt :meth:`prefill_pass` ran (``logits``: what its last pass returned), to
        the batch: its first token is picked and its cache appended. Its prefill passes count in :attr:`stats`
        now. All or nothing: when this raises, the batch is as it was."""
        with self._holding():
            self._first_tokens([row], logits)
            self._attach(row)
            self._count(row.prefill_seconds, row.prefill_passes)

    @contextmanager
    def _holding(self):
        """Charge the time of the block (a prefill pass, a join) to every row running now, as time other rows'
        prefills held it."""
        beside, t0 = list(self.rows), time.perf_counter()
        try:
            yield
        finally:
            waited = time.perf_counter() - t0
            for other in beside:
                other.others_prefill_seconds += waited

    def _attach(self, row: Row) -> None:
        """Append ``row``'s prefilled cache to the batch's. Everything that can fail runs before the batch
        changes (``append_cache_rows`` itself is all or nothing)."""
        cache = row.prefill_cache
        new_mask = torch.ones((1, row.prompt_len), dtype=torch.bool, device=self.device)
        if not self.rows:
            self.cache, self.kv_mask = cache, new_mask
            self.counts = np.array([row.prompt_len], dtype=np.int64)
            self._unmasked = True
        else:
            width = max(self.kv_mask.shape[1], row.prompt_len)
            kv_mask = torch.cat([_pad_left(self.kv_mask, width), _pad_left(new_mask, width)])
            counts = np.append(self.counts, row.prompt_len)
            append_cache_rows(self.cache, cache)
            self.kv_mask, self.counts, self._unmasked = kv_mask, counts, False
        self.rows.append(row)
        row.prefill_cache = None

    # ------------------------------------------------------------------ leaving

    def abandon(self) -> list[Row]:
        """Drop every running row (after a failed pass the batch's cache is in no known state) and return them."""
        rows = self.rows
        self._reset()
        return rows

    def cut(self) -> list[Row]:
        """End every running row and return them (the server is shutting down). What they generated joins the
        rolling cache, as a cancelled row's does."""
        running = self.rows
        self._reset()
        for row in running:
            try:
                row.finish_session()
            except Exception:  # the rolling cache misses this output; the shutdown goes on
                pass
        return running

    def _reset(self) -> None:
        self.rows, self.cache, self.kv_mask = [], None, None
        self.counts = np.zeros(0, dtype=np.int64)
        self._unmasked = False

    def _drop(self, gone: list[Row]) -> None:
        """Remove the rows ``gone`` from the batch and its cache."""
        if not gone:
            return
        staying = [i for i, row in enumerate(self.rows) if not any(row is other for other in gone)]
        if len(staying) == len(self.rows):
            return
        if not staying:
            self._reset()
            return
        select_cache_rows(self.cache, torch.tensor(staying, device=self.device))
        self.kv_mask, self.counts = self.kv_mask[staying], self.counts[staying]
        self.rows = [self.rows[i] for i in staying]

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[Row]:
        """Commit every row's last pass, drop the rows that are done (returned, with those that failed: their
        :attr:`Row.error` is set), and run the next pass for the rest. Raises only for a failure of what the rows
        share (the pass itself, the cache); the batch's state is then unknown (:meth:`abandon`)."""
        ended = []
        for row in self.rows:
            try:
                if row._commit():
                    ended.append(row)
            except Exception as err:  # this row's failure (its stop rule, callback, session)
                row._fail(err)
                ended.append(row)
        self._drop(ended)
        if not self.rows:
            return ended
        alone = len(self.rows) == 1
        longest, force = int(self.counts.max()), alone and not self._unmasked
        if self.static_slots is None:
            self.kv_mask = _compact(self.cache, self.kv_mask, longest, force=force)
        elif force or self.static_slots - self.kv_mask.shape[1] < max(row.max_new_tokens - row.generated
                                                                       for row in self.rows):
            # A static cache's holes cost no memory: they are squeezed out only when the next pass might not fit
            # (a row may draft up to its budget's end), and when one row is left, which then runs unmasked.
            self.kv_mask = _compact(self.cache, self.kv_mask, longest, force=True)
        self._unmasked = alone
        return ended + self._pass()

    def _propose(self) -> tuple:
        """``(drafts, failed)``: the running rows' drafts, after dropping the rows whose session failed to draft
        (``failed``). When the joint proposal raises, each session is tried alone to find whose fault it was."""
        # A pass feeds draft + 1 tokens: each row's budget bounds it, and on a static cache also the slots left.
        room = self.static_slots - self.kv_mask.shape[1] if self.static_slots is not None else None

        def limits(rows):
            budgets = [row.max_new_tokens - row.generated for row in rows]
            return [(n if room is None else min(n, room)) - 1 for n in budgets]

        widths = STATIC_WIDTHS if self.static_slots is not None else None  # priced as the padded pass
        try:
            return self.drafter.propose([row.session for row in self.rows], limits(self.rows), widths=widths), []
        except Exception:
            failed = []
            for row, limit in zip(self.rows, limits(self.rows)):
                try:
                    self.drafter.propose([row.session], [limit])
                except Exception as err:  # this row's session
                    row._fail(err)
                    failed.append(row)
            if not failed:
                raise
        self._drop(failed)
        if not self.rows:
            return [], failed
        return self.drafter.propose([row.session for row in self.rows], limits(self.rows), widths=widths), failed

    def _pass(self) -> list[Row]:
        t0 = time.perf_counter()
        drafts, failed = self._propose()
        self.stats.draft_seconds += time.perf_counter() - t0
        rows, drafter = self.rows, self.drafter
        if not rows:
            return failed
        span = max(len(draft) for draft in drafts) + 1  # tokens fed per row
        if self.static_slots is not None:
            span = static_width(span, self.static_slots - self.kv_mask.shape[1])
        # Built on the host ([last token, draft, filler] per row, the filler masked out), then one copy.
        if self._feed.numel() < len(rows) * span:
            self._feed = host_buffer(len(rows) * span * 2, self.device)
        host = self._feed[: len(rows) * span].view(len(rows), span)
        lens = np.array([len(draft) for draft in drafts])
        for i, (row, draft) in enumerate(zip(rows, drafts)):
            host[i, :] = row.step_tokens[-1]  # the last token, and the filler after the draft
            host[i, 1: len(draft) + 1] = torch.from_numpy(draft.astype(np.int64))
            row.draft = draft
        feed = host.to(self.device, non_blocking=True)  # [rows, span]
        feed_mask = torch.from_numpy(np.arange(span) <= lens[:, None]).to(self.device)  # [rows, span]
        for i, row in enumerate(rows):
            row.seq[0, row.cur: row.cur + lens[i]] = feed[i, 1: lens[i] + 1]
        if self._unmasked:
            logits = self._forward(feed, span, self.cache)
        else:
            positions = torch.from_numpy(self.counts[:, None] + np.arange(span)).to(self.device)
            mask = self._pass_mask(torch.cat([self.kv_mask, feed_mask], dim=1))
            logits = self._forward(feed, span, self.cache, mask, positions)
        drafter.observe(len(rows), span - 1, self.last_pass_seconds, [row.session for row in rows])

        accepted = np.zeros(len(rows), dtype=np.int64)
        bad = []
        for i, (row, verdict) in enumerate(zip(rows, _verify(logits, drafts, rows))):
            if isinstance(verdict, Exception):  # this row's verification (its pick, its processors)
                row._fail(verdict)
                bad.append(row)
                continue
            row.stats.record(len(row.draft), verdict.accepted)
            self._count_pass(row, self.last_pass_seconds)
            row.step_tokens = row.draft[: verdict.accepted].tolist() + [verdict.token]
            accepted[i] = verdict.accepted
        # Keep as many of the new slots as the row that accepted most needs; the other rows' extra slots in that
        # span stay in the cache as masked holes (compacted away once they pile up).
        new_slots = int(accepted.max()) + 1
        crop_cache(self.cache, span - new_slots)
        self.kv_mask = torch.cat([self.kv_mask, torch.from_numpy(np.arange(new_slots) <= accepted[:, None])
                                  .to(self.device)], dim=1)
        self.counts = self.counts + accepted + 1
        self._drop(bad)
        return failed + bad

    def _pass_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A pass's 2-D mask [rows, slots used]; on a static cache, extended over all its slots (the unused ones
        masked out), so a compiled forward sees one shape."""
        if self.static_slots is None:
            return mask
        return torch.cat([mask, mask.new_zeros((mask.shape[0], self.static_slots - mask.shape[1]))], dim=1)

    def _forward(self, ids, n_logits, cache, mask=None, positions=None) -> torch.Tensor:
        logits, self.last_pass_seconds = self._timed_forward(ids, n_logits, cache, mask, positions)
        self._count(self.last_pass_seconds, 1)
        return logits

    def _timed_forward(self, ids, n_logits, cache, mask=None, positions=None) -> tuple[torch.Tensor, float]:
        """One pass (:func:`target_forward`) and its seconds, the device caught up; it touches no state of the run."""
        t0 = time.perf_counter()
        logits = target_forward(self.model, ids, cache, n_logits, self.params, mask, positions)
        synchronize(logits.device)
        return logits, time.perf_counter() - t0

    def _count(self, seconds: float, passes: int) -> None:
        """Count passes and their model time in the batch's figures."""
        self.stats.model_seconds += seconds
        self.stats.target_passes += passes

    def _first_tokens(self, rows: list[Row], logits: torch.Tensor) -> None:
        """Each row's first token, from its prefill's last logits; raises the first row's failure."""
        verdicts = _verify(logits, [EMPTY] * len(rows), rows)
        for verdict in verdicts:
            if isinstance(verdict, Exception):
                raise verdict
        for row, verdict in zip(rows, verdicts):
            row.step_tokens = [verdict.token]
            row.draft = EMPTY
            self._count_pass(row, row.prefill_seconds)  # a prefill in chunks counts as one pass, of all its time

    @staticmethod
    def _count_pass(row: Row, seconds: float) -> None:
        row.stats.target_passes += 1
        row.stats.model_seconds += seconds
        row.pass_seconds = seconds


def _verify(logits: torch.Tensor, drafts, rows: list[Row]) -> list:
    """Each row's verdict on its draft, from ``logits`` [rows, span, vocab], or the exception its verification
    raised (that row's own failure). When every row is plain greedy (the common case), all are decided from one
    argmax over the whole batch and one transfer to the host."""
    if all(row.plain_greedy for row in rows):
        choices = logits.argmax(dim=-1).cpu().numpy()  # [rows, span]
        return [greedy_verdict(choices[i, : len(draft) + 1], draft) for i, draft in enumerate(drafts)]
    verdicts = []
    for i, (row, draft) in enumerate(zip(rows, drafts)):
        try:
            verdicts.append(row.verdict(logits[i, : len(draft) + 1], draft))
        except Exception as err:  # handed to the caller, which ends this row only
            verdicts.append(err)
    return verdicts


def _pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``mask`` [rows, w] with ``width - w`` masked slots in front."""
    return torch.cat([mask.new_zeros((mask.shape[0], width - mask.shape[1])), mask], dim=1)


def _compact(cache, kv_mask: torch.Tensor, longest: int, *, force: bool = False) -> torch.Tensor:
    """Squeeze the masked holes out of the cache once they take more than a quarter of the room the longest row's
    tokens do (:data:`_COMPACT_SHARE`, plus :data:`_COMPACT_SLACK` slots), so that every pass reads few of them and
    memory stays proportional to the longest row.

    Before (``.`` a hole or left padding, letters a row's tokens)::

        row 0:  . . a a . a a a . . a
        row 1:  b b b b b b . b b b b

    after: every row's tokens keep their order and end at the last slot, holes go to the left::

        row 0:  . . . . a a a a a a
        row 1:  b b b b b b b b b b

    Keys carry their positions already (rotary or absolute embeddings were applied when they were computed), so
    moving slots changes nothing a query sees.
    """
    slots = kv_mask.shape[1]
    if slots == longest or (slots <= longest + longest // _COMPACT_SHARE + _COMPACT_SLACK and not force):
        return kv_mask
    # A stable sort of the mask puts each row's holes first and its tokens last, both in their original order.
    order = torch.sort(kv_mask.to(torch.uint8), dim=1, stable=True).indices[:, slots - longest:]
    gather_cache_slots(cache, order)
    return torch.gather(kv_mask, 1, order)
