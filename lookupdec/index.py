"""NgramIndex: an incremental n-gram index over a growing token buffer, for lookup (prompt-lookup) drafting.

Appending a token costs amortised O(max_n); a proposal costs O(max_n + k) whatever the context length L.
(transformers' prompt lookup rescans the whole sequence every step; vLLM's KMP proposer is O(L) per step.)
The kernels are in `_kernels.py` (data layout documented there); the plain-Python twin is `_reference.ngram_match`.
"""

from __future__ import annotations

import operator

import numpy as np

from . import _kernels

MAX_N_LIMIT = 16  # longest n-gram the index will key on; longer matches are measured with match_length()
_INT32_MIN, _INT32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max
_NO_TOKENS = np.empty(0, dtype=np.int32)


def _as_token_array(tokens) -> np.ndarray:
    """Any 1-D array-like of ints (list, numpy array, CPU torch tensor) -> C-contiguous int32 array."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.int32:
        return np.ascontiguousarray(arr)
    if arr.size == 0:
        return _NO_TOKENS
    if arr.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    if not np.can_cast(arr.dtype, np.int32):
        # numpy's min/max cost ~1 us each on a tiny array, more than the append itself: decode steps add 1..k+1 tokens.
        if arr.shape[0] <= 32:
            values = arr.tolist()
            lo, hi = min(values), max(values)
        else:
            lo, hi = arr.min(), arr.max()
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise ValueError(f"token ids must fit in int32 [{_INT32_MIN}, {_INT32_MAX}]")
    return arr.astype(np.int32)


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


class NgramIndex:
    """Finds where the current suffix occurred before, and proposes the tokens that followed it.

    Buffer `tokens[0:L]`, L = len(self). A *source* of length n is a position `src` in [n, L-1] such that
    `tokens[src-n:src] == tokens[L-n:L]`: an earlier occurrence of the suffix n-gram that is followed by at least one
    known token (the suffix itself, ending at L, is never its own source).

    Match policy (decided here, pinned by golden tests in tests/test_index.py):
      * the LONGEST n in [min_n, max_n] with any source wins, even over a more recent shorter match;
      * among the sources for that n the MOST RECENT (largest src) wins: recent output is the likeliest to be
        continued, and it keeps one entry per n-gram in the index (a later occurrence overwrites the earlier one).
    Token ids are opaque int32 values; negative ids (e.g. -1 between reference documents) are ordinary tokens.

    Complexity: extend() is amortised O(max_n) per token; match() is O(max_n) expected and propose(k) O(max_n + k),
    independent of L. Memory is O(L * max_n) in the worst case (every n-gram distinct), less on repetitive text.
    """

    _compiled = False  # the kernels are compiled (or loaded from numba's cache) once per process

    def __init__(self, min_n: int = 1, max_n: int = 4, capacity: int = 1024):
        min_n, max_n, capacity = operator.index(min_n), operator.index(max_n), operator.index(capacity)
        if not 1 <= min_n <= max_n <= MAX_N_LIMIT:
            raise ValueError(f"need 1 <= min_n <= max_n <= {MAX_N_LIMIT}, got min_n={min_n}, max_n={max_n}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (initial token-buffer size), got {capacity}")
        self.min_n = min_n
        self.max_n = max_n
        self._buf = np.empty(capacity, dtype=np.int32)  # [buf_cap] tokens[0:L], doubled when full
        self._len = 0
        # Registering one src adds at most max_n nodes, so start with room for a few; doubled when full.
        node_cap = _next_pow2(max(capacity, 4 * max_n))
        self._nodes = np.empty((node_cap, 3), dtype=np.int32)  # [node_cap, 3] (parent, token, latest src)
        self._slots = np.full(2 * node_cap, _kernels.EMPTY, dtype=np.int32)  # [2 * node_cap] load <= 0.5
        self._clear_nodes()
        self._match_memo: tuple[int, int] | None = None  # match() result for the current buffer
        self._last_probes = 0  # slots inspected by the last match kernel call (a cost witness for tests)
        if not NgramIndex._compiled:
            self.warmup()

    # ----------------------------------------------------------------------------------------------------- state

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> np.ndarray:
        """Read-only int32 view of tokens[0:L]; it aliases the buffer, so copy it to keep it past extend()/reset()."""
        view = self._buf[: self._len]
        view.flags.writeable = False
        return view

    def extend(self, tokens) -> None:
        """Append tokens (1-D array-like of ints). Amortised O(max_n) per token."""
        new = _as_token_array(tokens)
        if new.shape[0] == 0:
            return
        t_lo = self._len
        t_hi = t_lo + new.shape[0]
        if t_hi > self._buf.shape[0]:
            grown = np.empty(max(t_hi, 2 * self._buf.shape[0]), dtype=np.int32)
            grown[:t_lo] = self._buf[:t_lo]
            self._buf = grown
        self._buf[t_lo:t_hi] = new
        self._len = t_hi
        self._match_memo = None
        # Every src in [t_lo, t_hi) is now followed by a known token, so it becomes a source; src = t_hi waits for
        # the next token (lagged insertion: the suffix is never its own source).
        t = t_lo
        while True:
            t, self._n_nodes = _kernels.index_positions(
                self._buf, t, t_hi, self.max_n, self._nodes, self._n_nodes, self._slots
            )
            if t == t_hi:
                break
            self._grow_nodes()

    def reset(self, tokens=()) -> None:
        """Forget everything (keeping the allocated buffers) and start over with `tokens`."""
        new = _as_token_array(tokens)  # validate before clearing, so a bad argument leaves the index intact
        self._len = 0
        self._match_memo = None
        self._clear_nodes()
        self.extend(new)

    # ---------------------------------------------------------------------------------------------------- lookup

    def match(self) -> tuple[int, int]:
        """(n, src): the longest suffix n-gram in [min_n, max_n] with a source, and its most recent source.

        (0, -1) when there is none. See the class docstring for the policy.
        """
        if self._match_memo is None:
            n, src, self._last_probes = _kernels.match_suffix(
                self._buf, self._len, self.min_n, self.max_n, self._nodes, self._slots
            )
            self._match_memo = (n, src)
        return self._match_memo

    def propose(self, k: int) -> np.ndarray:
        """Draft: tokens[src : min(src + k, L)] for the match() source, as a new int32 array of length 0..k.

        Empty (int32) when nothing matches or k == 0; never runs past the last known token.
        """
        k = self._check_count(k, "k")
        n, src = self.match()
        if n == 0 or k == 0:
            return _NO_TOKENS.copy()
        return self._buf[src : min(src + k, self._len)].copy()

    def match_length(self, src: int, cap: int) -> int:
        """Length of the common suffix of tokens[:src] and tokens[:L], capped at `cap`. O(cap).

        The drafter uses it as a confidence signal beyond max_n.
        """
        src = self._check_position(src)
        cap = self._check_count(cap, "cap")
        return _kernels.common_suffix_length(self._buf, src, self._len, cap)

    def continuation(self, src: int, k: int) -> np.ndarray:
        """tokens[src : min(src + k, L)] as a new int32 array (the drafter's alignment cursor reads through it)."""
        src = self._check_position(src)
        k = self._check_count(k, "k")
        return self._buf[src : min(src + k, self._len)].copy()

    # -------------------------------------------------------------------------------------------------- plumbing

    def warmup(self) -> None:
        """Compile every kernel for the argument types the index uses, by driving a throwaway index."""
        # JIT compilation (or loading numba's on-disk cache) takes up to seconds; pay it here, not in a decode step.
        was_compiled, NgramIndex._compiled = NgramIndex._compiled, True  # the scratch index must not recurse here
        try:
            scratch = NgramIndex(min_n=1, max_n=2, capacity=1)
            scratch.extend(np.arange(24, dtype=np.int32))  # enough distinct n-grams to run the growth path
            scratch.extend(np.arange(4, dtype=np.int32))
            scratch.propose(2)
            scratch.match_length(2, 4)
        except BaseException:
            NgramIndex._compiled = was_compiled
            raise

    def _clear_nodes(self) -> None:
        self._slots.fill(_kernels.EMPTY)
        self._nodes[_kernels.ROOT] = (-1, 0, -1)  # the empty gram; never stored in `slots`
        self._n_nodes = 1

    def _grow_nodes(self) -> None:
        """Double `nodes` and `slots` (keeping slots = 2 * nodes, load <= 0.5) and rehash."""
        nodes = np.empty((2 * self._nodes.shape[0], 3), dtype=np.int32)
        nodes[: self._n_nodes] = self._nodes[: self._n_nodes]
        slots = np.full(2 * nodes.shape[0], _kernels.EMPTY, dtype=np.int32)
        _kernels.rehash(nodes, self._n_nodes, slots)
        self._nodes, self._slots = nodes, slots

    def _check_position(self, src: int) -> int:
        src = operator.index(src)
        if not 0 <= src <= self._len:
            raise ValueError(f"src must be in [0, {self._len}] (the buffer length), got {src}")
        return src

    @staticmethod
    def _check_count(value: int, name: str) -> int:
        value = operator.index(value)
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        return value

    def __repr__(self) -> str:
        return f"NgramIndex(min_n={self.min_n}, max_n={self.max_n}, len={self._len})"
