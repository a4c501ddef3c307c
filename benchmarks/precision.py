"""Reduced precision: where lookupdec's greedy output parts from plain greedy decoding, and why.

A verification pass runs ``d + 1`` rows where plain decoding runs one. In fp32 on a CPU the rows round differently
too, but never enough to change an argmax on these prompts; in bf16 (8 significant bits) the two computations can
pick different tokens where the top two logits are close. This script measures how close.

For every prompt (6 per suite by default, as ``run.py``) it runs plain greedy ``model.generate`` and
``lookupdec.generate`` in the reduced dtype (``--dtype``, bf16 by default) on the CPU, and again in fp32 as the
control, which must be token-identical everywhere. Where the outputs part, at new-token position ``t`` (the first
``t`` tokens match), it reads plain's logits at ``t`` (the one-row step's raw logits, ``output_logits``) and the
verification pass's (lookupdec's passes replayed from its trace: the same forwards on the same cache, checked to
reproduce every token lookupdec chose), and at every position before ``t`` how much the verification pass changed
the gap between plain's top two logits.

**Units.** ``u`` is the spacing of the reduced dtype at the largest-magnitude logit of plain's row (bf16:
``2^(floor(log2|x|) - 7)``, so 0.125 for ``|x|`` in [16, 32); fp16: ``2^(floor(log2|x|) - 10)``). Not the spacing at
the top logit: the rounding a logit picks up comes from the hidden state and the head (``delta l_v = w_v . delta
h``), so it scales with the logits' overall size; where the top logit is small (1.7 while others reach -37), its
own spacing would call a 0.13 shift 17 ulps.

**Near-tie.** A position is a near-tie when plain's top-2 gap is at most ``K u`` (``K`` = ``--bound-ulps``). Why that
shape: if plain picks ``a`` and lookupdec picks ``b`` on the same prefix, ``l_p(a) - l_p(b) <= delta(b) - delta(a)``
(``delta`` = verification logit - plain logit), so plain's top-2 gap is at most the change the other computation
makes to the gap between those two tokens, and that change is rounding: this script measures it at every position
of the common prefixes. ``K = 8`` is twice the largest change measured in bf16 on the benchmark prompts (4 u; the
median is 0.5 u). A verifier that kept a wrong token would part from plain where the gap can be anything.

**Modes that give plain's bf16 tokens** (``--modes``, timed on ``--time-suites``, interleaved, against plain and the
normal mode in the same run):

- ``onerow``: a copy of the model that computes every row of a verification pass as a one-row step would:
  attention one query row at a time on the cache prefix (a registered transformers attention function), every
  linear layer one row at a time. Plain's logits bit for bit (its outputs are compared with plain's), but each row
  now costs a matrix-vector product per layer, as a plain step does (cheaper only because the weights stay in the
  CPU's cache from one row to the next).
- ``recheck``: a prototype loop that verifies as usual but decides any row whose top-2 gap is within the bound
  with a one-row step on the same cache instead (the draft is cut there). Not exact: the cache holds keys and
  values computed in multi-row passes, so that one-row step is not plain's either.

Writes ``precision.json`` (raw, per prompt) and ``precision.md`` (tables) into ``--out``.

Examples::

    python -m benchmarks.precision                                   # bf16 + fp32 control, 28 prompts, ~26 min
    python -m benchmarks.precision --per-suite 2 --modes             # no timing of the modes, ~6 min
    python -m benchmarks.precision --dtype fp16 --suites yaml code
    python -m benchmarks.precision --suites yaml --per-suite 1 --modes onerow recheck --out /tmp/precision
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import statistics
import sys
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import lookupdec
from benchmarks.prompts import encode, pick_prompts
from benchmarks.workloads import SUITES
from lookupdec import LookupDrafter, TraceRecorder
from lookupdec.models import load_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("onerow", "recheck")
# The bound on plain's top-2 gap at a divergence, in ulps at the row's largest |logit| (module docstring): above the
# largest change a verification pass made to plain's top-2 gap on the suite in bf16 (benchmarks/RESULTS.md).
BOUND_ULPS = 8


def ulp(x: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype``'s numbers at ``|x|``: ``eps * 2^floor(log2|x|)`` (bf16 eps = 2^-7, fp16 2^-10)."""
    x = abs(float(x))
    if x == 0.0:
        return float(torch.finfo(dtype).tiny)
    _, exp = math.frexp(x)  # x = m * 2^exp, 0.5 <= m < 1, so floor(log2 x) = exp - 1
    return float(torch.finfo(dtype).eps) * 2.0 ** (exp - 1)


def spacing(row: torch.Tensor, dtype: torch.dtype) -> float:  # row [vocab]
    """``u``: the spacing of ``dtype`` at the largest-magnitude logit of ``row`` (module docstring)."""
    return ulp(float(row.abs().max()), dtype)


def top2(row: torch.Tensor) -> tuple:  # row [vocab]
    """(top token, runner-up token, top logit, gap between the two) of one row of logits."""
    values, indices = row.float().topk(2)
    return int(indices[0]), int(indices[1]), float(values[0]), float(values[0] - values[1])


# --------------------------------------------------------------------------------------------------------------
# The two decoders, and the replay of lookupdec's passes


def plain_greedy(model, ids: torch.Tensor, max_new_tokens: int) -> tuple:
    """(new tokens, raw logits [new, vocab] in fp32, seconds) of plain greedy ``model.generate``."""
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    seconds = time.perf_counter() - t0
    logits = torch.cat([step.float() for step in out.logits])  # [new, vocab]; bf16 -> fp32 is exact
    return out.sequences[0, ids.shape[1]:].tolist(), logits, seconds


def lookup_greedy(model, ids: torch.Tensor, max_new_tokens: int, drafter=None) -> tuple:
    """(new tokens, the passes [(draft, accepted, token)], stats, seconds) of ``lookupdec.generate``, with a fresh
    calibrated ``LookupDrafter`` unless ``drafter`` is given."""
    trace = TraceRecorder()
    out = lookupdec.generate(model, ids, torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             drafter=LookupDrafter() if drafter is None else drafter, trace=trace)
    passes = [(list(s.draft), s.accepted, s.token) for s in trace.steps]
    return out.sequences[0, ids.shape[1]:].tolist(), passes, out.stats, out.stats.total_seconds


def _forward(model, ids: torch.Tensor, cache, keep: int) -> torch.Tensor:  # ids [1, n] -> logits [keep, vocab]
    # The call lookupdec's loop makes (lookupdec._transformers.target_forward, transformers 5.24 names).
    return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=keep).logits[0, -keep:]


def _cache(model):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if hasattr(cache, "activate_past_recording"):  # sliding-window layers must be able to roll back
        cache.activate_past_recording()
    return cache


def replay(model, ids: torch.Tensor, passes: list, upto: int) -> tuple:
    """The logits lookupdec's verification passes gave for new-token positions ``0 .. upto`` ([upto + 1, vocab],
    fp32), by running its passes again, and whether every replayed argmax equals the token lookupdec chose."""
    rows, faithful = [], True
    cache = _cache(model)
    last = None
    with torch.inference_mode():
        for draft, accepted, token in passes:
            if last is None:  # the prefill
                logits = _forward(model, ids, cache, 1)
            else:
                feed = torch.tensor([[last] + draft], dtype=torch.long)  # [1, d + 1]
                logits = _forward(model, feed, cache, len(draft) + 1)
                cache.crop(accepted - len(draft))
            choice = logits.argmax(dim=-1).tolist()
            faithful &= choice[:accepted] == draft[:accepted] and choice[accepted] == token
            rows.extend(logits[: accepted + 1].float())
            last = token
            if len(rows) > upto:
                break
    return torch.stack(rows[: upto + 1]), faithful


# --------------------------------------------------------------------------------------------------------------
# One prompt in one dtype


@dataclass
class Divergence:
    """Where a reduced-precision run parts from plain, at new-token position ``t``."""

    plain_token: int
    lookup_token: int
    top: float  # plain's top logit at t
    largest: float  # plain's largest |logit| at t
    ulp: float  # u: the dtype's spacing at `largest`
    bound: float  # BOUND_ULPS * u, logit units
    plain_gap: float  # plain's top-2 gap at t
    plain_choice_gap: float  # plain's l(plain_token) - l(lookup_token) (>= plain_gap)
    verify_gap: float | None = None  # the verification pass's top-2 gap at t
    verify_choice_gap: float | None = None  # the verification pass's l(lookup_token) - l(plain_token)
    recheck_token: int | None = None  # what a one-row step on lookupdec's cache picks at t
    within: bool = False  # plain_gap <= bound


@dataclass
class Record:
    suite: str
    name: str
    dtype: str
    prompt_tokens: int
    plain_tokens: int
    lookup_tokens: int
    identical: bool
    matched: int  # new tokens equal before the first difference (all of them when identical)
    plain_seconds: float
    lookup_seconds: float
    tokens_per_pass: float  # lookupdec's new tokens per target pass, the prefill included
    drafted_tokens: int  # lookupdec's drafted tokens, verified in passes of more than one row
    accepted_tokens: int
    replay_faithful: bool | None = None
    divergence: Divergence | None = None
    # At each position of the common prefix, in ulps (u of that position): how much the verification pass changed
    # the gap between plain's top two logits, |(v(a) - v(b)) - (p(a) - p(b))|, and the larger of |v(a) - p(a)|,
    # |v(b) - p(b)|. At every position plain produced: plain's top-2 gap in ulps.
    gap_change_ulps: list = field(default_factory=list)
    perturbation_ulps: list = field(default_factory=list)
    plain_gaps_ulps: list = field(default_factory=list)


def first_difference(a: list, b: list) -> int:
    n = min(len(a), len(b))
    return next((t for t in range(n) if a[t] != b[t]), n)


def measure(model, ids: torch.Tensor, max_new_tokens: int, *, bound_ulps: float = BOUND_ULPS, deep: bool = True,
            drafter=None, suite: str = "", name: str = "") -> Record:
    """Plain and lookupdec on one prompt ``ids`` [1, prompt_len] in the model's dtype; with ``deep``, plain's gaps,
    the perturbation along the common prefix and the logits at the divergence."""
    dtype = model.dtype
    with torch.inference_mode():
        plain, plain_logits, plain_seconds = plain_greedy(model, ids, max_new_tokens)
        lookup, passes, stats, lookup_seconds = lookup_greedy(model, ids, max_new_tokens, drafter)
    t = first_difference(plain, lookup)
    label = next(k for k, v in DTYPES.items() if v == dtype)
    rec = Record(suite, name, label, ids.shape[1], len(plain), len(lookup), plain == lookup, t,
                 round(plain_seconds, 3), round(lookup_seconds, 3),
                 round(stats.new_tokens / max(stats.target_passes, 1), 3), stats.drafted_tokens,
                 stats.accepted_tokens)
    if not deep:
        return rec
    rec.plain_gaps_ulps = [round(top2(row)[3] / spacing(row, dtype), 2) for row in plain_logits]
    upto = min(t, len(plain) - 1, len(lookup) - 1)
    verify, rec.replay_faithful = replay(model, ids, passes, upto)
    for s in range(min(t, upto + 1)):
        a, b, _, _ = top2(plain_logits[s])
        u = spacing(plain_logits[s], dtype)
        delta = verify[s, [a, b]] - plain_logits[s, [a, b]]  # [2]
        rec.gap_change_ulps.append(round(abs(float(delta[0] - delta[1])) / u, 2))
        rec.perturbation_ulps.append(round(float(delta.abs().max()) / u, 2))
    if t < min(len(plain), len(lookup)):
        p, v = plain_logits[t], verify[t]
        a, b = plain[t], lookup[t]
        _, _, top, gap = top2(p)
        u = spacing(p, dtype)
        rec.divergence = Divergence(
            plain_token=a, lookup_token=b, top=top, largest=float(p.abs().max()), ulp=u, bound=bound_ulps * u,
            plain_gap=gap,
            plain_choice_gap=float(p[a] - p[b]), verify_gap=top2(v)[3], verify_choice_gap=float(v[b] - v[a]),
            recheck_token=recheck_at(model, ids, passes, t), within=gap <= bound_ulps * u)
    return rec


def recheck_at(model, ids: torch.Tensor, passes: list, t: int) -> int:
    """The token a one-row step on lookupdec's own cache picks at new-token position ``t``: the passes replayed up
    to the one that decided ``t``, then that row fed alone."""
    cache = _cache(model)
    done, last = 0, None
    with torch.inference_mode():
        for draft, accepted, token in passes:
            if last is None:
                if t == 0:
                    return int(_forward(model, ids, cache, 1)[0].argmax())
                _forward(model, ids, cache, 1)
                done, last = 1, token
                continue
            feed = [last] + draft
            _forward(model, torch.tensor([feed]), cache, len(draft) + 1)
            if done + accepted >= t:  # this pass decided t, at row t - done: drop that row's input and later
                row = t - done  # ones from the cache, and feed it alone (what recheck_generate does)
                cache.crop(row - len(draft) - 1)
                return int(_forward(model, torch.tensor([[feed[row]]]), cache, 1)[0].argmax())
            cache.crop(accepted - len(draft))
            done += accepted + 1
            last = token
    raise ValueError(f"position {t} is past the passes")


# --------------------------------------------------------------------------------------------------------------
# The bit-identical mode: every row of a verification pass computed as a one-row step would


def _rowwise_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa, but a verification pass (queries after a non-empty cache) attends one query row at a
    time to the cache prefix it may see, with no mask: the call a one-row step makes. The prefill (no cache) and
    one-row steps go to sdpa unchanged. Single rows without padding only (a prototype)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]  # query [batch, heads, q_len, dim], key [batch, kv_heads, kv, dim]
    if q_len == 1 or kv_len == q_len:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = []
    for row in range(q_len):
        end = kv_len - q_len + row + 1
        out, _ = sdpa_attention_forward(module, query[:, :, row: row + 1], key[:, :, :end], value[:, :, :end],
                                        None, **kwargs)
        rows.append(out)  # [batch, 1, heads, dim]
    return torch.cat(rows, dim=1), None


def onerow_model(model):
    """A copy of ``model`` whose verification passes compute every row as a one-row step: attention row by row
    (above) and every linear layer one row at a time (oneDNN's bf16 products of three or more rows round some rows
    differently from a product of one: SmolLM2's down projection, 1536 -> 576, does). The prefill runs as usual,
    as plain decoding's does. A prototype: no sliding-window layers, no padding."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("lookupdec_onerow", _rowwise_attention)
    AttentionMaskInterface.register("lookupdec_onerow", sdpa_mask)
    copy_ = copy.deepcopy(model)
    copy_.set_attn_implementation("lookupdec_onerow")
    state = {"verifying": False}

    def before(_, args, kwargs):
        ids = kwargs.get("input_ids")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        state["verifying"] = ids is not None and ids.shape[1] > 1 and cache is not None and cache.get_seq_length() > 0

    def linear(self, x):  # x [batch, rows, in]
        if not state["verifying"] or x.dim() != 3 or x.shape[1] == 1:
            return F.linear(x, self.weight, self.bias)
        return torch.cat([F.linear(x[:, row: row + 1], self.weight, self.bias) for row in range(x.shape[1])], 1)

    copy_.register_forward_pre_hook(before, with_kwargs=True)
    for module in copy_.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(linear, module)
    return copy_


def recheck_generate(model, ids: torch.Tensor, max_new_tokens: int, bound_ulps: float, drafter=None) -> tuple:
    """A prototype of lookupdec's greedy loop (single row, no processors, EOS and budget only) that decides every
    near-tie row of a verification pass with a one-row step: the draft is cut before such a row, the cache cropped
    to before its input token, and that token fed alone. Returns (new tokens, passes, one-row rechecks)."""
    drafter = drafter or LookupDrafter()
    lookupdec.calibrate(drafter, model)
    eos = model.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else (eos or []))
    cache = _cache(model)
    session = drafter.start(ids[0].numpy(), eos_ids=eos)
    out, passes, rechecks = [], 1, 0
    with torch.inference_mode():
        step = [int(_forward(model, ids, cache, 1)[0].argmax())]
        started = None
        while True:
            for token in step:
                out.append(token)
                if token in eos or len(out) == max_new_tokens:
                    session.finish()
                    return out, passes, rechecks
            now = time.perf_counter()
            session.commit(np.asarray(step, dtype=np.int32), None if started is None else now - started)
            started = now
            draft = drafter.propose([session], [max_new_tokens - len(out) - 1])[0].tolist()
            d = len(draft)
            feed = [out[-1]] + draft
            logits = _forward(model, torch.tensor([feed]), cache, d + 1)  # [d + 1, vocab]
            passes += 1
            values, indices = logits.float().topk(2, dim=-1)  # [d + 1, 2]
            choice = indices[:, 0].tolist()
            near = [float(values[pos, 0] - values[pos, 1]) <= bound_ulps * spacing(logits[pos], model.dtype)
                    for pos in range(d + 1)]
            accepted = 0
            while accepted < d and choice[accepted] == draft[accepted] and not near[accepted]:
                accepted += 1
            if near[accepted] and d > 0:  # a one-row pass is plain-shaped already
                cache.crop(accepted - d - 1)
                token = int(_forward(model, torch.tensor([[feed[accepted]]]), cache, 1)[0].argmax())
                rechecks += 1
            else:
                cache.crop(accepted - d)
                token = choice[accepted]
            step = draft[:accepted] + [token]


def time_modes(model, prompts, tokenizer, modes, args) -> list:
    """Plain, lookupdec and each mode on every prompt, in rotated order; time and identity with plain."""
    systems = ["plain", "lookupdec"] + list(modes)
    onerow = onerow_model(model) if "onerow" in modes else None
    if onerow is not None:  # calibrated up front: its pass cost differs from the model's
        lookupdec.calibrate(LookupDrafter(), onerow)
    rows = []
    for i, prompt in enumerate(prompts):
        ids = encode(tokenizer, prompt.user)
        runs = {s: [] for s in systems}
        outputs = {}
        for rep in range(args.reps):
            shift = (i + rep) % len(systems)
            for system in systems[shift:] + systems[:shift]:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    if system == "plain":
                        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                             max_new_tokens=args.max_new_tokens, do_sample=False)
                        tokens = out[0, ids.shape[1]:].tolist()
                        extra = {}
                    elif system in ("lookupdec", "onerow"):
                        out = lookupdec.generate(onerow if system == "onerow" else model, ids, torch.ones_like(ids),
                                                 max_new_tokens=args.max_new_tokens, drafter=LookupDrafter())
                        tokens = out.sequences[0, ids.shape[1]:].tolist()
                        extra = {"tokens_per_pass": out.stats.new_tokens / out.stats.target_passes}
                    else:
                        tokens, passes, rechecks = recheck_generate(model, ids, args.max_new_tokens, args.bound_ulps)
                        extra = {"tokens_per_pass": len(tokens) / passes, "rechecks": rechecks}
                runs[system].append(time.perf_counter() - t0)
                outputs[system] = (tokens, extra)
        plain = outputs["plain"][0]
        rows.append({
            "suite": prompt.suite, "name": prompt.name, "new_tokens": len(plain),
            "seconds": {s: round(min(runs[s]), 3) for s in systems},
            "identical": {s: outputs[s][0] == plain for s in systems},
            "matched": {s: first_difference(outputs[s][0], plain) for s in systems},
            "extra": {s: outputs[s][1] for s in systems},
        })
        print(f"  {prompt.name}: " + ", ".join(f"{s} {rows[-1]['seconds'][s]:.1f}s"
                                               f"{'' if rows[-1]['identical'][s] else ' (differs)'}" for s in systems),
              file=sys.stderr)
    return rows


# --------------------------------------------------------------------------------------------------------------
# Report


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


BINS = (0, 1, 2, 4, 8, 16)  # ulps: the histogram's upper edges ("0" is exact, then "<= 1", ...)


def _histogram(values: list) -> list:
    """Shares of ``values`` (ulps) in the bins 0, (0, 1], (1, 2], ..., (8, 16], > 16, as percentages."""
    if not values:
        return ["-"] * (len(BINS) + 1)
    counts, low = [], -1.0
    for high in BINS:
        counts.append(sum(low < v <= high for v in values))
        low = high
    counts.append(sum(v > BINS[-1] for v in values))
    return [f"{100 * c / len(values):.1f}%" for c in counts]


def markdown(data: dict) -> str:
    meta, records, timing = data["meta"], data["records"], data.get("timing", [])
    low, k = meta["dtype"], meta["bound_ulps"]
    dtypes = " and ".join(dict.fromkeys(r["dtype"] for r in records))
    out = [f"# Precision: lookupdec vs plain greedy, {dtypes} on the CPU", "",
           f"`{meta['command']}`", "",
           (f"{meta['date']}; {meta['machine']}; {meta['model']}; {meta['max_new_tokens']} new tokens; "
           f"{meta['seconds']:.0f} s. u: the {low} spacing at the largest |logit| of plain's row. Near-tie: plain's "
           f"top-2 gap <= {k} u."), ""]
    out += [("| suite | dtype | prompts | identical | diverged | tokens matching before the divergence (median, "
            "min) | divergences at a near-tie | plain's top-2 gap there (u) |"), "|---|---|---|---|---|---|---|---|"]
    for suite in dict.fromkeys(r["suite"] for r in records):
        for dtype in (low, "fp32"):
            rs = [r for r in records if r["suite"] == suite and r["dtype"] == dtype]
            if not rs:
                continue
            div = [r for r in rs if not r["identical"]]
            within = sum(1 for r in div if r["divergence"] and r["divergence"]["within"])
            gaps = ", ".join(f"{r['divergence']['plain_gap'] / r['divergence']['ulp']:g}" for r in div
                             if r["divergence"])
            matched = [r["matched"] for r in div]
            out.append(f"| {suite} | {dtype} | {len(rs)} | {len(rs) - len(div)} | {len(div)} | "
                       + (f"{_median(matched):g}, {min(matched)}" if matched else "-")
                       + f" | {within}/{len(div)} | {gaps or '-'} |")
    deep = [r for r in records if r["dtype"] == low]
    div = [r for r in deep if r["divergence"]]
    out += ["", f"## Divergences ({low})", "",
            ("Logit units. a: plain's token, b: lookupdec's. `verify`: the verification pass's logits (replayed). "
             "`one-row recheck`: the token a one-row step on lookupdec's own cache picks there."), "",
            ("| prompt | matched | top logit | largest abs logit | u | plain top-2 gap | plain l(a)-l(b) | "
             "verify top-2 gap | verify l(b)-l(a) | bound | near-tie | one-row recheck = plain |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in div:
        d = r["divergence"]
        out.append(f"| {r['name']} | {r['matched']} | {d['top']:.3g} | {d['largest']:.3g} | {d['ulp']:g} | "
                   f"{d['plain_gap']:g} | {d['plain_choice_gap']:g} | {d['verify_gap']:g} | "
                   f"{d['verify_choice_gap']:g} | {d['bound']:g} | {'yes' if d['within'] else '**no**'} | "
                   f"{'yes' if d['recheck_token'] == d['plain_token'] else 'no'} |")
    gaps = [g for r in deep for g in r["plain_gaps_ulps"]]
    if gaps:
        at = [r["divergence"]["plain_gap"] / r["divergence"]["ulp"] for r in div]
        change = [c for r in deep for c in r["gap_change_ulps"]]
        pert = [c for r in deep for c in r["perturbation_ulps"]]
        heads = ["0"] + [f"<= {h}" for h in BINS[1:]] + [f"> {BINS[-1]}"]
        out += ["", f"## Where divergences sit ({low}, ulps u)", "",
                "| quantity | positions | " + " | ".join(heads) + " | median | largest |",
                "|---|---|" + "---|" * (len(heads) + 2)]
        for label, values in (("plain's top-2 gap, every position plain produced", gaps),
                              ("plain's top-2 gap at the divergences", at),
                              (("change the verification pass made to the gap between plain's top two, every "
                               "position before a divergence"), change),
                              ("largest shift of plain's top two logits, same positions", pert)):
            out.append(f"| {label} | {len(values)} | " + " | ".join(_histogram(values)) +
                       (f" | {_median(values):g} | {max(values):g} |" if values else " | - | - |"))
        out += ["", (f"The replay reproduced lookupdec's tokens on {sum(bool(r['replay_faithful']) for r in deep)}/"
                    f"{len(deep)} prompts.")]
    if timing:
        systems = list(timing[0]["seconds"])
        out += ["", f"## Modes that give plain's {low} tokens (seconds, min over {meta['reps']} repetition(s))", "",
                "| prompt | new tokens | " + " | ".join(systems) + " | " +
                " | ".join(f"{s} = plain" for s in systems[1:]) + " |",
                "|---|---|" + "---|" * (2 * len(systems) - 1)]
        for row in timing:
            out.append(f"| {row['name']} | {row['new_tokens']} | " +
                       " | ".join(f"{row['seconds'][s]:.2f}" for s in systems) + " | " +
                       " | ".join("yes" if row["identical"][s] else f"no ({row['matched'][s]})" for s in systems[1:])
                       + " |")
        out += ["", "| median of per-prompt ratios | " + " | ".join(systems[1:]) + " |",
                "|---|" + "---|" * (len(systems) - 1)]
        for ref in ("plain", "lookupdec"):
            out.append(f"| speed vs {ref} | " + " | ".join(
                f"{_median([row['seconds'][ref] / row['seconds'][s] for row in timing]):.2f}x"
                for s in systems[1:]) + " |")
        out.append("| tokens per pass | " + " | ".join(
            f"{_median([row['extra'][s].get('tokens_per_pass', 1.0) for row in timing]):.2f}" for s in systems[1:])
            + " |")
        out.append("| identical to plain | " + " | ".join(
            f"{sum(row['identical'][s] for row in timing)}/{len(timing)}" for s in systems[1:]) + " |")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="hub id, folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES))
    ap.add_argument("--per-suite", type=int, default=6, help="prompts per suite (all with 0)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--bound-ulps", type=float, default=BOUND_ULPS)
    ap.add_argument("--no-control", action="store_true", help="skip the fp32 control run")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES,
                    help="bit-identical candidates to time (none: skip the timing)")
    ap.add_argument("--time-suites", nargs="+", default=["yaml", "code"], choices=list(SUITES))
    ap.add_argument("--reps", type=int, default=2, help="timing repetitions per system (the fastest is reported)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/precision"))
    args = ap.parse_args(argv)
    # One thread, as tests/conftest.py: two OpenMP threads on a shared 2-core machine stall on every barrier.
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    prompts = pick_prompts(args)
    records = []
    for name in ([args.dtype] + ([] if args.no_control else ["fp32"])):
        model, tokenizer = load_model(args.model, device="cpu", dtype=DTYPES[name])
        print(f"{name}: {len(prompts)} prompts", file=sys.stderr)
        for prompt in prompts:
            ids = encode(tokenizer, prompt.user)
            rec = measure(model, ids, args.max_new_tokens, bound_ulps=args.bound_ulps, deep=name != "fp32",
                          suite=prompt.suite, name=prompt.name)
            records.append(asdict(rec))
            d = rec.divergence
            print(f"  {prompt.name}: " + ("identical" if rec.identical else
                  f"parts after {rec.matched} tokens" + (f", plain gap {d.plain_gap:g} ({d.plain_gap / d.ulp:g} u), "
                                                         f"near-tie: {d.within}" if d else "")), file=sys.stderr)
        if name == args.dtype and args.modes:
            timed = [p for p in prompts if p.suite in args.time_suites]
            print(f"timing {', '.join(args.modes)} on {len(timed)} prompts", file=sys.stderr)
            timing = time_modes(model, timed, tokenizer, args.modes, args)
        del model
    meta = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {torch.get_num_threads()} thread(s), "
        f"torch {torch.__version__}", "model": args.model or "SmolLM2-135M-Instruct (embedded)", "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens, "bound_ulps": args.bound_ulps, "modes": args.modes,
        "reps": args.reps, "seconds": round(time.perf_counter() - started, 1),
        "command": "python -m benchmarks.precision " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    data = {"meta": meta, "records": records, "timing": timing if args.modes else []}
    (args.out / "precision.json").write_text(json.dumps(data, indent=1))
    text = markdown(data)
    (args.out / "precision.md").write_text(text)
    print(text)
    print(f"total {meta['seconds']}s; results in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
