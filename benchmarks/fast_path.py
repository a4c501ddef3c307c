"""Plain decoding on transformers' fast path, measured before lookupdec is given it (issue 26, first step).

For each torch thread count, a fresh process per system loads the embedded model and greedily decodes one prompt
per suite (a YAML edit, a code edit, a summary, a context question, an open-ended one), timing the first call on
the first prompt (which pays any compilation) and then every prompt twice:

- ``eager``: plain ``model.generate``, dynamic cache (what lookupdec's plain baseline is today);
- ``static``: ``cache_implementation="static"`` (a preallocated KV cache), eager forward;
- ``compiled``: the static cache with ``torch.compile`` of the forward (inductor), as transformers documents its
  fast path; run twice, in two processes, on one fresh inductor cache, so the first pays the compile cold and the
  second shows a later start;
- ``lookupdec``: ``lookupdec.generate`` as it ships (eager, dynamic cache), for the ratio that matters.

Every system's text is compared with ``eager``'s. Ratios are within one run: systems run one after the other on
an idle machine, prompts in the same order.

    python -m benchmarks.fast_path --out /tmp/fast      # ~20-30 min on 2 idle cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMS = ("eager", "static", "compiled", "compiled", "lookupdec")


def child(system: str, threads: int, max_new_tokens: int) -> dict:
    import torch

    import lookupdec
    from lookupdec import load_model

    from .run import encode
    from .workloads import SUITES

    torch.set_num_threads(threads)
    model, tokenizer = load_model(device="cpu")
    prompts = [items[0] for items in (SUITES[s]() for s in ("yaml", "code", "summary", "qa", "open")) if items]
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if system in ("static", "compiled"):
        model.generation_config.cache_implementation = "static"
    if system == "compiled":
        model.forward = torch.compile(model.forward)  # as transformers documents it (prefill shapes go dynamic)

    def decode(ids):
        with torch.inference_mode():
            if system == "lookupdec":
                return lookupdec.generate(model, ids, **kwargs).sequences[0, ids.shape[1]:].tolist()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            return out[0, ids.shape[1]:].tolist()

    encoded = [encode(tokenizer, p.user) for p in prompts]
    started = time.perf_counter()
    decode(encoded[0])
    first = time.perf_counter() - started
    runs = []
    for rep in range(2):
        for prompt, ids in zip(prompts, encoded):
            started = time.perf_counter()
            tokens = decode(ids)
            runs.append({"prompt": prompt.name, "suite": prompt.suite, "rep": rep, "tokens": tokens,
                         "seconds": time.perf_counter() - started})
    return {"system": system, "threads": threads, "first_call_s": first, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/fast_path"))
    ap.add_argument("--child", nargs=2, metavar=("SYSTEM", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.max_new_tokens)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for threads in args.threads:
        inductor = tempfile.mkdtemp(prefix="inductor-")  # cold for the first compiled run, warm for the second
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, OMP_NUM_THREADS=str(threads),
                   NUMBA_NUM_THREADS="1")
        for system in SYSTEMS:
            started = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "benchmarks.fast_path", "--child", system, str(threads),
                                   "--max-new-tokens", str(args.max_new_tokens)],
                                  capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(f"{system} at {threads} thread(s) failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            result["process_s"] = time.perf_counter() - started
            result["start"] = "warm" if system == "compiled" and any(
                r["system"] == "compiled" and r["threads"] == threads for r in results) else "cold"
            results.append(result)
            print(f"{system:9s} threads={threads} start={result['start']} first call {result['first_call_s']:.1f} s, "
                  f"process {result['process_s']:.0f} s", flush=True)
    (args.out / "fast_path.json").write_text(json.dumps(results, indent=1))
    report = render(results)
    (args.out / "fast_path.md").write_text(report)
    print(report)


def render(results: list) -> str:
    lines = []
    for threads in sorted({r["threads"] for r in results}):
        mine = [r for r in results if r["threads"] == threads]
        eager = next((r for r in mine if r["system"] == "eager"), None)
        if eager is None:
            continue
        reference = {(x["prompt"], x["rep"]): x for x in eager["runs"]}
        suites = list(dict.fromkeys(x["suite"] for x in eager["runs"]))
        lines += [f"\n{threads} thread(s); speed = eager's seconds / the system's, median of 2 reps per prompt\n",
                  "| system | start | first call s | " + " | ".join(suites) + " | identical to eager |",
                  "|---|---|---|" + "---|" * len(suites) + "---|"]
        for r in mine:
            cells, same = [], True
            for suite in suites:
                ratios = []
                for x in r["runs"]:
                    if x["suite"] == suite:
                        ref = reference[(x["prompt"], x["rep"])]
                        ratios.append(ref["seconds"] / x["seconds"])
                        same &= x["tokens"] == ref["tokens"]
                cells.append(f"{statistics.median(ratios):.2f}x")
            lines.append(f"| {r['system']} | {r['start']} | {r['first_call_s']:.1f} | " + " | ".join(cells)
                         + f" | {'yes' if same else 'no'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
