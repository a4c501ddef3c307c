"""How often ``lookupdec reformat --instruction`` lands a real edit, and how fast, on real configs.

The set is ``benchmarks/edits/``: configs copied from public projects (``configs/``, sources and licences in
``cases.yaml``) and one- or two-value instructions, each with the data the file must hold afterwards, written as
operations on the parsed original (so the expectation is exact). Every case runs the real command in a
subprocess, on a copy of its config in a temporary folder::

    python -m lookupdec.cli reformat CONFIG -i INSTRUCTION -o OUT [--no-lookup]

and is judged on what a user would see:

- ``right``: exit 0 and OUT loads to exactly the expected data (same keys, values and value types; unknown tags
  such as ``!Ref`` or ``!!python/name:`` kept as tag + value). Formatting and comments are not judged; the
  ``comments`` and ``lines`` columns show what was lost or rewritten.
- ``rejected``: exit 1, OUT not written and the config untouched (the honest failure).
- ``refused``: exit 2, the command would not start on the file (e.g. a YAML tag it cannot load).
- ``wrong``: exit 0 but OUT holds other data (``wrote no change`` when it is the original data): a wrong edit
  written. The detail lists what the command changed and what was wanted.
- ``broken``: anything else (another exit code, a timeout, OUT written on a failure, the config modified).

Timing: the same command with ``--no-lookup`` (plain ``model.generate``) runs beside each lookup run, the two in
alternating order, one torch/OpenMP/numba thread each, one process at a time. ``decode s`` is the generation
time the command prints in its summary (``reformat: ... N s``); a rejected run prints none, so there it is timed
from the end of the model load (the loader's last progress line on stderr) to the exit, and marked ``~``.
``speedup`` is plain decode time over lookup decode time for the same prompts. Both runs decode greedily, so they
must give the same result; ``same`` says whether they did (exit code, error line and written bytes).

Writes ``edit_eval.json`` (every run, with the command's error line) and ``edit_eval.md`` (the table and totals)
into ``--out`` (default ``benchmarks/results/``). The target: at least 85 % right and no wrong edit written.

Bench dependency: PyYAML only (already a dependency of lookupdec); tags are kept by a loader defined here.

Examples::

    python -m benchmarks.edit_eval --check                 # validate cases.yaml against the configs, no model
    python -m benchmarks.edit_eval --quick                 # one case per config (22), lookup and plain
    python -m benchmarks.edit_eval                         # all cases; ~1 min per case on one core
    python -m benchmarks.edit_eval --plain quick           # all cases, plain-decoding timing on the quick ones only
    python -m benchmarks.edit_eval --cases k8s-replicas rtd-python --out /tmp/edits
    python -m benchmarks.edit_eval --rejudge benchmarks/results/edit_eval.json   # after fixing an expectation
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from lookupdec.reformat.yamldata import load_documents
from lookupdec.reformat.yamldata import same as same_data

ROOT = Path(__file__).resolve().parent.parent  # the repository whose lookupdec the command runs
EDITS = Path(__file__).resolve().parent / "edits"
OUTCOMES = ("right", "rejected", "refused", "wrong", "broken")
# One thread for every library that may start a pool: the other core belongs to whatever else runs here, and a
# busy second core makes batched (draft-verifying) passes far slower than single-token ones (README, "Thread
# settings").
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false"}


# --------------------------------------------------------------------------------------------------------------
# Comparing loads (lookupdec.reformat.yamldata loads them, unknown tags kept as opaque values)


def changes(old: Any, new: Any, path: str = "") -> list[str]:
    """Every place ``new`` departs from ``old``, one short line each (``spec.replicas: 3 -> 5``, ``removed
    comment``, ``added spec.type: 'LoadBalancer'``); empty when ``same_data``."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in old:
            sub = f"{path}.{key}" if path else str(key)
            out += [f"removed {sub}"] if key not in new else changes(old[key], new[key], sub)
        return out + [f"added {path + '.' if path else ''}{key}: {_short(new[key])}" for key in new if key not in old]
    if isinstance(old, list) and isinstance(new, list):
        out = []
        for i in range(max(len(old), len(new))):
            if i >= len(new):
                out.append(f"removed {path}[{i}]")
            elif i >= len(old):
                out.append(f"added {path}[{i}]: {_short(new[i])}")
            else:
                out += changes(old[i], new[i], f"{path}[{i}]")
        return out
    if same_data(old, new):
        return []
    return [f"{path or '(document)'}: {_short(old)} -> {_short(new)}"]


def document_changes(old: list, new: list) -> list[str]:
    """``changes`` between two lists of documents; with several, paths start with the document (``doc2.spec``)."""
    if len(old) == len(new) == 1:
        return changes(old[0], new[0])
    out = []
    for i in range(max(len(old), len(new))):
        if i >= len(new):
            out.append(f"removed document {i + 1}")
        elif i >= len(old):
            out.append(f"added document {i + 1}")
        else:
            out += changes(old[i], new[i], f"doc{i + 1}")
    return out


def _short(value: Any, width: int = 50) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


# --------------------------------------------------------------------------------------------------------------
# The set


@dataclass(frozen=True)
class Case:
    id: str
    file: str  # in edits/configs/
    kind: str  # from the file's entry: github-workflow, kubernetes, mkdocs (tags), ...
    instruction: str
    ops: tuple  # ({path, value | append | delete, doc?}, ...) turning the original documents into the expected ones
    quick: bool  # one case per file for --quick


def load_set(path: Path = EDITS / "cases.yaml") -> tuple[dict, list[Case]]:
    """``(files, cases)`` of the manifest: ``files`` maps a config's name to its source entry."""
    manifest = yaml.safe_load(path.read_text())
    files = manifest["files"]
    cases = [Case(c["id"], c["file"], files[c["file"]]["kind"], c["instruction"], tuple(c["ops"]),
                  bool(c.get("quick", False))) for c in manifest["cases"]]
    return files, cases


def apply_ops(documents: list, ops) -> list:
    """The expected documents: a deep copy of ``documents`` with ``ops`` applied in order. KeyError, IndexError
    or ValueError when an op does not fit the data (a set or delete must name something that exists)."""
    docs = copy.deepcopy(documents)
    for op in ops:
        *parents, last = op["path"]
        node = docs[op.get("doc", 0)]
        for key in parents:
            node = node[key]
        if "append" in op:
            target = node[last]
            if not isinstance(target, list):
                raise ValueError(f"append to {op['path']}: not a list")
            target.append(op["append"])
        elif op.get("delete"):
            node[last]  # must exist
            del node[last]
        elif "value" in op:
            node[last]  # must exist: a typo in a path must not pass as an added key
            node[last] = op["value"]
        else:
            raise ValueError(f"op {op}: needs value, append or delete")
    return docs


def check_set(files: dict, cases: list[Case]) -> list[str]:
    """Problems with the manifest: configs that do not load, copies that are not the noted blob, ops that do not
    apply or change nothing, duplicate ids, files without a quick case."""
    problems = []
    for name, entry in files.items():
        path = EDITS / "configs" / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        hashed = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, check=False)
        blob = hashed.stdout.strip()
        if blob and blob != entry.get("blob"):
            problems.append(f"{name}: git blob {blob}, the manifest says {entry.get('blob')}")
        try:
            load_documents(path.read_text())
        except yaml.YAMLError as err:
            problems.append(f"{name}: does not load: {str(err).splitlines()[0]}")
    seen = set()
    for case in cases:
        if case.id in seen:
            problems.append(f"{case.id}: duplicate id")
        seen.add(case.id)
        if case.file not in files:
            problems.append(f"{case.id}: unknown file {case.file}")
            continue
        original = load_documents((EDITS / "configs" / case.file).read_text())
        try:
            expected = apply_ops(original, case.ops)
        except (KeyError, IndexError, TypeError, ValueError) as err:
            problems.append(f"{case.id}: an op does not apply ({type(err).__name__}: {err})")
            continue
        if same_data(original, expected):
            problems.append(f"{case.id}: the ops change nothing")
    for name in files:
        if sum(c.quick for c in cases if c.file == name) != 1:
            problems.append(f"{name}: needs exactly one quick case")
    return problems


# --------------------------------------------------------------------------------------------------------------
# Running the command


@dataclass
class Run:
    mode: str  # "lookup" or "plain" (--no-lookup)
    exit_code: int | None  # None: timed out
    wall_s: float  # the whole command: start-up, model load, decoding, writing
    decode_s: float | None = None  # see decode_estimated; None for a refused run (it never decodes)
    decode_estimated: bool = False  # False: the command's own summary figure; True: from the end of the model load
    new_tokens: int | None = None  # from the summary line (a rejected run prints none)
    passes: int | None = None
    error: str = ""  # the command's first "error:" line, without the prefix
    output: str | None = None  # the written result, or None
    input_unchanged: bool = True
    # entries set to the value the instruction gives after every model answer for them was rejected (the
    # command's summary says so per file: "line 14 set to the value the instruction gives")
    from_instruction: int = 0


_SUMMARY = re.compile(r"reformat: (\d+) new tokens, (\d+) target passes, [\d.]+ tokens/pass, ([\d.]+) s")
_FROM_INSTRUCTION = re.compile(r"(lines? [\d, -]+(?:, lines? [\d -]+)*) set to the value the instruction gives")
# The model loader's last progress line: transformers' "Loading weights: 100%|...", else lookupdec's own note.
_LOADED = re.compile(r"Loading weights|loading cached weights|cached converted weights")


def command_env() -> dict:
    env = dict(os.environ, **ONE_THREAD)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_command(config: Path, instruction: str, mode: str, timeout: float) -> Run:
    """One ``lookupdec reformat`` of a fresh copy of ``config`` with ``instruction``, writing to ``-o``."""
    with tempfile.TemporaryDirectory(prefix="edit_eval_") as tmp:
        source = Path(tmp) / config.name
        shutil.copyfile(config, source)
        before = source.read_bytes()
        out = Path(tmp) / f"out{config.suffix}"
        cmd = [sys.executable, "-m", "lookupdec.cli", "reformat", str(source), "-i", instruction, "-o", str(out)]
        if mode == "plain":
            cmd.append("--no-lookup")
        code, lines, wall = timed(cmd, timeout)
        run = Run(mode, code, wall)
        stderr = "\n".join(text for _, text in lines)
        summary = _SUMMARY.search(stderr)
        if summary:
            run.new_tokens, run.passes, run.decode_s = int(summary[1]), int(summary[2]), float(summary[3])
        elif code not in (2, None):
            # A rejection prints no summary: time it from the end of the model load to the exit. That also holds
            # the drafter's calibration lookup, cutting and validating (well under a second), so it is marked.
            loaded = [t for t, text in lines if _LOADED.search(text)]
            if loaded:
                run.decode_s, run.decode_estimated = wall - loaded[-1], True
        errors = [text[len("error: "):] for _, text in lines if text.startswith("error: ")]
        run.error = errors[0] if errors else ("timed out" if code is None else "")
        if code not in (0, None) and not errors:
            run.error = (stderr.strip().splitlines() or [""])[-1][:300]  # a crash: its last line
        run.error = run.error.replace(str(source), config.name)
        run.output = out.read_text(errors="replace") if out.exists() else None
        run.input_unchanged = source.read_bytes() == before
        run.from_instruction = sum(len(m.split(",")) for m in _FROM_INSTRUCTION.findall(stderr))
        return run


def timed(cmd: list, timeout: float) -> tuple[int | None, list, float]:
    """Run ``cmd``: ``(exit code, or None when it ran past timeout and was killed; [(seconds since the start,
    stderr line), ...]; wall seconds)``. stderr is read as it comes, so each line carries the time it was
    printed (a progress bar's line counts from its last state)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace",
                            cwd=ROOT, env=command_env())
    killed = threading.Event()
    timer = threading.Timer(timeout, lambda: (killed.set(), proc.kill()))
    timer.start()
    lines = []
    try:
        for text in proc.stderr:
            lines.append((time.perf_counter() - started, text.rstrip("\n").split("\r")[-1]))
        code = proc.wait()
    finally:
        timer.cancel()
    return (None if killed.is_set() else code), lines, time.perf_counter() - started


# --------------------------------------------------------------------------------------------------------------
# Judging a run


def judge(run: Run, original_text: str, expected: list) -> tuple[str, str]:
    """``(outcome, detail)`` of one run against the expected documents (module docstring: the outcomes)."""
    if not run.input_unchanged:
        return "broken", "the input file was modified"
    if run.exit_code is None:
        return "broken", "timed out"
    if run.exit_code in (1, 2):
        if run.output is not None:
            return "broken", f"exit {run.exit_code} but the output was written"
        return ("rejected" if run.exit_code == 1 else "refused"), run.error
    if run.exit_code != 0:
        return "broken", f"exit {run.exit_code}: {run.error}"
    if run.output is None:
        return "broken", "exit 0 but nothing was written"
    try:
        got = load_documents(run.output)
    except yaml.YAMLError as err:
        return "wrong", f"the written file does not load: {str(err).splitlines()[0]}"
    if same_data(got, expected):
        return "right", ""
    original = load_documents(original_text)
    wanted, done = document_changes(original, expected), document_changes(original, got)
    wrote = "no change" if not done else "; ".join(done[:3]) + (f" (+{len(done) - 3} more)" if len(done) > 3 else "")
    return "wrong", f"wrote {wrote}; wanted {'; '.join(wanted)}"


def comment_lines(text: str) -> list[str]:
    """Comments of a YAML text, roughly (a ``#`` at a line's start or after a blank, quotes ignored): enough to
    count what a rewrite dropped."""
    out = []
    for line in text.splitlines():
        match = re.search(r"(?:^|\s)#(.*)$", line)
        if match:
            out.append(match[1].strip())
    return out


def text_changes(before: str, after: str) -> tuple[int, int]:
    """``(comments dropped, lines changed)`` between the input and the written result."""
    dropped = sum((Counter(comment_lines(before)) - Counter(comment_lines(after))).values())
    diff = difflib.ndiff(before.splitlines(), after.splitlines())
    changed = sum(1 for line in diff if line.startswith("- "))
    return dropped, changed


# --------------------------------------------------------------------------------------------------------------
# The run and its report


@dataclass
class Result:
    id: str
    file: str
    kind: str
    instruction: str
    outcome: str
    detail: str
    lookup: Run
    plain: Run | None = None
    same: bool | None = None  # lookup and plain gave the same exit code, error line and written bytes
    comments_dropped: int | None = None
    lines_changed: int | None = None


def evaluate(case: Case, with_plain: bool, order: int, timeout: float) -> Result:
    config = EDITS / "configs" / case.file
    modes = ["lookup", "plain"] if with_plain else ["lookup"]
    if order % 2:
        modes.reverse()  # alternate which goes first, so drift of the machine hits both alike
    runs = {mode: run_command(config, case.instruction, mode, timeout) for mode in modes}
    return assess(case, runs["lookup"], runs.get("plain"))


def assess(case: Case, lookup: Run, plain: Run | None) -> Result:
    """Judge a case's runs (the lookup run decides the outcome; the plain one is its timing baseline)."""
    text = (EDITS / "configs" / case.file).read_text()
    outcome, detail = judge(lookup, text, apply_ops(load_documents(text), case.ops))
    result = Result(case.id, case.file, case.kind, case.instruction, outcome, detail, lookup, plain)
    if plain is not None:
        result.same = (plain.exit_code, plain.error, plain.output) == (lookup.exit_code, lookup.error, lookup.output)
    if lookup.output is not None and lookup.exit_code == 0:
        result.comments_dropped, result.lines_changed = text_changes(text, lookup.output)
    return result


def totals(results: list[Result]) -> dict:
    n = len(results)
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    speedups, walls, exact = [], [], []
    for r in results:
        if r.plain is None or not r.lookup.decode_s or r.plain.decode_s is None:
            continue  # no plain run, or one of the two never decoded (refused, timed out)
        speedups.append(r.plain.decode_s / r.lookup.decode_s)
        if not (r.lookup.decode_estimated or r.plain.decode_estimated):
            exact.append(speedups[-1])
        walls.append(r.plain.wall_s / r.lookup.wall_s)
    return {
        "cases": n, **counts,
        "right_pct": 100 * counts["right"] / n if n else 0.0,
        "rejected_pct": 100 * counts["rejected"] / n if n else 0.0,
        "refused_pct": 100 * counts["refused"] / n if n else 0.0,
        "wrong_pct": 100 * counts["wrong"] / n if n else 0.0,
        "broken_pct": 100 * counts["broken"] / n if n else 0.0,
        "median_speedup": statistics.median(speedups) if speedups else None,
        "median_speedup_measured": statistics.median(exact) if exact else None,  # summary-line figures only
        "timed_pairs": len(speedups),
        "median_wall_ratio": statistics.median(walls) if walls else None,
        "same_result": sum(bool(r.same) for r in results if r.same is not None),
        "compared": sum(r.same is not None for r in results),
        "meets_target": n > 0 and counts["right"] / n >= 0.85 and counts["wrong"] == 0,
        # right only because an entry was set to the instruction's value after the model's answers failed
        "right_from_instruction": sum(r.outcome == "right" and r.lookup.from_instruction > 0 for r in results),
    }


def _fmt_s(run: Run | None) -> str:
    if run is None:
        return ""
    if run.decode_s is None:
        return f"({run.wall_s:.1f} wall)"
    return f"{'~' if run.decode_estimated else ''}{run.decode_s:.1f}"


def _fmt_x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _cell(text: str, width: int = 120) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."


def markdown(results: list[Result], summary: dict, meta: dict) -> str:
    lines = [
        "# Edit evaluation",
        "",
        (f"{meta['date']}, {meta['machine']}, lookupdec at {meta['commit']}. Command: `{meta['command']}`"
         + (f" (judged again {meta['rejudged']})." if meta.get("rejudged") else ".")),
        "",
        ("| case | kind | instruction | outcome | detail | decode s lookup | decode s plain | speedup | same | "
         "comments dropped | lines changed |"),
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in results:
        speed = ""
        if r.plain is not None and r.lookup.decode_s and r.plain.decode_s is not None:
            estimated = r.lookup.decode_estimated or r.plain.decode_estimated
            speed = f"{'~' if estimated else ''}{r.plain.decode_s / r.lookup.decode_s:.2f}x"
        same = "" if r.same is None else ("yes" if r.same else "**no**")
        lines.append(
            f"| {r.id} | {r.kind} | {_cell(r.instruction, 60)} | {r.outcome} | {_cell(r.detail)} | "
            f"{_fmt_s(r.lookup)} | {_fmt_s(r.plain)} | {speed} | {same} | "
            f"{'' if r.comments_dropped is None else r.comments_dropped} | "
            f"{'' if r.lines_changed is None else r.lines_changed} |")
    s = summary
    lines += [
        "",
        (f"**{s['cases']} cases**: right {s['right']} ({s['right_pct']:.0f} %), rejected {s['rejected']} "
         f"({s['rejected_pct']:.0f} %), refused {s['refused']} ({s['refused_pct']:.0f} %), wrong but written "
         f"{s['wrong']} ({s['wrong_pct']:.0f} %), broken {s['broken']} ({s['broken_pct']:.0f} %)."),
        f"Target (at least 85 % right, no wrong edit written): {'met' if s['meets_target'] else 'not met'}.",
        (f"Of the right ones, {s.get('right_from_instruction', 0)} had an entry set to the value the instruction "
         "gives after every answer of the model for it was rejected."),
        (f"Median lookup speedup over plain decoding: {_fmt_x(s['median_speedup'])} over {s['timed_pairs']} timed "
         f"pairs ({_fmt_x(s['median_speedup_measured'])} where both runs printed their decode time); median "
         f"wall-time ratio {_fmt_x(s['median_wall_ratio'])}. Lookup and plain gave the same result in "
         f"{s['same_result']} of {s['compared']} pairs."),
        "",
        ("Decode seconds are the command's own summary figure; `~`: a rejected run, which prints none, timed from "
         "the end of its model load to its exit; `(N wall)`: the run never decoded (refused), its whole wall time."),
        "",
    ]
    return "\n".join(lines)


def describe_machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, 1 thread per run, Python {platform.python_version()}"


def describe_commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                          check=False)
    if head.returncode != 0:
        return "an unknown commit (not a git checkout)"
    dirty = subprocess.run(["git", "status", "--porcelain", "lookupdec"], capture_output=True, text=True, cwd=ROOT,
                           check=False)
    return head.stdout.strip() + (" + uncommitted changes in lookupdec/" if dirty.stdout.strip() else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one case per config (the ones marked quick)")
    ap.add_argument("--cases", nargs="+", metavar="ID", help="only these cases")
    ap.add_argument("--plain", choices=("all", "quick", "none"), default="all",
                    help="which cases also run with --no-lookup for timing: all (default), the quick ones, none")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                    help="folder for edit_eval.json and edit_eval.md (default benchmarks/results/)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per command before it counts as broken")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed first run")
    ap.add_argument("--check", action="store_true", help="validate cases.yaml against the configs and exit")
    ap.add_argument("--rejudge", type=Path, metavar="JSON",
                    help="judge the runs saved in an edit_eval.json again, against the current cases.yaml, and "
                         "rewrite the reports into --out (no model runs)")
    args = ap.parse_args(argv)

    files, cases = load_set()
    problems = check_set(files, cases)
    if args.check or problems:
        for problem in problems:
            print(f"cases.yaml: {problem}", file=sys.stderr)
        if not problems:
            print(f"cases.yaml: {len(cases)} cases over {len(files)} configs, all consistent")
        return 1 if problems else 0
    if args.rejudge:
        saved = json.loads(args.rejudge.read_text())
        by_id = {c.id: c for c in cases}
        results = [assess(by_id[r["id"]], Run(**r["lookup"]), Run(**r["plain"]) if r["plain"] else None)
                   for r in saved["results"] if r["id"] in by_id]
        meta = dict(saved["meta"], rejudged=time.strftime("%Y-%m-%d %H:%M"))
        write_reports(results, meta, args.out)
        return 0
    if args.cases:
        unknown = set(args.cases) - {c.id for c in cases}
        if unknown:
            ap.error(f"unknown case ids: {', '.join(sorted(unknown))}")
        cases = [c for c in cases if c.id in args.cases]
    elif args.quick:
        cases = [c for c in cases if c.quick]

    print(f"edit_eval: {len(cases)} cases, lookupdec at {describe_commit()}", file=sys.stderr)
    if not args.no_warmup:
        # Fills the OS file cache with the model and, on a machine's first run, the drafter's pass-cost
        # calibration for one thread, so neither lands in the first timed case.
        smallest = min(cases, key=lambda c: (EDITS / "configs" / c.file).stat().st_size)
        run_command(EDITS / "configs" / smallest.file, smallest.instruction, "lookup", args.timeout)

    results = []
    for i, case in enumerate(cases):
        with_plain = args.plain == "all" or (args.plain == "quick" and case.quick)
        result = evaluate(case, with_plain, i, args.timeout)
        results.append(result)
        plain = f", plain {result.plain.wall_s:.1f} s" if result.plain else ""
        print(f"[{i + 1}/{len(cases)}] {case.id}: {result.outcome} ({result.lookup.wall_s:.1f} s{plain}) "
              f"{_cell(result.detail, 100)}", file=sys.stderr)

    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": describe_machine(), "commit": describe_commit(),
            "command": "python -m benchmarks.edit_eval " + " ".join(argv if argv is not None else sys.argv[1:]),
            "threads": ONE_THREAD}
    write_reports(results, meta, args.out)
    return 0


def write_reports(results: list[Result], meta: dict, out: Path) -> None:
    """``edit_eval.json`` (meta, totals, every run) and ``edit_eval.md`` (the table) into ``out``; the table is
    printed too."""
    summary = totals(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "edit_eval.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "results": [asdict(r) for r in results]}, indent=2) + "\n")
    table = markdown(results, summary, meta)
    (out / "edit_eval.md").write_text(table)
    print(table)


if __name__ == "__main__":
    sys.exit(main())
