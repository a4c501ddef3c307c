"""TraceRecorder: what it stores for each pass, the HTML a known trace renders to, the atomic save, the summary's
acceptance rates, the plot helpers, and that a recorder passed to generate agrees with its output and stats."""

from __future__ import annotations

import os
import re

import pytest
import torch

import lookupdec
from lookupdec import DrafterConfig, LookupDrafter
from lookupdec.policy import best_draft_length, linear_costs
from lookupdec.trace import (
    TraceRecorder,
    TraceStep,
    expected_speedup,
    plot_expected_speedup,
    plot_tokens_per_pass,
)

WORDS = {1: "a", 2: " b", 3: " c", 4: "\n", 5: " <d>", 6: " e", 7: "&"}


class WordTokenizer:
    """Token id -> text, decoding by concatenation; enough for rendering."""

    def decode(self, ids):
        return "".join(WORDS[int(t)] for t in ids)


def known_trace() -> TraceRecorder:
    trace = TraceRecorder(WordTokenizer())
    trace.start([1])
    trace.step([], 0, 2, 1, 0.1)  # prefill: " b"
    trace.step([3, 4, 1], 2, 5, 3, 0.2)  # " c", "\n" accepted; "a" rejected; target " <d>"
    trace.step([], 0, 6, 1, 0.1)  # no draft: " e"
    trace.step([7, 2], 2, 3, 2, 0.2)  # both accepted, generation stopped before the bonus token " c"
    return trace


def test_steps_keep_what_each_pass_did():
    steps = known_trace().steps
    assert steps[1] == TraceStep((3, 4, 1), 2, 5, 3, 0.2)
    assert [s.committed for s in steps] == [(2,), (3, 4, 5), (6,), (7, 2)]
    # The first rejected draft token; none when nothing was drafted, or when all were accepted.
    assert [s.rejected for s in steps] == [None, 1, None, None]
    assert known_trace().requests[0].output == (2, 3, 4, 5, 6, 7, 2)


def test_rejected_token_after_the_stop_is_not_shown():
    # Generation stopped at the first accepted token (say, EOS): what came after it never mattered.
    assert TraceStep((3, 4), 1, 5, 1, 0.0).rejected is None
    assert TraceStep((3, 4), 1, 5, 2, 0.0).rejected == 4


def test_known_trace_renders_to_known_html():
    html = known_trace().to_html()
    text = html[html.index('<div class="ld-text">'):]
    assert text == (
        '<div class="ld-text">'
        '<span class="ld-pass" title="pass 1: prefill, +1 token"><span class="ld-tgt"> b</span></span>'
        '<span class="ld-pass" title="pass 2: drafted 3, accepted 2, +3 tokens"><span class="ld-acc"> c\n</span>'
        '<span class="ld-rej">a</span><span class="ld-tgt"> &lt;d&gt;</span></span>'
        '<span class="ld-pass" title="pass 3: no draft, +1 token"><span class="ld-tgt"> e</span></span>'
        '<span class="ld-pass" title="pass 4: drafted 2, accepted 2, +2 tokens"><span class="ld-acc">&amp; b</span>'
        "</span></div></div></div>")
    assert ('<p class="ld-summary">4 passes, 7 new tokens, 1.75 tokens/pass; 2 drafts, 4/5 draft tokens accepted '
            "(80%)</p>") in html
    assert '<span class="ld-acc">accepted draft token</span>' in html  # the legend
    assert known_trace()._repr_html_() == html


def test_rejected_line_break_shows_as_a_sign():
    trace = TraceRecorder(WordTokenizer())
    trace.start([1])
    trace.step([4], 0, 2, 1, 0.1)
    assert '<span class="ld-rej">\u21b5</span><span class="ld-tgt"> b</span>' in trace.to_html()


def test_without_tokenizer_tokens_show_as_ids():
    trace = TraceRecorder()
    trace.start([1])
    trace.step([3, 4], 1, 5, 2, 0.1)
    assert '<span class="ld-acc">[3]</span><span class="ld-rej">[4]</span><span class="ld-tgt">[5]</span>' in (
        trace.to_html())


def test_labels_and_notes_head_each_request():
    trace = TraceRecorder(WordTokenizer(), title="run <1>")
    trace.label = "file.yaml: lines 1-3"
    trace.start([1])
    trace.step([], 0, 2, 1, 0.1)
    trace.requests[-1].note = "rejected: <why>"
    trace.label = None
    trace.start([1])
    trace.step([], 0, 3, 1, 0.1)
    page = trace.to_html(full_page=True)
    assert page.startswith("<!DOCTYPE html>") and "<title>run &lt;1&gt;</title>" in page
    assert page.count('<div class="ld-request">') == 2
    assert '<h3>file.yaml: lines 1-3</h3><p class="ld-note">rejected: &lt;why&gt;</p>' in page
    assert page.count("<h3>") == 1  # an unlabelled request gets no heading


def test_step_before_start_is_an_error():
    with pytest.raises(RuntimeError, match="before start"):
        TraceRecorder().step([], 0, 1, 1, 0.0)


def test_save_html_is_atomic_and_readable(tmp_path, monkeypatch):
    path = tmp_path / "trace.html"
    known_trace().save_html(path)
    assert path.read_text(encoding="utf-8") == known_trace().to_html(full_page=True)
    assert path.stat().st_mode & 0o777 == 0o644
    assert os.listdir(tmp_path) == ["trace.html"]
    # A failure while writing leaves the old file and no temporary file.
    path.write_text("old")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        known_trace().save_html(path)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["trace.html"]


def test_summary_acceptance_rates_follow_the_drafter_definitions():
    trace = TraceRecorder()
    trace.start([1])
    trace.step([], 0, 1, 1, 0.1)
    trace.step([1, 1, 1, 1], 4, 1, 5, 0.1)  # first accepted, 3 continuations, no stop (all accepted)
    trace.step([1, 1, 1], 1, 1, 2, 0.1)  # first accepted, 0 continuations, a stop
    trace.step([1, 1], 0, 1, 1, 0.1)  # first rejected
    summary = trace.summary()
    assert (summary.passes, summary.new_tokens, summary.drafts, summary.drafted, summary.accepted) == (4, 9, 3, 9, 5)
    assert summary.first == pytest.approx(2 / 3)
    assert summary.then == pytest.approx(3 / 4)  # continuations / (continuations + stops)
    assert summary.tokens_per_pass == pytest.approx(9 / 4)


def test_expected_speedup_is_what_best_draft_length_maximizes():
    first, then, jump, slope = 0.6, 0.9, 0.55, 0.05
    costs = linear_costs(jump, slope, 32)
    gains = [expected_speedup(first, then, costs, d) for d in range(33)]
    assert gains[0] == 1.0  # no draft: a plain step
    assert gains[1] == pytest.approx((1 + first) / (1 + jump + slope))
    assert max(range(1, 33), key=gains.__getitem__) == best_draft_length(first, then, costs, margin=0.0)
    jagged = [1.0, 1.6, 2.0, 1.5, 1.7, 1.75, 1.9, 1.8, 2.0]
    gains = [expected_speedup(0.6, 0.5, jagged, d) for d in range(9)]
    assert max(range(1, 9), key=gains.__getitem__) == best_draft_length(0.6, 0.5, jagged, margin=0.0) == 3


def test_plots_draw_the_curves_and_mark_the_run():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = known_trace()
    ax = plot_tokens_per_pass({"copying": trace, "plain": trace})
    assert [line.get_label() for line in ax.get_lines()[:2]] == ["copying (2.00 tokens/pass)",
                                                                 "plain (2.00 tokens/pass)"]
    ax = plot_expected_speedup(trace, jump=0.5, slope=0.05, max_draft=8, measured=1.3)
    curve, _, run, measured = ax.get_lines()
    assert list(curve.get_xdata()) == list(range(9))
    assert curve.get_ydata()[0] == 1.0
    # The run: mean draft length over its decoding passes (5 tokens / 3 passes), tokens per pass over their cost.
    assert run.get_xdata()[0] == pytest.approx(5 / 3)
    assert run.get_ydata()[0] == pytest.approx(2.0 / ((1.65 + 1 + 1.6) / 3))  # time 1 + 0.5 + 0.05 d
    assert measured.get_ydata()[0] == 1.3
    # A measured profile (a calibrated drafter) replaces the straight line, in the curve and in the run's mark.
    drafter = LookupDrafter()
    drafter.cost.use_profile([1.0, 2.0, 1.7, 1.5, 1.6, 1.75, 1.8, 1.9, 2.0])  # distinct costs for 2 and 3
    curve, _, run = plot_expected_speedup(trace, drafter, max_draft=8).get_lines()
    assert "measured cost" in curve.get_label()
    assert curve.get_ydata()[2] == pytest.approx(expected_speedup(trace.summary().first, trace.summary().then,
                                                                  drafter.cost.costs(8), 2))
    assert run.get_ydata()[0] == pytest.approx(2.0 / ((1.5 + 1 + 1.7) / 3))  # drafts of 3, 0 and 2 tokens
    only_jump = plot_expected_speedup(trace, drafter, jump=0.3, max_draft=8).get_lines()[0]  # slope from the fit
    assert only_jump.get_label().endswith(f"jump 0.30, slope {drafter.cost.relative()[1]:.3f})")
    with pytest.raises(ValueError, match="costs must cover"):
        plot_expected_speedup(trace, costs=[1.0, 2.0], max_draft=8)
    # Without max_draft the curve runs as far as the drafter may draft (else the default config's limit).
    short = plot_expected_speedup(trace, LookupDrafter(max_draft=12)).get_lines()[0]
    assert list(short.get_xdata()) == list(range(13))
    default = plot_expected_speedup(trace, jump=0.5, slope=0.05).get_lines()[0]
    assert list(default.get_xdata()) == list(range(DrafterConfig().max_draft + 1))
    plt.close("all")


def test_recorder_follows_generate(tiny_factory):
    model = tiny_factory("llama", peak=8.0)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    trace = TraceRecorder()
    out = lookupdec.generate(model, prompt, max_new_tokens=24, trace=trace)
    request, = trace.requests
    assert request.prompt == tuple(prompt[0].tolist())
    assert request.output == tuple(out.sequences[0, prompt.shape[1]:].tolist())
    summary = trace.summary()
    assert (summary.passes, summary.new_tokens) == (out.stats.target_passes, out.stats.new_tokens)
    assert (summary.drafted, summary.accepted) == (out.stats.drafted_tokens, out.stats.accepted_tokens)
    assert re.search(r"\d+ passes, 24 new tokens", trace.to_html())
