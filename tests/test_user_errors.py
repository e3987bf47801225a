"""A user's mistakes end in one line and a non-zero exit, never a traceback; bad updates never
reach the global model; a resumed run says where it continues and refuses to silently restart."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import quick_config, run
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.config.schema import ConfigError
from fedmerge.core.checkpoint import CheckpointError
from fedmerge.core.loop import RoundFailed, Schedule, run_rounds, screen_updates
from fedmerge.core.types import Payload, ServerState, Update
from fedmerge.run.prepare import check_compatibility
from fedmerge.run.results import RunStore
from fedmerge.run.runner import run_experiment

CONFIGS = Path(__file__).parent.parent / "configs"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 2-round run (not FedMerge, not SuPerFed)."""
    out = tmp_path_factory.mktemp("finished")
    return run(quick_config("rounds=2", "threads=1"), out / "run").run_dir


def bad_invocations(tmp: Path, run_dir: Path) -> list[list[str]]:
    (tmp / "empty").mkdir()
    (tmp / "file.txt").write_text("not yaml: [")
    (tmp / "binary.yaml").write_bytes(b"\xff\xfe\x00\x01")
    (tmp / "not.npz").write_bytes(b"PK")
    with open(tmp / "npy.npz", "wb") as f:  # a .npy under a .npz name: np.load returns an array, not an archive
        np.save(f, np.zeros(3))
    (tmp / "no_header.csv").write_text("1,2,0\n3,4,1\n")
    study = (Path(__file__).parent / "data" / "study_tiny" / "study_tiny.yaml").read_text()
    (tmp / "no_base.yaml").write_text(re.sub(r"(?m)^base: .*$", "base: configs/nowhere/absent.yaml", study))
    (tmp / "latin1.csv").write_bytes("a,b,label\n1,2,caf\xe9\n".encode("latin-1"))
    (tmp / "latin1_late.csv").write_bytes(b"a,b,label\n" + b"1,2,0\n" * 5000 + b"1,2,caf\xe9\n")  # past one read
    # issue #41: a regression target, a UCI .data file, a token model on a table, broken and empty image classes
    np.savez(tmp / "continuous.npz", x=np.zeros((60, 2)), y=np.linspace(0.01, 0.6, 60))
    (tmp / "letter.data").write_text("A,1,2\nB,3,4\n" * 30)
    (tmp / "table.csv").write_text("a,b,label\n" + "1,2,0\n3,4,1\n" * 30)
    from PIL import Image

    for name in ("broken", "no_image", "empty_class"):
        for label in ("a", "b"):
            (tmp / name / label).mkdir(parents=True)
            for i in range(5):
                Image.new("RGB", (4, 4)).save(tmp / name / label / f"{i}.png")
    (tmp / "broken" / "a" / "cut.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 20)
    (tmp / "no_image" / "b" / "notes.png").write_text("not a picture")
    (tmp / "empty_class" / "c").mkdir()
    images = ["dataset.image_size=4", "--no-progress"]
    return [
        ["run", "algorithm.num_model=3", "algorithm.name=fedmerge"],
        ["run", "rounds"],
        ["run", "eval_clients=sample:0"],
        ["run", f"dataset.path={tmp / 'continuous.npz'}", "--no-progress"],
        ["run", "dataset.name=npz", f"dataset.path={tmp / 'empty'}"],
        ["run", f"dataset.path={tmp / 'letter.data'}"],
        ["run", f"dataset.path={tmp / 'table.csv'}", "model.name=lstm", "--no-progress"],
        ["run", f"dataset.path={tmp / 'broken'}", *images],
        ["run", f"dataset.path={tmp / 'no_image'}", *images],
        ["run", f"dataset.path={tmp / 'empty_class'}", *images],
        ["run", "--resume", str(tmp / "damaged")],
        ["run", str(run_dir)],
        ["run", str(tmp / "empty")],
        ["run", str(tmp / "binary.yaml")],
        ["run", str(tmp / "file.txt")],
        ["run", str(tmp / "not.npz")],
        ["run", "missing.yaml"],
        ["run", "rounds=1", "lonely"],
        ["run", "algorithm.num_model=3"],
        ["run", "--resume", str(tmp / "empty")],
        ["run", "--resume", str(tmp / "file.txt")],
        ["run", "--checkpoint", "round-000001.safetensors"],
        ["run", "--resume", str(run_dir), "--checkpoint", "round-999999.safetensors"],
        ["run", "--device", "tpu"],
        ["run", f"dataset.path={tmp / 'missing.npz'}"],
        ["run", f"dataset.path={tmp / 'not.npz'}", "--no-progress"],
        ["run", f"dataset.path={tmp / 'npy.npz'}", "--no-progress"],
        ["run", f"dataset.path={tmp / 'no_header.csv'}", "dataset.label_column=0", "--no-progress"],
        ["run", f"dataset.path={tmp / 'latin1.csv'}", "--no-progress"],
        ["run", f"dataset.path={tmp / 'latin1_late.csv'}", "--no-progress"],
        ["run", "model.name=lstm", "rounds=1", f"output_dir={tmp / 'o'}", "--no-progress"],
        ["run", "dataset.name=wordnet_topics", "model.name=minilm_lora", f"model.path={tmp / 'missing'}"],
        ["run", f"output_dir={tmp / 'file.txt' / 'o'}", "rounds=1"],  # a file in the way
        ["sweep", f"output_dir={tmp / 'file.txt' / 'o'}", "rounds=1", "--no-progress"],
        ["tune", "--out", str(tmp / "file.txt" / "t"), "rounds=1"],
        ["tune", "--out", str(tmp / "file.txt"), "rounds=1"],  # a file where the folder should be
        ["sweep", "--out", str(tmp / "file.txt"), "rounds=1", "--no-progress"],
        ["run", "dataset.name=wordnet_features", f"dataset.cache_dir={tmp / 'file.txt' / 'c'}", "rounds=1"],
        ["run", "dataset.name=wordnet_topics", "model.name=minilm_lora", f"model.path={tmp / 'empty'}"],
        ["list", "nothing"],
        ["list", "algorithm", "nothing"],
        ["show", "nothing"],
        ["show", "algorithm", "fedmerg"],
        ["partition", str(run_dir)],
        ["partition", "partition.alpha=-1"],
        ["partition", "--plot", str(tmp / "p.xyz")],
        ["partition", "--plot", str(tmp / "file.txt" / "p.png")],
        ["export-clients"],
        ["export-clients", str(tmp / "file.txt"), str(tmp / "clients")],
        ["export-clients", str(tmp / "file.txt")],
        ["export-clients", "partition.num_clients=2", str(run_dir)],
        ["plot", "merge-weights", str(tmp / "missing")],
        ["plot", "merge-weights", str(run_dir)],
        ["plot", "merge-weights", str(run_dir), "--panels", "0"],
        ["plot", "lambda", str(tmp / "missing")],
        ["plot", "lambda", str(run_dir)],
        ["plot", "budget", str(tmp / "empty")],
        ["plot", "budget", str(run_dir), "--out", str(tmp / "file.txt" / "b.png")],
        ["livar", "calibrate"],
        ["livar", "calibrate", str(run_dir)],
        ["livar", "calibrate", str(CONFIGS / "livar_proxy_bible.yaml"), "--a-edges", "x"],
        ["livar", "calibrate", str(CONFIGS / "digits_fedavg.yaml")],
        ["study"],
        ["study", "missing.yaml"],
        ["study", str(tmp / "empty")],
        ["study", str(tmp / "file.txt")],
        ["study", str(CONFIGS / "digits_fedavg.yaml")],  # a config, not a study
        ["study", str(tmp / "no_base.yaml")],  # its base is found nowhere (neither beside it nor above it)
    ]


def test_no_subcommand_shows_a_traceback_for_bad_arguments(tmp_path, finished_run):
    import shutil

    damaged = tmp_path / "damaged"  # a copy of a finished run whose latest.json is cut
    shutil.copytree(finished_run, damaged)
    (damaged / "checkpoints" / "latest.json").write_text('{"file": ')
    runner = CliRunner()
    for args in bad_invocations(tmp_path, finished_run):
        result = runner.invoke(app, args)
        crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
        assert not crashed, f"{args}: uncaught {result.exception!r}"  # main() would call it an internal error
        assert "Traceback" not in result.output and "internal error" not in result.output, args
        assert result.exit_code != 0, (args, result.output)


@pytest.mark.parametrize(
    ("args", "what"), [(["run", "--tuned"], "tune file"), (["tune", "--space"], "search-space file")]
)
def test_a_missing_side_file_is_named_by_its_kind(tmp_path, args, what):
    result = CliRunner().invoke(app, [*args, str(tmp_path / "missing.yaml")])
    assert result.exit_code != 0 and f"{what} {tmp_path / 'missing.yaml'} does not exist" in result.output


def test_a_model_path_that_is_no_model_folder_is_refused_before_loading(tmp_path):
    for path, what in [(tmp_path / "missing", "no such folder"), (tmp_path, "a folder without config.json")]:
        result = CliRunner().invoke(app, ["run", "model.name=minilm_lora", f"model.path={path}"])
        assert result.exit_code != 0 and f"model.path: {what}; give a local Hugging Face model folder" in result.output


def test_an_output_folder_that_cannot_be_made_is_named_with_its_option(tmp_path):
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(app, ["run", f"output_dir={tmp_path / 'file' / 'o'}", "rounds=1"])
    assert result.exit_code != 0 and f"output_dir: cannot create {tmp_path / 'file' / 'o'}" in result.output
    assert "Not a directory" in result.output


def test_a_real_process_given_a_run_folder_suggests_resume(finished_run):
    proc = subprocess.run(
        [sys.executable, "-m", "fedmerge.cli", "run", str(finished_run)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert f"fedmerge run --resume {finished_run}" in proc.stderr


def test_partition_plot_creates_its_folder(tmp_path):
    png = tmp_path / "new" / "deeper" / "p.png"
    result = CliRunner().invoke(app, ["partition", "partition.num_clients=4", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert png.stat().st_size > 1000


# --- model / data compatibility -------------------------------------------------------------------


def test_model_that_cannot_read_tokens_is_refused_with_a_hint(tmp_path):
    cfg = quick_config("model.name=mlp", "dataset.name=wordnet_topics", f"output_dir={tmp_path}")
    with pytest.raises(ConfigError) as err:  # refused before the WordNet file is even read
        check_compatibility(cfg, torch.ones(2, 32, dtype=torch.int64), 26, torch.device("cpu"))
    message = str(err.value)
    assert "model 'mlp' does not fit dataset 'wordnet_topics' (token ids of shape (32,), int64)" in message
    assert "minilm_lora or lstm" in message and "\n" not in message


def test_incompatible_model_is_refused_before_the_run_folder_exists(tmp_path):
    cfg = quick_config("model.name=lstm", f"output_dir={tmp_path}")
    with pytest.raises(ConfigError, match=r"model 'lstm' does not fit dataset 'digits' \(images of shape \(1, 8, 8\)"):
        run_experiment(cfg, show_progress=False)
    assert list(tmp_path.iterdir()) == []


def test_batch_size_one_is_refused_for_a_model_with_batchnorm(tmp_path):
    cfg = quick_config("model.name=mobilenet_v1", "algorithm.batch_size=1", f"output_dir={tmp_path}")
    with pytest.raises(ConfigError, match=r"^algorithm.batch_size: 1 cannot train model 'mobilenet_v1': its BatchNorm"):
        run_experiment(cfg, show_progress=False)
    assert list(tmp_path.iterdir()) == []
    check_compatibility(quick_config("algorithm.batch_size=1"), torch.rand(2, 1, 8, 8), 10, torch.device("cpu"))


def test_compatibility_probe_leaves_the_run_unchanged(tmp_path):
    # The probe runs the model in eval mode with a forked RNG: results equal those of the model as built.
    cfg = quick_config("rounds=1", "model.name=twocnn")
    model = check_compatibility(cfg, torch.rand(2, 1, 8, 8), 10, torch.device("cpu"))
    assert model.training
    from fedmerge.models import build_model

    fresh = build_model(cfg.model, (1, 8, 8), 10, generator=torch.Generator().manual_seed(0))
    for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), k


# --- updates the server refuses -------------------------------------------------------------------


def upd(n: int, **tensors: torch.Tensor) -> Update:
    return Update(dict(tensors), {"num_examples": n, "train_loss": 0.5})


def test_screen_updates_drops_non_finite_and_misshapen_updates():
    good = torch.ones(2, 3)
    updates = {
        0: upd(5, w=good, b=torch.zeros(3)),
        1: upd(5, w=torch.tensor([[1.0, float("nan"), 1.0], [float("inf"), 1.0, 1.0]]), b=torch.zeros(3)),
        2: upd(5, w=torch.ones(3, 2), b=torch.zeros(3)),
        3: upd(5, w=good, b=torch.zeros(3), extra=torch.zeros(1)),
        4: upd(5, w=good, b=torch.zeros(3)),
        5: upd(5, w=good.double(), b=torch.zeros(3)),
        6: upd(5, w=good, b=torch.zeros(3)),
    }
    kept, dropped = screen_updates(7, updates)
    assert sorted(kept) == [0, 4, 6]
    reasons = {d["cid"]: d["reason"] for d in dropped}
    assert all(d["round"] == 7 and d["phase"] == "update" for d in dropped)
    assert reasons[1].startswith("2 non-finite value(s) in 'w'")
    assert "'w' is (3, 2) torch.float32, the other clients' are (2, 3) torch.float32" in reasons[2]
    assert "unexpected ['extra']" in reasons[3]
    assert "torch.float64" in reasons[5]


def test_screen_updates_without_a_majority_checks_only_values():
    kept, dropped = screen_updates(1, {0: upd(1, w=torch.ones(2)), 1: upd(1, w=torch.ones(3))})
    assert sorted(kept) == [0, 1] and dropped == []
    kept, dropped = screen_updates(1, {0: upd(-1, w=torch.ones(2))})
    assert kept == {} and "num_examples" in dropped[0]["reason"]


class MeanOfW:
    """An algorithm whose server state is the sample-weighted mean of the clients' ``w``."""

    config = type("Cfg", (), {"lr": 0.5})()

    def select_clients(self, state, rnd, scheduled):
        return scheduled

    def configure(self, state, rnd, selected):
        return {c: Payload(state.tensors) for c in selected}

    def aggregate(self, state, rnd, updates):
        n = sum(u.num_examples for u in updates.values())
        return ServerState({"w": sum(u.tensors["w"] * u.num_examples for u in updates.values()) / n})

    def configure_evaluate(self, state, rnd, cids):
        return {}

    def server_report(self, state, rnd):
        return {}


class ScriptedEngine:
    def __init__(self, values):
        self.values = values

    def fit(self, algorithm, rnd, payloads):
        return {c: upd(c + 1, w=torch.tensor([self.values[c]])) for c in payloads}

    def evaluate(self, algorithm, rnd, payloads):
        return {}

    def evaluate_global(self, algorithm, state):
        return None


def test_a_diverged_client_is_left_out_of_aggregation_and_recorded():
    records = []
    state = run_rounds(
        MeanOfW(),
        ScriptedEngine([1.0, float("nan"), 4.0]),
        Schedule(rounds=1, num_clients=3),
        ServerState({"w": torch.zeros(1)}),
        on_round_end=lambda rnd, s, record: records.append(record),
    )
    assert state.tensors["w"].item() == pytest.approx((1 * 1.0 + 3 * 4.0) / 4)  # client 1 (2 samples) left out
    (record,) = records
    assert [f["cid"] for f in record["failed_clients"]] == [1]


def test_a_round_where_every_update_is_dropped_stops_and_suggests_a_smaller_lr():
    with pytest.raises(RoundFailed, match=r"round 1: the updates of all 2 clients were dropped .* smaller algorithm"):
        run_rounds(
            MeanOfW(),
            ScriptedEngine([float("inf"), float("nan")]),
            Schedule(rounds=1, num_clients=2),
            ServerState({"w": torch.zeros(1)}),
        )


def test_drops_reach_metrics_jsonl_and_the_run_goes_on(tmp_path, monkeypatch):
    from fedmerge.engines.local import LocalEngine

    fit = LocalEngine.fit

    def poisoned_fit(self, algorithm, rnd, payloads):
        updates = fit(self, algorithm, rnd, payloads)
        if rnd == 2:
            next(iter(updates[3].tensors.values())).fill_(float("nan"))
        return updates

    monkeypatch.setattr(LocalEngine, "fit", poisoned_fit)
    result = run(quick_config("rounds=3", "threads=1"), tmp_path / "r")
    rows = RunStore(result.run_dir).read_metrics()
    assert [r.get("failed_clients") is None for r in rows] == [True, False, True]
    (failure,) = rows[1]["failed_clients"]
    assert failure["cid"] == 3 and "non-finite" in failure["reason"]
    assert all(torch.isfinite(t).all() for t in result.server_state.tensors.values())
    assert rows[-1]["summary"]["test_acc"]["mean"] > 0.5


def test_cli_stops_a_diverging_run_in_one_line(tmp_path):
    result = CliRunner().invoke(
        app, ["run", "rounds=2", "algorithm.lr=1e30", f"output_dir={tmp_path}", "threads=1", "--no-progress"]
    )
    assert result.exit_code == 1
    assert "smaller algorithm.lr (now 1e+30)" in result.output and len(result.output.strip().splitlines()) == 1


# --- resume ---------------------------------------------------------------------------------------


def test_resume_refuses_when_latest_json_is_gone_and_names_the_newest_checkpoint(tmp_path):
    cfg = quick_config("rounds=4", "threads=1")
    full = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "cut", stop_after=3)
    (tmp_path / "cut" / "checkpoints" / "latest.json").unlink()
    with pytest.raises(CheckpointError) as err:
        run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    hint = f"fedmerge run --resume {tmp_path / 'cut'} --checkpoint round-000003.safetensors"
    assert "newest: round-000003.safetensors" in str(err.value) and hint in str(err.value)
    result = CliRunner().invoke(app, ["run", "--resume", str(tmp_path / "cut"), "--no-progress"])
    assert result.exit_code == 2 and hint in result.output  # a damaged run folder is an input error

    # following the hint continues from round 3 and ends as the uninterrupted run
    from helpers import assert_runs_identical

    notices = []
    resumed = run_experiment(
        cfg, tmp_path / "cut", resume=True, show_progress=False, checkpoint="round-000003.safetensors",
        notify=notices.append,
    )  # fmt: skip
    assert notices == ["resuming from round 3 of 4"]
    assert_runs_identical(full.run_dir, resumed.run_dir)


def test_resume_prints_where_it_continues_and_wall_seconds_cover_every_segment(tmp_path):
    cfg = quick_config("rounds=3", "threads=1")
    run(cfg, tmp_path / "r", stop_after=2)
    first = RunStore(tmp_path / "r").read_metrics()[-1]["elapsed_seconds"]
    result = CliRunner().invoke(app, ["run", "--resume", str(tmp_path / "r"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "resuming from round 2 of 3" in result.output
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    rows = RunStore(tmp_path / "r").read_metrics()
    assert rows[-1]["fit_seconds"] > 0
    assert summary["wall_seconds"] >= first + rows[-1]["fit_seconds"]
    assert rows[-1]["elapsed_seconds"] >= first + rows[-1]["fit_seconds"]


def test_superfed_warns_when_mixing_never_starts(tmp_path):
    result = CliRunner().invoke(
        app,
        ["run", "algorithm.name=superfed_mm", "algorithm.start_round=5", "rounds=2", "partition.num_clients=4",
         f"output_dir={tmp_path}", "threads=1", "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "warning: rounds=2 <= algorithm.start_round=5: superfed_mm never starts mixing" in result.output


# --- discoverability ------------------------------------------------------------------------------


def test_list_kind_name_prints_every_key_with_type_default_and_description(monkeypatch):
    from fedmerge import cli
    from fedmerge.algorithms.fedmerge import FedMergeConfig

    monkeypatch.setattr(cli.out, "width", 250)  # one line per key
    result = CliRunner().invoke(app, ["list", "algorithm", "fedmerge"])
    assert result.exit_code == 0, result.output
    lines = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:5]]
        for line in result.output.splitlines()
        if line.count("│") == 5 and line.split("│")[1].strip()  # not a long description's continuation line
    }
    assert set(lines) == set(FedMergeConfig.model_fields) - {"name"}
    assert lines["num_models"] == ["int, >= 1", "5", "d, the number of global models on the server"]
    assert lines["merge_weights"][:2] == ["'dynamic' | 'fixed'", "dynamic"]
    assert CliRunner().invoke(app, ["show", "algorithm", "fedmerge"]).output == result.output
    assert CliRunner().invoke(app, ["list", "fedmerge"]).output == result.output  # a bare component name


def test_every_component_and_section_documents_every_key():
    from fedmerge.config import catalog
    from fedmerge.config.schema_docs import describe

    for kind, registry in catalog.REGISTRIES.items():
        for entry in registry.entries():
            rows = {r.key: r for r in describe(entry.config)}
            assert set(entry.config.model_fields) - {"name"} <= set(rows), (kind, entry.name)
            assert all(r.type and r.default for r in rows.values()), (kind, entry.name)
    for kind, cls in catalog.SECTIONS.items():
        assert set(cls.model_fields) <= {r.key for r in describe(cls)}, kind
    ditto = {r.key: r for r in describe(catalog.config_class("algorithm", "ditto"))}
    assert ditto["lam"].default == "1.0" and "proximal" not in ditto["lam"].type
    assert ditto["personal_lr"].type == "float | None, > 0" and ditto["personal_lr"].default == "null"
    superfed = {r.key: r for r in describe(catalog.config_class("algorithm", "superfed_mm"))}
    assert "mixing starts after this round" in superfed["start_round"].description


def test_sections_and_unknown_names():
    runner = CliRunner()
    run_keys = runner.invoke(app, ["list", "run"])
    assert run_keys.exit_code == 0 and "checkpoint_every" in run_keys.output and "participation" in run_keys.output
    assert "val_fraction" in runner.invoke(app, ["show", "split"]).output
    bad = runner.invoke(app, ["list", "algorithm", "fedmerg"])
    assert bad.exit_code == 2 and "unknown algorithm 'fedmerg'; did you mean fedmerge" in bad.output
    assert runner.invoke(app, ["list", "colour"]).exit_code == 2


def test_list_says_where_fedit_is():
    result = CliRunner().invoke(app, ["list"])
    assert result.exit_code == 0
    assert "FedIT" in result.output and "fedavg with model.name=minilm_lora" in result.output
    fedit = CliRunner().invoke(app, ["list", "algorithm", "FedIT"])
    assert fedit.exit_code == 0 and "algorithm.name=fedavg" in fedit.output


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["algorithm.name=fedmerge", "algorithm.num_model=3"], "num_model: unknown key; did you mean num_models?"),
        (["algorithm.name=ditto", "algorithm.lambda=1"], "did you mean lam?"),
        (["roundz=3"], "roundz: unknown key; did you mean rounds?"),
        (["algorithm.mu=0.1"], "algorithm.mu: unknown key for algorithm 'fedavg'; it belongs to fedprox"),
        (
            ["split.val=0.1"],
            "valid keys: val_fraction, test_fraction, test_per_client, test_from, unseen_clients "
            "(described by: fedmerge list split)",
        ),
        (["algorithm.name=fedmerg"], "unknown name 'fedmerg'; did you mean fedmerge"),
    ],
)
def test_unknown_keys_name_the_nearest_valid_ones(overrides, needle):
    with pytest.raises(ConfigError) as err:
        quick_config(*overrides)
    assert needle in str(err.value)


def test_run_folder_is_named_after_the_resolved_config(tmp_path):
    from fedmerge.config.schema import load_config

    assert load_config(None, ["algorithm.name=fedprox"]).name == "fedprox-digits"
    assert load_config(None, ["algorithm.name=fedprox", "name=mine"]).name == "mine"
    x = np.random.default_rng(0).normal(size=(90, 3))
    np.savez(tmp_path / "d.npz", x=x, y=(x[:, 0] > 0).astype(int))
    result = CliRunner().invoke(
        app,
        ["run", "dataset.name=npz", f"dataset.path={tmp_path / 'd.npz'}", "algorithm.name=fedprox", "rounds=1",
         "partition.num_clients=3", f"output_dir={tmp_path / 'runs'}", "threads=1", "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("fedprox-d-")  # a user's file is named by its stem, not by its loader


def test_a_bug_prints_one_error_and_saves_the_traceback(tmp_path, monkeypatch, capsys):
    import fedmerge.cli as cli
    import fedmerge.run.runner as runner

    def broken(*args, **kwargs):
        raise RuntimeError("mixed dtype (CPU): all inputs must share same datatype.\nsecond line")

    monkeypatch.setattr(runner, "run_from_files", broken)
    monkeypatch.setattr(sys, "argv", ["fedmerge", "run", str(CONFIGS / "digits_fedavg.yaml")])
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("FEDMERGE_TRACEBACK", raising=False)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "second line" not in err
    assert "internal error: RuntimeError: mixed dtype (CPU)" in err
    (log,) = tmp_path.glob("fedmerge-crash-*.log")
    assert str(log) in err.replace("\n", "")
    saved = log.read_text()
    assert saved.startswith(f"fedmerge run {CONFIGS / 'digits_fedavg.yaml'}") and "Traceback" in saved
    assert "def broken" not in err and "in broken" in saved

    monkeypatch.setenv("FEDMERGE_TRACEBACK", "1")  # a developer asks for the traceback itself
    with pytest.raises(RuntimeError, match="mixed dtype"):
        cli.main()


def test_ctrl_c_in_any_command_stops_with_one_line(monkeypatch, capsys):
    import fedmerge.cli as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "app", interrupted)
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_screening_tells_a_sum_that_overflows_from_a_non_finite_value():
    # the screen reads each tensor's sum first: huge finite values overflow it without being refused, and
    # infinities of both signs, whose sum is NaN, or one infinity among huge values, are still counted
    big = torch.finfo(torch.float32).max
    updates = {
        0: upd(5, w=torch.full((2, 3), big), b=torch.zeros(3)),  # sum +inf: every value finite
        1: upd(5, w=torch.tensor([[1.0, float("inf"), 1.0], [float("-inf"), 1.0, 1.0]]), b=torch.zeros(3)),
        2: upd(5, w=torch.ones(2, 3), b=torch.tensor([big, big, float("inf")])),
    }
    kept, dropped = screen_updates(1, updates)
    assert sorted(kept) == [0]
    reasons = {d["cid"]: d["reason"] for d in dropped}
    assert reasons[1].startswith("2 non-finite value(s) in 'w'")
    assert reasons[2].startswith("1 non-finite value(s) in 'b'")
