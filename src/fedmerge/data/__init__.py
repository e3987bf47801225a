"""Data layer: offline datasets, partitioners, per-client splits, label noise, FederatedDataset.

Importing this package registers every built-in dataset in ``DATASETS`` and partitioner in ``PARTITIONERS``.
"""

from fedmerge.data import sources  # noqa: F401  (registers the datasets)
from fedmerge.data.errors import ClientFileError, DataUnavailable
from fedmerge.data.federated import ClientData, FederatedDataset, build_federated_dataset
from fedmerge.data.noise import NoiseConfig, apply_label_noise
from fedmerge.data.partitioners import MIN_CLIENT_SAMPLES, PARTITIONERS, Partition, PartitionConfig
from fedmerge.data.pool import DATASETS, DatasetConfig, Pool, load_pool, stratified_subsample
from fedmerge.data.split import SplitConfig, split_indices
from fedmerge.data.transforms import rotate_images

__all__ = [
    "DATASETS",
    "MIN_CLIENT_SAMPLES",
    "PARTITIONERS",
    "ClientData",
    "ClientFileError",
    "DataUnavailable",
    "DatasetConfig",
    "FederatedDataset",
    "NoiseConfig",
    "Partition",
    "PartitionConfig",
    "Pool",
    "SplitConfig",
    "apply_label_noise",
    "build_federated_dataset",
    "load_pool",
    "rotate_images",
    "split_indices",
    "stratified_subsample",
]
