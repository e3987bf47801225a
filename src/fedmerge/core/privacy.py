"""Differential-privacy mechanisms and their accounting (docs/deployment.md, "Privacy").

- [`PrivateGradients`][fedmerge.core.privacy.PrivateGradients]: DP-SGD's step (Abadi et al. 2016) inside `local_sgd()`:
  every
  sample's gradient of the task loss, clipped to ``clip`` in L2 norm, summed, Gaussian noise of standard
  deviation ``noise_multiplier * clip`` added, divided by the expected batch size (Poisson batches).
- [`clip_to_norm()`][fedmerge.core.privacy.clip_to_norm]: the server's side of user-level (central) DP.
- [`Ledger`][fedmerge.core.privacy.Ledger]: the RDP accountant's history ``[(noise multiplier, sample rate, steps),
  ...]``, kept in
  the same merged form as Opacus's ``RDPAccountant`` so that the epsilon is Opacus's to the bit.

Every noise draw and every private sample comes from a [`NoiseSource`][fedmerge.core.privacy.NoiseSource]: a generator
keyed by a secret
that only the party adding the noise holds (a client's, kept in its own state; the server's, in the server
state), never by the run's seed, which the server sends and ``config.yaml`` publishes. Opacus is imported
only for accounting (``pip install -e '.[privacy]'``).
"""

from __future__ import annotations

import functools
import hashlib
import math
import secrets
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

INSTALL_HINT = "privacy needs Opacus: pip install -e '.[privacy]'"
CLIP_EPS = 1e-6  # as Opacus: a per-sample norm of 0 gets factor 1, not a division by zero


SECRET_BYTES = 32


def new_secret() -> str:
    """A fresh noise secret from the operating system's random source (hex; 256 bits)."""
    return secrets.token_hex(SECRET_BYTES)


def reproducible_secret(seed: int, owner: str) -> str:
    """A noise secret that follows from the run's seed: bit-for-bit reproducible noise, and hence NOT private
    (anyone holding the seed regenerates the noise). Only behind ``privacy.reproducible_noise: true``."""
    return hashlib.blake2b(
        f"fedmerge-reproducible-noise|{int(seed)}|{owner}".encode(), digest_size=SECRET_BYTES
    ).hexdigest()


class NoiseSource:
    """Gaussian noise and Poisson samples for one (round, client, purpose), from a secret.

    The stream is numpy's Philox keyed by 128 bits of a keyed BLAKE2b of the secret and the key, so that no
    one without the secret can regenerate it, while a party that holds it (a resumed client, a resumed
    server) draws the same numbers again. Draws are made on the CPU in float64 (the same numbers on every
    device); floating-point side channels of the Gaussian sampler (Mironov 2012) are not addressed."""

    def __init__(self, secret: str, round_idx: int, client_id: int, purpose: str) -> None:
        if not isinstance(secret, str) or len(secret) < 2 * 16:
            raise ValueError("a noise secret must be at least 128 bits (hex)")
        mac = hashlib.blake2b(f"{int(round_idx)}|{int(client_id)}|{purpose}".encode(), key=bytes.fromhex(secret)[:64],
                              digest_size=16)  # fmt: skip
        self._rng = np.random.Generator(np.random.Philox(key=int.from_bytes(mac.digest(), "little")))

    def normal(self, shape: Sequence[int], std: float, dtype: torch.dtype) -> torch.Tensor:
        """N(0, std^2) of ``shape`` (CPU)."""
        if std == 0:
            return torch.zeros(tuple(shape), dtype=dtype)
        return torch.from_numpy(self._rng.normal(0.0, std, tuple(shape))).to(dtype)

    def poisson_sample(self, n: int, rate: float) -> torch.Tensor:
        """The indices of ``range(n)`` each kept independently with probability ``rate`` (sorted, int64)."""
        if rate >= 1.0:
            return torch.arange(n)
        return torch.from_numpy(np.flatnonzero(self._rng.random(n) < rate)).to(torch.int64)


def opacus_available() -> bool:
    try:
        import opacus.accountants  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class PrivateGradients:
    """DP-SGD's gradient for one client's local training; counts the steps it privatised (for the ledger).

    Its batches are Poisson samples (`batches()`): every training sample joins a step independently with
    probability ``q = batch_size / n``, as the accountant assumes, and the noised sum of clipped per-sample
    gradients is divided by the *expected* batch size ``q n`` (a fixed number: the sensitivity to adding or
    removing one sample stays ``clip / (q n)``), not by the batch drawn.

    Only the task loss's gradient is privatised: an ``extra_loss`` of `local_sgd()` must not
    depend on the training data through the privatised parameters (a proximal term may; a second model's
    loss on the batch may, when that model is never sent), which the methods admitting DP-SGD guarantee."""

    clip: float
    noise_multiplier: float
    noise: NoiseSource  # the client's secret's, for (round, client, "dp-sgd"): the noise and the samples
    steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    def batches(
        self, n: int, batch_size: int, steps: int, device: torch.device | None = None
    ) -> Iterator[torch.Tensor]:
        """``steps`` Poisson batches of the indices ``range(n)`` at rate ``min(1, batch_size / n)``."""
        rate = sample_rate(n, batch_size)
        for _ in range(steps):
            idx = self.noise.poisson_sample(n, rate)
            yield idx if device is None else idx.to(device)

    def gradients(
        self,
        model: nn.Module,
        params: Sequence[tuple[str, nn.Parameter]],
        x: torch.Tensor,
        y: torch.Tensor,
        expected_batch: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Set ``p.grad`` of ``params`` (named parameters of ``model``) to the private gradient: the noised sum
        of per-sample gradients of the cross-entropy on (x, y), each clipped to ``clip``, over
        ``expected_batch`` (default: the batch's size); return the (detached) logits and the mean task loss."""
        batch = int(y.shape[0])
        divisor = float(batch if expected_batch is None else expected_batch)
        std = self.noise_multiplier * self.clip
        self.steps += 1
        self.batch_sizes.append(batch)
        if batch == 0:  # a Poisson sample may be empty: the step is noise alone
            for _, p in params:
                p.grad = self.noise.normal(p.shape, std, p.dtype).to(p.device) / divisor
            return torch.zeros((0,), device=y.device), torch.tensor(float("nan"))
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
        for name, p in params:
            summed = torch.einsum("i,i...->...", factors, per_sample[name])
            noise = self.noise.normal(summed.shape, std, summed.dtype).to(summed.device)
            p.grad = (summed + noise) / divisor
        return logits, losses.mean()


def sample_rate(n: int, batch_size: int) -> float:
    """DP-SGD's Poisson sampling rate on ``n`` samples: ``batch_size / n``, at most 1."""
    return min(1.0, batch_size / max(n, 1))


def per_sample_norms(per_sample: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each sample's whole gradient (over every parameter), shape (batch,)."""
    squares = [g.reshape(g.shape[0], -1).pow(2).sum(1) for g in per_sample]
    return torch.stack(squares, 1).sum(1).sqrt()


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

    def epsilon_prv(self, delta: float) -> float | None:
        """Epsilon at ``delta`` by Opacus's PRV accountant (Gopi et al. 2021) on the same history, a tighter
        estimate beside the RDP bound (None where the PRV accountant cannot evaluate it, e.g. q = 1 with
        large noise budgets; 0 before the first step; inf without noise)."""
        if not self.history:
            return 0.0
        if any(h[0] == 0 for h in self.history):
            return math.inf
        from opacus.accountants import PRVAccountant

        accountant = PRVAccountant()
        accountant.history = [(float(s), float(q), int(n)) for s, q, n in self.history]
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            try:
                return float(accountant.get_epsilon(delta=delta, eps_error=0.01))
            except (ValueError, RuntimeError, OverflowError, ZeroDivisionError, IndexError):
                return None


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
