"""LookupDrafter: proposes draft tokens by copying, and decides how many are worth verifying.

Sources, in the order a proposal consults them:

1. **Alignment cursor.** When the tokens committed after a draft continue the text the draft was copied from, the
   next draft continues from the same place without searching. Short n-grams such as ``- name:`` or ``}`` repeat
   all over configs and code; the cursor keeps a copy on the occurrence it is following.
2. **The request's own n-gram index** (``NgramIndex``) over reference texts, the prompt and the tokens generated so
   far: the longest suffix match (``min_n .. max_n``), most recent occurrence first. References come first in the
   buffer, so the prompt and the output win ties against them.
3. **The rolling cross-request cache** (``RollingCache``): what earlier requests generated. Used when it matches a
   longer suffix than the request's own index does.

Draft length is cost-aware (``DrafterConfig.adaptive``): every source bucket (the cursor; an index match by how
many tokens it really shares with the current suffix; a cache match by n) keeps a running estimate ``a`` of the
chance that the next drafted token is accepted, and ``PassCost`` says what a pass with ``d`` drafted tokens costs:
the target's measured cost at every draft length (``lookupdec.calibrate``, which ``lookupdec.generate`` runs once per
model, device and thread count), or else a running straight-line fit (any draft costs a jump, then a little per
token). A draft of ``d`` tokens yields ``1 + a + ... + a^d`` tokens per pass on average; the drafter picks the ``d``
with the best tokens per second and drafts nothing when no ``d`` beats a plain step (so open-ended text does not
get slower). A bucket that stopped
drafting slowly forgets its bad record, so copying is probed again later.

Each mechanism can be switched off in ``DrafterConfig`` (``cursor``, ``guard``, ``adaptive``, ``calibrate``, ``use_cache``) to
measure what it is worth (``benchmarks/simulate.py --ablate``).

None of this can change what the target outputs: it only decides which tokens the target is asked to check.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np

from .cache import RollingCache
from .hf import AssistantProtocol
from .index import NgramIndex

EMPTY = np.zeros(0, dtype=np.int32)
SEPARATOR = -1  # between reference texts in the index buffer; never a real token, so no n-gram crosses it


@dataclass(frozen=True)
class DrafterConfig:
    # Longest draft. On a 2-core CPU (SmolLM2-135M, one thread) verifying 32 tokens costs about 3.7 plain steps and
    # 64 about 6, so a copy that stays right for 64 tokens is cheaper as one pass than as two; the cost model keeps
    # drafts short when copies are less certain.
    max_draft: int = 64
    # n-gram sizes the index matches; 1 lets a single shared token start a copy (the cost model prices it).
    min_n: int = 1
    max_n: int = 4
    # Consult and feed the rolling cross-request cache (outputs of earlier requests).
    use_cache: bool = True
    # Token budget of the cache the drafter creates when none is passed in.
    cache_tokens: int = 65536
    # Choose each draft's length from measured acceptance and pass cost; False drafts max_draft whenever a
    # match exists (the behaviour of transformers' prompt lookup), for ablations.
    adaptive: bool = True
    # Keep copying from the occurrence the last draft came from while the output follows it (the alignment
    # cursor); False re-searches the index for every draft, for ablations.
    cursor: bool = True
    # The never-slower guard of the adaptive length: draft nothing when no length beats a plain step. False keeps
    # the adaptive choice but drafts at least one token whenever there is a candidate, for ablations.
    guard: bool = True
    # Price drafts with the target's measured pass cost at every draft length (lookupdec.calibrate: measured once
    # per model, device and thread count, then cached on disk) instead of a straight-line fit. False keeps the
    # online straight-line fit, for ablations and for callers that must not spend the few seconds it takes.
    calibrate: bool = True

    def margin(self, must_draft: bool = False) -> float:
        """By how much a draft's expected gain must beat a plain step for the adaptive length to draft: the
        never-slower guard's 2%, or below every gain (the best length >= 1 always wins) without the guard or for
        a caller that must draft."""
        return 0.02 if self.guard and not must_draft else -1.0

    def __post_init__(self):
        for name in ("use_cache", "adaptive", "cursor", "guard", "calibrate"):
            value = getattr(self, name)
            if type(value) is not bool:  # 0, 1, None or "no" are mistakes; bool cannot be subclassed
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if not 1 <= self.max_draft <= 256:
            raise ValueError(f"max_draft must be in [1, 256], got {self.max_draft}")
        if not 1 <= self.min_n <= self.max_n <= 16:
            raise ValueError(f"need 1 <= min_n <= max_n <= 16, got min_n={self.min_n}, max_n={self.max_n}")
        if self.cache_tokens < 1:
            raise ValueError(f"cache_tokens must be >= 1, got {self.cache_tokens}")


# Prior chance that the next drafted token is accepted, per source bucket. Index buckets are by how many tokens
# the match really shares with the current suffix (capped at 32): a long shared context is an aligned copy.
_PRIORS = {  # bucket -> (first, then)
    ("cursor", 1): (0.6, 0.85), ("cursor", 2): (0.65, 0.85), ("cursor", 3): (0.7, 0.9), ("cursor", 4): (0.75, 0.9),
    ("cursor", 8): (0.85, 0.92), ("cursor", 16): (0.92, 0.95),
    ("index", 1): (0.25, 0.7), ("index", 2): (0.35, 0.75), ("index", 3): (0.45, 0.8), ("index", 4): (0.55, 0.85),
    ("index", 8): (0.7, 0.9), ("index", 16): (0.8, 0.92),
    ("cache", 1): (0.2, 0.7), ("cache", 2): (0.3, 0.75), ("cache", 3): (0.4, 0.8), ("cache", 4): (0.5, 0.85),
}
_PRIOR_WEIGHT = 6.0  # pseudo-observations behind each prior
_FORGET = 0.97  # per update: recent behaviour counts more (a request moves between copying and writing)
_RECOVER = 0.85  # per skipped draft: a silent bucket drifts back to its prior, which is how copying is re-probed
_CALIBRATION_KEEP = 0.9  # the shared calibration follows the last ~10 drafts


def _bucket(kind: str, shared: int) -> tuple:
    for edge in (16, 8, 4, 3, 2):
        if shared >= edge:
            return (kind, edge)
    return (kind, 1)


class _Acceptance:
    """Running estimates, per source bucket, of how drafts from that bucket fare.

    Copies are bursty: a draft is either wrong at its first token (the copy was from the wrong place) or right for a
    long stretch (until an edit point). One per-token rate cannot say both, so two are kept:
    ``first``, the chance the first drafted token is accepted, and ``then``, the chance each later one is, given
    the ones before it were. A draft that got ``j >= 1`` tokens accepted adds ``j - 1`` continuations, plus a stop
    if it was cut short; ``then = continuations / (continuations + stops)`` is the maximum-likelihood estimate of a
    geometric run with censoring.

    Buckets that have seen few drafts lean on their priors, which suit copy-heavy text. A calibration shared by all
    buckets, (first tokens accepted + 2) / (first tokens predicted + 2) over recent drafts, scales ``first`` so
    that text where copies keep failing (open-ended writing) stops drafting after a few misses, whichever bucket
    the next match falls in.
    """

    def __init__(self):
        self._counts = {}  # bucket -> [first tries, first accepted, continuations, stops], excluding the prior
        self._calibration = [0.0, 0.0]  # first tokens accepted, first tokens predicted (both forgotten)
        self._lock = threading.Lock()

    def _raw(self, bucket) -> tuple:
        prior_first, prior_then = _PRIORS[bucket]
        tries, firsts, cont, stops = self._counts.get(bucket, (0.0, 0.0, 0.0, 0.0))
        first = (firsts + prior_first * _PRIOR_WEIGHT) / (tries + _PRIOR_WEIGHT)
        then = (cont + prior_then * _PRIOR_WEIGHT) / (cont + stops + _PRIOR_WEIGHT)
        return first, then

    def estimate(self, bucket) -> tuple:
        """``(first, then)`` for drafts from ``bucket``."""
        first, then = self._raw(bucket)
        seen, predicted = self._calibration
        return min(first * (seen + 2.0) / (predicted + 2.0), 0.999), then

    def update(self, bucket, accepted: int, drafted: int) -> None:
        if drafted == 0:
            return
        with self._lock:
            seen, predicted = self._calibration
            self._calibration = [seen * _CALIBRATION_KEEP + bool(accepted),
                                 predicted * _CALIBRATION_KEEP + self._raw(bucket)[0]]
            tries, firsts, cont, stops = (c * _FORGET for c in self._counts.get(bucket, (0.0, 0.0, 0.0, 0.0)))
            if accepted:
                firsts += 1.0
                cont += accepted - 1
                stops += float(accepted < drafted)
            self._counts[bucket] = [tries + 1.0, firsts, cont, stops]

    def skipped(self, bucket) -> None:
        with self._lock:
            if bucket in self._counts:
                self._counts[bucket] = [c * _RECOVER for c in self._counts[bucket]]


class PassCost:
    """A step's wall time against draft length ``d``, relative to a plain step: :meth:`costs`.

    With a measured profile (:meth:`use_profile`, from ``lookupdec.calibrate``) that is the profile: the cost of
    every draft length, as measured on this model, device and thread count. The curve need not be straight or
    even rise: on this project's CPU, one torch thread, SmolLM2-135M, a pass with 2 drafted tokens costs 2.0
    plain steps and one with 3 costs 1.5 (MKL runs products of 2 or 3 rows as that many matrix-vector products).

    Without one, a straight line: a plain step runs matrix-vector products, while any draft turns them into
    matrix-matrix products, which cost about 1.6 plain steps at once and then ~5% of a step per drafted token
    (32 tokens: ~3.2 steps). So ``time(0) = t0`` and ``time(d) = t1 + slope * d`` for ``d >= 1``, fitted by
    exponentially forgotten least squares on the steps actually run (:meth:`relative`); until enough steps of a
    kind have been seen, that CPU shape stands in. Batches use the straight line (``LookupDrafter.batch_cost``).
    """

    PRIOR_JUMP = 0.55  # time(1) / time(0) - 1 - PRIOR_SLOPE
    PRIOR_SLOPE = 0.05  # per drafted token, relative to time(0)
    _KEEP = 0.95  # forgetting per observation: machines are shared, and load drifts

    def __init__(self, prior_jump: float = PRIOR_JUMP, prior_slope: float = PRIOR_SLOPE):
        self.prior_jump, self.prior_slope = prior_jump, prior_slope
        self._plain = np.zeros(2)  # weight, sum t over d == 0
        self._draft = np.zeros(5)  # weight, sum d, sum t, sum d*d, sum d*t over d >= 1
        self._profile = None  # measured relative cost per draft length, when calibrated
        self._source = None  # weak reference to the model lookupdec.calibrate measured the profile on
        self._lock = threading.Lock()

    def observe(self, draft_len: int, seconds: float) -> None:
        d, t = float(draft_len), float(seconds)
        with self._lock:
            if draft_len == 0:
                self._plain *= self._KEEP
                self._plain += (1.0, t)
            else:
                self._draft *= self._KEEP
                self._draft += (1.0, d, t, d * d, d * t)

    def costs(self, available: int) -> np.ndarray:
        """Relative time of a pass with ``d`` drafted tokens, ``d = 0 .. available`` (``costs[0] == 1``): the
        measured profile when one is set (:meth:`use_profile`), else the straight-line fit of :meth:`relative`."""
        profile = self._profile
        if profile is None:
            return linear_costs(*self.relative(), available)
        if available < profile.size:
            return profile[: available + 1].copy()
        # Past the measured lengths: the slope of the profile's last quarter, which is where it is straight.
        last = profile.size - 1
        ref = max(1, last - max(1, last // 4))
        slope = max((profile[last] - profile[ref]) / (last - ref), 0.0) if last > ref else 0.0
        return np.concatenate([profile, profile[last] + slope * np.arange(1, available - last + 1)])

    def use_profile(self, profile, source=None) -> None:
        """Price drafts with ``profile[d]``, the measured time of a pass with ``d`` drafted tokens relative to a
        plain step; ``None`` goes back to the online straight-line fit. Beyond the profile's last length the cost
        grows by the slope of its last quarter. ``source`` is the model ``lookupdec.calibrate`` measured it on
        (``None``: set by hand, and then ``lookupdec.generate`` leaves it alone)."""
        if profile is None:
            self._profile, self._source = None, None
            return
        profile = np.asarray(profile, dtype=np.float64)
        if profile.ndim != 1 or profile.size < 2 or not np.all(np.isfinite(profile)) or profile.min() <= 0:
            raise ValueError(f"a pass-cost profile is a 1-D array of >= 2 positive costs, got {profile!r}")
        self._profile = profile / profile[0]
        self._source = weakref.ref(source) if source is not None else None

    @property
    def profile(self) -> np.ndarray | None:
        return None if self._profile is None else self._profile.copy()

    @property
    def profile_source(self):
        """The model the profile was measured on by ``lookupdec.calibrate``, or ``None`` (no profile, one set by
        hand, or a model that no longer exists)."""
        return self._source() if self._source is not None else None

    def relative(self) -> tuple:
        """``(jump, slope)`` with ``time(d) / time(0) = 1 + jump + slope * d`` for ``d >= 1``."""
        w0, s0 = self._plain
        w, sd, st, sdd, sdt = self._draft
        if w < 2:
            return self.prior_jump, self.prior_slope
        mean_d, mean_t = sd / w, st / w
        var = sdd / w - mean_d**2
        t0 = s0 / w0 if w0 >= 2 else None
        if var >= 4.0 and w >= 4:
            slope = (sdt / w - mean_d * mean_t) / var
        elif t0 is not None:
            slope = self.prior_slope * t0
        else:
            slope = mean_t * self.prior_slope / (1 + self.prior_jump + self.prior_slope * (1 + mean_d))
        slope = max(slope, 0.0)
        t1 = mean_t - slope * mean_d
        if t0 is None:
            t0 = t1 / (1 + self.prior_jump + self.prior_slope)
        if t0 <= 0:
            return self.prior_jump, self.prior_slope
        return max(t1 / t0 - 1.0, 0.0), slope / t0


def linear_costs(jump: float, slope: float, available: int) -> np.ndarray:
    """Relative pass times ``1`` for ``d == 0`` and ``1 + jump + slope * d`` for ``d = 1 .. available``."""
    costs = 1.0 + jump + slope * np.arange(available + 1, dtype=np.float64)
    costs[0] = 1.0
    return costs


def _cost_curve(costs) -> np.ndarray:
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 1 or costs.size < 1:
        raise ValueError(f"costs must list the relative pass cost of draft lengths 0, 1, ..., got {costs!r}")
    return costs


def best_draft_length(first: float, then: float, costs: Sequence[float], *, margin: float = 0.02) -> int:
    """The draft length with the most expected tokens per unit of time, or 0 if none beats a plain step by
    ``margin``. ``costs[d]`` is the relative time of a pass with ``d`` drafted tokens (``costs[0] == 1``; its
    length bounds the draft). Expected tokens for ``d`` drafted: ``1 + first * (1 + then + ... + then^(d-1))``
    (the 1 is the target's own token). Measured costs need not grow with ``d`` (on this project's CPU a pass of 3
    drafted tokens is cheaper than one of 2), so every length is weighed."""
    costs = _cost_curve(costs)
    available = costs.size - 1
    if available < 1:
        return 0
    tokens = 1.0 + first * np.cumsum(then ** np.arange(available, dtype=np.float64))
    gains = tokens / costs[1:]
    best = int(np.argmax(gains))  # the shortest of equal bests
    return best + 1 if gains[best] > 1.0 + margin else 0


@dataclass(frozen=True)
class Offer:
    """What a session could draft next: the longest candidate and the odds of its tokens being accepted."""

    tokens: np.ndarray  # int32, possibly empty
    first: float  # chance the first token is accepted
    then: float  # chance each later token is, given the ones before it were


def best_batch_length(offers: Sequence[Offer], costs: Sequence[float], *, margin: float = 0.02) -> int:
    """One draft length for a batch: each row drafts up to it (a batch pass is as wide as its longest draft, so
    shorter drafts would save nothing), and a pass with ``d`` drafted positions costs ``costs[d]`` batched plain
    steps (``costs[0] == 1``). Returns the length with the most expected tokens per unit of time, or 0 if none
    beats a plain step by ``margin``."""
    rows = len(offers)
    costs = _cost_curve(costs)
    longest = min(max((o.tokens.size for o in offers), default=0), costs.size - 1)
    best_d, best_gain = 0, 1.0 + margin
    expected = float(rows)  # the target's own token of every row
    reach = [o.first for o in offers]  # chance that row's draft is accepted up to the current position
    for d in range(1, longest + 1):
        for i, o in enumerate(offers):
            if o.tokens.size >= d:
                expected += reach[i]
                reach[i] *= o.then
        gain = expected / (rows * costs[d])
        if gain > best_gain:
            best_d, best_gain = d, gain
    return best_d


TokenSource = Union[str, Sequence[int], np.ndarray]


class LookupDrafter(AssistantProtocol):
    """Draft-free speculation: proposes continuations copied from the prompt, the output so far, reference texts
    and earlier outputs.

    Use it with :func:`lookupdec.generate` (one drafter may serve many requests and threads at once), or as
    ``model.generate(..., assistant_model=LookupDrafter())`` in transformers (one request at a time).

    Args:
        config: a :class:`DrafterConfig`; or pass its fields as keywords (``LookupDrafter(max_draft=16)``).
        cache: a shared :class:`~lookupdec.cache.RollingCache`; by default the drafter makes its own when
            ``config.use_cache`` is set, so outputs of earlier requests help later ones.
        references: extra texts to copy from, e.g. the file being edited: token-id sequences, or strings when
            ``tokenizer`` is given.
        vocab_size: the target's vocabulary size. Only the transformers route under sampling needs it, and it learns
            it from transformers on its own.
    """

    def __init__(
        self,
        config: DrafterConfig | None = None,
        *,
        cache: RollingCache | None = None,
        references: Iterable[TokenSource] | None = None,
        tokenizer=None,
        vocab_size: int | None = None,
        **fields,
    ):
        if config is not None and fields:
            raise TypeError("pass either a DrafterConfig or its fields as keywords, not both")
        self.drafter_config = config if config is not None else DrafterConfig(**fields)
        cfg = self.drafter_config
        if cache is None and cfg.use_cache:
            # Unigram hits across unrelated requests are noise; the cache starts at bigrams.
            cache = RollingCache(max_tokens=cfg.cache_tokens, min_n=max(2, cfg.min_n), max_n=max(2, cfg.max_n))
        self.cache = cache if cfg.use_cache else None
        self.references = [_as_tokens(ref, tokenizer) for ref in (references or [])]
        self.vocab_size = vocab_size
        self.acceptance = _Acceptance()
        self.cost = PassCost()
        self._batch_costs = {}
        self._batch_lock = threading.Lock()

    def batch_cost(self, rows: int) -> PassCost:
        """The pass-cost model of batches of ``rows`` rows (relative to a plain batched step), fitted online.

        Batching changes the price of a draft: a plain step of ``rows`` rows already runs matrix-matrix products,
        and every drafted position is paid ``rows`` times (the pass is as wide as its longest draft). Measured on a
        2-core CPU with SmolLM2-135M, a drafted position costs about 0.035 * rows plain batched steps, against 0.05
        for one row: by 8 rows a draft must be right far more often to pay. Those figures are the priors.
        """
        if rows <= 1:
            return self.cost
        with self._batch_lock:
            if rows not in self._batch_costs:
                self._batch_costs[rows] = PassCost(prior_jump=0.05 * rows, prior_slope=0.035 * rows)
            return self._batch_costs[rows]

    def start(self, prompt: Sequence[int], eos_ids: Iterable[int] = ()) -> DraftSession:
        """Begin drafting for one request whose context is ``prompt`` (token ids)."""
        return DraftSession(self, np.asarray(prompt, dtype=np.int32), frozenset(int(t) for t in eos_ids))


def _as_tokens(ref: TokenSource, tokenizer) -> np.ndarray:
    if isinstance(ref, str):
        if tokenizer is None:
            raise ValueError("reference texts given as strings need LookupDrafter(tokenizer=...)")
        return np.asarray(tokenizer.encode(ref, add_special_tokens=False), dtype=np.int32)
    return np.asarray(ref, dtype=np.int32)


class DraftSession:
    """Drafting state of one request: its index, its alignment cursor, and the draft awaiting verification."""

    def __init__(self, drafter: LookupDrafter, prompt: np.ndarray, eos_ids: frozenset):
        cfg = drafter.drafter_config
        self._drafter = drafter
        self._eos = np.array(sorted(eos_ids), dtype=np.int32)
        parts = []
        for ref in drafter.references:
            parts += [ref, np.array([SEPARATOR], dtype=np.int32)]
        self._output_start = sum(len(p) for p in parts) + len(prompt)  # t of the first generated token
        buffer = np.concatenate(parts + [prompt]) if parts else prompt
        self.index = NgramIndex(cfg.min_n, cfg.max_n, capacity=max(len(buffer) + 1024, 1024))
        self.index.extend(buffer)
        self._cursor = -1  # t in the buffer expected to hold the next token, or -1 when not aligned
        self._pending: tuple = (None, -1, EMPTY)  # (bucket, src, draft) of the proposal awaiting commit
        self._offered: tuple = (None, -1, EMPTY)  # (bucket, src, candidate) of the last offer
        self._finished = False

    def propose(self, limit: int, *, must_draft: bool = False) -> np.ndarray:
        """Up to ``limit`` draft tokens (int32, possibly empty) to verify next. ``must_draft``: the caller cannot
        verify an empty draft (transformers' sampling rule), so when there is a candidate the best length of at
        least one token is drafted even where a plain step would pay better; empty still means no candidate."""
        return self.take(self.length(self.offer(limit), must_draft=must_draft))

    def length(self, offer: Offer, *, must_draft: bool = False) -> int:
        """How many tokens of ``offer`` :meth:`propose` drafts: all of them without the adaptive length, else the
        length with the most expected tokens per unit of cost (0 where the guard finds none that pays)."""
        cfg = self._drafter.drafter_config
        if not cfg.adaptive or offer.tokens.size == 0:
            return offer.tokens.size
        costs = self._drafter.cost.costs(offer.tokens.size)
        return best_draft_length(offer.first, offer.then, costs, margin=cfg.margin(must_draft))

    def offer(self, limit: int) -> Offer:
        """The longest draft on offer (up to ``limit`` tokens) with its odds, for a caller that chooses the length
        itself (a batch, where one length serves every row); then call :meth:`take`."""
        limit = min(limit, self._drafter.drafter_config.max_draft)
        self._offered = (None, -1, EMPTY)
        self._pending = (None, -1, EMPTY)
        if limit <= 0:
            return Offer(EMPTY, 0.0, 0.0)
        bucket, src, candidate = self._candidate(limit)
        if bucket is None:
            return Offer(EMPTY, 0.0, 0.0)
        candidate = self._clip(candidate)
        self._offered = (bucket, src, candidate)
        return Offer(candidate, *self._drafter.acceptance.estimate(bucket))

    def take(self, length: int) -> np.ndarray:
        """Draft the first ``length`` tokens of the last :meth:`offer`; 0 skips this draft."""
        bucket, src, candidate = self._offered
        draft = candidate[:max(length, 0)]
        if bucket is not None and draft.size == 0:
            self._drafter.acceptance.skipped(bucket)
        self._pending = (bucket, src, draft)
        return draft

    def _candidate(self, limit: int) -> tuple:
        index = self.index
        if self._cursor >= 0:
            shared = index.match_length(self._cursor, 32)
            return _bucket("cursor", shared), self._cursor, self._copy(self._cursor, limit)
        n, src = index.match()
        shared = index.match_length(src, 32) if n else 0
        cache = self._drafter.cache
        if cache is not None and shared < 8:
            tokens = index.tokens
            n_cache, cached = cache.lookup(tokens[max(0, len(tokens) - cache.max_n):], limit)
            if n_cache > shared:
                return ("cache", min(n_cache, 4)), -1, cached
        if n == 0:
            return None, -1, EMPTY
        return _bucket("index", shared), src, self._copy(src, limit)

    def _copy(self, src: int, limit: int) -> np.ndarray:
        """Up to ``limit`` tokens copied from ``src``. A copy that runs into the present (the source is the text
        just written: the model is repeating itself with period ``len - src``) goes on repeating that period, as
        an LZ77 copy overlapping its own output does; otherwise a draft in a loop could never be longer than
        the loop."""
        copied = self.index.continuation(src, limit)
        if 0 < copied.size < limit and src + copied.size == len(self.index):
            copied = np.resize(copied, limit)
        return copied

    def _clip(self, candidate: np.ndarray) -> np.ndarray:
        """A draft never crosses a reference separator, and never runs past an EOS token."""
        stop = np.flatnonzero(candidate < 0)
        if stop.size:
            candidate = candidate[: stop[0]]
        if self._eos.size:
            hit = np.flatnonzero(np.isin(candidate, self._eos))
            if hit.size:
                candidate = candidate[: hit[0] + 1]
        return candidate

    def fallback_token(self) -> np.ndarray:
        """One token to offer when a caller cannot verify an empty draft: the continuation of the longest match,
        else a repeat of the last token."""
        n, src = self.index.match()
        token = self.index.continuation(src, 1) if n else self.index.tokens[-1:]
        token = self._clip(np.asarray(token, dtype=np.int32))
        if token.size == 0:
            token = self.index.tokens[-1:].copy()
        self._pending = (None, -1, token)
        return token

    def commit(self, tokens: Sequence[int], accepted: int, seconds: float | None = None) -> None:
        """Record a verified step: ``tokens`` is what was appended (accepted draft tokens + the target's token),
        ``seconds`` the wall time of the step (feeds the cost fit)."""
        bucket, src, draft = self._pending
        self._pending = (None, -1, EMPTY)
        if bucket is not None:
            self._drafter.acceptance.update(bucket, accepted, len(draft))
        if seconds is not None:
            self._drafter.cost.observe(len(draft), seconds)
        new = np.asarray(tokens, dtype=np.int32)
        self.index.extend(new)
        # Follow the source the draft came from (or the cursor, if nothing was drafted) through the new tokens.
        t = src if src >= 0 else self._cursor
        if t >= 0:
            buffer = self.index.tokens
            for token in new:
                if t < len(buffer) and buffer[t] == token:
                    t += 1
                else:
                    t = -1
                    break
        self._cursor = t if 0 <= t < len(self.index) and self._drafter.drafter_config.cursor else -1

    def finish(self) -> None:
        """End the request: its output joins the rolling cache, with a little of the prompt before it so the
        first generated tokens can be matched too."""
        if self._finished:
            return
        self._finished = True
        cache = self._drafter.cache
        if cache is not None and len(self.index) > self._output_start:
            start = max(0, self._output_start - cache.max_n)
            context = self.index.tokens[start:]
            context = context[np.flatnonzero(context < 0)[-1] + 1:] if (context < 0).any() else context
            cache.add(context.copy())
