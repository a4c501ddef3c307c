"""The drafter: proposes draft tokens by copying, and decides how many are worth verifying.

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
get slower). A bucket that stopped drafting slowly forgets its bad record, so copying is probed again later.

Each mechanism can be switched off in ``DrafterConfig`` (``cursor``, ``guard``, ``adaptive``, ``calibrate``,
``use_cache``) to measure what it is worth (``research/simulate.py --ablate``).

None of this can change what the target outputs: it only decides which tokens the target is asked to check.

The propose/commit driver. Every caller drafts the same way: :meth:`Drafter.propose` takes the sessions of the
rows in one target pass and returns their drafts (one length for all rows: a pass is as wide as its longest
draft), and :meth:`DraftSession.commit` records what each row appended after verification. The decoding loop
(one row or many), the ``assistant_model`` route and the research replays all go through these two calls.

This module imports no torch and no transformers: ``assistant.py`` adds the surface transformers reads from an
assistant model (``lookupdec.LookupDrafter``), and the loops (``loop.py``, ``batch.py``) join drafts to
verification (``verify.py``).
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, Union

import numpy as np

from .cache import CacheConfig, ClientCaches, RollingCache
from .index import NgramIndex
from .policy import (
    Acceptance,
    Ledger,
    Offer,
    PassCost,
    PlainSteps,
    best_batch_length,
    best_draft_length,
    bucket,
    padded_costs,
    padded_width,
    room_of,
)

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
    # In a batch, the guard also bounds what one pass may cost a row in expectation: a draft length is taken only
    # if no row's expected time per token exceeds a plain batched step by more than this fraction. Where verifying
    # gets dearer with the width (CPUs), a request with nothing to copy would otherwise run at the pace of the
    # widest draft beside it, and such rows set when a batch ends (docs/design.md).
    batch_slowdown: float = 0.2
    # Never slower, per request: a pass is drafted only if, were every drafted token rejected, no request in it
    # would have lost more than this fraction of its plain decoding time (plus policy.START_TOKENS tokens' worth)
    # to drafts, its own or, in a batch, the other rows' (policy.Ledger). Drafts that paid refill the room, so
    # copy-heavy text keeps its speed. None: no such bound (throughput first).
    max_slowdown: float | None = 0.05
    # Price drafts with the target's measured pass cost at every draft length (lookupdec.calibrate: measured once
    # per model, device and thread count, then cached on disk) instead of a straight-line fit. False keeps the
    # online straight-line fit, for ablations and for callers that must not spend the few seconds it takes.
    calibrate: bool = True

    def margin(self, must_draft: bool = False) -> float:
        """By how much a draft's expected gain must beat a plain step for the adaptive length to draft: the
        never-slower guard's 2%, or below every gain (the best length >= 1 always wins) without the guard or for
        a caller that must draft."""
        return 0.02 if self.guard and not must_draft else -1.0

    def slowdown(self, must_draft: bool = False) -> float:
        """How much slower per token the guard lets one row of a batch run for the others' drafts."""
        return self.batch_slowdown if self.guard and not must_draft else float("inf")

    def __post_init__(self):
        for name in ("use_cache", "adaptive", "cursor", "guard", "calibrate"):
            value = getattr(self, name)
            if type(value) is not bool:  # 0, 1, None or "no" are mistakes; bool cannot be subclassed
                raise ValueError(f"{name} must be True or False, got {value!r}")
        for name in ("max_draft", "min_n", "max_n", "cache_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # 16.0 or True are mistakes
                raise TypeError(f"{name} must be an int, got {value!r}")
        if not 1 <= self.max_draft <= 256:
            raise ValueError(f"max_draft must be in [1, 256], got {self.max_draft}")
        if not 1 <= self.min_n <= self.max_n <= 16:
            raise ValueError(f"need 1 <= min_n <= max_n <= 16, got min_n={self.min_n}, max_n={self.max_n}")
        if self.cache_tokens < 1:
            raise ValueError(f"cache_tokens must be >= 1, got {self.cache_tokens}")
        if isinstance(self.batch_slowdown, bool) or not isinstance(self.batch_slowdown, (int, float)) \
                or not self.batch_slowdown >= 0:
            raise ValueError(f"batch_slowdown must be a number >= 0, got {self.batch_slowdown!r}")
        value = self.max_slowdown
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 <= value < float("inf")):
            raise ValueError(f"max_slowdown must be a number >= 0 or None, got {value!r}")



def cache_config(config: DrafterConfig) -> CacheConfig:
    """The rolling cache for a drafter with ``config``: ``cache_tokens`` tokens, matching its n-gram sizes from
    bigrams on (unigram hits across unrelated requests are noise)."""
    return CacheConfig(max_tokens=config.cache_tokens, min_n=max(2, config.min_n), max_n=max(2, config.max_n))


def new_cache(config: DrafterConfig) -> RollingCache:
    """An empty rolling cache sized for a drafter with ``config`` (:func:`cache_config`)."""
    cfg = cache_config(config)
    return RollingCache(max_tokens=cfg.max_tokens, min_n=cfg.min_n, max_n=cfg.max_n)


TokenSource = Union[str, Sequence[int], np.ndarray]


class Session(Protocol):
    """What the loops need from one request's drafting state (:class:`DraftSession`, or a stand-in such as a
    benchmark's oracle). :meth:`Drafter.propose` calls ``offer`` then ``take``; the loops call ``commit`` after
    each verified pass and ``finish`` once (``generated``: how many output tokens the client received, when
    fewer than were committed)."""

    def offer(self, limit: int) -> Offer: ...

    def take(self, length: int) -> np.ndarray: ...

    def commit(self, tokens: Sequence[int], seconds: float | None = None) -> None: ...

    def finish(self, generated: int | None = None) -> None: ...


class Drafter:
    """Draft-free speculation: proposes continuations copied from the prompt, the output so far, reference texts
    and earlier outputs, and decides how many tokens are worth verifying.

    One drafter may serve many requests and threads at once in :func:`lookupdec.generate`: each request drafts in
    its own :class:`DraftSession` (:meth:`start`), while the acceptance estimates, the pass-cost model and the
    rolling cache are shared. :class:`lookupdec.LookupDrafter` is this class plus the surface transformers reads
    from an ``assistant_model``.

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
        if config is not None and not isinstance(config, DrafterConfig):
            raise TypeError(f"config must be a DrafterConfig, got {type(config).__name__}")
        self.drafter_config = config if config is not None else DrafterConfig(**fields)
        cfg = self.drafter_config
        if cache is not None and not cfg.use_cache:
            raise ValueError("a cache was passed with use_cache=False: drop one of them")
        if cache is None and cfg.use_cache:
            cache = new_cache(cfg)
        self.cache = cache if cfg.use_cache else None
        # Per-client caches (start(client=...)), under the same token budget as a cache the drafter makes itself.
        self.clients = ClientCaches(cache_config(cfg), cfg.cache_tokens) if cfg.use_cache else None
        self.references = [_as_tokens(ref, tokenizer) for ref in (references or [])]
        self.vocab_size = vocab_size
        self.acceptance = Acceptance()
        self.cost = PassCost()
        self.plain_steps = PlainSteps()  # what drafted passes are charged against, per exact number of rows
        self._batch_costs = {}
        self._batch_lock = threading.Lock()

    @staticmethod
    def batch_rows(rows: int) -> int:
        """The bucket a batch of ``rows`` rows is priced in: the next power of two. A batch shrinks as its rows
        finish, and a profile measured per bucket serves every size in it, its drafted passes priced up for a
        batch whose plain steps are cheaper than the bucket's (:meth:`~lookupdec.policy.PlainSteps.bucket_factor`)."""
        return 1 << max(rows - 1, 0).bit_length()

    def batch_cost(self, rows: int) -> PassCost:
        """The pass-cost model of passes over ``rows`` rows (relative to a plain step of as many rows): the
        single-row model for one row, else one per :meth:`batch_rows` bucket.

        Batching changes the price of a draft: a plain step of several rows already runs matrix-matrix products,
        and every drafted position is paid once per row (the pass is as wide as its longest draft). With
        ``calibrate`` on, ``lookupdec.generate`` measures the bucket of a batch's starting size
        (``lookupdec.calibrate(..., rows=n)``); other buckets fit a straight line online, starting from a prior
        that grows with the rows (a drafted position costing 0.035 x rows plain steps).
        """
        if rows <= 1:
            return self.cost
        rows = self.batch_rows(rows)
        with self._batch_lock:
            if rows not in self._batch_costs:
                self._batch_costs[rows] = PassCost(prior_jump=0.05 * rows, prior_slope=0.035 * rows)
            return self._batch_costs[rows]

    def start(self, prompt: Sequence[int], eos_ids: Iterable[int] = (), *, prediction: Sequence[int] | None = None,
              reproducible: bool = False, client: str | None = None, use_cache: bool = True) -> DraftSession:
        """Begin drafting for one request whose context is ``prompt`` (token ids). ``prediction``: token ids this
        request's output is expected to repeat (OpenAI's Predicted Outputs, e.g. the file being edited): a
        reference of its own, preferred over other copies of the same text, whose drafted tokens the session
        counts (:attr:`DraftSession.prediction_accepted`, :attr:`DraftSession.prediction_rejected`).
        ``reproducible``: the request samples from a seeded generator, so its draft lengths must not depend on
        timings (how many random draws a pass takes depends on its draft's length): passes with such a row price
        drafts with the measured profile as it is, neither refined nor probed (:class:`~lookupdec.policy.Refinement`).

        Which rolling cache of earlier outputs the request drafts from and feeds: ``client=None``, the drafter's
        shared :attr:`cache`; a client's name, that client's own cache in :attr:`clients` (other clients' outputs are
        never drafted from); ``use_cache=False``, none."""
        if client is not None and not isinstance(client, str):
            raise TypeError(f"client must be a string or None, got {type(client).__name__}")
        prediction = None if prediction is None else np.asarray(prediction, dtype=np.int32)
        session = DraftSession(self, np.asarray(prompt, dtype=np.int32), frozenset(int(t) for t in eos_ids),
                               prediction, client=client if use_cache else None, use_cache=use_cache)
        session.reproducible = bool(reproducible)
        return session

    # ------------------------------------------------------------------ the propose/commit driver

    def propose(self, sessions: Sequence[Session], limits: Sequence[int], *, must_draft: bool = False,
                widths: Sequence[int] | None = None) -> list[np.ndarray]:
        """The drafts (int32, possibly empty) of the rows of one target pass: row ``i`` drafts at most
        ``limits[i]`` tokens from its session. One length serves every row (:meth:`length`); a row whose
        candidate is shorter drafts all of it. ``must_draft``: the caller cannot verify an empty draft
        (transformers' sampling rule), so when there is a candidate the best length of at least one token is
        drafted even where a plain step would pay better; empty still means no candidate. ``widths``: the caller
        pads each pass (draft + 1 tokens) to one of these widths (a static cache), so drafts are priced as the
        padded pass (:func:`~lookupdec.policy.padded_costs`).

        Each session's :class:`~lookupdec.policy.Ledger`, where it keeps one, is charged the pass's price: the
        bound on how much slower than plain decoding drafting may make any request in the pass."""
        offers = [session.offer(limit) for session, limit in zip(sessions, limits, strict=True)]
        fixed = any(getattr(session, "reproducible", False) for session in sessions)
        length, price = self._choose(offers, must_draft=must_draft, fixed=fixed, widths=widths)
        for session in sessions:
            ledger = getattr(session, "ledger", None)
            if ledger is not None:
                ledger.charge(price)
        return [session.take(length) for session in sessions]

    def length(self, offers: Sequence[Offer], *, must_draft: bool = False, fixed: bool = False,
               widths: Sequence[int] | None = None) -> int:
        """How many tokens of the ``offers`` (one per row of a pass) :meth:`propose` drafts: the longest offer
        without the adaptive length; else the length with the most expected tokens per unit of cost, priced with
        the single-row cost (one row) or the batch's (several), and 0 where the guard finds none that pays or the
        rows' rooms (:class:`~lookupdec.policy.Ledger`) allow none."""
        return self._choose(offers, must_draft=must_draft, fixed=fixed, widths=widths)[0]

    def _choose(self, offers: Sequence[Offer], *, must_draft: bool, fixed: bool,
                widths: Sequence[int] | None) -> tuple:
        """``(length, price)``: :meth:`length`, and what the pass costs relative to a plain step of its rows."""
        cfg = self.drafter_config
        longest = max((offer.tokens.size for offer in offers), default=0)
        if longest == 0:
            return 0, 1.0
        cost = self.batch_cost(len(offers))
        if widths:
            costs = padded_costs(cost.costs(padded_width(longest + 1, widths) - 1, refined=not fixed), widths)
        else:
            costs = cost.costs(longest, refined=not fixed)
        if len(offers) > 1 and not fixed:  # a bucket's profile, for a batch of fewer rows than the bucket's
            factor = self.plain_steps.bucket_factor(len(offers), self.batch_rows(len(offers)))
            if factor != 1.0:
                costs = np.concatenate([costs[:1], costs[1:] * factor])
        if not cfg.adaptive:
            length = min(longest, costs.size - 1)
            return length, float(costs[length])
        margin = cfg.margin(must_draft)
        if must_draft or not cfg.guard:  # a caller that must draft, or an ablation without the guard: no room
            offers = [replace(offer, room=float("inf")) for offer in offers]
        if len(offers) == 1:
            length = best_draft_length(offers[0].first, offers[0].then, costs, margin=margin, room=offers[0].room)
        else:
            length = best_batch_length(offers, costs, margin=margin, slowdown=cfg.slowdown(must_draft))
        if length == 0 and cfg.guard and not (must_draft or fixed):
            # A calibrated profile learns from the passes run; now and then it asks for one it would not choose
            # (at most one pass per band of lengths, for every drafter of the model and setting), within the
            # rows' room, or of one token where the room affords none. In a batch, also within what the guard
            # lets a pass cost a row for the others' drafts: a probe's gain is unknown, and every row pays its
            # width (without a ledger, a fresh profile's 8-row probes ran 64 tokens wide, 18 plain steps each).
            runs = [padded_width(d + 1, widths) - 1 for d in range(longest + 1)] if widths else None
            room = room_of(offers) if len(offers) == 1 else min(room_of(offers), cfg.slowdown(must_draft))
            length = cost.probe(length, costs[: longest + 1], room, runs)
        return length, float(costs[length])

    def observe(self, rows: int, drafted: int, seconds: float, sessions: Sequence = ()) -> None:
        """Feed the cost fit: a pass over ``rows`` rows, ``drafted`` positions wide beyond each row's last token,
        took ``seconds``.

        A drafted pass also charges each of its sessions' :class:`~lookupdec.policy.Ledger` what it was measured
        to take against recent plain steps of as many rows (:attr:`plain_steps`), in place of its price
        (:meth:`~lookupdec.policy.Ledger.timed`; why: docs/design.md, "Never slower, per request"). Kept at their
        price: sessions whose draft lengths must not depend on timings (``reproducible``) and passes priced by a
        profile set by hand. A pass run before a plain step of its size was timed is charged once one is."""
        cost = self.batch_cost(rows)
        cost.observe(drafted, seconds)
        if not (np.isfinite(seconds) and seconds > 0):
            return
        if drafted == 0:
            self.plain_steps.observe(rows, seconds)
        if not cost.learns:
            return
        for session in sessions:
            ledger = getattr(session, "ledger", None)
            if ledger is not None and not getattr(session, "reproducible", False):
                ledger.timed(seconds if drafted else None, rows, self.plain_steps)


def _as_tokens(ref: TokenSource, tokenizer) -> np.ndarray:
    if isinstance(ref, str):
        if tokenizer is None:
            raise ValueError("reference texts given as strings need LookupDrafter(tokenizer=...)")
        return np.asarray(tokenizer.encode(ref, add_special_tokens=False), dtype=np.int32)
    return np.asarray(ref, dtype=np.int32)


class DraftSession:
    """Drafting state of one request: its index, its alignment cursor, and the draft awaiting verification."""

    def __init__(self, drafter: Drafter, prompt: np.ndarray, eos_ids: frozenset, prediction: np.ndarray | None = None,
                 *, client: str | None = None, use_cache: bool = True):
        cfg = drafter.drafter_config
        self.drafter = drafter
        self._client = client  # whose rolling cache this request drafts from and feeds (None: the shared one)
        self._use_cache = use_cache and drafter.cache is not None
        self.reproducible = False  # Drafter.start(reproducible=True): lengths priced without timings
        self._eos = np.array(sorted(eos_ids), dtype=np.int32)
        parts = []
        for ref in drafter.references:
            parts += [ref, np.array([SEPARATOR], dtype=np.int32)]
        # The prediction sits last before the prompt: buffer positions [start, end) hold it.
        self._prediction = (0, 0)
        self._prediction_grams: dict = {}
        self.prediction_accepted = 0  # drafted tokens copied from the prediction that the target kept
        self.prediction_rejected = 0  # ... and that it did not
        self.cache_drafted = 0  # drafted tokens copied from the rolling cache of earlier outputs
        self.cache_accepted = 0  # ... of which the target kept
        self._calibration = drafter.acceptance.record()  # this request's own record of how its drafts fared
        self.ledger = Ledger(cfg.max_slowdown)  # what the passes it was in cost it beyond plain decoding
        if prediction is not None and prediction.size:
            start = sum(len(p) for p in parts)
            self._prediction = (start, start + len(prediction))
            parts += [prediction, np.array([SEPARATOR], dtype=np.int32)]
            self._prediction_grams = _ngram_sources(prediction, start, cfg.min_n, cfg.max_n)
        self._output_start = sum(len(p) for p in parts) + len(prompt)  # t of the first generated token
        buffer = np.concatenate(parts + [prompt]) if parts else prompt
        self.index = NgramIndex(cfg.min_n, cfg.max_n, capacity=max(len(buffer) + 1024, 1024))
        self.index.extend(buffer)
        self._cursor = -1  # t in the buffer expected to hold the next token, or -1 when not aligned
        self._pending: tuple = (None, -1, EMPTY)  # (bucket, src, draft) of the proposal awaiting commit
        self._offered: tuple = (None, -1, EMPTY)  # (bucket, src, candidate) of the last offer
        self._finished = False

    def propose(self, limit: int, *, must_draft: bool = False) -> np.ndarray:
        """This request's next draft, alone in its pass: ``drafter.propose([self], [limit])[0]``."""
        return self.drafter.propose([self], [limit], must_draft=must_draft)[0]

    def offer(self, limit: int) -> Offer:
        """The longest draft on offer (up to ``limit`` tokens) with its odds; :meth:`take` then drafts a prefix of
        it. :meth:`Drafter.propose` calls both, choosing the length in between."""
        limit = min(limit, self.drafter.drafter_config.max_draft)
        self._offered = (None, -1, EMPTY)
        self._pending = (None, -1, EMPTY)
        if limit <= 0:
            return Offer(EMPTY, 0.0, 0.0, self.ledger.room())
        bucket_, src, candidate = self._candidate(limit)
        if bucket_ is None:
            return Offer(EMPTY, 0.0, 0.0, self.ledger.room())
        candidate = self._clip(candidate)
        self._offered = (bucket_, src, candidate)
        first, then = self.drafter.acceptance.estimate(bucket_, self._calibration)
        return Offer(candidate, first, then, self.ledger.room())

    def take(self, length: int) -> np.ndarray:
        """Draft the first ``length`` tokens of the last :meth:`offer`; 0 skips this draft."""
        bucket_, src, candidate = self._offered
        draft = candidate[:max(length, 0)]
        if bucket_ is not None and draft.size == 0:
            self.drafter.acceptance.skipped(bucket_)
        self._pending = (bucket_, src, draft)
        return draft

    def _candidate(self, limit: int) -> tuple:
        index = self.index
        if self._cursor >= 0 and self._prediction_grams and not self._in_prediction(self._cursor):
            n, src = self._prefer_prediction(self.drafter.drafter_config.max_n, self._cursor)
            self._cursor = src
        if self._cursor >= 0:
            shared = index.match_length(self._cursor, 32)
            return bucket("cursor", shared), self._cursor, self._copy(self._cursor, limit)
        n, src = index.match()
        if self._prediction_grams and not self._in_prediction(src):
            n, src = self._prefer_prediction(n, src)
        shared = index.match_length(src, 32) if n else 0
        cache = self._cache()
        if cache is not None and shared < 8 and not (n and self._in_prediction(src)):  # the caller's prediction first
            tokens = index.tokens
            n_cache, cached = cache.lookup(tokens[max(0, len(tokens) - cache.max_n):], limit)
            if n_cache > shared:
                return ("cache", min(n_cache, 4)), -1, cached
        if n == 0:
            return None, -1, EMPTY
        return bucket("index", shared), src, self._copy(src, limit)

    def _cache(self) -> RollingCache | None:
        """The rolling cache this request drafts from: the shared one, its client's (None until the client has
        one), or none."""
        if not self._use_cache:
            return None
        return self.drafter.cache if self._client is None else self.drafter.clients.get(self._client)

    def _in_prediction(self, src: int) -> bool:
        return self._prediction[0] <= src < self._prediction[1]

    def _prefer_prediction(self, n: int, src: int) -> tuple:
        """The index keeps the most recent source of each n-gram, and a prompt that quotes the predicted text
        holds a later copy of it; drafting from the prediction's own copy instead (when it shares as long a
        suffix) drafts the same tokens and lets them be counted as the prediction's."""
        tokens = self.index.tokens
        for m in range(min(self.drafter.drafter_config.max_n, len(tokens)), max(n, 1) - 1, -1):
            hit = self._prediction_grams.get(tuple(tokens[len(tokens) - m:].tolist()))
            if hit is not None:
                return m, hit
        return n, src

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

    def commit(self, tokens: Sequence[int], seconds: float | None = None, *, source: int | None = None) -> None:
        """Record a verified step: ``tokens`` is what was appended (the accepted draft tokens, then the target's
        own token). How many drafted tokens were accepted follows from them: the target's token differs from the
        drafted one where it rejects (greedy: it is the argmax, the draft was not; sampling: recovery excludes the
        drafted token), so the accepted tokens are the longest common prefix of the draft and ``tokens[:-1]``.
        ``seconds``: the wall time of the step, for the single-row cost fit. ``source``: where in :attr:`index`'s
        buffer ``tokens`` were copied from, when that is not where the draft came from (another branch of a token
        tree won); the alignment cursor then follows that copy."""
        bucket_, src, draft = self._pending
        self._pending = (None, -1, EMPTY)
        new = np.asarray(tokens, dtype=np.int32)
        if bucket_ is not None:
            accepted = _common_prefix(draft, new[:-1])
            self.drafter.acceptance.update(bucket_, accepted, len(draft), self._calibration)
            if self._in_prediction(src):  # a draft never crosses the separator after the prediction
                self.prediction_accepted += accepted
                self.prediction_rejected += len(draft) - accepted
            elif bucket_[0] == "cache":
                self.cache_drafted += len(draft)
                self.cache_accepted += accepted
        if seconds is not None:
            self.drafter.observe(1, len(draft), seconds, (self,))
        self.ledger.settle(len(new))
        self.index.extend(new)
        # Follow the source the draft came from (or the cursor, if nothing was drafted) through the new tokens.
        t = source if source is not None else src if src >= 0 else self._cursor
        if t >= 0:
            buffer = self.index.tokens
            for token in new:
                if t < len(buffer) and buffer[t] == token:
                    t += 1
                else:
                    t = -1
                    break
        self._cursor = t if 0 <= t < len(self.index) and self.drafter.drafter_config.cursor else -1

    def finish(self, generated: int | None = None) -> None:
        """End the request: its output joins the rolling cache, with a little of the prompt before it so the
        first generated tokens can be matched too. Calls after the first do nothing.

        ``generated``: how many of the committed output tokens the client received (a server that ends a request
        at a stop string in the text has committed more); only those join the cache. None: all of them. More
        than were committed, or a negative count, is a caller's error (``ValueError``). Either way nothing after
        the output's first EOS token joins: a request ends there, and what a loop committed past it was never
        output.
        """
        if self._finished:
            return
        committed = len(self.index) - self._output_start
        if generated is None:
            generated = committed
        elif isinstance(generated, bool) or not isinstance(generated, numbers.Integral) \
                or not 0 <= generated <= committed:
            raise ValueError(f"generated must be an integer in [0, {committed}] (the tokens committed), "
                             f"got {generated!r}")
        self._finished = True
        output = self.index.tokens[self._output_start:self._output_start + int(generated)]
        if self._eos.size:
            hit = np.flatnonzero(np.isin(output, self._eos))
            if hit.size:
                output = output[: hit[0] + 1]
        if not self._use_cache or not output.size:
            return
        max_n = (self.drafter.cache if self._client is None else self.drafter.clients.config).max_n
        start = max(0, self._output_start - max_n)  # a little of the prompt, so the first output tokens match too
        context = self.index.tokens[start:self._output_start + output.size]
        context = context[np.flatnonzero(context < 0)[-1] + 1:] if (context < 0).any() else context
        if self._client is None:
            self.drafter.cache.add(context.copy())
        else:
            self.drafter.clients.add(self._client, context.copy())


class NoDrafts:
    """A session that never drafts: plain decoding through the same loops (the server's ``"lookup": false``). In a
    batch beside drafting rows it keeps a :class:`~lookupdec.policy.Ledger` too, so that their drafts slow it no
    more than ``max_slowdown`` allows."""

    prediction_accepted = prediction_rejected = cache_drafted = cache_accepted = 0

    def __init__(self, max_slowdown: float | None = DrafterConfig.max_slowdown):
        self.ledger = Ledger(max_slowdown)

    def offer(self, limit: int) -> Offer:
        return Offer(EMPTY, 0.0, 0.0, self.ledger.room())

    def take(self, length: int) -> np.ndarray:
        return EMPTY

    def commit(self, tokens: Sequence[int], seconds: float | None = None) -> None:
        self.ledger.settle(len(tokens))

    def finish(self, generated: int | None = None) -> None:
        pass


def _ngram_sources(tokens: np.ndarray, offset: int, min_n: int, max_n: int) -> dict:
    """``{n-gram: source}`` for every n-gram of ``tokens`` with ``min_n <= n <= max_n`` that has a continuation in
    ``tokens``, its source (the position after it, counted from ``offset``) the most recent one, as the index's."""
    grams = {}
    values = tokens.tolist()
    for n in range(max(min_n, 1), max_n + 1):
        for end in range(n, len(values)):
            grams[tuple(values[end - n: end])] = offset + end
    return grams


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
