"""Replay ``benchmarks/serve.py``'s closed loop on a simulated engine that pays per scheduled token, as vLLM does.

The vLLM runs of issue 24 cost about 26 minutes for one interleaved comparison, and identical runs differ by 10%:
too slow and too noisy to choose a drafting policy by. Under greedy decoding what a draft gets accepted is fixed
by the target's output, so this script computes each request's greedy answer once (transformers, the embedded
model, the chat template vLLM applies; cached in ``--out``), then replays the benchmark's requests through a
simulated engine:

- ``--levels``: that many clients, each sending the next request in ``build_requests``' order when its last one ends
  (the benchmark's closed loop); an admitted request's prompt is prefilled within the next step, which also
  yields its first token (vLLM's chunked prefill, one chunk);
- a step costs ``base + per_token * tokens`` (:class:`lookupdec.policy.TokenCost`'s line; defaults: the line the
  proposer fitted on the served vLLM passes, ``benchmarks/RESULTS.md``), its tokens being each decoding row's last
  token and its draft, and the prefills;
- after every step the policy under study drafts for each decoding row through lookupdec's own driver (a
  ``Drafter`` shared by all requests, so the rolling cache works as on the server; ``session.offer`` and
  ``session.take``, as :class:`lookupdec.vllm.proposer.LookupProposer` does), each row keeps the longest prefix
  of its draft that matches its answer, plus one token.

It reports what ``benchmarks/serve.py`` reports against plain decoding (the same loop without drafts):
throughput, the median edit speed and each open-ended request's speed (plain latency over simulated).

``--like C`` and ``--interval S`` replace the closed loop by an open one, as ``benchmarks/serve.py --interval``
does: requests arrive at a fixed interval (S seconds, or the one at which plain decoding's closed loop of C clients
sent them), the same for both engines, so that a faster engine is not also handed more work while an open-ended
request runs.

It is a tuning tool: the truth is the served run. It cannot see what the real engine adds (the scheduler's own
time, the processes' contention on two cores, the noise), so compare policies with it, and confirm a choice with
``benchmarks/serve.py``.

Examples::

    python -m research.serve_sim --out /tmp/serve_sim
    python -m research.serve_sim --out /tmp/serve_sim --policies unbounded slowdown:0.25 cap:24
    python -m research.serve_sim --out /tmp/serve_sim --levels 8 --like 1 4 8 --policies unbounded oracle-edits:256
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.run import encode
from benchmarks.serve import build_requests
from lookupdec._fs import atomic_write
from lookupdec.drafter import Drafter, DrafterConfig
from lookupdec.policy import token_lengths
from lookupdec.vllm.launch import MAX_DRAFT

# What the proposer's own fit found on the served passes (RESULTS.md, issue 24): 48-52 ms + 2.6-2.8 ms a token.
BASE_S, PER_TOKEN_S = 0.050, 0.0027


@dataclass
class Job:
    name: str
    kind: str
    prompt: list
    answer: list  # greedy output, EOS included where the model stopped
    prediction: list | None
    max_tokens: int


@dataclass
class Live:
    job: Job
    admitted: float
    done: int = 0  # answer tokens committed
    session: object = None
    draft: list = field(default_factory=list)


def answers(out: Path, n_requests: int, max_tokens: int) -> tuple:
    """The benchmark's requests as token ids with their greedy answers (computed once, then read from ``out``)."""
    path = out / f"answers_{n_requests}_{max_tokens}.json"
    if path.exists():
        data = json.loads(path.read_text())
        return [Job(**j) for j in data["jobs"]], data["eos"]
    import torch

    from lookupdec.models import load_model

    model, tok = load_model(None)
    stop = model.generation_config.eos_token_id
    eos = int(stop if isinstance(stop, int) else stop[0])
    jobs = []
    for req in build_requests(n_requests, max_tokens):
        prompt = encode(tok, req.user)  # the chat template, as vLLM's OpenAI server applies it
        with torch.inference_mode():
            seq = model.generate(prompt, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos)[0, prompt.shape[1]:].tolist()
        pred = None if req.prediction is None else tok(req.prediction, add_special_tokens=False)["input_ids"]
        jobs.append(Job(req.name, req.kind, prompt[0].tolist(), seq, pred, max_tokens))
        print(f"  {req.name}: {prompt.shape[1]} prompt tokens, {len(seq)} answer tokens", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        f.write(json.dumps({"eos": eos, "jobs": [j.__dict__ for j in jobs]}))
    return jobs, eos


def policy_lengths(policy: str, offers, base: float, per_token: float, margin: float) -> list:
    """Each decoding row's draft length under ``policy``: ``unbounded`` (the proposer as committed),
    ``slowdown:S`` (a pass at most ``1 + S`` plain ones), ``cap:N`` (at most N drafted tokens a step). No prefill
    is priced beside the drafts: the proposer cannot know which prompts the next step will prefill."""
    kind, _, arg = policy.partition(":")
    if kind == "unbounded":
        return token_lengths(offers, base, per_token, margin=margin)
    if kind == "slowdown":
        return token_lengths(offers, base, per_token, margin=margin, slowdown=float(arg))
    if kind == "cap":
        lengths = token_lengths(offers, base, per_token, margin=margin)
        cap = int(arg)
        while sum(lengths) > cap:  # trim the longest draft first: its last token is the least likely kept
            lengths[int(np.argmax(lengths))] -= 1
        return lengths
    raise ValueError(f"unknown policy {policy!r}")


def run(jobs: list, eos: int, concurrency: int, policy: str | None, base: float, per_token: float,
        prefill_share: float = 1.0, max_draft: int = MAX_DRAFT, interval: float | None = None) -> dict:
    """One pass over ``jobs``; ``policy`` None is plain decoding. ``interval`` None is the closed loop of
    ``concurrency`` clients; a number is an open loop: request i arrives at ``i * interval`` seconds whatever the
    engine does, and waits while ``concurrency`` rows (vLLM's ``--max-num-seqs``) are running. Returns the wall
    time, each request's latency (its arrival, or its admission in the closed loop, to its last token) and the
    mean number of running rows over the steps."""
    lookup = policy is not None and not policy.startswith("oracle")
    drafter = Drafter(DrafterConfig(max_draft=max_draft, calibrate=False)) if lookup else None
    arrival = {j.name: (0.0 if interval is None else i * interval) for i, j in enumerate(jobs)}
    queue, live, latency, clock = list(jobs), [], {}, 0.0
    tokens_out, rows_stepped, steps = 0, 0, 0
    while queue or live:
        if not live and queue and arrival[queue[0].name] > clock:
            clock = arrival[queue[0].name]  # the engine idles until the next request arrives
        admitted = []
        while queue and len(live) + len(admitted) < concurrency and arrival[queue[0].name] <= clock:
            job = queue.pop(0)
            admitted.append(Live(job, clock if interval is None else arrival[job.name]))
        rows_stepped, steps = rows_stepped + len(live) + len(admitted), steps + 1
        tokens = sum(1 + len(r.draft) for r in live) + prefill_share * sum(len(r.job.prompt) for r in admitted)
        clock += base + per_token * tokens
        for r in live:  # verify: the longest matching prefix of the draft, plus one target token
            truth = r.job.answer[r.done:]
            keep = 0
            while keep < len(r.draft) and keep < len(truth) - 1 and r.draft[keep] == truth[keep]:
                keep += 1
            new = truth[: keep + 1]
            r.done += len(new)
            if r.session is not None:
                r.session.commit(new)
        for r in admitted:  # the prefill yields the first token
            r.done = 1
            if drafter is not None:
                r.session = drafter.start(r.job.prompt, eos_ids=[eos], prediction=r.job.prediction)
                r.session.commit(r.job.answer[:1])
        live += admitted
        for r in [r for r in live if r.done >= len(r.job.answer)]:
            latency[r.job.name] = clock - r.admitted
            tokens_out += len(r.job.answer)
            if r.session is not None:
                r.session.finish()
            live.remove(r)
        for r in live:
            r.draft = []
        if policy is not None and policy.startswith("oracle") and live:
            # A bound no drafter reaches: the true continuation, free of waste, up to N tokens; "oracle-edits"
            # drafts for edit requests only (the open-ended ones have nothing to copy).
            most = int(policy.partition(":")[2] or max_draft)
            for r in live:
                if r.job.kind == "edit" or not policy.startswith("oracle-edits"):
                    r.draft = r.job.answer[r.done:r.done + most][: len(r.job.answer) - r.done - 1]
        elif drafter is not None and live:
            # As the proposer: room left under max_tokens (it cannot know where the answer will stop).
            limits = [min(max_draft, r.job.max_tokens - r.done - 1) for r in live]
            rows = [(r, lim) for r, lim in zip(live, limits) if lim > 0]
            offers = [r.session.offer(lim) for r, lim in rows]
            lengths = policy_lengths(policy, offers, base, per_token, margin=drafter.drafter_config.margin())
            for (r, _), length in zip(rows, lengths):
                r.draft = [int(t) for t in r.session.take(length)]
    return {"wall": clock, "latency": latency, "tokens": tokens_out, "rows": rows_stepped / max(steps, 1)}


def matched_interval(jobs, eos, like: int, base: float, per_token: float, prefill_share: float = 1.0) -> float:
    """The open loop's interval for the offered load of plain decoding's closed loop of ``like`` clients: that
    loop's wall time over its requests."""
    return run(jobs, eos, like, None, base, per_token, prefill_share)["wall"] / len(jobs)


def compare(jobs, eos, concurrency, policies, base, per_token, prefill_share=1.0, max_draft=MAX_DRAFT,
            interval=None) -> list:
    plain = run(jobs, eos, concurrency, None, base, per_token, prefill_share, interval=interval)
    kinds = {j.name: j.kind for j in jobs}
    rows = []
    for policy in policies:
        got = run(jobs, eos, concurrency, policy, base, per_token, prefill_share, max_draft, interval)
        speed = {n: plain["latency"][n] / got["latency"][n] for n in got["latency"]}
        opens = sorted(round(s, 2) for n, s in speed.items() if kinds[n] == "open")
        edits = [s for n, s in speed.items() if kinds[n] == "edit"]
        rows.append({"c": concurrency, "policy": policy, "throughput": plain["wall"] / got["wall"],
                     "edit_median": statistics.median(edits), "open": opens,
                     "plain_rows": plain["rows"], "rows": got["rows"]})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/serve_sim"))
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--policies", nargs="+", default=["unbounded", "slowdown:1.0", "slowdown:0.25", "cap:24"],
                    help="unbounded (the proposer as committed), slowdown:S, cap:N, and the bounds oracle[:N] (every "
                         "row drafts its true answer, N tokens at most) and oracle-edits[:N] (edit requests only)")
    ap.add_argument("--base-ms", type=float, default=BASE_S * 1e3)
    ap.add_argument("--per-token-ms", type=float, default=PER_TOKEN_S * 1e3)
    ap.add_argument("--prefill-share", type=float, default=1.0,
                    help="what a prompt token costs against a decoding one (0: prefills free, to isolate them)")
    ap.add_argument("--max-draft", type=int, default=MAX_DRAFT,
                    help=f"the longest draft (lookupdec serve --engine vllm asks vLLM for {MAX_DRAFT})")
    loop = ap.add_mutually_exclusive_group()
    loop.add_argument("--like", type=int, nargs="+", default=None, metavar="C",
                      help="open loop instead: requests arrive at a fixed interval, the one at which plain decoding's "
                           "closed loop of C clients sent them on average (its wall time over the requests), so both "
                           "engines get the same offered load; --levels is then the most running rows (vLLM's "
                           "--max-num-seqs, 8 as served)")
    loop.add_argument("--interval", type=float, nargs="+", default=None, metavar="S",
                      help="open loop, a request every S seconds (benchmarks/serve.py --interval)")
    args = ap.parse_args(argv)
    jobs, eos = answers(args.out, args.requests, args.max_tokens)
    base, per_token = args.base_ms / 1e3, args.per_token_ms / 1e3
    print(f"step = {args.base_ms} ms + {args.per_token_ms} ms per scheduled token; ratios against plain decoding "
          f"in the same simulated loop")
    if args.like is None and args.interval is None:
        print("| c | policy | throughput | median edit speed | open-ended speed, per request |")
        print("|---|---|---|---|---|")
        for c in args.levels:
            for row in compare(jobs, eos, c, args.policies, base, per_token, args.prefill_share, args.max_draft):
                opens = ", ".join(f"{s:.2f}" for s in row["open"])
                print(f"| {c} | {row['policy']} | {row['throughput']:.2f}x | {row['edit_median']:.2f}x | {opens} |")
        return
    print("| load like c | interval s | most rows | policy | mean rows, plain / policy | median edit speed "
          "| open-ended speed, per request |")
    print("|---|---|---|---|---|---|---|")
    loads = [(f"{like}", matched_interval(jobs, eos, like, base, per_token, args.prefill_share))
             for like in args.like or []] + [("-", interval) for interval in args.interval or []]
    for like, interval in loads:
        for c in args.levels:
            for row in compare(jobs, eos, c, args.policies, base, per_token, args.prefill_share, args.max_draft,
                               interval):
                opens = ", ".join(f"{s:.2f}" for s in row["open"])
                print(f"| {like} | {interval:.2f} | {c} | {row['policy']} | {row['plain_rows']:.1f} / "
                      f"{row['rows']:.1f} | {row['edit_median']:.2f}x | {opens} |")


if __name__ == "__main__":
    main()
