"""``auto``: pick a default model from the input shape."""

from __future__ import annotations

from typing import Literal

from torch import nn

from fedmerge.core.registry import ComponentConfig

from .cnn import TwoCNNConfig, build_twocnn
from .mlp import MLPConfig, build_mlp
from .registry import MODELS


class AutoConfig(ComponentConfig):
    name: Literal["auto"] = "auto"


@MODELS.register(
    "auto",
    config=AutoConfig,
    description="mlp (hidden 200) for (F,) inputs, twocnn for (C,H,W) images; token data must name lstm",
)
def build_auto(cfg: AutoConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    # A (T,) token sequence looks like a (F,) feature vector, so text models are never chosen here.
    if len(input_shape) == 3:
        return build_twocnn(TwoCNNConfig(), input_shape, num_classes)
    if len(input_shape) == 1:
        return build_mlp(MLPConfig(), input_shape, num_classes)
    raise ValueError(f"model 'auto' cannot choose for input shape {input_shape}; name a model")
