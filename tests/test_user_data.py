"""The user's own data: non-finite values and header mistakes are refused in one line, CSVs without
a header are read with header=false, and standardization uses training samples only."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.data import DATASETS, NoiseConfig, SplitConfig, build_federated_dataset, load_pool
from fedmerge.data.pool import standardize


def write_csv(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(rows) + "\n")
    return path


def tabular(n: int = 120, f: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(3.0, 2.0, (n, f))
    return x, (x[:, 0] > 3.0).astype(np.int64)


# --- non-finite values ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_x, count",
    [
        (lambda x: np.where(np.arange(x.size).reshape(x.shape) % 50 == 7, np.nan, x), 8),  # NaN
        (lambda x: np.where(np.arange(x.size).reshape(x.shape) == 4, -np.inf, x), 1),  # -Inf
        (lambda x: np.where(np.arange(x.size).reshape(x.shape) < 3, 1e39, x), 3),  # overflows float32
    ],
    ids=["nan", "inf", "float32-overflow"],
)
def test_npz_with_non_finite_x_is_refused_naming_file_and_count(tmp_path, make_x, count):
    x, y = tabular()
    path = tmp_path / "bad.npz"
    np.savez(path, x=make_x(x), y=y)
    with pytest.raises(ValueError) as err:
        load_pool({"name": "npz", "path": str(path)})
    message = str(err.value)
    assert message.startswith(f"{path}: x: {count} non-finite value(s)") and "\n" not in message


def test_npz_images_and_labels_are_checked_too(tmp_path):
    images = np.random.default_rng(0).random((10, 4, 4)).astype(np.float32)
    images[3, 1, 1] = np.inf
    np.savez(tmp_path / "img.npz", x=images, y=np.arange(10) % 2)
    with pytest.raises(ValueError, match=r"img.npz: x: 1 non-finite value\(s\) .* the first in row 3"):
        load_pool({"name": "npz", "path": str(tmp_path / "img.npz")})
    np.savez(tmp_path / "y.npz", x=np.ones((4, 2)), y=np.array([0.0, 1.0, np.nan, 1.0]))
    with pytest.raises(ValueError, match=r"y.npz: y: 1 non-finite"):
        load_pool({"name": "npz", "path": str(tmp_path / "y.npz")})


def test_every_loader_is_checked_by_load_pool(monkeypatch):
    entry = DATASETS.get("digits")

    def digits_with_nan(cfg):
        pool = entry.obj(cfg)
        pool.x[5, 0, 2, 2] = np.nan
        return pool

    monkeypatch.setitem(DATASETS._entries, "digits", dataclasses.replace(entry, obj=digits_with_nan))
    with pytest.raises(ValueError, match=r"dataset 'digits': 1 non-finite value\(s\).* the first in row 5"):
        load_pool({"name": "digits"})


def test_cli_refuses_non_finite_data_before_writing_anything(tmp_path):
    x, y = tabular()
    x[10, 1] = np.nan
    np.savez(tmp_path / "d.npz", x=x, y=y)
    out = tmp_path / "runs"
    result = CliRunner().invoke(
        app, ["run", f"dataset.path={tmp_path / 'd.npz'}", f"output_dir={out}", "--no-progress"]
    )
    assert result.exit_code == 2
    assert "d.npz: x: 1 non-finite value(s)" in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_csv_non_finite_and_empty_fields_are_counted(tmp_path):
    path = write_csv(tmp_path / "t.csv", ["a,b,label", "1,inf,x", "2,,y", "nan,4,x", "5,6,y"])
    with pytest.raises(ValueError, match=r"t.csv: features: 3 non-finite value\(s\) .*empty fields count too"):
        load_pool({"name": "csv", "path": str(path)})


# --- CSV headers ----------------------------------------------------------------------------------


def test_a_first_row_of_numbers_is_refused_with_what_to_do(tmp_path):
    path = write_csv(tmp_path / "t.csv", ["0.5,1.5,2.5,1", "1,2,3,0", "4,5,6,1"])
    # what the user tried: name a value of the first row as the label column
    with pytest.raises(ValueError) as err:
        load_pool({"name": "csv", "path": str(path), "label_column": "1"})
    message = str(err.value)
    assert "the first row looks like data, not a header" in message
    assert "dataset.header=false" in message and "dataset.label_column=3" in message
    with pytest.raises(ValueError, match="looks like data"):  # the default label column too
        load_pool({"name": "csv", "path": str(path)})


def test_repeated_names_are_refused(tmp_path):
    path = write_csv(tmp_path / "t.csv", ["1,0,1,0,y", "1,2,3,4,0", "5,6,7,8,1"])
    with pytest.raises(ValueError, match=r"duplicate column names \['0', '1'\].*dataset.header=false"):
        load_pool({"name": "csv", "path": str(path), "label_column": "y"})
    path = write_csv(tmp_path / "named.csv", ["age,age,label", "1,2,a", "3,4,b"])
    with pytest.raises(ValueError, match=r"duplicate column names \['age'\]"):
        load_pool({"name": "csv", "path": str(path), "header": True})


@pytest.mark.parametrize("label", [4, -1, "col4"])
def test_header_false_names_columns_and_takes_the_label_by_index_or_name(tmp_path, label):
    rows = [f"{i},{i % 3},{2 * i},{i * i},{'ab'[i % 2]}" for i in range(10)]
    path = write_csv(tmp_path / "t.csv", rows)
    pool = load_pool({"name": "csv", "path": str(path), "header": False, "label_column": label, "client_column": 1})
    assert len(pool) == 10  # the first row is data
    np.testing.assert_array_equal(pool.x, [[i, 2 * i, i * i] for i in range(10)])
    assert pool.class_names == ["a", "b"] and pool.y.tolist() == [i % 2 for i in range(10)]
    assert pool.natural_id.tolist() == [i % 3 for i in range(10)]


def test_header_true_accepts_numeric_names(tmp_path):
    path = write_csv(tmp_path / "t.csv", ["0,1,label", "1,2,a", "3,4,b"])
    pool = load_pool({"name": "csv", "path": str(path), "header": True})
    assert pool.x.tolist() == [[1, 2], [3, 4]]


def test_csv_shape_errors_are_one_line(tmp_path):
    path = write_csv(tmp_path / "t.csv", ["a,b,label", "1,2,x", "1,2,3,y"])
    with pytest.raises(ValueError, match=r"t.csv: cannot parse it as CSV \(.*"):
        load_pool({"name": "csv", "path": str(path)})
    with pytest.raises(ValueError, match="label column index 7 is out of range"):
        load_pool({"name": "csv", "path": str(path), "label_column": 7})
    path = write_csv(tmp_path / "e.csv", ["a,b,label", "1,2,"])
    with pytest.raises(ValueError, match="column 'label' has 1 empty value"):
        load_pool({"name": "csv", "path": str(path)})


def test_csv_reads_quoted_labels_and_other_delimiters(tmp_path):
    path = write_csv(tmp_path / "t.tsv", ["f1;f2;kind", '1.5;2;"big, red"', "3;-4e2;small"])
    pool = load_pool({"name": "csv", "path": str(path), "delimiter": ";", "label_column": "kind"})
    assert pool.class_names == ["big, red", "small"] and pool.x.tolist() == [[1.5, 2.0], [3.0, -400.0]]


def test_csv_with_a_byte_order_mark_reads_its_first_column(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte-order mark; it is not part of the first name or value."""
    path = tmp_path / "bom.csv"
    path.write_bytes("\ufefflabel,a,b\nx,1,2\ny,3,4\n".encode())
    pool = load_pool({"name": "csv", "path": str(path), "label_column": "label"})
    assert pool.class_names == ["x", "y"] and pool.x.tolist() == [[1, 2], [3, 4]]
    path.write_bytes("\ufeff7,1,2\n8,3,4\n".encode())
    pool = load_pool({"name": "csv", "path": str(path), "header": False, "label_column": 0})
    assert pool.class_names == ["7", "8"] and pool.x.tolist() == [[1, 2], [3, 4]]


def test_csv_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("a,b,label\n1,2,caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.csv: not UTF-8 text \(byte 17 is not UTF-8\); save the CSV as UTF-8"):
        load_pool({"name": "csv", "path": str(path)})
    path.write_bytes(b"a,b,label\n" + b"1,2,0\n" * 5000 + b"1,2,caf\xe9\n")  # past csv's first read
    with pytest.raises(ValueError, match=r"latin1.csv: not UTF-8 text; save the CSV as UTF-8"):
        load_pool({"name": "csv", "path": str(path)})


def test_a_file_with_another_delimiter_is_named_and_a_shell_tab_is_accepted(tmp_path):
    path = write_csv(tmp_path / "t.csv", ["a\tb\tlabel", "1\t2\tx", "3\t4\ty"])
    with pytest.raises(ValueError, match=r"if the columns are separated by '\\t', set dataset.delimiter='\\t'"):
        load_pool({"name": "csv", "path": str(path)})
    pool = load_pool({"name": "csv", "path": str(path), "delimiter": "\\t"})  # as a shell passes '\t'
    assert pool.class_names == ["x", "y"] and pool.x.tolist() == [[1, 2], [3, 4]]


# --- standardization ------------------------------------------------------------------------------


def federated(path: Path, **dataset) -> object:
    return build_federated_dataset(
        {"name": "npz", "path": str(path), **dataset},
        {"name": "iid", "num_clients": 3},
        SplitConfig(val_fraction=0.1, test_fraction=0.3),
        NoiseConfig(),
        seed=0,
    )


def test_standardization_uses_training_samples_only(tmp_path):
    x, y = tabular(n=150, f=4)
    x[:, 2] = 7.0  # constant: centred only
    np.savez(tmp_path / "d.npz", x=x, y=y)
    data = federated(tmp_path / "d.npz")
    train = torch.cat([c.x_train for c in data.clients]).double()
    held_out = torch.cat([torch.cat([c.x_val, c.x_test]) for c in data.clients]).double()
    np.testing.assert_allclose(train.mean(0), 0, atol=1e-6)
    np.testing.assert_allclose(train.std(0, unbiased=False)[[0, 1, 3]], 1, atol=1e-5)
    assert torch.all(train[:, 2] == 0) and torch.all(held_out[:, 2] == 0)
    assert held_out[:, [0, 1, 3]].mean(0).abs().max() > 1e-3  # held-out rows did not shape the statistics
    # with the whole pool's statistics the training rows would not have mean 0 and std 1 exactly


def test_standardize_by_hand():
    x = np.array([[0.0, 5.0], [2.0, 5.0], [4.0, 5.0], [100.0, 9.0]])
    out = standardize(x, np.array([0, 1, 2]))  # rows 0..2 are the training rows: mean 2, std sqrt(8/3)
    np.testing.assert_allclose(out[:, 0], np.array([-2, 0, 2, 98]) / np.sqrt(8 / 3), rtol=1e-6)
    np.testing.assert_allclose(out[:, 1], [0, 0, 0, 4])  # constant on the training rows: centred only


def test_standardize_false_keeps_raw_values_and_images_are_never_standardized(tmp_path):
    x, y = tabular(n=60)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    data = federated(tmp_path / "d.npz", standardize=False)
    got = torch.cat([torch.cat([c.x_train, c.x_val, c.x_test]) for c in data.clients])
    expected = torch.from_numpy(x.astype(np.float32))
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, expected.tolist()))
    images = np.random.default_rng(0).integers(0, 256, (60, 4, 4), dtype=np.uint8)
    np.savez(tmp_path / "img.npz", x=images, y=np.arange(60) % 2)
    pool = load_pool({"name": "npz", "path": str(tmp_path / "img.npz")})
    assert not pool.standardize and pool.x.max() <= 1.0
