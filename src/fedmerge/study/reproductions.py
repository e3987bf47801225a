"""The published studies under ``docs/reproductions/``, read back from their JSON files.

Layout: ``docs/reproductions/PAPER/FAMILY/STUDY.json``, written by ``fedmerge study --out .../STUDY.md`` next to
its report; a family is one study and the revisions of its table, in the order they were made (``wide``,
``knobs_wide``, ...). The index of them all is ``fedmerge.study.reproductions_index``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAPERS = {"fedmerge": "FedMerge", "superfed": "SuPerFed", "livar": "LIVAR"}
# The order in which a study's revisions were made; a name's words after the family's shared ones are
# ranked by this list (unknown words last), so ``x``, ``x_wide``, ``x_knobs``, ``x_knobs_wide`` sort as run.
REVISION_WORDS = ["wide", "wider", "widest", "knobs", "ablation", "budget"]


@dataclass
class Study:
    """One report and its JSON: ``PAPER/FAMILY/NAME.json``."""

    json_path: Path
    data: dict[str, Any]

    @property
    def name(self) -> str:
        return self.json_path.stem

    @property
    def link(self) -> str:
        return self.json_path.with_suffix(".md").relative_to(self.json_path.parents[2]).as_posix()

    def seeds(self, key: str = "passes") -> int:
        """Seeds on which ``key`` (``passes``: both bars; ``local_starved``; ``fedavg_hurt``) holds."""
        return sum(bool(check[key]) for check in self.data["regime"])

    @property
    def is_confirmation(self) -> bool:
        return bool(self.data.get("explored_on"))

    def seed_list(self) -> list[int]:
        """The study's seeds (JSON written before they were recorded: the regime check's seeds)."""
        return self.data.get("seeds") or [check["seed"] for check in self.data["regime"]]

    def regime_read_test(self) -> bool:
        """Whether its regime check read the test split on some seed (every JSON from before it recorded one)."""
        return any(check.get("split", "test") == "test" for check in self.data["regime"])

    def claim_verdicts(self) -> str:
        """``3 reproduced, 1 level, 2 not reproduced`` over its judged comparisons, or why there is none."""
        claims = self.data.get("claims") or []
        if not claims:
            return "no claims declared"
        counts = {}
        for claim in claims:
            counts[claim["verdict"] or "no verdict"] = counts.get(claim["verdict"] or "no verdict", 0) + 1
        order = ["reproduced", "level", "not reproduced", "no verdict"]
        return ", ".join(f"{counts[v]} {v}" for v in order if v in counts)

    def row_figures(self, label: str) -> tuple[Any, ...]:
        """A row's seeds and per-seed values: two rows with equal figures are the same row, bit for bit."""
        row = self.data["rows"].get(label)
        if not row or not row.get("best_val"):  # no figures: the row is only itself
            return (self.name, label)
        return tuple(row["seeds"]), tuple(row["best_val"])

    def comparison_figures(self, claim: dict[str, Any]) -> tuple[Any, ...]:
        """What a comparison compares: its two rows' figures (so ``x > a`` and ``x > b`` are one comparison
        where rows ``a`` and ``b`` are equal bit for bit, here or in another study)."""
        return self.row_figures(claim["higher"]), self.row_figures(claim["lower"])

    @property
    def kept(self) -> bool:
        return bool(self.data["regime"]) and self.seeds() == len(self.data["regime"])

    def regime(self, detail: bool = False) -> str:
        """Seeds where both bars are met, as ``2 of 3``; ``detail`` adds each bar's count where not all are met."""
        n = len(self.data["regime"])
        if not n:
            return "no regime check"
        text = f"{self.seeds()} of {n}"
        if detail and not self.kept:
            text += f" (Local bar on {self.seeds('local_starved')}, FedAvg bar on {self.seeds('fedavg_hurt')})"
        return text


@dataclass(eq=False)  # hashed by identity: a family is one folder
class Family:
    """A study and the revisions of its table, in the order they were made."""

    paper: str
    folder: Path
    studies: list[Study] = field(default_factory=list)

    @property
    def link(self) -> str:
        return self.folder.relative_to(self.folder.parents[1]).as_posix()

    def label(self, study: Study) -> str:
        """The words a revision adds to the family's shared name (``wide``, ``knobs_wide``), or ``first``."""
        if len(self.studies) == 1:
            return "report"
        shared = shared_words([s.name for s in self.studies])
        return "_".join(study.name.split("_")[shared:]) or "first"


def shared_words(names: list[str]) -> int:
    """How many leading ``_``-separated words every name shares."""
    split = [name.split("_") for name in names]
    n = 0
    while all(len(words) > n and words[n] == split[0][n] for words in split):
        n += 1
    return n


def revision_order(names: list[str]) -> list[str]:
    """``names`` in the order their revisions were made (see ``REVISION_WORDS``)."""
    shared = shared_words(names)

    def key(name: str) -> tuple[tuple[int, str], ...]:
        words = name.split("_")[shared:]
        return tuple((REVISION_WORDS.index(w) if w in REVISION_WORDS else len(REVISION_WORDS), w) for w in words)

    return sorted(names, key=key)


CLIENTS_SUFFIX = ".clients.json"  # fedmerge.study.report.clients_path


def load_families(docs: Path) -> list[Family]:
    """Every ``PAPER/FAMILY/*.json`` under ``docs``, papers in ``PAPERS`` order, families by name; a report's
    per-client values (``STUDY.clients.json``, beside its JSON) are not a study."""
    families = []
    for paper in PAPERS:
        for folder in sorted(p for p in (docs / paper).glob("*") if p.is_dir()):
            by_name = {p.stem: p for p in folder.glob("*.json") if not p.name.endswith(CLIENTS_SUFFIX)}
            if not by_name:
                continue
            family = Family(paper, folder)
            for name in revision_order(list(by_name)):
                family.studies.append(Study(by_name[name], json.loads(by_name[name].read_text())))
            families.append(family)
    return families
