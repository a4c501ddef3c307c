"""lookupdec: exact draft-free speculative decoding for transformers causal LMs."""

__version__ = "0.1.0"
