"""Simulation efficiency: local training inside a FedAvg round vs. a plain centralized loop.

Both train the same architecture on the same samples with the same batches and optimizer, in one
process on the same number of threads. The ratio (plain-loop seconds divided by federated seconds)
measures what the simulation costs on top of the raw training work: per-client weight loading,
optimizer construction, RNG seeding, state copies, bookkeeping. ``fit`` is the engine's fit phase
alone, ``round`` adds the server average. Target: fit >= 0.97.

Every option takes a comma-separated list; one line is printed per case (the product of the lists):

    python benchmarks/sim_efficiency.py --model mlp,twocnn --batch-size 10,32 --clients 20,200 --threads 1,2
    python benchmarks/sim_efficiency.py --model cnn-small --profile   # where a round's time goes
    python benchmarks/sim_efficiency.py --model mlp --clients 200 --dropped  # what keeping the updates costs
    python benchmarks/sim_efficiency.py --model mlp --loop  # the training loop alone against the plain loop

Models: any registered name at its defaults, or ``cnn-small`` (TwoCNN with 8/16 channels, fc 64).
``--clock cpu`` times this process's CPU time instead of wall time: on a machine shared with other
jobs it removes the time the process waits for a core (meaningful with one thread only).

``--device cuda`` runs all of it on the GPU (data resident there; the clock waits for the device), and
``--vectorize`` adds the vectorised engine (``vectorize: true``: all clients of the round in one batched
computation) as a third column against the same plain loop:

    python benchmarks/sim_efficiency.py --device cuda --model cnn-small --clients 20,200 --batch-size 10,32 --vectorize
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
from plain_loop import plain_loop
from torch.nn import functional as F

from fedmerge.algorithms.fedavg import FedAvg, FedAvgConfig
from fedmerge.core.seeding import torch_generator
from fedmerge.core.training import local_sgd
from fedmerge.engines.local import LocalEngine
from fedmerge.engines.memory import keep_freed_memory
from fedmerge.models import MODELS, build_model

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def synced(base: Callable[[], float]) -> Callable[[], float]:
    """A clock that first waits for the GPU's queued work, so a reading includes it."""

    def read() -> float:
        torch.cuda.synchronize()
        return base()

    return read


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

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        model: str,
        batch: int,
        clients: int,
        samples: int,
        device: torch.device = torch.device("cpu"),
        vectorize: bool = False,
    ) -> None:
        model_cfg = model_config(model)
        x, y = x.to(device), y.to(device)  # resident on the device, as the runner puts client data
        self.x, self.y, self.batch, self.clients, self.samples = x, y, batch, clients, samples

        def factory(gen: torch.Generator) -> torch.nn.Module:
            return build_model(model_cfg, tuple(x.shape[1:]), 10, generator=gen)

        self.cfg = FedAvgConfig(lr=0.01, local_epochs=1, batch_size=batch)
        data = [
            SimpleNamespace(x_train=x[i * samples : (i + 1) * samples], y_train=y[i * samples : (i + 1) * samples])
            for i in range(clients)
        ]
        self.algo = FedAvg(self.cfg, factory, clients, seed=0)
        self.engine = LocalEngine(data, factory(torch_generator(0)), device, seed=0)
        self.vectorized = (
            LocalEngine(data, factory(torch_generator(0)), device, seed=0, vectorize=True) if vectorize else None
        )
        self.state = self.algo.init_server_state().to(device)
        self.central = factory(torch_generator(0)).to(device)

    def federated_round(self, rnd: int, keep: bool = True) -> tuple[list[float], float]:
        """(fit seconds of each client, aggregate seconds) of one round. With ``keep=False`` each update is
        dropped as soon as it is made and the round is not aggregated: its memory is then reused by the next
        client, which shows what writing every update to fresh memory costs."""
        payloads = self.algo.configure(self.state, rnd, list(range(self.clients)))
        fit, updates = [], {}
        for cid, payload in payloads.items():  # one client per call: each one timed on its own
            t0 = clock()
            update = self.engine.fit(self.algo, rnd, {cid: payload})
            fit.append(clock() - t0)
            if keep:
                updates.update(update)
        if not keep:
            return fit, 0.0
        t0 = clock()
        self.state = self.algo.aggregate(self.state, rnd, updates)
        return fit, clock() - t0

    def centralized_epoch(self, rnd: int) -> list[float]:
        """Seconds of the plain loop over each client's samples."""
        gen = torch_generator(0, rnd, -1, "central")
        parts = [(c.x_train, c.y_train) for c in self.engine.clients]
        return [plain_loop(self.central, [part], self.batch, self.cfg.lr, 1, gen, clock=clock) for part in parts]

    def client_overhead(self, repeats: int) -> float:
        """Seconds a client costs besides its training steps: the fastest fit of a client that trains one
        step, minus the fastest plain step on as many samples. Fixed per client, and robust to noise."""
        one_step = FedAvg(self.cfg.model_copy(update={"local_steps": 1}), self.algo.model_factory, 1, seed=0)
        payload = one_step.configure(self.state, 1, [0])
        x0, y0 = self.engine.clients[0].x_train[: self.batch], self.engine.clients[0].y_train[: self.batch]
        fed, plain = [], []
        for r in range(repeats + 1):
            t0 = clock()
            self.engine.fit(one_step, r, payload)
            fed.append(clock() - t0)
            gen = torch_generator(r)
            plain.append(plain_loop(self.central, [(x0, y0)], self.batch, self.cfg.lr, 1, gen, clock=clock))
        return min(fed[1:]) - min(plain[1:])

    def loop_ratio(self, repeats: int) -> float:
        """Plain-loop seconds over ``local_sgd``'s, both training one model on all clients' samples in one
        call (same batches, no engine, no per-client work): what the training loop itself adds per step."""
        n = self.clients * self.samples
        x, y = self.x[:n], self.y[:n]
        model = self.engine.model
        fed, plain = [], []
        for r in range(repeats + 1):  # interleaved, so that load changes hit both alike; the first is warm-up
            t0 = clock()
            local_sgd(model, x, y, self.cfg, torch_generator(r))
            fed.append(clock() - t0)
            gen = torch_generator(r)
            plain.append(plain_loop(self.central, [(x, y)], self.batch, self.cfg.lr, 1, gen, clock=clock))
        return min(plain[1:]) / min(fed[1:])

    def vectorized_fit(self, rnd: int) -> float:
        """Seconds of the vectorised engine's fit of all clients of a round, in one call."""
        payloads = self.algo.configure(self.state, rnd, list(range(self.clients)))
        t0 = clock()
        self.vectorized.fit(self.algo, rnd, payloads)
        return clock() - t0

    def measure(self, repeats: int, dropped: bool = False) -> tuple[float, float, float, float, float]:
        """(fit, fit + aggregate, plain loop, fit with updates dropped, vectorised fit) seconds of a round:
        for each client (and the aggregation) the fastest of the repeats, which are interleaved so that noise
        hits all alike. On a busy machine the fastest time is the least disturbed one; whole rounds would be
        dominated by the noise. The last two are measured only with ``dropped`` and ``vectorize`` (else nan)."""
        self.federated_round(0)  # warm-up: allocator, first optimizer construction
        self.centralized_epoch(0)
        if self.vectorized is not None:
            self.vectorized_fit(0)
        inf = [float("inf")] * self.clients
        fit, agg, plain, drop, vec = list(inf), float("inf"), list(inf), list(inf), float("inf")
        for r in range(1, repeats + 1):
            f, a = self.federated_round(r)
            fit, agg = [min(u, v) for u, v in zip(fit, f)], min(agg, a)
            if dropped:
                drop = [min(u, v) for u, v in zip(drop, self.federated_round(r, keep=False)[0])]
            plain = [min(u, v) for u, v in zip(plain, self.centralized_epoch(r))]
            if self.vectorized is not None:
                vec = min(vec, self.vectorized_fit(r))
        nan = float("nan")
        return (
            sum(fit),
            sum(fit) + agg,
            sum(plain),
            sum(drop) if dropped else nan,
            vec if self.vectorized is not None else nan,
        )


def csv(kind: type) -> Callable[[str], list]:
    return lambda text: [kind(v) for v in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=csv(str), default=["twocnn"])
    ap.add_argument("--batch-size", type=csv(int), default=[32])
    ap.add_argument("--clients", type=csv(int), default=[20])
    ap.add_argument("--threads", type=csv(int), default=[1])
    ap.add_argument("--samples", type=int, default=200, help="training samples per client")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the clock then waits for the device)")
    ap.add_argument("--vectorize", action="store_true", help="also time the vectorised engine (vectorize: true)")
    ap.add_argument("--profile", action="store_true", help="print a pyinstrument profile of one round per case")
    ap.add_argument(
        "--loop",
        action="store_true",
        help="also time local_sgd alone against the plain loop on all clients' samples in one call (no engine, "
        "no per-client work): what the training loop adds per step",
    )
    ap.add_argument(
        "--malloc-default",
        action="store_true",
        help="leave glibc's malloc as it is instead of keeping freed memory (keep_freed_memory, a run's default): "
        "each round's updates then page-fault fresh memory",
    )
    ap.add_argument(
        "--dropped",
        action="store_true",
        help="also time the fit with each update dropped at once (memory reused): the cost of keeping updates",
    )
    args = ap.parse_args()
    global clock
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch sees no CUDA device")
    clock = synced(CLOCKS[args.clock]) if device.type == "cuda" else CLOCKS[args.clock]

    kept_memory = not args.malloc_default and keep_freed_memory()  # as a run does (keep_freed_memory: true)
    x, y, source = load_samples(max(args.clients) * args.samples)
    print(
        f"data={source}, {args.samples} samples per client, FedAvg 1 local epoch, best of {args.repeats}, "
        f"{args.clock} clock, device {device}, freed memory {'kept' if kept_memory else 'returned (malloc default)'}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    for model, batch, clients, threads in itertools.product(args.model, args.batch_size, args.clients, args.threads):
        torch.set_num_threads(threads)
        case = Case(x, y, model, batch, clients, args.samples, device, args.vectorize)
        fit, rnd, plain, dropped, vec = case.measure(args.repeats, args.dropped)
        overhead = case.client_overhead(20 * args.repeats)
        n = clients * args.samples
        kept = f"; keeping the updates costs {(fit - dropped) / plain:.1%} of it" if args.dropped else ""
        if args.loop:
            kept += f"; local_sgd alone/plain {case.loop_ratio(args.repeats):.3f}"
        if args.vectorize:
            kept += f"; vectorised fit/plain {plain / vec:.3f} ({n / vec:,.0f} samples/s)"
        print(
            f"model={model:<9} batch={batch:<3} clients={clients:<4} threads={threads}: "
            f"fit/plain {plain / fit:.3f}  round/plain {plain / rnd:.3f}  (plain {n / plain:,.0f} samples/s, "
            f"fit {n / fit:,.0f}); "
            f"per client {overhead * 1e6:.0f} us besides training = {overhead * clients / plain:.1%} of it{kept}",
            flush=True,
        )
        if args.profile:
            from pyinstrument import Profiler

            with Profiler(interval=0.0005) as profiler:
                case.federated_round(args.repeats + 1)
            print(profiler.output_text(unicode=False, color=False, show_all=False))


if __name__ == "__main__":
    main()
