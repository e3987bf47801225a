"""What made a run folder: the exact command, package versions and git commit of every segment.

``provenance.jsonl`` gets one line each time a run starts or resumes, so a report can print the
command that really produced a number (never one rebuilt from today's defaults) and can tell when a
run's segments came from different commits.
"""

from __future__ import annotations

import platform
import re
import shlex
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from fedmerge.run.records import all_readable_rows, append_line, repair_tail
from fedmerge.run.results import PROVENANCE_FILE

FILE = PROVENANCE_FILE


@lru_cache(maxsize=1)
def source_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git checkout this package runs from; (None, None) outside one."""
    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", "src"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit or None, bool(status.strip())


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedmerge")
    except PackageNotFoundError:
        return "unknown"


# options whose value is a credential: never written to a file (``--token`` is how Flower starts a ServerApp)
SECRET_OPTION = re.compile(r"^--?[\w-]*(token|secret|password|passwd)[\w-]*$", re.IGNORECASE)


def redact(argv: list[str]) -> list[str]:
    """``argv`` with the value of every credential option replaced (``--token X``, ``--token=X``)."""
    out: list[str] = []
    for arg in argv:
        name, eq, _ = arg.partition("=")
        if out and SECRET_OPTION.match(out[-1]) and not eq:
            out.append("<redacted>")
        elif eq and SECRET_OPTION.match(name):
            out.append(f"{name}=<redacted>")
        else:
            out.append(arg)
    return out


def record_segment(
    run_dir: str | Path, start_round: int, resumed: bool, invocation: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Append this invocation to the run's provenance and return the line. ``invocation``: what the user
    asked for (``command`` and any details) when this process's command line is not that (a ServerApp)."""
    commit, dirty = source_commit()
    argv = list(sys.argv)
    # `fedmerge` on PATH, or `python -m fedmerge` (how `fedmerge sweep` starts its runs)
    if argv and (Path(argv[0]).name == "fedmerge" or Path(argv[0]).parts[-2:] == ("fedmerge", "__main__.py")):
        argv[0] = "fedmerge"
    line = {
        "command": shlex.join(redact(argv)),
        **(invocation or {}),
        "resumed": resumed,
        "start_round": start_round,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "fedmerge": package_version(),
        "commit": commit,
        "dirty": dirty,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    path = Path(run_dir) / FILE
    repair_tail(path)  # a line cut by a crash would swallow this one
    append_line(path, line)
    return line


def read_provenance(run_dir: str | Path) -> list[dict[str, Any]]:
    return all_readable_rows(Path(run_dir) / FILE)
