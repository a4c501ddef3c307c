"""lookupdec's vLLM proposer without vLLM: its bookkeeping across steps, driven as vLLM's model runner drives it.

A small driver plays vLLM's part (:class:`_Engine`): rows in a token array, ``propose`` after every step with each
row's newly sampled tokens, greedy verification of each draft (the longest agreeing prefix plus the target's own
token), rows that move, leave, are preempted and are replaced. The runner view the proposer reads is a fake with
the same methods as :class:`lookupdec.vllm._internals.RunnerView`. What vLLM itself does with the drafts is tested
on vLLM in ``tests/test_vllm.py``.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_exactness import _plain, _prompts

from lookupdec.drafter import Drafter, DrafterConfig
from lookupdec.vllm import _internals
from lookupdec.vllm import proposer as proposer_module


@pytest.fixture(autouse=True)
def _no_vllm(monkeypatch):
    monkeypatch.setattr(_internals, "check_version", lambda: None)
    monkeypatch.setattr(_internals, "hook_installed", lambda: True)  # what the plugin does in vLLM's processes


def _config(k=8, max_len=512, vocab=None, options=None):
    """What the proposer reads of vLLM's config (VllmConfig's attributes of the same names)."""
    vocab = vocab or 50_000
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_len, get_vocab_size=lambda: vocab),
                           additional_config={} if options is None else {"lookupdec": options})


class _View:
    def __init__(self, engine):
        self.engine = engine

    def req_ids(self):
        return list(self.engine.rows)

    def live(self):
        return set(self.engine.requests)

    def scheduled_tokens(self):
        return self.engine.scheduled

    def prompt_tokens(self):
        return 0  # the driver's rows start decoding at once: no step schedules a prompt chunk

    def request(self, req_id):
        r = self.engine.requests[req_id]
        return _internals.RequestInfo(req_id, r["prompt_len"], frozenset({1}), r.get("sampling_max", r["max_tokens"]),
                                      r["prediction"], r.get("client"), r.get("seeded", False))


class _Engine:
    """vLLM's part, greedy: ``rows[i]`` is the request id in row i (None: an empty row)."""

    def __init__(self, model, k=8, drafter=None, max_len=512, options=None):
        self.model = model
        config = _config(k, max_len, model.config.vocab_size, options)
        self.proposer = proposer_module.LookupProposer(config, drafter=drafter)
        self.tokens = np.zeros((4, max_len), dtype=np.int64)  # token_ids_cpu
        self.counts = np.zeros(4, dtype=np.int64)  # num_tokens_no_spec
        self.rows: list = []
        self.requests: dict = {}
        self.drafts: dict = {}
        self.scheduled = 0
        self.drafted = self.accepted = 0
        self.lengths: dict = {}  # request id -> its draft length at every step

    def add(self, req_id, prompt, max_tokens, prediction=None, **fields):
        self.requests[req_id] = {"prompt": prompt, "prompt_len": len(prompt), "max_tokens": max_tokens,
                                 "out": [], "prediction": prediction, **fields}
        self.rows.append(req_id)

    def _row_tokens(self, req_id):
        r = self.requests[req_id]
        return r["prompt"] + r["out"]

    def step(self):
        """One step: verify each row's pending draft greedily, then ``propose``."""
        sampled = []
        self.scheduled = 0
        for req_id in self.rows:
            r = self.requests[req_id]
            context = self._row_tokens(req_id)
            draft = self.drafts.pop(req_id, [])
            self.scheduled += 1 + len(draft)
            ids = torch.tensor([context + draft])
            with torch.inference_mode():
                logits = self.model(ids).logits[0, len(context) - 1:]
            picks = logits.argmax(-1).tolist()
            new = []
            for pos, token in enumerate(draft):
                if picks[pos] != token:
                    break
                new.append(token)
            new.append(picks[len(new)])
            self.drafted += len(draft)
            self.accepted += len(new) - 1
            room = r["max_tokens"] - len(r["out"])
            new = new[:room]
            if 1 in new:
                new = new[: new.index(1) + 1]
            r["out"] += new
            sampled.append(new)
        for row, req_id in enumerate(self.rows):
            context = self._row_tokens(req_id)
            self.tokens[row, : len(context)] = context
            self.counts[row] = len(context)
        drafts = self.proposer.propose(sampled, self.counts[: len(self.rows)].copy(), self.tokens)
        for req_id, draft in zip(self.rows, drafts):
            self.drafts[req_id] = list(draft)
            self.lengths.setdefault(req_id, []).append(len(draft))
        done = [req_id for req_id in self.rows if self._done(req_id)]
        for req_id in done:  # vLLM drops finished requests before its next step
            self.rows.remove(req_id)
            self.drafts.pop(req_id, None)
            del self.requests[req_id]
        return done

    def _done(self, req_id):
        r = self.requests[req_id]
        return len(r["out"]) >= r["max_tokens"] or (r["out"] and r["out"][-1] == 1)

    def bind(self):
        self.proposer.bind(_View(self))


def _greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    return _plain(model, ids, max_new_tokens=n)[0, len(prompt):].tolist()


def _drive(engine, schedule=None, steps=500):
    """Steps until no row is left; ``schedule(engine, step)`` may add, move or preempt rows before a step.
    Returns each request's output."""
    outputs = {}
    for step in range(steps):
        if schedule:
            schedule(engine, step)
        if not engine.rows:
            break
        engine.bind()
        before = {req_id: engine.requests[req_id]["out"] for req_id in engine.rows}
        for req_id in engine.step():
            outputs[req_id] = before[req_id]
    return outputs


def test_rows_that_move_leave_and_join_keep_greedy_output(tiny_model):
    # Three requests, one joining late into the row another left, rows swapped mid-way: every output is plain
    # greedy decoding's, and drafts were accepted (the prompts copy).
    prompts = [p[0].tolist() for p in _prompts(tiny_model, count=3, seed=31)]
    engine = _Engine(tiny_model)
    engine.add("a", prompts[0], 40)
    engine.add("b", prompts[1], 12)

    def schedule(engine, step):
        if step == 3 and len(engine.rows) == 2:
            engine.rows.reverse()  # vLLM condenses and reorders its batch
        if step == 6:
            engine.add("c", prompts[2], 30)

    outputs = _drive(engine, schedule)
    assert set(outputs) == {"a", "b", "c"}
    for req_id, prompt, n in (("a", prompts[0], 40), ("b", prompts[1], 12), ("c", prompts[2], 30)):
        assert outputs[req_id] == _greedy(tiny_model, prompt, n), req_id
    # b (12 tokens) finished long before the others: its session ended at the proposer's next call.
    assert engine.accepted > 0 and "b" not in engine.proposer._requests


def test_a_preempted_request_keeps_its_session(tiny_model):
    prompts = [p[0].tolist() for p in _prompts(tiny_model, count=2, seed=32)]
    engine = _Engine(tiny_model)
    engine.add("a", prompts[0], 40)
    engine.add("b", prompts[1], 40)
    sessions = {}

    def schedule(engine, step):
        if step == 2:
            sessions["a"] = engine.proposer._requests["a"].session
            engine.rows.remove("a")  # preempted: vLLM keeps the request, not its row or its draft
            engine.drafts.pop("a", None)
        if step == 5:
            engine.rows.insert(0, "a")  # resumed where it was
        if step == 7 and "a" in engine.requests:
            sessions["after"] = engine.proposer._requests["a"].session

    outputs = _drive(engine, schedule)
    for req_id, prompt in zip("ab", prompts):
        assert outputs[req_id] == _greedy(tiny_model, prompt, 40), req_id
    assert sessions["after"] is sessions["a"]


@pytest.mark.parametrize("room", ["budget", "context"])
def test_drafts_stay_within_the_request_budget_and_the_model_length(tiny_model, room):
    prompt = _prompts(tiny_model, count=1, seed=33)[0][0].tolist()
    budget, max_len = (6, 512) if room == "budget" else (60, len(prompt) + 10)
    engine = _Engine(tiny_model, k=16, max_len=max_len)
    engine.add("a", prompt, budget)
    seen = []
    real = engine.proposer.propose

    def spy(sampled, counts, tokens, slot_mappings=None):
        drafts = real(sampled, counts, tokens, slot_mappings)
        n = int(counts[0])
        seen.append((len(drafts[0]), budget - (n - len(prompt)), max_len - n))
        return drafts

    engine.proposer.propose = spy
    if room == "context":  # no max_tokens in the request; vLLM stops it at the model length
        engine.requests["a"].update(max_tokens=max_len - len(prompt), sampling_max=None)
    outputs = _drive(engine)
    assert outputs["a"] == _greedy(tiny_model, prompt, min(budget, max_len - len(prompt)))
    # A draft leaves room for the target's own token: it never reaches the budget or the model length.
    assert all(d <= max(left - 1, 0) and d <= max(space - 1, 0) for d, left, space in seen)
    assert any(d > 0 for d, _, _ in seen)


def test_a_prediction_is_drafted_from(tiny_model):
    # The request's prediction (vllm_xargs) is a reference of its own: a prompt with nothing to copy, the index's
    # and the cache's drafts off the table, and the model's own answer as the prediction: drafts come from it and
    # are accepted.
    prompt = torch.randint(3, tiny_model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    prompt = prompt.tolist()
    expected = _greedy(tiny_model, prompt, 30)
    drafter = Drafter(DrafterConfig(max_draft=8, use_cache=False, calibrate=False))
    engine = _Engine(tiny_model, drafter=drafter)
    engine.add("a", prompt, 30, prediction=expected)
    outputs = _drive(engine)
    assert outputs["a"] == expected
    assert engine.accepted >= 10


def test_no_runner_no_drafts(tiny_model):
    # Without the runner's view (an untested vLLM runner) the proposer drafts nothing rather than guess rows.
    proposer = proposer_module.LookupProposer(_config())
    tokens = np.tile(np.arange(50), (2, 4))
    assert proposer.propose([[3], [4]], np.array([100, 100]), tokens) == [[], []]


def test_without_the_plugins_hook_the_proposer_refuses_to_start(monkeypatch):
    # Loudly, at start-up: drafting nothing for ever would look like a slow model.
    monkeypatch.setattr(_internals, "hook_installed", lambda: False)
    with pytest.raises(RuntimeError, match="plugin did not run"):
        proposer_module.LookupProposer(_config())


@pytest.mark.parametrize("options, message", [({"cache_scope": "tenant"}, "cache_scope must be one of"),
                                              ({"max_slowdown": -1}, "max_slowdown must be"),
                                              ({"max_draft": 3}, "unknown lookupdec option"),
                                              ("user", "must be an object")])
def test_bad_options_are_refused_at_start_up(options, message):
    with pytest.raises(ValueError, match=message):
        proposer_module.LookupProposer(_config(options=options))


# ---------------------------------------------------------------------------------------------------------------
# Nothing a request carries can stop the engine: hostile predictions are ignored, faults cost only drafts

HOSTILE = {"too large": [2 ** 31], "negative": [-1, 5], "past the vocabulary": "vocab", "a float": [3.0],
           "a bool": [True], "a string": "12 13", "nested": [[1, 2]], "too long": "long", "a dict": {"a": 1}}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_prediction_is_ignored_and_the_answer_is_plain(tiny_model, kind, caplog):
    prompts = [p[0].tolist() for p in _prompts(tiny_model, count=2, seed=34)]
    prediction = HOSTILE[kind]
    if prediction == "vocab":
        prediction = [tiny_model.config.vocab_size]
    elif prediction == "long":
        prediction = [5] * 513  # past max_len
    engine = _Engine(tiny_model)
    engine.add("bad", prompts[0], 20, prediction=prediction)
    engine.add("good", prompts[1], 20)
    outputs = _drive(engine)
    assert outputs["bad"] == _greedy(tiny_model, prompts[0], 20)
    assert outputs["good"] == _greedy(tiny_model, prompts[1], 20)
    assert engine.accepted > 0  # the prompts still copy: only the prediction was dropped
    assert [r.getMessage() for r in caplog.records if "ignoring the prediction" in r.getMessage()] != []


def test_a_fault_while_drafting_one_row_costs_that_row_its_drafts_only(tiny_model, caplog):
    prompts = [p[0].tolist() for p in _prompts(tiny_model, count=2, seed=35)]
    engine = _Engine(tiny_model)
    real_start = engine.proposer.drafter.start

    def start(prompt, **kwargs):
        session = real_start(prompt, **kwargs)
        if len(prompt) == len(prompts[0]) and list(prompt) == prompts[0]:
            def offer(limit):
                raise IndexError("a bug in our code")
            session.offer = offer
        return session

    engine.proposer.drafter.start = start
    engine.add("broken", prompts[0], 25)
    engine.add("fine", prompts[1], 25)
    outputs = _drive(engine)
    assert outputs["broken"] == _greedy(tiny_model, prompts[0], 25)
    assert outputs["fine"] == _greedy(tiny_model, prompts[1], 25)
    assert set(engine.requests) == set()
    assert not any(engine.lengths["broken"]) and any(engine.lengths["fine"])
    faults = [r for r in caplog.records if "drafting for request broken failed" in r.getMessage()]
    assert len(faults) == 1  # logged once, not once a step


def test_a_fault_outside_any_row_costs_the_step_its_drafts_and_never_propagates(tiny_model, caplog):
    engine = _Engine(tiny_model)
    prompt = _prompts(tiny_model, count=1, seed=36)[0][0].tolist()
    engine.add("a", prompt, 20)

    class Broken(_View):
        def req_ids(self):
            raise KeyError("vLLM moved something")

    for _ in range(3):
        engine.proposer.bind(Broken(engine))
        assert engine.proposer.propose([[5]], np.array([len(prompt)]), engine.tokens) == [[]]
    assert len([r for r in caplog.records if "outside any one request" in r.getMessage()]) == 1


# ---------------------------------------------------------------------------------------------------------------
# Options: whose earlier answers a request drafts from; the bound on a step's slowdown; seeded sampling


def _random_prompt(model, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (40,), generator=generator).tolist()


def _sessions(engine):
    """Record every session the proposer's drafter starts, by prompt length order of creation."""
    sessions = []
    real = engine.proposer.drafter.start

    def start(prompt, **kwargs):
        sessions.append(real(prompt, **kwargs))
        return sessions[-1]

    engine.proposer.drafter.start = start
    return sessions


@pytest.mark.parametrize("scope", ["user", "shared", "off"])
def test_with_the_user_scope_a_client_never_drafts_from_another_clients_answer(tiny_model, scope):
    prompt = _random_prompt(tiny_model, 37)  # nothing to copy from itself: the earlier answer is the draft
    engine = _Engine(tiny_model, options={"cache_scope": scope})
    sessions = _sessions(engine)
    for req_id, client in (("first", "alice"), ("other", "bob"), ("again", "alice")):
        engine.add(req_id, prompt, 30, client=client)  # one after the other: each finds the earlier answers
        assert _drive(engine)[req_id] == _greedy(tiny_model, prompt, 30)
    first, other, again = sessions
    assert first.cache_drafted == 0
    if scope == "user":
        assert other.cache_drafted == 0 and again.cache_accepted > 0  # alice's answer is alice's only
    elif scope == "shared":
        assert other.cache_accepted > 0 and again.cache_accepted > 0
    else:
        assert other.cache_drafted == again.cache_drafted == 0 and engine.proposer.drafter.cache is None


def test_a_request_with_nothing_to_copy_pays_at_most_the_bound_for_the_others_drafts(tiny_model):
    # An open-ended row (nothing to copy) beside a row whose prediction is its answer, on a fixed
    # cost line (a drafted token costs 10% of a step's fixed part): the open row's account against plain decoding
    # stays within max_slowdown of its tokens (plus the start allowance); without the bound it does not.
    from lookupdec.policy import START_TOKENS

    copy_prompt, open_prompt = _random_prompt(tiny_model, 40), _random_prompt(tiny_model, 41)
    answer = _greedy(tiny_model, copy_prompt, 120)
    ledgers, drafted = {}, {}
    for bound in (0.05, None):
        engine = _Engine(tiny_model, k=16, options={"max_slowdown": bound, "cache_scope": "off"})
        engine.proposer.cost.line = lambda: (1.0, 0.1)
        started = {}
        real = engine.proposer.drafter.start

        def start(prompt, real=real, started=started, **kwargs):
            started[len(started)] = session = real(prompt, **kwargs)
            session.is_open = list(prompt) == open_prompt
            if session.is_open:  # nothing to copy (a tiny random model may repeat itself, which would copy)
                session.offer = lambda limit, s=session: Offer(np.zeros(0, dtype=np.int32), 0.0, 0.0, s.ledger.room())
            return session

        engine.proposer.drafter.start = start
        engine.add("copy", copy_prompt, 120, prediction=answer)
        engine.add("open", open_prompt, 60)
        outputs = _drive(engine)
        assert outputs["open"] == _greedy(tiny_model, open_prompt, 60) and outputs["copy"] == answer
        (ledgers[bound],) = [session.ledger for session in started.values() if session.is_open]
        drafted[bound] = sum(engine.lengths["copy"])
    bounded, free = ledgers[0.05], ledgers[None]
    assert bounded.excess <= 0.05 * (bounded.produced + START_TOKENS) + 1e-9
    assert free.excess > 0.05 * (free.produced + START_TOKENS)
    assert 0 < drafted[0.05] < drafted[None]


def test_max_slowdown_bounds_what_a_step_may_cost(tiny_model):
    prompt = _prompts(tiny_model, count=1, seed=38)[0][0].tolist()
    drafted = {}
    for bound in (None, 0.0):
        engine = _Engine(tiny_model, options={"max_slowdown": bound})
        engine.add("a", prompt, 30)
        assert _drive(engine)["a"] == _greedy(tiny_model, prompt, 30)
        drafted[bound] = engine.drafted
    assert drafted[None] > 0 and drafted[0.0] == 0  # no step may take longer than a plain one: no drafts


def test_a_seeded_sampled_request_drafts_the_same_whatever_ran_before(tiny_model):
    # vLLM draws a seeded request's random numbers per drafted token, so its answer depends on its draft lengths:
    # they must depend on its own tokens only, not on the shared estimates, the rolling cache or the clock.
    prompt = _random_prompt(tiny_model, 39)
    lengths = {}
    for history in ("fresh", "busy"):
        engine = _Engine(tiny_model)
        if history == "busy":  # an earlier answer to the same prompt in the cache, a fitted cost line
            engine.add("earlier", prompt, 30)
            _drive(engine)
            for n in (1, 9, 17, 33) * 4:
                engine.proposer.cost.observe(n, 0.01 + 0.02 * n)
        for seeded in (True, False):
            name = f"{history}-{seeded}"
            engine.add(name, prompt, 30, seeded=seeded)
            assert _drive(engine)[name] == _greedy(tiny_model, prompt, 30)
            lengths[history, seeded] = engine.lengths[name]
    assert lengths["fresh", True] == lengths["busy", True]
    assert lengths["fresh", False] != lengths["busy", False]  # what the seeded path is kept from


# ---------------------------------------------------------------------------------------------------------------
# Pricing per token (lookupdec.policy.token_lengths, TokenCost), against a brute force over every length choice

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lookupdec.policy import Offer, TokenCost, token_lengths  # noqa: E402


def _brute(offers, base, per_token, others, margin, slowdown):
    """Best tokens-per-second over every tuple of lengths (each row a prefix of its offer), or None where no
    drafting beats a plain pass by more than ``margin``: the slow reference of token_lengths."""
    import itertools

    rows = len(offers)
    plain = base + per_token * (rows + others)
    cap = slowdown * plain / per_token
    best = None
    for lengths in itertools.product(*(range(o.tokens.size + 1) for o in offers)):
        if sum(lengths) > cap:
            continue
        expected = rows + sum(o.first * sum(o.then ** d for d in range(k)) for o, k in zip(offers, lengths))
        ratio = expected / (plain + per_token * sum(lengths))
        if best is None or ratio > best:
            best = ratio
    return best if best > (1 + margin) * rows / plain else None


offer_strategy = st.builds(lambda n, first, then: Offer(np.zeros(n, dtype=np.int32), first, then),
                           st.integers(0, 4), st.floats(0.0, 1.0), st.floats(0.0, 0.99))


@settings(max_examples=300, deadline=None)
@given(st.lists(offer_strategy, min_size=1, max_size=3), st.floats(0.01, 1.0), st.floats(0.001, 0.5),
       st.integers(0, 3), st.sampled_from([0.02, 0.0]), st.sampled_from([0.2, 1.0, float("inf")]))
def test_token_lengths_match_a_brute_force(offers, base, per_token, others, margin, slowdown):
    lengths = token_lengths(offers, base, per_token, others=others, margin=margin, slowdown=slowdown)
    assert all(0 <= k <= o.tokens.size for k, o in zip(lengths, offers))
    best = _brute(offers, base, per_token, others, margin, slowdown)
    if best is None:
        assert lengths == [0] * len(offers)
        return
    rows = len(offers)
    expected = rows + sum(o.first * sum(o.then ** d for d in range(k)) for o, k in zip(offers, lengths))
    ratio = expected / (base + per_token * (rows + others + sum(lengths)))
    assert ratio == pytest.approx(best, rel=1e-9)


def test_token_lengths_price_what_rows_share():
    sure = Offer(np.zeros(16, dtype=np.int32), 0.95, 0.95)
    # A token costing 18% of a pass's fixed part (vLLM on this CPU): a sure copy drafts far, an unlikely one not.
    assert token_lengths([sure], 1.0, 0.18)[0] >= 8
    assert token_lengths([Offer(np.zeros(16, dtype=np.int32), 0.1, 0.5)], 1.0, 0.18) == [0]
    # Nearly free tokens (an accelerator): every offered token of the sure copy.
    assert token_lengths([sure], 1.0, 0.001) == [16]
    # Beside a row that drafts nothing, the 20% bound caps the pass at 1.2 plain ones.
    lengths = token_lengths([sure, Offer(np.zeros(0, dtype=np.int32), 0.0, 0.0)], 1.0, 0.05, slowdown=0.2)
    assert lengths[1] == 0 and 0 < lengths[0] <= 0.2 * 1.1 / 0.05


def test_token_cost_fits_the_line_and_assumes_the_slope_until_it_can_fit_one():
    cost = TokenCost()
    assert cost.line() == (1.0, TokenCost.PRIOR_SHARE)
    for _ in range(5):
        cost.observe(1, 0.06)
    base, per_token = cost.line()  # one token count only: the level measured, the slope assumed
    assert base + per_token == pytest.approx(0.06) and per_token == pytest.approx(TokenCost.PRIOR_SHARE * base)
    for n in (1, 5, 9, 17, 3, 12) * 3:
        cost.observe(n, 0.055 + 0.01 * n)
    base, per_token = cost.line()
    assert base == pytest.approx(0.055, rel=0.05) and per_token == pytest.approx(0.01, rel=0.05)
    cost.observe(0, 1.0)
    cost.observe(3, float("nan"))  # neither is a pass: ignored
    assert cost.line() == (base, per_token)


def test_token_cost_does_not_price_drafts_as_free_on_a_noisy_narrow_fit():
    # (scheduled tokens, ms) of the first drafting-free-of-prefill steps of a vLLM CPU server at four to eight
    # requests: sizes 1-11, 40-68 ms of scatter. Their least-squares slope is below zero; clamped to zero it priced
    # drafts as free, and every row then drafted its longest, in steps of ~100 tokens taking 0.34-0.41 s.
    steps = [(4, 41.6), (1, 46.3), (1, 49.4), (1, 45.3), (1, 45.0), (1, 45.2), (4, 39.2), (4, 40.4), (4, 40.8),
             (2, 54.3), (8, 56.0), (11, 67.5), (5, 49.0), (5, 45.3), (6, 51.6), (5, 47.0), (4, 52.8), (2, 56.9),
             (2, 61.2), (6, 46.4), (6, 40.2), (2, 56.5), (2, 66.5), (2, 67.8), (1, 59.6)]
    cost = TokenCost()
    for tokens, ms in steps:
        cost.observe(tokens, ms / 1000)
    base, per_token = cost.line()
    assert 0.04 < base < 0.06
    assert per_token > 0.01 * base  # a step of eight rows and 100 drafted tokens priced at over 1.9 plain ones


def test_steps_the_cost_fit_priced_too_cheaply_correct_it():
    # A fit that found tokens free (steps of 1-8 tokens all 50 ms) meets steps of 100 tokens taking 0.35 s: those
    # are the evidence that corrects it, not outliers to drop. An idle gap is still dropped.
    proposer = proposer_module.LookupProposer(_config())
    clock = 0.0

    def step(tokens, seconds):
        nonlocal clock
        proposer._last_end = clock
        clock += seconds
        proposer._observe(SimpleNamespace(scheduled_tokens=lambda: tokens, prompt_tokens=lambda: 0), clock)

    for tokens in (1, 2, 3, 4, 5, 6, 7, 8) * 3:
        step(tokens, 0.050)
    assert proposer.cost.line() == pytest.approx((0.050, 0.0))
    step(8, 10.0)  # the engine idled
    assert proposer.cost.line() == pytest.approx((0.050, 0.0))
    for _ in range(5):
        step(100, 0.050 + 0.003 * 100)
    base, per_token = proposer.cost.line()
    assert per_token > 0.0015


def test_the_served_cost_line_is_fitted_on_steps_without_prompt_tokens():
    # A step costs 50 ms, 2.2 ms a verified token (a row's last one or a draft), 1.5 ms a prompt token (it computes
    # no logits). Steps that prefill beside the rows must not pull the drafts' price towards the prompt tokens'.
    proposer = proposer_module.LookupProposer(_config())
    rng = np.random.default_rng(0)
    clock = 0.0
    for step in range(300):
        rows, drafted = 4, int(rng.integers(0, 24))
        prompt = 200 if step % 3 == 0 else 0
        view = SimpleNamespace(scheduled_tokens=lambda n=rows + drafted + prompt: n,
                               prompt_tokens=lambda p=prompt: p)
        proposer._last_end = clock
        clock += 0.050 + 0.0022 * (rows + drafted) + 0.0015 * prompt
        proposer._observe(view, clock)
    base, per_token = proposer.cost.line()
    assert base == pytest.approx(0.050, rel=0.02) and per_token == pytest.approx(0.0022, rel=0.02)


def test_the_runner_view_counts_the_prompt_tokens_a_step_scheduled():
    # a: its last token; b: its last token and four drafts; c and d: chunks of their prompts.
    out = SimpleNamespace(total_num_scheduled_tokens=209, num_scheduled_tokens={"a": 1, "b": 5, "c": 200, "d": 3},
                          scheduled_spec_decode_tokens={"b": [7, 8, 9, 10]})
    view = _internals.RunnerView(None, out)
    assert view.scheduled_tokens() == 209 and view.prompt_tokens() == 203
    out.scheduled_spec_decode_tokens = {}  # vLLM's default when nothing is drafted: b's five tokens are a chunk then
    assert view.prompt_tokens() == 208
