"""Moved into the package: ``python -m fedmerge.report.legacy.livar_report``; this runs it with this
checkout as the repository root (its configs, its runs/ folder)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's fedmerge
from fedmerge.report.legacy.livar_report import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:], root=ROOT)
