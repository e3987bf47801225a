"""fedmerge sweep: grid expansion, refusal of bad keys, comparison tables, parallel resumable runs."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
import yaml
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.config.schema import ConfigError
from fedmerge.config.tuned import load_tuned_config
from fedmerge.report.compare import DONE, FAILED, RunRecord, compare, paired_p_value, to_csv, to_markdown
from fedmerge.run.provenance import read_provenance
from fedmerge.run.runner import run_experiment
from fedmerge.sweep.progress import eta_seconds, format_duration
from fedmerge.sweep.runner import prepare, sweep_records
from fedmerge.sweep.spec import expand, spec_from_args

TINY = ["rounds=2", "partition.num_clients=4", "algorithm.local_epochs=1"]


def test_cli_lists_become_grid_axes_and_scalars_stay_fixed():
    spec = spec_from_args(["algorithm.name=[fedavg,ditto]", "seed=[0,1,2]", "rounds=3", "model.hidden=[[64,32]]"])
    assert spec.grid == {"algorithm.name": ["fedavg", "ditto"], "seed": [0, 1, 2], "model.hidden": [[64, 32]]}
    assert spec.overrides == ("rounds=3",)
    points = expand(spec)
    assert len(points) == 6
    assert {p.method for p in points} == {"fedavg", "ditto"}
    assert sorted({p.seed for p in points}) == [0, 1, 2]
    # model.hidden is a setting key (not algorithm.*, not seed); the list value reaches the config
    assert {p.setting for p in points} == {"model.hidden=[64, 32]"}
    assert all(p.config.model.hidden == (64, 32) and p.config.rounds == 3 for p in points)
    assert len({p.key for p in points}) == 6
    assert "ditto__hidden-64-32__s2" in {p.key for p in points}


def test_sweep_file_methods_and_settings(tmp_path):
    (tmp_path / "base.yaml").write_text("rounds: 2\npartition: {name: dirichlet, num_clients: 4, alpha: 0.5}\n")
    sweep_file = tmp_path / "study.yaml"
    sweep_file.write_text(
        yaml.safe_dump(
            {
                "config": "base.yaml",  # relative to the sweep file
                "overrides": ["algorithm.local_epochs=1"],
                "grid": {"partition.alpha": [0.1, 1.0], "seed": [0, 1]},
                "methods": {
                    "prox-strong": ["algorithm.name=fedprox", "algorithm.mu=1.0"],
                    "plain": {"algorithm.lr": 0.1},
                },
            }
        )
    )
    points = expand(spec_from_args([str(sweep_file)]))
    assert len(points) == 8
    strong = [p for p in points if p.method == "prox-strong"]
    assert all(p.config.algorithm.name == "fedprox" and p.config.algorithm.mu == 1.0 for p in strong)
    plain = [p for p in points if p.method == "plain"]
    assert all(p.config.algorithm.name == "fedavg" and p.config.algorithm.lr == 0.1 for p in plain)
    assert {p.setting for p in points} == {"partition.alpha=0.1", "partition.alpha=1.0"}
    assert all(p.config.algorithm.local_epochs == 1 and p.config.rounds == 2 for p in points)


def test_algorithm_hyperparameters_in_the_grid_are_method_variants():
    points = expand(spec_from_args(["algorithm.name=[fedprox]", "algorithm.mu=[0.01,0.1]"]))
    assert [p.method for p in points] == ["fedprox mu=0.01", "fedprox mu=0.1"]
    assert {p.setting for p in points} == {"digits, dirichlet"}


@pytest.mark.parametrize(
    "args, named",
    [
        (["algorithm.name=[fedavg,local]", "sed=[0,1]"], "grid key sed: unknown key; did you mean seed?"),
        (["algorithm.name=[fedavg,ditto]", "algorithm.lam=[0.1,1.0]"], "grid key algorithm.lam: unknown key"),
        (["seed=[0,1]", "partitio.num_clients=4"], "override partitio: unknown key"),
        (["seed=[]"], "grid key seed: expected a non-empty list"),
    ],
)
def test_bad_grid_keys_are_refused_before_any_run(tmp_path, args, named):
    out = tmp_path / "sweep"
    result = CliRunner().invoke(app, ["sweep", *args, "--out", str(out)])
    assert result.exit_code == 2
    assert named in result.output
    assert len(result.output.strip().splitlines()) == 1  # one line, no traceback
    assert not out.exists()  # nothing was started or written


def _records(method: str, accs: dict[int, float], last: dict[int, float] | None = None) -> list[RunRecord]:
    out = []
    for seed, acc in accs.items():
        summary = {
            "best_val": {"clients": {"test_acc": {"mean": acc, "worst10": acc - 0.1}}},
            "last": {"clients": {"test_acc": {"mean": (last or accs)[seed], "worst10": 0.0}}},
            "parameter_budget": {
                "client_optimized": 100.0,
                "down_per_client_round": 10.0,
                "up_per_client_round": 5.0,
                "server_stored": 10.0,
            },
        }
        out.append(RunRecord(f"{method}-{seed}", method, "s", seed, DONE, None, summary))
    return out


def test_paired_t_test_matches_the_closed_form():
    # differences 0.10, 0.05, 0.05: mean 1/15, sd 0.05/sqrt(3), t = 4 with 2 degrees of freedom, whose
    # CDF is 1/2 + t / (2 sqrt(t^2 + 2)); two-sided p = 1 - 4 / sqrt(18)
    p, n = paired_p_value({0: 0.80, 1: 0.90, 2: 0.85}, {0: 0.70, 1: 0.85, 2: 0.80})
    assert n == 3
    assert p == pytest.approx(1 - 4 / math.sqrt(18), rel=1e-9)
    assert paired_p_value({0: 0.8}, {0: 0.7}) == (None, 1)  # one pair: no test
    assert paired_p_value({0: 0.8, 1: 0.9}, {0: 0.7, 1: 0.8}) == (None, 2)  # constant difference: t undefined


def test_comparison_table_mean_std_best_and_failures():
    records = _records("a", {0: 0.80, 1: 0.90, 2: 0.85}) + _records("b", {0: 0.70, 1: 0.85, 2: 0.80})
    records += [RunRecord("c-0", "c", "s", 0, FAILED, error="boom (exit 1)")]
    (table,) = compare(records)
    assert table.best == "a"
    a, b, c = table.rows
    assert a.best_val.mean == pytest.approx(0.85) and a.best_val.std == pytest.approx(0.05)  # sample std
    assert b.p_value == pytest.approx(1 - 4 / math.sqrt(18)) and b.n_paired == 3
    assert a.p_value is None and c.best_val is None
    assert b.worst10.mean == pytest.approx(0.78333333 - 0.1)
    md = to_markdown([table])
    assert "| a | 3 | 85.00 ± 5.00 | 85.00 ± 5.00 | 75.00 ± 5.00 | best | 100 | 15 | 10 |" in md
    assert "| c | 0 (1 failed) | failed | failed | failed | - |" in md
    assert "- `c-0` (seed 0): boom (exit 1)" in md
    rows = list(csv.DictReader(io.StringIO(to_csv([table]))))
    assert [r["method"] for r in rows] == ["a", "b", "c"]
    assert float(rows[1]["best_val_mean"]) == pytest.approx(0.7833333333)
    assert rows[0]["is_best"] == "1" and rows[2]["seeds_failed"] == "1" and rows[2]["best_val_mean"] == ""


def test_eta_from_rounds_done():
    assert eta_seconds(10.0, 0, 5) is None
    assert eta_seconds(10.0, 2, 6) == pytest.approx(30.0)
    assert format_duration(None) == "ETA --" and format_duration(75) == "ETA 1:15"
    assert format_duration(3725) == "ETA 1:02:05"


def test_tuned_values_apply_per_algorithm_and_explicit_overrides_win(tmp_path):
    tuned = tmp_path / "tuned.yaml"
    values = ["algorithm.lr=0.01", "algorithm.momentum=0.5"]
    tuned.write_text(yaml.safe_dump({"methods": {"fedavg": {"overrides": values}}}))
    cfg = load_tuned_config(None, ["rounds=2"], tuned)
    assert cfg.algorithm.lr == 0.01 and cfg.algorithm.momentum == 0.5 and cfg.rounds == 2
    cfg = load_tuned_config(None, ["algorithm.lr=0.3"], tuned)
    assert cfg.algorithm.lr == 0.3 and cfg.algorithm.momentum == 0.5
    with pytest.raises(ConfigError, match="has no tuned values for algorithm 'ditto' \\(it has: fedavg\\)"):
        load_tuned_config(None, ["algorithm.name=ditto"], tuned)


def test_run_dir_that_holds_a_run_is_refused(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("seed: 0\n")
    for option in ("--out", "--run-dir"):  # --run-dir: the former name, in older runs' provenance
        result = CliRunner().invoke(app, ["run", "rounds=1", option, str(run_dir), "--no-progress"])
        assert result.exit_code == 2
        assert f"--out {run_dir} already holds a run" in result.output
        assert f"fedmerge run --resume {run_dir}" in result.output


def test_out_and_its_former_name_together_are_refused(tmp_path):
    args = ["run", "rounds=1", "--out", str(tmp_path / "a"), "--run-dir", str(tmp_path / "b"), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "former name of --out" in result.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_sweep_runs_in_parallel_skips_finished_resumes_stopped_and_records_failures(tmp_path):
    """Four runs (two methods x two seeds) in two workers. Before the sweep starts, one run is
    finished, one stopped after round 1, and one stopped with its checkpoint then corrupted: the
    sweep must skip the first, resume the second from its checkpoint, start the fourth afresh, and
    record the third as failed without stopping the others."""
    out = tmp_path / "sweep"
    spec = spec_from_args([*TINY, "algorithm.name=[fedavg,local]", "seed=[0,1]"])
    points = {p.key: p for p in prepare(spec, out)}
    assert sorted(points) == ["fedavg__s0", "fedavg__s1", "local__s0", "local__s1"]
    run_experiment(points["fedavg__s0"].config, out / "runs" / "fedavg__s0", show_progress=False)
    for key in ("local__s0", "local__s1"):
        run_experiment(points[key].config, out / "runs" / key, show_progress=False, stop_after=1)
    (out / "runs" / "local__s1" / "checkpoints" / "round-000001.safetensors").write_bytes(b"not a checkpoint")

    args = ["sweep", *TINY, "algorithm.name=[fedavg,local]", "seed=[0,1]", "--out", str(out), "-j", "2"]
    result = CliRunner().invoke(app, [*args, "--no-progress"])
    assert result.exit_code == 1, result.output
    assert "1 of 3 runs failed" in result.output  # the finished run was not run again
    assert "(2 at a time, " in result.output and "core(s) each, for the runs' worker processes" in result.output

    assert len(read_provenance(out / "runs" / "fedavg__s0")) == 1  # skipped: no second segment
    resumed = read_provenance(out / "runs" / "local__s0")
    assert [(s["resumed"], s["start_round"]) for s in resumed] == [(False, 0), (True, 1)]
    assert resumed[1]["command"] == f"fedmerge run --resume {out / 'runs' / 'local__s0'} --no-progress"
    (fresh,) = read_provenance(out / "runs" / "fedavg__s1")
    assert fresh["command"].startswith("fedmerge run rounds=2 partition.num_clients=4 algorithm.local_epochs=1 ")
    assert fresh["command"].endswith(f"--out {out / 'runs' / 'fedavg__s1'} --no-progress")
    # the two jobs share the cores as FEDMERGE_CORES for each run's workers: auto; threads stay 1, as in a plain run
    saved = yaml.safe_load((out / "runs" / "fedavg__s1" / "config.yaml").read_text())
    assert "threads=" not in fresh["command"] and saved["threads"] == 1 and saved["workers"] == "auto"

    records = {r.key: r for r in sweep_records(out)}
    assert {k: r.status for k, r in records.items()} == {
        "fedavg__s0": DONE,
        "fedavg__s1": DONE,
        "local__s0": DONE,
        "local__s1": FAILED,
    }
    assert "is corrupt or truncated" in records["local__s1"].error
    assert records["local__s1"].error.endswith("(exit 2)")  # a damaged checkpoint is an input error
    assert json.loads((out / "runs" / "local__s0" / "summary.json").read_text())["rounds_completed"] == 2
    md = (out / "results.md").read_text()
    assert "| local | 1 (1 failed) |" in md and "| fedavg | 2 |" in md
    assert "- `local__s1` (seed 1):" in md and (out / "results.csv").is_file()
