"""Plugins: a method from a package of its own (tests/plugin_example) reaches every place a run happens.

Two ways in: the entry point the installed package declares (``fedmerge.plugins``; .ci/run installs it),
and a config's ``plugins: [module]``, saved in config.yaml. The end-to-end tests take the second way
with the installed plugins switched off (FEDMERGE_DISABLE_PLUGIN_AUTOLOAD=1) in every process they
start, so that only the saved key can bring the method into a resumed run, a sweep's run processes
and Flower's ClientApps.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import torch
import yaml
from helpers import assert_runs_identical, run
from typer.testing import CliRunner

from fedmerge.algorithms.fedavg import FedAvg, FedAvgConfig
from fedmerge.cli import app
from fedmerge.config.schema import ConfigError, defaults_left_out, load_config, to_yaml
from fedmerge.core import plugins
from fedmerge.core.algorithm import ALGORITHMS
from fedmerge.core.types import ServerState, Update
from fedmerge.engines.flower.job import client_job, load_job_plugins
from fedmerge.run.results import DONE
from fedmerge.sweep.runner import sweep_records
from fedmerge.sweep.spec import spec_from_args

ROOT = Path(__file__).parent.parent
PLUGIN_DIR = ROOT / "tests" / "plugin_example"
MODULE = "fedmerge_server_step"
METHOD = "fedavg_server_lr"
CONFIG = {
    "plugins": [MODULE],
    "rounds": 2,
    "partition": {"name": "dirichlet", "num_clients": 3, "alpha": 0.5},
    "algorithm": {"name": METHOD, "server_lr": 0.5, "local_epochs": 1},
}


@pytest.fixture
def plugin_config(tmp_path, monkeypatch) -> Path:
    """A config naming the example plugin, whose module this process and the ones it starts can import
    (from its source folder) but no process loads as an installed plugin."""
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PLUGIN_DIR), *sys.path]))
    monkeypatch.setenv(plugins.AUTOLOAD_OFF, "1")
    path = tmp_path / "plugin.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


def fedmerge(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "fedmerge", *args], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


# --- the example method ---------------------------------------------------------------------------
def test_server_step_by_hand(plugin_config):
    cfg = load_config(plugin_config)
    cls = ALGORITHMS.get(METHOD).obj
    state = ServerState({"w": torch.tensor([1.0, 2.0]), "count": torch.tensor(3)})
    updates = {
        0: Update({"w": torch.tensor([3.0, 4.0]), "count": torch.tensor(5)}, {"num_examples": 1}),
        1: Update({"w": torch.tensor([5.0, 8.0]), "count": torch.tensor(9)}, {"num_examples": 3}),
    }  # mean by samples: w = [4.5, 7.0], count = round(8.0)
    # the step from w = [1, 2]: lr * [3.5, 5.0]; its length lr * sqrt(3.5^2 + 5^2) = lr * sqrt(37.25) (counters skipped)
    for lr, expected in [(0.5, [2.75, 4.5]), (1.5, [6.25, 9.5])]:
        algorithm = cls(cfg.algorithm.model_copy(update={"server_lr": lr}), None, 2, 0)
        new_state = algorithm.aggregate(state, 1, updates)
        new = new_state.tensors
        assert torch.equal(new["w"], torch.tensor(expected)) and torch.equal(new["count"], torch.tensor(8))
        assert new_state.meta["step_norm"] == pytest.approx(lr * math.sqrt(37.25), rel=1e-6)
        assert algorithm.server_report(new_state, 1) == {"step_norm": new_state.meta["step_norm"]}
    fedavg = FedAvg(FedAvgConfig(), None, 2, 0).aggregate(state, 1, updates).tensors
    one = cls(cfg.algorithm.model_copy(update={"server_lr": 1.0}), None, 2, 0).aggregate(state, 1, updates).tensors
    assert all(torch.equal(one[k], fedavg[k]) for k in fedavg)  # server_lr 1 is FedAvg, bit for bit


# --- loading ----------------------------------------------------------------------------------------
class LateConfig(FedAvgConfig):
    name: Literal["test_registered_late"] = "test_registered_late"


def test_a_component_registered_after_the_first_config_is_accepted():
    load_config()  # builds (and caches) the schema
    with pytest.raises(ConfigError, match="unknown name 'test_registered_late'"):
        load_config(None, ["algorithm.name=test_registered_late"])
    ALGORITHMS.register("test_registered_late", config=LateConfig, description="test only")(FedAvg)
    assert load_config(None, ["algorithm.name=test_registered_late"]).algorithm.name == "test_registered_late"


def test_the_plugins_key_is_imported_saved_and_left_out_when_empty(plugin_config):
    cfg = load_config(plugin_config)
    assert cfg.algorithm.name == METHOD and cfg.plugins == (MODULE,)
    saved = yaml.safe_load(to_yaml(cfg))
    assert saved["plugins"] == [MODULE]
    assert load_config(plugin_config, ["seed=1"]).seed == 1  # loading it again is a no-op, not a second registration
    plain = load_config()
    assert "plugins" not in yaml.safe_load(to_yaml(plain)) and "plugins" in defaults_left_out(plain)


def test_a_module_that_fails_to_import_is_one_line_every_time(tmp_path, monkeypatch):
    (tmp_path / "plugin_fails_halfway.py").write_text(
        "from fedmerge.algorithms.fedavg import FedAvg, FedAvgConfig\n"
        "from fedmerge.core.algorithm import ALGORITHMS\n"
        "from typing import Literal\n"
        "class C(FedAvgConfig):\n"
        "    name: Literal['test_plugin_halfway'] = 'test_plugin_halfway'\n"
        "ALGORITHMS.register('test_plugin_halfway', config=C, description='test only')(FedAvg)\n"
        "raise RuntimeError('boom')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = "plugins: cannot import plugin_fails_halfway (RuntimeError: boom)"
    for _ in range(2):  # the second time the same error, not "already registered"
        with pytest.raises(ConfigError) as err:
            load_config(None, ["plugins=[plugin_fails_halfway]"])
        assert str(err.value) == expected
    result = CliRunner().invoke(app, ["run", "plugins=[no_such_plugin_module]", "--no-progress"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: plugins: cannot import no_such_plugin_module (ModuleNotFoundError: No module named "
        "'no_such_plugin_module')"
    ]
    with pytest.raises(ConfigError, match="^plugins.0: String should match pattern"):
        load_config(None, ["plugins=[not a module]"])


def test_an_installed_plugin_that_fails_is_one_line_unless_switched_off(tmp_path, monkeypatch):
    info = tmp_path / "broken_plugin-0.1.dist-info"  # what pip installs for a package with the entry point
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{plugins.ENTRY_POINT_GROUP}]\nbroken = no_such_installed_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_installed_loaded", False)
    assert ("broken", "no_such_installed_plugin") in plugins.installed_plugins()
    for command in (["list"], ["run", "rounds=1", "--no-progress"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        assert result.output.strip().splitlines() == [
            "error: installed plugin 'broken' (entry point fedmerge.plugins): cannot import no_such_installed_plugin "
            "(ModuleNotFoundError: No module named 'no_such_installed_plugin'); "
            "FEDMERGE_DISABLE_PLUGIN_AUTOLOAD=1 skips installed plugins"
        ]
    monkeypatch.setenv(plugins.AUTOLOAD_OFF, "1")
    assert CliRunner().invoke(app, ["list"]).exit_code == 0


def test_installed_plugin_runs_without_the_key(tmp_path):
    if ("server_step", MODULE) not in plugins.installed_plugins():
        pytest.skip("example plugin not installed: pip install -e tests/plugin_example (.ci/run does)")
    env = {k: v for k, v in os.environ.items() if k != plugins.AUTOLOAD_OFF}
    out = tmp_path / "run"
    args = ["run", f"algorithm.name={METHOD}", "algorithm.server_lr=0.5", "rounds=1", "partition.num_clients=3"]
    proc = subprocess.run(
        [sys.executable, "-m", "fedmerge", *args, "--out", str(out), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["algorithm"]["name"] == METHOD and "plugins" not in saved


def test_sweep_keeps_a_plugins_list_fixed():
    spec = spec_from_args([f"plugins=[{MODULE}]", "seed=[0,1]"])
    assert spec.overrides == (f"plugins=[{MODULE}]",) and list(spec.grid) == ["seed"]


def test_the_client_job_names_the_plugins_and_a_node_imports_them(tmp_path, monkeypatch):
    (tmp_path / "plugin_probe_for_jobs.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    experiment = load_config().model_dump(mode="json")
    assert "plugins" not in client_job(experiment, 3, with_data=False)  # jobs without plugins stay unchanged
    job = client_job({**experiment, "plugins": ["plugin_probe_for_jobs"]}, 3, with_data=True)
    assert job["plugins"] == ["plugin_probe_for_jobs"]
    load_job_plugins(json.loads(json.dumps(job)))
    assert sys.modules["plugin_probe_for_jobs"].LOADED


# --- end to end, through the saved key only ---------------------------------------------------------
def test_plugin_method_runs_and_resumes_in_new_processes(plugin_config, tmp_path):
    out = tmp_path / "run"
    fedmerge("run", str(plugin_config), "--out", str(out), "--no-progress")
    assert yaml.safe_load((out / "config.yaml").read_text())["plugins"] == [MODULE]
    resumed = fedmerge("run", "--resume", str(out), "rounds=3", "--no-progress")  # reads config.yaml only
    assert "resuming from round 2 of 3" in resumed.stderr + resumed.stdout
    reference = run(load_config(plugin_config, ["rounds=3"]), tmp_path / "reference")
    assert_runs_identical(out, reference.run_dir)


def test_plugin_method_in_a_sweep(plugin_config, tmp_path):
    out = tmp_path / "sweep"
    args = ["sweep", str(plugin_config), "algorithm.server_lr=[0.5,2.0]", "rounds=1", "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--no-progress"])  # each run is a `fedmerge run` process
    assert result.exit_code == 0, result.output
    records = {r.key: r for r in sweep_records(out)}
    assert len(records) == 2
    assert {r.status for r in records.values()} == {DONE}, {k: r.error for k, r in records.items()}
    rows = []
    for key in sorted(records):
        saved = yaml.safe_load((out / "runs" / key / "config.yaml").read_text())
        assert saved["plugins"] == [MODULE] and saved["algorithm"]["name"] == METHOD
        rows.append(json.loads((out / "runs" / key / "metrics.jsonl").read_text().splitlines()[-1]))
    assert rows[0]["eval"]["global"] != rows[1]["eval"]["global"]  # the server step size changed the global model


def test_plugin_method_in_a_flower_simulation(plugin_config, tmp_path):
    pytest.importorskip("flwr", reason="Flower absent: pip install -e '.[flower]'")
    pytest.importorskip("ray", reason="Flower simulation needs ray: pip install -e '.[flower]'")
    local = run(load_config(plugin_config), tmp_path / "local")
    flower = run(load_config(plugin_config, ["engine=flower", "flower.num_cpus=1"]), tmp_path / "flower")
    assert_runs_identical(local.run_dir, flower.run_dir)


# --- what the method knows about its outputs: a summary field, a figure, a command --------------------------------
def installed_commands(folder: Path, lines: str) -> Path:
    """A dist-info in ``folder`` declaring ``lines`` in the entry-point group fedmerge.cli, as pip installs it."""
    info = folder / "example_commands-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: example-commands\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[fedmerge.cli]\n{lines}\n")
    return folder


def test_plugin_adds_a_summary_field_a_figure_and_a_command(plugin_config, tmp_path, monkeypatch):
    result = run(load_config(plugin_config), tmp_path / "run")  # server_lr 0.5, two rounds
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    norms = [row["server"]["step_norm"] for row in rows]
    assert len(norms) == 2 and all(n > 0 for n in norms)
    # the first step leaves the same w_0 towards the same client average: half FedAvg's (server_lr 1) first step
    fedavg_step = run(load_config(plugin_config, ["algorithm.server_lr=1.0", "rounds=1"]), tmp_path / "lr1")
    assert norms[0] == pytest.approx(0.5 * fedavg_step.summary["server_step"]["last_norm"], rel=1e-5)

    # the summary field and its line, from the method's hooks
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["server_step"] == {"mean_norm": (norms[0] + norms[1]) / 2, "last_norm": norms[1]}
    assert (
        f"server step norm: mean {(norms[0] + norms[1]) / 2:.4f}, last {norms[1]:.4f}"
        in (result.run_dir / "summary.md").read_text()
    )

    # the figure, drawn by `fedmerge plot figures` in a process that imports the plugin from config.yaml only
    fedmerge("plot", "figures", str(result.run_dir), "--out", str(tmp_path / "figures"))
    png = tmp_path / "figures" / "server_step.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape  # decodes: a real image, 5 x 3.5 inches at 100 dpi
    assert (width, height) == (500, 350)
    page = tmp_path / "report.html"
    assert CliRunner().invoke(app, ["report", str(result.run_dir), "-o", str(page)]).exit_code == 0
    section = page.read_text().split('<section id="server-step">')[1].split("</section>")[0]
    assert "<h2>Server steps</h2>" in section and section.count('src="data:image/png;base64,') == 1

    # the command group, found through the entry point fedmerge.cli of the installed package
    folder = installed_commands(tmp_path / "site", "server-step = fedmerge_server_step_cli:app")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ["PYTHONPATH"]]))
    monkeypatch.delenv(plugins.AUTOLOAD_OFF)  # installed command groups are skipped with the installed plugins
    listed = fedmerge("--help").stdout
    assert "server-step" in listed and "Tools of fedavg_server_lr" in listed
    steps = fedmerge("server-step", "steps", str(result.run_dir)).stdout
    assert steps.splitlines() == [f"round 1: {norms[0]!r}", f"round 2: {norms[1]!r}"]


# --- docs/extending.md ------------------------------------------------------------------------------
def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "extending.md").read_text(), re.S)


def test_the_walk_through_shows_the_example_plugin_as_it_is():
    method, hooks = _python_blocks()[:2]
    (command,) = [block for block in _python_blocks() if "typer.Typer(" in block]
    source = (PLUGIN_DIR / f"{MODULE}.py").read_text()
    assert method in source and hooks in source and "hooks=MethodHooks(" in hooks
    assert command in (PLUGIN_DIR / f"{MODULE}_cli.py").read_text()


def test_the_walk_through_dataset_and_model_run(tmp_path, monkeypatch):
    (block,) = [b for b in _python_blocks() if b.startswith("# my_components.py\n")]
    (tmp_path / "my_components.py").write_text(block)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    args = ["plugins=[my_components]", "dataset.name=blobs", "model.name=tanh_net", "model.hidden=16"]
    fedmerge("run", *args, "rounds=1", "partition.num_clients=3", "--out", str(tmp_path / "run"), "--no-progress")
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["dataset"]["name"] == "blobs" and saved["model"] == {"name": "tanh_net", "hidden": 16}


@pytest.mark.slow
def test_plugin_method_in_a_study(plugin_config, tmp_path):
    """A study row naming the plugin's method: its runs are `fedmerge run` processes that load the
    plugin from the saved key, and the report has the row."""
    base = yaml.safe_load(plugin_config.read_text()) | {"rounds": 1, "threads": 1, "name": "plugin-study"}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    study = {
        "title": "A plugin row",
        "description": "Local and FedAvg for the regime check, and the plugin's method.",
        "base": str(tmp_path / "base.yaml"),
        "seeds": [0],
        "tune_seed": 0,
        "regime": {"scope": "auto", "max_epochs": 1},
        "methods": [
            {"label": "Local", "overrides": ["algorithm.name=local"], "grid": {"algorithm.lr": [0.1]}},
            {"label": "FedAvg", "overrides": ["algorithm.name=fedavg"], "grid": {"algorithm.lr": [0.1]}},
            {"label": "Server step", "overrides": [f"algorithm.name={METHOD}"], "grid": {"algorithm.server_lr": [2.0]}},
        ],
    }
    (tmp_path / "plugin_study.yaml").write_text(yaml.safe_dump(study, sort_keys=False))
    runs, report = tmp_path / "runs", tmp_path / "report.md"
    args = ["study", str(tmp_path / "plugin_study.yaml"), "--runs", str(runs), "--out", str(report), "--jobs", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    saved = [yaml.safe_load(p.read_text()) for p in runs.rglob("config.yaml")]
    ours = [c for c in saved if c["algorithm"]["name"] == METHOD]
    assert ours and all(c["plugins"] == [MODULE] and c["algorithm"]["server_lr"] == 2.0 for c in ours)
    assert "| Server step | server_lr=2.0 |" in report.read_text()


# --- fedmerge.api: the one module a plugin imports ---------------------------------------------------------
def fedmerge_imports_past_the_api(source: str) -> list[str]:
    """The imports of fedmerge in ``source`` that are not ``fedmerge.api`` (``from fedmerge.api import ...``,
    ``import fedmerge.api``, ``from fedmerge import api``)."""
    wrong = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            wrong += [a.name for a in node.names if a.name.split(".")[0] == "fedmerge" and a.name != "fedmerge.api"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fedmerge":
            if node.module == "fedmerge":
                wrong += [f"fedmerge.{a.name}" for a in node.names if a.name != "api"]
            elif node.module != "fedmerge.api":
                wrong.append(node.module)
    return wrong


def test_the_example_plugin_imports_fedmerge_api_only():
    modules = sorted(PLUGIN_DIR.glob("*.py"))
    assert [m.name for m in modules] == [f"{MODULE}.py", f"{MODULE}_cli.py"]  # the method; its command group
    for module in modules:
        source = module.read_text()
        assert "fedmerge.api" in source
        assert fedmerge_imports_past_the_api(source) == [], module.name


def test_the_walk_through_plugins_import_fedmerge_api_only():
    plugins = [block for block in _python_blocks() if ".register(" in block]  # not the end-to-end test's lines
    assert len(plugins) == 2  # the example method; the dataset and model
    assert [fedmerge_imports_past_the_api(block) for block in plugins] == [[], []]


def test_reaching_past_the_api_is_caught():
    assert fedmerge_imports_past_the_api("from fedmerge.algorithms.base import GlobalModelAlgorithm") == [
        "fedmerge.algorithms.base"
    ]
    assert fedmerge_imports_past_the_api("import fedmerge.core.types\nfrom fedmerge import api, data") == [
        "fedmerge.core.types",
        "fedmerge.data",
    ]
    assert fedmerge_imports_past_the_api("from fedmerge.api import Update\nimport torch") == []


def test_every_api_name_resolves_and_is_re_exported():
    import fedmerge.api as api

    assert len(set(api.__all__)) == len(api.__all__)
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert not missing, missing
    public = {name for name in vars(api) if not name.startswith("_")}
    assert public == set(api.__all__), public ^ set(api.__all__)
    # no new logic: every class and function is the one its own module defines
    defined_here = [n for n in api.__all__ if getattr(getattr(api, n), "__module__", None) == "fedmerge.api"]
    assert not defined_here, defined_here
    assert api.ALGORITHMS is ALGORITHMS and api.ServerState is ServerState and api.Update is Update
    assert "fedavg" in ALGORITHMS.names()  # importing it registers the built-in methods
