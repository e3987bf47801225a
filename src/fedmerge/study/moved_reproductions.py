"""Check that moving docs/reproductions/ into <paper>/<family>/ folders changed nothing but paths.

    python -m fedmerge.study.moved_reproductions [--base REV]    # from the repository root

(``scripts/check_moved_reproductions.py`` runs the same from any folder.)

For every row of ``docs/reproductions/MOVED.md`` (old path -> new path) the file as it was at
``--base`` (a commit before the move; default: the one named in MOVED.md) is compared with the file
now. A JSON file must be byte-identical. A markdown file is compared after its relative links are
re-pointed: each link target is resolved from the old file's folder, mapped through MOVED.md, and
written relative to the new file's folder (a link text that spelled the old path is re-spelled the
same way). ``verdicts.md`` stays where it is but is checked the same way, with the one sentence that
named "a table above" (the README's tables, now TABLES.md) allowed to change. Prints one line per
file that differs and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import posixpath
import re
import subprocess
import sys
from pathlib import Path

MOVED = Path("docs") / "reproductions" / "MOVED.md"  # under the repository root
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
ROW = re.compile(r"^\| `([^`]+)` \| `([^`]+)` \|$")
BASE = re.compile(r"moved at commit `([0-9a-f]{7,40})`")
# Files that stay in place but whose links point at moved files.
UNMOVED = ["docs/reproductions/verdicts.md"]
# Edits to unmoved files that are not link re-pointing, each named here so a reviewer sees them all.
ALLOWED_EDITS = {
    "docs/reproductions/verdicts.md": [
        (
            "every figure is from a table above or from the study report it names",
            "every figure is from a table in [TABLES.md](TABLES.md) or from the study report it names",
        )
    ],
}


def read_moves(text: str) -> dict[str, str]:
    """The old -> new repository paths listed in MOVED.md's table."""
    moves = {}
    for line in text.splitlines():
        match = ROW.match(line.strip())
        if match:
            moves[match.group(1)] = match.group(2)
    return moves


def relink(text: str, old_file: str, new_file: str, moves: dict[str, str]) -> str:
    """``text`` (the content of ``old_file``) with its relative links re-pointed for ``new_file``."""
    old_dir, new_dir = posixpath.dirname(old_file), posixpath.dirname(new_file)

    def repoint(match: re.Match[str]) -> str:
        label, target = match.group(1), match.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return match.group(0)
        path, hash_, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(old_dir, path))
        new_target = posixpath.relpath(moves.get(resolved, resolved), new_dir) + hash_ + anchor
        if new_target == target:
            return match.group(0)
        # A label that spelled the old path is re-spelled; a bare file name that did not change stays.
        if label == target and ("/" in target or posixpath.basename(path) != posixpath.basename(new_target)):
            label = new_target
        return f"[{label}]({new_target})"

    return LINK.sub(repoint, text)


def old_version(root: Path, rev: str, path: str) -> bytes:
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, check=True).stdout


def check(root: Path, rev: str, moves: dict[str, str]) -> list[str]:
    """One line per file of the repository ``root`` whose content changed beyond its paths."""
    problems = []
    pairs = [*moves.items(), *((p, p) for p in UNMOVED)]
    for old, new in pairs:
        before, after = old_version(root, rev, old), (root / new).read_bytes()
        if new.endswith(".md"):
            expected = relink(before.decode(), old, new, moves)
            for was, now in ALLOWED_EDITS.get(new, []):
                expected = expected.replace(was, now)
            same = expected == after.decode()
        else:
            same = before == after
        if not same:
            problems.append(f"{old} -> {new}: content differs beyond moved paths")
    return problems


def main(argv: list[str] | None = None, root: Path | None = None) -> int:
    """The command; ``root``: the repository root (default: the current folder)."""
    root = Path.cwd() if root is None else root
    text = (root / MOVED).read_text()
    default = BASE.search(text)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=default.group(1) if default else None, help="a commit before the move")
    args = parser.parse_args(argv)
    if not args.base:
        parser.error("no --base given and MOVED.md names no commit")
    moves = read_moves(text)
    problems = check(root, args.base, moves)
    for line in problems:
        print(line)
    n_md = sum(new.endswith(".md") for new in moves.values()) + len(UNMOVED)
    print(f"{len(moves) + len(UNMOVED)} files checked against {args.base} ({n_md} markdown), {len(problems)} differ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
