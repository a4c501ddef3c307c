""":func:`generate`: lookup decoding with ``model.generate``'s arguments and output, and the loop that runs it.

:func:`generate` checks and resolves the arguments (:class:`Job`: each row's processors, stopping criteria and
special tokens, as ``model.generate`` builds them), then runs the decoding loop (:func:`generate_batch`) over a
:class:`~lookupdec.batch.BatchRun`, for one row as for many: rows are prefilled (together, or a single row alone
without its padding), then stepped (draft, one target pass, verify, commit) until every row is done.

The prompt is prefilled in one pass that also yields the first new token, exactly as plain ``generate`` does, so
the first token is computed identically. A single row then runs unmasked, its passes as a single-sequence
generation's (no mask, no positions; on a sliding-window model, the cache that rolls back).

**Logits processors.** The verification may process a pass's positions all at once, rejected ones included (the
eager path, on an accelerator); a processor that holds state from one call to the next (classifier-free guidance,
SynthID watermarking, any processor of the user's own) would then see calls plain decoding never makes. So unless
every processor is one transformers ships without state (:func:`~lookupdec._transformers.known_stateless`), each
row's verification processes one position at a time and stops at the first rejection: the processors are called
once per generated token, in order, on the committed prefix, as ``model.generate`` calls them. A batch of several
rows with such a processor is refused: each row's processors are called for that row alone, while
``model.generate`` calls them once per step for the whole batch.
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass

import torch

from ._transformers import Resolved, batch_cache, known_stateless, resolve_generation
from .batch import BatchRun, Row
from .calibration import calibrate_or_warn
from .drafter import Drafter
from .stats import GenerationStats, LookupOutput
from .verify import verify_greedy, verify_sample

__all__ = ["GenerationStats", "LookupOutput", "generate"]

STATIC_BLOCK = 256  # a static cache holds prompt + max_new_tokens slots, rounded up to whole blocks


def generate(
    model,
    input_ids: torch.LongTensor,  # [batch, prompt_len]
    attention_mask: torch.Tensor | None = None,  # [batch, prompt_len]; left padding, as for model.generate
    *,
    max_new_tokens: int | None = None,
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
    **generation_kwargs,
) -> LookupOutput:
    """Generate with lookup drafts; the output is what ``model.generate`` would produce with the same arguments.

    Greedy output is token-identical to plain greedy decoding; sampled output follows exactly the distribution of
    plain sampling with the same processors and warpers (temperature, top-k, top-p, min-p, penalties, ...). Pass a
    ``torch.Generator`` for reproducible sampling. ``tokenizer`` is only needed for ``stop_strings``.

    ``generation_kwargs``: any other field of a ``GenerationConfig`` that decides the tokens, as
    ``model.generate`` takes it (``eos_token_id``, ``pad_token_id``, ``min_p``, ``min_new_tokens``,
    ``stop_strings``, ``no_repeat_ngram_size``, ``bad_words_ids``, ...); ``max_new_tokens`` may come from
    ``generation_config`` too. Unknown names raise ``TypeError``; beam search and the fields that change what
    ``model.generate`` returns (``return_dict_in_generate``, ``output_scores``, ...) raise ``NotImplementedError``.

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

    ``cache_implementation="static"`` (given here, or set in either generation config) runs on a preallocated
    cache, as ``model.generate`` does on transformers' fast path, and pads each pass to a width of 1, 2, 4, ...
    tokens, pricing drafts as the padded pass: a forward compiled with ``torch.compile`` then sees a few fixed
    shapes. Rows of a batch share that cache, as plain batched decoding's do; models with sliding-window layers are
    refused. Greedy output is plain decoding's on the same path (see ``docs/design.md``).

    ``logits_processor``: processors that may hold state between calls (any not shipped stateless by transformers)
    are called exactly as ``model.generate`` calls them for one row, and refused for a batch of several rows
    (module docstring). ``stopping_criteria`` get ``scores=None``, as ``model.generate``'s do without
    ``output_scores``; one that reads the scores is refused with a ``TypeError`` saying so.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids holds no rows")
    refused = sorted(key for key, value in generation_kwargs.items() if key in _OUTPUT_FIELDS and value)
    if refused:
        raise NotImplementedError(f"lookupdec.generate returns the sequences and its own stats "
                                  f"(LookupOutput); {', '.join(refused)} is not supported")
    if max_new_tokens is None:
        max_new_tokens = getattr(generation_config, "max_new_tokens", None)
    if max_new_tokens is None:
        raise ValueError("max_new_tokens is required (as an argument or in generation_config)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    static = _uses_static_cache(model, generation_config, generation_kwargs.pop("cache_implementation", None))
    mask, lengths = left_padding(input_ids, attention_mask)
    if drafter is None:
        drafter = Drafter()
    elif not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a LookupDrafter (or another lookupdec.drafter.Drafter), "
                        f"got {type(drafter).__name__}")
    job = Job(model, max_new_tokens, drafter,
              dict(generation_kwargs, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                   repetition_penalty=repetition_penalty),
              generation_config, logits_processor, stopping_criteria, generator, tokenizer, static)
    batch = input_ids.shape[0]
    if streamer is not None and batch != 1:
        raise ValueError("a streamer needs a batch of one (transformers' streamers do too)")
    if trace is None:
        traces = [None] * batch
    elif isinstance(trace, (list, tuple)):
        traces = list(trace)
    elif batch == 1:
        traces = [trace]
    else:
        raise ValueError(f"a batch of {batch} rows needs {batch} trace recorders (a list), got one")
    if len(traces) != batch:
        raise ValueError(f"a batch of {batch} rows needs {batch} trace recorders (a list), got {len(traces)}")
    with torch.inference_mode():
        started = time.perf_counter()
        out = generate_batch(job, input_ids, mask, lengths, traces, streamer)
    # The calibration is a one-time measurement, not generation: the stats leave it out.
    out.stats.total_seconds = time.perf_counter() - started - job.calibration_seconds
    for row in out.stats.rows:
        row.total_seconds = out.stats.total_seconds
    return out


def _uses_static_cache(model, generation_config, given) -> bool:
    """Whether to run on a static cache: ``cache_implementation`` as given, else as ``generation_config`` or the
    model's generation config sets it. ``"static"`` runs on a preallocated cache (what a compiled forward needs),
    ``"dynamic"`` or none on lookupdec's own growing cache. Any other implementation is refused when given; one set
    in a generation config (Gemma 3's ship ``"hybrid"``) runs on the dynamic cache, which holds every layer kind."""
    if given is not None:
        if given not in ("static", "dynamic"):
            raise NotImplementedError(f"cache_implementation={given!r} is not supported by lookupdec.generate; "
                                      f"use 'static' or 'dynamic'")
        return given == "static"
    for config in (generation_config, getattr(model, "generation_config", None)):
        value = getattr(config, "cache_implementation", None)
        if value is not None:
            return value == "static"
    return False


# model.generate arguments that change what it returns (scores, logits, a dict): lookupdec returns LookupOutput.
_OUTPUT_FIELDS = frozenset({"return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                            "output_hidden_states"})


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
    static: bool = False  # cache_implementation="static": a preallocated cache, passes in fixed widths
    calibration_seconds: float = 0.0

    def calibrate(self, rows: int = 1) -> None:
        """Give the drafter this model's measured pass cost for passes of ``rows`` rows (measured once per model,
        device, thread count and batch bucket, then from memory or disk), once the request has been checked."""
        t0 = time.perf_counter()
        calibrate_or_warn(self.drafter, self.model, rows=rows)
        self.calibration_seconds += time.perf_counter() - t0

    def resolve(self, prompt: torch.Tensor, mask: torch.Tensor | None = None) -> Resolved:
        """``prompt`` [1, width]: a row as model.generate gets it, left padding included; ``mask`` [1, width]."""
        return resolve_generation(
            self.model, prompt, max_new_tokens=self.max_new_tokens, generation_config=self.generation_config,
            logits_processor=self.logits_processor, stopping_criteria=self.stopping_criteria,
            tokenizer=self.tokenizer, attention_mask=mask, **self.overrides,
        )

    def verifier(self, resolved: Resolved):
        """``pick(logits, draft, process, position=0) -> Verdict`` for a row: the greedy rule, or exact sampling
        drawing from the job's generator (``position``, the row's output position, is not needed by either).
        Processors that may hold state are run lazily, on the committed positions only (module docstring)."""
        eager = None if known_stateless(resolved.processors) else False
        if resolved.do_sample:
            generator = self.generator
            return lambda logits, draft, process, position=0: verify_sample(logits, draft, process,
                                                                            generator=generator, eager=eager)
        return lambda logits, draft, process, position=0: verify_greedy(logits, draft, process, eager=eager)


def generate_batch(job, input_ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, traces: list,
                   streamer=None) -> LookupOutput:
    """Lookup decoding of ``input_ids`` [B, L] (left padding given by ``mask`` [B, L] bool and ``lengths`` [B]) for
    a ``loop.Job``: the one loop of :func:`lookupdec.generate`, for one row as for many. ``traces``: one recorder
    (or None) per row; ``streamer``: a batch of one only. Each row's output equals what the row alone would give.

    Several rows are prefilled together, as plain batched generate does; a single row is prefilled alone without
    its padding (:meth:`BatchRun.join`), and then runs unmasked (module docstring)."""
    batch, width = input_ids.shape
    static_slots = None
    if job.static:  # a single row is prefilled without its padding
        # Whole blocks of slots, so that prompts of similar lengths give a compiled forward the same shapes.
        static_slots = -(-((width if batch > 1 else int(lengths[0])) + job.max_new_tokens) // STATIC_BLOCK) \
            * STATIC_BLOCK
    run = BatchRun(job.model, job.drafter, static_slots=static_slots)
    if batch > 1:
        batch_cache(job.model)  # refuses sliding-window models before anything runs
    on_commit = None
    if streamer is not None:  # a batch of one: loop.generate checks it

        def on_commit(tokens: list, done: bool) -> None:
            if tokens:
                streamer.put(torch.tensor(tokens, dtype=torch.long))

    rows = []
    for r in range(batch):
        padded = input_ids[r: r + 1].to(run.device)
        start = width - int(lengths[r])
        # Resolved on the padded row and its mask, as model.generate resolves them (min_new_tokens counts from the
        # padded width; a repetition penalty skips the padding).
        resolved = job.resolve(padded, mask[r: r + 1].long())
        if batch > 1 and not known_stateless(resolved.processors):
            names = sorted({type(p).__name__ for p in resolved.processors if not known_stateless([p])})
            raise NotImplementedError(f"logits processors that may hold state between calls ({', '.join(names)}) "
                                      f"need a batch of one in lookupdec.generate: each row's processors would be "
                                      f"called for that row alone, not once per step for the whole batch as "
                                      f"model.generate calls them; pass one row at a time")
        session = job.drafter.start(padded[0, start:].cpu().numpy(), eos_ids=resolved.eos_ids,
                                    reproducible=resolved.do_sample and job.generator is not None)
        rows.append(Row(padded[:, start:], resolved, session, job.max_new_tokens, job.verifier(resolved), index=r,
                        trace=traces[r], on_commit=on_commit, padding=padded[:, :start]))
    # A batch prices drafts by its size's bucket, measured for the starting size; the single-row profile serves
    # once one row is left.
    job.calibrate(rows=1)
    if batch > 1:
        job.calibrate(rows=batch)
        run.prefill(rows, input_ids, mask, lengths)
    else:
        if streamer is not None:
            streamer.put(input_ids.cpu())
        run.join(rows[0])
    while run.rows:
        for row in run.step():
            if row.error is not None:  # one row's failure fails the call, as it fails a single-row generation
                raise row.error
    if streamer is not None:
        streamer.end()

    stats = run.stats
    stats.rows = [row.stats for row in rows]
    for row in rows:
        stats.add_row(row.stats)
    generated = max(row.generated for row in rows)
    out = torch.full((batch, width + generated), rows[0].resolved.pad_token_id, dtype=torch.long, device=run.device)
    out[:, :width] = input_ids.to(run.device)
    for row in rows:
        out[row.index, width: width + row.generated] = row.tokens
    return LookupOutput(sequences=out, stats=stats, finish_reasons=[row.finish_reason for row in rows])
