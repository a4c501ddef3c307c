"""RollingCache: golden rules, agreement with a brute-force reference, eviction, persistence, thread safety."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import sys
import threading
import time

import numpy as np
import pygtrie
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lookupdec.cache as cache_module
from lookupdec.cache import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CacheConfig,
    CacheFileError,
    RollingCache,
)

# ------------------------------------------------------------------------------------------------------------ reference
# lookupdec/_reference.py belongs to another module's owner, so the cache's slow twin lives here.


def reference_lookup(sequences, context, k, min_n, max_n):
    """Obviously-correct lookup: try n from max_n down, scan sequences newest first and positions latest first.

    sequences: stored sequences oldest first, each [seq_len]; context: [ctx_len].
    """
    context = [int(x) for x in context]
    if k == 0:
        return 0, []
    for n in range(max_n, min_n - 1, -1):
        if len(context) < n:
            continue
        suffix = context[-n:]
        for seq in reversed(sequences):
            seq = [int(x) for x in seq]
            # t is the first draft token's position; it must exist, so t <= len(seq) - 1.
            for t in range(len(seq) - 1, n - 1, -1):
                if seq[t - n:t] == suffix:
                    return n, seq[t:t + k]
    return 0, []


class ReferenceStore:
    """The storage rules restated plainly: truncate to the budget, skip too-short sequences, evict whole oldest FIFO."""

    def __init__(self, max_tokens, min_n, max_n):
        self.max_tokens, self.min_n, self.max_n = max_tokens, min_n, max_n
        self.sequences: list[list[int]] = []

    def add(self, tokens):
        tokens = [int(x) for x in tokens][-self.max_tokens:]
        if len(tokens) < self.min_n + 1:
            return
        self.sequences.append(tokens)
        while sum(map(len, self.sequences)) > self.max_tokens:
            self.sequences.pop(0)

    def lookup(self, context, k):
        return reference_lookup(self.sequences, context, k, self.min_n, self.max_n)


def assert_same(cache: RollingCache, expected, context, k):
    n, draft = cache.lookup(context, k)
    assert isinstance(draft, np.ndarray) and draft.dtype == np.int32 and draft.ndim == 1
    assert (n, draft.tolist()) == (expected[0], list(expected[1])), (context, k)


def assert_index_consistent(cache: RollingCache):
    """White-box: both copies of the index hold the same sequences, and each trie holds exactly the most recent
    occurrence of every stored n-gram, and nothing else. Call it only when no add is running."""
    seqs = cache.sequences()
    assert len(cache) == sum(len(s) for s in seqs) <= cache.max_tokens
    for index in (cache._front, cache._back):
        assert not index.pins
        ids = list(index.order)
        assert [index.seqs[seq_id].tolist() for seq_id in ids] == [s.tolist() for s in seqs]
        assert index.total == len(cache) and len(index.seqs) == len(ids) == cache.num_sequences
        expected = {}
        for seq_id, seq in zip(ids, seqs):  # oldest first, so later assignments are the most recent occurrence
            toks = seq.tolist()
            for t in range(cache.min_n, len(toks)):
                for n in range(cache.min_n, min(cache.max_n, t) + 1):
                    expected[tuple(reversed(toks[t - n:t]))] = (seq_id, t)
        actual = {key: (value >> 48, value & ((1 << 48) - 1)) for key, value in index.trie.iteritems()}
        assert actual == expected


def all_contexts(vocab, max_len):
    """Every context over range(vocab) with length 0..max_len (small vocabularies only)."""
    out = [[]]
    frontier = [[]]
    for _ in range(max_len):
        frontier = [c + [v] for c in frontier for v in range(vocab)]
        out.extend(frontier)
    return out


# --------------------------------------------------------------------------------------------------------------- golden


def test_longest_match_wins_over_a_shorter_one():
    cache = RollingCache(min_n=2, max_n=4)
    cache.add([1, 2, 3, 4, 50, 51])  # 4-gram (1, 2, 3, 4) -> 50
    cache.add([3, 4, 60, 61])  # newer, but only the 2-gram (3, 4) -> 60
    n, draft = cache.lookup([9, 1, 2, 3, 4], k=2)
    assert n == 4
    assert draft.tolist() == [50, 51]  # Not [60, 61]: length beats recency.


def test_most_recently_added_sequence_wins_a_tie():
    cache = RollingCache(min_n=2, max_n=3)
    cache.add([7, 8, 9, 10, 11])
    cache.add([7, 8, 9, 20, 21])
    n, draft = cache.lookup([7, 8, 9], k=5)
    assert n == 3
    assert draft.tolist() == [20, 21]  # Not [10, 11]: the newer sequence wins an equal-length tie.


def test_latest_position_wins_inside_one_sequence():
    cache = RollingCache(min_n=2, max_n=2)
    cache.add([1, 2, 30, 1, 2, 40, 41])
    n, draft = cache.lookup([1, 2], k=3)
    assert (n, draft.tolist()) == (2, [40, 41])  # Not [30, 1, 2]: the later occurrence wins.


def test_draft_never_crosses_the_end_of_a_sequence():
    cache = RollingCache(min_n=2, max_n=2)
    cache.add([1, 2, 3, 4])
    cache.add([5, 6, 7, 8])
    n, draft = cache.lookup([2, 3], k=10)
    assert (n, draft.tolist()) == (2, [4])  # Not [4, 5, 6, 7, 8]: sequences are separate generations.


def test_a_match_needs_a_following_token():
    cache = RollingCache(min_n=2, max_n=3)
    cache.add([1, 2, 3, 4, 5])
    # (3, 4, 5) ends the sequence, so nothing follows it; the shorter (4, 5) also ends it: no draft at all.
    n, draft = cache.lookup([3, 4, 5], k=4)
    assert n == 0 and draft.size == 0
    # (2, 3) is followed by 4: a 2-gram match, since (9, 2, 3) was never seen.
    assert cache.lookup([9, 2, 3], k=4)[0] == 2


@pytest.mark.parametrize("context,k", [([1, 2], 0), ([40, 41], 3), ([2], 3), ([], 3)])
def test_no_draft_is_an_empty_int32_array(context, k):
    cache = RollingCache(min_n=2, max_n=4)
    cache.add([1, 2, 3, 4])
    n, draft = cache.lookup(context, k)
    assert n == 0
    assert isinstance(draft, np.ndarray) and draft.dtype == np.int32 and draft.shape == (0,)


def test_empty_cache_has_no_draft():
    n, draft = RollingCache().lookup([1, 2, 3, 4], 5)
    assert n == 0 and draft.dtype == np.int32 and draft.size == 0


def test_draft_is_int32_copy_not_a_view_of_the_store():
    cache = RollingCache(min_n=2, max_n=2)
    cache.add(np.array([1, 2, 3, 4], dtype=np.int64))
    _, draft = cache.lookup(np.array([1, 2], dtype=np.int64), 5)
    assert draft.dtype == np.int32 and draft.tolist() == [3, 4]
    draft[:] = 0
    assert cache.lookup([1, 2], 5)[1].tolist() == [3, 4]


def test_accepts_lists_tuples_and_numpy_arrays():
    cache = RollingCache(min_n=2, max_n=2)
    cache.add((1, 2, 3))
    cache.add(np.array([4, 5, 6], dtype=np.uint16))
    cache.add([7, 8, 9])
    assert cache.lookup((1, 2), 1)[1].tolist() == [3]
    assert cache.lookup(np.array([4, 5]), 1)[1].tolist() == [6]
    assert cache.lookup([7, 8], 1)[1].tolist() == [9]
    assert (len(cache), cache.num_sequences) == (9, 3)


def test_add_copies_the_callers_buffer():
    cache = RollingCache(min_n=2, max_n=2)
    buf = np.array([1, 2, 3], dtype=np.int32)
    cache.add(buf)
    buf[:] = 0
    assert cache.lookup([1, 2], 1)[1].tolist() == [3]


def test_short_sequences_are_ignored():
    cache = RollingCache(min_n=3, max_n=4)
    cache.add([1, 2, 3])  # min_n + 1 = 4 tokens needed
    cache.add([])
    assert (len(cache), cache.num_sequences) == (0, 0)
    cache.add([1, 2, 3, 4])
    assert (len(cache), cache.num_sequences) == (4, 1)


def test_clear_empties_everything():
    cache = RollingCache(min_n=2, max_n=2)
    cache.add([1, 2, 3])
    cache.clear()
    assert (len(cache), cache.num_sequences) == (0, 0)
    assert cache.lookup([1, 2], 3)[0] == 0
    cache.add([1, 2, 4])
    assert cache.lookup([1, 2], 3)[1].tolist() == [4]
    assert_index_consistent(cache)


# ------------------------------------------------------------------------------------------------------------- eviction


def test_over_long_sequence_keeps_its_last_max_tokens():
    cache = RollingCache(max_tokens=5, min_n=2, max_n=2)
    cache.add([1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.sequences()[0].tolist() == [4, 5, 6, 7, 8]
    assert cache.lookup([1, 2], 3)[0] == 0  # the dropped head is not indexed
    assert cache.lookup([5, 6], 3)[1].tolist() == [7, 8]


def test_eviction_is_fifo_by_whole_sequence_and_keeps_the_bound():
    cache = RollingCache(max_tokens=10, min_n=2, max_n=2)
    cache.add([1, 2, 3, 4])  # 4
    cache.add([5, 6, 7, 8])  # 8
    cache.add([9, 10, 11])  # 11 > 10: the oldest whole sequence goes
    assert [s.tolist() for s in cache.sequences()] == [[5, 6, 7, 8], [9, 10, 11]]
    assert len(cache) == 7
    assert cache.lookup([1, 2], 2)[0] == 0
    assert cache.lookup([5, 6], 2)[1].tolist() == [7, 8]
    assert_index_consistent(cache)


def test_eviction_keeps_keys_that_a_newer_sequence_overwrote():
    cache = RollingCache(max_tokens=8, min_n=2, max_n=2)
    cache.add([1, 2, 3, 4])
    cache.add([1, 2, 9])  # (1, 2) now points here
    cache.add([5, 6, 7])  # total 10 > 8: evicts [1, 2, 3, 4]
    assert cache.lookup([1, 2], 3)[1].tolist() == [9]  # the newer owner of (1, 2) survived the eviction
    assert cache.lookup([2, 3], 3)[0] == 0  # only the evicted sequence had (2, 3)
    assert_index_consistent(cache)


def test_many_adds_never_exceed_the_budget():
    rng = np.random.default_rng(0)
    cache = RollingCache(max_tokens=300, min_n=1, max_n=3)
    for _ in range(200):
        cache.add(rng.integers(0, 5, size=int(rng.integers(0, 120))))
        assert len(cache) <= 300
    assert_index_consistent(cache)


# ------------------------------------------------------------------------------------------------------------- property

VOCAB = 3


@st.composite
def cache_scenarios(draw):
    min_n = draw(st.integers(1, 3))
    max_n = draw(st.integers(min_n, min_n + 3))
    max_tokens = draw(st.integers(1, 40))
    seq = st.lists(st.integers(0, VOCAB - 1), max_size=18)
    steps = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("add"), seq),
                st.tuples(st.just("lookup"), st.lists(st.integers(0, VOCAB - 1), max_size=8), st.integers(0, 6)),
            ),
            max_size=30,
        )
    )
    return max_tokens, min_n, max_n, steps


@settings(deadline=None, max_examples=300)
@given(cache_scenarios())
def test_matches_brute_force_reference(scenario):
    max_tokens, min_n, max_n, steps = scenario
    cache = RollingCache(max_tokens=max_tokens, min_n=min_n, max_n=max_n)
    ref = ReferenceStore(max_tokens, min_n, max_n)
    for step in steps:
        if step[0] == "add":
            cache.add(step[1])
            ref.add(step[1])
            assert [s.tolist() for s in cache.sequences()] == ref.sequences
            assert len(cache) == sum(map(len, ref.sequences)) <= max_tokens
        else:
            _, context, k = step
            assert_same(cache, ref.lookup(context, k), context, k)
    assert_index_consistent(cache)
    # Finally every context up to length max_n + 1 over the vocabulary: nothing the steps missed can disagree.
    for context in all_contexts(VOCAB, max_n + 1):
        assert_same(cache, ref.lookup(context, 3), context, 3)


# --------------------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_tokens=0), r"max_tokens must be >= 1"),
        (dict(max_tokens=-5), r"max_tokens must be >= 1"),
        (dict(min_n=0), r"1 <= min_n <= max_n <= 16"),
        (dict(min_n=5, max_n=4), r"1 <= min_n <= max_n <= 16"),
        (dict(min_n=2, max_n=17), r"1 <= min_n <= max_n <= 16"),
        (dict(min_n=2.0), r"min_n must be an integer"),
        (dict(max_n=True), r"max_n must be an integer"),
        (dict(max_tokens="100"), r"max_tokens must be an integer"),
    ],
)
def test_invalid_config_raises_value_error_with_allowed_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RollingCache(**kwargs)


def test_config_is_frozen_and_normalises_numpy_ints():
    cache = RollingCache(max_tokens=np.int64(100), min_n=np.int32(1), max_n=16)
    assert cache.config == CacheConfig(max_tokens=100, min_n=1, max_n=16)
    assert type(cache.config.max_tokens) is int
    with pytest.raises(AttributeError):
        cache.config.min_n = 3


@pytest.mark.parametrize(
    "tokens,match",
    [
        ([[1, 2], [3, 4]], "1-D"),
        ([1.0, 2.0, 3.0], "integer token ids"),
        ([1, -2, 3], r"token ids must be in \[0, 2147483647\]"),
        ([1, 2**31, 3], r"token ids must be in \[0, 2147483647\]"),
    ],
)
def test_add_rejects_bad_tokens(tokens, match):
    cache = RollingCache()
    with pytest.raises(ValueError, match=match):
        cache.add(tokens)
    assert len(cache) == 0


@pytest.mark.parametrize("k", [-1, 1.5, True])
def test_lookup_rejects_bad_k(k):
    with pytest.raises(ValueError, match="k must be an integer >= 0"):
        RollingCache().lookup([1, 2, 3], k)


def test_lookup_rejects_bad_context():
    with pytest.raises(ValueError, match="1-D"):
        RollingCache().lookup(np.zeros((2, 2), dtype=np.int32), 3)
    with pytest.raises(ValueError, match="integer token ids"):
        RollingCache().lookup([1.5, 2.5], 3)


# ---------------------------------------------------------------------------------------------------------- save / load


def _filled_cache(seed=0, max_tokens=200, min_n=1, max_n=3, vocab=4):
    rng = np.random.default_rng(seed)
    cache = RollingCache(max_tokens=max_tokens, min_n=min_n, max_n=max_n)
    for _ in range(30):
        cache.add(rng.integers(0, vocab, size=int(rng.integers(0, 30))))
    return cache


def test_save_load_round_trip_gives_identical_lookups(tmp_path):
    cache = _filled_cache()
    path = tmp_path / "cache.json"
    cache.save(path)
    loaded = RollingCache.load(path, strict=True)
    assert loaded.config == cache.config
    assert (len(loaded), loaded.num_sequences) == (len(cache), cache.num_sequences)
    assert [s.tolist() for s in loaded.sequences()] == [s.tolist() for s in cache.sequences()]
    for context in all_contexts(4, 4):
        for k in (0, 1, 5):
            n1, d1 = cache.lookup(context, k)
            n2, d2 = loaded.lookup(context, k)
            assert (n1, d1.tolist()) == (n2, d2.tolist())
            assert d2.dtype == np.int32
    assert_index_consistent(loaded)


def test_saved_file_is_plain_json_with_format_and_settings(tmp_path):
    cache = RollingCache(max_tokens=50, min_n=2, max_n=5)
    cache.add([1, 2, 3])
    cache.add([4, 5, 6, 7])
    path = tmp_path / "c.json"
    cache.save(str(path))
    data = json.loads(path.read_text())
    assert data == {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "max_tokens": 50, "min_n": 2, "max_n": 5,
        "sequences": [[1, 2, 3], [4, 5, 6, 7]],
    }


def test_save_replaces_old_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "cache.json"
    path.write_text("old contents")
    _filled_cache().save(path)
    assert os.listdir(tmp_path) == ["cache.json"]
    assert RollingCache.load(path, strict=True).num_sequences > 0


def test_failed_save_keeps_the_old_file_and_removes_the_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "cache.json"
    old = RollingCache(min_n=2, max_n=2)
    old.add([1, 2, 3])
    old.save(path)
    before = path.read_bytes()

    def broken_dump(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(json, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        _filled_cache().save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["cache.json"]


def test_save_into_missing_folder_raises_os_error(tmp_path):
    with pytest.raises(OSError):
        RollingCache().save(tmp_path / "no" / "such" / "cache.json")


def _valid_payload(**overrides):
    payload = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "max_tokens": 77, "min_n": 1, "max_n": 3,
               "sequences": [[1, 2, 3]]}
    payload.update(overrides)
    return payload


def _without(key):
    payload = _valid_payload()
    del payload[key]
    return payload


# (file bytes, fragment of the reason, config the non-strict load must keep: the file's when readable, else defaults)
FILE_CONFIG = CacheConfig(max_tokens=77, min_n=1, max_n=3)
DEFAULT_CONFIG = CacheConfig()
BAD_FILES = {
    "empty": (b"", "is not valid JSON", DEFAULT_CONFIG),
    "truncated": (json.dumps(_valid_payload()).encode()[:-5], "is not valid JSON", DEFAULT_CONFIG),
    "binary": (b"\xff\xfe\x00garbage", "is not UTF-8 text", DEFAULT_CONFIG),
    "a pickle": (b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00.", "is not UTF-8 text", DEFAULT_CONFIG),
    "top-level list": (b"[1, 2, 3]", "top level is a JSON array", DEFAULT_CONFIG),
    "other format": (json.dumps(_valid_payload(format="something-else")).encode(), "format is 'something-else'",
                     DEFAULT_CONFIG),
    "newer version": (json.dumps(_valid_payload(version=2)).encode(), "format version 2 is not supported",
                      DEFAULT_CONFIG),
    "missing min_n": (json.dumps(_without("min_n")).encode(), "field 'min_n' is missing", DEFAULT_CONFIG),
    "string max_n": (json.dumps(_valid_payload(max_n="3")).encode(), "field 'max_n' must be an integer",
                     DEFAULT_CONFIG),
    "bool min_n": (json.dumps(_valid_payload(min_n=True)).encode(), "field 'min_n' must be an integer",
                   DEFAULT_CONFIG),
    "out-of-range n": (json.dumps(_valid_payload(min_n=0)).encode(), "invalid settings", DEFAULT_CONFIG),
    "missing sequences": (json.dumps(_without("sequences")).encode(), "field 'sequences' is missing", FILE_CONFIG),
    "sequences not a list": (json.dumps(_valid_payload(sequences={"a": 1})).encode(), "must be a list",
                             FILE_CONFIG),
    "sequence not a list": (json.dumps(_valid_payload(sequences=[[1, 2], 3])).encode(), "sequence 1 must be a list",
                            FILE_CONFIG),
    "string token": (json.dumps(_valid_payload(sequences=[[1, "x", 3]])).encode(),
                     "sequence 0, position 1: 'x' is not a token id", FILE_CONFIG),
    "float token": (json.dumps(_valid_payload(sequences=[[1, 2.5]])).encode(), "2.5 is not a token id",
                    FILE_CONFIG),
    "negative token": (json.dumps(_valid_payload(sequences=[[1, 2], [3, -1]])).encode(),
                       "sequence 1, position 1: -1 is not a token id", FILE_CONFIG),
    "deep nesting": (b"[" * 100000 + b"]" * 100000, "JSON", DEFAULT_CONFIG),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_bad_file_strict_raises_one_line_cache_file_error(tmp_path, name):
    content, reason, _ = BAD_FILES[name]
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(CacheFileError) as info:
        RollingCache.load(path, strict=True)
    message = str(info.value)
    assert str(path) in message and reason in message
    assert "\n" not in message and len(message) < 300
    assert isinstance(info.value, ValueError)
    # Strict loads leave the file where it is: the caller decides what to do about it.
    assert os.listdir(tmp_path) == ["bad.json"] and path.read_bytes() == content


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_bad_file_non_strict_warns_moves_it_aside_and_returns_empty_cache(tmp_path, caplog, name):
    content, reason, config = BAD_FILES[name]
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="lookupdec"):
        cache = RollingCache.load(path)
    assert (len(cache), cache.num_sequences) == (0, 0)
    assert cache.config == config
    records = [r for r in caplog.records if r.name == "lookupdec" and r.levelno == logging.WARNING]
    assert len(records) == 1
    message = records[0].getMessage()
    assert str(path) in message and reason in message
    assert "\n" not in message

    # The file's bytes survive under a new name beside it, and the warning says where.
    [moved] = os.listdir(tmp_path)
    assert re.fullmatch(r"bad\.json\.unreadable-\d{8}-\d{6}", moved)
    assert (tmp_path / moved).read_bytes() == content
    assert f"moved it to {str(tmp_path / moved)!r}" in message
    # So the next save cannot destroy them.
    cache.add([1, 2, 3])
    cache.save(path)
    assert sorted(os.listdir(tmp_path)) == ["bad.json", moved]
    assert (tmp_path / moved).read_bytes() == content
    assert RollingCache.load(path, strict=True).sequences()[0].tolist() == [1, 2, 3]


def test_moved_aside_files_are_never_overwritten(tmp_path, monkeypatch, caplog):
    class FrozenClock(cache_module.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(cache_module, "datetime", FrozenClock)
    path = tmp_path / "cache.json"
    for attempt in range(3):
        path.write_bytes(b"broken %d" % attempt)
        with caplog.at_level(logging.WARNING, logger="lookupdec"):
            assert len(RollingCache.load(path)) == 0
    # Same second each time: a numbered suffix rather than a replaced earlier file.
    stem = "cache.json.unreadable-20260102-030405"
    assert sorted(os.listdir(tmp_path)) == [stem, f"{stem}-1", f"{stem}-2"]
    assert [(tmp_path / name).read_bytes() for name in (stem, f"{stem}-1", f"{stem}-2")] == [
        b"broken 0", b"broken 1", b"broken 2"
    ]
    assert f"moved it to {str(tmp_path / (stem + '-2'))!r}" in caplog.text


def test_file_that_cannot_be_moved_aside_is_left_in_place_with_a_warning(tmp_path, monkeypatch, caplog):
    path = tmp_path / "cache.json"
    path.write_bytes(b"{not json")

    def read_only_folder(src, dst):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", read_only_folder)
    with caplog.at_level(logging.WARNING, logger="lookupdec"):
        cache = RollingCache.load(path)
    assert len(cache) == 0 and cache.config == DEFAULT_CONFIG
    records = [r for r in caplog.records if r.name == "lookupdec" and r.levelno == logging.WARNING]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "is not valid JSON" in message
    assert "could not move it aside (OSError: Read-only file system), left in place" in message
    # The file is untouched and the name claimed for it is given back.
    assert os.listdir(tmp_path) == ["cache.json"] and path.read_bytes() == b"{not json"


def test_missing_file(tmp_path, caplog):
    path = tmp_path / "absent.json"
    with pytest.raises(CacheFileError, match=r"absent\.json.*not found"):
        RollingCache.load(path, strict=True)
    with caplog.at_level(logging.WARNING, logger="lookupdec"):
        cache = RollingCache.load(path)
    assert cache.config == DEFAULT_CONFIG and len(cache) == 0
    assert "not found" in caplog.text and "starting with an empty cache" in caplog.text
    assert "moved" not in caplog.text and os.listdir(tmp_path) == []


def test_unreadable_path(tmp_path, caplog):
    # A directory where the file should be: open() fails with an OSError other than "not found".
    with pytest.raises(CacheFileError, match="cannot be read"):
        RollingCache.load(tmp_path, strict=True)
    with caplog.at_level(logging.WARNING, logger="lookupdec"):
        assert len(RollingCache.load(tmp_path)) == 0
    assert "cannot be read" in caplog.text
    # Not a cache file, so not ours to move.
    assert "moved" not in caplog.text and tmp_path.is_dir()
    assert not list(tmp_path.parent.glob(tmp_path.name + ".unreadable-*"))


def test_file_over_its_own_budget_loads_with_eviction(tmp_path):
    # A hand-edited file may hold more than max_tokens; load applies the normal add() rules instead of failing.
    path = tmp_path / "big.json"
    path.write_text(json.dumps(_valid_payload(max_tokens=6, sequences=[[1, 2, 3], [4, 5, 6], [7, 8, 9]])))
    cache = RollingCache.load(path, strict=True)
    assert [s.tolist() for s in cache.sequences()] == [[4, 5, 6], [7, 8, 9]]


# ------------------------------------------------------------------------------------------------------------- failures

# A=[1..5] and B are stored (10 tokens); adding C (7 tokens) evicts A. C has 9 trie keys (t in 2..6, n in 2..min(3, t)),
# so an add makes trie calls 1..9 on the back copy, then 10..18 on the old front; evicting A deletes on each copy.
FAIL_A, FAIL_B, FAIL_C = [1, 2, 3, 4, 5], [6, 1, 2, 7, 8], [1, 2, 9, 6, 1, 2, 3]


def _failing(monkeypatch, method, fail_on):
    """Make pygtrie.Trie.<method> raise MemoryError on its fail_on-th call (counting from now), once."""
    original = getattr(pygtrie.Trie, method)
    calls = []

    def wrapper(trie, *args):
        calls.append(None)
        if len(calls) == fail_on:
            raise MemoryError("injected")
        return original(trie, *args)

    monkeypatch.setattr(pygtrie.Trie, method, wrapper)
    return calls


def _assert_answers_like(cache, ref, vocab=10):
    for context in all_contexts(vocab, 3):
        assert_same(cache, ref.lookup(context, 3), context, 3)


@pytest.mark.parametrize("method, fail_on, took_effect", [
    ("__setitem__", 1, False),   # the first insertion into the back copy
    ("__setitem__", 5, False),   # half-way through the back copy
    ("__setitem__", 9, False),   # its last insertion
    ("__delitem__", 1, False),   # evicting A from the back copy, after all of C's insertions
    ("__setitem__", 10, True),   # the old front, after the back copy was published
    ("__setitem__", 16, True),
])
def test_an_add_that_fails_half_way_is_all_or_nothing(monkeypatch, method, fail_on, took_effect):
    # Before: the half-inserted keys stayed and pointed at a sequence never stored, and the half-changed copy was
    # published by the next add, which then raised KeyError in lookups.
    cache = RollingCache(max_tokens=12, min_n=2, max_n=3)
    ref = ReferenceStore(12, 2, 3)
    for seq in (FAIL_A, FAIL_B):
        cache.add(seq)
        ref.add(seq)
    calls = _failing(monkeypatch, method, fail_on)
    with pytest.raises(MemoryError):
        cache.add(FAIL_C)
    assert len(calls) == fail_on
    if took_effect:  # the changed copy was already published when the spare one failed: the add stands, whole
        ref.add(FAIL_C)
    assert [s.tolist() for s in cache.sequences()] == ref.sequences
    _assert_answers_like(cache, ref)
    assert_index_consistent(cache)  # both copies, so the next add starts from a whole state
    for seq in ([9, 6, 1, 2, 4, 4], FAIL_C, [2, 9, 6, 5]):  # later adds work, evictions included
        cache.add(seq)
        ref.add(seq)
        _assert_answers_like(cache, ref)
    assert_index_consistent(cache)


def test_a_failed_add_whose_spare_copy_cannot_be_rebuilt_at_once_rebuilds_it_at_the_next_write(monkeypatch):
    cache = RollingCache(max_tokens=12, min_n=2, max_n=3)
    ref = ReferenceStore(12, 2, 3)
    for seq in (FAIL_A, FAIL_B):
        cache.add(seq)
        ref.add(seq)
    _failing(monkeypatch, "__setitem__", 3)
    original_copy = cache_module._Index.copy
    copies = []

    def copy_failing_once(index):
        copies.append(None)
        if len(copies) == 1:
            raise MemoryError("injected")
        return original_copy(index)

    monkeypatch.setattr(cache_module._Index, "copy", copy_failing_once)
    with pytest.raises(MemoryError):
        cache.add(FAIL_C)
    assert cache._back is None  # thrown away, not kept half-changed
    _assert_answers_like(cache, ref)
    cache.add(FAIL_C)
    ref.add(FAIL_C)
    assert len(copies) == 2
    _assert_answers_like(cache, ref)
    assert_index_consistent(cache)


def test_a_key_whose_sequence_is_missing_gives_the_longest_stored_match_not_a_key_error():
    # Cannot happen through add(); lookups must not turn such an entry into a KeyError if it ever does.
    cache = RollingCache(max_tokens=100, min_n=2, max_n=3)
    cache.add([1, 2, 3, 4])
    cache.add([7, 2, 3, 5])
    assert cache.lookup([1, 2, 3], 2)[1].tolist() == [4]
    for index in (cache._front, cache._back):
        index.trie[(3, 2, 1)] = 999 << 48 | 1  # seq 999 was never stored
    assert_same(cache, (2, [5]), [1, 2, 3], 2)  # (2, 3) -> 5, its newest occurrence
    for index in (cache._front, cache._back):
        for key in list(index.trie.keys()):
            index.trie[key] = 999 << 48 | 1
    assert_same(cache, (0, []), [1, 2, 3], 2)


def test_a_file_replaced_while_it_was_read_is_not_moved_aside(tmp_path, monkeypatch, caplog):
    # Another process saves a good cache over the bad file between this load's failed read and its move-aside. The
    # move must take only the file that failed: the good one stays at the path and is loaded instead.
    path = tmp_path / "cache.json"
    path.write_bytes(b"{not json")
    good = RollingCache(max_tokens=50, min_n=2, max_n=3)
    good.add([1, 2, 3, 4])
    original_read = cache_module._read_cache_file
    reads = []

    def read_then_replaced(path_str):
        reads.append(None)
        try:
            return original_read(path_str)
        finally:
            if len(reads) == 1:
                good.save(path)  # an atomic replace: a new file at the same path

    monkeypatch.setattr(cache_module, "_read_cache_file", read_then_replaced)
    real_replace, renames = os.replace, []

    def spy_replace(src, dst):
        renames.append(str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy_replace)
    with caplog.at_level(logging.WARNING, logger="lookupdec"):
        cache = RollingCache.load(path)
        saved = path.read_bytes()
    assert os.listdir(tmp_path) == ["cache.json"]  # nothing moved aside, no claimed name left behind
    assert not [dst for dst in renames if ".unreadable-" in dst]  # not even for a moment: the path was checked first
    assert json.loads(saved)["sequences"] == [[1, 2, 3, 4]]
    assert len(reads) == 2 and cache.sequences()[0].tolist() == [1, 2, 3, 4] and cache.config == good.config
    assert "is not valid JSON" in caplog.text and "another file replaced it while it was read" in caplog.text


def test_a_save_landing_between_the_check_and_the_rename_is_put_back(tmp_path, monkeypatch):
    # The narrower race: the path is checked, then a save replaces it just before the rename takes "it". The rename
    # then took the saved file; it goes back to the path, and nothing is left under the moved-aside name.
    path = tmp_path / "cache.json"
    path.write_bytes(b"{not json")
    good = RollingCache(max_tokens=50, min_n=2, max_n=3)
    good.add([1, 2, 3, 4])
    good.save(tmp_path / "good.tmp")
    real_replace = os.replace

    def save_lands_first(src, dst):
        if ".unreadable-" in str(dst):
            real_replace(tmp_path / "good.tmp", path)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", save_lands_first)
    cache = RollingCache.load(path)
    assert os.listdir(tmp_path) == ["cache.json"]
    assert json.loads(path.read_bytes())["sequences"] == [[1, 2, 3, 4]]
    assert cache.sequences()[0].tolist() == [1, 2, 3, 4]


# -------------------------------------------------------------------------------------------------------------- threads


def test_concurrent_add_lookup_save_never_corrupts(tmp_path):
    max_tokens, min_n, max_n, vocab, k = 150, 1, 3, 3, 4
    cache = RollingCache(max_tokens=max_tokens, min_n=min_n, max_n=max_n)
    added: list[list[int]] = []  # list.append is atomic under the GIL
    errors: list[BaseException] = []
    stop = time.monotonic() + 2.0
    path = tmp_path / "shared.json"

    def plausible(context, n, draft):
        """Mid-run the state keeps changing, so check only that the answer came from something really added."""
        if n == 0:
            return draft.size == 0
        if not (min_n <= n <= max_n and 1 <= draft.size <= k):
            return False
        window = list(context[-n:]) + draft.tolist()
        for seq in added:
            for start in range(len(seq) - len(window) + 1):
                if seq[start:start + len(window)] == window:
                    # The draft stops early only at the end of its sequence.
                    if draft.size == k or start + len(window) == len(seq):
                        return True
        return False

    def worker(seed):
        rng = random.Random(seed)
        try:
            ops = 0
            while time.monotonic() < stop:
                roll = rng.random()
                if roll < 0.3:
                    seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
                    added.append(seq[-max_tokens:])
                    cache.add(np.array(seq, dtype=np.int64) if rng.random() < 0.5 else seq)
                elif roll < 0.33 and seed % 4 == 0:
                    cache.save(path)
                    RollingCache.load(path, strict=True)  # whatever was saved must be a valid file
                else:
                    context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
                    n, draft = cache.lookup(context, k)
                    assert draft.dtype == np.int32
                    assert plausible(context, n, draft), (context, n, draft)
                ops += 1
                assert len(cache) <= max_tokens
            assert ops > 10
        except BaseException as err:  # re-raised in the main thread below
            errors.append(err)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so interleavings inside add/lookup/save are actually tried
    try:
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors[0]

    assert len(cache) <= max_tokens
    assert_index_consistent(cache)
    stored = [s.tolist() for s in cache.sequences()]
    for context in all_contexts(vocab, max_n + 1):
        for kk in (1, k):
            assert_same(cache, reference_lookup(stored, context, kk, min_n, max_n), context, kk)
    loaded = RollingCache.load(path, strict=True)
    assert len(loaded) <= max_tokens


@pytest.mark.parametrize("held_pass", [1, 2], ids=["changing-the-back-copy", "changing-the-old-front-copy"])
def test_lookup_does_not_wait_for_an_add_in_progress(monkeypatch, held_pass):
    # An add changes the back copy of the index, publishes it, then changes the old front copy. Hold it halfway through
    # the trie insertions of one of those passes: a lookup must still answer at once, from the state before the whole
    # add (pass 1) or after it (pass 2), never from the half-changed copy.
    cache = RollingCache(max_tokens=100_000, min_n=2, max_n=3)
    cache.add([1, 2, 3, 4])
    long_seq = [1, 2, 3, 9] + list(range(10, 20_010))  # a newer occurrence of (1, 2, 3), inserted before the hold
    entered, release = threading.Event(), threading.Event()
    passes = []
    original = cache_module._ngram_entries

    def held_entries(arr, cfg):
        if arr.size != len(long_seq):
            yield from original(arr, cfg)
            return
        passes.append(None)
        for i, entry in enumerate(original(arr, cfg)):
            if i == len(long_seq) and len(passes) == held_pass:
                entered.set()
                release.wait(timeout=30)
            yield entry

    monkeypatch.setattr(cache_module, "_ngram_entries", held_entries)
    answers = []
    adder = threading.Thread(target=cache.add, args=(long_seq,), daemon=True)
    adder.start()
    try:
        assert entered.wait(timeout=30), "the add never reached the held point"
        reader = threading.Thread(
            target=lambda: answers.append((cache.lookup([1, 2, 3], 2), len(cache))), daemon=True
        )
        reader.start()
        reader.join(timeout=10)
        assert not reader.is_alive(), "lookup waited for the add"
        assert adder.is_alive()  # the answer came while the add was still held
    finally:
        release.set()
        adder.join(timeout=30)
    assert not adder.is_alive()
    (n, draft), size = answers[0]
    if held_pass == 1:
        assert (n, draft.tolist(), size) == (3, [4], 4)  # Not [9, 10]: the add is not visible until it is whole.
    else:
        assert (n, draft.tolist(), size) == (3, [9, 10], 4 + len(long_seq))
    assert cache.lookup([1, 2, 3], 2)[1].tolist() == [9, 10]
    assert_index_consistent(cache)


def test_concurrent_adds_and_lookups_match_a_serial_order(monkeypatch):
    """Adds from several threads while others look up: the end state is what the adds give one after another in the
    order they took effect, and every lookup answered from the state after some prefix of that order, a prefix that
    never shrinks within one thread (no add seen half done, none seen undone)."""
    max_tokens, min_n, max_n, vocab, k = 120, 1, 3, 3, 3
    cache = RollingCache(max_tokens=max_tokens, min_n=min_n, max_n=max_n)
    applied: dict[int, list[int]] = {}  # seq_id -> tokens; ids are handed out in the order adds take effect
    original_add = cache_module._Index.add

    def recording_add(index, seq_id, arr, evicted, cfg):
        applied[seq_id] = arr.tolist()
        original_add(index, seq_id, arr, evicted, cfg)

    monkeypatch.setattr(cache_module._Index, "add", recording_add)
    errors: list[BaseException] = []
    logs: list[list] = [[], []]

    def writer(seed):
        rng = random.Random(seed)
        try:
            for _ in range(25):
                cache.add([rng.randrange(vocab) for _ in range(rng.randrange(0, 40))])
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(err)

    def reader(seed, log):
        rng = random.Random(seed)
        try:
            while any(w.is_alive() for w in writers) and len(log) < 3000:
                context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
                n, draft = cache.lookup(context, k)
                log.append((context, n, draft.tolist()))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    writers = [threading.Thread(target=writer, args=(seed,), daemon=True) for seed in range(3)]
    readers = [threading.Thread(target=reader, args=(10 + i, logs[i]), daemon=True) for i in range(2)]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so lookups land inside adds
    try:
        for thread in writers + readers:
            thread.start()
        for thread in writers + readers:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in writers + readers)
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors[0]

    ref = ReferenceStore(max_tokens, min_n, max_n)
    states = [[]]  # states[j]: the stored sequences after the first j adds in effect order
    for seq_id in sorted(applied):
        ref.add(applied[seq_id])
        states.append(list(ref.sequences))
    assert [s.tolist() for s in cache.sequences()] == states[-1]
    assert_index_consistent(cache)
    for context in all_contexts(vocab, max_n + 1):
        assert_same(cache, reference_lookup(states[-1], context, k, min_n, max_n), context, k)

    for log in logs:
        j = 0
        for context, n, draft in log:
            while j < len(states) and reference_lookup(states[j], context, k, min_n, max_n) != (n, draft):
                j += 1
            assert j < len(states), f"lookup {context} -> {(n, draft)} matches no state at or after an earlier answer"
