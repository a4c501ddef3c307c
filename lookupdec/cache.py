"""Rolling cross-request output cache: draft continuations from what earlier generations produced.

Prompt lookup copies drafts from the current request's own context. When many requests are alike (a server or CLI
editing many similar files), their *outputs* share boilerplate that the new prompt may not contain yet. This module
keeps a bounded, FIFO-evicted store of finished sequences and answers "which stored n-gram matches the end of my
context, and what followed it?".

Decisions (pinned by tests/test_cache.py):

* The longest suffix of the context wins: n is tried from ``max_n`` down to ``min_n``.
* Among equally long matches, the most recently *added* sequence wins, and inside one sequence the latest position wins.
  Recent outputs are the best predictor of the next one (same edit session, same file family).
* A draft never crosses the end of the stored sequence it came from; sequences are separate generations, and the
  token after one sequence's end is not a continuation of it.
* A match needs at least one following token, so a "match" always yields a non-empty draft when ``k >= 1``.
* "No draft" is always ``(0, empty int32 array)``, never ``None``.

Index layout (of each of the two copies RollingCache keeps so lookups never wait for an add): one ``pygtrie.Trie``
keyed by the *reversed* n-gram ending just before a position ``t`` (most recent token first). For every stored
sequence ``seq``, every ``t`` in ``[min_n, len(seq) - 1]`` and every ``n`` in ``[min_n, min(max_n, t)]``::

    trie[reversed(seq[t - n:t])] = seq_id << 48 | t        # seq[t] is the first draft token

Because every length in ``[min_n, max_n]`` is stored, ``trie.longest_prefix(reversed(context[-max_n:]))`` returns the
node of the longest matching suffix in O(max_n) steps, independent of how much is stored. Insertion order makes
"most recent wins" free: a later insertion overwrites the value. Eviction is strictly FIFO, so when the oldest sequence
leaves, any key still pointing at it has no other stored occurrence (older ones were evicted earlier, newer ones would
have overwritten it) and can be deleted; keys overwritten by newer sequences are left alone.

An add is all or nothing: a failure half-way (an out-of-memory error inside pygtrie, an interrupt) never leaves a key
pointing at a sequence that is not stored, and a later add works (see :meth:`RollingCache._write`).

No torch and no numba here: the cache sits beside the numba index (see STYLE.md) and must stay importable and cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import numbers
import os
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pygtrie

from ._fs import atomic_write
from .errors import LookupdecError

__all__ = ["CACHE_SCOPES", "CacheConfig", "CacheFileError", "ClientCaches", "RollingCache"]

# Whose earlier answers a server's request drafts from (lookupdec serve --cache-scope, on either engine): its
# client's (named by OpenAI's `user`; requests without one share a cache), everyone's, or nobody's.
CACHE_SCOPES = ("user", "shared", "off")

logger = logging.getLogger("lookupdec")

# Written into every saved file; load() refuses anything else so a future layout change can never be misread.
FORMAT_NAME = "lookupdec-rolling-cache"
FORMAT_VERSION = 1

# Stored sequences are int32 arrays (compact, and what the rest of lookupdec uses for token ids).
_MAX_TOKEN_ID = np.iinfo(np.int32).max
# n above this buys nothing for lookup drafting and multiplies trie size; it also bounds per-lookup cost.
_MAX_N_LIMIT = 16

_EMPTY_DRAFT = np.empty(0, dtype=np.int32)

# A trie value packs (seq_id, t) into one int: seq_id << _POS_BITS | t. A plain int, unlike a tuple, is not tracked by
# the cyclic garbage collector, and a full cache holds ~200k values, so this keeps memory and GC pauses down.
# Python ints are unbounded, so 48 bits for t is free headroom: no sequence that fits in memory has 2**48 tokens.
_POS_BITS = 48
_POS_MASK = (1 << _POS_BITS) - 1


class CacheFileError(LookupdecError, ValueError):
    """A cache file is missing, corrupt or incompatible."""


@dataclass(frozen=True)
class CacheConfig:
    """Size and match range of a RollingCache; validated at construction."""

    # Budget in stored tokens across all sequences; bounds memory (the trie holds ~(max_n - min_n + 1) keys per token).
    max_tokens: int = 65536
    # Shortest suffix worth matching: a 1-gram match across unrelated requests is mostly noise.
    min_n: int = 2
    # Longest suffix tried first; longer matches are more specific and so more likely to be accepted.
    max_n: int = 4

    def __post_init__(self) -> None:
        for name in ("max_tokens", "min_n", "max_n"):
            value = getattr(self, name)
            # bool is an int subclass, but `min_n=True` is always a mistake.
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
            # Normalise numpy integers so the config (and the saved JSON) holds plain ints.
            object.__setattr__(self, name, int(value))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 1 <= self.min_n <= self.max_n <= _MAX_N_LIMIT:
            raise ValueError(
                f"need 1 <= min_n <= max_n <= {_MAX_N_LIMIT}, got min_n={self.min_n}, max_n={self.max_n}"
            )


def _as_token_array(tokens) -> np.ndarray:
    """Validate a finished sequence and return it as a fresh int32 array  # [seq_len]."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integer token ids, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _MAX_TOKEN_ID:
        raise ValueError(f"token ids must be in [0, {_MAX_TOKEN_ID}], got values in [{lo}, {hi}]")
    # Always copy: the caller may reuse its buffer after add() returns.
    return np.array(arr, dtype=np.int32, copy=True)


class _Index:
    """One copy of everything a reader looks at. RollingCache keeps two identical copies (see its docstring)."""

    __slots__ = ("order", "pins", "seqs", "total", "trie")

    def __init__(self):
        self.trie: pygtrie.Trie = pygtrie.Trie()
        # seq_id -> int32 array  # [seq_len]; ids grow monotonically, so a trie value never aliases a newer sequence.
        # The arrays are never written after add(), so both copies share them.
        self.seqs: dict[int, np.ndarray] = {}
        # Insertion order of live seq_ids, oldest first (a deque: O(1) pops from the old end).
        self.order: deque[int] = deque()
        self.total = 0
        # One entry per reader using this copy; list.append and list.pop are atomic in CPython.
        self.pins: list[None] = []

    def copy(self) -> _Index:
        """A fresh, unpinned copy (the trie's nodes copied; the sequence arrays, never written, shared)."""
        other = _Index()
        other.trie = self.trie.copy()
        other.seqs = dict(self.seqs)
        other.order = deque(self.order)
        other.total = self.total
        return other

    def add(self, seq_id: int, arr: np.ndarray, evicted: list[int], cfg: CacheConfig) -> None:
        """Index ``arr``  # [seq_len] under ``seq_id``, then evict the sequences ``evicted`` (oldest first).

        A sequence is stored before its first key and removed after its last, so even a copy left half-changed by a
        failure (which RollingCache discards rather than publishes) has no key pointing at a missing sequence.
        """
        trie = self.trie
        self.seqs[seq_id] = arr
        value = seq_id << _POS_BITS
        # Ascending t: a later position overwrites an earlier one (latest position wins within a sequence).
        for key, t in _ngram_entries(arr, cfg):
            trie[key] = value | t
        self.order.append(seq_id)
        self.total += arr.size
        for old_id in evicted:
            old = self.seqs[old_id]
            for key, _ in _ngram_entries(old, cfg):
                value = trie.get(key)
                # Only keys still owned by this sequence go; a newer sequence's overwrite must survive. The same key can
                # occur twice in this sequence and is then met twice, hence the check rather than a blind delete.
                if value is not None and value >> _POS_BITS == old_id:
                    del trie[key]
            self.order.popleft()
            del self.seqs[old_id]
            self.total -= old.size

    def clear(self) -> None:
        self.trie = pygtrie.Trie()
        self.seqs.clear()
        self.order.clear()
        self.total = 0


def _ngram_entries(arr: np.ndarray, cfg: CacheConfig) -> Iterator[tuple[tuple[int, ...], int]]:
    """(reversed n-gram ending before t, t) for every t in [min_n, seq_len - 1] and n in [min_n, min(max_n, t)], in
    ascending t; arr: [seq_len]."""
    seq_len = int(arr.size)
    # rev[seq_len - t : seq_len - t + n] == reversed(seq[t - n:t]); python ints make hashing and trie steps cheap.
    rev = arr[::-1].tolist()
    for t in range(cfg.min_n, seq_len):
        base = seq_len - t
        for n in range(cfg.min_n, min(cfg.max_n, t) + 1):
            yield tuple(rev[base:base + n]), t


class RollingCache:
    """Bounded FIFO store of finished token sequences, indexed for longest-suffix lookup.

    Thread safe, and a lookup never waits for an add: a server may share one cache across generating threads, and a
    long request finishing does not stall the others' decoding steps. Everything a reader uses lives in two identical
    copies (:class:`_Index`), a *front* one that readers use and a *back* one. A writer (add, clear; one at a time,
    under ``_write_lock``) changes the back copy, makes it the front in one assignment, waits for readers still on the
    old front (each is microseconds from done), and makes the same change to that copy, which becomes the back. A reader
    pins the front copy and checks it is still the front; a writer swaps before it waits on pins, so a pinned front is
    never changed under its reader. Every read therefore sees the state before or after a whole add, never part of one:
    concurrent calls give the results of some serial order of them. The price is a second copy of the index in memory
    and every add's trie work done twice, once per copy: lookups cost the same as with one lock, adds about twice.

    A write that fails part-way (see :meth:`_write`) publishes nothing half-done: the copy it was changing is thrown
    away and rebuilt from the front one, so both copies agree again before the next write starts.

    Lookups are O(max_n + k); add() is O(len(tokens) * (max_n - min_n + 1)) plus the cost of the evictions it causes.
    """

    def __init__(self, max_tokens: int = 65536, min_n: int = 2, max_n: int = 4):
        self._config = CacheConfig(max_tokens=max_tokens, min_n=min_n, max_n=max_n)
        # Readers only ever load _front; _back, _next_id and every change to either copy belong to the lock's holder.
        # _back is None after a failed write until it is rebuilt (_spare).
        self._front = _Index()
        self._back: _Index | None = _Index()
        self._write_lock = threading.Lock()
        self._next_id = 0

    # ------------------------------------------------------------------ introspection

    @property
    def config(self) -> CacheConfig:
        return self._config

    @property
    def max_tokens(self) -> int:
        return self._config.max_tokens

    @property
    def min_n(self) -> int:
        return self._config.min_n

    @property
    def max_n(self) -> int:
        return self._config.max_n

    def __len__(self) -> int:
        with self._reading() as index:
            return index.total

    @property
    def num_sequences(self) -> int:
        with self._reading() as index:
            return len(index.order)

    def sequences(self) -> list[np.ndarray]:
        """Copies of the stored sequences, oldest first  # each [seq_len] int32."""
        with self._reading() as index:
            return [index.seqs[seq_id].copy() for seq_id in index.order]

    def __repr__(self) -> str:
        cfg = self._config
        return (
            f"RollingCache(max_tokens={cfg.max_tokens}, min_n={cfg.min_n}, max_n={cfg.max_n}; "
            f"{len(self)} tokens in {self.num_sequences} sequences)"
        )

    # ------------------------------------------------------------------ readers and writers

    def _pin(self) -> _Index:
        """The front copy, pinned: nothing changes it until the caller's ``index.pins.pop()``."""
        while True:
            index = self._front
            index.pins.append(None)
            # Still the front once pinned: any writer that swaps it out later will see the pin and wait for it.
            if index is self._front:
                return index
            index.pins.pop()

    @contextlib.contextmanager
    def _reading(self) -> Iterator[_Index]:
        index = self._pin()
        try:
            yield index
        finally:
            index.pins.pop()

    def _spare(self) -> _Index:
        """The back copy, equal to the front one; rebuilt from the front if a failed write threw it away. The caller
        holds ``_write_lock``, so the front does not change while it is copied (readers only read it)."""
        if self._back is None:
            self._back = self._front.copy()
        return self._back

    def _write(self, change: Callable[[_Index], None]) -> None:
        """Apply ``change`` to both copies without blocking a reader; the caller holds ``_write_lock``.

        All or nothing. If ``change`` raises on the back copy, that copy is thrown away (readers never saw it) and
        the cache is as before. If it raises on the old front, after the changed copy was published, the change
        stands and the half-changed old copy is thrown away. Either way the exception propagates, and the spare copy
        is rebuilt from the front (now, or at the next write if that fails too: a rebuild under memory pressure can).
        """
        back = self._spare()
        try:
            change(back)
        except BaseException:
            self._rebuild_back()
            raise
        old = self._front
        self._front = back  # readers now get the changed copy
        self._back = old
        while old.pins:
            time.sleep(0)  # let the last readers of the old front finish
        try:
            change(old)
        except BaseException:
            self._rebuild_back()
            raise

    def _rebuild_back(self) -> None:
        """Replace a half-changed back copy by a copy of the front (best effort: _spare retries at the next write)."""
        self._back = None
        with contextlib.suppress(Exception):
            self._spare()

    # ------------------------------------------------------------------ mutation

    def add(self, tokens) -> None:
        """Store one finished sequence of token ids  # [seq_len] (list, tuple or numpy array).

        Only the last ``max_tokens`` tokens of an over-long sequence are kept (the end of an output is what the next,
        similar request is about to produce). A sequence that is then shorter than ``min_n + 1`` is ignored: it cannot
        hold an n-gram *and* a following token. Afterwards whole oldest sequences are evicted until the total fits.
        """
        self._add_array(_as_token_array(tokens))

    def clear(self) -> None:
        with self._write_lock:
            self._write(_Index.clear)
            # _next_id keeps growing on purpose: ids are never reused, even across clear().

    def _add_array(self, arr: np.ndarray) -> None:
        cfg = self._config
        if arr.size > cfg.max_tokens:
            arr = arr[-cfg.max_tokens:].copy()
        if arr.size < cfg.min_n + 1:
            return
        with self._write_lock:
            seq_id = self._next_id
            self._next_id += 1
            # Both copies hold the same state here, so the back one decides the evictions for both.
            back = self._spare()
            total = back.total + arr.size
            evicted = []
            for old_id in back.order:
                # The new sequence alone fits (truncated above), so this never evicts what is being added.
                if total <= cfg.max_tokens:
                    break
                total -= back.seqs[old_id].size
                evicted.append(old_id)
            self._write(lambda index: index.add(seq_id, arr, evicted, cfg))

    # ------------------------------------------------------------------ lookup

    def lookup(self, context, k: int) -> tuple[int, np.ndarray]:
        """Draft up to ``k`` tokens continuing ``context``  # context: [ctx_len] token ids.

        Returns ``(n, draft)``: ``n`` is the length of the longest suffix of ``context`` (``max_n`` down to ``min_n``)
        found in a stored sequence with at least one token after it; ``draft`` (int32, [1..k]) is what followed its most
        recent occurrence, cut at that sequence's end. ``(0, empty int32 array)`` when nothing matches or ``k == 0``.
        """
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"k must be an integer >= 0, got {k!r}")
        cfg = self._config
        if k == 0:
            return 0, _EMPTY_DRAFT.copy()
        # Slice before converting: contexts can be long, and only the last max_n tokens can matter.
        tail = np.asarray(context[-cfg.max_n:])
        if tail.ndim != 1:
            raise ValueError(f"context must be a 1-D sequence of token ids, got shape {tail.shape}")
        if tail.size < cfg.min_n:
            return 0, _EMPTY_DRAFT.copy()
        if tail.dtype.kind not in "iu":
            raise ValueError(f"context must hold integer token ids, got dtype {tail.dtype}")
        key = tuple(tail[::-1].tolist())
        # _pin() and try/finally, not _reading(): this runs every decoding step, and a generator costs a microsecond.
        index = self._pin()
        try:
            # Every stored key has length in [min_n, max_n], so the longest valued prefix is the longest suffix match.
            step = index.trie.longest_prefix(key)
            seq = index.seqs.get(step.value >> _POS_BITS) if step else None
            if step and seq is None:
                # Unreachable while writes are all or nothing (_write); should a key ever outlive its sequence, the
                # longest match whose sequence is stored answers instead of a KeyError.
                step, seq = next(
                    ((s, index.seqs[s.value >> _POS_BITS]) for s in reversed(list(index.trie.prefixes(key)))
                     if s.value >> _POS_BITS in index.seqs),
                    (None, None),
                )
            if seq is None:
                return 0, _EMPTY_DRAFT.copy()
            t = step.value & _POS_MASK
            draft = seq[t:t + int(k)].copy()
        finally:
            index.pins.pop()
        return len(step.key), draft

    # ------------------------------------------------------------------ persistence

    def save(self, path) -> None:
        """Write the cache as JSON, atomically (``lookupdec._fs.atomic_write``: a temp file in the same folder, then
        ``os.replace``).

        JSON rather than pickle so that loading a file from anywhere cannot run code. A failed save leaves any previous
        file at ``path`` untouched and removes its temp file; the error propagates.
        """
        path = os.fspath(path)
        cfg = self._config
        # Snapshot from a pinned copy, serialise outside it: other threads keep generating while the file is written.
        with self._reading() as index:
            sequences = [index.seqs[seq_id].tolist() for seq_id in index.order]
        payload = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "max_tokens": cfg.max_tokens,
            "min_n": cfg.min_n,
            "max_n": cfg.max_n,
            "sequences": sequences,
        }
        with atomic_write(path) as handle:
            json.dump(payload, handle, separators=(",", ":"))

    @classmethod
    def load(cls, path, *, strict: bool = False) -> RollingCache:
        """Read a file written by :meth:`save`.

        A missing, unreadable, corrupt or incompatible file raises :class:`CacheFileError` (one line, naming the file
        and the reason) when ``strict``, and nothing on disk changes. Otherwise the load logs a warning on the
        ``lookupdec`` logger and returns an empty cache, so a bad cache file can cost speed but never a generation. The
        empty cache keeps the file's n-range and budget when those were readable and valid, else the defaults.

        Non-strict, a file that exists but cannot be used (corrupt, truncated, from a newer lookupdec, unreadable) is
        first renamed to ``NAME.unreadable-YYYYmmdd-HHMMSS`` beside it (``-1``, ``-2``, ... appended when that name is
        taken; an earlier moved-aside file is never replaced), so the next :meth:`save` to ``path`` cannot destroy what
        it held; the warning says where it went. If the rename fails (a read-only folder, say), the warning says so and
        the file stays where it is: a later save to ``path`` would then replace it, though whatever stopped the rename
        (a read-only or sticky folder, an immutable file) usually stops that save too. A missing file, or a folder at
        ``path``, is left alone.

        Only the very file that failed to load is moved: another process may save to ``path`` (an atomic replace)
        while this one reads. If ``path`` names another file by the time of the move, that file stays, the warning
        says so, and it is read instead (once; should it fail too and be replaced again, the load starts empty).
        """
        path_str = os.fspath(path)
        for attempt in range(2):
            try:
                config, sequences = _read_cache_file(path_str)
                break
            except _UnusableFile as problem:
                message = f"cache file {path_str!r}: {problem.reason}"
                if strict:
                    raise CacheFileError(message) from None
                if problem.identity is not None:
                    try:
                        moved = _move_aside(path_str, problem.identity)
                    except OSError as err:
                        message += (f"; could not move it aside ({type(err).__name__}: {err.strerror or err}), "
                                    "left in place")
                    else:
                        if moved is not None:
                            message += f"; moved it to {moved!r}"
                        elif attempt == 0:
                            logger.warning("%s; another file replaced it while it was read: left that one in place, "
                                           "reading it instead", message)
                            continue
                        else:
                            message += "; another file replaced it while it was read, left that one in place"
                logger.warning("%s; starting with an empty cache", message)
                cfg = problem.config or CacheConfig()
                return cls(max_tokens=cfg.max_tokens, min_n=cfg.min_n, max_n=cfg.max_n)
        cache = cls(max_tokens=config.max_tokens, min_n=config.min_n, max_n=config.max_n)
        for arr in sequences:
            cache._add_array(arr)
        return cache


class ClientCaches:
    """One rolling cache per client, so that one client's answers never become another's drafts.

    Drafts never change an answer (the target verifies every token), but they change how fast it comes: with one
    cache shared by every client, a client who times its responses can learn whether some other client recently
    generated a text. Scoped caches close that channel between clients; the price is that a client no longer
    drafts from what others generated.

    Clients are named by a string (OpenAI's ``user`` field); only a hash of it is kept, so a long name costs a fixed
    amount. A client's cache is made by its first finished request (a lookup for an unknown client finds nothing
    and allocates nothing), and the caches together hold at most ``max_tokens`` tokens: the least recently used
    client's cache is dropped whole while they hold more. Thread safe.
    """

    def __init__(self, config: CacheConfig, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.config = config  # of each client's cache
        self.max_tokens = max_tokens
        self._caches: OrderedDict[str, RollingCache] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    @staticmethod
    def _key(client: str) -> str:
        return hashlib.sha256(client.encode("utf-8", "surrogatepass")).hexdigest()

    def __len__(self) -> int:
        """The clients that hold a cache now."""
        with self._lock:
            return len(self._caches)

    def get(self, client: str) -> RollingCache | None:
        """``client``'s cache, or None when it has none (nothing finished yet, or dropped)."""
        key = self._key(client)
        with self._lock:
            cache = self._caches.get(key)
            if cache is not None:
                self._caches.move_to_end(key)
            return cache

    def add(self, client: str, tokens) -> None:
        """Store a finished sequence in ``client``'s cache (made now if it has none), then drop the least recently
        used other clients' caches while all of them hold more than ``max_tokens``."""
        key = self._key(client)
        with self._lock:
            cache = self._caches.get(key)
            if cache is None:
                cfg = self.config
                cache = self._caches[key] = RollingCache(max_tokens=cfg.max_tokens, min_n=cfg.min_n, max_n=cfg.max_n)
            self._caches.move_to_end(key)
        cache.add(tokens)
        with self._lock:
            total = sum(len(c) for c in self._caches.values())
            for other in list(self._caches):
                if total <= self.max_tokens or other == key:
                    break
                total -= len(self._caches.pop(other))


def _identity(status: os.stat_result) -> tuple[int, int]:
    """What tells one file from another that replaced it at the same path."""
    return status.st_dev, status.st_ino


def _names(path: str, identity: tuple[int, int]) -> bool:
    """Whether ``path`` still names the file ``identity``."""
    try:
        return _identity(os.stat(path)) == identity
    except FileNotFoundError:
        return False


def _move_aside(path: str, identity: tuple[int, int]) -> str | None:
    """Rename the file ``identity`` at ``path`` to a free ``path.unreadable-YYYYmmdd-HHMMSS[-N]`` and return that name;
    None, with nothing moved, when ``path`` no longer names that file (another process saved over it)."""
    stem = f"{path}.unreadable-{datetime.now():%Y%m%d-%H%M%S}"
    suffix = 0
    while True:
        target = stem if suffix == 0 else f"{stem}-{suffix}"
        # Claim the name first: os.replace alone would silently replace an earlier moved-aside file.
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            suffix += 1
            continue
        try:
            if not _names(path, identity):
                os.remove(target)
                return None
            os.replace(path, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(target)
            raise
        if _names(target, identity):
            return target
        # A save replaced the file between the check and the rename, so the rename took the saved file: give it back.
        # os.link never replaces, so a still newer save at path wins, and the one taken is then superseded anyway.
        try:
            os.link(target, path)
        except FileExistsError:
            pass
        except OSError:  # no hard links on this filesystem
            os.replace(target, path)
            return None
        os.remove(target)
        return None


class _UnusableFile(Exception):
    """Internal: why a cache file cannot be used, plus its config when that much was readable."""

    def __init__(self, reason: str, config: CacheConfig | None = None):
        super().__init__(reason)
        # Messages must stay one line (CLI prints them as-is).
        self.reason = " ".join(reason.split())
        self.config = config
        # (st_dev, st_ino) of the regular file that failed, for _move_aside; None when there is no such file.
        self.identity: tuple[int, int] | None = None


def _read_cache_file(path: str) -> tuple[CacheConfig, list[np.ndarray]]:
    """Read, parse and validate a cache file; raise _UnusableFile with a one-line reason on any problem, carrying the
    identity of the regular file that failed (the one read through the descriptor, not whatever is at path now)."""
    identity = None
    try:
        # Identity before opening, for a file that exists but cannot be opened; the descriptor's once it is open.
        status = os.stat(path)
        identity = _identity(status) if stat.S_ISREG(status.st_mode) else None
        with open(path, "rb") as handle:
            status = os.fstat(handle.fileno())
            identity = _identity(status) if stat.S_ISREG(status.st_mode) else None
            raw = handle.read()
    except FileNotFoundError:
        raise _UnusableFile("not found") from None
    except OSError as err:
        problem = _UnusableFile(f"cannot be read ({type(err).__name__}: {err.strerror or err})")
        problem.identity = identity
        raise problem from None
    try:
        return _parse_cache_file(raw)
    except _UnusableFile as problem:
        problem.identity = identity
        raise


def _parse_cache_file(raw: bytes) -> tuple[CacheConfig, list[np.ndarray]]:
    """Parse and validate a cache file's bytes; raise _UnusableFile with a one-line reason on any problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _UnusableFile("is not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise _UnusableFile(f"is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    except (ValueError, RecursionError) as err:
        # ValueError: e.g. an integer literal beyond Python's digit limit; RecursionError: absurdly deep nesting.
        raise _UnusableFile(f"is not usable JSON ({type(err).__name__})") from None

    if not isinstance(data, dict):
        raise _UnusableFile(f"top level is a JSON {_json_type(data)}, expected an object")
    fmt = data.get("format")
    if fmt != FORMAT_NAME:
        raise _UnusableFile(f"format is {_short(fmt)}, expected {FORMAT_NAME!r}")
    version = data.get("version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise _UnusableFile(
            f"format version {_short(version)} is not supported (this lookupdec reads version {FORMAT_VERSION})"
        )

    fields = {}
    for name in ("max_tokens", "min_n", "max_n"):
        if name not in data:
            raise _UnusableFile(f"field {name!r} is missing")
        value = data[name]
        if type(value) is not int:
            raise _UnusableFile(f"field {name!r} must be an integer, got JSON {_json_type(value)}")
        fields[name] = value
    try:
        config = CacheConfig(**fields)
    except ValueError as err:
        raise _UnusableFile(f"invalid settings: {err}") from None

    # From here on the config is known good, so a non-strict load can keep it.
    if "sequences" not in data:
        raise _UnusableFile("field 'sequences' is missing", config)
    seqs_json = data["sequences"]
    if not isinstance(seqs_json, list):
        raise _UnusableFile(f"field 'sequences' must be a list, got JSON {_json_type(seqs_json)}", config)
    sequences = []
    for seq_index, seq in enumerate(seqs_json):
        if not isinstance(seq, list):
            raise _UnusableFile(f"sequence {seq_index} must be a list of token ids, got JSON {_json_type(seq)}", config)
        for pos, tok in enumerate(seq):
            # type() rather than isinstance(): JSON true/false load as bool, an int subclass.
            if type(tok) is not int or not 0 <= tok <= _MAX_TOKEN_ID:
                raise _UnusableFile(
                    f"sequence {seq_index}, position {pos}: {_short(tok)} is not a token id in [0, {_MAX_TOKEN_ID}]",
                    config,
                )
        sequences.append(np.array(seq, dtype=np.int32))
    return config, sequences


def _short(value, limit: int = 40) -> str:
    """repr() capped in length: a hostile or broken file must not turn an error message into megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
