"""The ``lookupdec`` command. ``lookupdec reformat FILE`` rewrites or edits a YAML config with a local model.

The command layer is thin: ``reformat`` reads and checks the file, splits it into sections, asks the model for each
section, validates every answer, and writes only a result that validated. The decisions live in small pure
functions below (reading, splitting, prompts, extracting the fenced block, validation, atomic writes), each tested
without a model; the model sits behind :class:`ModelEngine`, which tests replace with a stub where the model does
not matter.

Prompt design. The embedded SmolLM2-135M-Instruct copies short texts faithfully and long ones badly: a whole
config comes back with lines commented out, list items merged or endless repeats, while sections of up to ~80
tokens come back intact. What it needs:

- the text first, in a ```yaml fence, then the instruction, asking for the complete result in one fenced block;
- the answer started for it (prefilled): ```yaml and, for a reformat, the section's first line, without its
  newline (the tokenizer merges a newline with the next line's indentation, so a prefill ending in a newline
  would strip that indentation). Without the first line it often answers ``# database:`` for ``database:``;
- for a reformat, a system prompt that says it is an editor replying with one fenced block; for an instruction,
  the model's own default system prompt (with the editor prompt it copies the file and ignores the edit);
- a stop at the closing fence, since it otherwise repeats the block until the token budget runs out.

Sections. A reformat works on small sections: each top-level block alone (runs of one-line ``key: value``
blocks together, since a lone short line invites the model to invent more), cut further into a block's children
while larger than ``REFORMAT_SECTION_TOKENS``; a section whose answer is rejected is cut one level finer and
tried again. An instruction sees the whole file, and sections only when the file is longer than the model's
context or the ``--max-new-tokens`` budget, because an instruction sent to a section it is not about tends to
get applied there anyway. Documents (``---``) are always separate sections.

Validation. A reformatted section must load to the same data and keep the same comments (none dropped, none
invented); an edited one must parse. The joined file is checked again before anything is written.

JSON. ``--to json`` serializes the validated YAML result with ``json.dumps``: asked to write JSON itself, the
embedded model got 2 of 14 real config sections right (it invents keys and nests values), and a plain
conversion needs no model at all.

Exit codes: 0 success; 1 the model's output was rejected (nothing written; with several files, nothing for the
rejected ones); 2 usage or input error, including a model that cannot be loaded (nothing written); 130
interrupted (nothing written).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import yaml

from . import __version__

EXIT_OK = 0
EXIT_REJECTED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

MAX_FILE_BYTES = 1 << 20  # 1 MiB of YAML is hours of generation on a CPU; refuse before loading the model
REFORMAT_SECTION_TOKENS = 80  # the embedded model copies sections up to about this size faithfully
BUDGET_MARGIN = 16  # --max-new-tokens N: a section may hold N - 16 tokens (the fences and some slack)
PROMPT_OVERHEAD = 160  # system prompt, chat template and instruction around a section, in tokens
DEFAULT_BATCH = 4  # sections per batch: on a 2-core CPU lookup still pays at 4 rows (benchmarks/run.py --batch)

EXIT_CODES_HELP = """\b
Exit codes:
  0    success
  1    the model's output was rejected (it did not validate); nothing was written
       (with several files: nothing for the rejected ones)
  2    usage or input error (bad option, unreadable/invalid/empty/too large file,
       model that cannot be loaded); nothing was written
  130  interrupted (Ctrl-C); nothing was written
"""


class InputError(Exception):
    """A one-line reason the command cannot run on this input; exit code 2."""

# --------------------------------------------------------------------------------------------------------------
# Reading and parsing the input


def read_input(path: Path) -> str:
    """The file's text, or InputError saying why it cannot be edited (missing, a directory, unreadable, too large,
    binary, not UTF-8, empty)."""
    shown = click.format_filename(str(path))
    if path.is_dir():
        raise InputError(f"{shown}: is a directory, not a file")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise InputError(f"{shown}: file too large ({size:,} bytes; the limit is {MAX_FILE_BYTES:,})")
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{shown}: no such file") from None
    except PermissionError:
        raise InputError(f"{shown}: cannot read it (permission denied)") from None
    except OSError as err:
        raise InputError(f"{shown}: cannot read it ({err.strerror or err})") from None
    if b"\x00" in data:
        raise InputError(f"{shown}: looks like a binary file (it contains NUL bytes), not YAML")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise InputError(f"{shown}: not UTF-8 text (byte 0x{data[err.start]:02x} at line {line})") from None
    if not text.strip():
        raise InputError(f"{shown}: the file is empty")
    return text.removeprefix("\ufeff").replace("\r\n", "\n")  # the result is written as UTF-8 with \n


def yaml_error(err: yaml.YAMLError) -> str:
    """A parser error on one line, with 1-based line and column: ``line 3, column 7: mapping values are not
    allowed here``."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def load_yaml_documents(text: str) -> list:
    """Every document of ``text``; raises yaml.YAMLError."""
    return list(yaml.safe_load_all(text))


# --------------------------------------------------------------------------------------------------------------
# Sections


@dataclass(frozen=True)
class Section:
    text: str  # the section at column 0, ending in a newline; what the model sees when `edit` is set
    indent: str  # put back in front of every non-blank line of the result
    line: int  # 1-based line of the file where the section starts, for messages
    edit: bool  # False: copied through as is (blank lines, '---', the key line above a split block)

    @property
    def last_line(self) -> int:
        return self.line + self.text.count("\n") - 1

    @property
    def lines(self) -> str:
        """``line 4`` or ``lines 4-9``, for messages."""
        return f"line {self.line}" if self.line == self.last_line else f"lines {self.line}-{self.last_line}"

    def place(self, text: str) -> str:
        """``text`` (the section's result, at column 0) indented back to where the section sits."""
        if not self.indent:
            return text
        return "".join(self.indent + ln if ln.strip() else ln for ln in text.splitlines(keepends=True))


_DOC_MARKER = re.compile(r"^(---|\.\.\.)[ \t]*(#.*)?$")
_KEY_HEADER = re.compile(r"^[A-Za-z0-9_\"'][^#&*!|>{}\[\]]*:[ \t]*(#.*)?$")  # `key:` with children; no anchor/tag


def split_sections(text: str, too_big: Callable[[str], bool],
                   joinable: Callable[[str], bool] | None = None) -> list[Section]:
    """Cut ``text`` into sections that can be edited independently and joined back in order.

    Documents are split at ``---`` / ``...`` lines (kept as they are). A document that is not ``joinable``
    (default: that is ``too_big``) is cut into top-level blocks: a key line, or a top-level list item, with
    everything indented under it; comment lines go with the block that follows them, blank lines between blocks
    are kept as they are. Adjacent blocks are joined again while the join is ``joinable``. A block that is
    ``too_big`` and whose first line is a plain ``key:`` is cut the same way into its children, which are
    edited at column 0 and indented back.

    Every cut is checked: each part must load on its own, and the parts together must load to the document's
    data; otherwise that document (or block) stays whole. Joining the sections' texts, each placed at its
    indent, gives back ``text`` (with a final newline).
    """
    if not text.endswith("\n"):
        text += "\n"
    lines = text.splitlines(keepends=True)
    if any(ln.startswith(("%", "--- ", "---\t")) and not _DOC_MARKER.match(ln.rstrip("\n")) for ln in lines):
        return _whole(lines, 1, "")  # directives or content on a '---' line: not worth a special case
    if joinable is None:
        joinable = lambda t: not too_big(t)
    out: list[Section] = []
    doc: list[str] = []
    doc_start = 1
    for no, ln in enumerate(lines, 1):
        if _DOC_MARKER.match(ln.rstrip("\n")):
            out += _split_document(doc, doc_start, "", too_big, joinable)
            out.append(Section(ln, "", no, edit=False))
            doc, doc_start = [], no + 1
        else:
            doc.append(ln)
    out += _split_document(doc, doc_start, "", too_big, joinable)
    return out


def _whole(lines: Sequence[str], first: int, indent: str) -> list[Section]:
    """``lines`` as one editable section, with leading and trailing blank lines kept apart as they are."""
    start, end = 0, len(lines)
    while start < end and not lines[start].strip():
        start += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    out = []
    if start:
        out.append(Section("".join(lines[:start]), indent, first, edit=False))
    if end > start:
        body = "".join(lines[start:end])
        out.append(Section(body, indent, first + start, edit=_has_content(body)))
    if end < len(lines):
        out.append(Section("".join(lines[end:]), indent, first + end, edit=False))
    return out


def flat(text: str) -> bool:
    """Whether every line of ``text`` is a comment or a one-line ``key: value`` at column 0.

    A reformat joins such lines into one section and keeps every other top-level block apart: the model copies a
    block alone better than several joined, but left with a single short line it tends to invent more.
    """
    for ln in text.splitlines():
        if not ln.strip() or ln.lstrip().startswith("#"):
            continue
        if ln[0] in " \t-" or re.match(r"^[^#]*:[ \t]*(#.*)?$", ln) or ":" not in ln:
            return False
    return True


def _has_content(text: str) -> bool:
    return any(ln.strip() and not ln.lstrip().startswith("#") for ln in text.splitlines())


def _blocks(lines: Sequence[str]) -> list[tuple]:
    """Top-level pieces of a document as ``(start index, lines, is_block)``: blocks, and runs of blank lines
    between them. Comments directly above a block belong to it; those after the last block stand alone."""
    first = next((ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")), None)
    if first is None:
        return [(0, list(lines), False)]
    sequence = first.startswith("-")  # a top-level list: every `- ` line at column 0 starts an item

    def starts_block(ln: str) -> bool:
        if not ln.strip() or ln[0] in " \t#":
            return False
        return ln.startswith("-") if sequence else not ln.startswith("-")  # `key:` then `- item` at column 0

    pieces: list[tuple] = []
    cur: list[str] = []
    cur_start = 0
    pending: list[str] = []  # blank and comment lines not yet known to belong inside or above a block
    for i, ln in enumerate(lines):
        if not ln.strip() or ln.lstrip().startswith("#"):
            pending.append(ln)
            continue
        if starts_block(ln) or not cur:
            if cur:
                pieces.append((cur_start, cur, True))
            blank = 0
            while blank < len(pending) and not pending[blank].strip():
                blank += 1
            if blank:
                pieces.append((i - len(pending), pending[:blank], False))
            cur, cur_start = pending[blank:] + [ln], i - len(pending) + blank
        else:
            cur += pending + [ln]
        pending = []
    if cur:
        pieces.append((cur_start, cur, True))
    if pending:
        pieces.append((len(lines) - len(pending), pending, False))
    return pieces


def _split_document(lines: Sequence[str], first: int, indent: str, too_big: Callable[[str], bool],
                    joinable: Callable[[str], bool]) -> list[Section]:
    text = "".join(lines)
    if not text.strip():
        return [Section(text, indent, first, edit=False)] if text else []
    if joinable(text.strip("\n") + "\n"):
        return _whole(lines, first, indent)
    pieces = _blocks(lines)
    blocks = ["".join(ls) for _, ls, is_block in pieces if is_block]
    if not blocks or len(blocks) > 1 and not _parts_load_to(text, blocks):
        return _whole(lines, first, indent)
    out: list[Section] = []
    group: list[str] = []  # texts of adjacent blocks (and the blank lines between them) edited together
    group_start = 0
    between: list[tuple] = []  # (start, text) of blank runs after the group, joined with it or kept apart

    def flush():
        nonlocal group
        if group:
            out.append(Section("".join(group), indent, first + group_start, edit=True))
        group = []

    for start, ls, is_block in pieces:
        piece = "".join(ls)
        if not is_block:
            if group:
                between.append((start, piece))
            else:
                out.append(Section(piece, indent, first + start, edit=False))
            continue
        if too_big(piece):
            flush()
            out += [Section(p, indent, first + s, edit=False) for s, p in between]
            between = []
            out += _split_block(ls, first + start, indent, too_big, joinable)
            continue
        joined = "".join(group + [p for _, p in between] + [piece])
        if group and joinable(joined):
            group += [p for _, p in between] + [piece]
        else:
            flush()
            out += [Section(p, indent, first + s, edit=False) for s, p in between]
            group, group_start = [piece], start
        between = []
    flush()
    out += [Section(p, indent, first + s, edit=False) for s, p in between]
    return out


def _split_block(lines: Sequence[str], first: int, indent: str, too_big: Callable[[str], bool],
                 joinable: Callable[[str], bool]) -> list[Section]:
    """A too-big block: its comments and ``key:`` line as they are, then its children as a document of their own,
    or the block whole when it cannot be cut safely."""
    whole = [Section("".join(lines), indent, first, edit=True)]
    header = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#"))
    if not _KEY_HEADER.match(lines[header].rstrip("\n")):
        return whole
    children = lines[header + 1:]
    content = [ln for ln in children if ln.strip()]
    code = [ln for ln in content if not ln.lstrip().startswith("#")]
    if not code:
        return whole
    child_indent = code[0][: len(code[0]) - len(code[0].lstrip(" "))]
    if not child_indent and not code[0].startswith("-"):
        return whole
    if any(not ln.startswith(child_indent) for ln in content):
        return whole
    dedented = [ln[len(child_indent):] if ln.strip() else ln for ln in children]
    try:
        block_data = yaml.safe_load("".join(lines))
        child_data = yaml.safe_load("".join(dedented))
    except yaml.YAMLError:
        return whole
    if not isinstance(block_data, dict) or len(block_data) != 1 or next(iter(block_data.values())) != child_data:
        return whole
    head = Section("".join(lines[: header + 1]), indent, first, edit=False)
    return [head] + _split_document(dedented, first + header + 1, indent + child_indent, too_big, joinable)


def _parts_load_to(text: str, parts: Sequence[str]) -> bool:
    """Whether every part loads on its own and the parts together load to what ``text`` loads to."""
    try:
        whole = yaml.safe_load(text)
        datas = [yaml.safe_load(p) for p in parts]
    except yaml.YAMLError:
        return False
    if isinstance(whole, dict) and all(isinstance(d, dict) for d in datas):
        merged: dict = {}
        for d in datas:
            if set(d) & set(merged):
                return False
            merged.update(d)
        return merged == whole
    if isinstance(whole, list) and all(isinstance(d, list) for d in datas):
        return [x for d in datas for x in d] == whole
    return False


def join_sections(sections: Sequence[Section], results: Sequence[str | None]) -> str:
    """The file again: each section's result (or its own text where the result is None), placed at its indent."""
    out = []
    for section, result in zip(sections, results, strict=True):
        text = section.text if result is None else result
        if text and not text.endswith("\n"):
            text += "\n"
        out.append(section.place(text))
    return "".join(out)


# --------------------------------------------------------------------------------------------------------------
# Prompts and answers

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
    """The chat messages and answer prefill for one section (see the module docstring for why they look so)."""
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


# --------------------------------------------------------------------------------------------------------------
# Validation


def first_difference(before: str, after: str) -> str:
    """Where ``after`` first departs from ``before``, on one line: ``line 3: '  port: 8080' became '  port 9090:'``
    (line numbers are the output's)."""
    a, b = before.splitlines(), after.splitlines()
    for tag, i1, _i2, j1, _j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "replace":
            return f"line {j1 + 1}: {_cut(repr(a[i1]))} became {_cut(repr(b[j1]))}"
        if tag == "delete":
            return f"line {j1 + 1}: {_cut(repr(a[i1]))} is missing"
        if tag == "insert":
            return f"line {j1 + 1}: {_cut(repr(b[j1]))} was added"
    return "none (the texts are identical)"


def data_changes(old: Any, new: Any, path: str = "") -> list[str]:
    """What differs between two loaded documents, one short line per change: ``server.port: 8080 -> 9090``,
    ``removed logging.level``, ``added features[3]: 'metrics'``."""
    where = path or "(top level)"
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in old:
            sub = f"{path}.{key}" if path else str(key)
            if key not in new:
                out.append(f"removed {sub}")
            else:
                out += data_changes(old[key], new[key], sub)
        out += [f"added {path + '.' if path else ''}{key}: {_short(new[key])}" for key in new if key not in old]
        return out
    if isinstance(old, list) and isinstance(new, list):
        out = []
        for i in range(max(len(old), len(new))):
            sub = f"{path}[{i}]"
            if i >= len(new):
                out.append(f"removed {sub}")
            elif i >= len(old):
                out.append(f"added {sub}: {_short(new[i])}")
            else:
                out += data_changes(old[i], new[i], sub)
        return out
    if old == new and type(old) is type(new):
        return []
    return [f"{where}: {_short(old)} -> {_short(new)}"]


def _short(value: Any) -> str:
    try:
        return _cut(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError):  # a date, a set, ...: show what it is
        return _cut(repr(value))


def _cut(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def check_section(original: str, result: str, instruction: str | None) -> str | None:
    """Why ``result`` (the model's YAML for ``original``) is rejected, or None when it validates.

    Without an instruction the result must load to the same data as the original; with one it must parse. The
    reason has a second, indented line: the first differing line for a parser error, the first change of data
    otherwise.
    """
    if not result.strip():
        return "the model's output is empty"
    try:
        got = yaml.safe_load(result)
    except yaml.YAMLError as err:
        return (f"the model's output is not valid YAML ({yaml_error(err)})\n"
                f"  first differing line: {first_difference(original, result)}")
    if instruction is None:
        data = yaml.safe_load(original)
        if got != data or type(got) is not type(data):
            changes = data_changes(data, got)
            first = changes[0] if changes else "a value changed type"
            more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
            return f"the model's output changes the data\n  first change: {first}{more}"
        before, after = Counter(comments(original)), Counter(comments(result))
        dropped, added = before - after, after - before
        if dropped:
            return f"the model's output drops a comment: {_cut(repr('# ' + next(iter(dropped))))}"
        if added:
            return f"the model's output adds a comment: {_cut(repr('# ' + next(iter(added))))}"
    return None


def comments(text: str) -> list[str]:
    """The comments in a YAML text, in order, without their ``#`` and surrounding blanks.

    A ``#`` starts a comment at the start of a line or after a blank, outside quotes (a quote opens a scalar
    only where a token starts). Block scalars are not recognised, but their ``#`` lines count the same in a
    faithful copy, so comparing two texts stays fair.
    """
    out = []
    for line in text.splitlines():
        quote = None
        for i, ch in enumerate(line):
            if quote:
                if ch == quote:
                    quote = None
            elif ch in "'\"" and (i == 0 or line[i - 1] in " \t:[{,-"):
                quote = ch
            elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
                out.append(line[i + 1:].strip())
                break
    return out


def to_json(data: Any) -> str:
    """``data`` as JSON text; ValueError naming the first value JSON cannot hold (a date, a set, ...)."""
    text = json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n"
    back = json.loads(text)
    if back != data:
        changes = data_changes(data, back)
        raise ValueError(f"JSON cannot hold every value (first: {changes[0] if changes else 'a key type'}); "
                         "quote such values in the YAML to keep them as text")
    return text


# --------------------------------------------------------------------------------------------------------------
# Writing


def write_atomic(path: Path, text: str, *, backup: bool = False) -> None:
    """Replace ``path`` with ``text`` atomically: write a temporary file in the same folder, then ``os.replace``.
    With ``backup``, the old file is first copied (also atomically) to ``path.bak``. A failure or Ctrl-C at any
    point leaves ``path`` as it was and no temporary file behind."""
    folder = path.parent
    temps: list[str] = []

    def temp() -> str:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
        temps.append(name)
        return name

    try:
        if backup:
            bak_tmp = temp()
            shutil.copy2(path, bak_tmp)
            os.replace(bak_tmp, path.with_name(path.name + ".bak"))
        new = temp()
        with open(new, "w", encoding="utf-8", newline="") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        if path.exists():
            shutil.copymode(path, new)
        os.replace(new, path)
    finally:
        for name in temps:
            with contextlib.suppress(FileNotFoundError):
                os.remove(name)


def _check_writable(path: Path) -> None:
    shown = click.format_filename(str(path))
    if path.is_dir():
        raise InputError(f"{shown}: is a directory; -o needs a file name")
    folder = path.parent
    if not folder.is_dir():
        raise InputError(f"{shown}: folder {click.format_filename(str(folder))} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{shown}: cannot write to folder {click.format_filename(str(folder))} (permission denied)")


# --------------------------------------------------------------------------------------------------------------
# The model


@dataclass
class Completion:
    answer: str  # the prefill followed by the decoded new tokens
    token_ids: tuple  # the new tokens
    passes: int  # target forward passes (prefill included)
    seconds: float


class TokenProgress:
    """Counts tokens and target passes across a run and draws them on a tqdm bar on stderr (when enabled).

    It duck-types transformers' ``BaseStreamer`` (``put`` / ``end``) rather than subclassing it, so importing the
    CLI does not import transformers. ``put`` receives the prompt first (skipped), then each pass's new tokens:
    one pass per call for lookupdec and for plain decoding alike, so calls count target passes.
    """

    def __init__(self, total: int, enabled: bool):
        self.tokens = 0
        self.passes = 0
        self._skip_prompt = True
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="tok", file=sys.stderr, dynamic_ncols=True, leave=False,
                             desc="generating", disable=None)  # disable=None: no bar when stderr is not a TTY

    def start_request(self) -> None:
        self._skip_prompt = True

    def put(self, value) -> None:  # value: the prompt [1, prompt_len] first, then [n] new tokens per pass
        if self._skip_prompt:
            self._skip_prompt = False
            return
        n = int(value.numel())
        self.tokens += n
        self.passes += 1
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.tokens / self.passes:.2f} tok/pass", refresh=False)
            self._bar.update(n)

    def end(self) -> None:
        pass

    def add(self, tokens: int, passes: int) -> None:
        """A whole batch at once: ``tokens`` new tokens from ``passes`` batched passes."""
        self.tokens += tokens
        self.passes += passes
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.tokens / max(self.passes, 1):.2f} tok/pass", refresh=False)
            self._bar.update(tokens)

    def write(self, line: str) -> None:
        """A message on stderr that does not tear the bar."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            click.echo(line, err=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class ModelEngine:
    """A loaded (model, tokenizer) that answers prompts greedily: with lookup drafts, plainly, or with
    transformers' prompt lookup. One ``LookupDrafter`` serves every section of a run, so its rolling cache of
    earlier answers helps later sections (a section's own text is already in its prompt)."""

    def __init__(self, model, tokenizer):
        from lookupdec import LookupDrafter

        self.model = model
        self.tokenizer = tokenizer
        self.drafter = LookupDrafter()
        config = model.config
        self.context = int(getattr(config, "max_position_embeddings", None) or 2048)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def prepare(self, say) -> None:
        """Calibrate the drafter to this model's pass cost by draft length: measured once per model, device and
        thread count (saying so, since it takes a few seconds), then read from the cache."""
        from lookupdec.costs import calibrate_or_warn

        calibrate_or_warn(self.drafter, self.model, on_measure=lambda: say(
            "measuring this model's pass cost by draft length (once per machine and model, a few seconds)"))

    def encode(self, prompt: Prompt):
        import torch

        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(list(prompt.messages), add_generation_prompt=True, return_dict=True,
                                          return_tensors="pt")["input_ids"]
        else:  # a base model: the text, then the instruction, then the answer
            ids = tok("\n\n".join(m["content"] for m in prompt.messages) + "\n\n", return_tensors="pt")["input_ids"]
        prefill = torch.tensor([tok.encode(prompt.prefill, add_special_tokens=False)], dtype=ids.dtype)
        return torch.cat([ids, prefill], dim=1)

    def complete(self, prompt: Prompt, max_new_tokens: int, method: str = "lookup",
                 streamer: TokenProgress | None = None, drafter=None, trace=None) -> Completion:
        """Greedy answer to ``prompt``, stopping at the closing fence; ``method`` is ``lookup`` (lookupdec, with
        ``drafter`` or the engine's own), ``plain`` (``model.generate``) or ``pld`` (transformers' prompt lookup).
        ``trace`` (a ``TraceRecorder``) records a lookup answer pass by pass."""
        import torch
        from transformers import StoppingCriteriaList

        from lookupdec import generate

        ids = self.encode(prompt)  # [1, prompt_len]
        max_new_tokens = max(1, min(max_new_tokens, self.context - ids.shape[1]))  # a user budget may exceed it
        mask = torch.ones_like(ids)
        stop = StoppingCriteriaList([_FenceStop(self.tokenizer)])
        if streamer is not None:
            streamer.start_request()
        started = time.perf_counter()
        with torch.inference_mode(), _transformers_errors_only():
            if method == "lookup":
                out = generate(self.model, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                               drafter=drafter or self.drafter, do_sample=False, stopping_criteria=stop,
                               streamer=streamer, trace=trace)
                sequences, passes = out.sequences, out.stats.target_passes
            else:
                extra = {"prompt_lookup_num_tokens": 10} if method == "pld" else {}
                sequences = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                                do_sample=False, stopping_criteria=stop, streamer=streamer, **extra)
                passes = streamer.passes if streamer is not None else 0
        seconds = time.perf_counter() - started
        new = sequences[0, ids.shape[1]:].tolist()
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return Completion(prompt.prefill + text, tuple(new), passes, seconds)


    def complete_many(self, prompts: Sequence[Prompt], budgets: Sequence[int],
                      progress: TokenProgress | None = None, traces=None) -> list[Completion]:
        """Greedy lookup answers to several prompts in one batch (``lookupdec.generate`` on left-padded rows);
        each answer is what :meth:`complete` would give for that prompt and budget alone. ``traces``: one
        ``TraceRecorder`` per prompt, or None."""
        import torch
        from transformers import StoppingCriteriaList

        from lookupdec import generate

        encoded = [self.encode(p)[0] for p in prompts]
        budgets = [max(1, min(b, self.context - len(e))) for b, e in zip(budgets, encoded, strict=True)]
        if any(max(budgets) > self.context - len(e) for e in encoded):
            # One budget serves the batch (rows are cut at their own afterwards): it must fit every row's context.
            return [self.complete(p, b, streamer=progress, **({"trace": traces[i]} if traces else {}))
                    for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))]
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        width = max(len(e) for e in encoded)
        ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(encoded):
            ids[i, width - len(e):] = e
            mask[i, width - len(e):] = 1
        started = time.perf_counter()
        with torch.inference_mode(), _transformers_errors_only():
            out = generate(self.model, ids, attention_mask=mask, max_new_tokens=max(budgets), drafter=self.drafter,
                           do_sample=False, stopping_criteria=StoppingCriteriaList([_FenceStop(self.tokenizer)]),
                           trace=traces)
        seconds = time.perf_counter() - started
        done = []
        for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
            row = out.stats.rows[i]
            # A row may run past its own budget while others need more: cut it where it alone would have stopped.
            new = out.sequences[i, width: width + row.new_tokens].tolist()[:budget]
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            done.append(Completion(prompt.prefill + text, tuple(new), row.target_passes, seconds))
        if progress is not None:
            progress.add(sum(len(c.token_ids) for c in done), out.stats.target_passes)
        return done


@contextlib.contextmanager
def _transformers_errors_only():
    """transformers warns that no attention mask was passed (lookupdec's ``resolve_generation`` tells it so even
    when one was); on a terminal that reads like a problem with the user's file, so only errors are shown."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


class _FenceStop:
    """Stops generation once the answer closes its fenced block; without it the model repeats the block until
    the token budget runs out. It looks at the last few tokens for three backticks that do not open a block
    (an opening fence is followed by its language, ```yaml), so it needs no prompt length and serves every row
    of a batch: the prefilled opening fence does not count."""

    _CLOSING = re.compile(r"```(?![A-Za-z])")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, input_ids, scores=None, **kwargs):  # input_ids [batch, length] -> [batch] bool
        import torch

        return torch.tensor([self._closes(row[-4:].tolist()) for row in input_ids], dtype=torch.bool,
                            device=input_ids.device)

    def _closes(self, tail: list) -> bool:
        # Only a fence that the newest token completes counts: the prompt's last tokens (the prefilled first line,
        # which may itself hold backticks) are in the window too.
        before = len(self.tokenizer.decode(tail[:-1]))
        return any(m.end() > before for m in self._CLOSING.finditer(self.tokenizer.decode(tail)))


def _open_engine(name: str | None, progress: bool) -> ModelEngine:
    """Load the model (ModelLoadError on failure) and wrap it; tests replace this with a stub engine."""
    from lookupdec import models

    model, tokenizer = models.load_model(name, progress=progress)
    return ModelEngine(model, tokenizer)


# --------------------------------------------------------------------------------------------------------------
# Running the model over the sections


@dataclass
class Plan:
    sections: list[Section]
    budgets: list[int]  # max new tokens per section (0 for sections copied through)
    sizes: list[int]  # tokens per section (0 for sections copied through)


def plan_sections(text: str, engine, instruction: str | None, max_new_tokens: int | None,
                  path_shown: str) -> Plan:
    """Split ``text`` for this run and give each section its token budget; InputError when a section cannot be
    made small enough for the model's context or the user's budget.

    A section of ``n`` tokens gets ``ceil(1.5 n) + 32`` new tokens (room for a reformat to finish, and for an
    edit to grow the text a little) unless ``--max-new-tokens`` says otherwise; with it, a section holds at most
    ``N - BUDGET_MARGIN`` tokens. The prompt holds the section too, so the context fits ``n + 1.5 n + 32`` plus
    the prompt's own text.
    """
    overhead = PROMPT_OVERHEAD + (engine.count_tokens(instruction) if instruction else 0)
    context_limit = int((engine.context - overhead - 32) / 2.5)
    limit = context_limit if max_new_tokens is None else min(context_limit, max_new_tokens - BUDGET_MARGIN)
    if limit < 1:
        raise InputError(f"--max-new-tokens {max_new_tokens} is too small for any section "
                         f"(it needs at least {BUDGET_MARGIN + 1})")
    target = limit if instruction else min(limit, REFORMAT_SECTION_TOKENS)
    too_big = lambda t: engine.count_tokens(t) > target
    joinable = None if instruction else (lambda t: flat(t) and not too_big(t))
    sections = split_sections(text, too_big, joinable)
    budgets, sizes = [], []
    for section in sections:
        if not section.edit:
            budgets.append(0)
            sizes.append(0)
            continue
        n = engine.count_tokens(section.text)
        if n > limit:
            why = (f"the model's context is {engine.context} tokens" if limit == context_limit
                   else f"--max-new-tokens {max_new_tokens}")
            verb = "holds" if section.line == section.last_line else "hold"
            raise InputError(f"{path_shown}: too large even for sections: {section.lines} {verb} {n} tokens and "
                             f"cannot be split further; a section may hold {limit} ({why})")
        sizes.append(n)
        budgets.append(max_new_tokens if max_new_tokens is not None else math.ceil(1.5 * n) + 32)
    if not any(s.edit for s in sections):
        raise InputError(f"{path_shown}: nothing to edit (only comments and blank lines)")
    return Plan(sections, budgets, sizes)


def _trim_blank_lines(text: str) -> str:
    """``text`` without blank lines at its start and end (a section never has them: they stay outside it)."""
    lines = text.splitlines(keepends=True)
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "".join(lines)


class _Job:
    """One section to ask the model for; ``pieces`` becomes its result: ``(Section, text or None)`` pairs and, for
    a section cut finer after a rejection, the jobs of its parts, in file order."""

    def __init__(self, section: Section, budget: int, shown: str, depth: int = 0):
        self.section, self.budget, self.shown, self.depth = section, budget, shown, depth
        self.pieces: list = []
        self.request = None  # its trace request, when tracing

    def requests(self) -> list:
        """Trace requests of this job and its parts, in file order."""
        out = [self.request] if self.request is not None else []
        for piece in self.pieces:
            out += piece.requests() if isinstance(piece, _Job) else []
        return out

    def flat(self) -> list[tuple]:
        return _flat(self.pieces)


def _flat(pieces: Sequence) -> list[tuple]:
    """``(Section, text or None)`` pairs of ``pieces`` in file order, the jobs among them expanded."""
    out = []
    for piece in pieces:
        out += piece.flat() if isinstance(piece, _Job) else [piece]
    return out


class _Editor:
    """Asks the model for every section and validates the answers; counts what it did for the summary.

    Sections go to the model in batches of up to ``batch`` (one ``lookupdec.generate`` call per batch, sections
    of several files mixed), each answer exactly what the section alone would get. In a reformat, a section whose
    answer is rejected is cut into smaller sections that join the next round of batches (the model copies small
    ones better), down to pieces that cannot be cut; those are kept as they were. With an instruction, a
    rejected section stops the run unless ``keep_going``.
    """

    def __init__(self, engine, instruction, method, progress, keep_going, max_new_tokens, say, trace=None,
                 batch: int = 1):
        self.engine, self.instruction, self.method, self.progress = engine, instruction, method, progress
        self.keep_going, self.max_new_tokens, self.say = keep_going, max_new_tokens, say
        self.trace = trace  # a TraceRecorder for --trace, or None
        self.batch = batch
        self.completions: list[tuple] = []  # (prompt, budget, Completion) of every request, for --compare
        self.edited = Counter()  # per file shown: sections whose result is the model's or that were kept
        self.kept = Counter()

    def run(self, jobs: Sequence[_Job]) -> None:
        """Fill in every job's ``pieces``. Each batch is validated as soon as it returns (a rejected edit stops
        the run there); the parts of rejected sections go to the next round."""
        queue = list(jobs)
        while queue:
            following = []
            for start in range(0, len(queue), self.batch):
                chunk = queue[start: start + self.batch]
                for job, (done, request) in zip(chunk, self._complete(chunk), strict=True):
                    job.request = request
                    following += self._settle(job, done, request)
            queue = following

    def _complete(self, jobs: Sequence[_Job]) -> list[tuple]:
        """``[(Completion, trace request or None), ...]`` for ``jobs``, batched when the engine can."""
        prompts = [build_prompt(job.section.text, self.instruction) for job in jobs]
        recorders = [self._recorder(job) for job in jobs] if self.trace is not None else None
        done = None
        if len(jobs) > 1 and self.method == "lookup" and hasattr(self.engine, "complete_many"):
            try:
                done = self.engine.complete_many(prompts, [job.budget for job in jobs], self.progress, recorders)
            except NotImplementedError:
                # The model cannot run batches (sliding-window attention): one section at a time from now on.
                self.batch = 1
                recorders = [self._recorder(job) for job in jobs] if self.trace is not None else None
        if done is None:
            done = []
            for i, (job, prompt) in enumerate(zip(jobs, prompts, strict=True)):
                # trace is passed only when tracing, so engines without the argument still work
                traced = {"trace": recorders[i]} if recorders is not None else {}
                done.append(self.engine.complete(prompt, job.budget, method=self.method, streamer=self.progress,
                                                 **traced))
        requests = [None] * len(jobs)
        if recorders is not None:
            for i, recorder in enumerate(recorders):
                self.trace.requests += recorder.requests
                requests[i] = recorder.requests[-1] if recorder.requests else None
        self.completions += [(p, job.budget, d) for p, job, d in zip(prompts, jobs, done, strict=True)]
        return list(zip(done, requests, strict=True))

    def _recorder(self, job: _Job):
        recorder = type(self.trace)(self.trace.tokenizer, title=self.trace.title)
        recorder.label = f"{job.shown}: {job.section.lines}"
        return recorder

    def _settle(self, job: _Job, done: Completion, request) -> list[_Job]:
        """Validate ``job``'s answer and set its pieces; returns the jobs of its parts when it is cut finer."""
        section = job.section
        result, closed = extract_block(done.answer)
        reason = check_section(section.text, result, self.instruction) if closed else (
            f"the model's output did not close its fenced block within {len(done.token_ids)} new tokens")
        if request is not None:
            request.note = "validated" if reason is None else f"rejected: {reason.splitlines()[0]}"
        if reason is None:
            self.edited[job.shown] += 1
            job.pieces = [(section, _trim_blank_lines(result))]
            return []
        where = f"{job.shown}: {section.lines}"
        if self.instruction is not None:
            if not self.keep_going:
                raise _Failed(f"{where}: {reason}\n  nothing was written (--keep-going keeps such a section as it "
                              "was)", EXIT_REJECTED)
        elif job.depth < 3:
            parts = self._parts(section)
            if parts:
                for part in parts:
                    if not part.edit:
                        job.pieces.append((part, None))
                        continue
                    n = self.engine.count_tokens(part.text)
                    budget = self.max_new_tokens or math.ceil(1.5 * n) + 32
                    job.pieces.append(_Job(part, budget, job.shown, job.depth + 1))
                return [piece for piece in job.pieces if isinstance(piece, _Job)]
        self.edited[job.shown] += 1
        self.kept[job.shown] += 1
        self.say(f"{where}: kept unchanged: {reason}")
        job.pieces = [(section, None)]
        return []

    def _parts(self, section: Section) -> list[Section]:
        """``section`` cut one level finer, placed in the file; empty when it cannot be cut."""
        n = self.engine.count_tokens(section.text)
        too_big = lambda t: self.engine.count_tokens(t) >= n
        parts = split_sections(section.text, too_big, lambda t: flat(t) and not too_big(t))
        if sum(p.edit for p in parts) < 2:
            return []
        return [Section(p.text, section.indent + p.indent, section.line + p.line - 1, p.edit) for p in parts]


def _write(text: str, file: Path, output: Path | None, in_place: bool) -> str | None:
    """Write the result where it goes; returns the line telling where it went (None for stdout)."""
    if output is not None:
        write_atomic(output, text)
        return f"wrote {click.format_filename(str(output))}"
    if in_place:
        write_atomic(Path(os.path.realpath(file)), text, backup=True)  # through a symlink, not over it
        shown = click.format_filename(str(file))
        return f"replaced {shown}; the original is in {shown}.bak"
    click.echo(text, nl=False)
    return None


def describe_edit(before: list, after: list) -> list[str]:
    """Lines telling what an instruction changed in the data, so the user sees what the model did."""
    if len(before) == 1 and len(after) == 1:
        changes = data_changes(before[0], after[0])
    else:
        changes = data_changes(before, after)
    if not changes:
        return ["note: the data is unchanged (right for an edit of formatting or comments; otherwise the model did "
                "not apply the instruction)"]
    head = f"the data changed in {len(changes)} place{'s' * (len(changes) != 1)}:"
    more = [f"  ... and {len(changes) - 10} more"] if len(changes) > 10 else []
    return [head] + [f"  {c}" for c in changes[:10]] + more


def _compare(engine, completions, say) -> None:
    """Time lookupdec, plain greedy decoding and transformers' prompt lookup on the run's prompts and budgets.

    The run itself warmed everything up; the three are then timed interleaved, prompt by prompt, lookupdec with a
    fresh drafter (so its rolling cache starts empty, as in the run, and has not seen these answers). Answers are
    compared as extracted blocks: transformers' assisted loop checks stopping criteria only after a whole
    accepted draft, so prompt lookup may run a few tokens past the closing fence.
    """
    from lookupdec import LookupDrafter

    drafter = LookupDrafter()
    times = {"lookup": 0.0, "plain": 0.0, "pld": 0.0}
    differ = []
    for prompt, budget, done in completions:
        for method in times:
            other = engine.complete(prompt, budget, method=method, drafter=drafter)
            times[method] += other.seconds
            if extract_block(other.answer)[0] != extract_block(done.answer)[0] and method not in differ:
                differ.append(method)
    ours, plain, pld = times["lookup"], times["plain"], times["pld"]
    names = {"lookup": "lookupdec", "plain": "plain decoding", "pld": "prompt lookup"}
    note = f"; note: {' and '.join(names[m] for m in differ)} gave different text" if differ else "; same text"
    say(f"compare: lookupdec {ours:.1f} s, plain {plain:.1f} s ({plain / max(ours, 1e-9):.2f}x), "
        f"prompt lookup {pld:.1f} s ({pld / max(ours, 1e-9):.2f}x){note}")


# --------------------------------------------------------------------------------------------------------------
# The command


class _Failed(Exception):
    """Ends the command with a one-line message (maybe with an indented detail line) and an exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES_HELP)
@click.version_option(__version__, "--version", prog_name="lookupdec")
def main():
    """lookupdec: exact draft-free speculative decoding, and a config-editing command built on it."""


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("files", metavar="FILE...", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--instruction", "-i", metavar="TEXT", help="The edit to make, e.g. \"change the port to 9090\". "
              "Without it the file is reformatted, keeping every key, value and comment.")
@click.option("--to", "to", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True,
              help="Output format. The model always works on YAML (it is far more reliable there); JSON is "
                   "written from the validated result.")
@click.option("-o", "--output", type=click.Path(path_type=Path), metavar="OUT",
              help="Write the result to OUT instead of stdout; with several files, OUT is a folder that gets "
                   "each result under its file's name.")
@click.option("--in-place", is_flag=True, help="Replace FILE atomically, keeping the original as FILE.bak.")
@click.option("--batch", type=click.IntRange(min=1, max=64), default=DEFAULT_BATCH, show_default=True,
              metavar="N", help="Sections (of all files) the model works on together in one batch; 1 turns "
                               "batching off. Outputs do not depend on it, only speed does.")
@click.option("--model", "model_name", metavar="NAME_OR_PATH", default=None,
              help="Hub id, local folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct (offline).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), metavar="N", default=None,
              help="Token budget per section; a file that needs more is processed in smaller sections. "
                   "Default: 1.5x each section's length + 32.")
@click.option("--no-lookup", is_flag=True, help="Decode plainly (model.generate) instead of with lookup drafts.")
@click.option("--compare", is_flag=True, help="Also time plain decoding and transformers' prompt lookup on the "
              "same prompts and print the speedups.")
@click.option("--keep-going", is_flag=True, help="With --instruction: keep a section whose output fails "
              "validation as it was, instead of stopping.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the result (no progress, summary or notes).")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path), metavar="OUT.html",
              help="Also write an HTML trace of the model's work, one block per section: accepted draft tokens "
                   "green, the first rejected one red, the model's own tokens plain. Written when the result "
                   "validated and when it was rejected (to see why).")
def reformat(files, instruction, to, output, in_place, batch, model_name, max_new_tokens, no_lookup, compare,
             keep_going, quiet, trace_path):
    """Reformat or edit the YAML file FILE with a local model, validating what it writes.

    Without --instruction the file is rewritten with consistent formatting, section by section; the result must
    load to the same data as FILE, and a section whose output does not is kept as it was. With --instruction
    the edit is applied and the result must parse. Nothing is written unless the result validated: it goes to
    stdout, to OUT with -o, or replaces FILE with --in-place.

    Several files are edited together, their sections batched, and need --in-place or -o FOLDER; each file is
    validated and written on its own, and the exit code is 1 if any was rejected. With --instruction, a rejected
    section stops the whole run (nothing is written) unless --keep-going.

    \b
    Examples:
      lookupdec reformat examples/configs/service.yaml
      lookupdec reformat service.yaml -i "change the server port to 9090" --in-place
      lookupdec reformat service.yaml --to json -o service.json
      lookupdec reformat service.yaml --trace trace.html -o /dev/null
      lookupdec reformat a.yaml b.yaml c.yaml --in-place
    """
    if output is not None and in_place:
        raise click.UsageError("use either -o/--output or --in-place, not both")
    if compare and no_lookup:
        raise click.UsageError("--compare times lookup decoding against the others; drop --no-lookup")
    if instruction is not None and not instruction.strip():
        raise click.UsageError("--instruction is empty")
    if trace_path is not None and no_lookup:
        raise click.UsageError("--trace records lookup decoding's passes; drop --no-lookup")
    if len(files) > 1 and output is None and not in_place:
        raise click.UsageError("several files need --in-place or -o FOLDER")
    if len(files) > 1 and output is not None and not output.is_dir():
        raise click.UsageError(f"-o {click.format_filename(str(output))}: with several files, -o names an "
                               "existing folder")
    if len(set(os.path.realpath(f) for f in files)) < len(files):
        raise click.UsageError("a file is named twice")
    if len(files) > 1 and output is not None:
        targets = [os.path.realpath(_output_for(f, output, True, to)) for f in files]
        if len(set(targets)) < len(targets):
            raise click.UsageError("two files would be written to the same name in the -o folder")
        if set(targets) & {os.path.realpath(f) for f in files}:
            raise click.UsageError("-o would overwrite an input file; use --in-place to replace inputs")
    say = (lambda line: None) if quiet else (lambda line: click.echo(line, err=True))
    trace = _Trace(trace_path, files) if trace_path is not None else None
    try:
        _reformat(files, instruction, to, output, in_place, model_name, max_new_tokens, no_lookup, compare,
                  keep_going, quiet, say, trace, batch)
    except _Failed as err:
        if trace is not None and err.code == EXIT_REJECTED:
            try:
                trace.save(say)
            except _Failed as trace_err:
                click.echo(f"error: {trace_err}", err=True)
        click.echo(f"error: {err}", err=True)
        raise click.exceptions.Exit(err.code) from None
    except KeyboardInterrupt:
        click.echo("\ninterrupted; nothing was written", err=True)
        raise click.exceptions.Exit(EXIT_INTERRUPTED) from None


@dataclass
class _File:
    """One input file through the run: what was read, where the result goes, and its sections' jobs."""

    path: Path
    shown: str
    output: Path | None
    text: str = ""
    original: list = None
    converted: str | None = None
    plan: Plan | None = None
    pieces: list = None  # (Section, None) for sections copied through, _Job for the others, in file order


def _read_file(file: Path, to, output: Path | None, in_place: bool) -> _File:
    """Read and check one input (InputError on a problem), before any model is loaded."""
    run = _File(file, click.format_filename(str(file)), output)
    run.text = read_input(file)
    try:
        run.original = load_yaml_documents(run.text)
    except yaml.YAMLError as err:
        raise InputError(f"{run.shown}: invalid YAML at {yaml_error(err)}") from None
    if to == "json":
        if len(run.original) != 1:
            raise InputError(f"{run.shown}: holds {len(run.original)} YAML documents; JSON output needs exactly one")
        try:
            run.converted = to_json(run.original[0])
        except ValueError as err:
            raise InputError(f"{run.shown}: {err}") from None
    if output is not None:
        _check_writable(output)
    if in_place:
        _check_writable(file)
    return run


def _output_for(file: Path, output: Path | None, several: bool, to) -> Path | None:
    if output is None or not several:
        return output
    name = Path(file).with_suffix(".json").name if to == "json" else Path(file).name
    return output / name


def _reformat(files, instruction, to, output, in_place, model_name, max_new_tokens, no_lookup, compare,
              keep_going, quiet, say, trace: _Trace | None = None, batch: int = DEFAULT_BATCH) -> None:
    several = len(files) > 1
    try:
        runs = [_read_file(f, to, _output_for(f, output, several, to), in_place) for f in files]
        if trace is not None:
            _check_writable(trace.path)
    except InputError as err:
        raise _Failed(str(err), EXIT_USAGE) from None

    if to == "json" and instruction is None:
        # Converting validated data needs no model: json.dumps is exact, and the model gets JSON wrong.
        for run in runs:
            where = _write(run.converted, run.path, run.output, in_place)
            say(f"{run.shown}: converted to JSON without the model (nothing for it to do: the data stays as it is)"
                if several else
                "reformat: converted to JSON without the model (nothing for it to do: the data stays as it is)")
            if where:
                say(where)
        return

    from lookupdec.models import ModelLoadError

    try:
        engine = _open_engine(model_name, progress=not quiet)
        for run in runs:
            run.plan = plan_sections(run.text, engine, instruction, max_new_tokens, run.shown)
    except (ModelLoadError, InputError) as err:
        raise _Failed(str(err), EXIT_USAGE) from None
    if not no_lookup:
        engine.prepare(say)

    # About one token per token of a section, plus the closing fence.
    progress = TokenProgress(total=sum(n + 2 for run in runs for n, s in zip(run.plan.sizes, run.plan.sections,
                                                                              strict=True) if s.edit),
                             enabled=not quiet)
    editor = _Editor(engine, instruction, "plain" if no_lookup else "lookup", progress, keep_going, max_new_tokens,
                     (lambda line: None) if quiet else progress.write,
                     trace.start(engine.tokenizer) if trace is not None else None, batch=batch)
    jobs = []
    for run in runs:
        run.pieces = [_Job(section, budget, run.shown) if section.edit else (section, None)
                      for section, budget in zip(run.plan.sections, run.plan.budgets, strict=True)]
        jobs += [piece for piece in run.pieces if isinstance(piece, _Job)]
    started = time.perf_counter()
    try:
        editor.run(jobs)
    finally:
        progress.close()
    seconds = time.perf_counter() - started

    failures, written = [], []
    for run in runs:
        try:
            result_text, docs = _finish_file(run, editor, instruction, to)
        except _Failed as err:
            if not several:
                raise
            failures.append(err)
            continue
        written.append((run, _write(result_text, run.path, run.output, in_place), docs))
    tokens, passes = progress.tokens, progress.passes
    edited, kept = sum(editor.edited.values()), sum(editor.kept.values())
    say(f"reformat: {tokens} new tokens, {passes} target passes, {tokens / max(passes, 1):.2f} tokens/pass, "
        f"{seconds:.1f} s ({edited} section{'s' * (edited != 1)}, {kept} kept unchanged)")
    for run, where, docs in written:
        if instruction is not None:
            for line in describe_edit(run.original, docs):
                say(f"{run.shown}: {line}" if several else line)
    if compare:
        _compare(engine, editor.completions, say)
    for run, where, docs in written:
        if where:
            say(where)
    if trace is not None and trace.recorder is not None:
        # Batches and retries run sections out of order; the page lists them in file order.
        trace.recorder.requests = [request for run in runs for piece in run.pieces if isinstance(piece, _Job)
                                   for request in piece.requests()]
    if failures:
        for err in failures:
            click.echo(f"error: {err}", err=True)
        rest = "the others were written" if written else "nothing was written"
        raise _Failed(f"{len(failures)} of {len(runs)} files rejected; {rest}", EXIT_REJECTED)  # trace saved by reformat
    if trace is not None:
        trace.save(say)


def _finish_file(run: _File, editor: _Editor, instruction, to) -> tuple:
    """The validated result text of one file and its data; _Failed (exit 1) when it did not validate."""
    shown = run.shown
    if editor.kept[shown] == editor.edited[shown]:
        raise _Failed(f"{shown}: the model's output was rejected for every section; nothing was written",
                      EXIT_REJECTED)
    pieces = _flat(run.pieces)
    result_text = join_sections([p[0] for p in pieces], [p[1] for p in pieces])
    try:
        docs = load_yaml_documents(result_text)
    except yaml.YAMLError as err:  # every section parsed, so the join is at fault; never write it
        raise _Failed(f"{shown}: the joined result is not valid YAML ({yaml_error(err)})\n"
                      f"  first differing line: {first_difference(run.text, result_text)}", EXIT_REJECTED) from None
    if instruction is None and docs != run.original:
        changes = data_changes(run.original, docs)
        raise _Failed(f"{shown}: the joined result changes the data\n  first change: "
                      f"{changes[0] if changes else 'a value changed type'}", EXIT_REJECTED)
    if to == "json":
        try:
            result_text = to_json(docs[0])
        except ValueError as err:
            raise _Failed(f"{shown}: the edited data cannot be written as JSON: {err}", EXIT_REJECTED) from None
    return result_text, docs


class _Trace:
    """``--trace OUT.html``: the recorder that follows every section's request (not the ``--compare`` reruns),
    and where its HTML goes. Written when the run ends with a result or a rejection, not on an input error or
    Ctrl-C (nothing to see, or half a run)."""

    def __init__(self, path: Path, files: Sequence[Path]):
        self.path = path
        self.title = "lookupdec reformat " + " ".join(click.format_filename(str(f)) for f in files)
        self.recorder = None

    def start(self, tokenizer):
        from lookupdec.trace import TraceRecorder

        self.recorder = TraceRecorder(tokenizer, title=self.title)
        return self.recorder

    def save(self, say) -> None:
        if self.recorder is None or not self.recorder.requests:
            return
        shown = click.format_filename(str(self.path))
        try:
            self.recorder.save_html(self.path)
        except OSError as err:
            raise _Failed(f"{shown}: cannot write the trace ({err.strerror or err})", EXIT_USAGE) from None
        say(f"wrote trace {shown}")


if __name__ == "__main__":  # pragma: no cover
    main()
