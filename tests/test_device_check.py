"""benchmarks/device_check.py, the one-shot GPU check, in its CPU dry run: so the script cannot rot between the rare
runs on a GPU. The dry run runs once per session (about half a minute); the tests read what it wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import device_check

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    env = {**os.environ, "LOOKUPDEC_CACHE_DIR": str(out / "cache")}  # the calibration's profiles stay here
    for key in ("LOOKUPDEC_TEST_DEVICE", "LOOKUPDEC_TEST_DTYPE"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "device_check.json").read_text()), (out / "device_check.md").read_text(), out


def test_dry_run_reports_every_stage(dry_run):
    report, _, _ = dry_run
    meta = report["meta"]
    assert meta["dry_run"] is True and meta["device"] == "cpu" and meta["dtype"] == "float32"
    assert meta["max_draft"] == 8
    assert {name: s["status"] for name, s in report["stages"].items()} == dict.fromkeys(device_check.STAGES, "done")
    assert 0 < meta["seconds"] < meta["budget_s"]


def test_dry_run_exactness_counts(dry_run):
    report, _, _ = dry_run
    fp32, bf16 = report["exact32"], report["exact16"]
    assert (fp32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    # The dry run's selection: greedy equality and plain batched equality on the tiny llama, the seeded verifier.
    assert fp32["total"] == bf16["total"] == 3
    assert fp32["passed"] == 3 and fp32["failed"] == fp32["error"] == 0 and not fp32["timed_out"]
    assert fp32["failures"] == [] and fp32["seconds"] > 0
    # bf16 is data: whatever it gives, the counts add up and every failure is named.
    assert bf16["passed"] + bf16["failed"] + bf16["error"] + bf16["skipped"] == bf16["total"]
    assert len(bf16["failures"]) == bf16["failed"] + bf16["error"]
    assert all(f["test"].startswith("tests.test_") for f in bf16["failures"])


def test_dry_run_cost_curves(dry_run):
    report, _, _ = dry_run
    curves = report["cost_curves"]
    assert list(curves) == ["135M", "0.5B", "1.5B", "7B"]
    sizes = []
    for name, curve in curves.items():
        assert "error" not in curve, (name, curve.get("error"))
        profile = np.asarray(curve["profile"])
        assert profile.shape == (9,) and profile[0] == 1.0  # d = 0 .. 8, relative to a plain step
        assert np.all(np.isfinite(profile)) and profile.min() > 0.2 and profile.max() < 50
        assert 0 < curve["plain_step_ms"] < 1000 and curve["build_seconds"] >= 0
        assert curve["shape_of"].endswith("(tiny stand-in)") and curve["family"] in ("llama", "qwen2")
        sizes.append(curve["parameters"])
    assert sizes == sorted(sizes) and len(set(sizes)) == 4  # the stand-ins grow like the models they stand for


def test_dry_run_speed(dry_run):
    report, _, _ = dry_run
    speed = report["speed"]
    assert speed["model"].startswith("random weights") and not speed["cut_short"]
    assert len(speed["single"]) == 2 and speed["new_tokens"] == 12
    for row in speed["single"]:
        for system in device_check.SYSTEMS:
            assert row[system]["seconds"] > 0 and 1 <= row[system]["new_tokens"] <= 12
        # fp32 on a CPU: both lookup routes give greedy's tokens, in no more passes than greedy.
        assert row["lookupdec"]["identical"] and row["pld"]["identical"]
        assert 1 <= row["lookupdec"]["passes"] <= row["greedy"]["passes"]
    assert [b["batch"] for b in speed["batches"]] == [1, 4]
    for b in speed["batches"]:
        assert b["rows_equal_alone"] == b["rows"]
        for system in device_check.SYSTEMS:
            assert b[system]["tokens_per_s"] > 0 and b[system]["tokens"] > 0
        assert b["lookupdec_x_greedy"] > 0 and b["lookupdec_tokens_per_pass"] >= 1
    four = speed["batches"][1]
    assert four["rows"] == 4 and four["rows_equal_plain_batched"] == 4 and four["pld"]["rows_one_at_a_time"]
    assert len(speed["calibration"]) == 65 and speed["calibration"][0] == 1.0  # DrafterConfig.max_draft + 1


def test_dry_run_markdown(dry_run):
    report, md, _ = dry_run
    assert md.startswith("# Device check (dry run): CPU")
    for heading in ("## Exactness tests on the device", "## Verification cost curves (random weights)",
                    "## Speed on the quick prompts", "## Stages"):
        assert heading in md
    assert "| float32 | PASS | 3 | 0 | 0 | 0 |" in md
    for name in report["cost_curves"]:
        assert f"| {name} | " in md
    assert "| 1 | " in md and "| 4 | " in md
    assert "--cost-curve NAME" in md


def test_simulate_reads_the_dry_runs_curves(dry_run):
    # research/simulate.py --cost-file takes the json as written; the dry run's curves stop at d = 8, short of the
    # replay's 64, and that is said clearly.
    from research import simulate

    _, _, out = dry_run
    with pytest.raises(ValueError, match="the replay needs 0..64"):
        simulate.load_cost_file(out / "device_check.json", "7B")
    with pytest.raises(ValueError, match="one of: 135M, 0.5B, 1.5B, 7B"):
        simulate.load_cost_file(out / "device_check.json")


def test_models_are_built_on_the_device_they_are_meant_for():
    # Under the torch.device context transformers allocates the weights there: on the meta device a model of the
    # 7B's shapes takes no memory and no time, so on a GPU it is built there without a host copy.
    family, shape = device_check.SHAPES["7B"]
    model = device_check.build_random(family, shape, "meta", torch.bfloat16)
    params = list(model.parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params)
    assert 7.4e9 < sum(p.numel() for p in params) < 7.8e9  # Qwen2.5-7B: 7.6 G parameters
    family, shape = device_check.SHAPES["135M"]
    model = device_check.build_random(family, shape, "meta", torch.float32)
    assert 1.3e8 < sum(p.numel() for p in model.parameters()) < 1.4e8  # tied embeddings counted once


def test_tiny_stand_ins_keep_the_families():
    tiny = device_check.tiny_shapes()
    assert list(tiny) == list(device_check.SHAPES)
    for name, (family, shape) in tiny.items():
        assert family == device_check.SHAPES[name][0]
        assert shape["tie_word_embeddings"] == device_check.SHAPES[name][1]["tie_word_embeddings"]
