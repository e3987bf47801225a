"""The one local-training routine every algorithm reuses, plus batched prediction.

Methods that differ only by a loss term (Ditto's personal loss, SuPerFed...) pass ``extra_loss``; a proximal pull
towards an anchor (FedProx, FedMerge, Ditto's personal model) is a [`Proximal`][fedmerge.core.training.Proximal];
methods that alter gradients before the step (SCAFFOLD) pass ``before_step``; methods that do
work on the minibatch before the forward pass (pFedMe's inner solve) pass ``before_forward``;
DP-SGD (per-sample clipping and Gaussian noise, `privacy`) is ``private``.
Every hook receives the [`Step`][fedmerge.core.training.Step] in progress: the model, the step's index, the minibatch
(x, y) and, once computed, the forward's output. No algorithm writes its own epoch/batch loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import SGD

from .model_state import set_train_mode, trainable_parameters
from .privacy import PrivateGradients, sample_rate
from .pull_kernel import add_pull, pull_kernel


class LocalTraining(BaseModel):
    """Local optimisation hyper-parameters (embedded in algorithm configs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(0.05, gt=0)
    local_epochs: int = Field(1, ge=1)
    local_steps: int | None = Field(None, ge=1, description="if set, a fixed number of minibatch steps")
    batch_size: int = Field(32, ge=1)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    gap_samples: int = Field(
        0,
        ge=0,
        description="measure the local-global gap (training loss of the received vs. the trained model) on up to "
        "this many training samples per client: two extra forward passes per client; 0 = off",
    )


@dataclass
class TrainStats:
    loss: float  # mean training loss over the steps taken (task loss, without extra terms)
    steps: int
    samples: int


@dataclass
class Step:
    """One step of [`local_sgd()`][fedmerge.core.training.local_sgd], as its hooks see it."""

    model: nn.Module
    index: int  # 0-based position of the step in this local_sgd call
    x: torch.Tensor  # the minibatch
    y: torch.Tensor
    idx: torch.Tensor  # the minibatch's rows in the (x, y) given to local_sgd
    logits: torch.Tensor | None = None  # the forward pass's output, set before ``extra_loss`` runs


ExtraLoss = Callable[[Step], torch.Tensor]
StepHook = Callable[[Step], None]
BatchLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# A model that is not a classifier owns its loss: ``model.task_loss(output, x, y)`` (e.g. a causal LM's
# next-token cross-entropy on the answer tokens, whose targets are in x, not y).
ModelLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Proximal:
    """The term ``(mu / 2) * sum_k ||w_k - anchor_k||^2`` of a local loss: FedProx's and FedMerge's pull towards
    the received model, Ditto's of its personal model towards the global one. ``params``: the tensors ``w``
    by name (default: the trained model's parameters that require a gradient); ``anchor`` holds one tensor
    per name.

    Its gradient ``mu (w - anchor)`` is added to the parameters' gradients after the backward pass instead of
    going through autograd: at batch 10 that graph (a difference, a square, a sum per tensor) cost two thirds
    of a step of the default CNN more; three in-place passes cost an eighth. The floats are autograd's: it forms
    ``float(mu / 2) * (2 (w - anchor))`` in the parameter's dtype, one rounding of the same product as
    ``2 float(mu / 2) * (w - anchor)``, and sums it with the task loss's gradient in one addition. On the CPU
    the three roundings happen in one pass where numba is installed
    ([`pull_kernel`][fedmerge.core.pull_kernel]: 1.1 ms against 2.1 ms a step of the default CNN). The term's
    value is not computed: no method logs it (the training loss is the task loss).
    """

    def __init__(self, mu: float, anchor: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor] | None = None):
        self.mu = mu
        self.anchor = anchor
        self.params = params
        self._scratch: dict[str, torch.Tensor] = {}  # one buffer per tensor, reused across steps
        self._coeff: dict[torch.dtype, float] = {}

    @torch.no_grad()
    def add_gradient(self, model: nn.Module) -> None:
        params = self.params if self.params is not None else dict(model.named_parameters())
        for name, p in params.items():
            if not p.requires_grad:
                continue
            coeff = self._coeff.get(p.dtype)
            if coeff is None:  # autograd's rounding of mu / 2, doubled (exact)
                coeff = self._coeff[p.dtype] = 2 * torch.tensor(0.5 * self.mu, dtype=p.dtype).item()
            anchor = self.anchor[name]
            kernel = pull_kernel(p.grad, p, anchor) if p.grad is not None else None
            if kernel is not None:  # one pass on the CPU, the same floats
                add_pull(kernel, p.grad, p, anchor, coeff)
                continue
            pull = self._scratch.get(name)
            if pull is None or pull.shape != p.shape or pull.dtype != p.dtype or pull.device != p.device:
                pull = self._scratch[name] = torch.empty_like(p, memory_format=torch.contiguous_format)
            torch.sub(p, anchor, out=pull)
            pull.mul_(coeff)
            if p.grad is None:
                p.grad = pull.clone()
            else:
                p.grad.add_(pull)


def batch_slices(n: int, batch_size: int) -> list[slice]:
    """Contiguous batch slices over a permutation; a trailing batch of 1 is merged into the
    previous one (BatchNorm cannot train on a single sample). A client with one training sample
    still has a batch of 1: see [`running_statistics()`][fedmerge.core.training.running_statistics]."""
    bounds = list(range(0, n, batch_size)) + [n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        bounds.pop(-2)
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def planned_steps(n: int, cfg: LocalTraining) -> int:
    """Local steps of one call of [`local_sgd()`][fedmerge.core.training.local_sgd] on ``n`` samples: ``local_steps``,
    or ``local_epochs``
    passes of [`batch_slices()`][fedmerge.core.training.batch_slices]' batches (DP-SGD's Poisson batches are as
    many)."""
    if n == 0:
        return 0
    return cfg.local_steps if cfg.local_steps is not None else cfg.local_epochs * len(batch_slices(n, cfg.batch_size))


def iterate_minibatches(
    n: int,
    batch_size: int,
    generator: torch.Generator,
    epochs: int,
    max_steps: int | None,
    device: torch.device | None = None,
) -> Iterable[torch.Tensor]:
    """Index batches: a fresh permutation each epoch, stopping after ``max_steps`` if given. With
    ``device``, each epoch's permutation is moved there once (not one host copy per batch)."""
    steps = 0
    while True:
        perm = torch.randperm(n, generator=generator)
        if device is not None and device != perm.device:
            perm = perm.to(device)
        for sl in batch_slices(n, batch_size):
            yield perm[sl]
            steps += 1
            if max_steps is not None and steps >= max_steps:
                return
        epochs -= 1
        if max_steps is None and epochs <= 0:
            return


def local_sgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: LocalTraining,
    generator: torch.Generator,
    *,
    params: Iterable[nn.Parameter] | None = None,
    extra_loss: ExtraLoss | None = None,
    proximal: Proximal | None = None,
    before_forward: StepHook | None = None,
    before_step: StepHook | None = None,
    after_step: StepHook | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    loss_fn: BatchLoss | None = None,
    private: PrivateGradients | None = None,
) -> TrainStats:
    """Train ``model`` in place with minibatch SGD on (x, y).

    ``params`` restricts which parameters are optimised (others still get no update). Each call
    starts from a fresh SGD optimiser (no momentum carried over), as in the reference
    implementations, unless one is given (for methods that keep optimiser state across rounds in
    their ClientState); the fresh one is the model's reused optimiser with its state cleared. ``forward``
    replaces ``model(x)`` for methods whose prediction is not a plain call of the model (e.g. a
    forward through interpolated weights with ``torch.func.functional_call``); ``params`` must then
    name the tensors it trains. ``loss_fn(logits, y, idx)`` replaces the mean cross-entropy as the
    task loss; ``idx`` are the batch's sample indices into (x, y), for per-sample weights (FedEM).
    Without it the task loss is the model's own ``task_loss(output, x, y)`` when it has one (a model
    that is not a classifier, ``causal_lm_lora``), else the mean cross-entropy.

    Hooks, each called with the [`Step`][fedmerge.core.training.Step] in progress, in this order:
    ``before_forward`` (the batch is drawn, nothing computed yet), ``extra_loss`` (added to the task loss;
    ``step.logits`` is set), ``before_step`` (gradients are ready, ``proximal``'s included: it is added after
    the backward pass) and ``after_step`` (after the optimiser step, gradients still in place: LIVAR's
    path-integral importance reads the step's change there).

    ``private``: DP-SGD. The gradient of the task loss for the model's parameters the optimiser trains is
    `PrivateGradients.gradients()`' (per-sample clipped, noised); ``extra_loss``'s gradient is added
    to it as it is (it must not read the training data through those parameters), and ``proximal``'s after
    it. Not with ``forward``, ``loss_fn``, ``before_forward`` or a model with its own ``task_loss``, whose
    per-sample gradients this routine cannot form.
    """
    own_loss = hasattr(model, "task_loss")  # a model that scores itself (a causal LM)
    if private is not None and (forward is not None or loss_fn is not None or before_forward is not None or own_loss):
        raise ValueError("DP-SGD (private) trains through model(x) with the cross-entropy loss only")
    set_train_mode(model)
    n = int(y.shape[0])
    if n == 0:
        return TrainStats(loss=float("nan"), steps=0, samples=0)
    if optimizer is not None:
        return _train(model, x, y, cfg, generator, optimizer, extra_loss, proximal, before_forward, before_step,
                      after_step, forward, loss_fn, private)  # fmt: skip
    with fresh_sgd(model, params, cfg) as sgd:
        return _train(model, x, y, cfg, generator, sgd, extra_loss, proximal, before_forward, before_step,
                      after_step, forward, loss_fn, private)  # fmt: skip


def _train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: LocalTraining,
    generator: torch.Generator,
    optimizer: torch.optim.Optimizer,
    extra_loss: ExtraLoss | None,
    proximal: Proximal | None,
    before_forward: StepHook | None,
    before_step: StepHook | None,
    after_step: StepHook | None,
    forward: Callable[[torch.Tensor], torch.Tensor] | None,
    loss_fn: BatchLoss | None,
    private: PrivateGradients | None = None,
) -> TrainStats:
    n = int(y.shape[0])
    model_loss: ModelLoss | None = getattr(model, "task_loss", None)
    if private is not None:  # the model's parameters this optimiser trains (Ditto's also trains a second model)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        privatised = [(k, p) for k, p in model.named_parameters() if id(p) in held and p.requires_grad]
    losses: list[torch.Tensor] = []  # summed once at the end: no per-step conversion (nor device sync)
    steps = samples = 0
    if private is not None:  # Poisson batches from the client's secret, as the accountant assumes
        batches: Iterable[torch.Tensor] = private.batches(n, cfg.batch_size, planned_steps(n, cfg), x.device)
        expected_batch = sample_rate(n, cfg.batch_size) * n
    else:
        batches = iterate_minibatches(n, cfg.batch_size, generator, cfg.local_epochs, cfg.local_steps, x.device)
    for idx in batches:
        step = Step(model, steps, x[idx], y[idx], idx)
        if before_forward is not None:
            before_forward(step)
        optimizer.zero_grad(set_to_none=True)
        if private is not None:
            step.logits, task_loss = private.gradients(model, privatised, step.x, step.y, expected_batch)
            extra = extra_loss(step) if extra_loss is not None else None
            if extra is not None and extra.requires_grad:
                extra.backward()  # accumulates onto the private gradients
        else:
            with running_statistics(model) if idx.shape[0] == 1 else nullcontext():
                step.logits = model(step.x) if forward is None else forward(step.x)
            if loss_fn is not None:
                task_loss = loss_fn(step.logits, step.y, idx)
            elif model_loss is not None:
                task_loss = model_loss(step.logits, step.x, step.y)
            else:
                task_loss = F.cross_entropy(step.logits, step.y)
            loss = task_loss if extra_loss is None else task_loss + extra_loss(step)
            loss.backward()
        if proximal is not None:
            proximal.add_gradient(model)
        if before_step is not None:
            before_step(step)
        optimizer.step()
        if after_step is not None:
            after_step(step)
        losses.append(task_loss.detach())
        steps += 1
        samples += int(step.y.shape[0])
    total = 0.0  # float64, added in step order: the same sum as accumulating step by step
    for value in torch.stack(losses).double().cpu().tolist():
        total += value
    return TrainStats(loss=total / max(steps, 1), steps=steps, samples=samples)


@contextmanager
def running_statistics(model: nn.Module) -> Iterator[None]:
    """BatchNorm layers in eval mode for one forward pass: a batch of one sample (a client that
    holds a single training sample, or ``batch_size=1``) has no batch statistics, so they normalise
    with their running statistics and leave them unchanged, instead of failing. Their weights still
    train."""
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training]
    for m in norms:
        m.train(False)
    try:
        yield
    finally:
        for m in norms:
            m.train(True)


@contextmanager
def fresh_sgd(model: nn.Module, params: Iterable[nn.Parameter] | None, cfg: LocalTraining) -> Iterator[SGD]:
    """An SGD optimiser over the trainable ``params`` (default: the model's), as if new: the model's
    reused one with its state (momentum buffers) cleared, or a new one when that is in use (a nested
    call: pFedMe's inner solve) or covers other parameters. Constructing an optimiser per client is
    measurable per-client overhead for small models."""
    pool = model.__dict__.setdefault("_fedmerge_sgd", [])  # idle optimisers for this model
    candidates = trainable_parameters(model) if params is None else list(params)
    trainable = [p for p in candidates if p.requires_grad]
    sgd = next((o for o in pool if _same(o.param_groups[0]["params"], trainable)), None)
    if sgd is None:
        sgd = SGD(trainable, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
        pool.remove(sgd)
        sgd.state.clear()
        sgd.param_groups[0].update(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    try:
        yield sgd
    finally:
        sgd.state.clear()  # frees the momentum buffers
        pool.insert(0, sgd)
        del pool[_POOL:]


_POOL = 4  # optimisers kept per model (a method may train different parameter subsets in turn)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(u is v for u, v in zip(a, b))


@torch.no_grad()
def predict_logits(model: nn.Module, x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
    set_train_mode(model, False)
    if x.shape[0] == 0:
        return torch.empty(0)
    return torch.cat([model(x[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)])


def mean_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> float:
    """Cross-entropy of ``model`` on (x, y) in eval mode (e.g. the loss of a received model). For a model
    with its own ``task_loss``: that loss per batch, averaged over the batches weighted by their rows."""
    model_loss = getattr(model, "task_loss", None)
    if model_loss is not None:
        if not y.numel():
            return float("nan")
        set_train_mode(model, False)
        with torch.no_grad():
            total = sum(
                float(model_loss(model(x[i : i + batch_size]), x[i : i + batch_size], y[i : i + batch_size]))
                * int(y[i : i + batch_size].shape[0])
                for i in range(0, int(y.shape[0]), batch_size)
            )
        return total / int(y.shape[0])
    logits = predict_logits(model, x, batch_size)
    return float(F.cross_entropy(logits, y)) if y.numel() else float("nan")
