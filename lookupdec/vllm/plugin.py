"""lookupdec's vLLM plugin: the ``vllm.general_plugins`` entry point (``pyproject.toml``), which vLLM runs in
every process it starts (the API server, the engine core, each worker) once lookupdec is installed beside it.

It installs the hook that hands lookupdec's proposer the runner's view of the batch
(:func:`lookupdec.vllm._internals.install_hook`); nothing else, so a vLLM that does not use lookupdec runs as
before. On a vLLM lookupdec does not support it installs nothing and logs one line saying what to install; the
proposer, the middleware and ``lookupdec serve --engine vllm`` refuse to start there with the same line.
"""

from __future__ import annotations

import logging

_log = logging.getLogger(__name__)


def register() -> None:
    """The entry point vLLM calls in each of its processes."""
    from . import _internals

    reason = _internals.unsupported_reason(_internals.vllm_version_string())
    if reason is not None:
        _log.warning("%s; lookupdec's proposer is not available in this vLLM", reason)
        return
    _internals.install_hook()
