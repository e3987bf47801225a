"""log.tensorboard: per-round scalars equal to metrics.jsonl, and no round twice after a resume."""

from __future__ import annotations

import pytest

from fedmerge.config.schema import load_config, to_yaml
from fedmerge.run.results import RunStore
from fedmerge.run.resume import config_digest
from fedmerge.run.runner import run_experiment

TINY = ["rounds=3", "partition.num_clients=4", "algorithm.local_epochs=1", "threads=1"]


def _scalars(run_dir):
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator", reason="pip install -e '.[tensorboard]'"
    )
    acc = accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_match_the_metrics_and_survive_a_resume(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install -e '.[tensorboard]'")
    cfg = load_config(None, [*TINY, "log.tensorboard=true"])
    run_experiment(cfg, tmp_path / "run", show_progress=False, stop_after=2)
    run_experiment(cfg, tmp_path / "run", show_progress=False, resume=True)
    rows = RunStore(tmp_path / "run").read_metrics()
    scalars = _scalars(tmp_path / "run")
    assert scalars["train/loss"] == [(r["round"], pytest.approx(r["train_loss"], rel=1e-6)) for r in rows]
    for tag, key, stat in [("test/acc_mean", "test_acc", "mean"), ("test/acc_worst10", "test_acc", "worst10")]:
        assert scalars[tag] == [(r["round"], pytest.approx(r["summary"][key][stat], rel=1e-6)) for r in rows]
    assert [step for step, _ in scalars["val/nll_mean"]] == [1, 2, 3]


def test_log_section_changes_neither_the_config_file_nor_the_digest():
    plain, logged = load_config(None, TINY), load_config(None, [*TINY, "log.tensorboard=true"])
    assert "log" not in to_yaml(plain)  # run folders made before the option look the same
    assert config_digest(plain) == config_digest(logged)  # a run may be resumed with or without it
