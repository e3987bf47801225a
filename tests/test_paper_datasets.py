"""The papers' datasets: tiny archives in each source's exact layout are served on loopback, fetched,
verified and loaded; the cache of arrays and partitions is keyed by every parameter and self-checking."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import tarfile
import zipfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from fetch_server import served_dataset

from fedmerge.data import DataUnavailable, NoiseConfig, SplitConfig, load_pool
from fedmerge.data.federated import federate
from fedmerge.data.sources.leaf import LEAF_LETTERS, split_plays


def png(value: int, size: tuple[int, int] = (8, 8), mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, (value,) * len(mode) if mode != "L" else value).save(buf, format="PNG")
    return buf.getvalue()


def jpeg(value: int, size: tuple[int, int] = (8, 8)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (value, value, value)).save(buf, format="JPEG", quality=100)
    return buf.getvalue()


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def tgz_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def fetch_and_load(tmp_path: Path, name: str, content: dict[str, bytes], **options: object):
    """Fetch through the loader (download=true) from the loopback server, then load again offline.

    The test's catalog entry stays in force for the rest of the test (its checksums key the cache)."""
    stack.enter_context(served_dataset(name, content))
    pool = load_pool({"name": name, "data_dir": str(tmp_path), "download": True, **options})
    assert sorted(p.name for p in (tmp_path / name).iterdir() if p.is_file()) == sorted(content)
    again = load_pool({"name": name, "data_dir": str(tmp_path), **options})  # offline, from the cache
    np.testing.assert_array_equal(pool.x, again.x)
    return pool


stack = ExitStack()


@pytest.fixture(autouse=True)
def _close_overrides():
    yield
    stack.close()


# --- CIFAR ------------------------------------------------------------------------------------------
def cifar_batch(n: int, key: bytes, classes: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return pickle.dumps(
        {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), key: rng.integers(0, classes, n).tolist()}
    )


def test_cifar10_from_the_fetched_archive(tmp_path: Path) -> None:
    members = {f"cifar-10-batches-py/data_batch_{i}": cifar_batch(2, b"labels", 10, i) for i in range(1, 6)}
    members["cifar-10-batches-py/test_batch"] = cifar_batch(3, b"labels", 10, 9)
    members["cifar-10-batches-py/batches.meta"] = pickle.dumps({b"label_names": [f"c{i}".encode() for i in range(10)]})
    pool = fetch_and_load(tmp_path, "cifar10", {"cifar-10-python.tar.gz": tgz_bytes(members)})
    assert pool.x.shape == (13, 3, 32, 32) and pool.x.dtype == np.float32 and pool.class_names[4] == "c4"
    first = pickle.loads(members["cifar-10-batches-py/data_batch_1"])
    np.testing.assert_allclose(pool.x[0].reshape(-1), first[b"data"][0] / 255.0, atol=1e-7)
    assert pool.y[:2].tolist() == first[b"labels"]


def test_cifar100_fine_and_coarse_from_the_archive(tmp_path: Path) -> None:
    members = {}
    for split, n in (("train", 5), ("test", 2)):
        batch = pickle.loads(cifar_batch(n, b"fine_labels", 100, n))
        batch[b"coarse_labels"] = [y // 5 for y in batch[b"fine_labels"]]
        members[f"cifar-100-python/{split}"] = pickle.dumps(batch)
    content = {"cifar-100-python.tar.gz": tgz_bytes(members)}
    fine = fetch_and_load(tmp_path, "cifar100", content)
    coarse = load_pool({"name": "cifar100", "data_dir": str(tmp_path), "labels": "coarse"})
    assert fine.num_classes == 100 and coarse.num_classes == 20 and (coarse.y == fine.y // 5).all()


# --- MNIST ------------------------------------------------------------------------------------------
def idx(array: np.ndarray) -> bytes:
    import gzip

    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes())


def test_mnist_full_and_its_subsets(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    train, test = rng.integers(0, 256, (6, 28, 28)), rng.integers(0, 256, (4, 28, 28))
    content = {
        "train-images-idx3-ubyte.gz": idx(train), "train-labels-idx1-ubyte.gz": idx(np.arange(6) % 10),
        "t10k-images-idx3-ubyte.gz": idx(test), "t10k-labels-idx1-ubyte.gz": idx(np.array([9, 8, 7, 6])),
    }  # fmt: skip
    pool = fetch_and_load(tmp_path, "mnist", content)
    assert pool.x.shape == (10, 1, 28, 28) and pool.y.tolist() == [0, 1, 2, 3, 4, 5, 9, 8, 7, 6]
    np.testing.assert_allclose(pool.x[6, 0], test[0] / 255.0, atol=1e-7)
    only_test = load_pool({"name": "mnist", "data_dir": str(tmp_path), "subset": "test"})
    assert only_test.y.tolist() == [9, 8, 7, 6]


# --- Tiny-ImageNet ----------------------------------------------------------------------------------
def test_tiny_imagenet_val_labels_come_from_val_annotations(tmp_path: Path) -> None:
    root = "tiny-imagenet-200/"
    wnids = ["n01", "n02", "n03"]
    members = {root + "wnids.txt": "\n".join(wnids).encode(), root + "words.txt": b"n01\tcat, feline\nn02\tdog\n"}
    for c, w in enumerate(wnids):
        for i in range(2):
            members[f"{root}train/{w}/images/{w}_{i}.JPEG"] = jpeg(40 * c + i)
        members[f"{root}train/{w}/{w}_boxes.txt"] = b""
    # val images listed out of class order; a naive loader would give them all class 0
    annotations = [("val_0.JPEG", "n03"), ("val_1.JPEG", "n01"), ("val_2.JPEG", "n02")]
    for file, w in annotations:
        members[f"{root}val/images/{file}"] = jpeg(200 + wnids.index(w))
    members[root + "val/val_annotations.txt"] = "".join(f"{f}\t{w}\t0\t0\t8\t8\n" for f, w in annotations).encode()
    members[root + "test/images/test_0.JPEG"] = jpeg(1)
    pool = fetch_and_load(tmp_path, "tiny_imagenet", {"tiny-imagenet-200.zip": zip_bytes(members)}, image_size=16)
    assert pool.x.shape == (9, 3, 16, 16)
    assert pool.num_classes == 3 and pool.class_names == ["cat", "dog", "n03"]  # words.txt, else the wnid
    assert pool.y.tolist() == [0, 0, 1, 1, 2, 2, 2, 0, 1]
    val = load_pool({"name": "tiny_imagenet", "data_dir": str(tmp_path), "subset": "val", "image_size": 16})
    assert val.y.tolist() == [2, 0, 1]
    np.testing.assert_allclose(val.x[:, 0, 0, 0] * 255, [202, 200, 201], atol=2)  # each image kept its label


# --- PACS -------------------------------------------------------------------------------------------
def pacs_zip() -> bytes:
    members = {}
    for d, domain in enumerate(["art_painting", "cartoon", "photo", "sketch"]):
        for c, cls in enumerate(["dog", "elephant", "giraffe", "guitar", "horse", "house", "person"][:3]):
            for i in range(2):
                members[f"kfold/{domain}/{cls}/pic_{i}.{'png' if d == 3 else 'jpg'}"] = png(10 * d + c)
    return zip_bytes(members)


def test_pacs_domains_are_groups_for_the_domain_partitioner(tmp_path: Path) -> None:
    pool = fetch_and_load(tmp_path, "pacs", {"PACS.zip": pacs_zip()}, image_size=8)
    assert pool.x.shape == (24, 3, 8, 8) and pool.num_classes == 7
    assert np.bincount(pool.domain).tolist() == [6, 6, 6, 6]
    np.testing.assert_allclose(pool.x[:, 0, 0, 0] * 255, 10 * pool.domain + pool.y, atol=0.5)
    fed = federate(pool, {"name": "domain", "num_clients": 4}, SplitConfig(), NoiseConfig(), seed=0)
    for client, group in zip(fed.clients, fed.groups(), strict=True):
        idx = np.round(client.x_train[:, 0, 0, 0].numpy() * 255).astype(int)
        assert set((idx - idx % 10) // 10) == {group}  # each client holds one domain only


# --- EuroSAT ----------------------------------------------------------------------------------------
def test_eurosat_standard_split_lists(tmp_path: Path) -> None:
    classes = ["AnnualCrop", "Forest", "River"]
    members = {f"2750/{c}/{c}_{i}.jpg": jpeg(50 * k + i, (64, 64)) for k, c in enumerate(classes) for i in (1, 2, 3)}
    content = {
        "EuroSAT.zip": zip_bytes(members),
        "eurosat-train.txt": b"AnnualCrop_1.jpg\nForest_1.jpg\nRiver_1.jpg\nRiver_2.jpg\n",
        "eurosat-val.txt": b"AnnualCrop_2.jpg\n",
        "eurosat-test.txt": b"AnnualCrop_3.jpg\nForest_3.jpg\n",
    }
    stack.enter_context(served_dataset("eurosat", content))
    pool = load_pool({"name": "eurosat", "data_dir": str(tmp_path), "download": True, "image_size": 64})
    assert pool.x.shape == (9, 3, 64, 64) and pool.class_names == classes
    # subset=all needs no split list: only the zip was fetched (torchvision's root/eurosat/EuroSAT.zip is enough)
    assert [p.name for p in (tmp_path / "eurosat").iterdir() if p.is_file()] == ["EuroSAT.zip"]
    test = load_pool({"name": "eurosat", "data_dir": str(tmp_path), "subset": "test", "download": True})
    assert test.y.tolist() == [0, 1]
    train = load_pool({"name": "eurosat", "data_dir": str(tmp_path), "subset": "train", "download": True})
    assert train.y.tolist() == [0, 1, 2, 2] and train.num_classes == 3


# --- CUB-200-2011 -----------------------------------------------------------------------------------
def test_cub200_official_split(tmp_path: Path) -> None:
    root = "CUB_200_2011/"
    files = {
        1: "001.Black_footed_Albatross/a.jpg",
        2: "001.Black_footed_Albatross/b.jpg",
        3: "200.Common_Yellowthroat/c.jpg",
    }
    members = {root + "images/" + p: jpeg(60 * i, (12, 10)) for i, p in files.items()}  # images first in the stream
    members[root + "images.txt"] = "".join(f"{i} {p}\n" for i, p in files.items()).encode()
    members[root + "image_class_labels.txt"] = b"1 1\n2 1\n3 200\n"
    members[root + "train_test_split.txt"] = b"1 1\n2 0\n3 1\n"
    members[root + "classes.txt"] = b"1 001.Black_footed_Albatross\n200 200.Common_Yellowthroat\n"
    pool = fetch_and_load(tmp_path, "cub200", {"CUB_200_2011.tgz": tgz_bytes(members)}, image_size=8)
    assert pool.x.shape == (3, 3, 8, 8) and pool.num_classes == 200 and pool.y.tolist() == [0, 0, 199]
    assert pool.class_names[0] == "Black_footed_Albatross" and pool.class_names[199] == "Common_Yellowthroat"
    train = load_pool({"name": "cub200", "data_dir": str(tmp_path), "subset": "train", "image_size": 8})
    test = load_pool({"name": "cub200", "data_dir": str(tmp_path), "subset": "test", "image_size": 8})
    assert train.y.tolist() == [0, 199] and test.y.tolist() == [0]
    np.testing.assert_allclose(test.x[0, 0] * 255, 120, atol=2)


# --- FEMNIST ----------------------------------------------------------------------------------------
def nist_zips() -> tuple[dict[str, bytes], dict[tuple[str, int], int]]:
    """by_class/by_write in NIST SD19's layout: 3 writers; labels only through matching image hashes."""
    by_class, by_write, truth = {}, {}, {}
    codes = {"30": 0, "41": 10, "61": 36}  # '0', 'A', 'a'
    for w in range(3):
        for k, (hexcode, label) in enumerate(codes.items()):
            for i in range(w + 2):  # writer w has 3 * (w + 2) images
                value = 7 * w + 3 * k + i * 60  # distinct images
                image = png(value, (128, 128), "L")
                by_class[f"by_class/{hexcode}/hsf_{w}/{hexcode}_{w}_{i}.png"] = image
                by_write[f"by_write/hsf_{w}/f{w:04d}_1{w}/{'dul'[k]}{w:04d}_1{w}/{k}_{i}.png"] = image
                truth[(f"f{w:04d}_1{w}", value)] = label
    by_class["by_class/30/train_30/x.png"] = png(255, (128, 128), "L")  # not hsf: LEAF ignores it
    return {"by_class.zip": zip_bytes(by_class), "by_write.zip": zip_bytes(by_write)}, truth


def test_femnist_natural_writers_from_nist(tmp_path: Path) -> None:
    content, truth = nist_zips()
    pool = fetch_and_load(tmp_path, "femnist", content)
    assert pool.x.shape == (27, 1, 28, 28) and pool.num_classes == 62
    assert np.bincount(pool.natural_id).tolist() == [6, 9, 12]
    for x, y, client in zip(pool.x, pool.y, pool.natural_id, strict=True):
        assert truth[(f"f{client:04d}_1{client}", round(float(x[0, 0, 0]) * 255))] == y
    fed = federate(pool, {"name": "natural"}, SplitConfig(), NoiseConfig(), seed=0)
    assert fed.num_clients == 3
    few = load_pool({"name": "femnist", "data_dir": str(tmp_path), "min_samples": 7})
    assert np.bincount(few.natural_id).tolist() == [9, 12]
    one = load_pool({"name": "femnist", "data_dir": str(tmp_path), "max_clients": 2, "seed": 3})
    assert len(np.unique(one.natural_id)) == 2


def test_femnist_from_leaf_json(tmp_path: Path) -> None:
    folder = tmp_path / "leaf" / "all_data"
    folder.mkdir(parents=True)
    data = {
        "users": ["w1", "w0"],
        "num_samples": [3, 4],
        "user_data": {
            "w1": {"x": [[0.5] * 784] * 3, "y": [1, 2, 3]},
            "w0": {"x": [[1.0] * 784] * 4, "y": [61, 0, 0, 0]},
        },
    }
    (folder / "all_data_0.json").write_text(json.dumps(data))
    pool = load_pool({"name": "femnist", "leaf_dir": str(tmp_path / "leaf")})
    assert pool.x.shape == (7, 1, 28, 28) and sorted(pool.y.tolist()) == [0, 0, 0, 1, 2, 3, 61]
    assert np.bincount(pool.natural_id).tolist() == [4, 3]  # w0, w1 in sorted order
    np.testing.assert_allclose(pool.x[pool.natural_id == 1], 128 / 255, atol=1e-6)


# --- Shakespeare ------------------------------------------------------------------------------------
PLAY = """
THE TRAGEDY OF TESTING

by William Shakespeare

ACT I. SCENE 1.

  HAMLET. To be, or not to be, that is the question whether tis nobler
    in the mind to suffer the slings and arrows of outrageous fortune,
  HORATIO. My lord, I came to see your father's funeral and more words.
  HAMLET. I pray thee, do not mock me, fellow-student; I think it was
    to see my mother's wedding. Thrift, thrift, Horatio, the funeral.
  HAMLET. A third speech so that Hamlet has more than two lines of text here.
  HORATIO. Indeed my lord, it followed hard upon the wedding of the queen.
  HORATIO. A third line for Horatio too, long enough for sequences of eighty.
  GHOST. Only once.
"""


def test_shakespeare_roles_are_clients_and_samples_are_next_characters(tmp_path: Path) -> None:
    plays = split_plays(PLAY)
    assert [t for t, _ in plays] == ["THE TRAGEDY OF TESTING"]
    roles = plays[0][1]
    assert len(roles["HAMLET"]) == 5 and roles["HAMLET"][1].startswith("in the mind")
    content = {"1994-01-100.zip": zip_bytes({"100.txt": PLAY.encode("latin-1")})}
    pool = fetch_and_load(tmp_path, "shakespeare", content)
    assert pool.x.dtype == np.int64 and pool.x.shape[1] == 80 and pool.num_classes == 80 == len(LEAF_LETTERS)
    assert len(np.unique(pool.natural_id)) == 2  # GHOST has one line: skipped, like LEAF
    text = "".join(LEAF_LETTERS[i] for i in pool.x[0]) + LEAF_LETTERS[pool.y[0]]
    hamlet = " ".join(roles["HAMLET"]) + " "
    horatio = " ".join(roles["HORATIO"]) + " "
    assert text == hamlet[:81]  # clients in name order: ..._HAMLET, then ..._HORATIO
    # one sample per position: 80 characters in, the next one out
    assert np.bincount(pool.natural_id).tolist() == [len(hamlet) - 80, len(horatio) - 80]
    last = pool.natural_id == 1
    assert "".join(LEAF_LETTERS[i] for i in pool.x[last][-1]) + LEAF_LETTERS[pool.y[last][-1]] == horatio[-81:]


# --- the cache: keyed, verified, rebuilt ------------------------------------------------------------
def cache_entries(tmp_path: Path, kind: str) -> list[Path]:
    return sorted(p for p in (tmp_path / "cache").glob(f"{kind}-*") if p.is_dir())


def test_a_changed_parameter_never_reuses_an_entry_and_a_damaged_one_is_rebuilt(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pool = fetch_and_load(tmp_path, "pacs", {"PACS.zip": pacs_zip()}, image_size=8)
    bigger = load_pool({"name": "pacs", "data_dir": str(tmp_path), "image_size": 12})
    assert bigger.x.shape[-1] == 12 and len(cache_entries(tmp_path, "pacs")) == 2
    photo = load_pool({"name": "pacs", "data_dir": str(tmp_path), "image_size": 8, "domains": ["photo"]})
    assert len(photo) == 6 and len(cache_entries(tmp_path, "pacs")) == 3

    # damage the first entry: refused (one warning), rebuilt from the archive, same arrays
    def params(entry: Path) -> dict:
        return json.loads((entry / "manifest.json").read_text())["params"]

    (entry,) = [
        e for e in cache_entries(tmp_path, "pacs") if params(e)["image_size"] == 8 and len(params(e)["domains"]) == 4
    ]
    x_file = entry / "x.npy"
    raw = bytearray(x_file.read_bytes())
    raw[-1] ^= 0xFF
    x_file.write_bytes(bytes(raw))
    again = load_pool({"name": "pacs", "data_dir": str(tmp_path), "image_size": 8})
    assert "is damaged" in capsys.readouterr().err
    np.testing.assert_array_equal(again.x, pool.x)
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["files"]["x"]["sha256"] == hashlib.sha256((entry / "x.npy").read_bytes()).hexdigest()


def test_partitions_are_cached_per_parameter_and_seed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pool = fetch_and_load(tmp_path, "pacs", {"PACS.zip": pacs_zip()}, image_size=8)

    def clients(pcfg: dict, seed: int) -> list[list[float]]:
        fed = federate(pool, pcfg, SplitConfig(), NoiseConfig(), seed=seed)
        return [sorted(np.concatenate([c.x_train, c.x_val, c.x_test])[:, 0, 0, 0].tolist()) for c in fed.clients]

    iid = {"name": "iid", "num_clients": 4}
    a = clients(iid, 0)
    assert len(cache_entries(tmp_path, "partition")) == 1
    assert clients(iid, 0) == a and len(cache_entries(tmp_path, "partition")) == 1  # reused
    b = clients(iid, 1)  # another seed: another entry, another partition
    assert len(cache_entries(tmp_path, "partition")) == 2 and b != a
    c = clients({"name": "iid", "num_clients": 3}, 0)
    assert len(cache_entries(tmp_path, "partition")) == 3 and len(c) == 3
    d = clients({"name": "dirichlet", "num_clients": 4, "alpha": 0.5, "min_samples": 3}, 0)
    e = clients({"name": "dirichlet", "num_clients": 4, "alpha": 5.0, "min_samples": 3}, 0)
    assert len(cache_entries(tmp_path, "partition")) == 5 and d != e
    # a damaged partition entry is refused and rebuilt to the same partition
    for entry in cache_entries(tmp_path, "partition"):
        (entry / "indices.npy").write_bytes(b"garbage")
    assert clients(iid, 0) == a
    assert "is damaged" in capsys.readouterr().err


def test_download_false_and_no_data_is_one_line_naming_the_fetch_command(tmp_path: Path) -> None:
    for name in (
        "cifar10",
        "cifar100",
        "mnist",
        "tiny_imagenet",
        "pacs",
        "eurosat",
        "cub200",
        "femnist",
        "shakespeare",
    ):
        with pytest.raises(DataUnavailable) as err:
            load_pool({"name": name, "data_dir": str(tmp_path)})
        assert "\n" not in str(err.value) and f"fedmerge data fetch {name}" in str(err.value)


def test_cifar_path_still_works_and_wins_over_the_cache(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(cifar_batch(2, b"labels", 10, 1))
    pool = load_pool({"name": "cifar10", "path": str(tmp_path)})
    assert pool.x.shape == (12, 3, 32, 32) and pool.cache is None
    # --data-dir at extracted batches (what it meant before the cache existed) still reads them
    same = load_pool({"name": "cifar10", "data_dir": str(folder)})
    np.testing.assert_array_equal(same.x, pool.x)
