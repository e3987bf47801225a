"""Partitioners; importing this package registers every built-in one in ``PARTITIONERS``."""

from fedmerge.data.partitioners import groups, label_skew
from fedmerge.data.partitioners.base import MIN_CLIENT_SAMPLES, PARTITIONERS, Partition, PartitionConfig

__all__ = ["MIN_CLIENT_SAMPLES", "PARTITIONERS", "Partition", "PartitionConfig", "groups", "label_skew"]
