"""The LoRA machinery every pretrained-backbone model shares (``minilm_lora``, ``vit_lora``, ``causal_lm_lora``).

A backbone is loaded once per process and device, LoRA layers are injected into it by ``peft``, and it
is frozen and shared by every model instance: it is *not* a registered submodule, so ``state_dict()``,
``parameters()`` and everything an algorithm sees (and every payload) are the adapters plus whatever
the model adds (a classification head). Each instance owns its adapter tensors
([`LoRAAdapters`][fedmerge.models.lora.LoRAAdapters]); a forward pass runs the shared module through
``torch.func.functional_call``
with them substituted for the backbone's own (unused) LoRA weights.

What builds the backbone depends on the model: a loader registered by ``kind`` (``LOADERS``) returns
the pretrained module and a few facts about it (hidden size, pad id, normalisation).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


class LoRAUnavailable(RuntimeError):
    """transformers/peft (or timm) or the pretrained weights are not available."""


@dataclass(frozen=True)
class LoRASpec:
    """Everything that fixes the injected backbone (the cache key, with the device)."""

    path: str  # a local folder, a Hub name or a timm name: the loader's business
    r: int
    alpha: float
    targets: tuple[str, ...] | None  # module-name suffixes to adapt; None: the loader's default, else peft's
    layers: tuple[int, ...] | None
    kind: str = "text"  # the loader in LOADERS
    dtype: str = "float32"  # the frozen weights' dtype (the adapters are float32)


@dataclass
class Backbone:
    module: nn.Module  # the pretrained model with LoRA layers injected, frozen, in eval mode
    lora_names: tuple[str, ...]  # its LoRA weight names, in registration order
    hidden: int
    pad_id: int
    lock: threading.Lock  # functional_call swaps weights on the shared module: one forward at a time
    info: dict[str, Any] = field(default_factory=dict)  # loader-specific facts (image size, mean, std, ...)


# kind -> (spec -> (pretrained module, {"hidden": int, "pad_id": int, ...}))
Loader = Callable[[LoRASpec], tuple[nn.Module, dict[str, Any]]]
LOADERS: dict[str, Loader] = {}

_BACKBONES: dict[tuple[LoRASpec, str], Backbone] = {}
CACHE_LOCK = threading.RLock()  # reentrant: loading a backbone may load its tokenizer


def register_loader(kind: str) -> Callable[[Loader], Loader]:
    def add(fn: Loader) -> Loader:
        LOADERS[kind] = fn
        return fn

    return add


def require_hf(hint: str) -> None:
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise LoRAUnavailable(f"LoRA models need transformers and peft: {hint}") from exc


def shared_backbone(spec: LoRASpec, device: torch.device | str = "cpu") -> Backbone:
    """The process-wide frozen backbone for ``spec`` on ``device`` (loaded on first use)."""
    key = (spec, str(torch.device(device)))
    with CACHE_LOCK:
        if key not in _BACKBONES:
            _BACKBONES[key] = _load_backbone(spec, torch.device(device))
        return _BACKBONES[key]


def _load_backbone(spec: LoRASpec, device: torch.device) -> Backbone:
    # Loading and injecting draw from the global RNG; fork it so model inits stay reproducible
    # whether or not this call is the first in the process.
    with torch.random.fork_rng(devices=[]):
        module, info = LOADERS[spec.kind](spec)  # checks that its packages are installed
        from peft import LoraConfig, inject_adapter_in_model

        targets = spec.targets if spec.targets is not None else info.pop("targets", None)
        lora = LoraConfig(
            r=spec.r,
            lora_alpha=spec.alpha,
            target_modules=list(targets) if targets is not None else None,
            layers_to_transform=list(spec.layers) if spec.layers is not None else None,
            lora_dropout=0.0,
            bias="none",
        )
        try:
            module = inject_adapter_in_model(lora, module)
        except ValueError as exc:  # e.g. no module matches, or no default targets for this architecture
            named = list(targets) if targets is not None else "peft's default"
            raise ValueError(f"LoRA on {spec.path} (target_modules={named}): {str(exc).splitlines()[0]}") from None
    module.requires_grad_(False)
    module.eval().to(device)
    names = tuple(n for n, _ in module.named_parameters() if "lora_" in n)
    if not names:
        raise ValueError(f"no module of {spec.path} matches target_modules={list(targets or ())}")
    return Backbone(module, names, int(info.pop("hidden")), int(info.pop("pad_id", 0) or 0), threading.Lock(), info)


def short_name(name: str) -> str:
    """``encoder.layer.0.attention.self.query.lora_A.default.weight`` -> a ParameterDict key."""
    return name.replace(".default", "").replace(".weight", "").replace(".", "_")


class LoRAAdapters(nn.Module):
    """This instance's LoRA adapter tensors (``self.lora``) for the shared backbone of ``spec``.

    Subclasses call `init_adapters()` first in ``__init__`` (before anything else draws from
    the RNG, so that an instance's adapters depend only on its seed), then add their own layers.
    """

    spec: LoRASpec
    lora: nn.ParameterDict

    def init_adapters(self, spec: LoRASpec) -> Backbone:
        self.spec = spec
        bb = shared_backbone(spec)
        params = dict(bb.module.named_parameters())
        self._names = {short_name(n): n for n in bb.lora_names}
        self.lora = nn.ParameterDict()
        for short, full in self._names.items():
            p = nn.Parameter(torch.empty_like(params[full], dtype=torch.float32))
            if "lora_A" in full:  # peft's init: A ~ kaiming-uniform, B = 0 (so the adapter starts as a no-op)
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
            else:
                nn.init.zeros_(p)
            self.lora[short] = p
        return bb

    def backbone(self, device: torch.device) -> Backbone:
        return shared_backbone(self.spec, device)

    def adapter_keys(self) -> list[str]:
        """State-dict keys of the adapter tensors (everything but what the model adds, e.g. a head)."""
        return [f"lora.{short}" for short in self._names]

    def full_parameter_count(self) -> int:
        """Frozen backbone + adapters + the model's own layers: the size of the whole model a client runs."""
        frozen = sum(p.numel() for p in self.backbone(torch.device("cpu")).module.parameters())
        lora = sum(p.numel() for p in self.lora.parameters())
        return frozen - lora + sum(p.numel() for p in self.parameters())

    def adapter_weights(self, personal: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The backbone's LoRA weights by their full names. ``personal`` (keys as `adapter_keys()`)
        is a second adapter added to this one (FedLoRA): stacking the ranks, ``[B, B'] @ [A; A'] = B A + B' A'``."""
        weights = {full: self.lora[short] for short, full in self._names.items()}
        if personal is not None:
            for short, full in self._names.items():
                extra = personal[f"lora.{short}"]
                weights[full] = torch.cat([weights[full], extra], dim=0 if "lora_A" in full else 1)
        return weights

    def run_backbone(self, device: torch.device, personal: Mapping[str, Tensor] | None = None, **inputs: Any) -> Any:
        """The shared backbone's output on ``inputs`` (keyword arguments) with this instance's adapters."""
        bb = self.backbone(device)
        with bb.lock:
            return torch.func.functional_call(
                bb.module, self.adapter_weights(personal), args=(), kwargs=inputs, strict=False
            )


def hub_error(name: str, exc: BaseException, what: str = "model") -> LoRAUnavailable:
    """One line for a model that could not be loaded from a folder, the Hub cache or the Hub."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return LoRAUnavailable(
        f"cannot load {what} {name!r} ({first}): it is neither a local folder nor in the Hugging Face cache, and "
        f"could not be downloaded; run once with network access, or `hf download {name}` (HF_HOME selects the "
        "cache), or give a local folder holding config.json and the weights"
    )
