"""Two OpenAI-compatible servers on the same model, driven by the official ``openai`` client: ``lookupdec serve``
against ``transformers serve`` (the anchor), with ratios measured inside one run.

Both servers are started here as subprocesses on 127.0.0.1 (free ports), on the same weights (the folder
``lookupdec.models`` converts the model into, which must carry a chat template), the same device and dtype, and
the same torch thread count (``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``, which torch reads when it starts). They are
stopped (SIGTERM, then SIGKILL) on the way out, also on Ctrl-C.

Workload: the same requests at every concurrency level, all greedy (``temperature=0``): edits of YAML files and of
Python functions (``benchmarks/workloads.py``), sent to lookupdec with the file's text as the OpenAI ``prediction``,
and open-ended prompts (the control: nothing to copy). ``transformers serve`` gets no ``prediction`` (it names the
field as unsupported and ignores it). At each level a closed loop of that many clients sends the requests; the
servers run one at a time, in alternating order, so they never compete for the CPU. lookupdec gets a fresh server
for each level (its in-memory cache of earlier outputs would draft repeated requests from their own answers).

Reported per server and level: median and p95 latency (p95 by nearest rank: with few requests it is close to
the maximum), output tokens per second (all output tokens over the level's wall time; tokens are counted by
tokenizing the returned text with the model's tokenizer, so equal texts count equal tokens on both servers),
lookupdec's accepted / rejected prediction tokens (``usage.completion_tokens_details``), and the ratios
lookupdec / transformers. Greedy outputs are compared between the servers (``identical``) and with each server's
own output at concurrency 1 (``stable``). Writes ``serve.json`` (every request) and ``serve.md`` to ``--out``.

``--soak SECONDS`` drives lookupdec alone at concurrency 8 with raw HTTP (urllib), about 5% of the requests
malformed (bad JSON, ``n=2``, no ``messages``, an unknown model, ``tools``, a prompt past the context). It checks
that no answer is ever a 5xx, that every malformed request gets a 4xx with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``, and that every well-formed greedy request gets the text the
same request got when sent alone at the start; it reports the server's RSS (children included) at start and end.
Writes ``soak.json``; exits 1 when a check failed.

Examples::

    python -m benchmarks.serve --quick        # 8 requests, 96 tokens, c = 1 4 8: ~5-6 min on 2 idle cores
    python -m benchmarks.serve                # 12 requests, 256 tokens, 2 reps: ~30 min
    python -m benchmarks.serve --servers transformers --levels 4 --tf-mode sequential   # one server, one level
    python -m benchmarks.serve --soak 600     # 10 minutes of lookupdec alone at concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.workloads import SUITES

SERVERS = ("lookupdec", "transformers")
# transformers serve runs requests one at a time through model.generate ("sequential") or with its continuous
# batching ("cb": paged attention, one generation config shared by all requests, the first one's). At concurrency 4
# (8 requests, 128 tokens, one torch thread, 2-core CPU) cb gave 24.7 and 21.6 tok/s to sequential's 12.3 and 11.1,
# with identical texts, so it is the default (benchmarks/README.md). Its KV cache is sized here (cb_blocks).
TF_MODES = ("sequential", "cb")
DEFAULT_TF_MODE = "cb"
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # lookupdec's names -> transformers'
STARTUP_TIMEOUT_S = 300  # a first load converts the GGUF file (~20 s) and may calibrate; slow shared machines
CB_PAGE_TOKENS = 256  # tokens per KV block of transformers' continuous batching (ContinuousBatchingConfig.page_size)
REQUEST_TIMEOUT_S = 900  # one request at concurrency 8 on 2 cores can wait behind seven others
SOAK_MALFORMED_EVERY = 20  # one request in 20 (5%) is malformed


class BenchError(Exception):
    """A one-line reason the benchmark cannot run (missing package, server that does not start, ...)."""


# ---------------------------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True)
class Request:
    name: str  # the workloads.py prompt name, e.g. "service.yaml#0"
    kind: str  # "edit" (sent with a prediction to lookupdec) or "open"
    user: str  # the user message
    prediction: str | None  # the text being edited: the body of the prompt's fenced block; None for open prompts
    max_tokens: int


_FENCE = re.compile(r"```[a-z]*\n(.*?)\n```", re.DOTALL)


def edit_text(user: str) -> str:
    """The file an edit prompt carries: workloads.py puts it first, in one fenced block."""
    match = _FENCE.search(user)
    if match is None:
        raise ValueError("an edit prompt without a fenced block")
    return match.group(1) + "\n"


def build_requests(n_requests: int, max_tokens: int) -> list[Request]:
    """`n_requests` requests, three edits (YAML and code alternating) for each open prompt, in a fixed order that
    mixes the kinds, so every concurrency level sees the same mix from its first batch on."""
    yaml, code, open_ = SUITES["yaml"](), SUITES["code"](), SUITES["open"]()
    edits = [p for pair in itertools.zip_longest(yaml, code) for p in pair if p is not None]
    n_edit, n_open = _split(n_requests)
    if n_edit > len(edits) or n_open > len(open_):
        most = max(n for n in range(1, 4 * len(open_) + 4)
                   if _split(n)[0] <= len(edits) and _split(n)[1] <= len(open_))
        raise BenchError(f"--requests {n_requests}: workloads.py has {len(edits)} edit and {len(open_)} open prompts, "
                         f"enough for {most} requests at most")
    picked = [Request(p.name, "edit", p.user, edit_text(p.user), max_tokens) for p in edits[:n_edit]]
    opens = [Request(p.name, "open", p.user, None, max_tokens) for p in open_[:n_open]]
    for i, req in enumerate(opens):  # one open prompt after every three edits
        picked.insert(min(4 * i + 3, len(picked)), req)
    return picked


def _split(n_requests: int) -> tuple[int, int]:
    """(edits, open prompts) among `n_requests`: one in four open, at least one."""
    n_open = max(1, n_requests // 4)
    return n_requests - n_open, n_open


# ---------------------------------------------------------------------------------------------------------------
# Servers


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
    its output in a log file, waited for on /health, stopped with SIGTERM then SIGKILL."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path):
        self.name, self.base_argv, self.env, self.log = name, argv, env, log
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
        self.argv = [*self.base_argv, "--host", "127.0.0.1", "--port", str(self.port)]
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

    def wait_ready(self, timeout: float) -> None:
        """Poll /health until it answers 200, then read the model name from /v1/models."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} server exited during startup (exit code {self.proc.returncode}): "
                                 f"{self.last_log_line()} (full log: {self.log})")
            with contextlib.suppress(OSError):
                status, _ = http_get(self.url + "/health", timeout=2)
                if status == 200:
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

    def last_log_line(self) -> str:
        lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1][:300] if lines and not lines[-1].startswith("$ ") else "(no output)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # The server leads its own process group: signal the group, so helpers it forked go too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)

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
        with contextlib.suppress(Exception):
            import psutil

            times = psutil.Process(self.proc.pid).cpu_times()
            return times.user + times.system
        return None


def _vmrss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


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


def lookupdec_server(args, env: dict) -> Server:
    argv = [*_executable("lookupdec", ["-m", "lookupdec.cli"]), "serve", "--device", args.device,
            "--dtype", args.dtype]
    if args.model:
        argv += ["--model", args.model]
    if args.max_batch:
        argv += ["--max-batch", str(args.max_batch)]
    if args.max_queue:
        argv += ["--max-queue", str(args.max_queue)]
    return Server("lookupdec", argv, env, args.out / "serve-lookupdec.log")


def cb_blocks(requests: list[Request], tokenizer, concurrency: int) -> int:
    """KV blocks for transformers' continuous batching: room for `concurrency` of the longest requests, twice over.
    Left to itself on a CPU it sizes its paged cache from free system RAM (90%): 10.7 GB of RSS on a 23 GB
    machine, allocated at the first request, for a model whose eight requests here need a few hundred MB."""
    longest = max(len(tokenizer.apply_chat_template([{"role": "user", "content": r.user}], add_generation_prompt=True,
                                                    return_dict=True)["input_ids"]) + r.max_tokens for r in requests)
    return max(16, 2 * -(-concurrency * longest // CB_PAGE_TOKENS))


def transformers_server(args, env: dict, source: str, blocks: int) -> Server:
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise BenchError("transformers serve needs its serving extras (fastapi, uvicorn, openai, pydantic): "
                         "pip install 'transformers[serving]'")
    argv = [*_executable("transformers", ["-c", "from transformers.cli.transformers import main; main()"]),
            "serve", source, "--device", args.device, "--dtype", TORCH_DTYPES[args.dtype], "--log-level", "warning"]
    if args.tf_mode == "cb":
        argv += ["--continuous-batching", "--cb-num-blocks", str(blocks)]
    return Server("transformers", argv, env, args.out / "serve-transformers.log")


# ---------------------------------------------------------------------------------------------------------------
# Benchmark


@dataclass
class Result:
    server: str
    level: int
    rep: int
    name: str
    kind: str
    seconds: float
    text: str | None
    tokens: int  # the returned text tokenized with the model's tokenizer (the same count on both servers)
    completion_tokens: int  # as the server's usage reports it (both servers count a generated EOS token)
    accepted: int | None = None
    rejected: int | None = None
    error: str | None = None


def _openai():
    try:
        import openai
    except ImportError:
        raise BenchError("the benchmark drives the servers with the official client: pip install openai") from None
    return openai


async def _send(client, server: Server, req: Request, level: int, rep: int, tokenizer) -> Result:
    kw = {"model": server.model_id, "messages": [{"role": "user", "content": req.user}],
          "max_tokens": req.max_tokens, "temperature": 0}
    if server.name == "lookupdec" and req.prediction is not None:
        kw["prediction"] = {"type": "content", "content": req.prediction}
    start = time.perf_counter()
    try:
        resp = await client.chat.completions.create(**kw)
    except Exception as err:  # noqa: BLE001 - every failure is recorded and reported, none stops the run
        return Result(server.name, level, rep, req.name, req.kind, time.perf_counter() - start, None, 0, 0,
                      error=f"{type(err).__name__}: {err}"[:300])
    seconds = time.perf_counter() - start
    text = resp.choices[0].message.content or ""
    usage = resp.usage
    details = getattr(usage, "completion_tokens_details", None) if usage else None
    return Result(server.name, level, rep, req.name, req.kind, seconds, text,
                  len(tokenizer(text, add_special_tokens=False)["input_ids"]),
                  usage.completion_tokens if usage else 0,
                  getattr(details, "accepted_prediction_tokens", None) if details else None,
                  getattr(details, "rejected_prediction_tokens", None) if details else None)


async def _drive(server: Server, requests: list[Request], level: int, rep: int, tokenizer):
    """A closed loop of `level` clients over `requests`; returns (results in request order, wall seconds)."""
    openai = _openai()
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=REQUEST_TIMEOUT_S) as client:
        gate = asyncio.Semaphore(level)

        async def one(req):
            async with gate:
                return await _send(client, server, req, level, rep, tokenizer)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
        return list(results), time.perf_counter() - start


def drive(server, requests, level, rep, tokenizer):
    return asyncio.run(_drive(server, requests, level, rep, tokenizer))


# Warm-up prompts outside the workload: lookupdec's rolling cache remembers every output, so warming up on the
# measured prompts would hand it their answers.
WARMUP = [
    Request("warmup-edit", "edit", "```yaml\nname: demo\nreplicas: 2\nimage: nginx:1.25\n```\n\nChange the replicas "
            "to 3. Reply with the complete updated file in one ```yaml block and nothing else.",
            "name: demo\nreplicas: 2\nimage: nginx:1.25\n", 16),
    Request("warmup-open", "open", "Name three colours.", None, 16),
]


def warm_up(server: Server, tokenizer, width: int) -> None:
    """Untimed: first-call costs (JIT, continuous batching's start-up) on every path a level uses: one request
    alone, then `width` at once."""
    drive(server, WARMUP[:1], 1, -1, tokenizer)
    if width > 1:
        drive(server, (WARMUP * width)[:width], width, -1, tokenizer)


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-95 * len(ordered) // 100) - 1)]  # nearest rank


def summarize(results: list[Result], walls: dict, servers: list[str], levels: list[int]) -> dict:
    """Per (server, level) figures, and per level the ratios and the exactness counts."""
    by = {}
    for server in servers:
        for level in levels:
            rs = [r for r in results if r.server == server and r.level == level]
            ok = [r for r in rs if r.error is None]
            wall = sum(walls[(server, level, rep)] for rep in {r.rep for r in rs})
            row = {"requests": len(rs), "errors": len(rs) - len(ok), "wall_s": wall,
                   "median_s": statistics.median(r.seconds for r in ok) if ok else None,
                   "p95_s": p95([r.seconds for r in ok]) if ok else None,
                   "tok_s": sum(r.tokens for r in ok) / wall if ok else None}
            for kind in ("edit", "open"):
                times = [r.seconds for r in ok if r.kind == kind]
                row[f"median_{kind}_s"] = statistics.median(times) if times else None
            if server == "lookupdec":
                row["accepted"] = sum(r.accepted or 0 for r in ok)
                row["rejected"] = sum(r.rejected or 0 for r in ok)
            # Stable: the same text this server gave the same request at the lowest level of the run.
            base = {(r.rep, r.name): r.text for r in results if r.server == server and r.level == min(levels)}
            row["stable"] = sum(base.get((r.rep, r.name)) == r.text for r in ok)
            by[(server, level)] = row
    ratios = {}
    if set(SERVERS) <= set(servers):
        for level in levels:
            ld, tf = by[("lookupdec", level)], by[("transformers", level)]
            pairs = _pairs(results, level)
            ratios[level] = {
                "median_latency": _ratio(ld["median_s"], tf["median_s"]),
                "p95_latency": _ratio(ld["p95_s"], tf["p95_s"]),
                "throughput": _ratio(ld["tok_s"], tf["tok_s"]),
                "pairs": len(pairs), "identical": sum(a.text == b.text for a, b in pairs),
                "differences": [_difference(a, b) for a, b in pairs if a.text != b.text],
            }
    return {"servers": {f"{s}@{c}": row for (s, c), row in by.items()}, "ratios": ratios}


def _pairs(results, level):
    tf = {(r.rep, r.name): r for r in results if r.server == "transformers" and r.level == level and not r.error}
    return [(r, tf[(r.rep, r.name)]) for r in results
            if r.server == "lookupdec" and r.level == level and not r.error and (r.rep, r.name) in tf]


def _difference(ld: Result, tf: Result) -> dict:
    at = next((i for i, (a, b) in enumerate(zip(ld.text, tf.text)) if a != b), min(len(ld.text), len(tf.text)))
    return {"name": ld.name, "rep": ld.rep, "first_difference_at_char": at,
            "lookupdec": ld.text[max(0, at - 40): at + 40], "transformers": tf.text[max(0, at - 40): at + 40],
            "lookupdec_chars": len(ld.text), "transformers_chars": len(tf.text)}


def _ratio(a, b):
    return a / b if a is not None and b else None


def markdown(summary: dict, meta: dict) -> str:
    def f(v, digits=2):
        return "-" if v is None else f"{v:.{digits}f}"

    lookupdec_servers = ("one lookupdec server throughout" if meta["keep_cache"]
                         else "a fresh lookupdec server per level")
    lines = [(f"Run: {meta['date']}, {meta['machine']}, model {meta['model']}, {meta['requests']} requests "
              f"({meta['edits']} edits with a prediction for lookupdec, {meta['opens']} open) per level, "
              f"max_tokens={meta['max_tokens']}, greedy, reps={meta['reps']}, {meta['threads']} torch threads per "
              f"server, transformers serve in {meta['tf_mode']} mode, {lookupdec_servers}; "
              f"{meta['seconds']} s in all."), "",
             ("Per server and concurrency (latency in seconds per request; tok/s = output tokens over wall time; "
              "stable = same text as this server at the lowest level):"), "",
             ("| c | server | requests | errors | median s | p95 s | median edit s | median open s | out tok/s "
              "| accepted / rejected | stable |"), "|" + "---|" * 11]
    for key, row in summary["servers"].items():
        server, level = key.split("@")
        acc = f"{row['accepted']} / {row['rejected']}" if "accepted" in row else "-"
        lines.append(f"| {level} | {server} | {row['requests']} | {row['errors']} | {f(row['median_s'])} "
                     f"| {f(row['p95_s'])} | {f(row['median_edit_s'])} | {f(row['median_open_s'])} "
                     f"| {f(row['tok_s'], 1)} | {acc} | {row['stable']}/{row['requests'] - row['errors']} |")
    if summary["ratios"]:
        lines += ["", ("lookupdec / transformers, same run (latency < 1 and throughput > 1 favour lookupdec; "
                       "identical = same greedy text from both servers):"), "",
                  "| c | median latency | p95 latency | throughput | identical |", "|---|---|---|---|---|"]
        for level, r in summary["ratios"].items():
            lines.append(f"| {level} | {f(r['median_latency'])} | {f(r['p95_latency'])} | {f(r['throughput'])} "
                         f"| {r['identical']}/{r['pairs']} |")
        diffs = [(level, d) for level, r in summary["ratios"].items() for d in r["differences"]]
        if diffs:
            lines += ["", "Texts that differ (first differing character, 40 characters either side):", ""]
            for level, d in diffs:
                lines.append(f"- c={level} {d['name']} (rep {d['rep']}), char {d['first_difference_at_char']}: "
                             f"lookupdec {d['lookupdec']!r} / transformers {d['transformers']!r}")
    return "\n".join(lines) + "\n"


def benchmark(args, servers: dict, requests: list[Request], tokenizer) -> tuple[list[Result], dict, dict]:
    """Every (repetition, level) is a turn; in each, the servers run the requests one after the other, in an order
    that alternates from turn to turn. Unless --keep-cache, lookupdec gets a fresh server for each turn after the
    first: its in-memory rolling cache of earlier outputs would otherwise draft each repeated request from its own
    earlier answer, which no real workload offers. (transformers serve keeps running; its continuous batching shares
    KV blocks of repeated prompt prefixes, but only whole blocks of CB_PAGE_TOKENS; the workload's prompts, 165-230
    tokens with the chat template, fill none.)"""
    names = [s for s in SERVERS if s in servers]
    width = min(4, max(args.levels))
    for name in names:
        note(f"warming up {name}...")
        warm_up(servers[name], tokenizer, width)
    results, walls, cpu_share = [], {}, {}
    for turn, (rep, level) in enumerate(itertools.product(range(args.reps), args.levels)):
        order = names if turn % 2 == 0 else names[::-1]  # alternate who goes first: drift hits both alike
        for name in order:
            server = servers[name]
            if name == "lookupdec" and turn > 0 and not args.keep_cache:
                server.stop()
                server.start()
                server.wait_ready(args.startup_timeout)
                warm_up(server, tokenizer, width)
            cpu = server.cpu_seconds()
            rs, wall = drive(server, requests, level, rep, tokenizer)
            # The server's CPU time over the wall time: about its thread count when it had the cores to itself,
            # well below when another process took them (this machine is shared) or it waited on the client.
            busy = (server.cpu_seconds() - cpu) / wall if cpu is not None else None
            results += rs
            walls[(name, level, rep)] = wall
            cpu_share[(name, level, rep)] = busy
            ok = [r for r in rs if r.error is None]
            errors = [r.error for r in rs if r.error is not None]
            note(f"rep {rep} c={level} {name}: {wall:.1f} s, {sum(r.tokens for r in ok) / wall:.1f} tok/s, "
                 f"server CPU {busy or 0:.2f} of wall, load average {os.getloadavg()[0]:.1f}"
                 + (f", {len(errors)} errors (first: {errors[0]})" if errors else ""))
    return results, walls, cpu_share


# ---------------------------------------------------------------------------------------------------------------
# Soak


def soak(args, server: Server, requests: list[Request]) -> int:
    """lookupdec alone at concurrency 8 for `args.soak` seconds, ~5% malformed requests; returns the exit code."""
    url = server.url + "/v1/chat/completions"
    model = server.model_id

    def body(req: Request) -> dict:
        out = {"model": model, "messages": [{"role": "user", "content": req.user}], "max_tokens": req.max_tokens,
               "temperature": 0}
        if req.prediction is not None:
            out["prediction"] = {"type": "content", "content": req.prediction}
        return out

    good = body(requests[0])
    malformed = {  # kind -> raw request body
        "bad_json": b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", "content": "hi"',
        "n_2": json.dumps({**good, "n": 2}).encode(),
        "no_messages": json.dumps({"model": model, "max_tokens": 8}).encode(),
        "unknown_model": json.dumps({**good, "model": "no-such-model"}).encode(),
        "tools": json.dumps({**good, "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]}).encode(),
        # ~60k tokens: far past SmolLM2's 8,192-token context (and any small model's)
        "oversized": json.dumps({**good, "messages": [{"role": "user", "content": "lorem ipsum " * 30000}]}).encode(),
    }
    rss_ready = server.rss_mib()
    note(f"soak: reference outputs of {len(requests)} requests sent alone...")
    reference = {}
    for req in requests:
        status, raw = http_post(url, json.dumps(body(req)).encode(), REQUEST_TIMEOUT_S)
        if status != 200:
            raise BenchError(f"soak: {req.name} sent alone got HTTP {status}: {raw[:200]!r}")
        reference[req.name] = json.loads(raw)["choices"][0]["message"]["content"]

    lock = threading.Lock()
    tally = {"well_formed": 0, "well_formed_ok": 0, "status_5xx": 0, "failures": [],
             "malformed": {kind: {"sent": 0, "ok": 0, "statuses": {}} for kind in malformed}}

    def fail(what: str) -> None:
        with lock:
            if len(tally["failures"]) < 50:  # the first 50 say enough; the counts say the rest
                tally["failures"].append(what)

    def send_malformed(kind: str) -> None:
        status, raw = http_post(url, malformed[kind], 120)
        ok, why = _openai_error(status, raw)
        with lock:
            entry = tally["malformed"][kind]
            entry["sent"] += 1
            entry["ok"] += ok
            entry["statuses"][str(status)] = entry["statuses"].get(str(status), 0) + 1
            tally["status_5xx"] += status >= 500
        if not ok:
            fail(f"{kind}: {why}")

    def send_good(req: Request) -> None:
        status, raw = http_post(url, json.dumps(body(req)).encode(), REQUEST_TIMEOUT_S)
        with lock:
            tally["well_formed"] += 1
            tally["status_5xx"] += status >= 500
        if status != 200:
            fail(f"{req.name}: HTTP {status}: {raw[:200]!r}")
        elif json.loads(raw)["choices"][0]["message"]["content"] != reference[req.name]:
            fail(f"{req.name}: text differs from the same request sent alone")
        else:
            with lock:
                tally["well_formed_ok"] += 1

    for kind in malformed:  # each kind once on an idle server, so even a short soak covers them all
        send_malformed(kind)
    rss = [(0.0, server.rss_mib())]
    counter = itertools.count()
    kinds = itertools.cycle(malformed)
    start = time.monotonic()
    deadline = start + args.soak

    def worker() -> None:
        while time.monotonic() < deadline:
            with lock:
                i = next(counter)
                kind = next(kinds) if i % SOAK_MALFORMED_EVERY == SOAK_MALFORMED_EVERY - 1 else None
            try:
                send_malformed(kind) if kind else send_good(requests[i % len(requests)])
            except Exception as err:  # noqa: BLE001 - no answer, a body that is not JSON, ...: a failure, not a crash
                fail(f"{kind or requests[i % len(requests)].name}: {type(err).__name__}: {err}"[:300])

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(8)]
    for thread in workers:
        thread.start()
    next_note = 60
    while any(thread.is_alive() for thread in workers):
        time.sleep(5)
        rss.append((round(time.monotonic() - start, 1), server.rss_mib()))
        if time.monotonic() - start >= next_note:
            next_note += 60
            note(f"soak: {time.monotonic() - start:.0f}/{args.soak:.0f} s, {tally['well_formed']} well-formed, "
                 f"{sum(m['sent'] for m in tally['malformed'].values())} malformed, {len(tally['failures'])} "
                 f"failures, RSS {rss[-1][1]:.0f} MiB")
    alive = server.proc.poll() is None
    health = http_get(server.url + "/health", 5)[0] if alive else None
    sizes = [v for _, v in rss if v is not None]
    report = {"seconds": args.soak, "concurrency": 8, "max_tokens": requests[0].max_tokens,
              "rss_mib": {"ready": rss_ready, "start": rss[0][1], "end": rss[-1][1], "max": max(sizes)},
              "rss_timeline": rss, "alive_at_end": alive, "health_at_end": health, **tally}
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    n_bad = sum(m["sent"] for m in tally["malformed"].values())
    print(f"\nsoak {args.soak:.0f} s at concurrency 8: {tally['well_formed']} well-formed "
          f"({tally['well_formed_ok']} with the text they got alone), {n_bad} malformed "
          f"({sum(m['ok'] for m in tally['malformed'].values())} with a 4xx OpenAI error body), "
          f"{tally['status_5xx']} 5xx; server RSS {rss_ready:.0f} MiB when ready, {rss[0][1]:.0f} at the start of "
          f"the soak, {rss[-1][1]:.0f} at its end (max {max(sizes):.0f})")
    for kind, m in tally["malformed"].items():
        print(f"  {kind}: {m['ok']}/{m['sent']} right, statuses {m['statuses']}")
    for line in tally["failures"][:20]:
        print(f"  FAIL {line}")
    passed = not tally["failures"] and tally["status_5xx"] == 0 and alive and health == 200
    print("soak: " + ("passed" if passed else "FAILED") + f"; details in {args.out / 'soak.json'}")
    return 0 if passed else 1


def _openai_error(status: int, raw: bytes) -> tuple[bool, str]:
    """Whether a malformed request's answer is a 4xx with OpenAI's error body, and if not, why not."""
    if not 400 <= status < 500:
        return False, f"HTTP {status}, expected a 4xx: {raw[:160]!r}"
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return False, f"HTTP {status} without an OpenAI error body: {raw[:160]!r}"
    missing = {"message", "type", "param", "code"} - set(error if isinstance(error, dict) else ())
    if missing:
        return False, f"HTTP {status}, error body lacks {sorted(missing)}: {raw[:160]!r}"
    return True, ""


# ---------------------------------------------------------------------------------------------------------------


_T0 = time.perf_counter()


def note(line: str) -> None:
    """A progress line on stderr, stamped with the seconds since the start."""
    print(f"[{time.perf_counter() - _T0:6.0f} s] {line}", file=sys.stderr, flush=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="name, .gguf, folder or hub id as lookupdec.load_model takes it "
                                                  "(default: the embedded SmolLM2); it must have a chat template")
    ap.add_argument("--quick", action="store_true", help="8 requests, 96 tokens, 1 rep (~5-6 min on 2 idle cores)")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default 12; 8 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="max_tokens per request (default 256; 96 quick)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of every level (default 2; 1 quick)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8], help="concurrency levels")
    ap.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    ap.add_argument("--tf-mode", choices=TF_MODES, default=DEFAULT_TF_MODE,
                    help="transformers serve: model.generate one request at a time, or its continuous batching")
    # One thread by default: on a shared 2-core machine two threads ran 3.5x slower than one whenever another
    # process was busy (torch's threads wait on each other at every op), and the client needs a core too.
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each server (default 1)")
    ap.add_argument("--device", default="cpu", help="device of both servers: cpu, cuda, cuda:N (default cpu)")
    ap.add_argument("--dtype", choices=list(TORCH_DTYPES), default="fp32", help="dtype of both servers")
    ap.add_argument("--keep-cache", action="store_true",
                    help="one lookupdec server for the whole run, so its rolling cache of earlier outputs sees every "
                         "request again at each later level (default: a fresh server per level and repetition)")
    ap.add_argument("--max-batch", type=int, default=None, help="lookupdec serve --max-batch (default: its own)")
    ap.add_argument("--max-queue", type=int, default=None, help="lookupdec serve --max-queue (default: its own)")
    ap.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S)
    ap.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                    help="soak lookupdec alone at concurrency 8 for SECONDS, ~5%% malformed requests")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    args.requests = args.requests or (8 if args.quick else 12)
    args.max_tokens = args.max_tokens or (96 if args.quick else 256)
    args.reps = args.reps or (1 if args.quick else 2)
    args.levels = sorted(set(args.levels))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.soak:
        args.servers = ["lookupdec"]
        args.max_tokens = min(args.max_tokens, 64)  # short requests: many of them, and malformed ones in between

    # A SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, through the finally that stops the servers.
    signal.signal(signal.SIGTERM, _interrupt)
    servers = {}
    try:
        _openai()
        requests = build_requests(args.requests, args.max_tokens)
        source, tokenizer = model_source(args.model)
        env = server_env(args.threads)
        if "lookupdec" in args.servers:
            servers["lookupdec"] = lookupdec_server(args, env)
        if "transformers" in args.servers:
            blocks = cb_blocks([*requests, *WARMUP], tokenizer, max(args.levels))
            servers["transformers"] = transformers_server(args, env, source, blocks)
        for server in servers.values():  # one after the other: two loads at once would each take twice as long
            server.start()
            note(f"starting {server.name}: {' '.join(server.argv)}")
            server.wait_ready(args.startup_timeout)
            note(f"{server.name} ready in {server.ready_s:.1f} s, model {server.model_id!r}, "
                 f"RSS {server.rss_mib():.0f} MiB")
        if args.soak:
            return soak(args, servers["lookupdec"], requests)
        started = time.perf_counter()
        load = os.getloadavg()
        results, walls, cpu_share = benchmark(args, servers, requests, tokenizer)
        summary = summarize(results, walls, [s for s in SERVERS if s in servers], args.levels)
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model or "SmolLM2-135M-Instruct (embedded)",
            "source": source, "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
            f"{args.device} {args.dtype}", "threads": args.threads, "tf_mode": args.tf_mode,
            "requests": len(requests), "edits": sum(r.kind == "edit" for r in requests),
            "opens": sum(r.kind == "open" for r in requests), "max_tokens": args.max_tokens, "reps": args.reps,
            "levels": args.levels, "keep_cache": args.keep_cache, "seconds": round(time.perf_counter() - started, 1),
            "load_average_at_start": load, "load_average_at_end": os.getloadavg(),
            "servers": {s.name: {"argv": s.argv, "ready_s": round(s.ready_s, 1), "model_id": s.model_id,
                                 "starts": s.starts, "rss_mib_end": s.rss_mib()} for s in servers.values()},
            "command": "python -m benchmarks.serve " + " ".join(sys.argv[1:] if argv is None else argv),
        }
        (args.out / "serve.json").write_text(json.dumps(
            {"meta": meta, "summary": {**summary, "ratios": {str(k): v for k, v in summary["ratios"].items()}},
             "turns": {f"{s}@{c}#{rep}": {"wall_s": w, "server_cpu_share": cpu_share[(s, c, rep)]}
                       for (s, c, rep), w in walls.items()},
             "results": [asdict(r) for r in results]}, indent=1))
        table = markdown(summary, meta)
        (args.out / "serve.md").write_text(table)
        print(table)
        print(f"results in {args.out / 'serve.json'} and {args.out / 'serve.md'}", file=sys.stderr)
        return 0
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; stopping the servers", file=sys.stderr)
        return 130
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
