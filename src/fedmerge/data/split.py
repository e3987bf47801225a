"""Per-client train/val/test split, stratified by class."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)


class SplitConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    val_fraction: float = Field(0.1, ge=0, lt=1, description="fraction of each client's samples for validation")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="fraction of each client's samples for testing")
    test_per_client: int | None = Field(
        None,
        ge=1,
        description="draw each client's test split as this many held-out samples (the dataset's samples outside "
        "dataset.max_samples' subsample, which no client holds), with the (domain, class) mix of the client's "
        "training data, or of its group's for cluster/domain partitions; the client's own test_fraction part is "
        "then left unused, so train and val are unchanged. null: the test split is the client's test_fraction",
    )
    test_from: Literal["clients", "publisher"] = Field(
        "clients",
        description="where the global test set (the server model's test, metric scope global) comes from: clients "
        "(every client's test split, pooled) or publisher (the rows the dataset's publisher fixed as its test set, "
        "e.g. imagenet_r subset all: its test list; they are kept out of the partition, and each client's own test "
        "split still takes test_fraction of its samples); a dataset without such rows refuses publisher",
    )
    # int | float: a count stays a whole number through every dump (config.yaml, a node's job)
    unseen_clients: int | float = Field(
        0,
        ge=0,
        description="clients that never train (drawn from the seed, the same for every method): a fraction (< 1) "
        "or a count; each is onboarded after training on its train and val splits and tested on its test split "
        "(unseen: section); 0 = none",
    )

    @field_validator("unseen_clients", mode="before")
    @classmethod
    def _count_or_fraction(cls, value: object) -> object:
        # 1.0 reads as "every client" but would count one: the spelling must say which is meant
        if isinstance(value, float) and value == 1.0:
            raise ValueError(
                "ambiguous: write a count of clients as a whole number (1), a fraction strictly between 0 and 1 "
                "(e.g. 0.1)"
            )
        return value

    @model_validator(mode="after")
    def _leaves_training_data(self) -> SplitConfig:
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError("val_fraction + test_fraction must be below 1 (something must remain for training)")
        if self.unseen_clients >= 1 and self.unseen_clients != int(self.unseen_clients):
            raise ValueError("unseen_clients must be a fraction below 1 or a whole count")
        if self.test_from == "publisher" and self.test_per_client is not None:
            # the held-out samples test_per_client draws from could be publisher test rows: one sample, two roles
            raise ValueError("test_per_client and test_from: publisher cannot be combined; choose one")
        return self


def half_up(x: float) -> int:
    return int(np.floor(x + 0.5))


def split_sizes(n: int, cfg: SplitConfig) -> tuple[int, int, int]:
    """(train, val, test) sizes: test >= 1, val >= 1 when asked for, train >= 1."""
    n_test = max(1, half_up(cfg.test_fraction * n))
    n_val = max(1, half_up(cfg.val_fraction * n)) if cfg.val_fraction > 0 else 0
    while n - n_test - n_val < 1 and n_val > 0:
        n_val -= 1
    while n - n_test - n_val < 1 and n_test > 1:
        n_test -= 1
    if n - n_test - n_val < 1:
        raise ValueError(f"cannot split {n} sample(s) into train and test")
    return n - n_val - n_test, n_val, n_test


def split_indices(
    labels: np.ndarray, cfg: SplitConfig, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions (into ``labels``) of the train, val and test samples.

    Samples are ordered by a stratified key: one sample of every class first (so every class the client
    has appears in train when train is large enough), then each class's remaining samples spread evenly
    over [0, 1). Train takes the front of that order, test the back, so every split mirrors the client's
    class mix.
    """
    n = len(labels)
    # the classes' positions, grouped in class order and ascending within a class (as np.unique and
    # np.flatnonzero would give them): only the random draws stay per class, in the same order
    by_class = np.argsort(labels, kind="stable")
    grouped = labels[by_class]
    starts = np.flatnonzero(grouped[1:] != grouped[:-1]) + 1
    starts = np.concatenate(([0], starts)) if n else starts
    sizes = np.diff(starts, append=n)
    pos, jitter = by_class, np.empty(n)
    for start, end in zip(starts.tolist(), (starts + sizes).tolist()):
        rng.shuffle(pos[start:end])  # the draws of rng.permutation of that class's positions
        jitter[start:end] = rng.random(end - start)
    keys = np.empty(n)
    keys[pos] = (np.arange(n) - np.repeat(starts, sizes) + jitter) / np.repeat(sizes, sizes)
    keys[pos[starts]] = jitter[starts] - 1.0  # each class's first sample goes to the front
    order = np.argsort(keys, kind="stable")
    n_train, n_val, _ = split_sizes(n, cfg)
    return order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]
