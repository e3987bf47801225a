"""Where client work runs: the torch device named by a config's ``device`` key.

In the engine layer (not the experiment layer) because a deployed node resolves its own device
without any of the runner's machinery."""

from __future__ import annotations

import torch


class DeviceUnavailable(ValueError):
    """The requested device does not exist on this machine (one-line message)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceUnavailable(
            f"device: {name!r} requested but CUDA is not available (torch.cuda.is_available() is False)"
        )
    if name == "mps" and not torch.backends.mps.is_available():
        raise DeviceUnavailable("device: 'mps' requested but it is not available")
    return torch.device(name)


def peak_memory_mib(device: torch.device) -> float | None:
    """The most CUDA memory tensors held on ``device`` since the previous call (MiB), the peak then reset
    (a run's rounds, one after another: memory that grows over rounds shows); None off CUDA."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**20
    torch.cuda.reset_peak_memory_stats(device)
    return peak
