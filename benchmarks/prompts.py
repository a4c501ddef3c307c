"""The suites' prompts as the tools hand them to a model: which ones a run takes (:func:`pick_prompts`) and how
a user message becomes the model's input ids (:func:`encode`). ``workloads.py`` writes the prompts; the timed
tools here and the replays in ``research/`` take and encode them through this module, so every tool sees the same
token ids for the same prompt."""

from __future__ import annotations

import sys

from benchmarks.workloads import SUITES


def encode(tokenizer, user: str):
    """The input ids ``[1, n]`` (a torch tensor) of one user message: the model's chat template with the
    assistant's turn opened, or for a base model (no template) the plain text, the instruction last."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(user + "\n\n", return_tensors="pt")["input_ids"]


def pick_prompts(args) -> list:
    """The first ``args.per_suite`` prompts (all of them for 0 or None) of each of ``args.suites``, in that order.
    A suite whose data is not on this machine is skipped with a note on stderr."""
    prompts = []
    for suite in args.suites:
        items = SUITES[suite]()
        if not items:
            print(f"skipping suite {suite}: its data is not available (../shared/data)", file=sys.stderr)
            continue
        prompts += items[: args.per_suite] if args.per_suite else items
    return prompts
