"""FedMerge server step vs. a memory-bandwidth floor measured in the same run.

One full server step = ``aggregate`` (stack the client deltas, merge-logit gradient and step,
Theta update) + ``configure`` for the next round (merge the selected rows into one state dict per
client). The floor is the time to read the step's operands once (every client delta and the
(d, P) stack), measured with a plain reduction over the same tensors. Target: step <= 2x floor.

    python benchmarks/fedmerge_server.py [--models 30] [--clients 50] [--params 5e6] [--repeats 5] [--device cuda]

The step's matmuls do about 3 * 2 * s * d * P flops (45 GFLOP at the defaults), so on a CPU with
few cores the step is compute-bound rather than bandwidth-bound; the ratio is reported as is.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from fedmerge.algorithms.fedmerge import FedMerge, FedMergeConfig
from fedmerge.core.types import Update


def big_model(params: int) -> nn.Module:
    """Linear(1000 -> h) + Linear(h -> 10) with about ``params`` parameters."""
    hidden = max(1, round(params / 1011))
    return nn.Sequential(nn.Linear(1000, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def factory(params: int):
    def build(gen: torch.Generator) -> nn.Module:
        model = big_model(params)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
        return model

    return build


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, repeats: int, device: torch.device) -> list[float]:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=30, help="d")
    ap.add_argument("--clients", type=int, default=50, help="m (all selected)")
    ap.add_argument("--params", type=float, default=5e6, help="P, parameters per model")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--merge-grad", default="all", choices=["all", "head", "topk"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where the server state and the updates live")
    ap.add_argument("--profile", action="store_true", help="print the operators of one step (torch.profiler)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = FedMergeConfig(num_models=args.models, merge_grad=args.merge_grad)
    algo = FedMerge(cfg, factory(int(args.params)), args.clients, seed=0)
    state = algo.init_server_state().to(device)
    d, P = state.tensors["theta"].shape
    cids = list(range(args.clients))
    gen = torch.Generator().manual_seed(1)
    updates = {}
    for cid, payload in algo.configure(state, 1, cids).items():
        delta = {k: (torch.randn(v.shape, generator=gen) * 1e-3).to(device) for k, v in payload.tensors.items()}
        updates[cid] = Update(delta, {"num_examples": 100 + cid})

    phases: dict[str, list[float]] = {"aggregate": [], "configure": []}

    def step() -> None:
        nonlocal state
        t0 = time.perf_counter()
        state = algo.aggregate(state, 1, updates)
        sync(device)
        t1 = time.perf_counter()
        algo.configure(state, 2, cids)
        sync(device)
        phases["aggregate"].append(t1 - t0)
        phases["configure"].append(time.perf_counter() - t1)

    operands = [t for u in updates.values() for t in u.tensors.values()] + [state.tensors["theta"]]

    def read_once() -> None:
        for t in operands:
            t.sum()

    # The same bytes in one tensor, read by one reduction: the memory system's rate without one launch
    # (on a GPU, several microseconds) per operand; the floor at that rate is bytes / rate.
    one = torch.rand(sum(t.numel() for t in operands), device=device)

    def read_one() -> None:
        one.sum()

    # Compute reference: the step's three GEMM shapes alone, on preallocated buffers.
    theta = state.tensors["theta"]
    g = torch.randn(args.clients, P, device=device)
    w = torch.rand(args.clients, d, device=device)
    merged = torch.empty(args.clients, P, device=device)
    theta_copy = theta.clone()

    def gemms() -> None:
        torch.mm(theta, g.t())
        theta_copy.addmm_(w.t(), g, alpha=1e-9)
        torch.mm(w, theta, out=merged)

    step()  # warm-up: allocates the reused buffers
    read_once()
    read_one()
    gemms()
    # interleaved, so that a change of load on a shared machine hits them alike
    t_step, t_floor, t_one, t_gemm = [], [], [], []
    for _ in range(args.repeats):
        t_step += timed(step, 1, device)
        t_floor += timed(read_once, 1, device)
        t_one += timed(read_one, 1, device)
        t_gemm += timed(gemms, 1, device)
    gbytes = sum(t.numel() * t.element_size() for t in operands) / 1e9
    best_step, best_floor = min(t_step), min(t_floor)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, threads={torch.get_num_threads()}"
    print(f"d={d} m={args.clients} P={P:,} merge_grad={args.merge_grad} device={where}")
    print(f"operands read once: {gbytes:.2f} GB in {best_floor:.4f} s ({gbytes / best_floor:.1f} GB/s)")
    print(f"  the same bytes as one tensor: {min(t_one):.4f} s ({gbytes / min(t_one):.1f} GB/s)")
    print(f"server step: best {best_step:.3f} s, median {statistics.median(t_step):.3f} s")
    print("  of which (best): " + ", ".join(f"{k} {min(v):.3f} s" for k, v in phases.items()))
    gflop = 2 * args.clients * d * P * (3 if args.merge_grad != "head" else 2) / 1e9
    print(f"  matmul work {gflop:.0f} GFLOP = {gflop / best_step:.0f} GFLOP/s over the step")
    print(f"the three GEMMs alone: {min(t_gemm):.3f} s = {min(t_gemm) / best_floor:.2f}x the read floor")
    print(
        f"ratio step / floor: {best_step / best_floor:.2f}x (target <= 2x); step / one-tensor floor: "
        f"{best_step / min(t_one):.2f}x; step / GEMMs alone: {best_step / min(t_gemm):.2f}x"
    )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            step()
            sync(device)
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=40))


if __name__ == "__main__":
    main()
