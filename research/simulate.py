"""Replay drafting policies against known greedy outputs: a fast, noise-free estimate of speedup.

Under greedy decoding the target's output is fixed, so how many tokens a draft gets accepted does not depend on the
machine: it is the longest common prefix of the draft and the true continuation. This script computes the greedy
outputs once (cached in ``--out``), then replays each drafter step by step and charges every pass a relative cost
from a pass-cost model (default: a straight line fitted on a 2-core CPU with the embedded model, ``1`` for a plain
step and ``1.55 + 0.05 * d`` for ``d`` drafted tokens; ``--measure-cost`` charges what ``lookupdec.calibrate``
measures on this machine, at every draft length, and calibrates the drafters with it as ``lookupdec.generate``
does). Two more curves replay what the drafter would do on hardware we cannot time here, calibrated the same way:
``--cost-file PATH`` reads one (a JSON list of relative costs by draft length, ``cost[0] == 1``, or a curve of
``benchmarks/device_check.py``'s ``device_check.json`` named by ``--cost-curve``), and ``--flat-cost SLOPE``
assumes a GPU-like ``1 + SLOPE * d`` (see :func:`flat_cost`). Past a curve's last length every pass cost grows by
the slope of its last quarter, as the drafter's own cost model extrapolates.

Every replayed drafter is a :class:`lookupdec.drafter.Drafter` stepped through lookupdec's own propose/commit
driver (``drafter.propose([session], [limit])``, ``session.commit(tokens)``, ``drafter.observe``), as
``lookupdec.generate`` steps it: prompt lookup and the oracle are drafters without the adaptive length, and the
hindsight studies are drafters that choose lengths knowing the output.

It is a tuning tool: the wall-clock truth is ``benchmarks/run.py``. Where both were run, they agree on the ranking.

Examples::

    python -m research.simulate --quick
    python -m research.simulate --suites yaml code --per-suite 0
    python -m research.simulate --measure-cost
    python -m research.simulate --flat-cost 0.002 --out /tmp/sim     # a GPU-like curve (assumed)
    python -m research.simulate --cost-file /tmp/dc/device_check.json --cost-curve 7B
    python -m research.simulate --trees --flat-cost 0.002 --trees-out /tmp/ablate/trees_flat.md
    python -m research.simulate --ablate --ablate-out /tmp/ablate/ablation.md
    python -m research.simulate --ablate --measure-cost --ablate-out /tmp/ablate/ablation.md
    python -m research.simulate --trees --trees-out /tmp/ablate/trees.md
    python -m research.simulate --bounds --measure-cost
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from benchmarks.oracle import OracleDrafter
from benchmarks.prompts import encode, pick_prompts
from benchmarks.workloads import COPY_HEAVY, SUITES
from lookupdec.calibration import pass_costs
from lookupdec.drafter import EMPTY, Drafter, DrafterConfig
from lookupdec.models import load_model
from lookupdec.policy import Offer


def cpu_cost(d: int) -> float:
    return 1.0 if d == 0 else 1.55 + 0.05 * d


class MeasuredCost:
    """A pass-cost curve: ``profile[d]`` is the time of a pass with ``d`` drafted tokens relative to a plain step
    (``lookupdec.calibrate``'s measurement on this machine, a file's, or an assumed one; ``source`` says which, for
    the tables' captions). Past the last length the cost grows by the slope of the curve's last quarter, as
    ``lookupdec.policy.PassCost`` extrapolates a profile (a tree pass can verify more nodes than were measured)."""

    def __init__(self, profile, source: str = "the pass costs measured on this machine (lookupdec.calibrate)"):
        self.profile = np.asarray(profile, dtype=np.float64)
        self.source = source
        last = self.profile.size - 1
        ref = max(1, last - max(1, last // 4))
        self._slope = max((self.profile[last] - self.profile[ref]) / (last - ref), 0.0) if last > ref else 0.0

    def __call__(self, d: int) -> float:
        last = self.profile.size - 1
        if d <= last:
            return float(self.profile[d])
        return float(self.profile[last] + self._slope * (d - last))


# Draft lengths a cost curve must cover: every length the replayed drafters may draft.
COST_LENGTHS = DrafterConfig().max_draft


def flat_cost(slope: float, length: int = 256) -> MeasuredCost:
    """An assumed GPU-like curve, ``cost(d) = 1 + slope * d``. On a GPU a small model's decoding pass is bound by
    kernel launches and by reading the weights, not by how many tokens it carries, until that count nears the
    point where the matrix products become compute-bound (about 200 tokens on an H100/H200 in bf16, from the
    chip's FLOP-per-byte ratio): a pass verifying a few dozen tokens costs about one plain step. ``slope=0.002``
    charges 64 drafted tokens 1.13 plain steps. Assumed, not measured: ``benchmarks/device_check.py`` measures the
    real curve on a GPU (``--cost-file``)."""
    if not 0 <= slope < 10:
        raise ValueError(f"--flat-cost SLOPE must be in [0, 10), got {slope}")
    return MeasuredCost(1.0 + slope * np.arange(length + 1),
                        source=f"an assumed GPU-like curve, 1 + {slope:g} d (not measured)")


def load_cost_file(path: Path, curve: str | None = None) -> MeasuredCost:
    """The cost curve in ``path``: a JSON list of relative pass costs by draft length (``cost[0] == 1``), or the
    ``device_check.json`` of ``benchmarks/device_check.py``, whose ``cost_curves[curve]["profile"]`` is used
    (``curve`` may be left out when the file holds one curve). ``ValueError`` with a one-line reason otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise ValueError(f"{path} is not JSON: {err}") from None
    label = f"the curve in {Path(path).name}"
    if isinstance(data, dict):
        curves = data.get("cost_curves")
        if not isinstance(curves, dict) or not curves:
            raise ValueError(f"{path}: expected a JSON list of costs, or device_check.json with cost_curves")
        if curve is None and len(curves) == 1:
            curve = next(iter(curves))
        if curve not in curves:
            raise ValueError(f"{path}: name a curve with --cost-curve, one of: {', '.join(curves)}"
                             if curve is None else
                             f"{path} has no curve {curve!r}; it has: {', '.join(curves)}")
        entry = curves[curve]
        data = entry.get("profile") if isinstance(entry, dict) else None
        if data is None:
            raise ValueError(f"{path}: curve {curve!r} was not measured ({(entry or {}).get('error', 'no profile')})")
        label = (f"the curve of {curve} measured by device_check ({entry.get('device', '?')}, "
                 f"{entry.get('dtype', '?')})")
    elif curve is not None:
        raise ValueError(f"{path} is a plain list of costs: --cost-curve applies to device_check.json only")
    if not isinstance(data, list) or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                                             for c in data):
        raise ValueError(f"{path}: a cost curve is a JSON list of numbers (relative pass cost by draft length)")
    profile = np.asarray(data, dtype=np.float64)
    if profile.size <= COST_LENGTHS:
        raise ValueError(f"{path}: the curve has {profile.size} costs (draft lengths 0..{profile.size - 1}); the "
                         f"replay needs 0..{COST_LENGTHS}")
    if not np.all(np.isfinite(profile)) or profile.min() <= 0:
        raise ValueError(f"{path}: every cost must be a positive number")
    if abs(profile[0] - 1.0) > 1e-6:
        raise ValueError(f"{path}: cost[0] must be 1 (costs are relative to a plain step), got {profile[0]:g}; "
                         "divide the curve by its first entry")
    return MeasuredCost(profile, source=label)


def replay(drafter: Drafter, prompt: list, answer: list, cost, eos: int, branches: int = 1,
           branch_len: int = 256, free_branches: bool = False) -> dict:
    """Step ``drafter`` through ``answer`` on lookupdec's driver, as ``lookupdec.generate`` would with a target
    whose greedy output is ``answer``; returns passes, relative time, tokens and tree statistics.

    ``branches > 1`` studies token trees (lookup drafters only): besides the drafter's own draft, up to
    ``branches - 1`` continuations of other earlier occurrences of the suffix (``_alternatives``), each at most
    ``branch_len`` tokens and no longer than the draft, are verified in the same pass. The pass accepts the longest
    prefix of the truth along any path and costs ``cost(tree nodes)`` (``free_branches``: only the drafter's own
    draft is charged, an upper bound on what such trees could win).
    """
    session = drafter.start(prompt, eos_ids=[eos])
    passes, spent = 1, cost(0)  # the prefill pass yields the first token
    session.commit(np.asarray(answer[:1], dtype=np.int32))
    done = 1
    tree = {"drafts": 0, "with_alternative": 0, "alternative_won": 0}
    while done < len(answer):
        draft = [int(t) for t in drafter.propose([session], [len(answer) - done - 1])[0]]
        truth = answer[done:]
        paths, srcs = [draft], [-1]
        if branches > 1 and draft:
            for src, alt in _alternatives(session.index, min(len(draft), branch_len), eos):
                if not any(path[: len(alt)] == alt for path in paths):  # it adds at least one node
                    paths.append(alt)
                    srcs.append(src)
                    if len(paths) == branches:
                        break
        accepted = [_common_prefix(path, truth) for path in paths]
        best = int(np.argmax(accepted))  # the drafter's own draft wins ties
        committed = truth[: accepted[best] + 1]
        done += len(committed)
        passes += 1
        charged = len(draft) if free_branches else _trie_size(paths)
        step = cost(charged)
        spent += step
        if draft:
            tree["drafts"] += 1
            tree["with_alternative"] += len(paths) > 1
            tree["alternative_won"] += best > 0
        drafter.observe(1, charged, step)
        # The drafter learns how its own draft fared (commit infers it from the committed tokens); a winning
        # alternative becomes the copy the alignment cursor follows (only lookup sessions take ``source``).
        if best > 0:
            session.commit(np.asarray(committed, dtype=np.int32), source=srcs[best])
        else:
            session.commit(np.asarray(committed, dtype=np.int32))
    session.finish()  # the output joins the rolling cache, as lookupdec.generate does
    return {"tokens": len(answer), "passes": passes, "time": spent, **tree}


def _common_prefix(draft: list, truth: list) -> int:
    n = 0
    while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
        n += 1
    return n


def _trie_size(paths: list) -> int:
    """Nodes of the token tree whose root-to-leaf paths are ``paths`` (shared prefixes are verified once)."""
    return len({tuple(path[: i + 1]) for path in paths for i in range(len(path))})


def _alternatives(index, length: int, eos: int):
    """(src, continuation) for every earlier occurrence of a suffix n-gram, ``n`` from the index's longest match
    down to ``min_n``: the longest shared context first, then the most recent; continuations up to ``length``
    tokens, cut after EOS and before a reference separator."""
    tokens = index.tokens
    hits = set()
    for n in range(index.match()[0], index.min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: len(tokens) - 1], n)  # [i] ends at src i + n
        hits.update((np.flatnonzero((windows == tokens[len(tokens) - n:]).all(axis=1)) + n).tolist())
    for src in sorted(hits, key=lambda src: (index.match_length(src, 32), src), reverse=True):
        alt = tokens[src: src + length].tolist()
        for pos, token in enumerate(alt):
            if token < 0 or token == eos:
                alt = alt[: pos + (token == eos)]
                break
        if alt:
            yield src, alt


class _LookupFactory:
    """lookupdec's drafters for a run of requests: a fresh drafter per request, or (``shared``) one drafter for
    every request until ``reset()``, so later requests can copy from earlier outputs through the rolling cache."""

    def __init__(self, cost, shared=False, **config):
        self.shared, self.config = shared, config
        self.drafter = None
        # The drafter is calibrated (as lookupdec.generate does) when the simulation charges a measured profile.
        self.profile = getattr(cost, "profile", None) if config.get("calibrate", True) else None

    def reset(self):
        self.drafter = None

    def __call__(self) -> Drafter:
        if self.drafter is None or not self.shared:
            self.drafter = Drafter(**self.config)
            if self.profile is not None:
                self.drafter.cost.use_profile(self.profile)
        return self.drafter


class _PromptLookupDrafter(Drafter):
    """transformers' PromptLookupCandidateGenerator, re-expressed as a drafter: ``num_tokens``-token drafts
    (``max_draft``) copied after the first (leftmost) earlier occurrence with a continuation of the last ``n``
    tokens, n from ``max_ngram`` (``max_n``) down to 1, cut at EOS. No adaptive length, cache or calibration."""

    def __init__(self, num_tokens=10, max_ngram=2):
        super().__init__(DrafterConfig(max_draft=num_tokens, max_n=max_ngram, adaptive=False, use_cache=False,
                                       calibrate=False))

    def start(self, prompt, eos_ids=(), *, prediction=None, reproducible=False, client=None, use_cache=True):
        return _PromptLookupSession(prompt, self.drafter_config, eos_ids)


class _PromptLookupSession:
    """One request of :class:`_PromptLookupDrafter` (the ``Session`` protocol), searching a plain token list."""

    def __init__(self, prompt, config: DrafterConfig, eos_ids=()):
        self.tokens, self.k, self.max_ngram = list(prompt), config.max_draft, config.max_n
        self.eos = frozenset(int(t) for t in eos_ids)
        self.offered = EMPTY

    def offer(self, limit: int) -> Offer:
        self.offered = np.asarray(self._draft(limit), dtype=np.int32)
        return Offer(self.offered, 1.0, 1.0)

    def _draft(self, limit: int) -> list:
        toks = np.asarray(self.tokens)
        L = len(toks)
        for n in range(self.max_ngram, 0, -1):
            if L <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(toks, n)
            hits = np.flatnonzero((windows == toks[-n:]).all(axis=1))
            for idx in hits:
                start, end = idx + n, min(idx + n + self.k, L)
                if start < end:
                    draft = [int(t) for t in toks[start:end][:max(limit, 0)]]
                    for pos, token in enumerate(draft):
                        if token in self.eos:
                            return draft[: pos + 1]
                    return draft
        return []

    def take(self, length: int) -> np.ndarray:
        return self.offered[:max(length, 0)]

    def commit(self, tokens, seconds=None):
        self.tokens += [int(t) for t in tokens]

    def finish(self, generated=None):
        pass


# Ablation rows: each mechanism switched off in turn. One drafter serves a suite's prompts in order (as a server
# would), so the cross-request cache has earlier outputs to copy from; "fresh drafter" is run.py's setting.
ABLATIONS = {
    "lookupdec (all on)": {"shared": True},
    "calibrated cost off (straight-line fit)": {"shared": True, "calibrate": False},
    "cursor off": {"shared": True, "cursor": False},
    "guard off": {"shared": True, "guard": False},
    f"adaptive off ({DrafterConfig().max_draft}-token drafts)": {"shared": True, "adaptive": False},
    "cache off": {"shared": True, "use_cache": False},
    "min_n=2": {"shared": True, "min_n": 2},
    "min_n=3": {"shared": True, "min_n": 3},
    "max_n=2": {"shared": True, "max_n": 2},
    "max_draft=32": {"shared": True, "max_draft": 32},
    "fresh drafter per request": {},
    # transformers' prompt lookup as a DrafterConfig: 10-token drafts of the longest 1..2-gram match, nothing else
    # (it differs from transformers only in taking the most recent occurrence instead of the first).
    "PLD-like config": {"max_draft": 10, "max_n": 2, "adaptive": False, "cursor": False, "use_cache": False},
}


def ablate(prompts, cost, eos, out: Path) -> str:
    """Replay every ``ABLATIONS`` row, prompt lookup and the oracle over ``prompts`` [(Prompt, prompt ids,
    greedy output)]; returns (and writes to ``out``) Markdown tables of simulated speedup and tokens per pass."""
    systems = {name: _LookupFactory(cost, **config) for name, config in ABLATIONS.items()}
    systems["prompt lookup (transformers re-expressed, 10 tokens, 2-grams)"] = lambda: _PromptLookupDrafter(10, 2)
    rows = []
    for suite in dict.fromkeys(p.suite for p, _, _ in prompts):
        for factory in systems.values():
            if isinstance(factory, _LookupFactory):
                factory.reset()  # one shared drafter per suite: suites do not see each other's outputs
        for p, prompt, answer in (x for x in prompts if x[0].suite == suite):
            plain = len(answer) * cost(0)
            row = {"suite": suite, "name": p.name}
            for name, factory in [*systems.items(), ("oracle", lambda a=answer: _oracle(a))]:
                r = replay(factory(), prompt, answer, cost, eos)
                row[name] = (plain / r["time"], r["tokens"] / r["passes"])
            rows.append(row)
            print(f"{suite}/{p.name:28s} " + " ".join(f"{row[n][0]:.2f}" for n in row if n not in ("suite", "name")),
                  file=sys.stderr)
    names = [*systems, "oracle"]
    suites = list(dict.fromkeys(r["suite"] for r in rows))
    counts = {s: sum(r["suite"] == s for r in rows) for s in suites}
    lines = [(f"Simulated (cost model: {_cost_text(cost)}), "
              f"replaying cached greedy outputs of {len(rows)} prompts; medians over each suite's prompts."), ""]
    for what, col in (("simulated speedup over greedy", 0), ("tokens per pass (the target's own token included)", 1)):
        head = f"| {what} | " + " | ".join(f"{s} ({counts[s]})" for s in suites) + " | all |"
        lines += [head, "|---" * (len(suites) + 2) + "|"]
        for name in names:
            cells = [statistics.median(r[name][col] for r in rows if r["suite"] == s) for s in suites]
            cells.append(statistics.median(r[name][col] for r in rows))
            lines.append(f"| {name} | " + " | ".join(f"{c:.2f}" + ("x" if col == 0 else "") for c in cells) + " |")
        lines.append("")
    # Per prompt, each row against everything on: a median can hide a mechanism that helps some prompts and hurts
    # others.
    base = names[0]
    head = "| per-prompt speed ratio to " + base + ": median (min .. max) | " + " | ".join(suites) + " | all |"
    lines += [head, "|---" * (len(suites) + 2) + "|"]
    for name in names[1:]:
        cells = []
        for group in [[r for r in rows if r["suite"] == s] for s in suites] + [rows]:
            ratios = [r[name][0] / r[base][0] for r in group]
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f} .. {max(ratios):.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    return table


# Token-tree variants: (branches per pass, longest alternative branch, alternatives cost nothing).
TREES = {
    "chain (lookupdec)": (1, 256, False),
    "tree 2, alternatives <= 8 tokens": (2, 8, False),
    "tree 3, alternatives <= 4 tokens": (3, 4, False),
    "tree 3, alternatives <= 8 tokens": (3, 8, False),
    "tree 3, alternatives as long as the draft": (3, 256, False),
    "tree 3, as long, alternatives free (bound)": (3, 256, True),
}


def study_trees(prompts, cost, eos, out: Path) -> str:
    """Replay the full drafter as a chain and as each ``TREES`` variant; returns (and writes to ``out``) Markdown
    tables: how often alternatives exist and win, and the simulated speedups."""
    rows = []
    for suite in dict.fromkeys(p.suite for p, _, _ in prompts):
        factories = {name: _LookupFactory(cost, **ABLATIONS["lookupdec (all on)"]) for name in TREES}
        for p, prompt, answer in (x for x in prompts if x[0].suite == suite):
            plain = len(answer) * cost(0)
            row = {"suite": suite}
            for name, (branches, branch_len, free) in TREES.items():
                row[name] = replay(factories[name](), prompt, answer, cost, eos, branches, branch_len, free)
                row[name]["x"] = plain / row[name]["time"]
            rows.append(row)
            print(f"{suite}/{p.name:28s} " + " ".join(f"{row[name]['x']:.2f}" for name in TREES), file=sys.stderr)
    suites = [*dict.fromkeys(r["suite"] for r in rows), "all"]
    groups = {suite: [r for r in rows if suite in ("all", r["suite"])] for suite in suites}
    lines = [(f"Simulated (cost model: {_cost_text(cost)}; a tree pass costs cost(tree nodes)), one drafter per "
              "suite as in the ablation. Alternatives: continuations of other earlier occurrences of the suffix "
              "(longest n first), added when they disagree with every branch so far within their length."), "",
             "| counted in the 3-branch tree (alternatives as long as the draft) | " + " | ".join(suites) + " |",
             "|---" * (len(suites) + 1) + "|"]
    stat = {key: [sum(r["tree 3, alternatives as long as the draft"][key] for r in groups[s])
                  for s in suites] for key in ("drafts", "with_alternative", "alternative_won")}
    lines.append("| drafting passes | " + " | ".join(str(n) for n in stat["drafts"]) + " |")
    for key, what in (("with_alternative", "an alternative exists"), ("alternative_won", "an alternative wins")):
        lines.append(f"| {what} | " + " | ".join(f"{k / max(n, 1):.1%}" for k, n in zip(stat[key], stat["drafts"]))
                     + " |")
    lines += ["", "| simulated speedup over greedy (median per-prompt ratio to the chain) | " + " | ".join(suites)
              + " |", "|---" * (len(suites) + 1) + "|"]
    for name in TREES:
        cells = [f"{statistics.median(r[name]['x'] for r in groups[s]):.2f}x "
                 f"({statistics.median(r[name]['x'] / r['chain (lookupdec)']['x'] for r in groups[s]):.3f})"
                 for s in suites]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    return table


def _copy_lengths(prior: list, prompt: list, answer: list, limit: int, ngram: bool) -> np.ndarray:
    """For every output position i: the longest prefix of ``answer[i:]`` (at most ``limit``) that a copy from
    anywhere earlier reproduces (earlier outputs ``prior``, the prompt, the output before i; a copy may overlap
    the text it is writing, as an LZ77 copy does). ``ngram``: only copies whose source is preceded by the same
    token as position i, i.e. those an n-gram index can find."""
    seq = np.asarray([*prior, -1, *prompt, *answer], dtype=np.int64)
    base = len(prior) + 1 + len(prompt)
    lengths = np.zeros(len(answer), dtype=np.int64)
    for i in range(len(answer)):
        q = base + i
        cand = np.flatnonzero(seq[:q] == seq[q])
        if ngram:
            cand = cand[(cand > 0) & (seq[np.maximum(cand - 1, 0)] == seq[q - 1])]
        k = 0
        while cand.size and k < limit and q + k < len(seq):
            cand = cand[seq[cand + k] == seq[q + k]]
            k += bool(cand.size)
        lengths[i] = k
    return lengths


def _hindsight(lengths: np.ndarray, cost, max_draft: int) -> float:
    """Least total pass cost of an output of ``n = len(lengths)`` tokens for a drafter that, at each position i,
    can draft a copy of which at most ``lengths[i]`` tokens are right, and knows in hindsight how many will be.

    A pass drafting d tokens at i costs ``cost(d)`` and moves to i + a + 1 for any a <= min(d, lengths[i]) (a worse
    copy gets fewer right), at most ``n - i - 1`` drafted as in ``replay``. Drafting past the right length is
    allowed: a jagged cost curve can make a longer pass cheaper. The first token comes from the prefill pass.

    lengths  # [n] int
    """
    n = len(lengths)
    if n == 0:
        return 0.0
    best = np.zeros(n + 1)  # [n + 1] least cost from position i to the end
    for i in range(n - 1, 0, -1):
        top = min(max_draft, n - i - 1)
        # reach[a]: the cheapest way on after a pass that got a tokens right (a = 0 .. min(top, lengths[i])).
        reach = np.minimum.accumulate(best[i + 1: i + min(top, int(lengths[i])) + 2])
        best[i] = min(cost(d) + reach[min(d, reach.size - 1)] for d in range(top + 1))
    return cost(0) + best[1]


class _HindsightDrafter(Drafter):
    """``inner`` drafting (its copy source, acceptance estimates, cost fit and cache) with each draft's length
    chosen knowing the output ``answer``: ``choose(offer, right)``, where ``right`` is how many of the offered
    tokens are right. One request per instance; ``inner`` may serve a run of requests."""

    def __init__(self, inner: Drafter, answer: list, choose):
        super().__init__(DrafterConfig(adaptive=False, use_cache=False, calibrate=False))
        self.inner, self.answer, self.choose = inner, answer, choose
        self.session, self.start_len = None, 0

    def start(self, prompt, eos_ids=(), *, prediction=None, reproducible=False, client=None, use_cache=True):
        self.session = self.inner.start(prompt, eos_ids, prediction=prediction, reproducible=reproducible,
                                        client=client, use_cache=use_cache)
        self.start_len = len(self.session.index)  # the index then grows by exactly the committed output
        return self.session

    def length(self, offers, *, must_draft=False, fixed=False, widths=None) -> int:
        if widths:  # the replay runs on a growing cache: no padded widths to price
            raise ValueError("hindsight lengths are chosen for unpadded passes; the replay passes no widths")
        (offer,) = offers
        done = len(self.session.index) - self.start_len
        return self.choose(offer, _common_prefix(offer.tokens.tolist(), self.answer[done:]))

    def observe(self, rows, drafted, seconds, sessions=()):
        self.inner.observe(rows, drafted, seconds, sessions)


def _best_length_replay(drafter: Drafter, prompt: list, answer: list, cost, eos: int) -> dict:
    """``drafter`` chooses where to copy from (its occurrence, cursor and cache, as it does), and each pass drafts
    the length that turns out to give the most tokens per unit of cost in that pass (a per-pass choice, not the
    best schedule): the loss of our length policy and guard, measured apart from the loss of our choice of
    occurrence."""

    def choose(offer, right):
        return max(range(offer.tokens.size + 1), key=lambda d: ((min(d, right) + 1) / cost(d), -d))

    return replay(_HindsightDrafter(drafter, answer, choose), prompt, answer, cost, eos)


def _first_known_replay(drafter: Drafter, prompt: list, answer: list, cost, eos: int) -> dict:
    """``drafter`` (lookupdec), except that each pass knows whether the first token of its candidate is right: it
    skips the draft when not, and otherwise chooses the length as lookupdec does with the first token certain.
    What a perfect skip-or-draft decision alone would win."""

    def choose(offer, right):
        return drafter.length([Offer(offer.tokens, 1.0, offer.then)]) if right else 0

    return replay(_HindsightDrafter(drafter, answer, choose), prompt, answer, cost, eos)


def _oracle(answer: list) -> Drafter:
    """Drafts the true output, as long as lookupdec may draft (``DrafterConfig.max_draft``): the ceiling."""
    return OracleDrafter(answer, DrafterConfig().max_draft)


def study_bounds(prompts, cost, eos, out: Path) -> str:
    """Where the gap to the oracle comes from: the oracle, the best any copying drafter could do (lengths chosen
    with hindsight), the best an n-gram drafter could do, our choice of occurrence with per-pass best lengths,
    and lookupdec itself. One drafter per suite: earlier outputs of the suite are copyable, each with the few
    prompt tokens before it that the rolling cache keeps, as in the ablation."""
    max_draft = DrafterConfig().max_draft
    names = [f"oracle (drafts the true output, up to {max_draft} tokens)",
             "any copy, best lengths (hindsight bound)",
             "n-gram copy, best lengths (hindsight bound)",
             "lookupdec's copy source, per-pass best length",
             "lookupdec, knowing whether the first token is right",
             "lookupdec",
             "prompt lookup (transformers re-expressed, 10 tokens, 2-grams)"]
    rows = []
    for suite in dict.fromkeys(p.suite for p, _, _ in prompts):
        ours, hind, first = (_LookupFactory(cost, **ABLATIONS["lookupdec (all on)"]) for _ in range(3))
        prior = []
        for p, prompt, answer in (x for x in prompts if x[0].suite == suite):
            plain = len(answer) * cost(0)
            times = [
                replay(_oracle(answer), prompt, answer, cost, eos)["time"],
                _hindsight(_copy_lengths(prior, prompt, answer, max_draft, False), cost, max_draft),
                _hindsight(_copy_lengths(prior, prompt, answer, max_draft, True), cost, max_draft),
                _best_length_replay(hind(), prompt, answer, cost, eos)["time"],
                _first_known_replay(first(), prompt, answer, cost, eos)["time"],
                replay(ours(), prompt, answer, cost, eos)["time"],
                replay(_PromptLookupDrafter(10, 2), prompt, answer, cost, eos)["time"],
            ]
            rows.append({"suite": suite, **{name: plain / t for name, t in zip(names, times)}})
            prior += [-1, *prompt[-ours.drafter.cache.max_n:], *answer]  # what the rolling cache keeps
            print(f"{suite}/{p.name:28s} " + " ".join(f"{plain / t:.2f}" for t in times), file=sys.stderr)
    suites = list(dict.fromkeys(r["suite"] for r in rows))
    counts = {s: sum(r["suite"] == s for r in rows) for s in suites}
    copy_heavy = [s for s in suites if s in COPY_HEAVY]
    groups = {**{f"{s} ({counts[s]})": [r for r in rows if r["suite"] == s] for s in suites},
              **({" + ".join(COPY_HEAVY): [r for r in rows if r["suite"] in copy_heavy]} if copy_heavy else {})}
    head = " | ".join(groups)
    lines = [(f"Simulated (cost model: {_cost_text(cost)}), replaying cached greedy outputs of {len(rows)} prompts; "
              "medians over each group's prompts. In brackets: the median per-prompt share of the oracle's speedup."),
             "", f"| simulated speedup over greedy | {head} |", "|---" * (len(groups) + 1) + "|"]
    oracle = names[0]
    for name in names:
        cells = [f"{statistics.median(r[name] for r in g):.2f}x "
                 f"({statistics.median(r[name] / r[oracle] for r in g):.0%})" for g in groups.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    pld = names[-1]
    lines += ["", f"| median per-prompt ratio to prompt lookup | {head} |", "|---" * (len(groups) + 1) + "|"]
    for name in names[:-1]:
        cells = [f"{statistics.median(r[name] / r[pld] for r in g):.2f}x" for g in groups.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    # Each step up from lookupdec to the any-copy bound, as a median per-prompt gain; the first-token row is the
    # part of the length step that a perfect skip-or-draft decision would win.
    steps = [(names[5], names[4], "knowing whether the first token is right"),
             (names[5], names[3], "per-pass best length, same copy source"),
             (names[3], names[2], "best n-gram copy instead of ours (hindsight lengths)"),
             (names[2], names[1], "copies an n-gram index cannot find")]
    lines += ["", f"| median per-prompt gain (the first row is part of the second) | {head} |",
              "|---" * (len(groups) + 1) + "|"]
    for low, high, what in steps:
        cells = [f"{statistics.median(r[high] / r[low] for r in g) - 1:+.0%}" for g in groups.values()]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    return table


def _cost_text(cost) -> str:
    """The cost model ``cost`` charges, in words, for the tables' captions."""
    if isinstance(cost, MeasuredCost):
        return (f"{cost.source}: "
                + ", ".join(f"d={d} {cost(d):.2f}" for d in (1, 2, 3, 4, 8, 16, 32, 64) if d < cost.profile.size))
    return "1 per plain step, 1.55 + 0.05 d per pass with d drafted tokens"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES))
    ap.add_argument("--per-suite", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--model", default=None)
    curves = ap.add_mutually_exclusive_group()
    curves.add_argument("--measure-cost", action="store_true",
                        help="charge the pass costs lookupdec.calibrate measures on this machine (and calibrate the "
                             "drafters with them) instead of the fixed straight-line model")
    curves.add_argument("--cost-file", type=Path, default=None, metavar="PATH",
                        help="charge (and calibrate with) the curve in PATH: a JSON list of relative pass costs by "
                             "draft length, cost[0] == 1, or benchmarks/device_check.py's device_check.json")
    curves.add_argument("--flat-cost", type=float, default=None, metavar="SLOPE",
                        help="charge (and calibrate with) an assumed GPU-like curve, 1 + SLOPE * d (e.g. 0.002)")
    ap.add_argument("--cost-curve", default=None, metavar="NAME",
                    help="with --cost-file device_check.json: which model's curve (e.g. 7B)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads while measuring the pass cost")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--ablate", action="store_true",
                    help="switch each drafting mechanism off in turn; replays cached greedy outputs only")
    ap.add_argument("--ablate-out", type=Path, default=Path("benchmarks/results/ablation.md"))
    ap.add_argument("--trees", action="store_true",
                    help="study token-tree drafts (2-3 branches per pass); replays cached greedy outputs only")
    ap.add_argument("--trees-out", type=Path, default=Path("benchmarks/results/trees.md"))
    ap.add_argument("--bounds", action="store_true",
                    help="where the gap to the oracle comes from: hindsight bounds for copying drafters; replays "
                         "cached greedy outputs only")
    ap.add_argument("--bounds-out", type=Path, default=Path("benchmarks/results/bounds.md"))
    ap.add_argument("--summary-out", type=Path, default=Path("benchmarks/results/simulate.md"),
                    help="where a plain replay writes its per-suite table")
    args = ap.parse_args(argv)
    if args.quick:
        args.per_suite = 2
    if args.cost_curve is not None and args.cost_file is None:
        ap.error("--cost-curve needs --cost-file")
    cost = cpu_cost
    try:
        if args.cost_file is not None:
            cost = load_cost_file(args.cost_file, args.cost_curve)
        elif args.flat_cost is not None:
            cost = flat_cost(args.flat_cost)
    except ValueError as err:
        ap.error(f"--cost-file / --flat-cost: {err}")
    if isinstance(cost, MeasuredCost):
        print(f"relative pass cost ({cost.source}):", np.round(cost.profile[: COST_LENGTHS + 1], 3).tolist())
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    if args.measure_cost:
        cost = MeasuredCost(pass_costs(model, 128))
        print("measured relative pass cost (lookupdec.calibrate):",
              np.round(cost.profile[: DrafterConfig().max_draft + 1], 2).tolist())

    cache_file = args.out / f"greedy_{(args.model or 'smollm2').replace('/', '_')}_{args.max_new_tokens}.json"
    cached = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    eos = int(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, int)
              else model.generation_config.eos_token_id[0])
    if args.ablate or args.trees or args.bounds:
        prompts = []
        for p in pick_prompts(args):
            key = f"{p.suite}/{p.name}"
            if key in cached:
                prompts.append((p, encode(tokenizer, p.user)[0].tolist(), cached[key]))
            else:
                print(f"skipping {key}: no cached greedy output (a plain run of research.simulate makes it)",
                      file=sys.stderr)
        if args.ablate:
            print(ablate(prompts, cost, eos, args.ablate_out))
        if args.trees:
            print(study_trees(prompts, cost, eos, args.trees_out))
        if args.bounds:
            print(study_bounds(prompts, cost, eos, args.bounds_out))
        return
    rows = []
    for p in pick_prompts(args):
        ids = encode(tokenizer, p.user)
        key = f"{p.suite}/{p.name}"
        if key not in cached:
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=args.max_new_tokens)
            cached[key] = out[0, ids.shape[1]:].tolist()
            cache_file.write_text(json.dumps(cached))
        prompt, answer = ids[0].tolist(), cached[key]
        plain = len(answer) * cost(0)
        systems = {
            "pld": lambda: _PromptLookupDrafter(10, 2),
            "pld_20_3": lambda: _PromptLookupDrafter(20, 3),
            "lookupdec": _LookupFactory(cost),
            "fixed32": _LookupFactory(cost, adaptive=False, max_draft=32),
            "oracle": lambda: _oracle(answer),
        }
        row = {"suite": p.suite, "name": p.name, "tokens": len(answer)}
        for name, factory in systems.items():
            r = replay(factory(), prompt, answer, cost, eos)
            row[name] = plain / r["time"]
            row[f"tpp_{name}"] = r["tokens"] / r["passes"]
        rows.append(row)
        print(f"{key:28s} " + " ".join(f"{n} {row[n]:.2f} ({row[f'tpp_{n}']:.1f})" for n in systems))
    print()
    table = summarize_replay(rows, cost)
    args.summary_out.parent.mkdir(parents=True, exist_ok=True)
    args.summary_out.write_text(table)
    print(table)


def summarize_replay(rows: list, cost) -> str:
    """Markdown table of a plain replay's ``rows`` (one per prompt: speedup over greedy per system, tokens per
    pass): per suite, the pooled copy-heavy suites and all prompts, medians over prompts; ``vs pld`` and ``of
    oracle`` are per-prompt ratios, then the median, as benchmarks/run.py reports them."""
    suites = list(dict.fromkeys(r["suite"] for r in rows))
    groups = {s: [r for r in rows if r["suite"] == s] for s in suites}
    if all(s in suites for s in COPY_HEAVY):
        groups[" + ".join(COPY_HEAVY)] = [r for r in rows if r["suite"] in COPY_HEAVY]
    groups["all"] = rows
    lines = [f"Simulated (cost model: {_cost_text(cost)}), replaying cached greedy outputs of {len(rows)} prompts; "
             "medians over each group's prompts; `x` = speedup over greedy.", "",
             "| group | prompts | prompt lookup (10) x | prompt lookup (20, 3-grams) x | lookupdec x | oracle x "
             "| lookupdec vs prompt lookup (10) | of oracle | lookupdec tok/pass |", "|---" * 9 + "|"]
    for name, items in groups.items():
        med = {n: statistics.median(r[n] for r in items) for n in ("pld", "pld_20_3", "lookupdec", "oracle")}
        vs = statistics.median(r["lookupdec"] / r["pld"] for r in items)
        share = statistics.median(r["lookupdec"] / r["oracle"] for r in items)
        tpp = statistics.median(r["tpp_lookupdec"] for r in items)
        lines.append(f"| {name} | {len(items)} | {med['pld']:.2f} | {med['pld_20_3']:.2f} | {med['lookupdec']:.2f} "
                     f"| {med['oracle']:.2f} | {vs:.2f} | {share:.0%} | {tpp:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
