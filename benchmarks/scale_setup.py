"""Set-up time of a large population: building the partition, and the whole federated dataset.

A synthetic pool shaped like Fashion-MNIST's labels (10 classes, SAMPLES_PER_CLIENT samples per client,
small feature rows so the data fit in memory) is partitioned into N clients by each partitioner, then
split into per-client train/val/test, at N/10 and at N clients. The figure to read is the ratio of the
two times: about 10 when nothing grows faster than the population (a per-client scan of the pool
made it about 100). Seconds are wall-clock on this machine, for context only.

    python benchmarks/scale_setup.py [--clients 100000] [--per-client 30]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fedmerge.core.seeding import numpy_rng
from fedmerge.data import NoiseConfig, SplitConfig
from fedmerge.data.federated import federate
from fedmerge.data.partitioners import PARTITIONERS
from fedmerge.data.pool import Pool

PARTITIONS = {
    "iid": {},
    "dirichlet": {"alpha": 10.0, "min_samples": 3},  # a small alpha cannot give 100k clients >= 3 samples each
    "shards": {"classes_per_client": 2},
    "cluster": {"num_groups": 5},
    "natural": {},
}


def synthetic_pool(num_clients: int, per_client: int) -> Pool:
    rng = np.random.default_rng(0)
    n = num_clients * per_client
    return Pool(
        x=rng.random((n, 4), dtype=np.float32),
        y=rng.integers(0, 10, n),
        num_classes=10,
        name="synthetic",
        natural_id=rng.integers(0, num_clients, n),
    )


def partition_config(name: str, num_clients: int) -> dict:
    return {"name": name, **({} if name == "natural" else {"num_clients": num_clients}), **PARTITIONS[name]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100_000)
    parser.add_argument("--per-client", type=int, default=30)
    args = parser.parse_args()
    small, large = (setup_seconds(n, args.per_client) for n in (args.clients // 10, args.clients))
    print(f"time at {args.clients} clients / time at {args.clients // 10} clients:")
    for step in large:
        print(f"  {step:<14} {large[step] / max(small[step], 1e-9):5.1f}x  ({large[step]:.2f} s)")


def setup_seconds(num_clients: int, per_client: int) -> dict[str, float]:
    """Seconds of each partitioner (with validation) and of the whole dataset with the iid partition."""
    pool = synthetic_pool(num_clients, per_client)
    seconds = {}
    for name in PARTITIONS:
        cfg = PARTITIONERS.parse(partition_config(name, num_clients))
        t0 = time.perf_counter()
        PARTITIONERS.get(name).obj(cfg, pool, numpy_rng(0, purpose="partition")).validate(len(pool))
        seconds[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    data = federate(pool, partition_config("iid", num_clients), SplitConfig(), NoiseConfig(), 0)
    seconds["whole dataset"] = time.perf_counter() - t0
    assert data.num_clients == num_clients
    return seconds


if __name__ == "__main__":
    main()
