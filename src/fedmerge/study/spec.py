"""A study file: the base config, the seeds, the rows (methods) with their tuning grids, and revisions.

    title: ...                  # the report's heading
    description: ...            # the paragraph under it
    base: configs/repro/X.yaml  # every run starts from this config
    seeds: [0, 1, 2]            # the chosen point of every row runs on each
    tune_seed: 0                # grid points run on this seed (default: the first seed)
    columns: [test_ece]         # extra columns: client means at the best-validation round
    metric: {scope: clients, name: acc}   # or scope: global (the server model), name: top5
    select: val_metric          # a row's grid point: best validation metric; val_loss: lowest validation loss
    regime: {scope: auto, max_epochs: 40, lrs: [...], overrides: [...]}   # the central reference
    local_row: Local            # the rows the regime check reads (defaults shown)
    fedavg_row: FedAvg
    claims:                     # the paper's claims the table tests, each "higher > lower" (two rows)
    - {paper: 'Table 2: FedMerge beats FedAvg', higher: FedMerge d=5, lower: FedAvg}
    methods:
    - label: FedAvg
      overrides: [algorithm.name=fedavg]
      grid: {algorithm.lr: [0.05, 0.1]}          # a product of values
      extra_points: [{algorithm.lr: 0.3}]        # explicit points after it
      paper: {acc: 53.36, top5: 83.27}           # the paper's published values (percent): the report's comparison
    revisions:                  # later versions of the study, each applied on top of the one before
    - name: wide
      title: ... (grids widened)
      description_more: ...                      # appended to the description (or description: replaces it)
      regime: {lrs: [0.05, 0.1]}                 # the keys it sets replace the earlier ones
      methods:
      - label: FedAvg                            # a row it changes, by label
        grid: {algorithm.lr: [0.1, 0.2]}         # the fields it sets replace the earlier ones

Every row must have as many grid points as every other (the equal tuning budget), and every point
must be a valid config, in every revision: a study is refused, in one line, before anything runs.
A revision's runs live next to the first revision's (``runs/repro/STUDY_NAME``), in
``runs/repro/STUDY_NAME_REVISION``: the folders its ``STUDY_REVISION.yaml`` copy used to have.
"""

from __future__ import annotations

import copy
import itertools
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedmerge.config.schema import DEFAULT_CONFIG, ConfigError, apply_overrides, merge, read_yaml, validate
from fedmerge.config.schema_docs import did_you_mean

REFERENCE_MAX_EPOCHS = 40  # a study's regime.max_epochs when it sets none
DEFAULT_RUNS = Path("runs/repro")
LATEST, FIRST = "latest", "first"  # what --revision takes besides a revision's name
RESERVED = {LATEST, FIRST}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Row(_Strict):
    """One method of the table: fixed overrides and the points it is tuned over."""

    label: str = Field(min_length=1)
    overrides: list[str] = []
    grid: dict[str, list[Any]] = {}
    extra_points: list[dict[str, Any]] = []
    # The paper's published value of the table's metric (its name: acc, top5, rouge1) and of extra columns
    # (``test_ece`` or ``ece``), in the paper's units (percent for accuracies), for the report's comparison.
    # Not part of the run's identity: adding or correcting it reruns and renames nothing.
    paper: dict[str, float] = {}

    def points(self) -> list[dict[str, Any]]:
        """The row's tuning points: the product of its ``grid``, then its ``extra_points`` in order.

        Extra points tune a knob coordinate-wise (at the learning rate a narrower grid chose) without the
        cost of a full product; listed last, they leave the grid's points (and their run folders) where
        they were, so a revision that adds them reuses the earlier runs."""
        keys = list(self.grid)
        product = [dict(zip(keys, values)) for values in itertools.product(*(self.grid[k] for k in keys))]
        return product + [dict(p) for p in self.extra_points]


class Claim(_Strict):
    """A claim of the paper that the table tests: row ``higher`` is above row ``lower`` on the metric.
    A claim about several rows is several such pairs (the report judges each on its own interval)."""

    higher: str = Field(min_length=1)
    lower: str = Field(min_length=1)
    # Where and how the paper states it (shown in the report). Comparisons with the same ``paper`` text are
    # one paper claim, reproduced only if every one of them is; an empty text is a claim of its own.
    paper: str = ""


class RowChange(_Strict):
    """A revision's change to one row, by label: the fields it sets replace the row's."""

    label: str
    overrides: list[str] | None = None
    grid: dict[str, list[Any]] | None = None
    extra_points: list[dict[str, Any]] | None = None
    paper: dict[str, float] | None = None


class Regime(_Strict):
    """How the central reference trains: ``scope`` (per group, all clients, or auto), at most
    ``max_epochs`` epochs, at the learning rates ``lrs`` (default: the Local row's grid)."""

    scope: Literal["auto", "group", "all"] = "auto"
    max_epochs: int = Field(REFERENCE_MAX_EPOCHS, ge=1)
    lrs: list[float] | None = None
    overrides: list[str] = []


class Metric(_Strict):
    """The table's metric: the clients' mean (``clients``) or the server model on the pooled test split
    (``global``; a method without one falls back to the clients' mean), or the clients that never trained
    (``unseen``: their mean at the round chosen on the participants' validation split; the base config sets
    ``split.unseen_clients``); top-1 (``acc``), ``top5``, or ROUGE-1 of generated answers (``rouge1``).
    ``adapt_epochs`` (scope ``unseen``): the newcomers at a further budget of ``unseen.also_adapt_epochs``,
    onboarded in the same runs; None: at the runs' own ``unseen.adapt_epochs``."""

    scope: Literal["clients", "global", "unseen"] = "clients"
    name: Literal["acc", "top5", "rouge1"] = "acc"
    adapt_epochs: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _budget_needs_unseen(self) -> Metric:
        if self.adapt_epochs is not None and self.scope != "unseen":
            raise ValueError("metric.adapt_epochs is the newcomers' budget: it needs scope unseen")
        return self

    @property
    def part(self) -> str:
        """Its part of a summary's ``best_val`` (or ``last``): clients, global, unseen or unseen_adaptN."""
        return self.scope if self.adapt_epochs is None else f"unseen_adapt{self.adapt_epochs}"


class _Fields(_Strict):
    title: str
    description: str = ""
    base: str
    seeds: list[int] = Field(min_length=1)
    tune_seed: int | None = None
    columns: list[str] = []
    metric: Metric = Metric()
    # How a row's grid point is chosen on the tuning seed, each run read at its round of lowest mean
    # validation loss (``best_val``): by the clients' mean validation metric there (``val_metric``), or
    # by that lowest validation loss itself (``val_loss``: the (point, round) of lowest validation loss
    # over the whole grid, as FedMerge's LoRA experiment selects its checkpoint).
    select: Literal["val_metric", "val_loss"] = "val_metric"
    regime: Regime = Regime()
    local_row: str = "Local"
    fedavg_row: str = "FedAvg"
    methods: list[Row] = Field(min_length=1)
    # A confirmation study: the seeds on which its settings were explored (grids, chosen points, data
    # sizes). Its own seeds must be fresh: none of them may have informed any choice.
    explored_on: list[int] = []
    confirms: str | None = None  # the exploration study (and revision) whose chosen points it runs
    claims: list[Claim] = []

    @model_validator(mode="after")
    def _claims_name_rows(self) -> _Fields:
        labels = [m.label for m in self.methods]
        owner: dict[tuple[str, str], str] = {}
        for claim in self.claims:
            for label in (claim.higher, claim.lower):
                if label not in labels:
                    raise ValueError(f"claim {claim.higher!r} > {claim.lower!r}: no row {label!r} (the rows: {labels})")
            # Each comparison belongs to one paper claim and is counted once (the index counts paper claims).
            pair = (claim.higher, claim.lower)
            if pair in owner:
                raise ValueError(
                    f"claim {claim.higher!r} > {claim.lower!r} is listed twice (under {owner[pair]!r} and "
                    f"{claim.paper!r}); a comparison belongs to one paper claim"
                )
            owner[pair] = claim.paper
        return self

    @model_validator(mode="after")
    def _paper_names_columns(self) -> _Fields:
        known = [self.metric.name, *(c.removeprefix("test_") for c in self.columns)]
        for m in self.methods:
            for key in m.paper:
                if key.removeprefix("test_") not in known:
                    raise ValueError(
                        f"row {m.label!r}: paper value {key!r} is neither the metric nor a column (one of: {known})"
                    )
        return self

    @model_validator(mode="after")
    def _fresh_seeds(self) -> _Fields:
        used = set(self.seeds) | ({self.tune_seed} if self.tune_seed is not None else set())
        if self.explored_on and used & set(self.explored_on):
            raise ValueError(
                f"seeds {sorted(used & set(self.explored_on))} explored this study's settings (explored_on); "
                "a confirmation runs on fresh seeds only"
            )
        if self.explored_on and any(len(m.points()) != 1 for m in self.methods):
            raise ValueError("a confirmation study (explored_on) runs one chosen point per row, not a grid to tune")
        return self


class Study(_Fields):
    """One revision of a study, resolved: what its runs and its report are made from."""

    revision: str | None = None  # None: the study as first written

    @property
    def tuning_seed(self) -> int:
        return self.seeds[0] if self.tune_seed is None else self.tune_seed

    def row(self, label: str) -> Row | None:
        return next((m for m in self.methods if m.label == label), None)

    def local_lrs(self) -> list[Any] | None:
        """The reference is tuned over the Local row's learning-rate grid (the same budget)."""
        local = self.row(self.local_row)
        return None if local is None else local.grid.get("algorithm.lr")

    def reference_lrs(self) -> list[Any] | None:
        return self.regime.lrs if self.regime.lrs is not None else self.local_lrs()


class Revision(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")  # its runs' folder ends in _NAME
    title: str | None = None
    description: str | None = None
    description_more: str | None = None  # appended to the description, after a space
    regime: Regime | None = None
    # a revision that reads the same runs another way, e.g. the newcomers at a further budget
    # (metric.adapt_epochs) of runs that onboard them at several (unseen.also_adapt_epochs)
    metric: Metric | None = None
    methods: list[RowChange] = []


class StudyFile(_Fields):
    """What a study file holds: the study as first written and its revisions, oldest first."""

    revisions: list[Revision] = []

    @field_validator("revisions")
    @classmethod
    def _names(cls, revisions: list[Revision]) -> list[Revision]:
        names = [r.name for r in revisions]
        if len(set(names)) < len(names):
            raise ValueError(f"revision names {names} repeat")
        if set(names) & RESERVED:
            raise ValueError(f"{sorted(set(names) & RESERVED)[0]!r} names no revision (it means one: --revision)")
        return revisions

    def revision_names(self) -> list[str | None]:
        return [None, *(r.name for r in self.revisions)]

    def history(self, revision: str | None = LATEST) -> list[Study]:
        """Every revision up to ``revision`` (LATEST: the last one; FIRST or None: the study as first
        written), resolved."""
        names = self.revision_names()
        revision = names[-1] if revision == LATEST else None if revision == FIRST else revision
        if revision not in names:
            have = ", ".join(n for n in names if n) or "none"
            raise ConfigError(f"no revision {revision!r} in this study (its revisions: {have})")
        study = Study(**self.model_dump(exclude={"revisions"}))
        out = [study]
        for rev in self.revisions[: names.index(revision)]:
            study = _apply(study, rev)
            out.append(study)
        return out

    def at(self, revision: str | None = LATEST) -> Study:
        return self.history(revision)[-1]


def _apply(study: Study, rev: Revision) -> Study:
    rows = {m.label: m for m in study.methods}
    for change in rev.methods:
        if change.label not in rows:
            raise ConfigError(f"revision {rev.name!r} changes row {change.label!r}; the rows are {list(rows)}")
        update = change.model_dump(exclude={"label"}, exclude_unset=True)
        rows[change.label] = Row(**{**rows[change.label].model_dump(), **update})
    changed: dict[str, Any] = {"revision": rev.name, "methods": list(rows.values())}
    for key in ("title", "description"):
        if getattr(rev, key) is not None:
            changed[key] = getattr(rev, key)
    if rev.description_more is not None:
        before = changed.get("description", study.description).strip()
        changed["description"] = f"{before} {rev.description_more.strip()}"
    if rev.regime is not None:
        changed["regime"] = Regime(**{**study.regime.model_dump(), **rev.regime.model_dump(exclude_unset=True)})
    if rev.metric is not None:
        changed["metric"] = rev.metric
    return study.model_copy(update=changed)


# --- names -------------------------------------------------------------------------------------


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower().replace("+", " plus ")).strip("-")


def run_key(label: str, point: int, seed: int) -> str:
    """The folder of one row's grid point on one seed."""
    return f"{slug(label)}-g{point}-s{seed}"


def run_overrides(row: Row, point: dict[str, Any], seed: int) -> list[str]:
    return [*row.overrides, *(f"{k}={v}" for k, v in point.items()), f"seed={seed}"]


def runs_dir(study_path: Path, revision: str | None, runs: Path | None = None) -> Path:
    """Where a revision's runs are: ``runs`` (default ``runs/repro/STUDY_NAME``) for the study as first
    written, ``..._REVISION`` next to it for a revision."""
    first = runs if runs is not None else DEFAULT_RUNS / study_path.stem
    return first if revision is None else first.with_name(f"{first.name}_{revision}")


# --- loading -----------------------------------------------------------------------------------


def resolve_path(path: Path) -> tuple[Path, str | None]:
    """``STUDY.yaml``, or a former copy's name ``STUDY_REVISION.yaml`` (now a revision inside ``STUDY.yaml``):
    the file to read and the revision it names (None: the caller's choice)."""
    if path.exists():
        return path, None
    stem = path.stem
    for i in range(len(stem) - 1, 0, -1):
        if stem[i] != "_":
            continue
        parent = path.with_name(stem[:i] + path.suffix)
        if parent.is_file():
            revision = stem[i + 1 :]
            names = read_yaml(parent, "study file").get("revisions") or []
            if any(isinstance(r, dict) and r.get("name") == revision for r in names):
                return parent, revision
    return path, None


def base_path(study_path: Path, base: str) -> str:
    """Where a study's ``base:`` is: relative to the study file's folder or the first folder above it that
    holds it (``studies/paper/X.yaml``'s ``configs/paper/Y.yaml`` is the repository's, and the packaged
    copy's next to it), so that a study runs from any working folder. A base found nowhere there is read
    from the working folder, as before. Returned relative to the working folder when it lies inside it
    (the path studies always recorded), else absolute."""
    given = Path(base).expanduser()
    if given.is_absolute():
        return str(given)
    start = study_path.absolute().parent
    found = next((d / given for d in (start, *start.parents) if (d / given).is_file()), None)
    if found is None:
        return base  # found nowhere near the study: the working folder's (check() names it if missing)
    relative = os.path.relpath(found)
    return str(found) if relative.startswith("..") else relative


def load_study_file(path: Path) -> StudyFile:
    """The study file, validated: known keys only, equal budgets and valid configs in every revision.
    Its ``base:`` is resolved against the study file's folder (``base_path()``)."""
    data = read_yaml(path, "study file")
    if isinstance(data, dict) and isinstance(data.get("base"), str):
        data = {**data, "base": base_path(path, data["base"])}
    try:
        spec = StudyFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_one_line(exc)}") from None
    try:
        for study in spec.history(LATEST):
            check(study)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return spec


def load_study(path: Path, revision: str | None = LATEST) -> Study:
    return load_study_file(path).at(revision)


def explored_history(study: Study) -> list[Study]:
    """The revisions in which a study's rows spent their tuning budget: a confirmation study's are its
    exploration's (``confirms``: ``STUDY.yaml`` or ``STUDY.yaml revision REV``, up to that revision),
    read from the working folder; any other study's, itself (its caller passes its own history)."""
    if study.confirms is None:
        return [study]
    path, _, revision = study.confirms.partition(" revision ")
    return load_study_file(Path(path)).history(revision or FIRST)


def check(study: Study) -> None:
    """Refuse a study whose rows would share run folders, whose budgets differ, or one of whose grid
    points the config refuses (Ditto's lr x lam >= 2, say): found before anything runs."""
    where = f"revision {study.revision!r}: " if study.revision else ""
    labels = [m.label for m in study.methods]
    if len({slug(label) for label in labels}) < len(labels):
        raise ConfigError(f"{where}row labels {labels} collide as folder names")
    sizes = {m.label: len(m.points()) for m in study.methods}
    if len(set(sizes.values())) > 1:
        raise ConfigError(f"{where}unequal tuning budgets {sizes}; give every method the same number of grid points")
    try:
        base = merge(DEFAULT_CONFIG, read_yaml(Path(study.base)))  # as load_config(study.base, ...), read once
    except ConfigError as exc:
        raise ConfigError(f"base: {exc} (a path relative to the study file's folder or one above it)") from None
    for m in study.methods:
        for point in m.points():
            try:
                validate(apply_overrides(copy.deepcopy(base), run_overrides(m, point, study.tuning_seed)))
            except ConfigError as exc:
                first = str(exc).strip().splitlines()[0]
                raise ConfigError(f"{where}row {m.label!r}, grid point {point}: {first}") from None


def _one_line(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "study"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        key, parent = str(err["loc"][-1]), _model_at(err["loc"][:-1])
        valid = list(parent.model_fields) if parent else []
        msg = "unknown key" + (did_you_mean(key, valid) or (f"; valid keys: {', '.join(valid)}" if valid else ""))
    elif err["type"] == "missing" and len(err["loc"]) == 1:
        msg = "missing; a study file has at least title, base, seeds and methods"
    elif "input" in err and not isinstance(err["input"], dict | list):
        msg = f"{msg} (got {err['input']!r})"
    return f"{loc}: {msg}"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The model of the section a validation error's location points into (list indices skipped)."""
    model: type[BaseModel] | None = StudyFile
    for item in loc:
        if isinstance(item, int) or model is None:
            continue
        field = model.model_fields.get(str(item))
        model = _inner_model(field.annotation) if field is not None else None
    return model


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None
