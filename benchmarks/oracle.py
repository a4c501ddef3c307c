"""The oracle: a drafter that knows the greedy output and drafts it, as far as lookupdec may draft. Every draft is
right, so only verification costs remain: the ceiling any lookup drafter can reach with this model, loop and
machine (``benchmarks/run.py --systems oracle``; ``research/simulate.py`` replays it).

The oracle is a stand-in on lookupdec's own driver, so it must keep to the driver's contract as lookupdec changes:
:meth:`lookupdec.drafter.Drafter.start`'s parameters and the :class:`lookupdec.drafter.Session` protocol.
:func:`protocol_mismatches` says where a stand-in departs from them; the tools' tests run it on every stand-in.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence

import numpy as np

from lookupdec.drafter import Drafter, DrafterConfig, Session
from lookupdec.policy import Offer


class OracleDrafter(Drafter):
    """Drafts ``answer`` (the greedy output's token ids) from where the output stands: no adaptive length (it
    drafts all it may, ``max_draft`` tokens), no cache, no calibration."""

    def __init__(self, answer: Sequence[int], max_draft: int):
        super().__init__(DrafterConfig(max_draft=max_draft, adaptive=False, use_cache=False, calibrate=False))
        self.answer = list(answer)

    def start(self, prompt: Sequence[int], eos_ids: Iterable[int] = (), *, prediction: Sequence[int] | None = None,
              reproducible: bool = False, client: str | None = None, use_cache: bool = True) -> OracleSession:
        """A session for one request; the prompt, EOS ids, prediction and cache change nothing (the answer is
        known)."""
        session = OracleSession(self.answer, self.drafter_config.max_draft)
        session.reproducible = bool(reproducible)
        return session


class OracleSession:
    """One request of :class:`OracleDrafter` (the :class:`~lookupdec.drafter.Session` protocol): offers the next
    ``max_draft`` tokens of the answer after those committed, with certain odds."""

    def __init__(self, answer: list, max_draft: int):
        self.answer, self.max_draft, self.done = answer, max_draft, 0
        self.reproducible = False
        self.offered = np.zeros(0, dtype=np.int32)

    def offer(self, limit: int) -> Offer:
        k = max(min(limit, self.max_draft), 0)
        self.offered = np.asarray(self.answer[self.done: self.done + k], dtype=np.int32)
        return Offer(self.offered, 1.0, 1.0)

    def take(self, length: int) -> np.ndarray:
        return self.offered[: max(length, 0)]

    def commit(self, tokens: Sequence[int], seconds: float | None = None) -> None:
        self.done += len(tokens)

    def finish(self, generated: int | None = None) -> None:
        """Nothing to keep: the oracle has no cache."""


def _accepts(method, reference) -> bool:
    """Whether ``method`` takes every parameter of ``reference`` as ``reference`` does (the same name, kind and
    default; the positional ones in the same places), and needs no other: any parameter it adds has a default."""
    mine = inspect.signature(method).parameters
    theirs = inspect.signature(reference).parameters

    def positional(params) -> list:
        return [name for name, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    if positional(mine)[: len(positional(theirs))] != positional(theirs):
        return False
    for name, p in theirs.items():
        if name not in mine or (mine[name].kind, mine[name].default) != (p.kind, p.default):
            return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for name, p in mine.items() if name not in theirs)


def protocol_mismatches(drafter: type, session: type) -> list[str]:
    """Where ``drafter`` (a :class:`~lookupdec.drafter.Drafter` subclass) and ``session`` (the class its ``start``
    returns) depart from lookupdec's driver: ``drafter.start`` must take what ``Drafter.start`` takes, and each
    method of the :class:`~lookupdec.drafter.Session` protocol what the protocol's takes (:func:`_accepts`).
    Empty when they follow it. A new parameter in lookupdec (a keyword the loops pass) shows here before a run
    fails on it."""
    out = []
    if not _accepts(drafter.start, Drafter.start):
        out.append(f"{drafter.__name__}.start{inspect.signature(drafter.start)} is not "
                   f"Drafter.start{inspect.signature(Drafter.start)}")
    for name in [n for n, v in vars(Session).items() if callable(v) and not n.startswith("_")]:
        method = getattr(session, name, None)
        if method is None:
            out.append(f"{session.__name__} has no {name}")
        elif not _accepts(method, getattr(Session, name)):
            out.append(f"{session.__name__}.{name}{inspect.signature(method)} is not "
                       f"Session.{name}{inspect.signature(getattr(Session, name))}")
    return out
