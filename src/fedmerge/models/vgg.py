"""CIFAR-style VGG-11 with BatchNorm (kuangliu/pytorch-cifar layout, no dropout)."""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from fedmerge.core.registry import ComponentConfig

from .registry import MODELS, Classifier, image_shape

VGG11_LAYOUT: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG(Classifier):
    """[conv3x3-BN-ReLU | maxpool2]* -> adaptive avg pool 1x1 -> ``classifier``.

    A max pool that would take the map below 1x1 is left out, so 8x8 inputs work; on 32x32 the
    network is the reference one (its final map is already 1x1, so the pool is an identity).
    """

    def __init__(self, layout: tuple[int | str, ...], in_channels: int, hw: tuple[int, int], num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c, (h, w) = in_channels, hw
        for item in layout:
            if item == "M":
                if min(h, w) >= 2:
                    layers.append(nn.MaxPool2d(2))
                    h, w = h // 2, w // 2
            else:
                layers += [nn.Conv2d(c, int(item), 3, padding=1), nn.BatchNorm2d(int(item)), nn.ReLU()]
                c = int(item)
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.feature_dim = c
        self.classifier = nn.Linear(c, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.body(x)


class VGG11Config(ComponentConfig):
    name: Literal["vgg11"] = "vgg11"


@MODELS.register("vgg11", config=VGG11Config, description="CIFAR-style VGG-11 with BatchNorm, 512->classes head")
def build_vgg11(cfg: VGG11Config, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, h, w = image_shape(input_shape, "vgg11")
    return VGG(VGG11_LAYOUT, c, (h, w), num_classes)
