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
