"""CIFAR-style ResNets (3x3 stride-1 stem, no max pool), including FedMerge's tiny ResNet-9.

Layout follows the kuangliu/pytorch-cifar ResNet used by FedMerge's ``resnet.py``: a projection
shortcut (1x1 conv + BN) whenever the stride or width changes. The reference's ``avg_pool2d(4)``
and lazily created ``linear`` are replaced by an adaptive 1x1 average pool and a linear layer
sized at build time; both are identical on the 4x4 maps that 32x32 and 28x28 inputs produce.
"""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedmerge.core.registry import ComponentConfig

from .registry import MODELS, Classifier, image_shape


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.shortcut = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


def _shortcut(in_planes: int, out_planes: int, stride: int) -> nn.Module:
    if stride == 1 and in_planes == out_planes:
        return nn.Sequential()  # empty Sequential = identity, and no state_dict keys (as in the reference)
    return nn.Sequential(nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False), nn.BatchNorm2d(out_planes))


class ResNet(Classifier):
    """Stem conv3x3 + BN + ReLU, one stage per width (strides 1, 2, 2, ...), avg pool, ``classifier``."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        num_blocks: tuple[int, ...],
        widths: tuple[int, ...],
        in_channels: int,
        num_classes: int,
    ) -> None:
        super().__init__()
        if len(num_blocks) != len(widths):
            raise ValueError("num_blocks and widths must have the same length")
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        in_planes = widths[0]
        stages = []
        for i, (n, planes) in enumerate(zip(num_blocks, widths, strict=True)):
            blocks = []
            for s in [1 if i == 0 else 2] + [1] * (n - 1):
                blocks.append(block(in_planes, planes, s))
                in_planes = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        # Named layer1..layerN as in the reference so state_dict keys look familiar.
        self.num_stages = len(stages)
        for i, stage in enumerate(stages, start=1):
            self.add_module(f"layer{i}", stage)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = in_planes
        self.classifier = nn.Linear(in_planes, num_classes)

    def features(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        for i in range(1, self.num_stages + 1):
            out = getattr(self, f"layer{i}")(out)
        return self.pool(out).flatten(1)


class ResNet9Config(ComponentConfig):
    name: Literal["resnet9"] = "resnet9"
    widths: tuple[int, ...] = Field(default=(8, 16, 32, 64), min_length=1, description="channels of each stage")


@MODELS.register(
    "resnet9",
    config=ResNet9Config,
    description="FedMerge's tiny ResNet-9: BasicBlock [1,1,1,1], widths 8/16/32/64 (~84k params)",
)
def build_resnet9(cfg: ResNet9Config, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, _, _ = image_shape(input_shape, "resnet9")
    return ResNet(BasicBlock, (1,) * len(cfg.widths), cfg.widths, c, num_classes)


class _DeepResNetConfig(ComponentConfig):
    width_multiplier: float = Field(default=1.0, gt=0, description="scales the stage widths 64/128/256/512")


class ResNet18Config(_DeepResNetConfig):
    name: Literal["resnet18"] = "resnet18"


class ResNet34Config(_DeepResNetConfig):
    name: Literal["resnet34"] = "resnet34"


class ResNet50Config(_DeepResNetConfig):
    name: Literal["resnet50"] = "resnet50"


class ResNet101Config(_DeepResNetConfig):
    name: Literal["resnet101"] = "resnet101"


class ResNet152Config(_DeepResNetConfig):
    name: Literal["resnet152"] = "resnet152"


_DEEP: dict[str, tuple[type[_DeepResNetConfig], type[BasicBlock] | type[Bottleneck], tuple[int, ...]]] = {
    "resnet18": (ResNet18Config, BasicBlock, (2, 2, 2, 2)),
    "resnet34": (ResNet34Config, BasicBlock, (3, 4, 6, 3)),
    "resnet50": (ResNet50Config, Bottleneck, (3, 4, 6, 3)),
    "resnet101": (ResNet101Config, Bottleneck, (3, 4, 23, 3)),
    "resnet152": (ResNet152Config, Bottleneck, (3, 8, 36, 3)),
}


def _register_deep(name: str) -> None:
    cfg_cls, block, num_blocks = _DEEP[name]

    def build(cfg: _DeepResNetConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        c, _, _ = image_shape(input_shape, name)
        widths = tuple(max(1, round(w * cfg.width_multiplier)) for w in (64, 128, 256, 512))
        return ResNet(block, num_blocks, widths, c, num_classes)

    layout = ",".join(map(str, num_blocks))
    description = f"CIFAR-style {name}: {block.__name__} [{layout}], widths 64-512, stride-1 stem, no max pool"
    MODELS.register(name, config=cfg_cls, description=description)(build)


for _name in _DEEP:
    _register_deep(_name)
