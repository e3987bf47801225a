"""A fast start: ``fedmerge --help`` and the commands' ``--help`` import no method, model or dataset, and none
of the heavy libraries (torch, numpy, pydantic, Flower, transformers, matplotlib, ...); ``fedmerge list``
imports every method but still none of the optional heavy libraries. Checked on ``sys.modules`` in a fresh
process, never on a clock (timings depend on the machine and its load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fedmerge

SRC = Path(fedmerge.__file__).parent.parent

# imported only when a command runs that needs them
HEAVY = ("torch", "numpy", "pydantic", "pandas", "scipy", "sklearn", "safetensors", "lmdb", "yaml", "jinja2")
OPTIONAL = ("flwr", "ray", "transformers", "peft", "matplotlib", "optuna", "opacus", "shap", "timm", "tensorboard")
FLOORS = ("fedmerge.algorithms", "fedmerge.models", "fedmerge.data", "fedmerge.config", "fedmerge.run")

MARK = "MODULES:"


def modules_after(*args: str) -> set[str]:
    """The top-level packages and fedmerge packages in ``sys.modules`` after ``fedmerge ARGS`` ran in a new
    process, as the console script starts it."""
    code = (
        "import json, sys\n"
        "from fedmerge.cli import main\n"
        f"sys.argv = ['fedmerge', *{list(args)!r}]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "names = {m.split('.')[0] for m in sys.modules} | {'.'.join(m.split('.')[:2]) for m in sys.modules}\n"
        f"print({MARK!r} + json.dumps(sorted(names)))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), COLUMNS="100")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in reversed(proc.stdout.splitlines()) if line.startswith(MARK))
    return set(json.loads(line.removeprefix(MARK)))


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        [],  # no arguments: the help too
        ["run", "--help"],
        ["sweep", "--help"],
        ["list", "--help"],
        ["report", "--help"],
        ["plot", "budget", "--help"],
        ["data", "--help"],
        ["deploy", "--help"],
    ],
    ids=lambda args: " ".join(args) or "no-arguments",
)
def test_help_imports_nothing_heavy(args):
    loaded = modules_after(*args)
    assert "fedmerge.cli" in loaded  # the probe ran the command
    wrong = sorted(loaded & {*HEAVY, *OPTIONAL, *FLOORS})
    assert not wrong, f"fedmerge {' '.join(args)} imported {wrong}"


def test_list_imports_the_methods_but_no_optional_library():
    loaded = modules_after("list")
    assert {"fedmerge.algorithms", "fedmerge.models", "fedmerge.data"} <= loaded  # it lists them all
    wrong = sorted(loaded & set(OPTIONAL))
    assert not wrong, f"fedmerge list imported {wrong}"


def test_a_help_text_made_when_shown_still_names_the_datasets():
    from typer.testing import CliRunner

    from fedmerge.cli import app

    result = CliRunner().invoke(app, ["data", "fetch", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert "one of: cifar10, cifar100" in result.output and "$FEDMERGE_DATA_DIR" in result.output
