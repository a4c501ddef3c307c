"""Sections: a YAML file cut into pieces the model can edit one at a time, and joined back in order.

A reformat works on small sections: each top-level block alone (runs of one-line ``key: value`` blocks together,
since a lone short line invites the model to invent more), cut further into a block's children while larger than
``editor.REFORMAT_SECTION_TOKENS``; a section whose answer is rejected is cut one level finer and tried again
(:func:`split_finer`). An instruction sees the whole file first, and sections only when the file is longer than the
model's context or the ``--max-new-tokens`` budget (a capable model keeps a whole-file edit coherent); a rejected
section of an edit is then cut into the entries the instruction names (``editor.FileFocus``), since an
instruction sent to a section it is not about tends to get applied there anyway. Documents (``---``) are always
separate sections.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import yaml

from .yamldata import load


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
        def joinable(t):
            return not too_big(t)
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
        block_data = load("".join(lines))
        child_data = load("".join(dedented))
    except yaml.YAMLError:
        return whole
    if not isinstance(block_data, dict) or len(block_data) != 1 or next(iter(block_data.values())) != child_data:
        return whole
    head = Section("".join(lines[: header + 1]), indent, first, edit=False)
    return [head] + _split_document(dedented, first + header + 1, indent + child_indent, too_big, joinable)


def _parts_load_to(text: str, parts: Sequence[str]) -> bool:
    """Whether every part loads on its own and the parts together load to what ``text`` loads to."""
    try:
        whole = load(text)
        datas = [load(p) for p in parts]
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



def split_finer(section: Section, count_tokens: Callable[[str], int]) -> list[Section]:
    """``section`` cut one level finer (every part smaller than the whole), placed in the file; empty when it
    cannot be cut into at least two parts to edit. A reformat retries a rejected section this way: the model copies
    small sections better."""
    n = count_tokens(section.text)
    def too_big(t):
        return count_tokens(t) >= n

    parts = split_sections(section.text, too_big, lambda t: flat(t) and not too_big(t))
    if sum(p.edit for p in parts) < 2:
        return []
    return [Section(p.text, section.indent + p.indent, section.line + p.line - 1, p.edit) for p in parts]


def trim_blank_lines(text: str) -> str:
    """``text`` without blank lines at its start and end (a section never has them: they stay outside it)."""
    lines = text.splitlines(keepends=True)
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "".join(lines)
