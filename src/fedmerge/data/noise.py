"""Label noise on training labels (symmetric or pair flips)."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class NoiseConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["none", "symmetric", "pair"] = Field(
        "none", description="symmetric: a flipped label becomes any other class; pair: the next class"
    )
    rate: float = Field(0.0, ge=0, lt=1, description="fraction of each client's train labels flipped")


def apply_label_noise(
    labels: np.ndarray, cfg: NoiseConfig, num_classes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray | None]:
    """Return (noisy labels, clean labels or None when no noise is configured).

    Exactly ``round(rate * n)`` samples are flipped, so the realised rate is the configured one:
    ``symmetric`` to a uniformly drawn different class, ``pair`` from y to (y + 1) mod C.
    """
    if cfg.kind == "none":
        return labels, None
    if num_classes < 2:
        raise ValueError("noise: label noise needs at least 2 classes")
    noisy = labels.copy()
    flip = rng.choice(len(labels), size=int(np.floor(cfg.rate * len(labels) + 0.5)), replace=False)
    if cfg.kind == "symmetric":
        noisy[flip] = (noisy[flip] + rng.integers(1, num_classes, size=len(flip))) % num_classes
    else:
        noisy[flip] = (noisy[flip] + 1) % num_classes
    return noisy, labels.copy()
