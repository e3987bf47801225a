"""The ``fedmerge`` command: one module per command group, errors turned into one line in ``app``."""

from __future__ import annotations

import sys
from importlib import import_module

from rich.markup import escape

from fedmerge.cli.app import app, err, out, report_crash, system_problem

# Importing a command module registers its commands on ``app``; this order is the order of ``--help``.
# The method command groups (``fedmerge livar``, a plugin's) come after them, loaded when named (app.METHOD_COMMANDS).
COMMAND_MODULES = ("run", "sweep", "study", "report", "components", "clients", "deploy", "data")
for _module in COMMAND_MODULES:
    import_module(f"fedmerge.cli.{_module}")

__all__ = ["app", "main", "out"]


def main() -> None:
    try:
        app()
    except BrokenPipeError:  # e.g. `fedmerge list | head`
        sys.exit(0)
    except KeyboardInterrupt:  # commands that can continue say how; the others just stop
        err.print("[bold red]interrupted[/]", highlight=False)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001  (anything else is a bug: no traceback on the terminal)
        problem = system_problem(exc)  # a full disk, a read-only folder: the machine's, not a bug
        if problem is None:
            report_crash(exc)
        err.print(f"[bold red]error:[/] {escape(problem)}", highlight=False, soft_wrap=True)
        sys.exit(2)
