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
    statuses = {name: s["status"] for name, s in report["stages"].items()}
    assert list(statuses) == list(device_check.STAGES) and device_check.STAGES[-1] == "vllm"
    assert statuses == {**dict.fromkeys(device_check.STAGES, "done"), "vllm": statuses["vllm"]}
    assert 0 < meta["seconds"] < meta["budget_s"]


def test_dry_run_skips_vllm_with_a_reason(dry_run):
    # On a CPU the vllm stage skips itself at once (vLLM's CPU build is tests/test_vllm.py's), and says why.
    report, md, _ = dry_run
    reason = report["vllm"]["skipped"]
    assert reason.startswith("no CUDA device") and report["vllm"] == {"skipped": reason}
    assert report["stages"]["vllm"]["status"] == f"skipped: {reason}"
    assert report["stages"]["vllm"]["seconds"] < 1
    assert "## lookupdec on vLLM" in md and f"Skipped: {reason}" in md


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


def test_byte_tokenizer_for_random_weights_in_vllm(tmp_path):
    # The vllm stage's tokenizer for a random-weight model, built without a download: saved and read back as vLLM
    # reads it, bytes are ids 3 + b, every id up to the vocabulary decodes, and it has ChatML's template.
    from transformers import AutoTokenizer

    device_check.byte_tokenizer(400).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 400 and (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    text = "port: 9090\n  héllo ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [3 + b for b in text.encode()] and tok.decode(ids) == text
    assert tok.decode([300, 399]) == "<extra_300><extra_399>"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok(chat, add_special_tokens=False)["input_ids"][:1] == [1]


def test_vllm_comparison_and_its_markdown():
    # What the vllm stage makes of two runs of tests/vllm_offline.py (no vLLM needed): a difference is placed and
    # shown with plain's top-2 gap there.
    top = [{"5": -0.1, "6": -2.0}, {"7": -0.5, "8": -0.5004}, {"9": -0.2, "4": -3.0}]
    plain = {"token_ids": [[5, 7, 9], [5, 7], [5]], "batched_token_ids": [[5, 7, 9], [5, 7], [5]],
             "top": [top, top[:2], top[:1]], "batched_top": [top, top[:2], top[:1]], "texts": ["a", "b", "c"],
             "metrics": {}}
    lookup = {**plain, "token_ids": [[5, 8, 9], [5, 7], [5]], "batched_token_ids": [[5, 7, 9], [5, 7, 1], [5]],
              "texts": ["a'", "b", "c"], "metrics": {"vllm:spec_decode_num_draft_tokens": 40,
                                                     "vllm:spec_decode_num_accepted_tokens": 30}}
    rows = device_check.compare_vllm(plain, lookup)
    assert [r["request"] for r in rows] == list(device_check.VLLM_REQUESTS)
    assert [(r["identical_alone"], r["identical_batched"]) for r in rows] == [(False, True), (True, False),
                                                                             (True, True)]
    assert rows[0]["first_difference_alone"] == {"position": 1, "plain_token": 7, "lookupdec_token": 8,
                                                 "plain_top2_gap": 0.0004, "lookupdec_took_plain_second": True}
    assert rows[1]["first_difference_batched"] == {"position": 2, "plain_token": None, "lookupdec_token": 1,
                                                   "plain_top2_gap": None, "lookupdec_took_plain_second": False}
    result = {"vllm": "0.32.0", "transformers": "5.17.0", "torch": "2.11.0", "model": "m", "rows": rows,
              "drafted": 40, "accepted": 30, "runs": {"plain": {"seconds": 50.0}, "lookupdec": {"seconds": 60.0}}}
    md = "\n".join(device_check._vllm_markdown(result))
    assert "| yaml-edit | 3 | NO | yes | yes | at 1: gap 0.0004 (plain's 2nd) | - |" in md
    assert "Drafted 40 tokens, accepted 30 (75% accepted)" in md and "near-tie: NO." in md
    assert "plain 50.0, lookupdec 60.0" in md


def test_vllm_processes_get_the_images_transformers(tmp_path, monkeypatch):
    # device_check.sh run puts the carried transformers (lookupdec's pin) first on PYTHONPATH; vLLM's processes
    # get that folder without it, so they import the image's transformers, and keep the rest (pygtrie).
    site = tmp_path / "site"
    for name in ("transformers", "transformers-5.24.0.dist-info", "pygtrie-2.6.2.dist-info"):
        (site / name).mkdir(parents=True)
    (site / "pygtrie.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(ROOT)]))
    env, shadowed = device_check._vllm_env(torch.device("cuda"), tmp_path / "scratch", shadow=True)
    first, copy = env["PYTHONPATH"].split(os.pathsep)
    assert first == str(ROOT) and shadowed == [str(site)] and env["HF_HUB_OFFLINE"] == "1"
    assert sorted(p.name for p in Path(copy).iterdir()) == ["pygtrie-2.6.2.dist-info", "pygtrie.py"]
    env, shadowed = device_check._vllm_env(torch.device("cuda"), tmp_path / "scratch", shadow=False)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(site)] and shadowed == []


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
