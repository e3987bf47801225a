"""Fully connected models: a generic MLP and McMahan et al. (2017)'s 2NN."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import Tensor, nn

from fedmerge.core.registry import ComponentConfig

from .registry import MODELS, Classifier, flat_size


class MLP(Classifier):
    """Flatten -> [Linear -> ReLU] * len(hidden) -> Linear (``classifier``)."""

    def __init__(self, in_features: int, hidden: tuple[int, ...], num_classes: int, bias: bool = True) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h, bias=bias), nn.ReLU()]
            width = h
        self.body = nn.Sequential(*layers)
        self.feature_dim = width
        self.classifier = nn.Linear(width, num_classes, bias=bias)

    def features(self, x: Tensor) -> Tensor:
        return self.body(x)


class MLPConfig(ComponentConfig):
    name: Literal["mlp"] = "mlp"
    hidden: tuple[int, ...] = Field(default=(200,), description="hidden layer widths; empty = linear model")
    bias: bool = Field(default=True, description="whether every layer adds a bias (SuPerFed's models have none)")


class TwoNNConfig(ComponentConfig):
    name: Literal["twonn"] = "twonn"
    hidden: int = Field(default=200, ge=1, description="width of each of the two hidden layers")
    bias: bool = Field(default=True, description="SuPerFed builds its models without biases")


@MODELS.register("mlp", config=MLPConfig, description="MLP with ReLU hidden layers on flattened inputs")
def build_mlp(cfg: MLPConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return MLP(flat_size(input_shape), cfg.hidden, num_classes, bias=cfg.bias)


@MODELS.register("twonn", config=TwoNNConfig, description="McMahan et al. 2017 2NN: flatten-200-200-classes")
def build_twonn(cfg: TwoNNConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return MLP(flat_size(input_shape), (cfg.hidden, cfg.hidden), num_classes, bias=cfg.bias)
