"""RegMean (Jin et al. 2023, "Dataless knowledge fusion by merging weights") as a federated rule.

Each round the clients train like FedAvg; then each client runs its training data through the trained
model (eval mode, no gradient) and, with forward pre-hooks on every ``nn.Linear`` whose weight is
trainable, records the input Gram ``G_i = X_i^T X_i`` of that layer. The server merges every such weight
by the closed form ([`fedmerge.core.merge.gram_merge()`][fedmerge.core.merge.gram_merge])

    W* = (sum_i W_i G~_i) (sum_i G~_i)^+,   G~_i = alpha G_i + (1 - alpha) diag(G_i),

the minimiser of ``sum_i ||X_i W^T - X_i W_i^T||^2``. Biases and every other parameter or buffer are
averaged by sample count ``n_i`` (as FedAvg). The server state is exactly the model's state dict; the
Grams only travel in the update, under the key prefix ``regmean.gram/<module name>``.

Choices (and where they come from):

- ``gram="mean"`` (default, the official code): ``G_i = X_i^T X_i / rows_i``, the mean outer product
  over the rows fed to the layer (examples, times positions for sequence inputs). Every client then has
  model coefficient 1, so clients count equally regardless of data size. ``gram="sum"`` (fed-mammoth)
  sends the summed Gram, which implicitly weights clients by data size; coefficients stay 1.
- ``alpha`` (default 1.0 = no shrinkage, the official default) scales the off-diagonal entries; values
  below 1 regularise towards the diagonal (and make the system better conditioned).
- ``gram_samples`` caps the examples a client uses (a seeded random subset; default all).
- The solve uses a pseudo-inverse, so input directions no client's data spans get zero weight.
- A Linear module whose ``forward`` is never called (e.g. ``nn.MultiheadAttention.out_proj``) or
  whose Gram is missing from some update is averaged by ``n_i`` instead.

Two things to know before reading RegMean's figures (found in the LIVAR beta 0.2 study):

- On ``minilm_lora`` only the head is Gram-merged. The LoRA factors are parameters that the model
  applies to the shared frozen backbone with ``functional_call``, not ``nn.Linear`` modules of the
  model, so no hook sees their inputs and they are averaged by ``n_i`` (RegMean = FedIT adapters +
  a RegMean head; the update carries one 384 x 384 Gram).
- With ``alpha = 1`` the solve is unregularised least squares, and pooled sentence features are
  strongly correlated (one common direction; the summed Gram of about 1,050 pooled examples has
  eigenvalues from the largest down to 2.5e-4 of it, and below). Fitting every client's own logits
  exactly then takes large weights along rare input directions: after round 1 of the study (seed 1)
  the merged head has norm 10.5 where every client head and the FedAvg head have about 3. The next
  round's local SGD starts from that head, whose gradients into the adapters are correspondingly
  larger; at lr 0.2 the adapters move further (LoRA B norm 2.2 after round 3; FedAvg 1.05), the head
  norm ratchets up (14.5 after round 2; FedAvg 3.2), and the clients' pooled features collapse onto
  one direction (second Gram eigenvalue 0.6% of the first in round 3, 6% before), so the server's test
  accuracy falls to 15% in round 3 (0.44, 0.48, 0.15; FedAvg 0.42, 0.51, 0.61) although each round's
  merge, compared with the n_i-averaged head on the same client updates, is within a point of it or
  better (in round 3 both give 15%: the adapters, not the head merge, have failed). ``alpha < 1`` adds
  ``(1 - alpha) diag(G)``, a ridge as large as the common direction, and bounds the merged norm (5.5
  at alpha 0.9, 4.0 at 0.5 after round 1). This is the method's behaviour, not a numerical problem:
  float64 Grams and pseudo-inverse thresholds up to 1e-4 give the same accuracy. In that study, at lr
  0.2, alpha 0.5 is stable on all 3 seeds (last round 64, 62, 60%; alpha 1: 23, 15, 17%); alpha 0.9
  still drops in round 3 on seed 1 (48, 65, 47%); alpha 1 at lr 0.05 does not collapse (seed 1: 44,
  47, 50%). So ``alpha`` should be tuned together with the learning rate.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig, ClientContext, ClientDataLike
from fedmerge.core.merge import gram_merge
from fedmerge.core.types import ServerState, Update

from .base import StatisticsAlgorithm

GRAM = "regmean.gram/"


class RegMeanConfig(AlgorithmConfig):
    name: Literal["regmean"] = "regmean"
    gram: Literal["mean", "sum"] = Field(
        "mean",
        description="mean: X^T X / rows with coefficient 1 per client (official RegMean); "
        "sum: X^T X, implicitly weighting clients by data size (fed-mammoth)",
    )
    alpha: float = Field(
        1.0, gt=0, le=1, description="off-diagonal scaling of each Gram: alpha G + (1 - alpha) diag(G); 1 = none"
    )
    gram_samples: int | None = Field(
        None, ge=1, description="cap on the training examples a client uses for its Grams (seeded subset); None = all"
    )


def random_subset(x: Tensor, y: Tensor, cap: int | None, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Up to ``cap`` examples of (x, y), a random subset drawn from ``gen`` when there are more."""
    n = int(y.shape[0])
    if cap is None or n <= cap:
        return x, y
    idx = torch.randperm(n, generator=gen)[:cap].to(y.device)
    return x[idx], y[idx]


@torch.no_grad()
def linear_input_grams(
    model: nn.Module, x: Tensor, reduce: Literal["mean", "sum"] = "mean", batch_size: int = 1024
) -> dict[str, Tensor]:
    """``{module name: X^T X}`` (``/ rows`` for ``"mean"``) of the inputs of every ``nn.Linear`` with a
    trainable weight, over ``x`` in eval mode. Inputs ``(..., in)`` count each leading position as a row;
    a module called several times per forward accumulates all its inputs. Accumulated in float64,
    returned in the weight's dtype; modules never called are left out."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.weight.requires_grad}
    sums: dict[str, Tensor] = {}
    rows: dict[str, int] = {}

    def hook(name: str):
        def record(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            z = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = z.T @ z if name not in sums else sums[name] + z.T @ z
            rows[name] = rows.get(name, 0) + int(z.shape[0])

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    was_training = model.training
    model.eval()
    try:
        for i in range(0, int(x.shape[0]), batch_size):
            model(x[i : i + batch_size])
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    out = {}
    for name, m in linears.items():
        if name in sums:
            g = sums[name] / max(rows[name], 1) if reduce == "mean" else sums[name]
            out[name] = g.to(m.weight.dtype)
    return out


@ALGORITHMS.register(
    "regmean",
    config=RegMeanConfig,
    description="RegMean: Linear weights merged by clients' input Gram matrices, the rest averaged by sample count",
)
class RegMean(StatisticsAlgorithm):
    name = "regmean"
    stats_prefix = GRAM

    def client_statistics(self, ctx: ClientContext, data: ClientDataLike) -> dict[str, Tensor]:
        x, _ = random_subset(data.x_train, data.y_train, self.config.gram_samples, ctx.generator("regmean"))
        return linear_input_grams(ctx.model, x, self.config.gram)

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        # n_i-average everything (biases, other layers, buffers), then overwrite the Gram-merged weights
        grams, weights, merged = self.split(updates)
        for module in grams[0]:
            key = f"{module}.weight"
            if key in merged and all(module in g for g in grams):
                ws, gs = [w[key] for w in weights], [g[module] for g in grams]
                # coefficient 1 per client: "mean" Grams weigh clients equally, "sum" Grams by data size
                merged[key] = gram_merge(ws, gs, alpha=self.config.alpha)
        return ServerState(merged, dict(state.meta))
