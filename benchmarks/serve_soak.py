"""``lookupdec serve`` under a long load with attacks mixed in: does it stay up, exact, small and responsive?

One lookupdec server (started here, as ``benchmarks/servers.py`` says), 8 client threads of raw HTTP for
``--seconds``, cycling through ``serve.py``'s requests (edits with their file as ``prediction``, open-ended
prompts; ``--max-tokens``, 64 by default). Of every ten requests one is an attack, the cases of
``tests/serve_attacks.py`` in turn (the bodies past the size limit only twice: before the load and half-way), and
one is a client that leaves mid-request: a stream closed after its first event, or a plain request whose socket
closes after 0.2-1 s. Every case is also sent once on the idle server before the load (``serve_attack.py``).

Checks, each printed as ok / FAIL:

- no 5xx, ever;
- every attack gets what its case says (a 4xx with OpenAI's error body naming the field, or its answer);
- every well-formed request gets exactly the text it got when sent alone at the start;
- the server's RSS (children included, sampled every 5 s, or every quarter of a shorter run) at the end at most
  10% above its value after the first minute (after half the run for runs under two minutes);
- ``/health``, polled every 0.5 s by a side thread, answers 200 within 1 s throughout (the worst is reported);
- the server alive and healthy at the end.

Writes ``soak.json`` (counts per attack case and status, the RSS and ``/health`` timelines); exits 1 when a check
failed, 2 when the server could not run.

Examples::

    python -m benchmarks.serve_soak --seconds 600   # 10 minutes of load: ~12 min in all (estimate)
    python -m benchmarks.serve_soak --seconds 20 --requests 2 --max-tokens 8   # a smoke run: ~1.5 min
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import socket
import sys
import threading
import time

from benchmarks import servers as srv
from benchmarks.serve import REQUEST_TIMEOUT_S, Request, build_requests
from benchmarks.serve_attack import Tally
from benchmarks.servers import BenchError, Server, note
from tests import serve_attacks as attacks

# Of every SLOTS requests a client sends: one attack (slot 9), one whose client leaves mid-request (slot 4), eight
# well-formed.
SLOTS = 10
ATTACK_SLOT, LEAVE_SLOT = 9, 4
CONCURRENCY = 8
RSS_EVERY_S = 5
RSS_GROWTH = 0.10  # RSS at the end may be at most 10% above RSS after the first minute
HEALTH_EVERY_S = 0.5
HEALTH_LIMIT_S = 1.0  # /health answers within 1 s throughout, whatever else the server is doing
MAX_FAILURES = 50  # failures kept word for word; the counts say the rest


def stream_then_leave(url: str, body: bytes, timeout: float) -> int:
    """A streaming request whose client closes the connection once the first server-sent event arrived (or the
    answer ended, an error); returns the status, 0 when none came back."""
    buf, deadline = b"", time.monotonic() + timeout
    with socket.create_connection(attacks.address(url), timeout=timeout) as sock:
        sock.sendall(attacks.request_bytes(url, attacks.CHAT_PATH, body))
        while b"data:" not in buf.partition(b"\r\n\r\n")[2]:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = sock.recv(1 << 16)  # TimeoutError past the deadline: the caller records it
            if not data:
                break
            buf += data
    return attacks.parse_answer(buf)[0]


def send_then_leave(url: str, body: bytes, after: float) -> int:
    """A plain request whose client closes the socket ``after`` seconds; returns the status if the answer began
    before that (a fast refusal), else 0."""
    buf, deadline = b"", time.monotonic() + after
    with socket.create_connection(attacks.address(url), timeout=after + 5) as sock:
        sock.sendall(attacks.request_bytes(url, attacks.CHAT_PATH, body))
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                break
            if not data:
                break
            buf += data
    return attacks.parse_answer(buf)[0]


def soak(args, server: Server, requests: list[Request]) -> int:
    """``requests`` cycled through ``server`` at concurrency 8 for ``args.seconds``, attacks and clients that
    leave mixed in; returns the exit code."""
    model = server.model_id

    def body(req: Request, **extra) -> bytes:
        out = {"model": model, "messages": [{"role": "user", "content": req.user}], "max_tokens": req.max_tokens,
               "temperature": 0, **extra}
        if req.prediction is not None:
            out["prediction"] = {"type": "content", "content": req.prediction}
        return json.dumps(out).encode()

    def chat(req: Request) -> tuple[int, bytes]:
        status, _, raw = attacks.post(server.url, attacks.CHAT_PATH, body(req), REQUEST_TIMEOUT_S)
        return status, raw

    cases = attacks.cases(model)
    rss_ready = server.rss_mib()
    note(f"soak: reference outputs of {len(requests)} requests sent alone...")
    reference = {}
    for req in requests:
        status, raw = chat(req)
        if status != 200:
            raise BenchError(f"soak: {req.name} sent alone got HTTP {status}: {raw[:200]!r}")
        reference[req.name] = json.loads(raw)["choices"][0]["message"]["content"]

    lock = threading.Lock()
    hit = Tally(cases)
    tally = {"well_formed": 0, "well_formed_ok": 0, "status_5xx": 0, "failures": [],
             "left": {how: {"sent": 0, "statuses": {}} for how in ("after_first_event", "after_seconds")}}

    def fail(what: str) -> None:
        with lock:
            if len(tally["failures"]) < MAX_FAILURES:
                tally["failures"].append(what)

    def send_good(req: Request) -> None:
        status, raw = chat(req)
        with lock:
            tally["well_formed"] += 1
            tally["status_5xx"] += status >= 500
        if status != 200:
            fail(f"{req.name}: HTTP {status}: {raw[:200]!r}")
        elif json.loads(raw)["choices"][0]["message"]["content"] != reference[req.name]:
            fail(f"{req.name}: text differs from the same request sent alone")
        else:
            with lock:
                tally["well_formed_ok"] += 1

    def leave(req: Request, streaming: bool, rng: random.Random) -> None:
        if streaming:
            how, status = "after_first_event", stream_then_leave(server.url, body(req, stream=True),
                                                                 REQUEST_TIMEOUT_S)
        else:
            how, status = "after_seconds", send_then_leave(server.url, body(req), rng.uniform(0.2, 1.0))
        with lock:
            entry = tally["left"][how]
            entry["sent"] += 1
            entry["statuses"][str(status)] = entry["statuses"].get(str(status), 0) + 1
            tally["status_5xx"] += status >= 500
        if status >= 500 or (streaming and status != 200):
            fail(f"{req.name} (client leaves {how}): HTTP {status}")

    with attacks.HealthWatch(server.url, HEALTH_EVERY_S) as health:  # from the first attack to the end of the load
        note(f"soak: {len(cases)} attack cases, each once on the idle server...")
        for case in cases:  # so even a short soak covers them all
            hit.send(server.url, case)
        counter = itertools.count()
        big = [c for c in cases if c.big]
        kinds = itertools.cycle([c for c in cases if not c.big])
        start = time.monotonic()
        deadline = start + args.seconds
        rss = [(0.0, server.rss_mib())]

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                with lock:
                    i = next(counter)
                    slot = i % SLOTS
                    case = None
                    if slot == ATTACK_SLOT:
                        # the bodies past the size limit once more, half-way through: not at every turn of the cycle
                        late = time.monotonic() - start > args.seconds / 2
                        case = big.pop() if big and late else next(kinds)
                req = requests[i % len(requests)]
                try:
                    if case is not None:
                        hit.send(server.url, case)
                    elif slot == LEAVE_SLOT:
                        leave(req, streaming=(i // SLOTS) % 2 == 0, rng=rng)
                    else:
                        send_good(req)
                except Exception as err:  # noqa: BLE001 - no answer, a body not JSON, ...: a failure, not a crash
                    fail(f"{case.name if case else req.name}: {type(err).__name__}: {err}"[:300])

        workers = [threading.Thread(target=worker, args=(seed,), daemon=True) for seed in range(CONCURRENCY)]
        for thread in workers:
            thread.start()
        next_note = 60
        while any(thread.is_alive() for thread in workers):
            time.sleep(min(RSS_EVERY_S, args.seconds / 4))
            rss.append((round(time.monotonic() - start, 1), server.rss_mib()))
            if time.monotonic() - start >= next_note:
                next_note += 60
                note(f"soak: {time.monotonic() - start:.0f}/{args.seconds:.0f} s, {tally['well_formed']} well-formed, "
                     f"{hit.sent()} attacks, {sum(m['sent'] for m in tally['left'].values())} left, "
                     f"{len(tally['failures']) + len(hit.failures)} failures, RSS {rss[-1][1] or 0:.0f} MiB, "
                     f"/health worst {health.summary()['worst_s'] or 0:.2f} s")
    alive = server.proc.poll() is None
    health_end = srv.http_get(server.url + "/health", 5)[0] if alive else None
    rss_end = server.rss_mib() if alive else None
    # "After the first minute": the first sample at 60 s (at half the soak when it is shorter, as a smoke run is).
    first_at = min(60.0, args.seconds / 2)
    first = next(((t, v) for t, v in rss if t >= first_at and v is not None), rss[-1])
    sizes = [v for _, v in rss if v is not None]
    rss_ok = rss_end is not None and first[1] is not None and rss_end <= (1 + RSS_GROWTH) * first[1]
    hs = health.summary(HEALTH_LIMIT_S)
    n_left = sum(m["sent"] for m in tally["left"].values())
    checks = {"no_5xx": tally["status_5xx"] + hit.status_5xx == 0,
              "every_attack_answered_as_its_case_says": hit.right() == hit.sent(),
              "well_formed_exact_and_answered": not tally["failures"],
              "rss_end_within_10pct_of_first_minute": rss_ok,
              "health_within_1s": not health.problems(HEALTH_LIMIT_S),
              "alive_and_healthy_at_end": alive and health_end == 200}
    report = {"seconds": args.seconds, "concurrency": CONCURRENCY, "max_tokens": requests[0].max_tokens,
              "checks": checks,
              "rss_mib": {"ready": rss_ready, "start": rss[0][1], "first_minute": first[1], "first_minute_at_s":
                          first[0], "end": rss_end, "max": max(sizes) if sizes else None,
                          "end_over_first_minute": rss_end / first[1] if rss_end and first[1] else None},
              "rss_timeline": rss, "health": hs, "health_timeline": health.samples, "alive_at_end": alive,
              "health_at_end": health_end, **tally, "status_5xx": tally["status_5xx"] + hit.status_5xx,
              "attack_failures": hit.failures, "attack_families": hit.families(), "attacks": hit.by_case}
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    growth = report["rss_mib"]["end_over_first_minute"]
    print(f"\nsoak {args.seconds:.0f} s at concurrency {CONCURRENCY}: {tally['well_formed']} well-formed "
          f"({tally['well_formed_ok']} with the text they got alone), {hit.sent()} attacks ({hit.right()} answered "
          f"as their case says), {n_left} clients that left, {report['status_5xx']} 5xx")
    print(f"RSS (children included): {rss_ready or 0:.0f} MiB when ready, {first[1] or 0:.0f} at {first[0]:.0f} s, "
          f"{rss_end or 0:.0f} at the end ({'-' if growth is None else f'{growth:.3f}x'}; limit "
          f"{1 + RSS_GROWTH:.2f}x), max {max(sizes) if sizes else 0:.0f}")
    print(f"/health every {HEALTH_EVERY_S} s: {hs['polls']} polls, worst {hs['worst_s'] or 0:.3f} s at "
          f"{hs['worst_at_s'] or 0:.0f} s, {hs['over_limit']} over {HEALTH_LIMIT_S:.0f} s, {hs['not_200']} not 200")
    hit.print()
    for how, m in tally["left"].items():
        print(f"  client leaves {how}: {m['sent']} sent, statuses {m['statuses']} (0: left before any answer)")
    for line in tally["failures"][:20]:
        print(f"  FAIL {line}")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    passed = all(checks.values())
    print("soak: " + ("passed" if passed else "FAILED") + f"; details in {args.out / 'soak.json'}")
    return 0 if passed else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600, help="seconds of load (default 600)")
    ap.add_argument("--requests", type=int, default=12, help="well-formed requests, cycled (default 12)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each (default 64: many short ones)")
    srv.add_options(ap)
    args = ap.parse_args(argv)
    if args.seconds <= 0:
        ap.error("--seconds must be > 0")
    args.out.mkdir(parents=True, exist_ok=True)

    def body(started: srv.Servers) -> int:
        requests = build_requests(args.requests, args.max_tokens)
        server = started.start(srv.lookupdec_server(args, srv.server_env(args.threads)))
        return soak(args, server, requests)

    return srv.run(body)


if __name__ == "__main__":
    sys.exit(main())
