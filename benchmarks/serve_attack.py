"""Every attack of ``tests/serve_attacks.py`` sent once to a running ``lookupdec serve``: its own engine (the
default) or vLLM's (``--server vllm-lookupdec``, ``lookupdec serve --engine vllm`` in vLLM's environment), as a
process started here, over raw HTTP (one connection per request, bodies sent as given).

The cases are the ones tests/test_serve_attack.py sends to the server in-process: JSON nested 10,000 levels, roles
of the wrong type, lone surrogates in every text field, message names, every field fuzzed with every JSON type,
values out of range, unsupported fields, an unknown model, no messages, a prompt past the context, invalid JSON,
a declared Content-Length past the body limit, a body past it, and strange but valid bodies (a user turn typing
``<|im_end|>`` among them). Each must get what its case says: a 4xx with OpenAI's error body naming the field at
fault, or its answer; never a 5xx. ``serve_soak.py`` sends the same cases under load.

Prints a line per family of cases and every failure; writes ``serve_attack.json`` (every case's status and
problem) to ``--out``; exits 1 when a case failed, 2 when the server could not run.

Examples::

    python -m benchmarks.serve_attack                                 # lookupdec serve, embedded model: ~20 s
    python -m benchmarks.serve_attack --server vllm-lookupdec          # vLLM's engine: a vLLM start first
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from benchmarks import servers as srv
from benchmarks.servers import note
from tests import serve_attacks as attacks

ATTACK_TIMEOUT_S = 120  # a bad request is refused before it reaches the model: this is generous
MAX_FAILURES = 50  # failures kept word for word; the counts say the rest


class Tally:
    """What the server answered to the cases sent, by case: how many were sent, how many got what the case wants,
    their statuses; the first failures word for word. Safe to share between threads."""

    def __init__(self, cases: list[attacks.Case]):
        self.by_case = {c.name: {"family": c.family, "sent": 0, "ok": 0, "statuses": {}} for c in cases}
        self.failures: list[str] = []
        self.status_5xx = 0
        self._lock = threading.Lock()

    def send(self, url: str, case: attacks.Case, timeout: float = ATTACK_TIMEOUT_S) -> bool:
        """Send ``case`` to the server at ``url``, judge the answer (no answer in time is a failure), count it;
        whether it was right."""
        try:
            status, headers, body = attacks.send(url, case, timeout)
        except OSError as err:  # TimeoutError included
            status, headers, body = 0, {}, f"{type(err).__name__}: {err}".encode()
        why = attacks.problem(case, status, headers, body)
        with self._lock:
            entry = self.by_case[case.name]
            entry["sent"] += 1
            entry["ok"] += why is None
            entry["statuses"][str(status)] = entry["statuses"].get(str(status), 0) + 1
            self.status_5xx += status >= 500
            if why is not None and len(self.failures) < MAX_FAILURES:
                self.failures.append(f"{case.name}: {why}")
        return why is None

    def sent(self) -> int:
        return sum(entry["sent"] for entry in self.by_case.values())

    def right(self) -> int:
        return sum(entry["ok"] for entry in self.by_case.values())

    def families(self) -> dict:
        """Per family of cases: cases, sent, right, and the statuses they got."""
        out: dict = {}
        for entry in self.by_case.values():
            family = out.setdefault(entry["family"], {"cases": 0, "sent": 0, "ok": 0, "statuses": {}})
            family["cases"] += 1
            family["sent"] += entry["sent"]
            family["ok"] += entry["ok"]
            for status, n in entry["statuses"].items():
                family["statuses"][status] = family["statuses"].get(status, 0) + n
        return out

    def print(self) -> None:
        for name, family in self.families().items():
            print(f"  {name}: {family['ok']}/{family['sent']} right over {family['cases']} cases, statuses "
                  f"{family['statuses']}")
        for line in self.failures[:20]:
            print(f"  FAIL {line}")


def attack(url: str, cases: list[attacks.Case]) -> Tally:
    """Every one of ``cases`` once, one after the other, to the server at ``url``."""
    tally = Tally(cases)
    for case in cases:
        tally.send(url, case)
    return tally


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", choices=("lookupdec", "vllm-lookupdec"), default="lookupdec",
                    help="lookupdec serve on its own engine (default), or on vLLM's (run by --vllm-python)")
    ap.add_argument("--vllm-python", default=srv.vllm_python_default(),
                    help="python of vLLM's environment, for --server vllm-lookupdec")
    srv.add_options(ap)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return srv.run(lambda started: _run(args, argv, started))


def _run(args, argv, started: srv.Servers) -> int:
    t0 = time.perf_counter()
    env = srv.server_env(args.threads)
    if args.server == "lookupdec":
        server = started.start(srv.lookupdec_server(args, env))
    else:
        server = started.start(srv.vllm_server(args, args.server, srv.vllm_env(args.threads), source=""))
    cases = attacks.cases(server.model_id)
    note(f"{len(cases)} cases, one at a time...")
    tally = attack(server.url, cases)
    alive = server.proc.poll() is None
    report = {"server": args.server, "argv": server.argv, "model_id": server.model_id, "cases": len(cases),
              "right": tally.right(), "status_5xx": tally.status_5xx, "alive_at_end": alive,
              "seconds": round(time.perf_counter() - t0, 1), "families": tally.families(), "failures": tally.failures,
              "by_case": tally.by_case,
              "command": "python -m benchmarks.serve_attack " + " ".join(sys.argv[1:] if argv is None else argv)}
    (args.out / "serve_attack.json").write_text(json.dumps(report, indent=1))
    print(f"\n{args.server}: {tally.right()}/{len(cases)} cases answered as they must, {tally.status_5xx} 5xx; the "
          f"server {'alive' if alive else 'DEAD'} at the end")
    tally.print()
    passed = tally.right() == len(cases) and alive
    print("serve_attack: " + ("passed" if passed else "FAILED") + f"; details in {args.out / 'serve_attack.json'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
