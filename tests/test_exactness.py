"""Greedy exactness: both routes give plain greedy ``model.generate``'s tokens, token for token (fp32).

The prompts repeat material the model will produce, so drafts are both accepted and rejected; EOS is set to a token
the greedy output contains, so it lands inside drafts; budgets smaller than a draft are covered.
"""

import copy

import pytest
import torch
from helpers_costs import fixed_costs, nearly_free
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import lookupdec
from lookupdec import LookupDrafter
from lookupdec import verify as verify_module


def _prompts(model, count=3, seed=0):
    """Prompts made of a random head, the model's own greedy continuation of it, then the head again: the
    continuation after the second head is (mostly) a copy, with a divergence where the model's context differs."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    out = []
    for i in range(count):
        head = torch.randint(3, vocab, (1, 10 + 3 * i), generator=gen)
        cont = model.generate(head, attention_mask=torch.ones_like(head), max_new_tokens=24, do_sample=False)
        prompt = torch.cat([head, cont[:, head.shape[1]:], head], dim=1)
        prompt[prompt == model.generation_config.pad_token_id] = 3  # never a pad token inside a prompt
        out.append(prompt)
    return out


def _plain(model, prompt, **kw):
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, **kw)


def test_generate_matches_greedy(tiny_model):
    drafter = LookupDrafter()
    accepted = 0
    for prompt in _prompts(tiny_model):
        for budget in (1, 2, 7, 60):
            ref = _plain(tiny_model, prompt, max_new_tokens=budget)
            out = lookupdec.generate(tiny_model, prompt, max_new_tokens=budget, drafter=drafter)
            assert out.sequences.tolist() == ref.tolist(), (budget, prompt.tolist())
            assert out.stats.new_tokens == ref.shape[1] - prompt.shape[1]
            accepted += out.stats.accepted_tokens
    assert accepted > 0  # the prompts do exercise accepted drafts


def test_assistant_route_matches_greedy(tiny_model):
    drafter = LookupDrafter()
    for prompt in _prompts(tiny_model):
        for budget in (1, 5, 60):
            ref = _plain(tiny_model, prompt, max_new_tokens=budget)
            out = _plain(tiny_model, prompt, max_new_tokens=budget, assistant_model=drafter)
            assert out.tolist() == ref.tolist(), budget


def _fed_lengths(model, run):
    """Runs ``run()`` and returns the number of tokens each target pass was fed (the prefill first)."""
    fed = []
    hook = model.register_forward_pre_hook(lambda _, args, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        out = run()
    finally:
        hook.remove()
    return out, fed


def test_assistant_route_skips_drafts_that_do_not_pay(tiny_model):
    # Under greedy the route may hand transformers an empty draft, and the pass is a plain step. Priced so that
    # no draft pays, every pass after the prefill is fed one token; priced as usual, drafts are verified.
    prompt = _prompts(tiny_model, count=1, seed=2)[0]
    ref = _plain(tiny_model, prompt, max_new_tokens=30)
    steep = LookupDrafter(use_cache=False)
    steep.cost.use_profile([1.0] + [50.0] * steep.drafter_config.max_draft)
    out, fed = _fed_lengths(tiny_model, lambda: _plain(tiny_model, prompt, max_new_tokens=30, assistant_model=steep))
    assert out.tolist() == ref.tolist()
    assert len(fed) == 30 and set(fed[1:]) == {1}, str(fed)
    out, fed = _fed_lengths(tiny_model, lambda: _plain(tiny_model, prompt, max_new_tokens=30,
                                                       assistant_model=LookupDrafter(use_cache=False)))
    assert out.tolist() == ref.tolist()
    assert max(fed[1:]) > 1, str(fed)


def test_assistant_route_always_drafts_under_sampling(tiny_model):
    # transformers' sampling rule cannot verify an empty draft, so there every pass carries one, even where the
    # guard would skip it.
    prompt = _prompts(tiny_model, count=1, seed=2)[0]
    steep = LookupDrafter(use_cache=False)
    steep.cost.use_profile([1.0] + [50.0] * steep.drafter_config.max_draft)
    torch.manual_seed(0)
    out, fed = _fed_lengths(tiny_model, lambda: tiny_model.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=20, assistant_model=steep))
    assert out.shape[1] - prompt.shape[1] == 20
    # The last pass may be fed one token: with one token left, transformers asks for no draft at all.
    assert min(fed[1:-1]) >= 2, str(fed)


def test_assistant_route_refuses_a_confidence_threshold(tiny_model):
    # transformers' confidence threshold reads the draft's probabilities, which lookup drafts do not have.
    prompt = _prompts(tiny_model, count=1)[0]
    drafter = LookupDrafter()
    drafter.generation_config.assistant_confidence_threshold = 0.4
    with pytest.raises(ValueError, match="assistant_confidence_threshold"):
        _plain(tiny_model, prompt, max_new_tokens=5, assistant_model=drafter)


def test_eos_inside_drafts_stops_like_plain(tiny_model):
    prompt = _prompts(tiny_model, count=1, seed=3)[0]
    free = _plain(tiny_model, prompt, max_new_tokens=40)
    new = free[0, prompt.shape[1]:].tolist()
    eos = new[len(new) // 2]  # a token the greedy output produces mid-way: it will sit inside copied drafts
    ref = _plain(tiny_model, prompt, max_new_tokens=40, eos_token_id=eos)
    config = copy.deepcopy(tiny_model.generation_config)
    config.eos_token_id = eos
    out = lookupdec.generate(tiny_model, prompt, max_new_tokens=40, generation_config=config,
                             drafter=LookupDrafter(adaptive=False))
    assert out.sequences.tolist() == ref.tolist()
    assert out.sequences[0, -1].item() == eos
    via_hf = _plain(tiny_model, prompt, max_new_tokens=40, eos_token_id=eos, assistant_model=LookupDrafter())
    assert via_hf.tolist() == ref.tolist()


def test_budget_smaller_than_draft(tiny_model):
    # A fixed-length drafter proposes 32 tokens whenever it matches; the budget must still be exact.
    drafter = LookupDrafter(adaptive=False, max_draft=32)
    for prompt in _prompts(tiny_model, count=2, seed=5):
        for budget in (2, 3, 9):
            ref = _plain(tiny_model, prompt, max_new_tokens=budget)
            out = lookupdec.generate(tiny_model, prompt, max_new_tokens=budget, drafter=drafter)
            assert out.sequences.shape[1] == prompt.shape[1] + budget
            assert out.sequences.tolist() == ref.tolist()


def test_fixed_and_adaptive_drafting_agree(tiny_model):
    # Drafting policy changes speed only: three very different drafters give the same tokens.
    prompt = _prompts(tiny_model, count=1, seed=7)[0]
    outs = [
        lookupdec.generate(tiny_model, prompt, max_new_tokens=50, drafter=d).sequences.tolist()
        for d in (LookupDrafter(), LookupDrafter(adaptive=False, max_draft=64), LookupDrafter(min_n=3, max_n=3))
    ]
    assert outs[0] == outs[1] == outs[2] == _plain(tiny_model, prompt, max_new_tokens=50).tolist()


def test_repetition_penalty_matches(tiny_model):
    for prompt in _prompts(tiny_model, count=2, seed=11):
        ref = _plain(tiny_model, prompt, max_new_tokens=30, repetition_penalty=1.3)
        out = lookupdec.generate(tiny_model, prompt, max_new_tokens=30, repetition_penalty=1.3)
        assert out.sequences.tolist() == ref.tolist()
        via_hf = _plain(tiny_model, prompt, max_new_tokens=30, repetition_penalty=1.3,
                        assistant_model=LookupDrafter())
        assert via_hf.tolist() == ref.tolist()


class _StopAfter(StoppingCriteria):
    """Stops once `token` has been generated (a stand-in for stop strings, which need a tokenizer)."""

    def __init__(self, token, prompt_len):
        self.token, self.prompt_len = token, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.prompt_len:] == self.token).any(dim=1)


def test_stopping_criteria_fire_mid_draft(tiny_model):
    prompt = _prompts(tiny_model, count=1, seed=13)[0]
    free = _plain(tiny_model, prompt, max_new_tokens=40)[0, prompt.shape[1]:].tolist()
    stop = free[len(free) // 3]
    criteria = StoppingCriteriaList([_StopAfter(stop, prompt.shape[1])])
    ref = _plain(tiny_model, prompt, max_new_tokens=40, stopping_criteria=criteria)
    out = lookupdec.generate(tiny_model, prompt, max_new_tokens=40, stopping_criteria=criteria,
                             drafter=LookupDrafter(adaptive=False))
    assert out.sequences.tolist() == ref.tolist()
    assert out.sequences.shape[1] < prompt.shape[1] + 40


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_prompt_then_every_token_once(tiny_model):
    prompt = _prompts(tiny_model, count=1, seed=17)[0]
    streamer = _Collect()
    out = lookupdec.generate(tiny_model, prompt, max_new_tokens=40, streamer=streamer)
    assert streamer.chunks[0] == prompt[0].tolist()
    assert sum(streamer.chunks[1:], []) == out.sequences[0, prompt.shape[1]:].tolist()
    assert len(streamer.chunks) - 1 == out.stats.target_passes  # one chunk per pass: drafts arrive in blocks
    assert streamer.ended


def test_left_padding_in_a_batch_of_one(tiny_model):
    prompt = _prompts(tiny_model, count=1, seed=19)[0]
    pad = torch.full((1, 4), tiny_model.generation_config.pad_token_id)
    padded = torch.cat([pad, prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(prompt)], dim=1)
    ref = _plain(tiny_model, prompt, max_new_tokens=20)
    out = lookupdec.generate(tiny_model, padded, attention_mask=mask, max_new_tokens=20)
    assert out.sequences[:, :4].tolist() == pad.tolist()
    assert out.sequences[:, 4:].tolist() == ref.tolist()


def test_user_logits_processor_is_applied(tiny_model):
    from transformers import SuppressTokensLogitsProcessor

    prompt = _prompts(tiny_model, count=1, seed=23)[0]
    banned = _plain(tiny_model, prompt, max_new_tokens=10)[0, prompt.shape[1]:].tolist()[:3]
    procs = LogitsProcessorList([SuppressTokensLogitsProcessor(banned)])
    ref = _plain(tiny_model, prompt, max_new_tokens=30, logits_processor=procs)
    out = lookupdec.generate(tiny_model, prompt, max_new_tokens=30, logits_processor=procs)
    assert out.sequences.tolist() == ref.tolist()
    assert not set(banned) & set(out.sequences[0, prompt.shape[1]:].tolist())


class _Stateful(LogitsProcessor):
    """A processor whose effect depends on how often it was called, as classifier-free guidance's or SynthID
    watermarking's does: each call bans one token, named by the call's number, and records the prefix length it
    was given."""

    def __init__(self, vocab):
        self.vocab, self.lengths = vocab, []

    def __call__(self, input_ids, scores):
        self.lengths.append(input_ids.shape[1])
        scores = scores.clone()
        scores[:, 3 + (7 * len(self.lengths)) % (self.vocab - 3)] = -float("inf")
        return scores


@pytest.mark.parametrize("path", ["lazy", "eager"])
def test_a_processor_with_state_is_called_as_plain_decoding_calls_it(tiny_model, monkeypatch, path):
    # Plain decoding calls the processors once per generated token, in order. The eager verification (an
    # accelerator's) processes every position of a pass, rejected ones included; a processor that may hold state
    # is run on the committed positions only, whichever path the logits' device would take ("eager": taken as on
    # a GPU).
    if path == "eager":
        monkeypatch.setattr(verify_module, "eager_by_default", lambda logits: True)
    vocab = tiny_model.config.vocab_size
    prompt = _prompts(tiny_model, count=1, seed=29)[0]
    plain = _Stateful(vocab)
    ref = _plain(tiny_model, prompt, max_new_tokens=40, logits_processor=LogitsProcessorList([plain]))
    assert ref.shape[1] == prompt.shape[1] + 40  # no EOS: every call plain decoding makes is in the comparison
    ours = _Stateful(vocab)
    out = lookupdec.generate(tiny_model, prompt, max_new_tokens=40, logits_processor=LogitsProcessorList([ours]),
                             drafter=fixed_costs(LookupDrafter(), nearly_free))
    assert out.stats.accepted_tokens > 0 and out.stats.drafted_tokens > out.stats.accepted_tokens  # drafts refused
    assert ours.lengths == plain.lengths
    assert out.sequences.tolist() == ref.tolist()


def test_a_batch_refuses_processors_that_may_hold_state(tiny_model):
    from test_batch import _left_pad
    from transformers import SuppressTokensLogitsProcessor

    ids, mask = _left_pad(_prompts(tiny_model, count=2, seed=31), tiny_model.generation_config.pad_token_id)
    processor = _Stateful(tiny_model.config.vocab_size)
    with pytest.raises(NotImplementedError, match=r"may hold state between calls \(_Stateful\).*one row at a time"):
        lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=8,
                           logits_processor=LogitsProcessorList([processor]))
    assert processor.lengths == []  # refused before anything ran
    # transformers' own processors hold no state: batches take them (test_batch compares the outputs).
    lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=8,
                       logits_processor=LogitsProcessorList([SuppressTokensLogitsProcessor([5])]))
    lookupdec.generate(tiny_model, ids[:1], attention_mask=mask[:1], max_new_tokens=8,
                       logits_processor=LogitsProcessorList([processor]))  # one row: as plain decoding calls it


class _ReadsScores(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return scores[-1].argmax(dim=-1) == 1


def test_a_stopping_criterion_that_reads_the_scores_is_refused_clearly(tiny_model):
    # model.generate passes scores=None to stopping criteria unless return_dict_in_generate=True and
    # output_scores=True, which lookupdec.generate does not support: such a criterion cannot run here, and says so.
    prompt = _prompts(tiny_model, count=1, seed=37)[0]
    criteria = StoppingCriteriaList([_ReadsScores()])
    with pytest.raises(TypeError, match="NoneType"):
        _plain(tiny_model, prompt, max_new_tokens=8, stopping_criteria=criteria)  # plain decoding fails the same way
    with pytest.raises(TypeError, match=r"passes scores=None to stopping criteria.*output_scores=True"):
        lookupdec.generate(tiny_model, prompt, max_new_tokens=8, stopping_criteria=criteria)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_pass_whose_every_slot_is_kept_crops_nothing(tiny_model, monkeypatch, cache):
    # A plain step, or a draft accepted whole, leaves nothing to crop: no layer is asked to crop nothing
    # (transformers before 5.24 read crop(0) as "keep no token", and emptied the layer).
    from transformers.cache_utils import DynamicLayer, StaticLayer

    prompt = _prompts(tiny_model, count=1, seed=41)[0]
    ref = _plain(tiny_model, prompt, max_new_tokens=30)
    crops = []
    real_dynamic, real_static = DynamicLayer.crop, StaticLayer.crop

    def dynamic(self, n):
        crops.append(n)
        if n >= 0:  # the old reading: keep the first n tokens
            self.keys, self.values = self.keys[..., :n, :], self.values[..., :n, :]
            return
        real_dynamic(self, n)

    def static(self, n):
        crops.append(n)
        real_static(self, n)

    monkeypatch.setattr(DynamicLayer, "crop", dynamic)
    monkeypatch.setattr(StaticLayer, "crop", static)
    out = lookupdec.generate(tiny_model, prompt, max_new_tokens=30, drafter=fixed_costs(LookupDrafter()),
                             cache_implementation=cache)
    assert out.sequences.tolist() == ref.tolist()
    cropped = len(crops) // tiny_model.config.num_hidden_layers  # passes that cropped (each crops every layer)
    assert 0 < cropped < out.stats.target_passes - 1  # some decoding passes had rejected tokens, some none
    assert all(n < 0 for n in crops)  # and only those cropped


def test_runs_under_inference_mode(tiny_model):
    prompt = _prompts(tiny_model, count=1)[0]
    seen = []
    handle = tiny_model.register_forward_hook(lambda *a: seen.append(torch.is_inference_mode_enabled()))
    try:
        lookupdec.generate(tiny_model, prompt, max_new_tokens=8)
    finally:
        handle.remove()
    assert seen and all(seen)


def test_cache_never_holds_rejected_positions(tiny_model):
    # Before every pass after the prefill, the KV cache holds exactly the committed tokens but the last one (which
    # the pass feeds again, followed by its draft): rejected draft positions were cropped away.
    prompt = _prompts(tiny_model, count=1, seed=29)[0]
    passes = []  # (cache length after the pass, tokens fed)

    def hook(module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        passes.append((cache.get_seq_length(), kwargs["input_ids"].shape[1]))

    class Steps:  # the trace protocol: one step per pass, the prefill first
        def start(self, prompt):
            self.steps = []

        def step(self, draft, accepted, token, kept, seconds):
            self.steps.append((len(draft), kept))

    steps = Steps()
    handle = tiny_model.register_forward_hook(hook, with_kwargs=True)
    try:
        out = lookupdec.generate(tiny_model, prompt, max_new_tokens=40, drafter=LookupDrafter(adaptive=False),
                                 trace=steps)
    finally:
        handle.remove()
    assert out.stats.drafted_tokens > out.stats.accepted_tokens  # some drafts were rejected, so crops happened
    assert len(passes) == len(steps.steps) == out.stats.target_passes
    committed = prompt.shape[1]
    for i, ((after, fed), (drafted, kept)) in enumerate(zip(passes, steps.steps)):
        if i == 0:
            assert (after - fed, fed) == (0, prompt.shape[1])  # the prefill
        else:
            assert (after - fed, fed) == (committed - 1, drafted + 1)
        committed += kept
    assert committed == out.sequences.shape[1]


def test_bad_arguments(tiny_model):
    prompt = _prompts(tiny_model, count=1)[0]
    with pytest.raises(ValueError, match="max_new_tokens"):
        lookupdec.generate(tiny_model, prompt, max_new_tokens=0)
    with pytest.raises(ValueError, match="input_ids"):
        lookupdec.generate(tiny_model, prompt[0], max_new_tokens=4)
    right_padded = torch.ones_like(prompt)
    right_padded[0, -2:] = 0
    with pytest.raises(ValueError, match="left padding"):
        lookupdec.generate(tiny_model, prompt, attention_mask=right_padded, max_new_tokens=4)
    with pytest.raises(ValueError, match="at least one token"):
        lookupdec.generate(tiny_model, prompt, attention_mask=torch.zeros_like(prompt), max_new_tokens=4)


def test_one_drafter_serves_concurrent_requests(tiny_model):
    # A server shares one drafter (and its rolling cache) between threads: outputs stay exact.
    import threading

    prompts = _prompts(tiny_model, count=4, seed=31)
    refs = [_plain(tiny_model, p, max_new_tokens=30).tolist() for p in prompts]
    drafter = LookupDrafter()
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(3):
                out = lookupdec.generate(tiny_model, prompts[i], max_new_tokens=30, drafter=drafter)
                results.setdefault(i, []).append(out.sequences.tolist())
        except Exception as err:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, ref in enumerate(refs):
        assert results[i] == [ref] * 3
    assert len(drafter.cache) > 0  # the finished requests fed the shared cache
