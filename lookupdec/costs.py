"""Pass-cost profiles: how a target's verification pass time grows with draft length, measured once per model,
device and thread count, and cached on disk.

Whether a draft pays depends on what verifying it costs, and that curve is a property of the model, the hardware
and the math library, not of the text. On this project's 2-core CPU (SmolLM2-135M, fp32, one torch thread) it is
far from a straight line: MKL runs matrix products with 2 or 3 rows as that many matrix-vector products and only
from 4 rows on as a matrix-matrix product, so a pass with 2 drafted tokens (3 rows fed) costs about 2.0 plain
steps while one with 3 drafted tokens costs about 1.55; with two threads the whole curve is flatter (32 drafted
tokens: 2.5 steps instead of 3.8). A straight-line fit cannot see that, so :func:`pass_costs` measures the time of
a pass at every draft length up to 16 and every fourth one beyond (interpolated between), on a synthetic context,
and keeps the result in ``cache_dir()/costs/`` keyed by everything that changes it.

:func:`calibrate` hands the profile to a drafter; :func:`lookupdec.generate` does that on its own when
``DrafterConfig.calibrate`` is set (the default). For the transformers route call it yourself::

    drafter = LookupDrafter()
    lookupdec.calibrate(drafter, model)
    model.generate(**inputs, assistant_model=drafter)
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import platform
import statistics
import tempfile
import threading
import time
import weakref

import numpy as np
import torch
from transformers import DynamicCache

from .drafter import LookupDrafter
from .hf import target_forward
from .models import cache_dir

_log = logging.getLogger(__name__)

PROFILE_VERSION = 1  # bump when the measurement changes meaning; old files are then measured again
CONTEXT = 256  # tokens of synthetic context the passes run on (the curve barely moves between 300 and 1000)
ROUNDS = 3  # interleaved timing rounds per length; the median is kept

_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(threads, device, dtype): profile}
_memo_lock = threading.Lock()


def calibrate(drafter: LookupDrafter, model, *, refresh: bool = False, on_measure=None) -> np.ndarray:
    """Give ``drafter`` the measured pass-cost profile of ``model`` (measured now, or read from the cache) and
    return it: ``profile[d]`` is the time of a pass with ``d`` drafted tokens relative to a plain step.
    ``on_measure()`` is called before a measurement (not when the profile is known), e.g. to say why it waits."""
    profile = pass_costs(model, drafter.drafter_config.max_draft, refresh=refresh, on_measure=on_measure)
    drafter.cost.use_profile(profile)
    return profile


def pass_costs(model, max_draft: int = 32, *, refresh: bool = False, on_measure=None) -> np.ndarray:
    """``profile[d]`` for ``d = 0 .. max_draft``: the median time of one target pass with ``d`` drafted tokens,
    relative to a plain step, on this model, device, dtype and torch thread count. Read from
    ``cache_dir()/costs/`` when measured before (``refresh`` measures again), kept in memory per model."""
    # What can change between calls on one model object; the full key (config, versions) is computed on a miss.
    local = (torch.get_num_threads(), str(model.device), str(model.dtype))
    with _memo_lock:
        known = _memo.setdefault(model, {}).get(local)
        if known is not None and known.size > max_draft and not refresh:
            return known[: max_draft + 1]
        path = cache_dir() / "costs" / f"{profile_key(model)}.json"
        profile = None if refresh else _read(path, max_draft)
        if profile is None:
            if on_measure is not None:
                on_measure()
            started = time.perf_counter()
            profile = measure_pass_costs(model, max_draft)
            _log.info("measured the pass-cost profile of %s in %.1f s: %s", type(model).__name__,
                      time.perf_counter() - started, np.round(profile, 2).tolist())
            _write(path, profile)
        _memo[model][local] = profile
        return profile[: max_draft + 1]


def measure_pass_costs(model, max_draft: int = 32, *, context: int = CONTEXT, rounds: int = ROUNDS) -> np.ndarray:
    """Time target passes of ``d + 1`` tokens on a ``context``-token cache for ``d`` in :func:`_lengths`, in
    ``rounds`` interleaved rounds (after one untimed warm-up round); returns the medians relative to ``d == 0``,
    interpolated to every ``d = 0 .. max_draft``. Uses its own generator: the global RNG is left alone."""
    lengths = _lengths(max_draft)
    limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    context = max(1, min(context, limit - max_draft - 2))
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    device = model.device
    params = frozenset(inspect.signature(model.forward).parameters)
    times = {d: [] for d in lengths}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()
        target_forward(model, torch.randint(vocab, (1, context), generator=generator).to(device), cache, 1, params)
        for round_ in range(rounds + 1):
            for d in lengths:
                feed = torch.randint(vocab, (1, d + 1), generator=generator).to(device)
                _sync(device)
                start = time.perf_counter()
                target_forward(model, feed, cache, d + 1, params)
                _sync(device)
                if round_:  # round 0 warms up every shape
                    times[d].append(time.perf_counter() - start)
                cache.crop(-(d + 1))
    medians = np.array([statistics.median(times[d]) for d in lengths])
    return np.interp(np.arange(max_draft + 1), lengths, medians / medians[0])


def profile_key(model) -> str:
    """A file-name-safe digest of what the pass-cost curve depends on: the model's class and config, its dtype and
    device, torch's thread count, the versions of torch and transformers, and the processor."""
    import transformers

    parts = {
        "version": PROFILE_VERSION,
        "class": type(model).__qualname__,
        "config": model.config.to_json_string(use_diff=False),
        "dtype": str(model.dtype),
        "device": str(model.device),
        "threads": torch.get_num_threads() if model.device.type == "cpu" else 0,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "processor": _processor(),
        "attention": getattr(model.config, "_attn_implementation", None),
    }
    if model.device.type == "cuda":
        parts["gpu"] = torch.cuda.get_device_name(model.device)
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
    return f"{type(model).__name__}-{digest}"


def _lengths(max_draft: int) -> list[int]:
    """Every draft length up to 16 (where the curve is jagged), then every fourth, then every sixteenth past 64."""
    lengths = list(range(min(max_draft, 16) + 1))
    lengths += list(range(20, min(max_draft, 64) + 1, 4)) + list(range(80, max_draft + 1, 16))
    if lengths[-1] != max_draft:
        lengths.append(max_draft)
    return lengths


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@functools.lru_cache(maxsize=1)
def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read(path, max_draft: int) -> np.ndarray | None:
    try:
        data = json.loads(path.read_text())
        profile = np.asarray(data["profile"], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: measure again
    if data.get("version") != PROFILE_VERSION or profile.ndim != 1 or profile.size <= max_draft \
            or not np.all(np.isfinite(profile)) or profile.min() <= 0:
        return None
    return profile


def _write(path, profile: np.ndarray) -> None:
    """Atomically (temporary file in the same folder, then ``os.replace``); a cache that cannot be written only
    means measuring again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".costs-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": PROFILE_VERSION, "profile": profile.tolist()}, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as err:
        _log.warning("could not cache the pass-cost profile in %s: %s", path.parent, err)
