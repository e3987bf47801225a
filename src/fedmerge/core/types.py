"""Plain-data records that cross the server/client boundary.

A record is a dict of tensors plus small JSON metadata. Records round-trip through bytes
(safetensors), so the same algorithm runs in-process or over a network engine unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

_META_KEY = "fedmerge_meta"


@dataclass
class Record:
    """Tensors plus JSON-serialisable metadata."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}
        return st_save(tensors, metadata={_META_KEY: json.dumps(self.meta, sort_keys=True)})

    @classmethod
    def from_bytes(cls, data: bytes) -> Record:
        tensors = st_load(data)
        meta = json.loads(_read_metadata(data).get(_META_KEY, "{}"))
        return cls(tensors=dict(tensors), meta=meta)

    def num_parameters(self) -> int:
        """Number of floating-point values carried (model size figures)."""
        return sum(t.numel() for t in self.tensors.values() if t.is_floating_point())

    def num_values(self) -> int:
        """Number of tensor values of any dtype carried: what communication accounting counts
        (the JSON metadata, a few scalars such as the round or the sample count, is left out)."""
        return sum(t.numel() for t in self.tensors.values())

    def to(self, device: torch.device | str) -> Record:
        # tensors already there are kept as they are (what .to returns), without a call per tensor
        dev = torch.device(device)
        return type(self)({k: v if v.device == dev else v.to(dev) for k, v in self.tensors.items()}, dict(self.meta))

    def clone(self) -> Record:
        return type(self)({k: v.detach().clone() for k, v in self.tensors.items()}, json.loads(json.dumps(self.meta)))


class Payload(Record):
    """What the server sends one client in a round."""


class Update(Record):
    """What one client returns to the server. ``meta['num_examples']`` is the aggregation weight."""

    @property
    def num_examples(self) -> int:
        return int(self.meta["num_examples"])


class ClientState(Record):
    """Per-client persistent state, held by the runner (never inside a client object)."""


class ServerState(Record):
    """Everything the server keeps between rounds."""


def _read_metadata(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    return header.get("__metadata__", {}) or {}
