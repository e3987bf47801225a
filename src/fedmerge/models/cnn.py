"""McMahan et al. (2017)'s CNN ("TwoCNN")."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from fedmerge.core.registry import ComponentConfig

from .registry import MODELS, Classifier, image_shape


class TwoCNN(Classifier):
    """conv5x5(32)-relu-pool2, conv5x5(64)-relu-pool2, fc(512)-relu, ``classifier``."""

    def __init__(
        self,
        in_channels: int,
        hw: tuple[int, int],
        num_classes: int,
        channels: tuple[int, int] = (32, 64),
        hidden: int = 512,
        bias: bool = True,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c, h, w = in_channels, *hw
        for out in channels:
            layers += [nn.Conv2d(c, out, 5, padding=2, bias=bias), nn.ReLU()]
            # Skip a pool that would shrink the map to nothing (tiny inputs).
            if min(h, w) >= 2:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            c = out
        self.body = nn.Sequential(*layers, nn.Flatten())
        with torch.no_grad():  # no BN in the body, so a dummy pass changes no state
            flat = self.body(torch.zeros(1, in_channels, *hw)).shape[1]
        self.fc = nn.Linear(flat, hidden, bias=bias)
        self.feature_dim = hidden
        self.classifier = nn.Linear(hidden, num_classes, bias=bias)

    def features(self, x: Tensor) -> Tensor:
        return torch.relu(self.fc(self.body(x)))


class TwoCNNConfig(ComponentConfig):
    name: Literal["twocnn"] = "twocnn"
    channels: tuple[int, int] = Field(default=(32, 64), description="output channels of the two convolutions")
    hidden: int = Field(default=512, ge=1, description="width of the fully connected layer")
    bias: bool = Field(default=True, description="SuPerFed builds its models without biases")


@MODELS.register("twocnn", config=TwoCNNConfig, description="McMahan et al. 2017 CNN: 2x(conv5x5-pool), fc512")
def build_twocnn(cfg: TwoCNNConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, h, w = image_shape(input_shape, "twocnn")
    return TwoCNN(c, (h, w), num_classes, channels=cfg.channels, hidden=cfg.hidden, bias=cfg.bias)
