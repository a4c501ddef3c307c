"""YAML data as a run reads and compares it: unknown tags kept as opaque values, and the changes between two loads.

Tags. Real configs carry tags PyYAML's safe loader has no constructor for: mkdocs' ``!!python/name:...``,
CloudFormation's ``!Ref`` / ``!GetAtt`` / ``!Sub``, Home Assistant's ``!secret`` / ``!include``, GitLab's
``!reference``. They are valid YAML, so :func:`load_documents` keeps each as a :class:`Tagged` (the tag and the
plain value under it) that compares equal to the same tag over the same value, and is never executed or
resolved. PyYAML rather than ruamel.yaml (docs/design.md, "How ``lookupdec reformat`` makes an edit"): a run
never re-serializes YAML (the model's text is written, untouched sections byte for byte), so a round-trip dumper
would buy nothing, and ruamel's YAML 1.2 reading would change what ``--to json`` writes and what the checks
compare.

Changes. :func:`diff` lists what differs between two loads as :class:`Change` records with paths; lists are
aligned with ``difflib`` (removing an item is one removal, not a change at every later index).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml


@dataclass(frozen=True)
class Tagged:
    """A node whose tag the safe loader does not know (``!Ref``, ``!reference``, ``!!python/name:...``): the tag
    as the document spells it out (``!Ref``, ``tag:yaml.org,2002:python/name:...``) and the plain value under it
    (a string, list or dict). Equal when both are."""

    tag: str
    value: Any

    def __repr__(self) -> str:
        return f"{self.tag} {self.value!r}"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, with every tag it has no constructor for kept as a :class:`Tagged`."""


def _construct_tagged(loader: _Loader, node: yaml.Node) -> Tagged:
    if isinstance(node, yaml.MappingNode):
        value = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_scalar(node)
    return Tagged(node.tag, value)


_Loader.add_constructor(None, _construct_tagged)  # None: the fallback for tags without a constructor


def load(text: str) -> Any:
    """The single document of ``text`` (None when empty), unknown tags kept; raises yaml.YAMLError."""
    return yaml.load(text, Loader=_Loader)  # a safe loader: nothing is constructed but plain data and Tagged


def load_documents(text: str) -> list:
    """Every document of ``text``, unknown tags kept; raises yaml.YAMLError."""
    return list(yaml.load_all(text, Loader=_Loader))


def compose_documents(text: str) -> Iterator[tuple]:
    """``(node, loader)`` for each document of ``text``: the node tree with its marks (0-based lines and columns),
    and the loader that composed it, which constructs keys and values of that tree (``loader.construct_object``).
    Raises yaml.YAMLError."""
    loader = _Loader(text)
    try:
        while loader.check_node():
            yield loader.get_node(), loader
    finally:
        loader.dispose()


# --------------------------------------------------------------------------------------------------------------
# Changes between two loads


@dataclass(frozen=True)
class Change:
    kind: str  # "changed" (a value replaced), "added" or "removed"
    path: tuple  # keys and list indexes from the top of the document (indexes of the old list, or of the new
    #              one for an addition); a list of documents starts with the document's index
    old: Any = None  # the value before ("changed", "removed")
    new: Any = None  # the value after ("changed", "added")

    def __str__(self) -> str:
        where = format_path(self.path)
        if self.kind == "removed":
            return f"removed {where}"
        if self.kind == "added":
            return f"added {where}: {short(self.new)}"
        return f"{where or '(top level)'}: {short(self.old)} -> {short(self.new)}"


def same(a: Any, b: Any) -> bool:
    """Equal data with equal types all the way down: ``"3.14" != 3.14``, ``1 != True``, ``1 != 1.0``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)  # key order is formatting
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Tagged):
        return a.tag == b.tag and same(a.value, b.value)
    return a == b


def diff(old: Any, new: Any, path: tuple = ()) -> list[Change]:
    """Every place ``new`` departs from ``old``, in document order: a key or item removed or added, or a value
    replaced (a value whose type changed counts as replaced: ``"2000"`` is not ``2000``). Lists are aligned on
    their items, so taking one item out is one removal."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[Change] = []
        for key in old:
            if key not in new:
                out.append(Change("removed", path + (key,), old=old[key]))
            else:
                out += diff(old[key], new[key], path + (key,))
        out += [Change("added", path + (key,), new=new[key]) for key in new if key not in old]
        return out
    if isinstance(old, list) and isinstance(new, list):
        return _diff_lists(old, new, path)
    if same(old, new):
        return []
    return [Change("changed", path, old=old, new=new)]


def _diff_lists(old: list, new: list, path: tuple) -> list[Change]:
    keys_old, keys_new = [_key(x) for x in old], [_key(x) for x in new]
    out: list[Change] = []
    matcher = difflib.SequenceMatcher(None, keys_old, keys_new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if tag == "replace" and i2 - i1 == j2 - j1:  # items edited in place: say what changed inside each
            for k in range(i2 - i1):
                out += diff(old[i1 + k], new[j1 + k], path + (i1 + k,))
            continue
        out += [Change("removed", path + (i,), old=old[i]) for i in range(i1, i2)]
        out += [Change("added", path + (j,), new=new[j]) for j in range(j1, j2)]
    return out


def _key(value: Any) -> str:
    """A text that two items share exactly when they are the same data (types included)."""
    return repr(_typed(value))


def _typed(value: Any):
    if isinstance(value, dict):
        return ("dict", [(_typed(k), _typed(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("list", [_typed(x) for x in value])
    if isinstance(value, Tagged):
        return ("tag", value.tag, _typed(value.value))
    return (type(value).__name__, value)


def format_path(path: tuple) -> str:
    """``server.port``, ``features[3]``, ``[1].spec.replicas`` (a document's index first when there are several)."""
    out = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def short(value: Any, width: int = 60) -> str:
    """``value`` on one short line: JSON where it can be, else its repr (a date, a tag)."""
    try:
        if _has_tagged(value):
            raise TypeError
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _has_tagged(value: Any) -> bool:
    if isinstance(value, Tagged):
        return True
    if isinstance(value, dict):
        return any(_has_tagged(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_tagged(v) for v in value)
    return False
