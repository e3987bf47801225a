"""``fedmerge plot privacy RUNS...``: privacy-utility curves, epsilon against accuracy (issue #38).

Runs are read back from their folders alone (``config.yaml`` and ``summary.json``):

- a *family* is every run whose config is the same but for the seed, the name, where it was written and
  its ``privacy:`` section (a method at its settings); it is labelled by its algorithm, plus the keys
  that tell apart families of the same algorithm;
- a *point* is one family at one privacy setting: the mean over its seeds of the epsilon spent and of
  the mean client test accuracy (last round by default: the released model, which spent every round's
  epsilon; the best-validation round is chosen with evaluation metrics that the guarantee does not
  cover), with the seeds' spread (sample std) as the interval;
- DP-SGD's epsilon is the largest over the clients (``privacy.dp_sgd.epsilon_max``: the guarantee every
  client has), central DP's the server's (``privacy.central.epsilon``), each at the run's own delta.

One panel per mechanism (DP-SGD, central DP), epsilon on a log axis. The family's runs without privacy
are its reference: a dashed line with a +- std band in its colour; a family that has no private run at
all (Local: nothing is sent) is drawn as a grey reference in every panel. A run with both mechanisms,
a run without noise (epsilon infinite) and an unfinished run are listed as left out, not drawn.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedmerge.run.results import CONFIG_FILE, SUMMARY_FILE
from fedmerge.run.run_records import read_summary

MECHANISMS = {"dp_sgd": "DP-SGD (sample-level)", "central": "central DP (user-level)"}
EPSILON_TEXT = {"dp_sgd": "ε, largest over clients (log scale)", "central": "user-level ε (log scale)"}
# Keys that do not change what a run computes, or that tell runs of one family apart.
NOT_FAMILY = {"seed", "name", "output_dir", "privacy", "device", "threads", "workers", "eval_batch_size"}
NOT_FAMILY |= {"checkpoint_every", "keep_checkpoints"}
SELECTIONS = {"last": "last round", "best_val": "best-validation round"}


@dataclass(frozen=True)
class PrivacyRun:
    """One finished run as the curves read it."""

    run_dir: Path
    seed: int
    algorithm: str
    family: str  # JSON of the config without NOT_FAMILY: equal for runs that differ only in those
    flat: dict[str, Any]  # that config, flattened (``algorithm.lr``): what family labels are made of
    mechanism: str  # "none", "dp_sgd", "central" or "dp_sgd+central"
    privacy: str  # the privacy section as compact text ("" without one): one point per value
    noise: str  # the noise as a reader wants it: "z=1", "target ε=8"
    clip: float | None
    epsilon: float | None
    epsilon_mean: float | None  # DP-SGD: the clients' mean (the figure draws the largest)
    delta: float | None
    accuracy: float
    not_private: bool = False  # privacy.reproducible_noise: the noise follows from the seed


def read_run(run_dir: str | Path, selection: str = "last") -> PrivacyRun:
    """The run in ``run_dir``; ValueError (one line) when it is unfinished or its summary lacks a number."""
    run_dir = Path(run_dir)
    summary_path, config_path = run_dir / SUMMARY_FILE, run_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{run_dir}: no {CONFIG_FILE}; is it a run folder?")
    if not summary_path.is_file():
        raise ValueError(f"{run_dir}: unfinished (no {SUMMARY_FILE})")
    config = yaml.safe_load(config_path.read_text()) or {}
    summary = read_summary(summary_path)
    part = summary.selection(selection)
    stats = (part.clients or {}).get("test_acc") if part is not None else None
    if stats is None:
        raise ValueError(f"{summary_path}: no {selection}.clients.test_acc (no evaluated round?)")
    accuracy = float(stats.mean)
    section = {k: v for k, v in (config.get("privacy") or {}).items() if v is not None}
    mechanism = "+".join(k for k in MECHANISMS if k in section) or "none"
    spent = summary.privacy or {}
    epsilon = epsilon_mean = delta = clip = None
    noise = ""
    if mechanism in MECHANISMS:
        settings, figures = section[mechanism], spent.get(mechanism) or {}
        key = "epsilon_max" if mechanism == "dp_sgd" else "epsilon"
        if key not in figures:
            raise ValueError(f"{summary_path}: no privacy.{mechanism}.{key}")
        epsilon, delta, clip = float(figures[key]), float(figures["delta"]), float(settings["clip"])
        epsilon_mean = float(figures.get("epsilon_mean", epsilon))
        noise = noise_text(settings)
    kept = {k: v for k, v in config.items() if k not in NOT_FAMILY}
    return PrivacyRun(
        run_dir=run_dir,
        seed=int(config.get("seed", 0)),
        algorithm=str((config.get("algorithm") or {}).get("name", "?")),
        family=json.dumps(kept, sort_keys=True),
        flat=dotted_keys(kept),
        mechanism=mechanism,
        privacy=json.dumps(section, sort_keys=True) if section else "",
        noise=noise,
        clip=clip,
        epsilon=epsilon,
        epsilon_mean=epsilon_mean,
        delta=delta,
        accuracy=accuracy,
        not_private=spent.get("private") is False,
    )


def privacy_tag(section: dict[str, Any] | None) -> str:
    """A config's ``privacy:`` section in a few words (``DP-SGD z=1``, ``central DP target ε=8``); "" without one."""
    short = {"dp_sgd": "DP-SGD", "central": "central DP"}
    return ", ".join(f"{name} {noise_text(section[m])}" for m, name in short.items() if (section or {}).get(m))


def noise_text(settings: dict[str, Any]) -> str:
    """A mechanism's noise: ``z=1`` (its noise multiplier) or ``target ε=8``."""
    z = settings.get("noise_multiplier")
    return f"z={z:g}" if z is not None else f"target ε={settings.get('target_epsilon'):g}"


def dotted_keys(section: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config section as ``{"a.b.c": value}``, the form overrides take."""
    out: dict[str, Any] = {}
    for k, v in section.items():
        if isinstance(v, dict):
            out.update(dotted_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def family_labels(runs: list[PrivacyRun]) -> dict[str, str]:
    """Family -> label: the algorithm, plus the keys whose values differ between its families (at most two)."""
    families: dict[str, PrivacyRun] = {}
    for r in runs:
        families.setdefault(r.family, r)
    labels = {}
    for family, r in families.items():
        same = [o for o in families.values() if o.algorithm == r.algorithm]
        differ = [k for k in r.flat if len({repr(o.flat.get(k)) for o in same}) > 1]
        extra = [f"{k.split('.')[-1]}={r.flat[k]}" for k in differ[:2]]
        labels[family] = ", ".join([r.algorithm, *extra])
    return labels


@dataclass
class Point:
    """One family at one privacy setting, over its seeds."""

    label: str
    mechanism: str
    noise: str
    clip: float | None
    seeds: list[int]
    epsilons: list[float]
    epsilon_means: list[float]
    deltas: list[float]
    accuracies: list[float]

    @property
    def epsilon(self) -> float:
        return statistics.mean(self.epsilons)

    @property
    def accuracy(self) -> float:
        return statistics.mean(self.accuracies)

    @property
    def accuracy_std(self) -> float:
        """Sample std over seeds (0 for one seed)."""
        return statistics.stdev(self.accuracies) if len(self.accuracies) > 1 else 0.0


@dataclass
class Curves:
    points: list[Point]  # private points, in family order then by epsilon (descending noise: ascending epsilon)
    references: list[Point]  # runs without privacy, one per family
    left_out: list[str]  # one line per run not drawn, and why
    not_private: int = 0  # runs whose noise follows from the seed (privacy.reproducible_noise)

    def families(self, mechanism: str) -> list[str]:
        return list(dict.fromkeys(p.label for p in self.points if p.mechanism == mechanism))

    def mechanisms(self) -> list[str]:
        return [m for m in MECHANISMS if any(p.mechanism == m for p in self.points)]


def curves(runs: list[PrivacyRun], left_out: list[str] | None = None) -> Curves:
    """The points of ``runs``: grouped by family and privacy setting, averaged over seeds."""
    labels = family_labels(runs)
    skipped = list(left_out or [])
    groups: dict[tuple[str, str], list[PrivacyRun]] = {}
    for r in runs:
        if r.mechanism not in (*MECHANISMS, "none"):
            skipped.append(f"{r.run_dir}: both DP-SGD and central DP (two epsilons; not drawn)")
        elif r.epsilon is not None and not math.isfinite(r.epsilon):
            skipped.append(f"{r.run_dir}: no noise (epsilon infinite)")
        else:
            groups.setdefault((r.family, r.privacy), []).append(r)
    points, references = [], []
    for (family, _), runs_of in groups.items():
        members: list[PrivacyRun] = []
        for r in runs_of:  # one run per seed: a second copy of a run is left out, not averaged in
            if any(m.seed == r.seed for m in members):
                skipped.append(f"{r.run_dir}: seed {r.seed} of this setting is already read from another folder")
            else:
                members.append(r)
        seeds = [r.seed for r in members]
        first = members[0]
        point = Point(
            label=labels[family],
            mechanism=first.mechanism,
            noise=first.noise,
            clip=first.clip,
            seeds=seeds,
            epsilons=[r.epsilon for r in members if r.epsilon is not None],
            epsilon_means=[r.epsilon_mean for r in members if r.epsilon_mean is not None],
            deltas=[r.delta for r in members if r.delta is not None],
            accuracies=[r.accuracy for r in members],
        )
        (references if first.mechanism == "none" else points).append(point)
    order = list(labels.values())
    points.sort(key=lambda p: (order.index(p.label), list(MECHANISMS).index(p.mechanism), p.epsilon))
    return Curves(points, references, skipped, sum(r.not_private for r in runs))


def read_curves(run_dirs: list[Path], selection: str = "last") -> Curves:
    """Every run of ``run_dirs`` that can be read; the others are listed in ``left_out``."""
    runs, left_out = [], []
    for d in run_dirs:
        try:
            runs.append(read_run(d, selection))
        except ValueError as exc:
            left_out.append(str(exc))
    if not runs:
        raise ValueError("no finished run to draw" + (f" ({left_out[0]})" if left_out else ""))
    return curves(runs, left_out)


def privacy_figure(data: Curves, selection: str = "last") -> Any:
    """One panel per mechanism: epsilon (log) against accuracy, +- std over seeds; references dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    mechanisms = data.mechanisms()
    if not mechanisms:
        raise ValueError("no run with differential privacy (a privacy: section) to draw")
    labels = list(dict.fromkeys([*(p.label for p in data.points), *(p.label for p in data.references)]))
    color = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    fig = Figure(figsize=(6.2 * len(mechanisms), 4.6), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot: the caller's backend and open figures are untouched
    axes = fig.subplots(1, len(mechanisms), sharey=True, squeeze=False)[0]
    private = {p.label for p in data.points}
    for ax, mechanism in zip(axes, mechanisms):
        mine = data.families(mechanism)
        for label in mine:
            pts = [p for p in data.points if p.label == label and p.mechanism == mechanism]
            ax.errorbar(
                [p.epsilon for p in pts],
                [p.accuracy for p in pts],
                yerr=[p.accuracy_std for p in pts],
                fmt="o-",
                ms=5,
                capsize=3,
                color=color[label],
                label=label,
            )
            for p in pts:
                ax.annotate(p.noise, (p.epsilon, p.accuracy), textcoords="offset points", xytext=(4, 5),
                            fontsize="x-small", color=color[label])  # fmt: skip
        for ref in data.references:
            if ref.label in mine:
                _reference(ax, ref, color[ref.label], f"{ref.label}, no DP", "--")
            elif ref.label not in private:  # e.g. Local: a reference in every panel
                _reference(ax, ref, "0.45", f"{ref.label} (no DP run)", ":")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 10, 100: not 10^1
        ax.xaxis.set_minor_formatter(FuncFormatter(_minor_label))
        deltas = sorted({d for p in data.points if p.mechanism == mechanism for d in p.deltas})
        at = f" at δ={deltas[0]:g}" if len(deltas) == 1 else " at each run's δ"
        ax.set_xlabel(EPSILON_TEXT[mechanism].replace(" (log", at + " (log"))
        ax.set_title(MECHANISMS[mechanism], loc="left", fontsize="medium")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="x-small", loc="best")
    n = max((len(p.seeds) for p in [*data.points, *data.references]), default=0)
    seeds = f"mean ± std over {n} seeds" if n > 1 else "1 seed"
    axes[0].set_ylabel(f"mean client test accuracy, {SELECTIONS[selection]}\n({seeds})")
    if data.not_private:
        fig.suptitle(not_private_text(data.not_private), color="C3", fontsize="small")
    return fig


def not_private_text(count: int) -> str:
    return f"NOT private: {count} run(s) used privacy.reproducible_noise (the noise follows from the seed)"


def _minor_label(value: float, _: int) -> str:
    """Minor ticks of a log axis labelled at 2 and 5 times a power of ten only (an axis within one decade
    has no major tick to read)."""
    if value <= 0:
        return ""
    return f"{value:g}" if round(value / 10 ** math.floor(math.log10(value))) in (2, 5) else ""


def _reference(ax: Any, ref: Point, color: str, label: str, style: str) -> None:
    ax.axhline(ref.accuracy, color=color, ls=style, lw=1.2, label=label)
    if ref.accuracy_std > 0:
        ax.axhspan(ref.accuracy - ref.accuracy_std, ref.accuracy + ref.accuracy_std, color=color, alpha=0.08)


def privacy_table(data: Curves, selection: str = "last") -> str:
    """The figure's numbers as a Markdown table (percent), references first."""
    head = (
        "| method | mechanism | noise | clip | δ | ε (mean; min-max over seeds) | ε, clients' mean | seeds | "
        f"accuracy, {SELECTIONS[selection]} (%) |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [f"**{not_private_text(data.not_private)}**\n", head] if data.not_private else [head]
    for p in [*data.references, *data.points]:
        if p.epsilons:
            lo, hi = min(p.epsilons), max(p.epsilons)
            eps = f"{p.epsilon:.3g}" + ("" if lo == hi else f" ({lo:.3g}-{hi:.3g})")
            mean = f"{statistics.mean(p.epsilon_means):.3g}" if p.mechanism == "dp_sgd" else "-"
            delta = ", ".join(f"{d:g}" for d in sorted(set(p.deltas)))
        else:
            eps, delta, mean = "∞ (no DP)", "-", "-"
        acc = f"{100 * p.accuracy:.1f}" + (f" ± {100 * p.accuracy_std:.1f}" if len(p.accuracies) > 1 else "")
        mechanism = MECHANISMS.get(p.mechanism, "none")
        clip = "-" if p.clip is None else f"{p.clip:g}"
        cells = [p.label, mechanism, p.noise or "-", clip, delta, eps, mean, str(len(p.seeds)), acc]
        lines.append("| " + " | ".join(cells) + " |")
    if data.left_out:
        lines.append("")
        lines += [f"Not drawn: {why}" for why in data.left_out]
    return "\n".join(lines) + "\n"


def plot_privacy(run_dirs: list[Path], out: Path, table: Path | None = None, selection: str = "last") -> Path:
    """Draw the curves of ``run_dirs`` to ``out`` (a PNG) and, with ``table``, their numbers (Markdown)."""
    if selection not in SELECTIONS:
        raise ValueError(f"selection {selection!r}: one of {', '.join(SELECTIONS)}")
    data = read_curves(run_dirs, selection)
    fig = privacy_figure(data, selection)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    if table is not None:
        Path(table).parent.mkdir(parents=True, exist_ok=True)
        Path(table).write_text(privacy_table(data, selection))
    return out
