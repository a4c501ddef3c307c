"""numba kernels over int32 arrays. Imports numba and numpy only; the classes that own the arrays live elsewhere.

N-gram index (used by `index.NgramIndex`)
-----------------------------------------
Index spaces: `t` is an absolute position in the token buffer `buf[0:L]`; `src` is a `t` used as the start of a
draft (the position right after an earlier occurrence of an n-gram); `node` is a row of `nodes`; `slot` is a
position in the hash table `slots`.

Every n-gram (n <= max_n) that has occurred is interned as a node of a reversed trie: the n-gram
`buf[src-n:src]` is the node keyed by (its (n-1)-gram `buf[src-n+1:src]`, the token `buf[src-n]`), and node 0 is
the empty gram. Because the parent is itself an interned id, two keys are equal iff the n-grams are equal, so a
probe compares two int32s and hash collisions can never produce a false match, with no rescan of the tokens.

    nodes  # [node_cap, 3] int32: (parent node, token, most recent src); rows [0, n_nodes) are live
    slots  # [2 * node_cap] int32: node id or EMPTY; open addressing with linear probing

`slots` is always twice `nodes`, both powers of two, so the load factor stays <= 0.5 and every probe sequence
reaches an EMPTY slot. The caller grows both (doubling) when a kernel reports that it stopped for room.
"""

import numba
import numpy as np

EMPTY = -1  # a free slot in `slots`
PARENT, TOKEN, SRC = 0, 1, 2  # columns of `nodes`
ROOT = 0  # node 0 is the empty gram; it is never stored in `slots`

# murmur3's 64-bit finaliser constants; the arithmetic is done in uint64 so wrap-around is defined modular
# arithmetic (numba would otherwise promote a mixed int64/uint64 expression to float64).
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


@numba.njit(cache=True, inline="always")
def _slot_of(parent, token, mask):
    """Home slot of the key (parent, token). `mask` is len(slots) - 1."""
    # parent < 2**31 and the token's 32 bits fill the low word, so the packed key is exact and never overflows int64.
    key = np.uint64((np.int64(parent) << 32) | (np.int64(token) & 0xFFFFFFFF))
    key ^= key >> _S33
    key *= _M1
    key ^= key >> _S33
    key *= _M2
    key ^= key >> _S33
    return np.int64(key & np.uint64(mask))


@numba.njit(cache=True)
def index_positions(buf, t_lo, t_hi, max_n, nodes, n_nodes, slots):
    """Register every `src` in [t_lo, t_hi) as a source of the n-grams `buf[src-n:src]`, 1 <= n <= min(max_n, src).

    The caller passes t_hi <= L, so a registered src always has a known token `buf[src]` after it, and the current
    suffix (which would be src = L) is registered only once the next token arrives: the insertion lags by one.
    A later src overwrites the node's SRC, so each n-gram keeps its most recent occurrence. Cost O(max_n) per src.

    buf    # [>= t_hi] int32 token buffer
    nodes  # [node_cap, 3] int32, updated in place
    slots  # [2 * node_cap] int32, updated in place
    Returns (t, n_nodes): t == t_hi when done; t < t_hi when `nodes` has no room for another max_n nodes, in which
    case the caller grows `nodes`/`slots` and calls again from t.
    """
    mask = slots.shape[0] - 1
    node_cap = nodes.shape[0]
    for t in range(t_lo, t_hi):
        if n_nodes + max_n > node_cap:
            return t, n_nodes
        parent = ROOT
        for n in range(1, min(max_n, t) + 1):
            token = buf[t - n]
            slot = _slot_of(parent, token, mask)
            while True:
                node = slots[slot]
                if node == EMPTY:
                    node = n_nodes
                    n_nodes += 1
                    nodes[node, PARENT] = parent
                    nodes[node, TOKEN] = token
                    slots[slot] = node
                    break
                if nodes[node, PARENT] == parent and nodes[node, TOKEN] == token:
                    break
                slot = (slot + 1) & mask
            nodes[node, SRC] = t  # t only grows, so this is the most recent occurrence
            parent = node
    return t_hi, n_nodes


@numba.njit(cache=True)
def rehash(nodes, n_nodes, slots):
    """Insert nodes [1, n_nodes) into `slots` (all EMPTY on entry). Keys are distinct, so no equality test is needed.

    nodes  # [node_cap, 3] int32
    slots  # [2 * node_cap] int32, filled in place
    """
    mask = slots.shape[0] - 1
    for node in range(1, n_nodes):
        slot = _slot_of(nodes[node, PARENT], nodes[node, TOKEN], mask)
        while slots[slot] != EMPTY:
            slot = (slot + 1) & mask
        slots[slot] = node


@numba.njit(cache=True)
def match_suffix(buf, length, min_n, max_n, nodes, slots):
    """Longest n in [min_n, max_n] whose suffix n-gram `buf[L-n:L]` has a source, and that n-gram's latest source.

    Walks the suffix backwards, one trie level per token, and stops at the first n-gram that never occurred before
    (no longer n-gram can have occurred then either). At most max_n lookups, each O(1) expected probes, whatever L is.

    buf  # [>= L] int32, L = `length`
    Returns (n, src, probes): (0, -1, probes) when no n >= min_n matches; `probes` counts slots inspected (a cost
    witness for tests).
    """
    mask = slots.shape[0] - 1
    best_n, best_src = 0, -1
    probes = 0
    parent = ROOT
    for n in range(1, min(max_n, length) + 1):
        token = buf[length - n]
        slot = _slot_of(parent, token, mask)
        node = EMPTY
        while True:
            probes += 1
            candidate = slots[slot]
            if candidate == EMPTY:
                break
            if nodes[candidate, PARENT] == parent and nodes[candidate, TOKEN] == token:
                node = candidate
                break
            slot = (slot + 1) & mask
        if node == EMPTY:
            break
        if n >= min_n:
            best_n, best_src = n, nodes[node, SRC]
        parent = node
    return best_n, best_src, probes


@numba.njit(cache=True)
def common_suffix_length(buf, src, length, cap):
    """Length of the common suffix of `buf[:src]` and `buf[:L]` (L = `length`, src <= L), capped at `cap`. O(cap).

    buf  # [>= L] int32
    """
    matched = 0
    while matched < cap and matched < src and buf[src - 1 - matched] == buf[length - 1 - matched]:
        matched += 1
    return matched
