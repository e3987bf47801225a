"""The regime check of a reproduction: is Local data-starved, and is FedAvg hurt by heterogeneity?

A small-scale analogue of a paper's table says something only when it keeps the paper's regime, in
which neither Local nor FedAvg is near the ceiling. The ceiling here is a *central reference*: one
model trained centrally on the pooled training data of the clients that share a distribution (each
ground-truth group for cluster and domain partitions; all clients for label-skew partitions) and
evaluated on each client's own test split. Epochs (and the learning rate, from a grid) are chosen by
the pooled validation loss, as rounds and hyper-parameters are chosen for the federated methods.

A classifier's reference is scored by top-1; a model that generates text (a causal LM with LoRA) by
ROUGE-1 of its generated answers, through the runs' own evaluation code (``generative_metrics``), its
epochs chosen by the answer tokens' validation cross-entropy (the runs' ``val_nll``). It trains on the
device it is given (the study's config's ``device``), as the runs do.

    check = regime_check(reference_mean, local_mean, fedavg_mean)   # gaps in points, pass/fail

The bars (``LOCAL_GAP``, ``FEDAVG_GAP``) are those the reproductions are held to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch.nn import functional as F

from fedmerge.core.seeding import NO_ROUND, torch_generator
from fedmerge.core.training import LocalTraining, local_sgd, predict_logits
from fedmerge.data import FederatedDataset
from fedmerge.engines.evaluation import generative_metrics, is_generative
from fedmerge.models import build_model

LOCAL_GAP = 15.0  # points Local must sit below the central reference
FEDAVG_GAP = 10.0  # points FedAvg must sit below it

Scope = Literal["auto", "group", "all"]


@dataclass
class CentralReference:
    scope: str  # "group" or "all"
    epochs: list[int]  # chosen epoch per unit (group, or the single pooled unit)
    lrs: list[float]  # chosen learning rate per unit
    client_acc: list[float]  # test top-1 of each client under its unit's model
    # The same model told the client's label distribution: logits + log(training-label frequency).
    # A label-skewed client's prior is worth a lot; this is the ceiling a personalised model could
    # reach by knowing it, reported next to the plain reference that the bars use.
    # NaN for a generative model, which has no label distribution to be told.
    client_acc_prior: list[float]
    # What client_acc holds: top-1 ("acc") or ROUGE-1 of generated answers ("rouge1"); the regime check
    # compares it with the Local and FedAvg rows' client test mean of the same metric.
    metric: str = "acc"

    @property
    def mean(self) -> float:
        return sum(self.client_acc) / len(self.client_acc)

    @property
    def mean_prior(self) -> float:
        return sum(self.client_acc_prior) / len(self.client_acc_prior)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "mean": self.mean, "mean_prior": self.mean_prior}


def central_reference(
    data: FederatedDataset,
    model_cfg: Any,
    training: LocalTraining,
    seed: int,
    *,
    scope: Scope = "auto",
    max_epochs: int = 40,
    lrs: Sequence[float] | None = None,
    device: torch.device | str = "cpu",
) -> CentralReference:
    """Train one model per unit on its pooled training data, on ``device``; per-client test top-1 (ROUGE-1
    for a generative model) at the best-val epoch.

    ``lrs``: learning rates to try per unit (default: ``training.lr`` only); the (lr, epoch) with the
    lowest pooled validation loss is kept, so the reference is tuned as the federated rows are.
    """
    groups = [c.group for c in data.clients]
    if scope == "auto":
        scope = "group" if all(g is not None for g in groups) else "all"
    if scope == "group" and any(g is None for g in groups):
        raise ValueError("scope 'group' needs a partition with ground-truth groups (cluster, domain, natural)")
    units = sorted({g for g in groups}) if scope == "group" else [None]
    acc = [0.0] * data.num_clients
    acc_prior = [0.0] * data.num_clients
    chosen, chosen_lrs = [], []
    generative = False
    for unit in units:
        members = [c for c in data.clients if scope == "all" or c.group == unit]
        model = build_model(model_cfg, data.input_shape, data.num_classes, generator=_gen(seed, "init")).to(device)
        generative = is_generative(model)
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        x_tr, y_tr = _pooled(members, "train", device)
        x_va, y_va = _pooled(members, "val", device)
        best, best_epoch, best_lr, best_state = float("inf"), 0, training.lr, None
        for lr in lrs or [training.lr]:
            model.load_state_dict(init)
            cfg = training.model_copy(update={"lr": lr, "local_epochs": 1, "local_steps": None})
            for epoch in range(1, max_epochs + 1):
                local_sgd(model, x_tr, y_tr, cfg, _gen(seed, f"central/{unit}/{epoch}"))
                val = _val_loss(model, x_va, y_va) if len(y_va) else -epoch
                if val < best:
                    best, best_epoch, best_lr = val, epoch, lr
                    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(best_state)
        chosen.append(best_epoch)
        chosen_lrs.append(best_lr)
        for c in members:
            x_te, y_te = c.x_test.to(device), c.y_test.to(device)
            if generative:
                acc[c.cid] = generative_metrics(model, model, x_te, EVAL_BATCH)["rouge1"] if len(y_te) else NAN
                acc_prior[c.cid] = NAN
                continue
            logits = predict_logits(model, x_te)
            prior = torch.bincount(c.y_train, minlength=data.num_classes).to(logits) + 1e-3
            acc[c.cid] = _accuracy(logits, y_te)
            acc_prior[c.cid] = _accuracy(logits + prior.log(), y_te)
    return CentralReference(scope, chosen, chosen_lrs, acc, acc_prior, "rouge1" if generative else "acc")


NAN = float("nan")
EVAL_BATCH = 1024  # as the runs evaluate (a generative model caps it at its own eval_batch_size)


def _pooled(members: list[Any], split: str, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.cat([getattr(c, f"x_{split}") for c in members])
    y = torch.cat([getattr(c, f"y_{split}") for c in members])
    return x.to(device), y.to(device)


def _val_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The pooled validation loss the epoch is chosen by: cross-entropy of a classifier's logits, or a
    generative model's cross-entropy per answer token (its runs' ``val_nll``)."""
    if is_generative(model):
        model.eval()
        nll_sum, tokens = model.answer_nll(model, x, min(EVAL_BATCH, int(model.eval_batch_size)))
        return nll_sum / tokens if tokens else NAN
    return float(F.cross_entropy(predict_logits(model, x), y))


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(dim=1) == y).float().mean()) if len(y) else float("nan")


def _gen(seed: int, purpose: str) -> torch.Generator:
    return torch_generator(seed, NO_ROUND, 0, f"regime/{purpose}")


def regime_check(reference: float, local: float, fedavg: float) -> dict[str, Any]:
    """Gaps in points (inputs are accuracies in [0, 1]) and whether each bar is met."""
    local_gap, fedavg_gap = 100 * (reference - local), 100 * (reference - fedavg)
    return {
        "reference": reference,
        "local": local,
        "fedavg": fedavg,
        "local_gap": local_gap,
        "fedavg_gap": fedavg_gap,
        "local_starved": local_gap >= LOCAL_GAP,
        "fedavg_hurt": fedavg_gap >= FEDAVG_GAP,
        "passes": local_gap >= LOCAL_GAP and fedavg_gap >= FEDAVG_GAP,
    }
