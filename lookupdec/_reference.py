"""Slow, obviously-correct pure-Python twins of the fast paths. Tests check the fast paths against these exactly."""

# --------------------------------------------------------------------------------------------------------------------
# N-gram lookup (twin of `_kernels` + `index.NgramIndex`)
#
# `tokens[0:L]` is the buffer. A source of length n is a position src in [n, L-1] with tokens[src-n:src] equal to the
# suffix tokens[L-n:L]: an earlier occurrence of the suffix n-gram that is followed by at least one known token.
# The longest n in [min_n, max_n] with a source wins; among its sources the most recent (largest src) wins.
# --------------------------------------------------------------------------------------------------------------------


def ngram_match(tokens: list[int], min_n: int, max_n: int) -> tuple[int, int]:
    """(n, src) of the longest suffix n-gram with an earlier occurrence, latest occurrence; (0, -1) when none."""
    tokens = list(tokens)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):  # a source needs n <= src <= L - 1
        suffix = tokens[length - n :]
        for src in range(length - 1, n - 1, -1):  # most recent first; src = L would be the suffix itself
            if tokens[src - n : src] == suffix:
                return n, src
    return 0, -1


def ngram_propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up-to-k tokens that followed the matched occurrence; [] when nothing matches."""
    tokens = list(tokens)
    n, src = ngram_match(tokens, min_n, max_n)
    if n == 0:
        return []
    return tokens[src : src + k]


def ngram_match_length(tokens: list[int], src: int, cap: int) -> int:
    """Length of the common suffix of tokens[:src] and tokens[:L], capped at cap."""
    tokens = list(tokens)
    length = len(tokens)
    matched = 0
    for m in range(1, min(cap, src) + 1):  # common suffixes are nested, so stop at the first length that differs
        if tokens[src - m : src] != tokens[length - m : length]:
            break
        matched = m
    return matched
