"""benchmarks/serve_soak.py, a few seconds of it on a real ``lookupdec serve`` over a tiny model: the attacks, the
clients that leave and the well-formed requests all sent, and every check but memory growth (a few seconds say
nothing about it) holding. Tests of the tools, not of the product (``python -m pytest -q benchmarks research``)."""

import json

from benchmarks import serve_soak
from tests import serve_attacks as attacks


def test_a_short_soak_sends_every_kind_of_request(served, tmp_path):
    code = serve_soak.main(["--seconds", "4", "--requests", "2", "--max-tokens", "4", *served])
    report = json.loads((tmp_path / "soak.json").read_text())
    checks = report["checks"]
    assert code == (0 if all(checks.values()) else 1)
    for check in ("no_5xx", "every_attack_answered_as_its_case_says", "well_formed_exact_and_answered",
                  "health_within_1s", "alive_and_healthy_at_end"):
        assert checks[check], (check, report["failures"], report["attack_failures"])
    cases = attacks.cases("m")
    assert set(report["attacks"]) == {c.name for c in cases}
    assert all(entry["sent"] >= 1 for entry in report["attacks"].values())  # every case once before the load
    assert sum(entry["sent"] for entry in report["attacks"].values()) > len(cases)  # and more under it
    assert report["well_formed"] > 0 and report["well_formed_ok"] == report["well_formed"]
    assert all(report["left"][how]["sent"] > 0 for how in ("after_first_event", "after_seconds"))
    assert report["health"]["polls"] > 0 and len(report["rss_timeline"]) > 1
