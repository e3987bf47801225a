"""FEMNIST and Shakespeare with LEAF's natural clients (writers, speaking roles), preprocessed by our code.

Two inputs, the same records: LEAF's own ``all_data/*.json`` files (``leaf_dir``: ``{"users": [...],
"user_data": {user: {"x": [...], "y": [...]}}}``, as LEAF's scripts write them), or the raw sources
that `fedmerge data fetch femnist|shakespeare` verifies, turned into those records by LEAF's rules:

* FEMNIST: NIST SD19 ``by_write`` images (writer = folder ``fNNNN_NN``) labelled by matching each image's
  MD5 with ``by_class`` (``hsf_*`` folders); grey, shrunk to 28x28 (``thumbnail``), 62 classes
  (digits, upper, lower case). Pixels as LEAF stores them (white background = 1).
* Shakespeare: the 1994 Gutenberg complete works split into plays ("by William Shakespeare", from the
  second one on, up to LEAF's last line 124195) and speaking roles (``  NAME. text`` lines and their
  indented continuations); a client is a play's role with more than two lines; a sample is 80 characters
  and the next one, over LEAF's 80-symbol alphabet.
* FEMNIST differs from LEAF's output in one way: LEAF's ``group_by_writer.py`` gives each writer one
  image twice (a bug of its grouping loop); we keep every image once, so each writer has one sample fewer.

LEAF's sampling is then ours, seeded: drop clients with fewer than ``min_samples`` samples (LEAF's
``-k``), keep a random ``fraction`` of the samples by whole clients (``--sf``, non-IID), and at most
``max_clients`` clients (the papers' counts: SuPerFed used 730 FEMNIST and 660 Shakespeare clients).
``natural_id`` is the client, for ``partition.name=natural``.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Literal

import numpy as np
from pydantic import Field

from fedmerge.core.seeding import numpy_rng
from fedmerge.data.cache import Arrays, PoolCacheRef, params_key
from fedmerge.data.errors import DataUnavailable
from fedmerge.data.pool import DATASETS, Pool
from fedmerge.data.sources.fetched import FetchedConfig, cached_arrays, decode_thumbnail, progress, unit_float

# LEAF's alphabet (models/utils/language_utils.py): index = class; unknown characters map to the space.
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SEQ_LENGTH = 80
FEMNIST_CLASSES = [*"0123456789", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *"abcdefghijklmnopqrstuvwxyz"]


class LeafConfig(FetchedConfig):
    """LEAF's sampling options, shared by FEMNIST and Shakespeare."""

    leaf_dir: str | None = Field(
        None, description="a folder of LEAF's all_data/*.json instead of the fetched raw sources"
    )
    min_samples: int = Field(3, ge=3, description="drop clients with fewer samples (LEAF's -k; 3 = train/val/test)")
    fraction: float = Field(1.0, gt=0, le=1, description="keep about this fraction of samples, by whole clients")
    max_clients: int | None = Field(None, ge=1, description="keep at most this many clients (random, seeded)")
    seed: int = Field(0, description="seed of the client sampling (fixed per dataset, like max_samples)")


# --- records: (client ids, x, y) --------------------------------------------------------------------
def read_leaf_json(folder: str, kind: str) -> dict[str, np.ndarray]:
    """LEAF's ``all_data/*.json`` (or the folder holding them) -> records arrays."""
    root = Path(folder).expanduser()
    files = sorted((root / "all_data").glob("*.json")) or sorted(root.glob("*.json"))
    if not files:
        raise DataUnavailable(f"no LEAF json files in {root} or {root / 'all_data'} (check dataset.leaf_dir)")
    users: list[str] = []
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for file in files:
        data = json.loads(file.read_text())
        for user in data["users"]:
            record = data["user_data"][user]
            if kind == "femnist":
                pixels = np.asarray(record["x"], dtype=np.float64).reshape(-1, 28, 28)
                xs.append(np.clip(np.rint(pixels * 255), 0, 255).astype(np.uint8))
                ys.append(np.asarray(record["y"], dtype=np.int64))
            else:
                xs.append(encode_text(record["x"]))
                ys.append(encode_text(["".join(record["y"])]).reshape(-1))
            users.extend([user] * len(record["y"]))
    return records(users, xs, ys)


def records(users: list[str], xs: list[np.ndarray], ys: list[np.ndarray]) -> dict[str, np.ndarray]:
    names, client = np.unique(np.array(users, dtype=str), return_inverse=True) if users else (np.zeros(0, str), [])
    return {
        "x": np.concatenate(xs) if xs else np.zeros((0, 28, 28), np.uint8),
        "y": np.concatenate(ys) if ys else np.zeros(0, np.int64),
        "client": np.asarray(client, dtype=np.int64).reshape(-1),
        "client_names": names,
    }


_CODES = {ch: i for i, ch in enumerate(LEAF_LETTERS)}
_SPACE = _CODES[" "]


def encode_text(texts: list[str]) -> np.ndarray:
    """Equal-length strings -> ``len(texts) x length`` int64 indices into LEAF's alphabet."""
    rows = [[_CODES.get(c, _SPACE) for c in t] for t in texts]
    return np.asarray(rows, dtype=np.int64).reshape(len(rows), -1)


def femnist_class(hex_name: str) -> int:
    """NIST's class folder (ASCII code in hex) -> 0-9 digits, 10-35 upper case, 36-61 lower case."""
    code = int(hex_name, 16)
    if 0x30 <= code <= 0x39:
        return code - 0x30
    if 0x41 <= code <= 0x5A:
        return code - 0x41 + 10
    return code - 0x61 + 36


def read_nist(by_class: Path, by_write: Path) -> dict[str, np.ndarray]:
    """LEAF's FEMNIST preprocessing over the two NIST zips, read in place."""
    class_of: dict[str, int] = {}
    with zipfile.ZipFile(by_class) as zf:
        members = [n for n in zf.namelist() if n.lower().endswith(".png")]
        for n in progress(members, len(members), "by_class"):
            parts = PurePosixPath(n).parts  # by_class/<hex>/hsf_<k>/<image>.png
            if len(parts) >= 3 and "hsf" in parts[-2] and "mit" not in parts[-2]:
                class_of.setdefault(hashlib.md5(zf.read(n)).hexdigest(), femnist_class(parts[-3]))
    users: list[str] = []
    images: list[np.ndarray] = []
    labels: list[int] = []
    with zipfile.ZipFile(by_write) as zf:
        members = sorted(n for n in zf.namelist() if n.lower().endswith(".png"))
        for n in progress(members, len(members), "by_write"):
            parts = PurePosixPath(n).parts  # by_write/hsf_<k>/f<writer>_<nn>/<d|u|l><writer>_<nn>/<image>.png
            if len(parts) < 4 or len(parts[-3]) != 8 or len(parts[-2]) != 8:
                continue
            data = zf.read(n)
            label = class_of.get(hashlib.md5(data).hexdigest())
            if label is None:
                continue  # LEAF keeps only images whose hash is in by_class
            users.append(parts[-3])
            images.append(decode_thumbnail(data, 28))
            labels.append(label)
    if not images:
        raise DataUnavailable(f"{by_write}: no writer images matched {by_class} (not NIST SD19's zips?)")
    return records(users, [np.stack(images)], [np.asarray(labels, dtype=np.int64)])


_ROLE = re.compile(r"^  ([a-zA-Z][a-zA-Z ]*)\. (.*)")
_CONTINUED = re.compile(r"^    (.*)")
# The Comedy of Errors is not indented in this edition.
_ROLE_COE = re.compile(r"^([a-zA-Z][a-zA-Z ]*)\. (.*)")
_CONTINUED_COE = re.compile(r"^(.*)")


# LEAF's preprocess_shakespeare.py: "This marks the end of the plays in the file" (the poems follow)
LEAF_LAST_LINE = 124195


def split_plays(text: str, last_line: int = LEAF_LAST_LINE) -> list[tuple[str, dict[str, list[str]]]]:
    """(title, role -> lines) per play, following LEAF's ``preprocess_shakespeare.py`` rules: the file's
    first line is dropped, everything before the second "by William Shakespeare" (the contents and the
    sonnets) is skipped from five lines above it, and nothing after line ``last_line`` (counted after the
    first) is read."""
    lines = text.splitlines()[1:]
    authors = [i for i, line in enumerate(lines) if "by William Shakespeare" in line][:2]
    start = max(authors[1] - 5, 0) if len(authors) == 2 else 0
    plays: list[tuple[str, dict[str, list[str]]]] = []
    roles: dict[str, list[str]] | None = None
    current: str | None = None
    coe = False
    for i in range(start, min(len(lines), last_line + 1)):
        line = lines[i]
        if "by William Shakespeare" in line:
            title = next((lines[j].strip() for j in range(i - 2, max(i - 8, -1), -1) if lines[j].strip()), "")
            roles, current, coe = defaultdict(list), None, title == "THE COMEDY OF ERRORS"
            plays.append((title, roles))
            continue
        if roles is None:
            continue
        match = (_ROLE_COE if coe else _ROLE).match(line)
        if match:
            role = match.group(1).upper()
            if coe and role.startswith("ACT "):
                current = None
            else:
                roles[role].append(match.group(2))
                current = role
            continue
        if current is not None:
            match = (_CONTINUED_COE if coe else _CONTINUED).match(line)
            if match and coe and match.group(1).startswith("<"):
                current = None  # a stage direction ends the speech
            elif match:
                roles[current].append(match.group(1))
    return [(title, roles) for title, roles in plays if len(roles) > 1]


def shakespeare_records(text: str) -> dict[str, np.ndarray]:
    users: list[str] = []
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for title, roles in split_plays(text):
        for role, lines in roles.items():
            if len(lines) <= 2:
                continue  # LEAF skips roles with two lines or fewer
            # LEAF writes one line per speech line, then reads the file back with newlines as spaces
            raw = re.sub(r"   *", " ", "".join(f"{line}\n" for line in lines).replace("\n", " "))
            if len(raw) <= SEQ_LENGTH:
                continue
            codes = encode_text([raw])[0]
            windows = np.lib.stride_tricks.sliding_window_view(codes, SEQ_LENGTH + 1)
            xs.append(windows[:, :SEQ_LENGTH].copy())
            ys.append(windows[:, SEQ_LENGTH].copy())
            users.extend([re.sub(r"\W+", "_", f"{title}_{role}".replace(" ", "_"))] * len(windows))
    if not xs:
        raise DataUnavailable("no speaking roles found in the Shakespeare text (not Gutenberg's 1994 edition?)")
    return records(users, xs, ys)


def read_gutenberg(path: Path) -> dict[str, np.ndarray]:
    with zipfile.ZipFile(path) as zf:
        name = next((n for n in zf.namelist() if n.lower().endswith(".txt")), None)
        if name is None:
            raise DataUnavailable(f"{path}: no .txt member (not Gutenberg's 1994-01-100.zip); fetch it again")
        text = zf.read(name).decode("latin-1")
    return shakespeare_records(text)


# --- LEAF's sampling ---------------------------------------------------------------------------------
def sample_clients(client: np.ndarray, cfg: LeafConfig, name: str) -> np.ndarray:
    """Indices of the samples kept, client by client (seeded; the same for every experiment seed)."""
    counts = np.bincount(client) if client.size else np.zeros(0, np.int64)
    eligible = np.flatnonzero(counts >= cfg.min_samples)
    rng = numpy_rng(cfg.seed, purpose=f"leaf-sample/{name}")
    order = rng.permutation(eligible)
    if cfg.fraction < 1:  # LEAF's non-IID sampling: whole clients until the fraction of samples is reached
        target = cfg.fraction * counts[eligible].sum()
        reached = np.cumsum(counts[order])
        order = order[: int(np.searchsorted(reached, target)) + 1]
    if cfg.max_clients is not None:
        order = order[: cfg.max_clients]
    if not len(order):
        raise ValueError(f"dataset.min_samples: no {name} client has {cfg.min_samples} samples")
    keep = np.isin(client, order)
    return np.flatnonzero(keep)


def leaf_pool(
    name: str,
    cfg: LeafConfig,
    build_raw: Callable[[dict[str, Path]], Arrays],
    num_classes: int,
    class_names: list[str],
    records_version: int = 1,  # raised when the records built from the raw files change (a new cache entry)
) -> Pool:
    if cfg.leaf_dir is not None:
        arrays = read_leaf_json(cfg.leaf_dir, name)
        ref = None  # the user's own files: nothing of ours to key a partition cache on
    else:
        arrays, ref = cached_arrays(name, cfg, {"records": records_version}, build_raw)
    keep = sample_clients(arrays["client"], cfg, name)
    kept_ids, natural = np.unique(arrays["client"][keep], return_inverse=True)
    names = [str(n) for n in arrays["client_names"][kept_ids]]  # LEAF's writer / PLAY_ROLE names
    sampling = {"min_samples": cfg.min_samples, "fraction": cfg.fraction, "max_clients": cfg.max_clients}
    cache = None
    if ref is not None:  # partitions of this pool: keyed by the records and the sampling
        cache = PoolCacheRef(ref.cache, params_key({"pool": ref.pool_key, **sampling, "seed": cfg.seed}))
    x = arrays["x"][keep]
    x = unit_float(x[:, None]) if name == "femnist" else x.astype(np.int64)
    return Pool(
        x, arrays["y"][keep].astype(np.int64), num_classes, name, natural_id=natural.astype(np.int64),
        class_names=class_names, client_names=names, cache=cache,
    )  # fmt: skip


class FemnistConfig(LeafConfig):
    name: Literal["femnist"] = "femnist"


@DATASETS.register(
    "femnist", config=FemnistConfig, description="FEMNIST (LEAF), 62 classes, one client per writer (natural)"
)
def load_femnist(cfg: FemnistConfig) -> Pool:
    return leaf_pool(
        "femnist", cfg, lambda f: read_nist(f["by_class.zip"], f["by_write.zip"]), 62, list(FEMNIST_CLASSES)
    )


class ShakespeareConfig(LeafConfig):
    name: Literal["shakespeare"] = "shakespeare"

    def token_length(self) -> int | None:
        return SEQ_LENGTH


@DATASETS.register(
    "shakespeare",
    config=ShakespeareConfig,
    description="Shakespeare (LEAF), next character (80 symbols), one client per speaking role (natural)",
)
def load_shakespeare(cfg: ShakespeareConfig) -> Pool:
    names = [repr(c)[1:-1] for c in LEAF_LETTERS]
    # records version 2: LEAF's two rules (skip to the second "by William Shakespeare", stop after its last line)
    build = lambda f: read_gutenberg(f["1994-01-100.zip"])  # noqa: E731
    return leaf_pool("shakespeare", cfg, build, len(LEAF_LETTERS), names, records_version=2)
