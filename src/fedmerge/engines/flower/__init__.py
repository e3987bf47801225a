"""Flower engine: one generic ServerApp/ClientApp adapter that runs any registered algorithm.

- ``engine.FlowerEngine``: the Engine protocol over a Flower ``Grid`` (server side); ``engine.connect``
  is the handshake.
- ``client``, ``worker``: the ClientApp. Deployed, a node reads its own client file and keeps its client
  state in a ``StateStore`` on its disk (``node``); in a simulation the state lives in ``context.state``.
- ``job``: what the server sends a node about the experiment (no data).
- ``simulation``: Flower's simulation runtime in this process (``engine: flower``).
- ``app``: the ``server_app`` / ``client_app`` objects a SuperLink and SuperNodes load (deployment);
  ``python -m fedmerge.engines.flower DIR`` writes the Flower App folder that ``flwr run`` submits.

Flower is an optional extra. This module imports no Flower code, so ``fedmerge`` works without it.
"""

from __future__ import annotations

import importlib.util
import os

# No square brackets: the CLI prints errors through rich, which reads "[flower]" as markup.
INSTALL_HINT = (
    "engine=flower needs Flower, which is not installed: pip install 'flwr==1.41.*' ray  (the 'flower' extra)"
)

# Offline by construction: no telemetry, no update check, no Ray usage stats. Flower reads these at
# import time, so they are set before any ``flwr`` import (every submodule imports this package first);
# subprocesses (Ray workers, SuperLink, SuperNodes, ClientApps) inherit them.
OFFLINE_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0"}
os.environ.update(OFFLINE_ENV)


def flower_available(simulation: bool = False) -> bool:
    names = ["flwr", "ray"] if simulation else ["flwr"]
    return all(importlib.util.find_spec(n) is not None for n in names)
