"""Moved into the package: ``python -m fedmerge.report.legacy.fedmerge_report --setting ...``; this runs it with
this checkout's fedmerge."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's fedmerge
from fedmerge.report.legacy.fedmerge_report import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])
