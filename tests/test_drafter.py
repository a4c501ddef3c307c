"""LookupDrafter: the match policy, the cost model, and configuration. No model needed."""

import dataclasses

import numpy as np
import pytest

from lookupdec import DrafterConfig, LookupDrafter, RollingCache
from lookupdec.drafter import Drafter, NoDrafts
from lookupdec.policy import Acceptance, Offer, PassCost, best_batch_length, best_draft_length, linear_costs


def _session(prompt, **config):
    drafter = LookupDrafter(adaptive=False, use_cache=False, **config)
    return drafter, drafter.start(np.asarray(prompt, dtype=np.int32))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_draft": 0}, r"max_draft must be in \[1, 256\]"),
    ({"max_draft": 257}, r"max_draft must be in \[1, 256\]"),
    ({"min_n": 0}, "1 <= min_n <= max_n <= 16"),
    ({"min_n": 3, "max_n": 2}, "1 <= min_n <= max_n <= 16"),
    ({"max_n": 17}, "1 <= min_n <= max_n <= 16"),
    ({"cache_tokens": 0}, "cache_tokens must be >= 1"),
    ({"cursor": 0}, "cursor must be True or False"),
    ({"guard": "no"}, "guard must be True or False"),
    ({"adaptive": None}, "adaptive must be True or False"),
    ({"use_cache": 1}, "use_cache must be True or False"),
])
def test_invalid_config_is_refused_with_the_allowed_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DrafterConfig(**kwargs)
    with pytest.raises(ValueError, match=message):
        LookupDrafter(**kwargs)


def test_config_and_fields_are_exclusive():
    with pytest.raises(TypeError):
        LookupDrafter(DrafterConfig(), max_draft=4)


def test_no_draft_is_always_an_empty_int32_array():
    _, session = _session([5, 6, 7])
    for limit in (0, 3):
        draft = session.propose(limit)
        assert isinstance(draft, np.ndarray) and draft.dtype == np.int32 and draft.size == 0


def test_draft_copies_the_continuation_of_the_suffix():
    _, session = _session([1, 2, 3, 4, 5, 9, 1, 2])
    assert session.propose(3).tolist() == [3, 4, 5]


def test_draft_respects_the_limit_and_max_draft():
    _, session = _session(list(range(10, 50)) + [10, 11], max_draft=5)
    assert session.propose(100).tolist() == [12, 13, 14, 15, 16]  # max_draft
    assert session.propose(2).tolist() == [12, 13]  # the caller's budget


def test_draft_stops_after_eos():
    drafter = LookupDrafter(adaptive=False, use_cache=False)
    session = drafter.start(np.array([1, 2, 3, 99, 4, 1, 2]), eos_ids=[99])
    assert session.propose(10).tolist() == [3, 99]  # Not [3, 99, 4, 1, 2]: a draft never crosses EOS


def test_draft_never_crosses_into_another_reference():
    # references [7, 8, 9] and [5, 6]: the separator between them ends a draft copied from the first.
    drafter = LookupDrafter(adaptive=False, use_cache=False, references=[[7, 8, 9], [5, 6]])
    session = drafter.start(np.array([3, 7, 8]))
    assert session.propose(10).tolist() == [9]


def test_string_references_need_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        LookupDrafter(references=["some text"])


def test_cursor_keeps_copying_from_the_same_occurrence():
    # "1 2 3 4" occurs twice in the source, followed by 20 the first time and by 30 the second. The output is
    # copying the first occurrence; once it has produced "1 2 3 4" the cursor goes on with 20, where the index
    # alone would jump to the most recent occurrence and draft 30.
    source = [5, 1, 2, 3, 4, 20, 21, 9, 1, 2, 3, 4, 30, 31]
    _, session = _session(source + [5])
    assert session.propose(3).tolist() == [1, 2, 3]
    session.commit([1, 2, 3, 4])  # all accepted, the target added 4
    assert session.index.match()[1] == 12  # the index alone: the second occurrence
    assert session.propose(3).tolist() == [20, 21, 9]  # Not [30, 31]


def test_without_the_cursor_every_draft_searches_the_index_again():
    # The same text as above with cursor=False: after "1 2 3 4" the index's most recent occurrence wins.
    source = [5, 1, 2, 3, 4, 20, 21, 9, 1, 2, 3, 4, 30, 31]
    _, session = _session(source + [5], cursor=False)
    assert session.propose(3).tolist() == [1, 2, 3]
    session.commit([1, 2, 3, 4])
    assert session.propose(3).tolist() == [30, 31, 5]  # Not [20, 21, 9]: no cursor to follow


def test_output_of_a_finished_request_helps_the_next_one_through_the_cache():
    cache = RollingCache(max_tokens=1000)
    drafter = LookupDrafter(adaptive=False, cache=cache)
    first = drafter.start(np.array([1, 2, 3]))
    first.commit([50, 51, 52, 53, 54, 55])
    first.finish()
    assert len(cache) > 0
    second = drafter.start(np.array([7, 8, 50, 51]))  # the new prompt ends like the old output began
    assert second.propose(3).tolist() == [52, 53, 54]


def _finished_into_cache(output, eos_ids=(), **finish):
    """The rolling cache's sequences after a request with prompt [100, 101, 102] committed ``output`` and finished."""
    cache = RollingCache(max_tokens=1000, min_n=2, max_n=2)
    drafter = LookupDrafter(adaptive=False, cache=cache)
    session = drafter.start(np.array([100, 101, 102]), eos_ids=eos_ids)
    for start in range(0, len(output), 3):  # several verified steps
        session.commit(output[start:start + 3])
    session.finish(**finish)
    return cache


def test_finish_adds_only_the_output_the_client_received():
    # A server ends at a stop string in text after committing more tokens than it sent: only the first `generated`
    # join the cache (with the max_n prompt tokens before them, so the output's first tokens can be matched).
    cache = _finished_into_cache([1, 2, 3, 4, 5, 6, 7, 8], generated=4)
    assert [s.tolist() for s in cache.sequences()] == [[101, 102, 1, 2, 3, 4]]
    assert cache.lookup([2, 3], 4)[1].tolist() == [4]  # cut at the 4th token, not [4, 5, 6, 7]
    for context in ([3, 4], [4, 5], [5, 6], [7, 8]):  # nothing follows the 4th token; 5.. were never sent
        assert cache.lookup(context, 4)[0] == 0, context
    assert cache.lookup([102, 1], 2)[1].tolist() == [2, 3]


def test_finish_without_a_count_adds_every_committed_token_and_with_zero_none():
    assert [s.tolist() for s in _finished_into_cache([1, 2, 3, 4, 5]).sequences()] == [[101, 102, 1, 2, 3, 4, 5]]
    assert len(_finished_into_cache([1, 2, 3, 4, 5], generated=0)) == 0


def test_nothing_after_eos_joins_the_cache():
    # EOS ends a request; tokens a loop committed after it were never output.
    cache = _finished_into_cache([1, 2, 99, 5, 6], eos_ids=[99])
    assert [s.tolist() for s in cache.sequences()] == [[101, 102, 1, 2, 99]]
    cache = _finished_into_cache([1, 2, 99, 5, 6], eos_ids=[99], generated=2)
    assert [s.tolist() for s in cache.sequences()] == [[101, 102, 1, 2]]


@pytest.mark.parametrize("generated", [-1, 6, 2.0, True, "3"])
def test_finish_refuses_a_count_it_cannot_have_sent(generated):
    cache = RollingCache(max_tokens=1000, min_n=2, max_n=2)
    session = LookupDrafter(adaptive=False, cache=cache).start(np.array([100, 101, 102]))
    session.commit([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match=r"generated must be an integer in \[0, 5\]"):
        session.finish(generated)
    assert len(cache) == 0
    session.finish(5)  # the refused call did not end the session
    session.finish(5)  # and only the first call adds
    assert cache.num_sequences == 1


def test_no_drafts_session_takes_the_same_finish():
    session = NoDrafts()
    session.commit([1, 2])
    session.finish(1)
    session.finish()


def test_use_cache_false_means_no_cache():
    assert LookupDrafter(use_cache=False).cache is None
    assert LookupDrafter().cache is not None


def test_adaptive_drafter_stops_drafting_where_drafts_fail():
    # Text where every index match is wrong: after a few rejected drafts the drafter stops proposing.
    drafter = LookupDrafter(use_cache=False)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 4, size=200).astype(np.int32)  # tiny vocabulary: matches everywhere, all noise
    session = drafter.start(prompt)
    lengths = []
    for _ in range(60):
        draft = session.propose(16)
        lengths.append(len(draft))
        truth = rng.integers(100, 200, size=len(draft) + 1)  # never what was drafted
        session.commit(truth[:1], seconds=1.0 if len(draft) == 0 else 1.6)
    assert sum(lengths[-20:]) == 0, lengths


def test_without_the_guard_the_drafter_keeps_drafting_where_drafts_fail():
    # Hopeless text again, but the output stays in the prompt's vocabulary, so there is always a candidate. The
    # default stops drafting; with guard=False the adaptive length still shrinks, but never to nothing.
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 4, size=200).astype(np.int32)
    lengths = {}
    for guard in (True, False):
        session = LookupDrafter(use_cache=False, guard=guard).start(prompt)
        lengths[guard] = []
        for _ in range(60):
            draft = session.propose(16)
            lengths[guard].append(len(draft))
            wrong = (draft[0] + 1) % 4 if len(draft) else rng.integers(0, 4)  # never the drafted token
            session.commit([wrong], seconds=1.0 if len(draft) == 0 else 1.6)
    assert lengths[True][-20:].count(0) >= 5, lengths[True]  # the guard skips drafts that do not pay
    assert min(lengths[False]) >= 1 and max(lengths[False][-20:]) < 16, lengths[False]


def test_a_caller_that_must_draft_gets_the_length_that_pays_best_in_a_pass_it_pays_anyway():
    # transformers' sampling rule cannot verify an empty draft. Where the guard would draft nothing, must_draft
    # drafts the best length of at least one token under the cost curve: here 3, the cheapest pass of this jagged
    # profile.
    # (No slowdown bound: its room would stop the failing drafts before the estimates learn, which is not what this
    # test is about.)
    rng = np.random.default_rng(0)
    drafter = LookupDrafter(use_cache=False, max_slowdown=None)
    drafter.cost.use_profile([1.0, 1.6, 2.0, 1.5, 1.7, 1.75, 1.95, 1.8, 2.0] + [2.0 + 0.1 * d for d in range(1, 25)])
    session = drafter.start(rng.integers(0, 4, size=200).astype(np.int32))  # a candidate is always on offer
    skipped = 0
    for _ in range(40):  # every draft fails at its first token: copies stop paying
        draft = session.propose(16)
        skipped += draft.size == 0
        session.commit([(draft[0] + 1) % 4 if draft.size else rng.integers(0, 4)])
    assert skipped  # the guard: a plain step pays better
    while session.propose(16).size:
        session.commit([rng.integers(0, 4)])
    assert session.propose(16, must_draft=True).size == 3
    assert LookupDrafter(use_cache=False).start([1, 2, 3]).propose(8, must_draft=True).size == 0  # no candidate


def test_adaptive_drafter_drafts_long_on_a_faithful_copy():
    drafter = LookupDrafter(use_cache=False)
    source = np.arange(1000, 1400, dtype=np.int32)
    session = drafter.start(np.concatenate([source, source[:3]]))
    pos, lengths = 3, []
    while pos < 300:
        draft = session.propose(32)
        lengths.append(len(draft))
        truth = source[pos: pos + len(draft) + 1]
        accepted = len(draft) if np.array_equal(draft, truth[: len(draft)]) else 0
        session.commit(truth[: accepted + 1], seconds=1.0 + 0.6 * bool(len(draft)))
        pos += accepted + 1
    assert max(lengths[-5:]) >= 16, lengths


@pytest.mark.parametrize("first, then, jump, slope, expected", [
    (0.0, 0.9, 0.55, 0.05, 0),  # the first token is never accepted: never draft
    (0.3, 0.3, 0.55, 0.05, 0),  # 1 + 0.3 + ... < 1.6: a draft costs more than it yields
    (0.99, 0.99, 0.55, 0.05, 32),  # a near-certain copy: as long as allowed
    (0.5, 0.5, 0.0, 0.0, 32),  # drafting is free: any chance pays, take all
    (0.5, 0.98, 0.55, 0.05, 32),  # a coin flip whether the copy is right, but if it is, it runs long
])
def test_best_draft_length(first, then, jump, slope, expected):
    assert best_draft_length(first, then, linear_costs(jump, slope, 32)) == expected


def test_best_draft_length_is_the_argmax_of_expected_tokens_per_time():
    for first, then in ((0.6, 0.6), (0.8, 0.9), (0.5, 0.95)):
        gains = [1.02] + [(1 + first * sum(then**i for i in range(d))) / (1.55 + 0.05 * d) for d in range(1, 33)]
        assert best_draft_length(first, then, linear_costs(0.55, 0.05, 32)) == int(np.argmax(gains))


# This project's CPU, one torch thread (lookupdec.calibrate): 2 drafted tokens cost more than 3.
JAGGED = [1.0, 1.61, 1.98, 1.51, 1.72, 1.75, 1.95, 1.79, 2.01]


def test_best_draft_length_weighs_every_length_of_a_jagged_cost_curve():
    # A short, shaky copy (first token 60%, each next 50%): on this curve 3 drafted tokens cost less than 2, so 3
    # wins; a straight line through similar end points prices 3 above 2 and picks another length.
    gains = [(1 + 0.6 * sum(0.5**i for i in range(d))) / JAGGED[d] for d in range(1, 9)]
    assert best_draft_length(0.6, 0.5, JAGGED) == 1 + int(np.argmax(gains)) == 3
    assert best_draft_length(0.6, 0.5, linear_costs(0.55, 0.06, 8)) != 3
    assert best_draft_length(0.2, 0.5, JAGGED) == 0  # nothing beats a plain step
    assert best_draft_length(0.9, 0.9, JAGGED[:1]) == 0  # no room to draft


def test_a_profile_replaces_the_straight_line_and_extends_past_its_end():
    cost = PassCost()
    assert cost.costs(3).tolist() == pytest.approx([1.0, *(1 + PassCost.PRIOR_JUMP + PassCost.PRIOR_SLOPE * d
                                                             for d in (1, 2, 3))])
    cost.use_profile([2.0, 3.2, 4.0, 3.0, 3.4])  # seconds are fine: it is made relative to d = 0
    assert cost.costs(4).tolist() == pytest.approx([1.0, 1.6, 2.0, 1.5, 1.7])
    assert cost.costs(2).tolist() == pytest.approx([1.0, 1.6, 2.0])
    longer = cost.costs(7)  # past the end: the slope of the profile's last quarter (1.5 -> 1.7 per token)
    assert longer[:5].tolist() == pytest.approx([1.0, 1.6, 2.0, 1.5, 1.7])
    assert longer[5:].tolist() == pytest.approx([1.9, 2.1, 2.3])
    for bad in ([1.0], [1.0, -1.0], [[1.0, 2.0]], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="pass-cost profile"):
            cost.use_profile(bad)
    cost.use_profile(None)
    assert cost.profile is None and cost.costs(1)[1] == pytest.approx(1 + PassCost.PRIOR_JUMP + PassCost.PRIOR_SLOPE)


def test_pass_cost_recovers_the_shape_it_is_shown():
    cost = PassCost()
    assert cost.relative() == (PassCost.PRIOR_JUMP, PassCost.PRIOR_SLOPE)  # nothing seen: the prior
    for _ in range(20):
        for d in (0, 2, 8, 16, 32):
            cost.observe(d, 0.040 if d == 0 else 0.040 * (1.3 + 0.02 * d))
    jump, slope = cost.relative()
    assert jump == pytest.approx(0.3, abs=1e-6)
    assert slope == pytest.approx(0.02, abs=1e-6)


def _offer(length, first, then):
    return Offer(np.arange(length, dtype=np.int32), first, then)


def test_best_batch_length_is_the_argmax_of_the_batchs_expected_tokens_per_time():
    offers = [_offer(32, 0.95, 0.97), _offer(5, 0.6, 0.8), _offer(0, 0.0, 0.0), _offer(20, 0.3, 0.5)]
    jump, slope = 0.2, 0.14

    def gain(d):
        if d == 0:
            return 1.02
        tokens = 4 + sum(o.first * sum(o.then**i for i in range(min(d, o.tokens.size))) for o in offers)
        return tokens / (4 * (1 + jump + slope * d))

    assert best_batch_length(offers, linear_costs(jump, slope, 32)) == int(np.argmax([gain(d) for d in range(33)]))


def test_batch_drafts_shrink_as_verification_gets_dearer():
    offers = [_offer(32, 0.8, 0.9)] * 4
    cheap = best_batch_length(offers, linear_costs(0.05, 0.02, 32))
    dear = best_batch_length(offers, linear_costs(0.4, 0.28, 32))
    assert cheap > dear > 0
    assert best_batch_length([_offer(32, 0.1, 0.5)] * 4, linear_costs(0.4, 0.28, 32)) == 0  # unlikely copies
    assert best_batch_length([_offer(0, 0.0, 0.0)] * 2, linear_costs(0.0, 0.0, 32)) == 0
    assert best_batch_length([_offer(32, 0.9, 0.9)] * 2, linear_costs(0.0, 0.0, 4)) == 4  # costs bound the width


def test_offer_then_take_is_propose_with_a_chosen_length():
    drafter = LookupDrafter(use_cache=False)
    session = drafter.start([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    offer = session.offer(10)
    assert offer.tokens.tolist() == [4, 5, 6, 7, 8, 1, 2, 3, 4, 5]  # the copy reaches the present: it repeats
    assert 0 < offer.first < 1 and 0 < offer.then < 1
    assert session.take(3).tolist() == [4, 5, 6]
    session.commit([4, 5, 6, 7])  # all 3 accepted: the cursor follows the copy
    assert session.offer(2).tokens.tolist() == [8, 1]
    assert session.take(0).size == 0


def test_batch_cost_is_per_batch_size_and_the_single_cost_for_one_row():
    drafter = LookupDrafter()
    assert drafter.batch_cost(1) is drafter.cost
    four, eight = drafter.batch_cost(4), drafter.batch_cost(8)
    assert four is drafter.batch_cost(4) and four is not eight
    assert four.relative()[1] < eight.relative()[1]  # priors: a drafted position costs more in a bigger batch


def test_a_copy_that_reaches_the_present_repeats_its_period():
    # The model is looping ("7 8 9" over and over): the most recent earlier occurrence continues into the text just
    # written, so the draft keeps repeating the period instead of stopping after one loop.
    drafter = LookupDrafter(adaptive=False, use_cache=False)
    session = drafter.start([5, 7, 8, 9, 7, 8, 9, 7, 8])
    assert session.propose(10).tolist() == [9, 7, 8, 9, 7, 8, 9, 7, 8, 9]
    # Any copy cut short by the end of the text runs into the present; its period is the distance back.
    session = drafter.start([1, 2, 3, 4, 9, 9, 1, 2])
    assert session.propose(10).tolist() == [3, 4, 9, 9, 1, 2, 3, 4, 9, 9]


def _replay(session, answer, limit=16):
    """Step a session through ``answer`` as a greedy target would; returns (passes, drafted, accepted)."""
    done, passes, drafted, accepted = 0, 0, 0, 0
    session.commit(np.asarray(answer[:1], dtype=np.int32))
    done = 1
    while done < len(answer):
        draft = session.propose(min(limit, len(answer) - done - 1))
        truth = answer[done:]
        k = 0
        while k < len(draft) and k < len(truth) - 1 and draft[k] == truth[k]:
            k += 1
        session.commit(np.asarray(truth[: k + 1], dtype=np.int32))
        passes, drafted, accepted, done = passes + 1, drafted + len(draft), accepted + k, done + k + 1
    return passes, drafted, accepted


def test_a_prediction_is_drafted_from_and_its_tokens_counted():
    # The prompt quotes the file; the prediction is the file too. Drafts come from the prediction's copy, and the
    # session counts its drafted tokens the target kept and did not; an edit in the middle costs a few tokens, then
    # drafting picks up again, even where the prediction tokenized differently around the edit.
    rng = np.random.default_rng(0)
    file = rng.integers(10, 500, size=300).tolist()
    edited = file[:150] + [7, 8] + file[152:]  # one edit
    prediction = file[:220] + [600, 601] + file[222:]  # and a stretch split differently
    prompt = [1, 2, 3] + file + [4, 5]
    drafter = Drafter(use_cache=False)
    session = drafter.start(prompt, eos_ids=[0], prediction=prediction)
    passes, drafted, accepted = _replay(session, edited)
    assert session.prediction_accepted + session.prediction_rejected <= drafted
    # Every pass adds one token the target chose, so about len / (limit + 1) of them were not drafted.
    # Around the differently split stretch one draft may come from the prompt's copy, until the suffix is found
    # in the prediction again.
    assert accepted - 20 <= session.prediction_accepted <= accepted and accepted >= len(edited) - 40
    assert 0 < session.prediction_rejected
    assert passes < len(edited) / 5


def test_without_a_prediction_nothing_is_counted_as_predicted():
    rng = np.random.default_rng(1)
    file = rng.integers(10, 500, size=120).tolist()
    session = Drafter(use_cache=False).start([1] + file, eos_ids=[0])
    _, drafted, accepted = _replay(session, file)
    assert accepted > 100 and session.prediction_accepted == session.prediction_rejected == 0


def test_a_batch_draft_never_slows_any_row_past_the_bound():
    # Three rows copy well, one has nothing to copy: the batch gains most with long drafts, which would make
    # the fourth row's every token cost costs[d] plain steps.
    offers = [_offer(32, 0.95, 0.97)] * 3 + [_offer(0, 0.0, 0.0)]
    costs = linear_costs(0.1, 0.05, 32)  # costs[d] = 1.1 + 0.05 d
    free = best_batch_length(offers, costs)
    assert costs[free] > 1.5  # the unbounded choice: the idle row runs more than 1.5x slower
    for slowdown in (0.2, 0.5, 1.0):
        d = best_batch_length(offers, costs, slowdown=slowdown)
        assert 0 < d < free
        assert costs[d] <= 1.0 + slowdown  # the idle row's time per token, in plain steps
    assert best_batch_length(offers, costs, slowdown=0.05) == 0  # no length is cheap enough: plain steps
    # A row that drafts too counts its expected tokens: four good copiers are not held back.
    assert best_batch_length([_offer(32, 0.95, 0.97)] * 4, costs, slowdown=0.2) == \
        best_batch_length([_offer(32, 0.95, 0.97)] * 4, costs)


def test_the_drafter_applies_the_batch_bound_of_its_config():
    offers = [_offer(32, 0.95, 0.97)] * 3 + [_offer(0, 0.0, 0.0)]
    tight = LookupDrafter(use_cache=False, calibrate=False, batch_slowdown=0.0)
    loose = LookupDrafter(use_cache=False, calibrate=False, batch_slowdown=10.0)
    unguarded = LookupDrafter(use_cache=False, calibrate=False, guard=False, batch_slowdown=0.0)
    assert tight.length(offers) == 0
    assert loose.length(offers) > 0
    assert unguarded.length(offers) > 0  # guard=False switches the bound off with the rest of the guard
    with pytest.raises(ValueError, match="batch_slowdown"):
        DrafterConfig(batch_slowdown=-0.1)


def test_each_request_keeps_its_own_record_of_its_drafts():
    # Two requests share one drafter: one copies its prompt (every draft right), one writes freely (every draft
    # wrong). The writer's estimates fall with its own misses; the copier's stay high, and the writer no longer
    # drafts on the copier's record.
    drafter = LookupDrafter(use_cache=False, calibrate=False)
    text = np.arange(100, 400, dtype=np.int32)
    copier = drafter.start(np.concatenate([text, text[:8]]))
    rng = np.random.default_rng(1)
    writer = drafter.start(rng.integers(0, 4, size=300).astype(np.int32))
    copied = 8
    firsts = {"copier": [], "writer": []}
    for _ in range(12):
        offer = copier.offer(8)
        firsts["copier"].append(offer.first)
        draft = copier.take(8)
        copier.commit(np.concatenate([draft, text[copied + len(draft): copied + len(draft) + 1]]))
        copied += len(draft) + 1
        offer = writer.offer(8)
        firsts["writer"].append(offer.first)
        draft = writer.take(8)
        writer.commit([(draft[0] + 1) % 4 if len(draft) else 0])  # never the drafted token
    assert firsts["writer"][-1] < 0.5 * firsts["writer"][0]
    assert firsts["writer"][-1] < 0.25 * firsts["copier"][-1]
    assert firsts["copier"][-1] >= 0.9 * firsts["copier"][0]
    # A later request starts from the record they left together, not from either one's.
    later = drafter.acceptance.record()
    assert firsts["writer"][-1] / firsts["writer"][0] < later.shared_scale < 1.0


def test_a_request_whose_copies_break_early_expects_short_runs_from_every_bucket():
    # A request's drafts keep getting their first token right and then break (a QA answer quoting its context in
    # short pieces): each bucket has seen only a draft or two, so its own then stays near its prior, but the
    # request's record of continuations scales the expected run down for every bucket, including one it never
    # drafted from. Another request, with a fresh record, is not affected; a request whose copies run on is not
    # shortened.
    acceptance = Acceptance()
    breaks, runs, fresh = acceptance.record(), acceptance.record(), acceptance.record()
    buckets = [("index", 2), ("index", 3), ("cursor", 4), ("index", 8)]
    for bucket in buckets:
        acceptance.update(bucket, 1, 12, breaks)  # the first token right, the second wrong
    untouched = ("cursor", 16)

    def run(then):  # the expected continuations of a copy whose first token was right
        return then / (1.0 - then)

    raw_then = acceptance.estimate(untouched)[1]
    assert run(acceptance.estimate(untouched, breaks)[1]) < 0.5 * run(raw_then)
    for bucket in buckets:
        assert run(acceptance.estimate(bucket, breaks)[1]) < 0.5 * run(acceptance.estimate(bucket)[1])
    assert acceptance.estimate(untouched, fresh)[1] == pytest.approx(raw_then)
    for bucket in buckets:
        acceptance.update(bucket, 12, 12, runs)  # every drafted token right
    assert acceptance.estimate(untouched, runs)[1] >= acceptance.estimate(untouched)[1]
    # The first-token odds are the first-token record's business: continuations do not move them.
    same_firsts = dataclasses.replace(breaks, runs_accepted=0.0, runs_predicted=0.0)
    assert acceptance.estimate(untouched, breaks)[0] == acceptance.estimate(untouched, same_firsts)[0]
