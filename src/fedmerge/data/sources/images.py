"""Array helpers shared by the image loaders."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def to_unit_float(images: np.ndarray) -> np.ndarray:
    """Integer images (0..255) -> float32 in [0, 1]; float images are taken as already scaled."""
    if np.issubdtype(images.dtype, np.integer) or images.dtype == np.bool_:
        return (images.astype(np.float32) / 255.0).astype(np.float32)
    return images.astype(np.float32)


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of ``N x C x H x W`` float images to ``size x size``, kept in [0, 1]."""
    if images.shape[-2:] == (size, size):
        return images.astype(np.float32)
    t = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32))
    # Antialiasing only matters when shrinking; it keeps thin strokes from vanishing.
    shrinking = size < max(images.shape[-2:])
    out = F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False, antialias=shrinking)
    return out.clamp_(0.0, 1.0).numpy()
