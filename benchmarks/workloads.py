"""Benchmark suites: named lists of chat prompts, built from data nobody on this project wrote where possible.

Suites (at least 20 prompts each where the data is present; counts as of Python 3.11 with the test extras installed)
- ``yaml`` (27): edits of the config files shipped in ``examples/configs`` (change a value, add a key, reformat),
  then one edit of each real config in ``benchmarks/edits/configs`` (public projects' files; the instruction is the
  case ``cases.yaml`` marks ``quick``). Files over ``MAX_CHARS`` are skipped, not cut (a cut file is no longer the
  file the instruction is about): today that is ``starlette-mkdocs.yml`` (2,748 characters).
- ``code`` (28): edits of pure-Python standard-library functions read with ``inspect.getsource`` (rename a local
  variable, add type hints, remove the docstring, add or shorten a docstring), two edits per function. The text is
  the running interpreter's source, so it differs a little between Python versions.
- ``summary`` (100): CNN/DailyMail articles from ``../shared/data/pld_cnn_dm.json`` (the original prompt-lookup
  study).
- ``qa`` (100): HAGRID context-QA prompts from ``../shared/data/pld_hagrid.json``.
- ``open`` (24): open-ended writing (stories, explanations, letters, lists of ideas, poems), where copying from the
  prompt does not help (the control).
- ``docqa`` (29): questions on documentation found on this machine, answered mostly in new words: the licence
  files of installed distributions (``*.dist-info``; which licence, who holds the copyright, the conditions, a
  summary) and standard-library module docstrings and sources (a summary, which module, a list pulled from the
  text or the code). Its distributions are dependencies of lookupdec or of its ``test`` extra; one that is not
  installed, or ships no licence file, drops its prompts (the suite shrinks, it never fails). The texts are the
  installed versions', so they change when a package is upgraded.

Every prompt puts the text before the instruction; the edits ask for the whole result in one fenced block: the
embedded model copies far more faithfully that way (vLLM PR #18971 saw the same on InstructCoder).

Prompt names are stable and unique within a suite: a file and its edit, a function and the edit kind, a data row,
a source and the question; ``open#i`` is a position in ``OPEN_PROMPTS``, which is only appended to. New prompts go
after the existing ones, so ``--per-suite N`` keeps picking the prompts that published results were measured on.

To add a suite: write a function returning ``[Prompt, ...]`` and register it in ``SUITES``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
EDITS = Path(__file__).resolve().parent / "edits"  # real configs and their edit cases (benchmarks/edit_eval.py)
MAX_CHARS = 2500  # the embedded model copies short texts far better than long ones


@dataclass(frozen=True)
class Prompt:
    suite: str
    name: str
    user: str  # the user message; the runner applies the model's chat template


def _fenced(text: str, lang: str) -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


YAML_EDITS = {
    "service.yaml": ["Change the server port to 9090.",
                     "Set the logging level to debug and add the feature 'metrics'."],
    "dependabot.yml": ["Change the pip schedule interval to daily."],
    "codecov.yml": ["Change the patch target to 90%."],
    "readthedocs.yaml": ["Set fail_on_warning to false."],
}


def yaml_suite() -> list:
    out = []
    for name, edits in YAML_EDITS.items():
        text = (ROOT / "examples" / "configs" / name).read_text()
        for i, edit in enumerate(edits):
            out.append(Prompt("yaml", f"{name}#{i}", _yaml_user(text, edit)))
    text = (ROOT / "examples" / "configs" / "codecov.yml").read_text()
    out.append(Prompt("yaml", "codecov.yml#reformat", f"{_fenced(text, 'yaml')}\n\nRewrite this YAML with consistent "
                      "two-space indentation, keeping every key, value and comment. Reply with the complete file in "
                      "one ```yaml block and nothing else."))
    for case in yaml.safe_load((EDITS / "cases.yaml").read_text())["cases"]:
        if not case.get("quick"):  # one case per file: the one edit_eval's --quick runs
            continue
        text = (EDITS / "configs" / case["file"]).read_text()
        if len(text) > MAX_CHARS:
            continue
        out.append(Prompt("yaml", f"{case['file']}#{case['id']}", _yaml_user(text, case["instruction"])))
    return out


def _yaml_user(text: str, edit: str) -> str:
    return (f"{_fenced(text, 'yaml')}\n\n{edit} Keep everything else, including comments, exactly as it is. "
            "Reply with the complete updated file in one ```yaml block and nothing else.")


# Pure-Python functions whose source ships with CPython 3.10-3.13 (os and posixpath are frozen: no source), 10-40
# lines each from the fifth on. Function i gets the edits CODE_EDITS[i % 4] and CODE_EDITS[(i + 1) % 4], so each is
# picked to suit its two: a local variable to rename, a docstring to remove. Append only: the order fixes the edits.
STDLIB_FUNCTIONS = [
    "textwrap.indent", "shutil.copyfileobj", "fnmatch.filter", "difflib.get_close_matches",
    "statistics.mode", "glob.escape", "statistics.median", "colorsys.rgb_to_hsv", "inspect.cleandoc",
    "urllib.parse.unquote", "zipfile.is_zipfile", "linecache.getlines", "copy.copy", "textwrap.shorten",
]


def _stdlib_functions():
    out = []
    for name in STDLIB_FUNCTIONS:
        module, _, attr = name.rpartition(".")
        out.append((name, getattr(importlib.import_module(module), attr)))
    return out


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
        local = _a_local_name(source, inspect.signature(fn).parameters) or "result"
        for kind, edit in (CODE_EDITS[i % 4], CODE_EDITS[(i + 1) % 4]):
            user = (f"{_fenced(source, 'python')}\n\n{edit.format(var=local)} Change nothing else. Reply with the "
                    "complete function in one ```python block and nothing else.")
            out.append(Prompt("code", f"{name}#{kind}", user))
    return out


def _a_local_name(source: str, parameters):
    """The first name assigned in `source` that is not a parameter; None if there is none. textwrap.indent assigns
    none before Python 3.13, and its prompt then asks to rename `result`: kept so that its published prompt holds."""
    names = [n for n in re.findall(r"^\s+([a-z_][a-z0-9_]*) = ", source, flags=re.MULTILINE) if n not in parameters]
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


# Append only: a prompt's name is its position.
OPEN_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a ten-year-old why the sky is blue.",
    "Write a poem about autumn in a small town.",
    "Describe your ideal weekend in a few paragraphs.",
    "Write a letter to a friend who has just moved to another country, telling them about your week.",
    "Give me ten ideas for a rainy-day activity with young children, one line each.",
    "Write a sequence of five haiku about the sea.",
    "Explain in plain language how a bicycle stays upright while it is moving.",
    "Write a short story about a robot who learns to bake bread.",
    "Write a cover letter for a job as an assistant in a small public library.",
    "Suggest twelve names for a friendly neighbourhood bakery, with a one-line reason for each.",
    "Explain the difference between weather and climate to a high-school student.",
    "Write a limerick about a cat who refuses to get out of bed.",
    "Write a thank-you note to a teacher who helped you learn to read.",
    "List eight themes for a community garden party, with one sentence about each.",
    "Write a fable about a tortoise and a crow that teaches patience.",
    "Explain how vaccines train the immune system, in three short paragraphs.",
    "Write a sonnet about a city at night.",
    "Write a short story set on a night train crossing the mountains.",
    "Write a letter to your future self, to be opened in ten years.",
    "Give me fifteen questions to ask at the first meeting of a book club.",
    "Explain why we have leap years, as you would to a curious eight-year-old.",
    "Write a poem in free verse about learning to swim.",
    "Describe a market in a town that exists only in your imagination: its smells, its sounds and its people.",
]


def open_suite() -> list:
    return [Prompt("open", f"open#{i}", text) for i, text in enumerate(OPEN_PROMPTS)]


LICENCE_NAME = "Which licence is this? Answer with its name only."
# (distribution, question tag, question): licence files of lookupdec's dependencies and of its test extra.
DOCQA_LICENCES = [
    ("pyyaml", "name", LICENCE_NAME),
    ("click", "name", LICENCE_NAME),
    ("pytest", "name", LICENCE_NAME),
    ("uvicorn", "name", LICENCE_NAME),
    ("numba", "name", LICENCE_NAME),
    ("pygtrie", "name", LICENCE_NAME),
    ("gguf", "name", LICENCE_NAME),
    ("tqdm", "names", "Which licences does this text name? Answer with their names only."),
    ("click", "conditions", "List the conditions this licence sets for redistribution, one per line."),
    ("nbformat", "conditions", "List the conditions this licence sets for redistribution, one per line."),
    ("numba", "conditions", "List the conditions this licence sets for redistribution, one per line."),
    ("httpx", "holder", "Who holds the copyright? Answer with the name only."),
    ("pyyaml", "holder", "Who holds the copyright? Answer with the names only."),
    ("pytest", "summary", "Summarize what this licence allows and requires in 2-3 sentences."),
    ("hypothesis", "summary", "Summarize the text above in 2-3 sentences."),
    ("torch", "summary", "Summarize the text above in 2-3 sentences."),
]
# (standard-library module, question tag, question) over the module's docstring.
DOCQA_DOCSTRINGS = [
    ("json", "summary", "Summarize this documentation in 2-3 sentences."),
    ("copy", "summary", "Summarize this documentation in 2-3 sentences."),
    ("sched", "summary", "Summarize this documentation in 2-3 sentences."),
    ("uuid", "summary", "Summarize this documentation in 2-3 sentences."),
    ("pickle", "functions", "List the functions this documentation names, one per line."),
    ("string", "constants", "List the constants this documentation describes, one per line, names only."),
    ("re", "specials", "List the special characters this documentation describes, one per line, no explanations."),
    ("heapq", "module", "Which Python module does this documentation describe? Answer with the module name only."),
    ("csv", "module", "Which Python module does this documentation describe? Answer with the module name only."),
]
# Standard-library modules whose source (its head, up to MAX_CHARS) is asked for the functions it defines.
DOCQA_SOURCES = ["secrets", "bisect", "colorsys", "fnmatch"]
SOURCE_FUNCTIONS = "List the public functions defined in the code above, one per line, names only."


def docqa_suite() -> list:
    """Questions whose answers are mostly new words, on texts installed on this machine; a source that is missing
    drops its prompts."""
    out = []
    for dist, tag, question in DOCQA_LICENCES:
        text = _licence_text(dist)
        if text is not None:
            out.append(Prompt("docqa", f"licence:{dist}#{tag}", f"{_head(text)}\n\n{question}"))
    for module, tag, question in DOCQA_DOCSTRINGS:
        doc = _module_doc(module)
        if doc is not None:
            out.append(Prompt("docqa", f"doc:{module}#{tag}", f"{_head(doc)}\n\n{question}"))
    for module in DOCQA_SOURCES:
        source = _module_source(module)
        if source is not None:
            out.append(Prompt("docqa", f"source:{module}#functions",
                              f"{_fenced(_head(source), 'python')}\n\n{SOURCE_FUNCTIONS}"))
    return out


_LICENCE_FILE = re.compile(r"\.dist-info/(licenses/)?(LICEN[CS]E|COPYING)[^/]*$")


def _licence_text(dist: str):
    """The text of `dist`'s licence file (the first by path where it ships several); None when the distribution is
    not installed, lists no files, ships no licence file, or it cannot be read."""
    try:
        files = metadata.distribution(dist).files
    except metadata.PackageNotFoundError:
        return None
    for file in sorted((f for f in files or () if _LICENCE_FILE.search(f.as_posix())), key=lambda f: f.as_posix()):
        try:
            text = file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text:
            return text
    return None


def _module_doc(name: str):
    try:
        doc = importlib.import_module(name).__doc__
    except ImportError:
        return None
    return inspect.cleandoc(doc) if doc and doc.strip() else None


def _module_source(name: str):
    try:
        return inspect.getsource(importlib.import_module(name))
    except (ImportError, OSError, TypeError):
        return None


def _head(text: str, limit: int = MAX_CHARS) -> str:
    """`text` up to `limit` characters, cut at the last paragraph break that keeps at least half of them, else after
    the last whole line that fits."""
    text = text.strip()
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    if cut < limit // 2:
        cut = text.rfind("\n", 0, limit)
    return text[: cut if cut > 0 else limit].rstrip()


SUITES = {"yaml": yaml_suite, "code": code_suite, "summary": summary_suite, "qa": qa_suite, "open": open_suite,
          "docqa": docqa_suite}
COPY_HEAVY = ("yaml", "code")
