"""The commands benchmarks/README.md and research/README.md show: each names a tool that exists, its ``--help``
works, and its options are ones the tool takes (parsed by the tool's own parser, not run). So a README cannot
send a reader to a removed script or a renamed flag. Tests of the tools, not of the product
(``python -m pytest -q benchmarks research``)."""

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READMES = [ROOT / "benchmarks" / "README.md", ROOT / "research" / "README.md"]


def _commands() -> list:
    """(README, module, arguments) of every ``python -m benchmarks.X`` / ``research.X`` line in a bash block."""
    out = []
    for readme in READMES:
        in_block = False
        for line in readme.read_text().splitlines():
            if line.startswith("```"):
                in_block = not in_block and line.strip() == "```bash"
                continue
            match = re.match(r"(?:\S*python) -m ((?:benchmarks|research)\.\w+)(.*)", line.strip())
            if in_block and match:
                out.append((readme.parent.name, match[1], shlex.split(match[2], comments=True)))
    return out


COMMANDS = _commands()


class _Parsed(Exception):
    """Raised in place of running the tool, once its parser took the arguments."""


@pytest.fixture
def parse_only(monkeypatch):
    real = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)


def test_the_readmes_show_the_tools():
    modules = {module for _, module, _ in COMMANDS}
    assert {"benchmarks.run", "benchmarks.serve", "benchmarks.serve_attack", "benchmarks.serve_soak",
            "benchmarks.serve_hol", "benchmarks.edit_eval", "benchmarks.precision", "benchmarks.decompose",
            "benchmarks.device_check", "research.simulate"} <= modules


@pytest.mark.parametrize("readme, module, argv", COMMANDS,
                         ids=[f"{readme}:{module} {' '.join(argv)}"[:90] for readme, module, argv in COMMANDS])
def test_every_command_parses(readme, module, argv, parse_only):
    with pytest.raises(_Parsed):
        importlib.import_module(module).main(argv)


@pytest.mark.parametrize("module", sorted({module for _, module, _ in COMMANDS}))
def test_every_help_works(module, capsys):
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(["--help"])
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out
