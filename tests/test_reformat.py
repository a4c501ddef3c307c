"""The library behind `lookupdec reformat`, without the command: splitting a file into sections, prompts and
fenced-block extraction, validation messages, the engine's pieces (progress bar, fence stop, batches), and writing a
result. The command itself, driven as a user runs it, is tested in test_cli.py.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch

from lookupdec import _fs
from lookupdec.reformat.engine import FenceStop, ModelEngine, TokenProgress
from lookupdec.reformat.prompts import SYSTEM_EDITOR, build_prompt, extract_block
from lookupdec.reformat.run import write_result
from lookupdec.reformat.sections import (
    Section,
    flat,
    join_sections,
    split_finer,
    split_sections,
)
from lookupdec.reformat.validate import check_section, comments, data_changes

# --------------------------------------------------------------------------------------------------------------
# Sections


def test_split_sections_join_back_exactly():
    text = ("# head\n\nversion: 2\n\n# about a\na:\n  b: 1\n\n  c:\n    - x\n    - y\n# tail\n---\nz: [1,\n  2]\n"
            "...\n")
    for limit in (1, 3, 1000):
        sections = split_sections(text, lambda t, limit=limit: len(t.split()) > limit)
        assert join_sections(sections, [None] * len(sections)) == text


def test_split_sections_attach_comments_to_the_next_block():
    text = "# top\na: 1\n\n# about b\nb:\n  c: 2\n# trailing\n"
    sections = split_sections(text, lambda t: True)
    assert [(s.text, s.edit) for s in sections] == [
        ("# top\na: 1\n", True), ("\n", False), ("# about b\nb:\n", False), ("c: 2\n", True),
        ("# trailing\n", False)]


def test_split_sections_keep_a_compact_list_with_its_key():
    # `- x` at column 0 belongs to `items:`, not to a new block.
    text = "items:\n- x\n- y\nother: 1\n"
    sections = split_sections(text, lambda t: len(t.split()) > 5, joinable=lambda t: False)
    assert [s.text for s in sections if s.edit] == ["items:\n- x\n- y\n", "other: 1\n"]
    # ... and when the block is too big, its items are cut at column 0 with no indent to put back.
    sections = split_sections(text, lambda t: len(t.split()) > 3, joinable=lambda t: False)
    assert [(s.text, s.indent, s.edit) for s in sections] == [
        ("items:\n", "", False), ("- x\n", "", True), ("- y\n", "", True), ("other: 1\n", "", True)]


def test_split_sections_leave_unsafe_cuts_alone():
    # A flow collection over several lines at column 0 cannot be cut into blocks: the document stays whole.
    text = "a: [1,\n2]\nb: 3\n"
    assert [s.text for s in split_sections(text, lambda t: True)] == [text]
    # An alias needs its anchor in the same section.
    text = "base: &b\n  x: 1\nuse: *b\n"
    assert [s.text for s in split_sections(text, lambda t: True)] == [text]


@pytest.mark.parametrize("text, expected", [
    ("apiVersion: v1\nkind: Service\n", True),
    ("# about\nversion: 2\n", True),
    ("metadata:\n  name: web\n", False),
    ("- a\n", False),
])
def test_flat(text, expected):
    assert flat(text) is expected


def test_split_finer_cuts_a_section_one_level_and_places_the_parts():
    # A rejected `jobs:` section at lines 3-6, indented by two spaces in the file: its items come back as sections
    # of their own, at the file's line numbers and indent.
    section = Section("jobs:\n  - a: 1\n    b: 2\n  - c: 3\n", "  ", 3, True)
    parts = split_finer(section, lambda t: len(t.split()))
    assert [(p.text, p.indent, p.line, p.edit) for p in parts] == [
        ("jobs:\n", "  ", 3, False), ("- a: 1\n  b: 2\n", "    ", 4, True), ("- c: 3\n", "    ", 6, True)]
    # A single item cannot be cut into two parts to edit.
    assert split_finer(Section("- a: 1\n", "", 1, True), lambda t: len(t.split())) == []


# --------------------------------------------------------------------------------------------------------------
# Prompts and answers


def test_build_prompt_reformat_prefills_the_first_line():
    prompt = build_prompt("server:\n  port: 8080\n", None)
    assert prompt.prefill == "```yaml\nserver:"  # no newline: the tokenizer joins it with the next indent
    assert prompt.messages[0] == {"role": "system", "content": SYSTEM_EDITOR}
    assert prompt.messages[1]["content"].startswith("```yaml\nserver:\n  port: 8080\n```\n\nRewrite this YAML")


def test_build_prompt_instruction_puts_text_first_and_keeps_default_system_prompt():
    prompt = build_prompt("a: 1\n", "set a to 2")
    assert prompt.messages == ({"role": "user", "content": "```yaml\na: 1\n```\n\nset a to 2. Keep everything "
                                "else, including comments, exactly as it is. Reply with the complete updated file "
                                "in one ```yaml block and nothing else."},)
    assert prompt.prefill == "```yaml\n"


@pytest.mark.parametrize("answer, expected", [
    ("```yaml\na: 1\n```\nmore text", ("a: 1\n", True)),
    ("Sure!\n```\na: 1\n  ```\n```yaml\nb: 2\n```", ("a: 1\n", True)),  # the first block wins
    ("```yaml\na: 1\nb: 2", ("a: 1\nb: 2", False)),  # never closed: cut off
    ("a: 1\n", ("a: 1\n", True)),  # no fence at all: the whole answer
])
def test_extract_block(answer, expected):
    assert extract_block(answer) == expected


# --------------------------------------------------------------------------------------------------------------
# Validation


def test_check_section_messages():
    assert check_section("a: 1\n", "a:   1\n", None) is None
    assert check_section("a: 1\n", "a: 2\n", None) == (
        "the model's output changes the data\n  first change: a: 1 -> 2")
    assert check_section("a: 1\n", "a: 2\n", "set a to 2") is None
    assert check_section("a: 1\nb: 2\n", "a: 1\nb: [\n", "x") == (
        "the model's output is not valid YAML (line 3, column 1: expected the node content, but found "
        "'<stream end>')\n  first differing line: line 2: 'b: 2' became 'b: ['")


def test_check_section_rejects_dropped_and_invented_comments():
    # Comments are not data, so a reformat checks them apart: every one kept, none made up.
    assert check_section("# keep\na: 1  # why\n", "# keep\na: 1 # why\n", None) is None
    assert check_section("# keep\na: 1\n", "a: 1\n", None) == "the model's output drops a comment: '# keep'"
    assert check_section("a: 1\n", "# A nested YAML file.\na: 1\n", None) == (
        "the model's output adds a comment: '# A nested YAML file.'")


def test_comments_ignore_hashes_in_values():
    text = "# top\nurl: http://x/#frag\nmsg: \"a # b\"  # real\nq: it's # d\n"
    assert comments(text) == ["top", "real", "d"]


def test_data_changes():
    before = {"server": {"port": 8080, "tags": ["a", "b"]}, "gone": 1}
    after = {"server": {"port": 9090, "tags": ["a"]}, "new": {"x": 1}}
    assert data_changes(before, after) == [
        "server.port: 8080 -> 9090", "removed server.tags[1]", "removed gone", 'added new: {"x": 1}']


# --------------------------------------------------------------------------------------------------------------
# The engine


def test_progress_bar_on_a_terminal(monkeypatch):
    # On a terminal the bar shows tokens, tokens per pass and tokens/s; elsewhere (pipes, CI logs) it stays off.
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    progress = TokenProgress(total=40, enabled=True)
    for n in (10, 3, 7, 5):  # the prompt (skipped), then three passes
        progress.put(torch.zeros(n))  # put() looks only at numel()
    progress._bar.refresh()  # tqdm redraws at most every 0.1 s on its own
    progress.close()
    assert (progress.tokens, progress.passes) == (15, 3)
    assert "15/40" in screen.getvalue() and "5.00 tok/pass" in screen.getvalue() and "tok/s" in screen.getvalue()
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert TokenProgress(total=40, enabled=True)._bar.disable


def test_fence_stop_ignores_the_opening_fence_and_stops_at_the_closing_one():
    class Tok:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    def ids(text):
        return torch.tensor([[ord(c) for c in text]])

    stop = FenceStop(Tok())
    assert not bool(stop(ids("x\n```y"))[0])  # the last 4 characters: "```y", an opening fence
    assert not bool(stop(ids("a: 1\n"))[0])
    assert bool(stop(ids("a: 1\n```"))[0])
    assert not bool(stop(ids("1\n```\n"))[0])  # completed by an earlier token: it fired there
    assert not bool(stop(ids('cmd: "```"'))[0])  # backticks in the prefilled first line do not stop the answer
    two = torch.cat([ids("```yaml"), ids("abc\n```")])
    assert stop(two).tolist() == [False, True]


@pytest.mark.slow
def test_engine_batch_answers_equal_single_answers(smollm2):
    model, tokenizer = smollm2
    engine = ModelEngine(model, tokenizer)
    sections = ["server:\n  host: 0.0.0.0\n  port: 8080\n", "logging:\n  level: info\n  format: json\n",
                "features:\n  - search\n  - export\n  - audit\n"]
    prompts = [build_prompt(s, None) for s in sections]
    budgets = [40, 6, 60]  # the 6-token row stops on its budget while the others go on
    many = engine.complete_many(prompts, budgets)
    for prompt, budget, got in zip(prompts, budgets, many):
        alone = engine.complete(prompt, budget)
        assert got.token_ids == alone.token_ids
        assert got.answer == alone.answer
    assert len(many[1].token_ids) == 6


# --------------------------------------------------------------------------------------------------------------
# Writing


def test_write_result_failure_leaves_the_file_and_no_temp(tmp_path, monkeypatch):
    # --in-place goes through lookupdec._fs.atomic_write: a failure before the rename (here a full disk at fsync)
    # leaves the file as it was and no temporary file; the result is never half written.
    target = tmp_path / "f.yaml"
    target.write_text("old\n")
    monkeypatch.setattr(_fs.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        write_result("new\n", target, None, True, show=None)
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []


def test_write_result_in_place_keeps_a_backup_and_the_mode(tmp_path):
    target = tmp_path / "f.yaml"
    target.write_text("old\n")
    target.chmod(0o640)
    assert write_result("new\n", target, None, True, show=None) == (
        f"replaced {target}; the original is in {target}.bak")
    assert (target.read_text(), (tmp_path / "f.yaml.bak").read_text()) == ("new\n", "old\n")
    assert target.stat().st_mode & 0o777 == 0o640


def test_write_result_to_stdout_writes_no_file(tmp_path):
    shown = []
    assert write_result("a: 1\n", tmp_path / "f.yaml", None, False, show=shown.append) is None
    assert shown == ["a: 1\n"] and list(tmp_path.iterdir()) == []
