"""Simulation efficiency: local training inside a FedAvg round vs. a plain centralized loop.

Both train the same architecture on the same samples with the same batches and optimizer, in one
process on the same number of threads. The ratio (plain-loop seconds divided by federated seconds)
measures what the simulation costs on top of the raw training work: per-client weight loading,
optimizer construction, RNG seeding, state copies, bookkeeping. ``fit`` is the engine's fit phase
alone, ``round`` adds the server average. Target: fit >= 0.97.

Every option takes a comma-separated list; one line is printed per case (the product of the lists):

    python benchmarks/sim_efficiency.py --model mlp,twocnn --batch-size 10,32 --clients 20,200 --threads 1,2
    python benchmarks/sim_efficiency.py --model cnn-small --profile   # where a round's time goes

Models: any registered name at its defaults, or ``cnn-small`` (TwoCNN with 8/16 channels, fc 64).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from types import SimpleNamespace

import torch
from torch.nn import functional as F

from fedmerge.algorithms.fedavg import FedAvg, FedAvgConfig
from fedmerge.core.seeding import torch_generator
from fedmerge.engines.local import LocalEngine
from fedmerge.models import MODELS, build_model

PRESETS = {"cnn-small": ("twocnn", {"channels": (8, 16), "hidden": 64})}


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


def model_config(spec: str):
    name, fields = PRESETS.get(spec, (spec, {}))
    return MODELS.get(name).config(**fields)


class Case:
    """One FedAvg round's fit phase and the plain loop over the same samples and batches."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, model: str, batch: int, clients: int, samples: int) -> None:
        model_cfg = model_config(model)
        self.x, self.y, self.batch, self.clients, self.samples = x, y, batch, clients, samples

        def factory(gen: torch.Generator) -> torch.nn.Module:
            return build_model(model_cfg, tuple(x.shape[1:]), 10, generator=gen)

        self.cfg = FedAvgConfig(lr=0.01, local_epochs=1, batch_size=batch)
        data = [
            SimpleNamespace(x_train=x[i * samples : (i + 1) * samples], y_train=y[i * samples : (i + 1) * samples])
            for i in range(clients)
        ]
        self.algo = FedAvg(self.cfg, factory, clients, seed=0)
        self.engine = LocalEngine(data, factory(torch_generator(0)), torch.device("cpu"), seed=0)
        self.state = self.algo.init_server_state()
        self.central = factory(torch_generator(0))

    def federated_round(self, rnd: int) -> tuple[float, float]:
        """(fit seconds, aggregate seconds)."""
        payloads = self.algo.configure(self.state, rnd, list(range(self.clients)))
        t0 = time.perf_counter()
        updates = self.engine.fit(self.algo, rnd, payloads)
        t1 = time.perf_counter()
        self.state = self.algo.aggregate(self.state, rnd, updates)
        return t1 - t0, time.perf_counter() - t1

    def centralized_epoch(self, rnd: int) -> float:
        # The plain loop a user would write: one model, one optimizer, the same batches.
        opt = torch.optim.SGD(self.central.parameters(), lr=self.cfg.lr)
        self.central.train()
        gen = torch_generator(0, rnd, -1, "central")
        t0 = time.perf_counter()
        for i in range(self.clients):  # same batch boundaries as the clients (no cross-client batches)
            perm = torch.randperm(self.samples, generator=gen) + i * self.samples
            for j in range(0, self.samples, self.batch):
                idx = perm[j : j + self.batch]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(self.central(self.x[idx]), self.y[idx]).backward()
                opt.step()
        return time.perf_counter() - t0

    def measure(self, repeats: int) -> tuple[float, float, float]:
        """Medians of (fit, fit + aggregate, plain loop) seconds, interleaved so noise hits both alike."""
        self.federated_round(0)  # warm-up: allocator, first optimizer construction
        self.centralized_epoch(0)
        fit, rounds, plain = [], [], []
        for r in range(1, repeats + 1):
            f, a = self.federated_round(r)
            fit.append(f)
            rounds.append(f + a)
            plain.append(self.centralized_epoch(r))
        return statistics.median(fit), statistics.median(rounds), statistics.median(plain)


def csv(kind: type) -> callable:
    return lambda text: [kind(v) for v in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=csv(str), default=["twocnn"])
    ap.add_argument("--batch-size", type=csv(int), default=[32])
    ap.add_argument("--clients", type=csv(int), default=[20])
    ap.add_argument("--threads", type=csv(int), default=[1])
    ap.add_argument("--samples", type=int, default=200, help="training samples per client")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="print a pyinstrument profile of one round per case")
    args = ap.parse_args()

    x, y, source = load_samples(max(args.clients) * args.samples)
    print(f"data={source}, {args.samples} samples per client, FedAvg 1 local epoch, median of {args.repeats}")
    for model, batch, clients, threads in itertools.product(args.model, args.batch_size, args.clients, args.threads):
        torch.set_num_threads(threads)
        case = Case(x, y, model, batch, clients, args.samples)
        fit, rnd, plain = case.measure(args.repeats)
        n = clients * args.samples
        print(
            f"model={model:<9} batch={batch:<3} clients={clients:<4} threads={threads}: "
            f"fit/plain {plain / fit:.3f}  round/plain {plain / rnd:.3f}  (plain {n / plain:,.0f} samples/s)",
            flush=True,
        )
        if args.profile:
            from pyinstrument import Profiler

            with Profiler(interval=0.0005) as profiler:
                case.federated_round(args.repeats + 1)
            print(profiler.output_text(unicode=False, color=False, show_all=False))


if __name__ == "__main__":
    main()
