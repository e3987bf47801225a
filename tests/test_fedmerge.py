"""FedMerge: hand-written gradients vs autograd, the fixed-magnitude step, d=1 == FedProx, exact resume."""

import json
import math

import pytest
import torch
from helpers import assert_runs_identical, quick_config, run
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fedmerge.algorithms import merging
from fedmerge.algorithms.fedmerge import FedMerge, FedMergeConfig, FlatLayout
from fedmerge.config.schema import load_config
from fedmerge.core.params import flatten
from fedmerge.core.types import ServerState, Update
from fedmerge.models import build_model
from fedmerge.run.prepare import load_data
from fedmerge.run.results import RunStore
from fedmerge.run.runner import run_experiment
from fedmerge.run.summary import build_summary

S, D, M = 4, 3, 6  # selected clients, global models, all clients


def tiny_model(gen: torch.Generator | None = None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def client_batches(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (torch.randn(9, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (9,), generator=gen))
        for _ in range(S)
    ]


def loss_fn(model: nn.Module, layout: FlatLayout, flat: torch.Tensor, batch) -> torch.Tensor:
    params = layout.state_dict(flat, torch.zeros(0, dtype=torch.int64))
    x, y = batch
    return F.cross_entropy(functional_call(model, params, (x,)), y)


def autograd_reference(theta, logits, p, batches, model, layout):
    """L = sum_i p_i l_i(softmax(a_i) @ Theta): exact dL/dTheta and dL/da by autograd, and each g_i."""
    theta = theta.clone().requires_grad_(True)
    logits = logits.clone().requires_grad_(True)
    merged = torch.softmax(logits, dim=1) @ theta
    total = sum(p[i] * loss_fn(model, layout, merged[i], batches[i]) for i in range(S))
    d_theta, d_logits = torch.autograd.grad(total, (theta, logits))
    grads = []
    for i in range(S):
        point = merged[i].detach().clone().requires_grad_(True)
        grads.append(torch.autograd.grad(loss_fn(model, layout, point, batches[i]), point)[0])
    return d_theta, d_logits, torch.stack(grads)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture
def problem():
    gen = torch.Generator().manual_seed(1)
    model = tiny_model()
    layout = FlatLayout.of(model)
    theta = torch.randn(D, layout.num_floats, generator=gen, dtype=torch.float64)
    logits = torch.randn(S, D, generator=gen, dtype=torch.float64)
    n = torch.tensor([9.0, 20.0, 5.0, 13.0], dtype=torch.float64)
    return model, layout, theta, logits, n / n.sum(), client_batches(gen)


def test_merging_gradients_match_autograd(problem):
    model, layout, theta, logits, p, batches = problem
    d_theta, d_logits, grads = autograd_reference(theta, logits, p, batches, model, layout)
    w = merging.merge_weights(logits)
    assert rel_err(merging.theta_gradient(w, p, grads), d_theta) < 1e-6
    ours = merging.logit_gradient(w, merging.inner_products(grads, theta), p)
    assert rel_err(ours, d_logits) < 1e-6
    assert ours.sum(dim=1).abs().max() < 1e-12 * ours.abs().max()


def test_aggregate_applies_exact_gradients(problem):
    """Through the algorithm: delta_i = -grad l_i, Theta lr 1, plain logit SGD with lr 1, unnormalised
    Theta update => new state = old state - exact gradient of L (selected rows only)."""
    model, layout, theta, logits, p, batches = problem
    d_theta, d_logits, grads = autograd_reference(theta, logits, p, batches, model, layout)
    cfg = FedMergeConfig(num_models=D, theta_update="sum", logit_step="gradient", logit_lr=1.0, theta_lr=1.0)
    algo = FedMerge(cfg, tiny_model, M, seed=0)
    selected = [0, 2, 3, 5]
    all_logits = torch.zeros(M, D, dtype=torch.float64)
    all_logits[selected] = logits
    state = ServerState(
        {"theta": theta.clone(), "counters": torch.zeros(D, 0, dtype=torch.int64), "logits": all_logits}
    )
    n = p * 47  # the fixture's sample counts
    updates = {
        cid: Update(
            layout.state_dict(-grads[i], torch.zeros(0, dtype=torch.int64)), {"num_examples": round(float(n[i]))}
        )
        for i, cid in enumerate(selected)
    }
    new = algo.aggregate(state, 1, updates)
    assert rel_err(theta - new.tensors["theta"], d_theta) < 1e-6
    assert rel_err(all_logits[selected] - new.tensors["logits"][selected], d_logits) < 1e-6
    assert torch.equal(new.tensors["logits"][[1, 4]], all_logits[[1, 4]])  # unselected rows untouched


def reference_grid_loop(grad: torch.Tensor, p: torch.Tensor, lr: float) -> torch.Tensor:
    """The authors' loop, literally: normalise by the global L1 norm, step until the change exceeds lr."""
    g_hat = grad / grad.abs().sum()
    a0 = torch.zeros_like(grad)
    a, k = a0.clone(), 0
    while True:
        a = a - lr * p[:, None] * g_hat
        k += 1
        if (a - a0).abs().max() > lr or k > 10000:
            return a


@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e4])
def test_fixed_magnitude_step_moves_largest_logit_by_lr(scale):
    gen = torch.Generator().manual_seed(3)
    grad = scale * torch.randn(7, 5, generator=gen, dtype=torch.float64)
    grad -= grad.mean(dim=1, keepdim=True)
    p = torch.rand(7, generator=gen, dtype=torch.float64)
    p /= p.sum()
    step = merging.fixed_magnitude_step(grad, p, 0.01)
    one_increment = 0.01 * float((p[:, None] * grad).abs().max() / grad.abs().sum())
    assert 0.01 < step.abs().max() <= 0.01 + one_increment + 1e-15
    assert torch.allclose(step, reference_grid_loop(grad, p, 0.01), rtol=1e-9, atol=1e-15)
    assert torch.equal(merging.fixed_magnitude_step(torch.zeros(3, 2), torch.ones(3) / 3, 0.01), torch.zeros(3, 2))


def scalar_closed_form(grad, p, lr, increment=None):
    """The closed form with the step count on Python floats (what the server step computed before it
    stopped reading values back from the device)."""
    pg = p.to(grad.dtype)[:, None] * grad
    total = grad.abs().sum()
    if not torch.isfinite(total) or total == 0:
        return torch.zeros_like(grad)
    pg_hat = pg / total
    c = float(pg_hat.abs().max())
    if c == 0:
        return torch.zeros_like(grad)
    inc = lr if increment is None else increment
    k = min(math.floor(lr / (inc * c)) + 1, merging.MAX_GRID_STEPS + 1)
    return -(inc * k) * pg_hat


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fixed_magnitude_step_on_the_device_equals_python_scalar_arithmetic_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(11)
    cases = 0
    for trial in range(400):
        m, d = int(torch.randint(1, 60, (1,), generator=gen)), int(torch.randint(1, 31, (1,), generator=gen))
        scale = 10.0 ** float(torch.randint(-30, 30, (1,), generator=gen))
        grad = (scale * torch.randn(m, d, generator=gen, dtype=torch.float64)).to(dtype)
        p = torch.rand(m, generator=gen, dtype=torch.float64)
        if trial % 7 == 0:
            p[: m // 2] = 0.0  # clients with no weight
        p /= p.sum()
        lr = float(torch.rand((), generator=gen)) * 0.5 + 1e-4
        for increment in (None, 0.01, 1e-9):  # 1e-9: the 10,001-step cap binds
            expected = scalar_closed_form(grad, p, lr, increment)
            got = merging.fixed_magnitude_step(grad, p, lr, increment)
            assert got.dtype == expected.dtype
            assert torch.equal(got.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)), (trial, increment)
            cases += 1
    for special in (torch.zeros(4, 3), torch.full((4, 3), float("nan")), torch.tensor([[float("inf"), 1.0]])):
        special = special.to(dtype)
        p = torch.ones(special.shape[0], dtype=torch.float64) / special.shape[0]
        got = merging.fixed_magnitude_step(special, p, 0.1)
        assert torch.equal(got, torch.zeros_like(special)) and not torch.signbit(got).any()
    assert cases == 1200


def test_fedmerge_with_one_model_is_fedprox(tmp_path):
    """d=1: the merge is the single model, omega_i = p_i, so FedMerge is FedProx with mu = 2 * prox_mu
    (the reference's prox term has no 1/2). Identical up to float32 rounding of the average."""
    common = ["participation=0.5", "rounds=4", "algorithm.gap_samples=512"]
    a = run(quick_config(*common, "algorithm.name=fedmerge", "algorithm.num_models=1"), tmp_path / "fm")
    b = run(quick_config(*common, "algorithm.name=fedprox", "algorithm.mu=0.02"), tmp_path / "fp")
    rows_a, rows_b = RunStore(a.run_dir).read_metrics(), RunStore(b.run_dir).read_metrics()
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-5)
        assert ra["local_gap"]["gap"] == pytest.approx(rb["local_gap"]["gap"], rel=1e-4, abs=1e-6)
        for cid, m in ra["eval"]["clients"].items():
            assert m["test_acc"] == rb["eval"]["clients"][cid]["test_acc"]
            assert m["test_nll"] == pytest.approx(rb["eval"]["clients"][cid]["test_nll"], rel=1e-5)
    cfg = run_config(a)
    data = load_data(cfg)
    keys = [k for k, *_ in FlatLayout.of(build_model(cfg.model, data.input_shape, data.num_classes)).floats]
    theta = a.server_state.tensors["theta"][0]
    assert torch.allclose(theta, flatten(b.server_state.tensors, keys), rtol=1e-5, atol=1e-6)
    assert a.summary["parameter_budget"] == b.summary["parameter_budget"] | {
        "server_stored": b.summary["parameters"]["server_state"] + 6  # + the 6 x 1 merge logits
    }


def run_config(result):
    return load_config(result.run_dir / "config.yaml")


def test_fedmerge_stop_and_resume_is_bit_identical(tmp_path):
    cfg = quick_config("rounds=5", "algorithm.name=fedmerge", "algorithm.num_models=3", "participation=0.5")
    full = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "cut", stop_after=2)
    resumed = run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    assert_runs_identical(full.run_dir, resumed.run_dir)
    assert resumed.server_state.tensors.keys() == {"theta", "counters", "logits"}


CLUSTER = [
    "partition.name=cluster",
    "partition.num_groups=3",
    "partition.num_clients=9",
    "partition.group_sizes=random",
    "algorithm.name=fedmerge",
    "algorithm.num_models=3",
    "algorithm.logit_lr=0.1",
    "rounds=8",
    "eval_every=4",
    "algorithm.gap_samples=512",
]


def test_cluster_run_logs_merge_weights_and_recovery(tmp_path):
    res = run(quick_config(*CLUSTER), tmp_path / "c")
    rows = RunStore(res.run_dir).read_metrics()
    evals = [r for r in rows if "eval" in r]
    assert [r["round"] for r in evals] == [4, 8]
    for r in evals:
        w = r["server"]["merge_weights"]
        assert len(w) == 9 and all(len(row) == 3 and math.isclose(sum(row), 1, abs_tol=1e-5) for row in w)
    assert evals[0]["server"]["merge_weights"] != evals[1]["server"]["merge_weights"]
    assert all("local_gap" in r for r in rows)
    budget = res.summary["parameter_budget"]
    model = res.summary["parameters"]["model"]
    assert budget["down_per_client_round"] == budget["up_per_client_round"] == budget["client_stored"] == model
    assert budget["server_stored"] == 3 * model + 9 * 3  # three models plus the merge logits
    groups = [c.group for c in load_data(run_config(res)).clients]
    summary = build_summary(rows, {"algorithm": "fedmerge", "client_groups": groups})
    rec = summary["cluster_recovery"]
    # merge weights (hence the ARI) are logged every round, not only at evaluations
    assert rec["round"] == 8 and -1 <= rec["ari"] <= 1 and set(rec["ari_by_round"]) == {str(r) for r in range(1, 9)}


def test_fixed_merge_weights_are_k_uniform_and_frozen(tmp_path):
    res = run(
        quick_config(
            "algorithm.name=fedmerge",
            "algorithm.num_models=4",
            "algorithm.merge_weights=fixed",
            "algorithm.fixed_k=2",
            "eval_every=2",
        ),
        tmp_path / "f",
    )
    weights = [r["server"]["merge_weights"] for r in RunStore(res.run_dir).read_metrics() if "server" in r]
    assert all(w == weights[0] for w in weights)
    assert all(sorted(row) == [0.0, 0.0, 0.5, 0.5] for row in weights[0])
    assert len({tuple(row) for row in weights[0]}) > 1  # clients differ in which models they use


def test_fixed_k_cannot_exceed_num_models():
    with pytest.raises(ValueError, match="fixed_k"):
        FedMergeConfig(num_models=2, fixed_k=3)


def test_layout_round_trips_batchnorm_model():
    from fedmerge.models.resnet import ResNet9Config

    model = build_model(ResNet9Config(), (1, 28, 28), 10, generator=torch.Generator().manual_seed(0))
    layout = FlatLayout.of(model)
    state = model.state_dict()
    row = torch.empty(layout.num_floats)
    layout.flatten_into(state, row)
    back = layout.state_dict(row, layout.int_vector(state))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in state.items())
    head = [k for k, _, off in layout.floats if layout.head[0] <= off < layout.head[1]]
    assert len(head) == 2 and all(k.startswith(head[0].rsplit(".", 1)[0]) for k in head)
    assert layout.num_params == sum(p.numel() for p in model.parameters())


def test_flatten_rows_writes_what_flatten_into_writes_row_by_row():
    from fedmerge.models.resnet import ResNet9Config

    model = build_model(ResNet9Config(), (1, 28, 28), 10, generator=torch.Generator().manual_seed(0))
    layout = FlatLayout.of(model)
    gen = torch.Generator().manual_seed(1)
    states = [{k: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()} for _ in range(3)]
    want = torch.full((3, layout.num_floats), float("nan"))
    for state, row in zip(states, want):
        layout.flatten_into(state, row)
    for concatenate in (True, False, None):  # one concatenation (accelerators), row copies (CPU), auto
        got = torch.full_like(want, float("nan"))  # every entry must be written
        layout.flatten_rows(states, got, concatenate)
        assert torch.equal(got, want)
    doubles = [{k: v.double() for k, v in state.items()} for state in states]  # another dtype: row copies
    got.fill_(float("nan"))
    layout.flatten_rows(doubles, got, concatenate=True)
    assert torch.equal(got, want)


def test_summary_json_is_serialisable(tmp_path):
    res = run(quick_config("algorithm.name=fedmerge", "rounds=2", "algorithm.gap_samples=64"), tmp_path / "s")
    assert json.loads((res.run_dir / "summary.json").read_text())["local_gap"]["mean"] > 0


def test_topk_mask_keeps_the_largest_entries_per_row():
    g = torch.tensor([[0.1, -3.0, 2.0, 0.5], [4.0, 0.0, -0.2, 0.3]])
    assert torch.equal(merging.topk_mask(g, 0.5), torch.tensor([[0.0, -3.0, 2.0, 0.0], [4.0, 0.0, 0.0, 0.3]]))
    assert torch.equal(merging.topk_mask(g, 1.0), g)


@pytest.mark.parametrize(
    "options",
    [
        ["algorithm.merge_grad=head"],
        ["algorithm.merge_grad=topk", "algorithm.merge_grad_topk=0.05"],
        ["algorithm.theta_update=sum", "algorithm.logit_step=gradient", "algorithm.logit_lr=1.0"],
        ["algorithm.prox_form=fedprox", "algorithm.prox_mu=0"],
    ],
)
def test_reference_options_run_and_move_the_merge_weights(tmp_path, options):
    res = run(quick_config("algorithm.name=fedmerge", "algorithm.num_models=3", "rounds=2", *options), tmp_path / "o")
    weights = [r["server"]["merge_weights"] for r in RunStore(res.run_dir).read_metrics()]
    assert weights[0] != weights[1]
    assert res.summary["last"]["clients"]["test_acc"]["mean"] > 0.15  # above chance (0.1)


def test_flower_simulation_matches_local_engine(tmp_path):
    pytest.importorskip("flwr", reason="Flower absent: pip install -e '.[flower]'")
    pytest.importorskip("ray", reason="Flower simulation needs ray: pip install -e '.[flower]'")
    small = ["partition.num_clients=4", "rounds=3", "algorithm.name=fedmerge", "algorithm.num_models=2"]
    local = run(quick_config(*small, "participation=0.5"), tmp_path / "local")
    flower = run(quick_config(*small, "participation=0.5", "engine=flower", "flower.num_cpus=1"), tmp_path / "flower")
    assert_runs_identical(local.run_dir, flower.run_dir)


def wide_model(gen: torch.Generator | None = None) -> nn.Module:
    return nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 10))


def float64_logit_step(theta, deltas, logits, p, lr):
    """The fixed-magnitude logit step in float64, in the reference's order: difference first, then the
    inner product, G_ij = w_ij <Theta_j - theta_i, g_i> with g_i = -delta_i."""
    w = merging.merge_weights(logits)
    t, g = theta.double(), -deltas.double()
    merged = w @ t
    grad = torch.stack([w[i] * ((t - merged[i]) @ g[i]) for i in range(len(g))])
    return merging.fixed_magnitude_step(grad, p, lr)


@pytest.mark.parametrize("spread", [1e-5, 1e-3, 1.0])
def test_logit_step_is_precise_when_the_global_models_nearly_agree(spread):
    """Inner products <Theta_j, g_i> formed in float32 and centred afterwards cancel when the d models
    nearly agree: at a 1e-5 relative spread the float32 step was off by about 0.5-1%. The step must
    agree with the float64 computation to 1e-5 of its largest change at every spread."""
    gen = torch.Generator().manual_seed(3)
    s, d = 12, 5
    algo = FedMerge(FedMergeConfig(num_models=d, preset="paper", logit_lr=0.01), wide_model, s, seed=0)
    lay = algo.layout
    base = torch.randn(lay.num_floats, generator=gen)
    theta = base + spread * base.abs() * torch.randn(d, lay.num_floats, generator=gen)
    # client updates share a direction with the models (as trained updates do), which is what cancels
    deltas = 0.01 * torch.randn(s, 1, generator=gen) * base + 1e-3 * torch.randn(s, lay.num_floats, generator=gen)
    logits = 0.3 * torch.randn(s, d, generator=gen, dtype=torch.float64)
    n = torch.randint(20, 100, (s,), generator=gen)
    updates = {
        i: Update(lay.state_dict(deltas[i], torch.zeros(0, dtype=torch.int64)), {"num_examples": int(n[i])})
        for i in range(s)
    }
    state = ServerState({"theta": theta.clone(), "counters": torch.zeros(d, 0, dtype=torch.int64), "logits": logits})
    step = algo.aggregate(state, 1, updates).tensors["logits"] - logits
    want = float64_logit_step(theta, deltas, logits, n.double() / n.sum(), 0.01)
    assert float((step - want).abs().max()) < 1e-5 * float(want.abs().max())


def test_inner_products_switch_to_float64_only_when_they_cancel():
    """Well-separated models keep the float32 products bit for bit (published runs are unchanged);
    nearly equal ones get the float64 products."""
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(3000, generator=gen)
    grads = 0.01 * torch.randn(8, 1, generator=gen) * base + 1e-3 * torch.randn(8, 3000, generator=gen)
    w = merging.merge_weights(torch.randn(8, 4, generator=gen, dtype=torch.float64))
    for spread, precise in [(3.0, False), (1e-5, True)]:
        theta = base + spread * torch.randn(4, 3000, generator=gen)
        float32 = torch.mm(theta, grads.t()).t().double()
        float64 = merging.inner_products_float64(grads, theta)
        exact = (theta.double() @ grads.double().t()).t()
        assert torch.allclose(merging.inner_products_float64(grads, theta, block=1000), exact, rtol=1e-12, atol=0)
        assert torch.equal(merging.inner_products(grads, theta, w), float64 if precise else float32)
        assert torch.equal(merging.inner_products(grads, theta), float32)  # no weights: no check
