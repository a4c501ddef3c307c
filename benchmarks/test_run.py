"""benchmarks/run.py's opt-in systems (issue 26): the compiled forward swapped in and out, and llama.cpp as an anchor
where it is installed (it is not here: a stand-in module plays it, so what our adapter does with its tokens is
tested; whether llama.cpp itself decodes the GGUF is for a machine that has it).

Tests of the tools, not of the product. Run them from the repository root::

    python -m pytest -q benchmarks
"""

import sys
import types

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import run


def _tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def test_compiled_forward_is_swapped_in_for_its_calls_only():
    model = _tiny()
    compiled = run.CompiledForward(model, backend="eager")
    ids = torch.tensor([[5, 9, 4, 17, 5, 9]])
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    with compiled:
        assert "forward" in vars(model)  # the compiled one
        fast = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              cache_implementation="static")
    assert "forward" not in vars(model)  # the class's own again
    assert fast.tolist() == plain.tolist()
    with compiled:  # made once, reused
        first = model.forward
    with compiled:
        assert model.forward is first


class _FakeLlama:
    """llama_cpp.Llama's surface that LlamaCpp uses: generate() yields token ids forever, token_eos()."""

    def __init__(self, model_path, n_ctx, n_threads, verbose):
        self.model_path, self.resets, self.calls = model_path, 0, []

    def reset(self):
        self.resets += 1

    def token_eos(self):
        return 2

    def generate(self, tokens, temp, top_k, repeat_penalty, reset):
        self.calls.append((list(tokens), temp, top_k, repeat_penalty))
        yield from [7, 8, 9, 2, 11, 12] if tokens[0] == 1 else iter(lambda: 5, None)


def test_llamacpp_stops_at_eos_or_the_budget(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=_FakeLlama))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    engine, why = run.llamacpp_for(str(gguf), threads=1)
    assert why is None and engine.llm.model_path == str(gguf)
    assert engine.generate([1, 3], max_new_tokens=10) == [7, 8, 9]  # greedy, cut at EOS (not included)
    assert engine.llm.calls[-1] == ([1, 3], 0.0, 1, 1.0)  # temperature 0, top-1, no repetition penalty
    assert engine.generate([4], max_new_tokens=4) == [5, 5, 5, 5]  # cut at the budget


def test_llamacpp_is_skipped_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    assert run.llamacpp_for(None, None) == (None, "llama-cpp-python is not installed")
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=_FakeLlama))
    engine, why = run.llamacpp_for(str(tmp_path), None)  # a folder: no GGUF for llama.cpp
    assert engine is None and "is not a .gguf file" in why



def test_batch_mode_on_the_fast_path_runs_both_systems_on_a_static_cache():
    from transformers import StaticCache

    from benchmarks import batch

    model = _tiny()
    torch.manual_seed(1)
    texts = {f"p{i}": torch.randint(3, 64, (1, 12 + 3 * i)) for i in range(4)}  # prompt text -> ids
    caches = set()
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: caches.add(type(kwargs.get("cache", kwargs.get("past_key_values")))),
        with_kwargs=True)
    args = types.SimpleNamespace(max_new_tokens=10, reps=1, drafter={})
    tokenizer = types.SimpleNamespace(eos_token_id=model.generation_config.eos_token_id, pad_token_id=0)
    prompts = [types.SimpleNamespace(user=text) for text in texts]
    try:
        caches.clear()
        data = batch.run_batches(model, tokenizer, prompts, [2, 4], args, lambda _, text: texts[text],
                                 compiled=run.CompiledForward(model, backend="eager"))
    finally:
        hook.remove()
    assert StaticCache in caches
    for entry in data["batches"]:
        assert entry["rows_identical"] == entry["rows"] == 4 and entry["same_as_plain_batched"]
