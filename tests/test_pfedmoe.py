"""pFedMoE: only the global expert travels, the full model learns, exact resume."""

import json

import torch
from helpers import assert_runs_identical, quick_config, run

from fedmerge.algorithms import ALGORITHMS
from fedmerge.algorithms.pfedmoe import Gate, PFedMoE, gate_init
from fedmerge.core.algorithm import ClientContext
from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.models import build_model
from fedmerge.run.prepare import load_data
from fedmerge.run.runner import run_experiment

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


def test_client_step_is_plain_end_to_end_sgd_on_the_mixture():
    """One client update equals full-batch SGD, written out here, on CE(head(g0*h_glob + g1*h_loc)):
    the global expert's body, the local expert (body and head) and the gate all move; the global
    expert's own head does not; only the global body is uploaded."""
    from fedmerge.algorithms.pfedmoe import MoE
    from fedmerge.core.seeding import NO_ROUND, torch_generator
    from fedmerge.core.types import Payload
    from fedmerge.data.federated import ClientData

    def factory(gen):
        return build_model({"name": "mlp", "hidden": (6,)}, (5,), 3, generator=gen)

    cfg = ALGORITHMS.get("pfedmoe").config(lr=0.3, local_epochs=3, batch_size=64, gate_hidden=4)
    alg = PFedMoE(cfg, factory, num_clients=2, seed=7)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(20, 5, generator=gen), torch.randint(0, 3, (20,), generator=gen)
    data = ClientData(1, x, y, x[:4], y[:4], x[:4], y[:4])
    server = alg.init_server_state()
    state = alg.init_client_state(1)
    ctx = ClientContext(factory(torch.Generator()), torch.device("cpu"), 7, 1, 1)
    update, new_state = alg.client_update(Payload(server.tensors, {"round": 1}), data, state, ctx)

    # The same network, built by hand from the same initial weights, trained by hand.
    glob, loc = factory(torch.Generator()), factory(torch.Generator())
    glob.load_state_dict({**glob.state_dict(), **server.tensors})
    loc.load_state_dict({k[len("local/") :]: v for k, v in state.tensors.items()})
    gate = Gate(5, 4)
    gate.load_state_dict(gate_init(5, 4, torch_generator(7, NO_ROUND, 1, "pfedmoe/gate")))
    moe = MoE(glob, loc, gate)
    head_before = {k: v.clone() for k, v in glob.state_dict().items() if k.startswith("classifier")}
    params = [p for n, p in moe.named_parameters() if not n.startswith("global_expert.classifier")]
    moe.train()
    for _ in range(3):  # full batch: one step per epoch, the order of samples does not matter
        moe.zero_grad()
        torch.nn.functional.cross_entropy(moe(x), y).backward()
        with torch.no_grad():
            for p in params:
                p -= 0.3 * p.grad

    assert set(update.tensors) == {k for k in glob.state_dict() if not k.startswith("classifier")}
    for k, v in update.tensors.items():
        torch.testing.assert_close(v, glob.state_dict()[k], rtol=1e-5, atol=1e-6)
        assert not torch.equal(v, server.tensors[k])  # the global expert learned
    for k, v in loc.state_dict().items():
        torch.testing.assert_close(new_state.tensors["local/" + k], v, rtol=1e-5, atol=1e-6)
    for k, v in gate.state_dict().items():
        torch.testing.assert_close(new_state.tensors["gate/" + k], v, rtol=1e-5, atol=1e-6)
    for k, v in head_before.items():
        assert torch.equal(glob.state_dict()[k], v)


def _tiny_pfedmoe():
    """A 2-client pFedMoE on an MLP 5-6-3 whose client updates are full-batch SGD (batch > n)."""

    def factory(gen):
        return build_model({"name": "mlp", "hidden": (6,)}, (5,), 3, generator=gen)

    cfg = ALGORITHMS.get("pfedmoe").config(lr=0.3, local_epochs=2, batch_size=64, gate_hidden=4)
    alg = PFedMoE(cfg, factory, num_clients=2, seed=7)
    return alg, factory


def _client_data(cid: int, n: int):
    from fedmerge.data.federated import ClientData

    gen = torch.Generator().manual_seed(10 + cid)
    x, y = torch.randn(n + 6, 5, generator=gen), torch.randint(0, 3, (n + 6,), generator=gen)
    return ClientData(cid, x[:n], y[:n], x[n : n + 3], y[n : n + 3], x[n + 3 :], y[n + 3 :])


def test_two_rounds_carry_client_state_and_average_the_global_expert_by_n_i():
    """Two rounds of two clients (20 and 12 samples) against an independent reference: each client keeps
    its own modules (local expert, head, gate with its BatchNorm buffers) across rounds and trains
    all of them by hand; the server is the n_i-weighted mean of the uploaded global bodies, which is
    what every client starts round 2 from and what the round-2 evaluation mixes in."""
    from fedmerge.algorithms.pfedmoe import MoE
    from fedmerge.core.seeding import NO_ROUND, torch_generator

    alg, factory = _tiny_pfedmoe()
    data = {0: _client_data(0, 20), 1: _client_data(1, 12)}
    server = alg.init_server_state()
    states = {c: alg.init_client_state(c) for c in data}

    # the reference: one hand-built network per client, kept between rounds
    ref: dict[int, MoE] = {}
    for c in data:
        loc = factory(torch.Generator())
        loc.load_state_dict({k[len("local/") :]: v for k, v in states[c].tensors.items()})
        gate = Gate(5, 4)
        gate.load_state_dict(gate_init(5, 4, torch_generator(7, NO_ROUND, c, "pfedmoe/gate")))
        ref[c] = MoE(factory(torch.Generator()), loc, gate)
    ref_server = {k: v.clone() for k, v in server.tensors.items()}

    for rnd in (1, 2):
        payloads = alg.configure(server, rnd, [0, 1])
        updates = {}
        for c in (0, 1):  # interleaved clients share the algorithm's cached network
            ctx = ClientContext(factory(torch.Generator()), torch.device("cpu"), 7, rnd, c)
            updates[c], states[c] = alg.client_update(payloads[c], data[c], states[c], ctx)
        server = alg.aggregate(server, rnd, updates)

        uploads = {}
        for c, moe in ref.items():
            moe.global_expert.load_state_dict(ref_server, strict=False)
            params = [p for n, p in moe.named_parameters() if not n.startswith("global_expert.classifier")]
            moe.train()
            for _ in range(2):  # full batch: one step per epoch
                moe.zero_grad()
                torch.nn.functional.cross_entropy(moe(data[c].x_train), data[c].y_train).backward()
                with torch.no_grad():
                    for p in params:
                        p -= 0.3 * p.grad
            uploads[c] = {k: moe.global_expert.state_dict()[k].clone() for k in ref_server}
        ref_server = {k: (20 * uploads[0][k] + 12 * uploads[1][k]) / 32 for k in ref_server}
        uniform = {k: (uploads[0][k] + uploads[1][k]) / 2 for k in ref_server}

        assert server.tensors.keys() == ref_server.keys()
        for k, v in ref_server.items():
            torch.testing.assert_close(server.tensors[k], v, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(server.tensors[k], uniform[k], rtol=1e-5, atol=1e-6)  # n_i matters
        for c, moe in ref.items():
            expected = {
                **{"local/" + k: v for k, v in moe.local_expert.state_dict().items()},
                **{"gate/" + k: v for k, v in moe.gate.state_dict().items()},
            }
            assert states[c].tensors.keys() == expected.keys()
            for k, v in expected.items():
                torch.testing.assert_close(states[c].tensors[k], v, rtol=1e-5, atol=1e-6, msg=f"{rnd} {c} {k}")
    assert int(states[0].tensors["gate/bn1.num_batches_tracked"]) == 4  # 2 rounds x 2 steps, carried over

    # the round-2 evaluation: the averaged global expert in the client's own network, eval mode
    payloads = alg.configure_evaluate(server, 2, [0, 1])
    for c, moe in ref.items():
        moe.global_expert.load_state_dict(ref_server, strict=False)
        moe.eval()
        with torch.no_grad():
            expected = moe(data[c].x_test)
        ctx = ClientContext(factory(torch.Generator()), torch.device("cpu"), 7, 2, c)
        got = alg.predict(payloads[c], data[c], states[c], ctx, data[c].x_test)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_each_clients_predictor_keeps_its_own_weights():
    """personalize_variants of client 0, then of client 1: client 0's predictor still gives client 0's
    logits (the algorithm reuses one network object for all clients)."""
    alg, factory = _tiny_pfedmoe()
    data = {0: _client_data(0, 20), 1: _client_data(1, 12)}
    server = alg.init_server_state()
    states = {}
    for c in data:
        ctx = ClientContext(factory(torch.Generator()), torch.device("cpu"), 7, 1, c)
        _, states[c] = alg.client_update(alg.configure(server, 1, [c])[c], data[c], alg.init_client_state(c), ctx)
    payloads = alg.configure_evaluate(server, 1, [0, 1])
    ctxs = {c: ClientContext(factory(torch.Generator()), torch.device("cpu"), 7, 1, c) for c in data}
    variants = {c: alg.personalize_variants(payloads[c], data[c], states[c], ctxs[c]) for c in data}
    x = data[0].x_test
    own = alg.predict(payloads[0], data[0], states[0], ctxs[0], x)
    other = alg.predict(payloads[1], data[1], states[1], ctxs[1], x)
    assert not torch.allclose(own, other)
    assert torch.equal(variants[0][""](x), own)
