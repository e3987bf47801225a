"""Moved: ``python benchmarks/device_check.py``; this runs it with this checkout's fedmerge."""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's fedmerge

if __name__ == "__main__":
    runpy.run_path(str(ROOT / "benchmarks" / "device_check.py"), run_name="__main__")
