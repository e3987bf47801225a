"""Dataset loaders; importing this package registers every built-in dataset in ``DATASETS``."""

from fedmerge.data.sources import (
    cifar,
    digits,
    fashion_mnist,
    imagenet_r,
    instructions,
    leaf,
    multilingual,
    paper_images,
    shakespeare_plays,
    text,
    text_features,
    user_files,
)

__all__ = [
    "cifar",
    "digits",
    "fashion_mnist",
    "imagenet_r",
    "instructions",
    "leaf",
    "multilingual",
    "paper_images",
    "shakespeare_plays",
    "text",
    "text_features",
    "user_files",
]
