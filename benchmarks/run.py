"""Speed and exactness of lookupdec against plain greedy, transformers' prompt lookup and an oracle drafter.

Systems run side by side on each prompt, interleaved (A B C ... then again in rotated order), so drift of this
shared machine hits all of them alike. Ratios are computed inside one run, never across runs:

- ``greedy``: plain ``model.generate`` (the reference output and the 1.0x line)
- ``pld``: transformers' prompt lookup, ``prompt_lookup_num_tokens=10`` (its documented setting)
- ``pld_tuned``: prompt lookup with ``--pld-tokens`` / ``--pld-ngram`` (default 20 / 3, the best of a small sweep on
  YAML edits; ``--pld-sweep`` reruns that sweep on the copy-heavy prompts and uses its winner)
- ``lookupdec``: ``lookupdec.generate`` with a fresh ``LookupDrafter`` per request (no cross-request cache help)
- ``lookupdec_hf``: ``model.generate(assistant_model=drafter)`` (transformers' loop), the drafter calibrated with
  ``lookupdec.calibrate`` as ``lookupdec.generate`` does on its own
- ``oracle``: ``lookupdec.generate`` with a drafter that knows the greedy output and drafts as far as lookupdec may
  (``DrafterConfig.max_draft``, 64 by default; ``benchmarks/oracle.py``): the ceiling any lookup drafter can reach
  on this hardware with this loop.

Opt-in (``--systems``), transformers' fast path and an outside anchor:

- ``greedy_compiled``: plain ``model.generate`` on transformers' fast path, a static KV cache and
  ``torch.compile`` of the forward (inductor; the first call pays the compile, which the warm-up takes);
- ``lookupdec_compiled``: ``lookupdec.generate(cache_implementation="static")`` on the same compiled forward (a
  preallocated cache, passes padded to a few fixed widths). Its output is compared with ``greedy_compiled``'s
  (compiled kernels may round differently from eager ones), so ``identical`` holds it to plain decoding on the
  same path;
- ``llamacpp``: llama.cpp's plain greedy decoding of the same GGUF (``llama-cpp-python``, not a dependency; the
  system is dropped with a note where it is not installed or the model is not a .gguf). An anchor, not a
  reference: it decodes the quantized weights as stored, so its text may differ.

Per prompt it records new tokens, target passes, tokens per pass (the target's own token of each pass included),
acceptance by draft position, the share of time spent drafting, wall time, and whether the output is
token-identical to greedy. Per suite it reports each system's median speedup over the prompts, with the 10th
percentile (nearest rank) and the worst prompt's beside it. It writes ``results.json`` (raw), ``results.md``
(tables) and, with matplotlib, ``speedup.png`` and ``tokens_per_pass.png`` into ``--out``.

Examples::

    python -m benchmarks.run --quick                 # a few prompts per suite, 128 new tokens, ~10 min on 2 cores
    python -m benchmarks.run                         # the full run documented in the README
    python -m benchmarks.run --suites yaml code --reps 3 --out /tmp/bench
    python -m benchmarks.run --sample --quick        # T=0.7, fixed seed, speed only
    python -m benchmarks.run --model /path/to/model.gguf
    python -m benchmarks.run --systems greedy oracle --suites yaml --per-suite 1   # a smoke run of one prompt
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import lookupdec
from benchmarks.oracle import OracleDrafter
from benchmarks.prompts import encode, pick_prompts
from benchmarks.stats import spread
from benchmarks.workloads import COPY_HEAVY, SUITES
from lookupdec import DrafterConfig, LookupDrafter
from lookupdec.calibration import calibrate_or_warn, pass_costs
from lookupdec.models import load_model

SYSTEMS = ("greedy", "pld", "pld_tuned", "lookupdec", "lookupdec_hf", "oracle")
OPT_IN = ("greedy_compiled", "lookupdec_compiled", "llamacpp")  # run only when --systems names them
CHECKED = ("lookupdec", "lookupdec_hf", "oracle", "lookupdec_compiled")  # held to plain decoding on their path
COMPILED = ("greedy_compiled", "lookupdec_compiled")


class CompiledForward:
    """``torch.compile`` of the model's forward, made once and swapped in only for the compiled systems' calls.
    ``backend``: inductor (the fast path); ``eager`` traces without generating kernels (device_check's dry run).

    Both compiled systems share dynamo's cache, which is kept per code object: dynamo's default limit of 8 graphs
    per function is too few for lookupdec's pass widths and the layers' cache updates (one graph per
    ``layer_idx``) together, and past it plain decoding would fall back to eager. So the limit is raised to 64 and
    integer module attributes are traced as dynamic, for this process."""

    def __init__(self, model, backend: str = "inductor"):
        self.model, self.backend, self.compiled = model, backend, None

    def __enter__(self):
        if self.compiled is None:
            import torch._dynamo

            torch._dynamo.config.recompile_limit = 64
            torch._dynamo.config.allow_unspec_int_on_nn_module = True
            self.compiled = torch.compile(self.model.forward, backend=self.backend)
        self.model.forward = self.compiled
        return self

    def __exit__(self, *exc):
        del self.model.forward  # the class's own forward again


class LlamaCpp:
    """llama.cpp's plain greedy decoding of a .gguf file, on our prompt's token ids (the GGUF's own vocabulary)."""

    def __init__(self, gguf: Path, threads: int | None):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads or torch.get_num_threads(),
                         verbose=False)

    def generate(self, ids: list, max_new_tokens: int) -> list:
        out = []
        self.llm.reset()
        for token in self.llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            if token == self.llm.token_eos():
                break
            out.append(token)
            if len(out) == max_new_tokens:
                break
        return out


def llamacpp_for(model_name: str | None, threads: int | None):
    """A :class:`LlamaCpp` for the run's model, or ``(None, why)`` where llama.cpp cannot run it."""
    from lookupdec.models import _gguf_of

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None, "llama-cpp-python is not installed"
    gguf = _gguf_of(model_name) if model_name else _gguf_of("smollm2")
    if gguf is None:
        return None, f"{model_name} is not a .gguf file"
    return LlamaCpp(gguf, threads), None


@dataclass
class Run:
    system: str
    seconds: float
    new_tokens: int
    passes: int
    identical: bool
    accepted_per_position: list = field(default_factory=list)
    drafted_per_position: list = field(default_factory=list)
    draft_seconds: float = 0.0


class PassCounter:
    """Counts target forward passes of any system through a forward pre-hook."""

    def __init__(self, model):
        self.count = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *args):
        self.count += 1


def run_system(system, model, ids, args, counter, answer, pld, extra=None):
    """One timed generation of ``system``; ``extra``: ``{"compiled": CompiledForward, "llamacpp": LlamaCpp}``
    for the opt-in systems."""
    extra = extra or {}
    kw = dict(max_new_tokens=args.max_new_tokens)
    if args.sample:
        kw.update(do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
        torch.manual_seed(args.seed)
    else:
        kw.update(do_sample=False)
    ids = ids.to(model.device)
    mask = torch.ones_like(ids)
    counter.count = 0
    stats = None
    start = time.perf_counter()
    with torch.inference_mode():
        if system == "greedy":
            out = model.generate(ids, attention_mask=mask, **kw)
        elif system == "greedy_compiled":
            with extra["compiled"]:
                out = model.generate(ids, attention_mask=mask, cache_implementation="static", **kw)
        elif system == "lookupdec_compiled":
            with extra["compiled"]:
                res = lookupdec.generate(model, ids, attention_mask=mask, drafter=LookupDrafter(**args.drafter),
                                         cache_implementation="static", **kw)
            out, stats = res.sequences, res.stats
        elif system == "llamacpp":
            new = extra["llamacpp"].generate(ids[0].tolist(), args.max_new_tokens)
            out = torch.cat([ids.cpu(), torch.tensor([new], dtype=ids.dtype)], dim=1)
        elif system == "pld":
            out = model.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=10, **kw)
        elif system == "pld_tuned":
            out = model.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=pld[0],
                                 max_matching_ngram_size=pld[1], **kw)
        elif system == "lookupdec_hf":
            drafter = LookupDrafter(**args.drafter)
            calibrate_or_warn(drafter, model)  # as lookupdec.generate does on its own (from memory after warm-up)
            out = model.generate(ids, attention_mask=mask, assistant_model=drafter, **kw)
        else:
            if system == "oracle":  # as long a draft as lookupdec may make, so the ceiling is for the same cap
                drafter = OracleDrafter(answer, DrafterConfig(**args.drafter).max_draft)
            else:
                drafter = LookupDrafter(**args.drafter)
            gen = torch.Generator().manual_seed(args.seed) if args.sample else None
            res = lookupdec.generate(model, ids, attention_mask=mask, drafter=drafter, generator=gen, **kw)
            out, stats = res.sequences, res.stats
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    run = Run(system, seconds, len(new), counter.count, identical=(answer is None or new == answer))
    if stats is not None:
        run.accepted_per_position = stats.accepted_per_position
        run.drafted_per_position = stats.drafted_per_position
        run.draft_seconds = stats.draft_seconds
    return run, new


def sweep_pld(model, tokenizer, prompts, args, counter):
    """Best (num tokens, max n-gram) for transformers' prompt lookup on the copy-heavy prompts, by median time."""
    candidates = [(10, 2), (10, 3), (20, 2), (20, 3), (32, 3)]
    heavy = [p for p in prompts if p.suite in COPY_HEAVY][:4]
    times = {c: [] for c in candidates}
    for p in heavy:
        ids = encode(tokenizer, p.user)
        for c in candidates:
            run, _ = run_system("pld_tuned", model, ids, args, counter, None, c)
            times[c].append(run.seconds)
    best = min(candidates, key=lambda c: statistics.median(times[c]))
    print(f"prompt-lookup sweep: best num tokens / max n-gram = {best}", file=sys.stderr)
    return best


def summarize(records, systems):
    """Per prompt: median time per system and the ratios; per suite: medians of the per-prompt ratios."""
    rows = []
    for rec in records:
        # Seconds per new token: under greedy every system writes the same tokens, so this is the time ratio; under
        # sampling each system draws its own text, of its own length.
        med = {s: statistics.median(r["seconds"] / max(r["new_tokens"], 1) for r in rec["runs"] if r["system"] == s)
               for s in systems}
        one = {s: next(r for r in rec["runs"] if r["system"] == s) for s in systems}
        row = {"suite": rec["suite"], "name": rec["name"], "new_tokens": one["greedy"]["new_tokens"]}
        for s in systems:
            row[f"x_{s}"] = med["greedy"] / med[s]
            row[f"tpp_{s}"] = one[s]["new_tokens"] / max(one[s]["passes"], 1)
            row[f"same_{s}"] = all(r["identical"] for r in rec["runs"] if r["system"] == s)
        row["vs_pld_hf"] = med["pld"] / med["lookupdec_hf"] if {"pld", "lookupdec_hf"} <= set(systems) else None
        if "lookupdec" in systems:
            row["vs_pld"] = med["pld"] / med["lookupdec"] if "pld" in systems else None
            row["vs_pld_tuned"] = med["pld_tuned"] / med["lookupdec"] if "pld_tuned" in systems else None
            row["of_oracle"] = (med["oracle"] / med["lookupdec"]) if "oracle" in systems else None
            ld = [r for r in rec["runs"] if r["system"] == "lookupdec"]
            row["draft_share"] = statistics.median(r["draft_seconds"] / r["seconds"] for r in ld)
        if set(COMPILED) <= set(systems):
            row["vs_compiled"] = med["greedy_compiled"] / med["lookupdec_compiled"]
            fastest = min(med[s] for s in ("greedy", "greedy_compiled"))
            row["vs_fastest"] = fastest / min(med[s] for s in ("lookupdec", "lookupdec_compiled") if s in systems)
        if "llamacpp" in systems:
            row["vs_llamacpp"] = med["llamacpp"] / min(med[s] for s in systems if s.startswith("lookupdec"))
        rows.append(row)
    groups = {}
    for row in rows:
        groups.setdefault(row["suite"], []).append(row)
    if all(suite in groups for suite in COPY_HEAVY):  # the copy-heavy suites are also reported together
        groups[" + ".join(COPY_HEAVY)] = [row for row in rows if row["suite"] in COPY_HEAVY]
    suite_rows = []
    for name, items in groups.items():
        agg = {"suite": name, "prompts": len(items)}
        members = {item["suite"] for item in items}
        runs = [r for rec in records if rec["suite"] in members for r in rec["runs"] if r["system"] == "lookupdec"]
        agg["accept_by_position"] = [_acceptance_at(runs, p - 1) for p in ACCEPT_POSITIONS]
        for key in items[0]:
            if key.startswith(("x_", "tpp_", "vs_", "of_", "draft_")) and items[0][key] is not None:
                agg[key] = statistics.median(item[key] for item in items)
            if key.startswith("x_"):  # beside the median: the 10th percentile and the worst prompt
                tail = spread({item["name"]: item[key] for item in items})
                agg[f"p10_{key}"], agg[f"worst_{key}"], agg[f"worst_prompt_{key}"] = (
                    tail["p10"], tail["worst"], tail["worst_name"])
            if key.startswith("same_"):
                agg[key] = all(item[key] for item in items)
        suite_rows.append(agg)
    return rows, suite_rows


ACCEPT_POSITIONS = (1, 2, 4, 8, 16, 32)


def _acceptance_at(runs, pos):
    drafted = sum(r["drafted_per_position"][pos] for r in runs if len(r["drafted_per_position"]) > pos)
    accepted = sum(r["accepted_per_position"][pos] for r in runs if len(r["accepted_per_position"]) > pos)
    return accepted / drafted if drafted else None


def markdown(rows, suite_rows, systems, meta):
    shown = [s for s in systems if s != "greedy"]
    long = [d for d in (16, 32, 64) if d < len(meta.get("pass_costs", ()))]  # the longer drafts the caption lists
    head = "| suite | prompts | " + " | ".join(f"{s} x" for s in shown) + \
        " | lookupdec vs pld | vs pld_tuned | lookupdec_hf vs pld | of oracle | tok/pass | draft time | identical |"
    lines = [f"Run: {meta['date']}, {meta['machine']}, model {meta['model']}, {meta['mode']}, "
             f"max_new_tokens={meta['max_new_tokens']}, reps={meta['reps']}, prompt lookup tuned={meta['pld_tuned']}",
             *([(f"Pass cost by draft length d = 0..8, {', '.join(map(str, long))} (lookupdec.calibrate, in "
                 "plain steps): " + ", ".join(f"{meta['pass_costs'][d]:.2f}" for d in (*range(9), *long)))]
               if len(meta.get("pass_costs", ())) > 32 else []),
             "", ("Per suite (medians over prompts; `x` = speedup over plain greedy in the same run, as median (10th "
                  "percentile by nearest rank, worst prompt): below 10 prompts the 10th percentile is the worst):"),
             "", head,
             "|" + "---|" * (head.count("|") - 1)]

    def fmt(v, pct=False):
        if v is None:
            return "-"
        return f"{100 * v:.1f}%" if pct else f"{v:.2f}"

    def x(r, s):
        return f"{fmt(r[f'x_{s}'])} ({fmt(r[f'p10_x_{s}'])}, {fmt(r[f'worst_x_{s}'])})"

    for r in suite_rows:
        same = all(r.get(f"same_{s}", True) for s in CHECKED if s in systems)
        lines.append(f"| {r['suite']} | {r['prompts']} | " + " | ".join(x(r, s) for s in shown) +
                     f" | {fmt(r.get('vs_pld'))} | {fmt(r.get('vs_pld_tuned'))} | {fmt(r.get('vs_pld_hf'))}"
                     f" | {fmt(r.get('of_oracle'), True)}"
                     f" | {fmt(r.get('tpp_lookupdec'))} | {fmt(r.get('draft_share'), True)} | "
                     f"{'yes' if same else 'NO'} |")
    fast = [k for k in ("vs_compiled", "vs_fastest", "vs_llamacpp") if suite_rows and k in suite_rows[0]]
    if fast:
        names = {"vs_compiled": "lookupdec_compiled vs greedy_compiled",
                 "vs_fastest": "best lookupdec vs fastest plain transformers",
                 "vs_llamacpp": "best lookupdec vs llama.cpp plain (anchor)"}
        lines += ["", "The fast path (medians of per-prompt time ratios; greedy_compiled identical to eager greedy: "
                  f"{'yes' if all(r.get('same_greedy_compiled', True) for r in suite_rows) else 'NO'}):", "",
                  "| suite | " + " | ".join(names[k] for k in fast) + " |", "|" + "---|" * (len(fast) + 1)]
        lines += [f"| {r['suite']} | " + " | ".join(fmt(r.get(k)) for k in fast) + " |" for r in suite_rows]
    lines += ["", "Acceptance of lookupdec's drafts by draft position (accepted / drafted, all prompts of the "
              "suite):", "",
              "| suite | " + " | ".join(f"pos {p}" for p in ACCEPT_POSITIONS) + " |",
              "|" + "---|" * (len(ACCEPT_POSITIONS) + 1)]
    for r in suite_rows:
        lines.append(f"| {r['suite']} | " + " | ".join(fmt(a, True) if a is not None else "-"
                                                       for a in r.get("accept_by_position", [])) + " |")
    lines += ["", "Per prompt:", "", "| prompt | new | " + " | ".join(f"{s} x" for s in shown) +
              " | tok/pass | identical |", "|" + "---|" * (len(shown) + 4)]
    for r in rows:
        same = all(r.get(f"same_{s}", True) for s in CHECKED if s in systems)
        lines.append(f"| {r['name']} | {r['new_tokens']} | " + " | ".join(fmt(r.get(f"x_{s}")) for s in shown) +
                     f" | {fmt(r.get('tpp_lookupdec'))} | {'yes' if same else 'NO'} |")
    return "\n".join(lines) + "\n"


def plots(rows, suite_rows, systems, out: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return
    drafting = [s for s in systems if s != "greedy"]
    if not drafting:
        return  # plain greedy alone: every speedup is 1
    # The oracle is a dashed ceiling over the other systems' bars, or a bar of its own when it runs alone.
    shown = [s for s in drafting if s != "oracle"] or drafting
    suite_rows = [r for r in suite_rows if r["suite"] in SUITES]  # the pooled yaml + code row would repeat prompts
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(shown)
    for i, s in enumerate(shown):
        ax.bar([j + i * width for j in range(len(suite_rows))], [r.get(f"x_{s}", 0) for r in suite_rows], width,
               label=s)
    if "oracle" in systems and "oracle" not in shown:
        for j, r in enumerate(suite_rows):
            ax.hlines(r["x_oracle"], j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="--",
                      label="oracle (ceiling)" if j == 0 else None)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(suite_rows))], [r["suite"] for r in suite_rows])
    ax.set_ylabel("speedup over plain greedy (same run)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.boxplot([[r[f"tpp_{s}"] for r in rows] for s in drafting], tick_labels=drafting)
    ax.set_ylabel("tokens per target pass (per prompt)")
    fig.tight_layout()
    fig.savefig(out / "tokens_per_pass.png", dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="hub id, folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES))
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS + OPT_IN))
    ap.add_argument("--quick", action="store_true", help="2 prompts per suite, 128 new tokens, 1 rep")
    ap.add_argument("--per-suite", type=int, default=None, help="prompts per suite (default: 6; all with 0)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--sample", action="store_true", help="T=0.7 with a fixed seed; reports speed only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pld-tokens", type=int, default=20)
    ap.add_argument("--pld-ngram", type=int, default=3)
    ap.add_argument("--pld-sweep", action="store_true")
    ap.add_argument("--report", type=Path, default=None,
                    help="re-render results.md and the plots from an existing results.json, without running")
    ap.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default="default",
                    help="default (bf16 on CUDA, fp32 on CPU), auto (the checkpoint's), fp32, bf16, fp16")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for every system (default: torch's choice)")
    ap.add_argument("--batch", type=int, nargs="+", default=None, metavar="B",
                    help="batch mode: plain batched greedy vs lookupdec at these batch sizes, on the copy-heavy "
                         "prompts (see benchmarks/batch.py); writes batch.json / batch.md")
    ap.add_argument("--batch-compiled", action="store_true",
                    help="batch mode on the fast path: the forward compiled, both systems on a static cache")
    ap.add_argument("--drafter", nargs="+", default=[], metavar="FIELD=VALUE",
                    help="DrafterConfig fields for lookupdec's systems, e.g. --drafter min_n=3 cursor=false "
                         "max_slowdown=none (ablations on the clock)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    args.drafter = dict(_config_field(item) for item in args.drafter)
    if args.batch_compiled and not args.batch:
        ap.error("--batch-compiled is batch mode's fast path: give --batch B [B ...] too")
    if args.report:
        return report(args.report)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.per_suite = args.per_suite or 2
        args.max_new_tokens = args.max_new_tokens or 128
        args.reps = args.reps or 1
    args.per_suite = 6 if args.per_suite is None else args.per_suite
    args.max_new_tokens = args.max_new_tokens or 256
    args.reps = args.reps or 2
    systems = [s for s in SYSTEMS + OPT_IN if s in args.systems or s == "greedy"]
    if args.sample and "oracle" in systems:
        # A sampled output is not known in advance, so there is nothing for an oracle to draft.
        print("--sample: no oracle (sampled outputs are not known in advance)", file=sys.stderr)
        systems.remove("oracle")
    args.out.mkdir(parents=True, exist_ok=True)

    from tqdm import tqdm

    t_load = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    print(f"model loaded in {time.perf_counter() - t_load:.1f}s", file=sys.stderr)
    counter = PassCounter(model)
    if args.batch:
        return batch_mode(model, tokenizer, args)
    extra = {"compiled": CompiledForward(model)}
    if "llamacpp" in systems:
        extra["llamacpp"], why = llamacpp_for(args.model, args.threads)
        if why:
            print(f"llamacpp: skipped ({why})", file=sys.stderr)
            systems.remove("llamacpp")
    prompts = pick_prompts(args)
    pld = (args.pld_tokens, args.pld_ngram)
    if args.pld_sweep and "pld_tuned" in systems:
        pld = sweep_pld(model, tokenizer, prompts, args, counter)

    # Warm-up: JIT compilation, allocator, first-call overheads; not timed.
    warm = encode(tokenizer, "Say hello.")
    for s in systems:
        run_system(s, model, warm, argparse.Namespace(**{**vars(args), "max_new_tokens": 8}), counter,
                   run_system("greedy", model, warm, argparse.Namespace(**{**vars(args), "max_new_tokens": 8}),
                              counter, None, pld)[1], pld, extra)

    records = []
    started = time.perf_counter()
    bar = tqdm(total=len(prompts) * args.reps * len(systems), file=sys.stderr, desc="benchmark")
    for i, p in enumerate(prompts):
        ids = encode(tokenizer, p.user)
        first, answer = run_system("greedy", model, ids, args, counter, None, pld)
        first.identical = True
        runs = [first]
        bar.update(1)
        references = {s: answer for s in systems}
        if "greedy_compiled" in systems:  # the compiled systems' own reference, timed as its first run
            compiled, references["lookupdec_compiled"] = run_system("greedy_compiled", model, ids, args, counter,
                                                                    answer, pld, extra)
            runs.append(compiled)
            references["greedy_compiled"] = answer  # whether compiled plain decoding matches eager: recorded
            bar.update(1)
        for rep in range(args.reps):
            order = systems[(i + rep) % len(systems):] + systems[:(i + rep) % len(systems)]
            for s in order:
                if s in ("greedy", "greedy_compiled") and rep == 0:
                    continue
                run, _ = run_system(s, model, ids, args, counter, None if args.sample else references[s], pld,
                                    extra)
                runs.append(run)
                bar.update(1)
                bar.set_postfix_str(f"{p.name} {s}")
        records.append({"suite": p.suite, "name": p.name, "prompt_tokens": ids.shape[1],
                        "runs": [asdict(r) for r in runs]})
    bar.close()
    meta = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {model.device} {str(model.dtype).removeprefix('torch.')}",
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "mode": "sampling T=0.7" if args.sample else "greedy", "max_new_tokens": args.max_new_tokens,
        "reps": args.reps, "pld_tuned": list(pld), "seconds": round(time.perf_counter() - started, 1),
        "command": "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv),
        "drafter": args.drafter,
        # The pass cost the lookupdec drafters were calibrated with (measured once per model and thread count).
        "pass_costs": ([round(float(c), 3)
                        for c in pass_costs(model, DrafterConfig(**args.drafter).max_draft)]
                       if args.drafter.get("calibrate", True) and {"lookupdec", "lookupdec_hf"} & set(systems)
                       else []),
    }
    meta["systems"] = systems
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    report(args.out / "results.json")
    print(f"total {meta['seconds']}s; results in {args.out}", file=sys.stderr)


def _config_field(item: str) -> tuple:
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"--drafter {item}: expected FIELD=VALUE")
    lowered = value.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    if lowered == "none":
        return key, None
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    raise SystemExit(f"--drafter {item}: VALUE must be a number, true, false or none")


def batch_mode(model, tokenizer, args):
    from benchmarks import batch

    suites = [s for s in args.suites if s in COPY_HEAVY] or list(COPY_HEAVY)
    # Alternate the suites so every batch mixes YAML and code edits.
    per_suite = [SUITES[s]() for s in suites]
    prompts = [p for group in itertools.zip_longest(*per_suite) for p in group if p is not None]
    started = time.perf_counter()
    compiled = CompiledForward(model) if args.batch_compiled else None
    data = batch.run_batches(model, tokenizer, prompts, sorted(set(args.batch)), args, encode, compiled)
    meta = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {model.device} {str(model.dtype).removeprefix('torch.')}",
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "max_new_tokens": args.max_new_tokens, "reps": args.reps, "prompts": max(args.batch),
        "path": "compiled forward, static caches" if args.batch_compiled else "eager, growing caches",
        "seconds": round(time.perf_counter() - started, 1),
        "command": "python -m benchmarks.run " + " ".join(sys.argv[1:]),
    }
    batch.write(data, meta, args.out)
    print(f"total {meta['seconds']}s; results in {args.out}", file=sys.stderr)


def report(path: Path):
    """Tables and plots from a results.json (written by a run, or kept from an earlier one)."""
    data = json.loads(path.read_text())
    meta, records = data["meta"], data["records"]
    systems = meta.get("systems") or [s for s in SYSTEMS if any(r["system"] == s for r in records[0]["runs"])]
    rows, suite_rows = summarize(records, systems)
    table = markdown(rows, suite_rows, systems, meta)
    (path.parent / "results.md").write_text(table)
    plots(rows, suite_rows, systems, path.parent)
    print(table)


if __name__ == "__main__":
    main()
