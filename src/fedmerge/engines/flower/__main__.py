"""``python -m fedmerge.engines.flower DIR``: write the Flower App folder that ``flwr run DIR`` submits.

The app holds no code: its components are the installed ``fedmerge`` package's ServerApp and
ClientApp, so every machine needs ``pip install fedmerge[flower]`` and nothing is installed at run time.
"""

from __future__ import annotations

import sys
from pathlib import Path

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "fedmerge-flower"
version = "1.0.0"
description = "fedmerge experiments on Flower: any registered algorithm, unchanged"
license = "Apache-2.0"
dependencies = ["flwr==1.41.*", "fedmerge"]

[tool.flwr.app]
publisher = "fedmerge"

[tool.flwr.app.components]
serverapp = "fedmerge.apps.flower:server_app"
clientapp = "fedmerge.apps.flower:client_app"

[tool.flwr.app.config]
config = ""
overrides = ""
output-dir = ""
resume = ""
pooled-test = ""
command = ""
onboard = ""
onboard-round = ""
adapt-epochs = ""
partition-ids = ""
"""


def write_app(folder: Path) -> Path:
    """Create ``folder`` (its name must be a valid Flower App name: letters, digits, hyphens)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(PYPROJECT)
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m fedmerge.engines.flower DIR")
    try:
        print(write_app(Path(sys.argv[1])))
    except OSError as exc:  # a read-only place, a file in the way
        sys.exit(f"error: {sys.argv[1]}: cannot write the app folder ({exc.strerror})")
