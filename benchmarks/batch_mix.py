"""The server's request mix through the batch loop, in-process: what the drafting policy does to a mixed batch.

`benchmarks/serve.py` measures the server against `transformers serve` over HTTP; this runs the same requests
(`serve.build_requests`: three edits with the file as prediction for each open-ended prompt) through
`lookupdec.batch.BatchRun` directly, as the server's engine does, in a closed loop at one concurrency: a request
joins when a row frees (prefilled alone, then appended to the batch), and leaves when done. No HTTP, no second
server, so the policy's effect is seen without the noise of either. Greedy; one torch thread by default.

    python -m benchmarks.batch_mix --concurrency 8                       # 8 requests, 96 tokens
    python -m benchmarks.batch_mix --concurrency 4 --requests 12 --max-tokens 256
    python -m benchmarks.batch_mix --concurrency 8 --batch-slowdown inf  # without the per-row bound
    python -m benchmarks.batch_mix --concurrency 8 --no-lookup           # plain batched greedy

Prints one line per request (latency from joining the queue, passes, drafted and accepted tokens) and a summary:
output tokens per second over the wall time, and the median latency of edits and of open-ended requests.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

import numpy as np
import torch

from benchmarks.serve import build_requests
from lookupdec._transformers import resolve_generation
from lookupdec.batch import BatchRun, Row
from lookupdec.calibration import calibrate_or_warn
from lookupdec.drafter import Drafter, DrafterConfig, NoDrafts
from lookupdec.models import load_model
from lookupdec.verify import verify_greedy


def _row(model, tokenizer, drafter, req, lookup: bool) -> Row:
    text = tokenizer.apply_chat_template([{"role": "user", "content": req.user}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = torch.tensor([ids], dtype=torch.long)
    resolved = resolve_generation(model, prompt, max_new_tokens=req.max_tokens, generation_config=None,
                                  logits_processor=None, stopping_criteria=None, do_sample=False)
    if lookup:
        prediction = tokenizer.encode(req.prediction, add_special_tokens=False) if req.prediction else None
        session = drafter.start(np.asarray(ids, dtype=np.int32), eos_ids=resolved.eos_ids, prediction=prediction)
    else:
        session = NoDrafts()
    return Row(prompt, resolved, session, req.max_tokens, lambda logits, draft, process, position:
               verify_greedy(logits, draft, process), owner=req)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, progress=False)
    drafter = Drafter(DrafterConfig(batch_slowdown=args.batch_slowdown))
    rows = 1
    while True:  # the buckets the server's engine measures at its start
        calibrate_or_warn(drafter, model, None, rows=rows)
        if rows >= args.concurrency:
            break
        rows = min(rows * 2, drafter.batch_rows(args.concurrency))
    requests = build_requests(args.requests, args.max_tokens)
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long))
        batch = BatchRun(model, drafter)
        queue, joined, results = deque(requests), {}, []
        start = time.perf_counter()
        while queue or batch.rows:
            while queue and len(batch.rows) < args.concurrency:
                req = queue.popleft()
                joined[req.name] = time.perf_counter()
                batch.join(_row(model, tokenizer, drafter, req, not args.no_lookup))
            for row in batch.step():
                req = row.owner
                results.append({"name": req.name, "kind": req.kind, "seconds": time.perf_counter() - joined[req.name],
                                "tokens": row.generated, "passes": row.stats.target_passes,
                                "drafted": row.stats.drafted_tokens, "accepted": row.stats.accepted_tokens})
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    for r in results:
        print(f"  {r['name']:28s} {r['kind']:5s} {r['seconds']:6.1f} s  {r['tokens']:4d} tokens  {r['passes']:4d} "
              f"passes  drafted {r['drafted']:4d}  accepted {r['accepted']:4d}")

    def median(kind):
        values = [r["seconds"] for r in results if r["kind"] == kind]
        return statistics.median(values) if values else float("nan")

    summary = {"concurrency": args.concurrency, "requests": len(results), "wall_s": wall, "tok_s": tokens / wall,
               "edit_median_s": median("edit"), "open_median_s": median("open"),
               "open_max_s": max((r["seconds"] for r in results if r["kind"] == "open"), default=float("nan"))}
    print(f"c={args.concurrency} lookup={'off' if args.no_lookup else 'on'} batch_slowdown={args.batch_slowdown}: "
          f"{summary['tok_s']:.1f} tok/s over {wall:.1f} s; median latency: edits {summary['edit_median_s']:.1f} s, "
          f"open-ended {summary['open_median_s']:.1f} s (slowest {summary['open_max_s']:.1f} s)")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="as lookupdec.load_model takes it (default: the embedded model)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch-slowdown", type=float, default=DrafterConfig.batch_slowdown,
                    help="DrafterConfig.batch_slowdown (inf: no per-row bound)")
    ap.add_argument("--no-lookup", action="store_true", help="plain batched greedy (no drafts)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.concurrency < 1 or args.requests < 1 or args.max_tokens < 1:
        ap.error("--concurrency, --requests and --max-tokens must be >= 1")
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
