"""benchmarks/serve_attack.py: every case of tests/serve_attacks.py sent to a real ``lookupdec serve`` (on a tiny
model), each answered as its case says. Tests of the tools, not of the product
(``python -m pytest -q benchmarks research``)."""

import json

from benchmarks import serve_attack
from tests import serve_attacks as attacks


def test_every_case_is_sent_once_and_judged(served, tmp_path):
    assert serve_attack.main(served) == 0
    report = json.loads((tmp_path / "serve_attack.json").read_text())
    cases = attacks.cases(report["model_id"])
    assert report["cases"] == report["right"] == len(cases) and report["status_5xx"] == 0 and report["alive_at_end"]
    assert {c.name for c in cases} == set(report["by_case"])
    assert all(entry["sent"] == 1 for entry in report["by_case"].values())
    assert report["families"]["refused"]["statuses"] == {"404": 1, "400": 5, "413": 2}


def test_a_wrong_answer_is_a_failure_with_its_reason():
    # The judge the tool and the product's tests share: a 200 where a 4xx was due, a 4xx naming another field.
    case = attacks.refused("m")[0]  # temperature -1
    assert case.name == "range/temperature=-1"
    ok = json.dumps({"error": {"message": "no", "type": "invalid_request_error", "param": "temperature",
                               "code": None}}).encode()
    json_type = {"content-type": "application/json"}
    assert attacks.problem(case, 400, json_type, ok) is None
    assert attacks.problem(case, 200, json_type, b'{"choices": []}').startswith("HTTP 200, expected a 4xx")
    wrong = ok.replace(b'"temperature"', b'"top_p"')
    assert "param 'top_p', expected temperature" in attacks.problem(case, 400, json_type, wrong)
    assert "not JSON" in attacks.problem(case, 400, {"content-type": "text/plain"}, ok)
