"""benchmarks/device_check.py, the one-shot GPU check, in its CPU dry run: so the script cannot rot between the rare
runs on a GPU. The dry run runs once per module (about half a minute, as a command: nothing of the script is
imported here); the tests read the json it wrote and check what a GPU run's reader relies on: every field, its
type, and the outcomes that must hold on a CPU in fp32. The Markdown beside it is prose for people, not checked.
The script's own helpers are tested in research/test_device_check.py."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lookupdec import DrafterConfig

ROOT = Path(__file__).resolve().parent.parent

STAGES = ["exact32", "curves", "speed", "exact16", "compiled", "vllm"]  # in the order they run
CURVES = ["135M", "0.5B", "1.5B", "7B"]  # research/simulate.py --cost-curve NAME reads them by these names
SYSTEMS = ["greedy", "pld", "lookupdec"]
NUMBER = "number"  # an int or a float (json writes 2.0 and 2 alike once read back)

# Field -> type of each part of device_check.json (a part may hold more fields).
META = {"date": str, "dry_run": bool, "device": str, "device_name": str, "dtype": str, "torch": str,
        "transformers": str, "python": str, "max_draft": int, "budget_s": NUMBER, "command": str, "seconds": NUMBER}
STAGE = {"status": str, "seconds": NUMBER}
TESTS = {"device": str, "dtype": str, "command": str, "timed_out": bool, "returncode": int, "seconds": NUMBER,
         "total": int, "passed": int, "failed": int, "error": int, "skipped": int, "failures": list, "skips": list}
FAILURE = {"test": str, "message": str}
CURVE = {"family": str, "shape_of": str, "device": str, "dtype": str, "config": dict, "build_seconds": NUMBER,
         "parameters": int, "measure_seconds": NUMBER, "plain_step_ms": NUMBER, "profile": list,
         "measured_lengths": str}
SPEED = {"model": str, "prompts": list, "new_tokens": int, "cut_short": bool, "calibration": list,
         "calibration_seconds": NUMBER, "warmup_seconds": NUMBER, "single": list, "batches": list}
SINGLE = {"prompt": str, "suite": str, "prompt_tokens": int, **dict.fromkeys(SYSTEMS, dict)}
RUN = {"seconds": NUMBER, "new_tokens": int, "passes": int, "identical": bool}
RATE = {"tokens": int, "seconds": NUMBER, "tokens_per_s": NUMBER}
BATCH = {"batch": int, "rows": int, **dict.fromkeys(SYSTEMS, dict), "rows_equal_alone": int,
         "lookupdec_tokens_per_pass": NUMBER, "lookupdec_x_greedy": NUMBER, "lookupdec_vs_pld": NUMBER}
BATCHED = {**BATCH, "rows_equal_plain_batched": int, "plain_rows_equal_alone": int, "lookupdec_passes": int}
FAST = ["greedy", "greedy_compiled", "lookupdec", "lookupdec_compiled"]  # the compiled stage's systems
COMPILED = {"model": str, "prompts": list, "new_tokens": int, "backend": str, "cut_short": bool, "first_call_s": dict,
            "single": list, "greedy_compiled_x_greedy": NUMBER, "lookupdec_compiled_x_greedy_compiled": NUMBER,
            "best_lookupdec_x_fastest_plain": NUMBER, "greedy_compiled_identical": int, "lookupdec_identical": int,
            "lookupdec_compiled_identical": int}


def _fields(part, schema: dict, where: str) -> None:
    assert isinstance(part, dict), f"{where}: {part!r} is not an object"
    missing = sorted(set(schema) - set(part))
    assert not missing, f"{where}: no {', '.join(missing)}"
    for name, kind in schema.items():
        value = part[name]
        if kind == NUMBER:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else:
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        assert ok, f"{where}.{name}: {value!r} is not {getattr(kind, '__name__', kind)}"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    env = {**os.environ, "LOOKUPDEC_CACHE_DIR": str(out / "cache")}  # the calibration's profiles stay here
    for key in ("LOOKUPDEC_TEST_DEVICE", "LOOKUPDEC_TEST_DTYPE"):
        env.pop(key, None)
    # The script keeps to a budget of 240 s in a dry run; the timeout only stops a hung one.
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "device_check.md").read_text().strip()  # written beside the json
    return json.loads((out / "device_check.json").read_text())


def test_dry_run_reports_every_stage(dry_run):
    _fields(dry_run["meta"], META, "meta")
    meta = dry_run["meta"]
    assert meta["dry_run"] is True and (meta["device"], meta["dtype"]) == ("cpu", "float32")
    assert 0 < meta["seconds"] < meta["budget_s"]
    assert list(dry_run["stages"]) == STAGES
    for name, stage in dry_run["stages"].items():
        _fields(stage, STAGE, f"stages.{name}")
    # On a CPU every stage runs but vllm, which needs a CUDA device and says why it skipped.
    assert {name: s["status"] for name, s in dry_run["stages"].items() if name != "vllm"} == dict.fromkeys(
        STAGES[:-1], "done")
    _fields(dry_run["vllm"], {"skipped": str}, "vllm")
    reason = dry_run["vllm"]["skipped"]
    assert reason and dry_run["stages"]["vllm"]["status"] == f"skipped: {reason}"


@pytest.mark.parametrize("key, dtype", [("exact32", "float32"), ("exact16", "bfloat16")])
def test_dry_run_exactness_counts(dry_run, key, dtype):
    tests = dry_run[key]
    _fields(tests, TESTS, key)
    for i, failure in enumerate(tests["failures"]):
        _fields(failure, FAILURE, f"{key}.failures[{i}]")
    assert (tests["device"], tests["dtype"]) == ("cpu", dtype) and not tests["timed_out"]
    assert tests["total"] > 0
    assert tests["passed"] + tests["failed"] + tests["error"] + tests["skipped"] == tests["total"]
    assert len(tests["failures"]) == tests["failed"] + tests["error"]
    if dtype == "float32":  # fp32 on a CPU: the exactness tests pass; bf16 is data
        assert tests["passed"] == tests["total"] and tests["failures"] == [] and tests["returncode"] == 0


def test_dry_run_cost_curves(dry_run):
    curves = dry_run["cost_curves"]
    assert list(curves) == CURVES
    sizes = []
    for name, curve in curves.items():
        assert "error" not in curve, (name, curve.get("error"))
        _fields(curve, CURVE, f"cost_curves.{name}")
        profile = curve["profile"]
        assert len(profile) == dry_run["meta"]["max_draft"] + 1 and profile[0] == 1.0  # d = 0 .. max_draft
        assert all(isinstance(c, (int, float)) and 0 < c < math.inf for c in profile)
        assert curve["plain_step_ms"] > 0 and curve["parameters"] > 0
        sizes.append(curve["parameters"])
    assert sizes == sorted(sizes) and len(set(sizes)) == len(CURVES)  # growing like the models they stand for


def test_dry_run_speed(dry_run):
    speed = dry_run["speed"]
    _fields(speed, SPEED, "speed")
    assert not speed["cut_short"] and speed["single"] and speed["batches"]
    # The drafter's pass-cost profile: d = 0 .. its max_draft, relative to a plain step.
    assert len(speed["calibration"]) == DrafterConfig().max_draft + 1 and speed["calibration"][0] == 1.0
    for i, row in enumerate(speed["single"]):
        _fields(row, SINGLE, f"speed.single[{i}]")
        for system in SYSTEMS:
            _fields(row[system], RUN, f"speed.single[{i}].{system}")
            assert row[system]["seconds"] > 0 and 1 <= row[system]["new_tokens"] <= speed["new_tokens"]
        # fp32 on a CPU: both lookup routes give greedy's tokens, lookupdec in no more passes than greedy.
        assert row["lookupdec"]["identical"] and row["pld"]["identical"]
        assert 1 <= row["lookupdec"]["passes"] <= row["greedy"]["passes"]
    for i, batch in enumerate(speed["batches"]):
        where = f"speed.batches[{i}]"
        _fields(batch, BATCH if batch["batch"] == 1 else BATCHED, where)
        for system in SYSTEMS:
            _fields(batch[system], RATE, f"{where}.{system}")
        assert batch["rows_equal_alone"] == batch["rows"]
        if batch["batch"] > 1:
            assert batch["rows"] == batch["batch"] and batch["rows_equal_plain_batched"] == batch["rows"]
    assert [b["batch"] for b in speed["batches"]][0] == 1 and len(speed["batches"]) > 1  # batch 1 and a batch


def test_dry_run_compiled(dry_run):
    compiled = dry_run["compiled"]
    _fields(compiled, COMPILED, "compiled")
    assert compiled["backend"] == "eager" and not compiled["cut_short"] and compiled["single"]  # traced, no kernels
    assert sorted(compiled["first_call_s"]) == sorted(FAST)
    for i, row in enumerate(compiled["single"]):
        _fields(row, {"prompt": str, "suite": str, **dict.fromkeys(FAST, dict)}, f"compiled.single[{i}]")
        for system in FAST:
            timing = {k: v for k, v in RUN.items() if system != "greedy" or k != "identical"}  # greedy: the reference
            _fields(row[system], timing, f"compiled.single[{i}].{system}")
        # fp32 on a CPU with a traced (not generated) forward: every output is its reference's
        assert row["greedy_compiled"]["identical"] and row["lookupdec_compiled"]["identical"]
        assert row["lookupdec"]["identical"] and row["lookupdec_compiled"]["passes"] <= row["greedy"]["passes"]
    n = len(compiled["single"])
    assert compiled["lookupdec_compiled_identical"] == compiled["greedy_compiled_identical"] == n
