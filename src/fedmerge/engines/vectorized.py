"""Many clients' local SGD as one batched computation (``vectorize: true``), for accelerators.

For methods whose client step is plain local SGD on one model (``Algorithm.vectorizable``: FedAvg,
FedAvg+, FedProx, Local, FedMerge), the selected clients' parameters are stacked along a leading
client axis and trained together: every step runs ``torch.func.functional_call`` under
``torch.func.vmap`` over the stack, one forward and one backward for all clients, then one SGD update
of the whole stack. On a GPU that turns K small kernels per layer into one large one; on a CPU with
few cores it is usually slower than the sequential engine (measured 0.57x over 20 clients here).

Each client draws exactly the minibatches of the sequential engine (the same seeded generator), and
its loss is the mean over its own batch: clients with fewer samples or steps are padded and masked.
The mathematics is the sequential engine's; the numbers agree within float tolerance, not bit for
bit (batched kernels sum in other orders), which the tests check. Not supported, and refused when
the run starts: models with buffers (BatchNorm) or randomness (dropout), worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn import functional as F

from fedmerge.algorithms.base import gap_subset
from fedmerge.core.algorithm import Algorithm, ClientContext, ClientDataLike, PlainSGD
from fedmerge.core.training import LocalTraining, iterate_minibatches
from fedmerge.core.types import ClientState, Payload, Update

Prepare = Callable[[int], tuple[ClientContext, Payload, ClientState]]


def vectorize_problem(algorithm: Algorithm, model: nn.Module) -> str | None:
    """Why ``vectorize: true`` cannot train this method's clients (one line), or None when it can."""
    if not is_vectorizable(algorithm):
        return (
            f"vectorize: {algorithm.name} does not train its clients by plain local SGD on one model "
            "(vectorizable: fedavg, fedavg_ft, fedprox, local, fedmerge)"
        )
    if any(True for _ in model.buffers()):
        return "vectorize: the model has buffers (e.g. BatchNorm statistics), which clients cannot share in one batch"
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        return "vectorize: the model draws random numbers (dropout), which a batched step cannot draw per client"
    return None


def is_vectorizable(algorithm: Algorithm) -> bool:
    """``vectorizable`` holds for the class that declared it, not for a subclass that trains otherwise."""
    mro = type(algorithm).__mro__
    declared = next((i for i, c in enumerate(mro) if "vectorizable" in c.__dict__), None)
    if declared is None or not algorithm.vectorizable:
        return False
    return not any(name in c.__dict__ for c in mro[:declared] for name in ("client_update", "extra_loss", "plain_sgd"))


def fit_vectorized(
    algorithm: Algorithm,
    model: nn.Module,
    clients: Sequence[ClientDataLike],
    cids: list[int],
    prepare: Prepare,
) -> dict[int, tuple[Update, ClientState]]:
    """Each client's (update, state), as ``client_update`` would return them, from one batched run."""
    cfg: LocalTraining = algorithm.config
    jobs = []
    for cid in cids:
        ctx, payload, state = prepare(cid)
        jobs.append((cid, ctx, payload, state, algorithm.plain_sgd(payload, state)))
    tasks = [job[4] for job in jobs]
    datas = [clients[c] for c in cids]  # pooled-view clients gather their rows here, once
    trained, losses, steps = train_stack(model, tasks, datas, cfg, [job[1].generator("train") for job in jobs])
    out = {}
    for k, (cid, ctx, payload, state, task) in enumerate(jobs):
        data = datas[k]
        weights = {name: t[k].detach().clone() for name, t in trained.items()}
        meta: dict[str, Any] = {"num_examples": int(data.y_train.shape[0]), "train_loss": losses[k], "steps": steps[k]}
        meta.update(_gap_losses(model, algorithm, data, ctx, task.start, weights))
        out[cid] = algorithm.plain_sgd_result(payload, state, weights, meta)
    return out


def _gap_losses(
    model: nn.Module, algorithm: Algorithm, data: ClientDataLike, ctx: ClientContext, start: dict, trained: dict
) -> dict[str, float]:
    """The local-global gap's two losses, as [`train_received()`][fedmerge.algorithms.base.train_received] reports
    them."""
    x, y = gap_subset(data, ctx, algorithm.config.gap_samples)
    if not y.numel():
        return {"loss_received": float("nan"), "loss_trained": float("nan")}
    was = model.training
    model.eval()
    with torch.no_grad():
        received, after = (float(F.cross_entropy(functional_call(model, w, (x,)), y)) for w in (start, trained))
    model.train(was)
    return {"loss_received": received, "loss_trained": after}


def train_stack(
    model: nn.Module,
    tasks: Sequence[PlainSGD],
    data: Sequence[ClientDataLike],
    cfg: LocalTraining,
    generators: Sequence[torch.Generator],
) -> tuple[dict[str, torch.Tensor], list[float], list[int]]:
    """Local SGD of K clients at once: ({name: (K, ...) trained parameters}, mean task losses, steps)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    device = next(model.parameters()).device
    stack = {n: torch.stack([t.start[n].detach() for t in tasks]).to(device).requires_grad_(True) for n in names}
    anchor = {n: s.detach().clone() for n, s in stack.items()}
    frozen = {n: tasks[0].start[n].to(device) for n, p in model.named_parameters() if not p.requires_grad}
    mu = torch.tensor([t.prox_mu for t in tasks], dtype=stack[names[0]].dtype, device=device)
    # every client's batches, drawn exactly as the sequential engine draws them
    plans = [
        list(iterate_minibatches(int(d.y_train.shape[0]), cfg.batch_size, g, cfg.local_epochs, cfg.local_steps))
        if int(d.y_train.shape[0])
        else []
        for d, g in zip(data, generators)
    ]
    steps = [len(p) for p in plans]
    total = max(steps, default=0)
    width = max((len(idx) for p in plans for idx in p), default=0)
    k = len(tasks)
    # The round's training rows in one tensor, and every step's (K, width) rows into it with the
    # weights 1/batch (0 for padding), made once: a step is one gather, and nothing crosses to the
    # device inside the loop.
    dtype = stack[names[0]].dtype
    x_all = torch.cat([d.x_train for d in data]).to(device)
    y_all = torch.cat([d.y_train for d in data]).to(device)
    starts = torch.tensor([0, *[int(d.y_train.shape[0]) for d in data]]).cumsum(0).tolist()
    rows = torch.zeros((total, k, width), dtype=torch.long)
    weight = torch.zeros((total, k, width), dtype=dtype)
    for i, plan in enumerate(plans):
        for t, idx in enumerate(plan):
            rows[t, i, : len(idx)] = idx + starts[i]
            weight[t, i, : len(idx)] = 1.0 / len(idx)  # the mean over the client's own batch
    rows, weight = rows.to(device), weight.to(device)
    active = torch.tensor([[t < s for s in steps] for t in range(total)], device=device).view(total, k)
    prox = any(t.prox_mu > 0 for t in tasks)
    momentum: dict[str, torch.Tensor] = {}
    loss_sums = torch.zeros(k, dtype=torch.float64, device=device)
    model.train()

    def client_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor):
        logits = functional_call(model, {**params, **frozen}, (x,))
        return (F.cross_entropy(logits, y, reduction="none") * w).sum()

    batched = vmap(client_loss)
    for step in range(total):
        task = batched(stack, x_all[rows[step]], y_all[rows[step]], weight[step])  # (K,) mean loss per client
        loss = task.sum()
        if prox:
            for n in names:
                sq = ((stack[n] - anchor[n]) ** 2).flatten(1).sum(dim=1)
                loss = loss + (0.5 * mu * sq).sum()
        grads = torch.autograd.grad(loss, [stack[n] for n in names])
        loss_sums += torch.where(active[step], task.detach().double(), 0.0)
        with torch.no_grad():
            gate = active[step].to(dtype)
            for n, g in zip(names, grads):
                p = stack[n]
                d_p = g + cfg.weight_decay * p if cfg.weight_decay else g
                if cfg.momentum:
                    buf = momentum.get(n)
                    # a client's first step starts its buffer at d_p, as torch's SGD does
                    momentum[n] = d_p.clone() if buf is None else cfg.momentum * buf + d_p
                    d_p = momentum[n]
                p.sub_(cfg.lr * d_p * gate.view(-1, *([1] * (p.dim() - 1))))
    sums = loss_sums.tolist()
    losses = [sums[i] / steps[i] if steps[i] else float("nan") for i in range(k)]
    return {n: s.detach() for n, s in stack.items()}, losses, steps
