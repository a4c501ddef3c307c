"""The only module that knows transformers' internals (the ``assistant_model`` contract aside, which
``assistant.py`` states next to the adapter that honours it).

- :func:`resolve_generation` turns the arguments of :func:`lookupdec.generate` into the exact logits processors,
  stopping criteria and special tokens plain ``model.generate`` would build, by calling the same (private)
  transformers helpers. Exactness under sampling depends on applying the same processors in the same order.
- :func:`target_forward`: one pass of the target on a ``DynamicCache`` (:func:`rollback_cache`), under whichever
  names this transformers version gives the cache and ``logits_to_keep``.
- :func:`gather_cache_slots`, :func:`append_cache_rows`: moving a batch's cache slots (the batch loop's compaction)
  and adding a request's rows to a running batch, through the cache layers.

Importing this module checks the transformers version: lookupdec calls private helpers whose names and
signatures change between releases, so an untested version fails here, clearly, instead of deep inside a
generation. ``LOOKUPDEC_ALLOW_UNTESTED_TRANSFORMERS=1`` turns the error into a warning, at the user's risk.
"""

from __future__ import annotations

import inspect
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList

TESTED = ((5, 24), (6, 0))  # >= 5.24, < 6: the range pyproject.toml admits and the tests run on


def _check_version(version: str) -> None:
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if TESTED[0] <= numbers < TESTED[1]:
        return
    message = (f"lookupdec needs transformers >=5.24,<6 (it calls transformers' generation internals, which change "
               f"between releases); found {version}. Install a supported version: pip install 'transformers>=5.24,<6'")
    if os.environ.get("LOOKUPDEC_ALLOW_UNTESTED_TRANSFORMERS") == "1":
        warnings.warn(message + " (continuing: LOOKUPDEC_ALLOW_UNTESTED_TRANSFORMERS=1)", stacklevel=2)
        return
    raise ImportError(message)


_check_version(transformers.__version__)


# --------------------------------------------------------------------------------------------------------------
# Resolving generation arguments exactly as model.generate does


@dataclass
class Resolved:
    generation_config: GenerationConfig
    processors: LogitsProcessorList  # empty when nothing modifies the logits (the fast greedy path)
    stopping: StoppingCriteriaList | None  # only user criteria / stop strings; EOS and length are handled inline
    eos_ids: frozenset
    do_sample: bool

    def stop(self, step_tokens, seq: torch.Tensor, cur: int, budget: int) -> tuple:
        """``(done, keep)`` for a pass that appends ``step_tokens`` after ``cur`` committed tokens of ``seq``
        [1, length] (already written there), with ``budget`` new tokens left: keep the first ``keep``, and end
        generation there (``done``) at the first EOS, at the budget, or where a stopping criterion (stop strings,
        user criteria) first fires."""
        for i, token in enumerate(step_tokens):
            if i + 1 > budget:
                return True, i
            if token in self.eos_ids:
                return True, i + 1
            if self.stopping is not None and bool(self.stopping(seq[:, : cur + i + 1], None).any()):
                return True, i + 1
            if i + 1 == budget:
                return True, i + 1
        return False, len(step_tokens)

    @property
    def pad_token_id(self) -> int:
        """What pads a batch's finished rows, as in ``model.generate``: the pad token, else the first EOS."""
        config = self.generation_config
        for token in (config.pad_token_id, next(iter(sorted(self.eos_ids)), None)):
            if token is not None:
                return int(token[0] if isinstance(token, (list, tuple)) else token)
        return 0


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
# One target pass, and the cache it runs on


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


def batch_cache(model) -> DynamicCache:
    """The cache of a batched generation; ``NotImplementedError`` for a model with sliding-window layers (a window
    counts cache slots, and the batch loop leaves masked holes between a row's slots, which would shrink it)."""
    cache = DynamicCache(config=model.config)
    if any(cache.is_sliding):
        raise NotImplementedError("batched lookup decoding needs a model without sliding-window attention; "
                                  "pass one row at a time")
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


def append_cache_rows(cache: DynamicCache, other: DynamicCache) -> None:
    """Append the rows of ``other`` to ``cache`` (both of the same model), in every layer; whichever holds fewer
    slots is left-padded with zeros, which the caller's attention mask must leave out."""
    for layer, new in zip(cache.layers, other.layers, strict=True):
        width = max(layer.keys.shape[2], new.keys.shape[2])
        layer.keys = torch.cat([_pad_slots(layer.keys, width), _pad_slots(new.keys, width)])
        layer.values = torch.cat([_pad_slots(layer.values, width), _pad_slots(new.values, width)])


def _pad_slots(states: torch.Tensor, width: int) -> torch.Tensor:  # [rows, heads, slots, dim]
    return torch.nn.functional.pad(states, (0, 0, width - states.shape[2], 0)) if states.shape[2] < width else states


def gather_cache_slots(cache: DynamicCache, order: torch.Tensor) -> None:
    """Keep, for each row ``i``, the cache slots ``order[i]`` [rows, kept] in that order, in every layer."""
    for layer in cache.layers:
        index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        layer.keys = torch.gather(layer.keys, 2, index)
        index = order[:, None, :, None].expand(-1, layer.values.shape[1], -1, layer.values.shape[3])
        layer.values = torch.gather(layer.values, 2, index)
