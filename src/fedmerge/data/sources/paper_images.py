"""The papers' image datasets read from their fetched archives (never extracted): MNIST, Tiny-ImageNet-200,
PACS, EuroSAT RGB, CUB-200-2011. Decoded once into uint8 arrays in the cache (``fedmerge.data.cache``)."""

from __future__ import annotations

import tarfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Literal

import numpy as np
from pydantic import Field

from fedmerge.data.errors import DataUnavailable
from fedmerge.data.pool import DATASETS, Pool
from fedmerge.data.sources.fashion_mnist import read_idx
from fedmerge.data.sources.fetched import (
    FetchedConfig,
    FolderArchive,
    cached_arrays,
    cached_folder_arrays,
    decode_image,
    progress,
    unit_float,
)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def stack(images: list[np.ndarray], channels: int, size: int) -> np.ndarray:
    return np.stack(images) if images else np.zeros((0, channels, size, size), np.uint8)


def bad_archive(path: Path, what: str) -> DataUnavailable:
    return DataUnavailable(f"{path}: {what}; delete it and fetch it again")


# --- MNIST ------------------------------------------------------------------------------------------
class MnistConfig(FetchedConfig):
    name: Literal["mnist"] = "mnist"
    subset: Literal["all", "train", "test"] = Field("all", description="the 60,000 train, 10,000 test, or both")


@DATASETS.register("mnist", config=MnistConfig, description="MNIST, 70,000 28x28 (fedmerge data fetch mnist)")
def load_mnist(cfg: MnistConfig) -> Pool:
    def build(files: dict[str, Path]) -> dict[str, np.ndarray]:
        parts = [p for p in ("train", "t10k") if cfg.subset == "all" or p == cfg.subset.replace("test", "t10k")]
        x = np.concatenate([read_idx(files[f"{p}-images-idx3-ubyte.gz"]) for p in parts])[:, None]
        y = np.concatenate([read_idx(files[f"{p}-labels-idx1-ubyte.gz"]) for p in parts]).astype(np.int64)
        return {"x": x, "y": y}

    arrays, ref = cached_arrays("mnist", cfg, {"subset": cfg.subset}, build)
    return Pool(unit_float(arrays["x"]), arrays["y"], 10, "mnist", class_names=[str(i) for i in range(10)], cache=ref)


# --- Tiny-ImageNet-200 ------------------------------------------------------------------------------
class TinyImageNetConfig(FetchedConfig):
    name: Literal["tiny_imagenet"] = "tiny_imagenet"
    subset: Literal["all", "train", "val"] = Field(
        "all", description="the 100,000 train, the 10,000 labelled val images, or both (test has no labels)"
    )
    image_size: int = Field(64, ge=8, le=256, description="side in pixels (64 = as published)")


def read_tiny_imagenet(path: Path, subset: str, size: int) -> dict[str, np.ndarray]:
    """Labels: train from the folder's wnid, val from ``val_annotations.txt``; class order = ``wnids.txt``.
    ``path``: the zip, or the folder it extracts to (holding ``tiny-imagenet-200/``, or that folder itself)."""
    opened = FolderArchive(path) if path.is_dir() else zipfile.ZipFile(path)
    with opened as zf:
        names = zf.namelist()
        root = next((n[: -len("wnids.txt")] for n in names if n.endswith("wnids.txt")), None)
        if root is None:
            raise bad_archive(path, "no wnids.txt (not the tiny-imagenet-200.zip layout)")
        wnids = zf.read(root + "wnids.txt").decode().split()
        index = {w: i for i, w in enumerate(wnids)}
        items: list[tuple[str, int]] = []
        if subset in ("all", "train"):
            for n in names:
                parts = PurePosixPath(n[len(root) :]).parts
                if len(parts) == 4 and parts[0] == "train" and parts[2] == "images" and n.lower().endswith(".jpeg"):
                    items.append((n, index[parts[1]]))
        if subset in ("all", "val"):
            for line in zf.read(root + "val/val_annotations.txt").decode().splitlines():
                fields = line.split("\t")
                if len(fields) >= 2:
                    items.append((f"{root}val/images/{fields[0]}", index[fields[1]]))
        words = {}
        if root + "words.txt" in names:
            for line in zf.read(root + "words.txt").decode().splitlines():
                wnid, _, text = line.partition("\t")
                words[wnid] = text.split(",")[0].strip()
        images = [decode_image(zf.read(n), size) for n, _ in progress(items, len(items), "tiny_imagenet")]
    return {
        "x": stack(images, 3, size),
        "y": np.array([c for _, c in items], dtype=np.int64),
        "class_names": np.array([words.get(w, w) for w in wnids]),
    }


def extracted_tiny_imagenet(cfg: TinyImageNetConfig) -> Path | None:
    """An extracted ``tiny-imagenet-200/`` (at the data root or in ``tiny_imagenet/``) when no zip is there."""
    from fedmerge.data.catalog import CATALOG
    from fedmerge.data.download import resolve_data_dir

    entry = CATALOG.get("tiny_imagenet")
    if entry.locate(cfg.data_dir) or cfg.download:
        return None
    root = resolve_data_dir(cfg.data_dir)
    for folder in (root / "tiny-imagenet-200", root / entry.name / "tiny-imagenet-200"):
        if (folder / "wnids.txt").is_file():
            return folder
    return None


@DATASETS.register(
    "tiny_imagenet",
    config=TinyImageNetConfig,
    description="Tiny-ImageNet-200, 200 classes, val labels from val_annotations.txt",
)
def load_tiny_imagenet(cfg: TinyImageNetConfig) -> Pool:
    params = {"subset": cfg.subset, "image_size": cfg.image_size}
    extracted = extracted_tiny_imagenet(cfg)
    if extracted is not None:  # an extracted tiny-imagenet-200/ and no zip: read the folder (nothing to verify)
        arrays, ref = cached_folder_arrays(
            "tiny_imagenet", cfg, extracted, params,
            lambda: read_tiny_imagenet(extracted, cfg.subset, cfg.image_size),
            ["wnids.txt", "words.txt", "val/val_annotations.txt"],
        )  # fmt: skip
    else:
        arrays, ref = cached_arrays(
            "tiny_imagenet",
            cfg,
            params,
            lambda f: read_tiny_imagenet(f["tiny-imagenet-200.zip"], cfg.subset, cfg.image_size),
        )
    names = [str(n) for n in arrays["class_names"]]
    return Pool(unit_float(arrays["x"]), arrays["y"], len(names), "tiny_imagenet", class_names=names, cache=ref)


# --- PACS -------------------------------------------------------------------------------------------
PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")
PACS_CLASSES = ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person")


class PacsConfig(FetchedConfig):
    name: Literal["pacs"] = "pacs"
    domains: tuple[Literal["art_painting", "cartoon", "photo", "sketch"], ...] = Field(
        PACS_DOMAINS, min_length=1, description="domains to load, in this order (domain id = position)"
    )
    image_size: int = Field(64, ge=8, le=256, description="side in pixels (published at 227)")


def read_pacs(path: Path, domains: tuple[str, ...], size: int) -> dict[str, np.ndarray]:
    """``.../<domain>/<class>/<image>`` members; domain and class come from the folder names."""
    with zipfile.ZipFile(path) as zf:
        items = []
        for n in sorted(zf.namelist()):
            parts = PurePosixPath(n).parts
            if len(parts) >= 3 and parts[-3] in domains and parts[-2] in PACS_CLASSES:
                if n.lower().endswith(IMAGE_SUFFIXES):
                    items.append((n, domains.index(parts[-3]), PACS_CLASSES.index(parts[-2])))
        if not items:
            raise bad_archive(path, "no <domain>/<class>/<image> members (not DomainBed's PACS.zip)")
        images = [decode_image(zf.read(n), size) for n, _, _ in progress(items, len(items), "pacs")]
    return {
        "x": stack(images, 3, size),
        "y": np.array([c for _, _, c in items], dtype=np.int64),
        "domain": np.array([d for _, d, _ in items], dtype=np.int64),
    }


@DATASETS.register(
    "pacs", config=PacsConfig, description="PACS, 7 classes in 4 domains (domain = group for partition.name=domain)"
)
def load_pacs(cfg: PacsConfig) -> Pool:
    params = {"domains": list(cfg.domains), "image_size": cfg.image_size}
    arrays, ref = cached_arrays("pacs", cfg, params, lambda f: read_pacs(f["PACS.zip"], cfg.domains, cfg.image_size))
    return Pool(
        unit_float(arrays["x"]), arrays["y"], len(PACS_CLASSES), "pacs", domain=arrays["domain"],
        class_names=list(PACS_CLASSES), cache=ref,
    )  # fmt: skip


# --- EuroSAT RGB ------------------------------------------------------------------------------------
class EuroSatConfig(FetchedConfig):
    name: Literal["eurosat"] = "eurosat"
    subset: Literal["all", "train", "val", "test"] = Field(
        "all", description="the standard split's lists (16,200 / 5,400 / 5,400), or all 27,000"
    )
    image_size: int = Field(64, ge=8, le=256, description="side in pixels (64 = as published)")


def read_eurosat(files: dict[str, Path], subset: str, size: int) -> dict[str, np.ndarray]:
    path = files["EuroSAT.zip"]
    keep = None
    if subset != "all":
        keep = {line.strip() for line in files[f"eurosat-{subset}.txt"].read_text().splitlines() if line.strip()}
    with zipfile.ZipFile(path) as zf:
        members = [
            n for n in sorted(zf.namelist())
            if n.lower().endswith(IMAGE_SUFFIXES) and len(PurePosixPath(n).parts) >= 2
        ]  # fmt: skip
        classes = sorted({PurePosixPath(n).parts[-2] for n in members})
        if not classes:
            raise bad_archive(path, "no <class>/<image> members (not the EuroSAT RGB zip)")
        chosen = [n for n in members if keep is None or PurePosixPath(n).name in keep]
        images = [decode_image(zf.read(n), size) for n in progress(chosen, len(chosen), "eurosat")]
    return {
        "x": stack(images, 3, size),
        "y": np.array([classes.index(PurePosixPath(n).parts[-2]) for n in chosen], dtype=np.int64),
        "class_names": np.array(classes),
    }


@DATASETS.register(
    "eurosat", config=EuroSatConfig, description="EuroSAT RGB, 27,000 64x64, 10 classes, standard split lists"
)
def load_eurosat(cfg: EuroSatConfig) -> Pool:
    params = {"subset": cfg.subset, "image_size": cfg.image_size}
    needed = ["EuroSAT.zip"] + ([] if cfg.subset == "all" else [f"eurosat-{cfg.subset}.txt"])  # all: no lists
    arrays, ref = cached_arrays(
        "eurosat", cfg, params, lambda f: read_eurosat(f, cfg.subset, cfg.image_size), needed=needed
    )
    names = [str(n) for n in arrays["class_names"]]
    return Pool(unit_float(arrays["x"]), arrays["y"], len(names), "eurosat", class_names=names, cache=ref)


# --- CUB-200-2011 -----------------------------------------------------------------------------------
class Cub200Config(FetchedConfig):
    name: Literal["cub200"] = "cub200"
    subset: Literal["all", "train", "test"] = Field(
        "all", description="the official split (train_test_split.txt: 5,994 / 5,794), or both"
    )
    image_size: int = Field(64, ge=8, le=512, description="side in pixels (photos vary; resized, not cropped)")


def read_cub(path: Path, subset: str, size: int) -> dict[str, np.ndarray]:
    """One pass over the .tgz (a stream): text tables and images are picked up in any order."""
    tables: dict[str, str] = {}
    images: dict[str, np.ndarray] = {}
    try:
        with tarfile.open(path, "r:gz") as tf:
            for member in progress(tf, None, "cub200"):
                parts = PurePosixPath(member.name).parts
                if not member.isfile() or not parts or parts[0] != "CUB_200_2011":
                    continue
                rel = "/".join(parts[1:])
                if rel in ("images.txt", "image_class_labels.txt", "train_test_split.txt", "classes.txt"):
                    tables[rel] = tf.extractfile(member).read().decode()
                elif rel.startswith("images/") and rel.lower().endswith(IMAGE_SUFFIXES):
                    images[rel[len("images/") :]] = decode_image(tf.extractfile(member).read(), size)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise bad_archive(path, f"unreadable archive ({exc})") from None
    missing = {"images.txt", "image_class_labels.txt", "train_test_split.txt"} - set(tables)
    if missing:
        raise bad_archive(path, f"missing {sorted(missing)} (not CUB_200_2011.tgz)")

    def table(name: str) -> dict[str, str]:
        return dict(line.split(" ", 1) for line in tables[name].splitlines() if line.strip())

    files, labels, is_train = table("images.txt"), table("image_class_labels.txt"), table("train_test_split.txt")
    ids = [i for i in sorted(files, key=int) if subset == "all" or (is_train[i].strip() == "1") == (subset == "train")]
    classes = table("classes.txt") if "classes.txt" in tables else {}
    names = [classes.get(str(c), str(c)).split(".", 1)[-1] for c in range(1, 201)]
    return {
        "x": stack([images[files[i].strip()] for i in ids], 3, size),
        "y": np.array([int(labels[i]) - 1 for i in ids], dtype=np.int64),
        "class_names": np.array(names),
    }


@DATASETS.register(
    "cub200", config=Cub200Config, description="CUB-200-2011, 200 bird species, official train/test split"
)
def load_cub200(cfg: Cub200Config) -> Pool:
    params = {"subset": cfg.subset, "image_size": cfg.image_size}
    arrays, ref = cached_arrays(
        "cub200", cfg, params, lambda f: read_cub(f["CUB_200_2011.tgz"], cfg.subset, cfg.image_size)
    )
    names = [str(n) for n in arrays["class_names"]]
    return Pool(unit_float(arrays["x"]), arrays["y"], 200, "cub200", class_names=names, cache=ref)
