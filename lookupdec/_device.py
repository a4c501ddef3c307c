"""Device plumbing for the loops: where input ids go, waiting for a device before reading a clock, and host
buffers that copy to an accelerator without blocking."""

from __future__ import annotations

import torch


def input_device(model) -> torch.device:
    """Where the model reads its input ids: the input embedding's device. For a model spread over devices
    (``device_map="auto"``) that is the first one, while logits come back on the last; ``model.device`` may be
    either."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    return weight.device if isinstance(weight, torch.Tensor) else model.device


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run the work queued on it, so a clock read afterwards times that work (on CUDA a
    forward call returns as soon as its kernels are queued). Nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def host_buffer(size: int, device: torch.device) -> torch.Tensor:
    """A host-side int64 buffer for what the loops feed the model; page-locked when the model is on CUDA, so
    copying it to the device does not block the host."""
    return torch.empty(size, dtype=torch.long, pin_memory=device.type == "cuda")
