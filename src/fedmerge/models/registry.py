"""The model registry, the seeded builder and the base class every model shares."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.lazy import LazyModuleMixin

from fedmerge.core.registry import ComponentConfig, Registry

# An entry's obj is a builder: (cfg, per-sample input shape, num_classes) -> nn.Module.
ModelBuilder = Callable[[Any, tuple[int, ...], int], nn.Module]
MODELS: Registry[ModelBuilder] = Registry("model")


class Classifier(nn.Module):
    """A network split into a feature extractor and a final layer named ``classifier``.

    Head/body methods (FedPer, FedRep, LG-FedAvg, CCVR, FedProto) select parameters by
    ``head_prefix`` and read penultimate features through ``features``.
    """

    head_prefix: str = "classifier"
    classifier: nn.Module

    def features(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))

    def gate_input(self, x: Tensor) -> Tensor:
        """A fixed (untrained) float vector per sample for input-conditioned gates (pFedMoE): the
        flattened input by default; models whose inputs are not features (token ids) override it."""
        return x.flatten(1)


def image_shape(input_shape: tuple[int, ...], model: str) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(f"model {model!r} needs (C, H, W) inputs, got shape {input_shape}")
    c, h, w = input_shape
    return int(c), int(h), int(w)


def flat_size(input_shape: tuple[int, ...]) -> int:
    return int(math.prod(input_shape))


def build_model(
    cfg: ComponentConfig | Mapping[str, Any],
    input_shape: tuple[int, ...],
    num_classes: int,
    generator: torch.Generator | None = None,
) -> nn.Module:
    """Build a registered model; with ``generator`` the init is reproducible and global RNG is untouched."""
    if isinstance(cfg, Mapping):
        cfg = MODELS.parse(dict(cfg))
    entry = MODELS.get(cfg.name)
    if not isinstance(cfg, entry.config):
        raise TypeError(f"model {cfg.name!r} expects {entry.config.__name__}, got {type(cfg).__name__}")
    shape = tuple(int(s) for s in input_shape)
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    if generator is None:
        model = entry.obj(cfg, shape, int(num_classes))
    else:
        seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
        # Fork so that the default init functions (which draw from the global RNG) are seeded by
        # the generator while the caller's global RNG state is restored afterwards.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = entry.obj(cfg, shape, int(num_classes))
    # Lazy modules would leave the state_dict incomplete until the first forward pass, which
    # breaks flattening/merging parameters straight after construction.
    lazy = [n for n, m in model.named_modules() if isinstance(m, LazyModuleMixin)]
    if lazy:
        raise RuntimeError(f"model {cfg.name!r} has lazy modules: {lazy}")
    return model


def count_parameters(module: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
