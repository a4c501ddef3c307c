"""Helpers of benchmarks/device_check.py that its CPU dry run does not reach (the vllm stage skips itself without
a CUDA device) or reaches only with tiny models: the tokenizer it saves for a random-weight model, how it compares
plain vLLM with lookupdec's proposer, the environment of vLLM's processes, where it builds its models.

Tests of the tools, not of the product: the product suite (``python -m pytest`` from the repository root, whose
``testpaths`` is ``tests``) runs the dry run and checks what it writes (tests/test_device_check.py), not these.
Run them from the repository root::

    python -m pytest -q benchmarks
"""

import os
from pathlib import Path

import torch

from benchmarks import device_check

ROOT = Path(__file__).resolve().parent.parent


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
