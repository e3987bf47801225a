"""Per-client tensors (FederatedDataset) and the function that builds them from configs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmerge.core.registry import ComponentConfig
from fedmerge.core.seeding import numpy_rng
from fedmerge.data.cache import PoolCacheRef
from fedmerge.data.heldout import heldout_tests, num_strata, training_mix
from fedmerge.data.noise import NoiseConfig, apply_label_noise
from fedmerge.data.partitioners import PARTITIONERS, Partition
from fedmerge.data.pool import Pool, load_pool, load_pool_and_heldout, standardize
from fedmerge.data.split import SplitConfig, split_indices
from fedmerge.data.transforms import rotate_images
from fedmerge.data.unseen import seen_first, unseen_ids


@dataclass
class ClientData:
    cid: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    group: int | None = None
    y_train_clean: torch.Tensor | None = None

    @property
    def n_train(self) -> int:
        return len(self.y_train)

    @property
    def n_val(self) -> int:
        return len(self.y_val)

    @property
    def n_test(self) -> int:
        return len(self.y_test)

    def to(self, device: torch.device | str) -> ClientData:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


@dataclass
class FederatedDataset:
    clients: Sequence[ClientData]  # a list, or views into one pooled tensor (data.views.PooledClients)
    num_classes: int
    input_shape: tuple[int, ...]
    name: str
    class_names: list[str] | None = None  # from the dataset when it names its classes
    # split.unseen_clients: the last ``num_unseen`` clients never train (ids S..S+U-1); their partition indices
    unseen_origin: list[int] = field(default_factory=list)
    # each client's name (natural partitions of data that names its clients: "PLAY: ROLE"), else None
    client_names: list[str] | None = None
    # split.test_from: publisher: the (x, y) of the dataset publisher's test rows, which no client holds; the
    # global test set in place of the clients' pooled test splits
    global_test: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_unseen(self) -> int:
        return len(self.unseen_origin)

    @property
    def num_participants(self) -> int:
        return len(self.clients) - self.num_unseen

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def to(self, device: torch.device | str) -> FederatedDataset:
        moved = None if self.global_test is None else (self.global_test[0].to(device), self.global_test[1].to(device))
        if hasattr(self.clients, "to"):  # views into one pool (data.views.PooledClients): move the pool once
            return replace(self, clients=self.clients.to(device), global_test=moved)
        return replace(self, clients=[c.to(device) for c in self.clients], global_test=moved)

    def pooled_test(self, cids: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The global test set: the test splits of clients ``cids`` (None: every client), concatenated; with
        ``split.test_from: publisher``, the publisher's test rows whichever clients are named."""
        if self.global_test is not None:
            return self.global_test
        clients = self.clients if cids is None else [self.clients[c] for c in cids]
        return torch.cat([c.x_test for c in clients]), torch.cat([c.y_test for c in clients])

    def groups(self) -> list[int | None]:
        """Each client's group (cluster/domain partitions), without gathering any client's data."""
        if hasattr(self.clients, "group_list"):
            return self.clients.group_list()
        return [c.group for c in self.clients]

    def summary(self) -> list[dict]:
        return [
            {
                "cid": c.cid,
                "n_train": c.n_train,
                "n_val": c.n_val,
                "n_test": c.n_test,
                "classes": sorted(torch.unique(c.y_train).tolist()),
                "group": c.group,
            }
            for c in self.clients
        ]

    def summary_table(self) -> str:
        head = f"{'cid':>4} {'group':>5} {'train':>7} {'val':>6} {'test':>6}  classes"
        rows = [
            f"{s['cid']:>4} {'-' if s['group'] is None else s['group']:>5} {s['n_train']:>7} {s['n_val']:>6} "
            f"{s['n_test']:>6}  {compact_ranges(s['classes'])}"
            for s in self.summary()
        ]
        title = f"{self.name}: {self.num_clients} clients, {self.num_classes} classes, input {self.input_shape}"
        if self.global_test is not None:
            title += f"; global test: the publisher's {len(self.global_test[1])} test samples"
        names = self.named_classes()
        legend = [f"classes: {', '.join(f'{k}={n}' for k, n in enumerate(names))}"] if names else []
        return "\n".join([title, *legend, head, *rows])

    def named_classes(self) -> list[str] | None:
        """The label names the data holds (``letter``'s A..Z), None when they are only the indices 0..C-1."""
        names = self.class_names
        if names is None or [str(n) for n in names] == [str(k) for k in range(self.num_classes)]:
            return None
        return [str(n) for n in names]

    def class_counts(self) -> np.ndarray:
        """``clients x classes`` sample counts over all splits, with the true (clean) train labels."""
        counts = np.zeros((self.num_clients, self.num_classes), dtype=np.int64)
        for i, c in enumerate(self.clients):
            train = c.y_train if c.y_train_clean is None else c.y_train_clean
            for y in (train, c.y_val, c.y_test):
                counts[i] += np.bincount(y.cpu().numpy(), minlength=self.num_classes)
        return counts

    def plot_summary(self, path: str | Path) -> None:
        """Save `summary_figure()` as an image (creating its folder)."""
        fig = self.summary_figure()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)

    def summary_figure(self) -> Any:
        """Stacked bar chart of per-client class counts; with cluster or domain groups, clients are
        ordered by group, with a dashed separator and the group's name between groups."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        # A bare Figure with the Agg canvas: no pyplot, so the caller's global backend is untouched.
        counts = self.class_counts()
        names = self.named_classes()
        groups = [c.group for c in self.clients]
        grouped = all(g is not None for g in groups)
        order = np.argsort(np.asarray(groups), kind="stable") if grouped else np.arange(self.num_clients)
        fig = Figure(figsize=(max(6.0, 0.25 * self.num_clients + 2), 4.0))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        colors = _class_colors(self.num_classes)
        bottom = np.zeros(self.num_clients)
        pos = np.arange(self.num_clients)
        for k in range(self.num_classes):
            label = str(k) if names is None else names[k]
            ax.bar(pos, counts[order, k], bottom=bottom, width=0.85, color=colors[k], label=label)
            bottom = bottom + counts[order, k]  # a new array: bar() may keep a reference to the old one
        ax.margins(x=0.01)
        # explicit: the empty segments on top of each bar are "sticky" and would cancel a y margin
        ax.set_ylim(0, max(float(bottom.max()), 1.0) * 1.06)
        if self.num_clients <= 40:  # every client by its id
            ax.set_xticks(pos, [str(int(c)) for c in order], fontsize="small" if self.num_clients > 20 else None)
        else:  # integer positions only (ids are in order when there are no groups)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if grouped:
            sorted_groups = np.asarray(groups)[order]
            starts = [0, *(np.flatnonzero(np.diff(sorted_groups)) + 1).tolist()]
            ends = [*starts[1:], self.num_clients]
            for start, end in zip(starts, ends):
                if start:
                    ax.axvline(start - 0.5, color="0.3", linestyle="--", linewidth=1.0)
                label = f"group {sorted_groups[start]}"
                where = ax.get_xaxis_transform()  # x in data units, y in axes units: just above the plot
                ax.text((start + end - 1) / 2, 1.01, label, transform=where, ha="center", va="bottom", fontsize="small")
        ax.set_xlabel("client (ordered by group)" if grouped else "client")
        ax.set_ylabel("samples")
        ax.set_title(f"{self.name}: samples per client and class", pad=18 if grouped else 6)
        if self.num_classes <= 20:
            ax.legend(title="class", fontsize="small", ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
        fig.tight_layout()
        return fig


def _class_colors(num_classes: int) -> list:
    from matplotlib import colormaps

    if num_classes <= 20:  # qualitative palette: neighbouring classes stay distinguishable
        palette = colormaps["tab10" if num_classes <= 10 else "tab20"]
        return [palette(k) for k in range(num_classes)]
    return [colormaps["viridis"](k / (num_classes - 1)) for k in range(num_classes)]


def compact_ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts)


def build_federated_dataset(
    dataset_cfg: ComponentConfig | dict,
    partition_cfg: ComponentConfig | dict,
    split_cfg: SplitConfig,
    noise_cfg: NoiseConfig,
    seed: int,
) -> FederatedDataset:
    """Load, partition, split each client into train/val/test, and add label noise to train labels.

    Every random step has its own generator keyed by the seed (and client id), so changing, say, the
    noise does not change the partition or the splits. With ``split.test_per_client`` the test splits
    come from the samples ``dataset.max_samples`` left out ([`fedmerge.data.heldout`][fedmerge.data.heldout]).
    """
    if split_cfg.test_per_client is None:
        return federate(load_pool(dataset_cfg, seed), partition_cfg, split_cfg, noise_cfg, seed)
    pool, heldout = load_pool_and_heldout(dataset_cfg, seed)
    return federate(pool, partition_cfg, split_cfg, noise_cfg, seed, heldout)


def compute_partition(pool: Pool, pcfg: ComponentConfig, seed: int) -> Partition:
    partition = PARTITIONERS.get(pcfg.name).obj(pcfg, pool, numpy_rng(seed, purpose="partition"))
    partition.validate(len(pool))
    return partition


def partition_for(pool: Pool, pcfg: ComponentConfig, seed: int) -> Partition:
    """The partition of ``pool``; for a pool with a cache (fetched datasets), read from or written to it
    under a key over the pool's contents, every partition option and the seed."""
    if pool.cache is None:
        return compute_partition(pool, pcfg, seed)
    params = {"pool": pool.cache.pool_key, "partition": pcfg.model_dump(mode="json"), "seed": seed}
    arrays = pool.cache.cache.get_or_build(
        "partition", params, lambda: partition_to_arrays(compute_partition(pool, pcfg, seed))
    )
    partition = partition_from_arrays(arrays)
    partition.validate(len(pool))
    return partition


def partition_to_arrays(partition: Partition) -> dict[str, np.ndarray]:
    arrays = {
        "indices": np.concatenate(partition.indices).astype(np.int64) if partition.indices else np.zeros(0, np.int64),
        "sizes": np.array([len(i) for i in partition.indices], dtype=np.int64),
    }
    if partition.groups is not None:
        arrays["groups"] = np.asarray(partition.groups, dtype=np.int64)
    if partition.rotations is not None:
        arrays["rotations"] = np.asarray(partition.rotations, dtype=np.float64)
    return arrays


def partition_from_arrays(arrays: dict[str, np.ndarray]) -> Partition:
    indices = np.split(arrays["indices"], np.cumsum(arrays["sizes"])[:-1]) if len(arrays["sizes"]) else []
    groups = arrays["groups"].tolist() if "groups" in arrays else None
    rotations = arrays["rotations"].tolist() if "rotations" in arrays else None
    return Partition(indices, groups=groups, rotations=rotations)


def federate(
    pool: Pool,
    partition_cfg: ComponentConfig | dict,
    split_cfg: SplitConfig,
    noise_cfg: NoiseConfig,
    seed: int,
    heldout: Pool | None = None,
) -> FederatedDataset:
    """[`build_federated_dataset()`][fedmerge.data.federated.build_federated_dataset] on an already loaded pool (and,
    for ``split.test_per_client``, the
    held-out pool that [`load_pool_and_heldout()`][fedmerge.data.pool.load_pool_and_heldout] gives with it)."""
    pcfg = PARTITIONERS.parse(partition_cfg) if isinstance(partition_cfg, dict) else partition_cfg
    global_rows = publisher_test_rows(pool, split_cfg)
    if global_rows is None:
        partition = partition_for(pool, pcfg, seed)
        indices = [np.asarray(idx, dtype=np.int64) for idx in partition.indices]
    else:  # the partition sees only the other rows; its indices are mapped back to the pool's rows
        rest = np.flatnonzero(~pool.publisher_test)
        partition = partition_for(without_rows(pool, rest), pcfg, seed)
        indices = [rest[np.asarray(idx, dtype=np.int64)] for idx in partition.indices]
    splits = [
        split_indices(pool.y[idx], split_cfg, numpy_rng(seed, client_id=cid, purpose="split"))
        for cid, idx in enumerate(indices)
    ]
    unseen = unseen_ids(len(indices), getattr(split_cfg, "unseen_clients", 0), seed)
    x_np, y_np = pool.x, pool.y
    if split_cfg.test_per_client is not None:  # positions past the pool's rows: the held-out test samples
        tests, x_np, y_np = _heldout_test_rows(pool, heldout, indices, splits, partition.groups, split_cfg, seed)
    if pool.standardize:  # statistics of the participants' training samples only: nothing leaks from val/test
        left_out = set(unseen)
        fit = [idx[train] for cid, (idx, (train, _, _)) in enumerate(zip(indices, splits)) if cid not in left_out]
        train_rows = np.unique(np.concatenate(fit))
        x_np = standardize(x_np, train_rows)
    x_pool = torch.from_numpy(np.ascontiguousarray(x_np))
    x_pool = x_pool.float() if x_pool.is_floating_point() else x_pool.long()
    # One gather puts every client's rows in one tensor, client by client (train, val, test); each
    # client's splits are views of it: one allocation for the population, not three per client.
    if split_cfg.test_per_client is None:
        order = [np.concatenate([idx[t] for t in split]) for idx, split in zip(indices, splits)]
    else:  # the client's own test part is left unused: its train and val are unchanged
        order = [
            np.concatenate([idx[train], idx[val], test]) for idx, (train, val, _), test in zip(indices, splits, tests)
        ]
    x_all = x_pool[torch.from_numpy(np.concatenate(order) if order else np.zeros(0, dtype=np.int64))]

    def labels(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    global_test = None if global_rows is None else (x_pool[torch.from_numpy(global_rows)], labels(y_np[global_rows]))
    del x_pool

    clients = []
    start = 0
    for cid, idx in enumerate(indices):
        train, val, test = splits[cid]
        a, b, end = start + len(train), start + len(train) + len(val), start + len(order[cid])
        if partition.rotations is not None and partition.rotations[cid] % 360:
            x_all[start:end] = rotate_images(x_all[start:end], partition.rotations[cid])
        y = pool.y[idx]
        y_test = y[test] if split_cfg.test_per_client is None else y_np[tests[cid]]
        y_train, y_clean = (
            (y[train], None)  # no generator to make per client when there is no noise
            if noise_cfg.kind == "none"
            else apply_label_noise(
                y[train], noise_cfg, pool.num_classes, numpy_rng(seed, client_id=cid, purpose="noise")
            )
        )
        clients.append(
            ClientData(
                cid=cid,
                x_train=x_all[start:a],
                y_train=labels(y_train),
                x_val=x_all[a:b],
                y_val=labels(y[val]),
                x_test=x_all[b:end],
                y_test=labels(y_test),
                group=None if partition.groups is None else int(partition.groups[cid]),
                y_train_clean=None if y_clean is None else labels(y_clean),
            )
        )
        start = end
    class_names = None if pool.class_names is None else [str(c) for c in pool.class_names]
    names = natural_names(pool, pcfg, indices)
    if unseen:  # participants first (ids 0..S-1), then the clients that never train
        clients = [replace(c, cid=i) for i, c in enumerate(seen_first(clients, unseen))]
        names = None if names is None else seen_first(names, unseen)
    return FederatedDataset(
        clients,
        pool.num_classes,
        tuple(pool.x.shape[1:]),
        pool.name,
        class_names,
        unseen,
        client_names=names,
        global_test=global_test,
    )


def publisher_test_rows(pool: Pool, split_cfg: SplitConfig) -> np.ndarray | None:
    """The pool's rows of its publisher's test set with ``split.test_from: publisher`` (None otherwise);
    a pool that marks none, or marks every row, is refused in one line."""
    if split_cfg.test_from != "publisher":
        return None
    marked = pool.publisher_test
    if marked is None or not marked.any():
        raise ValueError(
            f"split.test_from: publisher: dataset {pool.name!r} marks no rows as its publisher's test set; "
            "use split.test_from: clients"
        )
    if marked.all():
        raise ValueError(
            f"split.test_from: publisher: every row of dataset {pool.name!r} is a test row; none is left "
            "for the clients"
        )
    return np.flatnonzero(marked)


def without_rows(pool: Pool, rest: np.ndarray) -> Pool:
    """``pool.subset(rest)`` (the rows a partition may give out), with a cache of its own for a cached pool.
    Rows in one run (ImageNet-R's train list before its test list) are a view: no copy of a large pool's x."""
    whole_run = len(rest) and int(rest[-1]) - int(rest[0]) + 1 == len(rest)
    part = pool.subset(slice(int(rest[0]), int(rest[-1]) + 1)) if whole_run else pool.subset(rest)
    if pool.cache is None:
        return part
    return replace(part, cache=PoolCacheRef(pool.cache.cache, f"{pool.cache.pool_key}/without-publisher-test"))


def natural_names(pool: Pool, pcfg: ComponentConfig, indices: list[np.ndarray]) -> list[str] | None:
    """Each client's name for a natural partition of a pool that names its client ids, else None."""
    if pcfg.name != "natural" or pool.client_names is None or pool.natural_id is None:
        return None
    return [str(pool.client_names[int(pool.natural_id[idx[0]])]) if len(idx) else "" for idx in indices]


def _heldout_test_rows(
    pool: Pool,
    heldout: Pool | None,
    indices: list[np.ndarray],
    splits: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    groups: list[int] | None,
    split_cfg: SplitConfig,
    seed: int,
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Each client's held-out test samples as rows past the pool's (``len(pool) + i``), and the pool's
    x and y with those samples appended."""
    if heldout is None or not len(heldout):
        raise ValueError(
            "split.test_per_client: the test samples are drawn from the dataset's samples outside "
            f"dataset.max_samples' subsample, and there are none; set dataset.max_samples below the {len(pool)} "
            "samples used now"
        )
    size = num_strata(pool, heldout)
    mix = training_mix(pool, [idx[train] for idx, (train, _, _) in zip(indices, splits)], groups, size)
    drawn = heldout_tests(heldout, mix, split_cfg.test_per_client, numpy_rng(seed, purpose="heldout_test"))
    every = np.concatenate(drawn)
    starts = len(pool) + np.concatenate(([0], np.cumsum([len(d) for d in drawn])))
    tests = [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])]
    return tests, np.concatenate([pool.x, heldout.x[every]]), np.concatenate([pool.y, heldout.y[every]])
