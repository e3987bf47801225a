"""pFedMoE: only the global expert travels, the full model learns, exact resume."""

import json

import torch
from helpers import assert_runs_identical, quick_config, run

from fedmerge.algorithms import ALGORITHMS
from fedmerge.algorithms.pfedmoe import Gate, PFedMoE, gate_init
from fedmerge.core.algorithm import ClientContext
from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.experiment.runner import load_data, run_experiment
from fedmerge.models import build_model

SMALL = ["dataset.max_samples=600"]


def test_gate_weights_are_a_distribution_and_init_matches_the_module():
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        gate = Gate(12, 8)
    state = gate_init(12, 8, gen)
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in gate.state_dict().items()}
    gate = Gate(12, 8)
    gate.load_state_dict(state)
    g = gate(torch.randn(5, 3, 2, 2, generator=gen))
    assert g.shape == (5, 2) and torch.allclose(g.sum(dim=1), torch.ones(5))


def test_resume_is_exact_and_only_the_global_expert_travels(tmp_path):
    cfg = quick_config(*SMALL, "algorithm.name=pfedmoe", "participation=0.5")
    full = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "cut", stop_after=2)
    resumed = run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    assert_runs_identical(full.run_dir, resumed.run_dir)

    server = full.server_state.tensors
    assert not any(k.startswith("classifier") for k in server)  # the body only
    body = sum(v.numel() for v in server.values())
    comm = full.summary["communication_per_client_per_round"]
    assert comm["down"] == comm["up"] == body

    data = load_data(cfg)

    def factory(gen):
        return build_model(cfg.model, data.input_shape, data.num_classes, generator=gen)

    alg = ALGORITHMS.get("pfedmoe").obj(cfg.algorithm, factory, len(data.clients), cfg.seed)
    assert isinstance(alg, PFedMoE)
    states = load_checkpoint(full.run_dir / "checkpoints").client_states
    trained = [c for c, s in states.items() if any(k.startswith("gate/") for k in s.tensors)]
    assert trained
    payloads = alg.configure_evaluate(full.server_state, cfg.rounds, trained)
    model = factory(torch.Generator().manual_seed(0))
    accs = []
    for cid in trained:
        client, state = data.clients[cid], states[cid]
        assert any(k.startswith("local/classifier") for k in state.tensors)
        ctx = ClientContext(model, torch.device("cpu"), cfg.seed, cfg.rounds, cid)
        logits = alg.predict(payloads[cid], client, state, ctx, client.x_test)
        accs.append(float((logits.argmax(dim=1) == client.y_test).float().mean()))
        g = alg.gate_weights(payloads[cid], client, state, ctx)
        assert abs(sum(g) - 1) < 1e-5
        model.load_state_dict(alg.personalize(payloads[cid], client, state, ctx))  # one model's weights
    assert sum(accs) / len(accs) > 0.5, accs  # chance is 0.1
    # the engine evaluated the full network (per-client test accuracies match)
    logged = [json.loads(line) for line in (full.run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    for cid, acc in zip(trained, accs):
        assert abs(logged["eval"]["clients"][str(cid)]["test_acc"] - acc) < 1e-6


def test_client_optimized_parameters_count_both_experts_and_the_gate():
    def factory(gen):
        return build_model({"name": "mlp", "hidden": (4,)}, (3,), 2, generator=gen)

    alg = PFedMoE(ALGORITHMS.get("pfedmoe").config(gate_hidden=5), factory, num_clients=1, seed=0)
    model = sum(p.numel() for p in factory(torch.Generator()).parameters())  # 3*4+4 body, 4*2+2 head
    state = alg.init_client_state(0)
    assert alg.client_optimized_parameters(model, [state]) == 2 * model - 10  # no gate yet
    state.tensors.update({"gate/" + k: v for k, v in gate_init(3, 5, torch.Generator()).items()})
    gate = 2 * 3 + (3 * 5 + 5) + 2 * 5 + (5 * 2 + 2) + 2 * 2
    assert alg.client_optimized_parameters(model, [state]) == 2 * model - 10 + gate
