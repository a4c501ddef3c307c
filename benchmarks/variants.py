"""Drafting ideas we tried and did not build, kept runnable so the README's "Tried and not built" can be checked.

Five studies; all but ``--prefill`` replay the cached greedy outputs of ``simulate.py`` (run ``simulate.py`` once first):

- ``--variants``: other rules for where to copy from and how much to draft, against lookupdec as it is, in the
  same noise-free simulation as ``simulate.py --ablate`` (one drafter per suite; ``--measure-cost`` charges the
  pass cost measured on this machine). Each variant is a :class:`DraftSession` subclass below.
- ``--confidence``: does the target's confidence in the token it has just chosen (its top probability, from one
  teacher-forced pass over prompt + greedy output) predict whether the next draft from an index match is
  accepted? A table of acceptance against predicted odds, by confidence bin.
- ``--predictor``: a logistic model of whether a draft's first token is accepted, over cheap n-gram statistics
  (how many earlier occurrences of the suffix there are and how many continue with the candidate's first token,
  for n = 1..4): its cross-validated AUC against lookupdec's own odds, and the speed its odds buy when fitted on
  the other suites. (Knowing the answer outright is a row of ``simulate.py --bounds``.)
- ``--survival``: lengths chosen from a run-length model instead of the geometric one. Copies are bursty, so the
  chance that token i of a draft is right given the ones before it may change with i; this keeps, per source
  bucket, a forgotten count of drafts that reached and broke at each position (binned) and drafts the length with
  the most expected tokens per unit of cost under that survival curve.
- ``--prefill RESULTS``: how much of plain greedy's wall time in a ``run.py`` results file is the prompt's
  prefill (timed here, per prompt, at the run's thread count: fastest of 3), and the ratio of lookupdec to prompt
  lookup with that time left out. An estimate (the prefill is timed apart from the run), for explaining how the
  prefill compresses wall-clock ratios; the README's targets are on wall time.

Examples::

    python benchmarks/variants.py --variants --measure-cost
    python benchmarks/variants.py --confidence --measure-cost
    python benchmarks/variants.py --predictor --measure-cost
    python benchmarks/variants.py --survival --measure-cost
    python benchmarks/variants.py --prefill benchmarks/results/full3/results.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from run import encode, pick_prompts
from simulate import (
    ABLATIONS,
    MeasuredCost,
    _cost_text,
    _LookupFactory,
    cpu_cost,
    replay,
    replay_offers,
)
from workloads import SUITES

from lookupdec import LookupDrafter
from lookupdec.costs import pass_costs
from lookupdec.drafter import (
    DraftSession,
    Offer,
    _bucket,
    _cost_curve,
)
from lookupdec.models import load_model

# name -> (occurrence rule, scale odds by agreement, length rule, first-token model weights); None keeps
# lookupdec's own choice. The weights of the logistic first-token model are fitted by --predictor.
VARIANTS = {
    "lookupdec (all on)": (None, False, None, None),
    "occurrence: longest shared context": ("longest", False, None, None),
    "occurrence: majority vote on the next token": ("vote", False, None, None),
    "occurrence: first after where the last copy ended": ("near", False, None, None),
    "odds scaled by agreement, plus the vote": ("vote", True, None, None),
    "length by net gain, rate 1.3": (None, False, 1.3, None),
    "length by net gain, rate 2.0": (None, False, 2.0, None),
    "length by net gain, running rate": (None, False, "running", None),
}
# First-token odds multiplier by how the earlier occurrences of the suffix continue, relative to the candidate:
# all agree with it, most do, fewer than half do, or there is only one.
_AGREEMENT_SCALE = {"agree": 1.3, "most": 1.0, "split": 0.6, "single": 1.0}
_NEAR_WINDOW = 64  # tokens after the last copy's end that "near" searches
_RATE_KEEP = 0.9  # forgetting of the running rate, per pass


def _occurrences(tokens: np.ndarray, n: int) -> np.ndarray:
    """Sources (positions right after an earlier occurrence) of the suffix n-gram, oldest first."""
    length = len(tokens)
    windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
    return np.flatnonzero((windows == tokens[length - n:]).all(axis=1)) + n


class _VariantSession(DraftSession):
    """A DraftSession whose index matches choose their source by ``rule``, whose odds can be scaled by agreement,
    and whose length can be chosen by net gain against a rate."""

    def __init__(self, drafter, prompt, eos_ids, variant):
        super().__init__(drafter, prompt, eos_ids)
        self._rule, self._scale, self._rate_rule, self._weights = variant
        self._last_end = -1  # source position right after the last accepted copy
        self._agreement = None
        self._rate = [1.0, 1.0]  # tokens, cost (forgotten)

    def _candidate(self, limit):
        bucket, src, candidate = super()._candidate(limit)
        self._agreement = None
        if bucket is None or bucket[0] == "cache" or candidate.size == 0:
            return bucket, src, candidate
        tokens = self.index.tokens
        n = self.index.match()[0] if bucket[0] == "index" else min(max(self.index.match_length(src, 4), 1), 4)
        hits = _occurrences(tokens, max(n, 1))
        following = tokens[hits]
        if bucket[0] == "index" and hits.size > 1 and self._rule is not None:
            chosen = self._choose(hits, following, candidate)
            if chosen is not None and chosen != src:
                src, candidate = chosen, self._copy(chosen, limit)
                bucket = _bucket("index", self.index.match_length(src, 32))
        if hits.size <= 1:
            self._agreement = "single"
        else:
            share = float((following == candidate[0]).mean())
            self._agreement = "agree" if share == 1 else "most" if share >= 0.5 else "split"
        return bucket, src, candidate

    def _choose(self, hits, following, candidate):
        if self._rule == "longest":
            shared = np.array([self.index.match_length(int(h), 32) for h in hits])
            return int(hits[shared == shared.max()][-1])
        if self._rule == "vote":
            values, counts = np.unique(following, return_counts=True)
            top = values[counts == counts.max()]
            return None if candidate[0] in top else int(hits[np.isin(following, top)][-1])
        if self._rule == "near" and self._last_end >= 0:
            after = hits[(hits >= self._last_end) & (hits < self._last_end + _NEAR_WINDOW)]
            return int(after[0]) if after.size else None
        return None

    def offer(self, limit):
        offer = super().offer(limit)
        if self._scale and self._agreement is not None and offer.tokens.size:
            offer = Offer(offer.tokens, min(offer.first * _AGREEMENT_SCALE[self._agreement], 0.99), offer.then)
        if self._weights is not None and offer.tokens.size:
            z = float(self._weights @ first_token_features(self, offer))
            offer = Offer(offer.tokens, 1.0 / (1.0 + np.exp(-z)), offer.then)
        return offer

    def propose(self, limit, *, must_draft=False):
        if self._rate_rule is None:
            return super().propose(limit, must_draft=must_draft)
        offer = self.offer(limit)
        if offer.tokens.size == 0:
            return self.take(0)
        costs = _cost_curve(self._drafter.cost.costs(offer.tokens.size))
        rate = self._rate[0] / self._rate[1] if self._rate_rule == "running" else self._rate_rule
        tokens = 1.0 + offer.first * np.cumsum(offer.then ** np.arange(costs.size - 1, dtype=np.float64))
        net = tokens - rate * costs[1:]
        best = int(np.argmax(net))
        return self.take(best + 1 if net[best] > 1.0 - rate + 0.02 else 0)

    def commit(self, tokens, accepted, seconds=None):
        _, src, draft = self._pending
        cost = float(self._drafter.cost.costs(len(draft))[-1]) if len(draft) else 1.0
        self._rate = [self._rate[0] * _RATE_KEEP + len(tokens), self._rate[1] * _RATE_KEEP + cost]
        super().commit(tokens, accepted, seconds)
        if src >= 0 and accepted:
            self._last_end = src + accepted + 1
        elif self._cursor >= 0:
            self._last_end = self._cursor


class _VariantDrafter(LookupDrafter):
    def __init__(self, variant, **config):
        super().__init__(**config)
        self.variant = variant

    def start(self, prompt, eos_ids=()):
        return _VariantSession(self, np.asarray(prompt, dtype=np.int32), frozenset(int(t) for t in eos_ids),
                               self.variant)


def _factory(variant, cost, eos) -> _LookupFactory:
    """One variant drafter per suite (``reset`` between suites), calibrated like simulate.py's drafters."""
    return _LookupFactory(cost, eos, drafter_class=functools.partial(_VariantDrafter, variant),
                          **ABLATIONS["lookupdec (all on)"])


def study_variants(prompts, cost, eos) -> str:
    factories = {name: _factory(variant, cost, eos) for name, variant in VARIANTS.items()}
    rows = []
    for suite in dict.fromkeys(p.suite for p, _, _ in prompts):
        for factory in factories.values():
            factory.reset()
        for p, prompt, answer in (x for x in prompts if x[0].suite == suite):
            plain = len(answer) * cost(0)
            rows.append({"suite": suite, **{name: plain / replay(f, prompt, answer, cost, eos)["time"]
                                            for name, f in factories.items()}})
            print(f"{suite}/{p.name:28s} " + " ".join(f"{rows[-1][n]:.2f}" for n in factories), file=sys.stderr)
    suites = list(dict.fromkeys(r["suite"] for r in rows))
    base = next(iter(VARIANTS))
    lines = [(f"Simulated (cost model: {_cost_text(cost)}), one drafter per suite; median speedup over greedy, and "
              "in brackets the median per-prompt ratio to lookupdec as it is."), "",
             "| variant | " + " | ".join(suites) + " |", "|---" * (len(suites) + 1) + "|"]
    for name in VARIANTS:
        cells = [f"{statistics.median(r[name] for r in rows if r['suite'] == s):.2f}x "
                 f"({statistics.median(r[name] / r[base] for r in rows if r['suite'] == s):.3f})" for s in suites]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def study_confidence(prompts, model, cost, eos) -> str:
    """Acceptance of index-match drafts against the target's top probability at the token before them."""
    bins = [(0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 0.98), (0.98, 1.01)]
    tally = {b: [0, 0, 0.0] for b in bins}  # offers, first token right, predicted first
    for suite in dict.fromkeys(p.suite for p, _, _ in prompts):
        factory = _factory(VARIANTS["lookupdec (all on)"], cost, eos)
        for p, prompt, answer in (x for x in prompts if x[0].suite == suite):
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1: -1].float()
            top = logits.softmax(-1).max(-1).values.tolist()  # [len(answer)] the target's confidence per token

            def choose(session, offer, right, done, top=top):
                bucket = session._offered[0]
                if bucket is not None and bucket[0] == "index":
                    b = next(b for b in bins if b[0] <= top[done - 1] < b[1])
                    tally[b][0] += 1
                    tally[b][1] += right > 0
                    tally[b][2] += offer.first
                return session.length(offer)

            replay_offers(factory, prompt, answer, cost, choose)
    lines = ["Index-match offers by the target's top probability at the token before the draft (teacher-forced).",
             "", "| top probability | offers | first token accepted | predicted by lookupdec |", "|---|---|---|---|"]
    for (lo, hi), (n, right, predicted) in tally.items():
        if n:
            lines.append(f"| {lo:.2f}-{min(hi, 1.0):.2f} | {n} | {right / n:.0%} | {predicted / n:.0%} |")
    return "\n".join(lines) + "\n"


def first_token_features(session, offer) -> np.ndarray:
    """Cheap n-gram statistics that might tell whether a candidate's first token will be accepted: lookupdec's own
    odds (as a logit), and for n = 1..4 how many earlier occurrences the suffix n-gram has and how many of them
    continue with the candidate's first token. [18] float64, the first entry the intercept."""
    p = min(max(offer.first, 1e-3), 1.0 - 1e-3)
    features = [1.0, np.log(p / (1.0 - p))]
    tokens = session.index.tokens
    for n in range(1, 5):
        hits = _occurrences(tokens, n) if len(tokens) > n else np.empty(0, dtype=np.int64)
        agree = int((tokens[hits] == offer.tokens[0]).sum())
        features += [np.log1p(hits.size), agree / hits.size if hits.size else 0.0, float(hits.size == 0),
                     np.log1p(agree)]
    return np.asarray(features)


def _fit_logistic(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Weights of a logistic model, lightly L2-regularised (scipy is in the test extra)."""
    from scipy.optimize import minimize

    def loss(w):
        z = x @ w
        return float(np.sum(np.logaddexp(0.0, z) - y * z) + 0.01 * w @ w)

    return minimize(loss, np.zeros(x.shape[1]), method="L-BFGS-B").x


def _auc(score: np.ndarray, y: np.ndarray) -> float:
    ranks = np.empty(len(score))
    ranks[np.argsort(score, kind="stable")] = np.arange(len(score))
    positive = y == 1
    return float((ranks[positive].mean() - (positive.sum() - 1) / 2) / (~positive).sum())


def study_predictor(prompts, cost, eos) -> str:
    """How well cheap statistics predict a draft's first token, and what better odds would buy.

    Collects every offer of a plain lookupdec replay with its features and outcome; reports the AUC of lookupdec's
    own odds and the 5-fold cross-validated AUC of a logistic model over :func:`first_token_features`; then
    replays each suite with that model (fitted on the other suites) supplying the first-token odds."""
    samples = []  # (suite, features, first token right)
    for suite in dict.fromkeys(p.suite for p, _, _ in prompts):
        factory = _factory(VARIANTS["lookupdec (all on)"], cost, eos)

        def choose(session, offer, right, done, suite=suite):
            if offer.tokens.size:
                samples.append((suite, first_token_features(session, offer), float(right > 0)))
            return session.length(offer)

        for _, prompt, answer in (x for x in prompts if x[0].suite == suite):
            replay_offers(factory, prompt, answer, cost, choose)
    suites = np.array([s for s, _, _ in samples])
    x = np.stack([f for _, f, _ in samples])
    y = np.array([r for _, _, r in samples])
    folds = np.random.default_rng(0).integers(0, 5, len(y))
    score = np.zeros(len(y))
    for fold in range(5):
        train = folds != fold
        score[~train] = x[~train] @ _fit_logistic(x[train], y[train])
    weights = {s: _fit_logistic(x[suites != s], y[suites != s]) for s in dict.fromkeys(suites)}
    rows = []
    for suite in dict.fromkeys(p.suite for p, _, _ in prompts):
        factories = {"lookupdec (all on)": _factory(VARIANTS["lookupdec (all on)"], cost, eos),
                     "first-token odds from the logistic model": _factory((None, False, None, weights[suite]), cost,
                                                                          eos)}
        for _, prompt, answer in (x for x in prompts if x[0].suite == suite):
            plain = len(answer) * cost(0)
            rows.append({"suite": suite, **{name: plain / replay(f, prompt, answer, cost, eos)["time"]
                                            for name, f in factories.items()}})
    names = list(rows[0])[1:]
    order = list(dict.fromkeys(r["suite"] for r in rows))
    lines = [(f"{len(y)} offers; first token accepted in {y.mean():.0%}. AUC of lookupdec's odds "
              f"{_auc(x[:, 1], y):.3f}; of the logistic model, 5-fold cross-validated, {_auc(score, y):.3f}."), "",
             ("Replayed with the model fitted on the other suites (medians; in brackets the median per-prompt ratio "
              "to lookupdec):"), "", "| | " + " | ".join(order) + " |", "|---" * (len(order) + 1) + "|"]
    for name in names:
        cells = [f"{statistics.median(r[name] for r in rows if r['suite'] == s):.2f}x "
                 f"({statistics.median(r[name] / r[names[0]] for r in rows if r['suite'] == s):.3f})"
                 for s in order]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# Draft positions (1 = the first drafted token) binned for the survival model: [1], [2], [3], [4, 5], [6, 8], ...
_SURVIVAL_EDGES = np.array([1, 2, 3, 4, 6, 9, 13, 17, 25, 33, 49, 65])
_SURVIVAL_PRIOR = 4.0  # pseudo-positions at risk behind each bin's prior hazard, 1 - then (a wide bin sees more)
_SURVIVAL_KEEP = 0.97  # forgetting per update, as the drafter's own estimates


class _Survival:
    """Per source bucket, forgotten counts of drafts at risk and broken at each binned position >= 2 (position 1 is
    the drafter's own first-token odds)."""

    def __init__(self):
        self.counts = {}  # bucket -> (at risk [bins], broke [bins])

    def _bins(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(_SURVIVAL_EDGES, np.minimum(positions, _SURVIVAL_EDGES[-1] - 1), side="right") - 1

    def length(self, session, offer) -> int:
        """The length with the most expected tokens per unit of cost, or 0 when none beats a plain step by 2%."""
        size = offer.tokens.size
        if size == 0:
            return 0
        bins = len(_SURVIVAL_EDGES) - 1
        risk, broke = self.counts.get(session._offered[0], (np.zeros(bins), np.zeros(bins)))
        hazard = (broke + (1 - offer.then) * _SURVIVAL_PRIOR) / (risk + _SURVIVAL_PRIOR)
        per_token = hazard[self._bins(np.arange(1, size + 1))]
        per_token[0] = 1 - offer.first
        gains = (1 + np.cumsum(np.cumprod(1 - per_token))) / session._drafter.cost.costs(size)[1:]
        best = int(np.argmax(gains))
        return best + 1 if gains[best] > 1.02 else 0

    def update(self, bucket, accepted: int, drafted: int) -> None:
        """A draft of ``drafted`` tokens got ``accepted`` right: positions 2 .. accepted + 1 (as far as drafted) were
        at risk, and position accepted + 1 broke if it was drafted."""
        if drafted == 0 or accepted == 0:
            return  # position 1 is the drafter's first-token estimate
        bins = len(_SURVIVAL_EDGES) - 1
        risk, broke = (c * _SURVIVAL_KEEP for c in self.counts.get(bucket, (np.zeros(bins), np.zeros(bins))))
        np.add.at(risk, self._bins(np.arange(2, min(accepted + 1, drafted) + 1)), 1.0)
        if accepted < drafted:
            broke[self._bins(np.array([accepted + 1]))[0]] += 1.0
        self.counts[bucket] = (risk, broke)


def study_survival(prompts, cost, eos) -> str:
    """lookupdec's lengths against lengths from :class:`_Survival`, the same copy sources, one drafter per suite."""
    rows = []
    for suite in dict.fromkeys(p.suite for p, _, _ in prompts):
        ours, theirs, model = _factory(VARIANTS["lookupdec (all on)"], cost, eos), \
            _factory(VARIANTS["lookupdec (all on)"], cost, eos), _Survival()

        def choose(session, offer, right, done, model=model):
            length = model.length(session, offer)
            model.update(session._offered[0], min(length, right), length)
            return length

        for _, prompt, answer in (x for x in prompts if x[0].suite == suite):
            plain = len(answer) * cost(0)
            base = replay_offers(ours, prompt, answer, cost, lambda s, o, r, d: s.length(o))["time"]
            rows.append({"suite": suite, "lookupdec": plain / base,
                         "survival": plain / replay_offers(theirs, prompt, answer, cost, choose)["time"]})
    order = list(dict.fromkeys(r["suite"] for r in rows))
    lines = [(f"Simulated (cost model: {_cost_text(cost)}), one drafter per suite; median speedup over greedy, and "
              "in brackets the median per-prompt ratio to lookupdec (min .. max)."), "",
             "| | " + " | ".join(order) + " |", "|---" * (len(order) + 1) + "|"]
    for name in ("lookupdec", "survival"):
        cells = []
        for s in order:
            ratios = [r[name] / r["lookupdec"] for r in rows if r["suite"] == s]
            cells.append(f"{statistics.median(r[name] for r in rows if r['suite'] == s):.2f}x "
                         f"({statistics.median(ratios):.3f}, {min(ratios):.2f} .. {max(ratios):.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def study_prefill(results: Path, model, tokenizer) -> str:
    data = json.loads(results.read_text())
    threads = int(data["meta"]["machine"].split(",")[1].split()[0])
    torch.set_num_threads(threads)
    by_key = {f"{p.suite}/{p.name}": p for suite in SUITES for p in SUITES[suite]()}
    per_suite = {}
    for rec in data["records"]:
        ids = encode(tokenizer, by_key[f"{rec['suite']}/{rec['name']}"].user)
        prefill = min(_timed_prefill(model, ids) for _ in range(3))
        seconds = {s: statistics.median(r["seconds"] for r in rec["runs"] if r["system"] == s)
                   for s in ("greedy", "pld", "lookupdec")}
        per_suite.setdefault(rec["suite"], []).append((
            prefill / seconds["greedy"], seconds["pld"] / seconds["lookupdec"],
            (seconds["pld"] - prefill) / (seconds["lookupdec"] - prefill)))
    lines = [f"Prefill timed here ({threads} torch thread(s), fastest of 3) against {results}; medians per suite.", "",
             "| suite | prefill share of greedy | lookupdec vs prompt lookup (wall) | prefill left out |",
             "|---|---|---|---|"]
    for suite, items in per_suite.items():
        share, wall, rest = (statistics.median(x[i] for x in items) for i in range(3))
        lines.append(f"| {suite} | {share:.0%} | {wall:.2f}x | {rest:.2f}x |")
    return "\n".join(lines) + "\n"


def _timed_prefill(model, ids: torch.Tensor) -> float:
    """Seconds of one prefill pass over ``ids`` [1, prompt_len] (logits of the last position only)."""
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids, logits_to_keep=1)
        return time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", action="store_true", help="replay the drafting variants against lookupdec")
    ap.add_argument("--confidence", action="store_true", help="acceptance by the target's confidence")
    ap.add_argument("--predictor", action="store_true",
                    help="a logistic first-token model over n-gram statistics: its AUC, and the speed it buys")
    ap.add_argument("--survival", action="store_true",
                    help="lengths from a per-position run-length model instead of the geometric one")
    ap.add_argument("--prefill", type=Path, help="a run.py results.json: prefill share and ratios without it")
    ap.add_argument("--measure-cost", action="store_true", help="charge the pass cost measured on this machine")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--greedy", type=Path, default=Path("benchmarks/results/greedy_smollm2_256.json"),
                    help="simulate.py's cached greedy outputs")
    args = ap.parse_args(argv)
    if not (args.variants or args.confidence or args.predictor or args.survival or args.prefill):
        ap.error("choose --variants, --confidence, --predictor, --survival or --prefill")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(None)
    if args.prefill:
        print(study_prefill(args.prefill, model, tokenizer))
    if not (args.variants or args.confidence or args.predictor or args.survival):
        return
    cost = MeasuredCost(pass_costs(model, 128)) if args.measure_cost else cpu_cost
    eos = model.generation_config.eos_token_id
    eos = int(eos if isinstance(eos, int) else eos[0])
    if not args.greedy.exists():
        ap.error(f"{args.greedy} not found: run benchmarks/simulate.py once to cache the greedy outputs")
    cached = json.loads(args.greedy.read_text())
    picked = pick_prompts(argparse.Namespace(suites=list(SUITES), per_suite=6))
    prompts = [(p, encode(tokenizer, p.user)[0].tolist(), cached[f"{p.suite}/{p.name}"])
               for p in picked if f"{p.suite}/{p.name}" in cached]
    if args.variants:
        print(study_variants(prompts, cost, eos))
    if args.confidence:
        print(study_confidence(prompts, model, cost, eos))
    if args.predictor:
        print(study_predictor(prompts, cost, eos))
    if args.survival:
        print(study_survival(prompts, cost, eos))


if __name__ == "__main__":
    main()
