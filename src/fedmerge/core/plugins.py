"""Plugins: modules of other packages that register components (methods, datasets, partitioners, models).

Two ways in, both plain imports (a module registers its components when imported, like the built-in ones):

- installed: a package declares its module in the entry-point group ``fedmerge.plugins``; every
  installed one is imported before the experiment schema is built
  ([`load_installed()`][fedmerge.core.plugins.load_installed]), and on
  Flower nodes before they read a job;
- named: a config's ``plugins: [package.module, ...]``, saved in the run's config.yaml, so a resume, a
  sweep's or study's run processes and Flower's ClientApps import the same code
  ([`import_plugin()`][fedmerge.core.plugins.import_plugin]).

Loading is idempotent: a module is imported once per process, and one that failed fails again with the
same one-line [`PluginError`][fedmerge.core.plugins.PluginError] instead of registering its components twice.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "fedmerge.plugins"
# set to 1 to skip the installed plugins (one that fails to import would otherwise stop every command)
AUTOLOAD_OFF = "FEDMERGE_DISABLE_PLUGIN_AUTOLOAD"

_failed: dict[str, PluginError] = {}
_installed_loaded = False


class PluginError(ValueError):
    """A plugin module that cannot be imported; ``str(err)`` is one line naming it and the error."""


def import_plugin(module: str, origin: str = "plugin") -> None:
    """Import ``module`` once; a failure is a [`PluginError`][fedmerge.core.plugins.PluginError] naming ``origin``, the
    module and the error."""
    if module in _failed:
        raise _failed[module]
    if module in sys.modules:
        return
    try:
        importlib.import_module(module)
    except Exception as exc:  # anything a user's module raises while it imports
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        error = PluginError(f"{origin}: cannot import {module} ({type(exc).__name__}: {first})")
        _failed[module] = error
        raise error from None


def import_plugins(modules: Iterable[str], origin: str = "plugins") -> None:
    for module in modules:
        import_plugin(module, origin)


def installed_plugins() -> list[tuple[str, str]]:
    """(entry-point name, module) of every installed plugin, by name."""
    found = entry_points(group=ENTRY_POINT_GROUP)
    return sorted((ep.name, ep.value.partition(":")[0].strip()) for ep in found)


def load_installed() -> None:
    """Import every installed plugin (once per process), unless ``FEDMERGE_DISABLE_PLUGIN_AUTOLOAD=1``."""
    global _installed_loaded
    if _installed_loaded or os.environ.get(AUTOLOAD_OFF, "") not in ("", "0"):
        return
    _installed_loaded = True  # first: a plugin that loads a config while it imports does not come back here
    errors = []
    for name, module in installed_plugins():
        try:
            import_plugin(module, f"installed plugin {name!r} (entry point {ENTRY_POINT_GROUP})")
        except PluginError as exc:
            errors.append(exc)
    if errors:
        _installed_loaded = False  # every later call reports it again (import_plugin remembers the error)
        raise PluginError(f"{errors[0]}; {AUTOLOAD_OFF}=1 skips installed plugins")
