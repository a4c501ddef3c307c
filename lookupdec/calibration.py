"""Pass-cost profiles: how a target's verification pass time grows with draft length, measured once per model,
device and thread count, and cached on disk.

Whether a draft pays depends on what verifying it costs, and that curve is a property of the model, the hardware
and the math library, not of the text. On a 2-core x86_64 CPU (SmolLM2-135M, fp32, one torch thread) it is
far from a straight line: MKL runs matrix products with 2 or 3 rows as that many matrix-vector products and only
from 4 rows on as a matrix-matrix product, so a pass with 2 drafted tokens (3 rows fed) costs about 2.0 plain
steps while one with 3 drafted tokens costs about 1.5; with two threads the whole curve is flatter (32 drafted
tokens: 2.5-3.0 steps instead of 3.7). A straight-line fit cannot see that, so :func:`pass_costs` measures the time of
a pass at every draft length up to 4 and at a few longer ones (interpolated between), on a synthetic context, in
2.1-2.4 s for SmolLM2-135M on a 2-core CPU, one thread, and keeps the result in ``cache_dir()/costs/`` keyed by
everything that changes it. Batches are measured the same way per batch-size bucket, for drafts of up to
``BATCH_DRAFT``.

:func:`calibrate` hands the profile to a drafter; :func:`lookupdec.generate` does that on its own when
``DrafterConfig.calibrate`` is set (the default). For the transformers route call it yourself::

    drafter = LookupDrafter()
    lookupdec.calibrate(drafter, model)
    model.generate(**inputs, assistant_model=drafter)
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import platform
import threading
import time
import weakref

import numpy as np
import torch

from ._device import input_device
from ._fs import atomic_write, cache_dir
from ._transformers import forward_params, rollback_cache, target_forward
from .drafter import Drafter, DrafterConfig
from .policy import Refinement

_log = logging.getLogger(__name__)

PROFILE_VERSION = 4  # bump when the measurement changes: files of another version are measured again
BATCH_DRAFT = 32  # longest draft length measured for batches: a wide batch pass is costly, so batches draft short
CONTEXT = 64  # tokens of synthetic context the passes run on (docs/design.md, "Calibration": the curve barely moves)
ROUNDS = 1  # timing rounds over every measured length at least; the fastest is kept (interference only adds time)
SHORT = 3  # lengths up to this one get at least one more round: the curve is jagged there, and passes are cheap
MAX_ROUNDS = 6  # rounds per length at most, while they fit in BUDGET_S
BUDGET_S = 1.0  # seconds of timed rounds a fast model may spend on more samples (a first call waits for them)
# Plausibility (implausible): no length cheaper than FLOOR plain steps, no short length dearer than SPIKE times a
# longer one; a profile that fails is measured again, at most REMEASURE more times (each length's cheapest kept),
# and one that still fails is used but not saved.
FLOOR = 0.7
SPIKE = 2.0
REMEASURE = 2

_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(threads, device, dtype): profile}
_memo_lock = threading.Lock()  # guards _memo and _key_locks only, never held while measuring
_key_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {local key: Lock}
_refinements: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {local key: Refinement}


def calibrate(drafter: Drafter, model, *, rows: int = 1, refresh: bool = False, on_measure=None) -> np.ndarray:
    """Give ``drafter`` the measured pass-cost profile of ``model`` for passes of ``rows`` rows (measured now, or
    read from the cache) and return it: ``profile[d]`` is the time of a pass with ``d`` drafted positions relative
    to a plain step of as many rows. Batches are priced per :meth:`Drafter.batch_rows` bucket (``rows`` is
    rounded up to it). ``on_measure()`` is called before a measurement (not when the profile is known), e.g. to say
    why it waits. Raises what measuring raises (``ValueError`` for a model whose context is too short to measure
    in); :func:`lookupdec.generate` catches that, warns, and keeps the straight-line fit."""
    rows = drafter.batch_rows(rows)
    longest = drafter.drafter_config.max_draft if rows == 1 else min(drafter.drafter_config.max_draft, BATCH_DRAFT)
    profile = pass_costs(model, longest, rows=rows, refresh=refresh, on_measure=on_measure)
    drafter.batch_cost(rows).use_profile(profile, source=model, refine=refinement(model, rows))
    return profile


def refinement(model, rows: int = 1) -> Refinement:
    """The one :class:`~lookupdec.policy.Refinement` of ``model``'s profile for passes of ``rows`` rows (at the
    current thread count, device and dtype), shared by every drafter calibrated to it in this process: what the
    passes of one request taught about the profile, the next request's drafter knows. Not saved: a profile on
    disk is a measurement, and each process corrects it from its own passes."""
    local = (torch.get_num_threads(), str(model.device), str(model.dtype), rows)
    with _memo_lock:
        return _refinements.setdefault(model, {}).setdefault(local, Refinement())


def calibrate_or_warn(drafter: Drafter, model, on_measure=None, *, rows: int = 1) -> None:
    """What :func:`lookupdec.generate` and the CLI run before decoding: calibrate ``drafter`` to ``model`` unless
    its config says not to (``calibrate=False``, or ``adaptive=False``: it does not choose lengths) or the caller
    set a profile of its own. A calibration that fails only costs the measured curve: a warning, and the drafter
    keeps its straight-line fit."""
    config = drafter.drafter_config
    if not (config.calibrate and config.adaptive):
        return
    cost = drafter.batch_cost(rows)
    if cost.profile is not None and cost.profile_source is None:
        return  # set by hand with use_profile(): the caller knows better
    if cost.profile_source is model:
        return  # already calibrated to this model (the memo would answer too, but this skips the key)
    try:
        calibrate(drafter, model, rows=rows, on_measure=on_measure)
    except Exception as err:  # any failure here must not stop generation
        _log.warning("could not measure the pass cost of %s (%s); drafting with a straight-line cost model",
                     type(model).__name__, err)


def pass_costs(model, max_draft: int = DrafterConfig.max_draft, *, rows: int = 1, refresh: bool = False,
               on_measure=None) -> np.ndarray:
    """``profile[d]`` for ``d = 0 .. max_draft`` (a new array): the time of one target pass over ``rows`` rows with
    ``d`` drafted positions each, relative to a plain step of ``rows`` rows, on this model, device, dtype and torch
    thread count. Read from ``cache_dir()/costs/`` when measured before (``refresh`` measures again), kept in
    memory per model. Other models and threads are not held up while one model is measured."""
    if max_draft < 1 or rows < 1:
        raise ValueError(f"need max_draft >= 1 and rows >= 1, got {max_draft} and {rows}")
    # What can change between calls on one model object; the full key (config, versions) is computed on a miss.
    local = (torch.get_num_threads(), str(model.device), str(model.dtype), rows)
    with _memo_lock:
        known = _memo.get(model, {}).get(local)
        if known is not None and known.size > max_draft and not refresh:
            return known[: max_draft + 1].copy()
        lock = _key_locks.setdefault(model, {}).setdefault(local, threading.Lock())
    with lock:  # one measurement per model and key at a time; a caller that waited finds it done
        with _memo_lock:
            known = _memo.get(model, {}).get(local)
        if known is not None and known.size > max_draft and not refresh:
            return known[: max_draft + 1].copy()
        path = cache_dir() / "costs" / f"{profile_key(model)}{'' if rows == 1 else f'-rows{rows}'}.json"
        profile = None if refresh else _read(path, max_draft)
        if profile is None:
            if on_measure is not None:
                on_measure()
            _log.info("measuring the pass cost of %s by draft length, %d row(s) (once; cached in %s)",
                      type(model).__name__, rows, path.parent)
            started = time.perf_counter()
            profile = measure_pass_costs(model, max_draft, rows=rows)
            reason = implausible(profile)
            for _ in range(REMEASURE):
                if reason is None:
                    break
                _log.info("pass-cost profile of %s looks disturbed (%s); measuring again", type(model).__name__,
                          reason)
                profile = np.minimum(profile, measure_pass_costs(model, max_draft, rows=rows))
                reason = implausible(profile)
            _log.info("measured the pass-cost profile of %s (%d row(s)) in %.1f s: %s", type(model).__name__,
                      rows, time.perf_counter() - started, np.round(profile, 2).tolist())
            if reason is None:
                _write(path, profile)
            else:  # used for this process only (the passes run refine it); the next start measures again
                _log.warning("the pass-cost profile of %s still looks disturbed after %d measurements (%s): not "
                             "saved; is the machine busy?", type(model).__name__, REMEASURE + 1, reason)
        with _memo_lock:
            _memo.setdefault(model, {})[local] = profile
            _refinements.get(model, {}).pop(local, None)  # corrections of another profile do not carry over
        return profile[: max_draft + 1].copy()


def measure_pass_costs(model, max_draft: int = DrafterConfig.max_draft, *, rows: int = 1, context: int = CONTEXT,
                       rounds: int = ROUNDS, budget_s: float = BUDGET_S, lengths=None) -> np.ndarray:
    """Time target passes of ``rows`` x ``d + 1`` tokens on a ``context``-token cache for ``d`` in :func:`_lengths`,
    in interleaved rounds after the untimed prefill of the context (a first round read no slower than later ones,
    so no other warm-up is spent): ``rounds`` over every length, more while they fit in ``budget_s`` seconds (fast
    models get more samples, at most ``MAX_ROUNDS``), then rounds over the short lengths (up to ``SHORT``, where
    the curve is jagged and a pass is cheap) until those have had ``rounds + 1``. Keeps each length's fastest time
    (interference from other work only ever adds time), past ``SHORT`` no dearer than a longer length's,
    relative to ``d == 0``, interpolated to every ``d = 0 ..
    max_draft``. Uses its own generator: the global RNG is left alone. ``ValueError`` when the model's context
    cannot hold the passes, or the timings make no sense. ``lengths``: the draft lengths to time instead of
    :func:`_lengths` (0 and ``max_draft`` among them), e.g. every one for a study of the whole curve."""
    if max_draft < 1 or rounds < 1:
        raise ValueError(f"need max_draft >= 1 and rounds >= 1, got {max_draft} and {rounds}")
    lengths = _lengths(max_draft) if lengths is None else sorted(set(lengths) | {0, max_draft})
    if lengths[0] < 0 or lengths[-1] > max_draft:
        raise ValueError(f"lengths must lie in 0..{max_draft}, got {lengths[0]}..{lengths[-1]}")
    text = model.config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None) or 1 << 30
    if limit < max_draft + 3:
        raise ValueError(f"a context of {limit} positions cannot hold a {max_draft}-token draft after a prompt")
    context = max(1, min(context, limit - max_draft - 2))
    generator = torch.Generator().manual_seed(0)
    device = input_device(model)
    params = forward_params(model)
    times = {d: [] for d in lengths}

    def one_round(chosen) -> float:
        started = time.perf_counter()
        for d in chosen:
            feed = torch.randint(text.vocab_size, (rows, d + 1), generator=generator).to(device)
            start = time.perf_counter()
            # .item() waits for the pass on any device (CUDA, MPS, XPU, a model split over several GPUs).
            target_forward(model, feed, cache, d + 1, params)[0, -1, 0].item()
            times[d].append(time.perf_counter() - start)
            cache.crop(-(d + 1))
        return time.perf_counter() - started

    with torch.inference_mode():
        cache = rollback_cache(model)
        target_forward(model, torch.randint(text.vocab_size, (rows, context), generator=generator).to(device),
                       cache, 1, params)
        spent, done = 0.0, 0
        while done < rounds or (done < MAX_ROUNDS and spent + spent / done <= budget_s):
            spent += one_round(lengths)
            done += 1
        short = [d for d in lengths if d <= SHORT] + [0]
        while len(times[1]) < rounds + 1 and len(times[1]) < MAX_ROUNDS:
            one_round(short)
    fastest = _capped(lengths, np.array([min(times[d]) for d in lengths]))
    if not np.all(np.isfinite(fastest)) or fastest.min() <= 0:
        raise ValueError(f"pass timings make no sense: {fastest.tolist()}")
    return np.interp(np.arange(max_draft + 1), lengths, fastest / fastest[0])


def implausible(profile: np.ndarray) -> str | None:
    """Why ``profile`` (relative costs by draft length, ``profile[0] == 1``) cannot be a quiet machine's pass-cost
    curve, or None. A pass over more tokens is not much cheaper than a plain step (no length below
    :data:`FLOOR`), and a short draft is not dearer than :data:`SPIKE` times a longer one (a CPU's curve is jagged
    for 1-3 drafted tokens, by up to 1.4x between neighbours, while a busy machine's interference reads 4-8x:
    docs/design.md, "Calibration")."""
    profile = np.asarray(profile, dtype=np.float64)
    low = int(np.argmin(profile[1:])) + 1 if profile.size > 1 else 0
    if low and profile[low] < FLOOR:
        return f"{low} drafted tokens priced at {profile[low]:.2f} plain steps"
    cheapest_after = np.minimum.accumulate(profile[::-1])[::-1]  # the cheapest length from d on
    for d in range(1, profile.size - 1):
        if profile[d] > SPIKE * cheapest_after[d + 1]:
            return (f"{d} drafted tokens priced at {profile[d]:.2f} plain steps, "
                    f"a longer draft at {cheapest_after[d + 1]:.2f}")
    return None


def profile_key(model) -> str:
    """A file-name-safe digest of what the pass-cost curve depends on: the model's class and config, its dtype and
    device, torch's thread count, the versions of torch and transformers, and the processor."""
    import transformers

    parts = {
        "version": PROFILE_VERSION,
        "class": type(model).__qualname__,
        "config": json.dumps({k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"},
                             sort_keys=True, default=str),
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
    """The draft lengths measured: every one up to ``SHORT`` (the most common drafts, and where a CPU's curve is
    jagged), then 4, 8, 16, 32 and every 32nd, and ``max_draft``; the profile interpolates between them. Pricing
    drafts with profiles measured this way instead of a dense, many-round curve moved simulated speed by a few
    percent at most (suite medians, SmolLM2 on a 2-core CPU; docs/design.md, "Calibration")."""
    lengths = list(range(min(max_draft, SHORT) + 1)) + [d for d in (4, 8, 16, 32) if SHORT < d < max_draft]
    lengths += list(range(64, max_draft, 32))
    if lengths[-1] != max_draft:
        lengths.append(max_draft)
    return lengths


def _capped(lengths: list[int], fastest: np.ndarray) -> np.ndarray:
    """``fastest`` with each time past ``SHORT`` lowered to the cheapest time of any longer length: a pass over
    more positions does not run faster there (the jagged part of a CPU's curve lies below), so a length that
    reads dearer than a longer one caught interference in its single round."""
    fastest = np.array(fastest, dtype=np.float64)
    tail = int(np.searchsorted(lengths, SHORT, side="right"))
    fastest[tail:] = np.minimum.accumulate(fastest[tail:][::-1])[::-1]
    return fastest


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
    """Through the one atomic write; a cache that cannot be written only means measuring again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as f:
            json.dump({"version": PROFILE_VERSION, "profile": profile.tolist()}, f)
    except OSError as err:
        _log.warning("could not cache the pass-cost profile in %s: %s", path.parent, err)
