"""lookupdec: exact draft-free speculative decoding for transformers causal LMs.

Drafts are copied from the prompt, the output so far, reference texts and earlier outputs, then verified by the
target model in one forward pass. Greedy output is token-identical to plain decoding; sampled output follows the
target's distribution exactly.

    from lookupdec import LookupDrafter, generate
    out = generate(model, input_ids, max_new_tokens=256)              # our loop
    ids = model.generate(**inputs, assistant_model=LookupDrafter())   # transformers' loop
"""

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)

# Attributes resolve lazily so `import lookupdec` (and the CLI's --help) does not pay for torch and numba.
_EXPORTS = {
    "generate": ("loop", "generate"),
    "calibrate": ("calibration", "calibrate"),
    "GenerationStats": ("stats", "GenerationStats"),
    "LookupOutput": ("stats", "LookupOutput"),
    "LookupDrafter": ("assistant", "LookupDrafter"),
    "Drafter": ("drafter", "Drafter"),
    "DrafterConfig": ("drafter", "DrafterConfig"),
    "RollingCache": ("cache", "RollingCache"),
    "load_model": ("models", "load_model"),
    "use_grouped_attention": ("_transformers", "use_grouped_attention"),
    "TraceRecorder": ("trace", "TraceRecorder"),
    "LookupdecError": ("errors", "LookupdecError"),
    "ModelLoadError": ("models", "ModelLoadError"),
    "CacheFileError": ("cache", "CacheFileError"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        module, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
