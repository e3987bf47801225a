"""CCVR's server-side classifier calibration (Luo et al., NeurIPS 2021), as reusable functions.

The registered method is ``ccvr.py`` (FedAvg + calibration); LIVAR composes "LIVAR then CCVR" with the
same functions. The steps:

1. [`client_class_stats()`][fedmerge.algorithms._ccvr.client_class_stats]: each client's per-class count ``N_ck``, mean
   ``mu_ck`` and *unbiased*
   covariance ``Sigma_ck`` of the penultimate features ``model.features(x)`` (eval mode).
2. [`pool_class_stats()`][fedmerge.algorithms._ccvr.pool_class_stats]: the exact mean and unbiased covariance of the
   union of the clients' features,

       mu_c    = sum_k N_ck mu_ck / N_c
       Sigma_c = sum_k (N_ck - 1)/(N_c - 1) Sigma_ck + sum_k N_ck/(N_c - 1) mu_ck mu_ck^T - N_c/(N_c - 1) mu_c mu_c^T

   (the paper's formula). FL-bench's client computes ``Sigma_ck`` with ``correction=0`` (biased) but
   pools with the unbiased formula above; here the local covariances are unbiased, so the pooled one is
   exactly ``torch.cov`` of the concatenated features (a test checks it).
3. [`virtual_features()`][fedmerge.algorithms._ccvr.virtual_features]: ``samples_per_class`` draws from ``N(mu_c,
   Sigma_c)`` per class with
   ``N_c >= 2`` (others are skipped), from a seeded generator. Sampling goes through an eigen-
   decomposition with eigenvalues clamped at zero plus ``jitter``, so rank-deficient covariances (fewer
   samples than feature dimensions, dead ReLU units) never fail.
4. [`calibrate_head()`][fedmerge.algorithms._ccvr.calibrate_head]: retrain only the final linear layer
   ``model.classifier`` on the virtual
   features with plain SGD (``settings.lr``, default the algorithm's lr; no momentum or weight decay, as
   FL-bench) for ``settings.epochs`` epochs at the algorithm's batch size, with the one training routine
   [`fedmerge.core.training.local_sgd()`][fedmerge.core.training.local_sgd].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from fedmerge.core.algorithm import StateDict
from fedmerge.core.merge import weighted_merge
from fedmerge.core.training import LocalTraining, local_sgd

from ._features import class_moments, features_and_logits, linear_head

STAT_KEYS = ("count", "mean", "cov")


class CCVRSettings(BaseModel):
    """Hyper-parameters of the calibration step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    samples_per_class: int = Field(200, ge=1, description="virtual features drawn per class")
    epochs: int = Field(1, ge=1, description="epochs of head retraining on the virtual features")
    lr: float | None = Field(None, gt=0, description="SGD step size of the head retraining (None: the algorithm's lr)")
    jitter: float = Field(1e-5, ge=0, description="added to every covariance eigenvalue before sampling")


def client_class_stats(model: nn.Module, x: Tensor, y: Tensor, num_classes: int) -> dict[str, Tensor]:
    """``count`` (C,) float64, ``mean`` (C, D) and unbiased ``cov`` (C, D, D) float32 of ``model.features``
    on (x, y), eval mode, no gradient. Absent classes have count 0 and zero mean/cov; classes with one
    sample have zero cov (the pooled formula weights it by ``N_ck - 1 = 0``)."""
    feats, _ = features_and_logits(model, x)
    moments = class_moments(feats, y.to(feats.device), num_classes, covariance=True)
    return {k: moments[k] for k in STAT_KEYS}


def pool_class_stats(stats: Sequence[dict[str, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """Pooled ``counts`` (C,) float64, ``means`` (C, D) and unbiased ``covs`` (C, D, D) (float32; computed
    in float64) of the union of the clients' samples. Classes with ``N_c < 2`` get a zero covariance, and
    absent classes a zero mean; [`virtual_features()`][fedmerge.algorithms._ccvr.virtual_features] skips both."""
    if not stats:
        raise ValueError("pool_class_stats needs the statistics of at least one client")
    counts = [s["count"].double() for s in stats]
    means = [s["mean"].double() for s in stats]
    total = torch.stack(counts).sum(0)
    mean = weighted_merge(means, [n[:, None] for n in counts], fallback=torch.zeros_like(means[0]))
    scatter = torch.zeros_like(stats[0]["cov"], dtype=torch.float64)
    for s, n, m in zip(stats, counts, means):
        scatter += (n - 1).clamp_min(0)[:, None, None] * s["cov"].double()
        scatter += n[:, None, None] * (m[:, :, None] * m[:, None, :])
    scatter -= total[:, None, None] * (mean[:, :, None] * mean[:, None, :])
    ok = total >= 2
    cov = torch.where(ok[:, None, None], scatter / (total - 1).clamp_min(1)[:, None, None], torch.zeros_like(scatter))
    dtype = stats[0]["mean"].dtype
    return total, mean.to(dtype), cov.to(dtype)


def virtual_features(
    counts: Tensor,
    means: Tensor,
    covs: Tensor,
    samples_per_class: int,
    generator: torch.Generator,
    jitter: float = 1e-5,
) -> tuple[Tensor, Tensor]:
    """``samples_per_class`` draws from ``N(means[c], covs[c])`` for every class with ``counts[c] >= 2``,
    in class order: features (M, D) float32 and labels (M,) int64, on ``means``' device.

    ``x = mu + V diag(sqrt(max(lambda, 0) + jitter)) z`` with ``covs[c] = V diag(lambda) V^T`` (symmetrised,
    float64) and ``z ~ N(0, I)`` drawn on the CPU from ``generator``, so the draws are the same on every
    device and never fail on a singular covariance."""
    device = means.device
    d = int(means.shape[1])
    feats, labels = [], []
    for c in range(int(counts.shape[0])):
        if float(counts[c]) < 2:
            continue
        cov = covs[c].double().cpu()
        evals, evecs = torch.linalg.eigh(0.5 * (cov + cov.T))
        root = evecs * (evals.clamp_min(0) + jitter).sqrt()[None, :]
        z = torch.randn((samples_per_class, d), generator=generator, dtype=torch.float64)
        feats.append((means[c].double().cpu()[None, :] + z @ root.T).float())
        labels.append(torch.full((samples_per_class,), c, dtype=torch.long))
    if not feats:
        return torch.zeros((0, d), device=device), torch.zeros((0,), dtype=torch.long, device=device)
    return torch.cat(feats).to(device), torch.cat(labels).to(device)


def calibrate_head(
    model: nn.Module,
    weights: StateDict,
    stats: Sequence[dict[str, Tensor]],
    settings: CCVRSettings,
    train_cfg: LocalTraining,
    generator: torch.Generator,
) -> StateDict:
    """A copy of ``weights`` whose ``classifier.*`` entries are retrained on virtual features drawn from the
    pooled client statistics (the other entries are the same tensors). ``model`` is a scratch module of the
    experiment's architecture (its weights are overwritten); ``generator`` drives both the sampling and the
    minibatch order. With no class having two samples the weights come back unchanged (a shallow copy)."""
    head = linear_head(model)
    counts, means, covs = pool_class_stats(stats)
    feats, labels = virtual_features(counts, means, covs, settings.samples_per_class, generator, settings.jitter)
    out = dict(weights)
    if labels.numel() == 0:
        return out
    device = next(iter(weights.values())).device
    model.to(device)
    model.load_state_dict(weights, strict=True)
    cfg = train_cfg.model_copy(
        update={
            "lr": settings.lr or train_cfg.lr,
            "local_epochs": settings.epochs,
            "local_steps": None,
            "momentum": 0.0,
            "weight_decay": 0.0,
        }
    )
    local_sgd(head, feats.to(device), labels.to(device), cfg, generator)
    out.update({f"classifier.{k}": v.detach().clone() for k, v in head.state_dict().items()})
    return out
