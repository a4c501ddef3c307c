"""Reduced precision: in bf16 on the CPU lookupdec's greedy output may part from plain greedy decoding, but only at
a near-tie; in fp32 it stays token-identical.

A verification pass computes ``d + 1`` rows where a plain step computes one, and the CPU's bf16 kernels round some
rows differently (oneDNN's products of three or more rows, attention over several queries), so the two
computations' logits differ by a few bf16 ulps. With ``u`` the bf16 spacing at the largest |logit| of plain's row
and ``K = BOUND_ULPS`` (helpers_precision; ``benchmarks/precision.py`` measures both on the benchmark suites), the
rules pinned here:

- at every position before the outputs part, the verification pass changes the gap between plain's top two logits
  by at most ``K u``: the two computations differ by rounding, nothing more;
- at the first position where they part, plain's top-2 gap is at most ``K u``: plain picks ``a``, lookupdec ``b``,
  so ``l(a) - l(b) <= delta(b) - delta(a)``, the change above. A verifier that kept a wrong token parts from plain
  where the gap can be anything: one that keeps the rejected drafted token fails these tests (on SmolLM2 and the
  tiny gpt2 by the gap, on the tiny llama by the replay check, which asks that every chosen token be the argmax of
  its pass's own logits).

Comparisons are with plain ``model.generate`` in the same dtype; the assertion messages give how many new tokens
matched. The drafter prices passes with a fixed profile, so the drafts, and with them the rounding, are the same on
every run.
"""

import copy
import inspect
import shutil
from pathlib import Path

import pytest
import torch
from helpers_precision import BOUND_ULPS, compare
from test_exactness import _prompts

from lookupdec import LookupDrafter

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


def _drafter():
    # Fixed pass costs, nearly free: no calibration and no timing in the draft lengths, and a draft wherever there
    # is a match, so that many verification passes have several rows.
    drafter = LookupDrafter()
    drafter.cost.use_profile([1.0] + [1.0 + 0.01 * d for d in range(1, drafter.drafter_config.max_draft + 1)])
    return drafter


def _check_near_ties(model, prompts, max_new_tokens) -> list:
    """Runs both decoders on every prompt in the model's dtype and asserts the two rules; returns the comparisons."""
    results = []
    for i, ids in enumerate(prompts):
        res = compare(model, ids, max_new_tokens, _drafter())
        where = (f"prompt {i}: {res.matched} of {len(res.plain)} new tokens match plain "
                 f"({'identical' if res.identical else 'then they part'})")
        if not res.identical:
            assert res.divergence_gap_ulps is not None, f"{where}; the outputs differ in length only"
            assert res.divergence_gap_ulps <= BOUND_ULPS, (
                f"{where}; at the divergence plain's top-2 gap is {res.divergence_gap_ulps:g} u, above the near-tie "
                f"bound of {BOUND_ULPS} u")
        assert res.replay_faithful, f"{where}; the replay of lookupdec's passes did not reproduce its tokens"
        assert max(res.gap_change_ulps, default=0.0) <= BOUND_ULPS, (
            f"{where}; a verification pass changed the gap between plain's top two logits by "
            f"{max(res.gap_change_ulps):g} u (allowed {BOUND_ULPS})")
        results.append(res)
    return results


def test_bf16_parts_from_plain_only_at_near_ties(tiny_model):
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)  # the fixture is shared: cast a copy
    results = _check_near_ties(model, _prompts(model, 4), 60)
    # Passes of several rows were verified (gpt2's absolute positions make it copy little, but it drafts).
    assert sum(r.drafted for r in results) > 100


def test_fp32_stays_identical_on_the_same_prompts(tiny_model):
    prompts = _prompts(copy.deepcopy(tiny_model).to(torch.bfloat16), 4)
    for i, ids in enumerate(prompts):
        res = compare(tiny_model, ids, 60, _drafter(), deep=False)
        assert res.identical, f"prompt {i}: fp32 parts from plain after {res.matched} tokens"


def _fenced(text: str, lang: str) -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


def _benchmark_prompts(tokenizer) -> list:
    """Three prompts of the benchmark suites, as benchmarks/workloads.py words them: two that part from plain
    early in the benchmark's bf16 run (service.yaml#0 after 1 token, codecov.yml#reformat after 8), one that
    does not (shutil.copyfileobj#hints)."""
    users = [
        f"{_fenced((CONFIGS / 'service.yaml').read_text(), 'yaml')}\n\nChange the server port to 9090. Keep "
        "everything else, including comments, exactly as it is. Reply with the complete updated file in one ```yaml "
        "block and nothing else.",
        f"{_fenced((CONFIGS / 'codecov.yml').read_text(), 'yaml')}\n\nRewrite this YAML with consistent two-space "
        "indentation, keeping every key, value and comment. Reply with the complete file in one ```yaml block and "
        "nothing else.",
        f"{_fenced(inspect.getsource(shutil.copyfileobj), 'python')}\n\nAdd type hints to the function's "
        "parameters and return value. Change nothing else. Reply with the complete function in one ```python block "
        "and nothing else.",
    ]
    return [tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"] for user in users]


@pytest.mark.slow
def test_smollm2_bf16_parts_from_plain_only_at_near_ties(smollm2):
    model, tokenizer = smollm2
    prompts = _benchmark_prompts(tokenizer)
    results = _check_near_ties(copy.deepcopy(model).to(torch.bfloat16), prompts, 48)  # the fixture is shared
    assert sum(r.accepted for r in results) > 40
    for i, ids in enumerate(prompts):  # fp32 on the same prompts: identical
        res = compare(model, ids, 48, _drafter(), deep=False)
        assert res.identical, f"prompt {i}: fp32 parts from plain after {res.matched} tokens"
