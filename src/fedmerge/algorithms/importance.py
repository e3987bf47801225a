"""LIVAR's layer importances: path-integral sums (Zenke et al. 2017) over the LoRA A and B matrices.

For every optimiser step and every LoRA layer l, ``s_A[l] += |sum(g_A * (A_before - A_after))|``
(and the same for B): the loss change the step attributes to that matrix. The tracker hooks into
``local_sgd`` through ``before_step`` (snapshot the parameters, gradients are ready) and
``after_step`` (read the change), so training itself is untouched.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedmerge.core.training import Step


def lora_layers(keys: list[str]) -> list[tuple[str, str, str]]:
    """(layer name, A key, B key) for every LoRA pair among state-dict ``keys``, in key order."""
    keyset = set(keys)
    layers = []
    for k in keys:
        if "lora_A" in k:
            b = k.replace("lora_A", "lora_B")
            if b not in keyset:
                raise ValueError(f"LoRA matrix {k} has no matching {b}")
            layers.append((k.replace("lora_A", "lora"), k, b))
    return layers


class PathIntegralImportance:
    """Accumulates (s_A, s_B) per LoRA layer of ``model`` across the steps it observes."""

    def __init__(self, model: nn.Module, layers: list[tuple[str, str, str]], start: Tensor | None = None) -> None:
        params = dict(model.named_parameters())
        self.a = [params[a] for _, a, _ in layers]
        self.b = [params[b] for _, _, b in layers]
        # on the model's device: no host sync per parameter per step on a GPU
        device = next(model.parameters()).device
        self.sums = (
            torch.zeros((2, len(layers)), dtype=torch.float64, device=device)
            if start is None
            else start.to(device, torch.float64).clone()
        )
        self._before: list[Tensor] = []

    def before_step(self, step: Step) -> None:
        self._before = [p.detach().clone() for p in (*self.a, *self.b)]

    @torch.no_grad()
    def after_step(self, step: Step) -> None:
        n = len(self.a)
        for j, (p, old) in enumerate(zip((*self.a, *self.b), self._before)):
            if p.grad is None:
                continue
            contribution = (p.grad * (old - p)).sum().abs().double()
            self.sums[j // n, j % n] += contribution
        self._before = []
