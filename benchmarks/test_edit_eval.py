"""benchmarks/edit_eval.py without a model: the shipped set is consistent with its configs, a broken entry is
named, each outcome is judged as the module says, saved runs are judged again into the reports, and a command's
stderr is read line by line with its times. Tests of the tools, not of the product
(``python -m pytest -q benchmarks research``)."""

import json
import sys
from dataclasses import asdict, replace

from benchmarks import edit_eval as ev

RTD = "flask-readthedocs.yaml"


def _rtd_case():
    files, cases = ev.load_set()
    return next(c for c in cases if c.id == "rtd-python")  # python: '3.13' -> "3.14"


def test_the_shipped_set_is_consistent():
    files, cases = ev.load_set()
    assert ev.check_set(files, cases) == []
    assert len(cases) > len(files) >= 10 and all(c.file in files for c in cases)


def test_a_broken_entry_is_named():
    files, cases = ev.load_set()
    case = _rtd_case()
    broken = [replace(case, id="typo", ops=({"path": ["build", "tool", "python"], "value": "3.14"},)),
              replace(case, id="same", ops=({"path": ["build", "tools", "python"], "value": "3.13"},)), case]
    problems = ev.check_set(files, [*cases, *broken])
    assert any(p.startswith("typo: an op does not apply (KeyError") for p in problems)
    assert "same: the ops change nothing" in problems and "rtd-python: duplicate id" in problems
    assert f"{RTD}: needs exactly one quick case" in problems


def test_each_outcome_is_judged_as_documented():
    case = _rtd_case()
    text = (ev.EDITS / "configs" / RTD).read_text()
    expected = ev.apply_ops(ev.load_documents(text), case.ops)
    right = text.replace("'3.13'", "'3.14'")

    def outcome(**fields):
        return ev.judge(ev.Run(**{"mode": "lookup", "exit_code": 0, "wall_s": 1.0, **fields}), text, expected)

    assert outcome(output=right) == ("right", "")
    assert outcome(output=text.replace("'3.13'", "3.14"))[0] == "wrong"  # a float is not the string "3.14"
    assert outcome(output=text) == ("wrong", "wrote no change; wanted build.tools.python: '3.13' -> '3.14'")
    assert outcome(exit_code=1, error="no edit") == ("rejected", "no edit")
    assert outcome(exit_code=2, error="a tag")[0] == "refused"
    assert outcome(exit_code=1, output=right) == ("broken", "exit 1 but the output was written")
    assert outcome(output=right, input_unchanged=False) == ("broken", "the input file was modified")
    assert outcome(exit_code=None) == ("broken", "timed out")
    assert outcome() == ("broken", "exit 0 but nothing was written")


def test_saved_runs_are_judged_again_into_the_reports(tmp_path, capsys):
    case = _rtd_case()
    right = (ev.EDITS / "configs" / RTD).read_text().replace("'3.13'", "'3.14'")
    lookup = ev.Run("lookup", 0, 10.0, decode_s=2.0, new_tokens=40, passes=10, output=right)
    plain = ev.Run("plain", 0, 14.0, decode_s=5.0, new_tokens=40, passes=40, output=right)
    result = ev.assess(case, lookup, plain)
    assert result.outcome == "right" and result.same and result.lines_changed == 1
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"meta": {"date": "d", "machine": "m", "commit": "c", "command": "x"},
                                 "results": [asdict(result)]}))
    assert ev.main(["--rejudge", str(saved), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "edit_eval.json").read_text())
    assert report["summary"]["right"] == 1 and report["summary"]["median_speedup"] == 2.5
    table = (tmp_path / "out" / "edit_eval.md").read_text()
    assert "| rtd-python | readthedocs |" in table and "| right |" in table and "2.50x" in table
    assert "judged again" in capsys.readouterr().out


def test_a_commands_stderr_is_read_with_its_times():
    code, lines, wall = ev.timed([sys.executable, "-c", "import sys; print('error: one', file=sys.stderr)"], 60)
    assert code == 0 and [text for _, text in lines] == ["error: one"] and 0 <= lines[0][0] <= wall
    code, _, wall = ev.timed([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert code is None and wall < 30  # killed at the timeout
