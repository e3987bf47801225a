"""The repository stands alone (no references outside it), the README and docs list what exists, pyproject
accepts other torch builds, and CI fails on a missing dataset and reports skipped tests."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from fedmerge.algorithms import ALGORITHMS
from fedmerge.data import DATASETS, PARTITIONERS

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ""}


def repo_text_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [ROOT / f for f in tracked.splitlines()] or list(ROOT.rglob("*"))
    return [f for f in files if f.is_file() and f.suffix in TEXT_SUFFIXES]


def test_nothing_points_outside_the_repository():
    outside = re.compile(r"\.\./shared|(?<![\w-])shared/[\w.-]+\.md|/work/")
    hits = [
        f"{f.relative_to(ROOT)}:{i}"
        for f in repo_text_files()
        if f.name != "test_packaging.py"
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), start=1)
        if outside.search(line)
    ]
    assert hits == []


def test_readme_links_resolve_and_architecture_doc_exists():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
    assert "docs/architecture.md" in readme and (ROOT / "docs" / "architecture.md").stat().st_size > 2000


def test_readme_and_the_guide_list_every_dataset_algorithm_and_partitioner():
    # The README's methods table names every method; the data page of the guide every dataset and partitioner.
    pages = {ALGORITHMS: "README.md", DATASETS: "docs/guide/data.md", PARTITIONERS: "docs/guide/data.md"}
    for registry, page in pages.items():
        text = (ROOT / page).read_text()
        shipped = [e for e in registry.entries() if e.config.__module__.startswith("fedmerge.")]  # not tests'
        missing = [e.name for e in shipped if f"`{e.name}`" not in text]
        assert missing == [], (registry.kind, page)
    own_data = (ROOT / "docs" / "guide" / "your-data.md").read_text()
    for option in ("header", "label_column", "client_column", "delimiter", "standardize"):
        assert option in own_data, option


def test_torch_is_a_compatible_range_not_a_pin():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    assert not any(s.operator == "==" for s in torch.specifier)
    assert all(v in torch.specifier for v in ("2.3.0", "2.13.0", "2.13.1")) and "3.0.0" not in torch.specifier
    assert "pip install torch==2.13.0 && pip install -e" in (ROOT / "README.md").read_text()  # CPU build first


# the SPDX identifiers pyproject may declare, with the title line their license text starts with
LICENSE_TITLES = {"Apache-2.0": ("Apache License", "Version 2.0, January 2004")}


def test_the_license_file_is_the_license_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    spdx = declared["text"] if isinstance(declared, dict) else declared
    assert spdx in LICENSE_TITLES, f"pyproject declares {spdx!r}: add its title to LICENSE_TITLES"
    text = (ROOT / "LICENSE").read_text()
    head = [line.strip() for line in text.splitlines() if line.strip()][:2]
    assert head == list(LICENSE_TITLES[spdx])
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not its title


def ci_tail(fake_pytest: str) -> subprocess.CompletedProcess:
    """Run .ci/run's test step with pytest replaced by ``fake_pytest`` (a shell command, run for each of the
    two stages: the default run, then the real-process tests)."""
    script = (ROOT / ".ci" / "run").read_text()
    tail = script[script.index("log=$(mktemp)") :].replace("python -m pytest -rs", "fake")
    fake = f"fake() {{ {fake_pytest}; }}\n"
    return subprocess.run(["bash", "-c", "set -euo pipefail\n" + fake + tail], capture_output=True, text=True)


def test_ci_reports_skipped_tests_last_and_keeps_pytests_exit_status():
    skipped = ci_tail("{ echo 'SKIPPED [2] tests/x.py: absent'; echo '=== 5 passed, 2 skipped in 1.0s ==='; }")
    assert skipped.returncode == 0
    assert skipped.stdout.strip().splitlines()[-1].startswith("CI: 4 test(s) SKIPPED")  # 2 in each stage
    failed = ci_tail("{ echo '=== 1 failed, 4 passed, 1 skipped in 1.0s ==='; return 1; }")
    assert failed.returncode == 1 and "2 test(s) SKIPPED" in failed.stdout
    clean = ci_tail("{ echo '=== 5 passed in 1.0s ==='; }")
    assert clean.returncode == 0 and "SKIPPED" not in clean.stdout


def test_ci_fails_loudly_when_a_dataset_cannot_be_installed():
    script = (ROOT / ".ci" / "run").read_text()
    # the datasets' part: a dataset that cannot be installed stops CI (its tests would be skipped silently); only
    # the one-node SLURM after it may be missing, said in a line and counted by the skipped-tests line at the end
    datasets = script[: script.index("# A one-node SLURM")]
    assert "will be skipped" not in datasets and "FASHION" in datasets
    assert script.count("|| die") >= 3 and "die()" in script
    for path in ("FASHION", "WORDNET", "DIGITS_PNG"):
        assert f'[ -f "${path}" ] || die' in script or f'if [ ! -f "${path}" ]' in script
