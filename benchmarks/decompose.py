"""Where lookupdec's time goes against plain decoding, prompt by prompt: prefill, undrafted and drafted passes.

For each prompt, plain greedy ``model.generate`` and ``lookupdec.generate`` (a fresh, calibrated drafter, with a
:class:`~lookupdec.trace.TraceRecorder`) run alternately, ``--reps`` times each, eager, one torch thread; the
fastest run of each is kept (interference only adds time). Plain decoding is also run for one token, which times
its prefill. From these, per prompt and summed per suite:

- ``plain step``: plain decoding's time per token after the prefill, ``(plain - prefill) / (tokens - 1)``;
- ``undrafted pass / plain step``: lookupdec's passes that checked no draft, against that step (its loop's
  own cost: 1.0 is none);
- ``drafted passes / plain time of their tokens``: the time of the passes that checked a draft against what plain
  decoding would have spent on the tokens they produced (below 1.0: drafting paid);
- ``drafted passes / their price``: their time against the drafter's price for them (its pass-cost profile at the
  end of the run, times the plain step): above 1.0, drafts cost more than the drafter believed;
- ``outside passes``: lookupdec's time that was neither a pass nor plain decoding's prefill (drafting, the loop,
  the calibration lookup), as a share of its total.

Greedy only, so every lookupdec output is checked against plain decoding's, token for token.

    python -m benchmarks.decompose --suites summary qa --per-suite 4 --out /tmp/decompose
    python -m benchmarks.decompose --suites yaml summary qa open --per-suite 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

import lookupdec
from lookupdec import LookupDrafter, load_model
from lookupdec._fs import atomic_write
from lookupdec.calibration import calibrate_or_warn
from lookupdec.trace import TraceRecorder

from .prompts import encode
from .workloads import SUITES


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def measure(model, ids: torch.Tensor, max_new_tokens: int, reps: int) -> dict:
    """One prompt: the fastest of ``reps`` alternating runs of each system, and lookupdec's trace of that run."""
    mask = torch.ones_like(ids)
    best_plain, best_prefill, best = None, None, None
    for _ in range(reps):
        with torch.inference_mode():
            prefill, _ = _timed(lambda: model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=1))
            plain_s, plain = _timed(lambda: model.generate(ids, attention_mask=mask, do_sample=False,
                                                           max_new_tokens=max_new_tokens))
        drafter, trace = LookupDrafter(), TraceRecorder()
        calibrate_or_warn(drafter, model)  # from memory after the first prompt: not this measurement's subject
        ours_s, ours = _timed(lambda: lookupdec.generate(model, ids, attention_mask=mask, drafter=drafter,
                                                         trace=trace, max_new_tokens=max_new_tokens))
        best_prefill = prefill if best_prefill is None else min(best_prefill, prefill)
        best_plain = plain_s if best_plain is None else min(best_plain, plain_s)
        if best is None or ours_s < best[0]:
            best = (ours_s, ours, trace, drafter)
    ours_s, ours, trace, drafter = best
    plain_new = plain[0, ids.shape[1]:].tolist()
    steps = trace.steps
    return {
        "prompt_tokens": ids.shape[1],
        "plain_s": best_plain, "prefill_s": best_prefill, "plain_tokens": len(plain_new),
        "lookupdec_s": ours_s, "identical": ours.sequences[0, ids.shape[1]:].tolist() == plain_new,
        "steps": [(len(s.draft), s.accepted, s.kept, s.seconds) for s in steps],
        "price": drafter.cost.costs(drafter.drafter_config.max_draft).tolist(),
    }


def decompose(records: list) -> dict:
    """Sums over ``records`` (one suite's prompts, from :func:`measure`): the figures in the module docstring."""
    plain = sum(r["plain_s"] for r in records)
    ours = sum(r["lookupdec_s"] for r in records)
    decode_tokens = sum(r["plain_tokens"] - 1 for r in records)
    # Per prompt, so that each prompt's passes are compared with its own plain step (context lengths differ).
    undrafted_s = undrafted_ref = drafted_s = drafted_plain = drafted_price = passes_s = 0.0
    undrafted = drafted = drafted_tokens = drafted_len = 0
    for r in records:
        step = (r["plain_s"] - r["prefill_s"]) / max(r["plain_tokens"] - 1, 1)
        price = np.asarray(r["price"])
        for d, _accepted, kept, seconds in r["steps"][1:]:  # the first is the prefill
            passes_s += seconds
            if d == 0:
                undrafted += 1
                undrafted_s += seconds
                undrafted_ref += step
            else:
                drafted += 1
                drafted_len += d
                drafted_tokens += kept
                drafted_s += seconds
                drafted_plain += kept * step
                drafted_price += price[min(d, len(price) - 1)] * step
        passes_s += r["steps"][0][3] if r["steps"] else 0.0
    prefill = sum(r["prefill_s"] for r in records)
    return {
        "prompts": len(records),
        "identical": sum(r["identical"] for r in records),
        "speedup": plain / ours,
        "prefill_share_of_plain": prefill / plain,
        "decode_speedup": (plain - prefill) / max(ours - prefill, 1e-9),
        "undrafted_passes": undrafted,
        "undrafted_vs_plain_step": undrafted_s / undrafted_ref if undrafted else None,
        "drafted_passes": drafted,
        "mean_draft": drafted_len / drafted if drafted else None,
        "tokens_per_drafted_pass": drafted_tokens / drafted if drafted else None,
        "drafted_vs_plain_time": drafted_s / drafted_plain if drafted else None,
        "drafted_vs_price": drafted_s / drafted_price if drafted else None,
        "outside_passes_share": (ours - passes_s) / ours,
        "plain_tokens_per_s": decode_tokens / max(plain - prefill, 1e-9),
    }


COLUMNS = [("prompts", "{}"), ("identical", "{}"), ("speedup", "{:.2f}x"), ("decode_speedup", "{:.2f}x"),
           ("prefill_share_of_plain", "{:.0%}"), ("undrafted_passes", "{}"), ("undrafted_vs_plain_step", "{:.2f}"),
           ("drafted_passes", "{}"), ("mean_draft", "{:.1f}"), ("tokens_per_drafted_pass", "{:.2f}"),
           ("drafted_vs_plain_time", "{:.2f}"), ("drafted_vs_price", "{:.2f}"), ("outside_passes_share", "{:.1%}")]


def markdown(table: dict) -> str:
    lines = ["| suite | " + " | ".join(name.replace("_", " ") for name, _ in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for suite, row in table.items():
        cells = ["-" if row[name] is None else fmt.format(row[name]) for name, fmt in COLUMNS]
        lines.append(f"| {suite} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suites", nargs="+", default=["summary", "qa"], choices=sorted(SUITES))
    ap.add_argument("--per-suite", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="folder for decompose.json and decompose.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    calibrate_or_warn(LookupDrafter(), model)
    records = {}
    for suite in args.suites:
        prompts = SUITES[suite]()[: args.per_suite]
        if not prompts:
            print(f"skipping suite {suite}: its data is not available (../shared/data)", file=sys.stderr)
            continue
        records[suite] = []
        for prompt in prompts:
            rec = measure(model, encode(tokenizer, prompt.user), args.max_new_tokens, args.reps)
            rec["name"] = prompt.name
            records[suite].append(rec)
            print(f"{prompt.name}: {rec['plain_s'] / rec['lookupdec_s']:.2f}x, identical={rec['identical']}",
                  file=sys.stderr)
    table = {suite: decompose(recs) for suite, recs in records.items()}
    text = markdown(table)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with atomic_write(args.out / "decompose.json") as f:
            json.dump({"args": {k: str(v) for k, v in vars(args).items()}, "table": table, "records": records}, f,
                      indent=1)
        with atomic_write(args.out / "decompose.md") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
