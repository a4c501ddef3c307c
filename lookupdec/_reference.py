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


# --------------------------------------------------------------------------------------------------------------------
# The acceptance rule (twin of `verify`), one position at a time, as the papers state it
#
# Greedy: keep drafted tokens while each equals the target's argmax (the first index of the maximum, as torch's
# argmax picks); the target's own token follows. Sampling (Leviathan et al. 2023, Chen et al. 2023, with q a point
# mass on each drafted token x): accept x with probability min(1, p(x) / q(x)) = p(x), drawing u ~ U[0, 1) and
# accepting when u < p(x); on the first rejection draw from norm(max(0, p - q)) = p with x removed; after a fully
# accepted draft draw the bonus token from the last position's p. Randomness comes from a torch generator, one
# uniform per decided position and one categorical draw per pass, in that order: the lazy fast path reads the
# generator the same way, so seeded runs of the two give the same samples.
# --------------------------------------------------------------------------------------------------------------------


def accept_greedy(logits: list[list[float]], draft: list[int]) -> tuple[int, int]:
    """(accepted, token) for ``logits`` [d + 1][vocab] and ``draft`` [d]."""
    for pos in range(len(draft) + 1):
        row = logits[pos]
        best = max(range(len(row)), key=lambda i: (row[i], -i))  # the first maximal index
        if pos == len(draft) or best != draft[pos]:
            return pos, best
    raise AssertionError("unreachable")


def accept_sample(logits, draft: list[int], generator) -> tuple[int, int]:
    """(accepted, token) for ``logits`` (a float tensor [d + 1, vocab]), drawing from ``generator``."""
    import torch

    for pos in range(len(draft) + 1):
        p = torch.softmax(logits[pos].float(), dim=-1)
        if pos == len(draft):
            return pos, int(torch.multinomial(p, 1, generator=generator))
        x = draft[pos]
        if float(torch.rand((), generator=generator)) < float(p[x]):
            continue
        residual = p.clone()
        residual[x] = 0.0
        return pos, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    raise AssertionError("unreachable")
