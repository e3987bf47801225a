"""FedEM: reduction to FedAvg, pi concentrating per group, the weighted loss, exact resume."""

import torch
from helpers import assert_runs_identical, quick_config, run
from torch.nn import functional as F

from fedmerge.algorithms import ALGORITHMS
from fedmerge.algorithms.fedem import FedEM, e_step, mixture_log_probs, weighted_cross_entropy
from fedmerge.core.algorithm import ClientContext
from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.core.training import LocalTraining, local_sgd
from fedmerge.models import build_model
from fedmerge.report.plot_merge_weights import client_groups
from fedmerge.run.prepare import load_data
from fedmerge.run.runner import run_experiment

SMALL = ["dataset.max_samples=600"]


def test_one_component_is_fedavg(tmp_path):
    a = run(quick_config("rounds=3", *SMALL), tmp_path / "fedavg")
    b = run(quick_config("rounds=3", *SMALL, "algorithm.name=fedem", "algorithm.num_components=1"), tmp_path / "em")
    assert_runs_identical(a.run_dir, b.run_dir)


def test_pi_concentrates_on_one_component_per_group(tmp_path):
    # two disjoint class sets (cluster partition): each group's clients end up on their own component
    cfg = quick_config(
        *SMALL,
        "partition.name=cluster",
        "partition.num_groups=2",
        "partition.num_clients=4",
        "rounds=12",
        "eval_every=12",
        "algorithm.local_epochs=3",
        "algorithm.name=fedem",
        "algorithm.num_components=2",
    )
    res = run(cfg, tmp_path / "r")
    groups = client_groups(res.run_dir)
    states = load_checkpoint(res.run_dir / "checkpoints").client_states
    pis = torch.stack([states[c].tensors["pi"] for c in range(4)])
    assert torch.allclose(pis.sum(dim=1), torch.ones(4, dtype=pis.dtype))
    assert (pis.max(dim=1).values > 0.9).all(), pis
    chosen = pis.argmax(dim=1).tolist()
    mapping = {g: c for g, c in zip(groups, chosen)}
    assert len(set(mapping.values())) == 2 and chosen == [mapping[g] for g in groups]

    # the true mixture prediction classifies the test data well, and it is what the engine evaluated
    data = load_data(cfg)
    alg = ALGORITHMS.get("fedem").obj(cfg.algorithm, factory(cfg, data), 4, cfg.seed)
    assert isinstance(alg, FedEM)
    payload = alg.configure_evaluate(res.server_state, 12, [0, 1, 2, 3])
    model = factory(cfg, data)(torch.Generator().manual_seed(0))
    accs = []
    for cid, client in enumerate(data.clients):
        ctx = ClientContext(model, torch.device("cpu"), cfg.seed, 12, cid)
        logp = alg.predict(payload[cid], states[cid], ctx, client.x_test)
        assert torch.allclose(logp.exp().sum(dim=1), torch.ones(len(logp)), atol=1e-5)
        accs.append(float((logp.argmax(dim=1) == client.y_test).float().mean()))
    assert sum(accs) / len(accs) > 0.85, accs
    assert abs(res.summary["last"]["clients"]["test_acc"]["mean"] - sum(accs) / len(accs)) < 1e-6
    assert "dominant/test_acc" in res.summary["last"]["clients"]


def factory(cfg, data):
    return lambda gen: build_model(cfg.model, data.input_shape, data.num_classes, generator=gen)


def test_e_step_and_mixture():
    losses = torch.tensor([[0.1, 3.0, 1.0], [2.0, 0.2, 1.0]])
    pi = torch.tensor([0.25, 0.75], dtype=torch.float64)
    q, new_pi = e_step(losses, pi)
    expect = torch.softmax(torch.log(pi)[:, None] - losses.double(), dim=0)
    assert torch.allclose(q, expect) and torch.allclose(q.sum(dim=0), torch.ones(3, dtype=q.dtype))
    assert torch.allclose(new_pi, expect.mean(dim=1))
    logits = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    mix = (pi.float()[:, None, None] * logits.softmax(-1)).sum(0)
    assert torch.allclose(mixture_log_probs(logits, pi).exp(), mix, atol=1e-6)
    assert torch.equal(mixture_log_probs(logits[:1], pi[:1] * 0 + 1), F.log_softmax(logits[0], dim=-1))


def test_weighted_step_is_the_gradient_step_of_the_weighted_loss():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, generator=gen), torch.randint(0, 2, (8,), generator=gen)
    q = torch.rand(8, generator=gen)
    model = build_model({"name": "mlp", "hidden": (4,)}, (3,), 2, generator=gen)
    ref = build_model({"name": "mlp", "hidden": (4,)}, (3,), 2)
    ref.load_state_dict(model.state_dict())
    cfg = LocalTraining(lr=0.5, batch_size=8, local_steps=1)
    local_sgd(model, x, y, cfg, torch.Generator(), loss_fn=weighted_cross_entropy(q))
    loss = (q * F.cross_entropy(ref(x), y, reduction="none")).mean()
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    for (_, p), p0, g in zip(model.named_parameters(), ref.parameters(), grads):
        assert torch.allclose(p, p0 - 0.5 * g, atol=1e-6)


def test_resume_is_exact_with_persistent_momentum(tmp_path):
    cfg = quick_config(
        *SMALL,
        "algorithm.name=fedem",
        "algorithm.num_components=2",
        "algorithm.momentum=0.9",
        "participation=0.5",
    )
    full = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "cut", stop_after=2)
    resumed = run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    assert_runs_identical(full.run_dir, resumed.run_dir)
    states = load_checkpoint(full.run_dir / "checkpoints").client_states.values()
    trained = [s for s in states if "pi" in s.tensors]
    assert trained and all(any(k.startswith("momentum/1/") for k in s.tensors) for s in trained)
    comm = full.summary["communication_per_client_per_round"]
    assert comm["down"] == comm["up"] == 2 * full.summary["parameters"]["model"]  # M models each way
