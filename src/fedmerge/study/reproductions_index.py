"""Write docs/reproductions/README.md (the index) and TABLES.md (every study's rows) from the studies' JSON files.

    python -m fedmerge.study.reproductions_index            # write both files (from the repository root)
    python -m fedmerge.study.reproductions_index --check    # exit 1, naming the file, if either is out of date

``scripts/reproductions_index.py`` runs the same from any folder. Layout (``fedmerge.study.reproductions``):
``docs/reproductions/PAPER/FAMILY/STUDY.json``, written by ``fedmerge study --out .../STUDY.md`` next to its
report; a family is one study and the revisions of its table, with a hand-written ``HISTORY.md`` and, where
one was written, ``READING.md`` beside them. ``verdicts.md`` and ``unseen/READING.md`` are rendered first,
from the templates beside them whose every figure is read from the JSON files
(``fedmerge.study.reproductions_pages``); ``--check`` fails if a rendered page differs from the committed
one. The README's first table, the study of record per paper table, takes its rows from the "At a glance"
table of ``verdicts.md`` and its regime column from the JSON files; a paper table called
evidence there whose study does not keep the regime on every seed stops the script, so a verdict cannot drift
from the numbers silently. Its second table gives, per paper table, the confirmation on fresh seeds: a study
JSON in the record's family with ``explored_on`` (written by ``fedmerge.study.confirmation``'s study): the
seeds that explored the settings, the fresh ones, the regime on those, and its paper claims: "N of M paper
claims reproduced" (``fedmerge.study.claims``: a claim is reproduced only if every comparison it needs is),
the failed ones named, each comparison counted once across the table, the claims declared after their runs
marked with the times (read from git), the comparisons' own count following as the detail. A hand-written "N
of M paper claims reproduced" in the "At a glance" table that differs from the JSON stops the script (the
template reads it from the JSON, so it can only differ in a hand-edited page).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedmerge.study import claims as claims_lib
from fedmerge.study import reproductions_pages
from fedmerge.study.claims import PaperClaim, count_text, familywise_text, mark_late, paper_claims
from fedmerge.study.regime import FEDAVG_GAP, LOCAL_GAP
from fedmerge.study.reproductions import PAPERS, Family, Study, load_families, revision_order, shared_words

__all__ = ["Family", "Study", "load_families", "main", "outputs", "paper_claims", "revision_order", "shared_words"]

DOCS = Path("docs") / "reproductions"  # under the repository root
GLANCE_HEADER = "| paper table | study of record | regime kept | verdicts |"
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")

METRICS = {
    "clients test acc": "mean client test top-1",
    "clients test top5": "mean client test top-5",
    "global test acc": "the server model's top-1 on the pooled test split",
    "global test top5": "the server model's top-5 on the pooled test split",
}


def pct(values: list[float]) -> str:
    if not values:
        return "-"
    vals = [100 * v for v in values]
    return f"{vals[0]:.1f}" if len(vals) == 1 else f"{statistics.mean(vals):.1f} ± {statistics.stdev(vals):.1f}"


def study_section(study: Study) -> list[str]:
    """One study's regime line and rows (mean ± std over seeds), as TABLES.md lists them."""
    data, checks = study.data, study.data["regime"]
    gaps = ""
    if checks:
        local_gap = statistics.mean(c["local_gap"] for c in checks)
        fedavg_gap = statistics.mean(c["fedavg_gap"] for c in checks)
        gaps = f" (mean gaps: Local {local_gap:.1f}, FedAvg {fedavg_gap:.1f} points)"
    lines = [
        f"### [{data['title']}]({study.link})",
        "",
        f"Regime {'**kept**' if study.kept else '**NOT kept**'}: both bars met on {study.seeds()} of "
        f"{len(checks)} seeds{gaps}.",
        "",
        f"Metric: {METRICS[data.get('metric', 'clients test acc')]}.",
        "",
        "| method | seeds | at best val (%) | last round (%) |",
        "|---|---|---|---|",
    ]
    # reports made since #55 give each row's 95% t interval over its seeds: a column of its own there
    intervals = any("interval" in row for row in data["rows"].values())
    if intervals:
        lines[-2:] = [
            "| method | seeds | at best val (%) | 95% interval over seeds (%) | last round (%) |",
            "|---|---|---|---|---|",
        ]
    for label, row in data["rows"].items():
        cells = [label, str(len(row["seeds"])), pct(row["best_val"])]
        if intervals:
            cells.append(interval_text(row.get("interval")))
        lines.append(f"| {' | '.join([*cells, pct(row['last'])])} |")
    return [*lines, ""]


def interval_text(interval: list[float] | None) -> str:
    """A row's interval (fractions) in percent, or "-" (one seed)."""
    return f"[{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]" if interval else "-"


def glance_rows(verdicts: str) -> list[list[str]]:
    """The cells of the "At a glance" table of verdicts.md: paper table, study of record, regime, verdicts."""
    lines = verdicts.splitlines()
    if GLANCE_HEADER not in lines:
        raise ValueError(f"verdicts.md has no 'At a glance' table starting with {GLANCE_HEADER!r}")
    rows = []
    for line in lines[lines.index(GLANCE_HEADER) + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def record_table(families: list[Family], verdicts: str) -> list[str]:
    """The study of record per paper table: verdicts.md's choice, the JSON's regime, the family's history."""
    studies = {s.link: (s, f) for f in families for s in f.studies}
    lines = [
        "| paper table | study of record | regime kept: seeds where both bars are met | verdicts | history |",
        "|---|---|---|---|---|",
    ]
    for paper_table, record, _, verdict in glance_rows(verdicts):
        links = [target for _, target in LINK.findall(record)]
        missing = [t for t in links if t not in studies]
        if not links or missing:
            raise ValueError(f"verdicts.md: {paper_table!r} names no study report here: {missing or record!r}")
        chosen = [studies[t] for t in links]
        weak = [s.name for s, _ in chosen if not s.kept]
        if verdict.startswith(("evidence", "regime kept")) and weak:
            raise ValueError(
                f"verdicts.md calls {paper_table!r} evidence, but the regime of {', '.join(weak)} is not kept "
                "on every seed"
            )
        regime = ", ".join(s.regime(detail=True) for s, _ in chosen)
        history = ", ".join(f"[{f.folder.name}]({f.link}/HISTORY.md)" for f in dict.fromkeys(f for _, f in chosen))
        lines.append(f"| {paper_table} | {record} | {regime} | {verdict} | {history} |")
    return lines


def seeds_text(seeds: list[int]) -> str:
    """``0-2`` for a run of consecutive seeds, else the list."""
    if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(str(s) for s in seeds)


def count_paper_claims(
    study: Study, counted: dict[tuple[Any, ...], str], where: str, declared: dict[tuple[str, str], str]
) -> list[PaperClaim]:
    """The study's paper claims, each comparison counted once across the index: a claim all of whose
    comparisons have the figures of ones counted before (in ``counted``, figures to the paper table that
    counted them; updated here) is kept with ``counted_under`` and not counted again. ``declared``: per
    comparison, the late-declaration note (see ``late_declarations``)."""
    out = []
    for claim in paper_claims(study.data.get("claims") or []):
        figures = [study.comparison_figures(c) for c in claim.comparisons]
        seen = [counted[f] for f in figures if f in counted]
        if len(seen) == len(figures):
            claim.counted_under = seen[0]
        for f in figures:
            counted.setdefault(f, where)
        out.append(claim)
    return mark_late(out, declared)


def paper_claims_text(claims: list[PaperClaim], link: str) -> str:
    """``[1 of 3 paper claims reproduced](link); not reproduced: A; B`` with the late declarations marked
    and the claims counted under an earlier paper table named."""
    if all(c.counted_under for c in claims):
        return f"[no paper claim of its own]({link})"
    count, _, rest = count_text(claims).partition(";")
    text = f"[{count}]({link})" + (f";{rest}" if rest else "")
    again = [f"{c.text} (counted under {c.counted_under})" for c in claims if c.counted_under]
    if again:
        text += "; not counted again: " + "; ".join(again)
    return text


def run_commits(report: Path) -> list[str]:
    """The commits a study's runs recorded: the last column of its report's results table."""
    if not report.exists():
        return []
    lines = report.read_text().splitlines()
    try:
        start = lines.index("## Results")
    except ValueError:
        return []
    commits: set[str] = set()
    for line in lines[start:]:
        if line.startswith("## Claims"):
            break
        if line.startswith("| ") and not line.startswith(("| method", "|---")):
            last = line.rstrip(" |").split(" | ")[-1].replace(" (mixed)", "")
            commits |= {c.split("+")[0] for c in last.split(", ") if re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", c)}
    return sorted(commits)


def late_declarations(study: Study, root: Path) -> dict[tuple[str, str], str]:
    """Per comparison of a study declared after its runs, its note (``fedmerge.study.claims``): its study
    file is ``studies/**/NAME.yaml`` under the repository ``root``, the study it confirms is named in its
    JSON, its runs' commits are in its report."""
    files = [str(p.relative_to(root)) for p in sorted((root / "studies").rglob(f"{study.name}.yaml"))]
    if files and study.data.get("confirms"):
        files.append(study.data["confirms"].split()[0])
    pairs = [(c["higher"], c["lower"]) for c in study.data.get("claims") or []]
    return claims_lib.late_declarations(root, files, run_commits(study.json_path.with_suffix(".md")), pairs)


Declarations = Callable[[Study], dict[tuple[str, str], str]]


def confirmation_table(families: list[Family], verdicts: str, declarations: Declarations) -> list[str]:
    """Per paper table: the seeds that explored its settings, the fresh seeds that confirm them, the regime
    on those, and the confirmation's paper claims, "N of M reproduced", the failed ones named, each
    comparison counted once across the table (found in the families of its study of record); the
    comparisons' own count follows as the detail. ``declarations(study)``: the late-declaration notes."""
    counted: dict[tuple[Any, ...], str] = {}
    by_link = {s.link: f for f in families for s in f.studies}
    lines = [
        "| paper table | exploration seeds | confirmation seeds | regime kept on confirmation seeds | verdicts "
        "on confirmation seeds |",
        "|---|---|---|---|---|",
    ]
    for paper_table, record, _, verdict in glance_rows(verdicts):
        owners = list(dict.fromkeys(by_link[t] for _, t in LINK.findall(record) if t in by_link))
        records = [s for _, t in LINK.findall(record) for s in [s for f in owners for s in f.studies if s.link == t]]
        confirms = [s for f in owners for s in f.studies if s.is_confirmation]
        if not confirms:
            explored = sorted({seed for s in records for seed in s.seed_list()})
            if verdict.startswith("provisional"):  # no regime-kept setting was found to confirm
                why = "none: the regime is not kept on the exploration seeds, so no setting is there to confirm"
                lines.append(f"| {paper_table} | {seeds_text(explored)} | {why} | - | provisional only |")
            else:
                pending = f"not confirmed (exploration: {verdict})"
                lines.append(f"| {paper_table} | {seeds_text(explored)} | none yet | - | {pending} |")
            continue
        stated = set(re.findall(r"(\d+) of (\d+) paper claims reproduced", verdict))
        found = set()
        for c in confirms:
            regime = c.regime() + (" (read test)" if c.regime_read_test() else "")
            claims = count_paper_claims(c, counted, paper_table, declarations(c))
            own = [x for x in claims if not x.counted_under]
            found.add((str(sum(x.reproduced for x in own)), str(len(own))))
            familywise = f"; {text}" if claims and (text := familywise_text(claims)) else ""
            verdicts_text = (
                f"{paper_claims_text(claims, c.link)} (comparisons: {c.claim_verdicts()}{familywise})"
                if claims
                else f"[{c.claim_verdicts()}]({c.link})"
            )
            lines.append(
                f"| {paper_table} | {seeds_text(c.data['explored_on'])} | {seeds_text(c.seed_list())} | {regime} | "
                f"{verdicts_text} |"
            )
        if stated and stated != found:  # verdicts.md is hand-written: its count may not drift from the JSON
            said = ", ".join(f"{n} of {m}" for n, m in sorted(stated))
            raise ValueError(
                f"verdicts.md says {said} paper claims reproduced for {paper_table!r}; the JSON: "
                + ", ".join(f"{n} of {m}" for n, m in sorted(found))
            )
    return lines


def family_index(families: list[Family]) -> list[str]:
    """Per paper, one line per family: its name (linking its history), its revisions in order, its reading."""
    lines = []
    for paper, title in PAPERS.items():
        own = [f for f in families if f.paper == paper]
        if not own:
            continue
        lines += [
            f"### {title}",
            "",
            "| study family (its history) | revisions, in order (seeds where both bars are met) | reading |",
            "|---|---|---|",
        ]
        for family in own:
            name = family.folder.name
            if (family.folder / "HISTORY.md").exists():
                name = f"[{name}]({family.link}/HISTORY.md)"
            revisions = " → ".join(f"[{family.label(s)}]({s.link}) {s.regime()}" for s in family.studies)
            reading = f"[reading]({family.link}/READING.md)" if (family.folder / "READING.md").exists() else "-"
            lines.append(f"| {name} | {revisions} | {reading} |")
        lines.append("")
    return lines


README_INTRO = """# Small-scale reproductions

Small-scale analogues of the tables of the FedMerge, SuPerFed and LIVAR papers, each run as a study
(`studies/NAME.yaml`, its revisions inside it) by `fedmerge study` into a report and a JSON file. This file is generated
by `scripts/reproductions_index.py` from those JSON files and from
[verdicts.md](verdicts.md) (itself rendered from `verdicts.md.j2`); do not edit it.

## Study of record, per paper table
"""

README_CONFIRM = """## Confirmation on fresh seeds, per paper table

Settings are explored on some seeds and confirmed on fresh ones that informed no choice; only the
confirmation seeds decide a claim. A comparison's verdict is the 95% interval of the paired difference
of its two rows: reproduced above zero, level across it, not reproduced below (the confirmation report
gives each). Reports made since #55 take Student's t over the seeds for every claim on two seeds or more
and publish their per-client values (`STUDY.clients.json`, recomputed by `python -m
fedmerge.study.recompute STUDY.json`); earlier ones took the two-level bootstrap where each seed had 10
clients or more, a median 0.74x as wide on 5 seeds (the guide's "The interval rule",
[../guide/studies.md](../guide/studies.md)). A paper claim (the comparisons its study file lists under
one `paper` text) is reproduced only if every comparison it needs is; the table counts paper claims and
names the failed ones, the comparisons' own count following as the detail. Each comparison is counted
once: a claim whose comparisons all have the figures of ones counted in an earlier row (the same rows,
bit for bit) is not counted again. A claim that its study file (or the study it confirms) did not yet
declare at the earliest commit its runs recorded is marked **declared after its runs**, with the time of
the commit that first declared it. "(read test)": that regime check read the test split, as checks did
before it read validation only.
"""

README_PROTOCOL = """A paper table's verdicts can be **evidence** only where its study keeps the regime on every seed
(**provisional** otherwise), and they count once confirmed on fresh seeds (the second table).
[verdicts.md](verdicts.md) gives each claim's verdict with the figures behind it, and says why two tables
whose regime is not kept were run all the same.

## Protocol

- A study names a base config, the seeds and the rows (methods). Every row is tuned on the
  validation split of one seed over a grid of the same size as every other row's (the equal
  budget), then its chosen point runs on every seed (3); a row reports mean ± std over seeds at the
  best-validation round, and at the last round.
- Each run is one `fedmerge run` in a folder that records its command, package versions and git
  commit; the report prints the commands from those records.
- The report gives its **regime check before any result**, and is published whether the regime is
  kept or not.
- Where a row's choice sits at an edge of its grid, a revision of the study (`wide`, `wider`,
  `widest`; `knobs` for a row's second knob: `revisions:` inside the study file, reports named
  `STUDY_REV.md`) gives that row new points past the edge and reuses every unchanged run. A study
  family is one study and the revisions of its table; its `HISTORY.md` says what each revision
  changed and why.

## The bars

A small-scale table says something about a paper's claim only in the paper's regime, where neither
Local nor FedAvg is near the ceiling. The ceiling is a **central reference**: one model trained on
the pooled training data of each ground-truth group (cluster and domain partitions) or of all clients
(label skew), its epochs and learning rate chosen on the pooled validation split, evaluated on each
client's own test split. A seed keeps the regime when both bars are met:

"""

README_LINKS = """## More

- [verdicts.md](verdicts.md): every paper claim's verdict, the figures behind it, per study family
  (its prose written by hand in `verdicts.md.j2`, its figures read from the JSON files).
- [TABLES.md](TABLES.md): every study's rows side by side, mean ± std at the best-validation round and
  at the last round (generated).
- [MOVED.md](MOVED.md): where each report, JSON file and reading was before they got a folder per
  paper and study family.
- [archive/](archive/README.md): the first reproductions, made before the regime check (not evidence).
- [unseen/](unseen/READING.md): clients that never trained, on the domain and cluster analogues: what each
  method gives a newcomer, at no adaptation and at 2 epochs (no paper claim: questions, with intervals).
- To run a study and refresh this index:

  ```bash
  fedmerge study studies/NAME.yaml [--revision REV] --out docs/reproductions/PAPER/FAMILY/NAME_REV.md
  python scripts/reproductions_index.py
  ```
"""

TABLES_INTRO = """# Every study's rows

Generated by `scripts/reproductions_index.py` from each study's JSON file; do not edit. Studies are
grouped by paper and study family, revisions in the order they were made; the reports hold the
regime check's per-seed figures, the tuning grids and the commands. Each row: mean ± std over seeds
of the client (or server) test accuracy at the best-validation round and at the last round.
"""


def render_readme(families: list[Family], verdicts: str, declarations: Declarations) -> str:
    bars = [
        f"- Local at least **{LOCAL_GAP:g} points** below the reference: Local is starved of data;",
        f"- FedAvg at least **{FEDAVG_GAP:g} points** below it: one global model is hurt by heterogeneity.",
        "",
        "(`LOCAL_GAP` and `FEDAVG_GAP` in `src/fedmerge/study/regime.py`.) A study whose regime is not kept",
        "is reported all the same; its verdicts are provisional, or it stops at the regime check.",
        "",
        "## Studies",
        "",
    ]
    parts = [
        README_INTRO,
        *record_table(families, verdicts),
        "",
        README_CONFIRM,
        *confirmation_table(families, verdicts, declarations),
    ]
    parts += ["", README_PROTOCOL + "\n".join(bars)]
    parts += [*family_index(families), README_LINKS]
    return "\n".join(parts).rstrip() + "\n"


def render_tables(families: list[Family]) -> str:
    lines = [TABLES_INTRO]
    for paper, title in PAPERS.items():
        own = [f for f in families if f.paper == paper]
        if own:
            lines.append(f"## {title}\n")
        for family in own:
            for study in family.studies:
                lines += study_section(study)
    return "\n".join(lines).rstrip() + "\n"


def outputs(docs: Path, root: Path | None = None) -> dict[Path, str]:
    """What the index writes: every page rendered from a template (``fedmerge.study.reproductions_pages``:
    ``verdicts.md`` from ``verdicts.md.j2``, ...), then README.md and TABLES.md under ``docs``, by path.
    ``root``: the repository whose ``studies/`` and git history date the claims (default: the current folder)."""
    root = Path.cwd() if root is None else root
    families = load_families(docs)
    rendered = reproductions_pages.pages(docs)
    verdicts_path = docs / "verdicts.md"
    verdicts = rendered[verdicts_path] if verdicts_path in rendered else verdicts_path.read_text()
    readme = render_readme(families, verdicts, lambda study: late_declarations(study, root))
    return {**rendered, docs / "README.md": readme, docs / "TABLES.md": render_tables(families)}


def main(argv: list[str] | None = None, root: Path | None = None) -> int:
    """The command; ``root``: the repository root (default: the current folder)."""
    root = Path.cwd() if root is None else root
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    parser.add_argument(
        "--docs", type=Path, default=root / DOCS, help="the folder to read and write (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        files = outputs(args.docs, root)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    stale = [path for path, text in files.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} is out of date: run python scripts/reproductions_index.py")
        return 1 if stale else 0
    for path in stale:
        path.write_text(text := files[path])
        print(f"wrote {path} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
