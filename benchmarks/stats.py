"""How the tools summarise a set of per-prompt or per-request ratios: the median, the tail and the worst case, so a
table shows the prompt a median hides as well as the typical one."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def nearest_rank(values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile of ``values`` by nearest rank: the smallest value with at least ``pct`` % of them
    at or below it. A value that was measured, never one interpolated between two; with fewer than ten values the
    10th percentile is the smallest and the 95th the largest."""
    if not values:
        raise ValueError("no values")
    if not 0 < pct <= 100:
        raise ValueError(f"pct must be in (0, 100], got {pct}")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct * len(ordered) / 100) - 1)]


def spread(named: dict) -> dict:
    """``named``: {prompt or request name: ratio, where higher is better (a speedup)}. Returns the median, the
    10th percentile by nearest rank (:func:`nearest_rank`), the worst ratio and whose it is, and how many."""
    if not named:
        return {"n": 0, "median": None, "p10": None, "worst": None, "worst_name": None}
    worst = min(named, key=named.get)
    values = list(named.values())
    return {"n": len(values), "median": statistics.median(values), "p10": nearest_rank(values, 10),
            "worst": named[worst], "worst_name": worst}


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None where either is missing or ``b`` is 0 (a figure that was not measured)."""
    return a / b if a is not None and b else None
