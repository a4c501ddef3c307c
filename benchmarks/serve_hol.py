"""Head-of-line blocking in ``lookupdec serve``: does a long or heavy request hold up the others, or ``/health``?

One lookupdec server (started here, one torch thread unless ``--threads``), all in one run, every request on a
connection of its own with a timeout:

- (a) ``"Say hi."`` (greedy, max_tokens 16) alone, ``--reps`` times, after one untimed send so that the rolling
  cache holds its answer for every measured send alike;
- (b) the same request sent ``--delay`` seconds after one whose prompt is 8,000 tokens (within 100, chat template
  included, counted with the model's tokenizer) of real text (the summary suite's news articles, starting
  elsewhere in each repetition so no two share a prefix), max_tokens 8: its median latency over (a)'s, which must
  be at most 2x; the long request's latency; and whether the long request was still running when the short one
  was sent (else the ratio measures nothing: lower ``--delay`` on a fast device);
- (c) six concurrent bodies of 7.9 MB (a prompt of that many characters, under the 8 MiB body limit; refused as
  past the context once tokenized) while ``/health`` is polled every 0.2 s: their statuses and the worst
  ``/health`` latency, which must stay within 1 s;
- (d) unless ``--no-prediction``, the short request sent 1 s after one carrying a 7.5 MB ``prediction``: its
  latency over (a)'s and the worst ``/health`` (reported, no limit).

``/health`` is polled in every part. Checks: (b) at most 2x, every short and long request answered, the long one
still running when the short was sent; (c) ``/health`` within 1 s and every body answered with a 4xx or 200; no
5xx anywhere. Writes ``head_of_line.json`` (every request, every poll summary) and ``head_of_line.md`` (the
table); exits 1 when a check failed, 2 when the server could not run.

Examples::

    python -m benchmarks.serve_hol                          # ~5-10 min on 2 cores (estimate)
    python -m benchmarks.serve_hol --reps 1 --no-prediction # one of each: ~2.5 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

from benchmarks import servers as srv
from benchmarks.serve import warm_up
from benchmarks.servers import BenchError, Server, note
from benchmarks.stats import ratio
from benchmarks.workloads import SUITES
from tests import serve_attacks as attacks

HEALTH_LIMIT_S = 1.0  # /health answers within 1 s throughout, whatever else the server is doing

SHORT = "Say hi."
SHORT_TOKENS = 16
LONG_TOKENS = 8000  # the long prompt, chat template included, lands within LONG_TOLERANCE of this
LONG_TOLERANCE = 100
LONG_MAX_TOKENS = 8
MAX_RATIO = 2.0  # the short request behind the long one: at most 2x its latency alone
BIG_BODIES, BIG_BODY_BYTES = 6, 7_900_000  # six bodies just under the server's 8 MiB limit
PREDICTION_BYTES = 7_500_000
PREDICTION_DELAY_S = 1.0  # the neighbour follows the big prediction by this much
HEALTH_EVERY_S = 0.2
TIMEOUT_S = 600  # any one request of the head-of-line run


def _corpus() -> str:
    """Real prose to build long prompts from: the summary suite's news articles (~218k characters), or, where their
    data (../shared/data) is absent, the docs suite's texts, which every machine with lookupdec installed has."""
    for suite in ("summary", "docqa"):
        texts = [p.user for p in SUITES[suite]()]
        if texts:
            return "\n\n".join(texts)
    raise SystemExit("error: no text to build long prompts from (the summary and docqa suites are both empty)")


def long_prompt(tokenizer, corpus: str, variant: int, target: int) -> tuple[str, int]:
    """A user message of real text whose chat-templated prompt is `target` tokens (within LONG_TOLERANCE), and
    that count. Each variant starts elsewhere in the corpus, so no two share a prefix a server could reuse."""
    start = (variant * 50_021) % len(corpus)
    source = corpus[start:] + "\n\n" + corpus
    while len(source) < 12 * target:
        source += "\n\n" + corpus
    tail = "\n\nSay in one sentence what the text above is about."

    def size(n_chars: int) -> int:
        text = tokenizer.apply_chat_template([{"role": "user", "content": source[:n_chars] + tail}],
                                             add_generation_prompt=True, tokenize=False)
        return len(tokenizer.encode(text, add_special_tokens=False))

    lo, hi = 0, 12 * target  # the most characters whose prompt fits in `target` tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size(mid) <= target else (lo, mid - 1)
    n_tokens = size(lo)
    if abs(n_tokens - target) > LONG_TOLERANCE:
        raise BenchError(f"could not build a {target}-token prompt (got {n_tokens} tokens)")
    return source[:lo] + tail, n_tokens


def _json_body(model: str, content: str, max_tokens: int, **extra) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0, **extra}).encode()


def _sized_body(model: str, corpus: str, n_bytes: int, field: str) -> bytes:
    """A chat body of about `n_bytes` whose bulk is real text, in the user message (`field` "content") or in the
    prediction (`field` "prediction", with SHORT as the message)."""
    source = corpus * (n_bytes // len(corpus) + 2)

    def build(n_chars: int) -> bytes:
        if field == "content":
            return _json_body(model, source[:n_chars], LONG_MAX_TOKENS)
        return _json_body(model, SHORT, LONG_MAX_TOKENS,
                          prediction={"type": "content", "content": source[:n_chars]})

    n_chars = n_bytes
    for _ in range(4):  # JSON escapes (quotes, newlines) make the body longer than the text
        body = build(n_chars)
        n_chars = int(n_chars * n_bytes / len(body))
    return build(n_chars)


def _timed(url: str, body: bytes, t0: float) -> dict:
    """One chat request on its own connection: status, seconds, start and end (seconds since `t0`), the answer's
    text or the error."""
    start = time.perf_counter()
    try:
        status, _, raw = attacks.post(url, attacks.CHAT_PATH, body, TIMEOUT_S)
    except OSError as err:
        status, raw = 0, f"{type(err).__name__}: {err}".encode()
    end = time.perf_counter()
    out = {"status": status, "seconds": round(end - start, 3), "start": round(start - t0, 3),
           "end": round(end - t0, 3), "bytes": len(body)}
    try:
        answer = json.loads(raw)
        if status == 200:
            out["text"] = answer["choices"][0]["message"]["content"]
            out["prompt_tokens"] = answer.get("usage", {}).get("prompt_tokens")
        else:
            out["error"] = answer.get("error", {}).get("message", "")[:200]
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        out["error"] = raw[:200].decode(errors="replace")
    return out


def _in_background(fn, *args) -> tuple[threading.Thread, dict]:
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(fn(*args)), daemon=True)
    thread.start()
    return thread, box


def head_of_line(args, server: Server, tokenizer) -> int:
    """The head-of-line figures, all on one server in one run: a short request alone and behind an 8k-token
    prefill, six 7.9 MB bodies against /health, and (unless --no-prediction) a 7.5 MB prediction's neighbour.
    Returns the exit code."""
    model, url, reps, t0 = server.model_id, server.url, args.reps, time.perf_counter()
    corpus = _corpus()
    short = _json_body(model, SHORT, SHORT_TOKENS)
    note("head-of-line: warming up...")
    warm_up(server, tokenizer, 2)
    # Once untimed: lookupdec's rolling cache then holds this answer for every measured send alike.
    first = _timed(url, short, t0)
    if first["status"] != 200:
        raise BenchError(f"head-of-line: {SHORT!r} alone got HTTP {first['status']}: {first.get('error')}")
    report: dict = {"reps": reps, "delay_s": args.delay}

    note(f"head-of-line (a): {SHORT!r}, max_tokens {SHORT_TOKENS}, alone x{reps}...")
    with attacks.HealthWatch(server.url, HEALTH_EVERY_S) as health:
        alone = [_timed(url, short, t0) for _ in range(reps)]
    alone_ok = [r["seconds"] for r in alone if r["status"] == 200]
    report["a_alone"] = {"runs": alone, "median_s": statistics.median(alone_ok) if alone_ok else None,
                         "health": health.summary(HEALTH_LIMIT_S)}

    note(f"head-of-line (b): the same, {args.delay} s after a ~{LONG_TOKENS}-token prompt, x{reps}...")
    runs = []
    with attacks.HealthWatch(server.url, HEALTH_EVERY_S) as health:
        for rep in range(reps):
            text, n_tokens = long_prompt(tokenizer, corpus, rep, LONG_TOKENS)
            thread, long_ = _in_background(_timed, url, _json_body(model, text, LONG_MAX_TOKENS), t0)
            time.sleep(args.delay)
            behind = _timed(url, short, t0)
            thread.join(TIMEOUT_S + 10)
            # Only a short request sent while the long one was still being served measures anything (on a fast
            # device an 8k prefill may be over before --hol-delay has passed).
            runs.append({"long_prompt_tokens": n_tokens, "long": dict(long_), "short": behind,
                         "overlapped": long_.get("end", float("inf")) > behind["start"]})
            note(f"  rep {rep}: long {long_.get('status')} in {long_.get('seconds', 0):.1f} s, short "
                 f"{behind['status']} in {behind['seconds']:.2f} s")
    behind_ok = [r["short"]["seconds"] for r in runs if r["short"]["status"] == 200]
    long_ok = [r["long"]["seconds"] for r in runs if r["long"].get("status") == 200]
    b_median = statistics.median(behind_ok) if behind_ok else None
    report["b_behind_long"] = {
        "runs": runs, "median_s": b_median, "long_median_s": statistics.median(long_ok) if long_ok else None,
        "ratio": ratio(b_median, report["a_alone"]["median_s"]),
        "overlapped": sum(r["overlapped"] for r in runs),
        "same_text": sum(r["short"].get("text") == first.get("text") for r in runs),
        "health": health.summary(HEALTH_LIMIT_S)}

    note(f"head-of-line (c): {BIG_BODIES} bodies of {BIG_BODY_BYTES / 1e6:.1f} MB at once, /health every "
         f"{HEALTH_EVERY_S} s...")
    big = _sized_body(model, corpus, BIG_BODY_BYTES, "content")
    with attacks.HealthWatch(server.url, HEALTH_EVERY_S) as health:
        pending = [_in_background(_timed, url, big, t0) for _ in range(BIG_BODIES)]
        for thread, _ in pending:
            thread.join(TIMEOUT_S + 10)
        time.sleep(1)  # a second more of polls once the last body is answered
    bodies = [dict(box) for _, box in pending]
    report["c_big_bodies"] = {"bytes": len(big), "runs": bodies, "statuses": _statuses(bodies),
                              "slowest_s": max((r.get("seconds", 0) for r in bodies), default=None),
                              "health": health.summary(HEALTH_LIMIT_S)}

    if not args.no_prediction:
        note(f"head-of-line (d): a {PREDICTION_BYTES / 1e6:.1f} MB prediction, and {SHORT!r} "
             f"{PREDICTION_DELAY_S} s later, x{reps}...")
        pred = _sized_body(model, corpus, PREDICTION_BYTES, "prediction")
        runs = []
        with attacks.HealthWatch(server.url, HEALTH_EVERY_S) as health:
            for _ in range(reps):
                thread, big_pred = _in_background(_timed, url, pred, t0)
                time.sleep(PREDICTION_DELAY_S)
                neighbour = _timed(url, short, t0)
                thread.join(TIMEOUT_S + 10)
                runs.append({"prediction": dict(big_pred), "neighbour": neighbour})
        ok = [r["neighbour"]["seconds"] for r in runs if r["neighbour"]["status"] == 200]
        d_median = statistics.median(ok) if ok else None
        report["d_big_prediction"] = {
            "bytes": len(pred), "runs": runs, "statuses": _statuses([r["prediction"] for r in runs]),
            "neighbour_median_s": d_median, "ratio": ratio(d_median, report["a_alone"]["median_s"]),
            "health": health.summary(HEALTH_LIMIT_S)}

    every = [*alone, *(r[k] for r in report["b_behind_long"]["runs"] for k in ("long", "short")), *bodies,
             *(r[k] for r in report.get("d_big_prediction", {}).get("runs", []) for k in ("prediction", "neighbour"))]
    b, c = report["b_behind_long"], report["c_big_bodies"]
    checks = {
        "short_behind_long_at_most_2x": b["ratio"] is not None and b["ratio"] <= MAX_RATIO,
        "every_short_and_long_answered": len(behind_ok) == len(long_ok) == reps and len(alone_ok) == reps,
        # else the ratio measures nothing: lower --hol-delay (a fast device prefills 8k tokens in well under 2.5 s)
        "long_still_running_when_short_sent": b["overlapped"] == reps,
        "big_bodies_health_within_1s": c["health"]["polls"] > 0 and c["health"]["over_limit"] == 0
                                       and c["health"]["not_200"] == 0,
        "big_bodies_all_answered_4xx_or_200": all(200 <= r.get("status", 0) < 500 for r in bodies),
        "no_5xx": all(r.get("status", 0) < 500 for r in every),
    }
    report["checks"] = checks
    report["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model or "SmolLM2-135M-Instruct "
                      "(embedded)", "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.device} "
                      f"{args.dtype}", "threads": args.threads, "argv": server.argv,
                      "seconds": round(time.perf_counter() - t0, 1), "rss_mib_end": server.rss_mib(),
                      "command": "python -m benchmarks.serve_hol " + " ".join(sys.argv[1:])}
    (args.out / "head_of_line.json").write_text(json.dumps(report, indent=1))
    table = hol_markdown(report)
    (args.out / "head_of_line.md").write_text(table)
    print(table)
    print(f"details in {args.out / 'head_of_line.json'}", file=sys.stderr)
    return 0 if all(checks.values()) else 1


def _statuses(runs: list[dict]) -> dict:
    out: dict = {}
    for r in runs:
        out[str(r.get("status", 0))] = out.get(str(r.get("status", 0)), 0) + 1
    return out


def hol_markdown(report: dict) -> str:
    def s(v, digits=2):
        return "-" if v is None else f"{v:.{digits}f} s"

    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    def h(health):
        return f"{s(health['worst_s'], 3)} ({health['polls']} polls, {health['over_limit']} over 1 s)"

    a, b, c = report["a_alone"], report["b_behind_long"], report["c_big_bodies"]
    reps, meta = report["reps"], report["meta"]
    tokens = sorted({r["long_prompt_tokens"] for r in b["runs"]})
    tokens = f"{tokens[0]}" if len(tokens) == 1 else f"{tokens[0]}-{tokens[-1]}"
    lines = [(f"Head-of-line, one lookupdec server, {meta['machine']}, {meta['threads']} torch thread(s), model "
              f"{meta['model']}, {meta['date']}; {meta['seconds']} s in all. Short request: {SHORT!r}, greedy, "
              f"max_tokens {SHORT_TOKENS}; medians of {reps}; /health polled every {HEALTH_EVERY_S} s."), "",
             "| part | measured | value | /health worst |", "|---|---|---|---|",
             f"| a | short request alone | {s(a['median_s'])} | {h(a['health'])} |",
             (f"| b | short request sent {report['delay_s']} s after a prompt of {tokens} tokens "
              f"(max_tokens {LONG_MAX_TOKENS}) | {s(b['median_s'])}, **{x(b['ratio'])}** of alone (limit "
              f"{MAX_RATIO:.0f}x); the long one still running when it was sent: {b['overlapped']}/{reps}; same text "
              f"{b['same_text']}/{reps} | {h(b['health'])} |"),
             f"| b | the long request | {s(b['long_median_s'])} | |",
             (f"| c | {BIG_BODIES} bodies of {c['bytes'] / 1e6:.2f} MB at once | statuses {c['statuses']}, "
              f"slowest {s(c['slowest_s'])} | **{h(c['health'])}** |")]
    d = report.get("d_big_prediction")
    if d:
        lines.append(f"| d | short request {PREDICTION_DELAY_S} s after a {d['bytes'] / 1e6:.2f} MB prediction "
                     f"(statuses {d['statuses']}) | {s(d['neighbour_median_s'])}, {x(d['ratio'])} of alone | "
                     f"{h(d['health'])} |")
    lines += ["", "Checks: " + ", ".join(f"{name} {'ok' if ok else 'FAILED'}" for name, ok in
                                         report["checks"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="sends per measurement (default 3)")
    ap.add_argument("--delay", type=float, default=2.5,
                    help="seconds between the long prompt and the short request (default 2.5)")
    ap.add_argument("--no-prediction", action="store_true", help="skip part (d), the 7.5 MB prediction")
    srv.add_options(ap)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.delay < 0:
        ap.error("--reps must be >= 1 and --delay >= 0")
    args.out.mkdir(parents=True, exist_ok=True)

    def body(started: srv.Servers) -> int:
        _, tokenizer = srv.model_source(args.model)
        server = started.start(srv.lookupdec_server(args, srv.server_env(args.threads)))
        return head_of_line(args, server, tokenizer)

    return srv.run(body)


if __name__ == "__main__":
    sys.exit(main())
