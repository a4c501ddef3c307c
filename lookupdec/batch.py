"""Ragged batches: ``input_ids`` [B, L], left-padded, with ``attention_mask``.

One target pass per step serves every row. Each row drafts from its own session; the drafter's driver picks one
draft length for the batch (``Drafter.propose``: the pass is as wide as its longest draft, so every row may fill
that width) and shorter drafts are padded with masked filler.
Rows accept different numbers of tokens, and ``DynamicCache`` appends the same number of slots to every row, so
the cache keeps, per step, as many new slots as the row that accepted most needs; the other rows' extra slots
stay behind as *holes*, masked out in the 2-D attention mask, and each row's ``position_ids`` count only its real
tokens, so a row sees exactly the keys, at exactly the positions, it would see alone::

    slot:        0  1  2  3  4  5  6  7
    row 0:       .  p  p  p  l  a  a  l'    . = left padding or a hole (masked out)
    row 1:       p  p  p  p  l  .  .  l'    p = prompt, a = accepted draft, l = a step's last token

    (step 1 fed [l, x0, x1, x2] at slots 4-7 for both rows; row 0 accepted 2 drafted tokens, row 1 none. Slots
    4-6 were kept, slot 7 was dropped, and row 1's slots 5-6 became holes; step 2 starts at slot 7.)

Holes are squeezed out (``_compact``: a gather that moves each row's tokens to the right end) once they outnumber
the real tokens, so memory stays proportional to the longest row. Finished rows (EOS, budget, stopping criteria)
leave the batch (``batch_select_indices``) and cost nothing more. Sliding-window models are refused for batches:
a window counts slots, and holes would shrink it. Per row, outputs are token-identical to single-sequence
generation, and sampling uses the exact rule per row (one generator, drawn row after row: independent draws).

:class:`BatchRun` holds a running batch. :func:`generate_batch` prefills its rows together and steps until all
are done; ``lookupdec serve`` lets requests join between steps (:meth:`BatchRun.join`: prefilled alone, exactly
as a single-row generation is, then appended to the batch's cache with masked left padding) and leave when done
or cancelled, each with its own settings (greedy, or sampling with its own seed).
"""


from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from ._device import host_buffer, input_device, synchronize
from ._transformers import (
    append_cache_rows,
    batch_cache,
    forward_params,
    gather_cache_slots,
    target_forward,
)
from .drafter import EMPTY
from .stats import GenerationStats, LookupOutput
from .verify import greedy_verdict

_COMPACT_SLACK = 64  # cache slots of holes tolerated beyond the longest row's tokens, before compacting


class Row:
    """One request of a batch: its prompt, settings, drafting session, committed tokens and figures.

    ``pick(logits, draft, process, position) -> Verdict`` verifies its drafts (``position``: how many tokens it
    has generated before this pass). ``on_commit(tokens, done)``, when given, is told each pass's committed
    tokens (a list) and whether the row is done. Setting ``cancelled`` ends the row at the next step.
    """

    def __init__(self, prompt: torch.Tensor, resolved, session, max_new_tokens: int, pick: Callable, *,
                 index: int = 0, trace=None, on_commit: Callable | None = None, owner=None):
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
        self.finish_reason = None  # "stop" (EOS or a stopping criterion), "length" or "cancelled", once done
        self.seq = torch.empty((1, self.prompt_len + max_new_tokens), dtype=torch.long, device=prompt.device)
        self.seq[:, : self.prompt_len] = prompt
        self.cur = self.prompt_len
        self.stats = GenerationStats()
        self.process = self._process if len(resolved.processors) else None
        self.plain_greedy = not resolved.do_sample and self.process is None
        self.step_tokens: list = []
        self.draft = EMPTY
        self.pass_seconds = 0.0
        if trace is not None:
            trace.start(prompt[0].tolist())

    @property
    def generated(self) -> int:
        return self.cur - self.prompt_len

    @property
    def tokens(self) -> torch.Tensor:
        """The tokens generated so far [n]."""
        return self.seq[0, self.prompt_len: self.cur]

    def verdict(self, logits: torch.Tensor, draft: np.ndarray):
        return self.pick(logits, draft, self.process, self.generated)

    def _process(self, pos: int, row: torch.Tensor) -> torch.Tensor:
        return self.resolved.processors(self.seq[:, : self.cur + pos].to(row.device), row[None, :].float())[0]

    def _commit(self) -> bool:
        """Commit the last pass's tokens (the accepted ones are in ``seq`` already, the target's follows);
        ``True`` when the row is done."""
        if self.cancelled:
            done, keep, self.finish_reason = True, 0, "cancelled"
        else:
            n_new = len(self.step_tokens)
            self.seq[0, self.cur + n_new - 1] = self.step_tokens[-1]
            done, keep = self.resolved.stop(self.step_tokens, self.seq, self.cur, self.max_new_tokens - self.generated)
        committed = self.step_tokens[:keep]
        self.cur += keep
        if done and self.finish_reason is None:
            self.finish_reason = "stop" if self._stopped(committed) else "length"
        self.stats.new_tokens += keep
        if self.trace is not None and not self.cancelled:
            self.trace.step(self.draft.tolist(), len(self.step_tokens) - 1, self.step_tokens[-1], keep,
                            self.pass_seconds)
        if self.on_commit is not None:
            self.on_commit(committed, done)
        if not self.cancelled:  # the pass time belongs to the batch (observed there), not to this row's draft
            self.session.commit(np.asarray(self.step_tokens, dtype=np.int32))
        if done:
            self.session.finish()
        return done

    def _stopped(self, committed: list) -> bool:
        """Whether the row's last committed token ended it by itself (EOS, a stopping criterion), not the budget."""
        if not committed:
            return False
        if committed[-1] in self.resolved.eos_ids:
            return True
        stopping = self.resolved.stopping
        return stopping is not None and bool(stopping(self.seq[:, : self.cur], None).any())


class BatchRun:
    """A running batch on one model and drafter: rows join (:meth:`prefill` for a starting set, :meth:`join` one
    at a time between steps), each :meth:`step` commits the last pass's tokens, lets finished rows go, and runs
    the next pass for the rest."""

    def __init__(self, model, drafter):
        self.model, self.drafter = model, drafter
        self.device = input_device(model)  # drafts go where the model reads its input; logits are read where they are
        self.params = forward_params(model)
        if "position_ids" not in self.params:
            raise NotImplementedError(f"{type(model).__name__}.forward takes no position_ids; batches need them")
        self.rows: list[Row] = []  # running rows, in cache order
        self.stats = GenerationStats()  # passes and model time of the whole batch
        # Cache bookkeeping: ``kv_mask[i, slot]`` says whether a cache slot holds one of row i's tokens;
        # ``counts[i]`` how many do, which is also the position of its last committed token, the one not yet in
        # the cache. Both live on the host too (counts as numpy), so that sizing a step never waits for the device.
        self.cache = None
        self.kv_mask = None
        self.counts = np.zeros(0, dtype=np.int64)
        self._feed = host_buffer(0, self.device)
        self._seconds = 0.0  # the last pass's forward time
        # One row whose cache holds no hole or padding: its passes run as a single-row generation's do, without a
        # mask or positions (which would make the model build a full attention mask every step).
        self._solo = False

    def __len__(self) -> int:
        return len(self.rows)

    def prefill(self, rows: list[Row], input_ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        """Start an empty batch with ``rows`` prefilled in one pass, as plain batched generate does it: their
        prompts are ``input_ids`` [B, L], left padding masked out by ``mask``, positions counted from each row's
        start."""
        if self.rows:
            raise RuntimeError("prefill starts an empty batch; use join() to add to a running one")
        self.cache = batch_cache(self.model)
        mask = mask.to(self.device)
        positions = mask.long().cumsum(-1) - 1
        positions.masked_fill_(~mask, 1)
        logits = self._forward(input_ids.to(self.device), 1, self.cache, mask, positions)  # [batch, 1, vocab]
        self._first_tokens(rows, logits)
        self.rows = list(rows)
        self.kv_mask = mask
        self.counts = lengths.cpu().numpy().astype(np.int64)
        self._solo = False

    def join(self, row: Row) -> None:
        """Add ``row`` to the batch before the next step: its prompt is prefilled alone (the pass a single-row
        generation runs), and its cache slots are appended to the batch's, the shorter side left-padded with
        masked slots."""
        cache = batch_cache(self.model)
        logits = self._forward(row.prompt, 1, cache)  # [1, 1, vocab]
        self._first_tokens([row], logits)
        new_mask = torch.ones((1, row.prompt_len), dtype=torch.bool, device=self.device)
        self._solo = not self.rows
        if not self.rows:
            self.cache, self.kv_mask = cache, new_mask
        else:
            append_cache_rows(self.cache, cache)
            width = max(self.kv_mask.shape[1], row.prompt_len)
            self.kv_mask = torch.cat([_pad_left(self.kv_mask, width), _pad_left(new_mask, width)])
        self.rows.append(row)
        self.counts = np.append(self.counts, row.prompt_len)

    def step(self) -> list[Row]:
        """Commit every row's last pass, drop the rows that are done (returned), and run the next pass."""
        finished = [i for i, row in enumerate(self.rows) if row._commit()]
        if finished:
            done = [self.rows[i] for i in finished]
            keep = [i for i in range(len(self.rows)) if i not in finished]
            if not keep:
                self.rows, self.cache, self.kv_mask = [], None, None
                self.counts = np.zeros(0, dtype=np.int64)
                return done
            self.cache.batch_select_indices(torch.tensor(keep, device=self.device))
            self.kv_mask, self.counts = self.kv_mask[keep], self.counts[keep]
            self.rows = [self.rows[i] for i in keep]
        else:
            done = []
        solo = len(self.rows) == 1
        self.kv_mask = _compact(self.cache, self.kv_mask, int(self.counts.max()), force=solo and not self._solo)
        self._solo = solo
        self._pass()
        return done

    def _pass(self) -> None:
        rows, drafter = self.rows, self.drafter
        t0 = time.perf_counter()
        drafts = drafter.propose([row.session for row in rows],
                                 [row.max_new_tokens - row.generated - 1 for row in rows])
        self.stats.draft_seconds += time.perf_counter() - t0
        span = max(len(draft) for draft in drafts) + 1  # tokens fed per row
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
        if self._solo:
            logits = self._forward(feed, span, self.cache)
        else:
            positions = torch.from_numpy(self.counts[:, None] + np.arange(span)).to(self.device)
            logits = self._forward(feed, span, self.cache, torch.cat([self.kv_mask, feed_mask], dim=1), positions)
        drafter.observe(len(rows), span - 1, self._seconds)

        accepted = np.zeros(len(rows), dtype=np.int64)
        for i, (row, verdict) in enumerate(zip(rows, _verify(logits, drafts, rows))):
            row.stats.record(len(row.draft), verdict.accepted)
            self._count_pass(row)
            row.step_tokens = row.draft[: verdict.accepted].tolist() + [verdict.token]
            accepted[i] = verdict.accepted
        # Keep as many of the new slots as the row that accepted most needs; the other rows' extra slots in that
        # span stay in the cache as masked holes (compacted away once they pile up).
        kept = int(accepted.max()) + 1
        self.cache.crop(kept - span)
        self.kv_mask = torch.cat([self.kv_mask, torch.from_numpy(np.arange(kept) <= accepted[:, None])
                                  .to(self.device)], dim=1)
        self.counts = self.counts + accepted + 1

    def _forward(self, ids, keep, cache, mask=None, positions=None) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = target_forward(self.model, ids, cache, keep, self.params, mask, positions)
        synchronize(logits.device)
        self._seconds = time.perf_counter() - t0
        self.stats.model_seconds += self._seconds
        self.stats.target_passes += 1
        return logits

    def _first_tokens(self, rows: list[Row], logits: torch.Tensor) -> None:
        for row, verdict in zip(rows, _verify(logits, [EMPTY] * len(rows), rows)):
            row.step_tokens = [verdict.token]
            row.draft = EMPTY
            self._count_pass(row)

    def _count_pass(self, row: Row) -> None:
        row.stats.target_passes += 1
        row.stats.model_seconds += self._seconds
        row.pass_seconds = self._seconds


def generate_batch(job, input_ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, trace) -> LookupOutput:
    """Batched lookup decoding of ``input_ids`` [B, L] (left padding given by ``mask`` [B, L] bool and ``lengths``
    [B]) for a ``loop.Job``; each row's output equals what the row alone would give."""
    batch, width = input_ids.shape
    traces = list(trace) if trace is not None else [None] * batch
    if len(traces) != batch:
        raise ValueError(f"a batch of {batch} rows needs {batch} trace recorders (a list), got {len(traces)}")
    run = BatchRun(job.model, job.drafter)
    batch_cache(job.model)  # refuses sliding-window models before anything runs
    rows = []
    for r in range(batch):
        prompt = input_ids[r: r + 1, width - int(lengths[r]):].to(run.device)
        resolved = job.resolve(prompt)
        session = job.drafter.start(prompt[0].cpu().numpy(), eos_ids=resolved.eos_ids)
        rows.append(Row(prompt, resolved, session, job.max_new_tokens, job.verifier(resolved), index=r,
                        trace=traces[r]))
    # A batch prices drafts by its size's bucket, measured for the starting size; the single-row profile serves
    # once one row is left.
    job.calibrate(rows=1)
    job.calibrate(rows=batch)
    run.prefill(rows, input_ids, mask, lengths)
    while run.rows:
        run.step()

    stats = run.stats
    stats.rows = [row.stats for row in rows]
    for row in rows:
        stats.add_row(row.stats)
    generated = max(row.generated for row in rows)
    out = torch.full((batch, width + generated), rows[0].resolved.pad_token_id, dtype=torch.long, device=run.device)
    out[:, :width] = input_ids.to(run.device)
    for row in rows:
        out[row.index, width: width + row.generated] = row.tokens
    return LookupOutput(sequences=out, stats=stats)


def _verify(logits: torch.Tensor, drafts, rows: list[Row]) -> list:
    """Each row's verdict on its draft, from ``logits`` [rows, span, vocab]. When every row is plain greedy (the
    common case), all are decided from one argmax over the whole batch and one transfer to the host."""
    if all(row.plain_greedy for row in rows):
        choices = logits.argmax(dim=-1).cpu().numpy()  # [rows, span]
        return [greedy_verdict(choices[i, : len(draft) + 1], draft) for i, draft in enumerate(drafts)]
    return [row.verdict(logits[i, : len(draft) + 1], draft) for i, (row, draft) in enumerate(zip(rows, drafts))]


def _pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``mask`` [rows, w] with ``width - w`` masked slots in front."""
    return torch.cat([mask.new_zeros((mask.shape[0], width - mask.shape[1])), mask], dim=1)


def _compact(cache, kv_mask: torch.Tensor, longest: int, *, force: bool = False) -> torch.Tensor:
    """Squeeze the masked holes out of the cache once they take more room than the tokens do, so memory stays
    proportional to the longest row.

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
    if slots == longest or (slots <= 2 * longest + _COMPACT_SLACK and not force):
        return kv_mask
    # A stable sort of the mask puts each row's holes first and its tokens last, both in their original order.
    order = torch.sort(kv_mask.to(torch.uint8), dim=1, stable=True).indices[:, slots - longest:]
    gather_cache_slots(cache, order)
    return torch.gather(kv_mask, 1, order)
