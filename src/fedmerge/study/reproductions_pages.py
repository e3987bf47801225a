"""Render the reproductions' hand-written pages from templates whose every figure is read from a study's JSON.

A page ``docs/reproductions/**/NAME.md`` with a template ``NAME.md.j2`` beside it is generated: its prose is
hand-written in the template, and each figure in it is a reference to a published JSON file (paths relative
to the template's folder), formatted by a filter, so a figure cannot drift from the table it comes from::

    {{ claim("unseen/fedmerge_digits_rotation_h50_unseen.json", "FedMerge d=5", "IFCA k=5").difference | signed1 }}
    {{ claim(S, "FedMerge d=5", "IFCA k=5") | interval }}           ->  [-44.1, -34.5]
    {{ row(S, "FedAvg").best_val | pm }}                             ->  70.2 ± 2.2  (mean ± std over seeds)
    {{ (row(S, "FedAvg").test_acc - row(S, "FedAvg").best_val) | pm }}  per-seed differences, then mean ± std
    {{ regime(S).fedavg_gap[0] | f1 }}                               ->  the first seed's FedAvg gap

``python -m fedmerge.study.reproductions_index`` renders every template with the index (``--check`` fails if
a rendered page differs from its committed ``.md``); ``tests/test_reproductions_pages.py`` also refuses a
decimal number in a template's prose outside a reference.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

SUFFIX = ".md.j2"


@dataclass(frozen=True)
class Series:
    """A figure per seed (in points where it is an accuracy), with the seeds it belongs to."""

    seeds: tuple[int, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.seeds) != len(self.values):
            raise ValueError(f"{len(self.values)} values for {len(self.seeds)} seeds")

    @property
    def mean(self) -> float:
        return statistics.mean(self.values)

    @property
    def std(self) -> float:
        """The sample standard deviation over seeds, as the study reports and TABLES.md give it."""
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    def __getitem__(self, index: int) -> float:
        return self.values[index]

    def __iter__(self) -> Iterator[float]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def at(self, seed: int) -> float:
        """The figure of one seed."""
        if seed not in self.seeds:
            raise ValueError(f"no seed {seed} among {list(self.seeds)}")
        return self.values[self.seeds.index(seed)]

    def __sub__(self, other: Series) -> Series:
        """Paired per-seed differences (the two must have the same seeds)."""
        if self.seeds != other.seeds:
            raise ValueError(f"seeds differ: {list(self.seeds)} against {list(other.seeds)}")
        return Series(self.seeds, tuple(a - b for a, b in zip(self.values, other.values, strict=True)))

    def __neg__(self) -> Series:
        return Series(self.seeds, tuple(-v for v in self.values))

    def only(self, seeds: Iterable[int]) -> Series:
        """The figures of some seeds only."""
        keep = list(seeds)
        return Series(tuple(keep), tuple(self.at(s) for s in keep))


class Row:
    """One row of a study: ``best_val`` (the metric at the best-validation round), ``last`` and, in the
    unseen-client studies, ``test_acc`` (the participants'), each a Series in points; ``ari`` unscaled;
    ``chosen``: the settings its tuning chose."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data, self.where = data, where
        self.chosen: dict[str, Any] = data.get("chosen") or {}

    def _series(self, key: str, scale: float) -> Series:
        values = self.data.get(key)
        if not values:
            raise ValueError(f"{self.where} has no {key!r} figures")
        return Series(tuple(self.data["seeds"]), tuple(scale * v for v in values))

    @property
    def best_val(self) -> Series:
        return self._series("best_val", 100.0)

    @property
    def last(self) -> Series:
        return self._series("last", 100.0)

    @property
    def test_acc(self) -> Series:
        return self._series("test_acc", 100.0)

    @property
    def ece(self) -> Series:
        """Expected calibration error on test, ×100."""
        return self._series("test_ece", 100.0)

    @property
    def mce(self) -> Series:
        """Maximum calibration error on test, ×100."""
        return self._series("test_mce", 100.0)

    @property
    def ari(self) -> Series:
        return self._series("ari", 1.0)

    @property
    def noise_floor(self) -> float:
        """The standard error of the row's mean from test sampling alone (on one seed; mean over seeds), in
        points."""
        return 100.0 * self.data["noise_floor"]


class Claim:
    """One judged comparison: ``difference``, ``low``, ``high`` (points), ``per_seed`` (a Series), ``verdict``."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.difference: float = data["difference"]
        self.low: float = data["low"]
        self.high: float = data["high"]
        self.verdict: str = data["verdict"]
        self.method: str = data.get("method", "")
        self.per_seed = Series(tuple(data["seeds"]), tuple(data["per_seed"]))


class Regime:
    """A study's regime check per seed: ``local_gap``, ``fedavg_gap``, ``reference`` (points) as Series;
    ``kept``: seeds where both bars are met, ``total``: seeds checked."""

    def __init__(self, checks: list[dict[str, Any]]) -> None:
        self.checks = checks
        seeds = tuple(c["seed"] for c in checks)
        self.local_gap = Series(seeds, tuple(c["local_gap"] for c in checks))
        self.fedavg_gap = Series(seeds, tuple(c["fedavg_gap"] for c in checks))
        self.reference = Series(seeds, tuple(100.0 * c["reference"] for c in checks))
        self.kept = sum(bool(c["passes"]) for c in checks)
        self.local_kept = sum(bool(c["local_starved"]) for c in checks)  # seeds where Local's bar is met
        self.fedavg_kept = sum(bool(c["fedavg_hurt"]) for c in checks)  # seeds where FedAvg's bar is met
        self.total = len(checks)
        self.failing = [c["seed"] for c in checks if not c["passes"]]


class Study:
    """A published study JSON, read by a template."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text())

    def row(self, label: str) -> Row:
        rows = self.data["rows"]
        if label not in rows:
            raise ValueError(f"{self.path.name} has no row {label!r} (rows: {', '.join(rows)})")
        return Row(rows[label], f"{self.path.name} row {label!r}")

    def claim(self, higher: str, lower: str) -> Claim:
        found = [c for c in self.data.get("claims") or [] if (c["higher"], c["lower"]) == (higher, lower)]
        if not found:
            raise ValueError(f"{self.path.name} has no claim {higher!r} above {lower!r}")
        return Claim(found[0])

    @property
    def regime(self) -> Regime:
        return Regime(self.data["regime"])

    def paper_claims(self, skip: Iterable[str] = ()) -> list[Any]:
        """Its comparisons grouped per paper claim (``fedmerge.study.claims``), less the claims in ``skip``
        (counted under another table)."""
        from fedmerge.study.claims import paper_claims

        return [c for c in paper_claims(self.data.get("claims") or []) if c.text not in set(skip)]

    def paper_count(self, skip: Iterable[str] = ()) -> str:
        """``N of M``: its paper claims reproduced (every comparison of a claim reproduced), of all."""
        claims = self.paper_claims(skip)
        return f"{sum(c.reproduced for c in claims)} of {len(claims)}"

    def familywise_count(self, skip: Iterable[str] = ()) -> str:
        """``N of M`` under Holm's step-down over all the study's comparisons (``claims.holm_reproduced``)."""
        from fedmerge.study.claims import holm_reproduced

        kept = holm_reproduced(self.data.get("claims") or [])
        claims = self.paper_claims(skip)
        held = sum(all((c["higher"], c["lower"]) in kept for c in claim.comparisons) for claim in claims)
        return f"{held} of {len(claims)}"

    @property
    def budgets(self) -> list[int]:
        """Every row's tuning budget (settings tried across the table's revisions)."""
        return [r["budget_total"] for r in self.data["rows"].values() if r.get("budget_total") is not None]

    def ranked(self, names: dict[str, str] | None = None, labels: Iterable[str] | None = None) -> str:
        """``CCVR 68.1 ± 4.4, LIVAR 63.3 ± 1.3, ...``: rows (all, or ``labels``) by mean at the best-validation
        round, highest first, each under the name ``names`` gives it (default: its label)."""
        names = names or {}
        rows = [(label, self.row(label).best_val) for label in (labels or self.data["rows"])]
        rows.sort(key=lambda item: -item[1].mean)
        return ", ".join(f"{names.get(label, label)} {pm(values)}" for label, values in rows)

    @property
    def comparisons(self) -> str:
        """``8 reproduced, 2 level, 3 not reproduced``: its comparisons' verdicts, counted."""
        from fedmerge.study.reproductions import Study as Published

        return Published(self.path, self.data).claim_verdicts()

    @property
    def noise_floors(self) -> list[float]:
        """Every row's noise floor (``Row.noise_floor``), in points, where the study recorded one."""
        return [100.0 * r["noise_floor"] for r in self.data["rows"].values() if r.get("noise_floor") is not None]

    @property
    def seeds(self) -> list[int]:
        return list(self.data.get("seeds") or [c["seed"] for c in self.data["regime"]])


def paired_t(series: Series) -> Claim:
    """The mean of per-seed differences and its 95% paired-t interval (Student's t, seeds - 1 degrees of
    freedom), as a claim: what a reader computes from a report's per-seed differences."""
    from scipy import stats

    n = len(series)
    half = stats.t.ppf(0.975, n - 1) * series.std / n**0.5
    data = {"difference": series.mean, "low": series.mean - half, "high": series.mean + half, "verdict": ""}
    return Claim(data | {"per_seed": list(series.values), "seeds": list(series.seeds), "method": "paired t"})


def signed1(value: float) -> str:
    """``+1.2`` / ``-1.2`` (a difference, one decimal)."""
    return f"{value:+.1f}"


def f1(value: float) -> str:
    return f"{value:.1f}"


def f2(value: float) -> str:
    return f"{value:.2f}"


def pm(series: Series) -> str:
    """``mean ± std`` over seeds, one decimal each."""
    return f"{series.mean:.1f} ± {series.std:.1f}"


def pm2(series: Series) -> str:
    """``mean ± std`` with two decimals (ARI)."""
    return f"{series.mean:.2f} ± {series.std:.2f}"


def interval(claim: Claim) -> str:
    """``[low, high]``, each signed with one decimal."""
    return f"[{claim.low:+.1f}, {claim.high:+.1f}]"


def each(series: Series, fmt: Callable[[float], str] = signed1) -> str:
    """Each seed's figure, comma-separated: ``+1.0, -2.0, +3.0``."""
    return ", ".join(fmt(v) for v in series)


def each1(series: Series) -> str:
    """Each seed's figure unsigned: ``71.7, 82.7, 78.3``."""
    return each(series, f1)


def each_and(series: Series) -> str:
    """Each seed's figure, signed, the last after "and": ``+1.0, -2.0 and +3.0``."""
    *head, last = [signed1(v) for v in series]
    return f"{', '.join(head)} and {last}" if head else last


def each1_and(series: Series) -> str:
    """Each seed's figure, the last after "and": ``19.5, 27.6 and 19.7``."""
    *head, last = [f1(v) for v in series]
    return f"{', '.join(head)} and {last}" if head else last


def each2(series: Series) -> str:
    """Each seed's figure with two decimals (ARI): ``0.70, 0.91, 0.75``."""
    return each(series, f2)


def neg(series: Series) -> Series:
    """The figures negated: a difference read the other way round (``below by``)."""
    return -series


def _spread(values: Iterable[float], fmt: str) -> str:
    """``low-high`` over some figures, or the one figure where both read the same."""
    vals = list(values)
    if not vals:
        raise ValueError("a spread of no figures")
    low, high = format(min(vals), fmt), format(max(vals), fmt)
    return low if low == high else f"{low}-{high}"


def spread1(values: Iterable[float]) -> str:
    """``low-high`` over some figures, one decimal each: ``2.6-31.1``."""
    return _spread(values, ".1f")


def spread0(values: Iterable[float]) -> str:
    """``low-high`` rounded to whole points: ``58-74``."""
    return _spread(values, ".0f")


def spread2(values: Iterable[float]) -> str:
    """``low-high`` with two decimals: ``0.57-0.70``."""
    return _spread(values, ".2f")


def spread_signed(values: Iterable[float]) -> str:
    """``+low to +high`` over some differences: ``+7.0 to +8.6``."""
    vals = list(values)
    return f"{min(vals):+.1f} to {max(vals):+.1f}"


def spread_g(values: Iterable[float]) -> str:
    """``low-high`` over some settings, each in its shortest form: ``0.05-0.4``."""
    return _spread(values, "g")


def g(value: float) -> str:
    """A setting's value, shortest form: ``0.8``, ``0.05``."""
    return f"{value:g}"


FILTERS: dict[str, Callable[..., str]] = {
    "signed1": signed1,
    "f1": f1,
    "f2": f2,
    "pm": pm,
    "pm2": pm2,
    "interval": interval,
    "each": each,
    "each1": each1,
    "each2": each2,
    "each_and": each_and,
    "each1_and": each1_and,
    "neg": neg,
    "spread2": spread2,
    "spread_signed": spread_signed,
    "spread1": spread1,
    "spread0": spread0,
    "spread_g": spread_g,
    "g": g,
    "paired_t": paired_t,
}


def environment(folder: Path) -> Any:
    """A jinja2 environment whose references resolve JSON paths relative to ``folder``."""
    import jinja2

    from fedmerge.study.regime import FEDAVG_GAP, LOCAL_GAP

    @cache
    def study(path: str) -> Study:
        file = folder / path
        if not file.is_file():
            raise ValueError(f"no published study {path!r} under {folder}")
        return Study(file)

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,  # a line holding only a block tag ({% set %}, {% for %}) leaves no line behind
        lstrip_blocks=True,
        autoescape=False,  # Markdown, not HTML
    )
    env.filters.update(FILTERS)
    env.filters["claims_of"] = lambda path: study(path).data.get("claims") or []
    env.filters["claim_difference"] = lambda lower, path, higher: study(path).claim(higher, lower).difference
    env.globals.update(
        study=study,
        row=lambda path, label: study(path).row(label),
        claim=lambda path, higher, lower: study(path).claim(higher, lower),
        regime=lambda path: study(path).regime,
        diff=lambda path, higher, lower, field="best_val": (  # per-seed differences of two rows, in points
            getattr(study(path).row(higher), field) - getattr(study(path).row(lower), field)
        ),
        chosen=lambda path, label, key: study(path).row(label).chosen[key],
        means=lambda paths, labels, field="best_val": [
            getattr(study(p).row(label), field).mean for p in paths for label in labels
        ],
        gap_means=lambda paths, labels: [  # participants minus newcomers, per seed, then the mean
            (study(p).row(label).test_acc - study(p).row(label).best_val).mean for p in paths for label in labels
        ],
        lrs=lambda path, labels: [study(path).row(label).chosen["algorithm.lr"] for label in labels],
        bars={"local": f"{LOCAL_GAP:g}", "fedavg": f"{FEDAVG_GAP:g}"},  # the regime's bars, in points
    )
    return env


def render(template: Path) -> str:
    """The page a template renders to."""
    return environment(template.parent).get_template(template.name).render()


def templates(docs: Path) -> list[Path]:
    return sorted(docs.rglob(f"*{SUFFIX}"))


def page_of(template: Path) -> Path:
    return template.with_name(template.name[: -len(SUFFIX)] + ".md")


def pages(docs: Path) -> dict[Path, str]:
    """Every generated page under ``docs``: its path and its text."""
    return {page_of(t): render(t) for t in templates(docs)}
