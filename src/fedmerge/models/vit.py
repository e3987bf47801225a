"""A frozen pretrained vision transformer with LoRA adapters and a linear head (``vit_lora``).

LIVAR's model: ViT-B/16 pretrained on ImageNet-21k (``google/vit-base-patch16-224-in21k``), LoRA on
the qkv, attention-projection and MLP layers of every block, a linear classification head on the
[CLS] feature. The backbone is shared and frozen as in ``minilm_lora`` (``lora.py``): only the
adapters and the head train and travel, so FedAvg is FedIT, and LIVAR (G_SHAP over the LoRA layers,
variance-weighted head rows), FedMerge over adapters, FedLoRA and Local run on it unchanged.

Two backends build the backbone:

* ``hf`` (default): ``transformers``' ``AutoModel`` (a ViT checkpoint: a Hub name or a local folder).
  LoRA targets ``attention.q_proj``/``k_proj``/``v_proj``, ``attention.o_proj`` (the attention
  projection) and ``mlp.fc1``/``mlp.fc2`` (transformers 5's names; before it ``query``/``key``/``value``,
  ``attention.output.dense``, ``intermediate.dense``, ``output.dense``).
* ``timm``: ``timm.create_model(name, pretrained=True, num_classes=0)`` for any timm name; LoRA targets
  ``attn.qkv``, ``attn.proj``, ``mlp.fc1``, ``mlp.fc2``. timm needs torchvision built for your torch.

Inputs are the pool's float32 images ``N x C x H x W`` in [0, 1]: the model repeats a single channel
to three, resizes (bilinear, antialiased) to the checkpoint's image size and normalises with the
checkpoint's mean and std (``preprocessor_config.json`` for ``hf``, ``pretrained_cfg`` for ``timm``),
all inside ``forward``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator
from torch import Tensor, nn

from fedmerge.core.registry import ComponentConfig

from .lora import LoRAAdapters, LoRASpec, LoRAUnavailable, hub_error, register_loader, require_hf
from .registry import MODELS, Classifier, image_shape

HF_HINT = 'pip install "fedmerge[lora]" (transformers and peft)'
TIMM_HINT = "pip install timm torchvision (torchvision built for your torch), or use model.backend=hf"
DEFAULT_MODEL = {"hf": "google/vit-base-patch16-224-in21k", "timm": "vit_base_patch16_224.augreg_in21k"}
# qkv, the attention projection and the MLP of every block, by each implementation's module names
HF_TARGETS = (  # transformers >= 5
    "attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj", "mlp.fc1", "mlp.fc2",
)  # fmt: skip
HF_TARGETS_4 = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")
TIMM_TARGETS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
# ViTImageProcessor's defaults (IMAGENET_STANDARD_MEAN/STD), for a checkpoint without preprocessor_config.json
STANDARD_MEAN, STANDARD_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


def _pair(size: Any) -> tuple[int, int]:
    if isinstance(size, Mapping):  # a preprocessor's {"height": h, "width": w}
        return int(size["height"]), int(size["width"])
    if isinstance(size, list | tuple):
        return int(size[0]), int(size[-1])
    return int(size), int(size)


def _normalisation(path: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The checkpoint's image mean and std (its ``preprocessor_config.json``), else ViT's defaults."""
    from transformers.utils import cached_file

    try:
        file = cached_file(path, "preprocessor_config.json", _raise_exceptions_for_missing_entries=False)
    except OSError:
        file = None
    if file is None:
        return STANDARD_MEAN, STANDARD_STD
    with open(file) as f:
        pre = json.load(f)
    return tuple(pre.get("image_mean", STANDARD_MEAN)), tuple(pre.get("image_std", STANDARD_STD))


@register_loader("vision")
def _load_hf_vision(spec: LoRASpec) -> tuple[nn.Module, dict[str, Any]]:
    require_hf(HF_HINT)
    from transformers import AutoConfig, AutoModel

    try:
        config = AutoConfig.from_pretrained(spec.path)
        extra = {"add_pooling_layer": False} if config.model_type in ("vit", "deit") else {}
        module = AutoModel.from_pretrained(spec.path, dtype=getattr(torch, spec.dtype), **extra)
        mean, std = _normalisation(spec.path)
    except OSError as exc:
        raise hub_error(spec.path, exc) from None
    size = getattr(config, "image_size", None)
    if size is None:
        raise ValueError(f"{spec.path} is not a vision model (its config has no image_size)")
    names = [n for n, _ in module.named_modules()]
    targets = HF_TARGETS if any(n.endswith(".attention.q_proj") for n in names) else HF_TARGETS_4
    info = {"image_size": _pair(size), "mean": mean, "std": std, "targets": targets}
    return module, {"hidden": config.hidden_size, **info}


@register_loader("timm")
def _load_timm(spec: LoRASpec) -> tuple[nn.Module, dict[str, Any]]:
    try:
        import timm
    except ImportError as exc:  # timm itself, or the torchvision it imports
        raise LoRAUnavailable(f"model.backend=timm cannot import timm ({exc}): {TIMM_HINT}") from None
    require_hf(HF_HINT)  # peft injects the adapters
    try:
        module = timm.create_model(spec.path, pretrained=True, num_classes=0)
    except (OSError, RuntimeError) as exc:
        raise hub_error(spec.path, exc, "timm model") from None
    cfg = module.pretrained_cfg
    info = {"image_size": _pair(cfg["input_size"][1:]), "mean": tuple(cfg["mean"]), "std": tuple(cfg["std"])}
    info["targets"] = TIMM_TARGETS
    return module.to(getattr(torch, spec.dtype)), {"hidden": module.num_features, **info}


class ViTLoRAClassifier(LoRAAdapters, Classifier):
    """Frozen shared vision transformer + this instance's LoRA adapters -> [CLS] (or mean) -> ``classifier``."""

    def __init__(
        self,
        spec: LoRASpec,
        num_classes: int,
        channels: int,
        image_size: tuple[int, int] | None = None,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        pooling: Literal["cls", "mean"] = "cls",
    ) -> None:
        super().__init__()
        bb = self.init_adapters(spec)
        self.channels, self.pooling = channels, pooling
        self.image_size = image_size or bb.info["image_size"]
        self.mean, self.std = tuple(mean or bb.info["mean"]), tuple(std or bb.info["std"])
        self.feature_dim = bb.hidden
        self.classifier = nn.Linear(bb.hidden, num_classes)

    def preprocess(self, x: Tensor) -> Tensor:
        """[0, 1] images -> the checkpoint's input: three channels, its size, its normalisation."""
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        if tuple(x.shape[-2:]) != tuple(self.image_size):
            x = F.interpolate(x, size=self.image_size, mode="bilinear", align_corners=False, antialias=True)
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        return ((x - mean) / std).to(getattr(torch, self.spec.dtype))

    def features(self, x: Tensor, personal: Mapping[str, Tensor] | None = None) -> Tensor:
        """Image features; ``personal``: a second adapter added to this one (FedLoRA)."""
        pixels = self.preprocess(x)
        if self.spec.kind == "timm":  # num_classes=0: timm's own pooled pre-logits features
            return self.run_backbone(x.device, personal, x=pixels).float()
        hidden = self.run_backbone(x.device, personal, pixel_values=pixels).last_hidden_state.float()
        return hidden[:, 0] if self.pooling == "cls" else hidden[:, 1:].mean(1)

    def forward(self, x: Tensor, personal: Mapping[str, Tensor] | None = None) -> Tensor:
        return self.classifier(self.features(x, personal))


class ViTLoRAConfig(ComponentConfig):
    name: Literal["vit_lora"] = "vit_lora"
    backend: Literal["hf", "timm"] = Field(
        "hf", description="hf: transformers' AutoModel (a ViT checkpoint); timm: timm.create_model (needs torchvision)"
    )
    model: str | None = Field(
        None,
        description="hf: a Hub name or a local folder (config.json + weights); timm: a timm name. Default: "
        "google/vit-base-patch16-224-in21k (hf), vit_base_patch16_224.augreg_in21k (timm). Weights come from the "
        "Hugging Face cache (HF_HOME), downloaded there on first use",
    )
    r: int = Field(8, ge=1, description="LoRA rank")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scaling alpha / r)")
    target_modules: tuple[str, ...] | None = Field(
        None,
        min_length=1,
        description="module-name suffixes to adapt; default: qkv, attention projection and MLP of every block "
        "(hf: attention.q_proj/k_proj/v_proj/o_proj mlp.fc1 mlp.fc2, or query key value attention.output.dense "
        "intermediate.dense output.dense before transformers 5; timm: attn.qkv attn.proj mlp.fc1 mlp.fc2)",
    )
    layers: tuple[int, ...] | None = Field(None, description="adapt only these blocks (default: all)")
    image_size: int | None = Field(None, ge=1, description="resize inputs to this size; default: the checkpoint's")
    mean: tuple[float, float, float] | None = Field(None, description="normalisation mean; default: the checkpoint's")
    std: tuple[float, float, float] | None = Field(None, description="normalisation std; default: the checkpoint's")
    pooling: Literal["cls", "mean"] = Field("cls", description="hf: [CLS] token or mean of the patch tokens")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the frozen backbone (adapters and head stay float32)"
    )

    @field_validator("model")
    @classmethod
    def _folder_has_config(cls, model: str | None) -> str | None:
        if model is not None and os.path.isdir(os.path.expanduser(model)):
            if not os.path.isfile(os.path.join(os.path.expanduser(model), "config.json")):
                raise ValueError("a folder without config.json; give a Hugging Face model folder or a Hub name")
        return model

    @field_validator("std")
    @classmethod
    def _positive_std(cls, std: tuple[float, float, float] | None) -> tuple[float, float, float] | None:
        if std is not None and min(std) <= 0:
            raise ValueError("std must be positive")
        return std


def vit_spec(cfg: ViTLoRAConfig) -> LoRASpec:
    name = cfg.model or DEFAULT_MODEL[cfg.backend]
    local = os.path.expanduser(name)
    path = os.path.abspath(local) if os.path.isdir(local) else name
    kind = "vision" if cfg.backend == "hf" else "timm"
    return LoRASpec(path, cfg.r, float(cfg.alpha), cfg.target_modules, cfg.layers, kind, cfg.dtype)


@MODELS.register(
    "vit_lora",
    config=ViTLoRAConfig,
    description="frozen pretrained ViT (ViT-B/16 in21k by default; transformers or timm) + LoRA on qkv, "
    "attention projection and MLP + linear head",
)
def build_vit_lora(cfg: ViTLoRAConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    channels, _, _ = image_shape(input_shape, "vit_lora")
    if channels not in (1, 3):
        raise ValueError(f"model 'vit_lora' needs 1- or 3-channel images, got {channels} channels")
    size = (cfg.image_size, cfg.image_size) if cfg.image_size is not None else None
    return ViTLoRAClassifier(vit_spec(cfg), num_classes, channels, size, cfg.mean, cfg.std, cfg.pooling)
