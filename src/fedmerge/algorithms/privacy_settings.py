"""The ``privacy:`` config section and the checks that refuse what it cannot do: its settings, the constants the
mechanisms share (meta keys, the metadata an update may carry), and the noise-multiplier arithmetic of the
adaptive clip. [`fedmerge.algorithms.privacy`][fedmerge.algorithms.privacy] applies the mechanisms."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedmerge.core.algorithm import (
    ALGORITHMS,
)
from fedmerge.core.privacy import (
    INSTALL_HINT,
    NoiseSource,
    PrivateGradients,
    new_secret,
    opacus_available,
)

KEY = "privacy"  # the meta key of the ledgers (client and server states), the report and the update
CLIP_KEY = "privacy_clip"  # payload meta: the clipping bound (clip_on_client)
BIT_KEY = "privacy_clip_bit"  # update meta: whether the client's change was within the bound (clip_on_client)
SECRET_KEY = "privacy_secret"  # state meta: the noise secret (a client's own state; the server state)
# the update metadata that may leave a client under DP: counts that do not read its data's values (the sample
# count is not covered by the guarantee, and says so in the docs); everything else (training losses, local-global
# gap losses, APFL's alpha, ...) is computed on raw data and is dropped
PUBLIC_META = ("num_examples", "steps", "body_steps", "head_steps")
NOT_PRIVATE = "NOT private: privacy.reproducible_noise derives the noise from the seed, which anyone can read"


class _Noise(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    noise_multiplier: float | None = Field(
        None, ge=0, description="noise standard deviation / clip; set this or target_epsilon"
    )
    target_epsilon: float | None = Field(
        None, gt=0, description="the noise multiplier that spends this epsilon over the run's rounds (at delta)"
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the (epsilon, delta) guarantee reported")

    @model_validator(mode="after")
    def _one_noise(self) -> _Noise:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("set exactly one of noise_multiplier and target_epsilon")
        return self


class DPSGDSettings(_Noise):
    """``privacy.dp_sgd``: sample-level DP-SGD in every client's local training."""

    clip: float = Field(1.0, gt=0, description="bound on each training sample's gradient norm (L2)")


class CentralDPSettings(_Noise):
    """``privacy.central``: user-level DP of the server's aggregate."""

    clip: float = Field(
        1.0, gt=0, description="bound on each client's update norm (L2 of its change); adaptive: the first bound"
    )
    adaptive: bool = Field(False, description="adapt the bound towards target_quantile of the norms (Andrew et al.)")
    target_quantile: float = Field(0.5, gt=0, lt=1, description="adaptive: fraction of updates left unclipped")
    clip_lr: float = Field(0.2, gt=0, description="adaptive: geometric step of the bound per round")
    clip_count_stddev: float | None = Field(
        None, gt=0, description="adaptive: noise on the count of unclipped updates (default: clients per round / 20)"
    )
    clip_on_client: bool = Field(False, description="each client clips its own update before sending it")


class SecureAggregationSettings(BaseModel):
    """``privacy.secure_aggregation``: the server learns only the round's sum (Flower's SecAgg+; engine=flower)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_weight: float = Field(
        10000.0, gt=0, description="bound on a client's weight (its training samples); the error grows with it"
    )
    clipping_range: float = Field(
        8.0, gt=0, description="each value a client enters (its weighted change) must lie in [-range, range]"
    )
    num_shares: float = Field(
        1.0,
        gt=0,
        description="neighbours that hold shares of a client's keys: a count (> 2) or a fraction of the round",
    )
    reconstruction_threshold: float = Field(
        0.67,
        gt=0,
        description=(
            "shares needed to unmask a client: a count or a fraction of num_shares (at least 2); above half, so "
            "that a server lying about who dropped cannot collect both kinds of a client's shares"
        ),
    )


class PrivacySettings(BaseModel):
    """``privacy:`` section: differential privacy (docs/deployment.md, "Privacy"; needs Opacus for accounting)
    and secure aggregation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reproducible_noise: bool = Field(
        False,
        description="derive the DP noise from the seed (bit-for-bit reproducible, for tests): NOT private",
    )

    dp_sgd: DPSGDSettings | None = Field(None, description="sample-level DP-SGD in every client's local training")
    central: CentralDPSettings | None = Field(None, description="user-level DP on the server's aggregate")
    secure_aggregation: SecureAggregationSettings | None = Field(
        None, description="the server sees only the sum of the round's updates (Flower's SecAgg+, engine=flower)"
    )

    @model_validator(mode="after")
    def _something(self) -> PrivacySettings:
        if self.reproducible_noise and not (self.dp_sgd or self.central):
            raise ValueError("reproducible_noise: set with dp_sgd or central (it is about their noise)")
        if self.dp_sgd is None and self.central is None and self.secure_aggregation is None:
            raise ValueError("set dp_sgd, central, secure_aggregation or several (or remove the privacy section)")
        return self

    @property
    def differential(self) -> bool:
        """Whether a DP mechanism is on (the method is then wrapped in `PrivateAlgorithm`)."""
        return self.dp_sgd is not None or self.central is not None


def clients_per_round(num_clients: int, participation: float) -> int:
    """How many clients the round loop's ``Schedule`` samples per round."""
    return max(1, min(num_clients, int(round(participation * num_clients))))


def settings_problem(name: str, settings: PrivacySettings) -> str | None:
    """Why ``settings`` cannot apply to method ``name`` whatever the model and data (one line), or None: what
    an operator's machine can refuse before a ServerApp starts."""
    cls = ALGORITHMS.get(name).obj
    if settings.secure_aggregation is not None:
        if cls.secure_aggregation_refusal is not None:
            return f"privacy.secure_aggregation: {name} {cls.secure_aggregation_refusal}"
        if settings.central is not None:
            return (
                "privacy.secure_aggregation: not with privacy.central, whose server clips each update and so "
                "must hold it (use dp_sgd, whose noise is added on the clients)"
            )
    if settings.dp_sgd is not None and cls.dp_sgd_refusal is not None:
        return f"privacy.dp_sgd: {name} {cls.dp_sgd_refusal}"
    if settings.central is not None:
        if cls.central_dp_refusal is not None:
            return f"privacy.central: {name} {cls.central_dp_refusal}"
        c = settings.central
        if c.adaptive and c.clip_on_client:
            return (
                "privacy.central: adaptive clipping counts the unclipped updates on the server; not with clip_on_client"
            )
    if settings.differential and not opacus_available():
        return INSTALL_HINT
    return None


def privacy_problem(name: str, settings: PrivacySettings, model: nn.Module, sample: torch.Tensor) -> str | None:
    """Why ``settings`` cannot apply to method ``name`` with ``model`` (one line), or None."""
    problem = settings_problem(name, settings)
    if problem is not None or settings.dp_sgd is None:
        return problem
    if any(isinstance(m, _BatchNorm) for m in model.modules()):
        return (
            "privacy.dp_sgd: the model has BatchNorm layers, whose per-sample gradients do not exist (a sample's "
            "gradient depends on its batch); use a model without them or a GroupNorm variant "
            "(opacus.validators.ModuleValidator.fix makes one)"
        )
    problem = _per_sample_problem(model, sample)
    if problem is not None:
        return f"privacy.dp_sgd: cannot form per-sample gradients of the model ({problem})"
    return None


def _per_sample_problem(model: nn.Module, sample: torch.Tensor) -> str | None:
    params = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    probe = PrivateGradients(1.0, 0.0, NoiseSource(new_secret(), 0, 0, "probe"))
    y = torch.zeros(sample.shape[0], dtype=torch.int64, device=sample.device)
    try:
        with torch.random.fork_rng(devices=[]):
            probe.gradients(model, params, sample, y)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
        text = str(exc).strip()
        return text.splitlines()[0] if text else type(exc).__name__
    finally:
        for _, p in params:
            p.grad = None
    return None


def adaptive_noise_multiplier(z: float, count_stddev: float) -> float:
    """Andrew et al. (2021), Theorem 1: the updates' noise multiplier z_delta such that the updates and the
    noised count of unclipped updates (sensitivity 1/2 after centring) together spend noise multiplier z."""
    rest = z ** (-2) - (2 * count_stddev) ** (-2)
    if rest <= 0:
        raise ValueError(
            f"privacy.central: clip_count_stddev {count_stddev:g} is too small for noise multiplier {z:g} "
            f"(needs more than {z / 2:g})"
        )
    return rest ** (-0.5)
