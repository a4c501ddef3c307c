"""benchmarks/run.py: its per-suite summary (medians of per-prompt ratios, the pooled copy-heavy row, the 10th
percentile and the worst prompt beside each median), its opt-in systems (the compiled forward swapped in and out,
and llama.cpp as an anchor where it is installed: it is not here, so a stand-in module plays it, which tests what
our adapter does with its tokens; whether llama.cpp itself decodes the GGUF is for a machine that has it), and its
batch mode on the fast path (benchmarks/batch.py).

Tests of the tools, not of the product; CI runs them after the product suite. From the repository root::

    python -m pytest -q benchmarks research
"""

import sys
import types

import pytest
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


def _record(suite, name, seconds):
    runs = [{"system": s, "seconds": t, "new_tokens": 10, "passes": 5, "identical": True, "draft_seconds": 0.0,
             "accepted_per_position": [], "drafted_per_position": []} for s, t in seconds.items()]
    return {"suite": suite, "name": name, "prompt_tokens": 5, "runs": runs}


def test_the_summary_pools_the_copy_heavy_suites_and_reports_each_medians_tail():
    # Per suite, medians of per-prompt ratios; the yaml + code row pools those prompts; beside each system's
    # median speedup, the 10th percentile (nearest rank) and the worst prompt's.
    records = [_record("yaml", "a", {"greedy": 8, "pld": 4, "lookupdec": 2, "lookupdec_hf": 4}),
               _record("yaml", "b", {"greedy": 8, "pld": 4, "lookupdec": 1, "lookupdec_hf": 2}),
               _record("code", "c", {"greedy": 6, "pld": 3, "lookupdec": 3, "lookupdec_hf": 3}),
               _record("qa", "d", {"greedy": 6, "pld": 6, "lookupdec": 3, "lookupdec_hf": 6})]
    systems = ["greedy", "pld", "lookupdec", "lookupdec_hf"]
    rows, suites = run.summarize(records, systems)
    by = {r["suite"]: r for r in suites}
    assert list(by) == ["yaml", "code", "qa", "yaml + code"]
    assert by["yaml + code"]["prompts"] == 3
    assert by["yaml + code"]["vs_pld"] == 2.0  # per prompt 2, 4, 1
    assert by["yaml + code"]["vs_pld_hf"] == 1.0  # per prompt 1, 2, 1
    assert by["yaml"]["vs_pld"] == 3.0 and by["qa"]["vs_pld_hf"] == 1.0
    # lookupdec's speedups over greedy: a 4, b 8, c 2. Median 4; with three prompts the 10th percentile is the worst.
    pooled = by["yaml + code"]
    assert (pooled["x_lookupdec"], pooled["p10_x_lookupdec"], pooled["worst_x_lookupdec"]) == (4.0, 2.0, 2.0)
    assert pooled["worst_prompt_x_lookupdec"] == "c" and by["yaml"]["worst_prompt_x_lookupdec"] == "a"
    meta = {"date": "d", "machine": "m", "model": "x", "mode": "greedy", "max_new_tokens": 10, "reps": 1,
            "pld_tuned": None}
    table = run.markdown(rows, suites, systems, meta)
    # pld, ours, hf: x greedy as median (p10, worst); then lookupdec vs pld, vs pld_tuned (not run), hf vs pld
    assert "| yaml + code | 3 | 2.00 (2.00, 2.00) | 4.00 (2.00, 2.00) | 2.00 (2.00, 2.00) | 2.00 | - | 1.00 |" in table
    _, alone = run.summarize(records[:2], systems)
    assert [r["suite"] for r in alone] == ["yaml"]  # no pooled row without both suites


def test_report_renders_any_choice_of_systems(tmp_path):
    # --report (and the end of every run) from a results.json: the tables, and the plots where matplotlib is here;
    # the oracle alone beside greedy (--systems greedy oracle) is drawn as a bar of its own.
    import json

    records = [_record("yaml", "a", {"greedy": 8, "oracle": 1}), _record("code", "c", {"greedy": 6, "oracle": 2})]
    meta = {"date": "d", "machine": "m", "model": "x", "mode": "greedy", "max_new_tokens": 10, "reps": 1,
            "pld_tuned": None, "systems": ["greedy", "oracle"]}
    (tmp_path / "results.json").write_text(json.dumps({"meta": meta, "records": records}))
    run.report(tmp_path / "results.json")
    assert "| yaml + code | 2 | 5.50 (3.00, 3.00) |" in (tmp_path / "results.md").read_text()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "speedup.png").stat().st_size > 0 and (tmp_path / "tokens_per_pass.png").stat().st_size > 0


def test_the_tenth_percentile_is_a_measured_value_by_nearest_rank():
    from benchmarks.stats import nearest_rank, spread

    values = list(range(1, 21))  # 1 .. 20
    assert nearest_rank(values, 10) == 2 and nearest_rank(values, 95) == 19 and nearest_rank(values, 100) == 20
    assert nearest_rank([3.0, 1.0, 2.0], 10) == 1.0  # below ten values: the smallest
    assert spread({"a": 1.5, "b": 0.9, "c": 1.2}) == {"n": 3, "median": 1.2, "p10": 0.9, "worst": 0.9,
                                                      "worst_name": "b"}


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


def test_drafter_fields_take_numbers_booleans_and_none():
    from benchmarks.run import _config_field

    assert _config_field("min_n=3") == ("min_n", 3)
    assert _config_field("max_slowdown=0.1") == ("max_slowdown", 0.1)
    assert _config_field("max_slowdown=none") == ("max_slowdown", None)
    assert _config_field("cursor=false") == ("cursor", False)
    with pytest.raises(SystemExit, match="must be a number, true, false or none"):
        _config_field("cursor=maybe")
