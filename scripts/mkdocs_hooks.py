"""MkDocs hooks for the documentation site (mkdocs.yml: ``hooks``).

``<!-- options: KIND NAME -->`` in a page becomes the option table of that component, rendered from its
config schema at build time (``fedmerge.config.schema_docs.markdown_table``, the same rows as
``fedmerge list KIND NAME``), so the site's tables cannot drift from the code. On GitHub the marker is
an invisible comment; each page says which ``fedmerge list`` command prints the same table.
An unknown kind or name fails the build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

# The tables describe the checkout being built, not whichever fedmerge is installed (mkdocstrings: paths: [src]).
# Imported here: MkDocs restores sys.path once the hook module is loaded.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from fedmerge.config import catalog  # noqa: E402
from fedmerge.config.schema_docs import markdown_table  # noqa: E402

MARKER = re.compile(r"<!--\s*options:\s*(\w+)(?:\s+([\w-]+))?\s*-->")
# ``<!-- options-all: KIND -->``: a heading and a table for every registered component of KIND (the options
# reference page), or every plain section for KIND ``sections``
ALL_MARKER = re.compile(r"<!--\s*options-all:\s*(\w+)\s*-->")


def options_table(kind: str, name: str | None) -> str:
    try:
        cls = catalog.config_class(kind, name)
    except KeyError as exc:
        raise PluginError(f"options marker: {exc.args[0]}") from None
    return markdown_table(cls)


def all_tables(kind: str) -> str:
    if kind == "sections":
        parts = [(f"`{name}`" if name == "run" else f"`{name}:`", name, None) for name in catalog.SECTIONS]
    elif kind in catalog.REGISTRIES:
        registry = catalog.REGISTRIES[kind]
        parts = [(f"`{kind}.name: {e.name}`: {e.description}", kind, e.name) for e in registry.entries()]
    else:
        known = ", ".join(["sections", *catalog.REGISTRIES])
        raise PluginError(f"options-all marker: unknown kind {kind!r}; one of: {known}")
    return "\n\n".join(f"### {title}\n\n{options_table(k, n)}" for title, k, n in parts)


def expand(markdown: str) -> str:
    markdown = ALL_MARKER.sub(lambda m: all_tables(m.group(1)), markdown)
    return MARKER.sub(lambda m: options_table(m.group(1), m.group(2)), markdown)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    return expand(markdown)
