"""What ``_transformers.py`` adds to transformers' cache and processors.

- :class:`BlockLayer` holds exactly what transformers' ``DynamicLayer`` holds after any sequence of the operations
  the loops use (update, crop, row selection, slot gathering, row appending), while reallocating only when a block
  is full and never on a crop; and generation on it stays token-identical to plain ``model.generate``, including
  across block boundaries (blocks made tiny here so the short test generations cross many).
- :func:`append_cache_rows` and :func:`gather_cache_slots` are all or nothing: an allocation failing at any layer
  leaves the cache as it was.
- ``stable_temperature``: every temperature in (0, 2] gives the distribution it names; a tiny one is greedy.
"""

import types

import numpy as np
import pytest
import test_batch
import torch
from test_batch import _left_pad, _rows, _singles
from test_exactness import _plain, _prompts
from transformers import DynamicCache, MistralConfig
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

import lookupdec
from lookupdec import LookupDrafter
from lookupdec import _transformers as tf
from lookupdec._transformers import (
    BlockLayer,
    StableTemperatureLogitsWarper,
    append_cache_rows,
    batch_cache,
    gather_cache_slots,
    resolve_generation,
    rollback_cache,
)
from lookupdec.verify import verify_keyed

HEADS, DIM, LAYERS = 2, 3, 3


def _states(rows, slots, gen):  # [rows, heads, slots, dim]
    return torch.randn((rows, HEADS, slots, DIM), generator=gen)


def _pair(block=4):
    """The same empty cache twice: transformers' layers, and block layers with ``block`` slots per block."""
    plain, blocky = DynamicCache(), DynamicCache()
    plain.layers = [DynamicLayer() for _ in range(LAYERS)]
    blocky.layers = [BlockLayer() for _ in range(LAYERS)]
    for layer in blocky.layers:
        layer.block_slots = block
    return plain, blocky


def _update(caches, rows, slots, gen):
    for index in range(LAYERS):
        keys, values = _states(rows, slots, gen), _states(rows, slots, gen)
        outs = [cache.update(keys, values, index) for cache in caches]
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def _assert_same(plain, blocky):
    assert plain.get_seq_length() == blocky.get_seq_length()
    for a, b in zip(plain.layers, blocky.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def _rooms(cache):
    return [(layer._key_room.data_ptr(), layer._value_room.data_ptr()) for layer in cache.layers]


@pytest.mark.parametrize("seed", range(6))
def test_block_layers_hold_what_dynamic_layers_hold(seed):
    """Random sequences of the batch loop's operations give the same keys and values on both kinds of layer."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    plain, blocky = _pair(block=int(rng.integers(1, 9)))
    rows = int(rng.integers(1, 4))
    _update((plain, blocky), rows, int(rng.integers(1, 12)), gen)  # the prefill
    for _ in range(40):
        op = rng.choice(["step", "step", "step", "crop", "select", "gather", "append"])
        slots = plain.get_seq_length()
        if op == "step":
            _update((plain, blocky), rows, int(rng.integers(1, 6)), gen)
        elif op == "crop" and slots > 1:
            remove = -int(rng.integers(0, slots))
            plain.crop(remove)
            blocky.crop(remove)
        elif op == "select" and rows > 1:
            keep = torch.tensor(sorted(rng.choice(rows, size=int(rng.integers(1, rows)), replace=False)))
            plain.batch_select_indices(keep)
            blocky.batch_select_indices(keep)
            rows = len(keep)
        elif op == "gather" and slots > 1:
            kept = int(rng.integers(1, slots))
            order = torch.from_numpy(np.stack([np.sort(rng.choice(slots, kept, replace=False)) for _ in range(rows)]))
            gather_cache_slots(plain, order)
            gather_cache_slots(blocky, order)
        elif op == "append":
            joining = _pair()  # a request's own prefilled cache: plain layers on both sides, as batch.py builds it
            _update(joining, 1, int(rng.integers(1, 2 * slots + 2)), gen)
            append_cache_rows(plain, joining[0])
            append_cache_rows(blocky, joining[1])
            rows += 1
        _assert_same(plain, blocky)


def test_block_layer_reallocates_only_when_a_block_is_full():
    gen = torch.Generator().manual_seed(0)
    plain, blocky = _pair(block=8)
    _update((plain, blocky), 2, 3, gen)
    rooms = _rooms(blocky)
    assert blocky.layers[0]._key_room.shape[2] == 8
    for _ in range(5):  # 3 -> 8 slots: still the first block
        _update((plain, blocky), 2, 1, gen)
    assert _rooms(blocky) == rooms
    plain.crop(-4)
    blocky.crop(-4)  # a crop moves the end, copies nothing
    assert _rooms(blocky) == rooms and blocky.get_seq_length() == 4
    _update((plain, blocky), 2, 4, gen)  # 4 -> 8: the cropped slots are reused
    assert _rooms(blocky) == rooms
    _update((plain, blocky), 2, 1, gen)  # 9 slots: a second block
    assert _rooms(blocky) != rooms and blocky.layers[0]._key_room.shape[2] == 16
    _assert_same(plain, blocky)


def test_block_layer_takes_over_keys_assigned_from_outside():
    """Code that treats the layer as a DynamicLayer and assigns ``keys`` (offloading, a reordering) wins: the next
    update copies that tensor into a fresh room rather than writing into the stale one."""
    gen = torch.Generator().manual_seed(1)
    plain, blocky = _pair(block=8)
    _update((plain, blocky), 3, 5, gen)
    for cache in (plain, blocky):
        cache.reorder_cache(torch.tensor([2, 0, 1]))
    _update((plain, blocky), 3, 2, gen)
    _assert_same(plain, blocky)


def _failing_allocation(monkeypatch, fail_at):
    """``Tensor.new_empty`` (where the cache code allocates) raises an out-of-memory error on call ``fail_at``."""
    real, calls = torch.Tensor.new_empty, [0]

    def new_empty(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at:
            raise torch.OutOfMemoryError("injected")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)
    return calls


def _snapshot(cache):
    return [(layer.keys, layer.values, layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def _assert_unchanged(cache, snapshot):
    for layer, (keys, values, key_copy, value_copy) in zip(cache.layers, snapshot, strict=True):
        assert layer.keys is keys and layer.values is values
        assert torch.equal(keys, key_copy) and torch.equal(values, value_copy)


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("operation", ["append", "gather"])
def test_growing_and_compacting_are_all_or_nothing(monkeypatch, blocks, operation):
    """Whichever allocation fails (every layer allocates twice: keys, values), the batch's cache is untouched,
    and the same operation then succeeds."""
    gen = torch.Generator().manual_seed(2)
    plain, blocky = _pair(block=4)
    cache = blocky if blocks else plain
    _update((plain, blocky), 2, 6, gen)
    joining = _pair()[0]
    for index in range(LAYERS):
        joining.update(_states(1, 9, gen), _states(1, 9, gen), index)
    order = torch.tensor([[0, 2, 5], [1, 3, 4]])

    def run():
        if operation == "append":
            append_cache_rows(cache, joining)
        else:
            gather_cache_slots(cache, order)

    for fail_at in range(1, 2 * LAYERS + 1):
        snapshot = _snapshot(cache)
        with monkeypatch.context() as patch:
            _failing_allocation(patch, fail_at)
            with pytest.raises(torch.OutOfMemoryError):
                run()
        _assert_unchanged(cache, snapshot)
    calls = _failing_allocation(monkeypatch, 0)
    run()
    assert calls[0] == 2 * LAYERS  # every allocation was tried above
    assert cache.layers[0].keys.shape[:3] == ((3, HEADS, 9) if operation == "append" else (2, HEADS, 3))


def test_block_layers_only_where_every_layer_is_full_attention(tiny_factory):
    llama = tiny_factory("llama")
    assert all(type(layer) is BlockLayer for layer in rollback_cache(llama).layers)
    assert all(type(layer) is BlockLayer for layer in batch_cache(llama).layers)
    assert all(type(layer) is DynamicLayer for layer in rollback_cache(llama, blocks=False).layers)
    sliding = types.SimpleNamespace(config=MistralConfig(num_hidden_layers=2, sliding_window=16))
    cache = rollback_cache(sliding)
    assert all(cache.is_sliding) and not any(isinstance(layer, BlockLayer) for layer in cache.layers)


# ------------------------------------------------------------------------------------------------ exactness on blocks


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of 5 slots, so that the tests' short generations reallocate every few passes."""
    monkeypatch.setattr(BlockLayer, "block_slots", 5)


def _counting_rooms(monkeypatch):
    calls = [0]
    real = tf._extend

    def extend(view, room, new, block):
        out = real(view, room, new, block)
        calls[0] += out[1] is not room
        return out

    monkeypatch.setattr(tf, "_extend", extend)
    return calls


def test_single_row_on_blocks_matches_greedy(tiny_model, tiny_blocks, monkeypatch):
    grown = _counting_rooms(monkeypatch)
    accepted = 0
    for prompt in _prompts(tiny_model, count=2, seed=3):
        ref = _plain(tiny_model, prompt, max_new_tokens=60)
        # Not calibrated: timed pass costs could price every draft out on a busy machine, and this test needs drafts.
        out = lookupdec.generate(tiny_model, prompt, max_new_tokens=60, drafter=LookupDrafter(calibrate=False))
        assert out.sequences.tolist() == ref.tolist()
        assert out.stats.drafted_tokens > 0  # drafts were written into the blocks, and the rejected ones cropped
        accepted += out.stats.accepted_tokens
    if tiny_model.config.model_type != "gpt2":  # the random gpt2 (learned positions) seldom copies its prompt
        assert accepted > 0  # multi-token passes crossed block boundaries too
    assert grown[0] > 0  # the blocks were in use and grew


def test_batch_on_blocks_matches_greedy(tiny_model, tiny_blocks, monkeypatch):
    grown = _counting_rooms(monkeypatch)
    prompts = _prompts(tiny_model, count=4, seed=5)
    pad = tiny_model.generation_config.pad_token_id
    ids, mask = _left_pad(prompts, pad)
    out = lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=60, drafter=LookupDrafter())
    assert _rows(out, ids.shape[1], pad) == _singles(tiny_model, prompts, 60)
    assert grown[0] > 0


@pytest.mark.parametrize("case", ["test_rows_joining_a_running_batch_match_single_sequence_greedy",
                                  "test_compaction_keeps_rows_exact"])
def test_joining_and_compaction_on_blocks_match_greedy(tiny_model, tiny_blocks, monkeypatch, case):
    """test_batch's own checks of rows joining a running batch and of the compaction, on tiny blocks."""
    grown = _counting_rooms(monkeypatch)
    getattr(test_batch, case)(tiny_model, *([monkeypatch] if case == "test_compaction_keeps_rows_exact" else []))
    assert grown[0] > 0


@pytest.mark.slow
def test_real_model_on_blocks_matches_greedy(smollm2, tiny_blocks):
    model, tokenizer = smollm2
    text = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
            "    return 2 * (width + height)\n\n\n")
    prompts = [tokenizer(text * 2 + head, return_tensors="pt").input_ids for head in ("def", "# Rectangles\ndef")]
    for prompt in prompts:
        out = lookupdec.generate(model, prompt, max_new_tokens=40, drafter=LookupDrafter())
        assert out.sequences.tolist() == _plain(model, prompt, max_new_tokens=40).tolist()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, mask = _left_pad(prompts, pad)
    out = lookupdec.generate(model, ids, attention_mask=mask, max_new_tokens=40, drafter=LookupDrafter())
    singles = [_plain(model, p, max_new_tokens=40)[0, p.shape[1]:].tolist() for p in prompts]
    assert [row[: len(single)] for row, single in zip(_rows(out, ids.shape[1], pad), singles)] == singles


# ------------------------------------------------------------------------------------------------------- temperature

TINY = (1e-40, 1e-30, 1e-8, 1e-50)  # 1e-50 is 0 in float32: the maxima must not become 0 / 0
ORDINARY = (0.5, 1.0, 1.7, 2.0)


def _scores(seed):  # [4, vocab] float32, some rows with large logits
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((4, 300), generator=gen) * torch.tensor([[1.0], [10.0], [60.0], [0.01]])


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperature_is_a_point_mass_on_the_argmax(temperature):
    scores = _scores(0)
    p = torch.softmax(StableTemperatureLogitsWarper(temperature)(None, scores), dim=-1)
    assert torch.equal(p, torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[1]).float())
    if temperature <= 1e-40:  # transformers' own warper overflows there (the server's garbage): no distribution
        assert torch.isnan(torch.softmax(TemperatureLogitsWarper(temperature)(None, scores), dim=-1)).any()


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperature_spreads_evenly_over_exact_ties(temperature):
    scores = _scores(1)
    top = scores.max(-1).values
    scores[0, [3, 40]] = top[0]  # a three-way tie with the argmax
    scores[1, 7] = top[1]  # a two-way tie
    p = torch.softmax(StableTemperatureLogitsWarper(temperature)(None, scores), dim=-1)
    ties = scores == scores.max(-1, keepdim=True).values
    assert ties.sum(-1).tolist()[:2] == [3, 2]
    assert torch.allclose(p, ties.float() / ties.sum(-1, keepdim=True), atol=1e-7, rtol=0)


@pytest.mark.parametrize("temperature", ORDINARY)
def test_ordinary_temperature_names_the_same_distribution(temperature):
    scores = _scores(2)
    p = torch.softmax(StableTemperatureLogitsWarper(temperature)(None, scores), dim=-1)
    expected = torch.softmax(scores.double() / temperature, dim=-1).float()
    assert torch.allclose(p, expected, atol=1e-7, rtol=1e-5)


def _resolve(model, prompt, stable, temperature, top_p=0.9):
    return resolve_generation(model, prompt, max_new_tokens=8, generation_config=None, logits_processor=None,
                              stopping_criteria=None, stable_temperature=stable, do_sample=True,
                              temperature=temperature, top_p=top_p, top_k=0)


def test_stable_temperature_replaces_the_warper_in_place(tiny_factory):
    """Temperature comes before top-p, as in model.generate; without the flag, transformers' own warper stays."""
    model = tiny_factory("llama")
    prompt = torch.tensor([[5, 6, 7]], device=model.device)
    plain = [type(p) for p in _resolve(model, prompt, False, 0.7).processors]
    stable = [type(p) for p in _resolve(model, prompt, True, 0.7).processors]
    assert plain.index(TemperatureLogitsWarper) < plain.index(TopPLogitsWarper)
    assert stable == [StableTemperatureLogitsWarper if t is TemperatureLogitsWarper else t for t in plain]
    assert _resolve(model, prompt, True, 0.7).processors[plain.index(TemperatureLogitsWarper)].temperature == 0.7


@pytest.mark.parametrize("temperature", (1e-40, 1e-8))
def test_seeded_sampling_at_a_tiny_temperature_gives_the_greedy_token(tiny_factory, temperature):
    model = tiny_factory("llama")
    gen = torch.Generator().manual_seed(4)
    for trial in range(8):
        prompt = torch.randint(3, model.config.vocab_size, (1, 12), generator=gen).to(model.device)
        with torch.no_grad():
            logits = model(prompt).logits[0, -1:].float().cpu()  # [1, vocab]
        processors = _resolve(model, prompt, True, temperature).processors

        def process(pos, row):
            return processors(prompt.cpu(), row[None, :])[0]

        verdict = verify_keyed(logits, np.zeros(0, dtype=np.int32), process, seed=trial, position=trial)
        assert verdict.token == int(logits[0].argmax())
