"""Loading weights into, and copying them out of, the one reused model object: cheaply.

The engines run every client on one model object, so each client update begins with a load and
ends with a copy of the weights. ``nn.Module.load_state_dict`` and ``state_dict`` walk the module
tree and run per-module checks on every call: for a small model at batch 10 that costs more than the
copies themselves (about 100 us per client for the MLP, several percent of its training).

[`load_state()`][fedmerge.core.model_state.load_state] and [`copy_state()`][fedmerge.core.model_state.copy_state] do
the same copies through a table of the model's
tensors, built once per model. Each entry is (module, attribute), looked up at use time, so a
parameter that is replaced rather than updated in place is still found. Values are exactly those of
the ordinary calls (``copy_`` is what ``load_state_dict`` does). A model whose state-dict behaviour
is customised (state-dict hooks, extra state, an overridden ``_load_from_state_dict`` or
``_save_to_state_dict``) and any load that is not an exact match of keys and shapes take the
ordinary path, which also gives the ordinary error messages. The table is built on first use: a
model must not gain modules, parameters or state-dict hooks after that (fedmerge's models do not).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

StateDict = dict[str, torch.Tensor]

# Modules whose state-dict methods may be overridden without changing what a matching load does:
# BatchNorm's override only fills in a missing num_batches_tracked key.
_SAFE_LOAD = {nn.Module._load_from_state_dict, _NormBase._load_from_state_dict}
_HOOKS = (
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


class _Table:
    """The model's state-dict entries in ``state_dict`` order, as (key, module, attribute, is_param)."""

    def __init__(self, model: nn.Module) -> None:
        self.entries: list[tuple[str, nn.Module, str, bool]] = []
        self.modules = list(model.modules())
        self.plain = all(_plain(m) for m in self.modules)
        for prefix, module in model.named_modules(remove_duplicate=False):
            head = f"{prefix}." if prefix else ""
            for name, p in module._parameters.items():
                if p is not None:
                    self.entries.append((head + name, module, name, True))
            for name, b in module._buffers.items():
                if b is not None and name not in module._non_persistent_buffers_set:
                    self.entries.append((head + name, module, name, False))
        # state_dict keeps the first occurrence of a shared tensor's key, as here; check rather than assume.
        self.keys = [k for k, *_ in self.entries]
        if self.plain and self.keys != list(model.state_dict(keep_vars=True)):
            self.plain = False
        self.key_set = frozenset(self.keys)
        self.params: list[tuple[nn.Module, str]] = []  # model.parameters(), in its order
        for name, _ in model.named_parameters():
            prefix, _, attr = name.rpartition(".")
            self.params.append((model.get_submodule(prefix), attr))

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(k, (m._parameters if p else m._buffers)[a]) for k, m, a, p in self.entries]


def _plain(module: nn.Module) -> bool:
    cls = type(module)
    return (
        not any(getattr(module, h, None) for h in _HOOKS)
        and cls._load_from_state_dict in _SAFE_LOAD
        and cls._save_to_state_dict is nn.Module._save_to_state_dict
        and cls.get_extra_state is nn.Module.get_extra_state
    )


_ATTR = "_fedmerge_state_table"


def _table(model: nn.Module) -> _Table:
    # Kept in the model's own __dict__ (not a weak mapping: the table refers to the model, which would
    # then never be freed); a deep copy of the model copies the table consistently with it.
    table = model.__dict__.get(_ATTR)
    if table is None:
        table = model.__dict__[_ATTR] = _Table(model)
    return table


def load_state(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict(weights, strict=True)``, without its per-call walk of the module tree."""
    table = _table(model)
    if not table.plain or len(weights) != len(table.keys) or weights.keys() != table.key_set:
        model.load_state_dict(weights, strict=True)
        return
    pairs = [(t, weights[k]) for k, t in table.tensors()]
    if any(t.shape != v.shape for t, v in pairs):
        model.load_state_dict(weights, strict=True)  # raises the ordinary size-mismatch error
        return
    with torch.no_grad():
        for t, v in pairs:
            t.copy_(v)


def copy_state(model: nn.Module) -> StateDict:
    """A copy of ``model.state_dict()`` (detached clones), without its per-call walk of the module tree."""
    table = _table(model)
    if not table.plain:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # a clone without the graph: one operation per tensor instead of two
        return {k: t.clone() for k, t in table.tensors()}


def set_train_mode(model: nn.Module, mode: bool = True) -> None:
    """``model.train(mode)``, skipped when every submodule already is in that mode (the usual case)."""
    table = model.__dict__.get(_ATTR)  # no table is built for this: a module used once needs none
    if table is None or any(m.training is not mode for m in table.modules):
        model.train(mode)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """``list(model.parameters())``, without its per-call walk of the module tree."""
    return [m._parameters[a] for m, a in _table(model).params]
