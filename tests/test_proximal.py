"""`Proximal` adds the gradient of (mu/2) ||w - anchor||^2 after the backward pass: the same floats, bit for bit,
as building the term through autograd (the way FedProx, FedMerge and Ditto computed it before issue 56), both
through numba's one-pass kernel and through the three PyTorch ops it falls back to."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedmerge.core import pull_kernel
from fedmerge.core.training import LocalTraining, Proximal, local_sgd

HAS_NUMBA = pull_kernel._compiled() is not None


@pytest.fixture(params=["kernel", "torch-ops"])
def both_paths(request, monkeypatch):
    """A test on both paths; the kernel's only where numba is installed (CI installs it)."""
    if request.param == "kernel" and not HAS_NUMBA:
        pytest.skip("numba is not installed")
    if request.param == "torch-ops":
        monkeypatch.setattr(pull_kernel, "_compiled", lambda: None)
    calls = []
    if request.param == "kernel":  # count the kernel's calls: a test on this path must go through it
        real = pull_kernel.add_pull
        monkeypatch.setattr("fedmerge.core.training.add_pull", lambda *a: calls.append(1) or real(*a))
    yield request.param
    if request.param == "kernel":
        assert calls, "the kernel path never ran the kernel"


def autograd_term(mu: float, params: dict[str, torch.Tensor], anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """The term as the methods wrote it before."""
    return 0.5 * mu * torch.stack([((p - anchor[k]) ** 2).sum() for k, p in params.items()]).sum()


def model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3)).to(dtype)


@pytest.mark.usefixtures("both_paths")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_gradient_is_autograds_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 7, generator=gen, dtype=dtype), torch.randint(0, 3, (5,), generator=gen)
    for trial in range(40):  # mu values whose halves round differently in float32
        mu = float(torch.rand((), generator=gen, dtype=torch.float64)) * 10.0 ** (trial % 5 - 3)
        net = model(dtype)
        anchor = {
            k: p.detach() + 0.1 * torch.randn(p.shape, generator=gen, dtype=dtype) for k, p in net.named_parameters()
        }
        params = dict(net.named_parameters())

        (F.cross_entropy(net(x), y) + autograd_term(mu, params, anchor)).backward()
        want = {k: p.grad.clone() for k, p in params.items()}
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        Proximal(mu, anchor).add_gradient(net)
        for k, p in params.items():
            assert torch.equal(p.grad, want[k]), f"mu={mu!r}, {k}: the gradient differs from autograd's"


def test_a_parameter_without_a_task_gradient_gets_the_pull_alone():  # the PyTorch ops on either path
    net = model(torch.float32)
    anchor = {k: torch.zeros_like(p) for k, p in net.named_parameters()}
    params = dict(net.named_parameters())
    autograd_term(0.3, params, anchor).backward()
    want = {k: p.grad.clone() for k, p in params.items()}
    net.zero_grad(set_to_none=True)
    Proximal(0.3, anchor).add_gradient(net)
    assert all(torch.equal(p.grad, want[k]) for k, p in params.items())


def test_frozen_parameters_and_a_second_model_by_name():
    net = model(torch.float32)
    net[0].weight.requires_grad_(False)
    anchor = {k: torch.ones_like(p) for k, p in net.named_parameters()}
    Proximal(1.0, anchor).add_gradient(net)
    assert net[0].weight.grad is None  # frozen: no pull
    assert torch.equal(net[2].bias.grad, net[2].bias.detach() - 1)

    # a second model's tensors, named, pulled towards the first (Ditto's personal model)
    v = {k: p.detach().clone().requires_grad_(True) for k, p in net.named_parameters()}
    Proximal(2.0, {k: torch.zeros_like(t) for k, t in v.items()}, v).add_gradient(net)
    assert all(torch.equal(t.grad, 2 * t.detach()) for t in v.values())


@pytest.mark.usefixtures("both_paths")
def test_local_sgd_trains_the_same_weights_as_with_the_term_in_the_loss():
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(40, 7, generator=gen), torch.randint(0, 3, (40,), generator=gen)
    cfg = LocalTraining(lr=0.1, batch_size=8, local_epochs=2)
    anchor = {k: p.detach().clone() + 0.5 for k, p in model(torch.float32).named_parameters()}

    before, after = model(torch.float32), model(torch.float32)
    local_sgd(before, x, y, cfg, torch.Generator().manual_seed(3),
              extra_loss=lambda step: autograd_term(0.07, dict(step.model.named_parameters()), anchor))  # fmt: skip
    local_sgd(after, x, y, cfg, torch.Generator().manual_seed(3), proximal=Proximal(0.07, anchor))
    moved = {k: p for k, p in model(torch.float32).named_parameters()}
    for (k, a), b in zip(before.named_parameters(), after.parameters()):
        assert not torch.equal(a, moved[k])
        assert torch.equal(a, b), f"{k}: local_sgd with Proximal trained other weights"


def test_the_kernel_takes_cpu_contiguous_float_tensors_only():
    if not HAS_NUMBA:
        pytest.skip("numba is not installed")
    w = torch.ones(4, 3)
    assert pull_kernel.pull_kernel(w, w, w) is not None
    assert pull_kernel.pull_kernel(w.half(), w.half(), w.half()) is None
    assert pull_kernel.pull_kernel(w, w.t(), w.t()) is None  # not contiguous
    assert pull_kernel.pull_kernel(w, w.double(), w) is None
    g, a = torch.zeros(4, 3), torch.full((4, 3), 3.0)
    pull_kernel.add_pull(pull_kernel.pull_kernel(g, w, a), g, w, a, 0.5)
    assert torch.equal(g, torch.full((4, 3), -1.0))


def test_without_a_writable_cache_the_kernel_compiles_in_memory(monkeypatch):
    if not HAS_NUMBA:
        pytest.skip("numba is not installed")
    import numba

    real = numba.njit

    def no_cache(*args, cache=False, **kwargs):
        if cache:  # what numba raises where neither the package's nor the user's cache folder is writable
            raise RuntimeError("cannot cache function '_pull_loop': no locator available")
        return real(*args, **kwargs)

    monkeypatch.setattr(numba, "njit", no_cache)
    pull_kernel._compiled.cache_clear()
    try:
        w, g = torch.ones(3), torch.zeros(3)
        kernel = pull_kernel.pull_kernel(g, w, w * 2)
        pull_kernel.add_pull(kernel, g, w, w * 2, 4.0)
        assert torch.equal(g, torch.full((3,), -4.0))
    finally:
        pull_kernel._compiled.cache_clear()


def test_the_environment_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv(pull_kernel.DISABLE_ENV, "0")
    pull_kernel._compiled.cache_clear()
    try:
        assert pull_kernel.pull_kernel(torch.ones(3), torch.ones(3), torch.ones(3)) is None
    finally:
        pull_kernel._compiled.cache_clear()
