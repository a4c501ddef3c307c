"""Batched lookup decoding against plain batched greedy ``model.generate``: throughput by batch size.

Run through ``python -m benchmarks.run --batch 1 2 4 8``. The same copy-heavy prompts are used at every batch
size (8 prompts: one batch of 8, two of 4, four of 2, eight of 1), left-padded like any batched ``generate`` call;
a batch larger than the number of copy-heavy prompts repeats them.
Each batch runs plain greedy and ``lookupdec.generate`` in turn (order rotated per repetition), and every row of
every lookup run is compared with single-sequence greedy on that prompt alone, and with the plain batched run.

Reported per batch size: tokens per second of both systems (real new tokens, padding excluded), their ratio,
lookupdec's tokens per pass per row, the width of its passes, and whether every row was identical.

``--batch-compiled`` runs both on transformers' fast path instead: the forward compiled (``run.CompiledForward``),
plain batched ``generate`` and ``lookupdec.generate`` both with ``cache_implementation="static"``; each batch is
run once untimed per system first, so that compiling is not timed. Rows are still compared with eager
single-sequence greedy, and with the plain batched run on the same compiled forward.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import lookupdec
from lookupdec import LookupDrafter


def left_pad(rows, pad: int):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long, device=rows[0].device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=rows[0].device)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def _new_tokens(out, width, eos, pad):
    """Per row, the new tokens up to and including the first EOS (the rest is padding)."""
    rows = []
    for row in out[:, width:].tolist():
        for i, t in enumerate(row):
            if t in eos:
                row = row[: i + 1]
                break
        rows.append(row)
    return rows


def run_batches(model, tokenizer, prompts, sizes, args, encode, compiled=None) -> dict:
    """``compiled``: a ``run.CompiledForward`` to run both systems on, with a static cache (None: eager, growing
    caches)."""
    eos = {tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    count = max(sizes)
    if len(prompts) < count:
        # More rows than prompts: the list is repeated (a repeat is generated independently, row by row).
        print(f"--batch {count}: {len(prompts)} prompts, repeated to fill {count} rows", file=sys.stderr)
        prompts = [prompts[i % len(prompts)] for i in range(count)]
    prompts = prompts[:count]
    encoded = [encode(tokenizer, p.user)[0].to(model.device) for p in prompts]
    kw = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    with torch.inference_mode():
        singles = [
            model.generate(e[None], attention_mask=torch.ones_like(e[None]), **kw)[0, len(e):].tolist()
            for e in encoded
        ]
        warm_ids, warm_mask = left_pad(encoded[:2], pad)
        model.generate(warm_ids, attention_mask=warm_mask, max_new_tokens=4, do_sample=False)
        lookupdec.generate(model, warm_ids, warm_mask, max_new_tokens=4)
    fast = {"cache_implementation": "static"} if compiled is not None else {}
    path = compiled if compiled is not None else contextlib.nullcontext()

    def generate(system, ids, mask):
        with torch.inference_mode(), path:
            if system == "plain":
                return model.generate(ids, attention_mask=mask, **kw, **fast), None
            widths = _WidthLog(model)
            try:
                return lookupdec.generate(model, ids, mask, drafter=LookupDrafter(**args.drafter), **kw, **fast), \
                    widths
            finally:
                widths.close()

    results = []
    for size in sizes:
        entry = {"batch": size, "plain_seconds": 0.0, "lookup_seconds": 0.0, "tokens": 0, "passes": [],
                 "rows_identical": 0, "rows": 0, "same_as_plain_batched": True, "tokens_per_pass": [],
                 "widths": []}
        for start in range(0, count, size):
            group = list(range(start, start + size))
            ids, mask = left_pad([encoded[i] for i in group], pad)
            times = {"plain": [], "lookup": []}
            if compiled is not None:  # compile this batch's shapes, untimed
                for system in times:
                    generate(system, ids, mask)
            for rep in range(args.reps):
                for system in (("plain", "lookup") if rep % 2 == 0 else ("lookup", "plain")):
                    t0 = time.perf_counter()
                    out, log = generate(system, ids, mask)
                    times[system].append(time.perf_counter() - t0)
                    if system == "plain":
                        plain = out
                    else:
                        res, widths = out, log
            got = _new_tokens(res.sequences, ids.shape[1], eos, pad)
            entry["same_as_plain_batched"] &= got == _new_tokens(plain, ids.shape[1], eos, pad)
            entry["rows_identical"] += sum(g == singles[i] for g, i in zip(got, group))
            entry["rows"] += size
            entry["tokens"] += sum(len(g) for g in got)
            entry["plain_seconds"] += statistics.median(times["plain"])
            entry["lookup_seconds"] += statistics.median(times["lookup"])
            entry["passes"].append(res.stats.target_passes)
            entry["tokens_per_pass"] += [row.tokens_per_pass for row in (res.stats.rows or [res.stats])]
            entry["widths"] += widths.widths[1:]  # the prefill is not a draft
        entry["plain_tok_s"] = entry["tokens"] / entry["plain_seconds"]
        entry["lookup_tok_s"] = entry["tokens"] / entry["lookup_seconds"]
        entry["speedup"] = entry["plain_seconds"] / entry["lookup_seconds"]
        print(f"batch {size}: plain {entry['plain_tok_s']:.1f} tok/s, lookupdec {entry['lookup_tok_s']:.1f} tok/s, "
              f"{entry['speedup']:.2f}x, rows identical {entry['rows_identical']}/{entry['rows']}", file=sys.stderr)
        results.append(entry)
    return {"batches": results}


class _WidthLog:
    """Records the width (tokens per row) of every target pass."""

    def __init__(self, model):
        self.widths = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.widths.append(int(kwargs["input_ids"].shape[1]))

    def close(self):
        self._handle.remove()


def _as_list(value):
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def markdown(data: dict, meta: dict) -> str:
    run = (f"Run: {meta['date']}, {meta['machine']}, model {meta['model']}, greedy, "
           f"max_new_tokens={meta['max_new_tokens']}, reps={meta['reps']}, {meta['prompts']} copy-heavy prompts, "
           f"{meta.get('path', 'eager, growing caches')}")
    head = ("| batch | plain tok/s | lookupdec tok/s | speedup | tok/pass per row (median) | mean pass width | "
            "rows identical | = plain batched |")
    lines = [run, "", head, "|---|---|---|---|---|---|---|---|"]
    for e in data["batches"]:
        width = statistics.mean(e["widths"]) if e["widths"] else 1.0
        lines.append(f"| {e['batch']} | {e['plain_tok_s']:.1f} | {e['lookup_tok_s']:.1f} | {e['speedup']:.2f}x | "
                     f"{statistics.median(e['tokens_per_pass']):.2f} | {width:.1f} | "
                     f"{e['rows_identical']}/{e['rows']} | {'yes' if e['same_as_plain_batched'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def write(data: dict, meta: dict, out: Path) -> None:
    (out / "batch.json").write_text(json.dumps({"meta": meta, **data}, indent=1))
    (out / "batch.md").write_text(markdown(data, meta))
    print(markdown(data, meta))
