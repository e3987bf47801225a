"""fedmerge: personalized federated learning by model merging."""

__version__ = "0.1.0"
