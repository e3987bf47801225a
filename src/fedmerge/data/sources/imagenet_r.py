"""ImageNet-R (Hendrycks et al., ICCV 2021) read from its fetched tar (never extracted), split as LIVAR's
authors split it.

The LIVAR paper (Fiorini et al.) states only that every method is scored on "a global test set"
(Section 5.1). Its authors' code (aimagelab/fed-mammoth, ``datasets/seq_imagenetr.py``) reads ImageNet-R
through two fixed lists, ``imagenet-r_train.yaml`` and ``imagenet-r_test.yaml`` (24,000 and 6,000
images, each ``data:`` a list of ``data/imagenet-r/<wnid>/<file>`` paths and ``targets:`` their class
numbers), the lists aimagelab/mammoth keeps in ``datasets/imagenet_r_utils/``. `fedmerge data fetch
imagenet_r` fetches them with the tar; ``subset`` picks either list, and the class numbers are theirs.
With ``subset: all`` the test list's rows are marked as the publisher's test set, so that
``split.test_from: publisher`` scores the server model on them and partitions only the train list, as LIVAR does.
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path, PurePosixPath
from typing import Literal

import numpy as np
from pydantic import Field

from fedmerge.data.errors import DataUnavailable
from fedmerge.data.pool import DATASETS, Pool
from fedmerge.data.sources.fetched import FetchedConfig, cached_arrays, decode_image, progress, unit_float

SPLIT_FILES = {"train": "imagenet-r_train.yaml", "test": "imagenet-r_test.yaml"}
_WORDS = re.compile(r"^(n\d{8})\s+(.+)$")


class ImageNetRConfig(FetchedConfig):
    name: Literal["imagenet_r"] = "imagenet_r"
    subset: Literal["all", "train", "test"] = Field(
        "all", description="LIVAR's authors' split lists (24,000 train / 6,000 test), or both (all 30,000)"
    )
    image_size: int = Field(64, ge=8, le=512, description="side in pixels (renditions vary; resized, not cropped)")

    def marks_publisher_test(self) -> bool:
        return self.subset == "all"  # both lists loaded: the test list's rows are marked


def read_split(path: Path) -> list[tuple[str, int]]:
    """A split list -> ``(<wnid>/<file>, class number)`` in the list's order."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the 24,000-line list in a second
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)  # noqa: S506 (a safe loader)
        paths, targets = data["data"], data["targets"]
    except (yaml.YAMLError, KeyError, TypeError) as exc:
        raise DataUnavailable(f"{path}: not a split list with data: and targets: ({exc}); fetch it again") from None
    if len(paths) != len(targets):
        raise DataUnavailable(f"{path}: {len(paths)} paths but {len(targets)} targets; fetch it again")
    return [("/".join(PurePosixPath(p).parts[-2:]), int(t)) for p, t in zip(paths, targets, strict=True)]


def class_wnids(items: list[tuple[str, int]]) -> list[str]:
    """The wnid of each class number; a number given to two wnids means the lists are not LIVAR's."""
    wnid_of: dict[int, str] = {}
    for key, target in items:
        wnid = key.split("/")[0]
        if wnid_of.setdefault(target, wnid) != wnid:
            raise DataUnavailable(f"ImageNet-R split lists give class {target} to {wnid_of[target]} and {wnid}")
    count = max(wnid_of) + 1 if wnid_of else 0
    return [wnid_of.get(t, f"class_{t}") for t in range(count)]


def read_imagenet_r(files: dict[str, Path], subset: str, size: int) -> dict[str, np.ndarray]:
    """One pass over the tar: the images the chosen lists name, in the lists' order (train, then test)."""
    lists = {s: read_split(files[f]) for s, f in SPLIT_FILES.items()}
    items = [it for s in ("train", "test") if subset in ("all", s) for it in lists[s]]
    wnids = class_wnids(lists["train"] + lists["test"])
    wanted = {key for key, _ in items}
    images: dict[str, np.ndarray] = {}
    words: dict[str, str] = {}
    path = files["imagenet-r.tar"]
    try:
        with tarfile.open(path, "r:*") as tf:
            for member in progress(tf, None, "imagenet_r"):
                if not member.isfile():
                    continue
                key = "/".join(PurePosixPath(member.name).parts[-2:])
                if key in wanted:
                    images[key] = decode_image(tf.extractfile(member).read(), size)
                elif member.name.lower().endswith("readme.txt"):  # "<wnid> <name>" lines, where present
                    for line in tf.extractfile(member).read().decode(errors="replace").splitlines():
                        found = _WORDS.match(line.strip())
                        if found:
                            words[found.group(1)] = found.group(2).strip()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise DataUnavailable(f"{path}: unreadable archive ({exc}); delete it and fetch it again") from None
    missing = [key for key in wanted if key not in images]
    if missing:
        raise DataUnavailable(
            f"{path}: {len(missing)} image(s) of the split lists are not in the archive (first: {sorted(missing)[0]}); "
            "delete it and fetch it again"
        )
    x = [images[key] for key, _ in items]
    return {
        "x": np.stack(x) if x else np.zeros((0, 3, size, size), np.uint8),
        "y": np.array([t for _, t in items], dtype=np.int64),
        "test_list": np.array([s == "test" for s in ("train", "test") if subset in ("all", s) for _ in lists[s]]),
        "class_names": np.array([words.get(w, w) for w in wnids]),
    }


@DATASETS.register(
    "imagenet_r",
    config=ImageNetRConfig,
    description="ImageNet-R, 200 classes, LIVAR's authors' train/test lists (fedmerge data fetch imagenet_r)",
)
def load_imagenet_r(cfg: ImageNetRConfig) -> Pool:
    # "marks": arrays cached before they held test_list are not read
    params = {"subset": cfg.subset, "image_size": cfg.image_size, "marks": "test_list"}
    arrays, ref = cached_arrays("imagenet_r", cfg, params, lambda f: read_imagenet_r(f, cfg.subset, cfg.image_size))
    names = [str(n) for n in arrays["class_names"]]
    marked = arrays["test_list"].astype(bool) if cfg.subset == "all" else None
    return Pool(
        unit_float(arrays["x"]),
        arrays["y"],
        len(names),
        "imagenet_r",
        class_names=names,
        cache=ref,
        publisher_test=marked,
    )
