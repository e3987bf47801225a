"""build_federated_dataset: splits, label noise, determinism, tensors, summaries, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from fedmerge.core.registry import ComponentConfig
from fedmerge.data import (
    DATASETS,
    FederatedDataset,
    NoiseConfig,
    Pool,
    SplitConfig,
    build_federated_dataset,
    split_indices,
)

DIGITS = {"name": "digits"}
DIRICHLET = {"name": "dirichlet", "num_clients": 8, "alpha": 0.5}


def build(noise: NoiseConfig | None = None, seed: int = 0, partition: dict | None = None, **split) -> FederatedDataset:
    return build_federated_dataset(DIGITS, partition or DIRICHLET, SplitConfig(**split), noise or NoiseConfig(), seed)


@pytest.fixture(scope="module")
def clean() -> FederatedDataset:
    return build()


def test_clients_have_typed_contiguous_tensors(clean: FederatedDataset) -> None:
    assert clean.num_classes == 10 and clean.input_shape == (1, 8, 8) and clean.name == "digits"
    assert len(clean.clients) == 8
    for c in clean.clients:
        for x, y in ((c.x_train, c.y_train), (c.x_val, c.y_val), (c.x_test, c.y_test)):
            assert x.dtype == torch.float32 and y.dtype == torch.int64
            assert x.is_contiguous() and x.shape[1:] == (1, 8, 8) and len(x) == len(y)
        assert c.y_train_clean is None and c.group is None
    assert sum(c.n_train + c.n_val + c.n_test for c in clean.clients) == 1797


def test_split_sizes_follow_fractions(clean: FederatedDataset) -> None:
    for c in clean.clients:
        n = c.n_train + c.n_val + c.n_test
        assert abs(c.n_test - 0.2 * n) <= 1 and abs(c.n_val - 0.1 * n) <= 1
        # every class the client holds is in its train split
        held = torch.unique(torch.cat([c.y_train, c.y_val, c.y_test]))
        assert torch.equal(torch.unique(c.y_train), held)


def test_split_is_stratified() -> None:
    labels = np.repeat(np.arange(4), [100, 50, 30, 20])
    train, val, test = split_indices(labels, SplitConfig(val_fraction=0.1, test_fraction=0.2), np.random.default_rng(0))
    assert sorted(np.concatenate([train, val, test]).tolist()) == list(range(200))
    assert (len(train), len(val), len(test)) == (140, 20, 40)
    np.testing.assert_allclose(np.bincount(labels[test], minlength=4), [20, 10, 6, 4], atol=1)
    np.testing.assert_allclose(np.bincount(labels[val], minlength=4), [10, 5, 3, 2], atol=1)


def test_tiny_clients_still_get_train_val_and_test() -> None:
    train, val, test = split_indices(np.array([0, 1, 1]), SplitConfig(), np.random.default_rng(0))
    assert (len(train), len(val), len(test)) == (1, 1, 1)
    train, val, test = split_indices(np.array([0, 1, 1]), SplitConfig(val_fraction=0), np.random.default_rng(0))
    assert (len(train), len(val), len(test)) == (2, 0, 1)


def test_same_seed_same_data_different_seed_different(clean: FederatedDataset) -> None:
    again, other = build(seed=0), build(seed=1)
    for a, b in zip(clean.clients, again.clients, strict=True):
        for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
            assert torch.equal(getattr(a, name), getattr(b, name))
    assert [c.n_train for c in other.clients] != [c.n_train for c in clean.clients]


@pytest.mark.parametrize("kind", ["symmetric", "pair"])
def test_label_noise_flips_train_labels_only(clean: FederatedDataset, kind: str) -> None:
    noisy = build(NoiseConfig(kind=kind, rate=0.3))
    flipped = total = 0
    for c0, c in zip(clean.clients, noisy.clients, strict=True):
        # the noise has its own generator: the partition and splits are unchanged
        assert torch.equal(c.y_train_clean, c0.y_train) and torch.equal(c.x_train, c0.x_train)
        assert torch.equal(c.y_val, c0.y_val) and torch.equal(c.y_test, c0.y_test)
        changed = c.y_train != c.y_train_clean
        assert int(changed.sum()) == round(0.3 * c.n_train)
        if kind == "pair":
            assert torch.equal(c.y_train[changed], (c.y_train_clean[changed] + 1) % 10)
        flipped += int(changed.sum())
        total += c.n_train
    assert abs(flipped / total - 0.3) < 0.01
    if kind == "symmetric":  # targets spread over the other classes
        targets = torch.cat([c.y_train[c.y_train != c.y_train_clean] for c in noisy.clients])
        assert len(torch.unique(targets)) == 10


def test_noise_and_split_configs_validate() -> None:
    with pytest.raises(ValidationError, match="rate"):
        NoiseConfig(kind="symmetric", rate=1.0)
    with pytest.raises(ValidationError, match="kind"):
        NoiseConfig(kind="asymmetric")
    with pytest.raises(ValidationError, match="extra"):
        NoiseConfig(kind="pair", ratio=0.1)
    with pytest.raises(ValidationError, match="must be below 1"):
        SplitConfig(val_fraction=0.5, test_fraction=0.5)
    with pytest.raises(ValidationError, match="test_fraction"):
        SplitConfig(test_fraction=0)


def test_too_many_clients_is_a_one_line_config_error() -> None:
    with pytest.raises(ValueError, match=r"^partition\.num_clients: 100 clients need at least 3 samples"):
        build_federated_dataset(
            {"name": "digits", "max_samples": 50}, {"name": "iid", "num_clients": 100}, SplitConfig(), NoiseConfig(), 0
        )


def test_cluster_groups_reach_the_clients() -> None:
    fed = build(partition={"name": "cluster", "num_clients": 10, "num_groups": 5})
    assert [c.group for c in fed.clients] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [s["classes"] for s in fed.summary()][:2] == [[0, 1], [0, 1]]


def test_pooled_test_summary_plot_and_to(clean: FederatedDataset, tmp_path: Path) -> None:
    x, y = clean.pooled_test()
    assert len(x) == len(y) == sum(c.n_test for c in clean.clients)
    summary = clean.summary()
    assert [s["cid"] for s in summary] == list(range(8))
    assert set(summary[0]) == {"cid", "n_train", "n_val", "n_test", "classes", "group"}
    table = clean.summary_table()
    assert table.splitlines()[0].startswith("digits: 8 clients") and len(table.splitlines()) == 10
    clean.plot_summary(tmp_path / "clients.png")
    assert (tmp_path / "clients.png").stat().st_size > 1000
    moved = clean.to("cpu")
    assert moved.clients[0].x_train.device.type == "cpu" and moved.num_classes == clean.num_classes


class TokensConfig(ComponentConfig):
    name: Literal["test_tokens"] = "test_tokens"


def test_token_sequences_stay_int64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DATASETS, "_entries", dict(DATASETS._entries))  # registration undone after the test

    @DATASETS.register("test_tokens", config=TokensConfig, description="token sequences")
    def tokens(cfg: TokensConfig) -> Pool:
        rng = np.random.default_rng(0)
        return Pool(rng.integers(0, 50, (60, 12)), np.arange(60) % 3, 3, "tokens")

    fed = build_federated_dataset(
        {"name": "test_tokens"}, {"name": "iid", "num_clients": 3}, SplitConfig(), NoiseConfig(), 0
    )
    assert fed.clients[0].x_train.dtype == torch.int64 and fed.input_shape == (12,)
