"""Client and server math of SCAFFOLD, pFedMe, Ditto, APFL and SuPerFed against values computed by hand
(closed forms on a quadratic, gradients written out) or by autograd, on problems of a few numbers.

Each client update is run through the method's real ``client_update`` with float64 models and one
batch holding every sample (the batch order then changes only the rounding of a mean).
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fedmerge.algorithms import superfed as superfed_module
from fedmerge.algorithms.apfl import APFL, APFLConfig
from fedmerge.algorithms.ditto import Ditto, DittoConfig
from fedmerge.algorithms.pfedme import PFedMe, PFedMeConfig
from fedmerge.algorithms.scaffold import CONTROL, Scaffold, ScaffoldConfig
from fedmerge.algorithms.superfed import SuPerFedMM, SuPerFedMMConfig
from fedmerge.core.algorithm import ClientContext
from fedmerge.core.types import ClientState, Payload, ServerState, Update

F64 = torch.float64


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=1e-10, atol=1e-12)


class Quadratic(nn.Module):
    """A "classifier" whose mean cross-entropy has the gradient of a chosen quadratic.

    Every label is 0 and the logits are (0, 2 (q_s - q_s.detach())): their value is (0, 0), so the
    cross-entropy is log 2 and its derivative with respect to q_s is 2 * softmax_1 = 1. The mean over
    a batch therefore has the gradient of mean_s q_s(w), q_s(w) = 1/2 sum_j a_j (w_j - x_sj)^2:
    grad = a * (w - mean_s x_s), whatever the batch order.
    """

    def __init__(self, a: torch.Tensor, w: torch.Tensor) -> None:
        super().__init__()
        self.a = a
        self.w = nn.Parameter(w.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = 0.5 * (self.a * (self.w - x) ** 2).sum(1)
        u = 2 * (q - q.detach())
        return torch.stack([torch.zeros_like(u), u], 1)


def client_data(x: torch.Tensor, y: torch.Tensor | None = None) -> SimpleNamespace:
    y = torch.zeros(x.shape[0], dtype=torch.long) if y is None else y
    return SimpleNamespace(x_train=x, y_train=y, x_val=x[:0], y_val=y[:0])


def context(model: nn.Module) -> ClientContext:
    return ClientContext(model, torch.device("cpu"), seed=0, round=1, cid=0)


def linear_factory(gen: torch.Generator) -> nn.Linear:
    model = nn.Linear(3, 4).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))
    return model


def random_linear_state(seed: int) -> dict[str, torch.Tensor]:
    return dict(linear_factory(torch.Generator().manual_seed(seed)).state_dict())


# --- SCAFFOLD -------------------------------------------------------------------------------
A = t(1.0, 2.0, 0.5)  # curvatures of the client's quadratic
X_CLIENT = t(0.0, 1.0, 2.0, 1.0, -1.0, 0.0, 2.0, 0.0, 1.0, 1.0, 3.0, 1.0).reshape(4, 3)


def test_scaffold_client_control_variate_is_option_ii():
    lr, steps = 0.1, 3
    x0, c, c_i = t(1.0, -2.0, 0.5), t(0.1, 0.2, -0.3), t(0.05, -0.1, 0.2)
    cfg = ScaffoldConfig(lr=lr, local_steps=steps, batch_size=8)
    alg = Scaffold(cfg, lambda gen: Quadratic(A, torch.zeros(3, dtype=F64)), num_clients=5, seed=0)
    ctx = context(Quadratic(A, torch.zeros(3, dtype=F64)))
    payload = Payload({"w": x0, CONTROL + "w": c}, {"round": 1})
    update, state = alg.client_update(payload, client_data(X_CLIENT), ClientState({"w": c_i}), ctx)

    # y_{k+1} = y_k - lr (a (y_k - m) + c - c_i) contracts to y* = m - (c - c_i) / a by (1 - lr a) per step
    m = X_CLIENT.mean(0)
    y_star = m - (c - c_i) / A
    path = [y_star + (1 - lr * A) ** k * (x0 - y_star) for k in range(steps + 1)]
    new_c_i = c_i - c + (x0 - path[-1]) / (steps * lr)  # option II
    close(update.tensors["w"], path[-1])
    close(state.tensors["w"], new_c_i)
    close(update.tensors[CONTROL + "w"], new_c_i - c_i)
    assert update.meta["steps"] == steps
    # option II's control variate is the mean of the uncorrected gradients along the local path
    close(new_c_i, torch.stack([A * (y - m) for y in path[:-1]]).mean(0))


@pytest.mark.parametrize(
    ("weighting", "global_lr", "expected_x"),
    [("samples", 1.0, t(4.0, -1.0)), ("uniform", 1.0, t(3.0, 0.0)), ("uniform", 0.5, t(2.5, 1.0))],
)
def test_scaffold_server_step_under_partial_participation(weighting, global_lr, expected_x):
    cfg = ScaffoldConfig(weighting=weighting, global_lr=global_lr)
    alg = Scaffold(cfg, lambda gen: Quadratic(A[:2], torch.zeros(2, dtype=F64)), num_clients=5, seed=0)
    x = t(2.0, 2.0) if global_lr != 1.0 else t(0.0, 0.0)
    state = ServerState({"w": x, CONTROL + "w": t(0.5, -1.0)})
    updates = {  # 2 of the N = 5 clients took part
        1: Update({"w": t(1.0, 2.0), CONTROL + "w": t(1.0, 2.0)}, {"num_examples": 10}),
        3: Update({"w": t(5.0, -2.0), CONTROL + "w": t(4.0, -3.0)}, {"num_examples": 30}),
    }
    new = alg.aggregate(state, 1, updates).tensors
    # samples: (10 (1, 2) + 30 (5, -2)) / 40 = (4, -1); uniform: (3, 0); eta_g 0.5 from (2, 2): (2.5, 1)
    close(new["w"], expected_x)
    # c += |S| / N * mean(dc) = (dc_1 + dc_3) / 5 = (5, -1) / 5, not / |S|
    close(new[CONTROL + "w"], t(1.5, -1.2))


# --- pFedMe ---------------------------------------------------------------------------------
def test_pfedme_inner_and_outer_steps_follow_the_hand_computed_sequence():
    a, w_g = [1.0, 3.0], [1.0, -1.0]
    x = t(0.0, 1.0, 2.0, -1.0, 1.0, 3.0).reshape(3, 2)
    lam, plr, inner, eta, outer = 2.0, 0.1, 3, 0.05, 4
    cfg = PFedMeConfig(lam=lam, personal_lr=plr, inner_steps=inner, lr=eta, local_steps=outer, batch_size=8)
    alg = PFedMe(cfg, lambda gen: Quadratic(t(*a), torch.zeros(2, dtype=F64)), num_clients=2, seed=0)
    model = Quadratic(t(*a), torch.zeros(2, dtype=F64))
    payload = Payload({"w": t(*w_g)}, {"round": 1})
    update, state = alg.client_update(payload, client_data(x), ClientState(), context(model))

    m = x.mean(0).tolist()
    theta, w = list(w_g), list(w_g)  # both start at the received global model
    for _ in range(outer):
        for _ in range(inner):  # theta -= plr * (grad f(theta) + lam (theta - w_loc))
            theta = [th - plr * (aj * (th - mj) + lam * (th - wj)) for th, aj, mj, wj in zip(theta, a, m, w)]
        w = [wj - eta * lam * (wj - th) for wj, th in zip(w, theta)]  # w_loc -= eta lam (w_loc - theta)
    close(update.tensors["w"], t(*w))  # w_loc travels
    close(state.tensors["w"], t(*theta))  # theta is the personal model
    assert update.meta["steps"] == outer


# --- Ditto ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prox_step", ["explicit", "implicit"])
def test_ditto_personal_and_global_steps_follow_the_hand_computed_sequence(prox_step):
    a, w_g, v0 = [1.0, 3.0], [1.0, -1.0], [0.5, 2.0]
    x = t(0.0, 1.0, 2.0, -1.0, 1.0, 3.0).reshape(3, 2)
    lam, lr, plr, steps = 0.8, 0.1, 0.2, 4
    cfg = DittoConfig(lam=lam, lr=lr, personal_lr=plr, local_steps=steps, batch_size=8, prox_step=prox_step)
    alg = Ditto(cfg, lambda gen: Quadratic(t(*a), torch.zeros(2, dtype=F64)), num_clients=2, seed=0)
    model = Quadratic(t(*a), torch.zeros(2, dtype=F64))
    payload = Payload({"w": t(*w_g)}, {"round": 1})
    update, state = alg.client_update(payload, client_data(x), ClientState({"w": t(*v0)}), context(model))

    m = x.mean(0).tolist()
    eta = plr if prox_step == "explicit" else plr / (1 + plr * lam)  # backward Euler: the same step, eta shrunk
    w, v = list(w_g), list(v0)
    for _ in range(steps):
        w = [wj - lr * aj * (wj - mj) for wj, aj, mj in zip(w, a, m)]  # w: plain SGD on f (FedAvg's step)
        # v -= eta (grad f(v) + lam (v - w^t)), the anchor w^t = the received global model
        v = [vj - eta * (aj * (vj - mj) + lam * (vj - gj)) for vj, aj, mj, gj in zip(v, a, m, w_g)]
    close(update.tensors["w"], t(*w))  # w travels
    close(state.tensors["w"], t(*v))  # v stays on the client
    assert update.meta["steps"] == steps
    if prox_step == "implicit":  # one step in the docstring's closed form (v - plr g + plr lam w^t) / (1 + plr lam)
        v1 = [(vj - plr * aj * (vj - mj) + plr * lam * gj) / (1 + plr * lam) for vj, aj, mj, gj in zip(v0, a, m, w_g)]
        cfg1 = DittoConfig(lam=lam, lr=lr, personal_lr=plr, local_steps=1, batch_size=8, prox_step=prox_step)
        alg1 = Ditto(cfg1, lambda gen: Quadratic(t(*a), torch.zeros(2, dtype=F64)), num_clients=2, seed=0)
        _, s1 = alg1.client_update(payload, client_data(x), ClientState({"w": t(*v0)}), context(model))
        close(s1.tensors["w"], t(*v1))


@pytest.mark.parametrize(("weighting", "expected"), [("samples", t(4.0, -1.0)), ("uniform", t(3.0, 0.0))])
def test_ditto_server_averages_the_global_copies(weighting, expected):
    alg = Ditto(DittoConfig(weighting=weighting), lambda gen: Quadratic(A[:2], torch.zeros(2, dtype=F64)), 5, 0)
    updates = {
        1: Update({"w": t(1.0, 2.0)}, {"num_examples": 10}),
        3: Update({"w": t(5.0, -2.0)}, {"num_examples": 30}),
    }
    # samples: (10 (1, 2) + 30 (5, -2)) / 40; uniform (the reference): w^t + mean(w_i - w^t) = mean(w_i)
    close(alg.aggregate(ServerState({"w": t(9.0, 9.0)}), 1, updates).tensors["w"], expected)


# --- APFL -----------------------------------------------------------------------------------
def test_apfl_alpha_gradient_is_autograd_of_the_mixed_loss():
    alpha, eta, decay = 0.4, 0.1, 0.02
    cfg = APFLConfig(alpha=alpha, adaptive_alpha=True, alpha_lr=eta, alpha_decay=decay, local_steps=1, batch_size=16)
    alg = APFL(cfg, linear_factory, num_clients=2, seed=0)
    w, v = random_linear_state(1), random_linear_state(2)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 3, generator=gen, dtype=F64), torch.randint(0, 4, (6,), generator=gen)
    model = linear_factory(torch.Generator().manual_seed(0))
    update, state = alg.client_update(
        Payload(w, {"round": 1}), client_data(x, y), ClientState(v, {"alpha": alpha}), context(model)
    )
    new_alpha = state.meta["alpha"]
    assert 0 < new_alpha < 1 and update.meta["alpha"] == new_alpha  # no clipping: the step shows the gradient
    grad = (alpha - new_alpha) / eta - decay * alpha

    # autograd of the loss v trains on, the output mixture, at the weights before the step
    a = torch.tensor(alpha, dtype=F64, requires_grad=True)
    mixed = a * functional_call(model, v, (x,)) + (1 - a) * functional_call(model, w, (x,))
    F.cross_entropy(mixed, y).backward()
    assert grad == pytest.approx(a.grad.item(), rel=1e-9)
    # for a linear model it is also the paper's <v - w, grad f(alpha v + (1 - alpha) w)>
    vbar = {k: (alpha * v[k] + (1 - alpha) * w[k]).requires_grad_(True) for k in w}
    F.cross_entropy(functional_call(model, vbar, (x,)), y).backward()
    paper = sum(float(((v[k] - w[k]) * vbar[k].grad).sum()) for k in w)
    assert grad == pytest.approx(paper, rel=1e-9)


# --- SuPerFed -------------------------------------------------------------------------------
def flat(tensors: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    return torch.cat([tensors[k].reshape(-1) for k in keys])


def unflat(vector: torch.Tensor, like: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    out, i = {}, 0
    for k in keys:
        out[k] = vector[i : i + like[k].numel()].reshape(like[k].shape)
        i += like[k].numel()
    return out


def linear_ce_gradient(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """d mean CE(x W^T + b, y) / d(W, b) = ((P - Y)^T x, sum of rows of P - Y) / B."""
    logits = x @ params["weight"].T + params["bias"]
    err = (torch.softmax(logits, 1) - F.one_hot(y, logits.shape[1]).to(F64)) / x.shape[0]
    return {"weight": err.T @ x, "bias": err.sum(0)}


def superfed_step(wf, wl, wg, lam, x, y, lr, mu, nu, prox, eps):
    """One SGD step on CE(W(lam)) + mu prox(w_f - w_g) + nu cos^2(w_f, w_l), gradients written out."""
    keys = ["weight", "bias"]
    g_mix = linear_ce_gradient({k: (1 - lam) * wf[k] + lam * wl[k] for k in keys}, x, y)
    if prox == "squared":  # mu ||w_f - w_g||^2
        g_prox = {k: 2 * mu * (wf[k] - wg[k]) for k in keys}
    else:  # mu sum_tensors ||w_f - w_g||_2 (0 where they coincide)
        g_prox = {k: mu * (wf[k] - wg[k]) / max(float((wf[k] - wg[k]).norm()), 1e-300) for k in keys}
    f, loc = flat(wf, keys), flat(wl, keys)
    n, nf, nl = f @ loc + eps * f.numel(), f @ f, loc @ loc  # eps is added to each of the products
    d_f = unflat(nu * (2 * n / (nf * nl) * loc - 2 * n**2 / (nf**2 * nl) * f), wf, keys)
    d_l = unflat(nu * (2 * n / (nf * nl) * f - 2 * n**2 / (nf * nl**2) * loc), wf, keys)
    new_f = {k: wf[k] - lr * ((1 - lam) * g_mix[k] + g_prox[k] + d_f[k]) for k in keys}
    new_l = {k: wl[k] - lr * (lam * g_mix[k] + d_l[k]) for k in keys}
    return new_f, new_l


@pytest.mark.parametrize(
    ("nu", "prox", "eps"),
    [(0.0, "squared", 0.0), (0.5, "squared", 0.0), (0.5, "layer_norm", 0.01)],
    ids=["cos-off", "cos-on", "reference-loss"],
)
def test_superfed_mixed_steps_match_the_written_out_gradients(monkeypatch, nu, prox, eps):
    lams, lr, mu = [0.3, 0.8], 0.2, 0.7
    draws = iter(lams)  # fixed lambdas instead of U(0, 1) draws, one per step
    monkeypatch.setattr(superfed_module, "sample_lambdas", lambda names, mode, gen: dict.fromkeys(names, next(draws)))
    cfg = SuPerFedMMConfig(lr=lr, local_steps=2, batch_size=16, mu=mu, nu=nu, prox=prox, cos_eps=eps, start_round=0)
    alg = SuPerFedMM(cfg, linear_factory, num_clients=2, seed=0)
    wg, wl = random_linear_state(1), random_linear_state(2)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(5, 3, generator=gen, dtype=F64), torch.randint(0, 4, (5,), generator=gen)
    model = linear_factory(torch.Generator().manual_seed(0))
    update, state = alg.client_update(Payload(wg, {"round": 1}), client_data(x, y), ClientState(wl), context(model))

    f, loc = dict(wg), dict(wl)
    for lam in lams:  # the second step has w_f != w_g, so the prox term acts
        f, loc = superfed_step(f, loc, wg, lam, x, y, lr, mu, nu, prox, eps)
    for k in ("weight", "bias"):
        close(update.tensors[k], f[k])  # w_f travels
        close(state.tensors[k], loc[k])  # w_l stays on the client
