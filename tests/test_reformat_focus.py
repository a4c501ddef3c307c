"""What an edit is about and what it may change, without a model: YAML tags kept as opaque values, changes between
two loads, how an instruction is read, which entries of a file it names, and the check that rejects a wrong edit.
(lookupdec/reformat/yamldata.py and focus.py; the editor that uses them is tested in test_reformat_edit.py.)
"""

from __future__ import annotations

import pytest
import yaml

from lookupdec.reformat.focus import (
    atoms,
    choose_targets,
    find_entries,
    read_instruction,
    split_clauses,
    unasked_change,
)
from lookupdec.reformat.validate import data_changes, load_yaml_documents, to_json
from lookupdec.reformat.yamldata import Change, Tagged, diff, load, same

# --------------------------------------------------------------------------------------------------------------
# Tags

TAGGED = """\
site_name: Docs
markdown_extensions:
  - pymdownx.emoji:
      emoji_index: !!python/name:material.extensions.emoji.twemoji
Resources:
  Bucket:
    Properties:
      Name: !Sub '${AWS::StackName}-logs'
      Arn: !GetAtt [Role, Arn]
      Owner: !Ref Admin
api_password: !secret http_password
automation: !include automations.yaml
rules:
  - !reference [.rules, scheduled]
"""


def test_unknown_tags_load_as_opaque_tagged_values():
    # Valid YAML that PyYAML's safe loader refuses ("could not determine a constructor for the tag"): each tag is
    # kept with the plain value under it, never resolved or executed.
    data = load(TAGGED)
    assert data["markdown_extensions"][0]["pymdownx.emoji"]["emoji_index"] == Tagged(
        "tag:yaml.org,2002:python/name:material.extensions.emoji.twemoji", "")
    props = data["Resources"]["Bucket"]["Properties"]
    assert props == {"Name": Tagged("!Sub", "${AWS::StackName}-logs"), "Arn": Tagged("!GetAtt", ["Role", "Arn"]),
                     "Owner": Tagged("!Ref", "Admin")}
    assert data["api_password"] == Tagged("!secret", "http_password")
    assert data["rules"] == [Tagged("!reference", [".rules", "scheduled"])]
    with pytest.raises(yaml.constructor.ConstructorError):
        yaml.safe_load(TAGGED)  # what used to make the command refuse such files


def test_tagged_values_compare_by_tag_and_value():
    # Two loads of one file are the same data, so a reformat of a tagged file validates; another tag or another
    # value under it is a change.
    assert same(load(TAGGED), load(TAGGED))
    assert diff(load("a: !Ref X\n"), load("a: !Ref Y\n")) == [
        Change("changed", ("a",), Tagged("!Ref", "X"), Tagged("!Ref", "Y"))]
    assert not same(load("a: !Ref X\n"), load("a: !GetAtt X\n"))
    assert not same(load("a: !Ref X\n"), load("a: X\n"))


def test_json_cannot_hold_a_tag():
    with pytest.raises(ValueError, match=r"^JSON has no YAML tags \(first: b\[1\]: !Ref 'X'\); write YAML instead$"):
        to_json(load_yaml_documents("a: 1\nb: [2, !Ref X]\n")[0])


# --------------------------------------------------------------------------------------------------------------
# Changes between two loads


def test_diff_aligns_list_items():
    # Taking out the first of five items is one removal, not four changed items and a removed fifth.
    old = {"versions": ["3.9", "3.10", "3.11", "3.12"]}
    assert [str(c) for c in diff(old, {"versions": ["3.10", "3.11", "3.12"]})] == ["removed versions[0]"]
    assert [str(c) for c in diff(old, {"versions": ["3.9", "3.10", "3.11", "3.12", "3.13"]})] == [
        'added versions[4]: "3.13"']
    # Items edited in place say what changed inside them.
    assert [str(c) for c in diff([{"id": "a"}, {"id": "b"}], [{"id": "a"}, {"id": "c"}])] == ['[1].id: "b" -> "c"']


def test_diff_counts_a_type_change():
    # "2000" is not 2000, 1 is not True, 1 is not 1.0: a quoted value the model unquotes is a change.
    assert [str(c) for c in diff({"iops": "2000"}, {"iops": 2000})] == ['iops: "2000" -> 2000']
    assert diff({"a": 1}, {"a": True}) and diff({"a": 1}, {"a": 1.0})
    assert diff({"a": 1, "b": 2}, {"b": 2, "a": 1}) == []  # key order is formatting, not data


def test_data_changes_keep_their_wording():
    assert data_changes({"server": {"port": 8080}, "gone": 1}, {"server": {"port": 9090}, "new": [1]}) == [
        "server.port: 8080 -> 9090", "removed gone", "added new: [1]"]


# --------------------------------------------------------------------------------------------------------------
# Reading an instruction


def test_atoms_split_keys_as_people_write_them():
    assert atoms("DBInstanceClass") == ["db", "instance", "class"]
    assert atoms("default-days show_source HOUSEKEEPER_TARGET_PROJECT_ID") == [
        "default", "day", "show", "source", "housekeeper", "target", "project", "id"]
    assert atoms("branches replicas retries status") == ["branch", "replica", "retry", "status"]


def test_split_clauses_at_and_but_not_inside_quotes():
    assert split_clauses("Set the cpu request to 200m and the memory request to 256Mi.") == [
        "Set the cpu request to 200m", "the memory request to 256Mi."]
    assert split_clauses("Set the title to 'Tom and Jerry'.") == ["Set the title to 'Tom and Jerry'."]


def test_read_instruction_tells_new_values_from_values_to_replace():
    clause = read_instruction("Update actions/checkout to v5.").clauses[0]
    assert (clause.old, clause.new, clause.given) == (("actions/checkout",), ("v5",), ("v5",))
    clause = read_instruction("Run the workflow on the main branch instead of master.").clauses[0]
    assert clause.old == ("master",) and "main" in clause.context and clause.replaces
    clause = read_instruction("Use the mysql:8 image for the db service instead of mariadb.").clauses[0]
    assert clause.given == ("mysql:8",) and clause.old == ("mariadb",)  # a value-looking word is a new value
    clause = read_instruction("Change the image tag of the php-redis container to v6.").clauses[0]
    assert "php-redis" in clause.context and "php-redis" not in clause.old  # "of X" names, it is not replaced
    assert read_instruction("Remove Python 3.9 from the matrix.").clauses[0].removes
    assert read_instruction("Turn on database echo.").clauses[0].booleans
    assert not read_instruction("Run the workflow on the main branch.").clauses[0].booleans  # "on" alone
    assert read_instruction("Change restart to always for both services.").clauses[0].all


@pytest.mark.parametrize("instruction, expects", [
    ("Set the log level to debug.", True),  # gives a value
    ("Remove Python 3.9 from the matrix.", True),
    ("Enable the project coverage status.", True),
    ("Use mysql for the db instead of mariadb.", True),
    ("Change the port.", False),  # names what, not to what: the model's unchanged copy is an answer
    ("Add a comment above the port saying why.", False),  # comments are not data
    ("Rename the jobs.", False),
])
def test_expects_change(instruction, expects):
    assert read_instruction(instruction, "server:\n  port: 8080\njobs: 1\n").expects_change is expects


def test_structural_instructions_are_recognised():
    assert read_instruction("Sort the keys alphabetically.").structural == "sort"
    assert read_instruction("Move the port under database.").structural == "move"
    assert read_instruction("Change the port to 9090.").structural is None


# --------------------------------------------------------------------------------------------------------------
# The file's entries and the instruction's targets

COMPOSE = """\
services:
  prometheus:
    image: prom/prometheus
    restart: unless-stopped
  grafana:
    image: grafana/grafana
    restart: unless-stopped
    ports: ["3000:3000"]
    command: |
      serve
      --verbose
"""

DEPENDABOT = """\
updates:
  - package-ecosystem: "github-actions"
    cooldown:
      default-days: 2
  - package-ecosystem: "pip"
    cooldown:
      default-days: 2
"""


def test_find_entries_gives_paths_and_lines():
    entries = {e.path: (e.first, e.last) for e in find_entries(COMPOSE + "---\nother: 1\n")}
    assert entries[(0, "services", "grafana", "image")] == (6, 6)
    assert entries[(0, "services", "grafana", "ports")] == (8, 8)  # a one-line flow list is one entry
    assert entries[(0, "services", "grafana", "command")] == (9, 11)  # a block scalar: its lines
    assert entries[(1, "other")] == (13, 13)  # the second document
    beside = next(e for e in find_entries(DEPENDABOT) if e.path == (0, "updates", 1, "cooldown", "default-days"))
    assert "pip" in beside.beside_values  # the value that says which item it is


def _targets(instruction: str, text: str) -> list:
    found = choose_targets(read_instruction(instruction, text), find_entries(text))
    return [e.path[1:] for e in found.chosen], [[e.path[1:] for e in es] for _, es in found.ambiguous]


def test_targets_a_named_key_over_an_other_value_of_its_item():
    # The key named (image) wins over the mapping's name (php-redis), which only says which container.
    text = "containers:\n  - name: php-redis\n    image: gcr.io/frontend:v5\n"
    assert _targets("Change the image tag of the php-redis container to v6.", text) == (
        [("containers", 0, "image")], [])


def test_targets_break_a_tie_by_the_value_beside():
    # Two default-days, equally named; "pip" is beside the second one only.
    assert _targets("Change the cooldown default-days of the pip updates to 7.", DEPENDABOT) == (
        [("updates", 1, "cooldown", "default-days")], [])


def test_targets_keep_a_tie_for_both_or_a_replaced_value():
    assert _targets("Change restart to always for both services.", COMPOSE)[0] == [
        ("services", "prometheus", "restart"), ("services", "grafana", "restart")]
    text = "on:\n  push:\n    branches: [master]\n  pull_request:\n    branches: [master]\n"
    assert _targets("Run on main instead of master.", text)[0] == [
        (True, "push", "branches"), (True, "pull_request", "branches")]  # `on` loads as True (YAML 1.1)


def test_targets_break_a_tie_by_the_old_values_likeness_to_the_new():
    # "python version": the python key and the version key are named alike; '3.13' looks like 3.14, 2 does not.
    text = "version: 2\nbuild:\n  tools:\n    python: '3.13'\n"
    assert _targets("Change the python version to 3.14.", text) == ([("build", "tools", "python")], [])


def test_targets_left_ambiguous_for_the_judge():
    text = "server:\n  port: 8080\ndatabase:\n  port: 5432\n"
    assert _targets("Change the port to 9090.", text) == ([], [[("server", "port"), ("database", "port")]])
    assert _targets("Change the database port to 6543.", text) == ([("database", "port")], [])


def test_an_instruction_naming_nothing_has_no_targets():
    assert _targets("Add a comment to every key.", COMPOSE) == ([], [])


# --------------------------------------------------------------------------------------------------------------
# The check on changes

SERVICE = "server:\n  host: 0.0.0.0\n  port: 8080\n  workers: 4\nlogging:\n  level: info\n"


def _why(instruction: str, text: str, result: str):
    request = read_instruction(instruction, text)
    targets = choose_targets(request, find_entries(text)).chosen
    return unasked_change(diff(load_yaml_documents(text), load_yaml_documents(result)), request, targets)


@pytest.mark.parametrize("instruction, result", [
    ("Change the server port to 9090.", SERVICE.replace("8080", "9090")),
    ("Change the port.", SERVICE.replace("8080", "8081")),  # no value given: any value for the named key
    ("Set the log level to debug.", SERVICE.replace("info", "debug")),
    ("Set the port to 9090 and the workers to 8.", SERVICE.replace("8080", "9090").replace(": 4", ": 8")),
])
def test_changes_the_instruction_asked_for_pass(instruction, result):
    assert _why(instruction, SERVICE, result) is None


@pytest.mark.parametrize("instruction, result, why", [
    # another key changed too
    ("Change the server port to 9090.", SERVICE.replace("8080", "9090").replace(": 4", ": 9090"),
     "it changes [0].server.workers: 4 -> 9090, which the instruction does not name"),
    # a near miss of the value
    ("Change the server port to 9090.", SERVICE.replace("8080", "909"),
     "it writes [0].server.port: 8080 -> 909, a value the instruction does not give"),
    ("Set the log level to debug.", SERVICE.replace("info", "Debug"),
     'it writes [0].logging.level: "info" -> "Debug", a value the instruction does not give'),
    # the type of the value
    ("Change the server port to 9090.", SERVICE.replace("8080", '"9090"'),
     'it changes the type of [0].server.port ([0].server.port: 8080 -> "9090")'),
    # lost data
    ("Change the server port to 9090.", SERVICE.replace("8080", "9090").replace("  workers: 4\n", ""),
     "it changes removed [0].server.workers, which the instruction does not name"),
    ("Change the server port to 9090.", "server:\n  port: 9090\n  host: 0.0.0.0\n  workers: 4\n",
     "it changes removed [0].logging, which the instruction does not name"),
])
def test_wrong_edits_are_caught(instruction, result, why):
    assert _why(instruction, SERVICE, result) == why


def test_a_version_bump_inside_a_value_passes_but_not_the_other_clauses_value():
    text = 'steps:\n  - uses: "actions/checkout@v4"\n  - uses: "actions/setup-python@v5"\n'
    instruction = "Update actions/checkout to v5 and actions/setup-python to v6."
    assert _why(instruction, text, text.replace("checkout@v4", "checkout@v5").replace("python@v5", "python@v6")) is None
    assert _why(instruction, text, text.replace("checkout@v4", "checkout@v6")) == (
        'it writes [0].steps[0].uses: "actions/checkout@v4" -> "actions/checkout@v6", a value the instruction '
        "does not give")


def test_booleans_flip_only_when_asked():
    text = "echo: false\ncache: true\n"
    assert _why("Turn on echo.", text, "echo: true\ncache: true\n") is None
    assert _why("Set the echo to yes please.", text, "echo: true\ncache: true\n") == (
        "it writes [0].echo: false -> true, a value the instruction does not give")


def test_removal_needs_an_instruction_that_removes():
    text = 'matrix:\n  python: ["3.9", "3.10"]\n'
    assert _why("Remove 3.9 from the python matrix.", text, 'matrix:\n  python: ["3.10"]\n') is None
    assert _why("Change the python matrix to 3.11.", text, 'matrix:\n  python: ["3.10"]\n') == (
        "it removes [0].matrix.python[0], which the instruction does not ask to remove")
