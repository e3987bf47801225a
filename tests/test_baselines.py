"""Personalisation baselines: exact reductions, the stated training order, and exact resume."""

import json

import pytest
import torch
from helpers import assert_runs_identical, quick_config, run

from fedmerge.algorithms import base as base_module
from fedmerge.algorithms import fedrep as fedrep_module
from fedmerge.algorithms import pfedme as pfedme_module
from fedmerge.algorithms.scaffold import split_control
from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.core.types import ClientState


def client_metrics(run_dir, rnd=None):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    row = rows[-1] if rnd is None else next(r for r in rows if r["round"] == rnd)
    return row["eval"]["clients"]


def test_scaffold_with_control_variates_held_at_zero_is_fedavg(tmp_path):
    a = run(quick_config(), tmp_path / "a")
    b = run(quick_config("algorithm.name=scaffold", "algorithm.control_variates=false"), tmp_path / "b")
    assert_runs_identical(a.run_dir, b.run_dir)


def test_scaffold_run_keeps_controls_and_sends_them(tmp_path):
    # the values of c and c_i are checked by hand in test_client_math.py; here: they exist after a
    # run, every parameter has one, and they travel next to the model
    res = run(quick_config("algorithm.name=scaffold", "participation=0.5"), tmp_path / "s")
    ckpt = load_checkpoint(res.run_dir / "checkpoints")
    model, c = split_control(ckpt.server_state.tensors)
    params = {k for k in model if "running" not in k and "num_batches" not in k}
    assert set(c) == params and all(v.abs().max() > 0 for v in c.values())
    assert all(set(s.tensors) == params for s in ckpt.client_states.values() if s.tensors)
    assert res.summary["communication_per_client_per_round"]["up"] > 1.9 * 2010  # model + control


def test_scaffold_rejects_momentum():
    with pytest.raises(ValueError, match="plain SGD"):
        quick_config("algorithm.name=scaffold", "algorithm.momentum=0.9")


def test_ditto_lambda_zero_is_local_and_its_global_model_is_fedavg(tmp_path):
    local = run(quick_config("algorithm.name=local"), tmp_path / "local")
    ditto = run(quick_config("algorithm.name=ditto", "algorithm.lam=0"), tmp_path / "ditto")
    assert client_metrics(ditto.run_dir) == client_metrics(local.run_dir)  # personal models bit-identical
    fedavg = run(quick_config(), tmp_path / "fedavg")
    for k, v in fedavg.server_state.tensors.items():
        assert torch.equal(v, ditto.server_state.tensors[k]), k


def test_ditto_lambda_to_infinity_is_fedavg(tmp_path):
    # implicit prox step: lam -> inf gives v = w^t, the global model received in round r, i.e.
    # FedAvg's personalised (= global) model evaluated after round r - 1
    fedavg = run(quick_config(), tmp_path / "fedavg")
    ditto = run(
        quick_config("algorithm.name=ditto", "algorithm.lam=1e7", "algorithm.prox_step=implicit"), tmp_path / "d"
    )
    for rnd in (3, 4):
        d, f = client_metrics(ditto.run_dir, rnd), client_metrics(fedavg.run_dir, rnd - 1)
        for cid in d:
            assert d[cid]["test_acc"] == pytest.approx(f[cid]["test_acc"], abs=1e-9)
            assert d[cid]["test_nll"] == pytest.approx(f[cid]["test_nll"], rel=1e-3)


def test_fedrep_needs_head_epochs():
    with pytest.raises(ValueError, match="body_epochs must be below local_epochs"):
        quick_config("algorithm.name=fedrep", "algorithm.local_epochs=1")


def test_ditto_rejects_unstable_explicit_step():
    with pytest.raises(ValueError, match="below 2"):
        quick_config("algorithm.name=ditto", "algorithm.lr=0.2", "algorithm.lam=10")


def test_fedrep_trains_head_then_body_in_the_stated_epochs(tmp_path, monkeypatch):
    calls = []
    real = fedrep_module.local_sgd

    def recording(model, x, y, cfg, gen, **kw):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        stats = real(model, x, y, cfg, gen, **kw)
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        calls.append((cfg.local_epochs, changed, stats.steps, len(y)))
        return stats

    monkeypatch.setattr(fedrep_module, "local_sgd", recording)
    cfg = quick_config("algorithm.name=fedrep", "algorithm.local_epochs=3", "algorithm.body_epochs=1", "rounds=1")
    res = run(cfg, tmp_path / "r")
    assert len(calls) == 2 * 6  # two phases per client
    for head, body in zip(calls[0::2], calls[1::2]):
        assert head[0] == 2 and body[0] == 1  # head epochs first, then body epochs
        assert head[1] == {"classifier.weight", "classifier.bias"}
        assert body[1] and not any(n.startswith("classifier") for n in body[1])
        batches = -(-head[3] // 32)
        assert head[2] in (2 * batches, 2 * batches - 2) and body[2] in (batches, batches - 1)
    row = json.loads((res.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert row["eval"]["clients"]["0"]["test_acc"] > 0


@pytest.mark.parametrize("name,personal", [("fedper", "classifier"), ("fedrep", "classifier"), ("lg_fedavg", "body")])
def test_partial_sharing_keeps_the_personal_part_on_the_client(tmp_path, name, personal):
    res = run(quick_config(f"algorithm.name={name}", "algorithm.local_epochs=2", "rounds=2"), tmp_path / name)
    ckpt = load_checkpoint(res.run_dir / "checkpoints")
    assert all(k.startswith(personal) for s in ckpt.client_states.values() for k in s.tensors)
    assert not any(k.startswith(personal) for k in ckpt.server_state.tensors)
    a, b = ckpt.client_states[0].tensors, ckpt.client_states[1].tensors
    assert any(not torch.equal(a[k], b[k]) for k in a)  # personal parts diverge
    assert res.summary["last"]["clients"]["test_acc"]["mean"] > 0.3


def test_apfl_adaptive_alpha_moves_and_stays_in_unit_interval(tmp_path):
    fixed = run(quick_config("algorithm.name=apfl", "rounds=2"), tmp_path / "f")
    adaptive = run(quick_config("algorithm.name=apfl", "algorithm.adaptive_alpha=true", "rounds=2"), tmp_path / "a")
    fa = load_checkpoint(fixed.run_dir / "checkpoints").client_states
    aa = load_checkpoint(adaptive.run_dir / "checkpoints").client_states
    assert all(s.meta["alpha"] == 0.5 for s in fa.values())
    alphas = [s.meta["alpha"] for s in aa.values()]
    assert all(0 <= a <= 1 for a in alphas) and any(a != 0.5 for a in alphas)


def test_pfedme_personal_model_differs_from_global_and_counts_outer_steps(tmp_path, monkeypatch):
    calls = []  # (outer?, steps taken) of every local_sgd call, inner ones first (they run inside the outer)
    real = pfedme_module.local_sgd

    def recording(model, x, y, cfg, gen, **kw):
        stats = real(model, x, y, cfg, gen, **kw)
        calls.append(("before_forward" in kw, stats.steps))
        return stats

    monkeypatch.setattr(pfedme_module, "local_sgd", recording)  # the inner solves
    monkeypatch.setattr(base_module, "local_sgd", recording)  # the outer steps (client_sgd)
    # workers=1: the recording patch lives in this process (a forked worker's calls would not come back)
    cfg = quick_config("algorithm.name=pfedme", "algorithm.local_steps=4", "algorithm.lr=0.05", "rounds=2", "workers=1")
    res = run(cfg, tmp_path / "p")
    # per client and round: 4 outer steps, each one inner solve of inner_steps (5) steps
    assert calls == ([(False, 5)] * 4 + [(True, 4)]) * (6 * 2)
    ckpt = load_checkpoint(res.run_dir / "checkpoints")
    theta = ckpt.client_states[0].tensors
    assert any(not torch.equal(theta[k], ckpt.server_state.tensors[k]) for k in theta)
    rows = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["summary"]["test_acc"]["mean"] > 0.2


def test_client_states_round_trip_through_bytes(tmp_path):
    res = run(quick_config("algorithm.name=apfl", "algorithm.adaptive_alpha=true", "rounds=1"), tmp_path / "b")
    state = load_checkpoint(res.run_dir / "checkpoints").client_states[0]
    back = ClientState.from_bytes(state.to_bytes())
    assert back.meta == state.meta and all(torch.equal(back.tensors[k], v) for k, v in state.tensors.items())


RESUME_CASES = {
    "superfed_mm": ["algorithm.name=superfed_mm", "algorithm.start_round=2", "participation=0.5"],
    "superfed_lm": ["algorithm.name=superfed_lm", "algorithm.start_round=1", "algorithm.prox=layer_norm"],
    "scaffold": ["algorithm.name=scaffold", "participation=0.5"],
    "lg_fedavg": ["algorithm.name=lg_fedavg"],
    "fedper": ["algorithm.name=fedper", "participation=0.5"],
    "fedrep": ["algorithm.name=fedrep", "algorithm.local_epochs=2"],
    "apfl": ["algorithm.name=apfl", "algorithm.adaptive_alpha=true", "participation=0.5"],
    "pfedme": ["algorithm.name=pfedme", "algorithm.local_steps=3", "algorithm.lr=0.05"],
    "ditto": ["algorithm.name=ditto", "algorithm.lam=1", "participation=0.5"],
}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_stop_and_resume_is_bit_identical(tmp_path, case):
    cfg = quick_config("rounds=4", *RESUME_CASES[case])
    full = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "cut", stop_after=2)
    resumed = run(cfg, tmp_path / "cut", resume=True)
    assert_runs_identical(full.run_dir, resumed.run_dir)


def test_apfl_evaluates_the_output_mixture(tmp_path):
    from torch.func import functional_call

    from fedmerge.models import build_model
    from fedmerge.run.prepare import load_data

    cfg = quick_config("algorithm.name=apfl", "algorithm.alpha=0.3", "rounds=2")
    res = run(cfg, tmp_path / "o")
    ckpt = load_checkpoint(res.run_dir / "checkpoints")
    data = load_data(cfg)
    model = build_model(cfg.model, data.input_shape, data.num_classes).eval()
    logged = json.loads((res.run_dir / "metrics.jsonl").read_text().splitlines()[-1])["eval"]["clients"]
    for cid, client in enumerate(data.clients):
        v, w = ckpt.client_states[cid].tensors, ckpt.server_state.tensors
        with torch.no_grad():
            out = 0.3 * functional_call(model, v, (client.x_test,)) + 0.7 * functional_call(model, w, (client.x_test,))
        acc = float((out.argmax(1) == client.y_test).float().mean())
        assert abs(logged[str(cid)]["test_acc"] - acc) < 1e-6
    params = run(
        quick_config("algorithm.name=apfl", "algorithm.alpha=0.3", "algorithm.personal_eval=mixture", "rounds=2"),
        tmp_path / "p",
    )
    assert params.summary["last"]["clients"]["test_nll"] != res.summary["last"]["clients"]["test_nll"]
