"""One run of ``lookupdec reformat``: every file read and checked, its sections edited, each result validated and
written on its own.

Nothing is written for a file unless its result validated: to ``show`` (the command's stdout), to ``-o``, or over
the file with ``--in-place`` (keeping ``FILE.bak``), always through ``lookupdec._fs.atomic_write``. A run ends with
a :class:`~lookupdec.reformat.validate.ReformatError` (message and exit code) when it cannot start, when an
instruction's section is rejected at every grain, when an instruction cannot be made section by section (it asks
to sort, move or merge things and the file needs several sections), when the model cannot tell which of several
equally named entries an instruction means, or when a file's result is rejected.

JSON. ``--to json`` serializes the validated YAML result with ``json.dumps``: asked to write JSON itself, the
embedded model got 2 of 14 real config sections right (it invents keys and nests values), and a plain conversion
needs no model at all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from lookupdec._fs import atomic_write

from .editor import Editor, FileFocus, Job, Plan, describe_sections, flatten, plan_sections
from .engine import TokenProgress, compare_methods, open_engine
from .focus import unasked_change
from .sections import join_sections
from .validate import (
    EXIT_REJECTED,
    EXIT_USAGE,
    InputError,
    ReformatError,
    check_writable,
    data_changes,
    describe_edit,
    display_name,
    first_difference,
    load_yaml_documents,
    read_input,
    to_json,
    yaml_error,
)
from .yamldata import diff, same

DEFAULT_BATCH = 4  # sections per batch: on a 2-core CPU lookup still pays at 4 rows (benchmarks/run.py --batch)


@dataclass(frozen=True)
class ReformatOptions:
    """How to edit the files of a run: the command's options, checked by it (these checks only catch misuse)."""

    instruction: str | None = None  # the edit to make; None reformats, keeping every key, value and comment
    to: str = "yaml"  # output format, "yaml" or "json"; the model always works on YAML
    output: Path | None = None  # a file, or with several inputs an existing folder; None: stdout or --in-place
    in_place: bool = False  # replace each input atomically, keeping FILE.bak
    batch: int = DEFAULT_BATCH  # sections (of all files) per batch; outputs do not depend on it, speed does
    model: str | None = None  # hub id, local folder or .gguf file; None: the embedded model
    device: str = "auto"  # where the model runs: auto (CUDA if available), cpu, cuda, cuda:N
    dtype: str = "default"  # default (bf16 on CUDA, fp32 on CPU), auto (the checkpoint's), fp32, bf16, fp16
    max_new_tokens: int | None = None  # per section; None: 1.5x the section's length + 32
    lookup: bool = True  # False: plain model.generate (--no-lookup)
    compare: bool = False  # also time plain decoding and prompt lookup on the run's prompts
    keep_going: bool = False  # with an instruction: keep a rejected section as it was instead of stopping
    quiet: bool = False  # no progress bar (the caller's `say` decides about the other messages)

    def __post_init__(self):
        if self.to not in ("yaml", "json"):
            raise ValueError(f"to must be 'yaml' or 'json', not {self.to!r}")
        if self.batch < 1:
            raise ValueError(f"batch must be at least 1, not {self.batch}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1 or None, not {self.max_new_tokens}")
        if self.output is not None and self.in_place:
            raise ValueError("output and in_place exclude each other")


class Trace:
    """``--trace OUT.html``: the recorder that follows every section's request (not the ``--compare`` reruns),
    and where its HTML goes. Written when the run ends with a result or a rejection, not on an input error or
    Ctrl-C (nothing to see, or half a run); the caller saves it after a rejection."""

    def __init__(self, path: Path, files: Sequence[Path]):
        self.path = path
        self.title = "lookupdec reformat " + " ".join(display_name(f) for f in files)
        self.recorder = None

    def start(self, tokenizer):
        from lookupdec.trace import TraceRecorder

        self.recorder = TraceRecorder(tokenizer, title=self.title)
        return self.recorder

    def save(self, say: Callable[[str], None]) -> None:
        """Write the page (if anything was recorded); ReformatError (exit code 2) when it cannot be written."""
        if self.recorder is None or not self.recorder.requests:
            return
        shown = display_name(self.path)
        try:
            self.recorder.save_html(self.path)
        except OSError as err:
            raise ReformatError(f"{shown}: cannot write the trace ({err.strerror or err})", EXIT_USAGE) from None
        say(f"wrote trace {shown}")


@dataclass
class FileRun:
    """One input file through the run: what was read, where the result goes, and its sections' jobs."""

    path: Path
    shown: str
    output: Path | None
    text: str = ""
    original: list = None  # its YAML documents
    converted: str | None = None  # with --to json: the original as JSON
    plan: Plan | None = None
    pieces: list = None  # (Section, None) for sections copied through, Job for the others, in file order
    focus: FileFocus | None = None  # with an instruction: what it is about in this file


def read_file(file: Path, to: str, output: Path | None, in_place: bool) -> FileRun:
    """Read and check one input (InputError on a problem), before any model is loaded."""
    run = FileRun(file, display_name(file), output)
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
        check_writable(output)
    if in_place:
        check_writable(file)
    return run


def output_for(file: Path, output: Path | None, several: bool, to: str) -> Path | None:
    """Where ``file``'s result goes with ``-o output``: ``output`` itself, or with several files the file's name
    (``.json`` in place of its suffix with ``--to json``) in the folder ``output``."""
    if output is None or not several:
        return output
    name = Path(file).with_suffix(".json").name if to == "json" else Path(file).name
    return output / name


def write_result(text: str, file: Path, output: Path | None, in_place: bool,
                 show: Callable[[str], None]) -> str | None:
    """Write the result where it goes; returns the line telling where it went (None for ``show``, the stdout)."""
    if output is not None:
        with atomic_write(output) as f:
            f.write(text)
        return f"wrote {display_name(output)}"
    if in_place:
        with atomic_write(os.path.realpath(file), backup=True) as f:  # through a symlink, not over it
            f.write(text)
        shown = display_name(file)
        return f"replaced {shown}; the original is in {shown}.bak"
    show(text)
    return None


def reformat_files(files: Sequence[Path], options: ReformatOptions, say: Callable[[str], None],
                   show: Callable[[str], None], trace: Trace | None = None) -> None:
    """Edit ``files`` as ``options`` say. ``say`` gets the progress notes and the summary, one line each; ``show``
    gets the result when it goes to stdout (one file, no ``-o``, no ``--in-place``).

    ReformatError when the run cannot start (an InputError, exit code 2: nothing is written), when an instruction's
    section is rejected (nothing is written) or when a file's result is: with several files the others are still
    written, and the error's ``causes`` are the rejected files' errors.
    """
    several = len(files) > 1
    runs = [read_file(f, options.to, output_for(f, options.output, several, options.to), options.in_place)
            for f in files]
    if trace is not None:
        check_writable(trace.path)

    if options.to == "json" and options.instruction is None:
        # Converting validated data needs no model: json.dumps is exact, and the model gets JSON wrong.
        for run in runs:
            where = write_result(run.converted, run.path, run.output, options.in_place, show)
            say(f"{run.shown}: converted to JSON without the model (nothing for it to do: the data stays as it is)"
                if several else
                "reformat: converted to JSON without the model (nothing for it to do: the data stays as it is)")
            if where:
                say(where)
        return

    engine = open_engine(options.model, progress=not options.quiet, device=options.device, dtype=options.dtype)
    for run in runs:
        run.plan = plan_sections(run.text, engine, options.instruction, options.max_new_tokens, run.shown)
        if options.instruction is not None:
            run.focus = FileFocus(run.text, run.original, options.instruction)
            refuse_structural(run)
    if options.lookup:
        engine.prepare(say)

    # About one token per token of a section, plus the closing fence.
    progress = TokenProgress(total=sum(n + 2 for run in runs for n, s in zip(run.plan.sizes, run.plan.sections,
                                                                              strict=True) if s.edit),
                             enabled=not options.quiet, say=say)
    editor = Editor(engine, options.instruction, "lookup" if options.lookup else "plain", progress,
                    options.keep_going, options.max_new_tokens, progress.write,
                    trace.start(engine.tokenizer) if trace is not None else None, batch=options.batch)
    jobs = []
    for run in runs:
        run.pieces = [Job(section, budget, run.shown, focus=run.focus) if section.edit else (section, None)
                      for section, budget in zip(run.plan.sections, run.plan.budgets, strict=True)]
        jobs += [piece for piece in run.pieces if isinstance(piece, Job)]
    started = time.perf_counter()
    try:
        for run in runs:
            if run.focus is not None and run.focus.ambiguous:
                editor.judge(run.focus, run.shown)
        editor.run(jobs)
    finally:
        progress.close()
    seconds = time.perf_counter() - started

    failures, written = [], []
    for run in runs:
        try:
            result_text, docs = finish_file(run, editor, options.instruction, options.to)
        except ReformatError as err:
            if not several:
                raise
            failures.append(err)
            continue
        written.append((run, write_result(result_text, run.path, run.output, options.in_place, show), docs))
    tokens, passes = progress.tokens, progress.passes
    edited, kept = sum(editor.edited.values()), sum(editor.kept.values())
    say(f"reformat: {tokens} new tokens, {passes} target passes, {tokens / max(passes, 1):.2f} tokens/pass, "
        f"{seconds:.1f} s ({edited} section{'s' * (edited != 1)}, {kept} kept unchanged)")
    for run, where, docs in written:
        if options.instruction is not None:
            told = describe_sections(run.shown, [piece for piece in run.pieces if isinstance(piece, Job)])
            if told:
                say(told)
            for line in describe_edit(run.original, docs):
                say(f"{run.shown}: {line}" if several else line)
    if options.compare:
        compare_methods(engine, editor.completions, say)
    for run, where, docs in written:
        if where:
            say(where)
    if trace is not None and trace.recorder is not None:
        # Batches and retries run sections out of order; the page lists them in file order.
        trace.recorder.requests = [request for run in runs for piece in run.pieces if isinstance(piece, Job)
                                   for request in piece.requests()]
    if failures:
        rest = "the others were written" if written else "nothing was written"
        raise ReformatError(f"{len(failures)} of {len(runs)} files rejected; {rest}", EXIT_REJECTED,
                            causes=failures)  # the caller saves the trace
    if trace is not None:
        trace.save(say)


def refuse_structural(run: FileRun) -> None:
    """ReformatError (exit code 1) when the instruction asks to sort, move or merge things and the file is edited
    in several sections: each section would get its own part of such a change, so the result would be partial."""
    word = run.focus.instruction.structural
    count = sum(section.edit for section in run.plan.sections)
    if word is not None and count > 1:
        raise ReformatError(f"{run.shown}: the instruction asks to {word} things across the file, which cannot be "
                            f"done in the {count} sections this model can edit at once; nothing was written "
                            "(a model with a longer context (--model) can take the file whole)")


def finish_file(run: FileRun, editor: Editor, instruction: str | None, to: str) -> tuple:
    """The validated result text of one file and its data; ReformatError (exit code 1) when it did not validate."""
    shown = run.shown
    if editor.kept[shown] == editor.edited[shown]:
        raise ReformatError(f"{shown}: the model's output was rejected for every section; nothing was written")
    pieces = flatten(run.pieces)
    result_text = join_sections([p[0] for p in pieces], [p[1] for p in pieces])
    try:
        docs = load_yaml_documents(result_text)
    except yaml.YAMLError as err:  # every section parsed, so the join is at fault; never write it
        raise ReformatError(f"{shown}: the joined result is not valid YAML ({yaml_error(err)})\n"
                            f"  first differing line: {first_difference(run.text, result_text)}") from None
    if instruction is None and not same(docs, run.original):
        changes = data_changes(run.original, docs)
        raise ReformatError(f"{shown}: the joined result changes the data\n  first change: "
                            f"{changes[0] if changes else 'a value changed type'}")
    if run.focus is not None:
        # Every section passed this check alone; the joined file passes it as a whole.
        changes = diff(run.original, docs)
        why = unasked_change(changes, run.focus.instruction, run.focus.targets)
        if why is None and not changes and run.focus.instruction.expects_change:
            why = "the model did not apply the instruction (the data is unchanged)"
        if why:
            raise ReformatError(f"{shown}: the joined result is rejected: {why}; nothing was written")
    if to == "json":
        try:
            result_text = to_json(docs[0])
        except ValueError as err:
            raise ReformatError(f"{shown}: the edited data cannot be written as JSON: {err}") from None
    return result_text, docs
