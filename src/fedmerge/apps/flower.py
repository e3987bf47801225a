"""Deployment entry points: the objects a SuperLink (``server_app``) and SuperNodes (``client_app``) load.

The ServerApp runs the whole experiment (``run_experiment`` with ``engine: flower``) against the Grid
it is given and writes the usual results folder. Run config keys (``flwr run --run-config``):

- ``config``: path of an experiment YAML file on the SuperLink's machine ("" = built-in default);
- ``overrides``: space-separated ``key.path=value`` overrides, as on the ``fedmerge run`` command line;
- ``output-dir``: where the run folder is created; ``resume``: a run folder to continue instead;
- ``pooled-test``: optional, a pooled test file (``fedmerge export-clients --pooled-test``) on the
  SuperLink's machine, on which the server tests the global model ("" = none).

The run is a deployment: every SuperNode reads its own client file (``--node-config data-path=...``)
and keeps its client's state on its own disk; the server loads no dataset (docs/deployment.md).
A run that cannot start or go on (a node without a readable file, nodes that disagree, too few
replies) stops with one line, ``fedmerge: error: ...``, in the ServerApp's log (``flwr run --stream``,
``flwr log``) and no traceback; Flower marks the run ``finished:failed`` with that line, which
``fedmerge deploy run`` turns into its exit status. Each round adds a line of progress.

``onboard``: a run folder on the SuperLink's machine; instead of training, the SuperNodes of clients that never
trained get their personalised models from it (``run/onboard.py``; ``onboard-round``: last, best or N;
``adapt-epochs``; ``partition-ids``: comma-separated, default every newcomer online).
"""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedmerge.engines.flower.client import app as client_app

log = logging.getLogger(__name__)
server_app = ServerApp()


class DeploymentFailed(Exception):
    """A deployed run stopped; its message is the one line the operator reads. Raised (not ``SystemExit``)
    so that Flower flushes the ServerApp's log to ``flwr run --stream`` / ``flwr log`` and marks the run
    ``finished:failed`` with this line as its details."""


class _NoTraceback(logging.Filter):
    """Flower logs a ServerApp's exception with its traceback; for a
    [`DeploymentFailed`][fedmerge.apps.flower.DeploymentFailed] the one
    line already printed says everything."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], DeploymentFailed):
            record.exc_info = None
        return True


logging.getLogger("flwr").addFilter(_NoTraceback())  # the logger of Flower's ServerApp runtime


def say(message: str) -> None:
    """A line of the ServerApp's log (what ``flwr run --stream`` and ``flwr log`` show)."""
    print(f"fedmerge: {message}", flush=True)


def run_config_text(rc: dict) -> str:
    """The run config as ``flwr run --run-config`` takes it (keys that are set, values quoted)."""
    parts = []
    for key in ("config", "overrides", "output-dir", "resume", "pooled-test"):
        value = str(rc.get(key, ""))
        if value:
            parts.append(f"{key}={json.dumps(value)}")
    return " ".join(parts)


def invocation(rc: dict, flower_run_id: int) -> dict:
    """What the operator asked for, for ``provenance.jsonl``: the ``fedmerge deploy run`` command that
    started this run (it passes its own, credentials removed), else the ``flwr run`` equivalent; never
    this process's command line, which holds the SuperLink's token."""
    command = str(rc.get("command", "")) or f"flwr run APP SUPERLINK --run-config {shlex.quote(run_config_text(rc))}"
    return {"command": command, "flower_run_id": int(flower_run_id), "run_config": run_config_text(rc)}


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    from fedmerge.config.schema import ConfigError
    from fedmerge.core.checkpoint import CheckpointError
    from fedmerge.core.loop import RoundFailed
    from fedmerge.core.state_store import StateStoreError
    from fedmerge.data import DataUnavailable
    from fedmerge.run.resume import RESUME_OVERRIDABLE
    from fedmerge.run.runner import run_from_files

    rc = context.run_config
    if str(rc.get("onboard", "")):
        onboard(grid, rc)
        return
    overrides = [*shlex.split(str(rc.get("overrides", ""))), "engine=flower"]
    if rc.get("output-dir"):
        overrides.append(f"output_dir={rc['output-dir']}")
    resume = str(rc.get("resume", "")) or None
    if resume:  # only settings that may change on resume; the run folder's config.yaml has the rest
        overrides = [o for o in overrides if o.partition("=")[0] in RESUME_OVERRIDABLE]
    try:
        result = run_from_files(
            str(rc.get("config", "")) or None,
            overrides,
            resume_dir=resume,
            show_progress=False,
            grid=grid,
            deployment=True,
            pooled_test=str(rc.get("pooled-test", "")) or None,
            notify=say,
            invocation=invocation(rc, context.run_id),
        )
    except (ConfigError, DataUnavailable, CheckpointError, RoundFailed, StateStoreError) as exc:
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        say(f"error: {line}")
        raise DeploymentFailed(line) from None
    say(f"results in {result.run_dir}")


def onboard(grid: Grid, rc: dict) -> None:
    """``onboard=RUN_DIR`` (``fedmerge deploy onboard``): onboard the newcomers' SuperNodes from that run folder
    (read only); a line per newcomer with its test metrics and where its node saved its model. Fails (one line)
    when a newcomer failed, after reporting the others."""
    from fedmerge.config.schema import ConfigError
    from fedmerge.core.checkpoint import CheckpointError
    from fedmerge.core.loop import RoundFailed
    from fedmerge.run.onboard import OnboardRequest, newcomer_line, onboard_run

    ids = str(rc.get("partition-ids", "")).replace(",", " ").split()
    try:
        if not all(i.isdigit() for i in ids):
            raise ConfigError(f"partition-ids {rc.get('partition-ids')!r}: give client ids, comma-separated")
        epochs = str(rc.get("adapt-epochs", ""))
        request = OnboardRequest(
            Path(str(rc["onboard"])),
            str(rc.get("onboard-round", "")) or "last",
            int(epochs) if epochs.lstrip("-").isdigit() else None,
            tuple(int(i) for i in ids) if ids else None,
        )
        if epochs and request.adapt_epochs is None:
            raise ConfigError(f"adapt-epochs {epochs!r}: give a number of epochs")
        result = onboard_run(request, grid, say)
    except (ConfigError, CheckpointError, RoundFailed) as exc:
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        say(f"error: {line}")
        raise DeploymentFailed(line) from None
    for newcomer in result.newcomers:
        say(newcomer_line(newcomer))
    if result.failures:
        line = "; ".join(f"client {f['cid']} failed: {f['reason']}" for f in result.failures)
        say(f"error: {line}")
        raise DeploymentFailed(line)


__all__ = ["DeploymentFailed", "client_app", "server_app"]
