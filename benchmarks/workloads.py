"""Benchmark suites: named lists of chat prompts, built from data nobody on this project wrote where possible.

Suites
- ``yaml``: edits of the config files shipped in ``examples/configs`` (change a value, add a key, reformat).
- ``code``: edits of Python standard-library functions read with ``inspect.getsource`` (rename a variable, add
  type hints, remove the docstring, add a docstring).
- ``summary``: CNN/DailyMail articles from ``../shared/data/pld_cnn_dm.json`` (the original prompt-lookup study).
- ``qa``: HAGRID context-QA prompts from ``../shared/data/pld_hagrid.json``.
- ``open``: open-ended writing, where copying does not help (the control).

Every prompt puts the text before the instruction and asks for the whole result in one fenced block: the
embedded model copies far more faithfully that way (vLLM PR #18971 saw the same on InstructCoder).

To add a suite: write a function returning ``[Prompt, ...]`` and register it in ``SUITES``.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"


@dataclass(frozen=True)
class Prompt:
    suite: str
    name: str
    user: str  # the user message; the runner applies the model's chat template


def _fenced(text: str, lang: str) -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


YAML_EDITS = {
    "service.yaml": ["Change the server port to 9090.", "Set the logging level to debug and add the feature 'metrics'."],
    "dependabot.yml": ["Change the pip schedule interval to daily."],
    "codecov.yml": ["Change the patch target to 90%."],
    "readthedocs.yaml": ["Set fail_on_warning to false."],
}


def yaml_suite() -> list:
    out = []
    for name, edits in YAML_EDITS.items():
        text = (ROOT / "examples" / "configs" / name).read_text()
        for i, edit in enumerate(edits):
            user = (f"{_fenced(text, 'yaml')}\n\n{edit} Keep everything else, including comments, exactly as it is. "
                    "Reply with the complete updated file in one ```yaml block and nothing else.")
            out.append(Prompt("yaml", f"{name}#{i}", user))
    text = (ROOT / "examples" / "configs" / "codecov.yml").read_text()
    out.append(Prompt("yaml", "codecov.yml#reformat", f"{_fenced(text, 'yaml')}\n\nRewrite this YAML with consistent "
                      "two-space indentation, keeping every key, value and comment. Reply with the complete file in "
                      "one ```yaml block and nothing else."))
    return out


def _stdlib_functions():
    # Pure-Python functions whose source ships with CPython (os and posixpath are frozen: no source).
    import difflib
    import fnmatch
    import shutil
    import textwrap

    return [("textwrap.indent", textwrap.indent), ("shutil.copyfileobj", shutil.copyfileobj),
            ("fnmatch.filter", fnmatch.filter), ("difflib.get_close_matches", difflib.get_close_matches)]


CODE_EDITS = [
    ("rename", "Rename the local variable `{var}` to `{var}_value` everywhere in the function."),
    ("hints", "Add type hints to the function's parameters and return value."),
    ("nodoc", "Remove the docstring."),
    ("doc", "Add a one-line docstring if there is none, otherwise shorten the docstring to one line."),
]


def code_suite() -> list:
    out = []
    for i, (name, fn) in enumerate(_stdlib_functions()):
        source = inspect.getsource(fn)
        local = _a_local_name(source) or "result"
        for kind, edit in (CODE_EDITS[i % 4], CODE_EDITS[(i + 1) % 4]):
            user = (f"{_fenced(source, 'python')}\n\n{edit.format(var=local)} Change nothing else. Reply with the "
                    "complete function in one ```python block and nothing else.")
            out.append(Prompt("code", f"{name}#{kind}", user))
    return out


def _a_local_name(source: str):
    names = re.findall(r"^\s+([a-z_][a-z0-9_]*) = ", source, flags=re.MULTILINE)
    return names[0] if names else None


def _pld_suite(file: str, suite: str, tag: str, to_user) -> list:
    """Prompts of the prompt-lookup study's data file, their Mistral [INST] wrapper stripped and rewritten by
    ``to_user(body)``; empty when ../shared/data is absent."""
    path = SHARED_DATA / file
    if not path.exists():
        return []
    rows = json.loads(path.read_text())
    bodies = (row["prompt"].replace("[INST]", "").replace("[/INST]", "").strip() for row in rows)
    return [Prompt(suite, f"{tag}#{i}", to_user(body)) for i, body in enumerate(bodies)]


MAX_CHARS = 2500  # the embedded model copies short texts far better than long ones


def _summary_user(body: str) -> str:
    article = body.split("Article:", 1)[-1].rsplit("Summary:", 1)[0].strip()[:MAX_CHARS]
    return f"Article: {article}\n\nSummarize the article above in a few sentences, reusing its wording."


def _qa_user(body: str) -> str:
    context, _, rest = body.partition("Question:")
    question = rest.split("Answer:", 1)[0].strip()
    context = context.replace("Context:", "", 1).strip()[:MAX_CHARS]
    return f"Context: {context}\n\nQuestion: {question}\nAnswer from the context, quoting it where you can."


def summary_suite() -> list:
    return _pld_suite("pld_cnn_dm.json", "summary", "cnn_dm", _summary_user)


def qa_suite() -> list:
    return _pld_suite("pld_hagrid.json", "qa", "hagrid", _qa_user)


OPEN_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a ten-year-old why the sky is blue.",
    "Write a poem about autumn in a small town.",
    "Describe your ideal weekend in a few paragraphs.",
]


def open_suite() -> list:
    return [Prompt("open", f"open#{i}", text) for i, text in enumerate(OPEN_PROMPTS)]


SUITES = {"yaml": yaml_suite, "code": code_suite, "summary": summary_suite, "qa": qa_suite, "open": open_suite}
COPY_HEAVY = ("yaml", "code")
