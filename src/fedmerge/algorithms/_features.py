"""Penultimate-feature statistics that clients send instead of data (LIVAR, CCVR, FedProto).

Every model is a ``Classifier`` whose ``features(x)`` feed a final ``nn.Linear`` named ``classifier``;
the statistics here are computed in eval mode with no gradient, in batches, and returned as plain
tensors so they travel inside an ``Update`` (prefixed keys) and round-trip through safetensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn


def linear_head(model: nn.Module) -> nn.Linear:
    """The model's final linear layer (rows = classes); a clear error for models without one."""
    head = getattr(model, "classifier", None)
    if not isinstance(head, nn.Linear) or not hasattr(model, "features"):
        raise ValueError(f"{type(model).__name__} has no linear `classifier` over `features(x)`; this method needs one")
    return head


@torch.no_grad()
def features_and_logits(model: nn.Module, x: Tensor, batch_size: int = 1024) -> tuple[Tensor, Tensor]:
    """Penultimate features ``(N, D)`` and logits ``(N, C)`` of ``model`` on ``x`` (eval mode)."""
    head = linear_head(model)
    was_training = model.training
    model.eval()
    feats, logits = [], []
    for i in range(0, int(x.shape[0]), batch_size):
        f = model.features(x[i : i + batch_size])
        feats.append(f)
        logits.append(head(f))
    model.train(was_training)
    if not feats:
        d = head.in_features
        return x.new_zeros((0, d), dtype=torch.float32), x.new_zeros((0, head.out_features), dtype=torch.float32)
    return torch.cat(feats), torch.cat(logits)


def class_moments(feats: Tensor, y: Tensor, num_classes: int, covariance: bool = False) -> dict[str, Tensor]:
    """Per-class ``count`` (C,), ``mean`` (C, D), per-dimension unbiased ``var`` (C, D) and, if asked,
    unbiased ``cov`` (C, D, D). Classes with fewer than two samples get zero variance/covariance
    (their count tells the server to ignore them)."""
    d = int(feats.shape[1])
    f = feats.double()
    count = torch.bincount(y, minlength=num_classes).double()
    mean = torch.zeros((num_classes, d), dtype=torch.float64, device=f.device).index_add_(0, y, f)
    mean = mean / count.clamp_min(1)[:, None]
    centred = f - mean[y]
    denom = (count - 1).clamp_min(1)[:, None]
    sq = torch.zeros_like(mean).index_add_(0, y, centred * centred)
    var = torch.where(count[:, None] > 1, sq / denom, torch.zeros_like(sq))
    out = {"count": count, "mean": mean, "var": var}
    if covariance:
        cov = torch.zeros((num_classes, d, d), dtype=torch.float64, device=f.device)
        for c in range(num_classes):
            if count[c] > 1:
                z = centred[y == c]
                cov[c] = z.T @ z / (count[c] - 1)
        out["cov"] = cov
    return {k: v.float() if k != "count" else v for k, v in out.items()}


def with_prefix(prefix: str, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {f"{prefix}{k}": v for k, v in tensors.items()}


def take_prefix(prefix: str, tensors: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(entries under ``prefix`` with it removed, all other entries)."""
    inside = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    rest = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    return inside, rest
