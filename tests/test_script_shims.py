"""scripts/ holds only shims for the paths that docs, HISTORY files and generated files name: each one reaches the
command it stands for (read without running it), and stays small."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from fedmerge.report.legacy import fedmerge_report, foundation_report, livar_report, superfed_ablation, superfed_report
from fedmerge.study import confirmation, moved_reproductions, reproductions_index

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
PACKAGE = {
    "reproductions_index": reproductions_index.main,
    "check_moved_reproductions": moved_reproductions.main,
    "confirmation_study": confirmation.main,
    "livar_report": livar_report.main,
    "superfed_report": superfed_report.main,
    "superfed_ablation": superfed_ablation.main,
    "foundation_report": foundation_report.main,
    "fedmerge_report": fedmerge_report.main,
}
BENCHMARKS = {"device_check", "pfedmoe_diagnose"}
OTHERS = {"mkdocs_hooks.py", "reproduce.py", "slurm_one_node.sh"}  # the MkDocs hook, a deprecation, SLURM


def test_scripts_holds_only_the_known_shims_and_tools():
    names = {p.name for p in SCRIPTS.iterdir() if p.is_file()}
    assert names == {f"{n}.py" for n in [*PACKAGE, *BENCHMARKS]} | OTHERS


@pytest.mark.parametrize("name", sorted(PACKAGE))
def test_a_package_shim_runs_the_package_command(name):
    namespace = runpy.run_path(str(SCRIPTS / f"{name}.py"), run_name="not_main")
    assert namespace["main"] is PACKAGE[name]
    assert len((SCRIPTS / f"{name}.py").read_text().splitlines()) < 15


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_a_benchmark_shim_runs_the_benchmark(name):
    shim = (SCRIPTS / f"{name}.py").read_text()
    assert f'ROOT / "benchmarks" / "{name}.py"' in shim and (ROOT / "benchmarks" / f"{name}.py").exists()
    assert len(shim.splitlines()) < 15
