"""``fedmerge tune``: Optuna on the validation split, the same number of trials for every method.

Each method gets its own study, named after it, in one SQLite file (``TUNE_DIR/study.db``), so
running the command again continues where it stopped: only the trials still missing from the budget
are run (a trial cut short by a kill does not count). Every trial is an ordinary run folder
(``TUNE_DIR/trials/METHOD/trial-NNN``) trained with the test split *withheld*: it is removed from the
data before training starts, so no metric, summary or model selection of a trial can read it. The
objective is the mean client validation accuracy at the best-validation round (or the validation
loss, ``--metric val_nll``).

The search space of a method comes from its config schema ([`default_space()`][fedmerge.sweep.tune.default_space])
unless a space
file says otherwise; the result, ``TUNE_DIR/best.yaml``, is read by ``fedmerge run --tuned`` and
``fedmerge sweep --tuned``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel

from fedmerge.config.schema import ConfigError, ExperimentConfig, load_config, make_folder, read_yaml
from fedmerge.core.loop import RoundFailed
from fedmerge.run.results import CHECKPOINT_DIR
from fedmerge.run.run_records import RunSummary, as_summary
from fedmerge.run.runner import run_experiment

INSTALL_HINT = "fedmerge tune needs Optuna: pip install -e '.[tune]'"
BEST_FILE = "best.yaml"
STUDY_FILE = "study.db"
# numerical safeguards, not hyper-parameters
NOT_TUNED = {"eps", "jitter", "cos_eps"}
METRICS = {"val_acc": "maximize", "val_nll": "minimize"}
MAX_REFUSED = 200  # sampled points refused by the config before the space is called unusable

Notify = Callable[[str], None]


@dataclass(frozen=True)
class Param:
    low: float
    high: float
    log: bool = False
    integer: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"low": self.low, "high": self.high, "log": self.log}
        if self.integer:
            out["type"] = "int"
        return out


def default_space(algorithm: BaseModel) -> dict[str, Param]:
    """Every float field of the method's config whose value is positive: log-uniform over a factor of
    ten either side of its value (clipped to the field's bounds), or uniform over the field's range
    when it is bounded on both sides within [0, 1]. Integer fields (epochs, batch size, number of
    models) change the compute budget and are left to the user's space file."""
    space = {}
    for name, field in type(algorithm).model_fields.items():
        value = getattr(algorithm, name)
        if name in NOT_TUNED or isinstance(value, bool) or not isinstance(value, float) or value <= 0:
            continue
        lo, hi, lo_open, hi_open = _bounds(field.metadata)
        if lo is not None and hi is not None and lo >= 0 and hi <= 1:
            eps = 1e-6 * (hi - lo)
            space[f"algorithm.{name}"] = Param(lo + (eps if lo_open else 0), hi - (eps if hi_open else 0))
            continue
        low, high = value / 10, value * 10
        if hi is not None:
            high = min(high, hi * (1 - 1e-6) if hi_open else hi)
        space[f"algorithm.{name}"] = Param(low, high, log=True)
    return space


def _bounds(metadata: list[Any]) -> tuple[float | None, float | None, bool, bool]:
    lo = hi = None
    lo_open = hi_open = False
    for m in metadata:
        if isinstance(m, Ge | Gt):
            lo, lo_open = float(m.ge if isinstance(m, Ge) else m.gt), isinstance(m, Gt)
        elif isinstance(m, Le | Lt):
            hi, hi_open = float(m.le if isinstance(m, Le) else m.lt), isinstance(m, Lt)
    return lo, hi, lo_open, hi_open


def load_space_file(path: str | Path) -> dict[str, dict[str, Param | None]]:
    """``METHOD or '*': {key: {low, high, log, type: int} | null}``; null removes a default key."""
    data = read_yaml(Path(path), "search-space file")
    out: dict[str, dict[str, Param | None]] = {}
    for method, params in data.items():
        if not isinstance(params, dict):
            raise ConfigError(f"{path}: {method}: expected key: {{low, high, log}} entries")
        out[str(method)] = {}
        for key, spec in params.items():
            if spec is None:
                out[str(method)][str(key)] = None
                continue
            try:
                low, high = float(spec["low"]), float(spec["high"])
            except (TypeError, KeyError, ValueError):
                raise ConfigError(f"{path}: {method}.{key}: expected {{low: NUMBER, high: NUMBER}}") from None
            if not low < high or (spec.get("log") and low <= 0):
                raise ConfigError(f"{path}: {method}.{key}: need low < high (and low > 0 with log: true)")
            out[str(method)][str(key)] = Param(low, high, bool(spec.get("log")), spec.get("type") == "int")
    return out


def space_for(cfg: ExperimentConfig, user: dict[str, dict[str, Param | None]], config: str | None) -> dict[str, Param]:
    """The default space of ``cfg``'s method, updated by the user's ``'*'`` then method entries;
    every key is checked against the config at both ends of its range."""
    space: dict[str, Param | None] = dict(default_space(cfg.algorithm))
    space.update(user.get("*", {}))
    space.update(user.get(cfg.algorithm.name, {}))
    final = {k: p for k, p in space.items() if p is not None}
    for key, p in final.items():
        for end in (p.low, p.high):
            value = int(end) if p.integer else end
            try:
                load_config(config, [f"algorithm.name={cfg.algorithm.name}", f"{key}={value}"])
            except ConfigError as exc:
                # the key itself is wrong (unknown, out of its bounds); a rule across fields (Ditto's
                # personal_lr * lam < 2) only refuses some points, which the trials skip
                if str(exc).startswith(f"{key}:"):
                    raise ConfigError(f"search space of {cfg.algorithm.name}: {exc}") from None
    if not final:
        raise ConfigError(f"search space of {cfg.algorithm.name} is empty; give one with --space FILE")
    return final


def objective_value(summary: RunSummary | Mapping[str, Any], metric: str) -> float:
    """The validation metric at the best-validation round: the only figure a trial reports."""
    part = as_summary(summary).best_val
    if part is None or metric not in (part.clients or {}):
        raise ConfigError("tuning needs a validation split: set split.val_fraction above 0")
    return float(part.clients[metric].mean)


@dataclass
class MethodResult:
    method: str
    overrides: list[str]
    value: float
    trials: int
    space: dict[str, Param]


def tune(
    config: str | None,
    overrides: list[str],
    methods: list[str],
    trials: int,
    out_dir: Path,
    *,
    metric: str = "val_acc",
    space_file: str | None = None,
    notify: Notify | None = None,
) -> list[MethodResult]:
    """Tune every method with ``trials`` finished trials; write and return the best overrides."""
    try:
        import optuna
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    notify = notify or (lambda message: None)
    user = load_space_file(space_file) if space_file else {}
    plans = []
    for method in methods:  # everything is validated before the first trial
        cfg = load_config(config, [*overrides, f"algorithm.name={method}"])
        if cfg.engine != "local":
            raise ConfigError("fedmerge tune runs its trials on the local engine; drop engine=flower")
        if cfg.split.val_fraction <= 0:
            raise ConfigError("tuning needs a validation split: set split.val_fraction above 0")
        plans.append((method, cfg, space_for(cfg, user, config)))
    notify(f"tuning {', '.join(methods)} with {trials} trials each in {out_dir}")
    make_folder(out_dir, "tune folder (--out, or output_dir)")
    storage = f"sqlite:///{(out_dir / STUDY_FILE).resolve()}"
    results = []
    for method, cfg, space in plans:
        study = optuna.create_study(
            study_name=method,
            storage=storage,
            direction=METRICS[metric],
            load_if_exists=True,
        )
        # seeded by the trials so far: a resumed study draws new points, not the first ones again
        study.sampler = optuna.samplers.TPESampler(seed=cfg.seed + len(study.get_trials(deepcopy=False)))
        base = [*overrides, f"algorithm.name={method}"]
        _check_same_study(study, cfg, space, metric, out_dir)
        run = _objective(config, base, space, out_dir / "trials" / method, metric, notify, method, trials)
        while (done := _counted(study)) < trials:
            study.optimize(run, n_trials=trials - done, catch=(RoundFailed,))
        best = study.best_trial
        chosen = [f"{k}={_number(best.params[k], space[k])}" for k in space]
        results.append(MethodResult(method, chosen, float(best.value), _counted(study), space))
        notify(f"{method}: best {metric} {best.value:.4f} with {' '.join(chosen)}")
    write_best(out_dir / BEST_FILE, results, config, overrides, metric, trials)
    return results


def _check_same_study(study: Any, cfg: ExperimentConfig, space: dict[str, Param], metric: str, out_dir: Path) -> None:
    """A study continues only with the config, space and metric it started with."""
    fixed = cfg.model_dump(mode="json", exclude={"algorithm", "threads", "workers", "output_dir", "name"})
    fingerprint = json.dumps(
        {"config": fixed, "algorithm": cfg.algorithm.name, "space": {k: p.to_json() for k, p in space.items()},
         "metric": metric},
        sort_keys=True,
    )  # fmt: skip
    old = study.user_attrs.get("fingerprint")
    if old is not None:  # studies made before workers was left out hold it (it changes no number)
        data = json.loads(old)
        data.get("config", {}).pop("workers", None)
        old = json.dumps(data, sort_keys=True)
    if old is None:
        study.set_user_attr("fingerprint", fingerprint)
    elif old != fingerprint:
        raise ConfigError(
            f"{out_dir / STUDY_FILE} holds a study of {cfg.algorithm.name} made with another config, search "
            "space or metric; use another --out folder"
        )


def _counted(study: Any) -> int:
    """Trials that used the budget: finished ones and those whose run failed (a diverged lr);
    a trial cut short by a kill does not count, and its point is tried anew."""
    from optuna.trial import TrialState

    return sum(
        t.state == TrialState.COMPLETE or (t.state == TrialState.FAIL and "error" in t.user_attrs)
        for t in study.get_trials(deepcopy=False)
    )


def _number(value: float, param: Param) -> float | int:
    return int(round(value)) if param.integer else float(value)


def _objective(
    config: str | None,
    base: list[str],
    space: dict[str, Param],
    trials_dir: Path,
    metric: str,
    notify: Notify,
    method: str,
    budget: int,
) -> Callable[[Any], float]:
    import optuna

    refused: list[str] = []

    def run(trial: Any) -> float:
        values = {
            k: trial.suggest_int(k, int(p.low), int(p.high), log=p.log)
            if p.integer
            else trial.suggest_float(k, p.low, p.high, log=p.log)
            for k, p in space.items()
        }
        try:
            cfg = load_config(config, [*base, *(f"{k}={v}" for k, v in values.items())])
        except ConfigError as exc:  # a point that a rule across fields refuses: costs nothing, not counted
            refused.append(str(exc))
            if len(refused) >= MAX_REFUSED:
                raise ConfigError(f"search space of {method}: {len(refused)} points refused, e.g. {exc}") from None
            raise optuna.TrialPruned(str(exc)) from None
        run_dir = trials_dir / f"trial-{trial.number:03d}"
        trial.set_user_attr("run_dir", str(run_dir))
        shown = " ".join(f"{k.removeprefix('algorithm.')}={v:.4g}" for k, v in values.items())
        try:
            result = run_experiment(cfg, run_dir, show_progress=False, withhold_test=True)
        except RoundFailed as exc:
            trial.set_user_attr("error", str(exc))
            notify(f"{method} trial {_counted(trial.study) + 1}/{budget}: failed ({exc}) with {shown}")
            raise
        finally:
            shutil.rmtree(run_dir / CHECKPOINT_DIR, ignore_errors=True)  # metrics and config are kept
        value = objective_value(result.summary, metric)
        notify(f"{method} trial {_counted(trial.study) + 1}/{budget}: {metric} {value:.4f} with {shown}")
        return value

    return run


def write_best(
    path: Path, results: list[MethodResult], config: str | None, overrides: list[str], metric: str, trials: int
) -> None:
    data = {
        "tuned_on": {
            "config": str(Path(config).resolve()) if config else None,
            "overrides": list(overrides),
            "metric": f"{metric}: mean over clients at the best-validation round (test split withheld)",
            "trials": trials,
            "study": str(path.parent / STUDY_FILE),
        },
        "methods": {
            r.method: {
                "overrides": r.overrides,
                "value": r.value,
                "trials": r.trials,
                "space": {k: p.to_json() for k, p in r.space.items()},
            }
            for r in results
        },
    }
    header = "# written by fedmerge tune; use with: fedmerge run --tuned FILE, fedmerge sweep --tuned FILE\n"
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))


def describe_space(param: Param) -> str:
    scale = "log" if param.log else "linear"
    kind = "int" if param.integer else "float"
    return f"{kind} [{param.low:.4g}, {param.high:.4g}] {scale}"
