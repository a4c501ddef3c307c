"""The drafting policy: how likely a draft is to be accepted, what verifying it costs, and which length pays best.

Pure numpy, no torch: the drafter (``drafter.py``) and the research replays (``research/``) price drafts with the
same functions, and none of it needs a model.

- :class:`Acceptance` keeps running estimates, per source bucket (:func:`bucket`), of the chance that a draft's
  first token is accepted (``first``) and that each later one is, given the ones before it were (``then``).
- :class:`PassCost` says what a pass with ``d`` drafted tokens costs relative to a plain step: a measured profile
  (``lookupdec.calibrate``) or a running straight-line fit.
- :func:`best_draft_length` (one row) and :func:`best_batch_length` (one length for a batch of rows) pick the
  length with the most expected tokens per unit of time, or 0 when none beats a plain step by a margin: the
  never-slower guard. In a batch, the guard also bounds how much slower any one row runs for the others' drafts.
- :class:`PlainSteps` keeps the recent time of a plain step per number of rows, against which drafted passes are
  charged and a batch bucket's profile is priced for a smaller batch.
- :class:`Ledger` keeps, per request, what the passes it was in cost it beyond plain decoding: a draft is made only
  where, were it rejected outright, no request in the pass would end up more than ``max_slowdown`` slower than
  plain decoding (the room each :class:`Offer` carries).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

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
_RUN_WEIGHT = 8.0  # continuations' worth of evidence behind the buckets' run length, in a request's own record


def bucket(kind: str, shared: int) -> tuple:
    for edge in (16, 8, 4, 3, 2):
        if shared >= edge:
            return (kind, edge)
    return (kind, 1)


@dataclass
class RequestRecord:
    """One request's own record of how its drafts fared (:meth:`Acceptance.record`), which calibrates the shared
    estimates for that request (:meth:`Acceptance.estimate`, :meth:`Acceptance.update`). Sums are forgotten at
    ``_CALIBRATION_KEEP`` per draft."""

    firsts_accepted: float = 0.0  # drafts whose first token was accepted
    firsts_predicted: float = 0.0  # the first-token odds the buckets gave those drafts
    shared_scale: float = 1.0  # the shared calibration when the request started: two drafts' worth of evidence
    runs_accepted: float = 0.0  # continuations accepted (``j - 1`` for a draft whose first ``j >= 1`` were)
    runs_predicted: float = 0.0  # continuations the buckets' ``then`` predicted for those drafts


class Acceptance:
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
    the next match falls in. A request keeps its own such record too (``own``, from :meth:`record`, which
    :meth:`estimate` and :meth:`update` read and write): it starts from the shared scale as it stands when the
    request starts, then follows the request's own drafts only. In a batch, a request writing freely beside
    requests that copy well stops drafting after its own misses, rather than drafting on the others' record.

    The request's record also calibrates ``then``: the continuations its drafts got (``j - 1`` for each draft
    whose first token was accepted) against those the buckets' ``then`` predicted for them (``then + then^2 + ...
    + then^(d-1)`` for a draft of ``d``), both forgotten as the first-token record is. Their ratio, with
    ``_RUN_WEIGHT`` continuations of evidence for the buckets, scales the expected run ``then / (1 - then)``. So
    a request whose copies break after a token or two (an answer quoting its context in short pieces, in a new
    order) drafts short from whichever bucket the next match falls in, where each bucket's own count would take
    many drafts to learn it (docs/design.md, "Each request's own record").
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

    def estimate(self, bucket, own: RequestRecord | None = None) -> tuple:
        """``(first, then)`` for drafts from ``bucket``, calibrated by the request's own record ``own`` when given."""
        first, then = self._raw(bucket)
        if own is not None:
            run = then / (1.0 - then) * (own.runs_accepted + _RUN_WEIGHT) / (own.runs_predicted + _RUN_WEIGHT)
            then = run / (1.0 + run)  # from the expected continuations, ``run``
        return min(first * self._scale(own), 0.999), then

    def record(self) -> RequestRecord:
        """A new request's own calibration record, starting from the shared scale as it stands now."""
        return RequestRecord(shared_scale=self._scale(None))

    def _scale(self, own: RequestRecord | None) -> float:
        if own is not None:
            return (own.firsts_accepted + 2.0 * own.shared_scale) / (own.firsts_predicted + 2.0)
        seen, predicted = self._calibration
        return (seen + 2.0) / (predicted + 2.0)

    def update(self, bucket, accepted: int, drafted: int, own: RequestRecord | None = None) -> None:
        if drafted == 0:
            return
        with self._lock:
            seen, predicted = self._calibration
            hit, expected = float(bool(accepted)), self._raw(bucket)[0]
            self._calibration = [seen * _CALIBRATION_KEEP + hit, predicted * _CALIBRATION_KEEP + expected]
            if own is not None:
                own.firsts_accepted = own.firsts_accepted * _CALIBRATION_KEEP + hit
                own.firsts_predicted = own.firsts_predicted * _CALIBRATION_KEEP + expected
                if accepted:  # continuations are counted given the first token: a miss says nothing of them
                    then = self._raw(bucket)[1]
                    own.runs_accepted = own.runs_accepted * _CALIBRATION_KEEP + (accepted - 1)
                    own.runs_predicted = own.runs_predicted * _CALIBRATION_KEEP \
                        + float(np.sum(then ** np.arange(1, drafted)))
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
    every draft length, as measured on this model, device, dtype and thread count. The curve need not be straight
    or even rise (a CPU's math library may run products of 2 or 3 rows as that many matrix-vector products, and
    one of 4 rows as a cheaper matrix-matrix product), and on a GPU it is nearly flat for short drafts.

    Without one (``DrafterConfig(calibrate=False)``, or a measurement that failed), a straight line: ``time(0) =
    t0`` and ``time(d) = t1 + slope * d`` for ``d >= 1``, fitted by exponentially forgotten least squares on the
    steps actually run (:meth:`relative`). Until enough steps of a kind have been seen, a cautious prior stands in:
    any draft costs 1.6 plain steps, plus 5% of a step per drafted token. It is a prior, not a fact about any
    machine: it makes an unmeasured drafter draft only copies that are likely to be right, and the fit takes over
    after a few passes.
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
        self._refinement: Refinement | None = None  # what the passes taught about the profile, when refined
        self._lock = threading.Lock()

    def observe(self, draft_len: int, seconds: float) -> None:
        d, t = float(draft_len), float(seconds)
        if not (np.isfinite(t) and t > 0):
            return
        with self._lock:
            if draft_len == 0:
                self._plain *= self._KEEP
                self._plain += (1.0, t)
            else:
                self._draft *= self._KEEP
                self._draft += (1.0, d, t, d * d, d * t)
        profile, refinement = self._profile, self._refinement
        if refinement is not None and profile is not None:
            refinement.observe(draft_len, t, _extended(profile, draft_len)[draft_len])

    @property
    def learns(self) -> bool:
        """Whether the passes' timings correct this cost: the online fit, or a profile with a refinement (not one
        set by hand)."""
        return self._profile is None or self._refinement is not None

    def costs(self, available: int, *, refined: bool = True) -> np.ndarray:
        """Relative time of a pass with ``d`` drafted tokens, ``d = 0 .. available`` (``costs[0] == 1``): the
        measured profile when one is set (:meth:`use_profile`), corrected by what the passes run taught when it
        came from a calibration (:class:`Refinement`) unless ``refined`` is false; else the straight-line fit of
        :meth:`relative`."""
        profile, refinement = self._profile, self._refinement
        if profile is None:
            return linear_costs(*self.relative(), available)
        costs = _extended(profile, available)[: available + 1].copy()
        if refinement is not None and refined:
            costs *= refinement.factors(available)
        return costs

    def probe(self, chosen: int, costs: np.ndarray, room: float = float("inf"), runs=None) -> int:
        """The draft length to run instead of the policy's pick (:meth:`Refinement.probe`); ``chosen`` unless the
        profile is refined."""
        refinement = self._refinement
        if refinement is None or self._profile is None:
            return chosen
        return refinement.probe(chosen, costs, room, runs)

    def use_profile(self, profile, source=None, *, refine=None) -> None:
        """Price drafts with ``profile[d]``, the measured time of a pass with ``d`` drafted tokens relative to a
        plain step; ``None`` goes back to the online straight-line fit. Beyond the profile's last length the cost
        grows by the slope of its last quarter. ``source`` is the model ``lookupdec.calibrate`` measured it on
        (``None``: set by hand, and then ``lookupdec.generate`` leaves it alone). ``refine``: a
        :class:`Refinement` to correct the profile with (``lookupdec.calibrate`` passes the one every drafter of
        that model and setting shares), ``True`` for one of its own, ``False`` for none; by default one of its
        own when ``source`` is given. A refined profile measured while the machine was busy, or saved on a machine
        whose load has since changed, heals within a few dozen passes."""
        if profile is None:
            self._profile, self._source, self._refinement = None, None, None
            return
        profile = np.asarray(profile, dtype=np.float64)
        if profile.ndim != 1 or profile.size < 2 or not np.all(np.isfinite(profile)) or profile.min() <= 0:
            raise ValueError(f"a pass-cost profile is a 1-D array of >= 2 positive costs, got {profile!r}")
        if refine is None:
            refine = source is not None
        self._profile = profile / profile[0]
        self._source = weakref.ref(source) if source is not None else None
        self._refinement = refine if isinstance(refine, Refinement) else Refinement() if refine else None

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


class PlainSteps:
    """The time of a plain step lately, per exact number of rows (forgotten at :attr:`PassCost._KEEP` per step of
    that size): what a drafted pass is charged against (:meth:`Ledger.timed`), and how a batch bucket's profile,
    measured against plain steps of the bucket's size, is priced for a batch that has fewer rows
    (:meth:`bucket_factor`). A bucket's plain steps are no measure of a smaller batch's: on a CPU a plain step of 3
    rows can take three quarters of one of 4, while their drafted passes cost nearly alike. Thread-safe."""

    def __init__(self):
        self._steps: dict = {}  # rows -> [weight, sum of seconds]
        self._lock = threading.Lock()

    def observe(self, rows: int, seconds: float) -> None:
        if not (np.isfinite(seconds) and seconds > 0):
            return
        with self._lock:
            entry = self._steps.setdefault(rows, [0.0, 0.0])
            entry[0] = entry[0] * PassCost._KEEP + 1.0
            entry[1] = entry[1] * PassCost._KEEP + seconds

    def seconds(self, rows: int) -> float | None:
        """The time of a plain step of ``rows`` rows lately, or ``None`` before one was timed."""
        with self._lock:
            weight, total = self._steps.get(rows, (0.0, 0.0))
        return total / weight if weight >= 1.0 else None

    def bucket_factor(self, rows: int, bucket: int) -> float:
        """By how much to raise a drafted pass's price from the profile of ``bucket`` rows (relative to a plain
        step of ``bucket`` rows) for a batch of ``rows``: the ratio of their plain steps, at least 1, and 1 until
        both were timed. So a drafted pass of fewer rows is priced as the bucket's would take: measured on a
        CPU, 3 rows' drafted passes took 0.85-1.0 of 4 rows', so this prices them a little dear rather than a fifth
        too cheap."""
        if rows == bucket:
            return 1.0
        mine, theirs = self.seconds(rows), self.seconds(bucket)
        if mine is None or theirs is None:
            return 1.0
        return max(theirs / mine, 1.0)


class Refinement:
    """What the passes run taught about a measured pass-cost profile (:meth:`PassCost.use_profile`): per band of
    draft lengths (1, 2, 3, 4-7, 8-15, ...), the mean of ``seconds / profile[d]`` over the band's passes, and the
    mean time of a plain step, both forgotten at :attr:`KEEP` per pass of their kind. ``lookupdec.calibrate`` keeps
    one per model and setting, shared by every drafter calibrated to it, so what one request taught the next one
    knows (``lookupdec.generate`` without a drafter makes a new drafter each call). Thread-safe."""

    KEEP = 0.9  # forgetting per pass of a kind: a few dozen passes, so a wrong profile heals fast
    DEAD_BAND = 1.25  # a band's factor within [1 / this, this] is taken as 1 (see factors)
    CLIP = 8.0  # factors stay within [1 / this, this]

    def __init__(self):
        self._near = np.zeros((2, _band(1 << 16) + 1))  # per band: weight, sum of seconds / profile[d]
        self._base = np.zeros(2)  # weight, sum of plain-step seconds
        self._probing: set = set()  # bands a probe was handed out for, until its pass is observed
        self._lock = threading.Lock()

    def observe(self, draft_len: int, seconds: float, priced: float) -> None:
        """A pass with ``draft_len`` drafted tokens took ``seconds``; the profile prices it at ``priced`` plain
        steps."""
        with self._lock:
            if draft_len == 0:
                self._base *= self.KEEP
                self._base += (1.0, seconds)
            else:
                band = _band(draft_len)
                self._probing.discard(band)
                self._near[:, band] *= self.KEEP
                self._near[:, band] += (1.0, seconds / priced)

    def factors(self, available: int) -> np.ndarray:
        """Per draft length ``0 .. available``, the factor on the profile's price: a band's mean ``seconds /
        profile[d]`` against the mean plain step. A band not yet observed takes the factor of the nearest one
        that was (a profile measured on a loaded machine is off by a similar factor at every length); all ones
        until a plain step and a drafted pass have been seen. Within :attr:`DEAD_BAND` of 1 the measurement
        stands: a profile measured on a busy machine is off by a large factor, while the passes' own noise
        (contexts longer than the profile's, load that comes and goes) would otherwise move drafts priced right."""
        factors = np.ones(available + 1)
        with self._lock:
            base_w, base_t = self._base
            weights, sums = self._near.copy()
        seen = np.flatnonzero(weights >= 1.0)
        if base_w < 1.0 or seen.size == 0 or available < 1:
            return factors
        found = np.clip(sums[seen] / weights[seen] / (base_t / base_w), 1 / self.CLIP, self.CLIP)
        found[(found > 1 / self.DEAD_BAND) & (found < self.DEAD_BAND)] = 1.0
        bands = np.array([_band(d) for d in range(1, available + 1)])
        factors[1:] = found[np.abs(bands[:, None] - seen[None, :]).argmin(axis=1)]
        return factors

    def probe(self, chosen: int, costs: np.ndarray, room: float = float("inf"), runs=None) -> int:
        """The draft length to run instead of ``chosen`` (the policy's pick; ``costs[d]``: the price of ``d``
        drafted tokens, as far as the candidates on offer reach; ``room``: the tightest room of the pass's rows,
        :class:`Ledger`; ``runs[d]``: the drafted width a draft of ``d`` tokens is run and observed as, ``d``
        itself by default, wider where passes are padded) so that the profile gets the passes it is corrected
        from (a profile priced too dear would otherwise never draft, and so never be contradicted:
        docs/design.md, "Calibration"). Where the policy says no draft pays and a plain step has been timed: the
        longest length whose band was never run and whose price the room affords, else one token if its band was
        never run (the cheapest drafted pass, whose correction carries to every band not yet run:
        :meth:`factors`). A band is handed out once, to one caller, until its pass is observed, so at most one
        pass per band, whichever drafters share this refinement (a handed-out pass never observed is not asked
        for again); ``chosen`` otherwise."""
        longest = len(costs) - 1
        if chosen or longest < 1:
            return chosen
        runs = range(longest + 1) if runs is None else runs
        with self._lock:
            if self._base[0] < 1.0:
                return chosen
            weights, taken = self._near[0], self._probing
            unrun = [d for d in range(longest, 0, -1) if weights[_band(runs[d])] < 1.0 and _band(runs[d]) not in taken]
            pick = next((d for d in unrun if costs[d] - 1.0 <= room), 1 if unrun and unrun[-1] == 1 else chosen)
            if pick:
                taken.add(_band(runs[pick]))
            return pick


def _extended(profile: np.ndarray, available: int) -> np.ndarray:
    """A profile to length ``available`` at least: past its measured lengths, the slope of its last quarter
    (where it is straight)."""
    if available < profile.size:
        return profile
    last = profile.size - 1
    ref = max(1, last - max(1, last // 4))
    slope = max((profile[last] - profile[ref]) / (last - ref), 0.0) if last > ref else 0.0
    return np.concatenate([profile, profile[last] + slope * np.arange(1, available - last + 1)])


def _band(d: int) -> int:
    """The band of draft length ``d >= 1`` a profile's correction is kept for: 1, 2, 3, then 4-7, 8-15, 16-31, ...
    (lengths whose passes cost alike)."""
    return d - 1 if d < 4 else int(d).bit_length()


def linear_costs(jump: float, slope: float, available: int) -> np.ndarray:
    """Relative pass times ``1`` for ``d == 0`` and ``1 + jump + slope * d`` for ``d = 1 .. available``."""
    costs = 1.0 + jump + slope * np.arange(available + 1, dtype=np.float64)
    costs[0] = 1.0
    return costs


def cost_curve(costs) -> np.ndarray:
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 1 or costs.size < 1:
        raise ValueError(f"costs must list the relative pass cost of draft lengths 0, 1, ..., got {costs!r}")
    return costs


def padded_width(span: int, widths: Sequence[int]) -> int:
    """The width of a pass of ``span`` tokens whose caller pads passes to ``widths`` (ascending): the first that
    holds ``span``, or ``span`` itself beyond the largest."""
    for width in widths:
        if width >= span:
            return width
    return span


def padded_costs(costs: np.ndarray, widths: Sequence[int]) -> np.ndarray:
    """``costs`` [d = 0 .. top] priced as padded passes: a draft of ``d`` tokens costs the pass of
    ``padded_width(d + 1) - 1`` drafted positions, so lengths that share a width cost the same, and the policy,
    which prefers more expected tokens at equal cost, fills the width. ``costs`` must reach the padded width of
    its own last length; the result stops at the longest length that fits in it."""
    lengths = [d for d in range(costs.size) if padded_width(d + 1, widths) - 1 < costs.size]
    return costs[[padded_width(d + 1, widths) - 1 for d in lengths]]


def best_draft_length(first: float, then: float, costs: Sequence[float], *, margin: float = 0.02,
                      room: float = float("inf")) -> int:
    """The draft length with the most expected tokens per unit of time, or 0 if none beats a plain step by
    ``margin``. ``costs[d]`` is the relative time of a pass with ``d`` drafted tokens (``costs[0] == 1``; its
    length bounds the draft). Expected tokens for ``d`` drafted: ``1 + first * (1 + then + ... + then^(d-1))``
    (the 1 is the target's own token). Measured costs need not grow with ``d`` (on this project's CPU a pass of 3
    drafted tokens is cheaper than one of 2), so every length is weighed."""
    costs = cost_curve(costs)
    gains = draft_gains(first, then, costs)[1:]
    gains[costs[1:] - 1.0 > room] = -np.inf  # a length whose pass, rejected outright, would overdraw the room
    if gains.size < 1:
        return 0
    best = int(np.argmax(gains))  # the shortest of equal bests
    return best + 1 if gains[best] > 1.0 + margin else 0


def draft_gains(first: float, then: float, costs: Sequence[float]) -> np.ndarray:
    """``gains[d]``, tokens per unit of time with ``d`` drafted tokens relative to a plain step, for ``d = 0 ..
    len(costs) - 1``: expected tokens ``1 + first * (1 + then + ... + then^(d-1))`` over ``costs[d]``. What
    :func:`best_draft_length` maximizes."""
    costs = cost_curve(costs)
    tokens = 1.0 + first * np.concatenate([[0.0], np.cumsum(then ** np.arange(costs.size - 1, dtype=np.float64))])
    return tokens / costs


# Tokens' worth of allowance a request starts with under a slowdown bound (Ledger): room for a first probe before
# the request has produced anything to earn it, at most max_slowdown * START_TOKENS plain steps of loss in all.
START_TOKENS = 4


@dataclass
class Ledger:
    """One request's account against plain decoding, in plain steps: each pass it is in costs it ``price`` (the
    pass's time relative to a plain step of the same rows, priced by the cost model) and produces its accepted
    tokens plus one, where a plain step produces one. ``excess`` sums ``price - produced``: the time the request has
    lost to drafts so far (negative: saved).

    The bound, in one sentence: a pass is drafted only if, were every drafted token rejected, the request's excess
    would stay within ``max_slowdown`` times the tokens it has produced, plus :data:`START_TOKENS`. So a request
    never runs more than ``max_slowdown`` slower than plain decoding, plus ``max_slowdown * START_TOKENS`` steps,
    whatever drafts it or the rows beside it make (as far as the cost model prices passes right); drafts that paid
    refill the room. ``max_slowdown=None``: no bound."""

    max_slowdown: float | None = None
    excess: float = 0.0
    produced: int = 0
    price: float = 1.0  # of the pass now being run, until settled
    # Drafted passes not yet timed against a plain step of their size: rows -> [seconds, price, passes], summed,
    # so that it stays one entry per batch size however long the request runs.
    untimed: dict = field(default_factory=dict)

    def room(self) -> float:
        """How much longer than a plain step the next pass may take for this request (``inf``: unbounded)."""
        if self.max_slowdown is None:
            return float("inf")
        return max(self.max_slowdown * (self.produced + 1 + START_TOKENS) - self.excess, 0.0)

    def charge(self, price: float) -> None:
        """The pass now being run costs ``price`` plain steps."""
        self.price = float(price)

    def timed(self, seconds: float | None, rows: int, plain: PlainSteps) -> None:
        """The pass now being run, over ``rows`` rows, took ``seconds`` (``None``: a plain step); ``plain`` knows
        what plain steps of each size take lately. Where that is known, a drafted pass is charged what it took,
        never less than a plain step, in place of its price; those run before a plain step of their size was timed
        keep their price until one is, and are then charged the difference (all of them at once, never less than
        one plain step a pass in all)."""
        step = plain.seconds(rows)
        if seconds is not None:
            if step is None:
                entry = self.untimed.setdefault(rows, [0.0, 0.0, 0])
                entry[0] += seconds
                entry[1] += self.price
                entry[2] += 1
            else:
                self.price = max(seconds / step, 1.0)
        for size, step in [(size, plain.seconds(size)) for size in self.untimed]:
            if step is not None:
                took, price, passes = self.untimed.pop(size)
                self.excess += max(took / step, passes) - price

    def settle(self, produced: int) -> None:
        """The pass produced ``produced`` tokens for this request."""
        self.excess += self.price - produced
        self.produced += produced
        self.price = 1.0


@dataclass(frozen=True)
class Offer:
    """What a session could draft next: the longest candidate and the odds of its tokens being accepted."""

    tokens: np.ndarray  # int32, possibly empty
    first: float  # chance the first token is accepted
    then: float  # chance each later token is, given the ones before it were
    room: float = float("inf")  # how much longer than a plain step the pass may take for this request (Ledger)


def room_of(offers: Sequence[Offer]) -> float:
    """The tightest room among the rows of a pass: every row pays for the pass."""
    return min((offer.room for offer in offers), default=float("inf"))


def best_batch_length(offers: Sequence[Offer], costs: Sequence[float], *, margin: float = 0.02,
                      slowdown: float = float("inf")) -> int:
    """One draft length for a batch: each row drafts up to it (a batch pass is as wide as its longest draft, so
    shorter drafts would save nothing), and a pass with ``d`` drafted positions costs ``costs[d]`` batched plain
    steps (``costs[0] == 1``). Returns the length with the most expected tokens per unit of time, or 0 if none
    beats a plain step by ``margin``.

    ``slowdown`` bounds what one row pays for the others' drafts: a length is taken only if every row's expected
    time per token, ``costs[d]`` over its expected tokens, stays within ``1 + slowdown`` plain steps. Without the
    bound, a row with nothing to copy (open-ended text beside edits) would run as slowly as the widest pass where
    verifying costs grow with the width (CPUs), though the batch as a whole gains. Each offer's ``room``
    (:class:`Ledger`) bounds the pass's cost outright: a length is taken only if its pass, rejected in every row,
    would overdraw no row's room."""
    rows = len(offers)
    room = room_of(offers)
    costs = cost_curve(costs)
    longest = min(max((o.tokens.size for o in offers), default=0), costs.size - 1)
    best_d, best_gain = 0, 1.0 + margin
    expected = np.ones(rows)  # per row: the target's own token, then each drafted token's chance of acceptance
    reach = np.array([o.first for o in offers], dtype=np.float64)  # chance the row's draft is accepted up to d
    then = np.array([o.then for o in offers], dtype=np.float64)
    sizes = np.array([o.tokens.size for o in offers])
    for d in range(1, longest + 1):
        drafting = sizes >= d
        expected[drafting] += reach[drafting]
        reach[drafting] *= then[drafting]
        if costs[d] > (1.0 + slowdown) * expected.min() or costs[d] - 1.0 > room:
            continue
        gain = expected.sum() / (rows * costs[d])
        if gain > best_gain:
            best_d, best_gain = d, gain
    return best_d


class TokenCost:
    """A pass's wall time against the tokens it schedules, for engines that pay per token rather than per padded
    batch width (vLLM flattens a batch into one sequence of tokens): ``time = base + per_token * tokens``.

    Fitted by exponentially forgotten least squares on the passes actually run (:meth:`observe`); a pass's tokens
    are its rows' last tokens, their drafts and any prefill chunk scheduled beside them. Until the passes have
    spread over enough different token counts to fit a slope, a prior stands in for it: a token costs
    :attr:`PRIOR_SHARE` of the fixed part (on this project's CPU vLLM runs SmolLM2-135M at about 65 ms for one
    token and 95 ms for four, a share of 0.18; an accelerator's is far lower, and the fit finds it within a few
    dozen passes of a copy-heavy request). Only the ratio of the two parts prices a draft.

    The slope used is the least-squares one (at least zero) plus :attr:`_CAUTION` of its standard errors: a slope
    fitted on steps of nearly the same size is mostly noise, and one fitted at or near zero prices drafts as free,
    so that every row drafts its longest, each step costs several plain ones, and the rows that draft nothing pay
    for it (seen on vLLM's CPU build: steps of ~100 tokens taking 6 plain steps, priced at 1)."""

    PRIOR_SHARE = 0.1
    _KEEP = 0.98  # forgetting per observation: a few hundred passes, so the fit follows the machine's load
    _MIN_SPREAD = 4.0  # variance of the token counts seen before the slope is fitted rather than assumed
    _CAUTION = 2.0  # standard errors added to the fitted slope

    def __init__(self, prior_share: float = PRIOR_SHARE):
        self.prior_share = prior_share
        self._sums = np.zeros(6)  # weight, sum n, sum t, sum n*n, sum n*t, sum t*t
        self._lock = threading.Lock()

    def observe(self, tokens: int, seconds: float) -> None:
        n, t = float(tokens), float(seconds)
        if not (n >= 1 and np.isfinite(t) and t > 0):
            return
        with self._lock:
            self._sums *= self._KEEP
            self._sums += (1.0, n, t, n * n, n * t, t * t)

    @property
    def weight(self) -> float:
        """How many passes the fit stands on (forgotten ones count less)."""
        return float(self._sums[0])

    def line(self) -> tuple:
        """``(base, per_token)`` in seconds; ``(1.0, prior_share)`` before any pass was seen (only their ratio
        prices drafts)."""
        with self._lock:
            w, sn, st, snn, snt, stt = self._sums
        if w < 2:
            return 1.0, self.prior_share
        mean_n, mean_t = sn / w, st / w
        var = snn / w - mean_n ** 2
        if var >= self._MIN_SPREAD and w >= 4:
            slope = (snt / w - mean_n * mean_t) / var
            scatter = max(stt / w - mean_t ** 2 - slope * slope * var, 0.0)  # residual variance about the line
            slope = max(slope, 0.0)
            base = mean_t - slope * mean_n
            if base > 0:
                return base, slope + self._CAUTION * float(np.sqrt(scatter / (w * var)))
        base = mean_t / (1.0 + self.prior_share * mean_n)  # the slope assumed, the level measured
        return base, self.prior_share * base


def token_lengths(offers: Sequence[Offer], base: float, per_token: float, *, others: int = 0,
                  margin: float = 0.02, slowdown: float = float("inf")) -> list:
    """Per-row draft lengths for a pass that costs ``base + per_token * tokens`` (:class:`TokenCost`), where
    each row schedules its last token plus its draft, and ``others`` more tokens (prefill) ride along: the
    lengths with the most expected tokens per second, or all zeros if drafting beats a plain pass by no more
    than ``margin``.

    Rows are priced apart, unlike :func:`best_batch_length`'s one padded width: a drafted token costs
    ``per_token`` whichever row it is in, and the ``d``-th token of a row is worth its chance of being accepted
    (``first * then ** (d - 1)``). Those chances fall along each row, so taking drafted tokens in falling order of
    worth, while the next one's worth exceeds the running tokens-per-second times its cost, gives the best set
    (each row's share a prefix of its offer). ``slowdown`` bounds what a row without drafts pays for the others':
    the pass may take at most ``1 + slowdown`` times a plain one, and at most ``1 + room`` for the tightest of the
    offers' rooms (:class:`Ledger`)."""
    slowdown = min(slowdown, room_of(offers))
    rows = len(offers)
    lengths = [0] * rows
    if rows == 0 or per_token <= 0 and base <= 0:
        return lengths
    plain_time = base + per_token * (rows + others)
    worth, owner = [], []
    for row, offer in enumerate(offers):
        reach = offer.first
        for _ in range(offer.tokens.size):
            worth.append(reach)
            owner.append(row)
            reach *= offer.then
    if not worth:
        return lengths
    order = np.argsort(-np.asarray(worth), kind="stable")  # stable: a row's tokens stay in their order
    cap = slowdown * plain_time / per_token if per_token > 0 else float("inf")
    expected, time, best = float(rows), plain_time, (float(rows) / plain_time, 0)
    for k, item in enumerate(order, start=1):
        if k > cap:
            break
        expected += worth[item]
        time += per_token
        if expected / time > best[0]:
            best = (expected / time, k)
        elif worth[item] * time < per_token * expected:  # worth falls from here: no longer prefix pays more
            break
    if best[0] <= (1.0 + margin) * rows / plain_time:
        return lengths
    for item in order[: best[1]]:
        lengths[owner[item]] += 1
    return lengths
