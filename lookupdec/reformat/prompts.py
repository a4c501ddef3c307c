"""Prompts: what the model is asked for one section, and how its answer is read.

The embedded SmolLM2-135M-Instruct copies short texts faithfully and long ones badly: a whole config comes back
with lines commented out, list items merged or endless repeats, while sections of up to ~80 tokens come back
intact. What it needs:

- the text first, in a ```yaml fence, then the instruction, asking for the complete result in one fenced block;
- the answer started for it (prefilled): ```yaml and, for a reformat, the section's first line, without its
  newline (the tokenizer merges a newline with the next line's indentation, so a prefill ending in a newline
  would strip that indentation). Without the first line it often answers ``# database:`` for ``database:``;
- for a reformat, a system prompt that says it is an editor replying with one fenced block; for an instruction,
  the model's own default system prompt (with the editor prompt it copies the file and ignores the edit);
- a stop at the closing fence, since it otherwise repeats the block until the token budget runs out (the engine's
  ``FenceStop``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SYSTEM_EDITOR = ("You are a careful editor of configuration files. You reply with the complete file in one fenced "
                 "code block and nothing else.")
REFORMAT = ("Rewrite this YAML with consistent two-space indentation, keeping every key, value and comment. "
            "Reply with the complete file in one ```yaml block and nothing else.")
EDIT = ("{instruction} Keep everything else, including comments, exactly as it is. Reply with the complete updated "
        "file in one ```yaml block and nothing else.")


@dataclass(frozen=True)
class Prompt:
    messages: tuple  # chat messages, ({"role": ..., "content": ...}, ...)
    prefill: str  # the start of the answer, written for the model


def build_prompt(section: str, instruction: str | None) -> Prompt:
    """The chat messages and answer prefill for one section (the module docstring says why they look so)."""
    fenced = f"```yaml\n{section.rstrip()}\n```\n\n"
    if instruction:
        text = instruction.strip()
        if text[-1] not in ".!?":
            text += "."
        return Prompt(({"role": "user", "content": fenced + EDIT.format(instruction=text)},), "```yaml\n")
    first_line = section.split("\n", 1)[0]
    return Prompt(({"role": "system", "content": SYSTEM_EDITOR}, {"role": "user", "content": fenced + REFORMAT}),
                  f"```yaml\n{first_line}")


_FENCE = re.compile(r"^```[^\n`]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_OPEN_FENCE = re.compile(r"^```[^\n`]*\n", re.MULTILINE)


def extract_block(answer: str) -> tuple:
    """``(text, closed)``: the first fenced block of ``answer``, or the whole answer when it has no fence.
    ``closed`` is False when a fence was opened and never closed (the answer was cut off)."""
    match = _FENCE.search(answer)
    if match:
        return match.group(1), True
    opened = _OPEN_FENCE.search(answer)
    if opened:
        return answer[opened.end():], False
    return answer, True

