"""Deterministic randomness keyed by purpose.

Every random draw in fedmerge comes from a generator seeded by ``(root_seed, round, client_id,
purpose)``. Nothing depends on hidden global RNG state, so a resumed run, a different engine or a
different client order reproduces the same numbers.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

NO_CLIENT = -1
NO_ROUND = -1


def derive_seed(root_seed: int, round_idx: int = NO_ROUND, client_id: int = NO_CLIENT, purpose: str = "") -> int:
    """A 63-bit seed that depends on every part of the key (stable across Python runs)."""
    key = f"{int(root_seed)}|{int(round_idx)}|{int(client_id)}|{purpose}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def torch_generator(
    root_seed: int,
    round_idx: int = NO_ROUND,
    client_id: int = NO_CLIENT,
    purpose: str = "",
    device: str = "cpu",
) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(root_seed, round_idx, client_id, purpose))
    return gen


def numpy_rng(
    root_seed: int, round_idx: int = NO_ROUND, client_id: int = NO_CLIENT, purpose: str = ""
) -> np.random.Generator:
    return np.random.default_rng(derive_seed(root_seed, round_idx, client_id, purpose))
