"""SuPerFed: reduction to FedAvg, the lambda line and its selection, the loss terms, the lambda plot."""

import json

import pytest
import torch
from helpers import assert_runs_identical, quick_config, run

from fedmerge.algorithms.superfed import cos_squared, layer_of, prox_term, sample_lambdas
from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.report.plot_lambda import lambda_curve, plot_lambda, read_rows

LINE = [f"lambda={i / 10:g}" for i in range(11)]


@pytest.mark.parametrize("name", ["superfed_mm", "superfed_lm"])
def test_lambda_zero_nu_mu_zero_is_fedavg(tmp_path, name):
    a = run(quick_config(), tmp_path / "a")
    overrides = [f"algorithm.name={name}", "algorithm.start_round=100", "algorithm.mu=0", "algorithm.nu=0"]
    b = run(quick_config(*overrides), tmp_path / "b")
    assert_runs_identical(a.run_dir, b.run_dir)


def test_mu_term_changes_training_before_mixing(tmp_path):
    a = run(quick_config("rounds=2"), tmp_path / "a")
    b = run(
        quick_config("algorithm.name=superfed_mm", "algorithm.start_round=100", "algorithm.mu=0.5", "rounds=2"),
        tmp_path / "b",
    )
    assert any(not torch.equal(v, b.server_state.tensors[k]) for k, v in a.server_state.tensors.items())


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    cfg = quick_config("algorithm.name=superfed_mm", "algorithm.start_round=2", "rounds=4")
    return run(cfg, tmp_path_factory.mktemp("mm") / "run")


def test_line_is_logged_only_after_mixing_starts_and_best_lambda_is_chosen_on_val(mixed_run):
    rows = read_rows(mixed_run.run_dir)
    for row in rows:
        keys = set(row["eval"]["clients"]["0"])
        has_line = all(f"{k}/test_acc" in keys for k in LINE)
        assert has_line == (row["round"] > 2)
    for metrics in rows[-1]["eval"]["clients"].values():
        best_val = max(metrics[f"{k}/val_acc"] for k in LINE)
        assert metrics["val_acc"] == best_val
        chosen = [
            k for k in LINE if metrics[f"{k}/val_acc"] == best_val and metrics[f"{k}/test_acc"] == metrics["test_acc"]
        ]
        assert chosen  # the personalised model is one of the line's models
    # the local models were trained and differ between clients; w_f at lambda=0 is the global model
    ckpt = load_checkpoint(mixed_run.run_dir / "checkpoints")
    a, b = ckpt.client_states[0].tensors, ckpt.client_states[1].tensors
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert "ece" in " ".join(rows[-1]["summary"])


def test_select_lambda_on_test_is_the_reference_choice(tmp_path):
    cfg = quick_config(
        "algorithm.name=superfed_lm", "algorithm.start_round=1", "algorithm.select_lambda_on=test", "rounds=2"
    )
    rows = read_rows(run(cfg, tmp_path / "t").run_dir)
    for metrics in rows[-1]["eval"]["clients"].values():
        assert metrics["test_acc"] == max(metrics[f"{k}/test_acc"] for k in LINE)


def test_local_models_start_from_their_own_seeded_init(tmp_path):
    from fedmerge.algorithms.superfed import SuPerFedMM, SuPerFedMMConfig
    from fedmerge.models import build_model

    def factory(gen):
        return build_model({"name": "mlp"}, (64,), 10, generator=gen)

    alg = SuPerFedMM(SuPerFedMMConfig(), factory, num_clients=3, seed=0)
    s0, s1 = alg.init_client_state(0).tensors, alg.init_client_state(1).tensors
    assert all(torch.equal(v, alg.init_client_state(0).tensors[k]) for k, v in s0.items())
    assert any(not torch.equal(v, s1[k]) for k, v in s0.items())
    glob = alg.init_server_state().tensors
    assert any(not torch.equal(v, glob[k]) for k, v in s0.items())


def test_lambda_sampling_mm_one_value_lm_one_per_layer():
    names = ["body.1.weight", "body.1.bias", "body.3.weight", "classifier.weight", "classifier.bias"]
    gen = torch.Generator().manual_seed(0)
    mm = sample_lambdas(names, "mm", gen)
    assert len(set(mm.values())) == 1 and 0 <= mm["body.1.weight"] < 1
    lm = sample_lambdas(names, "lm", gen)
    assert len(set(lm.values())) == 3
    assert lm["body.1.weight"] == lm["body.1.bias"] and lm["classifier.weight"] == lm["classifier.bias"]
    assert layer_of("classifier.bias") == "classifier"


def test_regularisers_match_their_definitions():
    wf = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([[2.0]])}
    wl = {"a": torch.tensor([0.0, 1.0]), "b": torch.tensor([[1.0]])}
    # <wf,wl> = 2, |wf|^2 = 5, |wl|^2 = 2 -> cos^2 = 4/10
    assert cos_squared(wf, wl).item() == pytest.approx(0.4)
    assert cos_squared(wf, wl, eps=0.5).item() == pytest.approx((2 + 0.5 * 3) ** 2 / 10)
    anchor = {"a": torch.zeros(2), "b": torch.zeros(1, 1)}
    assert prox_term(wf, anchor, "squared").item() == pytest.approx(5.0)
    assert prox_term(wf, anchor, "layer_norm").item() == pytest.approx(1.0 + 2.0)
    w = {"a": torch.zeros(2, requires_grad=True)}
    prox_term(w, {"a": torch.zeros(2)}, "layer_norm").backward()
    assert torch.equal(w["a"].grad, torch.zeros(2))  # the norm's subgradient at 0 is 0, not NaN


def test_plot_lambda_draws_the_curve(mixed_run, tmp_path):
    curve = lambda_curve(read_rows(mixed_run.run_dir))
    assert curve["lambdas"] == [i / 10 for i in range(11)] and curve["round"] == 4
    assert sum(curve["best_lambda_counts"].values()) == 6
    path = plot_lambda(mixed_run.run_dir, tmp_path / "l.png")
    assert path.exists() and path.stat().st_size > 1000


def test_plot_lambda_explains_runs_without_a_line(tmp_path):
    res = run(quick_config("rounds=1"), tmp_path / "f")
    with pytest.raises(ValueError, match="no lambda"):
        plot_lambda(res.run_dir)
    assert json.loads((res.run_dir / "metrics.jsonl").read_text().splitlines()[0])["round"] == 1
