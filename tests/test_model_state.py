"""The per-client fast paths give exactly the numbers of the ordinary calls: weight loads and copies
through the model's tensor table, the reused SGD optimiser, the loss summed once per call."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedmerge.core.model_state import copy_state, load_state, trainable_parameters
from fedmerge.core.training import LocalTraining, Step, batch_slices, fresh_sgd, local_sgd


def bn_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))


def randomised(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A state dict of ``model``'s keys with random values (integers for integer buffers)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=gen) if v.is_floating_point() else torch.randint(0, 9, v.shape, generator=gen)
        for k, v in model.state_dict().items()
    }


def test_load_and_copy_equal_the_ordinary_calls_buffers_included():
    fast, ref = bn_model(0), bn_model(0)
    for seed in (1, 2):  # twice: the second call uses the table built by the first
        weights = randomised(ref, seed)
        load_state(fast, weights)
        ref.load_state_dict(weights)
        for (k, a), (k2, b) in zip(copy_state(fast).items(), ref.state_dict().items(), strict=True):
            assert k == k2 and a.dtype == b.dtype and torch.equal(a, b), k
    copied = copy_state(fast)
    before = {k: v.clone() for k, v in copied.items()}
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(1.0)
    assert all(torch.equal(copied[k], before[k]) for k in copied), "a copy must not share storage with the model"
    assert not any(v.requires_grad for v in copied.values())


def test_bad_loads_give_the_ordinary_errors():
    model = bn_model(0)
    weights = randomised(model, 1)
    with pytest.raises(RuntimeError, match="Missing key"):
        load_state(model, {k: v for k, v in weights.items() if k != "4.bias"})
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_state(model, {**weights, "4.bias": torch.zeros(5)})


def test_a_replaced_parameter_is_still_found():
    model = bn_model(0)
    load_state(model, randomised(model, 1))  # builds the table
    model[4].bias = nn.Parameter(torch.zeros(4))
    weights = randomised(model, 2)
    load_state(model, weights)
    assert torch.equal(model[4].bias.detach(), weights["4.bias"])
    assert any(p is model[4].bias for p in trainable_parameters(model))


def reference_sgd(model: nn.Module, x, y, cfg: LocalTraining, gen: torch.Generator) -> float:
    """local_sgd written out: a new optimiser, the task loss accumulated in float64 step by step."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    total = torch.zeros((), dtype=torch.float64)
    steps = 0
    for _ in range(cfg.local_epochs):
        perm = torch.randperm(len(y), generator=gen)
        for sl in batch_slices(len(y), cfg.batch_size):
            idx = perm[sl]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.detach().double()
            steps += 1
    return float(total / steps)


def test_local_sgd_equals_a_fresh_optimiser_loop_bit_for_bit_on_consecutive_calls():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(37, 1, 6, 6, generator=gen), torch.randint(0, 4, (37,), generator=gen)
    cfg = LocalTraining(lr=0.1, momentum=0.9, weight_decay=0.01, batch_size=8, local_epochs=2)
    fast, ref = bn_model(0), bn_model(0)
    for call in range(3):  # the reused optimiser must not carry momentum from one call to the next
        a = local_sgd(fast, x, y, cfg, torch.Generator().manual_seed(call))
        b = reference_sgd(ref, x, y, cfg, torch.Generator().manual_seed(call))
        assert a.loss == b
        for (k, u), v in zip(fast.state_dict().items(), ref.state_dict().values(), strict=True):
            assert torch.equal(u, v), (call, k)


def test_nested_calls_get_their_own_optimiser_and_subsets_theirs():
    model = bn_model(0)
    cfg = LocalTraining(lr=0.1, momentum=0.5)
    with fresh_sgd(model, None, cfg) as outer:
        with fresh_sgd(model, None, cfg) as inner:
            assert inner is not outer
        head = list(model[4].parameters())
        with fresh_sgd(model, head, cfg) as sub:
            assert sub is not outer and sub.param_groups[0]["params"] == head
    with fresh_sgd(model, None, cfg.model_copy(update={"lr": 0.3})) as again:
        assert again in (outer, inner) and again.param_groups[0]["lr"] == 0.3 and not again.state


def test_a_hook_may_train_the_same_model_inside_a_step():
    """pFedMe's pattern: an inner local_sgd on the same model in before_forward; same as without reuse."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(20, 1, 6, 6, generator=gen), torch.randint(0, 4, (20,), generator=gen)
    cfg = LocalTraining(lr=0.05, momentum=0.9, batch_size=5)
    inner = cfg.model_copy(update={"local_epochs": 2, "batch_size": 3})

    def nested(step: Step) -> None:
        local_sgd(step.model, step.x, step.y, inner, torch.Generator().manual_seed(step.index))

    fast = bn_model(0)
    local_sgd(fast, x, y, cfg, torch.Generator().manual_seed(0), before_forward=nested)

    ref = bn_model(0)
    opt = torch.optim.SGD(ref.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    for i, sl in enumerate(batch_slices(20, 5)):
        idx = perm[sl]
        reference_sgd(ref, x[idx], y[idx], inner, torch.Generator().manual_seed(i))
        ref.train()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ref(x[idx]), y[idx]).backward()
        opt.step()
    for k, v in ref.state_dict().items():
        assert torch.equal(fast.state_dict()[k], v), k
