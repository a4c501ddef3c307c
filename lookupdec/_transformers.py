"""The only module that knows transformers' internals (the ``assistant_model`` contract aside, which
``assistant.py`` states next to the adapter that honours it).

- :func:`resolve_generation` turns the arguments of :func:`lookupdec.generate` into the exact logits processors,
  stopping criteria and special tokens plain ``model.generate`` would build, by calling the same (private)
  transformers helpers. Exactness under sampling depends on applying the same processors in the same order.
  ``stable_temperature`` swaps transformers' temperature warper for :class:`StableTemperatureLogitsWarper`, which
  gives the distribution a temperature names for every temperature, however small.
- :func:`target_forward`: one pass of the target on a ``DynamicCache`` (:func:`rollback_cache`), under whichever
  names this transformers version gives the cache and ``logits_to_keep``; :func:`crop_cache` drops a pass's
  rejected slots.
- :func:`known_stateless`: whether a list of logits processors holds no state from one call to the next (the
  verification may then run them on positions whose tokens are then rejected).
- :class:`BlockLayer`: a full-attention cache layer that grows in blocks instead of reallocating at every pass.
- :func:`gather_cache_slots`, :func:`append_cache_rows`: moving a batch's cache slots (the batch loop's compaction)
  and adding a request's rows to a running batch, through the cache layers.
- :func:`use_grouped_attention`: transformers' SDPA attention, except that a pass of several new tokens on a CPU
  reads a grouped-query model's shared key/value heads in place instead of copying them once per query head; the
  same numbers, bit for bit (:data:`GROUPED_ATTENTION`).

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
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StaticCache, StoppingCriteriaList
from transformers.cache_utils import DynamicLayer
from transformers.generation import logits_process
from transformers.generation.logits_process import LogitsProcessor, TemperatureLogitsWarper
from transformers.integrations.sdpa_attention import sdpa_attention_forward

TESTED = ((5, 24), (6, 0))  # >= 5.24, < 6: the range the tests run on (pyproject.toml admits older ones for the
# vLLM side, which needs no transformers internals: this check guards lookupdec's own engine)


def _release(version: str) -> tuple:
    """``(major, minor)`` of a version string such as ``"5.25.0"`` or ``"2.13.0+cpu"``."""
    return tuple(int(n) for n in re.findall(r"\d+", version)[:2])


def _check_version(version: str) -> None:
    if TESTED[0] <= _release(version) < TESTED[1]:
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
        """``(done, kept)`` for a pass that appends ``step_tokens`` after ``cur`` committed tokens of ``seq``
        [1, length] (already written there), with ``budget`` new tokens left: commit the first ``kept``, and end
        generation there (``done``) at the first EOS, at the budget, or where a stopping criterion (stop strings,
        user criteria) first fires."""
        for i, token in enumerate(step_tokens):
            if i + 1 > budget:
                return True, i
            if token in self.eos_ids:
                return True, i + 1
            if self.criteria_hit(seq[:, : cur + i + 1]):
                return True, i + 1
            if i + 1 == budget:
                return True, i + 1
        return False, len(step_tokens)

    def criteria_hit(self, seq: torch.Tensor) -> bool:
        """Whether a stopping criterion (stop strings, the user's) fires on ``seq`` [1, length]. The criteria get
        ``scores=None``, as ``model.generate``'s do unless ``return_dict_in_generate=True, output_scores=True``
        (which lookupdec does not support); a criterion that fails on ``None`` is refused with a message saying
        so."""
        if self.stopping is None:
            return False
        try:
            return bool(self.stopping(seq, None).any())
        except (TypeError, AttributeError) as err:
            if "NoneType" not in str(err):
                raise
            raise TypeError(f"a stopping criterion failed ({type(err).__name__}: {err}): lookupdec.generate passes "
                            f"scores=None to stopping criteria, as model.generate does without "
                            f"output_scores=True, which lookupdec does not support; a criterion that reads the "
                            f"scores cannot run here") from err

    @property
    def pad_token_id(self) -> int:
        """What pads a batch's finished rows, as in ``model.generate``: the pad token, else the first EOS id in
        the generation config's order (transformers' ``_prepare_special_tokens`` picks it), else 0."""
        config = self.generation_config
        token = getattr(config, "_pad_token_tensor", None)
        if token is None:
            token = config.pad_token_id
        if token is None:
            return 0
        if isinstance(token, torch.Tensor):
            return int(token.flatten()[0])
        return int(token[0] if isinstance(token, (list, tuple)) else token)


def resolve_generation(
    model,
    input_ids: torch.Tensor,  # [1, prompt_len]
    *,
    max_new_tokens: int,
    generation_config: GenerationConfig | None,
    logits_processor: LogitsProcessorList | None,
    stopping_criteria: StoppingCriteriaList | None,
    tokenizer=None,
    stable_temperature: bool = False,
    attention_mask: torch.Tensor | None = None,
    **overrides: Any,
) -> Resolved:
    """Build the processors, stopping criteria and EOS set that ``model.generate`` would use for these arguments.

    ``stable_temperature``: replace transformers' temperature warper, in place (it comes before top-k / top-p), by
    :class:`StableTemperatureLogitsWarper`, which gives the same distribution (to rounding) where transformers' is
    finite, and the right one where transformers' overflows (a tiny temperature). Off by default:
    :func:`lookupdec.generate` must apply exactly what ``model.generate`` applies; the server turns it on, since its
    API accepts any temperature in (0, 2].

    ``input_ids`` is the row as ``model.generate`` gets it, left padding included, and ``attention_mask`` [1,
    prompt_len] its mask: processors that read the prompt (a repetition penalty skips the padding, as there) are
    built from both, so they see what ``model.generate``'s see."""
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
        model_kwargs={} if attention_mask is None else {"attention_mask": attention_mask.to(input_ids.device)},
    )
    if stable_temperature:
        processors = LogitsProcessorList(
            StableTemperatureLogitsWarper(p.temperature) if isinstance(p, TemperatureLogitsWarper) else p
            for p in processors)
    stopping = None
    if stopping_criteria or config.stop_strings:
        stopping = StoppingCriteriaList(stopping_criteria or [])
        if config.stop_strings:
            stopping = model._get_stopping_criteria(config, stopping, tokenizer=tokenizer)
    eos = config._eos_token_tensor
    eos_ids = frozenset(int(t) for t in eos.flatten().tolist()) if eos is not None else frozenset()
    return Resolved(config, processors, stopping, eos_ids, bool(config.do_sample))


# transformers' logits processors that hold no state from one call to the next: their ``__call__`` changes nothing
# of theirs but the device of their own constants (or prepares them once, the same way every time), so calling one
# on a position whose token is then rejected changes none of its later calls. Exact types: a subclass may add state.
# Not here: classifier-free guidance (runs the model on its own cache, one token per call), SynthID watermarking
# (keeps a context across calls), prefix_allowed_tokens_fn (calls user code), and every processor of the user's own.
_STATELESS_PROCESSORS = frozenset(
    cls for cls in (getattr(logits_process, name, None) for name in (
        "EncoderNoRepeatNGramLogitsProcessor", "EncoderRepetitionPenaltyLogitsProcessor", "EpsilonLogitsWarper",
        "EtaLogitsWarper", "ExponentialDecayLengthPenalty", "ForcedBOSTokenLogitsProcessor",
        "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor", "LogitNormalization",
        "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "MinPLogitsWarper",
        "NoBadWordsLogitsProcessor", "NoRepeatNGramLogitsProcessor", "RepetitionPenaltyLogitsProcessor",
        "SequenceBiasLogitsProcessor",
        "SuppressTokensAtBeginLogitsProcessor", "SuppressTokensLogitsProcessor", "TemperatureLogitsWarper",
        "TopHLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "TypicalLogitsWarper", "WatermarkLogitsProcessor",
    )) if cls is not None)


def known_stateless(processors) -> bool:
    """Whether every processor of ``processors`` is one of transformers' (or lookupdec's) that hold no state from
    one call to the next. Others may (classifier-free guidance, SynthID watermarking, any of the user's own): the
    decoding loop calls them only on positions whose tokens it commits, in order, as ``model.generate`` does."""
    return all(type(p) in _STATELESS_PROCESSORS or type(p) is StableTemperatureLogitsWarper for p in processors)


class StableTemperatureLogitsWarper(LogitsProcessor):
    """``softmax`` of its output is ``softmax(scores / temperature)`` for every temperature > 0.

    transformers' ``TemperatureLogitsWarper`` computes ``scores / temperature``, which overflows to ``inf`` in
    float32 once the temperature is below about ``|score| / 3.4e38`` (1e-40 always does), and ``inf - inf`` makes
    the softmax NaN. Softmax is unchanged by subtracting a row's maximum, and ``(scores - max) / temperature`` cannot
    overflow upwards: the maximum entries become 0 and the others a finite negative number or ``-inf``. As the
    temperature goes to 0 the distribution becomes a point mass on the argmax (uniform over exact ties), which is
    what this gives. The maxima are pinned to 0 explicitly because a temperature below the dtype's smallest
    subnormal rounds to 0 there, and ``0 / 0`` is NaN."""

    def __init__(self, temperature: float):
        if not (isinstance(temperature, float) and temperature > 0):
            raise ValueError(f"temperature must be a float > 0, got {temperature!r}")
        self.temperature = temperature

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:  # scores [rows, vocab]
        shifted = scores - scores.max(dim=-1, keepdim=True).values
        return torch.where(shifted == 0, shifted, shifted / self.temperature)


# --------------------------------------------------------------------------------------------------------------
# Attention for passes of several tokens

GROUPED_ATTENTION = "lookupdec_sdpa"  # the attention implementation use_grouped_attention() selects
_GQA_KERNEL = _release(torch.__version__) >= (2, 5)  # SDPA's enable_gqa


def _grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                  **kwargs):
    """transformers' ``sdpa`` attention, except for a masked pass of several query tokens on a CPU in a model with
    grouped-query heads (a drafted pass, a prefill under a padding mask): transformers copies every key/value head
    once per query head it serves (``repeat_kv``) before calling the kernel, so a drafted pass's cost grows with
    rows x context (8 rows at 512 tokens of context: one drafted token cost 1.75 plain steps instead of 1.33; at
    2048, 6.5 instead of 1.3). Here the kernel reads the shared heads itself (``enable_gqa``), which on a CPU
    computes the same numbers bit for bit (x86_64, torch 2.13, fp32 and bf16: tests/test_transformers_attention.py
    checks it wherever the tests run). A one-token step, a pass without a mask, and every other device go to
    transformers' function unchanged."""
    if (query.shape[2] > 1 and attention_mask is not None and query.device.type == "cpu" and not module.training
            and getattr(module, "num_key_value_groups", 1) > 1 and key.shape[-1] == value.shape[-1]
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False)):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask[..., : key.shape[-2]], scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def use_grouped_attention(model) -> bool:
    """Switch ``model`` from transformers' ``sdpa`` attention to :func:`_grouped_sdpa` (registered as
    :data:`GROUPED_ATTENTION`) where that can change its speed and not its numbers: on a CPU, with torch 2.5 or
    newer, for a model whose attention is ``sdpa``. Returns whether it switched. :func:`lookupdec.load_model` does
    this for the models it loads; a model loaded otherwise keeps its attention unless its owner calls this
    (``lookupdec.use_grouped_attention(model)``)."""
    config = model.config
    if not (_GQA_KERNEL and model.device.type == "cpu" and getattr(config, "_attn_implementation", None) == "sdpa"):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_ATTENTION, _grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_ATTENTION, sdpa_mask)  # the masks sdpa gets
    model.set_attn_implementation(GROUPED_ATTENTION)
    return config._attn_implementation == GROUPED_ATTENTION


# --------------------------------------------------------------------------------------------------------------
# One target pass, and the cache it runs on


def stateless_passes(model) -> bool:
    """Whether two passes of ``model`` may run at once, on caches of their own (a prefill beside a batch's step):
    not where a rotary embedding recomputes its frequencies in a pass ("dynamic" and "longrope" RoPE write them to
    the module, for the longest position the pass sees)."""
    for module in model.modules():
        kind = getattr(module, "rope_type", None)
        kinds = kind.values() if isinstance(kind, dict) else [kind]
        if any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds):
            return False
    return True


def forward_params(model) -> frozenset:
    """The keyword names ``model.forward`` takes, for :func:`target_forward` (computed once per generation)."""
    return frozenset(inspect.signature(model.forward).parameters)


def rollback_cache(model, *, blocks: bool = True) -> DynamicCache:
    """A ``DynamicCache`` that :meth:`crop` can roll back by any number of tokens: sliding-window layers keep their
    past while a draft is pending (transformers' ``activate_past_recording``), so cropping restores them too.
    ``blocks``: when every layer is a plain full-attention layer, they grow in blocks (:class:`BlockLayer`)."""
    cache = DynamicCache(config=model.config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return _in_blocks(cache) if blocks else cache


def batch_cache(model, *, blocks: bool = True) -> DynamicCache:
    """The cache of a batched generation, its layers growing in blocks (:class:`BlockLayer`) unless ``blocks`` is
    false; ``NotImplementedError`` for a model with sliding-window layers (a window counts cache slots, and the
    batch loop leaves masked holes between a row's slots, which would shrink it)."""
    cache = DynamicCache(config=model.config)
    if any(cache.is_sliding):
        raise NotImplementedError("batched lookup decoding needs a model without sliding-window attention; "
                                  "pass one row at a time")
    return _in_blocks(cache) if blocks else cache


def static_cache(model, slots: int) -> StaticCache:
    """A preallocated cache of ``slots`` positions per row (transformers' ``StaticCache``, as
    ``cache_implementation="static"`` gives ``model.generate``): every pass attends over the same number of slots,
    so a compiled forward keeps its shapes, and a pass writes in place. ``crop`` only moves the write position back
    (the rejected slots are overwritten by the next pass, and no query sees them: they lie after it). Every row
    writes at the same slots (one write position), as in a batch on a growing cache. Raises
    ``NotImplementedError`` for a model with sliding-window layers (a static window cannot roll back)."""
    cache = StaticCache(config=model.config, max_cache_len=slots)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise NotImplementedError("cache_implementation='static' needs a model without sliding-window attention "
                                  "(a static window cannot roll back a rejected draft); pass "
                                  "cache_implementation='dynamic'")
    return cache


def _in_blocks(cache: DynamicCache) -> DynamicCache:
    """``cache`` with its layers replaced by :class:`BlockLayer` when every one is a plain ``DynamicLayer``
    (sliding-window, linear-attention and shared layers keep transformers' own classes, and the whole cache then
    stays as it is: one kind of layer is what the tests cover)."""
    if cache.layers:
        if all(type(layer) is DynamicLayer and not layer.is_initialized for layer in cache.layers):
            cache.layers = [BlockLayer() for _ in cache.layers]
    elif cache.layer_class_to_replicate is DynamicLayer:  # a config without layer types: layers come lazily
        cache.layer_class_to_replicate = BlockLayer
    return cache


class BlockLayer(DynamicLayer):
    """A full-attention cache layer whose ``keys`` / ``values`` [rows, heads, slots, dim] are views of the first
    ``slots`` positions of a larger buffer (its *room*), grown by whole blocks of :attr:`block_slots` positions.

    transformers' ``DynamicLayer`` concatenates at every pass, so every decoding step reallocates every layer one
    step longer; that churn fragments the host heap. Here a pass writes into the room and moves the view's end;
    only every ``block_slots`` tokens (per row) is a layer reallocated. :meth:`crop` (inherited) only shortens the
    view, without a copy.

    Invariant: the room is used only while ``keys`` (resp. ``values``) is still a prefix view of it. Code that
    treats the layer as a ``DynamicLayer`` and assigns ``layer.keys`` (transformers' ``offload``,
    ``reorder_cache``, ``batch_repeat_interleave``) makes that tensor the truth again, and the next :meth:`update`
    copies it into a fresh room; so the class cannot disagree with such code. This module's own
    :func:`gather_cache_slots` and :func:`append_cache_rows` build their result in a room with spare blocks.

    Writing into the room after a crop overwrites slots an older, longer view still sees: nothing may keep a view
    from one pass to the next (the models only read the views ``update`` returns, within the pass).
    """

    block_slots = 256  # a 2k-token answer reallocates 8 times instead of 2,000; rows carry < 256 spare slots

    def __init__(self, **kwargs):
        self._key_room: torch.Tensor | None = None  # [rows, heads, capacity, dim]
        self._value_room: torch.Tensor | None = None
        super().__init__(**kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:  # states [rows, heads, new, dim]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self._key_room = _extend(self.keys, self._key_room, key_states, self.block_slots)
        self.values, self._value_room = _extend(self.values, self._value_room, value_states, self.block_slots)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices``, selected from the rooms (one copy, the spare slots kept)."""
        if self.get_seq_length() > 0 and _is_prefix(self.keys, self._key_room) \
                and _is_prefix(self.values, self._value_room):
            slots = self.keys.shape[2]
            self._key_room = self._key_room[indices]
            self._value_room = self._value_room[indices]
            self.keys, self.values = self._key_room[:, :, :slots], self._value_room[:, :, :slots]
        else:
            super().batch_select_indices(indices)

    def reset(self) -> None:
        self._key_room = self._value_room = None
        super().reset()


def _is_prefix(view: torch.Tensor | None, room: torch.Tensor | None) -> bool:
    """Whether ``view`` is ``room[:, :, :n]`` for some ``n`` (the same memory, rows, heads, dim and strides)."""
    return (room is not None and view is not None and view.dim() == 4 and view.data_ptr() == room.data_ptr()
            and view.dtype == room.dtype and view.device == room.device and view.stride() == room.stride()
            and view.shape[:2] == room.shape[:2] and view.shape[3] == room.shape[3])


def _extend(view: torch.Tensor, room: torch.Tensor | None, new: torch.Tensor, block: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view + new, room)``: ``new`` [rows, heads, m, dim] written after ``view`` [rows, heads, n, dim] in
    ``room``, or in a fresh room of a whole number of blocks (``view`` copied in first) when ``view`` is not a
    prefix of ``room`` or ``room`` has no space left."""
    n = view.shape[2] if view.dim() == 4 else 0  # lazy initialisation leaves a 1-D empty tensor
    end = n + new.shape[2]
    fits = (_is_prefix(view, room) and room.dtype == new.dtype and end <= room.shape[2]
            and room.shape[:2] == new.shape[:2] and room.shape[3] == new.shape[3])  # no silent broadcast
    if not fits:
        room = new.new_empty((new.shape[0], new.shape[1], _blocks(end, block), new.shape[3]))
        if n:
            room[:, :, :n] = view
    room[:, :, n:end] = new
    return room[:, :, :end], room


def _blocks(slots: int, block: int) -> int:
    return -(-slots // block) * block


def _capacity(layer, slots: int) -> int:
    """The room to give ``layer`` for ``slots`` used slots: whole blocks for a :class:`BlockLayer`, else exactly."""
    return _blocks(slots + 1, layer.block_slots) if isinstance(layer, BlockLayer) else slots


def _set_rooms(layer, key_room: torch.Tensor, value_room: torch.Tensor, slots: int) -> None:
    """Make the first ``slots`` slots of the rooms [rows, heads, capacity, dim] ``layer``'s keys and values. Plain
    assignments only: nothing here can fail half-way."""
    if isinstance(layer, BlockLayer):
        layer._key_room, layer._value_room = key_room, value_room
    layer.keys, layer.values = key_room[:, :, :slots], value_room[:, :, :slots]


def target_forward(model, ids: torch.Tensor, cache, n_logits: int, params: frozenset, mask=None,
                   positions=None) -> torch.Tensor:
    """One target pass over ``ids`` [rows, n] on ``cache``; returns the last ``n_logits`` logits of each row
    [rows, n_logits, vocab]. Batches pass a 2-D ``mask`` over cache + new slots and each row's ``positions``."""
    kwargs = {"logits_to_keep": n_logits} if "logits_to_keep" in params else {}
    # transformers 5.24 renamed past_key_values to cache (the old name warns, and goes in 5.40).
    kwargs["cache" if "cache" in params else "past_key_values"] = cache
    if mask is not None:
        kwargs.update(attention_mask=mask.long(), position_ids=positions)
    out = model(input_ids=ids, use_cache=True, **kwargs)
    return out.logits[:, -n_logits:]


def crop_cache(cache, slots: int) -> None:
    """Drop the last ``slots`` slots of every row of ``cache`` (a pass's rejected positions and filler). With none
    to drop, no full-attention or static layer is cropped at all (transformers before 5.24 read ``crop(0)`` as
    "keep no token"); layers that record their past while a draft is pending (sliding-window and linear-attention
    layers of a :func:`rollback_cache`) are still trimmed back to what the next pass needs, which is what their
    ``crop(0)`` does, and what transformers' own assisted decoding runs after every pass."""
    if slots > 0:
        cache.crop(-slots)
        return
    for layer in cache.layers:
        if getattr(layer, "record_past", False):
            layer.crop(0)


def append_cache_rows(cache: DynamicCache, other: DynamicCache) -> None:
    """Append the rows of ``other`` to ``cache`` (both of the same model), in every layer; whichever holds fewer
    slots is left-padded with zeros, which the caller's attention mask must leave out.

    All or nothing: every layer's new keys and values are built before any layer is changed, so a failure (out of
    memory, typically) leaves ``cache`` as it was and the running batch intact. The price is the peak: the old and
    the grown cache are both held until the end, not one layer at a time. A :class:`BlockLayer` gets its spare
    blocks in the same allocation."""
    grown = []
    for layer, new in zip(cache.layers, other.layers, strict=True):
        width = max(layer.keys.shape[2], new.keys.shape[2])
        capacity = _capacity(layer, width)
        grown.append((_rows_in_room([layer.keys, new.keys], width, capacity),
                      _rows_in_room([layer.values, new.values], width, capacity), width))
    for layer, (keys, values, width) in zip(cache.layers, grown):
        _set_rooms(layer, keys, values, width)


def _rows_in_room(parts: list[torch.Tensor], width: int, capacity: int) -> torch.Tensor:
    """A room [sum of rows, heads, capacity, dim] holding the rows of each part [rows_i, heads, slots_i, dim] in
    order, each part's slots ending at slot ``width`` with zeros before them (the spare slots after ``width`` are
    left unset)."""
    first = parts[0]
    room = first.new_empty((sum(part.shape[0] for part in parts), first.shape[1], capacity, first.shape[3]))
    row = 0
    for part in parts:
        rows, pad = part.shape[0], width - part.shape[2]
        room[row: row + rows, :, :pad] = 0
        room[row: row + rows, :, pad: width] = part
        row += rows
    return room


def gather_cache_slots(cache: DynamicCache | StaticCache, order: torch.Tensor) -> None:
    """Keep, for each row ``i``, the cache slots ``order[i]`` [rows, kept] in that order, in every layer (into a
    fresh room with spare blocks for a :class:`BlockLayer`). All or nothing, as :func:`append_cache_rows`.

    A ``StaticCache`` keeps its tensors (a compiled forward, and a CUDA graph, hold their addresses): the kept
    slots are gathered aside, written back to its first ``kept`` slots, and its write position set after them."""
    kept = order.shape[1]
    static = isinstance(cache, StaticCache)
    gathered = []
    for layer in cache.layers:
        rooms = []
        for states in (layer.keys, layer.values):  # [rows, heads, slots, dim]
            index = order[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3])
            capacity = kept if static else _capacity(layer, kept)
            room = states.new_empty((states.shape[0], states.shape[1], capacity, states.shape[3]))
            torch.gather(states, 2, index, out=room[:, :, :kept])
            rooms.append(room)
        gathered.append(rooms)
    for layer, (keys, values) in zip(cache.layers, gathered):
        if static:
            layer.keys[:, :, :kept] = keys
            layer.values[:, :, :kept] = values
            layer.cumulative_length.fill_(kept)
        else:
            _set_rooms(layer, keys, values, kept)


def select_cache_rows(cache: DynamicCache | StaticCache, indices: torch.Tensor) -> None:
    """Keep the rows ``indices`` of ``cache``, in that order, in every layer. transformers' ``StaticLayer`` has no
    ``batch_select_indices``: its tensors are replaced by the selected rows (new tensors, marked static again for
    a compiled forward, whose graph for the new row count is traced once), its write position kept."""
    if not isinstance(cache, StaticCache):
        cache.batch_select_indices(indices)
        return
    selected = [(layer.keys[indices], layer.values[indices]) for layer in cache.layers if layer.is_initialized]
    for layer, (keys, values) in zip((layer for layer in cache.layers if layer.is_initialized), selected):
        layer.keys, layer.values = keys, values
        layer.batch_size = keys.shape[0]
        torch._dynamo.mark_static_address(keys)
        torch._dynamo.mark_static_address(values)
