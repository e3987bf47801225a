"""Federated methods, one module each; importing this package registers them all."""

from fedmerge.core.algorithm import ALGORITHMS, Algorithm, AlgorithmConfig

from . import fedavg, fedavg_ft, fedprox, local  # noqa: F401  (registration side effects)

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmConfig"]
