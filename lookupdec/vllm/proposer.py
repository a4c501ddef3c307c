"""The copy drafter as vLLM's speculative proposer (``--speculative-config '{"method": "custom_class", ...}'``).

vLLM calls :meth:`LookupProposer.propose` after every step with each row's newly sampled tokens and its whole
context; the proposer returns each row's draft (a list, empty for none), which vLLM's next step verifies with its
rejection sampler. For a point-mass draft, as ours are, that sampler is the exact rule (accept a drafted token
with the target's probability of it, else sample from the rest), so greedy answers are vLLM's plain answers and
sampled ones follow the target's distribution.

What differs from vLLM's own ``ngram`` method:

- **Cost-aware lengths, zero included.** vLLM pays per token scheduled, not per padded batch width, so each
  row's length is priced apart (:func:`lookupdec.policy.token_lengths`) with a straight line of pass time
  against scheduled tokens fitted on vLLM's own passes (:class:`lookupdec.policy.TokenCost`: the wall time
  between two ``propose`` calls is one step). Nothing is drafted where nothing pays, so open-ended text runs at
  plain speed.
- **Drafting state per request**, kept across steps by request id while vLLM reorders, preempts and replaces
  rows: a :class:`~lookupdec.drafter.DraftSession` with its incremental n-gram index and alignment cursor, a
  rolling cache of earlier outputs (shared, the client's own, or none: :class:`~lookupdec.vllm.ProposerOptions`),
  and the request's prediction (``vllm_xargs`` ``lookupdec_prediction``: token ids).

**Nothing a request carries can stop the engine.** Whatever reaches the proposer from a client is checked here,
whether or not lookupdec's middleware ran: a prediction must be a list of at most ``max_model_len`` token ids, each
in ``[0, vocabulary size)``, else it is ignored (logged once per request). Any exception raised while drafting
one row costs that row its drafts (logged once per request, the request goes on without drafts); one raised
outside any row costs the step its drafts. None propagates into vLLM's step.

**Seeded sampling.** vLLM's rejection sampler draws a seeded request's random numbers from its own generator, one
per drafted token, so its answer depends on its draft lengths. For such a request the proposer drafts from its
own prompt, output and prediction only, with lengths priced by a fixed cost line and its own acceptance record:
lengths that depend on nothing but its tokens, so a seed gives the same answer however loaded the engine is and
whatever others generated.

The request ids come from the model runner (:mod:`lookupdec.vllm._internals`), which vLLM does not pass to a
custom proposer; the plugin installs the hook that supplies them, and the proposer refuses to start without it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from ..drafter import Drafter, DrafterConfig
from ..policy import TokenCost, token_lengths
from . import _internals

_log = logging.getLogger(__name__)

# A step whose gap since the last one is this many times its expected time is not a step (the engine idled, or a
# request's prefill ran alone between two drafting steps): it is not fed to the cost fit. The expected time prices
# each token at no less than the prior's share of the fixed part, so that steps the fit priced too cheaply are not
# taken for outliers: they are what corrects it.
_OUTLIER = 4.0


class _Tracked:
    """One request's drafting state: its session, how many of its tokens the session has seen, what vLLM holds
    of it, and for a seeded sampled request the drafter of its own (no shared estimates, no cache)."""

    __slots__ = ("session", "seen", "info", "own")

    def __init__(self, session, seen, info, own):
        self.session, self.seen, self.info, self.own = session, seen, info, own


def checked_prediction(raw, vocab_size: int, max_len: int) -> tuple:
    """``(token ids as int32, None)`` for a well-formed prediction, ``(None, why)`` for one that is not (a list of
    at most ``max_len`` ints, each in ``[0, vocab_size)``), ``(None, None)`` when there is none."""
    if raw is None:
        return None, None
    if not isinstance(raw, list):
        return None, f"not a list of token ids but {type(raw).__name__}"
    if len(raw) > max_len:
        return None, f"{len(raw)} token ids, more than the model's context ({max_len})"
    for token in raw:
        if type(token) is not int or not 0 <= token < vocab_size:
            return None, f"{str(token)[:24]!r} is not a token id in [0, {vocab_size})"
    return np.asarray(raw, dtype=np.int32), None


class LookupProposer:
    """vLLM ``custom_class`` proposer: ``--speculative-config '{"method": "custom_class", "model":
    "lookupdec.vllm.proposer.LookupProposer", "num_speculative_tokens": 16}'``; options in
    ``--additional-config '{"lookupdec": {...}}'`` (:class:`~lookupdec.vllm.ProposerOptions`).

    ``num_speculative_tokens`` is the longest draft; the cost model picks each row's length up to it."""

    def __init__(self, vllm_config, drafter: Drafter | None = None):
        _internals.check_version()
        if not _internals.hook_installed():
            raise RuntimeError("lookupdec's vLLM plugin did not run in this process, so the proposer cannot tell "
                               "which request a row belongs to: install lookupdec into vLLM's environment (its "
                               "vllm.general_plugins entry point 'lookupdec'), and if VLLM_PLUGINS is set, name "
                               "lookupdec in it")
        self.options = _internals.options(vllm_config)
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = _internals.vocab_size(vllm_config)
        if drafter is None:
            drafter = Drafter(DrafterConfig(max_draft=max(1, min(self.k, 256)), calibrate=False,
                                            use_cache=self.options.cache_scope != "off",
                                            max_slowdown=self.options.max_slowdown))
        self.drafter = drafter
        self.cost = TokenCost()
        self._requests: dict = {}  # req_id -> _Tracked
        self._faulted: set = set()  # requests that draft no more: drafting for them raised
        self._view = None
        self._last_end = None  # when the last propose returned
        self._step_fault_logged = False

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load: the drafts are copied (vLLM's CPU runner calls this on every drafter)."""

    def bind(self, view) -> None:
        """Called by the runner before :meth:`propose`, with a view of the batch (:mod:`._internals`)."""
        self._view = view

    # ------------------------------------------------------------------ vLLM's interface

    def propose(self, sampled_token_ids: list, num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None, **_) -> list:
        """``sampled_token_ids[row]``: the tokens the step just committed for that row (empty while its prompt is
        prefilled); ``num_tokens_no_spec[row]``: its tokens now; ``token_ids_cpu[row, :n]``: those tokens.
        Returns each row's draft, a list of at most ``num_speculative_tokens`` token ids. Never raises."""
        start = time.perf_counter()
        view, self._view = self._view, None
        rows = len(sampled_token_ids)
        drafts = [[] for _ in range(rows)]
        try:
            if view is not None and rows:
                self._observe(view, start)
                self._draft(view, drafts, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception:
            drafts = [[] for _ in range(rows)]
            if not self._step_fault_logged:  # once: a fault outside any row would repeat every step
                self._step_fault_logged = True
                _log.exception("lookupdec's proposer failed outside any one request; this step drafts nothing "
                               "(logged once)")
        self._last_end = time.perf_counter()
        return drafts

    def _draft(self, view, drafts, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> None:
        rows = len(drafts)
        req_ids = view.req_ids()[:rows]
        self._forget(view.live())
        shared, own = [], []  # (row, req_id, session, offer): priced together / each alone
        ledgers = []  # of every row in the step priced on the fitted line, drafting or not: each pays for the step
        for row, (req_id, sampled) in enumerate(zip(req_ids, sampled_token_ids)):
            if req_id is None or not sampled or req_id in self._faulted:
                continue
            try:
                n = int(num_tokens_no_spec[row])
                tracked = self._track(view, req_id, token_ids_cpu[row], n)
                if tracked.own is None:
                    ledgers.append(tracked.session.ledger)
                limit = min(self.k, self.max_model_len - n - 1)
                if tracked.info.max_tokens is not None:
                    limit = min(limit, tracked.info.max_tokens - (n - tracked.info.prompt_len) - 1)
                if limit <= 0:
                    continue
                entry = (row, req_id, tracked.session, tracked.session.offer(limit))
            except Exception as err:
                self._fault(req_id, err)
                continue
            (own if tracked.own is not None else shared).append(entry)
        base, per_token = self.cost.line()
        plain = base + per_token * rows  # the step with every row's last token and no drafts
        own_lengths = [self._own_length(entry) for entry in own]
        room = min((ledger.room() for ledger in ledgers), default=float("inf"))
        room -= per_token * sum(own_lengths) / plain  # what the seeded rows' drafts take of it
        lengths = self._lengths([entry[3] for entry in shared], base, per_token, rows - len(shared), max(room, 0.0))
        drafted = 0
        for (row, req_id, session, _), length in list(zip(shared, lengths)) + list(zip(own, own_lengths)):
            try:
                drafts[row] = session.take(length).tolist()
                drafted += len(drafts[row])
            except Exception as err:
                self._fault(req_id, err)
        price = (plain + per_token * drafted) / plain
        for ledger in ledgers:
            ledger.charge(price)

    def _lengths(self, offers: list, base: float, per_token: float, others: int, room: float) -> list:
        """The rows' lengths, priced together on the fitted cost line (``base + per_token * tokens``);
        ``others``: rows in the step that draft nothing here but schedule their last token; ``room``: how much
        longer than a plain step the step may take for the tightest row in it (:class:`~lookupdec.policy.Ledger`)."""
        if not offers:
            return []
        cfg = self.drafter.drafter_config
        if not cfg.adaptive:
            return [offer.tokens.size for offer in offers]
        return token_lengths(offers, base, per_token, others=others, margin=cfg.margin(), slowdown=room)

    def _own_length(self, entry) -> int:
        """A seeded sampled request's length: priced alone, on the cost model's fixed prior line, and charged to
        its own ledger at that price, so that it depends on the request's own tokens only (the bound on what
        others' drafts cost it is then on that line too)."""
        session, offer = entry[2], entry[3]
        cfg = self.drafter.drafter_config
        if not cfg.adaptive:
            return offer.tokens.size
        share = TokenCost.PRIOR_SHARE
        length = token_lengths([offer], 1.0, share, margin=cfg.margin())[0]
        session.ledger.charge((1.0 + share * (1 + length)) / (1.0 + share))
        return length

    # ------------------------------------------------------------------ bookkeeping

    def _fault(self, req_id: str, err: Exception) -> None:
        """Drafting for ``req_id`` raised: it drafts no more (its session may be half-updated), said once."""
        self._faulted.add(req_id)
        self._requests.pop(req_id, None)  # not finished into the cache: its state is not trusted
        _log.warning("lookupdec: drafting for request %s failed (%s: %s); it goes on without drafts", req_id,
                     type(err).__name__, err, exc_info=err)

    def _observe(self, view, start: float) -> None:
        """Feed the cost fit with the step that just ran: from the end of the last propose to the start of
        this one, ``view.scheduled_tokens()`` tokens. Only steps without a prompt chunk: a prompt token is cheaper
        than a row's last token or a drafted one, each of which is verified (SmolLM2 on this project's CPU: 1.5 ms
        against 2.2 ms), so steps with prefills fitted beside them would price drafts too cheap and let the rows
        beside them lose more than ``max_slowdown``."""
        if self._last_end is None or view.prompt_tokens():
            return
        seconds = start - self._last_end
        tokens = view.scheduled_tokens()
        base, per_token = self.cost.line()
        expected = base + max(per_token, self.cost.prior_share * base) * tokens
        if self.cost.weight >= 8 and seconds > _OUTLIER * expected:
            return
        self.cost.observe(tokens, seconds)

    def _track(self, view, req_id: str, tokens: np.ndarray, n: int) -> _Tracked:
        """The request's session, brought up to its ``n`` tokens (``tokens[:n]``); a new session for a request
        seen for the first time, or one whose tokens no longer extend what the session saw."""
        tracked = self._requests.get(req_id)
        if tracked is not None and n < tracked.seen:
            tracked.session.finish(0)
            tracked = None
        if tracked is None:
            tracked = self._requests[req_id] = self._start(view.request(req_id), tokens, n)
        if n > tracked.seen:
            tracked.session.commit(tokens[tracked.seen:n].tolist())
            tracked.seen = n
        return tracked

    def _start(self, info: _internals.RequestInfo, tokens: np.ndarray, n: int) -> _Tracked:
        """A new session for ``info``'s request, its prediction and client checked."""
        prediction, why = checked_prediction(info.prediction, self.vocab_size, self.max_model_len)
        if why is not None:
            _log.warning("lookupdec: ignoring the prediction of request %s: %s", info.req_id, why)
        client = info.client
        if client is not None and not isinstance(client, str):
            _log.warning("lookupdec: ignoring the client of request %s: not a string", info.req_id)
            client = None
        prompt = tokens[:min(info.prompt_len, n)]
        if info.seeded_sampling:
            own = Drafter(replace(self.drafter.drafter_config, use_cache=False), references=self.drafter.references)
            session = own.start(prompt, eos_ids=info.stop_ids, prediction=prediction, use_cache=False)
            return _Tracked(session, len(prompt), info, own)
        scope = self.options.cache_scope
        session = self.drafter.start(prompt, eos_ids=info.stop_ids, prediction=prediction,
                                     client=client if scope == "user" else None, use_cache=scope != "off")
        return _Tracked(session, len(prompt), info, None)

    def _forget(self, live: set) -> None:
        """End the sessions of requests the runner no longer holds (finished or aborted): their outputs join
        the rolling cache."""
        self._faulted &= live
        for req_id in [r for r in self._requests if r not in live]:
            tracked = self._requests.pop(req_id)
            try:
                tracked.session.finish()
            except Exception:  # the cache misses one output; drafting goes on
                _log.warning("lookupdec: could not add request %s's output to the rolling cache", req_id,
                             exc_info=True)
