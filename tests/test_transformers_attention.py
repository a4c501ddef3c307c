"""lookupdec's variant of transformers' SDPA attention (``_transformers.use_grouped_attention``).

- It computes the same numbers as transformers' ``sdpa`` bit for bit, for the passes it changes (several query
  tokens, a mask, grouped key/value heads) and the ones it hands on.
- A model switched to it gives the same logits as before, and its passes of several tokens no longer copy the
  key/value heads (``repeat_kv``): the copy that made a batch's drafted passes dearer with every token of context.
- Batched generation on a switched model matches plain decoding on the original, token for token.
- Only a CPU model on ``sdpa`` is switched; ``lookupdec.load_model`` switches the models it loads.
"""

import copy
import types

import pytest
import torch
from test_batch import _left_pad, _rows, _singles
from test_exactness import _prompts
from transformers.integrations import sdpa_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import lookupdec
from lookupdec import LookupDrafter
from lookupdec import _transformers as tf
from lookupdec._transformers import GROUPED_ATTENTION, use_grouped_attention

pytestmark = pytest.mark.skipif(not tf._GQA_KERNEL, reason="torch < 2.5 has no grouped-query SDPA kernel")


def _module(groups):
    return types.SimpleNamespace(num_key_value_groups=groups, training=False, is_causal=True)


@pytest.mark.parametrize("rows,heads,kv_heads,queries,keys", [
    (8, 9, 3, 2, 514), (1, 9, 3, 9, 70), (4, 8, 1, 17, 300), (3, 4, 2, 1, 40), (2, 4, 4, 5, 40)])
@pytest.mark.parametrize("float_mask", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_computes_sdpa_bit_for_bit(rows, heads, kv_heads, queries, keys, float_mask, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + queries)
    query = torch.randn(rows, heads, queries, 64, generator=gen).to(dtype)
    key, value = (torch.randn(rows, kv_heads, keys, 64, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(rows, 1, queries, keys, generator=gen) > 0.2
    mask[..., 0] = True  # every query sees a key
    if float_mask:
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    module = _module(heads // kv_heads)
    ours, _ = tf._grouped_sdpa(module, query, key, value, mask, scaling=0.1)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.1)
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs)


def _passes(model, prompts):
    """Logits of a padded two-row prefill, then of a masked pass of 5 new tokens per row on its cache."""
    pad = model.generation_config.pad_token_id
    ids, mask = _left_pad(prompts, pad)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = tf.rollback_cache(model)
    params = tf.forward_params(model)
    with torch.inference_mode():
        first = tf.target_forward(model, ids, cache, 1, params, mask, positions)
        feed = torch.arange(3, 13).view(2, 5)
        mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1 + torch.arange(5)
        second = tf.target_forward(model, feed, cache, 5, params, mask, positions)
    return first, second


def test_a_switched_model_gives_the_same_logits_without_copying_heads(tiny_factory, monkeypatch):
    model = tiny_factory("llama")  # 4 query heads on 2 key/value heads
    if model.device.type != "cpu":
        pytest.skip("the variant applies on a CPU only")
    switched = copy.deepcopy(model)
    assert use_grouped_attention(switched)
    assert switched.config._attn_implementation == GROUPED_ATTENTION
    prompts = _prompts(model, count=2, seed=3)
    before, after = _passes(model, prompts), _passes(switched, prompts)
    assert all(torch.equal(a, b) for a, b in zip(before, after))

    def copied(*args, **kwargs):
        raise AssertionError("repeat_kv called")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", copied)
    _passes(switched, prompts)  # no copy of the heads
    with pytest.raises(AssertionError, match="repeat_kv"):
        _passes(model, prompts)  # transformers' own sdpa copies them: the check can see a copy


def test_batched_generation_on_a_switched_model_matches_plain_decoding(tiny_factory):
    model = tiny_factory("llama")
    if model.device.type != "cpu":
        pytest.skip("the variant applies on a CPU only")
    switched = copy.deepcopy(model)
    assert use_grouped_attention(switched)
    prompts = _prompts(model, count=4, seed=5)
    pad = model.generation_config.pad_token_id
    ids, mask = _left_pad(prompts, pad)
    out = lookupdec.generate(switched, ids, attention_mask=mask, max_new_tokens=40,
                             drafter=LookupDrafter(calibrate=False))
    assert _rows(out, ids.shape[1], pad) == _singles(model, prompts, 40)
    assert out.stats.accepted_tokens > 0  # drafted passes ran, on the switched attention


def test_only_a_cpu_model_on_sdpa_is_switched(tiny_factory):
    model = copy.deepcopy(tiny_factory("llama"))
    if model.device.type != "cpu":
        assert not use_grouped_attention(model)
        return
    model.set_attn_implementation("eager")
    assert not use_grouped_attention(model)
    assert model.config._attn_implementation == "eager"


def test_load_model_switches_the_models_it_loads(smollm2):
    model, _ = smollm2
    expected = GROUPED_ATTENTION if model.device.type == "cpu" else "sdpa"
    assert model.config._attn_implementation == expected
