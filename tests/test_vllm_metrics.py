"""lookupdec's counters on vLLM's own ``/metrics`` (``lookupdec:prediction_accepted_tokens_total``,
``lookupdec:prediction_rejected_tokens_total``, counted by the Predicted Outputs middleware in vLLM's API-server
process), read through vLLM's own metrics route (``attach_router``): in one API-server process (vLLM serves
prometheus_client's default registry) and with several (vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts
them, and its route sums the processes' files).

Runs only where vLLM is installed (``.ci/run``'s vLLM environment); each case in fresh processes, as vLLM's API
servers are. No engine is started.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("prometheus_client")

_COUNT = r"""
import sys
from lookupdec.vllm import middleware
accepted, rejected = middleware._prediction_counters()
accepted.labels("smollm2").inc(int(sys.argv[1]))
rejected.labels("smollm2").inc(1)
"""
_SCRAPE = r"""
import sys
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from vllm.entrypoints.serve.instrumentator.metrics import attach_router
if sys.argv[1] == "count here":
    from lookupdec.vllm import middleware
    accepted, rejected = middleware._prediction_counters()
    accepted.labels("smollm2").inc(7)
    rejected.labels("smollm2").inc(2)
app = FastAPI()
attach_router(app)
for family in text_string_to_metric_families(TestClient(app).get("/metrics").text):
    for sample in family.samples:
        if sample.name.startswith("lookupdec:") and sample.name.endswith("_total"):
            print(sample.name, sample.labels["model_name"], sample.value)
"""


def _run(code: str, arg: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    root = str(Path(__file__).resolve().parents[1])  # this checkout's lookupdec
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return {**env, **extra}


EXPECTED = ("lookupdec:prediction_accepted_tokens_total smollm2 7.0\n"
            "lookupdec:prediction_rejected_tokens_total smollm2 2.0\n")


def test_one_api_server_shows_the_counters_on_vllms_metrics():
    assert _run(_SCRAPE, "count here", _env()) == EXPECTED


def test_several_api_servers_show_their_sum(tmp_path):
    env = _env(PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    for accepted in (3, 4):  # two API-server processes, each counting one answer
        _run(_COUNT, str(accepted), env)
    assert _run(_SCRAPE, "read only", env) == EXPECTED
