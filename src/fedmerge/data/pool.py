"""The in-memory dataset before partitioning, the dataset registry and shared array helpers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator

from fedmerge.core.registry import ComponentConfig, Registry
from fedmerge.core.seeding import numpy_rng
from fedmerge.data.cache import PoolCacheRef


@dataclass
class Pool:
    """A whole dataset in memory.

    ``x`` is float32 (images ``N x C x H x W`` in [0, 1]; tabular ``N x F`` as read, standardized later
    when ``standardize``) or int64 token sequences ``N x T``; ``y`` holds int64 labels ``0..num_classes-1``.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str
    domain: np.ndarray | None = None
    natural_id: np.ndarray | None = None
    class_names: list[str] | None = None
    # the name of each natural client id (``client_names[natural_id]``: a writer, "PLAY: ROLE"), when the data
    # names them; a natural partition carries them to the run's outputs
    client_names: list[str] | None = None
    # standardize features with the statistics of the training samples (fedmerge.data.federated)
    standardize: bool = False
    # where partitions of exactly this pool are cached (fetched datasets); dropped by subset()
    cache: PoolCacheRef | None = None
    # rows of the test set the dataset's publisher fixed (bool per row; ImageNet-R's test list), which
    # split.test_from: publisher keeps out of the partition as the global test set; None: no such rows
    publisher_test: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.x)
        if self.y.shape != (n,):
            raise ValueError(f"dataset {self.name!r}: y has shape {self.y.shape}, expected ({n},)")
        for field in ("domain", "natural_id", "publisher_test"):
            arr = getattr(self, field)
            if arr is not None and arr.shape != (n,):
                raise ValueError(f"dataset {self.name!r}: {field} has shape {arr.shape}, expected ({n},)")
        if n and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise ValueError(f"dataset {self.name!r}: labels must lie in 0..{self.num_classes - 1}")
        if self.publisher_test is not None and self.publisher_test.dtype != np.bool_:
            kind = self.publisher_test.dtype
            raise ValueError(f"dataset {self.name!r}: publisher_test must be a boolean array, not {kind}")

    def __len__(self) -> int:
        return len(self.y)

    @property
    def is_image(self) -> bool:
        return self.x.ndim == 4

    def subset(self, idx: np.ndarray | slice) -> Pool:
        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[idx]

        return replace(
            self,
            x=self.x[idx],
            y=self.y[idx],
            domain=pick(self.domain),
            natural_id=pick(self.natural_id),
            publisher_test=pick(self.publisher_test),
            cache=None,
        )


class DatasetConfig(ComponentConfig):
    """Options every dataset accepts."""

    max_samples: int | None = Field(
        None,
        ge=1,
        description="keep a stratified subsample of this many samples (drawn with subsample_seed); the samples it "
        "leaves out are the held-out data of split.test_per_client",
    )
    subsample_seed: Annotated[int, Field(ge=0)] | Literal["run"] = Field(
        0,
        description="seed of max_samples' subsample: a number (default 0: the same samples for every run seed, as "
        "the published studies had) or run (the run's seed: seeds then vary the data too, so the spread across "
        "seeds includes sampling variance)",
    )

    @field_validator("subsample_seed", mode="before")
    @classmethod
    def _seed_or_run(cls, value: object) -> object:
        if value == "run" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError("a seed (an integer >= 0) or run")

    # A loader that draws max_samples' subsample itself (to skip work on the samples it leaves out) says so:
    # load_pool then leaves the subsampling to it, and load_pool_and_heldout loads the rest separately.
    subsamples_itself: ClassVar[bool] = False

    def lazy_whole(self) -> Pool | None:
        """The whole dataset (``max_samples`` ignored) with its inputs as [`LazyRows`][fedmerge.data.lazy_rows.LazyRows]
        made only for the rows used, for a loader whose inputs are expensive to make; None (the default): the
        whole dataset is loaded as usual. ``load_pool_and_heldout`` takes the held-out pool from it."""
        return None

    def marks_publisher_test(self) -> bool:
        """Whether the loaded pool marks rows as its publisher's test set (``Pool.publisher_test``): a loader
        that marks them says so here, so that ``split.test_from: publisher`` is checked before any loading."""
        return False

    def token_length(self) -> int | None:
        """Length of the int64 token sequences this dataset yields, known before loading; None for
        float inputs (their shape is known only once loaded)."""
        return None


DatasetLoader = Callable[[ComponentConfig], Pool]
DATASETS: Registry[DatasetLoader] = Registry("dataset")


def stratified_subsample(pool: Pool, max_samples: int, seed: int = 0) -> Pool:
    """Keep ``max_samples`` samples with class (and domain) proportions preserved.

    ``seed`` (``dataset.subsample_seed``) defaults to 0 for every experiment seed, so that a quick run sees
    the same data whichever partition the experiment seed draws.
    """
    if max_samples >= len(pool):
        return pool
    return pool.subset(subsample_rows(pool, max_samples, seed))


def subsample_rows(pool: Pool, max_samples: int, seed: int = 0) -> np.ndarray:
    """The rows (ascending) that [`stratified_subsample()`][fedmerge.data.pool.stratified_subsample] keeps; every row
    when ``max_samples`` covers
    the pool."""
    if max_samples >= len(pool):
        return np.arange(len(pool))
    rng = numpy_rng(seed, purpose=f"subsample/{pool.name}")
    strata = pool.y if pool.domain is None else pool.domain.astype(np.int64) * pool.num_classes + pool.y
    keys, inverse, counts = np.unique(strata, return_inverse=True, return_counts=True)
    # Largest-remainder allocation: quotas sum exactly to max_samples.
    exact = counts * (max_samples / len(pool))
    quota = np.floor(exact).astype(np.int64)
    short = max_samples - quota.sum()
    quota[np.argsort(-(exact - quota), kind="stable")[:short]] += 1
    chosen = [rng.choice(np.flatnonzero(inverse == k), size=quota[k], replace=False) for k in range(len(keys))]
    return np.sort(np.concatenate(chosen))


def to_float32(x: np.ndarray) -> np.ndarray:
    """``x`` as float32; values beyond its range become +-Inf silently
    ([`require_finite()`][fedmerge.data.pool.require_finite] counts them)."""
    with np.errstate(over="ignore"):
        return x.astype(np.float32)


def require_finite(x: np.ndarray, where: str, note: str = "") -> np.ndarray:
    """``x`` unchanged if every value is finite, else one-line ValueError naming ``where`` and the count.

    Loaders call it after converting to float32, so values that overflow it (1e39) count as Inf.
    """
    if x.dtype.kind not in "fc":
        return x
    bad = ~np.isfinite(x)
    count = int(bad.sum())
    if count:
        row = int(np.flatnonzero(bad.reshape(len(x), -1).any(axis=1))[0]) if x.ndim else 0
        extra = f"; {note}" if note else ""
        raise ValueError(
            f"{where}: {count} non-finite value(s) (NaN, Inf or beyond float32's range{extra}), the first in row "
            f"{row}; fix or drop those rows"
        )
    return x


def standardize(x: np.ndarray, fit_rows: np.ndarray | None = None) -> np.ndarray:
    """Zero mean, unit variance per feature with the statistics of ``x[fit_rows]`` (default: all rows);
    features constant on those rows are only centred."""
    fit = (x if fit_rows is None else x[fit_rows]).astype(np.float64)
    mean, std = fit.mean(axis=0), fit.std(axis=0)
    std[std == 0] = 1.0
    return ((x.astype(np.float64) - mean) / std).astype(np.float32)


def encode_labels(values: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Map arbitrary label values to 0..C-1 in sorted order; the originals become class names."""
    uniques, codes = np.unique(values, return_inverse=True)
    return codes.astype(np.int64).reshape(-1), [str(u) for u in uniques]


def load_pool(dataset_cfg: ComponentConfig | dict, seed: int | None = None) -> Pool:
    """Load a registered dataset from its config (or a ``{"name": ...}`` dict), subsampled if asked.

    ``seed``: the run's seed, which ``dataset.subsample_seed: run`` draws the subsample with.
    """
    cfg = dataset_config(dataset_cfg, seed)
    pool = _load_checked(cfg)
    if not isinstance(cfg, DatasetConfig) or cfg.max_samples is None or cfg.subsamples_itself:
        return pool
    return stratified_subsample(pool, cfg.max_samples, cfg.subsample_seed)


def load_pool_and_heldout(dataset_cfg: ComponentConfig | dict, seed: int | None = None) -> tuple[Pool, Pool]:
    """The pool [`load_pool()`][fedmerge.data.pool.load_pool] gives, and the held-out pool: every sample of the dataset
    that
    ``max_samples``' subsample leaves out (empty without ``max_samples``). No client is ever given a
    held-out sample, so they can serve as test data (``split.test_per_client``)."""
    cfg = dataset_config(dataset_cfg, seed)
    if not isinstance(cfg, DatasetConfig) or cfg.max_samples is None:
        pool = _load_checked(cfg)
        return pool, pool.subset(np.zeros(0, dtype=np.int64))
    lazy = cfg.lazy_whole()
    full = lazy if lazy is not None else _load_checked(cfg.model_copy(update={"max_samples": None}))
    rows = subsample_rows(full, cfg.max_samples, cfg.subsample_seed)
    if cfg.subsamples_itself:
        pool = _load_checked(cfg)  # the loader's own subsample, exactly as load_pool gives it
        kept = np.asarray(full.x[rows])  # a lazy pool makes (or reads from its cache) the subsample's inputs
        same = np.array_equal(pool.y, full.y[rows]) and pool.x.shape == kept.shape
        if not same or (pool.x.dtype.kind == "f" and not np.allclose(pool.x, kept, rtol=1e-3, atol=1e-3)):
            raise RuntimeError(f"dataset {cfg.name!r}: its loader's subsample is not stratified_subsample's")
    else:
        pool = full.subset(rows) if len(rows) < len(full) else full
    rest = np.ones(len(full), dtype=bool)
    rest[rows] = False
    return pool, full.subset(np.flatnonzero(rest))


def dataset_config(dataset_cfg: ComponentConfig | dict, seed: int | None = None) -> ComponentConfig:
    """The parsed dataset config with ``subsample_seed: run`` replaced by the run's ``seed``."""
    cfg = DATASETS.parse(dataset_cfg) if isinstance(dataset_cfg, dict) else dataset_cfg
    if not isinstance(cfg, DatasetConfig) or cfg.subsample_seed != "run" or cfg.max_samples is None:
        return cfg  # nothing to draw with the run's seed
    if seed is None:
        raise ValueError("dataset.subsample_seed: 'run' draws the subsample with the run's seed, and none was given")
    return cfg.model_copy(update={"subsample_seed": seed})


def _load_checked(cfg: ComponentConfig) -> Pool:
    pool = DATASETS.get(cfg.name).obj(cfg)
    # every loader, built-in or added later: no NaN/Inf reaches training
    # a user's file (path) or a fetched dataset's folder (data_dir): fields of some loaders' configs only
    where = getattr(cfg, "path", None) or getattr(cfg, "data_dir", None) or f"dataset {cfg.name!r}"
    require_finite(pool.x, str(where))
    return pool
