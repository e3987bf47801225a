"""The documentation site: option tables rendered from the config schema, every built-in method documented,
a strict build (broken links and anchors fail it), and two built pages opened in headless Chromium."""

from __future__ import annotations

import functools
import html
import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Literal

import pytest
import yaml
from headless_chromium import open_url, unavailable
from pydantic import BaseModel, Field

from fedmerge.algorithms import ALGORITHMS
from fedmerge.config import catalog, schema, sections
from fedmerge.config.schema_docs import describe, markdown_table

ROOT = Path(__file__).resolve().parent.parent
METHODS = ROOT / "docs" / "methods"
MARKER = re.compile(r"<!--\s*options:\s*algorithm\s+([\w-]+)\s*-->")
NO_MKDOCS = "mkdocs absent: pip install -e '.[docs]'"


def has_mkdocs() -> bool:
    return all(importlib.util.find_spec(m) for m in ("mkdocs", "material", "mkdocstrings_handlers.python"))


def load_hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Toy(BaseModel):
    name: Literal["toy"] = "toy"
    mode: Literal["a", "b"] = Field("a", description="a: ||w||^2 <= 1 & b*c")
    steps: int = Field(3, ge=1)


def test_markdown_table_escapes_pipes_and_markup_by_hand():
    assert markdown_table(_Toy).splitlines() == [
        "| key | type | default | description |",
        "|---|---|---|---|",
        "| `mode` | <code>'a' &#124; 'b'</code> | <code>a</code> "
        "| a: &#124;&#124;w&#124;&#124;^2 &lt;= 1 &amp; b\\*c |",
        "| `steps` | <code>int, &gt;= 1</code> | <code>3</code> |  |",
    ]


@pytest.mark.parametrize("name", [e.name for e in ALGORITHMS.entries() if e.config.__module__.startswith("fedmerge.")])
def test_every_key_of_a_method_is_a_row_of_its_table(name):
    cls = catalog.config_class("algorithm", name)
    rows = markdown_table(cls).splitlines()[2:]
    assert [re.match(r"\| `([^`]+)` \|", r).group(1) for r in rows] == [d.key for d in describe(cls)]
    assert all(r.count(" | ") == 3 for r in rows)  # four cells: no pipe of a type or description splits a row


def test_every_builtin_method_has_one_options_table_on_a_methods_page():
    shipped = sorted(e.name for e in ALGORITHMS.entries() if e.config.__module__.startswith("fedmerge."))
    found = {}
    for page in sorted(METHODS.glob("*.md")):
        text = page.read_text()
        for name in MARKER.findall(text):
            assert name not in found, f"{name} on {found.get(name)} and {page.name}"
            found[name] = page.name
            assert f"`algorithm.name={name}`" in text and f"fedmerge list algorithm {name}" in text, name
    assert sorted(found) == shipped


@pytest.mark.skipif(not has_mkdocs(), reason=NO_MKDOCS)
def test_hook_renders_the_schema_and_refuses_an_unknown_name():
    from mkdocs.exceptions import PluginError

    hooks = load_hooks()
    page = "Before\n\n<!-- options: algorithm fedprox -->\n\nAfter <!-- not a marker -->\n"
    expected = markdown_table(catalog.config_class("algorithm", "fedprox"))
    assert hooks.on_page_markdown(page, page=None) == f"Before\n\n{expected}\n\nAfter <!-- not a marker -->\n"
    with pytest.raises(PluginError, match="fedprx"):
        hooks.expand("<!-- options: algorithm fedprx -->")


def test_the_options_page_has_a_table_for_every_section_dataset_partitioner_and_model():
    from mkdocs.exceptions import PluginError

    hooks = load_hooks()
    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "options.md").read_text()
    out = hooks.on_page_markdown(page, page=None)
    want = [markdown_table(catalog.config_class(kind)) for kind in catalog.SECTIONS]
    for kind in ("dataset", "partition", "model"):
        want += [markdown_table(e.config) for e in catalog.REGISTRIES[kind].entries()]
        assert all(f"`{kind}.name: {e.name}`" in out for e in catalog.REGISTRIES[kind].entries())
    assert all(table in out for table in want) and "options-all" not in out
    with pytest.raises(PluginError, match="unknown kind 'datasets'"):
        hooks.expand("<!-- options-all: datasets -->")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    )


@pytest.mark.skipif(not has_mkdocs(), reason=NO_MKDOCS)
@pytest.mark.parametrize("link", ["[gone](missing.md)", "[gone](other.md#no-such-heading)"])
def test_the_sites_validation_fails_a_broken_link_or_anchor(tmp_path, link):
    settings = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# Home\n\nSee {link}.\n")
    (docs / "other.md").write_text("# Other\n\n## A heading\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(
        yaml.safe_dump({"site_name": "t", "strict": settings["strict"], **{"validation": settings["validation"]}})
    )
    result = mkdocs_build(config, tmp_path / "site")
    assert result.returncode != 0 and ("missing.md" in result.stderr or "no-such-heading" in result.stderr)
    (docs / "index.md").write_text("# Home\n\nSee [it](other.md#a-heading).\n")
    assert mkdocs_build(config, tmp_path / "site").returncode == 0


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # no access log in the test output
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if not has_mkdocs():
        pytest.skip(NO_MKDOCS)
    out = tmp_path_factory.mktemp("site")
    result = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_site_builds_strictly_with_generated_tables_and_api(site):
    merging = (site / "methods" / "merging" / "index.html").read_text()
    for row in describe(catalog.config_class("algorithm", "fedmerge")):
        assert f"<code>{row.key}</code>" in merging, row.key
    logit_lr = next(r for r in describe(catalog.config_class("algorithm", "fedmerge")) if r.key == "logit_lr")
    assert logit_lr.description.split(";")[0] in merging
    assert "options:" not in merging  # no marker left unexpanded
    loop = (site / "api" / "loop" / "index.html").read_text()
    assert 'id="fedmerge.core.loop.run_rounds"' in loop  # the docstrings were rendered
    # config classes show their fields (griffe-pydantic), not only "Bases: BaseModel": a field, its description
    config = html.unescape(re.sub(r"<[^>]+>", " ", (site / "api" / "config" / "index.html").read_text()))
    config = re.sub(r"\s+", " ", config)
    assert "Fields:" in config
    for cls in (schema.RunSettings, sections.FlowerSettings):
        for name in cls.model_fields:
            assert f" {name} " in config, name
        first = next(f.description for f in cls.model_fields.values() if f.description)
        assert first.split("(")[0].strip() in config, first


@pytest.mark.slow
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_two_pages_open_in_headless_chromium_with_navigation_and_no_errors(site, tmp_path):
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    # The navigation as a reader sees it: the top tabs and the section links of the sidebar.
    probe = """JSON.stringify({
      tabs: [...document.querySelectorAll('.md-tabs__link')].map(a => a.textContent.trim()),
      links: document.querySelectorAll('nav.md-nav--primary a.md-nav__link').length,
      title: document.querySelector('article h1') && document.querySelector('article h1').textContent.trim(),
      tables: document.querySelectorAll('article table').length,
      cut: [...document.querySelectorAll('article pre code')].filter(c => c.scrollWidth > c.clientWidth + 1).length})"""
    try:
        for path, title in (("", "fedmerge"), ("methods/merging/", "Model merging: FedMerge")):
            shot = tmp_path / f"{path.strip('/').replace('/', '_') or 'home'}.png"
            result = open_url(f"{base}/{path}", probe, shot)
            assert result.errors == [], (path, result.errors)
            seen = json.loads(result.value)
            assert seen["title"].startswith(title), seen
            assert {"Getting started", "User guide", "How-to", "Methods", "API reference"} <= set(seen["tabs"]), seen
            assert seen["links"] > 20 and seen["tables"] >= 1, seen
            assert shot.stat().st_size > 10_000
        # long command lines wrap, none cut at the column's edge (17 of deployment.md's 20 blocks were)
        deployment = json.loads(open_url(f"{base}/deployment/", probe, tmp_path / "deployment.png").value)
        assert deployment["cut"] == 0, deployment
    finally:
        server.shutdown()


def test_docstrings_use_the_sites_cross_references_not_sphinx_roles():
    """mkdocstrings shows a Sphinx role (:class:`X`) literally; the site's syntax is [`X`][fedmerge.path.X]."""
    import re

    role = re.compile(r":(class|func|meth|data|mod|attr|exc|obj):`")
    src = Path(__file__).resolve().parents[1] / "src" / "fedmerge"
    found = [
        f"{p.relative_to(src)}:{i}"
        for p in src.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if role.search(line)
    ]
    assert not found, f"Sphinx roles in docstrings: {found[:5]}"
