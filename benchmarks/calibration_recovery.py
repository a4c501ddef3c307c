"""Does a wrong pass-cost profile heal? (issue 25)

Runs the same copy-heavy edit several times in a row, each time with a fresh drafter given one pass-cost profile
(the quietly measured one; the same priced 6x too dear at every drafted length; optionally one measured while two
CPU hogs ran), with the profile's refinement from the passes on and off, and prints tokens per pass and time per
request. No rolling cache (each request drafts from its own prompt only), so what changes from one request to the
next is the cost model alone.

    python -m benchmarks.calibration_recovery                 # ~3 min on 2 idle cores
    python -m benchmarks.calibration_recovery --hog 6         # also a profile measured beside six busy processes
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import numpy as np
import torch

from lookupdec import LookupDrafter, generate, load_model
from lookupdec import calibration as cal

from .run import encode
from .workloads import yaml_suite


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def hog_profile(model, max_draft: int, hogs: int = 2) -> np.ndarray:
    """A profile measured while ``hogs`` processes keep the cores busy (as on a shared machine)."""
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(hogs)]
    for hog in hogs:
        hog.start()
    time.sleep(0.5)
    try:
        return cal.measure_pass_costs(model, max_draft)
    finally:
        stop.set()
        for hog in hogs:
            hog.join()


def run(model, ids: torch.Tensor, profile: np.ndarray, refine: bool, requests: int, max_new_tokens: int) -> list:
    drafter = LookupDrafter(use_cache=False)
    drafter.cost.use_profile(profile, source=model, refine=refine)
    rows = []
    for _ in range(requests):
        started = time.perf_counter()
        out = generate(model, ids, max_new_tokens=max_new_tokens, drafter=drafter)
        rows.append((out.stats.tokens_per_pass, time.perf_counter() - started, out.sequences[0, ids.shape[1]:]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt", default="service.yaml#1", help="a yaml suite prompt (benchmarks/workloads.py)")
    ap.add_argument("--hog", type=int, nargs="?", const=2, default=0, metavar="N",
                    help="also a profile measured beside N busy processes (default N: 2)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(device="cpu")
    prompt = next(p for p in yaml_suite() if p.name == args.prompt)
    ids = encode(tokenizer, prompt.user)
    max_draft = LookupDrafter().drafter_config.max_draft
    quiet = cal.pass_costs(model, max_draft)
    dear = quiet.copy()
    dear[1:] *= 6
    profiles = {"quiet": quiet, "6x too dear": dear}
    if args.hog:
        profiles[f"measured beside {args.hog} busy processes"] = hog_profile(model, max_draft, args.hog)
    for name, profile in profiles.items():
        print(f"{name}: {np.round(profile[:9], 2).tolist()} ...", flush=True)
    print(f"\n{args.prompt}, {args.max_new_tokens} tokens, {args.requests} requests in a row, one thread\n")
    print("| profile | refined | " + " | ".join(f"request {i + 1} tok/pass, s" for i in range(args.requests)) + " |")
    print("|---|---|" + "---|" * args.requests)
    reference = None
    with torch.inference_mode():
        generate(model, ids, max_new_tokens=8)  # warm-up
        for name, profile in profiles.items():
            for refine in (False, True):
                rows = run(model, ids, profile, refine, args.requests, args.max_new_tokens)
                reference = rows[0][2] if reference is None else reference
                assert all(torch.equal(r[2], reference) for r in rows), "outputs differ"
                cells = " | ".join(f"{tpp:.2f}, {s:.2f}" for tpp, s, _ in rows)
                print(f"| {name} | {'yes' if refine else 'no'} | {cells} |", flush=True)
    print("\nevery output identical")


if __name__ == "__main__":
    main()
