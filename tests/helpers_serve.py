"""Serving the tiny models over HTTP without a real tokenizer: :class:`CharTokenizer` (one character per token id)
and :func:`running_app` (any app on uvicorn in a thread, at a free port of 127.0.0.1); :func:`gated_passes` holds the
engine's target passes while a test sets the scene."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

BASE = 0x100  # token i is the character chr(BASE + i): printable, one character, valid Unicode


class CharTokenizer:
    """Token ``i`` is the character ``chr(BASE + i)``; no chat template (the tiny models serve /v1/completions)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        return [ord(c) - BASE for c in text]

    def decode(self, ids, **kwargs) -> str:
        return "".join(chr(BASE + int(i)) for i in ids)


def text_of(ids) -> str:
    """The text :class:`CharTokenizer` encodes as ``ids``."""
    return CharTokenizer().decode(ids)


@contextmanager
def running_app(app):
    """``app`` on uvicorn in a thread, at a free port of 127.0.0.1; yields its base URL; stopped (drained) on
    exit."""
    import uvicorn

    from lookupdec.serve.run import draining_server

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = draining_server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def gated_passes(monkeypatch) -> threading.Event:
    """Every target pass of lookupdec's batch loop waits while the returned event is clear (it starts set)."""
    from lookupdec import batch as batch_module

    gate = threading.Event()
    gate.set()
    real = batch_module.target_forward

    def forward(*args, **kwargs):
        gate.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(batch_module, "target_forward", forward)
    return gate


def wait_for_load(engine, load: tuple, timeout: float = 30.0) -> None:
    """Wait until ``engine.load`` (running, waiting) is ``load``; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while engine.load != load:
        assert time.monotonic() < deadline, engine.load
        time.sleep(0.005)
