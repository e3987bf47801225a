"""fedmerge tune: search spaces from the schema, equal budgets, resumable studies, test split never read."""

from __future__ import annotations

import pytest
import torch
import yaml
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.config.schema import ConfigError, load_config
from fedmerge.config.tuned import load_tuned_config
from fedmerge.run import data_plan, runner
from fedmerge.sweep.tune import Param, default_space, load_space_file, space_for

optuna = pytest.importorskip("optuna", reason="pip install -e '.[tune]'")

TINY = ["rounds=2", "partition.num_clients=4", "algorithm.local_epochs=1", "threads=1"]


def test_default_space_from_the_schema():
    # the built-in default config trains FedAvg with lr=0.2: a factor of ten either side, log scale
    assert default_space(load_config().algorithm) == {"algorithm.lr": Param(0.02, 2.0, log=True)}
    apfl = default_space(load_config(None, ["algorithm.name=apfl", "algorithm.lr=0.05"]).algorithm)
    assert apfl["algorithm.alpha"] == Param(0.0, 1.0)  # bounded within [0, 1]: uniform over the range
    assert apfl["algorithm.alpha_decay"] == Param(0.002, pytest.approx(0.2), log=True)
    assert "algorithm.momentum" not in apfl and "algorithm.alpha_lr" not in apfl  # 0 and None: no scale
    assert "algorithm.local_epochs" not in apfl and "algorithm.batch_size" not in apfl  # budget, not tuned
    pfedme = default_space(load_config(None, ["algorithm.name=pfedme"]).algorithm)
    assert pfedme["algorithm.lam"] == Param(1.5, 150.0, log=True)
    topk = default_space(load_config(None, ["algorithm.name=fedmerge"]).algorithm)["algorithm.merge_grad_topk"]
    assert 0 < topk.low < 1e-5 and topk.high == 1.0 and not topk.log  # (0, 1]: the open end excluded


def test_user_space_overrides_adds_and_removes_keys(tmp_path):
    space_file = tmp_path / "space.yaml"
    space_file.write_text(
        yaml.safe_dump(
            {
                "*": {"algorithm.lr": {"low": 0.001, "high": 0.1, "log": True}},
                "ditto": {"algorithm.lam": None, "algorithm.local_epochs": {"low": 1, "high": 3, "type": "int"}},
            }
        )
    )
    user = load_space_file(space_file)
    ditto = space_for(load_config(None, ["algorithm.name=ditto"]), user, None)
    assert ditto == {
        "algorithm.lr": Param(0.001, 0.1, log=True),
        "algorithm.local_epochs": Param(1.0, 3.0, integer=True),
    }
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"fedavg": {"algorithm.lam": {"low": 0.1, "high": 1}}}))
    with pytest.raises(ConfigError, match="search space of fedavg: algorithm.lam: unknown key"):
        space_for(load_config(), load_space_file(bad), None)
    bad.write_text(yaml.safe_dump({"fedavg": {"algorithm.momentum": {"low": 0.1, "high": 1.5}}}))
    with pytest.raises(ConfigError, match="algorithm.momentum: Input should be less than 1"):
        space_for(load_config(), load_space_file(bad), None)
    bad.write_text(yaml.safe_dump({"fedavg": {"algorithm.lr": {"low": 0.0, "high": 1, "log": True}}}))
    with pytest.raises(ConfigError, match="low > 0 with log"):
        load_space_file(bad)
    # Ditto refuses personal_lr * lam >= 2 across fields: such points are skipped by the trials, the space stands
    assert "algorithm.lam" in space_for(load_config(None, ["algorithm.name=ditto"]), {}, None)


def _tune(out, *extra: str, trials: int = 2):
    args = ["tune", *TINY, *extra, "--trials", str(trials), "--out", str(out)]
    return CliRunner().invoke(app, args)


def _trials(out, method):
    study = optuna.load_study(study_name=method, storage=f"sqlite:///{out / 'study.db'}")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    return [(t.params, t.value) for t in done]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "study"
    result = _tune(out, "algorithm.name=[fedavg,local]")
    assert result.exit_code == 0, result.output
    return out


def test_tune_gives_every_method_the_same_budget_and_writes_usable_overrides(tuned):
    best = yaml.safe_load((tuned / "best.yaml").read_text())
    assert list(best["methods"]) == ["fedavg", "local"]
    for method in ("fedavg", "local"):
        trials = _trials(tuned, method)
        assert len(trials) == 2 == best["methods"][method]["trials"]
        params, value = max(trials, key=lambda t: t[1])
        assert best["methods"][method]["value"] == value
        assert best["methods"][method]["overrides"] == [f"algorithm.lr={params['algorithm.lr']}"]
    # fedmerge run --tuned / sweep --tuned read it; an explicit override still wins
    lr = float(best["methods"]["local"]["overrides"][0].split("=")[1])
    assert load_tuned_config(None, ["algorithm.name=local"], tuned / "best.yaml").algorithm.lr == lr
    assert load_tuned_config(None, ["algorithm.lr=0.3"], tuned / "best.yaml").algorithm.lr == 0.3


def test_the_test_split_is_never_evaluated_while_tuning(tuned):
    trial_files = [p for name in ("metrics.jsonl", "summary.json") for p in (tuned / "trials").glob(f"*/*/{name}")]
    assert len(trial_files) == 2 * 2 * 2  # of four trials
    for path in trial_files:
        text = path.read_text()
        assert "test_" not in text and '"global"' not in text.replace('"global": null', ""), path
        assert "val_acc" in text


def test_tuning_result_does_not_change_when_test_labels_are_poisoned(tuned, tmp_path, monkeypatch):
    clean_load = data_plan.load_data

    def poisoned(cfg):
        data = clean_load(cfg)
        for c in data.clients:  # every test label wrong, every test input noise
            c.y_test = (c.y_test + 1) % data.num_classes
            c.x_test = torch.randn_like(c.x_test)
        return data

    cfg = load_config(None, TINY)
    honest = runner.run_experiment(cfg, tmp_path / "honest", show_progress=False).summary
    monkeypatch.setattr(data_plan, "load_data", poisoned)
    spoiled = runner.run_experiment(cfg, tmp_path / "spoiled", show_progress=False).summary
    # the poison is real: a run that reads its test split sees it
    assert spoiled["last"]["clients"]["test_acc"]["mean"] < honest["last"]["clients"]["test_acc"]["mean"] - 0.3

    result = _tune(tmp_path / "poisoned", "algorithm.name=[fedavg,local]")
    assert result.exit_code == 0, result.output
    for method in ("fedavg", "local"):
        assert _trials(tmp_path / "poisoned", method) == _trials(tuned, method)


def test_tuning_resumes_and_refuses_a_changed_study(tuned, tmp_path):
    out = tmp_path / "study"
    assert _tune(out, "algorithm.name=[local]", trials=1).exit_code == 0
    first = _trials(out, "local")
    result = _tune(out, "algorithm.name=[local]", trials=2)
    assert result.exit_code == 0, result.output
    again = _trials(out, "local")
    assert len(again) == 2 and again[0] == first[0]  # one more trial, the first one kept
    assert again[1][0] != again[0][0]  # a resumed study draws a new point
    changed = CliRunner().invoke(app, ["tune", *TINY, "rounds=3", "algorithm.name=[local]", "--out", str(out)])
    assert changed.exit_code == 2 and "made with another config" in changed.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--metric", "test_acc"], "--metric: expected one of val_acc, val_nll"),
        (["seed=[0,1]"], "seed: tune takes a list only for algorithm.name"),
        (["split.val_fraction=0"], "tuning needs a validation split"),
    ],
)
def test_tune_refusals_are_one_line(tmp_path, args, message):
    result = CliRunner().invoke(app, ["tune", *TINY, *args, "--out", str(tmp_path / "t")])
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "t" / "trials").exists()


def test_show_space_prints_each_methods_space():
    result = CliRunner().invoke(app, ["tune", "algorithm.name=[fedavg,ditto]", "--show-space"])
    assert result.exit_code == 0
    assert "fedavg: algorithm.lr float [0.02, 2] log" in result.output
    assert "ditto: algorithm.lam float [0.1, 10] log" in result.output
