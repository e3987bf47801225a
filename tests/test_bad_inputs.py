"""A user's second hour (issue #41): input that used to be accepted silently is refused or flagged in one
line, a user's own mistake (a damaged image, a full disk) is never "internal error", and each one-line
message names the problem and its fix. Every test feeds the bad input and checks the exact line and exit
code."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import quick_config, run
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.config.schema import load_config
from fedmerge.data import load_pool
from fedmerge.data.errors import DataWarning
from fedmerge.run.folder_lock import LOCK_FILE

FAST = ["rounds=1", "partition.num_clients=3", "algorithm.local_epochs=1", "threads=1", "--no-progress"]


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def one_error(result, code: int = 2) -> str:
    """The single line a refused command prints, without its ``error:`` prefix."""
    assert result.exit_code == code, result.output
    crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
    assert not crashed, repr(result.exception)
    text = result.output.strip()
    assert len(text.splitlines()) == 1 and "internal error" not in text and "Traceback" not in text, text
    assert text.startswith("error: "), text
    return text.removeprefix("error: ")


def warnings_of(result) -> list[str]:
    assert result.exit_code == 0, result.output
    return [line for line in result.output.splitlines() if line.startswith("warning:")]


def save_images(root: Path, classes: dict[str, int]) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, count in classes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / name / f"{i}.png")


def tabular(path: Path, y: np.ndarray) -> Path:
    np.savez(path, x=np.random.default_rng(0).normal(size=(len(y), 4)), y=y)
    return path


# --- silently accepted, now refused or flagged ------------------------------------------------------


def test_a_typo_given_before_a_component_switch_is_refused_not_dropped(tmp_path):
    result = invoke("run", "algorithm.num_model=3", "algorithm.name=fedmerge", f"output_dir={tmp_path}", *FAST)
    assert one_error(result) == "algorithm.num_model: unknown key; did you mean num_models?"
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []
    # what the switch is for still works: the old component's keys from the config file are dropped, and
    # keys given on the command line that the new one accepts are kept
    cfg = load_config(None, ["algorithm.lr=0.05", "algorithm.name=ditto"])
    assert cfg.algorithm.name == "ditto" and cfg.algorithm.lr == 0.05
    yaml_file = tmp_path.parent / f"{tmp_path.name}.yaml"
    yaml_file.write_text("algorithm: {name: fedprox, mu: 0.1}\n")
    assert load_config(yaml_file, ["algorithm.name=fedavg"]).algorithm.name == "fedavg"


@pytest.mark.parametrize("partition", ["dirichlet", "iid"])
def test_continuous_labels_are_refused_naming_the_labels_not_the_partition(tmp_path, partition):
    path = tabular(tmp_path / "reg.npz", (np.arange(300) + 0.5) / 10)  # 0.05, 0.15, ...: a regression target
    result = invoke("run", f"dataset.path={path}", f"partition.name={partition}", f"output_dir={tmp_path}", *FAST)
    assert one_error(result) == (
        f"{path}: y: 300 distinct labels for 300 samples (e.g. 0.05, not a whole number): fewer than 2 samples per "
        "class, so these look like measurements, not classes; fedmerge trains classifiers: store class ids or "
        "names in y"
    )


def test_ids_in_the_label_column_of_a_csv_are_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("a,b,label\n" + "".join(f"{i % 7},{i % 5},row{i}\n" for i in range(40)))
    result = invoke("run", f"dataset.path={path}", f"output_dir={tmp_path}", *FAST)
    assert one_error(result) == (
        f"{path}: column 'label': 40 distinct labels for 40 samples (e.g. 'row0'): fewer than 2 samples per class, "
        "so these look like ids, not classes; fedmerge trains classifiers: set dataset.label_column to the column "
        "of classes"
    )


def test_fractional_labels_are_flagged_as_class_names(tmp_path):
    x = np.random.default_rng(0).normal(size=(120, 4))
    path = tmp_path / "half.npz"
    np.savez(path, x=x, y=np.where(x[:, 0] > 0, 0.5, 1.5))
    result = invoke("run", f"dataset.path={path}", f"output_dir={tmp_path / 'o'}", *FAST)
    assert warnings_of(result) == [
        f"warning: {path}: y: labels 0.5, 1.5 are not whole numbers; they are taken as 2 class names"
    ]
    with pytest.warns(DataWarning):
        assert load_pool({"name": "npz", "path": str(path)}).class_names == ["0.5", "1.5"]


def test_a_single_class_is_warned_about(tmp_path):
    path = tabular(tmp_path / "one.npz", np.zeros(90, dtype=int))
    result = invoke("run", f"dataset.path={path}", f"output_dir={tmp_path / 'o'}", *FAST)
    assert warnings_of(result) == [
        "warning: dataset 'one' has a single class ('0'): every prediction is right, so accuracy is 1.0 by "
        "construction; check the labels (dataset.label_column for a CSV)"
    ]
    two = tabular(tmp_path / "two.npz", np.arange(90) % 2)
    assert warnings_of(invoke("run", f"dataset.path={two}", f"output_dir={tmp_path / 'o'}", *FAST)) == []


def test_channels_last_images_are_transposed_with_a_warning(tmp_path):
    x = np.random.default_rng(0).integers(0, 255, (30, 8, 6, 3), dtype=np.uint8)  # N x H x W x C
    path = tmp_path / "nhwc.npz"
    np.savez(path, x=x, y=np.arange(30) % 3)
    with pytest.warns(DataWarning) as caught:
        pool = load_pool({"name": "npz", "path": str(path)})
    assert str(caught[0].message) == (
        f"{path}: x of shape (30, 8, 6, 3) is read as N x H x W x C (3 channel(s) of 8 x 6); store it as "
        "N x C x H x W to silence this"
    )
    assert pool.x.shape == (30, 3, 8, 6)
    assert np.array_equal(pool.x, x.transpose(0, 3, 1, 2).astype(np.float32) / 255)
    np.savez(path, x=x.transpose(0, 3, 1, 2), y=np.arange(30) % 3)  # already N x C x H x W: read as is
    assert np.array_equal(load_pool({"name": "npz", "path": str(path)}).x, pool.x)


def test_notebook_and_macos_folders_are_no_classes_and_an_empty_class_is_refused(tmp_path):
    save_images(tmp_path, {"cat": 6, "dog": 6})
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / "__MACOSX" / "cat").mkdir(parents=True)
    (tmp_path / "__MACOSX" / "cat" / "._0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (tmp_path / "cat" / "._1.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")  # not an image, hidden: skipped
    pool = load_pool({"name": "image_folder", "path": str(tmp_path), "image_size": 8})
    assert pool.class_names == ["cat", "dog"] and len(pool) == 12
    (tmp_path / "bird").mkdir()
    result = invoke("run", f"dataset.path={tmp_path}", "dataset.image_size=8", f"output_dir={tmp_path / 'o'}", *FAST)
    assert one_error(result) == (
        f"{tmp_path}: class folder(s) ['bird'] hold no images (.bmp, .gif, .jpeg, .jpg, .png, .tif, .tiff, .webp); "
        "every sub-folder is a class: remove them or add their images"
    )


def test_a_diverged_run_is_flagged_in_its_summary_the_cli_and_the_sweep_tables(tmp_path):
    from fedmerge.report.compare import compare, to_markdown
    from fedmerge.run.results import DONE, RunRecord
    from fedmerge.run.summary import divergence

    # the threshold is 10 x ln(C), the loss of a uniform guess: 23.03 for 10 classes
    assert divergence([{"train_loss": 23.02}], 10) is None
    assert divergence([{"train_loss": 23.03}], 10) == (
        "diverged: the last round's training loss is 23, more than 10 x ln(10) = 23 (a uniform guess); "
        "use a smaller algorithm.lr"
    )
    assert divergence([{"train_loss": math.inf}], 10) is not None
    assert divergence([{"train_loss": 1e9}], None) is None  # a causal LM's own loss: not judged

    result = invoke("run", "algorithm.lr=1e6", "rounds=2", f"output_dir={tmp_path}", *FAST[1:])
    (line,) = warnings_of(result)
    assert line.startswith("warning: diverged: the last round's training loss is ") and "ln(10) = 23" in line
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert line == f"warning: {summary['diverged']}" and summary["num_classes"] == 10
    assert "**warning: diverged" in (run_dir / "summary.md").read_text()

    ok = RunRecord("fedavg__s0", "fedavg", "s", 0, DONE, None, {"best_val": None})
    bad = RunRecord("fedavg__s1", "fedavg", "s", 1, DONE, None, {"diverged": summary["diverged"]})
    text = to_markdown(compare([ok, bad]))
    assert "| fedavg | 2 (1 diverged) |" in text
    assert f"- `fedavg__s1` (seed 1): {summary['diverged']}" in text


# --- a user's mistake is not our bug ----------------------------------------------------------------


def test_a_corrupt_jpeg_and_a_non_image_png_are_input_errors(tmp_path):
    from PIL import Image

    save_images(tmp_path, {"a": 6, "b": 6})
    good = tmp_path / "a" / "full.jpg"
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(good)
    (tmp_path / "a" / "cut.jpg").write_bytes(good.read_bytes()[:100])
    good.unlink()
    args = ["run", f"dataset.path={tmp_path}", "dataset.image_size=8", f"output_dir={tmp_path / 'o'}", *FAST]
    message = one_error(invoke(*args))
    assert message.startswith(f"{tmp_path / 'a' / 'cut.jpg'}: not a readable image (")
    assert message.endswith("); replace or remove it")
    (tmp_path / "a" / "cut.jpg").unlink()
    (tmp_path / "b" / "notes.png").write_text("not a picture")
    assert one_error(invoke(*args)) == f"{tmp_path / 'b' / 'notes.png'}: not an image (PIL cannot identify it); " + (
        "replace or remove it"
    )


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    from fedmerge.core import checkpoint

    target = tmp_path / "summary.json"
    target.write_bytes(b"old")

    def full_disk(path: Path, data: bytes) -> None:
        path.write_bytes(data[:3])  # part of it reached the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_synced", full_disk)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.atomic_write_bytes(target, b"new content")
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"] and target.read_bytes() == b"old"


def test_a_full_disk_is_one_line_naming_the_run_and_resume_finishes_it(tmp_path, monkeypatch):
    from fedmerge.core import checkpoint

    write = checkpoint._write_synced

    def full_when_summarizing(path: Path, data: bytes) -> None:
        if ".summary.json.tmp-" in path.name:
            path.write_bytes(data[:10])
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, data)

    monkeypatch.setattr(checkpoint, "_write_synced", full_when_summarizing)
    result = invoke("run", "rounds=2", f"output_dir={tmp_path}", *FAST[1:])
    (run_dir,) = tmp_path.iterdir()
    assert one_error(result) == (
        f"No space left on device (free some space); continue with: fedmerge run --resume {run_dir}"
    )
    temporary = [p.name for p in run_dir.iterdir() if p.name.startswith(".") and p.name != LOCK_FILE]
    assert temporary == []  # no .summary.json.tmp-PID
    assert not (run_dir / "summary.json").exists()

    monkeypatch.setattr(checkpoint, "_write_synced", write)  # space freed
    resumed = invoke("run", "--resume", str(run_dir), "--no-progress")
    assert resumed.exit_code == 0, resumed.output
    assert "resuming from round 2 of 2" in resumed.output
    assert json.loads((run_dir / "summary.json").read_text())["rounds_completed"] == 2


def test_a_full_disk_outside_a_run_command_is_one_line_not_an_internal_error(monkeypatch, capsys):
    import sys

    import fedmerge.cli as cli

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/x")

    monkeypatch.setattr(cli, "app", full)
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == "error: No space left on device: /data/x (free some space)"
    monkeypatch.setattr(sys, "argv", ["fedmerge"])


# --- one-liners that named the wrong thing ----------------------------------------------------------


def test_a_key_without_a_value_is_not_called_a_missing_config_file():
    assert one_error(invoke("run", "rounds")) == (
        "config file rounds does not exist; if rounds is a key, give it a value: rounds=VALUE"
    )
    assert one_error(invoke("run", "algorithm.lr")) == (
        "config file algorithm.lr does not exist; if algorithm.lr is a key, give it a value: algorithm.lr=VALUE"
    )
    assert one_error(invoke("run", "missing.yaml")) == "config file missing.yaml does not exist"


def test_a_folder_given_as_the_npz_file_is_called_a_folder(tmp_path):
    folder = tmp_path / "data.npz"
    folder.mkdir()
    result = invoke("run", "dataset.name=npz", f"dataset.path={folder}", f"output_dir={tmp_path}", *FAST)
    assert one_error(result) == (
        f"npz file expected, {folder} is a folder (check dataset.path; a folder of class folders of images is "
        "dataset.name=image_folder)"
    )


def test_a_path_whose_loader_cannot_be_told_names_dataset_name(tmp_path):
    path = tmp_path / "letter.data"
    path.write_text("".join(f"{'AB'[i % 2]},{i % 7},{i % 5}\n" for i in range(60)))
    assert one_error(invoke("run", f"dataset.path={path}", f"output_dir={tmp_path}", *FAST)) == (
        "dataset.path: cannot tell the loader from 'letter.data'; add dataset.name=csv (a delimited table, e.g. "
        "UCI's .data), dataset.name=npz, dataset.name=image_folder, or another loader of fedmerge list dataset"
    )
    assert one_error(invoke("run", f"dataset.path={tmp_path / 'gone'}")) == (
        f"dataset.path: no such file or folder: {tmp_path / 'gone'}"
    )
    ok = ["dataset.name=csv", f"dataset.path={path}", "dataset.header=false", "dataset.label_column=0"]
    assert invoke("run", *ok, f"output_dir={tmp_path / 'o'}", *FAST).exit_code == 0


def test_sample_zero_says_k_must_be_at_least_one(tmp_path):
    assert one_error(invoke("run", "eval_clients=sample:0", f"output_dir={tmp_path}", *FAST)) == (
        "eval_clients: sample:K needs K >= 1 clients (all: every client) (got 'sample:0')"
    )


def test_a_token_model_on_tabular_features_is_refused_before_torch_complains(tmp_path):
    path = tmp_path / "tab.csv"
    path.write_text("a,b,c,label\n" + "".join(f"{i % 7},{i % 5},{i % 11},{i % 3}\n" for i in range(90)))
    result = invoke("run", f"dataset.path={path}", "model.name=lstm", f"output_dir={tmp_path}", *FAST)
    assert one_error(result) == (
        "model 'lstm' does not fit dataset 'tab' (features of shape (3,), float32): it reads int64 token ids, not "
        "tabular features; use model.name=mlp"
    )


# --- exit codes and Ctrl-C --------------------------------------------------------------------------


@pytest.fixture
def stopped_run(tmp_path) -> Path:
    """A run stopped after round 1 of 2, as a crash would leave it."""
    return run(quick_config("rounds=2", "threads=1"), tmp_path / "r", stop_after=1).run_dir


def test_a_damaged_latest_json_or_checkpoint_exits_2(stopped_run):
    latest = stopped_run / "checkpoints" / "latest.json"
    saved = latest.read_text()
    latest.write_text("{not json")
    message = one_error(invoke("run", "--resume", str(stopped_run), "--no-progress"))
    assert message.startswith(f"{latest} is unreadable (") and message.endswith("); refusing to resume")
    latest.write_text(saved)
    ckpt = stopped_run / "checkpoints" / json.loads(saved)["file"]
    ckpt.write_bytes(ckpt.read_bytes()[:-20])
    message = one_error(invoke("run", "--resume", str(stopped_run), "--no-progress"))
    assert str(ckpt) in message


def test_ctrl_c_names_the_run_folder_or_says_none_was_made(tmp_path, monkeypatch):
    import fedmerge.run.data_plan as data_plan
    from fedmerge.engines.local import LocalEngine

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(data_plan, "load_data", interrupted)
        result = invoke("run", f"output_dir={tmp_path}", *FAST)
    assert one_error(result, 130) == "interrupted before the run folder was made; nothing to resume"
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []

    fit = LocalEngine.fit

    def interrupted_in_round_2(self, algorithm, rnd, payloads):
        if rnd == 2:
            raise KeyboardInterrupt
        return fit(self, algorithm, rnd, payloads)

    monkeypatch.setattr(LocalEngine, "fit", interrupted_in_round_2)
    result = invoke("run", "rounds=2", f"output_dir={tmp_path}", *FAST[1:])
    (run_dir,) = tmp_path.iterdir()
    assert one_error(result, 130) == f"interrupted; continue with: fedmerge run --resume {run_dir}"
    again = invoke("run", "--resume", str(run_dir), "--no-progress")  # stopped again while resuming
    assert again.exit_code == 130 and again.output.strip().splitlines() == [
        "resuming from round 1 of 2",
        f"error: interrupted; continue with: fedmerge run --resume {run_dir}",
    ]


# --- friction ---------------------------------------------------------------------------------------


def test_a_users_file_names_runs_settings_and_summaries_by_its_stem(tmp_path):
    from fedmerge.sweep.spec import expand, spec_from_args

    path = tmp_path / "letter.csv"
    path.write_text("a,b,label\n" + "".join(f"{i % 7},{i % 5},{'ABC'[i % 3]}\n" for i in range(90)))
    assert load_config(None, [f"dataset.path={path}"]).name == "fedavg-letter"
    assert load_config(None, [f"dataset.path={path}", "name=mine"]).name == "mine"
    assert load_config(None, ["dataset.name=digits"]).name == "fedavg-digits"
    (point, _) = expand(spec_from_args([f"dataset.path={path}", "seed=[0,1]"]))
    assert point.setting == "letter, dirichlet"
    result = invoke("run", f"dataset.path={path}", f"output_dir={tmp_path / 'o'}", *FAST)
    (run_dir,) = (tmp_path / "o").iterdir()
    assert run_dir.name.startswith("fedavg-letter-") and "fedavg on letter (3 clients)" in result.output
    assert json.loads((run_dir / "summary.json").read_text())["dataset"] == "letter"


def test_partition_shows_the_label_names_the_file_holds(tmp_path):
    path = tmp_path / "letter.csv"
    path.write_text("a,b,label\n" + "".join(f"{i % 7},{i % 5},{'ABC'[i % 3]}\n" for i in range(90)))
    result = invoke("partition", f"dataset.path={path}", "partition.num_clients=3")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1] == "classes: 0=A, 1=B, 2=C"
    digits = invoke("partition", "partition.num_clients=3")  # names that are the indices are not repeated
    assert not any(line.startswith("classes:") for line in digits.output.splitlines())


def test_a_sweep_run_is_the_plain_run_its_cores_given_as_workers_not_threads(tmp_path):
    from fedmerge.sweep.runner import run_command
    from fedmerge.sweep.spec import expand, spec_from_args

    (point,) = expand(spec := spec_from_args(["rounds=1"]))
    # the command of `fedmerge run rounds=1`, hence its numbers; the launcher's FEDMERGE_CORES sizes its workers
    cmd = run_command(spec, point, tmp_path / "r")
    assert "rounds=1" in cmd and not any(c.startswith(("threads=", "workers=")) for c in cmd)
    (point,) = expand(spec := spec_from_args(["rounds=1", "threads=2"]))
    assert "threads=2" in run_command(spec, point, tmp_path / "r")  # the user's own setting


def test_fedmerge_warns_when_its_merge_weights_did_not_move(tmp_path):
    from fedmerge.core.types import ServerState

    cfg = quick_config("algorithm.name=fedmerge", "algorithm.logit_lr=0.01")  # the former default
    algorithm = __import__("fedmerge.algorithms", fromlist=["ALGORITHMS"]).ALGORITHMS.get("fedmerge")
    fedmerge = algorithm.obj(cfg.algorithm, lambda g: torch.nn.Linear(2, 2), 3, 0)
    # d = 5: a weight of 1.5 / 5 = 0.3 moved enough; e^a / (e^a + 4) = 0.3 at a = ln(12 / 7)
    edge = math.log(12 / 7)
    logits = torch.zeros(3, 5, dtype=torch.float64)
    assert fedmerge.run_warnings(ServerState({"logits": logits}), 30) == [
        "fedmerge's merge weights barely moved from the uniform 1/5 = 0.20 (all within 0.20-0.20 after 30 rounds): "
        "raise algorithm.logit_lr (now 0.01; try 0.03, or tune it) or run more rounds"
    ]
    logits[1, 2] = edge - 1e-6
    assert len(fedmerge.run_warnings(ServerState({"logits": logits}), 30)) == 1
    logits[1, 2] = edge + 1e-6
    assert fedmerge.run_warnings(ServerState({"logits": logits}), 30) == []

    result = invoke(
        "run", "algorithm.name=fedmerge", "algorithm.logit_lr=0.01", "rounds=2", f"output_dir={tmp_path}", *FAST[1:]
    )
    assert [w.split(" (all within")[0] for w in warnings_of(result)] == [
        "warning: fedmerge's merge weights barely moved from the uniform 1/5 = 0.20"
    ]
    moved = invoke(
        "run", "algorithm.name=fedmerge", "algorithm.logit_lr=1", "rounds=2", f"output_dir={tmp_path}", *FAST[1:]
    )
    assert warnings_of(moved) == []
    listed = invoke("list", "algorithm", "fedmerge").output
    assert "logit_lr  float, > 0, default 0.3\n" in listed and "preset=reference" in listed


def test_every_key_of_every_component_and_section_has_a_description():
    from fedmerge.config import catalog
    from fedmerge.config.schema_docs import describe

    empty = [
        (kind, entry.name, row.key)
        for kind, registry in catalog.REGISTRIES.items()
        for entry in registry.entries()
        if entry.config.__module__.startswith("fedmerge.")  # not the test modules' or plugins' own components
        for row in describe(entry.config)
        if not row.description.strip()
    ]
    empty += [
        (kind, "", row.key)
        for kind, cls in catalog.SECTIONS.items()
        for row in describe(cls)
        if not row.description.strip()
    ]
    assert empty == []


def test_one_option_name_per_idea(tmp_path):
    result = invoke("sweep", "--output-dir", str(tmp_path), "rounds=1", "seed=[0,1]", "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].startswith(f"2 runs in {tmp_path / 'sweeps'}/")
    exact = invoke("sweep", "--out", str(tmp_path / "mine"), "rounds=1", "seed=[0,1]", "--dry-run")
    assert exact.output.strip().splitlines()[-1] == f"2 runs in {tmp_path / 'mine'}"
    assert invoke("tune", "--output-dir", str(tmp_path), "rounds=1", "--show-space").exit_code == 0
    for name in ("--data-dir", "--dir"):  # data's folder option is named as run's; the former name still works
        listed = invoke("data", "list", name, str(tmp_path))
        assert listed.exit_code == 0 and listed.output.startswith(f"data dir: {tmp_path}")


def test_workers_above_the_core_count_are_warned_about(tmp_path, monkeypatch):
    import fedmerge.run.plan as plan

    monkeypatch.setattr(plan, "available_cores", lambda: 1)
    result = invoke("run", "workers=2", f"output_dir={tmp_path}", *FAST)
    assert warnings_of(result) == ["warning: workers=2 is more than the 1 cores; they slow each other"]
