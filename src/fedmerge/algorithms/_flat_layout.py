"""FedMerge's flat stacks: every model's state dict laid out as one row of a float matrix (and one of an integer
matrix for counters), so that merging d models for many clients is one matrix product."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedmerge.core.algorithm import (
    StateDict,
)


@dataclass(frozen=True)
class FlatLayout:
    """Where each state-dict entry lives in the flat stack (float) or the counter stack (integer)."""

    floats: tuple[tuple[str, torch.Size, int], ...]  # (key, shape, offset) in stack order
    ints: tuple[tuple[str, torch.Size, torch.dtype], ...]
    num_floats: int
    num_params: int  # columns [0, num_params) are trainable parameters
    head: tuple[int, int]  # columns of the last Linear layer's parameters
    dtype: torch.dtype
    state_keys: tuple[str, ...] = ()  # every state-dict key, in the model's order

    @classmethod
    def of(cls, model: nn.Module) -> FlatLayout:
        state = model.state_dict()
        params = [n for n, p in model.named_parameters() if p.requires_grad]
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        if linears:
            head_ids = {id(q) for q in linears[-1].parameters()}
            head_names = {n for n, q in model.named_parameters() if id(q) in head_ids}
        else:  # no Linear layer: the last two parameter tensors stand in for the head
            head_names = set(params[-2:])
        order = [n for n in params if n not in head_names] + [n for n in params if n in head_names]
        buffers = [k for k, v in state.items() if k not in set(params) and v.is_floating_point()]
        floats, offset = [], 0
        head_start = sum(state[n].numel() for n in params if n not in head_names)
        for key in order + buffers:
            floats.append((key, state[key].shape, offset))
            offset += state[key].numel()
        num_params = sum(state[n].numel() for n in params)
        ints = tuple((k, v.shape, v.dtype) for k, v in state.items() if not v.is_floating_point())
        dtype = state[order[0]].dtype if order else torch.float32
        return cls(tuple(floats), ints, offset, num_params, (head_start, num_params), dtype, tuple(state))

    def param_columns_from_key(self, word: str) -> slice | torch.Tensor:
        """Columns of the trainable parameters from the first state-dict key containing ``word`` on (the
        reference's ``get_top_layers_from_key``); every parameter when no key contains it. Buffers
        (BatchNorm statistics) are left out, as the reference's inner product skips them. Parameters keep
        the model's order in the stack except the head, moved last, so the columns are one range (a
        slice: a view) unless the word first appears inside the head and parameters follow the head."""
        first = next((i for i, key in enumerate(self.state_keys) if word in key), 0)
        chosen = set(self.state_keys[first:])
        spans = sorted(
            (off, off + shape.numel()) for key, shape, off in self.floats if key in chosen and off < self.num_params
        )
        if not spans:
            return slice(0, 0)
        if sum(b - a for a, b in spans) == spans[-1][1] - spans[0][0]:
            return slice(spans[0][0], spans[-1][1])
        return torch.cat([torch.arange(a, b) for a, b in spans])

    def flatten_into(self, state: StateDict, row: torch.Tensor) -> None:
        for key, shape, off in self.floats:
            row[off : off + shape.numel()].copy_(state[key].reshape(-1))

    def flatten_rows(self, states: list[StateDict], out: torch.Tensor, concatenate: bool | None = None) -> None:
        """``flatten_into`` for each state, row by row of the contiguous ``out``. On an accelerator it is
        one concatenation into ``out`` instead of one copy per tensor: hundreds of small launches are
        issued by the host more slowly than the device runs them (an H100 profile of the server step). On
        CPU the row copies are kept (8-11% faster there: 50 deltas of 5M floats, 1 thread). The same
        bytes land in the same places either way; ``concatenate`` forces the choice (tests)."""
        if concatenate is None:
            concatenate = out.device.type != "cpu"
        if concatenate:
            parts = [state[key].reshape(-1) for state in states for key, _, _ in self.floats]
            if out.is_contiguous() and all(t.dtype == out.dtype and t.device == out.device for t in parts):
                torch.cat(parts, out=out.view(-1))
                return
        for state, row in zip(states, out):  # CPU, or another dtype or device (copy_ converts)
            self.flatten_into(state, row)

    def int_vector(self, state: StateDict) -> torch.Tensor:
        if not self.ints:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([state[k].reshape(-1).to(torch.int64) for k, _, _ in self.ints])

    def state_dict(self, row: torch.Tensor, int_row: torch.Tensor) -> StateDict:
        """Views into ``row`` (no copy) plus the integer entries."""
        out = {key: row[off : off + shape.numel()].view(shape) for key, shape, off in self.floats}
        offset = 0
        for key, shape, dtype in self.ints:
            n = shape.numel()
            out[key] = int_row[offset : offset + n].reshape(shape).to(dtype)
            offset += n
        return out
