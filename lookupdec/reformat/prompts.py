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

An edit of a small section (one entry or a few lines, :func:`build_focused_prompt`) is asked differently: asked as
above, the model copies a small section back, or loops. It gets worked examples of one-line edits (as earlier
turns of the chat), the editor system prompt, and the answer started with the line's key (``level:``); where it
still copies the old value, the new one is usually its second choice, which the editor reaches by asking for the
model's most likely answers that depart from the copy (``ModelEngine.departures``). docs/design.md, "How
``lookupdec reformat`` makes an edit", has the measurements.

Which of several equally named entries an instruction means is asked as a numbered choice
(:func:`build_judge`), answered with a number.
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


# Worked examples for small sections: (section, instruction, answer). Each shows one kind of edit the embedded
# model must make on a line it would otherwise copy: a value, a list item, a commented line, a boolean, a quoted
# string, an item taken out of a flow list, an item added after another.
FOCUSED_EXAMPLES = (
    ("host: 127.0.0.1\n", "Change the host to 0.0.0.0.", "host: 0.0.0.0\n"),
    ("- lint\n", "Replace lint with test in the steps.", "- test\n"),
    ("retries: 3  # per request\n", "Set retries to 5.", "retries: 5  # per request\n"),
    ("enabled: true\n", "Disable the cache.", "enabled: false\n"),
    ("version: \"1.2\"\n", "Bump the version to 1.3.", "version: \"1.3\"\n"),
    ("tags: [\"a\", \"b\", \"c\"]\n", "Remove b from the tags.", "tags: [\"a\", \"c\"]\n"),
    ("- id: black\n", "Add an isort hook after black.", "- id: black\n- id: isort\n"),
)
SYSTEM_FOCUSED = ("You edit YAML. You apply the instruction to the YAML and reply with the edited YAML in one fenced "
                  "block.")


@dataclass(frozen=True)
class Prompt:
    messages: tuple  # chat messages, ({"role": ..., "content": ...}, ...)
    prefill: str  # the start of the answer, written for the model


def build_prompt(section: str, instruction: str | None) -> Prompt:
    """The chat messages and answer prefill for one section (the module docstring says why they look so)."""
    fenced = f"```yaml\n{section.rstrip()}\n```\n\n"
    if instruction:
        return Prompt(({"role": "user", "content": fenced + EDIT.format(instruction=_sentence(instruction))},),
                      "```yaml\n")
    first_line = section.split("\n", 1)[0]
    return Prompt(({"role": "system", "content": SYSTEM_EDITOR}, {"role": "user", "content": fenced + REFORMAT}),
                  f"```yaml\n{first_line}")


def build_focused_prompt(section: str, instruction: str) -> Prompt:
    """The prompt for a small section the instruction is about: the worked examples as earlier turns, then the
    section and the instruction, the answer started with the section's key (``level:``, ``- id:``, ``-``)."""
    messages = [{"role": "system", "content": SYSTEM_FOCUSED}]
    for example, asked, answer in FOCUSED_EXAMPLES:
        messages += [{"role": "user", "content": f"```yaml\n{example}```\n\n{asked}"},
                     {"role": "assistant", "content": f"```yaml\n{answer}```"}]
    messages.append({"role": "user", "content": f"```yaml\n{section.rstrip()}\n```\n\n{_sentence(instruction)}"})
    return Prompt(tuple(messages), "```yaml\n" + lead(section))


_LEAD = re.compile(r"^(- )?(\"[^\"]*\"|'[^']*'|[^\s#'\"{\[\-?][^#]*?):(?=\s|$)|^-(?=\s)")


def lead(section: str) -> str:
    """The start of a small section's first line that an edit keeps: its key (``level:``, ``- id:``) or a list
    item's dash; empty when it has neither."""
    match = _LEAD.match(section)
    return match.group(0) if match else ""


def build_judge(instruction: str, candidates: list[str]) -> Prompt:
    """A numbered choice: which of ``candidates`` (one line each, ``server.port: 8080``) the instruction changes.
    The answer is started as ``Answer:`` and read with :func:`read_choice`."""
    listed = "".join(f"{i}. {c}\n" for i, c in enumerate(candidates, 1))
    question = (f"```yaml\n{listed}```\n\nInstruction: {_sentence(instruction)}\n"
                f"Which numbered setting does the instruction change? Reply with its number only.")
    return Prompt(({"role": "user", "content": question},), "Answer:")


def read_choice(answer: str, count: int) -> int | None:
    """The 0-based choice of a judge's answer (``Answer: 2`` -> 1), or None when it names no single candidate."""
    numbers = re.findall(r"\d+", answer[len("Answer:"):] if answer.startswith("Answer:") else answer)
    if not numbers or not 1 <= int(numbers[0]) <= count:
        return None
    return int(numbers[0]) - 1


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text[-1] in ".!?" else text + "."


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

