"""The regime check of a reproduction: is Local data-starved, and is FedAvg hurt by heterogeneity?

A small-scale analogue of a paper's table says something only when it keeps the paper's regime, in
which neither Local nor FedAvg is near the ceiling. The ceiling here is a *central reference*: one
model trained centrally on the pooled training data of the clients that share a distribution (each
ground-truth group for cluster and domain partitions; all clients for label-skew partitions) and
evaluated on each client's own split. Epochs (and the learning rate, from a grid) are chosen by
the pooled validation loss, as rounds and hyper-parameters are chosen for the federated methods.

The check reads validation data only (``VAL``): the reference's and the tuned Local and FedAvg rows'
mean client validation score, at the epoch and round chosen on validation loss; the test split stays
unread until the table. References computed before the reference kept validation scores
(``client_val_acc``) can only be checked on the test split (``TEST``), as the published reports were;
``reference_split`` says which split a stored reference allows, and the report states it.

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
MIN_KEPT_SEEDS = 3  # seeds that must keep the regime before a study's verdicts count as evidence

Scope = Literal["auto", "group", "all"]
VAL, TEST = "val", "test"  # the split a regime check reads


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
    # The same two on each client's validation split: what the regime check reads.
    client_val_acc: list[float]
    client_val_acc_prior: list[float]
    # What client_acc and client_val_acc hold: top-1 ("acc") or ROUGE-1 of generated answers ("rouge1");
    # the regime check compares them with the Local and FedAvg rows' client mean of the same metric.
    metric: str = "acc"

    @property
    def mean(self) -> float:
        return sum(self.client_acc) / len(self.client_acc)

    @property
    def mean_prior(self) -> float:
        return sum(self.client_acc_prior) / len(self.client_acc_prior)

    @property
    def val_mean(self) -> float:
        return _mean_over_clients_with_data(self.client_val_acc)

    @property
    def val_mean_prior(self) -> float:
        return _mean_over_clients_with_data(self.client_val_acc_prior)

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "mean": self.mean,
            "mean_prior": self.mean_prior,
            "val_mean": self.val_mean,
            "val_mean_prior": self.val_mean_prior,
        }


def _mean_over_clients_with_data(values: list[float]) -> float:
    """The mean over the clients that have samples (NaN for the others), as the run summaries take it."""
    have = [v for v in values if v == v]
    return sum(have) / len(have) if have else float("nan")


def reference_split(reference: dict[str, Any]) -> str:
    """The split a stored reference (``CentralReference.to_json``) lets the regime check read: VAL, or
    TEST for a reference computed before validation accuracies were kept."""
    return VAL if "val_mean" in reference else TEST


def reference_means(reference: dict[str, Any], split: str) -> tuple[float, float]:
    """The stored reference's mean client accuracy on ``split``, plain and with the client prior."""
    if split == VAL:
        return reference["val_mean"], reference["val_mean_prior"]
    return reference["mean"], reference.get("mean_prior", float("nan"))  # the earliest references kept no prior


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
    val_acc = [0.0] * data.num_clients
    val_acc_prior = [0.0] * data.num_clients
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
            if generative:
                acc[c.cid], val_acc[c.cid] = (_rouge1(model, *_on(c, split, device)) for split in ("test", "val"))
                acc_prior[c.cid] = val_acc_prior[c.cid] = NAN
                continue
            counts = torch.bincount(c.y_train, minlength=data.num_classes).to(device)
            acc[c.cid], acc_prior[c.cid] = _accuracies(model, *_on(c, "test", device), counts)
            val_acc[c.cid], val_acc_prior[c.cid] = _accuracies(model, *_on(c, "val", device), counts)
    metric = "rouge1" if generative else "acc"
    return CentralReference(scope, chosen, chosen_lrs, acc, acc_prior, val_acc, val_acc_prior, metric)


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


def _on(client: Any, split: str, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    return getattr(client, f"x_{split}").to(device), getattr(client, f"y_{split}").to(device)


def _rouge1(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return generative_metrics(model, model, x, EVAL_BATCH)["rouge1"] if len(y) else NAN


def _accuracies(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, label_counts: torch.Tensor
) -> tuple[float, float]:
    """Top-1 plain and with the log of the client's training-label frequencies added."""
    logits = predict_logits(model, x)
    prior = label_counts.to(logits.dtype) + 1e-3
    return _accuracy(logits, y), _accuracy(logits + prior.log(), y)


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
