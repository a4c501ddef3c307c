"""Focus: which entries of a file an instruction is about, and whether a change in the data is one it asked for.

Everything here is cheap text evidence, with no model: the words an instruction names, matched against the keys
and values of the file as PyYAML composes it (so every entry has a path and exact lines).

- :func:`read_instruction` cuts an instruction into clauses (``... and ...``) and reads what each names: terms
  (words, split and stemmed, matched against keys), literals (values as written: ``ubuntu-22.04``, ``v6``), the
  new values it gives (after ``to`` / ``with`` / ``into`` / ``=``), and the values it names as the thing to
  replace (``replace X``, ``X instead of``, ``update X to``, everything in a removal).
- :func:`find_entries` lists the file's entries that a section of one line or a few can hold: a ``key: value``,
  a list item, a one-line flow collection; each with its path, lines, and the words around it (the keys above
  it, the scalar values beside it: ``name: php-redis``, ``package-ecosystem: pip``).
- :func:`choose_targets` scores entries per clause (:func:`score`: a key named, 3 per word; the value named as
  the one to replace, 3 per word; a new value sharing a word with it, 2; each word of a key above it or a value
  beside it, 1) and keeps the best-scored entry that the clause names itself. Ties are kept together when the
  clause says ``both`` / ``all`` / ``every`` or names the shared old value, and broken by how close the old value
  is to the new one; a tie left after that is *ambiguous*, for the model to judge
  (:mod:`~lookupdec.reformat.prompts`, ``build_judge``).
- :func:`unasked_change` is the check every edited result passes before it is written: each change in the data
  must be at or next to a target, named by a clause (its key, or its old value as the thing to replace), be
  what the clause implies when it gives a value (:func:`implied`: the whole value, or exactly the named part of
  a ``KEY=VALUE``, ``name:tag``, ``owner/repo@ref``; ``to 9090``: ``9090``, not ``909``; ``to v5``:
  ``checkout@v5``, not ``checkout@v4v5``), and keep its type (``"2000"`` stays a string). A change no clause
  asked for is a wrong edit and is rejected.
- :func:`implied_writes` lists what a target becomes by the clauses that chose it (each value :func:`implied`
  gives, or its removal), for an answer written from the instruction when the model's are all rejected
  (``FileFocus.implied_answers``); :func:`render_scalar` writes such a value in the entry's own quoting.

Decisions. An instruction that names nothing in the file (``add a comment to every key``) concerns every section.
One that asks to move, sort or merge things (:attr:`Instruction.structural`) cannot be made section by section,
so it is never retried at finer grain. The data left unchanged counts as the instruction not applied when the
instruction gives a value, removes, enables or disables something, or names a word the file lacks
(:attr:`Instruction.expects_change`); otherwise (``change the port``, ``add a comment``) unchanged data is a
valid answer.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from .yamldata import Change, Tagged, compose_documents, format_path

# Words that say what to do rather than what to do it to; never matched against keys.
STOPWORDS = frozenset("""
a an the to of in on for from with by at as into onto and or but its it this that these those be is are was
please should must so than then also only just new old current currently value values setting settings option entry
entries item items key keys field fields list both all every each instead same
change changes set sets update upgrade downgrade use make replace rename bump pin lower raise increase decrease
scale add remove delete drop enable disable turn switch put let give move want need
""".split())
_ALL_WORDS = ("both", "all", "every", "each")
_VERBS = frozenset("""change set update upgrade downgrade use make replace rename bump pin lower raise increase
decrease scale add remove delete drop enable disable turn switch put run""".split())
_REMOVE_WORDS = ("remove", "delete", "drop", "without", "unset")
_BOOL_WORDS = ("true", "false", "enable", "enabled", "disable", "disabled")  # and "turn/switch on/off"
_REPLACE_WORDS = ("replace", "instead")
_NEW_AFTER = ("to", "with", "into")  # the literal after these is a new value
_VALUE_LIKE = re.compile(r"\d|[:/@=%]")  # a word holding these is a value rather than a name
_OLD_AFTER = ("replace", "remove", "delete", "drop", "rename", "from", "after", "before")  # see _anchors
_STRUCTURAL = re.compile(r"\b(sort|sorted|sorting|reorder|alphabeticall?y?|move|swap|merge|nest|flatten|"
                         r"restructure|reorgani[sz]e|regroup|deduplicate|dedupe)\b", re.IGNORECASE)
_ABOUT_TEXT = re.compile(r"\b(comments?|format|formatting|indent|indentation|quotes?|quoting|whitespace|spacing|"
                         r"style|reformat)\b", re.IGNORECASE)
_CLAUSE_SPLIT = re.compile(r"\s*(?:;|,?\s+and\s+|,\s+(?=(?:set|change|update|use|add|remove|make|bump)\b))\s*",
                           re.IGNORECASE)
_PUNCT = "\"'`.,;:!?()[]{}"


def atoms(text: str) -> list[str]:
    """The words of ``text`` as keys and values are matched: split at anything not a letter or digit and at
    camelCase humps, lowercased and stemmed (``DBInstanceClass`` -> db, instance, class; ``default-days`` ->
    default, day; ``branches`` -> branch)."""
    out = []
    for word in re.findall(r"[A-Za-z0-9]+", text):
        for part in re.findall(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+", word):
            out.append(stem(part.lower()))
    return out


def stem(word: str) -> str:
    """A plural's singular, roughly (both sides of a match are stemmed alike, so rough is enough)."""
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith(("ches", "shes", "xes", "sses")):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us")):
        return word[:-1]
    return word


def literals(text: str) -> list[str]:
    """The clause's words as written, surrounding punctuation and quotes trimmed (``ubuntu-22.04``,
    ``grafana/grafana:11.1.0``, ``--quiet-level=2``, ``90%``)."""
    out = []
    for raw in text.split():
        word = raw.strip(_PUNCT)
        if word.endswith("'s"):
            word = word[:-2]
        if word:
            out.append(word)
    return out


@dataclass(frozen=True)
class Clause:
    """One clause of an instruction (``set the cpu to 1`` of ``set the cpu to 1 and the memory to 2``), read."""

    text: str
    terms: frozenset  # stemmed words that may name keys (stopwords and the new values' words left out)
    old: tuple  # literals naming a value to replace (lowercased)
    context: tuple  # the other literals (lowercased), which may name a value beside the target
    new: tuple  # literals given as new values (lowercased)
    given: tuple  # the new values as written (case kept): what a changed value may be
    context_given: tuple  # the other literals as written: a replacement's new value when no "to" gives it
    all: bool  # "both", "all", "every", "each": every tied entry is meant
    removes: bool  # remove, delete, drop: a key or item is to go
    renames: bool  # "rename": a key may go (and come back under another name)
    replaces: bool  # "replace", "instead of": some value is to be replaced
    booleans: bool  # true/false/enable/disable, turn/switch on/off: a boolean may flip

    @property
    def gives_value(self) -> bool:
        """Whether the clause says what the new value is (so a changed value must be one it gives)."""
        return bool(self.new) or self.booleans

    @property
    def only_removes(self) -> bool:
        """Whether the clause takes something out and puts nothing in its place (no value, rename or
        replacement)."""
        return self.removes and not (self.gives_value or self.renames or self.replaces)


@dataclass(frozen=True)
class Instruction:
    text: str
    clauses: tuple
    structural: str | None  # the word that asks for a change across the file (sort, move, merge, ...), or None
    about_text: bool  # about comments or formatting: unchanged data is right
    vocabulary: frozenset = field(default=frozenset(), compare=False)  # set by read_instruction: the file's words

    def sentence(self, clause: Clause) -> str:
        """``clause`` as an instruction of its own: with the first clause's verb when it has none (``set the
        cpu to 1 and the memory to 2`` -> ``set the memory to 2``)."""
        text = clause.text.strip().rstrip(".") + "."
        first = self.clauses[0].text.split()
        own = text.split()[0].lower() if text.split() else ""
        if clause is self.clauses[0] or own in _VERBS or not first or first[0].lower() not in _VERBS:
            return text[0].upper() + text[1:]
        return f"{first[0]} {text}"

    @property
    def expects_change(self) -> bool:
        """Whether unchanged data means the instruction was not applied: it gives a value, removes, enables or
        disables something, or names a word the file lacks; and it is not about comments or formatting."""
        if self.about_text:
            return False
        for clause in self.clauses:
            if clause.gives_value or clause.removes or clause.replaces:
                return True
            if self.vocabulary and any(t not in self.vocabulary for t in clause.terms):
                return True
        return False


def read_instruction(text: str, file_text: str = "") -> Instruction:
    """What ``text`` names, clause by clause (the module docstring says how it is read). ``file_text``: the file
    it is for, whose words tell a new word from a known one."""
    clauses = tuple(_read_clause(p) for p in split_clauses(text)) or (_read_clause(text),)
    structural = _STRUCTURAL.search(text)
    vocabulary = frozenset(atoms(file_text)) if file_text else frozenset()
    return Instruction(text, clauses, structural.group(1).lower() if structural else None,
                       bool(_ABOUT_TEXT.search(text)), vocabulary)


def split_clauses(text: str) -> list[str]:
    """``text`` cut at ``;``, `` and `` and ``, set ...`` (``set the cpu to 1 and the memory to 2``), never
    inside quotes."""
    masked = re.sub(r"(['\"`]).*?\1", lambda m: "x" * len(m.group(0)), text)
    parts, start = [], 0
    for match in _CLAUSE_SPLIT.finditer(masked):
        parts.append(text[start: match.start()])
        start = match.end()
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip(_PUNCT + " ")]


def _read_clause(text: str) -> Clause:
    lits = literals(text)
    lower = [w.lower() for w in lits]
    new, old, context = [], [], []
    # "to false" also gives the text "false": the value of a KEY=VALUE item or a quoted string ("REV_SERVER=true"
    # -> "REV_SERVER=false"); a boolean entry flips through ``booleans``
    spelled = [w for i, w in enumerate(lits) if i and lower[i] in ("true", "false") and lower[i - 1] in _NEW_AFTER]
    removes = any(w in _REMOVE_WORDS for w in lower)
    booleans = any(w in _BOOL_WORDS for w in lower) or bool(re.search(r"\b(turn|switch)\w*\s+(\w+\s+)?(on|off)\b",
                                                                       text, re.IGNORECASE))
    for i, word in enumerate(lower):
        if word in STOPWORDS or word in _BOOL_WORDS:
            continue
        if i and lower[i - 1] in _NEW_AFTER:
            new.append(word)
        elif removes or _anchors(lower, i):
            old.append(word)
        elif _VALUE_LIKE.search(word):  # "use the mysql:8 image": a value, and not one to replace
            new.append(word)
        else:
            context.append(word)
    new_atoms = {a for w in new for a in atoms(w)}
    terms = {a for w, low in zip(lits, lower, strict=True) if low not in STOPWORDS and low not in new
             for a in atoms(w)} - new_atoms - {stem(w) for w in STOPWORDS} - set(_BOOL_WORDS)
    cased = {w.lower(): w for w in lits}
    return Clause(text, frozenset(terms), tuple(old), tuple(context), tuple(new),
                  tuple(cased[w] for w in new) + tuple(spelled),
                  tuple(cased[w] for w in context), all=any(w in _ALL_WORDS for w in lower), removes=removes,
                  renames="rename" in lower, replaces=any(w in _REPLACE_WORDS for w in lower), booleans=booleans)


def _anchors(words: Sequence[str], i: int) -> bool:
    """Whether ``words[i]`` names the value to replace: after replace/remove/from/after/before/rename or
    ``instead of``, or right before ``to`` (``update actions/checkout to v5``; a word there that is no value of
    the file, ``set the level to``, anchors nothing)."""
    before = words[i - 1] if i else ""
    if before == "of":
        return i >= 2 and words[i - 2] == "instead"
    if before in _OLD_AFTER:
        return True
    return i + 1 < len(words) and words[i + 1] == "to"


# --------------------------------------------------------------------------------------------------------------
# The file's entries


@dataclass(frozen=True)
class Entry:
    """One entry of the file that a small section can hold: a ``key: value``, a list item, a one-line flow
    collection."""

    path: tuple  # (document index, key or list index, ...), as yamldata.diff gives paths over documents
    key: Any  # its own key; for a list item, the key of the list (None at the top of a document)
    value: Any  # the loaded value
    first: int  # 1-based first line (the key, or the line of the item's '- ')
    last: int  # 1-based last line
    above: frozenset  # words of the keys above it
    beside: frozenset  # words of the scalar values beside it and beside the mappings above it
    beside_values: tuple  # those values, lowercased
    # a one-line scalar's place in the file, (0-based line, first column, column past its end), and its style
    # (None: plain, "'" or '"'); None for anything else (a block scalar, a flow collection, a multi-line scalar)
    span: tuple | None = None
    style: str | None = None

    @property
    def lines(self) -> str:
        return f"line {self.first}" if self.first == self.last else f"lines {self.first}-{self.last}"

    def key_atoms(self) -> set:
        return set(atoms(str(self.key))) if self.key is not None else set()

    def scalar_texts(self) -> list[str]:
        """The value as texts to match literals against: the scalar, or each scalar of a flow collection."""
        return [str(v).lower() for v in _scalars(self.value)]


def _scalars(value: Any) -> Iterable:
    if isinstance(value, Tagged):
        yield from _scalars(value.value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _scalars(v)
    elif isinstance(value, list):
        for v in value:
            yield from _scalars(v)
    elif value is not None:
        yield value


def find_entries(text: str) -> list[Entry]:
    """The entries of ``text`` in file order (empty when it does not load). Entries under an alias or a merge
    key (``<<``) are left out: their lines belong to the anchor."""
    out: list[Entry] = []
    try:
        for doc, (node, loader) in enumerate(compose_documents(text)):
            _walk(node, loader, (doc,), None, (), (), out, set())
    except yaml.YAMLError:
        return []
    return out


def _last_line(node: yaml.Node) -> int:
    # end_mark is just past the node: at column 0 of the next line after a block scalar
    return node.end_mark.line if node.end_mark.column == 0 else node.end_mark.line + 1


def _walk(node, loader, path, key, above, beside, out, seen):
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        pairs = [(k, v) for k, v in node.value if k.tag != "tag:yaml.org,2002:merge"]
        for knode, vnode in pairs:
            try:
                k = loader.construct_object(knode, deep=True)
            except yaml.YAMLError:
                continue
            # the scalar values of the mapping's other entries say which one it is (name: php-redis)
            here = beside + tuple(str(v.value) for other, v in pairs
                                  if other is not knode and isinstance(v, yaml.ScalarNode))
            if _is_leaf(vnode):
                _add(out, loader, path + (k,), k, vnode, knode.start_mark.line + 1, above, here)
            else:
                _walk(vnode, loader, path + (k,), k, above + (str(k),), here, out, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if _is_leaf(item):
                _add(out, loader, path + (i,), key, item, item.start_mark.line + 1, above, beside)
            else:
                _walk(item, loader, path + (i,), key, above, beside, out, seen)


def _is_leaf(node: yaml.Node) -> bool:
    if isinstance(node, yaml.ScalarNode):
        return True
    return bool(getattr(node, "flow_style", False)) and node.start_mark.line == node.end_mark.line


def _add(out, loader, path, key, vnode, first, above, beside):
    try:
        value = loader.construct_object(vnode, deep=True)
    except yaml.YAMLError:
        return
    words = frozenset(a for b in beside for a in atoms(b))
    span = style = None
    if (isinstance(vnode, yaml.ScalarNode) and vnode.style in (None, "'", '"') and not vnode.tag.startswith("!")
            and vnode.start_mark.line == vnode.end_mark.line):
        span, style = (vnode.start_mark.line, vnode.start_mark.column, vnode.end_mark.column), vnode.style
    out.append(Entry(path, key, value, first, max(first, _last_line(vnode)),
                     frozenset(a for k in above for a in atoms(k)), words, tuple(b.lower() for b in beside),
                     span, style))


# --------------------------------------------------------------------------------------------------------------
# Choosing targets


@dataclass(frozen=True)
class Targets:
    chosen: tuple  # entries the instruction is about, in file order
    ambiguous: tuple  # (clause, (entry, ...)): equally good candidates for a clause, for the model to judge
    clauses: dict = field(default_factory=dict)  # entry path -> the clauses that chose it


def score(clause: Clause, entry: Entry) -> tuple:
    """``(score, anchored)``: how much of ``clause`` names ``entry``, and whether it names the entry itself (only
    such entries can be targets): by its own key, by its value as the one to replace, or by a new value that
    shares a word with its value (``use ubuntu-24.04 for the lint job``: ``runs-on: ubuntu-latest``). A word
    counts once, where it names most."""
    points, used = 0, set()
    own = entry.key_atoms() & clause.terms
    points += 3 * len(own)
    used |= own
    values = entry.scalar_texts()
    by_value = 0
    for lit in clause.old:  # a value named as the one to replace names the entry as well as its key would
        if any(_contains(v, lit) for v in values):
            # the whole value, or the whole KEY of a KEY=VALUE item (``set ADDRESS to ...``: ``ADDRESS=0.0.0.0``
            # over ``ipv4_address``), named exactly: one more
            exact = any(v == lit or v.split("=", 1)[0] == lit for v in values)
            by_value = max(by_value, 3 * len(set(atoms(lit)) - used) + exact)
    value_words = {a for v in values for a in atoms(v) if a.isalpha() and len(a) > 2}
    if not by_value and any(set(atoms(lit)) & value_words for lit in clause.new):
        by_value = 2  # weaker: the new value looks like this one (a word shared, no number)
    points += by_value
    points += len((entry.above & clause.terms) - used)
    used |= entry.above
    points += len({a for a in entry.beside if a in clause.terms} - used)
    used |= entry.beside
    points += sum(1 for lit in clause.context if set(atoms(lit)) - used
                  and any(_contains(v, lit) for v in entry.beside_values))
    return points, bool(own) or by_value > 0


def _contains(value: str, literal: str) -> bool:
    """``literal`` inside ``value`` with no letter or digit on either side (``actions/checkout`` in
    ``actions/checkout@v4``, not ``3.1`` in ``3.13``)."""
    start = value.find(literal)
    while start >= 0:
        end = start + len(literal)
        if (start == 0 or not value[start - 1].isalnum()) and (end == len(value) or not value[end].isalnum()):
            return True
        start = value.find(literal, start + 1)
    return False


def choose_targets(instruction: Instruction, entries: Sequence[Entry]) -> Targets:
    """The entries each clause is about (see the module docstring); none when the instruction names nothing."""
    chosen: list[Entry] = []
    ambiguous = []
    asked: dict = {}
    for clause in instruction.clauses:
        scored = [(score(clause, e), e) for e in entries]
        candidates = [(s, e) for (s, anchored), e in scored if anchored]
        if not candidates:
            continue
        best = max(s for s, _ in candidates)
        tied = [e for s, e in candidates if s == best]
        if len(tied) > 1 and not clause.all and not _same_old_value(clause, tied):
            tied = _closest_to_new(clause, tied)
        if len(tied) > 1 and not clause.all and not _same_old_value(clause, tied):
            ambiguous.append((clause, tuple(tied)))
            continue
        chosen += [e for e in tied if e not in chosen]
        for e in tied:
            asked.setdefault(e.path, []).append(clause)
    order = {e.path: i for i, e in enumerate(entries)}
    return Targets(tuple(sorted(chosen, key=lambda e: order[e.path])), tuple(ambiguous),
                   {path: tuple(c) for path, c in asked.items()})


def _same_old_value(clause: Clause, tied: Sequence[Entry]) -> bool:
    """Every tied entry holds a value the clause names as the one to replace (``instead of master``)."""
    return bool(clause.old) and all(any(_contains(v, lit) for lit in clause.old for v in e.scalar_texts())
                                    for e in tied)


def _closest_to_new(clause: Clause, tied: Sequence[Entry]) -> list[Entry]:
    """The tied entries whose old value has the shape of a new value the clause gives (``'3.13'`` for ``3.14``,
    not ``2``), when one stands out; shapes only, so ``8080`` is no closer to ``9090`` than ``5432`` is."""
    if not clause.new:
        return list(tied)

    def closeness(entry: Entry) -> float:
        texts = entry.scalar_texts() or [""]
        return max(difflib.SequenceMatcher(None, _shape(t), _shape(n)).ratio() for t in texts for n in clause.new)

    marks = [(closeness(e), e) for e in tied]
    top = max(m for m, _ in marks)
    return [e for m, e in marks if m >= top - 0.05]


def _shape(text: str) -> str:
    return re.sub(r"[a-z]+", "a", re.sub(r"\d+", "9", text.lower()))


# --------------------------------------------------------------------------------------------------------------
# Checking changes


def unasked_change(changes: Sequence[Change], instruction: Instruction, targets: Sequence[Entry]) -> str | None:
    """Why one of ``changes`` is not what ``instruction`` asked for (one line), or None when every change is.

    A change is asked for when it lies at a target or next to one (an item of the target's list, a key added
    beside it, or inside its flow collection; anywhere when no entry was chosen) and some clause asks for it:
    the clause names its key (for a list item, the list's key) or names its old value as the one to replace;
    when the clause gives a value, the new value is one it implies (:func:`implied`: ``actions/checkout@v5``
    for ``... to v5``); a removal needs a clause that removes, and a clause that only removes adds nothing; a
    value keeps its type (an int stays a number, a quoted string a string) unless it was empty; a boolean flips
    only when the clause says true, false, enable, disable, on or off.
    """
    for change in changes:
        if targets and not any(near(change, t.path) for t in targets):
            return f"it changes {change}, which the instruction does not name"
        reasons = [_clause_refuses(c, change, targets) for c in instruction.clauses]
        if all(reasons):
            return reasons[0]
    return None


def near(change: Change, target: tuple) -> bool:
    """Whether ``change`` is at the entry at ``target`` or next to it (see :func:`unasked_change`)."""
    path = change.path
    if path[: len(target)] == target:
        return True  # the target itself, or inside its flow collection
    if change.kind == "added" and path[:-1] == target[:-1]:
        return True  # a key or item added beside it
    # an item of a list the target is in (or is an item of): added after it, or removed
    return (len(target) >= len(path) and target[: len(path) - 1] == path[:-1] and _is_item(path)
            and _is_item(target[: len(path)]))


def _own_key(path: tuple) -> Any:
    for part in reversed(path[1:]):
        if not isinstance(part, int) or isinstance(part, bool):
            return part
    return None


def _clause_refuses(clause: Clause, change: Change, targets: Sequence[Entry]) -> str | None:
    key = _own_key(change.path)
    named_key = key is not None and bool(set(atoms(str(key))) & clause.terms)
    old_texts = [str(v).lower() for v in _scalars(change.old)] if change.kind != "added" else []
    named_old = any(_contains(v, lit) for v in old_texts for lit in clause.old)
    target = next((t for t in targets if change.path[: len(t.path)] == t.path), None)
    named_target = target is not None and score(clause, target)[1]
    if not (named_key or named_old or named_target):
        return f"it changes {change}, which the instruction does not name"
    if change.kind == "removed":
        return None if clause.removes or clause.renames else (
            f"it removes {format_path(change.path)}, which the instruction does not ask to remove")
    if change.kind == "added" and clause.only_removes:
        return f"it writes {change}, which an instruction that only removes does not add"
    if isinstance(change.new, bool) or change.kind == "changed" and isinstance(change.old, bool):
        if not clause.booleans:
            return f"it writes {change}, a value the instruction does not give"
    elif clause.gives_value or clause.replaces:
        given = clause.given if clause.gives_value else clause.given + clause.context_given
        if change.kind == "changed" and not _writes_given(change.old, change.new, given, clause.old):
            return f"it writes {change}, a value the instruction does not give"
        if change.kind == "added" and not all(_writes_given(None, v, given) for v in _scalars(change.new)):
            return f"it writes {change}, a value the instruction does not give"
    if change.kind == "changed" and not _same_kind(change.old, change.new):
        return f"it changes the type of {format_path(change.path)} ({change})"
    return None


def _is_item(path: tuple) -> bool:
    return isinstance(path[-1], int) and not isinstance(path[-1], bool)


def _writes_given(old: Any, new: Any, given: Sequence[str], named: Sequence[str] = ()) -> bool:
    """Whether ``new`` is what the clause implies for an entry holding ``old``: one of ``given`` as written (case
    and all) in place of the whole value, or of exactly one component of it (:func:`implied`). ``named``: the
    values the clause names as the ones to replace (lowercased)."""
    text = str(new)
    if not isinstance(old, str):  # a number, a tag, a collection, nothing: only a value given whole
        return text in given
    return any(text in implied(str(old), value, named) for value in given)


def implied(old: str, value: str, named: Sequence[str] = ()) -> set[str]:
    """Every text an entry holding ``old`` may hold after an instruction gives it ``value``: ``value`` itself (the
    whole value replaced) or, for a structured scalar, ``old`` with exactly the component the instruction
    names replaced by ``value`` and the rest kept byte for byte:

    - ``KEY=VALUE`` (cut at the first ``=``): the VALUE side, by a value without ``=`` (``PATH=/usr/bin``, ``set
      PATH to /opt/bin``: ``PATH=/opt/bin``);
    - ``name@ref`` (the last ``@``) and ``name:tag`` (the last ``:``, with a letter before it and no ``/`` after
      it): the ref or tag, by a value without that separator (``actions/checkout@v3`` -> ``@v4``,
      ``nginx:1.25`` -> ``nginx:1.27``, ``localhost:8080`` -> ``localhost:9090``); or, when the instruction
      names a ``/``-segment of the name before its last as the one to replace (``replace docker.io with
      ghcr.io``), that segment, the tag kept;
    - a path ``a/b/c``: only a segment the instruction names as the one to replace, by a value without ``/``;
    - a scalar without those separators: a number or version inside it, by a value of the same shape
      (``ubuntu-22.04`` -> ``ubuntu-24.04`` for ``24.04``, ``18-alpine`` -> ``20-alpine`` for ``20``; not
      ``18-20``), and then not the whole (``24.04`` alone would drop the ``ubuntu-`` the instruction kept). A
      word is never a component: ``admin`` for ``${POSTGRES_USER}`` is ``admin``, not ``${admin_USER}``.

    The whole of a ``KEY=VALUE``, ``name@ref`` or ``name:tag`` is replaced only by a value of the same kind
    (holding that separator): ``set PATH to /opt/bin`` never makes the item ``/opt/bin``, nor ``bump nginx to
    1.27`` the image ``1.27``. A scalar with other colons (``8080:80``, ``127.0.0.1:80``) has no tag: only a
    whole value replaces it.

    Decision: a written value that merely contains ``value`` is no replacement (``PATH=/usr//opt/bin``,
    ``nginx:1.25:1.27``, ``actions/checkout@v3v4`` are not in the set): a wrong write costs a user a broken
    config, a rejection only a retry, so a reading not listed here is rejected rather than guessed.
    """
    if "=" in old:
        key, rest = old.split("=", 1)
        if "=" in value:
            return {value}
        return {f"{key}={v}" for v in implied(rest, value, named)}
    for sep in "@:":
        if sep not in old:
            continue
        cut = old.rfind(sep)
        if sep == ":" and "/" in old[cut:]:
            break  # a scheme (https://...) or a port with a path after it: a path, not a tag
        if sep == ":" and not re.search("[A-Za-z]", old[:cut]):
            return {value} if ":" in value else set()  # a port mapping, an address, a time: no tag to replace
        if sep in value:
            return {value}
        head, tail = old[:cut], old[cut + 1:]
        owner, slash, name = head.rpartition("/")
        # the name's last segment (nginx, checkout) is how the instruction points at the entry, not a part to
        # replace: "bump nginx to 1.27" names nginx and gives the tag
        renamed = {f"{h}{slash}{name}" for h in _named_segment_replaced(owner, value, named)}
        if renamed:  # the instruction names a part of the name (the registry): the tag stays
            return {f"{h}{sep}{tail}" for h in renamed}
        return {f"{head}{sep}{v}" for v in implied(tail, value, named)}
    if "/" in old:
        return {value} | _named_segment_replaced(old, value, named)
    parts = set()
    if not any(c in value for c in _SEPARATORS) and any(c.isdigit() for c in value):
        for match in _RUN.finditer(old):
            if _shape(match.group()) == _shape(value):
                parts.add(old[: match.start()] + value + old[match.end():])
    return parts or {value}  # "to 24.04" for ubuntu-22.04 is ubuntu-24.04, not 24.04


def implied_writes(entry: Entry, clauses: Sequence[Clause]) -> list[str | None]:
    """What ``clauses`` (the ones that chose ``entry``) imply the entry becomes, most direct first and without
    repeats: the new scalar's text for each value a clause gives (:func:`implied`: ``REV_SERVER=false`` for
    ``REV_SERVER=true`` and ``to false``), or None for a clause that only removes. Empty for a clause that gives
    no value (``enable the cache``, ``change the port``, ``replace mariadb``): what to write there is the model's
    to say (the check lets a replacement take any literal the clause names; this list takes only given values)."""
    out: list[str | None] = []
    for clause in clauses:
        if clause.only_removes:
            out.append(None)
            continue
        for value in clause.given if clause.gives_value else ():
            if isinstance(entry.value, str):
                out += sorted(implied(entry.value, value, clause.old), key=lambda v: (v != value, v))
            elif not isinstance(entry.value, (dict, list, Tagged)):
                out.append(value)
    return list(dict.fromkeys(out))


def render_scalar(text: str, style: str | None, old: Any) -> str:
    """``text`` written as a YAML scalar in ``style`` (None: plain, ``'`` or ``"``), as the value it replaces is
    written. A plain string that would load as another type or not at all (``8.6``, ``a: b``) is double-quoted
    so that it stays a string; a number or boolean is written as given (the check refuses a changed type)."""
    if style == '"':
        return json.dumps(text, ensure_ascii=False)
    if style == "'":
        return "'" + text.replace("'", "''") + "'"
    if isinstance(old, str) or old is None:
        try:
            if yaml.safe_load(f"k: {text}\n") == {"k": text}:
                return text
        except yaml.YAMLError:
            pass
        return json.dumps(text, ensure_ascii=False)
    return text


def _named_segment_replaced(path: str, value: str, named: Sequence[str]) -> set[str]:
    """``path`` with one ``/``-segment that ``named`` holds replaced by ``value`` (which holds no separator)."""
    if any(c in value for c in _SEPARATORS):
        return set()
    parts = path.split("/")
    return {"/".join(parts[:i] + [value] + parts[i + 1:]) for i, part in enumerate(parts)
            if part and part.lower() in named}


_SEPARATORS = "=@:/ "  # what structures a scalar (and a blank, which no single component holds)
_RUN = re.compile(r"[A-Za-z0-9]+(?:\.[0-9]+)*")  # a word or a dotted version (v5, 3.13, 10-focal -> 10, focal)


def _same_kind(old: Any, new: Any) -> bool:
    if old is None:
        return True
    number = (int, float)
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if isinstance(old, number) and isinstance(new, number):
        return True
    if isinstance(old, Tagged) or isinstance(new, Tagged):
        return isinstance(old, Tagged) and isinstance(new, Tagged) and old.tag == new.tag
    return type(old) is type(new)
