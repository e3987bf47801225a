"""The client job: the part of an experiment config a node needs, and how a node rebuilds from it.

The server sends only what client work depends on: the algorithm and model sections, the seed, the
thread count, the device, the evaluation batch size, the split rules and whether a process keeps freed
memory, plus the number of clients and the config's ``plugins`` (modules that register components of
other packages, imported by the node with its installed plugins before it reads the rest). In a simulation
the job also names the data config (``data``), because virtual nodes rebuild their partition on the
server's machine; a deployed node's data comes from its own file and the job names none.
"""

from __future__ import annotations

import importlib
from typing import Any

# ``split`` holds rules (validation and test fractions), no data: a node with raw data splits with them
CLIENT_KEYS = ("algorithm", "model", "seed", "threads", "device", "eval_batch_size", "split")
DATA_SECTIONS = ("dataset", "partition", "split", "noise")


def client_job(experiment: dict[str, Any], num_clients: int, *, with_data: bool) -> dict[str, Any]:
    """The job sent with every message, from a validated experiment config dumped as JSON."""
    job = {key: experiment[key] for key in CLIENT_KEYS}
    job["keep_freed_memory"] = experiment.get("keep_freed_memory", True)  # a process serving many clients
    job["num_clients"] = num_clients
    if experiment.get("privacy") is not None:  # DP-SGD runs on the node; a target epsilon plans for the rounds
        job["privacy"] = experiment["privacy"]
        job["rounds"], job["participation"] = experiment["rounds"], experiment["participation"]
    if experiment.get("plugins"):  # absent when empty: jobs of runs without plugins stay unchanged
        job["plugins"] = list(experiment["plugins"])
    if with_data:
        job["data"] = {key: experiment[key] for key in DATA_SECTIONS} | {"seed": experiment["seed"]}
    return job


def load_job_plugins(job: dict[str, Any]) -> None:
    """Import the node's installed plugins and the job's ``plugins``, before its sections are read."""
    from fedmerge.core.plugins import import_plugins, load_installed

    load_installed()
    import_plugins(job.get("plugins", ()))


def parse_sections(job: dict[str, Any], algorithm_module: str) -> tuple[Any, Any]:
    """The algorithm and model config objects, validated by their registries' own classes."""
    from fedmerge.algorithms import ALGORITHMS
    from fedmerge.models import MODELS

    if job["algorithm"]["name"] not in ALGORITHMS:
        importlib.import_module(algorithm_module)  # an algorithm registered outside fedmerge.algorithms
    return ALGORITHMS.parse(job["algorithm"]), MODELS.parse(job["model"])


def build_data(data: dict[str, Any]) -> Any:
    """Simulation only: the whole federated dataset, exactly as the server built it."""
    from fedmerge.data import NoiseConfig, SplitConfig, build_federated_dataset

    return build_federated_dataset(
        data["dataset"],
        data["partition"],
        SplitConfig.model_validate(data["split"]),
        NoiseConfig.model_validate(data["noise"]),
        int(data["seed"]),
    )
