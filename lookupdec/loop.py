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

Batches (``input_ids`` [B, L], left-padded) run in ``batch.py`` on the same driver. Drafting goes through the
drafter's propose/commit driver (``Drafter.propose``, ``DraftSession.commit``), verification through ``verify.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ._device import host_buffer, input_device, synchronize
from ._transformers import (
    Resolved,
    forward_params,
    resolve_generation,
    rollback_cache,
    target_forward,
)
from .batch import generate_batch
from .calibration import calibrate_or_warn
from .drafter import Drafter
from .stats import GenerationStats, LookupOutput
from .verify import verify_greedy, verify_sample

__all__ = ["GenerationStats", "LookupOutput", "generate"]


def generate(
    model,
    input_ids: torch.LongTensor,  # [batch, prompt_len]
    attention_mask: torch.Tensor | None = None,  # [batch, prompt_len]; left padding, as for model.generate
    *,
    max_new_tokens: int,
    drafter: Drafter | None = None,
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
    mask, lengths = left_padding(input_ids, attention_mask)
    if drafter is None:
        drafter = Drafter()
    elif not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a LookupDrafter (or another lookupdec.drafter.Drafter), "
                        f"got {type(drafter).__name__}")
    job = Job(model, max_new_tokens, drafter,
              dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                   repetition_penalty=repetition_penalty),
              generation_config, logits_processor, stopping_criteria, generator, tokenizer)
    with torch.inference_mode():
        started = time.perf_counter()
        if input_ids.shape[0] == 1:
            out = _generate(job, input_ids, int(lengths[0]), streamer, trace)
        else:
            if streamer is not None:
                raise ValueError("a streamer needs a batch of one (transformers' streamers do too)")
            out = generate_batch(job, input_ids, mask, lengths, trace)
    # The calibration is a one-time measurement, not generation: the stats leave it out.
    out.stats.total_seconds = time.perf_counter() - started - job.calibration_seconds
    for row in out.stats.rows:
        row.total_seconds = out.stats.total_seconds
    return out


def left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple:
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


@dataclass
class Job:
    """What every row of one :func:`generate` call shares: the model, the drafter, the budget, and the arguments
    that :func:`~lookupdec._transformers.resolve_generation` turns into each row's processors and stops."""

    model: object
    max_new_tokens: int
    drafter: Drafter
    overrides: dict
    generation_config: object
    logits_processor: object
    stopping_criteria: object
    generator: torch.Generator | None
    tokenizer: object
    calibration_seconds: float = 0.0

    def calibrate(self, rows: int = 1) -> None:
        """Give the drafter this model's measured pass cost for passes of ``rows`` rows (measured once per model,
        device, thread count and batch bucket, then from memory or disk), once the request has been checked."""
        t0 = time.perf_counter()
        calibrate_or_warn(self.drafter, self.model, rows=rows)
        self.calibration_seconds += time.perf_counter() - t0

    def resolve(self, prompt: torch.Tensor) -> Resolved:  # prompt [1, prompt_len]
        return resolve_generation(
            self.model, prompt, max_new_tokens=self.max_new_tokens, generation_config=self.generation_config,
            logits_processor=self.logits_processor, stopping_criteria=self.stopping_criteria,
            tokenizer=self.tokenizer, **self.overrides,
        )

    def verifier(self, resolved: Resolved):
        """``pick(logits, draft, process, position=0) -> Verdict`` for a row: the greedy rule, or exact sampling
        drawing from the job's generator (``position``, the row's output position, is not needed by either)."""
        if resolved.do_sample:
            generator = self.generator
            return lambda logits, draft, process, position=0: verify_sample(logits, draft, process,
                                                                            generator=generator)
        return lambda logits, draft, process, position=0: verify_greedy(logits, draft, process)


def _generate(job: Job, input_ids: torch.Tensor, length: int, streamer, trace) -> LookupOutput:
    model, max_new_tokens, drafter = job.model, job.max_new_tokens, job.drafter
    device = input_device(model)  # drafts go where the model reads its input; logits are read where they are
    # Batch of one: left padding carries no information; drop it and put it back in the output.
    padding = input_ids.shape[1] - length
    prompt = input_ids[:, padding:].to(device)
    prompt_len = prompt.shape[1]
    resolved = job.resolve(prompt)
    stats = GenerationStats()

    # seq holds prompt + committed tokens (and, during a step, the draft): processors and stopping criteria read
    # prefixes of it. A draft never exceeds the remaining budget minus one, so this is enough room.
    seq = torch.empty((1, prompt_len + max_new_tokens), dtype=torch.long, device=device)
    seq[:, :prompt_len] = prompt
    cur = prompt_len  # committed length
    feed_host = host_buffer(drafter.drafter_config.max_draft + 1, device)  # [last token, draft...]

    processors = resolved.processors

    def process(pos: int, row: torch.Tensor) -> torch.Tensor:  # row [vocab] -> processed [vocab]
        return processors(seq[:, : cur + pos].to(row.device), row[None, :].float())[0]

    process_fn = process if len(processors) else None
    pick = job.verifier(resolved)

    cache = rollback_cache(model)
    params = forward_params(model)

    if streamer is not None:
        streamer.put(input_ids.cpu())

    job.calibrate()
    session = drafter.start(prompt[0].cpu().numpy(), eos_ids=resolved.eos_ids)
    t0 = time.perf_counter()
    logits = target_forward(model, prompt, cache, 1, params)[0]  # [1, vocab]
    synchronize(logits.device)
    pass_seconds = time.perf_counter() - t0
    stats.model_seconds += pass_seconds
    stats.target_passes += 1
    draft = np.zeros(0, dtype=np.int32)
    verdict = pick(logits, draft, process_fn)
    step_tokens = [verdict.token]
    if trace is not None:
        trace.start(prompt[0].tolist())
    step_started = None
    while True:
        # Commit step_tokens (the previous pass's accepted tokens + its target token). The accepted tokens are in
        # seq already (the draft was written there); the target's token goes after them.
        n_new = len(step_tokens)
        seq[0, cur + n_new - 1] = step_tokens[-1]
        done, keep = resolved.stop(step_tokens, seq, cur, max_new_tokens - (cur - prompt_len))
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
        session.commit(np.asarray(step_tokens, dtype=np.int32), seconds)
        step_started = t0
        # The bonus/recovered token always follows the draft, so the draft may use all but one of the budget.
        draft = drafter.propose([session], [max_new_tokens - (cur - prompt_len) - 1])[0]
        stats.draft_seconds += time.perf_counter() - t0
        d = len(draft)
        feed_host[0] = step_tokens[-1]
        feed_host[1: d + 1] = torch.from_numpy(draft.astype(np.int64))
        feed = feed_host[: d + 1].to(device, non_blocking=True)[None, :]  # [1, d + 1]: last committed + draft
        seq[0, cur: cur + d] = feed[0, 1:]

        t0 = time.perf_counter()
        logits = target_forward(model, feed, cache, d + 1, params)[0]  # [d + 1, vocab]
        synchronize(logits.device)
        pass_seconds = time.perf_counter() - t0
        stats.model_seconds += pass_seconds
        stats.target_passes += 1

        verdict = pick(logits, draft, process_fn)
        stats.record(d, verdict.accepted)
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
    return LookupOutput(sequences=out.clone(), stats=stats)
