"""``cache_implementation="static"``: rows on a preallocated cache, passes padded to fixed widths.

The rule pinned here: on the static cache, greedy output is plain greedy ``model.generate``'s, token for token, on
the eager path and on a compiled forward, while every pass has a width from ``STATIC_WIDTHS`` (or, near the end of
a full cache, the exact draft + 1) and runs on transformers' ``StaticCache``. A batch keeps its holes in place and
squeezes them out, in the same tensors, only when the next pass might not fit.
"""

import copy

import numpy as np
import pytest
import torch
from helpers_costs import fixed_costs, nearly_free
from test_batch import _left_pad, _row, _rows, _singles
from test_exactness import _plain, _prompts
from transformers import StaticCache

import lookupdec
from lookupdec import LookupDrafter, loop
from lookupdec import batch as batch_module
from lookupdec.batch import STATIC_WIDTHS, BatchRun, static_width


def _passes(model, run):
    """``(out, passes)``: ``run()``'s result and, per target pass, ``(tokens fed, cache object)``. The model's
    pass cost is measured first, so that the calibration's own passes are not among them."""
    lookupdec.generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=1)
    passes = []

    def record(_, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        passes.append((kwargs["input_ids"].shape[1], cache))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = run()
    finally:
        hook.remove()
    return out, passes


def test_static_width():
    assert static_width(1, 100) == 1
    assert static_width(3, 100) == 4  # padded up to the next width
    assert static_width(8, 100) == 8  # a width already in the set stays
    assert static_width(9, 100) == 16
    assert static_width(9, 12) == 9  # 16 would not fit: the exact width, never past the cache's end
    assert static_width(300, 1000) == 300  # beyond the largest width: exact
    assert STATIC_WIDTHS == tuple(sorted(STATIC_WIDTHS))


def test_static_matches_greedy(tiny_model):
    drafter = fixed_costs(LookupDrafter())  # drafts that pay whatever this machine's speed (helpers_costs)
    accepted = 0
    for prompt in _prompts(tiny_model):
        for budget in (1, 2, 7, 60):
            ref = _plain(tiny_model, prompt, max_new_tokens=budget)
            assert _plain(tiny_model, prompt, max_new_tokens=budget, cache_implementation="static").tolist() \
                == ref.tolist()  # plain decoding itself agrees on both caches
            out, passes = _passes(tiny_model, lambda: lookupdec.generate(
                tiny_model, prompt, max_new_tokens=budget, drafter=drafter, cache_implementation="static"))
            assert out.sequences.tolist() == ref.tolist(), (budget, prompt.tolist())
            assert all(isinstance(cache, StaticCache) for _, cache in passes)
            assert len({id(cache) for _, cache in passes}) == 1  # one cache, written in place
            # Budgets here stay far from the end of the cache (whole blocks of 256 slots): every pass is padded.
            assert all(width in STATIC_WIDTHS for width, _ in passes[1:]), passes
            accepted += out.stats.accepted_tokens
    assert accepted > 0  # rejected drafts were rolled back, and accepted ones kept


def test_static_padding_is_not_a_draft(tiny_model):
    # Priced by hand so that every draft pays, the passes fed more tokens than they drafted (a draft cut short by
    # its candidate or the budget is padded to the next width): the filler is computed and thrown away, and the
    # stats count only drafted tokens.
    prompt = _prompts(tiny_model, count=1, seed=1)[0]
    ref = _plain(tiny_model, prompt, max_new_tokens=40)
    class Drafts:
        def __init__(self):
            self.lengths = []

        def start(self, prompt):
            pass

        def step(self, draft, accepted, token, kept, seconds):
            self.lengths.append(len(draft))

    drafts = Drafts()
    out, passes = _passes(tiny_model, lambda: lookupdec.generate(
        tiny_model, prompt, max_new_tokens=40, drafter=fixed_costs(LookupDrafter(use_cache=False), nearly_free),
        cache_implementation="static", trace=drafts))
    assert out.sequences.tolist() == ref.tolist()
    assert len(passes) == out.stats.target_passes == len(drafts.lengths)
    fed = sum(width - 1 for width, _ in passes[1:])
    assert out.stats.drafted_tokens == sum(drafts.lengths) < fed  # filler was fed, and is not counted as drafted


def test_static_with_processors_matches_plain(tiny_model):
    # A repetition penalty runs the logits processors on each verified position of the padded pass.
    prompt = _prompts(tiny_model, count=1, seed=3)[0]
    ref = _plain(tiny_model, prompt, max_new_tokens=30, repetition_penalty=1.3)
    out = lookupdec.generate(tiny_model, prompt, max_new_tokens=30, repetition_penalty=1.3,
                             cache_implementation="static")
    assert out.sequences.tolist() == ref.tolist()


def test_static_from_the_generation_config(tiny_model):
    prompt = _prompts(tiny_model, count=1)[0]
    config = copy.deepcopy(tiny_model.generation_config)
    config.cache_implementation = "static"
    _, passes = _passes(tiny_model, lambda: lookupdec.generate(tiny_model, prompt, max_new_tokens=8,
                                                               generation_config=config))
    assert isinstance(passes[0][1], StaticCache)
    _, passes = _passes(tiny_model, lambda: lookupdec.generate(tiny_model, prompt, max_new_tokens=8,
                                                               generation_config=config,
                                                               cache_implementation="dynamic"))
    assert not isinstance(passes[0][1], StaticCache)  # the argument wins over the config
    _, passes = _passes(tiny_model, lambda: lookupdec.generate(tiny_model, prompt, max_new_tokens=8))
    assert not isinstance(passes[0][1], StaticCache)  # the default stays the dynamic cache


def test_static_refusals(tiny_model):
    ids = torch.randint(3, 64, (2, 10))
    with pytest.raises(NotImplementedError, match="'offloaded' is not supported"):
        lookupdec.generate(tiny_model, ids[:1], max_new_tokens=4, cache_implementation="offloaded")

    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    model = MistralForCausalLM(config).eval()
    with pytest.raises(NotImplementedError, match="sliding-window"):
        lookupdec.generate(model, ids[:1], max_new_tokens=4, cache_implementation="static")
    # A run on a static cache takes its rows at the start: a second row cannot join it.
    drafter = LookupDrafter()
    run = BatchRun(tiny_model, drafter, static_slots=64)
    first, second = (_row(tiny_model, drafter, ids[i: i + 1], 4) for i in range(2))
    run.join(first)
    with pytest.raises(RuntimeError, match="static cache"):
        run.join(second)
    assert run.rows == [first]


@pytest.mark.parametrize("budget", [1, 3, 50])
def test_static_batch_rows_match_single_sequence_greedy(tiny_model, budget):
    prompts = _prompts(tiny_model, count=4, seed=5)  # lengths differ: left padding differs per row
    pad = tiny_model.generation_config.pad_token_id
    ids, mask = _left_pad(prompts, pad)
    out, passes = _passes(tiny_model, lambda: lookupdec.generate(
        tiny_model, ids, attention_mask=mask, max_new_tokens=budget, drafter=LookupDrafter(calibrate=False),
        cache_implementation="static"))
    assert _rows(out, ids.shape[1], pad) == _singles(tiny_model, prompts, budget)
    assert all(isinstance(cache, StaticCache) for _, cache in passes)
    assert len({id(cache) for _, cache in passes}) == 1  # one cache: rows leave it in place
    assert all(width in STATIC_WIDTHS for width, _ in passes[1:]), passes
    if budget == 50:
        assert out.stats.drafted_tokens > 0
        assert len({row.target_passes for row in out.stats.rows}) > 1  # rows left the batch at different steps


def test_static_batch_matches_plain_static_batched_generate(tiny_model):
    # The whole output, padding included, as plain batched decoding on transformers' static cache gives it; with a
    # repetition penalty, which reads each row's own tokens.
    prompts = _prompts(tiny_model, count=3, seed=7)
    ids, mask = _left_pad(prompts, tiny_model.generation_config.pad_token_id)
    for kwargs in ({}, {"repetition_penalty": 1.3}):
        plain = tiny_model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                    cache_implementation="static", **kwargs)
        out = lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=40,
                                 cache_implementation="static", **kwargs)
        assert out.sequences.tolist() == plain.tolist(), kwargs


def test_static_batch_squeezes_holes_out_in_place(tiny_model, monkeypatch):
    # Slots for exactly the padded prompt and the budget: the holes rows leave behind soon leave no room for the
    # next pass, so they are squeezed out, in the cache's own tensors, and drafts shrink to the room left.
    monkeypatch.setattr(loop, "STATIC_BLOCK", 1)
    gathered = []
    real = batch_module.gather_cache_slots
    monkeypatch.setattr(batch_module, "gather_cache_slots",
                        lambda cache, order: (gathered.append(order.shape[1]), real(cache, order))[1])
    tensors = set()
    pad = tiny_model.generation_config.pad_token_id
    for seed in (5, 13):
        prompts = _prompts(tiny_model, count=4, seed=seed)
        ids, mask = _left_pad(prompts, pad)
        slots = ids.shape[1] + 50

        def record(_, args, kwargs):
            layer = kwargs.get("cache", kwargs.get("past_key_values")).layers[0]
            if layer.is_initialized:
                assert layer.keys.shape[2] == slots  # never grown, never shrunk
                assert int(layer.cumulative_length) + kwargs["input_ids"].shape[1] <= slots
                tensors.add(layer.keys.data_ptr())
            if kwargs.get("attention_mask") is not None:
                assert kwargs["attention_mask"].shape[1] == slots  # one mask shape for a compiled forward

        hook = tiny_model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            out = lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=50,
                                     drafter=LookupDrafter(calibrate=False, adaptive=False),
                                     cache_implementation="static")
        finally:
            hook.remove()
        assert _rows(out, ids.shape[1], pad) == _singles(tiny_model, prompts, 50)
    assert gathered  # the holes were squeezed out
    assert len(tensors) <= 2 * 4  # per run: the prefill's tensors and one per row count after a row left



def test_compiled_static_matches_compiled_plain(tiny_factory):
    # The fast path as users run it: the forward compiled (inductor), plain decoding on transformers' static cache
    # against lookupdec on its own; a fresh model, so the compiled forward is this test's alone.
    torch._dynamo.reset()
    model = tiny_factory("llama")
    prompts = _prompts(model, count=2)
    eager = [_plain(model, prompt, max_new_tokens=40) for prompt in prompts]
    model.forward = torch.compile(model.forward)
    drafter = fixed_costs(LookupDrafter())  # drafts that pay, and no calibration (its passes would compile too)
    try:
        for prompt, ref in zip(prompts, eager):
            plain = _plain(model, prompt, max_new_tokens=40, cache_implementation="static")
            out = lookupdec.generate(model, prompt, max_new_tokens=40, cache_implementation="static",
                                     drafter=drafter)
            assert out.sequences.tolist() == plain.tolist()
            assert out.stats.accepted_tokens > 0
            assert plain.tolist() == ref.tolist()  # compiled kernels round as eager ones do, on this tiny model
        # A batch: rows on one static cache, against plain batched decoding on the same compiled forward.
        ids, mask = _left_pad(_prompts(model, count=3, seed=7), model.generation_config.pad_token_id)
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                               cache_implementation="static")
        out = lookupdec.generate(model, ids, attention_mask=mask, max_new_tokens=40, cache_implementation="static",
                                 drafter=drafter)
        assert out.sequences.tolist() == plain.tolist()
    finally:
        del model.forward
        torch._dynamo.reset()


def test_drafts_are_priced_as_the_padded_pass():
    from lookupdec.policy import best_draft_length, padded_costs

    costs = np.array([1.0, 1.5, 1.8, 2.0, 2.4, 2.5, 2.6, 2.7, 2.8])  # d = 0 .. 8
    # d drafted tokens run in a pass of padded_width(d + 1) tokens: d=1 -> 2, d=2..3 -> 4, d=4..7 -> 8; d=8 would
    # need the costs up to 15 drafted positions, so the padded costs stop at 7.
    assert padded_costs(costs, STATIC_WIDTHS).tolist() == [1.0, 1.5, 2.0, 2.0, 2.7, 2.7, 2.7, 2.7]
    # At equal cost the longer draft brings more expected tokens: the policy fills the width it pays for.
    assert best_draft_length(0.9, 0.9, padded_costs(costs, STATIC_WIDTHS)) == 7
    # A draft of 2 costs the pass of 4 it runs in: cheap as 2 tokens, it pays; priced as 4, one token pays better.
    steep = np.array([1.0, 1.5, 1.6, 2.4])
    assert best_draft_length(0.9, 0.5, steep) == 2
    assert best_draft_length(0.9, 0.5, padded_costs(steep, STATIC_WIDTHS)) == 1


def test_static_runs_price_drafts_by_width(tiny_model):
    seen = []

    class Recording(LookupDrafter):
        def propose(self, sessions, limits, **kwargs):
            seen.append(kwargs.get("widths"))
            return super().propose(sessions, limits, **kwargs)

    prompt = _prompts(tiny_model, count=1)[0]
    lookupdec.generate(tiny_model, prompt, max_new_tokens=12, drafter=Recording(), cache_implementation="static")
    assert seen and all(widths == STATIC_WIDTHS for widths in seen)
    seen.clear()
    lookupdec.generate(tiny_model, prompt, max_new_tokens=12, drafter=Recording())
    assert seen and all(widths is None for widths in seen)  # the dynamic cache runs any width


def test_static_sampling_draws_as_the_dynamic_cache(peaky):
    # Sampling verifies each padded pass's real positions with the exact rule; with drafts fixed (no adaptive
    # length, no cache) both caches see the same drafts, so one seed gives the same tokens on both.
    model, prompt = peaky
    outs = []
    for cache in ("dynamic", "static"):
        drafter = LookupDrafter(adaptive=False, use_cache=False, max_draft=6)
        outs.append(lookupdec.generate(model, prompt, max_new_tokens=40, do_sample=True, temperature=0.8,
                                       drafter=drafter, generator=torch.Generator().manual_seed(7),
                                       cache_implementation=cache))
    assert outs[0].sequences.tolist() == outs[1].sequences.tolist()
    assert 0 < outs[1].stats.accepted_tokens < outs[1].stats.drafted_tokens  # drafts kept and drafts refused
