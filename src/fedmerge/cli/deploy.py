"""``fedmerge deploy``: run an experiment on a Flower deployment, and keep a SuperNode restartable."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

from fedmerge.cli.app import app, err, fail, new_typer, split_args

deploy_app = new_typer(
    help="Run on a Flower deployment (docs/deployment.md): launch a run and follow it; supervise a SuperNode.",
    no_args_is_help=True,
)
app.add_typer(deploy_app, name="deploy")


def _say(message: str) -> None:
    err.print(message, highlight=False, soft_wrap=True, markup=False)


def _launch(superlink: str, values: dict[str, str], app_dir: Path | None) -> None:
    """Submit the fedmerge app to ``superlink`` and exit with the run's outcome (a launch error in one line)."""
    from fedmerge.apps.deploy import LaunchError, launch

    try:
        code = launch(superlink, values, _say, app_dir)
    except LaunchError as exc:
        fail(str(exc), 1)
    raise typer.Exit(code)


def _refuse_what_cannot_run(config_path: str | None, overrides: list[str]) -> None:
    """A privacy section the method cannot run under (e.g. secure aggregation of FedMerge) is refused here, in
    one line, before a ServerApp starts, when the config is readable on this machine too."""
    if config_path and not Path(config_path).expanduser().is_file():
        return  # only on the SuperLink's machine: its ServerApp refuses it there
    from fedmerge.algorithms.privacy_settings import settings_problem
    from fedmerge.config.schema import ConfigError, load_config

    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as exc:
        fail(str(exc), 2)
    if cfg.privacy is not None and (problem := settings_problem(cfg.algorithm.name, cfg.privacy)) is not None:
        fail(problem, 2)


@deploy_app.command("run", context_settings={"allow_interspersed_args": True})
def run_cmd(
    superlink: str = typer.Argument(..., help="the SuperLink connection (in $FLWR_HOME/config.toml), e.g. secure"),
    args: list[str] = typer.Argument(
        None, metavar="[CONFIG] [KEY=VALUE...]", help="a YAML config on the SuperLink's machine, then overrides"
    ),
    output_dir: str | None = typer.Option(None, "--output-dir", help="where the SuperLink's machine writes runs"),
    resume: str | None = typer.Option(None, "--resume", help="continue this run folder (on the SuperLink's machine)"),
    pooled_test: str | None = typer.Option(None, "--pooled-test", help="a pooled test file for the server"),
    app_dir: Path | None = typer.Option(None, "--app", help="a Flower App folder (default: written for this run)"),
) -> None:
    """Start a run on the SuperLink, stream its log, and exit 0 only if it completed (1 with the reason)."""
    from fedmerge.run.provenance import redact

    config_path, overrides = split_args(args)
    if resume and config_path:
        fail("--resume continues a run folder with its own config.yaml; give no CONFIG", 2)
    if not resume:
        _refuse_what_cannot_run(config_path, overrides)
    values = {
        "config": str(Path(config_path).expanduser().resolve()) if config_path else "",
        "overrides": " ".join(overrides),
        "output-dir": output_dir or "",
        "resume": resume or "",
        "pooled-test": pooled_test or "",
        # provenance.jsonl records this command, not the ServerApp's command line (which holds a token)
        "command": shlex.join(["fedmerge", *redact(sys.argv[1:])]),
    }
    _launch(superlink, values, app_dir)


@deploy_app.command(
    "node", context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
)
def node_cmd(ctx: typer.Context) -> None:
    """flower-supernode with these arguments (--superlink required); exits non-zero within seconds when it
    stops unasked (refused by its SuperLink), after ending its whole process group."""
    from fedmerge.apps.deploy import LaunchError, flower_command, superlink_given, supervise

    if not superlink_given(ctx.args) and not {"-h", "--help", "-V", "--version"} & set(ctx.args):
        # flower-supernode would retry its default address forever, never naming it
        fail("fedmerge deploy node needs --superlink HOST:PORT, the SuperLink's Fleet API address", 2)
    try:
        argv = [flower_command("flower-supernode"), *ctx.args]
    except LaunchError as exc:
        fail(str(exc), 1)
    raise typer.Exit(supervise(argv, _say))


@deploy_app.command("onboard")
def onboard_cmd(
    superlink: str = typer.Argument(..., help="the SuperLink connection (in $FLWR_HOME/config.toml), e.g. secure"),
    run_dir: str = typer.Argument(..., help="the trained run folder, on the SuperLink's machine (read, never written)"),
    round_: str = typer.Option(
        "last", "--round", help="the checkpoint to onboard from: last, best (the best-validation round) or N"
    ),
    adapt_epochs: int | None = typer.Option(
        None, "--adapt-epochs", min=0, help="the newcomers' adaptation budget (default: the run's unseen.adapt_epochs)"
    ),
    partition_id: list[int] = typer.Option(
        None, "--partition-id", help="onboard this client (repeatable; default: every newcomer's SuperNode online)"
    ),
    app_dir: Path | None = typer.Option(None, "--app", help="a Flower App folder (default: written for this run)"),
) -> None:
    """Give the SuperNodes of clients that never trained their personalised models from a trained run: each
    node builds and keeps its model, and reports only its metrics. Exits 0 only if every newcomer was onboarded."""
    from fedmerge.config.schema import ConfigError
    from fedmerge.run.onboard import parse_round
    from fedmerge.run.provenance import redact

    try:
        parse_round(round_)
    except ConfigError as exc:
        fail(str(exc), 2)
    values = {
        "onboard": str(Path(run_dir).expanduser().resolve()),
        "onboard-round": round_,
        "adapt-epochs": "" if adapt_epochs is None else str(adapt_epochs),
        "partition-ids": ",".join(str(i) for i in partition_id or []),
        "command": shlex.join(["fedmerge", *redact(sys.argv[1:])]),
    }
    _launch(superlink, values, app_dir)
