"""The ``assistant_model`` route: ``model.generate(**inputs, assistant_model=LookupDrafter(...))``.

transformers builds its ``AssistedCandidateGenerator`` around whatever it is given as ``assistant_model`` and asks it
for candidates through ``assistant_model.generate(...)``. :class:`LookupDrafter` is a
:class:`~lookupdec.drafter.Drafter` with the small surface of a ``PreTrainedModel`` that this path reads
(``config``, ``generation_config``, ``device``, ``generate``), so it stands in for a draft model without patching
transformers. The contract it honours (what transformers reads, and when) is stated here, beside the adapter;
``_transformers.py`` checks the transformers version on import.

How exactness is kept on this route: transformers verifies the candidates itself. Under greedy it keeps the prefix
equal to its own argmax; under sampling it runs its speculative-sampling rule with ``q`` = ``softmax(candidate
scores)``, and we return scores that are ``-inf`` everywhere except ``0`` at the drafted token, so ``q`` is exactly
the point mass our drafts are (``lookupdec.verify`` explains why that is exact).

Two limits of transformers' candidate interface, stated here because they cost speed, not exactness: a candidate
generator built this way stacks the scores of the drafted tokens, so it has no way to say "no draft". Under greedy
the scores are never read, so an empty draft goes back with one placeholder row and the pass is a plain step, as in
our own loop (the never-slower guard works here too). Under sampling transformers' speculative rule indexes the
scores by draft position and fails on an empty draft, so this route drafts at least one token there. And it learns
the target's vocabulary size (needed for ``q`` under sampling) from transformers' own check that the assistant
shares the target's vocabulary, which a lookup drafter always does because it copies the target's token ids.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from transformers import GenerationConfig
from transformers.utils import ModelOutput

from . import _transformers  # noqa: F401 - imported for its check of the transformers version
from .drafter import Drafter, DraftSession


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


class LookupDrafter(Drafter):
    """The drafter users hold: a :class:`~lookupdec.drafter.Drafter` that transformers also takes as an
    ``assistant_model``, through the surface of a ``PreTrainedModel`` its assisted generation reads (``config``,
    ``generation_config``, ``device``, ``generate``).

    Use it with :func:`lookupdec.generate` (one drafter may serve many requests and threads at once), or as
    ``model.generate(..., assistant_model=LookupDrafter())`` in transformers. On that route its state lives in
    ``self._hf``: one request at a time, so do not share one drafter between threads there. transformers does not
    tell a candidate generator that a request ended, so a request's output joins the rolling cache when the next
    request on the same drafter starts. Takes the arguments of :class:`~lookupdec.drafter.Drafter`.
    """

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
    if continues:
        seconds = now - state.last_call if state.last_call is not None else None
        state.session.commit(seq[len(prev):], seconds)
    else:
        if state.session is not None:
            state.session.finish()
        state.session = drafter.start(seq, eos_ids=_eos_ids(generation_config))
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
