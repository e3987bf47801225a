"""Methods own their knowledge: the hooks of an algorithm's registry entry (summary fields and lines, report figures)
and the method command groups (``fedmerge livar``, a plugin's through the entry point ``fedmerge.cli``). The example
plugin's end-to-end use of all of them is in tests/test_plugins.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from typer.testing import CliRunner

from fedmerge.algorithms import ALGORITHMS
from fedmerge.algorithms.assignments import ASSIGNMENT_HOOKS, MERGE_WEIGHTS
from fedmerge.algorithms.fedavg import FedAvg, FedAvgConfig
from fedmerge.algorithms.lambda_line import LAMBDA_HOOKS, LAMBDA_LINE
from fedmerge.cli import app
from fedmerge.cli.app import method_commands
from fedmerge.core import plugins
from fedmerge.core.method_hooks import NO_HOOKS, MethodHooks, ReportFigure
from fedmerge.report.method_figures import figure_kinds
from fedmerge.run.summary import build_summary, summary_markdown

# four clients in two groups, merge weights whose argmax recovers them exactly
ROWS = [
    {
        "round": 1,
        "comm_down": 1.0,
        "comm_up": 1.0,
        "server": {"merge_weights": [[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.1, 0.9]]},
    }
]


def test_the_built_in_methods_declare_their_hooks():
    for name in ("fedmerge", "ifca", "fedem"):
        assert ALGORITHMS.hooks(name) is ASSIGNMENT_HOOKS
    for name in ("superfed_mm", "superfed_lm", "apfl"):
        assert ALGORITHMS.hooks(name) is LAMBDA_HOOKS
    assert ALGORITHMS.hooks("fedavg") is NO_HOOKS and ALGORITHMS.hooks("no_such_method") is NO_HOOKS
    assert ALGORITHMS.hooks(None) is NO_HOOKS
    kinds = [f.name for f in figure_kinds()]
    assert kinds[:2] == ["merge_weights", "lambda"] and len(set(kinds)) == len(kinds)  # shared figures once
    assert figure_kinds()[:2] == [MERGE_WEIGHTS, LAMBDA_LINE]


def test_cluster_recovery_is_the_methods_own_field():
    info = {"num_clients": 4, "client_groups": [0, 0, 1, 1]}
    ifca = build_summary(ROWS, {"algorithm": "ifca", **info})
    assert ifca["cluster_recovery"] == {"round": 1, "ari": 1.0, "ari_by_round": {"1": 1.0}}
    # where the runner wrote it before: after the run-wide fields, before the selections
    assert list(ifca)[-2:] == ["parameter_budget", "cluster_recovery"]
    assert summary_markdown(ifca).endswith(
        "\ncluster recovery (ARI of argmax merge weight vs. true group) at round 1: 1.0000\n"
    )
    fedavg = build_summary(ROWS, {"algorithm": "fedavg", **info})  # the same rows, a method without the hook
    assert "cluster_recovery" not in fedavg and "cluster recovery" not in summary_markdown(fedavg)


class ClashConfig(FedAvgConfig):
    name: Literal["test_hooks_clash"] = "test_hooks_clash"


class Clash(FedAvg):  # its own class, defined here: the registry's built-in methods stay fedmerge's own
    name = "test_hooks_clash"


def test_a_summary_field_may_not_replace_the_summarys_own():
    if "test_hooks_clash" not in ALGORITHMS:
        hooks = MethodHooks(summary_extras=lambda rows, info: {"parameter_budget": {}, "mine": 1})
        ALGORITHMS.register("test_hooks_clash", config=ClashConfig, description="test only", hooks=hooks)(Clash)
    with pytest.raises(ValueError) as err:
        build_summary(ROWS, {"algorithm": "test_hooks_clash"})
    assert str(err.value) == "summary_extras of test_hooks_clash: parameter_budget is a field the summary already has"
    # a second registration of the name is refused before its hooks could replace the first's
    with pytest.raises(ValueError, match="already registered"):
        ALGORITHMS.register("test_hooks_clash", config=ClashConfig, description="again", hooks=NO_HOOKS)(Clash)
    assert ALGORITHMS.hooks("test_hooks_clash") is not NO_HOOKS


class FigureConfig(FedAvgConfig):
    name: Literal["test_hooks_figure"] = "test_hooks_figure"


class WithFigure(FedAvg):  # defined here, outside fedmerge: a plugin's method
    name = "test_hooks_figure"


def test_a_plugins_figure_is_a_section_only_on_a_page_with_its_runs():
    if "test_hooks_figure" not in ALGORITHMS:
        figure = ReportFigure(name="test_hooks_steps", title="Steps", draw=lambda run, path: None, order=5)
        hooks = MethodHooks(report_figures=(figure,))
        ALGORITHMS.register("test_hooks_figure", config=FigureConfig, description="test only", hooks=hooks)(WithFigure)
    assert "test_hooks_steps" not in [f.name for f in figure_kinds()]  # fedmerge's own sections only
    assert "test_hooks_steps" not in [f.name for f in figure_kinds(["fedavg", "fedmerge"])]
    # by order (5 before the built-ins' 10 and 20), then name
    assert [f.name for f in figure_kinds(["test_hooks_figure"])][:3] == ["test_hooks_steps", "merge_weights", "lambda"]


# --- method command groups --------------------------------------------------------------------------------------
def installed(folder: Path, lines: str) -> None:
    info = folder / "commands_for_tests-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: commands-for-tests\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[fedmerge.cli]\n{lines}\n")


@pytest.fixture
def command_module(tmp_path, monkeypatch) -> Path:
    """A light module with a typer app, a package declaring it (and a broken one, and one named like a built-in
    command) in the entry-point group, both on sys.path."""
    (tmp_path / "hooks_test_commands.py").write_text(
        "import typer\n"
        "app = typer.Typer(help='Commands for tests.')\n"
        "@app.command('hello')\n"
        "def hello(who: str) -> None:\n"
        "    typer.echo(f'hello {who}')\n"
    )
    installed(
        tmp_path,
        "hooks-test = hooks_test_commands:app\nbroken = no_such_command_module:app\nrun = hooks_test_commands:app",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.AUTOLOAD_OFF, raising=False)
    return tmp_path


def test_an_installed_command_group_runs_and_a_broken_one_is_one_line(command_module, monkeypatch):
    found = method_commands()
    assert found["livar"] == ("fedmerge", "fedmerge.cli.livar:livar_app")  # fedmerge's own, the same way
    assert found["hooks-test"][1] == "hooks_test_commands:app"
    assert "Run an experiment" in CliRunner().invoke(app, ["run", "--help"]).output  # a built-in name stays fedmerge's
    result = CliRunner().invoke(app, ["hooks-test", "hello", "you"])
    assert result.exit_code == 0 and result.output == "hello you\n"
    listing = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "300"}).output
    assert "Commands for tests." in listing and "Run an experiment" in listing  # `run` is still fedmerge's
    for args in (["broken"], ["broken", "--help", "x"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2
        assert result.output.strip().splitlines() == [
            "error: installed command 'broken' (entry point fedmerge.cli): cannot import no_such_command_module:app "
            "(ModuleNotFoundError: No module named 'no_such_command_module'); "
            "FEDMERGE_DISABLE_PLUGIN_AUTOLOAD=1 skips installed plugins"
        ]
    monkeypatch.setenv(plugins.AUTOLOAD_OFF, "1")  # skipped with the installed plugins; fedmerge's own stay
    assert "hooks-test" not in method_commands() and "livar" in method_commands()
    assert CliRunner().invoke(app, ["hooks-test", "hello", "you"]).exit_code == 2


def test_help_with_an_installed_command_group_imports_nothing_heavy(command_module):
    """The example plugin's command module (typer at the top, fedmerge.api inside its command) keeps the fast start."""
    plugin_dir = Path(__file__).parent / "plugin_example"
    installed(command_module / "example", "server-step = fedmerge_server_step_cli:app")
    src = Path(__file__).parent.parent / "src"
    code = (
        "import sys\n"
        "from fedmerge.cli import main\n"
        "sys.argv = ['fedmerge', '--help']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('LOADED', sorted(m for m in ('torch', 'numpy', 'fedmerge.algorithms', 'fedmerge_server_step') "
        "if m in sys.modules), 'fedmerge_server_step_cli' in sys.modules)\n"
    )
    path = os.pathsep.join(
        [str(src), str(command_module / "example"), str(plugin_dir), os.environ.get("PYTHONPATH", "")]
    )
    env = {**os.environ, "PYTHONPATH": path, "COLUMNS": "200"}
    env.pop(plugins.AUTOLOAD_OFF, None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "server-step" in proc.stdout and "Tools of fedavg_server_lr" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "LOADED [] True"
