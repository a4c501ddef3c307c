"""Everything that touches transformers' ``generate()`` internals, kept in one place.

Three jobs:

1. :func:`resolve_generation` turns the arguments of :func:`lookupdec.generate` into the exact logits processors,
   stopping criteria and special tokens plain ``model.generate`` would build, by calling the same (private)
   transformers helpers. Exactness under sampling depends on applying the same processors in the same order.
2. The ``assistant_model`` route: ``model.generate(**inputs, assistant_model=LookupDrafter(...))``. transformers
   builds its ``AssistedCandidateGenerator`` around whatever it is given as ``assistant_model`` and asks it for
   candidates through ``assistant_model.generate(...)``. :class:`AssistantProtocol` is the small surface of a
   ``PreTrainedModel`` that this path reads (``config``, ``generation_config``, ``device``, ``generate``), so a
   :class:`~lookupdec.LookupDrafter` can stand in for a draft model without patching transformers.

   How exactness is kept on this route: transformers verifies the candidates itself. Under greedy it keeps the
   prefix equal to its own argmax; under sampling it runs its speculative-sampling rule with ``q`` =
   ``softmax(candidate scores)``, and we return scores that are ``-inf`` everywhere except ``0`` at the drafted
   token, so ``q`` is exactly the point mass our drafts are (``lookupdec.verify`` explains why that is exact).

   Two limits of transformers' candidate interface, stated here because they cost speed, not exactness:
   a candidate generator built this way stacks the scores of the drafted tokens, so it has no way to say "no
   draft". Under greedy the scores are never read, so an empty draft goes back with one placeholder row and the
   pass is a plain step, as in our own loop (the never-slower guard works here too). Under sampling
   transformers' speculative rule indexes the scores by draft position and fails on an empty draft, so this
   route drafts at least one token there. And it learns the target's vocabulary size (needed for ``q`` under
   sampling) from transformers' own check that the assistant shares the target's vocabulary, which a lookup
   drafter always does because it copies the target's token ids.
3. :func:`target_forward`: one pass of the target on a ``DynamicCache`` (:func:`rollback_cache`), under whichever
   names this transformers version gives the cache and ``logits_to_keep`` (the loop and the pass-cost calibration
   share them).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessorList,
    StoppingCriteriaList,
)
from transformers.utils import ModelOutput

if TYPE_CHECKING:
    from .drafter import DraftSession, LookupDrafter

SUPPORTED_TRANSFORMERS = ">=5.24,<6"


# --------------------------------------------------------------------------------------------------------------
# 1. Resolving generation arguments exactly as model.generate does


@dataclass
class Resolved:
    generation_config: GenerationConfig
    processors: LogitsProcessorList  # empty when nothing modifies the logits (the fast greedy path)
    stopping: StoppingCriteriaList | None  # only user criteria / stop strings; EOS and length are handled inline
    eos_ids: frozenset
    do_sample: bool


def resolve_generation(
    model,
    input_ids: torch.Tensor,  # [1, prompt_len]
    *,
    max_new_tokens: int,
    generation_config: GenerationConfig | None,
    logits_processor: LogitsProcessorList | None,
    stopping_criteria: StoppingCriteriaList | None,
    tokenizer=None,
    **overrides: Any,
) -> Resolved:
    """Build the processors, stopping criteria and EOS set that ``model.generate`` would use for these arguments."""
    overrides = {key: value for key, value in overrides.items() if value is not None}
    config, unused = model._prepare_generation_config(generation_config, max_new_tokens=max_new_tokens, **overrides)
    if unused:
        raise TypeError(f"unexpected generation arguments: {sorted(unused)}")
    if config.num_beams not in (None, 1) or config.num_return_sequences not in (None, 1):
        raise NotImplementedError("lookupdec.generate supports greedy and sampling, not beam search")
    prompt_len = input_ids.shape[1]
    config.max_length = prompt_len + max_new_tokens
    if config.min_new_tokens is not None:
        config.min_length = prompt_len + config.min_new_tokens
    # True: the loop strips left padding itself, so transformers need not warn about guessing a mask.
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=input_ids.device)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_len,
        encoder_input_ids=input_ids,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        device=input_ids.device,
        model_kwargs={},
    )
    stopping = None
    if stopping_criteria or config.stop_strings:
        stopping = StoppingCriteriaList(stopping_criteria or [])
        if config.stop_strings:
            stopping = model._get_stopping_criteria(config, stopping, tokenizer=tokenizer)
    eos = config._eos_token_tensor
    eos_ids = frozenset(int(t) for t in eos.flatten().tolist()) if eos is not None else frozenset()
    return Resolved(config, processors, stopping, eos_ids, bool(config.do_sample))


# --------------------------------------------------------------------------------------------------------------
# 2. The assistant_model route


class _TargetVocab:
    """Stands for the target's vocabulary size: a lookup drafter copies the target's own token ids, so it shares
    whatever vocabulary the target has. transformers compares ``target_vocab == assistant_vocab`` before assisted
    generation; the comparison falls through to this object, which says yes and remembers the size."""

    def __init__(self, owner: _AssistantConfig):
        self._owner = owner

    def __eq__(self, other):
        if isinstance(other, (int, np.integer)):
            self._owner.vocab_size_seen = int(other)
            return True
        return NotImplemented

    def __hash__(self):
        return hash("lookupdec-target-vocab")

    def __repr__(self):
        return f"<same as target: {self._owner.vocab_size_seen}>"


class _AssistantConfig:
    """The part of a ``PretrainedConfig`` transformers reads from an assistant model."""

    is_encoder_decoder = False

    def __init__(self, vocab_size: int | None):
        self.vocab_size_seen = vocab_size
        self._vocab = _TargetVocab(self) if vocab_size is None else vocab_size

    @property
    def vocab_size(self):
        return self._vocab

    def get_text_config(self, *args, **kwargs):
        return self


class AssistantProtocol:
    """Mixed into :class:`~lookupdec.LookupDrafter`: the surface of a ``PreTrainedModel`` that transformers'
    assisted generation reads from ``assistant_model``. State lives in ``self._hf`` (one request at a time: do not
    share one drafter between threads on this route; :func:`lookupdec.generate` has no such limit). transformers
    does not tell a candidate generator that a request ended, so a request's output joins the rolling cache when
    the next request on the same drafter starts."""

    def _hf_state(self) -> _HfState:
        state = getattr(self, "_hf", None)
        if state is None:
            state = self._hf = _HfState(_AssistantConfig(self.vocab_size), self.drafter_config.max_draft)
        return state

    @property
    def config(self) -> _AssistantConfig:
        """What transformers reads as ``assistant_model.config`` (the drafter's own knobs: ``drafter_config``)."""
        return self._hf_state().config

    @property
    def generation_config(self) -> GenerationConfig:
        return self._hf_state().generation_config

    @property
    def device(self) -> torch.device:
        # Drafting is host-side numpy work; transformers moves the candidates to the target's device.
        return torch.device("cpu")

    def _supports_logits_to_keep(self) -> bool:
        return False

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, generation_config=None, **unused) -> ModelOutput:
        """Called by transformers once per step with the full sequence so far ([1, length]); returns the draft."""
        return _assistant_generate(self, self._hf_state(), input_ids, max_new_tokens, generation_config)


class _HfState:
    def __init__(self, config: _AssistantConfig, max_draft: int):
        self.config = config
        self.generation_config = GenerationConfig(
            num_assistant_tokens=max_draft,
            # Our drafter sizes its own drafts; transformers must not grow or shrink the cap.
            num_assistant_tokens_schedule="constant",
            # 0 disables transformers' confidence-threshold machinery, which needs draft probabilities.
            assistant_confidence_threshold=0.0,
        )
        self.session: DraftSession | None = None
        self.sequence: np.ndarray | None = None  # int32 [length] as of the last call
        self.last_draft: np.ndarray = np.zeros(0, dtype=np.int32)
        self.last_call: float | None = None


def _assistant_generate(
    drafter: LookupDrafter,
    state: _HfState,
    input_ids: torch.Tensor,  # [1, length]
    max_new_tokens: int,
    generation_config: GenerationConfig | None,
) -> ModelOutput:
    if input_ids.shape[0] != 1:
        raise NotImplementedError("transformers' assisted generation supports batch size 1 only")
    if generation_config is not None and generation_config.assistant_ensemble_weight is not None:
        raise ValueError("lookup drafts carry no distribution: assistant_ensemble_weight is not supported")
    if state.generation_config.assistant_confidence_threshold:  # transformers would read scores greedy never fills
        raise ValueError("lookup drafts carry no confidence: keep assistant_confidence_threshold at 0")
    now = time.perf_counter()
    seq = input_ids[0].to("cpu", torch.int32).numpy()
    prev = state.sequence
    continues = (
        state.session is not None
        and prev is not None
        and len(seq) > len(prev)
        # An O(length) memcmp per step: microseconds, and it is what tells a new request from the next step.
        and np.array_equal(seq[: len(prev)], prev)
    )
    eos = _eos_ids(generation_config)
    if continues:
        new = seq[len(prev):]
        draft = state.last_draft
        accepted = 0
        while accepted < min(len(draft), len(new) - 1) and new[accepted] == draft[accepted]:
            accepted += 1
        seconds = now - state.last_call if state.last_call is not None else None
        state.session.commit(new, accepted, seconds)
    else:
        if state.session is not None:
            state.session.finish()
        state.session = drafter.start(seq, eos_ids=eos)
    state.sequence = seq
    do_sample = bool(generation_config is not None and generation_config.do_sample)
    if do_sample:
        # transformers' sampling rule cannot verify an empty candidate (module docstring): when drafting would
        # not pay, the pass is paid anyway, so draft the length that pays best in it; with no candidate, offer
        # the likeliest token.
        draft = state.session.propose(max_new_tokens, must_draft=True)
        if len(draft) == 0 and max_new_tokens > 0:
            draft = state.session.fallback_token()
    else:
        draft = state.session.propose(max_new_tokens)
    state.last_draft = draft
    state.last_call = time.perf_counter()
    draft_ids = torch.from_numpy(draft.astype(np.int64))[None, :]  # [1, d]
    sequences = torch.cat([input_ids, draft_ids.to(input_ids.device)], dim=1)
    return ModelOutput(sequences=sequences, scores=_point_mass_scores(draft, state.config, do_sample), cache=None)


def _point_mass_scores(draft: np.ndarray, config: _AssistantConfig, do_sample: bool) -> tuple:
    """Per drafted token, logits of the draft distribution q: a point mass on the drafted token.

    Greedy verification never reads them, so they are one column wide there, and an empty draft gets one
    placeholder row (transformers stacks the rows, which fails on none); sampling needs the full vocabulary.
    """
    if not do_sample:
        return tuple(torch.zeros(1, 1) for _ in range(max(len(draft), 1)))
    vocab = config.vocab_size_seen
    if vocab is None:
        raise ValueError("pass LookupDrafter(vocab_size=model.config.vocab_size) to sample on this route")
    scores = []
    for token in draft:
        row = torch.full((1, vocab), float("-inf"))
        row[0, int(token)] = 0.0
        scores.append(row)
    return tuple(scores)


def _eos_ids(generation_config: GenerationConfig | None) -> frozenset:
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if eos is None:
        return frozenset()
    if isinstance(eos, torch.Tensor):
        return frozenset(int(t) for t in eos.flatten().tolist())
    if isinstance(eos, int):
        return frozenset([eos])
    return frozenset(int(t) for t in eos)


# --------------------------------------------------------------------------------------------------------------
# 3. One target pass


def forward_params(model) -> frozenset:
    """The keyword names ``model.forward`` takes, for :func:`target_forward` (computed once per generation)."""
    return frozenset(inspect.signature(model.forward).parameters)


def rollback_cache(model) -> DynamicCache:
    """A ``DynamicCache`` that :meth:`crop` can roll back by any number of tokens: sliding-window layers keep their
    past while a draft is pending (transformers' ``activate_past_recording``), so cropping restores them too."""
    cache = DynamicCache(config=model.config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def target_forward(model, ids: torch.Tensor, cache, keep: int, params: frozenset, mask=None,
                   positions=None) -> torch.Tensor:
    """One target pass over ``ids`` [rows, n] on ``cache``; returns the last ``keep`` logits of each row
    [rows, keep, vocab]. Batches pass a 2-D ``mask`` over cache + new slots and each row's ``positions``."""
    kwargs = {"logits_to_keep": keep} if "logits_to_keep" in params else {}
    # transformers 5.24 renamed past_key_values to cache (the old name warns, and goes in 5.40).
    kwargs["cache" if "cache" in params else "past_key_values"] = cache
    if mask is not None:
        kwargs.update(attention_mask=mask.long(), position_ids=positions)
    out = model(input_ids=ids, use_cache=True, **kwargs)
    return out.logits[:, -keep:]
