"""What a client puts into a secure sum and what the server makes of the sum (no cryptography here).

Secure aggregation (Flower's SecAgg+, ``engines/flower/secure.py``) gives the server the sum of the clients'
vectors and nothing else: each vector is quantized to integers, masked, and the masks cancel only in the
sum. This module decides what those vectors are so that, from the sum alone, the server recovers exactly
what an admitted method's aggregate needs (``Algorithm.secure_aggregation_refusal``):

- a *mean* tensor (the default) enters as ``(w_i / W) * (t_i - p_i)``: the client's change to the tensor
  ``p_i`` it was sent, pre-multiplied by its weight ``w_i`` (its sample count, or 1 for a uniform mean) over
  a bound ``W`` (``max_weight``) common to all clients; the server knows the ``p_i`` (it sent them) and the
  weights (sent in the clear with the update's metadata), so ``sum_i w_i t_i / sum_i w_i =
  (sum_i w_i p_i + W * S) / sum_i w_i``;
- a *summed* tensor (SCAFFOLD's control-variate changes, which its server adds up) enters as ``t_i``.

Integer tensors (BatchNorm's step counters) are divided by ``INT_SCALE`` first (their change per round is a
count of steps, far above the clipping range) and rounded back as `weighted_average()` does.

Quantization: each value is clipped to ``[-C, C]`` and stochastically rounded to a step ``2C / Q``, so the
recovered sum of ``m`` vectors is within ``m * 2C / Q`` of the true sum, elementwise. A value outside the
range would be clipped silently by the protocol, so [`summands()`][fedmerge.core.secure_sum.summands] refuses it
instead (one line).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .types import Update

StateDict = dict[str, torch.Tensor]
INT_SCALE = 1024.0  # integer tensors enter divided by this (their step counts would exceed the range)
MOD_BITS = 32  # Flower's SecAgg+ sums modulo 2**32 (masks are drawn below it)
MAX_QUANT_BITS = 30  # Flower's stochastic rounding casts to int32


class SecureSumError(ValueError):
    """A client's update cannot enter the secure sum (a value out of range, a weight above the bound)."""


@dataclass(frozen=True)
class SumSettings:
    """The numbers every client of a round and the server share (``privacy.secure_aggregation``)."""

    max_weight: float  # W: the largest weight (sample count) of a client
    clipping_range: float  # C: each entered value must lie in [-C, C]
    quantization_range: int  # Q: the number of quantization steps over [-C, C]

    @property
    def step(self) -> float:
        """The quantization step ``2C / Q``: one client's rounding error is below it, per value."""
        return 2 * self.clipping_range / self.quantization_range

    def to_json(self) -> str:
        return json.dumps({"max_weight": self.max_weight, "clipping_range": self.clipping_range,
                           "quantization_range": self.quantization_range})  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> SumSettings:
        d = json.loads(text)
        return cls(float(d["max_weight"]), float(d["clipping_range"]), int(d["quantization_range"]))


def quantization_range(clients: int) -> int:
    """The finest quantization for a round of ``clients``: the sum of their quantized values (each at most
    ``Q``) must stay below the modulus ``2**32``, so that it is recovered exactly."""
    return 2 ** min(MAX_QUANT_BITS, MOD_BITS - math.ceil(math.log2(clients + 1)))


Layout = list[tuple[str, str, list[int]]]  # (key, dtype, shape) of each tensor, in the vector's order


def layout_of(update: Update) -> Layout:
    return [(k, str(t.dtype).removeprefix("torch."), list(t.shape)) for k, t in sorted(update.tensors.items())]


def _anchor(key: str, tensor: torch.Tensor, sent: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    p = sent.get(key)
    return p if p is not None and p.shape == tensor.shape and p.dtype == tensor.dtype else None


def _scale(tensor_dtype: torch.dtype) -> float:
    return 1.0 if tensor_dtype.is_floating_point else INT_SCALE


def summands(
    update: Update, sent: Mapping[str, torch.Tensor], weight: float, summed: Callable[[str], bool], s: SumSettings
) -> list[np.ndarray]:
    """The client's vector for the secure sum, one float64 array per tensor of ``update`` (key order).

    ``sent``: the tensors the client was sent (its payload); ``weight``: its weight in the mean;
    ``summed(key)``: the tensor is summed, not averaged. Raises
    [`SecureSumError`][fedmerge.core.secure_sum.SecureSumError] (one line) for a
    weight above ``max_weight`` or a value outside the clipping range."""
    if not 0 <= weight <= s.max_weight:
        raise SecureSumError(
            f"secure aggregation: this client's weight {weight:g} (its training samples) exceeds "
            f"privacy.secure_aggregation.max_weight={s.max_weight:g}; raise it to the largest client's"
        )
    out = []
    for key, t in sorted(update.tensors.items()):
        x = t.detach().to("cpu", torch.float64)
        if not summed(key):
            p = _anchor(key, t, sent)
            if p is not None:
                x = x - p.detach().to("cpu", torch.float64)
            x = x * (weight / s.max_weight)
        x = x / _scale(t.dtype)
        peak = float(x.abs().max()) if x.numel() else 0.0
        if not math.isfinite(peak) or peak > s.clipping_range:
            raise SecureSumError(
                f"secure aggregation: {key!r} enters the sum as {peak:.4g}, outside the clipping range "
                f"±{s.clipping_range:g}; raise privacy.secure_aggregation.clipping_range (coarser quantization)"
            )
        out.append(x.numpy())
    return out


@dataclass
class SummedUpdates:
    """All a server under secure aggregation receives for a round: one update whose tensors are the round's
    combination (the weighted mean of each mean tensor, the sum of each summed one), each client's metadata
    (in the clear), and the bound on the combination's error. Never a client's tensor."""

    combined: Update
    metas: dict[int, dict[str, Any]]
    error_bound: float  # largest elementwise error of a mean or summed float tensor (quantization)
    values_up: dict[int, int] = field(default_factory=dict)  # values each client sent (its masked vector)

    @property
    def clients(self) -> list[int]:
        return sorted(self.metas)


def combine(
    total: list[np.ndarray],
    layout: Layout,
    sent: Mapping[int, Mapping[str, torch.Tensor]],
    weights: Mapping[int, float],
    summed: Callable[[str], bool],
    s: SumSettings,
) -> tuple[StateDict, float]:
    """The server's side of [`summands()`][fedmerge.core.secure_sum.summands]: from the sum ``total`` of the vectors of
    the clients
    ``weights`` (their payload tensors in ``sent``), each tensor's weighted mean or sum, and the bound on
    the error of the float tensors: ``m * step * W / sum_i w_i`` for a mean, ``m * step`` for a sum."""
    cids = sorted(weights)
    m, w_total = len(cids), float(sum(weights[c] for c in cids))
    if w_total <= 0:
        raise SecureSumError("secure aggregation: the clients' weights sum to zero")
    out: StateDict = {}
    bound = 0.0
    for (key, dtype_name, shape), x in zip(layout, total, strict=True):
        dtype = getattr(torch, dtype_name)
        value = torch.from_numpy(np.asarray(x, dtype=np.float64)).reshape(shape) * _scale(dtype)
        if summed(key):
            err = m * s.step
        else:
            value = value * (s.max_weight / w_total)
            anchors = [(weights[c], sent[c].get(key)) for c in cids]
            if all(p is not None and list(p.shape) == shape and p.dtype == dtype for _, p in anchors):
                value = value + sum(w * p.detach().to("cpu", torch.float64) for w, p in anchors) / w_total
            err = m * s.step * s.max_weight / w_total
        if dtype.is_floating_point:
            bound = max(bound, err)
            out[key] = value.to(dtype)
        else:
            out[key] = torch.round(value).to(dtype)
    return out, bound
