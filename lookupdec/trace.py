"""Traces of lookup decoding that people can look at: what was drafted, what the target kept, pass by pass.

:class:`TraceRecorder` is the ``trace=`` hook of :func:`lookupdec.generate`. It stores one :class:`TraceStep` per
target pass, grouped by request (one :class:`RequestTrace` per ``generate`` call), and renders them as HTML:
accepted draft tokens green, the first rejected draft token red and struck through, the target's own token of
each pass plain. In a notebook the recorder displays itself (``_repr_html_``); ``save_html(path)`` writes a
self-contained page (this is what ``lookupdec reformat --trace out.html`` writes).

Two plot helpers (matplotlib, imported only when called): :func:`plot_tokens_per_pass`, and
:func:`plot_expected_speedup`, the drafter's cost model (``best_draft_length`` in ``policy.py``) evaluated at the
acceptance the trace measured, with the run itself marked.

Vocabulary, as in ``verify.py`` and ``loop.py``: a *pass* is one forward of the target model. A pass that checked a
draft of ``d`` tokens keeps the ``accepted`` leading ones the target agrees with, plus one token of the target's
own (recovered where a draft token was rejected, bonus where all were accepted). The prefill is the first pass,
with an empty draft.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._fs import atomic_write
from .drafter import DrafterConfig
from .policy import PassCost, draft_gains, linear_costs


@dataclass(frozen=True)
class TraceStep:
    """One target pass."""

    draft: tuple  # token ids the pass checked; () for the prefill and for plain steps
    accepted: int  # leading draft tokens the target agreed with
    token: int  # the target's own token: recovered (after a rejection) or bonus (after a full accept)
    kept: int  # how many of ``accepted + 1`` tokens were committed; fewer only where generation stopped
    seconds: float  # the pass's forward time

    @property
    def committed(self) -> tuple:
        """The tokens this pass added to the output."""
        return (self.draft[: self.accepted] + (self.token,))[: self.kept]

    @property
    def rejected(self) -> int | None:
        """The first draft token the target disagreed with, or None (nothing drafted, all accepted, or generation
        stopped before it, in which case it never mattered)."""
        if self.accepted < len(self.draft) and self.kept == self.accepted + 1:
            return self.draft[self.accepted]
        return None


@dataclass
class RequestTrace:
    """The passes of one ``generate`` call."""

    prompt: tuple  # the prompt's token ids
    label: str | None = None  # a heading for this request in the HTML (a file section, a prompt's name)
    note: str | None = None  # a line shown under the heading (e.g. why its output was rejected)
    steps: list[TraceStep] = field(default_factory=list)

    @property
    def output(self) -> tuple:
        """The generated token ids, in order."""
        return tuple(t for step in self.steps for t in step.committed)


class TraceSummary:
    """Counts over a list of steps. Tokens per pass includes each pass's own target token and the prefill, as
    :class:`~lookupdec.stats.GenerationStats` counts them; the acceptance rates are those the drafter estimates
    (``policy.Acceptance``): ``first``, the share of drafts whose first token was accepted, and ``then``, the
    chance that each further draft token was accepted given the ones before it were."""

    def __init__(self, steps: Sequence[TraceStep]):
        drafts = [s for s in steps if s.draft]
        self.passes = len(steps)
        self.new_tokens = sum(s.kept for s in steps)
        self.drafts = len(drafts)
        self.drafted = sum(len(s.draft) for s in drafts)
        self.accepted = sum(s.accepted for s in drafts)
        self.seconds = sum(s.seconds for s in steps)
        hits = [s for s in drafts if s.accepted]
        continuations = sum(s.accepted - 1 for s in hits)
        stops = sum(1 for s in hits if s.accepted < len(s.draft))
        self.first = len(hits) / len(drafts) if drafts else 0.0
        self.then = continuations / (continuations + stops) if continuations + stops else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / self.passes if self.passes else 0.0

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens over drafted ones."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def line(self) -> str:
        text = (f"{self.passes} passes, {self.new_tokens} new tokens, {self.tokens_per_pass:.2f} tokens/pass; "
                f"{self.drafts} drafts, {self.accepted}/{self.drafted} draft tokens accepted")
        return text + (f" ({self.acceptance:.0%})" if self.drafted else "")


class TraceRecorder:
    """Records :func:`lookupdec.generate` pass by pass (pass it as ``trace=``); renders the record as HTML.

    One recorder may follow several ``generate`` calls: each ``start`` begins a new :class:`RequestTrace`,
    labelled with the recorder's ``label`` at that moment. ``tokenizer`` (optional) turns token ids into text for
    the HTML; without it tokens are shown as ``[id]``. Not thread-safe: use one recorder per concurrent request.
    """

    def __init__(self, tokenizer=None, *, title: str = "lookupdec trace"):
        self.tokenizer = tokenizer
        self.title = title
        self.label: str | None = None  # given to the requests that start from now on
        self.requests: list[RequestTrace] = []

    # The hook protocol of lookupdec.generate

    def start(self, prompt: Sequence[int]) -> None:
        self.requests.append(RequestTrace(tuple(int(t) for t in prompt), label=self.label))

    def step(self, draft: Sequence[int], accepted: int, token: int, kept: int, seconds: float) -> None:
        if not self.requests:
            raise RuntimeError("TraceRecorder.step before start: pass the recorder as generate(trace=...)")
        self.requests[-1].steps.append(
            TraceStep(tuple(int(t) for t in draft), int(accepted), int(token), int(kept), float(seconds)))

    # Reading the record

    @property
    def steps(self) -> list[TraceStep]:
        """Every pass of every request, in order."""
        return [step for request in self.requests for step in request.steps]

    def summary(self) -> TraceSummary:
        return TraceSummary(self.steps)

    # HTML

    def to_html(self, *, full_page: bool = False) -> str:
        """The trace as HTML: a summary line, a legend, then each request's output with its passes marked.
        ``full_page`` wraps it in a standalone document (what :meth:`save_html` writes)."""
        blocks = []
        for request in self.requests:
            heading = f"<h3>{html.escape(request.label)}</h3>" if request.label else ""
            note = f'<p class="ld-note">{html.escape(request.note)}</p>' if request.note else ""
            stats = f'<p class="ld-stats">{html.escape(TraceSummary(request.steps).line())}</p>'
            text = self._render_request(request)
            blocks.append(f'<div class="ld-request">{heading}{note}{stats}<div class="ld-text">{text}</div></div>')
        body = (f'<div class="ld-trace">{_STYLE}'
                f'<p class="ld-summary">{html.escape(self.summary().line())}</p>{_LEGEND}{"".join(blocks)}</div>')
        if not full_page:
            return body
        return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
                f"<title>{html.escape(self.title)}</title>\n</head>\n<body>\n<h2>{html.escape(self.title)}</h2>\n"
                f"{body}\n</body>\n</html>\n")

    def _repr_html_(self) -> str:
        return self.to_html()

    def save_html(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_html` as a standalone page, atomically (``lookupdec._fs.atomic_write``): ``path`` is
        never seen half-written, and a failure leaves no temporary file."""
        with atomic_write(path) as file:
            file.write(self.to_html(full_page=True))

    def _render_request(self, request: RequestTrace) -> str:
        """The request's output, pass by pass: each pass's accepted draft tokens, its first rejected draft token
        (shown, but not part of the text), then its target token; each pass in a span whose tooltip says what it
        did."""
        context = list(request.prompt)  # prompt + committed tokens so far (the decoder looks at the last few)
        passes = []
        for pos, step in enumerate(request.steps):
            accepted, rejected, target = "", "", ""
            for i, token in enumerate(step.committed):
                if i == step.accepted and step.rejected is not None:  # context ends with the accepted tokens
                    # Not part of the text: a line break shows as a sign instead of breaking the line.
                    rejected = self._piece(context, step.rejected).replace("\n", "\u21b5")
                if i < step.accepted:
                    accepted += self._piece(context, token)
                else:
                    target += self._piece(context, token)
                context.append(token)
            spans = "".join(f'<span class="{kind}">{html.escape(text)}</span>' for kind, text in (
                ("ld-acc", accepted), ("ld-rej", rejected), ("ld-tgt", target)) if text)
            if pos == 0:
                what = "prefill"
            elif step.draft:
                what = f"drafted {len(step.draft)}, accepted {step.accepted}"
            else:
                what = "no draft"
            title = f"pass {pos + 1}: {what}, +{step.kept} token{'s' * (step.kept != 1)}"
            passes.append(f'<span class="ld-pass" title="{html.escape(title)}">{spans}</span>')
        return "".join(passes)

    def _piece(self, context: Sequence[int], token: int) -> str:
        """The text ``token`` adds after ``context``, decoded in context so word-initial spaces (SentencePiece)
        and multi-byte characters split over tokens come out right."""
        if self.tokenizer is None:
            return f"[{token}]"
        window = list(context[-8:])
        before = self.tokenizer.decode(window).rstrip("\ufffd")
        after = self.tokenizer.decode(window + [token]).rstrip("\ufffd")  # a partial character waits for its end
        if after.startswith(before):
            return after[len(before):]
        return self.tokenizer.decode([token])


_STYLE = """<style>
.ld-trace { font-family: system-ui, sans-serif; font-size: 14px; }
.ld-trace .ld-text { font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.5;
  border: 1px solid #ddd; padding: 6px; }
.ld-trace .ld-acc { background: #c8f0c8; color: #0b4d0b; }
.ld-trace .ld-rej { background: #f8c8c8; color: #8b0000; text-decoration: line-through; }
.ld-trace .ld-pass:hover { outline: 1px dotted #888; }
.ld-trace .ld-stats, .ld-trace .ld-note { margin: 2px 0; color: #555; }
.ld-trace h3 { margin: 12px 0 2px; font-size: 15px; }
</style>"""

_LEGEND = ('<p class="ld-legend"><span class="ld-acc">accepted draft token</span> '
           '<span class="ld-rej">rejected draft token</span> <span class="ld-tgt">target token</span> '
           "(hover for each pass)</p>")


# --------------------------------------------------------------------------------------------------------------
# Plots


Traces = TraceRecorder | Sequence[TraceRecorder] | dict[str, TraceRecorder]


def plot_tokens_per_pass(traces: Traces, ax=None, *, window: int = 8):
    """Tokens each pass added, over the passes of a run (prefill left out), as light bars with a running mean
    over ``window`` passes. ``traces``: one recorder, a list, or ``{label: recorder}``. Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        ax = plt.subplots(figsize=(8, 3))[1]
    if isinstance(traces, TraceRecorder):
        traces = {"": traces}
    elif not isinstance(traces, dict):
        traces = {f"run {k + 1}": trace for k, trace in enumerate(traces)}
    for (label, trace), color in zip(traces.items(), ("tab:green", "tab:blue", "tab:orange", "tab:purple")):
        tokens = [step.kept for step in _decode_steps(trace)]
        passes = range(1, len(tokens) + 1)
        ax.bar(passes, tokens, width=1.0, color=color, alpha=0.25)
        mean = [sum(tokens[max(0, k - window + 1): k + 1]) / len(tokens[max(0, k - window + 1): k + 1])
                for k in range(len(tokens))]
        summary = TraceSummary(_decode_steps(trace))
        ax.plot(passes, mean, color=color, label=f"{label} ({summary.tokens_per_pass:.2f} tokens/pass)".strip())
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("pass")
    ax.set_ylabel("tokens per pass")
    ax.legend(loc="upper right")
    return ax


def expected_speedup(first: float, then: float, costs: Sequence[float], draft_len: int) -> float:
    """Tokens per unit of time for drafts of ``draft_len`` tokens, relative to plain decoding: the quantity
    :func:`lookupdec.policy.best_draft_length` maximizes (:func:`lookupdec.policy.draft_gains`); time
    ``costs[d]`` plain steps (``costs[0] == 1``)."""
    return float(draft_gains(first, then, list(costs)[: draft_len + 1])[draft_len])


def plot_expected_speedup(trace: TraceRecorder, drafter=None, ax=None, *, first: float | None = None,
                          then: float | None = None, jump: float | None = None, slope: float | None = None,
                          costs: Sequence[float] | None = None, max_draft: int | None = None,
                          measured: float | None = None):
    """The cost model's expected speedup over draft length, for the run's acceptance and verification cost, with
    the run marked on it.

    Acceptance (``first``, ``then``) comes from the trace (:class:`TraceSummary`). The pass cost by draft length
    is ``costs`` when given, else the straight line ``1 + jump + slope * d`` when either is given (the other from
    the drafter's or the trace's straight-line fit), else the
    drafter's (its measured profile after ``lookupdec.calibrate``, or its running straight-line fit), else a
    straight line fitted to the trace's own pass times. The run is marked at its mean draft length and its tokens
    per pass divided by the mean cost of its passes (the speedup the cost model credits it with); ``measured``
    (e.g. plain time / lookup time) adds the wall-clock speedup at the same draft length. The curve runs to
    ``max_draft``: by default the drafter's (``DrafterConfig.max_draft``), or the default config's.
    Returns the axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        ax = plt.subplots(figsize=(6, 3.5))[1]
    steps = _decode_steps(trace)
    summary = TraceSummary(steps)
    first = summary.first if first is None else first
    then = summary.then if then is None else then
    if max_draft is None:
        config = getattr(drafter, "drafter_config", None) or DrafterConfig()
        max_draft = config.max_draft
    longest = max([max_draft, *(len(s.draft) for s in steps)])
    cost = drafter.cost if drafter is not None else _fitted_cost(steps)  # what the arguments do not say
    if costs is not None:
        label = "measured cost"
        costs = list(costs)
        if len(costs) <= longest:
            raise ValueError(f"costs must cover draft lengths 0..{longest}, got {len(costs)} values")
    elif jump is not None or slope is not None:  # a straight line; the one not given comes from the fit
        fit_jump, fit_slope = cost.relative()
        jump = fit_jump if jump is None else jump
        slope = fit_slope if slope is None else slope
        label = f"jump {jump:.2f}, slope {slope:.3f}"
        costs = linear_costs(jump, slope, longest)
    else:
        costs = cost.costs(longest)
        label = "measured cost" if cost.profile is not None else "jump {:.2f}, slope {:.3f}".format(*cost.relative())
    lengths = list(range(max_draft + 1))
    curve = [expected_speedup(first, then, costs, d) for d in lengths]
    ax.plot(lengths, curve, color="tab:blue", label=f"expected (first {first:.2f}, then {then:.2f}, {label})")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    if steps:
        mean_d = sum(len(s.draft) for s in steps) / len(steps)
        mean_time = sum(float(costs[len(s.draft)]) for s in steps) / len(steps)
        ax.plot([mean_d], [summary.tokens_per_pass / mean_time], "o", color="tab:red",
                label=f"this run ({summary.tokens_per_pass:.2f} tokens/pass, mean draft {mean_d:.1f})")
        if measured is not None:
            ax.plot([mean_d], [measured], "s", color="black", label=f"measured wall clock ({measured:.2f}x)")
    ax.set_xlabel("draft length")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(loc="best", fontsize="small")
    return ax


def _decode_steps(trace: TraceRecorder) -> list[TraceStep]:
    """Every pass but each request's prefill (a prompt pass, not a decoding step)."""
    return [step for request in trace.requests for step in request.steps[1:]]


def _fitted_cost(steps: Sequence[TraceStep]) -> PassCost:
    cost = PassCost()
    for step in steps:
        cost.observe(len(step.draft), step.seconds)
    return cost
