"""Differential-privacy mechanisms and their accounting (docs/deployment.md, "Privacy").

- :class:`PrivateGradients`: DP-SGD's step (Abadi et al. 2016) inside :func:`~.training.local_sgd`: every
  sample's gradient of the task loss, clipped to ``clip`` in L2 norm, summed, Gaussian noise of standard
  deviation ``noise_multiplier * clip`` added, divided by the batch's size.
- :func:`clip_to_norm`, :func:`gaussian_noise`: the server's side of user-level (central) DP.
- :class:`Ledger`: the RDP accountant's history ``[(noise multiplier, sample rate, steps), ...]``, kept in
  the same merged form as Opacus's ``RDPAccountant`` so that the epsilon is Opacus's to the bit.

Every noise draw comes from a generator the caller seeds by (seed, round, client, purpose). Opacus is
imported only for accounting (``pip install -e '.[privacy]'``).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

INSTALL_HINT = "privacy needs Opacus: pip install -e '.[privacy]'"
CLIP_EPS = 1e-6  # as Opacus: a per-sample norm of 0 gets factor 1, not a division by zero


def opacus_available() -> bool:
    try:
        import opacus.accountants  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class PrivateGradients:
    """DP-SGD's gradient for one client's local training; counts the steps it privatised (for the ledger).

    Only the task loss's gradient is privatised: an ``extra_loss`` of :func:`~.training.local_sgd` must not
    depend on the training data through the privatised parameters (a proximal term may; a second model's
    loss on the batch may, when that model is never sent), which the methods admitting DP-SGD guarantee."""

    clip: float
    noise_multiplier: float
    generator: torch.Generator  # CPU; seeded by (seed, round, client, "dp-sgd")
    steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    def gradients(
        self, model: nn.Module, params: Sequence[tuple[str, nn.Parameter]], x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Set ``p.grad`` of ``params`` (named parameters of ``model``) to the private gradient of the
        mean cross-entropy on (x, y); return the (detached) logits and the mean task loss."""
        trained = {name: p.detach() for name, p in params}
        rest = {n: t.detach() for n, t in (*model.named_parameters(), *model.named_buffers()) if n not in trained}

        def loss_one(weights: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor):
            logits = functional_call(model, {**weights, **rest}, (xi.unsqueeze(0),))
            loss = F.cross_entropy(logits, yi.unsqueeze(0))
            return loss, (loss.detach(), logits.squeeze(0).detach())

        # randomness="different": each sample's dropout mask differs, drawn from torch's global RNG,
        # which the engines seed per (round, client)
        per_sample, (losses, logits) = vmap(grad(loss_one, has_aux=True), in_dims=(None, 0, 0), randomness="different")(
            trained, x, y
        )
        norms = per_sample_norms(per_sample.values())
        factors = (self.clip / (norms + CLIP_EPS)).clamp(max=1.0)
        batch = int(y.shape[0])
        std = self.noise_multiplier * self.clip
        for name, p in params:
            summed = torch.einsum("i,i...->...", factors, per_sample[name])
            noise = gaussian_noise(summed.shape, std, self.generator, summed.dtype).to(summed.device)
            p.grad = (summed + noise) / batch
        self.steps += 1
        self.batch_sizes.append(batch)
        return logits, losses.mean()


def per_sample_norms(per_sample: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each sample's whole gradient (over every parameter), shape (batch,)."""
    squares = [g.reshape(g.shape[0], -1).pow(2).sum(1) for g in per_sample]
    return torch.stack(squares, 1).sum(1).sqrt()


def gaussian_noise(shape: Sequence[int], std: float, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """N(0, std^2) of ``shape`` on the CPU generator (the same numbers on every device)."""
    if std == 0:
        return torch.zeros(tuple(shape), dtype=dtype)
    return torch.normal(0.0, std, tuple(shape), generator=generator).to(dtype)


def flat_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of the concatenation of ``tensors`` (float64, keys in sorted order)."""
    total = 0.0
    for k in sorted(tensors):
        total += float(tensors[k].double().pow(2).sum())
    return math.sqrt(total)


def clip_to_norm(tensors: Mapping[str, torch.Tensor], bound: float) -> tuple[dict[str, torch.Tensor], float]:
    """``tensors`` scaled by ``min(1, bound / norm)`` (their joint L2 norm), and that norm."""
    norm = flat_norm(tensors)
    factor = min(1.0, bound / norm) if norm > 0 else 1.0
    if factor == 1.0:
        return dict(tensors), norm
    return {k: v * factor for k, v in tensors.items()}, norm


# --- accounting ------------------------------------------------------------------------------
History = list[list[float]]  # [[noise multiplier, sample rate, steps], ...]: JSON-able


@dataclass
class Ledger:
    """An RDP accountant's history, merged as Opacus's ``RDPAccountant.step`` merges it: a run of steps
    with the same noise multiplier and sample rate is one entry."""

    history: History = field(default_factory=list)

    def add(self, noise_multiplier: float, sample_rate: float, steps: int) -> None:
        if steps <= 0:
            return
        last = self.history[-1] if self.history else None
        if last is not None and last[0] == noise_multiplier and last[1] == sample_rate:
            last[2] = int(last[2]) + int(steps)
        else:
            self.history.append([float(noise_multiplier), float(sample_rate), int(steps)])

    @property
    def steps(self) -> int:
        return sum(int(h[2]) for h in self.history)

    def epsilon(self, delta: float) -> float:
        """Epsilon at ``delta`` of everything recorded (0 before the first step; inf without noise):
        Opacus's ``RDPAccountant.get_epsilon`` on this history, with each entry's per-step RDP computed
        once per process (Opacus's ``compute_rdp`` is that vector times the steps, so the sum is the same)."""
        if not self.history:
            return 0.0
        if any(h[0] == 0 for h in self.history):
            return math.inf
        from opacus.accountants import RDPAccountant
        from opacus.accountants.analysis.rdp import get_privacy_spent

        rdp = sum([_rdp_per_step(float(s), float(q)) * int(n) for s, q, n in self.history])
        with warnings.catch_warnings():  # "optimal order is the largest alpha": a looser bound, still a bound
            warnings.simplefilter("ignore", UserWarning)
            eps, _ = get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
        return float(eps)


@functools.lru_cache(maxsize=1024)
def _rdp_per_step(noise_multiplier: float, sample_rate: float):
    """The subsampled Gaussian's RDP of one step at Opacus's default orders (the slow part of accounting)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    rdp = compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS)
    rdp.setflags(write=False)
    return rdp


def noise_for_epsilon(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The noise multiplier that spends ``target_epsilon`` at ``delta`` in ``steps`` steps at ``sample_rate``
    (Opacus's search, to within its 0.01 tolerance; the spent epsilon is at most the target)."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():  # "optimal order is the largest alpha" (see Ledger.epsilon)
        warnings.simplefilter("ignore", UserWarning)
        return float(
            get_noise_multiplier(
                target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate, steps=max(steps, 1)
            )
        )
