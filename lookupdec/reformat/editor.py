"""Running the model over a run's sections: how big each may be, what it may spend, and what happens to its answer.

:func:`plan_sections` cuts a file for the run and gives each section its token budget; :class:`Editor` sends the
sections of every file to the model in batches, validates each answer as it comes back, and retries a rejected
reformat section in smaller parts.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .engine import Completion, TokenProgress
from .prompts import build_prompt, extract_block
from .sections import Section, flat, split_finer, split_sections, trim_blank_lines
from .validate import InputError, ReformatError, check_section

REFORMAT_SECTION_TOKENS = 80  # the embedded model copies sections up to about this size faithfully
BUDGET_MARGIN = 16  # --max-new-tokens N: a section may hold N - 16 tokens (the fences and some slack)
PROMPT_OVERHEAD = 160  # system prompt, chat template and instruction around a section, in tokens


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
        budgets.append(budget_for(n, max_new_tokens))
    if not any(s.edit for s in sections):
        raise InputError(f"{path_shown}: nothing to edit (only comments and blank lines)")
    return Plan(sections, budgets, sizes)


class Job:
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
            out += piece.requests() if isinstance(piece, Job) else []
        return out

    def flat(self) -> list[tuple]:
        return flatten(self.pieces)


def flatten(pieces: Sequence) -> list[tuple]:
    """``(Section, text or None)`` pairs of ``pieces`` in file order, the jobs among them expanded."""
    out = []
    for piece in pieces:
        out += piece.flat() if isinstance(piece, Job) else [piece]
    return out


class Editor:
    """Asks the model for every section and validates the answers; counts what it did for the summary.

    Sections go to the model in batches of up to ``batch`` (one ``lookupdec.generate`` call per batch, sections
    of several files mixed), each answer exactly what the section alone would get. In a reformat, a section whose
    answer is rejected is cut into smaller sections that join the next round of batches (the model copies small
    ones better), down to pieces that cannot be cut; those are kept as they were. With an instruction, a
    rejected section stops the run unless ``keep_going``.
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

    def run(self, jobs: Sequence[Job]) -> None:
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

    def _complete(self, jobs: Sequence[Job]) -> list[tuple]:
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

    def _recorder(self, job: Job):
        recorder = type(self.trace)(self.trace.tokenizer, title=self.trace.title)
        recorder.label = f"{job.shown}: {job.section.lines}"
        return recorder

    def _settle(self, job: Job, done: Completion, request) -> list[Job]:
        """Validate ``job``'s answer and set its pieces; returns the jobs of its parts when it is cut finer."""
        section = job.section
        result, closed = extract_block(done.answer)
        reason = check_section(section.text, result, self.instruction) if closed else (
            f"the model's output did not close its fenced block within {len(done.token_ids)} new tokens")
        if request is not None:
            request.note = "validated" if reason is None else f"rejected: {reason.splitlines()[0]}"
        if reason is None:
            self.edited[job.shown] += 1
            job.pieces = [(section, trim_blank_lines(result))]
            return []
        where = f"{job.shown}: {section.lines}"
        if self.instruction is not None:
            if not self.keep_going:
                raise ReformatError(f"{where}: {reason}\n  nothing was written (--keep-going keeps such a section "
                                    "as it was)")
        elif job.depth < 3:
            parts = split_finer(section, self.engine.count_tokens)
            if parts:
                for part in parts:
                    if not part.edit:
                        job.pieces.append((part, None))
                        continue
                    budget = budget_for(self.engine.count_tokens(part.text), self.max_new_tokens)
                    job.pieces.append(Job(part, budget, job.shown, job.depth + 1))
                return [piece for piece in job.pieces if isinstance(piece, Job)]
        self.edited[job.shown] += 1
        self.kept[job.shown] += 1
        self.say(f"{where}: kept unchanged: {reason}")
        job.pieces = [(section, None)]
        return []
