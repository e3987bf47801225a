"""Every Markdown table under docs/ renders: a header row, then a separator row with as many cells, and no body
row longer than the header (GitHub and MkDocs drop a table whose header and separator disagree, and cut longer
rows); and the published studies whose regime is not kept on every seed label their verdicts provisional."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
SEPARATOR = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def cells(line: str) -> int:
    """Cells of a table row: pipes not escaped as ``\\|``, outer pipes optional."""
    row = line.strip()
    row = row[1:] if row.startswith("|") else row
    row = row[:-1] if row.endswith("|") and not row.endswith("\\|") else row
    return len(re.split(r"(?<!\\)\|", row))


def tables(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each run of lines starting with a pipe, outside fenced code."""
    found, block, fenced = [], [], False
    for number, line in enumerate([*text.splitlines(), ""], start=1):
        if FENCE.match(line):
            fenced = not fenced
        if not fenced and line.lstrip().startswith("|"):
            block.append(line)
            continue
        if block:
            found.append((number - len(block), block))
            block = []
    return found


def table_problems(text: str) -> list[str]:
    problems = []
    for start, block in tables(text):
        if len(block) < 2 or not SEPARATOR.match(block[1]):
            problems.append(f"line {start}: no separator row under the header")
            continue
        header, separator = cells(block[0]), cells(block[1])
        if header != separator:
            problems.append(f"line {start}: {header} header cells over {separator} separator cells")
        for offset, row in enumerate(block[2:], start=2):
            if cells(row) > header:
                problems.append(f"line {start + offset}: {cells(row)} cells under a {header}-cell header")
    return problems


def test_the_check_finds_each_kind_of_broken_table():
    good = "| a | b |\n|---|:-:|\n| 1 | 2 \\| 3 |\n\n```\n| not | a table\n```\n"
    assert table_problems(good) == []
    wrong = "| a | b | c |\n|---|---|\n| 1 | 2 | 3 |\n"
    assert table_problems(wrong) == ["line 1: 3 header cells over 2 separator cells"]
    assert table_problems("text\n| a | b |\n|---|---|\n| 1 | 2 | 3 |\n") == ["line 4: 3 cells under a 2-cell header"]
    assert table_problems("| a | b |\n| 1 | 2 |\n") == ["line 1: no separator row under the header"]


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_table_in_the_docs_has_matching_header_and_separator(page):
    assert table_problems(page.read_text()) == []


UNSEEN = DOCS / "reproductions" / "unseen"


@pytest.mark.parametrize("page", sorted(UNSEEN.glob("*.md")), ids=lambda p: p.name)
def test_the_unseen_studies_verdicts_are_provisional_where_the_regime_is_not_kept(page):
    text = page.read_text()
    verdicts = re.findall(r"\| \*\*(?:reproduced|level|not reproduced)\*\*( \(provisional\))? \|$", text, re.M)
    if "**Regime NOT kept**" in text:
        assert verdicts and all(verdicts), page.name
    elif "**Regime kept**" in text:
        assert not any(verdicts), page.name
