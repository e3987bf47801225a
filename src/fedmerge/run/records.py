"""A run's JSON-lines logs (``metrics.jsonl``, ``provenance.jsonl``): whole-line appends, and reading
back only the lines that were written whole.

A line is whole when it ends with a newline and holds one JSON object; everything from the first line
that is not (a crash mid-write, a copy cut short) is the damaged tail, never read as data.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedmerge.core.checkpoint import atomic_write_bytes


def append_line(path: Path, row: dict[str, Any], sort_keys: bool = False) -> None:
    """One whole line in one write, on disk when this returns (a round's end)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row, sort_keys=sort_keys) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_lines(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """(the rows before the first damaged line, whether anything follows them)."""
    if not path.exists():
        return [], False
    text = path.read_text(encoding="utf-8", errors="replace")
    rows: list[dict[str, Any]] = []
    for line in text.splitlines(keepends=True):
        row = _whole(line)
        if row is None:
            return rows, True
        rows.append(row)
    return rows, False


def all_readable_rows(path: Path) -> list[dict[str, Any]]:
    """Every line that parses, damaged or not around it (for figures that only grow, like time spent)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def rewrite_lines(path: Path, rows: list[dict[str, Any]], sort_keys: bool = False) -> None:
    """``path`` holds exactly ``rows`` (written to a temporary file and renamed: never half of it)."""
    text = "".join(json.dumps(r, sort_keys=sort_keys) + "\n" for r in rows)
    atomic_write_bytes(path, text.encode())


def repair_tail(path: Path, sort_keys: bool = False) -> bool:
    """Drop a damaged tail so that the next append starts a line of its own; whether there was one."""
    rows, damaged = read_lines(path)
    if damaged:
        rewrite_lines(path, rows, sort_keys)
    return damaged


def _whole(line: str) -> dict[str, Any] | None:
    if not line.endswith("\n"):
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None
