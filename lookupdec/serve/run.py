"""One server run: load the model and the rolling cache, start listening (``/health`` says ``"starting"`` while the
pass cost is measured), serve until SIGTERM or Ctrl-C, then drain: no new connections, the requests in flight get
``drain_timeout`` seconds to finish and what is still running is answered with a 503, and the rolling cache is
saved atomically."""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from ..cache import RollingCache
from ..drafter import Drafter, DrafterConfig, new_cache
from ..errors import LookupdecError
from ..models import DEFAULT_MODEL, load_model

_log = logging.getLogger(__name__)


class ServeError(LookupdecError):
    """A server that cannot start (bad option, model that cannot be loaded, missing extra): one line."""


@dataclass
class ServeOptions:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_queue: int = 64
    cache: Path | None = None
    api_key: str | None = None
    device: str = "auto"
    dtype: str = "default"
    drain_timeout: float = 30.0  # seconds the requests in flight get to finish at shutdown
    calibrate: bool = True  # measure the pass cost (once per machine); False: a straight-line fit learned online
    cache_scope: str = "user"  # whose earlier answers a request drafts from (lookupdec.cache.CACHE_SCOPES)
    max_slowdown: float | None = 0.05  # DrafterConfig.max_slowdown: the per-request bound (None: throughput first)
    # The names requests may give the model; answers carry the first. Empty: the --model value (or the embedded
    # model's name). Several serve clients that send some fields only to the model names they know (Obsidian
    # Smart Composer sends `prediction` only to gpt-4o* and gpt-4.1*).
    served_model_names: tuple = ()
    access_log: bool = True  # one line per request on the lookupdec.access logger (stderr)
    # Torch threads of a worker that prefills prompts beside the decoding steps (0: between the steps; None: the
    # cores the steps leave free on a CPU, up to as many as they use: scheduler.default_prefill_threads).
    prefill_threads: int | None = None


def serve(options: ServeOptions, say=print) -> None:
    """Run the server in the foreground until it is told to stop."""
    try:
        import uvicorn

        from .app import create_app
        from .engine import Engine
    except ImportError as err:
        raise ServeError(f"the server needs its extra: pip install 'lookupdec[serve]' ({err})") from None
    from ..models import ModelLoadError

    if options.cache is not None and options.cache_scope == "off":
        raise ServeError("--cache keeps the rolling cache of earlier answers, and --cache-scope off keeps none")
    try:
        model, tokenizer = load_model(options.model, device=options.device, dtype=options.dtype, progress=True)
    except (ModelLoadError, ValueError) as err:
        raise ServeError(str(err)) from None
    names = list(options.served_model_names) or [options.model or DEFAULT_MODEL]
    name = names[0]
    access_log(options.access_log)
    cache = _load_cache(options.cache, say)
    drafter = Drafter(DrafterConfig(calibrate=options.calibrate, use_cache=options.cache_scope != "off",
                                    max_slowdown=options.max_slowdown), cache=cache)
    engine = Engine(model, tokenizer, drafter, max_batch=options.max_batch, max_queue=options.max_queue,
                    cache_scope=options.cache_scope, prefill_threads=options.prefill_threads)
    said = []

    def measuring() -> None:
        said.append(True)
        say(f"measuring the model's pass cost by draft length and batch size (once per machine; step {len(said)})..."
            if len(said) > 1 else "measuring the model's pass cost by draft length and batch size (once per machine;"
            " /health says 'starting' meanwhile)...")

    def startup() -> None:
        engine.calibrate(on_measure=measuring)
        if said:
            say("measured; ready")

    def save_cache() -> None:
        if options.cache is not None and drafter.cache is not None:
            try:
                drafter.cache.save(options.cache)
                say(f"saved the rolling cache ({len(drafter.cache)} tokens) to {options.cache}")
            except OSError as err:
                _log.error("could not save the rolling cache to %s: %s", options.cache, err)

    app = create_app(engine, names, api_key=options.api_key or os.environ.get("LOOKUPDEC_API_KEY") or None,
                     on_shutdown=save_cache, drain_timeout=options.drain_timeout, startup=startup)
    also = f" (also as {', '.join(names[1:])})" if len(names) > 1 else ""
    beside = f", prompts prefilled beside the steps on {engine.scheduler.threads} thread" \
        f"{'s' if engine.scheduler.threads > 1 else ''}" if engine.scheduler.threads else ""
    say(f"serving {name}{also} on http://{options.host}:{options.port}/v1 (max batch {engine.max_batch}{beside})")
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level="warning")
    # uvicorn handles SIGTERM and SIGINT while it serves (a graceful shutdown), then raises them again under the
    # handlers found at its start: those end the process quietly here, since the shutdown has been done.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        draining_server(config).run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    say("stopped")


def access_log(enabled: bool) -> None:
    """The access log (``lookupdec.access``, one line per request) to stderr with a timestamp, or off."""
    from .observe import ACCESS_LOG

    logger = logging.getLogger(ACCESS_LOG)
    logger.setLevel(logging.INFO if enabled else logging.WARNING)
    logger.propagate = False
    if enabled and not any(getattr(handler, "_lookupdec", False) for handler in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        handler._lookupdec = True
        logger.addHandler(handler)


def draining_server(config):
    """A ``uvicorn.Server`` for ``config`` (whose app is :func:`~lookupdec.serve.app.create_app`'s) that drains
    the app before uvicorn's own shutdown: it stops accepting connections, then the app gives the requests in
    flight their drain time and answers the rest with 503s; only then does uvicorn close the connections, which
    are all answered by then. (uvicorn alone would wait for the handlers and then cancel them, which cuts a stream
    mid-answer and answers a plain request with a bare text/plain 500.)"""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            for server in self.servers:
                server.close()
            await config.app.state.drain()
            await super().shutdown(sockets)

    # uvicorn's own wait comes after the drain: by then every request has its answer, so a few seconds suffice.
    config.timeout_graceful_shutdown = 10
    return DrainingServer(config)


def _load_cache(path: Path | None, say) -> RollingCache | None:
    """The rolling cache saved at ``path`` (a file that cannot be used is moved aside with a warning), or a new
    one; ``None`` without ``--cache`` (the drafter makes its own, kept in memory only)."""
    if path is None:
        return None
    if path.exists():
        cache = RollingCache.load(path)
        say(f"loaded the rolling cache from {path} ({len(cache)} tokens)")
        return cache
    return new_cache(DrafterConfig())
