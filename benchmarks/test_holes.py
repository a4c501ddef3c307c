"""benchmarks/holes.py on a tiny random Llama: every width and span is timed against the narrowest cache, and each
compaction keeps exactly the rows' tokens. Times are not checked (a test asserts behaviour, not speed)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import holes


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def test_every_width_and_span_is_timed_against_the_narrowest_cache(tiny):
    result = holes.measure(tiny, rows=3, tokens=40, widths=[40, 70], spans=[1, 5], reps=2)
    assert [(p["width"], p["span"]) for p in result["passes"]] == [(40, 1), (40, 5), (70, 1), (70, 5)]
    assert all(p["seconds"] > 0 for p in result["passes"])
    assert [p["over_narrowest"] for p in result["passes"] if p["width"] == 40] == [1.0, 1.0]
    assert [c["width"] for c in result["compaction"]] == [40, 70]
    assert all(c["in_plain_steps"] > 0 for c in result["compaction"])
    table = holes.markdown(result, {"date": "d", "model": "tiny", "threads": 1})
    assert "| 70 | 5 |" in table and "| 70 slots |" in table


def test_a_cache_holds_each_rows_tokens_among_its_holes(tiny):
    cache, mask = holes._cache(tiny, rows=2, tokens=10, width=25, seed=1)
    assert mask.shape == (2, 25) and mask.sum(1).tolist() == [10, 10]
    assert cache.get_seq_length() == 25


def test_a_width_narrower_than_the_tokens_is_refused(tiny, tmp_path, capsys):
    with pytest.raises(ValueError, match="at least --tokens"):
        holes.measure(tiny, rows=1, tokens=10, widths=[5], spans=[1], reps=1)
    with pytest.raises(SystemExit) as exit_:
        holes.main(["--tokens", "10", "--widths", "5", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and "--widths" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written
