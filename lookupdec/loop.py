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
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch
from transformers import DynamicCache

from .drafter import LookupDrafter
from .hf import resolve_generation
from .verify import verify_greedy, verify_sample


@dataclass
class GenerationStats:
    target_passes: int = 0  # target forward passes, the prefill included
    new_tokens: int = 0
    # accepted_per_position[pos]: drafts whose token at draft position pos was accepted;
    # drafted_per_position[pos]: drafts that had a token at position pos.
    accepted_per_position: List[int] = field(default_factory=list)
    drafted_per_position: List[int] = field(default_factory=list)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_seconds: float = 0.0  # proposing drafts and updating the drafter
    model_seconds: float = 0.0  # target forward passes (prefill included)
    total_seconds: float = 0.0

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
    input_ids: torch.LongTensor,  # [1, prompt_len]
    attention_mask: Optional[torch.Tensor] = None,  # [1, prompt_len]; left padding is allowed
    *,
    max_new_tokens: int,
    drafter: Optional[LookupDrafter] = None,
    do_sample: Optional[bool] = None,
    temperature: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    repetition_penalty: Optional[float] = None,
    generation_config=None,
    logits_processor=None,
    stopping_criteria=None,
    streamer=None,
    generator: Optional[torch.Generator] = None,
    tokenizer=None,
    trace=None,
) -> LookupOutput:
    """Generate with lookup drafts; the output is what ``model.generate`` would produce with the same arguments.

    Greedy output is token-identical to plain greedy decoding; sampled output follows exactly the distribution of
    plain sampling with the same processors and warpers (temperature, top-k, top-p, penalties, ...). Pass a
    ``torch.Generator`` for reproducible sampling. ``tokenizer`` is only needed for ``stop_strings``.
    ``trace`` (e.g. a :class:`lookupdec.trace.TraceRecorder`) is told about every target pass: its
    ``start(prompt)`` gets the prompt's token ids, then ``step(draft, accepted, token, kept, seconds)`` runs once
    per pass, the prefill first (empty draft); ``kept`` is how many of the pass's ``accepted + 1`` tokens were
    committed (fewer only where generation stopped), ``seconds`` the pass's forward time.
    Unset arguments fall back to ``generation_config``, then to ``model.generation_config``, as in transformers.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise NotImplementedError("lookupdec.generate handles batch size 1 for now")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    with torch.inference_mode():
        return _generate(
            model, input_ids, attention_mask, max_new_tokens, drafter or LookupDrafter(),
            dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                 repetition_penalty=repetition_penalty),
            generation_config, logits_processor, stopping_criteria, streamer, generator, tokenizer, trace,
        )


def _generate(model, input_ids, attention_mask, max_new_tokens, drafter, overrides, generation_config,
              logits_processor, stopping_criteria, streamer, generator, tokenizer, trace) -> LookupOutput:
    started = time.perf_counter()
    device = model.device
    padding = 0
    if attention_mask is not None and not bool(attention_mask.all()):
        # Batch of one: left padding carries no information; drop it and put it back in the output.
        padding = int((attention_mask[0] == 0).sum())
        if bool(attention_mask[0, padding:].all()) is False or bool(attention_mask[0, :padding].any()):
            raise ValueError("attention_mask must be left padding (zeros first, then ones)")
    prompt = input_ids[:, padding:].to(device)
    prompt_len = prompt.shape[1]
    if prompt_len == 0:
        raise ValueError("input_ids is empty")
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

    cache = DynamicCache(config=model.config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    params = frozenset(inspect.signature(model.forward).parameters)

    if streamer is not None:
        streamer.put(input_ids.cpu())

    session = drafter.start(prompt[0].cpu().numpy(), eos_ids=resolved.eos_ids)
    t0 = time.perf_counter()
    logits = _forward(model, prompt, cache, 1, params)  # [1, vocab]
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
        logits = _forward(model, feed, cache, d + 1, params)  # [d + 1, vocab]
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


def _forward(model, ids: torch.Tensor, cache, keep: int, params: frozenset) -> torch.Tensor:
    """One target pass over ``ids`` [1, n] on ``cache``; returns the last ``keep`` rows of logits [keep, vocab]."""
    kwargs = {"logits_to_keep": keep} if "logits_to_keep" in params else {}
    # transformers 5.24 renamed past_key_values to cache (the old name warns, and goes in 5.40).
    kwargs["cache" if "cache" in params else "past_key_values"] = cache
    out = model(input_ids=ids, use_cache=True, **kwargs)
    return out.logits[0, -keep:]


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
