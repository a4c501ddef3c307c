"""How few calibration measurements are enough: time ``lookupdec.calibrate``'s measurement as a first call runs it,
then price lookupdec's drafts with each profile it measured while charging a dense, many-round curve of the same
model, and report the speed lost against pricing with the dense curve itself (docs/design.md, "Calibration").

    python -m research.calibration_study --greedy /tmp/sim_ref/greedy_smollm2_256.json

``--greedy`` is the greedy-output cache a plain ``python -m research.simulate --out DIR`` run writes (about 9
minutes). Takes 2-3 minutes: the dense curve is every draft length 0..64 in five rounds on a 256-token context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from benchmarks.run import encode, pick_prompts
from benchmarks.workloads import SUITES
from lookupdec.calibration import measure_pass_costs
from lookupdec.drafter import Drafter, DrafterConfig
from lookupdec.models import load_model
from research.simulate import MeasuredCost, replay


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--greedy", type=Path, required=True, help="research.simulate's greedy-output cache (JSON)")
    ap.add_argument("--repeats", type=int, default=3, help="profiles measured the default way")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dense", type=Path, help="read the dense curve from this JSON list if it exists, else measure "
                    "it and write it there")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    longest = DrafterConfig().max_draft
    eos = model.generation_config.eos_token_id
    eos = int(eos if isinstance(eos, int) else eos[0])

    candidates = {}
    for i in range(args.repeats):
        started = time.perf_counter()
        candidates[f"default #{i + 1}"] = measure_pass_costs(model, longest)
        print(f"default #{i + 1}: measured in {time.perf_counter() - started:.2f} s")
    if args.dense is not None and args.dense.exists():
        dense = np.asarray(json.loads(args.dense.read_text()))
    else:
        started = time.perf_counter()
        dense = measure_pass_costs(model, longest, lengths=range(longest + 1), rounds=5, budget_s=0, context=256)
        print(f"dense reference: {time.perf_counter() - started:.1f} s")
        if args.dense is not None:
            args.dense.write_text(json.dumps(dense.tolist()))
    for name, profile in candidates.items():
        print(f"{name:12s}", np.round(profile[[1, 2, 3, 4, 6, 8, 16, 32, longest]], 2).tolist())
    print(f"{'dense':12s}", np.round(dense[[1, 2, 3, 4, 6, 8, 16, 32, longest]], 2).tolist())

    cached = json.loads(args.greedy.read_text())
    charge = MeasuredCost(dense, source="dense reference")
    prompts = pick_prompts(SimpleNamespace(suites=list(SUITES), per_suite=0))
    ratios = {name: {} for name in candidates}
    for p in prompts:
        key = f"{p.suite}/{p.name}"
        if key not in cached:
            continue
        prompt, answer = encode(tokenizer, p.user)[0].tolist(), cached[key]
        times = {}
        for name, profile in [("dense", dense), *candidates.items()]:
            drafter = Drafter()
            drafter.cost.use_profile(profile)
            times[name] = replay(drafter, prompt, answer, charge, eos)["time"]
        for name in candidates:
            ratios[name].setdefault(p.suite, []).append(times["dense"] / times[name])
    print("\nspeed priced with each profile / priced with the dense curve (suite medians; both charged the dense)")
    suites = list(next(iter(ratios.values())))
    print(f"{'':12s} " + " ".join(f"{s:>8s}" for s in suites))
    for name, by_suite in ratios.items():
        print(f"{name:12s} " + " ".join(f"{statistics.median(by_suite[s]):8.3f}" for s in suites))


if __name__ == "__main__":
    main()
