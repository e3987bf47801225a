"""A study's comparisons counted per paper claim, and the claims declared after their runs.

* A paper claim is the comparisons ("higher > lower", ``claims:`` in the study file) listed under one
  ``paper`` text; a comparison without a text is a claim of its own. A claim is reproduced only if every
  comparison it needs is. A comparison listed twice is refused: it belongs to one claim.
* A comparison is declared after its runs where neither its study file nor the study it confirms lists
  it at the earliest commit its runs recorded; the mark names the commit that first listed it and when
  (read from git; nothing is marked where git or the files cannot be read).

Used by the study report (``fedmerge.study.report``) and the index of reproductions
(``scripts/reproductions_index.py``).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class PaperClaim:
    """One claim of the paper and the comparisons it needs. ``late``: why it counts as declared after
    its runs (empty where it was declared before); ``counted_under``: where a claim whose every comparison
    was counted before is counted (the index counts each comparison once)."""

    text: str
    comparisons: list[dict[str, Any]] = field(default_factory=list)
    late: str = ""
    counted_under: str = ""

    @property
    def reproduced(self) -> bool:
        return all(c.get("verdict") == "reproduced" for c in self.comparisons)


def paper_claims(claims: list[dict[str, Any]]) -> list[PaperClaim]:
    """Comparisons (each with ``paper``, ``higher``, ``lower``, ``verdict``) grouped by paper claim, in the
    order declared. A comparison listed twice raises ValueError (one line)."""
    groups: dict[str, PaperClaim] = {}
    owner: dict[tuple[str, str], str] = {}
    for claim in claims:
        pair = (claim["higher"], claim["lower"])
        text = claim.get("paper") or f"{claim['higher']} above {claim['lower']}"
        if pair in owner:
            raise ValueError(
                f"comparison {pair[0]!r} > {pair[1]!r} is listed under {owner[pair]!r} and {text!r}: "
                "a comparison belongs to one paper claim"
            )
        owner[pair] = text
        groups.setdefault(text, PaperClaim(text)).comparisons.append(claim)
    return list(groups.values())


def mark_late(claims: list[PaperClaim], late: dict[tuple[str, str], str]) -> list[PaperClaim]:
    """Each claim's ``late`` note: that of its first comparison declared after the runs (``late``)."""
    for claim in claims:
        notes = [late[p] for c in claim.comparisons if (p := (c["higher"], c["lower"])) in late]
        claim.late = notes[0] if notes else ""
    return claims


def count_text(claims: list[PaperClaim]) -> str:
    """``1 of 3 paper claims reproduced; not reproduced: A; B`` and, in bold, the late declarations with
    their times (claims counted elsewhere are left out)."""
    own = [c for c in claims if not c.counted_under]
    text = f"{sum(c.reproduced for c in own)} of {len(own)} paper claims reproduced"
    failed = [c.text for c in own if not c.reproduced]
    if failed:
        text += "; not reproduced: " + "; ".join(failed)
    notes: dict[str, list[str]] = {}
    for c in own:
        if c.late:
            notes.setdefault(c.late, []).append(c.text)
    for note, texts in notes.items():
        which = f"all {len(own)}" if len(texts) == len(own) > 1 else "; ".join(texts)
        text += f"; **{note.replace(': ', f' ({which}): ', 1)}**"
    return text


def interval_p_value(comparison: dict[str, Any]) -> float:
    """Two-sided p-value of "no difference" read back from a comparison's 95% interval: its standard error is
    the interval's half-width over the quantile that made it (the normal's 1.96 for the bootstrap, Student's
    t with seeds - 1 degrees of freedom for the paired t), so a reader can recompute it from the JSON."""
    from scipy import stats

    n = len(comparison.get("seeds") or comparison.get("per_seed") or [])
    t_interval = comparison.get("method") == "paired t" and n > 1
    quantile = stats.t.ppf(0.975, n - 1) if t_interval else stats.norm.ppf(0.975)
    se = (comparison["high"] - comparison["low"]) / (2 * quantile)
    if se <= 0:
        return 0.0 if comparison["difference"] != 0 else 1.0
    score = abs(comparison["difference"]) / se
    return float(2 * (stats.t.sf(score, n - 1) if t_interval else stats.norm.sf(score)))


def holm_reproduced(comparisons: list[dict[str, Any]], alpha: float = 0.05) -> set[tuple[str, str]]:
    """The (higher, lower) pairs still reproduced when the family's error rate is held at ``alpha`` over all
    ``comparisons`` of a study (Holm's step-down): a pair must be reproduced on its own interval and its
    p-value must pass Holm's threshold alpha / (m - rank)."""
    ranked = sorted(comparisons, key=interval_p_value)
    kept: set[tuple[str, str]] = set()
    for rank, comparison in enumerate(ranked):
        if interval_p_value(comparison) > alpha / (len(ranked) - rank):
            break  # Holm stops at the first pair that fails: none after it is rejected
        if comparison.get("verdict") == "reproduced":
            kept.add((comparison["higher"], comparison["lower"]))
    return kept


def familywise_text(claims: list[PaperClaim]) -> str:
    """``family-wise (Holm over the study's N comparisons): K of M paper claims reproduced``, the claims
    counted elsewhere left out as in ``count_text``; empty without intervals."""
    every = [c for claim in claims for c in claim.comparisons if "high" in c]
    if not every:
        return ""  # no interval to read a p-value from
    kept = holm_reproduced(every)
    own = [c for c in claims if not c.counted_under]
    held = sum(all((c["higher"], c["lower"]) in kept for c in claim.comparisons) for claim in own)
    return f"family-wise (Holm over the study's {len(every)} comparisons): {held} of {len(own)} paper claims reproduced"


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


def git_root(path: Path) -> Path | None:
    """The checkout ``path`` is in, or None."""
    top = _git(path if path.is_dir() else path.parent, "rev-parse", "--show-toplevel")
    return Path(top.strip()) if top else None


def declared_pairs(root: Path, path: str, commit: str) -> set[tuple[str, str]] | None:
    """The comparisons (higher, lower) a study file lists at ``commit`` (revisions too); None where the
    file is not there."""
    text = _git(root, "show", f"{commit}:{path}")
    if text is None:
        return None
    pairs: set[tuple[str, str]] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("higher"), str) and isinstance(node.get("lower"), str):
                pairs.add((node["higher"], node["lower"]))
            nodes = list(node.values())
        else:
            nodes = node if isinstance(node, list) else []
        for value in nodes:
            walk(value)

    try:
        walk(yaml.safe_load(text))
    except yaml.YAMLError:
        return None
    return pairs


def _when(stamp: str) -> str:
    return stamp[:16].replace("T", " ") + " UTC" if stamp.endswith(("+00:00", "Z")) else stamp[:16].replace("T", " ")


def late_declarations(
    root: Path, files: list[str], run_commits: list[str], pairs: list[tuple[str, str]]
) -> dict[tuple[str, str], str]:
    """Per comparison of ``pairs`` declared after its runs: ``declared after its runs: <time> (<commit>);
    runs from <commit> (<time>)``. ``files``: the study file, then the study it confirms (paths relative to
    ``root``); ``run_commits``: the commits the runs recorded (the earliest by commit time is the runs'
    start at the latest). Empty where git or the commits cannot be read."""
    dated = []
    for commit in run_commits:
        stamp = _git(root, "log", "-1", "--format=%cI %H", commit)
        if stamp:
            dated.append(tuple(stamp.split()))
    if not files or not dated:
        return {}
    run_time, run_commit = min(dated)
    before: set[tuple[str, str]] = set()
    for path in files:
        before |= declared_pairs(root, path, run_commit) or set()
    log = _git(root, "log", "--reverse", "--format=%H %cI", "--follow", "--", files[0]) or ""
    history = [line.split() for line in log.splitlines() if line.strip()]
    run = f"runs from {run_commit[:8]} ({_when(run_time)})"
    out = {}
    for pair in pairs:
        if pair in before:
            continue
        first = next(((h, t) for h, t in history if pair in (declared_pairs(root, files[0], h) or set())), None)
        when = f"{_when(first[1])} ({first[0][:8]})" if first else "in no commit"
        out[pair] = f"declared after its runs: {when}; {run}"
    return out
