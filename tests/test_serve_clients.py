"""What real clients send to ``lookupdec serve``, and the server names they need.

- Obsidian Smart Composer's Apply sends ``prediction.content`` as two text parts, and sends ``prediction`` at all
  only to model ids starting with ``gpt-4o`` or ``gpt-4.1``: ``--served-model-name smollm2 gpt-4.1-mini``;
- Goose's Relace editor sends ``{"prediction": {"content": ...}}`` without ``type`` (taken as ``content``);
- the official Node client (npm ``openai`` 5.x): chat, and streaming with ``stream_options.include_usage``.

The fast tests check the bodies and the command line; the slow ones start ``lookupdec serve --served-model-name
smollm2 gpt-4.1-mini`` on the embedded model and send each client's request (the README's YAML edit): each gets
its edit, with ``accepted_prediction_tokens`` > 0. The Node test installs ``openai@5`` with npm into a cached folder
(``$LOOKUPDEC_TEST_NODE_DIR``, default ``~/.cache/lookupdec/test-node-openai5``) and is skipped where node or npm
is missing or the install fails (offline).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

httpx = pytest.importorskip("httpx")

from lookupdec import cli  # noqa: E402
from lookupdec.serve.protocol import APIError, parse  # noqa: E402
from lookupdec.vllm import launch  # noqa: E402

CONFIG = "name: web\nimage: nginx:1.25\nport: 8080\n"
FENCED = f"```yaml\n{CONFIG}```"
SYSTEM = "You edit YAML. You apply the instruction to the YAML and reply with the edited YAML in one fenced block."
MESSAGES = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{FENCED}\n\nChange the port to 9090."}]
NAMES = ["smollm2", "gpt-4.1-mini"]


def smart_composer(model="gpt-4.1-mini") -> dict:
    """Smart Composer's Apply: the file as the prediction, in two text parts."""
    return {"model": model, "messages": MESSAGES, "temperature": 0, "stop": ["\n```"],
            "prediction": {"type": "content", "content": [{"type": "text", "text": FENCED[:13]},
                                                          {"type": "text", "text": FENCED[13:]}]}}


def goose(model="smollm2") -> dict:
    """Goose's Relace editor: a prediction without ``type``."""
    return {"model": model, "messages": MESSAGES, "temperature": 0, "stop": ["\n```"],
            "prediction": {"content": FENCED}}


# ------------------------------------------------------------------------------------------- bodies, fast


@pytest.mark.parametrize("prediction", [
    FENCED,  # a string
    [{"type": "text", "text": FENCED[:13]}, {"type": "text", "text": FENCED[13:]}],  # text parts
], ids=["string", "text parts"])
@pytest.mark.parametrize("typed", [True, False], ids=["typed", "typeless"])
def test_a_prediction_is_a_string_or_text_parts_with_or_without_its_type(prediction, typed):
    body = {"model": "smollm2", "messages": MESSAGES,
            "prediction": {"type": "content", "content": prediction} if typed else {"content": prediction}}
    assert parse(body, "chat", NAMES).prediction == FENCED


@pytest.mark.parametrize("prediction, param", [
    ({"type": None, "content": "x"}, "prediction.type"),  # null is not "left out"
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"type": "", "content": "x"}, "prediction.type"),
    ({}, "prediction.content"),
    ({"content": "x", "kind": "content"}, "prediction.kind"),
])
def test_a_prediction_with_another_type_or_null_stays_a_400(prediction, param):
    with pytest.raises(APIError) as caught:
        parse({"model": "smollm2", "messages": MESSAGES, "prediction": prediction}, "chat", NAMES)
    assert caught.value.status == 400 and caught.value.param == param


def test_the_clients_bodies_parse_and_answers_carry_the_first_served_name():
    composer = parse(smart_composer(), "chat", NAMES)
    assert composer.model == "smollm2" and composer.prediction == FENCED and composer.stop == ["\n```"]
    assert parse(goose(), "chat", NAMES).prediction == FENCED
    with pytest.raises(APIError) as caught:
        parse(smart_composer("gpt-4o"), "chat", NAMES)
    assert caught.value.status == 404 and caught.value.code == "model_not_found"
    assert "this server has: smollm2, gpt-4.1-mini" in caught.value.message


# ------------------------------------------------------------------------------------------ command line, fast


def _serve_options(monkeypatch, *args):
    """The ServeOptions ``lookupdec serve ARGS`` runs the server with (the server itself not started)."""
    from lookupdec.serve import run

    seen = []
    monkeypatch.setattr(run, "serve", lambda options, say: seen.append(options))
    result = CliRunner().invoke(cli.main, ["serve", *args], catch_exceptions=False)
    return result, (seen[0] if seen else None)


@pytest.mark.parametrize("args", [
    ["--served-model-name", "smollm2", "gpt-4.1-mini"],  # as vLLM takes it
    ["--served-model-name", "smollm2", "--served-model-name", "gpt-4.1-mini"],  # the option repeated
    ["--served-model-name", "smollm2", "gpt-4.1-mini", "--served-model-name", "smollm2"],  # a name twice: once
    ["--served-model-name=smollm2", "--served-model-name", "gpt-4.1-mini"],
])
def test_served_model_names_are_taken_as_vllm_takes_them_or_repeated(monkeypatch, args):
    result, options = _serve_options(monkeypatch, *args, "--port", "9000")
    assert result.exit_code == 0, result.output
    assert options.served_model_names == ("smollm2", "gpt-4.1-mini") and options.port == 9000


def test_without_served_model_names_the_model_is_named_as_before(monkeypatch):
    result, options = _serve_options(monkeypatch)
    assert result.exit_code == 0 and options.served_model_names == () and options.access_log is True
    result, options = _serve_options(monkeypatch, "--no-access-log")
    assert options.access_log is False


def test_an_empty_served_name_is_a_usage_error(monkeypatch):
    result, options = _serve_options(monkeypatch, "--served-model-name", " ")
    assert result.exit_code == 2 and options is None and "a served model name is empty" in result.output


def test_names_after_the_double_dash_stay_vllms():
    assert cli.spread_names(["--served-model-name", "a", "b", "--", "c", "--served-model-name", "d", "e"]) == [
        "--served-model-name", "a", "--served-model-name", "b", "--", "c", "--served-model-name", "d", "e"]


def test_the_help_shows_the_served_names_and_the_access_log():
    text = CliRunner().invoke(cli.main, ["serve", "--help"]).output
    assert "--served-model-name NAME [NAME ...]" in text and "gpt-4.1-mini" in text
    assert "--access-log / --no-access-log" in text


def test_vllm_gets_every_served_name_the_request_id_header_and_the_access_log_switch():
    options = launch.VllmOptions(served_model_names=("smollm2", "gpt-4.1-mini"), access_log=False)
    args = launch.command(options, "/models/x", "ignored", cpu=True)
    at = args.index("--served-model-name")
    assert args[at + 1: at + 4] == ["smollm2", "gpt-4.1-mini", "--host"]
    assert "--enable-request-id-headers" in args and "--disable-uvicorn-access-log" in args
    args = launch.command(launch.VllmOptions(), "/models/x", "smollm2", cpu=True)
    at = args.index("--served-model-name")
    assert args[at + 1: at + 3] == ["smollm2", "--host"] and "--disable-uvicorn-access-log" not in args


# ---------------------------------------------------------------------------- the real server, slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``lookupdec serve --served-model-name smollm2 gpt-4.1-mini`` on the embedded model: (url, log path)."""
    pytest.importorskip("fastapi")
    from lookupdec import models

    try:
        models.model_folder()
    except models.ModelLoadError as err:
        pytest.skip(f"embedded model unavailable: {err}")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lookupdec.cli", "serve", "--port", str(port),
                                 "--no-calibrate", "--max-batch", "4", "--served-model-name", *NAMES],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"the server exited: {log_path.read_text()}"
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        yield url, log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _edit_answer(answer: dict) -> None:
    """The README's edit came back: the port changed, the rest copied, the prediction counted."""
    text = answer["choices"][0]["message"]["content"]
    assert "port: 9090" in text and "name: web" in text and "image: nginx:1.25" in text, text
    assert answer["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


@pytest.mark.slow
def test_smart_composers_apply_gets_its_edit_under_an_openai_model_name(served):
    url, log_path = served
    r = httpx.post(url + "/v1/chat/completions", json=smart_composer(), timeout=300)
    assert r.status_code == 200, r.text
    _edit_answer(r.json())
    assert r.json()["model"] == "smollm2"  # answers carry the first name, as vLLM's do
    assert r.headers["x-request-id"] == r.json()["id"]
    assert {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]} == set(NAMES)


@pytest.mark.slow
def test_gooses_typeless_prediction_gets_its_edit(served):
    url, log_path = served
    r = httpx.post(url + "/v1/chat/completions", json=goose(), timeout=300, headers={"x-request-id": "goose-1"})
    assert r.status_code == 200, r.text
    _edit_answer(r.json())
    assert r.headers["x-request-id"] == "goose-1"
    deadline = time.monotonic() + 10
    while "request_id=goose-1 " not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(line for line in log_path.read_text().splitlines() if "request_id=goose-1 " in line)
    usage = r.json()["usage"]
    assert f"completion_id={r.json()['id']} " in line and " status=200 " in line
    assert f" prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']} " in line
    assert f" passes={usage['lookup']['passes']} " in line


_NODE_SCRIPT = r"""
const mod = require(process.argv[2]);
const OpenAI = mod.OpenAI || mod.default || mod;
const url = process.argv[3], messages = JSON.parse(process.argv[4]), file = process.argv[5];
(async () => {
  const client = new OpenAI({ baseURL: url + "/v1", apiKey: "unused", maxRetries: 0, timeout: 300000 });
  const models = [];
  for await (const model of client.models.list()) models.push(model.id);
  const request = { messages, temperature: 0, stop: ["\n```"], prediction: { type: "content", content: file } };
  const { data: chat, response } = await client.chat.completions
    .create({ ...request, model: "gpt-4.1-mini" }).withResponse();
  const stream = await client.chat.completions.create({ ...request, model: "smollm2", stream: true,
                                                        stream_options: { include_usage: true } });
  let text = "", usage = null;
  const ids = new Set();
  for await (const chunk of stream) {
    ids.add(chunk.id);
    if (chunk.choices.length) text += chunk.choices[0].delta.content || "";
    if (chunk.usage) usage = chunk.usage;
  }
  console.log(JSON.stringify({ models, chat, requestId: response.headers.get("x-request-id"),
                               stream: { text, usage, ids: [...ids] } }));
})().catch((err) => { console.error(String(err && err.stack || err)); process.exit(1); });
"""


@pytest.fixture(scope="module")
def node_openai():
    """The folder of npm's ``openai`` 5.x (installed once, cached); skipped without node and npm or offline."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node or npm is not installed")
    folder = Path(os.environ.get("LOOKUPDEC_TEST_NODE_DIR") or Path.home() / ".cache/lookupdec/test-node-openai5")
    package = folder / "node_modules" / "openai"
    if not (package / "package.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = folder.parent / f".{folder.name}-{os.getpid()}"  # installed aside, then moved in whole
        try:
            done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(staging), "openai@5"],
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            shutil.rmtree(staging, ignore_errors=True)
            pytest.skip("npm install openai@5 timed out (offline?)")
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
            pytest.skip(f"npm install openai@5 failed (offline?): {tail}")
        try:
            os.replace(staging, folder)
        except OSError:  # another run installed it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
    version = json.loads((package / "package.json").read_text())["version"]
    assert version.startswith("5."), version
    return node, package


@pytest.mark.slow
def test_the_official_node_client_gets_its_edit_plain_and_streamed(served, node_openai, tmp_path):
    url, _ = served
    node, package = node_openai
    script = tmp_path / "client.cjs"
    script.write_text(_NODE_SCRIPT)
    done = subprocess.run([node, str(script), str(package), url, json.dumps(MESSAGES), FENCED],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out["models"]) == set(NAMES)
    _edit_answer(out["chat"])
    assert out["chat"]["model"] == "smollm2" and out["requestId"] == out["chat"]["id"]
    stream = out["stream"]
    assert stream["text"] == out["chat"]["choices"][0]["message"]["content"]  # greedy: the same edit
    assert stream["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    openai_part = lambda usage: {k: v for k, v in usage.items() if k != "lookup"}  # noqa: E731 - lookup's
    assert openai_part(stream["usage"]) == openai_part(out["chat"]["usage"])  # figures depend on the rolling cache
    assert len(stream["ids"]) == 1
