"""The config floor's user-facing error and the name of the config file a run folder holds (both needed by
every module of the floor, so kept apart from the schema that imports the registries)."""

from __future__ import annotations

# the validated config a run folder holds (written by fedmerge.run, read back on resume)
CONFIG_FILE = "config.yaml"


class ConfigError(ValueError):
    """A user-facing configuration problem; ``str(err)`` is one line."""
