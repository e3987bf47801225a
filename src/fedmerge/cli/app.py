"""The ``fedmerge`` Typer app, its consoles, and the one place where errors become one line."""

from __future__ import annotations

import errno
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup


def new_typer(**options: Any) -> typer.Typer:
    """A ``typer.Typer`` that suggests a close command name once: click 8.4+ does it itself, and typer's
    own suggestion would repeat it ("Did you mean 'run'? Did you mean 'run'?")."""
    if hasattr(click.exceptions, "NoSuchCommand") and "suggest_commands" in inspect.signature(typer.Typer).parameters:
        options["suggest_commands"] = False
    return typer.Typer(**options)


def lazy_help(**helps: Callable[[], str]) -> type[TyperCommand]:
    """A command class (``@app.command(cls=lazy_help(param=text))``) whose parameters' help texts are made only
    when its ``--help`` is shown: texts that name what a lower floor knows (the datasets) would otherwise import
    that floor, and torch with it, at every start of ``fedmerge``."""

    class LazyHelpCommand(TyperCommand):
        def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
            for param in self.params:
                if param.name in helps:
                    param.help = helps[param.name]()  # type: ignore[attr-defined]
            super().format_help(ctx, formatter)

    return LazyHelpCommand


# Command groups that a method brings: loaded when named (or listed by --help), as "module:attribute" of a
# typer.Typer or click command. fedmerge's own are listed here; other packages add theirs through the entry-point
# group below (docs/api/plugins.md), skipped like installed plugins under FEDMERGE_DISABLE_PLUGIN_AUTOLOAD=1.
METHOD_COMMANDS = {"livar": "fedmerge.cli.livar:livar_app"}
COMMANDS_ENTRY_POINT = "fedmerge.cli"
AUTOLOAD_OFF = "FEDMERGE_DISABLE_PLUGIN_AUTOLOAD"  # the same switch as fedmerge.core.plugins' (not imported: slow)


def method_commands() -> dict[str, tuple[str, str]]:
    """Name -> (where it comes from, "module:attribute") of every method command group: fedmerge's own, then the
    installed packages' (a name fedmerge already uses keeps fedmerge's command)."""
    import os
    from importlib.metadata import entry_points

    found = {name: ("fedmerge", ref) for name, ref in METHOD_COMMANDS.items()}
    if os.environ.get(AUTOLOAD_OFF, "") in ("", "0"):
        for ep in sorted(entry_points(group=COMMANDS_ENTRY_POINT), key=lambda ep: ep.name):
            found.setdefault(ep.name, (f"installed command {ep.name!r} (entry point {COMMANDS_ENTRY_POINT})", ep.value))
    return found


def load_command(name: str, origin: str, ref: str) -> click.Command:
    """The click command behind ``ref``; one that cannot be loaded becomes a command that says why in one line."""
    from importlib import import_module

    module, _, attribute = ref.partition(":")
    try:
        obj = getattr(import_module(module.strip()), attribute.strip() or "app")
        command = typer.main.get_group(obj) if isinstance(obj, typer.Typer) else obj
        if not isinstance(command, click.Command):
            raise TypeError(f"{ref} is a {type(obj).__name__}, not a typer.Typer or click command")
    except Exception as exc:  # noqa: BLE001  (anything a plugin's module raises while it imports)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        problem = f"{origin}: cannot import {ref} ({type(exc).__name__}: {first})"
        if origin != "fedmerge":
            problem += f"; {AUTOLOAD_OFF}=1 skips installed plugins"

        def broken() -> None:
            fail(problem, 2)

        return click.Command(  # any arguments, --help too: the one line
            name,
            callback=broken,
            help=f"(not loaded: {problem})",
            add_help_option=False,
            context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        )
    command.name = name
    return command


class MethodCommandsGroup(TyperGroup):
    """fedmerge's command group, with the method command groups ([`method_commands`][fedmerge.cli.app.method_commands])
    after the built-in commands, each imported only when named or when ``--help`` lists it."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        own = super().list_commands(ctx)
        return [*own, *(name for name in method_commands() if name not in own)]

    _loaded: dict[tuple[str, str, str], click.Command] = {}  # imported once per process

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and (found := method_commands().get(cmd_name)) is not None:
            key = (cmd_name, *found)
            command = self._loaded[key] = self._loaded.get(key) or load_command(*key)
        return command


app = new_typer(
    cls=MethodCommandsGroup,
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


def fail(message: str, code: int) -> None:
    # escape: messages contain literal brackets (e.g. pip install -e '.[flower]') that rich would eat
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def notice(message: str) -> None:
    style = "bold yellow" if message.startswith("warning:") else "dim"
    err.print(f"[{style}]{escape(message)}[/]", highlight=False, soft_wrap=True)


def split_args(args: list[str] | None) -> tuple[str | None, list[str]]:
    """``[CONFIG] [key=value ...]``: the first argument is a config file unless it contains '='."""
    args = list(args or [])
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def user_errors() -> tuple[type[BaseException], ...]:
    from fedmerge.config.schema import ConfigError
    from fedmerge.data import DataUnavailable

    return ConfigError, DataUnavailable


# the machine's problems, not fedmerge's: a full disk or quota, a read-only or forbidden place
SYSTEM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def system_problem(exc: BaseException) -> str | None:
    """One line for an OSError that the user's machine caused ([`SYSTEM_ERRNOS`][fedmerge.cli.app.SYSTEM_ERRNOS]), else
    None."""
    if not isinstance(exc, OSError) or exc.errno not in SYSTEM_ERRNOS:
        return None
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free some space"
    elif _unreadable(exc.filename):  # an input, not a place to write
        fix = "it cannot be read: change its permissions, or give another file"
    else:
        fix = "choose a writable place"
    return f"{reason(exc)} ({fix})"


def _unreadable(filename: object) -> bool:
    import os

    return (
        isinstance(filename, str | bytes | os.PathLike)
        and os.path.exists(filename)
        and not os.access(filename, os.R_OK)
    )


def stopped_run(exc: BaseException, what: str) -> str:
    """How to continue a run that ``exc`` stopped: its folder (set by ``run_experiment``) when it exists."""
    run_dir = getattr(exc, "run_dir", None)
    if run_dir is None:
        return f"{what} before the run folder was made; nothing to resume"
    return f"{what}; continue with: fedmerge run --resume {run_dir}"


def reason(exc: Exception) -> str:
    """One line for an OSError or ValueError: the system's words and the path, not errno's repr."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc).splitlines()[0]


def report_crash(exc: BaseException) -> None:
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
    run_dir = getattr(exc, "run_dir", None)
    resume = (
        f"The run keeps its last checkpoint: fix or report, then fedmerge run --resume {run_dir}."
        if run_dir is not None
        else "A run whose folder was made keeps its last checkpoint: fix or report, then fedmerge run --resume it."
    )
    err.print(
        f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(first)}\n"
        f"This is a bug in fedmerge, not in your input; {escape(saved)}. {escape(resume)}",
        highlight=False,
        soft_wrap=True,
    )
    sys.exit(1)
