"""State-dict arithmetic shared by every algorithm: clone, weighted average, flatten."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .merge import weighted_merge

StateDict = dict[str, torch.Tensor]


def clone_state(state: Mapping[str, torch.Tensor]) -> StateDict:
    return {k: v.detach().clone() for k, v in state.items()}


def weighted_average(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> StateDict:
    """sum_i w_i s_i / sum_i w_i for floating tensors, in the given (deterministic) order.

    Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) are counters, not parameters:
    the weighted mean is rounded back to the integer dtype.
    """
    if not states:
        raise ValueError("weighted_average needs at least one state")
    if len(states) != len(weights):
        raise ValueError("states and weights differ in length")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    coefs = [float(w) / total for w in weights]
    out: StateDict = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            out[key] = weighted_merge([s[key].detach() for s in states], coefs)
        else:
            acc = sum(c * s[key].double() for c, s in zip(coefs, states))
            out[key] = torch.round(acc).to(first.dtype)
    return out


def flatten(state: Mapping[str, torch.Tensor], keys: Sequence[str] | None = None) -> torch.Tensor:
    """Concatenate (float copies of) the tensors of ``keys`` into one vector."""
    keys = list(state) if keys is None else keys
    return torch.cat([state[k].detach().reshape(-1).to(torch.float32) for k in keys])


def unflatten(vector: torch.Tensor, like: Mapping[str, torch.Tensor], keys: Sequence[str] | None = None) -> StateDict:
    """Inverse of [`flatten()`][fedmerge.core.params.flatten], casting each slice back to the dtype of ``like``."""
    keys = list(like) if keys is None else keys
    out: StateDict = {}
    offset = 0
    for k in keys:
        ref = like[k]
        n = ref.numel()
        out[k] = vector[offset : offset + n].reshape(ref.shape).to(ref.dtype)
        offset += n
    if offset != vector.numel():
        raise ValueError(f"vector has {vector.numel()} entries, state needs {offset}")
    return out


def trainable_keys(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]
