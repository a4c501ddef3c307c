"""The benchmark suites: big enough for a worst case and a 10th percentile to mean something, stable names, today's
prompts first and unchanged (published results stay reproducible), and every prompt fits the embedded model."""

import hashlib
import inspect
import re

import pytest

from benchmarks import workloads
from benchmarks.workloads import SUITES

MIN_PROMPTS = 20
NEW_TOKENS = 256  # the most a benchmark asks for (run.py's default); the prompt must leave room for them
DATA_SUITES = ("summary", "qa")  # built from ../shared/data, absent on a bare checkout


def _prompts(suite):
    prompts = SUITES[suite]()
    if suite in DATA_SUITES and not workloads.SHARED_DATA.is_dir():
        pytest.skip(f"{workloads.SHARED_DATA} is absent")
    return prompts


def _sha(text):
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.mark.parametrize("suite", list(SUITES))
def test_every_suite_has_enough_prompts_with_unique_names(suite):
    prompts = _prompts(suite)
    assert len(prompts) >= MIN_PROMPTS, f"{suite}: {len(prompts)} prompts"
    names = [p.name for p in prompts]
    assert len(set(names)) == len(names), f"{suite}: repeated names"
    assert all(p.suite == suite and p.user.strip() for p in prompts)


def test_docqa_is_registered_as_low_copy():
    assert "docqa" in SUITES and "docqa" not in workloads.COPY_HEAVY


# The prompts published results were measured on, in their order: name and a hash of the text. Their sources are in
# the repository (examples/configs, this module) or in ../shared/data, so the text is the same on every machine.
PINNED = {
    "yaml": [("service.yaml#0", "9046177231e804bd"), ("service.yaml#1", "9b64b4e84d40bd11"),
             ("dependabot.yml#0", "dc6b168fe9705f4f"), ("codecov.yml#0", "3dc0e67024781af3"),
             ("readthedocs.yaml#0", "6ed881d65bf318b0"), ("codecov.yml#reformat", "426ebfea538155fe")],
    "open": [("open#0", "58a3d2be4a5cf6d1"), ("open#1", "0d4f6aa1886bb8c6"), ("open#2", "80badaa7b5671a97"),
             ("open#3", "08fcdca895def3c1")],
    "summary": [("cnn_dm#0", "91bb5d5811333c51"), ("cnn_dm#1", "cf431c3a8d3b65dd")],
    "qa": [("hagrid#0", "cef5d39c7349f4eb"), ("hagrid#1", "88021ccd158c00e6")],
}


@pytest.mark.parametrize("suite", list(PINNED))
def test_published_prompts_come_first_unchanged(suite):
    prompts = _prompts(suite)
    got = [(p.name, _sha(p.user)) for p in prompts[: len(PINNED[suite])]]
    assert got == PINNED[suite]


def test_published_code_prompts_come_first():
    """The code suite's text is the interpreter's stdlib source, which moves between Python versions: pin the names,
    the function each opens with and the instruction each ends with."""
    prompts = SUITES["code"]()
    tail = "Change nothing else. Reply with the complete function in one ```python block and nothing else."
    pinned = [
        ("textwrap.indent#rename", "def indent(text, prefix, predicate=None):", None),
        ("textwrap.indent#hints", "def indent(text, prefix, predicate=None):",
         "Add type hints to the function's parameters and return value."),
        ("shutil.copyfileobj#hints", "def copyfileobj(fsrc, fdst, length=0):",
         "Add type hints to the function's parameters and return value."),
        ("shutil.copyfileobj#nodoc", "def copyfileobj(fsrc, fdst, length=0):", "Remove the docstring."),
        ("fnmatch.filter#nodoc", "def filter(names, pat):", "Remove the docstring."),
        ("fnmatch.filter#doc", "def filter(names, pat):",
         "Add a one-line docstring if there is none, otherwise shorten the docstring to one line."),
        ("difflib.get_close_matches#doc", "def get_close_matches(word, possibilities, n=3, cutoff=0.6):",
         "Add a one-line docstring if there is none, otherwise shorten the docstring to one line."),
        ("difflib.get_close_matches#rename", "def get_close_matches(word, possibilities, n=3, cutoff=0.6):",
         "Rename the local variable `result` to `result_value` everywhere in the function."),
    ]
    assert [p.name for p in prompts[: len(pinned)]] == [name for name, _, _ in pinned]
    for p, (name, first_line, instruction) in zip(prompts, pinned):
        assert p.user.startswith(f"```python\n{first_line}\n"), name
        if instruction is not None:
            assert p.user.endswith(f"```\n\n{instruction} {tail}"), name


def test_added_code_functions_are_short_and_suit_their_edits():
    """Functions after the first four are 10-40 lines; a rename names a variable the function assigns."""
    for name, fn in workloads._stdlib_functions()[4:]:
        lines = inspect.getsource(fn).rstrip("\n").count("\n") + 1
        assert 10 <= lines <= 40, f"{name}: {lines} lines"
    for p in SUITES["code"]()[8:]:
        if p.name.endswith("#rename"):
            var = re.search(r"variable `(\w+)`", p.user).group(1)
            assert re.search(rf"^\s+{var} = ", p.user, flags=re.MULTILINE), p.name


def test_docqa_drops_what_is_missing_and_keeps_the_rest(monkeypatch):
    base = workloads.docqa_suite()
    monkeypatch.setattr(workloads, "DOCQA_LICENCES",
                        [*workloads.DOCQA_LICENCES, ("no-such-distribution-xyz", "name", workloads.LICENCE_NAME)])
    monkeypatch.setattr(workloads, "DOCQA_DOCSTRINGS",
                        [*workloads.DOCQA_DOCSTRINGS, ("no_such_module_xyz", "summary", "Summarize.")])
    monkeypatch.setattr(workloads, "DOCQA_SOURCES", [*workloads.DOCQA_SOURCES, "no_such_module_xyz", "sys"])
    assert workloads.docqa_suite() == base  # sys is built in: no source


@pytest.fixture(scope="module")
def embedded():
    """The embedded model's tokenizer and context length, read from its .gguf file (no weights are loaded)."""
    import gguf
    from transformers import AutoTokenizer

    from lookupdec.models import embedded_gguf_path

    path = embedded_gguf_path()
    fields = gguf.GGUFReader(path).fields
    arch = fields["general.architecture"].contents()
    context = int(fields[f"{arch}.context_length"].contents())
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), context


@pytest.mark.parametrize("suite", list(SUITES))
def test_every_prompt_fits_the_embedded_model_with_room_to_answer(suite, embedded):
    tokenizer, context = embedded
    assert context == 8192  # SmolLM2-135M-Instruct
    for p in _prompts(suite):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p.user}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        assert len(ids) + NEW_TOKENS <= context, f"{p.name}: {len(ids)} prompt tokens"
