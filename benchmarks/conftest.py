"""Fixtures of the tools' tests (``python -m pytest -q benchmarks research``, which CI runs after the product
suite): a cache folder of their own, and a tiny model a real ``lookupdec serve`` starts on in seconds."""

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory):
    """lookupdec's cache (calibration profiles, converted models) in a folder of this session, servers started by
    the tools included (they inherit the environment): the tiny models' profiles stay out of the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOOKUPDEC_CACHE_DIR", str(tmp_path_factory.mktemp("lookupdec-cache")))
        yield


@pytest.fixture(scope="session")
def tiny_served_model(tmp_path_factory) -> Path:
    """A folder ``lookupdec serve --model`` loads: a random-weight Llama of 30k parameters with a context of 16k
    tokens, and device_check's byte tokenizer (a byte is a token) with ChatML's chat template. What it writes is
    noise; the serve tools' tests check what a tool does with a server's answers, not what the model says."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.device_check import byte_tokenizer

    folder = tmp_path_factory.mktemp("tiny-served-model")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16384,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = 2
    model.save_pretrained(folder)
    byte_tokenizer(config.vocab_size).save_pretrained(folder)
    return folder


@pytest.fixture
def served(tiny_served_model, tmp_path) -> list[str]:
    """The options every serve tool takes, for a run on the tiny model writing to the test's ``tmp_path``."""
    return ["--model", str(tiny_served_model), "--out", str(tmp_path), "--startup-timeout", "120"]
