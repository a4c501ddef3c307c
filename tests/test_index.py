"""NgramIndex: golden tests that pin the match policy, and property tests against the plain-Python reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookupdec._reference import ngram_match, ngram_match_length, ngram_propose
from lookupdec.index import NgramIndex


def _index(tokens, min_n=1, max_n=4, capacity=1024):
    index = NgramIndex(min_n=min_n, max_n=max_n, capacity=capacity)
    index.extend(tokens)
    return index


def _assert_draft(draft, expected):
    assert isinstance(draft, np.ndarray) and draft.dtype == np.int32 and draft.ndim == 1
    assert draft.tolist() == list(expected)


# ------------------------------------------------------------------------------------------------------ golden rules


def test_most_recent_source_wins_a_tie():
    # Suffix [5] occurred at t=0 (followed by 1) and at t=3 (followed by 3): the most recent, src=4, wins.
    index = _index([5, 1, 2, 5, 3, 2, 5], max_n=1)
    assert index.match() == (1, 4)
    _assert_draft(index.propose(3), [3, 2, 5])  # Not [1, 2, 5]


def test_longest_match_beats_a_more_recent_shorter_one():
    # Suffix [1, 2, 3]: the 3-gram occurred at src=3 (followed by 9); the 1-gram [3] is more recent (src=6, followed
    # by 8) but shorter, so the 3-gram wins.
    index = _index([1, 2, 3, 9, 7, 3, 8, 1, 2, 3], max_n=3)
    assert index.match() == (3, 3)
    _assert_draft(index.propose(2), [9, 7])  # Not [8, 1]


def test_longest_n_is_capped_at_max_n_then_most_recent_wins():
    # With max_n=1 the same buffer only sees the 1-gram [3]; its most recent source is src=6.
    index = _index([1, 2, 3, 9, 7, 3, 8, 1, 2, 3], max_n=1)
    assert index.match() == (1, 6)
    _assert_draft(index.propose(2), [8, 1])  # Not [9, 7]


def test_matches_shorter_than_min_n_are_ignored():
    # Suffix [1] occurred at src=1, but with min_n=2 only the 2-gram [3, 1] counts, and it never occurred before.
    index = _index([1, 2, 3, 1], min_n=2, max_n=3)
    assert index.match() == (0, -1)
    _assert_draft(index.propose(4), [])  # Not [2, 3, 1]


def test_suffix_is_never_its_own_source():
    # A lone token has no earlier occurrence; [7, 7]'s 2-gram suffix only occurs ending at L, so n falls back to 1.
    assert _index([7], max_n=4).match() == (0, -1)
    index = _index([7, 7], max_n=4)
    assert index.match() == (1, 1)
    _assert_draft(index.propose(4), [7])


def test_draft_never_runs_past_the_last_known_token():
    # Suffix [1, 2] occurred at src=2, and only 2 tokens are known after it.
    index = _index([1, 2, 1, 2], max_n=2)
    assert index.match() == (2, 2)
    _assert_draft(index.propose(5), [1, 2])  # Not 5 tokens
    _assert_draft(index.continuation(2, 5), [1, 2])
    _assert_draft(index.continuation(4, 5), [])


def test_negative_ids_are_ordinary_tokens():
    # -1 separates two reference documents; the suffix [-1, 4] occurred at src=2 and is followed by 6.
    index = _index([-1, 4, 6, -1, 4], max_n=2)
    assert index.match() == (2, 2)
    _assert_draft(index.propose(3), [6, -1, 4])


def test_no_draft_is_an_empty_int32_array():
    empty = NgramIndex()
    assert len(empty) == 0 and empty.match() == (0, -1)
    _assert_draft(empty.propose(3), [])
    _assert_draft(_index([1, 2, 3]).propose(3), [])  # no repeated token at all
    _assert_draft(_index([1, 2, 1]).propose(0), [])  # a match exists, but k == 0
    _assert_draft(empty.continuation(0, 3), [])


def test_match_length_measures_beyond_max_n():
    # tokens[:7] and tokens[:11] share the suffix [3, 1, 2, 3] (4 tokens), although the index keys on max_n=2 only.
    tokens = [9, 0, 3, 1, 2, 3, 5, 3, 1, 2, 3]
    index = _index(tokens, max_n=2)
    assert index.match() == (2, 6)
    assert index.match_length(6, cap=16) == 4
    assert index.match_length(6, cap=3) == 3
    assert index.match_length(len(tokens), cap=5) == 5  # the buffer against itself: only the cap stops it


def test_tokens_view_and_reset():
    index = _index(np.array([4, 5, 4], dtype=np.int64))
    assert index.tokens.dtype == np.int32 and index.tokens.tolist() == [4, 5, 4]
    assert index.match() == (1, 1)
    index.reset([6, 6, 6])
    assert len(index) == 3 and index.match() == (2, 2)  # nothing from [4, 5, 4] survives
    index.reset()
    assert len(index) == 0 and index.match() == (0, -1)


def test_extend_accepts_lists_numpy_and_torch():
    torch = pytest.importorskip("torch")
    index = NgramIndex(max_n=2)
    index.extend([3, 4])
    index.extend(np.array([9, 3], dtype=np.uint16))
    index.extend(torch.tensor([4], dtype=torch.int64))  # np.asarray reads a CPU tensor directly
    assert index.tokens.tolist() == [3, 4, 9, 3, 4]
    assert index.match() == (2, 2)


def test_growth_past_initial_capacity_keeps_exactness():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 3, size=10_000).astype(np.int32)
    index = NgramIndex(min_n=1, max_n=8, capacity=1)
    end = 0
    for step, chunk in enumerate(rng.integers(1, 64, size=10_000)):
        if end >= len(tokens):
            break
        index.extend(tokens[end : end + chunk])
        end = min(end + chunk, len(tokens))
        if step % 25 == 0:
            assert index.match() == ngram_match(tokens[:end].tolist(), 1, 8)
    assert len(index) == len(tokens)
    assert index.tokens.tolist() == tokens.tolist()
    assert index.match() == ngram_match(tokens.tolist(), 1, 8)
    # A large vocabulary makes most n-grams distinct, so the node table grows many times too.
    wide = rng.integers(-5, 50_000, size=10_000)
    index.reset(wide)
    assert index.match() == ngram_match(wide.tolist(), 1, 8)


@pytest.mark.parametrize(
    "kwargs",
    [dict(min_n=0), dict(max_n=17), dict(min_n=3, max_n=2), dict(capacity=0)],
)
def test_invalid_constructor_arguments(kwargs):
    with pytest.raises(ValueError, match="1 <= min_n <= max_n <= 16|capacity must be >= 1"):
        NgramIndex(**kwargs)


def test_invalid_token_input():
    index = NgramIndex()
    with pytest.raises(ValueError, match="int32"):
        index.extend([2**31])
    with pytest.raises(TypeError):
        index.extend([1.5])
    with pytest.raises(ValueError, match="1-D"):
        index.extend([[1, 2]])
    assert len(index) == 0  # a rejected extend changes nothing


def test_proposal_work_does_not_grow_with_context_length():
    # Not a timing test: the match kernel counts the hash slots it inspects. It does at most max_n lookups, and with
    # the load factor held at <= 0.5 each lookup inspects O(1) slots, so the count must not drift upward with L.
    rng = np.random.default_rng(1)
    for vocab in (4, 1000):
        tokens = rng.integers(0, vocab, size=50_000).astype(np.int32)
        index = NgramIndex(min_n=1, max_n=4)
        probes_at = {}
        end = 0
        for length in (1_000, 50_000):
            samples = []
            while end < length:
                index.extend(tokens[end : end + 1])
                end += 1
                index.match()
                samples.append(index._last_probes)
            probes_at[length] = np.mean(samples[-500:])
        assert probes_at[50_000] <= 4 * 3  # max_n lookups x a few slots each
        assert probes_at[50_000] <= 2 * probes_at[1_000] + 1


# -------------------------------------------------------------------------------------------- against the reference

_vocab = st.sampled_from([2, 3, 4, 50])
_ngram_range = st.tuples(st.integers(1, 6), st.integers(0, 5)).map(lambda p: (p[0], p[0] + p[1]))


def _check_against_reference(index, tokens, min_n, max_n, k, probe_src, cap):
    assert len(index) == len(tokens) and index.tokens.tolist() == tokens
    n, src = index.match()
    assert (n, src) == ngram_match(tokens, min_n, max_n)
    _assert_draft(index.propose(k), ngram_propose(tokens, min_n, max_n, k))
    if n:
        assert index.match_length(src, cap) == ngram_match_length(tokens, src, cap)
        assert index.match_length(src, max_n) >= n  # the match itself is a common suffix
    probe_src = min(probe_src, len(tokens))
    assert index.match_length(probe_src, cap) == ngram_match_length(tokens, probe_src, cap)
    _assert_draft(index.continuation(probe_src, k), tokens[probe_src : probe_src + k])


@settings(deadline=None, max_examples=300)
@given(data=st.data(), vocab=_vocab, ngram_range=_ngram_range)
def test_incremental_index_matches_reference(data, vocab, ngram_range):
    min_n, max_n = ngram_range
    token = st.integers(-1, vocab - 2)  # -1 plays the separator
    index = NgramIndex(min_n=min_n, max_n=max_n, capacity=data.draw(st.integers(1, 8)))
    tokens = []
    for _ in range(data.draw(st.integers(1, 12))):
        chunk = data.draw(st.lists(token, max_size=20))
        if data.draw(st.integers(0, 9)) == 0:
            index.reset(chunk)
            tokens = list(chunk)
        else:
            index.extend(np.array(chunk, dtype=np.int64) if data.draw(st.booleans()) else chunk)
            tokens += chunk
        k = data.draw(st.integers(0, 8))
        _check_against_reference(
            index, tokens, min_n, max_n, k, data.draw(st.integers(0, 200)), data.draw(st.integers(0, 20))
        )


@settings(deadline=None, max_examples=100)
@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=60)
    | st.lists(st.sampled_from([-(2**31), -1, 0, 2**31 - 1]), max_size=60),
    ngram_range=_ngram_range,
)
def test_extreme_token_ids_match_reference(tokens, ngram_range):
    # The whole int32 range hashes and compares exactly (the hash packs the token's 32 bits).
    min_n, max_n = ngram_range
    index = _index(tokens, min_n, max_n)
    assert index.match() == ngram_match(tokens, min_n, max_n)
