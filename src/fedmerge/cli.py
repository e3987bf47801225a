"""The ``fedmerge`` command."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _typer(**options: Any) -> typer.Typer:
    """A ``typer.Typer`` that suggests a close command name once: click 8.4+ does it itself, and typer's
    own suggestion would repeat it ("Did you mean 'run'? Did you mean 'run'?")."""
    if hasattr(click.exceptions, "NoSuchCommand") and "suggest_commands" in inspect.signature(typer.Typer).parameters:
        options["suggest_commands"] = False
    return typer.Typer(**options)


# show_locals=False: a bug's traceback must not dump tensors (thousands of lines) into the terminal
app = _typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Personalized federated learning by model merging.",
    epilog="An internal error prints one line and saves its traceback to a file; FEDMERGE_TRACEBACK=1 prints it.",
)
out = Console()
err = Console(stderr=True)


CONFIG_AND_OVERRIDES = typer.Argument(
    None, metavar="CONFIG KEY=VALUE...", help="an optional YAML config, then key.path=value overrides"
)


def _fail(message: str, code: int) -> None:
    # escape: messages contain literal brackets (e.g. pip install -e '.[flower]') that rich would eat
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _notice(message: str) -> None:
    style = "bold yellow" if message.startswith("warning:") else "dim"
    err.print(f"[{style}]{escape(message)}[/]", highlight=False, soft_wrap=True)


def _split_args(args: list[str] | None) -> tuple[str | None, list[str]]:
    """``[CONFIG] [key=value ...]``: the first argument is a config file unless it contains '='."""
    args = list(args or [])
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _user_errors() -> tuple[type[BaseException], ...]:
    from fedmerge.data import DataUnavailable
    from fedmerge.experiment.config import ConfigError

    return ConfigError, DataUnavailable


def _reason(exc: Exception) -> str:
    """One line for an OSError or ValueError: the system's words and the path, not errno's repr."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc).splitlines()[0]


@app.command()
def run(
    args: list[str] = CONFIG_AND_OVERRIDES,
    resume: Path | None = typer.Option(None, "--resume", help="continue the run in this folder"),
    checkpoint: str | None = typer.Option(
        None, "--checkpoint", help="with --resume: continue from this file of RUN_DIR/checkpoints, not latest.json's"
    ),
    device: str | None = typer.Option(None, "--device", help="cpu, cuda, cuda:N or auto"),
    data_dir: str | None = typer.Option(None, "--data-dir", help="folder holding the dataset files"),
    out_dir: str | None = typer.Option(None, "--output-dir", help="where run folders are created"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="live progress display"),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="create the run in exactly this folder"),
    tuned: Path | None = typer.Option(None, "--tuned", help="apply this fedmerge tune file's values"),
) -> None:
    """Run an experiment (the built-in FedAvg on UCI digits when no config is given)."""
    from fedmerge.core.checkpoint import CheckpointError
    from fedmerge.core.loop import RoundFailed
    from fedmerge.core.state_store import StateStoreError
    from fedmerge.experiment.runner import run_from_files

    config_path, overrides = _split_args(args)
    if device:
        overrides.append(f"device={device}")
    if data_dir:
        overrides.append(f"dataset.data_dir={data_dir}")
    if out_dir:
        overrides.append(f"output_dir={out_dir}")
    try:
        result = run_from_files(
            config_path,
            overrides,
            resume_dir=str(resume) if resume else None,
            checkpoint=checkpoint,
            show_progress=progress,
            notify=_notice,
            run_dir=str(run_dir) if run_dir else None,
            tuned=str(tuned) if tuned else None,
        )
    except _user_errors() as exc:
        _fail(str(exc), 2)
    except (CheckpointError, StateStoreError, RoundFailed) as exc:
        _fail(str(exc), 1)
    except KeyboardInterrupt:
        _fail("interrupted; continue with: fedmerge run --resume RUN_DIR", 130)
    print_summary(result.summary)
    out.print(f"results in [bold]{result.run_dir}[/]", soft_wrap=True, highlight=False)


def print_summary(summary: dict[str, Any]) -> None:
    table = Table(
        title=f"{summary.get('algorithm')} on {summary.get('dataset')} ({summary.get('num_clients')} clients)"
    )
    for col in ("selection", "round", "metric", "mean", "weighted", "std", "worst 10%"):
        table.add_column(col, justify="right" if col not in ("selection", "metric") else "left")
    for label in ("last", "best_val"):
        part = summary.get(label)
        if not part:
            continue
        for key in ("test_acc", "test_top5", "test_nll", "test_ece", "test_mce"):
            s = part["clients"].get(key)
            if s:
                table.add_row(
                    label,
                    str(part["round"]),
                    key,
                    f"{s['mean']:.4f}",
                    f"{s['weighted_mean']:.4f}",
                    f"{s['std']:.4f}",
                    f"{s['worst10']:.4f}",
                )
        if part.get("global"):
            table.add_row(label, str(part["round"]), "global test_acc", f"{part['global']['test_acc']:.4f}", "", "", "")
    out.print(table)
    comm = summary.get("communication_per_client_per_round")
    params = summary.get("parameters", {})
    if comm:
        out.print(
            f"parameters: model {params.get('model', 0):,.0f}, server {params.get('server_state', 0):,.0f}, "
            f"per client state {params.get('client_state_mean', 0):,.0f}; "
            f"communicated per client per round: down {comm['down']:,.0f}, up {comm['up']:,.0f}",
            soft_wrap=True,
        )
    gap = summary.get("local_gap")
    if gap:
        out.print(f"local-global gap (train loss received - trained): mean {gap['mean']:.4f}, last {gap['last']:.4f}")
    recovery = summary.get("cluster_recovery")
    if recovery:
        out.print(f"cluster recovery (ARI, argmax merge weight vs true group): {recovery['ari']:.4f}")


SWEEP_ARGS = typer.Argument(
    None,
    metavar="[SWEEP.yaml | CONFIG] KEY=VALUE | KEY=[V1,V2]...",
    help="a sweep file or a config, then overrides; a list value is a grid axis (seed=[0,1,2])",
)


@app.command()
def sweep(
    args: list[str] = SWEEP_ARGS,
    jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="runs at a time, each in its own process"),
    out_dir: Path | None = typer.Option(None, "--out", help="sweep folder (default OUTPUT_DIR/sweeps/NAME)"),
    resume: Path | None = typer.Option(None, "--resume", help="continue the sweep in this folder"),
    tuned: Path | None = typer.Option(None, "--tuned", help="apply this fedmerge tune file's values per algorithm"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the runs and stop"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="live progress display"),
) -> None:
    """Run a grid of runs (methods x settings x seeds) in parallel and compare them per setting."""
    from fedmerge.experiment import sweep as sw
    from fedmerge.experiment.sweep_progress import SweepProgress
    from fedmerge.experiment.sweep_spec import spec_from_args

    try:
        if resume is not None:
            if args or tuned:
                _fail("--resume SWEEP_DIR takes no other arguments: the sweep is read from its sweep.yaml", 2)
            spec, out_dir = sw.load_spec(resume), resume
        else:
            spec = spec_from_args(list(args or []), str(tuned) if tuned else None)
        points = sw.expand(spec)
        out_dir = out_dir or sw.default_sweep_dir(spec, points)
        if dry_run:
            for p in points:
                out.print(f"{p.key}: {' '.join(p.overrides)}", highlight=False, soft_wrap=True)
            out.print(f"{len(points)} runs in {out_dir}", highlight=False, soft_wrap=True)
            return
        points = sw.prepare(spec, out_dir)
    except _user_errors() as exc:
        _fail(str(exc), 2)
    runner = sw.SweepRunner(spec, out_dir, points, jobs)
    _notice(f"sweep of {len(points)} runs in {out_dir} ({jobs} at a time, {runner.threads} thread(s) each)")
    try:
        with SweepProgress(runner, live=progress and err.is_terminal, console=err) as display:
            outcomes = runner.run(display.update)
    except KeyboardInterrupt:
        _fail(f"interrupted; continue with: fedmerge sweep --resume {out_dir}", 130)
    tables = sw.write_results(out_dir)
    _print_tables(tables)
    out.print(f"tables in {out_dir / sw.RESULTS_MD} and {out_dir / sw.RESULTS_CSV}", soft_wrap=True, highlight=False)
    out.print(f"the page: fedmerge report {out_dir} -o report.html", soft_wrap=True, highlight=False)
    failed = sum(t.status == "failed" for t in outcomes)
    if failed:
        _fail(f"{failed} of {len(outcomes)} runs failed; their errors are in the tables and in {out_dir / 'logs'}", 1)


def _print_tables(tables: list[Any]) -> None:
    from fedmerge.experiment.compare import SHORT_COLUMNS, row_cells

    for t in tables:
        table = Table(title=escape(t.setting), title_justify="left")
        for i, col in enumerate(SHORT_COLUMNS):
            table.add_column(col, justify="left" if i == 0 else "right")
        for row in t.rows:
            table.add_row(*(escape(c) for c in row_cells(t, row)))
        out.print(table)
        for r in t.failures:
            out.print(f"failed: {r.key}: {escape(r.error or '')}", highlight=False, soft_wrap=True)


@app.command()
def tune(
    args: list[str] = typer.Argument(
        None,
        metavar="[CONFIG] KEY=VALUE... [algorithm.name=[M1,M2]]",
        help="a config and overrides; a list of algorithm names tunes each with the same budget",
    ),
    trials: int = typer.Option(20, "--trials", min=1, help="finished trials per method (the same for all)"),
    out_dir: Path | None = typer.Option(None, "--out", help="study folder (default OUTPUT_DIR/tune/NAME)"),
    metric: str = typer.Option("val_acc", "--metric", help="val_acc (maximised) or val_nll (minimised)"),
    space: Path | None = typer.Option(None, "--space", help="YAML: METHOD or '*': {KEY: {low, high, log}}"),
    show_space: bool = typer.Option(False, "--show-space", help="print each method's search space and stop"),
) -> None:
    """Tune each method on the validation split with Optuna (resumable; test split withheld)."""
    from fedmerge.experiment import tune as tu
    from fedmerge.experiment.config import ConfigError, load_config, parse_override

    config_path, overrides = _split_args(args)
    if metric not in tu.METRICS:
        _fail(f"--metric: expected one of {', '.join(tu.METRICS)}, got {metric!r}", 2)
    methods: list[str] = []
    try:
        fixed = []
        for text in overrides:
            path, value = parse_override(text)
            if isinstance(value, list):
                if path != ["algorithm", "name"]:
                    raise ConfigError(f"{text.partition('=')[0]}: tune takes a list only for algorithm.name")
                methods = [str(v) for v in value]
            else:
                fixed.append(text)
        cfg = load_config(config_path, fixed)
        methods = methods or [cfg.algorithm.name]
        if show_space:
            user = tu.load_space_file(space) if space else {}
            for method in methods:
                mcfg = load_config(config_path, [*fixed, f"algorithm.name={method}"])
                for key, param in tu.space_for(mcfg, user, config_path).items():
                    out.print(f"{method}: {key} {tu.describe_space(param)}", highlight=False, soft_wrap=True)
            return
        name = Path(config_path).stem if config_path else "tune"
        folder = out_dir or Path(cfg.output_dir) / "tune" / name
        tu.tune(
            config_path, fixed, methods, trials, folder, metric=metric,
            space_file=str(space) if space else None, notify=_notice,
        )  # fmt: skip
    except _user_errors() as exc:
        _fail(str(exc), 2)
    except KeyboardInterrupt:
        _fail("interrupted; run the same command again to continue the study", 130)
    out.print(f"best values in {folder / tu.BEST_FILE} (use: fedmerge run --tuned FILE)", soft_wrap=True)


@app.command()
def report(
    paths: list[Path] = typer.Argument(..., help="run folders, sweep folders, or folders holding them"),
    out_path: Path = typer.Option(Path("report.html"), "--out", "-o", help="the HTML file to write"),
    title: str | None = typer.Option(None, "--title", help="page title"),
) -> None:
    """One self-contained HTML page: tables, curves, partitions, budgets, merge weights, commands."""
    from fedmerge.experiment.html_report import build_report
    from fedmerge.experiment.report_data import NoRuns

    try:
        path = build_report(paths, out_path, title)
    except NoRuns as exc:
        _fail(str(exc), 2)
    except OSError as exc:  # an unwritable -o
        _fail(f"{out_path}: {exc.strerror or exc}", 2)
    out.print(f"report written to {path}", soft_wrap=True, highlight=False)


KIND_ARG = typer.Argument(
    None, help="algorithm, dataset, partition, model, or a section: run, split, noise, flower, log, state"
)
NAME_ARG = typer.Argument(None, help="a registered name (e.g. fedmerge): print its options")


@app.command("list")
def list_components(kind: str | None = KIND_ARG, name: str | None = NAME_ARG) -> None:
    """Show the registered components, or every option of one: fedmerge list algorithm fedmerge."""
    from fedmerge.experiment import catalog

    if kind is None:
        for registry in catalog.REGISTRIES.values():
            _print_registry(registry)
        known = Table(title="known by another name", show_header=False, title_justify="left")
        known.add_column("name", style="bold")
        known.add_column("is")
        for alias, (_, text) in catalog.KNOWN_AS.items():
            known.add_row(text.split(":", 1)[0] if ":" in text else alias, text.split(": ", 1)[-1])
        out.print(known)
        out.print(
            "options of one component: fedmerge list KIND NAME (e.g. fedmerge list algorithm fedmerge); "
            "other settings: fedmerge list run | split | noise | flower | log | state",
            soft_wrap=True,
            highlight=False,
        )
        return
    resolved = catalog.kind_of(kind)
    if resolved is None:  # `fedmerge list fedmerge`: a component name on its own
        hits = catalog.find_component(kind) if name is None else []
        if len(hits) != 1:
            _fail(f"unknown kind {kind!r}; expected one of {', '.join(catalog.kinds())}", 2)
        resolved, name = hits[0]
    if resolved in catalog.REGISTRIES and name is None:
        _print_registry(catalog.REGISTRIES[resolved])
        out.print(f"options of one: fedmerge list {resolved} NAME", highlight=False)
        return
    _print_options(resolved, name)


@app.command("show")
def show_component(kind: str = typer.Argument(..., help=KIND_ARG.help), name: str | None = NAME_ARG) -> None:
    """Every option of a component or section, with type, default and description (as list KIND NAME)."""
    list_components(kind, name)


def _print_registry(registry: Any) -> None:
    table = Table(title=f"{registry.kind}s", show_header=False, title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("description")
    for entry in registry.entries():
        table.add_row(entry.name, entry.description)
    out.print(table)


def _print_options(kind: str, name: str | None) -> None:
    from fedmerge.experiment import catalog
    from fedmerge.experiment.schema_docs import describe

    try:
        cls = catalog.config_class(kind, name)
    except KeyError as exc:
        _fail(str(exc.args[0]), 2)
    if kind in catalog.REGISTRIES:
        registered = cls.model_fields["name"].default
        alias = catalog.KNOWN_AS.get(str(name).lower())
        if alias is not None and name != registered:
            out.print(alias[1], highlight=False)
        title = (
            f"{kind}.name={registered}: {catalog.REGISTRIES[kind].get(registered).description}\n"
            f"set a key as {kind}.KEY=VALUE"
        )
    elif kind == "run":
        title = "top-level settings, set as KEY=VALUE (sections: fedmerge list)"
    else:
        title = f"{kind} settings, set as {kind}.KEY=VALUE"
    table = Table(title=escape(title), title_justify="left")
    for column in ("key", "type", "default", "description"):
        table.add_column(column, style="bold" if column == "key" else None, overflow="fold", no_wrap=column == "key")
    for row in describe(cls):
        table.add_row(row.key, escape(row.type), escape(row.default), escape(row.description))
    out.print(table)


@app.command()
def partition(
    args: list[str] = CONFIG_AND_OVERRIDES,
    plot: Path | None = typer.Option(None, "--plot", help="save a per-client class histogram (PNG)"),
) -> None:
    """Print (and optionally plot) how a config splits the data among clients."""
    from fedmerge.experiment.config import load_config
    from fedmerge.experiment.runner import load_data

    config_path, overrides = _split_args(args)
    try:
        data = load_data(load_config(config_path, overrides))
    except _user_errors() as exc:
        _fail(str(exc), 2)
    out.print(data.summary_table(), highlight=False)
    if plot is not None:
        try:
            data.plot_summary(plot)
        except (OSError, ValueError) as exc:  # an unwritable folder, an unknown image format
            _fail(f"--plot {plot}: {_reason(exc)}", 2)
        out.print(f"plot saved to {plot}", soft_wrap=True, highlight=False)


@app.command("export-clients")
def export_clients_cmd(
    args: list[str] = typer.Argument(
        None, metavar="[CONFIG] [KEY=VALUE...] OUT_DIR", help="a config and overrides as for run, then the folder"
    ),
    force: bool = typer.Option(False, "--force", help="write into a non-empty folder, replacing its client files"),
    pooled_test: bool = typer.Option(
        False, "--pooled-test", help="also write pooled-test.safetensors (every client's test split) for the server"
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="progress bar"),
) -> None:
    """Write one file per client (its train/val/test tensors), so that each node holds only its own data.

    Each file is self-contained: it also names the classes and the input shape."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from fedmerge.data.client_files import POOLED_FILE, check_out_dir, export_clients, source_digest, write_pooled_test
    from fedmerge.experiment.config import load_config
    from fedmerge.experiment.runner import load_data

    args = list(args or [])
    if not args or "=" in args[-1]:
        _fail("missing OUT_DIR: fedmerge export-clients [CONFIG] [KEY=VALUE...] OUT_DIR", 2)
    config_path, overrides = _split_args(args[:-1])
    out_dir = Path(args[-1])
    try:
        cfg = load_config(config_path, overrides)
        check_out_dir(out_dir, force=force)  # before the (slow) data build
        data = load_data(cfg)
        digest = source_digest(cfg.model_dump(mode="json", include={"dataset", "partition", "split", "noise", "seed"}))
        columns = (TextColumn("export-clients"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, console=err, transient=True, disable=not progress) as bar:
            task = bar.add_task("", total=data.num_clients)
            paths = export_clients(
                data, out_dir, source_digest=digest, force=force, on_written=lambda _: bar.advance(task)
            )
        if pooled_test:
            write_pooled_test(data, out_dir / POOLED_FILE, digest)
    except _user_errors() as exc:
        _fail(str(exc), 2)
    shape = "x".join(map(str, data.input_shape))
    out.print(
        f"wrote {len(paths)} client files{' and ' + POOLED_FILE if pooled_test else ''} to {out_dir} "
        f"({data.name}, {data.num_classes} classes, input {shape})",
        highlight=False,
        soft_wrap=True,
    )


plot_app = _typer(no_args_is_help=True, help="Plots drawn from run folders.")
app.add_typer(plot_app, name="plot")


@plot_app.command("merge-weights")
def plot_merge_weights_cmd(
    run_dir: Path = typer.Argument(..., help="a FedMerge run folder"),
    out_path: Path | None = typer.Option(None, "--out", help="PNG path (default RUN_DIR/merge_weights.png)"),
    rounds: list[int] | None = typer.Option(None, "--round", help="round to show (repeatable; default: spread)"),
    panels: int = typer.Option(4, "--panels", min=1, help="number of rounds shown when --round is not given"),
) -> None:
    """Heatmaps of the merge weights (clients x global models) at several rounds, as the paper's Fig. 5."""
    from fedmerge.experiment.plots import plot_merge_weights

    if not (run_dir / "metrics.jsonl").exists():
        _fail(f"{run_dir}: no metrics.jsonl; is it a run folder?", 2)
    try:
        path = plot_merge_weights(run_dir, out_path, rounds or None, panels)
    except (OSError, ValueError) as exc:
        _fail(_reason(exc), 2)
    out.print(f"plot saved to {path}", soft_wrap=True, highlight=False)


@plot_app.command("lambda")
def plot_lambda_cmd(
    run_dir: Path = typer.Argument(..., help="a SuPerFed run folder"),
    out_path: Path | None = typer.Option(None, "--out", help="PNG path (default: in RUN_DIR)"),
    split: str = typer.Option("test", "--split", help="test or val"),
) -> None:
    """Accuracy along SuPerFed's line between the federated (0) and local (1) model (Fig. 3 / A2)."""
    from fedmerge.experiment.plot_lambda import plot_lambda

    try:
        path = plot_lambda(run_dir, out_path, split=split)
    except (OSError, ValueError) as exc:  # OSError: an unwritable --out
        _fail(f"--out {out_path}: {_reason(exc)}" if isinstance(exc, OSError) else _reason(exc), 2)
    out.print(f"plot saved to {path}", soft_wrap=True, highlight=False)


@plot_app.command("budget")
def plot_budget_cmd(
    run_dirs: list[Path] = typer.Argument(..., help="finished run folders"),
    out_path: Path = typer.Option(Path("budget.png"), "--out", help="PNG path"),
) -> None:
    """Accuracy against server / communicated / per-client parameters (FedMerge Figs. 3-4)."""
    from fedmerge.experiment.plot_budget import plot_budget

    try:
        path = plot_budget(run_dirs, out_path)
    except (OSError, ValueError) as exc:  # OSError: an unwritable --out
        _fail(f"--out {out_path}: {_reason(exc)}" if isinstance(exc, OSError) else _reason(exc), 2)
    out.print(f"plot saved to {path}", soft_wrap=True, highlight=False)


livar_app = _typer(no_args_is_help=True, help="LIVAR tools.")
app.add_typer(livar_app, name="livar")


def _edges(text: str, name: str) -> tuple[float, ...]:
    try:
        edges = tuple(float(v) for v in text.split(","))
    except ValueError:
        _fail(f"{name}: expected comma-separated percentages such as 25,50, got {text!r}", 2)
    return edges


@livar_app.command("calibrate")
def livar_calibrate_cmd(
    args: list[str] = CONFIG_AND_OVERRIDES,
    out_dir: Path = typer.Option(Path("runs/livar-calibration"), "--out", help="folder for g_shap.json and plots"),
    repeats: int = typer.Option(3, "--repeats", min=1, help="fresh starts, each adding clients x layers samples"),
    trees: int = typer.Option(200, "--trees", min=1, help="random-forest size"),
    a_edges: str = typer.Option("25,50", "--a-edges", help="quantile edges (percent) of s_A"),
    b_edges: str = typer.Option("60,80", "--b-edges", help="quantile edges (percent) of s_B"),
) -> None:
    """Fit LIVAR's G_SHAP table on a proxy task (a LoRA config): federated clients vs. a centralized
    model, per-layer NNLS, random forest, SHAP, quantile table. Use it with algorithm.shap_table=OUT/g_shap.json."""
    from fedmerge.experiment.config import load_config
    from fedmerge.experiment.livar_calibration import calibrate

    config_path, overrides = _split_args(args)
    if config_path is None:
        _fail("livar calibrate needs a proxy config with a LoRA model, e.g. configs/livar_proxy_bible.yaml", 2)
    a, b = _edges(a_edges, "--a-edges"), _edges(b_edges, "--b-edges")
    try:
        cfg = load_config(config_path, overrides)
        result = calibrate(cfg, out_dir, repeats, trees, a, b, log=lambda m: err.print(escape(m), highlight=False))
    except ImportError as exc:
        _fail(f"{exc}: livar calibrate needs pip install -e '.[livar]' (scikit-learn, shap)", 2)
    except (*_user_errors(), ValueError) as exc:
        _fail(str(exc), 2)
    grid = Table(title=f"G_SHAP from {len(result.samples)} samples (rows: s_A bins, columns: s_B bins)")
    grid.add_column("")
    bounds = lambda e: [f"<{e[0]:g}", *[f"{lo:g}-{hi:g}" for lo, hi in zip(e[:-1], e[1:])], f">{e[-1]:g}"]  # noqa: E731
    for label in bounds(result.table.b_edges):
        grid.add_column(f"Q_B {label}", justify="right")
    for label, row in zip(bounds(result.table.a_edges), result.table.values):
        grid.add_row(f"Q_A {label}", *[f"{v:.4f}" for v in row])
    out.print(grid)
    out.print(f"table saved to {result.out_dir / 'g_shap.json'}", soft_wrap=True, highlight=False)


def _report_crash(exc: BaseException) -> None:
    """A bug, not a user error: one line on the terminal, the traceback in a file to attach to a report.
    ``FEDMERGE_TRACEBACK=1`` prints the traceback instead."""
    import os
    import tempfile
    import time
    import traceback

    if os.environ.get("FEDMERGE_TRACEBACK") == "1":
        raise exc
    text = "".join(traceback.format_exception(exc))
    where = Path(tempfile.gettempdir()) / f"fedmerge-crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    try:
        where.write_text(f"fedmerge {' '.join(sys.argv[1:])}\n\n{text}")
        saved = f"the traceback is in {where}"
    except OSError:
        saved = "run again with FEDMERGE_TRACEBACK=1 to see the traceback"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    err.print(
        f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(first)}\n"
        f"This is a bug in fedmerge, not in your input; {escape(saved)}. A run that was under way "
        "keeps its last checkpoint: fix or report, then fedmerge run --resume RUN_DIR.",
        highlight=False,
        soft_wrap=True,
    )
    sys.exit(1)


def main() -> None:
    try:
        app()
    except BrokenPipeError:  # e.g. `fedmerge list | head`
        sys.exit(0)
    except KeyboardInterrupt:  # commands that can continue say how; the others just stop
        err.print("[bold red]interrupted[/]", highlight=False)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001  (anything else is a bug: no traceback on the terminal)
        _report_crash(exc)


if __name__ == "__main__":
    main()
