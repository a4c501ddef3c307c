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
"""


from __future__ import annotations

import time

import numpy as np
import torch

from ._transformers import batch_cache, forward_params, gather_cache_slots, target_forward
from .stats import GenerationStats, LookupOutput

_COMPACT_SLACK = 64  # cache slots of holes tolerated beyond the longest row's tokens, before compacting


class _Row:
    """One request of a batch: its committed tokens, drafting session, processors and figures."""

    def __init__(self, index, prompt, resolved, session, max_new_tokens, trace):
        self.index = index  # row in the caller's input_ids
        self.prompt_len = prompt.shape[1]
        self.resolved = resolved
        self.session = session
        self.trace = trace
        self.seq = torch.empty((1, self.prompt_len + max_new_tokens), dtype=torch.long, device=prompt.device)
        self.seq[:, : self.prompt_len] = prompt
        self.cur = self.prompt_len
        self.stats = GenerationStats()
        self.process = self._process if len(resolved.processors) else None
        self.step_tokens: list = []
        self.draft = np.zeros(0, dtype=np.int32)

    def _process(self, pos: int, row: torch.Tensor) -> torch.Tensor:
        return self.resolved.processors(self.seq[:, : self.cur + pos], row[None, :].float())[0]


def generate_batch(job, input_ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, trace) -> LookupOutput:
    """Batched lookup decoding of ``input_ids`` [B, L] (left padding given by ``mask`` [B, L] bool and ``lengths``
    [B]) for a ``loop.Job``; each row's output equals what the row alone would give."""
    model, max_new_tokens, drafter = job.model, job.max_new_tokens, job.drafter
    device = model.device
    batch, width = input_ids.shape
    traces = list(trace) if trace is not None else [None] * batch
    if len(traces) != batch:
        raise ValueError(f"a batch of {batch} rows needs {batch} trace recorders (a list), got {len(traces)}")
    cache = batch_cache(model)
    params = forward_params(model)
    if "position_ids" not in params:
        raise NotImplementedError(f"{type(model).__name__}.forward takes no position_ids; batches need them")

    rows = []
    for r in range(batch):
        prompt = input_ids[r: r + 1, width - int(lengths[r]):].to(device)
        resolved = job.resolve(prompt)
        session = drafter.start(prompt[0].cpu().numpy(), eos_ids=resolved.eos_ids)
        rows.append(_Row(r, prompt, resolved, session, max_new_tokens, traces[r]))
        if traces[r] is not None:
            traces[r].start(prompt[0].tolist())
    pick = job.verifier(rows[0].resolved)  # one generation config: every row greedy, or every row sampled
    stats = GenerationStats(rows=[row.stats for row in rows])
    # Batches of two or more rows price drafts per batch size; the measured profile serves once one row is left.
    job.calibrate()

    # Prefill, as plain batched generate does it: left padding masked out, positions counted from each row's start.
    mask = mask.to(device)
    positions = mask.long().cumsum(-1) - 1
    positions.masked_fill_(~mask, 1)
    t0 = time.perf_counter()
    logits = target_forward(model, input_ids.to(device), cache, 1, params, mask, positions)  # [batch, 1, vocab]
    pass_seconds = time.perf_counter() - t0
    stats.model_seconds += pass_seconds
    stats.target_passes += 1
    empty = input_ids.new_empty(0, device=device)
    for i, row in enumerate(rows):
        row.step_tokens = [pick(logits[i], empty, row.process).token]
        row.stats.target_passes += 1
        row.stats.model_seconds += pass_seconds

    # Cache bookkeeping for the rows still running (``active``, in cache order): ``kv_mask[i, slot]`` says whether
    # a cache slot holds one of row i's tokens; ``counts[i]`` how many do, which is also the position of its last
    # committed token, the one not yet in the cache.
    active = rows
    kv_mask = mask
    counts = lengths.to(device).clone()
    while True:
        finished = []
        for i, row in enumerate(active):
            n_new = len(row.step_tokens)
            row.seq[0, row.cur: row.cur + n_new] = torch.tensor(row.step_tokens, dtype=torch.long)
            done, keep = row.resolved.stop(row.step_tokens, row.seq, row.cur,
                                           max_new_tokens - (row.cur - row.prompt_len))
            row.cur += keep
            row.stats.new_tokens += keep
            if row.trace is not None:
                row.trace.step(row.draft.tolist(), n_new - 1, row.step_tokens[-1], keep, pass_seconds)
            if done:
                finished.append(i)
                row.session.finish()
            else:
                # The pass time belongs to the batch (observed below), not to this row's draft.
                row.session.commit(np.asarray(row.step_tokens, dtype=np.int32))
        if finished:
            # A finished row leaves the batch, and its cache entries with it.
            keep_rows = [i for i in range(len(active)) if i not in finished]
            if not keep_rows:
                break
            select = torch.tensor(keep_rows, device=device)
            cache.batch_select_indices(select)
            kv_mask, counts = kv_mask[select], counts[select]
            active = [active[i] for i in keep_rows]
        kv_mask = _compact(cache, kv_mask, counts)

        t0 = time.perf_counter()
        drafts = drafter.propose([row.session for row in active],
                                 [max_new_tokens - (row.cur - row.prompt_len) - 1 for row in active])
        stats.draft_seconds += time.perf_counter() - t0
        span = max(len(draft) for draft in drafts) + 1  # tokens fed per row
        feed = torch.empty((len(active), span), dtype=torch.long, device=device)
        feed_mask = torch.zeros((len(active), span), dtype=torch.bool, device=device)
        draft_ts = []
        for i, (row, draft) in enumerate(zip(active, drafts)):
            d = len(draft)
            draft_t = torch.from_numpy(draft.astype(np.int64)).to(device)
            row.seq[0, row.cur: row.cur + d] = draft_t
            feed[i, : d + 1] = row.seq[0, row.cur - 1: row.cur + d]
            feed[i, d + 1:] = feed[i, 0]  # filler, masked out
            feed_mask[i, : d + 1] = True
            row.draft = draft
            draft_ts.append(draft_t)
        positions = counts[:, None] + torch.arange(span, device=device)

        t0 = time.perf_counter()
        logits = target_forward(model, feed, cache, span, params, torch.cat([kv_mask, feed_mask], dim=1),
                                positions)  # [rows, span, vocab]
        pass_seconds = time.perf_counter() - t0
        drafter.observe(len(active), span - 1, pass_seconds)
        stats.model_seconds += pass_seconds
        stats.target_passes += 1

        accepted = []
        for i, (row, draft_t) in enumerate(zip(active, draft_ts)):
            d = len(draft_t)
            verdict = pick(logits[i, : d + 1], draft_t, row.process)
            row.stats.record(d, verdict.accepted)
            row.stats.target_passes += 1
            row.stats.model_seconds += pass_seconds
            row.step_tokens = row.draft[: verdict.accepted].tolist() + [verdict.token]
            accepted.append(verdict.accepted)
        # Keep as many of the new slots as the row that accepted most needs; the other rows' extra slots in that
        # span stay in the cache as masked holes (compacted away once they pile up).
        accepted_t = torch.tensor(accepted, device=device)
        kept = int(accepted_t.max()) + 1
        cache.crop(kept - span)
        kv_mask = torch.cat([kv_mask, torch.arange(kept, device=device) <= accepted_t[:, None]], dim=1)
        counts = counts + accepted_t + 1

    for row in rows:
        stats.add_row(row.stats)
    generated = max(row.cur - row.prompt_len for row in rows)
    out = torch.full((batch, width + generated), rows[0].resolved.pad_token_id, dtype=torch.long, device=device)
    out[:, :width] = input_ids.to(device)
    for row in rows:
        n = row.cur - row.prompt_len
        out[row.index, width: width + n] = row.seq[0, row.prompt_len: row.cur]
    return LookupOutput(sequences=out, stats=stats)


def _compact(cache, kv_mask: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
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
    slots, longest = kv_mask.shape[1], int(counts.max())
    if slots <= 2 * longest + _COMPACT_SLACK:
        return kv_mask
    # A stable sort of the mask puts each row's holes first and its tokens last, both in their original order.
    order = torch.sort(kv_mask.to(torch.uint8), dim=1, stable=True).indices[:, slots - longest:]
    gather_cache_slots(cache, order)
    return torch.gather(kv_mask, 1, order)
