"""RegMean and Fisher averaging: the server rules on constructed updates, the client statistics against
brute force, and short real runs (accuracy bar, bit-identical resume)."""

import pytest
import torch
from helpers import assert_runs_identical, quick_config, run
from torch import nn
from torch.func import functional_call, jacrev
from torch.nn import functional as F

from fedmerge.algorithms.fisher import FISHER, FisherAveraging, FisherAvgConfig, diagonal_fisher
from fedmerge.algorithms.regmean import GRAM, RegMean, RegMeanConfig, linear_input_grams
from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.core.types import ServerState, Update


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def spd(d, seed):
    a = rand(d, d + 2, seed=seed)
    return a @ a.T


def updates(states, stats, prefix, ns):
    return {
        i: Update({**s, **{prefix + k: v for k, v in st.items()}}, {"num_examples": n})
        for i, (s, st, n) in enumerate(zip(states, stats, ns))
    }


def regmean(**kw):
    return RegMean(RegMeanConfig(**kw), lambda g: nn.Linear(4, 3), num_clients=3, seed=0)


def fisher_avg(**kw):
    return FisherAveraging(FisherAvgConfig(**kw), lambda g: nn.Linear(4, 3), num_clients=3, seed=0)


def n_mean(ts, ns):
    return sum(n * t for t, n in zip(ts, ns)) / sum(ns)


STATE = ServerState(
    {"fc.weight": torch.zeros(3, 4, dtype=torch.float64), "fc.bias": torch.zeros(3, dtype=torch.float64)}
)
NS = [10, 30, 60]


def client_states(k=3):
    return [{"fc.weight": rand(3, 4, seed=10 + i), "fc.bias": rand(3, seed=20 + i)} for i in range(k)]


@pytest.mark.parametrize("alpha", [1.0, 0.4])
def test_regmean_identical_grams_is_plain_average_and_bias_by_n(alpha):
    states, g = client_states(), spd(4, 1)
    out = regmean(alpha=alpha).aggregate(STATE, 1, updates(states, [{"fc": g}] * 3, GRAM, NS)).tensors
    assert list(out) == ["fc.weight", "fc.bias"]  # server state = model state, no Grams
    ws = [s["fc.weight"] for s in states]
    torch.testing.assert_close(out["fc.weight"], sum(ws) / 3)  # coefficient 1 per client, not n_i
    torch.testing.assert_close(out["fc.bias"], n_mean([s["fc.bias"] for s in states], NS))


def test_regmean_summed_grams_scaled_by_n_give_the_n_weighted_average():
    states, g = client_states(), spd(4, 1)
    out = regmean(gram="sum").aggregate(STATE, 1, updates(states, [{"fc": n * g} for n in NS], GRAM, NS)).tensors
    torch.testing.assert_close(out["fc.weight"], n_mean([s["fc.weight"] for s in states], NS))


def test_regmean_off_diagonal_scaling_is_applied():
    states, grams = client_states(), [spd(4, i) for i in range(3)]
    out = regmean(alpha=0.3).aggregate(STATE, 1, updates(states, [{"fc": g} for g in grams], GRAM, NS)).tensors
    shrunk = [0.3 * g + 0.7 * torch.diag(torch.diag(g)) for g in grams]
    lhs = sum(s["fc.weight"] @ g for s, g in zip(states, shrunk))
    torch.testing.assert_close(out["fc.weight"], torch.linalg.solve(sum(shrunk), lhs.T).T)


def test_regmean_recovers_a_layer_fitting_clients_on_disjoint_subspaces():
    # client 1's inputs span (e1, e2), client 2's span (e3, e4); each W_i fits its own targets of one true W
    # and is arbitrary on the other client's subspace. RegMean must reproduce both clients' outputs.
    w_true = rand(3, 4, seed=1)
    xs = [
        torch.cat([rand(20, 2, seed=2), torch.zeros(20, 2, dtype=torch.float64)], 1),
        torch.cat([torch.zeros(30, 2, dtype=torch.float64), rand(30, 2, seed=3)], 1),
    ]
    ws = []
    for i, x in enumerate(xs):
        fit = torch.linalg.lstsq(x[:, 2 * i : 2 * i + 2], x @ w_true.T).solution.T  # (3, 2) on own coordinates
        w = rand(3, 4, seed=4 + i) * 5  # garbage elsewhere
        w[:, 2 * i : 2 * i + 2] = fit
        ws.append(w)
        torch.testing.assert_close(x @ w.T, x @ w_true.T)
    states = [{"fc.weight": w, "fc.bias": torch.zeros(3, dtype=torch.float64)} for w in ws]
    grams = [{"fc": x.T @ x / len(x)} for x in xs]
    merged = regmean().aggregate(STATE, 1, updates(states, grams, GRAM, [20, 30])).tensors["fc.weight"]
    avg = (ws[0] + ws[1]) / 2
    for x in xs:
        torch.testing.assert_close(x @ merged.T, x @ w_true.T, atol=1e-5, rtol=0)
        assert (x @ avg.T - x @ w_true.T).abs().max() > 0.1  # plain averaging does not


def test_linear_input_grams_are_the_layer_inputs_outer_products():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Dropout(0.5), nn.Linear(6, 3), nn.Linear(3, 2)).train()
    model[4].weight.requires_grad_(False)  # frozen weight: no Gram (averaged by n)
    x = torch.randn(37, 5)
    grams = linear_input_grams(model, x, "mean", batch_size=8)
    assert model.training and list(grams) == ["0", "3"]
    h = torch.relu(model[0](x)).detach()  # eval mode: no dropout
    torch.testing.assert_close(grams["0"], x.T @ x / 37)
    torch.testing.assert_close(grams["3"], h.T @ h / 37)
    summed = linear_input_grams(model, x, "sum")
    torch.testing.assert_close(summed["3"], h.T @ h, rtol=1e-5, atol=1e-5)


# --- Fisher averaging -------------------------------------------------------------------------


def bn_states(k=3):
    return [
        {**s, "bn.running_mean": rand(4, seed=30 + i), "bn.num_batches_tracked": torch.tensor(10 * i)}
        for i, s in enumerate(client_states(k))
    ]


FSTATE = ServerState(bn_states(1)[0])


def test_fisher_equal_fishers_is_plain_average_and_buffers_by_n():
    states = bn_states()
    f = {"fc.weight": rand(3, 4, seed=5).abs(), "fc.bias": rand(3, seed=6).abs()}
    out = fisher_avg().aggregate(FSTATE, 1, updates(states, [f] * 3, FISHER, NS)).tensors
    assert list(out) == list(FSTATE.tensors)
    for k in ("fc.weight", "fc.bias"):
        torch.testing.assert_close(out[k], sum(s[k] for s in states) / 3)
    torch.testing.assert_close(out["bn.running_mean"], n_mean([s["bn.running_mean"] for s in states], NS))
    assert out["bn.num_batches_tracked"] == round(n_mean([0, 10, 20], NS))


@pytest.mark.parametrize("eps,tol", [(0.0, 0.0), (1e-6, 1e-5)])
def test_fisher_entries_without_mass_come_from_the_other_client(eps, tol):
    states = bn_states(2)
    f0 = {"fc.weight": torch.ones(3, 4, dtype=torch.float64), "fc.bias": torch.ones(3, dtype=torch.float64)}
    f1 = {k: v * 2 for k, v in f0.items()}
    f1["fc.weight"][0] = 0.0  # client 1 has no Fisher on row 0: that row must be client 0's
    f0["fc.bias"][2] = 0.0  # client 0 none on bias entry 2: client 1's
    out = fisher_avg(eps=eps).aggregate(FSTATE, 1, updates(states, [f0, f1], FISHER, [5, 5])).tensors
    a, b = states[0], states[1]
    torch.testing.assert_close(out["fc.weight"][0], a["fc.weight"][0], atol=tol, rtol=tol)
    torch.testing.assert_close(out["fc.bias"][2], b["fc.bias"][2], atol=tol, rtol=tol)
    mixed = (a["fc.weight"][1:] + 2 * b["fc.weight"][1:]) / 3
    torch.testing.assert_close(out["fc.weight"][1:], mixed, atol=tol + 1e-12, rtol=0)


def test_fisher_normalize_removes_each_clients_scale():
    states = bn_states(2)
    fs = [{"fc.weight": rand(3, 4, seed=7 + i).abs(), "fc.bias": rand(3, seed=9 + i).abs()} for i in range(2)]
    scaled = [fs[0], {k: 100 * v for k, v in fs[1].items()}]

    def run_(norm, f):
        return fisher_avg(normalize=norm, eps=0).aggregate(FSTATE, 1, updates(states, f, FISHER, [5, 5]))

    base, big = run_(True, fs).tensors, run_(True, scaled).tensors
    torch.testing.assert_close(base["fc.weight"], big["fc.weight"])
    raw = run_(False, scaled).tensors
    assert (raw["fc.weight"] - base["fc.weight"]).abs().max() > 1e-3


def tiny_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 4))
    model[1].running_mean.uniform_(-0.5, 0.5)
    model[0].bias.requires_grad_(False)  # frozen: no Fisher
    return model.train()


def brute_force(model, x, y):
    """Per-example Jacobians of log p(.|x) by torch.func: (exact, empirical) diagonal Fishers."""
    model.eval()
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    rest = {k: v for k, v in model.state_dict().items() if k not in params}

    def logp(p, xi):
        return F.log_softmax(functional_call(model, {**rest, **p}, (xi[None],)), -1)[0]

    exact = {k: torch.zeros_like(v) for k, v in params.items()}
    emp = {k: torch.zeros_like(v) for k, v in params.items()}
    for xi, yi in zip(x, y):
        jac, prob = jacrev(logp)(params, xi), logp(params, xi).exp()
        for k, j in jac.items():
            exact[k] += torch.einsum("c,c...->...", prob, j**2) / len(x)
            emp[k] += j[yi] ** 2 / len(x)
    model.train()
    return exact, emp


def test_fisher_estimators_match_brute_force():
    model = tiny_model()
    x, y = torch.randn(3, 3, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 3, 1])
    exact, emp = brute_force(model, x, y)
    assert set(exact) == {"0.weight", "1.weight", "1.bias", "3.weight", "3.bias"}
    got = diagonal_fisher(model, x, y, "exact")
    assert model.training and set(got) == set(exact)
    for k in exact:
        torch.testing.assert_close(got[k], exact[k], rtol=1e-4, atol=1e-7)
    got = diagonal_fisher(model, x, y, "empirical")
    for k in emp:
        torch.testing.assert_close(got[k], emp[k], rtol=1e-4, atol=1e-7)
    # sampled: unbiased, so its mean over many draws (each example repeated) approaches the exact Fisher
    reps = 400
    sampled = diagonal_fisher(model, x.repeat(reps, 1), y.repeat(reps), "sampled", torch.Generator().manual_seed(0))

    def flat(d):
        return torch.cat([d[k].flatten() for k in sorted(d)])

    err = (flat(sampled) - flat(exact)).norm() / flat(exact).norm()
    assert err < 0.1, err
    assert (flat(sampled) - flat(emp)).norm() / flat(exact).norm() > 2 * err  # not just the empirical Fisher
    again = diagonal_fisher(model, x, y, "sampled", torch.Generator().manual_seed(5))
    assert all(
        torch.equal(v, diagonal_fisher(model, x, y, "sampled", torch.Generator().manual_seed(5))[k])
        for k, v in again.items()
    )


@pytest.mark.parametrize("estimator", ["exact", "empirical", "sampled"])
def test_fisher_per_example_loop_fallback_matches_the_vmapped_path(monkeypatch, estimator):
    # Models that cannot be vmapped (the LoRA transformer) take the loop; both must agree exactly.
    import fedmerge.algorithms.fisher as fisher_module

    model = tiny_model()
    x, y = torch.randn(5, 3, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 3, 1, 1, 2])
    fast = diagonal_fisher(model, x, y, estimator, torch.Generator().manual_seed(3))

    def unvmappable(*args, **kwargs):
        raise RuntimeError("vmap: data-dependent control flow")

    monkeypatch.setattr(fisher_module, "_vmapped", unvmappable)
    slow = diagonal_fisher(model, x, y, estimator, torch.Generator().manual_seed(3))
    for k in fast:
        torch.testing.assert_close(slow[k], fast[k], rtol=1e-5, atol=1e-8)


# --- real runs ----------------------------------------------------------------------------------

RUNS = {
    "regmean": ["algorithm.name=regmean", "algorithm.gram_samples=100"],
    "fisher_avg": ["algorithm.name=fisher_avg", "algorithm.fisher_samples=48"],
}


@pytest.mark.parametrize("case", sorted(RUNS))
def test_runs_clear_bar_and_resume_bit_identical(tmp_path, case):
    cfg = quick_config(*RUNS[case])
    full = run(cfg, tmp_path / "full")
    # FedAvg reaches ~0.63 in this 4-round setting; both rules do better
    assert full.summary["last"]["clients"]["test_acc"]["mean"] > 0.70
    assert full.summary["last"]["global"]["test_acc"] > 0.70
    ckpt = load_checkpoint(full.run_dir / "checkpoints")
    model_keys = {"body.1.weight", "body.1.bias", "classifier.weight", "classifier.bias"}
    assert set(ckpt.server_state.tensors) == model_keys  # statistics never enter the server state
    assert full.summary["communication_per_client_per_round"]["up"] > 1.9 * 15010  # model + statistics
    run(cfg, tmp_path / "cut", stop_after=2)
    resumed = run(cfg, tmp_path / "cut", resume=True)
    assert_runs_identical(full.run_dir, resumed.run_dir)
