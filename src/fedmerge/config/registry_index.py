"""The built-in components' names and descriptions, as a committed file, so that ``fedmerge list`` answers
without importing the methods, models and datasets (torch among them).

``registry_index.json`` beside this module is generated from the live registries
(``python -m fedmerge.config.registry_index --write``); ``tests/test_cli.py`` fails when it differs from them,
so a method added without regenerating it cannot go unnoticed. With installed plugins the listing reads the
live registries instead, since a plugin's components are only known once it is imported.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

INDEX_FILE = Path(__file__).with_name("registry_index.json")

Index = dict[str, list[tuple[str, str]]]  # kind -> (name, description) in registration order


def read_index() -> Index:
    data = json.loads(INDEX_FILE.read_text(encoding="utf-8"))
    return {kind: [(name, text) for name, text in rows] for kind, rows in data.items()}


def live_index() -> Index:
    """The index of the registries as this process has them (imports every built-in component)."""
    from fedmerge.config.catalog import REGISTRIES

    return {kind: [(e.name, e.description) for e in reg.entries()] for kind, reg in REGISTRIES.items()}


def index_text(index: Index) -> str:
    return json.dumps(index, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write or check the built-in components' index")
    ap.add_argument("--write", action="store_true", help="rewrite registry_index.json from the registries")
    args = ap.parse_args(argv)
    text = index_text(live_index())
    if args.write:
        INDEX_FILE.write_text(text, encoding="utf-8")
        return 0
    if INDEX_FILE.read_text(encoding="utf-8") != text:
        print(f"{INDEX_FILE.name} is stale: python -m fedmerge.config.registry_index --write")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
