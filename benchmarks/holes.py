"""What masked holes cost a batched pass, and what squeezing them out costs.

A row that accepts nothing beside rows that accept many keeps masked slots ("holes") in a batch's cache until
:func:`lookupdec.batch._compact` squeezes them out. Every pass still reads them. This tool times passes of ``--rows``
rows, each holding ``--tokens`` tokens, over caches of several widths (``--widths``: the tokens plus holes), for
passes of 1 token per row (a plain step) and of ``--spans`` tokens (a drafted pass), against the cache without holes
in the same run; then one compaction of each width down to the tokens. The holes are spread at random, as drafts
leave them; the model and its threads are the ones given.

Writes ``holes.json`` and ``holes.md`` to ``--out``.

Example::

    python -m benchmarks.holes                          # SmolLM2, 4 rows of 300 tokens, widths 300 450 664
    python -m benchmarks.holes --rows 8 --widths 300 400 500 --spans 1 17
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _cache(model, rows: int, tokens: int, width: int, seed: int):
    """A batch cache `width` slots wide whose every row holds `tokens` tokens, at random slots; (cache, mask)."""
    from lookupdec._transformers import batch_cache, forward_params, target_forward

    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros((rows, width), dtype=torch.bool)
    for row in range(rows):
        mask[row, torch.randperm(width, generator=gen)[:tokens].sort().values] = True
    ids = torch.randint(3, model.config.vocab_size, (rows, width), generator=gen)
    cache = batch_cache(model)
    target_forward(model, ids, cache, 1, forward_params(model), mask, (mask.long().cumsum(-1) - 1).clamp(min=0))
    return cache, mask


def measure(model, rows: int, tokens: int, widths: list[int], spans: list[int], reps: int = 10) -> dict:
    """Median seconds of a pass of each span over a cache of each width (the same tokens, ``width - tokens``
    holes), the pass's new slots dropped after each; and of one compaction of each width down to the tokens."""
    from lookupdec._transformers import crop_cache, forward_params, target_forward
    from lookupdec.batch import _compact

    if any(w < tokens for w in widths):
        raise ValueError("every width must hold the tokens: --widths at least --tokens")
    params = forward_params(model)
    passes, compaction = {}, {}
    with torch.inference_mode():
        for width in widths:
            cache, mask = _cache(model, rows, tokens, width, seed=width)
            for span in spans:
                times = []
                for _ in range(reps + 2):  # the first two warm up
                    feed = torch.randint(3, model.config.vocab_size, (rows, span))
                    step_mask = torch.cat([mask, torch.ones((rows, span), dtype=torch.bool)], dim=1)
                    positions = torch.full((rows, 1), tokens) + torch.arange(span)
                    t0 = time.perf_counter()
                    target_forward(model, feed, cache, span, params, step_mask, positions)
                    times.append(time.perf_counter() - t0)
                    crop_cache(cache, span)
                passes[(width, span)] = statistics.median(times[2:])
            t0 = time.perf_counter()
            kept = _compact(cache, mask, tokens, force=True)
            compaction[width] = time.perf_counter() - t0
            if kept.shape[1] != tokens or cache.get_seq_length() != tokens:
                raise AssertionError(f"a compaction of {width} slots kept {kept.shape[1]}, not {tokens}")
    base = min(widths)
    return {"rows": rows, "tokens": tokens, "widths": widths, "spans": spans, "reps": reps,
            "passes": [{"width": w, "span": s, "seconds": passes[(w, s)],
                        "over_narrowest": passes[(w, s)] / passes[(base, s)]} for w in widths for s in spans],
            "compaction": [{"width": w, "seconds": compaction[w],
                            "in_plain_steps": compaction[w] / passes[(base, 1)] if 1 in spans else None}
                           for w in widths]}


def markdown(result: dict, meta: dict) -> str:
    base = min(result["widths"])
    lines = [f"Run: {meta['date']}, model {meta['model']}, {meta['threads']} torch threads, {result['rows']} rows of "
             f"{result['tokens']} tokens, median of {result['reps']} passes each.", "",
             f"| cache width | tokens per row in the pass | ms | over {base} slots |", "|---|---|---|---|"]
    for p in result["passes"]:
        lines.append(f"| {p['width']} | {p['span']} | {p['seconds'] * 1000:.1f} | {p['over_narrowest']:.3f}x |")
    lines += ["", "| compaction of | ms | in one-token steps |", "|---|---|---|"]
    for c in result["compaction"]:
        steps = "-" if c["in_plain_steps"] is None else f"{c['in_plain_steps']:.2f}"
        lines.append(f"| {c['width']} slots | {c['seconds'] * 1000:.1f} | {steps} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="as lookupdec.load_model takes it (default: the embedded SmolLM2)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=300, help="tokens each row holds")
    ap.add_argument("--widths", type=int, nargs="+", default=[300, 450, 664], help="cache widths, tokens + holes")
    ap.add_argument("--spans", type=int, nargs="+", default=[1, 9], help="tokens per row of the timed passes")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    if min(args.rows, args.tokens, args.reps, args.threads, *args.spans) < 1:
        ap.error("--rows, --tokens, --spans, --reps and --threads take counts >= 1")
    if min(args.widths) < args.tokens:
        ap.error("--widths must each hold the tokens: at least --tokens")
    import lookupdec

    torch.set_num_threads(args.threads)
    model, _ = lookupdec.load_model(args.model, device="cpu")
    result = measure(model, args.rows, args.tokens, sorted(set(args.widths)), sorted(set(args.spans)), args.reps)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model or "SmolLM2-135M-Instruct (embedded)",
            "threads": args.threads, "command": "python -m benchmarks.holes " + " ".join(sys.argv[1:] if argv is None
                                                                                      else argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "holes.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
    table = markdown(result, meta)
    (args.out / "holes.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
