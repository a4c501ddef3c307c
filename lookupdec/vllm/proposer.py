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
  rows: a :class:`~lookupdec.drafter.DraftSession` with its incremental n-gram index and alignment cursor, the
  engine-wide rolling cache of earlier outputs, and the request's prediction (``vllm_xargs``
  ``lookupdec_prediction``: token ids).

The request ids come from the model runner (:mod:`lookupdec.vllm._internals`), which vLLM does not pass to a
custom proposer. Without them (an untested runner) the proposer drafts nothing rather than guess.
"""

from __future__ import annotations

import time

import numpy as np

from ..drafter import Drafter, DrafterConfig
from ..policy import TokenCost, token_lengths
from . import _internals

# A step whose gap since the last one is this many times the fitted time is not a step (the engine idled, or a
# request's prefill ran alone between two drafting steps): it is not fed to the cost fit.
_OUTLIER = 4.0


class _Tracked:
    """One request's drafting state: its session and how many of its tokens the session has seen."""

    __slots__ = ("session", "seen", "info")

    def __init__(self, session, seen, info):
        self.session, self.seen, self.info = session, seen, info


class LookupProposer:
    """vLLM ``custom_class`` proposer: ``--speculative-config '{"method": "custom_class", "model":
    "lookupdec.vllm.proposer.LookupProposer", "num_speculative_tokens": 16}'``.

    ``num_speculative_tokens`` is the longest draft; the cost model picks each row's length up to it."""

    def __init__(self, vllm_config, drafter: Drafter | None = None):
        _internals.check_version()
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.drafter = drafter or Drafter(DrafterConfig(max_draft=max(1, min(self.k, 256)), calibrate=False))
        self.cost = TokenCost()
        self._requests: dict = {}  # req_id -> _Tracked
        self._view = None
        self._last_end = None  # when the last propose returned
        _internals.bind_runner()

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
        Returns each row's draft, a list of at most ``num_speculative_tokens`` token ids."""
        start = time.perf_counter()
        view, self._view = self._view, None
        rows = len(sampled_token_ids)
        drafts = [[] for _ in range(rows)]
        if view is None or rows == 0:
            self._last_end = time.perf_counter()
            return drafts
        self._observe(view, start)
        req_ids = view.req_ids()[:rows]
        self._forget(view.live())
        sessions, limits, where = [], [], []
        for row, (req_id, sampled) in enumerate(zip(req_ids, sampled_token_ids)):
            if req_id is None or not sampled:
                continue
            n = int(num_tokens_no_spec[row])
            tracked = self._track(view, req_id, token_ids_cpu[row], n)
            limit = min(self.k, self.max_model_len - n - 1)
            if tracked.info.max_tokens is not None:
                limit = min(limit, tracked.info.max_tokens - (n - tracked.info.prompt_len) - 1)
            if limit <= 0:
                continue
            sessions.append(tracked.session)
            limits.append(limit)
            where.append(row)
        if sessions:
            offers = [session.offer(limit) for session, limit in zip(sessions, limits)]
            base, per_token = self.cost.line()
            cfg = self.drafter.drafter_config
            # No bound on what one row pays for the others' drafts (DrafterConfig.batch_slowdown): here a drafted
            # token costs the other rows only its marginal time, not a padded width, and with the bound a batch of
            # 8 on this CPU drafted 3-4 tokens a pass in all: vLLM's n-gram method outran it at 4 and 8 rows.
            lengths = token_lengths(offers, base, per_token, others=rows - len(sessions), margin=cfg.margin()) \
                if cfg.adaptive else [o.tokens.size for o in offers]
            for row, session, length in zip(where, sessions, lengths):
                drafts[row] = session.take(length).tolist()
        self._last_end = time.perf_counter()
        return drafts

    # ------------------------------------------------------------------ bookkeeping

    def _observe(self, view, start: float) -> None:
        """Feed the cost fit with the step that just ran: from the end of the last propose to the start of
        this one, ``view.scheduled_tokens()`` tokens."""
        if self._last_end is None:
            return
        seconds = start - self._last_end
        tokens = view.scheduled_tokens()
        base, per_token = self.cost.line()
        fitted = base + per_token * tokens
        if self.cost.weight >= 8 and seconds > _OUTLIER * fitted:
            return
        self.cost.observe(tokens, seconds)

    def _track(self, view, req_id: str, tokens: np.ndarray, n: int):
        """The request's session, brought up to its ``n`` tokens (``tokens[:n]``); a new session for a request
        seen for the first time, or one whose tokens no longer extend what the session saw."""
        tracked = self._requests.get(req_id)
        if tracked is not None and n < tracked.seen:
            tracked.session.finish(0)
            tracked = None
        if tracked is None:
            info = view.request(req_id)
            prompt_len = min(info.prompt_len, n)
            session = self.drafter.start(tokens[:prompt_len], eos_ids=info.stop_ids, prediction=info.prediction)
            tracked = self._requests[req_id] = _Tracked(session, prompt_len, info)
        if n > tracked.seen:
            tracked.session.commit(tokens[tracked.seen:n].tolist())
            tracked.seen = n
        return tracked

    def _forget(self, live: set) -> None:
        """End the sessions of requests the runner no longer holds (finished or aborted): their outputs join
        the rolling cache."""
        for req_id in [r for r in self._requests if r not in live]:
            tracked = self._requests.pop(req_id)
            try:
                tracked.session.finish()
            except Exception:  # noqa: BLE001,S110 - the cache misses one output; drafting goes on
                pass
