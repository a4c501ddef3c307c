"""Running the model over a run's sections: how big each may be, what it may spend, and what happens to its answer.

:func:`plan_sections` cuts a file for the run and gives each section its token budget; :class:`Editor` sends the
sections of every file to the model in batches, validates each answer as it comes back, and retries a rejected
section in smaller parts: a reformat one level finer, an edit as the entries the instruction is about
(:class:`FileFocus`), each alone.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import yaml

from .engine import Completion, TokenProgress
from .focus import (
    Entry,
    Instruction,
    choose_targets,
    find_entries,
    implied_writes,
    near,
    read_instruction,
    render_scalar,
    unasked_change,
)
from .prompts import Prompt, build_focused_prompt, build_judge, build_prompt, extract_block, read_choice
from .sections import Section, flat, split_finer, split_sections, trim_blank_lines
from .validate import InputError, ReformatError, check_section, yaml_error
from .yamldata import diff, format_path, load_documents

REFORMAT_SECTION_TOKENS = 80  # the embedded model copies sections up to about this size faithfully
BUDGET_MARGIN = 16  # --max-new-tokens N: a section may hold N - 16 tokens (the fences and some slack)
PROMPT_OVERHEAD = 160  # system prompt, chat template and instruction around a section, in tokens
DEPARTURES = 8  # answers departing from a copied entry that are tried (ModelEngine.departures); each is short


@dataclass
class Plan:
    sections: list[Section]
    budgets: list[int]  # max new tokens per section (0 for sections copied through)
    sizes: list[int]  # tokens per section (0 for sections copied through)


def budget_for(n: int, max_new_tokens: int | None) -> int:
    """New tokens for a section of ``n`` tokens: ``--max-new-tokens`` when given, else ``ceil(1.5 n) + 32`` (room
    for a reformat to finish, and for an edit to grow the text a little)."""
    return max_new_tokens if max_new_tokens is not None else math.ceil(1.5 * n) + 32


def plan_sections(text: str, engine, instruction: str | None, max_new_tokens: int | None,
                  path_shown: str) -> Plan:
    """Split ``text`` for this run and give each section its token budget; InputError when a section cannot be
    made small enough for the model's context or the user's budget.

    A section of ``n`` tokens gets ``ceil(1.5 n) + 32`` new tokens (:func:`budget_for`) unless ``--max-new-tokens``
    says otherwise; with it, a section holds at most ``N - BUDGET_MARGIN`` tokens. The prompt holds the section
    too, so the context fits ``n + 1.5 n + 32`` plus the prompt's own text.
    """
    overhead = PROMPT_OVERHEAD + (engine.count_tokens(instruction) if instruction else 0)
    context_limit = int((engine.context - overhead - 32) / 2.5)
    limit = context_limit if max_new_tokens is None else min(context_limit, max_new_tokens - BUDGET_MARGIN)
    if limit < 1:
        raise InputError(f"--max-new-tokens {max_new_tokens} is too small for any section "
                         f"(it needs at least {BUDGET_MARGIN + 1})")
    target = limit if instruction else min(limit, REFORMAT_SECTION_TOKENS)
    def too_big(t):
        return engine.count_tokens(t) > target

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
        budgets.append(budget_for(n, max_new_tokens))
    if not any(s.edit for s in sections):
        raise InputError(f"{path_shown}: nothing to edit (only comments and blank lines)")
    return Plan(sections, budgets, sizes)


class FileFocus:
    """What an instruction is about in one file, and the check every answer for a section of it passes.

    Read once per file before the run: the file's entries and the ones the instruction names (its targets,
    :mod:`~lookupdec.reformat.focus`). An answer for a section is put back into the whole file and the file
    loaded again, so the changes are seen with their full paths, whatever the section's size.
    """

    def __init__(self, text: str, original: list, instruction: str):
        self.text = text if text.endswith("\n") else text + "\n"
        self.lines = self.text.splitlines(keepends=True)
        self.original = original
        self.instruction: Instruction = read_instruction(instruction, text)
        self.entries: list[Entry] = find_entries(text)
        found = choose_targets(self.instruction, self.entries)
        self.targets: tuple = found.chosen
        self.ambiguous: tuple = found.ambiguous  # settled by Editor.judge before the run
        self.clauses: dict = dict(found.clauses)  # target path -> the clauses that chose it
        self.judged: set = set()  # paths of the targets the model chose between equally named entries

    def untargeted(self) -> list:
        """The instruction's clauses that ask for a change but name no entry of the file: cut into entries, the
        file would get only the other clauses' changes, a partial edit."""
        chosen = {c for clauses in self.clauses.values() for c in clauses}
        return [c for c in self.instruction.clauses if c not in chosen and (c.gives_value or c.removes or c.replaces)]

    def splice(self, section: Section, result: str) -> str:
        """The file with ``section`` replaced by ``result`` (the section's text at column 0)."""
        if result and not result.endswith("\n"):
            result += "\n"
        return "".join(self.lines[: section.line - 1]) + section.place(result) + "".join(
            self.lines[section.last_line:])

    def check(self, section: Section, result: str) -> str | None:
        """Why the file with ``result`` in place of ``section`` is not the edit the instruction asked for, or
        None: it must load, change only what the instruction names (``focus.unasked_change``), and, when the
        instruction expects a change, change every target inside the section."""
        try:
            docs = load_documents(self.splice(section, result))
        except yaml.YAMLError as err:
            return f"the model's output does not fit back into the file ({yaml_error(err)})"
        changes = diff(self.original, docs)
        instruction = self.instruction
        if not changes:
            concerned = bool(self.targets_in(section)) or not self.targets
            return ("the model did not apply the instruction (the data is unchanged)"
                    if instruction.expects_change and concerned else None)
        why = unasked_change(changes, instruction, self.targets)
        if why:
            return f"the model's output is a wrong edit: {why}"
        if instruction.expects_change:
            for target in self.targets_in(section):
                if not any(near(c, target.path) for c in changes):
                    return f"the model did not apply the instruction to {format_path(target.path[1:])}"
        return None

    def ask(self, section: Section) -> str:
        """What the model is asked for a section cut around targets: the clauses that chose them (the model
        mixes up the values of a two-value instruction when it sees both), else the whole instruction."""
        clauses = [c for t in self.targets_in(section) for c in self.clauses.get(t.path, ())]
        if not clauses or len(clauses) == len(self.instruction.clauses):
            return self.instruction.text
        unique = list(dict.fromkeys(clauses))
        return " ".join(self.instruction.sentence(c) for c in unique)

    def implied_answers(self, section: Section) -> list[str]:
        """Answers for a focused ``section`` (one entry at column 0) written from what the instruction gives
        rather than by the model: the entry's one-line scalar replaced, in place and in its own quoting, by each
        value the clauses that chose it imply (``focus.implied_writes``), or the entry taken out for a clause
        that only removes. Whether one is right is still for :meth:`check` to say. None for an entry the model
        chose between equally named ones (:meth:`Editor.judge`): the instruction's value is written only where
        the instruction itself points (the judge once picked another service's volume for "the db volume")."""
        inside = self.targets_in(section)
        if len(inside) != 1 or inside[0].first != section.line or inside[0].path in self.judged:
            return []
        target = inside[0]
        answers = []
        for new in implied_writes(target, self.clauses.get(target.path, self.instruction.clauses)):
            if new is None:
                answers.append("")
                continue
            if target.span is None:
                continue
            line, start, end = target.span
            lines = section.text.splitlines(keepends=True)
            row, cut = line + 1 - section.line, len(section.indent)
            text = lines[row]
            lines[row] = text[: start - cut] + render_scalar(new, target.style, target.value) + text[end - cut:]
            answers.append("".join(lines))
        return answers

    def targets_in(self, section: Section) -> list[Entry]:
        return [t for t in self.targets if section.line <= t.first and t.last <= section.last_line]

    def focused_sections(self, section: Section) -> list[Section] | None:
        """``section`` cut into the entries the instruction is about (each a section of its own, at column 0) and
        the lines between them (copied through); None when it holds no target."""
        inside = self.targets_in(section)
        if not inside:
            return None
        out: list[Section] = []
        line = section.line
        for target in inside:
            if target.first < line:
                continue  # two targets on one line (a flow collection's items): the first one's section has it
            if target.first > line:
                out.append(Section("".join(self.lines[line - 1: target.first - 1]), "", line, edit=False))
            lines = self.lines[target.first - 1: target.last]
            indent = lines[0][: len(lines[0]) - len(lines[0].lstrip(" "))]
            if any(ln.strip() and not ln.startswith(indent) for ln in lines):
                return None
            text = "".join(ln[len(indent):] if ln.strip() else ln for ln in lines)
            out.append(Section(text, indent, target.first, edit=True))
            line = target.last + 1
        if line <= section.last_line:
            out.append(Section("".join(self.lines[line - 1: section.last_line]), "", line, edit=False))
        return out


class Job:
    """One section to ask the model for; ``pieces`` becomes its result: ``(Section, text or None)`` pairs and, for
    a section cut finer after a rejection, the jobs of its parts, in file order."""

    def __init__(self, section: Section, budget: int, shown: str, depth: int = 0, focus: FileFocus | None = None,
                 parent: Job | None = None, focused: bool = False):
        self.section, self.budget, self.shown, self.depth = section, budget, shown, depth
        self.focus = focus  # with an instruction: the file's focus, which checks every answer
        self.parent = parent  # the job this one is a part of
        self.focused = focused  # an entry the instruction is about, asked with the focused prompt
        self.from_instruction = False  # its answer was written from the instruction's value (Editor._implied)
        self.pieces: list = []
        self.request = None  # its trace request, when tracing
        self.more_requests: list = []  # trace requests of the answers tried after it (departures)
        self.rejected: str | None = None  # why its own answer was rejected (when it was retried in parts)
        self.outcome = ""  # "edited", "retried", "kept" (given up), "left" (not about the instruction)

    def top(self) -> Job:
        return self if self.parent is None else self.parent.top()

    def requests(self) -> list:
        """Trace requests of this job and its parts, in file order."""
        out = ([self.request] if self.request is not None else []) + self.more_requests
        for piece in self.pieces:
            out += piece.requests() if isinstance(piece, Job) else []
        return out

    def flat(self) -> list[tuple]:
        return flatten(self.pieces)

    def parts(self) -> list[Job]:
        return [piece for piece in self.pieces if isinstance(piece, Job)]


def flatten(pieces: Sequence) -> list[tuple]:
    """``(Section, text or None)`` pairs of ``pieces`` in file order, the jobs among them expanded."""
    out = []
    for piece in pieces:
        out += piece.flat() if isinstance(piece, Job) else [piece]
    return out


def describe_sections(shown: str, jobs: Sequence[Job]) -> str | None:
    """One line telling what happened to each section of a file the model was asked about: ``service.yaml:
    lines 1-17 retried at finer grain (the model's output is not valid YAML): line 4 edited``. None when
    there is nothing to tell beyond "the whole file was edited"."""
    if len(jobs) == 1 and jobs[0].outcome == "edited":
        return None
    said = []
    for job in jobs:
        lines = job.section.lines
        if job.outcome == "retried":
            edited = [p for p in job.parts() if p.outcome == "edited"]
            given = [p.section.lines for p in edited if p.from_instruction]
            by_model = [p.section.lines for p in edited if not p.from_instruction]
            done = [f"{', '.join(by_model)} edited"] if by_model else []
            if given:
                done.append(f"{', '.join(given)} set to the value the instruction gives")
            said.append(f"{lines} retried at finer grain ({job.rejected.splitlines()[0]}): "
                        f"{'; '.join(done) or 'nothing edited'}, the rest left as it was")
        elif job.outcome == "left":
            said.append(f"{lines} left as {'it was' if job.section.line == job.section.last_line else 'they were'} "
                        "(the instruction is not about them)")
        elif job.outcome == "kept":
            said.append(f"{lines} kept unchanged (rejected)")
        else:
            said.append(f"{lines} edited")
    return f"{shown}: " + "; ".join(said)


class Editor:
    """Asks the model for every section and validates the answers; counts what it did for the summary.

    Sections go to the model in batches of up to ``batch`` (one ``lookupdec.generate`` call per batch, sections
    of several files mixed), each answer exactly what the section alone would get. A rejected section is cut
    into smaller sections that join the next round of batches (the model copies small ones better):

    - in a reformat, one level finer, down to pieces that cannot be cut; those are kept as they were;
    - with an instruction, into the entries the instruction is about (its targets), each asked alone with the
      focused prompt; the rest of the section stays byte for byte. An entry whose answer is rejected (or copies
      it unchanged) is tried again from the model's most likely answers that depart from its first one
      (``engine.departures``, when the engine has it). A section the instruction is not about is left as it
      was. An instruction that names nothing in the file is retried on every part, one level finer; one that
      asks for a change across the file (sort, move, ...) is not retried. When an entry cannot be edited, its
      whole section is given up: the run stops with the section's first rejection unless ``keep_going``, which
      keeps that section as it was.
    """

    def __init__(self, engine, instruction: str | None, method: str, progress: TokenProgress | None,
                 keep_going: bool, max_new_tokens: int | None, say: Callable[[str], None], trace=None,
                 batch: int = 1):
        self.engine, self.instruction, self.method, self.progress = engine, instruction, method, progress
        self.keep_going, self.max_new_tokens, self.say = keep_going, max_new_tokens, say
        self.trace = trace  # a TraceRecorder for --trace, or None
        self.batch = batch
        self.completions: list[tuple] = []  # (prompt, budget, Completion) of every request, for --compare
        self.edited = Counter()  # per file shown: sections whose result is the model's or that were kept
        self.kept = Counter()

    def judge(self, focus: FileFocus, shown: str) -> None:
        """Settle ``focus``'s ambiguous clauses (several entries named equally well) by asking the model which
        one each means; ReformatError when its answer names none of them."""
        for clause, entries in focus.ambiguous:
            candidates = [f"{format_path(e.path[1:])}: {focus.lines[e.first - 1].strip()}" for e in entries]
            prompt = build_judge(clause.text, candidates)
            done = self.engine.complete(prompt, 8, method=self.method)
            self.completions.append((prompt, 8, done))
            choice = read_choice(done.answer, len(entries))
            if choice is None:
                named = " or ".join(f"{format_path(e.path[1:])} ({e.lines})" for e in entries)
                raise ReformatError(f"{shown}: the instruction could mean {named}; say which (nothing was written)")
            focus.targets = tuple(sorted(focus.targets + (entries[choice],), key=lambda e: e.first))
            focus.judged.add(entries[choice].path)
            focus.clauses[entries[choice].path] = (clause,)
        focus.ambiguous = ()

    def run(self, jobs: Sequence[Job]) -> None:
        """Fill in every job's ``pieces``. Each batch is validated as soon as it returns (a rejected edit stops
        the run there); the parts of rejected sections go to the next round."""
        queue = list(jobs)
        while queue:
            following = []
            for start in range(0, len(queue), self.batch):
                chunk = [job for job in queue[start: start + self.batch] if not self._abandoned(job)]
                if not chunk:
                    continue
                for job, (done, request) in zip(chunk, self._complete(chunk), strict=True):
                    job.request = request
                    following += self._settle(job, done, request)
            queue = [job for job in following if not self._abandoned(job)]

    @staticmethod
    def _abandoned(job: Job) -> bool:
        return job.parent is not None and job.top().outcome == "kept"

    def _prompt(self, job: Job) -> Prompt:
        if job.focused:
            return build_focused_prompt(job.section.text, job.focus.ask(job.section))
        return build_prompt(job.section.text, self.instruction)

    def _complete(self, jobs: Sequence[Job], prompts: Sequence[Prompt] | None = None) -> list[tuple]:
        """``[(Completion, trace request or None), ...]`` for ``jobs`` (or ``prompts`` for them), batched when the
        engine can."""
        prompts = list(prompts) if prompts is not None else [self._prompt(job) for job in jobs]
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

    def _recorder(self, job: Job):
        recorder = type(self.trace)(self.trace.tokenizer, title=self.trace.title)
        recorder.label = f"{job.shown}: {job.section.lines}"
        return recorder

    def _reason(self, job: Job, done: Completion) -> tuple:
        """``(result, reason)``: the answer's block, and why it is rejected (None when it validates)."""
        result, closed = extract_block(done.answer)
        if not closed:
            return result, f"the model's output did not close its fenced block within {len(done.token_ids)} new tokens"
        return result, self._invalid(job, result)

    def _invalid(self, job: Job, result: str) -> str | None:
        """Why ``result`` is not a valid answer for ``job``'s section, or None. An empty answer for one entry
        takes the entry out, which the file's check judges (a removal the instruction asks for, or not)."""
        if job.focused and not result.strip():
            return job.focus.check(job.section, "")
        reason = check_section(job.section.text, result, self.instruction)
        if reason is None and job.focus is not None:
            reason = job.focus.check(job.section, trim_blank_lines(result))
        return reason

    def _settle(self, job: Job, done: Completion, request) -> list[Job]:
        """Validate ``job``'s answer and set its pieces; returns the jobs of its parts when it is cut finer."""
        section = job.section
        result, reason = self._reason(job, done)
        if request is not None:
            request.note = "validated" if reason is None else f"rejected: {reason.splitlines()[0]}"
        if reason is not None and job.focused and hasattr(self.engine, "departures"):
            result, reason = self._depart(job, done, reason)
        if reason is not None and job.focused:
            result, reason = self._implied(job, result, reason)
        if reason is None:
            self.edited[job.shown] += 1
            job.outcome = "edited"
            job.pieces = [(section, trim_blank_lines(result))]
            return []
        if self.instruction is not None:
            return self._retry_edit(job, reason)
        where = f"{job.shown}: {section.lines}"
        if job.depth < 3:
            parts = split_finer(section, self.engine.count_tokens)
            if parts:
                return self._cut(job, parts)
        self.edited[job.shown] += 1
        self.kept[job.shown] += 1
        job.outcome = "kept"
        self.say(f"{where}: kept unchanged: {reason}")
        job.pieces = [(section, None)]
        return []

    def _cut(self, job: Job, parts: list, focus: FileFocus | None = None, focused: bool = False) -> list[Job]:
        """Retry ``job`` as ``parts`` (sections in file order): a job for each part to edit, the others kept as
        they are; returns the new jobs."""
        job.outcome = "retried"
        for part in parts:
            if not part.edit:
                job.pieces.append((part, None))
                continue
            budget = budget_for(self.engine.count_tokens(part.text), self.max_new_tokens)
            job.pieces.append(Job(part, budget, job.shown, job.depth + 1, focus, job, focused=focused))
        return job.parts()

    def _implied(self, job: Job, result: str, reason: str) -> tuple:
        """The model's answers for a focused entry were rejected: ``(answer, None)`` for an answer written from the
        value the instruction gives (:meth:`FileFocus.implied_answers`) that passes the same check, else ``(result,
        reason)`` unchanged, also when several pass (``replace local with opt`` in ``/usr/local/bin``: ``opt`` or
        ``/usr/opt/bin``; the embedded model's likelihoods preferred the shorter, so they are no judge here).

        Decision: a small model often knows which entry to change and still misspells the value it was given
        (``grafana/grafana-11.1.0.0`` for ``grafana/grafana:11.1.0``); the value itself is in the instruction, so
        it is written from there. Nothing passes here that the check would refuse from the model."""
        valid = [a for a in job.focus.implied_answers(job.section) if self._invalid(job, a) is None]
        if len(valid) != 1:
            return result, reason  # none, or several readings (the whole value or a part of it): not guessed
        if job.request is not None:
            job.request.note += "; written with the value the instruction gives"
        job.from_instruction = True
        return valid[0], None

    def _depart(self, job: Job, done: Completion, reason: str) -> tuple:
        """The first of the model's answers departing from ``done`` that validates, as ``(result, None)``; else
        ``(None, reason)``. They are asked one at a time in the engine's order (most likely first), stopping at
        the first that validates: each shares a long prompt, so asking all of them in one batch cost more (12 s
        for 8 on one CPU thread) than the one or two usually needed."""
        first = self._prompt(job)
        for n, start in enumerate(self.engine.departures(first, done, DEPARTURES)):
            attempt = Job(job.section, job.budget, job.shown, job.depth, job.focus, job.parent, True)
            prompt = Prompt(first.messages, start)
            [(answer, request)] = self._complete([attempt], [prompt])
            result, why = self._reason(attempt, answer)
            if request is not None:
                request.label += f" (try {n + 2})"
                request.note = "validated" if why is None else f"rejected: {why.splitlines()[0]}"
                job.more_requests.append(request)
            if why is None:
                return result, None
        return None, reason

    def _retry_edit(self, job: Job, reason: str) -> list[Job]:
        """A rejected section of an edit: cut into the entries the instruction is about, left as it was when it
        holds none, cut one level finer when the instruction names no entry of the file; else given up."""
        focus, section = job.focus, job.section
        if job.parent is not None:
            return self._give_up(job.top())
        job.rejected = reason
        instruction = focus.instruction if focus is not None else None
        if instruction is not None and instruction.structural is None and not focus.untargeted():
            parts = focus.focused_sections(section)
            focused = parts is not None
            if parts is None and focus.targets:  # the instruction is about other sections: leave this one
                self.edited[job.shown] += 1
                self.kept[job.shown] += 1
                job.outcome = "left"
                job.pieces = [(section, None)]
                return []
            if parts is None:  # it names no entry of the file: every part of the section is its concern
                parts = split_finer(section, self.engine.count_tokens)
            if parts:
                if job.request is not None:
                    job.request.note += "; retried at finer grain"
                return self._cut(job, parts, focus, focused)
        return self._give_up(job)

    def _give_up(self, top: Job) -> list[Job]:
        """``top`` (a section of the plan) cannot be edited: stop the run with its first rejection, or with
        ``keep_going`` keep it as it was (counting its parts' edits back out)."""
        where = f"{top.shown}: {top.section.lines}"
        reason = top.rejected or "the model's output was rejected"
        instruction = top.focus.instruction if top.focus is not None else None
        if instruction is not None and instruction.structural is not None:
            reason += (f"\n  the instruction asks to {instruction.structural} things, which cannot be done in "
                       "smaller sections")
        elif instruction is not None and top.focus.untargeted():
            reason += (f"\n  {top.focus.untargeted()[0].text.rstrip('.')!r} names no key or value of the file, so it "
                       "cannot be done in smaller sections")
        if not self.keep_going:
            raise ReformatError(f"{where}: {reason}\n  nothing was written (--keep-going keeps such a section as it "
                                "was)")
        self.edited[top.shown] -= sum(1 for part in top.parts() if part.outcome == "edited")
        self.edited[top.shown] += 1
        self.kept[top.shown] += 1
        top.outcome = "kept"
        top.pieces = [(top.section, None)]
        self.say(f"{where}: kept unchanged: {reason}")
        return []
