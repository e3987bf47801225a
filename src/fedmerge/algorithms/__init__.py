"""Federated methods, one module each; importing this package registers them all.

Every public module of this package is imported here, so a new method only needs its own file.
"""

import importlib
import pkgutil

from fedmerge.core.algorithm import ALGORITHMS, Algorithm, AlgorithmConfig

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmConfig"]
