"""Image transforms applied per client when the federated dataset is built."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rotate_images(x: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate ``N x C x H x W`` images counter-clockwise (the direction of ``torch.rot90``).

    Multiples of 90 degrees are exact (``rot90``); other angles are bilinear with zero fill.
    """
    degrees = degrees % 360
    if degrees % 90 == 0:
        return torch.rot90(x, int(degrees // 90), dims=(-2, -1)).contiguous()
    t = math.radians(degrees)
    c, s = math.cos(t), math.sin(t)
    theta = torch.tensor([[c, -s, 0.0], [s, c, 0.0]], dtype=x.dtype).expand(len(x), 2, 3)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
