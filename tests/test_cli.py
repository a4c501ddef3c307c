"""`lookupdec reformat`, driven as a user runs it (click's CliRunner on the real command, and one subprocess for a
real Ctrl-C), asserting exit codes, messages and file contents.

Three kinds of test:

- **Embedded model** (`real` fixture, marked slow): where what the model does matters. Reformatting the real
  configs in examples/configs (dependabot, codecov, readthedocs, the README's service.yaml and a CI workflow that
  needs nested sections), the README's instruction edit, -o / --in-place, --to json with an edit, --no-lookup,
  --compare. Greedy decoding is deterministic, so each file's outcome is asserted exactly.
- **Stub engine** (`stub` fixture): only where the test is about file handling or error paths (bad input,
  rejected output, sections and budgets, atomic writes, Ctrl-C). The stub answers by echoing the section (or
  by a function the test gives), so these tests pin the command's behaviour without depending on the model.

The library helpers behind the command (splitting, prompts, fenced-block extraction, validation messages, the
engine's pieces, writing) are tested on their own in test_reformat.py.

Every test runs in its own temporary folder with relative file names, so messages can be compared exactly.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from helpers_costs import fixed_costs

from lookupdec import _fs, cli
from lookupdec.reformat import run as reformat_run
from lookupdec.reformat import validate
from lookupdec.reformat.engine import Completion

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "configs"
SUMMARY = re.compile(r"^reformat: (\d+) new tokens, (\d+) target passes, (\d+\.\d\d) tokens/pass, (\d+\.\d) s "
                     r"\((\d+) sections?, (\d+) kept unchanged\)$", re.MULTILINE)

SERVICE = (CONFIGS / "service.yaml").read_text()


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A fresh working folder holding a copy of service.yaml."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "service.yaml").write_text(SERVICE)
    return tmp_path


def run(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)


def leftovers(folder: Path) -> list:
    """Temporary files lookupdec._fs.atomic_write might have left behind."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# --------------------------------------------------------------------------------------------------------------
# The stub engine


class _Tokens:
    """What a streamer's put() receives, as far as TokenProgress looks at it."""

    def __init__(self, n):
        self.n = n

    def numel(self):
        return self.n


class StubEngine:
    """Stands in for ModelEngine in file-handling tests: it never loads a model. By default it answers with the
    section it was given (a perfect copy); `answer(section, prompt)` can return other text or raise. Tokens are
    words, and every answer counts as one target pass per line, so the summary line is predictable."""

    def __init__(self, answer=None, context=2048):
        self.answer = answer or (lambda section, prompt: section)
        self.context = context
        self.close_fence = True  # False: answers run out of budget before closing their fenced block
        self.sections = []  # the sections asked for, in order
        self.streamed = []  # (new tokens, passes) the streamer was given for each request, the prompt left out
        self.prepared = False

    def count_tokens(self, text):
        return len(text.split())

    def prepare(self, say):
        self.prepared = True  # ModelEngine calibrates its drafter here

    def complete(self, prompt, max_new_tokens, method="lookup", streamer=None, drafter=None):
        user = prompt.messages[-1]["content"]
        section = user[len("```yaml\n"): user.index("\n```\n\n")] + "\n"
        self.sections.append(section)
        body = self.answer(section, prompt)
        answer = f"```yaml\n{body}" + ("```" if self.close_fence else "")
        if streamer is not None:
            streamer.start_request()
            streamer.put(_Tokens(10))  # the prompt, skipped
            passes = [len(line.split()) or 1 for line in body.splitlines()]
            for n in passes:
                streamer.put(_Tokens(n))
            self.streamed.append((sum(passes), len(passes)))
        return Completion(answer, tuple(range(len(body.split()))), len(body.splitlines()), 0.0)


@pytest.fixture
def stub(monkeypatch):
    """Install a StubEngine (returned) as the command's model; `stub.answer = ...` changes its answers."""
    engine = StubEngine()
    monkeypatch.setattr(reformat_run, "open_engine", lambda name, progress, **where: engine)
    return engine


def summary(stderr: str) -> tuple:
    match = SUMMARY.search(stderr)
    assert match, stderr
    tokens, passes, per_pass, _, sections, kept = match.groups()
    return int(tokens), int(passes), float(per_pass), int(sections), int(kept)


# --------------------------------------------------------------------------------------------------------------
# Help, version, usage


def test_help_documents_exit_codes():
    result = run("reformat", "--help")
    assert result.exit_code == 0
    for line in ["0    success", "1    the model's output was rejected", "2    usage or input error",
                 "130  interrupted (Ctrl-C); nothing was written"]:
        assert line in result.stdout
    assert "Exit codes:" in run("--help").stdout


def test_version():
    result = run("--version")
    assert (result.exit_code, result.stdout) == (0, "lookupdec, version 0.1.0\n")


def test_help_does_not_import_torch():
    # `lookupdec --help` must stay instant: the model stack is imported inside the command only.
    code = "import sys, lookupdec.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "False False\n"


@pytest.mark.parametrize("args, message", [
    (["-o", "out.yaml", "--in-place"], "use either -o/--output or --in-place, not both"),
    (["--compare", "--no-lookup"], "--compare times lookup decoding against the others; drop --no-lookup"),
    (["--instruction", "  "], "--instruction is empty"),
    (["--to", "toml"], "'toml' is not one of 'yaml', 'json'"),
    (["--max-new-tokens", "0"], "0 is not in the range x>=1"),
])
def test_usage_errors_exit_2(here, stub, args, message):
    result = run("reformat", "service.yaml", *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert stub.sections == []


# --------------------------------------------------------------------------------------------------------------
# Bad input -> one line, exit 2, file untouched, model never asked (stub)


def test_missing_file(here, stub):
    result = run("reformat", "nope.yaml")
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", "error: nope.yaml: no such file\n")


def test_directory(here, stub):
    (here / "conf").mkdir()
    result = run("reformat", "conf")
    assert (result.exit_code, result.stderr) == (2, "error: conf: is a directory, not a file\n")


def test_unreadable_file(here, stub, monkeypatch):
    (here / "service.yaml").chmod(0)
    if os.geteuid() == 0:  # root reads files whatever their mode; make the read fail as it would for a user
        def read_bytes(path):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(Path, "read_bytes", read_bytes)
    result = run("reformat", "service.yaml")
    assert (result.exit_code, result.stderr) == (2, "error: service.yaml: cannot read it (permission denied)\n")


def test_binary_file(here, stub):
    (here / "blob.yaml").write_bytes(b"key: \x00\x01\x02")
    result = run("reformat", "blob.yaml")
    assert (result.exit_code, result.stderr) == (
        2, "error: blob.yaml: looks like a binary file (it contains NUL bytes), not YAML\n")


def test_non_utf8_file(here, stub):
    (here / "latin1.yaml").write_bytes("name: demo\ncity: Zürich\n".encode("latin-1"))
    result = run("reformat", "latin1.yaml")
    assert (result.exit_code, result.stderr) == (2, "error: latin1.yaml: not UTF-8 text (byte 0xfc at line 2)\n")


def test_invalid_yaml_reports_line_and_column(here, stub):
    (here / "bad.yaml").write_text("server:\n  port: 8080\n  host: [a, b\nlogging: x\n")
    result = run("reformat", "bad.yaml", "--in-place")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: bad.yaml: invalid YAML at line 4, column 8: ")
    assert result.stderr.count("\n") == 1
    assert (here / "bad.yaml").read_text() == "server:\n  port: 8080\n  host: [a, b\nlogging: x\n"
    assert sorted(p.name for p in here.iterdir()) == ["bad.yaml", "service.yaml"]


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(here, stub, content):
    (here / "empty.yaml").write_text(content)
    result = run("reformat", "empty.yaml")
    assert (result.exit_code, result.stderr) == (2, "error: empty.yaml: the file is empty\n")


def test_comments_only(here, stub):
    (here / "notes.yaml").write_text("# nothing here yet\n\n# still nothing\n")
    result = run("reformat", "notes.yaml")
    assert (result.exit_code, result.stderr) == (
        2, "error: notes.yaml: nothing to edit (only comments and blank lines)\n")


def test_file_over_the_byte_limit(here, stub):
    (here / "huge.yaml").write_text("k: v\n" * (validate.MAX_FILE_BYTES // 5 + 1))
    size = (here / "huge.yaml").stat().st_size
    result = run("reformat", "huge.yaml")
    assert (result.exit_code, result.stderr) == (
        2, f"error: huge.yaml: file too large ({size:,} bytes; the limit is "
           f"{validate.MAX_FILE_BYTES:,})\n")
    assert stub.sections == []


def test_block_too_large_even_for_sections(here, stub):
    # A block scalar cannot be cut; with a 400-token context a section may hold (400 - 160 - 32) / 2.5 = 83 tokens.
    stub.context = 400
    words = " ".join(f"w{i}" for i in range(120))
    (here / "long.yaml").write_text(f"a: 1\ntext: |\n  {words}\nb: 2\n")
    result = run("reformat", "long.yaml", "--in-place")
    assert (result.exit_code, result.stderr) == (
        2, "error: long.yaml: too large even for sections: lines 2-3 hold 122 tokens and cannot be split further; "
           "a section may hold 83 (the model's context is 400 tokens)\n")
    assert stub.sections == []
    assert sorted(p.name for p in here.iterdir()) == ["long.yaml", "service.yaml"]


def test_budget_too_small_for_any_section(here, stub):
    result = run("reformat", "service.yaml", "--max-new-tokens", "10")
    assert (result.exit_code, result.stderr) == (
        2, "error: --max-new-tokens 10 is too small for any section (it needs at least 17)\n")


def test_too_large_for_the_user_budget(here, stub):
    # --max-new-tokens 20 leaves 4 tokens (words, for the stub) per section: `server:` is cut into its children,
    # but the line under it cannot be cut.
    (here / "wordy.yaml").write_text("name: demo\nserver:\n  motto: one two three four five six\n  port: 1\n")
    result = run("reformat", "wordy.yaml", "-i", "change the port", "--max-new-tokens", "20")
    assert (result.exit_code, result.stderr) == (
        2, "error: wordy.yaml: too large even for sections: line 3 holds 7 tokens and cannot be split "
           "further; a section may hold 4 (--max-new-tokens 20)\n")
    assert stub.sections == []


def test_model_that_cannot_be_loaded(here):
    result = run("reformat", "service.yaml", "--model", "./missing/model.gguf")
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == "error: cannot load model './missing/model.gguf': no such file\n"


@pytest.mark.parametrize("flags, message", [
    (["--device", "gpu0"], "error: unknown device 'gpu0': "),
    (["--dtype", "fp8"], "Invalid value for '--dtype'"),
] + ([] if torch.cuda.is_available() else [
    (["--device", "cuda"], "error: device 'cuda': CUDA is not available on this machine (use --device cpu)\n"),
]))
def test_a_device_or_dtype_this_machine_lacks_is_a_usage_error(here, flags, message):
    result = run("reformat", "service.yaml", "-i", "change the port", *flags)
    assert result.exit_code == 2 and message in result.stderr
    if message.startswith("error:"):  # ours: one line (click words its own usage errors)
        assert result.stderr.count("\n") == 1
    assert (here / "service.yaml").read_text() == SERVICE


@pytest.mark.parametrize("flags, progress", [([], True), (["--quiet"], False)])
def test_model_loading_shows_progress_unless_quiet(here, monkeypatch, flags, progress):
    from lookupdec import models

    calls = []

    def load_model(name=None, **kwargs):
        calls.append((name, kwargs))
        raise models.ModelLoadError("cannot load model 'org/none': not in the local cache")

    monkeypatch.setattr(models, "load_model", load_model)
    result = run("reformat", "service.yaml", "--model", "org/none", *flags)
    assert calls == [("org/none", {"device": "auto", "dtype": "default", "progress": progress})]
    assert (result.exit_code, result.stderr) == (2, "error: cannot load model 'org/none': not in the local cache\n")


@pytest.mark.parametrize("out, message", [
    ("nowhere/out.yaml", "error: nowhere/out.yaml: folder nowhere does not exist\n"),
    (".", "error: .: is a directory; -o needs a file name\n"),
])
def test_bad_output_path_fails_before_the_model(here, stub, out, message):
    result = run("reformat", "service.yaml", "-o", out)
    assert (result.exit_code, result.stderr) == (2, message)
    assert stub.sections == []


# --------------------------------------------------------------------------------------------------------------
# Rejected model output -> exit 1, nothing written (stub)


def _garble_port(section, prompt):
    return section.replace("port: 8080", "port 8080: [")


def test_rejected_instruction_output_shows_parser_error_and_first_differing_line(here, stub):
    stub.answer = _garble_port
    result = run("reformat", "service.yaml", "-i", "change the port", "--in-place")
    assert result.exit_code == 1
    assert result.stderr == (
        "error: service.yaml: lines 1-17: the model's output is not valid YAML (line 6, column 18: expected ',' "
        "or ']', but got ':')\n"
        "  first differing line: line 4: '  port: 8080' became '  port 8080: ['\n"
        "  nothing was written (--keep-going keeps such a section as it was)\n")
    assert (here / "service.yaml").read_text() == SERVICE
    assert sorted(p.name for p in here.iterdir()) == ["service.yaml"]  # no .bak, no temp file


def test_reformat_keeps_rejected_section_unchanged(here, stub):
    # The server block comes back with a changed value: it is kept as it was, the others are taken.
    stub.answer = lambda section, prompt: section.replace("workers: 4", "workers: 5").replace("  ", "    ")
    result = run("reformat", "service.yaml")
    assert result.exit_code == 0
    lines = result.stderr.splitlines()
    assert lines[:2] == ["service.yaml: lines 1-6: kept unchanged: the model's output changes the data",
                         "  first change: server.workers: 4 -> 5"]
    assert summary(result.stderr)[3:] == (4, 1)
    assert result.stdout.startswith(SERVICE[: SERVICE.index("database:")])  # server block as it was
    assert "database:\n    url: postgres://app@localhost:5432/app\n" in result.stdout  # re-indented by the model
    assert yaml.safe_load(result.stdout) == yaml.safe_load(SERVICE)


def test_reformat_retries_a_rejected_section_in_smaller_parts(here, stub):
    # The "model" garbles the features block as a whole but copies its items one by one.
    stub.answer = lambda section, prompt: "features: [\n" if section.startswith("features:") else section
    result = run("reformat", "service.yaml")
    assert (result.exit_code, result.stdout) == (0, SERVICE)
    assert stub.sections[-4:] == ["features:\n  - search\n  - export\n  - audit-log\n",
                                  "- search\n", "- export\n", "- audit-log\n"]
    assert summary(result.stderr)[3:] == (6, 0)  # server, database, logging, and three items
    assert "kept unchanged:" not in result.stderr


def test_reformat_with_every_section_rejected_exits_1(here, stub):
    stub.answer = lambda section, prompt: "oops: [\n"
    result = run("reformat", "service.yaml", "-o", "out.yaml")
    assert result.exit_code == 1
    assert result.stderr.endswith(
        "error: service.yaml: the model's output was rejected for every section; nothing was written\n")
    # features: is cut into its three items and tried again; nothing else can be cut.
    assert result.stderr.count("kept unchanged: the model's output is not valid YAML") == 6
    assert result.stderr.startswith(
        "service.yaml: lines 1-6: kept unchanged: the model's output is not valid YAML (line 2, column 1: "
        "expected the node content, but found '<stream end>')\n"
        "  first differing line: line 1: '# Example service configuration edited in the README.' became "
        "'oops: ['\n")
    assert not (here / "out.yaml").exists()


def test_cut_off_output_is_rejected(here, stub):
    # An answer whose fence never closes was cut off by the token budget; even if it parses, it may be missing
    # lines, so it is rejected rather than written.
    stub.close_fence = False
    result = run("reformat", "service.yaml", "-i", "change the port")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: service.yaml: lines 1-17: the model's output did not close its fenced "
                                    "block within 36 new tokens\n")


def test_keep_going_keeps_failed_instruction_sections(here, stub):
    # A budget of 40 tokens (24 per section) makes two sections; the one with the server block fails to parse.
    stub.answer = _garble_port
    result = run("reformat", "service.yaml", "-i", "change the port", "--max-new-tokens", "40", "--keep-going")
    assert result.exit_code == 0
    assert result.stdout == SERVICE
    assert "service.yaml: lines 1-10: kept unchanged: the model's output is not valid YAML" in result.stderr
    assert "note: the data is unchanged (right for an edit of formatting or comments" in result.stderr
    assert summary(result.stderr)[3:] == (2, 1)


# --------------------------------------------------------------------------------------------------------------
# Sections (stub)


def test_instruction_sees_the_whole_file_when_it_fits(here, stub):
    result = run("reformat", "service.yaml", "-i", "change the port")
    assert result.exit_code == 0
    assert stub.sections == [SERVICE]


@pytest.mark.parametrize("flag, prepared", [([], True), (["--no-lookup"], False)])
def test_the_drafter_is_calibrated_before_lookup_decoding_only(here, stub, flag, prepared):
    assert run("reformat", "service.yaml", *flag).exit_code == 0
    assert stub.prepared == prepared


def test_reformat_works_on_top_level_blocks(here, stub):
    result = run("reformat", "service.yaml")
    assert result.exit_code == 0
    assert result.stdout == SERVICE
    assert [s.split("\n")[0] for s in stub.sections] == [
        "# Example service configuration edited in the README.", "database:", "logging:", "features:"]
    assert summary(result.stderr)[3:] == (4, 0)


def test_budget_splits_an_instruction_into_sections(here, stub):
    # --max-new-tokens 40: a section holds at most 24 words; blocks are joined up to that.
    result = run("reformat", "service.yaml", "-i", "change the port", "--max-new-tokens", "40")
    assert result.exit_code == 0
    assert [s.split("\n")[0] for s in stub.sections] == [
        "# Example service configuration edited in the README.", "logging:"]
    assert result.stdout == SERVICE


def test_context_splits_documents_and_nested_blocks(here, stub):
    stub.context = 300  # a section may hold (300 - 192) / 2.5 = 43 words
    items = "".join(f"  - name: job{i}\n    run: make target{i} --verbose --jobs 4\n" for i in range(6))
    text = f"# first document\nversion: 2\njobs:\n{items}---\nsecond: document\n"
    (here / "multi.yaml").write_text(text)
    result = run("reformat", "multi.yaml", "-i", "rename the jobs")
    assert result.exit_code == 0
    assert result.stdout == text
    # jobs: is too big, so its list items go to the model one group at a time, dedented to column 0.
    assert stub.sections[0] == "# first document\nversion: 2\n"
    assert all(s.startswith("- name: job") for s in stub.sections[1:-1])
    assert stub.sections[-1] == "second: document\n"


def test_reformat_result_is_indented_back_into_place(here, stub):
    stub.context = 300
    items = "".join(f"  - name: job{i}\n    run: make target{i} --verbose --jobs 4\n" for i in range(6))
    (here / "jobs.yaml").write_text(f"jobs:\n{items}")
    # The "model" re-indents each item (edited at column 0); it comes back under `jobs:` at the old indent.
    stub.answer = lambda section, prompt: section.replace("- ", "-   ").replace("\n  ", "\n    ")
    result = run("reformat", "jobs.yaml")
    assert result.exit_code == 0
    assert result.stdout.startswith("jobs:\n  -   name: job0\n      run: make target0 --verbose --jobs 4\n")
    assert yaml.safe_load(result.stdout) == yaml.safe_load((here / "jobs.yaml").read_text())


# --------------------------------------------------------------------------------------------------------------
# Writing (stub)


def test_output_file(here, stub):
    result = run("reformat", "service.yaml", "-o", "out.yaml")
    assert (result.exit_code, result.stdout) == (0, "")
    assert (here / "out.yaml").read_text() == SERVICE
    assert result.stderr.endswith("wrote out.yaml\n")
    assert leftovers(here) == []


def test_in_place_keeps_a_backup(here, stub):
    stub.answer = lambda section, prompt: section.replace("8080", "9090")
    (here / "service.yaml").chmod(0o640)
    result = run("reformat", "service.yaml", "-i", "change the port", "--in-place")
    assert (result.exit_code, result.stdout) == (0, "")
    assert (here / "service.yaml").read_text() == SERVICE.replace("8080", "9090")
    assert (here / "service.yaml.bak").read_text() == SERVICE
    assert (here / "service.yaml").stat().st_mode & 0o777 == 0o640
    assert result.stderr.splitlines()[1:] == [
        "the data changed in 1 place:",
        "  server.port: 8080 -> 9090",
        "replaced service.yaml; the original is in service.yaml.bak"]
    assert leftovers(here) == []


def test_in_place_through_a_symlink_replaces_the_target(here, stub):
    (here / "real").mkdir()
    shutil.move(here / "service.yaml", here / "real" / "service.yaml")
    (here / "link.yaml").symlink_to(here / "real" / "service.yaml")
    stub.answer = lambda section, prompt: section.replace("8080", "9090")
    assert run("reformat", "link.yaml", "-i", "change the port", "--in-place").exit_code == 0
    assert (here / "link.yaml").is_symlink()
    assert "port: 9090" in (here / "real" / "service.yaml").read_text()
    assert (here / "real" / "service.yaml.bak").read_text() == SERVICE


def test_interrupted_write_leaves_file_and_no_temp(here, stub, monkeypatch):
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "service.yaml":
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(_fs.os, "replace", replace)
    stub.answer = lambda section, prompt: section.replace("8080", "9090")
    result = run("reformat", "service.yaml", "-i", "change the port", "--in-place")
    assert (result.exit_code, result.stderr.splitlines()[-1]) == (130, "interrupted; nothing was written")
    assert (here / "service.yaml").read_text() == SERVICE
    assert leftovers(here) == []


def test_ctrl_c_during_generation(here, stub):
    calls = []

    def answer(section, prompt):
        calls.append(section)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return section

    stub.answer = answer
    result = run("reformat", "service.yaml", "--in-place")
    assert (result.exit_code, result.stdout) == (130, "")
    assert result.stderr == "\ninterrupted; nothing was written\n"
    assert (here / "service.yaml").read_text() == SERVICE
    assert sorted(p.name for p in here.iterdir()) == ["service.yaml"]


def test_real_sigint_during_generation(here):
    # A real Ctrl-C (SIGINT) in a separate process, with a stub engine that blocks in generation.
    driver = textwrap.dedent("""
        import signal, sys, time
        from lookupdec import cli
        from lookupdec.reformat import run

        # Ctrl-C as in a terminal: a shell starts background jobs with SIGINT ignored, and a child inherits that.
        signal.signal(signal.SIGINT, signal.default_int_handler)

        class Slow:
            context = 2048
            def count_tokens(self, text):
                return len(text.split())
            def prepare(self, say):
                pass
            def complete(self, prompt, max_new_tokens, method="lookup", streamer=None, drafter=None):
                print("generating", file=sys.stderr, flush=True)
                time.sleep(60)

        run.open_engine = lambda name, progress, **where: Slow()
        cli.main(["reformat", "service.yaml", "--in-place"])
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=here, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline() == "generating\n"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert (proc.returncode, stdout, stderr) == (130, "", "\ninterrupted; nothing was written\n")
    assert sorted(p.name for p in here.iterdir()) == ["service.yaml"]
    assert (here / "service.yaml").read_text() == SERVICE


def test_to_json_without_instruction_needs_no_model(here, monkeypatch):
    def no_model(name, progress):
        raise AssertionError("a plain conversion must not load the model")

    monkeypatch.setattr(reformat_run, "open_engine", no_model)
    result = run("reformat", "service.yaml", "--to", "json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == yaml.safe_load(SERVICE)
    assert result.stderr == ("reformat: converted to JSON without the model (nothing for it to do: the data "
                             "stays as it is)\n")


def test_to_json_refuses_several_documents_and_dates(here, stub):
    (here / "two.yaml").write_text("a: 1\n---\nb: 2\n")
    (here / "dated.yaml").write_text("released: 2024-05-01\n")
    assert run("reformat", "two.yaml", "--to", "json").stderr == (
        "error: two.yaml: holds 2 YAML documents; JSON output needs exactly one\n")
    result = run("reformat", "dated.yaml", "--to", "json")
    assert (result.exit_code, result.stderr) == (
        2, "error: dated.yaml: JSON cannot hold every value (first: released: datetime.date(2024, 5, 1) -> "
           "\"2024-05-01\"); quote such values in the YAML to keep them as text\n")


def test_quiet_prints_only_the_result(here, stub):
    stub.answer = lambda section, prompt: section.replace("8080", "9090")
    result = run("reformat", "service.yaml", "-i", "change the port", "--quiet")
    assert (result.exit_code, result.stdout, result.stderr) == (0, SERVICE.replace("8080", "9090"), "")


def test_summary_counts_tokens_and_passes(here, stub):
    # The summary adds up what the engine streamed for every section: new tokens, target passes (one per put()
    # after the prompt's) and their ratio. Four sections here, so a count that missed a section, or took a
    # prompt for a pass, would not add up.
    result = run("reformat", "service.yaml")
    assert result.exit_code == 0
    tokens, passes, per_pass, sections, kept = summary(result.stderr)
    assert (sections, kept) == (4, 0) and len(stub.streamed) == 4
    assert (tokens, passes) == (sum(t for t, _ in stub.streamed), sum(p for _, p in stub.streamed))
    assert per_pass == float(f"{tokens / passes:.2f}")


# --------------------------------------------------------------------------------------------------------------
# With the embedded model


@pytest.fixture
def real(smollm2, monkeypatch):
    """The command with the embedded SmolLM2, loaded once per session (conftest's `smollm2`). Its drafter's pass
    costs are set by hand instead of measured, so that how much it drafts does not depend on this machine's speed
    (helpers_costs; the calibration's place in the command is test_the_drafter_is_calibrated_...'s subject)."""
    from lookupdec import calibration, models

    monkeypatch.setattr(models, "load_model", lambda name=None, **kwargs: smollm2)
    monkeypatch.setattr(calibration, "calibrate_or_warn", lambda drafter, model, *args, **kwargs: fixed_costs(drafter))
    return smollm2


# Measured outcome per file (greedy, so deterministic): sections and how many the model's output failed for.
# service.yaml is the README's first command; ci-workflow.yml needs sections cut inside `jobs:` and retried.
REAL_CONFIGS = {"dependabot.yml": (3, 0), "codecov.yml": (3, 0), "readthedocs.yaml": (5, 0), "service.yaml": (4, 0),
                "ci-workflow.yml": (14, 0)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_model_reformats_real_configs(here, real, name):
    shutil.copy(CONFIGS / name, here / name)
    result = run("reformat", name, "--in-place")
    assert (result.exit_code, result.stdout) == (0, ""), result.stderr
    assert (here / f"{name}.bak").read_text() == (CONFIGS / name).read_text()
    original, written = (CONFIGS / name).read_text(), (here / name).read_text()
    assert list(yaml.safe_load_all(written)) == list(yaml.safe_load_all(original))
    tokens, passes, per_pass, sections, kept = summary(result.stderr)
    assert (sections, kept) == REAL_CONFIGS[name]
    assert per_pass > 3  # copying: lookup drafts verify several tokens per pass
    assert sum(1 for ln in original.splitlines() if ln.startswith("#")) == sum(
        1 for ln in written.splitlines() if ln.startswith("#"))  # comments kept


@pytest.mark.slow
@pytest.mark.parametrize("instruction", [
    "Change the server port to 9090.",  # the README's first command, word for word
    "change the server port to 9090",
])
def test_model_applies_an_instruction(here, real, instruction):
    result = run("reformat", "service.yaml", "--instruction", instruction)
    assert result.exit_code == 0, result.stderr
    assert yaml.safe_load(result.stdout) == {**yaml.safe_load(SERVICE),
                                             "server": {**yaml.safe_load(SERVICE)["server"], "port": 9090}}
    assert result.stdout.startswith("# Example service configuration")  # comment kept
    assert result.stderr.endswith("the data changed in 1 place:\n  server.port: 8080 -> 9090\n")
    assert summary(result.stderr)[3:] == (1, 0)


@pytest.mark.slow
def test_model_in_place_and_output_file(here, real):
    result = run("reformat", "service.yaml", "-o", "out.yaml")
    assert (result.exit_code, result.stdout) == (0, "")
    assert yaml.safe_load((here / "out.yaml").read_text()) == yaml.safe_load(SERVICE)
    result = run("reformat", "service.yaml", "-i", "change the server port to 9090", "--in-place")
    assert result.exit_code == 0, result.stderr
    assert yaml.safe_load((here / "service.yaml").read_text())["server"]["port"] == 9090
    assert (here / "service.yaml.bak").read_text() == SERVICE
    assert leftovers(here) == []


@pytest.mark.slow
def test_model_edit_to_json(here, real):
    result = run("reformat", "service.yaml", "-i", "change the server port to 9090", "--to", "json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["server"]["port"] == 9090
    assert data["features"] == ["search", "export", "audit-log"]


@pytest.mark.slow
def test_model_no_lookup_gives_the_same_text(here, real):
    name = "readthedocs.yaml"
    shutil.copy(CONFIGS / name, here / name)
    with_lookup = run("reformat", name)
    plain = run("reformat", name, "--no-lookup")
    assert plain.exit_code == 0
    assert plain.stdout == with_lookup.stdout
    tokens, passes, per_pass, _, _ = summary(plain.stderr)
    assert (tokens, per_pass) == (passes, 1.0)  # plain decoding: one token per pass


@pytest.mark.slow
def test_model_compare(here, real):
    name = "dependabot.yml"
    shutil.copy(CONFIGS / name, here / name)
    result = run("reformat", name, "--compare")
    assert result.exit_code == 0
    assert re.search(r"^compare: lookupdec \d+\.\d s, plain \d+\.\d s \(\d+\.\d\dx\), prompt lookup \d+\.\d s "
                     r"\(\d+\.\d\dx\); same text$", result.stderr, re.MULTILINE), result.stderr


# --------------------------------------------------------------------------------------------------------------
# --trace


def test_trace_needs_lookup_and_a_writable_path(here, stub):
    result = run("reformat", "service.yaml", "--trace", "t.html", "--no-lookup")
    assert result.exit_code == 2 and "--trace records lookup decoding's passes; drop --no-lookup" in result.stderr
    result = run("reformat", "service.yaml", "--trace", "missing/t.html")
    assert (result.exit_code, result.stderr) == (2, "error: missing/t.html: folder missing does not exist\n")
    assert stub.sections == []


@pytest.mark.slow
def test_model_writes_a_trace(here, real):
    result = run("reformat", "service.yaml", "-i", "change the server port to 9090", "--trace", "t.html")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.endswith("wrote trace t.html\n")
    page = (here / "t.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "<title>lookupdec reformat service.yaml</title>" in page
    assert '<h3>service.yaml: lines 1-17</h3><p class="ld-note">validated</p>' in page
    # The text of the trace, rejected draft tokens left out, is the model's answer: the result, then the fence.
    body = page[page.index('<div class="ld-text">'):]
    text = html.unescape(re.sub(r"<[^>]+>", "", re.sub(r'<span class="ld-rej">.*?</span>', "", body, flags=re.DOTALL)))
    assert text.startswith(result.stdout) and text[len(result.stdout):].startswith("```")
    # Drafts that ran past an edit point show their first rejected token struck through (which tokens depends on
    # the lengths the drafter chose, so on the pass costs, set by hand here: the `real` fixture).
    assert re.search(r'<span class="ld-rej">[^<]+</span>', body)
    assert leftovers(here) == []


# --------------------------------------------------------------------------------------------------------------
# Several files, batches


def test_several_files_need_in_place_or_a_folder(here, stub):
    shutil.copy(here / "service.yaml", here / "other.yaml")
    result = run("reformat", "service.yaml", "other.yaml")
    assert result.exit_code == 2
    assert "several files need --in-place or -o FOLDER" in result.stderr
    result = run("reformat", "service.yaml", "other.yaml", "-o", "missing")
    assert result.exit_code == 2
    assert "-o names an existing folder" in result.stderr
    result = run("reformat", "service.yaml", "./service.yaml", "--in-place")
    assert result.exit_code == 2
    assert "named twice" in result.stderr
    assert stub.sections == []  # refused before any model work


def test_several_files_in_place_and_into_a_folder(here, stub):
    shutil.copy(CONFIGS / "dependabot.yml", here / "dependabot.yml")
    result = run("reformat", "service.yaml", "dependabot.yml", "--in-place")
    assert result.exit_code == 0, result.stderr
    for name in ("service.yaml", "dependabot.yml"):
        assert (here / f"{name}.bak").exists()
        assert yaml.safe_load((here / name).read_text()) == yaml.safe_load((here / f"{name}.bak").read_text())
    (here / "out").mkdir()
    result = run("reformat", "service.yaml.bak", "dependabot.yml.bak", "-o", "out", "--to", "json")
    assert result.exit_code == 0, result.stderr
    assert json.loads((here / "out" / "service.yaml.json").read_text()) == yaml.safe_load(SERVICE)
    assert sorted(p.name for p in (here / "out").iterdir()) == ["dependabot.yml.json", "service.yaml.json"]


def test_one_rejected_file_of_several_exits_1_and_the_others_are_written(here, stub):
    (here / "bad.yaml").write_text("alpha: 1\nbeta: 2\n")
    stub.answer = lambda section, prompt: section.replace(": 1", ": 7").replace(": 2", ": 8")
    result = run("reformat", "service.yaml", "bad.yaml", "--in-place")
    assert result.exit_code == 1
    assert "bad.yaml: the model's output was rejected for every section; nothing was written" in result.stderr
    assert "1 of 2 files rejected; the others were written" in result.stderr
    assert (here / "bad.yaml").read_text() == "alpha: 1\nbeta: 2\n" and not (here / "bad.yaml.bak").exists()
    assert (here / "service.yaml.bak").exists()


@pytest.mark.slow
def test_model_batches_give_the_same_files_as_one_section_at_a_time(here, real):
    # The CI workflow has 14 sections (some retried in parts): batching them changes speed, not results.
    names = ["ci-workflow.yml", "codecov.yml"]
    for name in names:
        shutil.copy(CONFIGS / name, here / name)
    (here / "one").mkdir()
    (here / "four").mkdir()
    first = run("reformat", *names, "-o", "one", "--batch", "1")
    second = run("reformat", *names, "-o", "four", "--batch", "4")
    assert first.exit_code == second.exit_code == 0, (first.stderr, second.stderr)
    for name in names:
        assert (here / "one" / name).read_text() == (here / "four" / name).read_text()
        assert yaml.safe_load((here / "four" / name).read_text()) == yaml.safe_load((CONFIGS / name).read_text())
    assert summary(second.stderr)[3:] == summary(first.stderr)[3:]  # same sections, same kept
    assert summary(second.stderr)[1] < summary(first.stderr)[1]  # fewer target passes: rows share them


class BatchingStub(StubEngine):
    """A StubEngine that also takes batches (answering each prompt as `complete` would), and records their sizes."""

    def __init__(self, answer=None):
        super().__init__(answer)
        self.batches = []

    def complete_many(self, prompts, budgets, progress=None, traces=None):
        self.batches.append(len(prompts))
        return [self.complete(p, b) for p, b in zip(prompts, budgets)]


def test_batched_sections_keep_file_order_and_retries(here, monkeypatch):
    # Two files in one batch queue; three sections are rejected and retried in parts in a later round (here the
    # parts are rejected too, so the sections are kept as they were). Results and messages are those of --batch 1.
    from collections import Counter

    shutil.copy(CONFIGS / "dependabot.yml", here / "dependabot.yml")
    seen = Counter()

    def answer(section, prompt):  # an invented comment (rejected) for the larger sections holding these keys
        seen[section] += 1
        big = section.count("\n") > 3 and ("port: 8080" in section or "package-ecosystem" in section)
        return "# invented\n" + section if big else section

    outputs = {}
    for batch in ("1", "4"):
        engine = BatchingStub(answer)
        seen.clear()
        monkeypatch.setattr(reformat_run, "open_engine", lambda name, progress, engine=engine, **where: engine)
        folder = here / f"out{batch}"
        folder.mkdir()
        result = run("reformat", "service.yaml", "dependabot.yml", "-o", folder.name, "--batch", batch)
        assert result.exit_code == 0, result.stderr
        outputs[batch] = {name: (folder / name).read_text() for name in ("service.yaml", "dependabot.yml")}
        if batch == "4":
            assert engine.batches and max(engine.batches) <= 4 and max(engine.batches) > 1
        else:
            assert engine.batches == []
        kept = [line for line in result.stderr.splitlines() if "kept unchanged:" in line]
        outputs[batch]["kept"] = kept
        assert len(kept) == 3 and kept[0].startswith("service.yaml") and len(engine.sections) > 7  # retried
    assert outputs["1"] == outputs["4"]
    assert yaml.safe_load(outputs["4"]["service.yaml"]) == yaml.safe_load(SERVICE)
    assert outputs["4"]["dependabot.yml"] == (CONFIGS / "dependabot.yml").read_text()


def test_several_files_refuse_colliding_outputs(here, stub):
    (here / "a").mkdir()
    (here / "b").mkdir()
    shutil.copy(here / "service.yaml", here / "a" / "x.yaml")
    shutil.copy(here / "service.yaml", here / "b" / "x.yaml")
    (here / "out").mkdir()
    result = run("reformat", "a/x.yaml", "b/x.yaml", "-o", "out")
    assert result.exit_code == 2 and "same name" in result.stderr
    result = run("reformat", "a/x.yaml", "service.yaml", "-o", "a")
    assert result.exit_code == 2 and "overwrite an input" in result.stderr
    assert stub.sections == []
