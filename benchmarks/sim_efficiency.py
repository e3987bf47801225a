"""Simulation efficiency: local training inside a FedAvg round vs. a plain centralized loop.

Both train the same architecture on the same samples with the same batch size and optimizer,
in one process. The ratio (federated samples/s divided by centralized samples/s) measures what
the simulation costs on top of the raw training work: per-client model loading, optimizer
construction, RNG, state copies and the server average. Target: >= 0.9.

    python benchmarks/sim_efficiency.py [--clients 20] [--samples 200] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from torch.nn import functional as F

from fedmerge.algorithms.fedavg import FedAvg, FedAvgConfig
from fedmerge.core.seeding import torch_generator
from fedmerge.engines.local import LocalEngine
from fedmerge.models import MODELS, build_model


def load_samples(n: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """n Fashion-MNIST images when installed, else UCI digits upsampled to 28x28 (always offline)."""
    from fedmerge.data import DATASETS, DataUnavailable, load_pool

    for name in ("fashion_mnist", "digits"):
        try:
            pool = load_pool(DATASETS.get(name).config(max_samples=max(n, 100)))
        except DataUnavailable:
            continue
        x = torch.as_tensor(pool.x[:n])
        if x.shape[-1] != 28:
            x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
        x = x.repeat((n + len(x) - 1) // len(x), 1, 1, 1)[:n]
        y = torch.as_tensor(pool.y[:n]).repeat((n + len(pool.y) - 1) // len(pool.y))[:n]
        return x.contiguous(), y.contiguous(), name
    raise SystemExit("no dataset available")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--samples", type=int, default=200, help="training samples per client")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--model", default="twocnn")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    n = args.clients * args.samples
    x, y, source = load_samples(n)
    model_cfg = MODELS.get(args.model).config()
    num_classes = 10

    def factory(gen: torch.Generator) -> torch.nn.Module:
        return build_model(model_cfg, tuple(x.shape[1:]), num_classes, generator=gen)

    cfg = FedAvgConfig(lr=0.01, local_epochs=1, batch_size=args.batch_size)
    clients = [
        SimpleNamespace(
            x_train=x[i * args.samples : (i + 1) * args.samples],
            y_train=y[i * args.samples : (i + 1) * args.samples],
            x_val=x[:0],
            y_val=y[:0],
        )
        for i in range(args.clients)
    ]
    algo = FedAvg(cfg, factory, args.clients, seed=0)
    engine = LocalEngine(clients, factory(torch_generator(0)), torch.device("cpu"), seed=0)
    state = algo.init_server_state()
    selected = list(range(args.clients))

    central = factory(torch_generator(0))

    def federated_round(rnd: int) -> float:
        nonlocal state
        t0 = time.perf_counter()
        updates = engine.fit(algo, rnd, algo.configure(state, rnd, selected))
        state = algo.aggregate(state, rnd, updates)
        return time.perf_counter() - t0

    def centralized_epoch(rnd: int) -> float:
        # The plain loop a user would write: one model, one optimizer, the same batches.
        opt = torch.optim.SGD(central.parameters(), lr=cfg.lr)
        central.train()
        gen = torch_generator(0, rnd, -1, "central")
        t0 = time.perf_counter()
        for i in range(args.clients):  # same batch boundaries as the clients (no cross-client batches)
            perm = torch.randperm(args.samples, generator=gen) + i * args.samples
            for j in range(0, args.samples, args.batch_size):
                idx = perm[j : j + args.batch_size]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(central(x[idx]), y[idx]).backward()
                opt.step()
        return time.perf_counter() - t0

    federated_round(0)  # warm-up: imports, allocator, first optimizer construction
    centralized_epoch(0)
    fed, cen = [], []
    for r in range(1, args.repeats + 1):  # interleaved, so machine noise hits both alike
        fed.append(federated_round(r))
        cen.append(centralized_epoch(r))
    fed_sps, cen_sps = n / statistics.median(fed), n / statistics.median(cen)
    print(
        f"data={source} model={args.model} clients={args.clients}x{args.samples} batch={args.batch_size} "
        f"threads={torch.get_num_threads()} repeats={args.repeats}"
    )
    print(f"federated round (fit + aggregate): {fed_sps:8.0f} samples/s  (median {statistics.median(fed):.3f} s)")
    print(f"centralized loop                 : {cen_sps:8.0f} samples/s  (median {statistics.median(cen):.3f} s)")
    print(f"ratio federated/centralized      : {fed_sps / cen_sps:.3f}  (target >= 0.9)")


if __name__ == "__main__":
    main()
