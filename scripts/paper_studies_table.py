"""Moved into the package: ``python -m fedmerge.study.paper_table [--write]`` (the table of the papers' own
experiments in docs/paper_studies.md and docs/howto/paper-table.md, generated from the study files)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's fedmerge
from fedmerge.study.paper_table import main  # noqa: E402

if __name__ == "__main__":
    main()
