"""Moved into the package: ``python -m fedmerge.study.moved_reproductions [--base REV]``; this runs it on this
checkout from any folder."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's fedmerge
from fedmerge.study.moved_reproductions import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], root=ROOT))
