"""What a run accepts: the input file, the model's answer for each section, and the result before it is written.

Input. A file is refused before any model is loaded when it is missing, a folder, unreadable, larger than
``MAX_FILE_BYTES``, binary, not UTF-8, empty or not valid YAML; an output path when its folder is missing or not
writable.

Validation. A reformatted section must load to the same data and keep the same comments (none dropped, none
invented); an edited one must parse, and the file with it in place must change only what the instruction names
(``editor.FileFocus.check``, ``focus.unasked_change``). The joined file is checked again before anything is
written. YAML is loaded with unknown tags (``!Ref``, ``!!python/name:...``) kept as opaque values
(:mod:`~lookupdec.reformat.yamldata`), so such files are valid input.

Errors. A run ends with a :class:`ReformatError`: a one-line message (perhaps with indented detail lines) and the
exit code for it, ``EXIT_REJECTED`` when the model's output did not validate and ``EXIT_USAGE`` (an
:class:`InputError`) when the run could not start. Nothing is written for a file whose run ended so.
"""

from __future__ import annotations

import difflib
import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import yaml

from ..errors import LookupdecError
from .yamldata import Tagged, diff, format_path, load, load_documents, same

EXIT_REJECTED = 1  # the model's output was rejected; nothing was written (for that file)
EXIT_USAGE = 2  # the file, an option, an output path or the model cannot be used; nothing was written

MAX_FILE_BYTES = 1 << 20  # 1 MiB of YAML is hours of generation on a CPU; refuse before loading the model


class ReformatError(LookupdecError):
    """Ends a run (or one file's part of it) with a message and the exit code that goes with it.

    ``causes``: with several files, the errors of the files that were rejected, which this one sums up.
    """

    def __init__(self, message: str, code: int = EXIT_REJECTED, causes: Sequence[ReformatError] = ()):
        super().__init__(message)
        self.code = code
        self.causes = tuple(causes)


class InputError(ReformatError):
    """A one-line reason the run cannot start on this input (file, options, output path, model); exit code 2."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_USAGE)


def display_name(path: str | os.PathLike) -> str:
    """``path`` as messages show it (bytes that are not UTF-8 become U+FFFD rather than breaking the message)."""
    return click.format_filename(os.fspath(path))


# --------------------------------------------------------------------------------------------------------------
# Reading and parsing the input


def read_input(path: Path) -> str:
    """The file's text, or InputError saying why it cannot be edited (missing, a directory, unreadable, too large,
    binary, not UTF-8, empty)."""
    shown = display_name(path)
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
    """Every document of ``text``, tags the safe loader does not know kept as opaque ``Tagged`` values (see
    :mod:`~lookupdec.reformat.yamldata`); raises yaml.YAMLError."""
    return load_documents(text)



def check_writable(path: Path) -> None:
    """InputError when ``path`` cannot be written: a folder, in a missing folder, or in one we may not write to."""
    shown = display_name(path)
    if path.is_dir():
        raise InputError(f"{shown}: is a directory; -o needs a file name")
    folder = path.parent
    if not folder.is_dir():
        raise InputError(f"{shown}: folder {display_name(folder)} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{shown}: cannot write to folder {display_name(folder)} (permission denied)")



# --------------------------------------------------------------------------------------------------------------
# Checking the model's answers and the result


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


def data_changes(old: Any, new: Any) -> list[str]:
    """What differs between two loaded documents, one short line per change: ``server.port: 8080 -> 9090``,
    ``removed logging.level``, ``added features[3]: "metrics"`` (lists aligned on their items: see
    :func:`~lookupdec.reformat.yamldata.diff`)."""
    return [str(change) for change in diff(old, new)]


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
        got = load(result)
    except yaml.YAMLError as err:
        return (f"the model's output is not valid YAML ({yaml_error(err)})\n"
                f"  first differing line: {first_difference(original, result)}")
    if instruction is None:
        data = load(original)
        if not same(got, data):
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
    """``data`` as JSON text; ValueError naming the first value JSON cannot hold (a YAML tag, a date, a set, ...)."""
    tagged = first_tagged(data)
    if tagged is not None:
        where, value = tagged
        raise ValueError(f"JSON has no YAML tags (first: {format_path(where) or '(top level)'}: {value!r}); "
                         "write YAML instead")
    text = json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n"
    back = json.loads(text)
    if back != data:
        changes = data_changes(data, back)
        raise ValueError(f"JSON cannot hold every value (first: {changes[0] if changes else 'a key type'}); "
                         "quote such values in the YAML to keep them as text")
    return text


def first_tagged(data: Any, path: tuple = ()) -> tuple | None:
    """``(path, value)`` of the first :class:`~lookupdec.reformat.yamldata.Tagged` value in ``data``, or None."""
    if isinstance(data, Tagged):
        return path, data
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found = first_tagged(value, path + (key,))
        if found is not None:
            return found
    return None


def describe_edit(before: list, after: list) -> list[str]:
    """Lines telling what an instruction changed in the data, so the user sees what the model did."""
    if len(before) == 1 and len(after) == 1:
        changes = data_changes(before[0], after[0])
    else:
        changes = data_changes(before, after)
    if not changes:
        return [("note: the data is unchanged (right for an edit of formatting or comments; otherwise the model "
                 "did not apply the instruction)")]
    head = f"the data changed in {len(changes)} place{'s' * (len(changes) != 1)}:"
    more = [f"  ... and {len(changes) - 10} more"] if len(changes) > 10 else []
    return [head] + [f"  {c}" for c in changes[:10]] + more

