"""Edits with ``--instruction``: a rejected section retried on the entries the instruction names, the model's
departures from a copied line, wrong edits caught, sections the instruction is not about left byte for byte, the
judge for ambiguous entries, instructions that cannot be made section by section, tagged files.

A stub engine stands in for the model (it answers by a function of the section and prompt) wherever the model
does not matter; two tests at the end use the embedded model. The command is driven through click's CliRunner
on temporary files, so exit codes, messages and written bytes are what a user gets.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from lookupdec import cli
from lookupdec.reformat import run as reformat_run
from lookupdec.reformat.editor import Editor, FileFocus, Job
from lookupdec.reformat.engine import Completion
from lookupdec.reformat.prompts import SYSTEM_FOCUSED, build_focused_prompt
from lookupdec.reformat.sections import Section

SERVICE = (Path(__file__).resolve().parent.parent / "examples" / "configs" / "service.yaml").read_text()


class Stub:
    """A model that answers ``answer(section, prompt)`` (the text inside the answer's fence) and, when
    ``starts`` is given, offers departures: ``starts(section)`` -> texts that follow the prefilled key."""

    def __init__(self, answer, starts=None, context=2048):
        self.answer, self.starts, self.context = answer, starts, context
        self.asked = []  # (section, focused prompt?, prefill)

    def count_tokens(self, text):
        return len(text.split())

    def prepare(self, say):
        pass

    def complete(self, prompt, max_new_tokens, method="lookup", streamer=None, drafter=None, trace=None):
        user = prompt.messages[-1]["content"]
        section = user[len("```yaml\n"): user.index("\n```\n\n")] + "\n"
        focused = prompt.messages[0]["content"] == SYSTEM_FOCUSED
        self.asked.append((section, focused, prompt.prefill))
        body = self.answer(section, prompt)
        return Completion(f"```yaml\n{body}```", tuple(range(len(body.split()))), 1, 0.0)

    def __getattr__(self, name):
        if name == "departures" and self.starts is not None:
            return lambda prompt, done, limit: [prompt.prefill + s for s in self.starts(prompt)][:limit]
        raise AttributeError(name)


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "service.yaml").write_text(SERVICE)
    return tmp_path


def use(monkeypatch, engine):
    monkeypatch.setattr(reformat_run, "open_engine", lambda name, progress, **where: engine)
    return engine


def run(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)


def drops_the_list(section, prompt):
    """The embedded model's way with a whole file: the port edited, the features list lost."""
    if prompt.messages[0]["content"] == SYSTEM_FOCUSED:
        return section.replace("8080", "9090")
    return section.replace("8080", "9090").split("features:")[0]


# --------------------------------------------------------------------------------------------------------------
# Retrying at finer grain


def test_a_rejected_edit_is_retried_on_the_entry_it_names(here, monkeypatch):
    stub = use(monkeypatch, Stub(drops_the_list))
    result = run("reformat", "service.yaml", "-i", "Change the server port to 9090.", "-o", "out.yaml")
    assert result.exit_code == 0, result.stderr
    # Only the port line was asked again, alone, with the focused prompt and its key started for the model.
    assert stub.asked[1:] == [("port: 8080\n", True, "```yaml\nport:")]
    assert (here / "out.yaml").read_text() == SERVICE.replace("port: 8080", "port: 9090")  # the rest byte for byte
    assert result.stderr.splitlines()[1:] == [
        "service.yaml: lines 1-17 retried at finer grain (the model's output is a wrong edit: it changes removed "
        "[0].features, which the instruction does not name): line 4 edited, the rest left as it was",
        "the data changed in 1 place:",
        "  server.port: 8080 -> 9090",
        "wrote out.yaml"]


def near_miss(section, prompt):
    """The whole file with a value the instruction does not name changed too; the port line alone with a near
    miss of the value."""
    if section == "port: 8080\n":
        return section.replace("8080", "909")
    return section.replace("8080", "9090").replace(": 4", ": 8")


def test_a_near_miss_is_written_with_the_value_the_instruction_gives(here, monkeypatch):
    use(monkeypatch, Stub(near_miss))
    result = run("reformat", "service.yaml", "-i", "Change the server port to 9090.", "-o", "out.yaml")
    assert result.exit_code == 0, result.stderr
    assert (here / "out.yaml").read_text() == SERVICE.replace("port: 8080", "port: 9090")
    assert "line 4 set to the value the instruction gives, the rest left as it was" in result.stderr
    # Not an answer the check would refuse from the model: a value of another type is not written either.
    result = run("reformat", "service.yaml", "-i", "Change the server port to many.", "-o", "other.yaml")
    assert result.exit_code == 1 and not (here / "other.yaml").exists()


def test_a_wrong_edit_is_rejected_and_nothing_is_written(here, monkeypatch):
    # The model's near miss at every grain, and the instruction's own value not offered (the test above):
    # exit 1 with the first rejection, the file untouched.
    use(monkeypatch, Stub(near_miss))
    monkeypatch.setattr(FileFocus, "implied_answers", lambda self, section: [])
    result = run("reformat", "service.yaml", "-i", "Change the server port to 9090.", "--in-place")
    assert result.exit_code == 1
    assert result.stderr == (
        "error: service.yaml: lines 1-17: the model's output is a wrong edit: it changes [0].server.workers: 4 -> 8, "
        "which the instruction does not name\n"
        "  nothing was written (--keep-going keeps such a section as it was)\n")
    assert (here / "service.yaml").read_text() == SERVICE
    assert sorted(p.name for p in here.iterdir()) == ["service.yaml"]


def test_a_copied_line_is_retried_from_the_models_departures(here, monkeypatch):
    # The model copies every line unchanged; its departures from the copy are tried one at a time in its order,
    # and the first that the check accepts is taken: "warn" is not the value asked for, "debug" is; "trace" is
    # never asked.
    stub = use(monkeypatch, Stub(lambda section, prompt: prompt.prefill[len("```yaml\n"):] + "\n"
                                 if prompt.prefill.endswith(("warn", "debug")) else section,
                                 starts=lambda prompt: [" warn", " debug", " trace"]))
    result = run("reformat", "service.yaml", "-i", "Set the log level to debug.", "-o", "out.yaml")
    assert result.exit_code == 0, result.stderr
    assert [prefill for _, focused, prefill in stub.asked if focused] == [
        "```yaml\nlevel:", "```yaml\nlevel: warn", "```yaml\nlevel: debug"]
    assert (here / "out.yaml").read_text() == SERVICE.replace("level: info", "level: debug")


@pytest.mark.parametrize("entry_answer", ["", "- export\n"])
def test_a_list_item_is_removed_alone(here, monkeypatch, entry_answer):
    # The whole file comes back broken; the item alone comes back empty (the model took it out) or copied (then
    # it is taken out as the instruction says). Either way only that item goes.
    use(monkeypatch, Stub(lambda section, prompt: entry_answer if section == "- export\n" else "oops: [\n"))
    result = run("reformat", "service.yaml", "-i", "Remove export from the features.", "-o", "out.yaml")
    assert result.exit_code == 0, result.stderr
    assert (here / "out.yaml").read_text() == SERVICE.replace("  - export\n", "")


def test_a_copy_is_not_an_applied_edit(here, monkeypatch):
    # The instruction asks for a change (it turns something on), so an unchanged copy at every grain means it was
    # not applied: exit 1. (It gives no value to write instead.)
    use(monkeypatch, Stub(lambda section, prompt: section))
    result = run("reformat", "service.yaml", "-i", "Turn on the database echo.", "-o", "out.yaml")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: service.yaml: lines 1-17: the model did not apply the instruction (the "
                                    "data is unchanged)\n")
    assert not (here / "out.yaml").exists()


def test_two_values_are_asked_one_clause_each(here, monkeypatch):
    stub = use(monkeypatch, Stub(lambda section, prompt: "oops: [\n" if len(section.splitlines()) > 1 else
                                 section.replace("8080", "9090").replace("info", "debug")))
    result = run("reformat", "service.yaml", "-i", "Set the port to 9090 and the log level to debug.", "-o", "o.yaml")
    assert result.exit_code == 0, result.stderr
    asked = [(section, stub_prompt) for section, focused, stub_prompt in stub.asked if focused]
    assert [section for section, _ in asked] == ["port: 8080\n", "level: info\n"]
    prompts = [build_focused_prompt(s, i).messages[-1]["content"] for s, i in [
        ("port: 8080\n", "Set the port to 9090."), ("level: info\n", "Set the log level to debug.")]]
    assert prompts[0].endswith("Set the port to 9090.") and prompts[1].endswith("Set the log level to debug.")
    assert yaml.safe_load((here / "o.yaml").read_text())["logging"]["level"] == "debug"


def test_a_section_the_instruction_is_not_about_is_left_as_it_was(here, monkeypatch):
    # --max-new-tokens 40 cuts the file in two sections; the model garbles the second, which holds nothing the
    # instruction names: it is left byte for byte, and the edit of the first is written.
    use(monkeypatch, Stub(lambda section, prompt: "oops: [\n" if "logging" in section else
                          section.replace("8080", "9090")))
    result = run("reformat", "service.yaml", "-i", "Change the server port to 9090.", "--max-new-tokens", "40",
                 "-o", "out.yaml")
    assert result.exit_code == 0, result.stderr
    assert (here / "out.yaml").read_text() == SERVICE.replace("8080", "9090")
    assert ("service.yaml: lines 1-10 edited; lines 11-17 left as they were (the instruction is not about them)"
            in result.stderr.splitlines())


def test_keep_going_keeps_the_section_whose_entry_failed(here, monkeypatch):
    # (Instructions that give no value: a given one would be written from the instruction when the model fails.)
    use(monkeypatch, Stub(lambda section, prompt: section.replace("echo: false", "echo false: [")))
    result = run("reformat", "service.yaml", "-i", "Turn on the database echo.", "--keep-going", "-o", "out.yaml")
    assert result.exit_code == 1  # the only section is kept: nothing of the model's is left to write
    assert "service.yaml: lines 1-17: kept unchanged: the model's output is not valid YAML" in result.stderr
    assert result.stderr.endswith("error: service.yaml: the model's output was rejected for every section; nothing "
                                  "was written\n")
    # With a second section the model gets right, the first is kept and the second written (as asked).
    use(monkeypatch, Stub(lambda section, prompt: section.replace("echo: false", "echo false: [")
                          .replace("info", "debug")))
    result = run("reformat", "service.yaml", "-i", "Turn on the database echo and change the log level.",
                 "--keep-going", "--max-new-tokens", "40", "-o", "out.yaml")
    assert result.exit_code == 0, result.stderr
    assert (here / "out.yaml").read_text() == SERVICE.replace("info", "debug")
    assert "service.yaml: lines 1-10 kept unchanged (rejected); lines 11-17 edited" in result.stderr.splitlines()


# --------------------------------------------------------------------------------------------------------------
# What cannot be done section by section, and what is ambiguous


def test_a_structural_instruction_is_not_retried(here, monkeypatch):
    stub = use(monkeypatch, Stub(lambda section, prompt: "oops: [\n"))
    result = run("reformat", "service.yaml", "-i", "Sort the keys alphabetically.", "-o", "out.yaml")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[2] == (
        "  the instruction asks to sort things, which cannot be done in smaller sections")
    assert len(stub.asked) == 1
    # When the file needs several sections anyway, it is refused before the model is asked.
    result = run("reformat", "service.yaml", "-i", "Sort the keys alphabetically.", "--max-new-tokens", "40")
    assert (result.exit_code, result.stderr) == (
        1, "error: service.yaml: the instruction asks to sort things across the file, which cannot be done in the 2 "
           "sections this model can edit at once; nothing was written (a model with a longer context (--model) "
           "can take the file whole)\n")
    assert len(stub.asked) == 1


def test_a_clause_naming_nothing_in_the_file_is_not_done_in_part(here, monkeypatch):
    # "the retry budget" names no entry: editing only the port at finer grain would write half the instruction.
    stub = use(monkeypatch, Stub(lambda section, prompt: "oops: [\n"))
    result = run("reformat", "service.yaml", "-i", "Set the port to 9090 and the retry budget to 3.", "-o", "o.yaml")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[2] == ("  'the retry budget to 3' names no key or value of the file, so it "
                                             "cannot be done in smaller sections")
    assert len(stub.asked) == 1 and not (here / "o.yaml").exists()


def test_an_instruction_naming_nothing_reaches_every_part(here, monkeypatch):
    # "every key" names no key or value of the file: after the whole file is rejected, every block is asked.
    stub = use(monkeypatch, Stub(lambda section, prompt: "oops: [\n" if section.startswith("#") else section))
    result = run("reformat", "service.yaml", "-i", "Add a comment to every key.", "-o", "out.yaml")
    assert result.exit_code == 1  # the first block (with the file's comment) stays garbled at every grain
    firsts = [section.split("\n")[0] for section, _, _ in stub.asked]
    assert firsts[1:] == ["# Example service configuration edited in the README.", "database:", "logging:",
                          "features:"]


AMBIGUOUS = "server:\n  port: 8080\ndatabase:\n  port: 5432\n"


@pytest.mark.parametrize("choice, code", [("2", 0), ("none of them", 1)])
def test_an_ambiguous_entry_is_judged_by_the_model(here, monkeypatch, choice, code):
    def answer(section, prompt):
        if prompt.prefill == "Answer:":
            return choice
        return "oops: [\n" if "server" in section else section.replace("5432", "6543")

    (here / "two.yaml").write_text(AMBIGUOUS)
    stub = use(monkeypatch, Stub(answer))
    result = run("reformat", "two.yaml", "-i", "Change the port to 6543.", "-o", "out.yaml")
    assert result.exit_code == code, result.stderr
    assert stub.asked[0][0] == "1. server.port: port: 8080\n2. database.port: port: 5432\n"
    if code == 0:
        assert (here / "out.yaml").read_text() == AMBIGUOUS.replace("5432", "6543")
    else:
        assert result.stderr == ("error: two.yaml: the instruction could mean server.port (line 2) or database.port "
                                 "(line 4); say which (nothing was written)\n")


def test_a_judged_entry_is_not_written_from_the_instruction(here, monkeypatch):
    # The model picks database.port and then misses the value: the instruction's own value is not written at an
    # entry only the model's judgement chose (it may have picked the wrong one). Named outright, it is.
    def answer(section, prompt):
        if prompt.prefill == "Answer:":
            return "2"
        return "oops: [\n" if "server" in section else section.replace("5432", "654")

    (here / "two.yaml").write_text(AMBIGUOUS)
    use(monkeypatch, Stub(answer))
    assert run("reformat", "two.yaml", "-i", "Change the port to 6543.", "-o", "out.yaml").exit_code == 1
    assert not (here / "out.yaml").exists()
    result = run("reformat", "two.yaml", "-i", "Change the database port to 6543.", "-o", "out.yaml")
    assert result.exit_code == 0, result.stderr
    assert (here / "out.yaml").read_text() == AMBIGUOUS.replace("5432", "6543")


# --------------------------------------------------------------------------------------------------------------
# Tags, trace


CFN = """\
Resources:
  myDB:
    Type: AWS::RDS::DBInstance
    Properties:
      DBInstanceClass: db.t3.small
      MasterUsername: !Ref DBUser
      MasterUserPassword: !Sub '{{resolve:secretsmanager:${DBCredential}}}'
"""


def test_a_tagged_file_is_reformatted_and_edited(here, monkeypatch):
    (here / "cfn.yaml").write_text(CFN)
    use(monkeypatch, Stub(lambda section, prompt: section.replace("db.t3.small", "db.t3.medium")))
    result = run("reformat", "cfn.yaml", "-o", "same.yaml")  # a reformat: a copy validates, tags and all
    assert result.exit_code == 1 and "changes the data" in result.stderr  # (this stub edits even here)
    use(monkeypatch, Stub(lambda section, prompt: section))
    assert run("reformat", "cfn.yaml", "-o", "same.yaml").exit_code == 0
    assert (here / "same.yaml").read_text() == CFN
    use(monkeypatch, Stub(lambda section, prompt: section.replace("db.t3.small", "db.t3.medium")))
    result = run("reformat", "cfn.yaml", "-i", "Change the DBInstanceClass to db.t3.medium.", "-o", "out.yaml")
    assert result.exit_code == 0, result.stderr
    assert (here / "out.yaml").read_text() == CFN.replace("small", "medium")
    result = run("reformat", "cfn.yaml", "--to", "json")
    assert (result.exit_code, result.stderr) == (
        2, "error: cfn.yaml: JSON has no YAML tags (first: Resources.myDB.Properties.MasterUsername: !Ref 'DBUser'); "
           "write YAML instead\n")


class Recorder:
    """What Editor asks of a TraceRecorder: a title, a tokenizer, requests with a label and a note."""

    def __init__(self, tokenizer=None, title=""):
        self.tokenizer, self.title, self.requests, self.label = tokenizer, title, [], None


class Request:
    def __init__(self, label):
        self.label, self.note = label, None


def test_the_trace_shows_the_retries():
    class Traced(Stub):
        def complete(self, prompt, max_new_tokens, method="lookup", streamer=None, drafter=None, trace=None):
            trace.requests.append(Request(trace.label))
            return super().complete(prompt, max_new_tokens, method)

    engine = Traced(lambda section, prompt: prompt.prefill[len("```yaml\n"):] + "\n"
                    if prompt.prefill.endswith("debug") else section, starts=lambda prompt: [" debug"])
    focus = FileFocus(SERVICE, list(yaml.safe_load_all(SERVICE)), "Set the log level to debug.")
    trace = Recorder()
    editor = Editor(engine, "Set the log level to debug.", "lookup", None, False, None, lambda line: None, trace)
    job = Job(Section(SERVICE, "", 1, True), 100, "service.yaml", focus=focus)
    editor.run([job])
    assert [(r.label, r.note) for r in job.requests()] == [
        ("service.yaml: lines 1-17", "rejected: the model did not apply the instruction (the data is unchanged); "
                                     "retried at finer grain"),
        ("service.yaml: line 12", "rejected: the model did not apply the instruction (the data is unchanged)"),
        ("service.yaml: line 12 (try 2)", "validated")]


# --------------------------------------------------------------------------------------------------------------
# With the embedded model


@pytest.fixture
def real(smollm2, monkeypatch):
    from lookupdec import models

    monkeypatch.setattr(models, "load_model", lambda name=None, **kwargs: smollm2)
    return smollm2


DEPENDABOT = """\
version: 2
updates:
  - package-ecosystem: "github-actions"
    directory: "/"
    schedule:
      interval: daily
  - package-ecosystem: "pip"
    directory: "/"
    schedule:
      interval: daily
"""


@pytest.mark.slow
@pytest.mark.parametrize("instruction, change", [
    ("Set the schedule interval to weekly for both ecosystems.", ("interval: daily", "interval: weekly")),
    ("Set the log level to debug.", ("level: info", "level: debug")),
])
def test_model_lands_a_one_value_edit_that_failed_on_the_whole_file(here, real, instruction, change):
    name = "dependabot.yml" if "ecosystems" in instruction else "service.yaml"
    if name == "dependabot.yml":
        (here / name).write_text(DEPENDABOT)
    original = (here / name).read_text()
    result = run("reformat", name, "-i", instruction, "-o", "out.yaml")
    assert result.exit_code == 0, result.stderr
    assert (here / "out.yaml").read_text() == original.replace(*change)  # every other byte as it was
    assert "retried at finer grain" in result.stderr


@pytest.mark.slow
def test_model_departures_offer_its_second_choice(real):
    from lookupdec.reformat.engine import ModelEngine

    engine = ModelEngine(*real)
    prompt = build_focused_prompt("level: info\n", "Set the log level to debug.")
    done = engine.complete(prompt, 16)
    assert done.answer.startswith("```yaml\nlevel: info")  # it copies the line ...
    starts = engine.departures(prompt, done, 4)
    assert "```yaml\nlevel: debug" in starts[:2]  # ... and ranks the edit right after the copy
    assert all(re.match(r"```yaml\nlevel:", s) for s in starts)


def test_several_readings_of_the_instructions_value_are_not_guessed(here, monkeypatch):
    # "local" in /usr/local/bin: the whole value or the segment (focus.implied) may be meant; neither is written.
    (here / "paths.yaml").write_text("path: /usr/local/bin\nname: app\n")
    use(monkeypatch, Stub(lambda section, prompt: section.replace("local", "lokal")))
    result = run("reformat", "paths.yaml", "-i", "Replace local with opt in the path.", "-o", "out.yaml")
    assert result.exit_code == 1 and not (here / "out.yaml").exists()
