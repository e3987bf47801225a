"""CIFAR-style MobileNet v1 and v2: stride-1 stem, adaptive average pool, no dropout.

v1 follows the kuangliu/pytorch-cifar layout (stem 32, depthwise-separable blocks up to 1024).
v2 follows the paper's inverted residuals (ReLU6, identity shortcut only when stride 1 and widths
match) with the usual CIFAR change: stem stride 1 and the second stage (24 channels) stride 1.
Width multipliers round channel counts to multiples of 8, as in the reference implementations.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import Tensor, nn

from fedmerge.core.registry import ComponentConfig

from .registry import MODELS, Classifier, image_shape


def make_divisible(v: float, divisor: int = 8) -> int:
    """Round to a multiple of ``divisor`` without going more than 10% below ``v``."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new < 0.9 * v:
        new += divisor
    return new


def _conv_bn(c_in: int, c_out: int, k: int, stride: int, groups: int, act: type[nn.Module] | None) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
    ]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


# (out_channels, stride) per depthwise-separable block.
V1_LAYOUT: tuple[tuple[int, int], ...] = (
    (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
    (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1),
)  # fmt: skip


class MobileNetV1(Classifier):
    def __init__(self, in_channels: int, num_classes: int, width_multiplier: float = 1.0) -> None:
        super().__init__()
        c = make_divisible(32 * width_multiplier)
        layers: list[nn.Module] = [_conv_bn(in_channels, c, 3, 1, 1, nn.ReLU)]
        for out, stride in V1_LAYOUT:
            out = make_divisible(out * width_multiplier)
            layers += [_conv_bn(c, c, 3, stride, c, nn.ReLU), _conv_bn(c, out, 1, 1, 1, nn.ReLU)]
            c = out
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.feature_dim = c
        self.classifier = nn.Linear(c, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.body(x)


class InvertedResidual(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = c_in * expansion
        layers: list[nn.Module] = []
        if expansion != 1:
            layers.append(_conv_bn(c_in, hidden, 1, 1, 1, nn.ReLU6))
        layers += [
            _conv_bn(hidden, hidden, 3, stride, hidden, nn.ReLU6),
            _conv_bn(hidden, c_out, 1, 1, 1, None),
        ]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv(x)
        return x + out if self.residual else out


# (expansion, out_channels, num_blocks, first stride); stage 2 stride is 1 for 32x32 inputs (CIFAR).
V2_LAYOUT: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1),
)  # fmt: skip


class MobileNetV2(Classifier):
    def __init__(self, in_channels: int, num_classes: int, width_multiplier: float = 1.0) -> None:
        super().__init__()
        c = make_divisible(32 * width_multiplier)
        layers: list[nn.Module] = [_conv_bn(in_channels, c, 3, 1, 1, nn.ReLU6)]
        for t, out, n, s in V2_LAYOUT:
            out = make_divisible(out * width_multiplier)
            for i in range(n):
                layers.append(InvertedResidual(c, out, s if i == 0 else 1, t))
                c = out
        last = make_divisible(1280 * max(1.0, width_multiplier))  # never thin the last layer
        layers.append(_conv_bn(c, last, 1, 1, 1, nn.ReLU6))
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.feature_dim = last
        self.classifier = nn.Linear(last, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.body(x)


class MobileNetV1Config(ComponentConfig):
    name: Literal["mobilenet_v1"] = "mobilenet_v1"
    width_multiplier: float = Field(default=1.0, gt=0, description="scales every layer's channel count")


class MobileNetV2Config(ComponentConfig):
    name: Literal["mobilenet_v2"] = "mobilenet_v2"
    width_multiplier: float = Field(default=1.0, gt=0, description="scales every layer's channel count")


@MODELS.register("mobilenet_v1", config=MobileNetV1Config, description="CIFAR-style MobileNet v1 (stride-1 stem)")
def build_mobilenet_v1(cfg: MobileNetV1Config, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, _, _ = image_shape(input_shape, "mobilenet_v1")
    return MobileNetV1(c, num_classes, cfg.width_multiplier)


@MODELS.register("mobilenet_v2", config=MobileNetV2Config, description="CIFAR-style MobileNet v2 (stride-1 stem)")
def build_mobilenet_v2(cfg: MobileNetV2Config, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, _, _ = image_shape(input_shape, "mobilenet_v2")
    return MobileNetV2(c, num_classes, cfg.width_multiplier)
