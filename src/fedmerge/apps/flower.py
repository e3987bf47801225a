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
replies) stops with one line, ``fedmerge: error: ...``, in the ServerApp's log and no traceback.
"""

from __future__ import annotations

import logging
import shlex

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedmerge.engines.flower.client import app as client_app

log = logging.getLogger(__name__)
server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    from fedmerge.config.schema import ConfigError
    from fedmerge.core.checkpoint import CheckpointError
    from fedmerge.core.loop import RoundFailed
    from fedmerge.data import DataUnavailable
    from fedmerge.run.resume import RESUME_OVERRIDABLE
    from fedmerge.run.runner import run_from_files

    rc = context.run_config
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
        )
    except (ConfigError, DataUnavailable, CheckpointError, RoundFailed) as exc:
        print(f"fedmerge: error: {str(exc).splitlines()[0]}", flush=True)
        raise SystemExit(1) from None
    print(f"fedmerge: results in {result.run_dir}", flush=True)


__all__ = ["client_app", "server_app"]
