"""Exactness on real models: the embedded SmolLM2 (llama architecture) on real edit prompts, and Gemma 3
(sliding-window attention, a different cache layout) on copy-heavy text. fp32, greedy, both routes."""

import copy
import inspect
import textwrap
from pathlib import Path

import pytest
import torch

import lookupdec
from lookupdec import LookupDrafter

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "configs"

ARTICLE = (
    "The city council voted on Tuesday to extend the riverside bike lane by three kilometres. The project, "
    "which will cost 2.4 million euros, is expected to open next spring. Council member Ana Ruiz said the lane "
    "had doubled cycling traffic along the river since it opened in 2021."
)


def _edit_prompts():
    service = (EXAMPLES / "service.yaml").read_text()
    indent = inspect.getsource(textwrap.indent)
    return {
        "yaml": f"```yaml\n{service}```\n\nChange the server port to 9090. Reply with the complete file in one "
                "```yaml block and nothing else.",
        "code": f"```python\n{indent}```\n\nRename the parameter `predicate` to `keep`. Reply with the complete "
                "function in one ```python block and nothing else.",
        "summary": f"{ARTICLE}\n\nSummarize the text above in two sentences, reusing its wording.",
    }


def _priced_drafter():
    # Draft lengths follow the pass cost, and a drafter that measures it draws them from this machine's timings:
    # on a slow or busy machine it drafts less. Fixed costs (a CPU-like profile: a draft costs 1.3 plain steps
    # plus 5% per token) keep "drafts do the work" a statement about the drafts, not about the machine.
    drafter = LookupDrafter()
    drafter.cost.use_profile([1.0] + [1.3 + 0.05 * d for d in range(1, drafter.drafter_config.max_draft + 1)])
    return drafter


def _chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_dict=True, return_tensors="pt")["input_ids"]


@pytest.mark.parametrize("kind", ["yaml", "code", "summary"])
def test_embedded_model_matches_greedy_on_real_edits(smollm2, kind):
    model, tokenizer = smollm2
    ids = _chat(tokenizer, _edit_prompts()[kind])
    mask = torch.ones_like(ids)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=96)
    ours = lookupdec.generate(model, ids, attention_mask=mask, max_new_tokens=96, drafter=_priced_drafter())
    assert ours.sequences.tolist() == ref.tolist()
    assert lookupdec.generate(model, ids, attention_mask=mask, max_new_tokens=96).sequences.tolist() == ref.tolist()
    via_hf = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=96,
                            assistant_model=LookupDrafter())
    assert via_hf.tolist() == ref.tolist()
    if kind != "summary":  # an edit copies its input: drafts must be doing the work
        assert ours.stats.tokens_per_pass > 2.0, ours.stats


def test_embedded_model_on_a_static_cache_matches_greedy(smollm2):
    # cache_implementation="static" (issue 26): one preallocated cache, passes padded to fixed widths.
    model, tokenizer = smollm2
    ids = _chat(tokenizer, _edit_prompts()["yaml"])
    mask = torch.ones_like(ids)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=96)
    assert model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=96,
                          cache_implementation="static").tolist() == ref.tolist()
    ours = lookupdec.generate(model, ids, attention_mask=mask, max_new_tokens=96, cache_implementation="static",
                              drafter=_priced_drafter())
    assert ours.sequences.tolist() == ref.tolist()
    assert ours.stats.tokens_per_pass > 2.0, ours.stats


def test_gemma3_matches_greedy(gemma3):
    # Longer than Gemma 3's 512-token sliding window, so rejected drafts must be cropped from sliding layers too.
    model, tokenizer = gemma3
    files = [(EXAMPLES / name).read_text() for name in sorted(p.name for p in EXAMPLES.glob("*.y*ml"))]
    text = "\n".join(files * 2)
    ids = tokenizer(f"{text}\n# The first file again:\n{files[0][:60]}", return_tensors="pt")["input_ids"]
    assert ids.shape[1] > model.config.sliding_window
    mask = torch.ones_like(ids)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=64)
    ours = lookupdec.generate(model, ids, attention_mask=mask, max_new_tokens=64)
    assert ours.sequences.tolist() == ref.tolist()
    assert ours.stats.accepted_tokens > 0
    via_hf = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=64,
                            assistant_model=LookupDrafter())
    assert via_hf.tolist() == ref.tolist()


def test_stop_strings_end_generation_like_plain(smollm2):
    model, tokenizer = smollm2
    ids = _chat(tokenizer, _edit_prompts()["yaml"])
    mask = torch.ones_like(ids)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=60, stop_strings=["port"],
                         tokenizer=tokenizer)
    config = copy.deepcopy(model.generation_config)
    config.stop_strings = ["port"]
    ours = lookupdec.generate(model, ids, attention_mask=mask, max_new_tokens=60, generation_config=config,
                              tokenizer=tokenizer)
    assert ours.sequences.tolist() == ref.tolist()
    assert tokenizer.decode(ours.sequences[0, ids.shape[1]:]).endswith("port")
