"""benchmarks/device_check.py, the one-shot GPU check: its CPU dry run, so the script cannot rot between the rare
runs on a GPU, and the helpers the dry run does not reach.

The dry run runs once per module (about half a minute, as a command); the tests read the json it wrote and check
what a GPU run's reader relies on: every field, its type, and the outcomes that must hold on a CPU in fp32. The
Markdown beside it is prose for people, not checked. The helpers: the tokenizer it saves for a random-weight model,
how it compares plain vLLM with lookupdec's proposer (the vllm stage skips itself without a CUDA device), the
environment of vLLM's processes, where it builds its models.

Tests of the tools, not of the product; CI runs them after the product suite. From the repository root::

    python -m pytest -q benchmarks research
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import device_check
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


# ---- helpers the dry run does not reach -------------------------------------------------------------------


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
