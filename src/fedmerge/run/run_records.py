"""The typed, versioned records of a run folder: ``summary.json`` (`RunSummary`) and each line of ``metrics.jsonl``
(`RoundRecord`), written and read here only.

Each record class names the keys this version knows as fields (a JSON key that is no Python name, ``global``,
under another name with the key in the field's metadata); keys it does not know, a method's summary fields
(`MethodHooks.summary_extras`, e.g. FedMerge's ``cluster_recovery``) or a method's round fields (merge
weights, lambda lines), are kept in ``extras``. A record remembers which known keys its file held (``keys``), so
writing back what was read gives the same bytes, a key absent stays absent and a ``null`` stays ``null``.

Versions: the files written before versioning (every file so far) carry no ``schema_version`` key and are version
1; a later layout will write its number, and a file newer than this fedmerge reads is refused in one line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from fedmerge.core.checkpoint import atomic_write_bytes

SCHEMA_VERSION = 1  # the newest layout this fedmerge writes and reads
VERSION_KEY = "schema_version"
_BOOKKEEPING = ("extras", "keys", "schema_version")

R = TypeVar("R", bound="JsonRecord")


def _field(*, key: str | None = None, record: type | None = None, each: type | None = None) -> Any:
    """A known key: ``key`` where the JSON key is no Python name; ``record``: its value is that record class;
    ``each``: its value is a mapping (or list) of that record class."""
    return field(default=None, metadata={"key": key, "record": record, "each": each})


@dataclass(frozen=True)
class JsonRecord:
    """A JSON object with typed known keys (the subclass's fields) and untouched unknown ones (``extras``)."""

    extras: Mapping[str, Any] = field(default_factory=dict, repr=False)
    # the object's keys in its file's order (known and extra); None: the known fields that are not None
    keys: tuple[str, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.keys is None:
            present = tuple(k for k, name in self._known().items() if getattr(self, name) is not None)
            object.__setattr__(self, "keys", present)

    @classmethod
    def _known(cls) -> dict[str, str]:
        """JSON key -> field name, for the keys this version knows."""
        return _layout(cls)[0]

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        known, meta = _layout(cls)
        values = {name: _decode(meta[name], data[key]) for key, name in known.items() if key in data}
        extras = {k: v for k, v in data.items() if k not in known and k != VERSION_KEY}
        return cls(**values, extras=extras, keys=tuple(data))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: the known keys present and the extras, in the order they were read."""
        assert self.keys is not None
        values = {key: _encode(getattr(self, name)) for key, name in self._known().items() if key in self.keys}
        values |= self._more() | dict(self.extras)
        return {k: values[k] for k in self.keys if k in values} | values

    def _more(self) -> dict[str, Any]:
        """Keys a subclass writes besides its fields and extras."""
        return {}

    def has(self, key: str) -> bool:
        """Whether the file holds ``key`` (known or extra), even as ``null``."""
        assert self.keys is not None
        return key in self.keys or key in self.extras


@cache
def _layout(cls: type) -> tuple[dict[str, str], dict[str, Mapping[str, Any]]]:
    """A record class's known keys (JSON key -> field name) and each field's metadata, worked out once a class."""
    known = {f.metadata.get("key") or f.name: f.name for f in fields(cls) if f.name not in _BOOKKEEPING}
    return known, {f.name: f.metadata for f in fields(cls)}


def _decode(meta: Mapping[str, Any], value: Any) -> Any:
    if value is None:
        return None
    if meta.get("record") is not None:
        return meta["record"].from_dict(value)
    if (each := meta.get("each")) is not None:
        if isinstance(value, list):
            return [each.from_dict(v) for v in value]
        return {k: each.from_dict(v) for k, v in value.items()}
    return value


def _encode(value: Any) -> Any:
    if isinstance(value, JsonRecord):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    return value


@dataclass(frozen=True)
class VersionedRecord(JsonRecord):
    """A top-level record of a file: its layout's ``schema_version`` (1: a file without the key)."""

    schema_version: int = SCHEMA_VERSION
    WHAT: ClassVar[str] = "record"

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        version = data.get(VERSION_KEY, 1) if isinstance(data, Mapping) else 1
        if problem := version_problem(version, cls.WHAT):  # type: ignore[attr-defined]
            raise ValueError(problem)
        record = super().from_dict(data)  # type: ignore[misc]
        object.__setattr__(record, "schema_version", version)
        return record

    def _more(self) -> dict[str, Any]:
        # version 1 is the layout of every file written before versioning, which had no key; a file that names
        # its version keeps it
        named = self.schema_version != 1 or VERSION_KEY in (self.keys or ())
        return {VERSION_KEY: self.schema_version} if named else {}


def version_problem(version: Any, what: str) -> str | None:
    """Why a file of layout ``version`` cannot be read (one line), or None."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        return f"{what}: schema_version {version!r} is not a layout version (a whole number from 1)"
    if version > SCHEMA_VERSION:
        return (
            f"{what}: schema_version {version} is newer than this fedmerge reads (up to {SCHEMA_VERSION}); "
            "upgrade fedmerge to read it"
        )
    return None


# --- summary.json ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats(JsonRecord):
    """One metric across clients (`fedmerge.metrics.summarize`)."""

    mean: float = _field()
    weighted_mean: float = _field()
    std: float = _field()
    worst10: float = _field()
    min: float = _field()
    max: float = _field()


@dataclass(frozen=True)
class Selection(JsonRecord):
    """The figures of one chosen round (``last``, ``best_val``): each metric across the clients, the pooled test
    of a global model, and the clients that never trained (``unseen``; further budgets ``unseen_adaptN`` in
    extras)."""

    round: int = _field()
    clients: Mapping[str, Stats] = _field(each=Stats)
    pooled: Mapping[str, float] | None = _field(key="global")  # the global model on the pooled test split
    val_nll: float | None = _field()  # best_val: the mean validation loss it was chosen by
    unseen: Mapping[str, Stats] | None = _field(each=Stats)
    participation_gap: Mapping[str, float] | None = _field()
    by_client: list[dict[str, Any]] | None = _field()  # named clients' headline metrics

    def part(self, name: str) -> Mapping[str, Any] | None:
        """A part by its key: ``clients``, ``global``, ``unseen`` or a further budget's ``unseen_adaptN`` (across
        clients: `Stats`; ``global``: the pooled figures); None when the selection has none."""
        known: dict[str, Mapping[str, Any] | None] = {"clients": self.clients, "global": self.pooled}
        if name in known:
            return known[name]
        if name == "unseen":
            return self.unseen
        further = self.extras.get(name) if name.startswith("unseen_adapt") else None
        return None if further is None else {k: Stats.from_dict(v) for k, v in further.items()}


@dataclass(frozen=True)
class Communication(JsonRecord):
    """Float values sent per client per round, mean over the rounds."""

    down: float = _field()
    up: float = _field()


@dataclass(frozen=True)
class ParameterBudget(JsonRecord):
    """The paper's Appendix A accounting (`fedmerge.run.summary.parameter_budget`)."""

    server_stored: float = _field()
    down_per_client_round: float = _field()
    up_per_client_round: float = _field()
    client_stored: float = _field()
    client_optimized: float = _field()


@dataclass(frozen=True)
class LocalGap(JsonRecord):
    """Training loss on the received model minus after local training (`fedmerge.run.summary.local_gap_summary`)."""

    mean: float = _field()
    mean_second_half: float = _field()
    last: float = _field()
    last_received: float = _field()
    last_trained: float = _field()


@dataclass(frozen=True)
class RunSummary(VersionedRecord):
    """``summary.json``: what a finished run computed. A method's own fields (``cluster_recovery``, ...) are in
    ``extras``."""

    WHAT: ClassVar[str] = "summary.json"

    name: str | None = _field()
    algorithm: str | None = _field()
    dataset: str | None = _field()
    partition: str | None = _field()
    model: str | None = _field()
    num_clients: int | None = _field()
    seed: int | None = _field()
    num_classes: int | None = _field()
    parameters: Mapping[str, float] | None = _field()
    client_groups: list[Any] | None = _field()
    client_names: list[str] | None = _field()
    wall_seconds: float | None = _field()
    workers: Mapping[str, Any] | None = _field()
    unseen_clients: Mapping[str, Any] | None = _field()
    privacy: Mapping[str, Any] | None = _field()
    rounds_completed: int | None = _field()
    communication_per_client_per_round: Communication | None = _field(record=Communication)
    parameter_budget: ParameterBudget | None = _field(record=ParameterBudget)
    local_gap: LocalGap | None = _field(record=LocalGap)
    diverged: str | None = _field()  # one line when training blew up
    last: Selection | None = _field(record=Selection)
    best_val: Selection | None = _field(record=Selection)

    def selection(self, which: str) -> Selection | None:
        """``last`` or ``best_val`` by name (a table's chosen column)."""
        if which not in ("last", "best_val"):
            raise ValueError(f"selection {which!r}: choose last or best_val")
        return self.last if which == "last" else self.best_val

    @property
    def private(self) -> bool | None:
        """False when the run's privacy section says it is not private; None without one."""
        return None if not self.privacy else self.privacy.get("private")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunSummary:
        return cls.from_dict(json.loads(text))


def as_summary(summary: RunSummary | Mapping[str, Any]) -> RunSummary:
    """A summary given as its JSON object (a caller that built one by hand) read into a `RunSummary`."""
    return summary if isinstance(summary, RunSummary) else RunSummary.from_dict(summary)


def write_summary(path: Path, summary: RunSummary) -> None:
    atomic_write_bytes(path, summary.to_json().encode())


def read_summary(path: Path) -> RunSummary:
    """``summary.json`` at ``path``; a missing or unreadable file, or a newer layout, is one ``ValueError`` line."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read the run summary ({str(err).splitlines()[0]})") from None
    try:
        return RunSummary.from_dict(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def summary_or_none(path: Path) -> RunSummary | None:
    """``summary.json`` when the run finished and the file parses; None before (a newer layout is still refused)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        return RunSummary.from_dict(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


# --- metrics.jsonl ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evaluation(JsonRecord):
    """An evaluated round: each client's metrics (by client id as a string), the global model's pooled test."""

    clients: Mapping[str, Mapping[str, float]] = _field()
    pooled: Mapping[str, float] | None = _field(key="global")
    comm_down: float | None = _field()


@dataclass(frozen=True)
class RoundGap(JsonRecord):
    """A round's local-global gap: the clients' mean training loss on the received model (``received``), after
    local training (``trained``), and their difference (``gap``)."""

    gap: float = _field()
    received: float = _field()
    trained: float = _field()


@dataclass(frozen=True)
class RoundRecord(VersionedRecord):
    """One line of ``metrics.jsonl``: a completed round. Newcomers' evaluations (``eval_unseen...``,
    ``summary_unseen...``) and a method's own round fields are in ``extras``."""

    WHAT: ClassVar[str] = "metrics.jsonl"

    round: int = _field()
    selected: list[int] | None = _field()
    train_loss: float | None = _field()
    comm_down: float | None = _field()
    comm_up: float | None = _field()
    comm_clients: Mapping[str, Mapping[str, float]] | None = _field()
    fit_seconds: float | None = _field()
    eval_seconds: float | None = _field()
    elapsed_seconds: float | None = _field()
    gpu_peak_mib: float | None = _field()
    local_gap: RoundGap | None = _field(record=RoundGap)
    failed_clients: list[dict[str, Any]] | None = _field()
    eval: Evaluation | None = _field(record=Evaluation)
    summary: Mapping[str, Stats] | None = _field(each=Stats)  # each metric across the evaluated clients

    def evaluation(self, name: str = "eval") -> Evaluation | None:
        """The round's evaluation of the participants (``eval``) or of the newcomers (``eval_unseen``,
        ``eval_unseen_adaptN``); None when the round has none."""
        if name == "eval":
            return self.eval
        found = self.extras.get(name) if name.startswith("eval_unseen") else None
        return None if found is None else Evaluation.from_dict(found)

    def unseen_summaries(self) -> dict[str, Mapping[str, Stats]]:
        """The newcomers' summaries by name (``unseen``, ``unseen_adaptN``), in the row's order."""
        return {
            k.removeprefix("summary_"): {m: Stats.from_dict(v) for m, v in found.items()}
            for k, found in self.extras.items()
            if k.startswith("summary_unseen")
        }

    def mean(self, metric: str) -> float | None:
        """The clients' mean of ``metric`` at this round; None when it was not evaluated."""
        stats = (self.summary or {}).get(metric)
        return None if stats is None else stats.mean

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RoundRecord:
        return cls.from_dict(json.loads(text))


def round_records(rows: Sequence[RoundRecord | Mapping[str, Any]]) -> list[RoundRecord]:
    """The rows of ``metrics.jsonl`` (as `fedmerge.run.records.read_lines` gives them) typed."""
    return [r if isinstance(r, RoundRecord) else RoundRecord.from_dict(r) for r in rows]


def plain(value: Any) -> Any:
    """A record (or a mapping or list of them) as its JSON value: what a summary being built holds."""
    return _encode(value)
