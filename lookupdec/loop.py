"""The decoding loop: draft -> one target forward -> verify -> commit, cropping the KV cache on rejection.

Invariant between steps: the KV cache holds every committed token except the last one, ``last``. A step feeds
``[last, x_0 .. x_{d-1}]`` (``d + 1`` tokens) and gets ``d + 1`` rows of logits back: row ``pos`` predicts the token
after draft position ``pos - 1``. The verifier keeps ``accepted`` drafted tokens and adds one target token; the
cache is cropped to drop the ``d - accepted`` rejected positions, and that target token becomes the new ``last``.

The prompt is prefilled in one pass that also yields the first new token, exactly as plain ``generate`` does, so
the first token is computed identically.

Model-agnostic: it needs a transformers causal LM whose cache can be cropped (``DynamicCache``), and nothing
about its architecture. Sliding-window layers keep their past while a draft is pending (transformers'
``activate_past_recording``), so cropping restores them too.

Batches (``input_ids`` [B, L], left-padded, with ``attention_mask``). One target pass per step serves every row.
Each row drafts from its own session; the batch picks one draft length (``best_batch_length``: the pass is as
wide as its longest draft, so every row may fill that width) and shorter drafts are padded with masked filler.
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
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from .costs import calibrate_or_warn
from .drafter import LookupDrafter, best_batch_length
from .hf import forward_params, resolve_generation, rollback_cache, target_forward
from .verify import verify_greedy, verify_sample


@dataclass
class GenerationStats:
    target_passes: int = 0  # target forward passes, the prefill included
    new_tokens: int = 0
    # accepted_per_position[pos]: drafts whose token at draft position pos was accepted;
    # drafted_per_position[pos]: drafts that had a token at position pos.
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_seconds: float = 0.0  # proposing drafts and updating the drafter
    model_seconds: float = 0.0  # target forward passes (prefill included)
    total_seconds: float = 0.0
    # Batches: the figures of each row, in the order of input_ids. The totals above count each batched pass once
    # (target_passes, model_seconds) and sum the rows' tokens. Empty for a batch of one.
    rows: list[GenerationStats] = field(default_factory=list)

    @property
    def tokens_per_pass(self) -> float:
        """New tokens per target pass, the target's own token of each pass (recovered or bonus) included."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def _record(self, draft_len: int, accepted: int) -> None:
        while len(self.drafted_per_position) < draft_len:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for pos in range(draft_len):
            self.drafted_per_position[pos] += 1
            if pos < accepted:
                self.accepted_per_position[pos] += 1
        self.drafted_tokens += draft_len
        self.accepted_tokens += accepted


@dataclass
class LookupOutput:
    sequences: torch.LongTensor  # [batch, prompt_len + new_tokens], like model.generate
    stats: GenerationStats


def generate(
    model,
    input_ids: torch.LongTensor,  # [batch, prompt_len]
    attention_mask: torch.Tensor | None = None,  # [batch, prompt_len]; left padding, as for model.generate
    *,
    max_new_tokens: int,
    drafter: LookupDrafter | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    generation_config=None,
    logits_processor=None,
    stopping_criteria=None,
    streamer=None,
    generator: torch.Generator | None = None,
    tokenizer=None,
    trace=None,
) -> LookupOutput:
    """Generate with lookup drafts; the output is what ``model.generate`` would produce with the same arguments.

    Greedy output is token-identical to plain greedy decoding; sampled output follows exactly the distribution of
    plain sampling with the same processors and warpers (temperature, top-k, top-p, penalties, ...). Pass a
    ``torch.Generator`` for reproducible sampling. ``tokenizer`` is only needed for ``stop_strings``.

    Batches: a left-padded ``input_ids`` [B, L] with its ``attention_mask`` runs one target pass per step for all
    rows (see the module docstring); each row's output equals what the row alone would give. ``.sequences`` is
    padded like ``model.generate``'s (rows that finished early get the pad token), and ``.stats`` holds the totals
    with each row's own figures in ``.stats.rows``. A streamer needs a batch of one; ``trace`` takes one recorder
    per row (a list).
    ``trace`` (e.g. a :class:`lookupdec.trace.TraceRecorder`) is told about every target pass: its
    ``start(prompt)`` gets the prompt's token ids, then ``step(draft, accepted, token, kept, seconds)`` runs once
    per pass, the prefill first (empty draft); ``kept`` is how many of the pass's ``accepted + 1`` tokens were
    committed (fewer only where generation stopped), ``seconds`` the pass's forward time.
    Unset arguments fall back to ``generation_config``, then to ``model.generation_config``, as in transformers.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids holds no rows")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    run = _generate if input_ids.shape[0] == 1 else _generate_batch
    with torch.inference_mode():
        return run(
            model, input_ids, attention_mask, max_new_tokens, drafter if drafter is not None else LookupDrafter(),
            dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                 repetition_penalty=repetition_penalty),
            generation_config, logits_processor, stopping_criteria, streamer, generator, tokenizer, trace,
        )


def _left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple:
    """``(mask, lengths)``: the attention mask as bools and each row's token count; ValueError unless every row
    is left padding (zeros first, then ones) followed by at least one token."""
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}")
    width = input_ids.shape[1]
    lengths = mask.sum(dim=1)
    if bool((lengths == 0).any()):
        raise ValueError("every row of input_ids needs at least one token (not empty, not all padding)")
    if not bool((mask == (torch.arange(width, device=mask.device) >= (width - lengths)[:, None])).all()):
        raise ValueError("attention_mask must be left padding (zeros first, then ones) on every row")
    return mask, lengths


def _generate(model, input_ids, attention_mask, max_new_tokens, drafter, overrides, generation_config,
              logits_processor, stopping_criteria, streamer, generator, tokenizer, trace) -> LookupOutput:
    started = time.perf_counter()
    device = model.device
    # Batch of one: left padding carries no information; drop it and put it back in the output.
    _, lengths = _left_padding(input_ids, attention_mask)
    padding = input_ids.shape[1] - int(lengths[0])
    prompt = input_ids[:, padding:].to(device)
    prompt_len = prompt.shape[1]
    resolved = resolve_generation(
        model, prompt, max_new_tokens=max_new_tokens, generation_config=generation_config,
        logits_processor=logits_processor, stopping_criteria=stopping_criteria, tokenizer=tokenizer, **overrides,
    )
    stats = GenerationStats()

    # seq holds prompt + committed tokens (and, during a step, the draft): processors read prefixes of it.
    # A draft never exceeds the remaining budget minus one, so this is enough room.
    seq = torch.empty((1, prompt_len + max_new_tokens), dtype=torch.long, device=device)
    seq[:, :prompt_len] = prompt
    cur = prompt_len  # committed length

    processors = resolved.processors

    def process(pos: int, row: torch.Tensor) -> torch.Tensor:  # row [vocab] -> processed [vocab]
        return processors(seq[:, : cur + pos], row[None, :].float())[0]

    process_fn = process if len(processors) else None
    pick = verify_sample if resolved.do_sample else verify_greedy
    extra = {"generator": generator} if resolved.do_sample else {}

    cache = rollback_cache(model)
    params = forward_params(model)

    if streamer is not None:
        streamer.put(input_ids.cpu())

    started += _calibrate(drafter, model)
    session = drafter.start(prompt[0].cpu().numpy(), eos_ids=resolved.eos_ids)
    t0 = time.perf_counter()
    logits = target_forward(model, prompt, cache, 1, params)[0]  # [1, vocab]
    pass_seconds = time.perf_counter() - t0
    stats.model_seconds += pass_seconds
    stats.target_passes += 1
    verdict = pick(logits, prompt.new_empty(0), process_fn, **extra)
    step_tokens = [verdict.token]
    draft = np.zeros(0, dtype=np.int32)
    if trace is not None:
        trace.start(prompt[0].tolist())
    step_started = None
    while True:
        # Commit step_tokens (the previous pass's accepted tokens + its target token).
        n_new = len(step_tokens)
        seq[0, cur: cur + n_new] = torch.tensor(step_tokens, dtype=torch.long)
        done, keep = _stop_check(step_tokens, resolved, seq, cur, prompt_len, max_new_tokens)
        committed = step_tokens[:keep]
        cur += keep
        stats.new_tokens += keep
        if streamer is not None and committed:
            streamer.put(torch.tensor(committed, dtype=torch.long))
        if trace is not None:
            trace.step(draft.tolist(), n_new - 1, step_tokens[-1], keep, pass_seconds)
        if done:
            break
        t0 = time.perf_counter()
        seconds = (t0 - step_started) if step_started is not None else None
        session.commit(np.asarray(step_tokens, dtype=np.int32), len(step_tokens) - 1, seconds)
        step_started = t0
        # The bonus/recovered token always follows the draft, so the draft may use all but one of the budget.
        draft = session.propose(max_new_tokens - (cur - prompt_len) - 1)
        stats.draft_seconds += time.perf_counter() - t0
        d = len(draft)
        draft_t = torch.from_numpy(draft.astype(np.int64)).to(device)
        seq[0, cur: cur + d] = draft_t
        feed = seq[:, cur - 1: cur + d]  # [1, d + 1]: last committed token + draft

        t0 = time.perf_counter()
        logits = target_forward(model, feed, cache, d + 1, params)[0]  # [d + 1, vocab]
        pass_seconds = time.perf_counter() - t0
        stats.model_seconds += pass_seconds
        stats.target_passes += 1

        verdict = pick(logits, draft_t, process_fn, **extra)
        stats._record(d, verdict.accepted)
        # Drop the rejected positions. crop(0) is not a no-op: sliding-window layers release the past they kept
        # in case of a rollback.
        cache.crop(verdict.accepted - d)
        step_tokens = draft[: verdict.accepted].tolist() + [verdict.token]
    session.finish()
    if streamer is not None:
        streamer.end()
    out = seq[:, :cur]
    if padding:
        out = torch.cat([input_ids[:, :padding].to(device), out], dim=1)
    stats.total_seconds = time.perf_counter() - started
    return LookupOutput(sequences=out.clone(), stats=stats)



def _calibrate(drafter, model) -> float:
    """Calibrate the drafter's pass cost (measured once per model, device and thread count, then from memory or
    disk); returns the seconds it took, which the stats leave out: a one-time measurement is not generation."""
    t0 = time.perf_counter()
    calibrate_or_warn(drafter, model)
    return time.perf_counter() - t0


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


def _generate_batch(model, input_ids, attention_mask, max_new_tokens, drafter, overrides, generation_config,
                    logits_processor, stopping_criteria, streamer, generator, tokenizer, trace) -> LookupOutput:
    started = time.perf_counter()
    device = model.device
    batch, width = input_ids.shape
    if streamer is not None:
        raise ValueError("a streamer needs a batch of one (transformers' streamers do too)")
    traces = list(trace) if trace is not None else [None] * batch
    if len(traces) != batch:
        raise ValueError(f"a batch of {batch} rows needs {batch} trace recorders (a list), got {len(traces)}")
    mask, lengths = _left_padding(input_ids, attention_mask)
    if not hasattr(drafter, "batch_cost"):
        raise TypeError(f"batches need a LookupDrafter (or a subclass), got {type(drafter).__name__}")
    cache = DynamicCache(config=model.config)
    params = forward_params(model)
    if any(cache.is_sliding):
        # Rows accept different numbers of tokens, which leaves masked holes between a row's cache entries; a
        # sliding window counts cache slots, so holes would shrink it. Full-attention models only, for now.
        raise NotImplementedError("batched lookup decoding needs a model without sliding-window attention; "
                                  "pass one row at a time")
    if "position_ids" not in params:
        raise NotImplementedError(f"{type(model).__name__}.forward takes no position_ids; batches need them")

    pick = None
    rows = []
    for r in range(batch):
        prompt = input_ids[r: r + 1, width - int(lengths[r]):].to(device)
        resolved = resolve_generation(
            model, prompt, max_new_tokens=max_new_tokens, generation_config=generation_config,
            logits_processor=logits_processor, stopping_criteria=stopping_criteria, tokenizer=tokenizer,
            **overrides,
        )
        pick = verify_sample if resolved.do_sample else verify_greedy
        session = drafter.start(prompt[0].cpu().numpy(), eos_ids=resolved.eos_ids)
        rows.append(_Row(r, prompt, resolved, session, max_new_tokens, traces[r]))
        if traces[r] is not None:
            traces[r].start(prompt[0].tolist())
    extra = {"generator": generator} if rows[0].resolved.do_sample else {}
    stats = GenerationStats(rows=[row.stats for row in rows])
    # Batches of two or more rows price drafts per batch size; the measured profile serves once one row is left.
    started += _calibrate(drafter, model)

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
        row.step_tokens = [pick(logits[i], empty, row.process, **extra).token]
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
            done, keep = _stop_check(row.step_tokens, row.resolved, row.seq, row.cur, row.prompt_len,
                                     max_new_tokens)
            row.cur += keep
            row.stats.new_tokens += keep
            if row.trace is not None:
                row.trace.step(row.draft.tolist(), n_new - 1, row.step_tokens[-1], keep, pass_seconds)
            if done:
                finished.append(i)
                row.session.finish()
            else:
                # The pass time belongs to the batch, not to this row's draft: the single-row cost fit stays out.
                row.session.commit(np.asarray(row.step_tokens, dtype=np.int32), n_new - 1, None)
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
        offers = [row.session.offer(max_new_tokens - (row.cur - row.prompt_len) - 1) for row in active]
        cost = drafter.batch_cost(len(active))
        if drafter.drafter_config.adaptive:
            # One length for the batch: the pass is as wide as the longest draft, so every row may fill it.
            length = best_batch_length(offers, cost.costs(max(o.tokens.size for o in offers)),
                                       margin=drafter.drafter_config.margin())
        else:
            length = max(offer.tokens.size for offer in offers)
        drafts = [row.session.take(length) for row in active]
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
        cost.observe(span - 1, pass_seconds)
        stats.model_seconds += pass_seconds
        stats.target_passes += 1

        accepted = []
        for i, (row, draft_t) in enumerate(zip(active, draft_ts)):
            d = len(draft_t)
            verdict = pick(logits[i, : d + 1], draft_t, row.process, **extra)
            row.stats._record(d, verdict.accepted)
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
        stats.new_tokens += row.stats.new_tokens
        stats.drafted_tokens += row.stats.drafted_tokens
        stats.accepted_tokens += row.stats.accepted_tokens
        for pos, (n_drafted, n_accepted) in enumerate(zip(row.stats.drafted_per_position,
                                                           row.stats.accepted_per_position)):
            if pos == len(stats.drafted_per_position):
                stats.drafted_per_position.append(0)
                stats.accepted_per_position.append(0)
            stats.drafted_per_position[pos] += n_drafted
            stats.accepted_per_position[pos] += n_accepted
    generated = max(row.cur - row.prompt_len for row in rows)
    pad = _pad_token(rows[0].resolved)
    out = torch.full((batch, input_ids.shape[1] + generated), pad, dtype=torch.long, device=device)
    out[:, : input_ids.shape[1]] = input_ids.to(device)
    for row in rows:
        n = row.cur - row.prompt_len
        out[row.index, input_ids.shape[1]: input_ids.shape[1] + n] = row.seq[0, row.prompt_len: row.cur]
    stats.total_seconds = time.perf_counter() - started
    for row in rows:
        row.stats.total_seconds = stats.total_seconds
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
    for layer in cache.layers:
        index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        layer.keys = torch.gather(layer.keys, 2, index)
        index = order[:, None, :, None].expand(-1, layer.values.shape[1], -1, layer.values.shape[3])
        layer.values = torch.gather(layer.values, 2, index)
    return torch.gather(kv_mask, 1, order)


def _pad_token(resolved) -> int:
    config = resolved.generation_config
    for token in (config.pad_token_id, next(iter(sorted(resolved.eos_ids)), None)):
        if token is not None:
            return int(token[0] if isinstance(token, (list, tuple)) else token)
    return 0


def _stop_check(step_tokens, resolved, seq, cur, prompt_len, max_new_tokens) -> tuple:
    """How many of ``step_tokens`` to keep, and whether generation ends there: at the first EOS, at
    ``max_new_tokens``, or where a stopping criterion (stop strings, user criteria) first fires."""
    budget = max_new_tokens - (cur - prompt_len)
    for i, token in enumerate(step_tokens):
        if i + 1 > budget:
            return True, i
        if token in resolved.eos_ids:
            return True, i + 1
        if resolved.stopping is not None and bool(resolved.stopping(seq[:, : cur + i + 1], None).any()):
            return True, i + 1
        if i + 1 == budget:
            return True, i + 1
    return False, len(step_tokens)
