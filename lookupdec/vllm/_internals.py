"""What lookupdec reads from vLLM's internals, all in one place, behind a version check.

vLLM's ``custom_class`` proposer is called with the rows' tokens but not with the requests they belong to; the
proposer needs those (a row's drafting state lives across steps while vLLM reorders its batch, and a request's
prediction arrives in its sampling parameters). So :func:`bind_runner` wraps the model runner's
``propose_draft_token_ids`` once, to hand a :class:`~lookupdec.vllm.proposer.LookupProposer` its runner before
each call. Everything else read here (the batch's request ids, a request's sampling parameters and output
length, the tokens scheduled in the step) goes through :class:`RunnerView`. ``tests/test_vllm.py`` runs against
the real classes, so a vLLM that moves any of these fails there, not in a user's server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import PREDICTION_ARG

TESTED_VERSIONS = ((0, 32),)


def vllm_version_string() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


def check_version() -> None:
    """Refuse a vLLM whose internals this module was not tested against."""
    version = vllm_version_string()
    if tuple(int(n) for n in re.findall(r"\d+", version)[:2]) not in TESTED_VERSIONS:
        tested = ", ".join(".".join(map(str, v)) for v in TESTED_VERSIONS)
        raise RuntimeError(f"lookupdec's vLLM proposer is tested on vLLM {tested}; this is vLLM {version}. Install "
                           "a tested version, or a lookupdec that supports this one.")


@dataclass
class RequestInfo:
    """What the proposer needs of one request."""

    req_id: str
    prompt_len: int
    stop_ids: frozenset  # EOS and stop token ids: a draft never crosses one
    max_tokens: int | None  # output tokens the request may generate
    prediction: list | None  # token ids of its prediction (vllm_xargs), if any


class RunnerView:
    """Reads of a vLLM 0.32 ``GPUModelRunner`` (also the base of its ``CPUModelRunner``)."""

    def __init__(self, runner, scheduler_output):
        self._runner, self._scheduler_output = runner, scheduler_output

    def req_ids(self) -> list:
        """Request id of each row of the batch, in row order (the order of ``propose``'s arguments)."""
        return list(self._runner.input_batch.req_ids)

    def live(self) -> set:
        """Ids of every request the runner holds, including those preempted and waiting to be resumed."""
        return set(self._runner.requests)

    def scheduled_tokens(self) -> int:
        """Tokens the step that just ran scheduled: last tokens, drafts and prefill chunks of every row."""
        return int(self._scheduler_output.total_num_scheduled_tokens)

    def request(self, req_id: str) -> RequestInfo:
        state = self._runner.requests[req_id]
        params = state.sampling_params
        stop = frozenset(int(t) for t in (params.all_stop_token_ids or ())) if params is not None else frozenset()
        extra = (params.extra_args or {}) if params is not None else {}
        prediction = extra.get(PREDICTION_ARG)
        if prediction is not None and not (isinstance(prediction, list)
                                           and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prediction)):
            prediction = None  # not ours to refuse here: the server validated what it sent
        return RequestInfo(req_id, int(state.num_prompt_tokens), stop,
                           None if params is None else params.max_tokens, prediction)


_BOUND = False


def bind_runner() -> None:
    """Wrap ``GPUModelRunner.propose_draft_token_ids`` (once per process) so that a runner whose drafter has a
    ``bind`` method hands it a :class:`RunnerView` before drafting."""
    global _BOUND
    if _BOUND:
        return
    check_version()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        bind = getattr(getattr(self, "drafter", None), "bind", None)
        if bind is not None:
            bind(RunnerView(self, scheduler_output))
        return original(self, scheduler_output, *args, **kwargs)

    propose_draft_token_ids.__wrapped__ = original
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    _BOUND = True


def served_model(app) -> tuple:
    """``(tokenizer path, context length)`` of the model vLLM's OpenAI server (the ASGI ``app``) serves."""
    state = getattr(app, "state", None)
    config = getattr(state, "vllm_config", None)
    if config is None:
        raise RuntimeError("lookupdec's middleware found no vllm_config on the server's app; it runs inside "
                           "vLLM's OpenAI server (vllm serve ... --middleware lookupdec.vllm.middleware."
                           "PredictedOutputs)")
    return config.model_config.tokenizer, int(config.model_config.max_model_len)
