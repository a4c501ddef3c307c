"""benchmarks/serve_hol.py on a real ``lookupdec serve`` over a tiny model, its sizes scaled down (a 1,500-token
prompt, bodies of 300 kB): every part runs, every request gets an answer (the bodies too large for the context a
4xx), and the report holds what a reader relies on. Whether the ratios meet their limits is the measured run's
question, not this one's. Tests of the tools, not of the product (``python -m pytest -q benchmarks research``)."""

import json

import pytest

from benchmarks import serve_hol


def test_every_part_runs_and_is_reported(served, tmp_path, monkeypatch):
    monkeypatch.setattr(serve_hol, "LONG_TOKENS", 1500)
    monkeypatch.setattr(serve_hol, "BIG_BODY_BYTES", 300_000)
    monkeypatch.setattr(serve_hol, "PREDICTION_BYTES", 300_000)
    code = serve_hol.main(["--reps", "1", "--delay", "0.1", *served])
    report = json.loads((tmp_path / "head_of_line.json").read_text())
    assert code == (0 if all(report["checks"].values()) else 1)
    assert report["checks"]["no_5xx"] and report["checks"]["every_short_and_long_answered"]
    assert report["checks"]["big_bodies_all_answered_4xx_or_200"]
    a, b, c, d = (report[k] for k in ("a_alone", "b_behind_long", "c_big_bodies", "d_big_prediction"))
    assert a["median_s"] > 0 and b["ratio"] > 0 and b["long_median_s"] > 0
    assert abs(b["runs"][0]["long_prompt_tokens"] - 1500) <= serve_hol.LONG_TOLERANCE
    assert c["statuses"] == {"400": serve_hol.BIG_BODIES}  # 300k byte tokens: past the 16k context
    assert d["runs"][0]["neighbour"]["status"] == 200
    for part in (a, b, c, d):
        assert part["health"]["polls"] > 0
    assert "| b | short request sent 0.1 s after a prompt of" in (tmp_path / "head_of_line.md").read_text()


def test_long_prompts_come_from_installed_texts_where_the_news_data_is_absent(monkeypatch):
    # A clone with nothing beside it has no ../shared/data: the summary suite is empty, the docs suite is not.
    monkeypatch.setitem(serve_hol.SUITES, "summary", lambda: [])
    corpus = serve_hol._corpus()
    assert corpus and corpus == "\n\n".join(p.user for p in serve_hol.SUITES["docqa"]())
    monkeypatch.setitem(serve_hol.SUITES, "docqa", lambda: [])
    with pytest.raises(SystemExit, match="no text to build long prompts from"):
        serve_hol._corpus()
