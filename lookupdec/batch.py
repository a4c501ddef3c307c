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

from ._device import host_buffer, input_device, synchronize
from ._transformers import batch_cache, forward_params, gather_cache_slots, target_forward
from .stats import GenerationStats, LookupOutput
from .verify import greedy_verdict

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
        return self.resolved.processors(self.seq[:, : self.cur + pos].to(row.device), row[None, :].float())[0]


def generate_batch(job, input_ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, trace) -> LookupOutput:
    """Batched lookup decoding of ``input_ids`` [B, L] (left padding given by ``mask`` [B, L] bool and ``lengths``
    [B]) for a ``loop.Job``; each row's output equals what the row alone would give."""
    model, max_new_tokens, drafter = job.model, job.max_new_tokens, job.drafter
    device = input_device(model)  # drafts go where the model reads its input; logits are read where they are
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
    # A batch prices drafts by its size's bucket, measured for the starting size; the single-row profile serves
    # once one row is left.
    job.calibrate(rows=1)
    job.calibrate(rows=batch)

    # Prefill, as plain batched generate does it: left padding masked out, positions counted from each row's start.
    mask = mask.to(device)
    positions = mask.long().cumsum(-1) - 1
    positions.masked_fill_(~mask, 1)
    t0 = time.perf_counter()
    logits = target_forward(model, input_ids.to(device), cache, 1, params, mask, positions)  # [batch, 1, vocab]
    synchronize(logits.device)
    pass_seconds = time.perf_counter() - t0
    stats.model_seconds += pass_seconds
    stats.target_passes += 1
    verdicts = _verify(pick, logits, [row.draft for row in rows], rows)
    for row, verdict in zip(rows, verdicts):
        row.step_tokens = [verdict.token]
        row.stats.target_passes += 1
        row.stats.model_seconds += pass_seconds

    # Cache bookkeeping for the rows still running (``active``, in cache order): ``kv_mask[i, slot]`` says whether
    # a cache slot holds one of row i's tokens; ``counts[i]`` how many do, which is also the position of its last
    # committed token, the one not yet in the cache.
    # Both live on the host too (counts as numpy), so that sizing a step never waits for the device.
    active = rows
    kv_mask = mask
    counts = lengths.cpu().numpy().astype(np.int64)
    feed_host = host_buffer(batch * (drafter.drafter_config.max_draft + 1), device)
    while True:
        finished = []
        for i, row in enumerate(active):
            # The accepted tokens are in row.seq already (the draft was written there); the target's token follows.
            n_new = len(row.step_tokens)
            row.seq[0, row.cur + n_new - 1] = row.step_tokens[-1]
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
            kv_mask, counts = kv_mask[select], counts[keep_rows]
            active = [active[i] for i in keep_rows]
        kv_mask = _compact(cache, kv_mask, int(counts.max()))

        t0 = time.perf_counter()
        drafts = drafter.propose([row.session for row in active],
                                 [max_new_tokens - (row.cur - row.prompt_len) - 1 for row in active])
        stats.draft_seconds += time.perf_counter() - t0
        span = max(len(draft) for draft in drafts) + 1  # tokens fed per row
        # Built on the host ([last token, draft, filler] per row, the filler masked out), then one copy.
        host = feed_host[: len(active) * span].view(len(active), span)
        lens = np.array([len(draft) for draft in drafts])
        for i, (row, draft) in enumerate(zip(active, drafts)):
            host[i, :] = row.step_tokens[-1]  # the last token, and the filler after the draft
            host[i, 1: len(draft) + 1] = torch.from_numpy(draft.astype(np.int64))
            row.draft = draft
        feed = host.to(device, non_blocking=True)  # [rows, span]
        feed_mask = torch.from_numpy(np.arange(span) <= lens[:, None]).to(device)  # [rows, span]
        for i, row in enumerate(active):
            row.seq[0, row.cur: row.cur + lens[i]] = feed[i, 1: lens[i] + 1]
        positions = torch.from_numpy(counts[:, None] + np.arange(span)).to(device)

        t0 = time.perf_counter()
        logits = target_forward(model, feed, cache, span, params, torch.cat([kv_mask, feed_mask], dim=1),
                                positions)  # [rows, span, vocab]
        synchronize(logits.device)
        pass_seconds = time.perf_counter() - t0
        drafter.observe(len(active), span - 1, pass_seconds)
        stats.model_seconds += pass_seconds
        stats.target_passes += 1

        accepted = np.zeros(len(active), dtype=np.int64)
        for i, (row, verdict) in enumerate(zip(active, _verify(pick, logits, drafts, active))):
            row.stats.record(len(row.draft), verdict.accepted)
            row.stats.target_passes += 1
            row.stats.model_seconds += pass_seconds
            row.step_tokens = row.draft[: verdict.accepted].tolist() + [verdict.token]
            accepted[i] = verdict.accepted
        # Keep as many of the new slots as the row that accepted most needs; the other rows' extra slots in that
        # span stay in the cache as masked holes (compacted away once they pile up).
        kept = int(accepted.max()) + 1
        cache.crop(kept - span)
        kv_mask = torch.cat([kv_mask, torch.from_numpy(np.arange(kept) <= accepted[:, None]).to(device)], dim=1)
        counts = counts + accepted + 1

    for row in rows:
        stats.add_row(row.stats)
    generated = max(row.cur - row.prompt_len for row in rows)
    out = torch.full((batch, width + generated), rows[0].resolved.pad_token_id, dtype=torch.long, device=device)
    out[:, :width] = input_ids.to(device)
    for row in rows:
        n = row.cur - row.prompt_len
        out[row.index, width: width + n] = row.seq[0, row.prompt_len: row.cur]
    return LookupOutput(sequences=out, stats=stats)


def _verify(pick, logits: torch.Tensor, drafts, rows) -> list:
    """Each row's verdict on its draft, from ``logits`` [rows, span, vocab]. Greedy rows without processors (the
    common case) are decided from one argmax over the whole batch and one transfer to the host."""
    if not rows[0].resolved.do_sample and all(row.process is None for row in rows):
        choices = logits.argmax(dim=-1).cpu().numpy()  # [rows, span]
        return [greedy_verdict(choices[i, : len(draft) + 1], draft) for i, draft in enumerate(drafts)]
    return [pick(logits[i, : len(draft) + 1], draft, row.process) for i, (row, draft) in enumerate(zip(rows, drafts))]


def _compact(cache, kv_mask: torch.Tensor, longest: int) -> torch.Tensor:
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
    if slots <= 2 * longest + _COMPACT_SLACK:
        return kv_mask
    # A stable sort of the mask puts each row's holes first and its tokens last, both in their original order.
    order = torch.sort(kv_mask.to(torch.uint8), dim=1, stable=True).indices[:, slots - longest:]
    gather_cache_slots(cache, order)
    return torch.gather(kv_mask, 1, order)
