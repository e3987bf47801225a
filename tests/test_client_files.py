"""fedmerge export-clients writes one self-contained file per client; a node reads back exactly its
own, bit for bit, and refuses a missing, damaged or foreign file, or files that disagree, in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.config.schema import load_config
from fedmerge.data import ClientData, FederatedDataset
from fedmerge.data.client_files import (
    FORMAT_VERSION,
    SPLITS,
    ClientFileError,
    check_consistent,
    export_clients,
    load_client_file,
    load_client_files,
)
from fedmerge.run.prepare import load_data

# cluster partition: clients carry a group; label noise: files carry y_train_clean too
OVERRIDES = [
    "partition.name=cluster",
    "partition.num_clients=4",
    "partition.num_groups=2",
    "noise.kind=symmetric",
    "noise.rate=0.2",
    "dataset.max_samples=600",
]
TENSORS = (*SPLITS, "y_train_clean")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, FederatedDataset]:
    out = tmp_path_factory.mktemp("export") / "clients"
    result = CliRunner().invoke(app, ["export-clients", *OVERRIDES, str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "wrote 4 client files" in result.output
    return out, load_data(load_config(None, OVERRIDES))


def one_line_error(path: Path) -> str:
    with pytest.raises(ClientFileError) as info:
        load_client_file(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    return message


def test_each_file_holds_exactly_its_clients_tensors_and_metadata(exported):
    out, data = exported
    files = sorted(out.iterdir())
    assert [f.name for f in files] == [f"client-{i:04d}.safetensors" for i in range(4)]
    for path, expected in zip(files, data.clients):
        client, meta = load_client_file(path)
        assert expected.y_train_clean is not None  # the noisy config really exercises the optional tensor
        for name in TENSORS:
            got, want = getattr(client, name), getattr(expected, name)
            assert got.dtype == want.dtype and torch.equal(got, want), (path.name, name)
        assert (client.cid, client.group) == (expected.cid, expected.group)
        assert meta.client_id == expected.cid and meta.group == expected.group
        assert (meta.num_clients, meta.num_classes, meta.input_shape) == (4, 10, (1, 8, 8))
        assert (meta.dataset, meta.input_dtype, meta.format_version) == ("digits", "float32", FORMAT_VERSION)
        assert meta.class_names == data.class_names
    assert {load_client_file(f)[1].group for f in files} == {0, 1}
    assert len({load_client_file(f)[1].source_digest for f in files}) == 1


def test_reassembled_files_equal_the_federated_dataset(exported):
    out, data = exported
    back = load_client_files(sorted(out.iterdir(), reverse=True))  # order of the paths does not matter
    assert (back.num_clients, back.num_classes, back.input_shape, back.name) == (4, 10, (1, 8, 8), "digits")
    assert back.summary() == data.summary()


def test_a_node_reads_its_file_without_any_dataset(exported, monkeypatch):
    def no_data(*_a, **_k):
        raise AssertionError("a node must not load a dataset")

    monkeypatch.setattr("fedmerge.data.federated.load_pool", no_data)
    monkeypatch.setattr("fedmerge.data.pool.load_pool", no_data)
    monkeypatch.setenv("HOME", "/nonexistent")
    client, _ = load_client_file(exported[0] / "client-0002.safetensors")
    assert client.cid == 2 and client.n_train > 0


def test_a_missing_truncated_or_altered_file_is_refused_in_one_line(exported, tmp_path):
    raw = (exported[0] / "client-0001.safetensors").read_bytes()
    assert "not found" in one_line_error(tmp_path / "absent.safetensors")
    for cut in (0, 4, 100, len(raw) // 2, len(raw) - 1):
        (tmp_path / "cut.safetensors").write_bytes(raw[:cut])
        assert "truncated or damaged" in one_line_error(tmp_path / "cut.safetensors"), cut
    header_len = int.from_bytes(raw[:8], "little")
    flipped = bytearray(raw)
    flipped[-5] ^= 0x01  # one bit of the last tensor's data: safetensors alone would not notice
    (tmp_path / "flip.safetensors").write_bytes(bytes(flipped))
    assert "checksum mismatch" in one_line_error(tmp_path / "flip.safetensors")
    header = raw[8 : 8 + header_len].decode()
    edited = header.replace('"num_classes":"10"', '"num_classes":"11"')  # same length: still valid JSON
    assert edited != header
    (tmp_path / "meta.safetensors").write_bytes(raw[:8] + edited.encode() + raw[8 + header_len :])
    assert "checksum mismatch" in one_line_error(tmp_path / "meta.safetensors")
    broken = bytearray(raw)
    broken[9] ^= 0xFF  # the header's JSON
    (tmp_path / "json.safetensors").write_bytes(bytes(broken))
    assert "truncated or damaged" in one_line_error(tmp_path / "json.safetensors")


def test_a_file_that_is_not_a_client_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "text.safetensors").write_text("x,y\n1,2\n" * 50)
    one_line_error(tmp_path / "text.safetensors")
    save_file({"w": torch.zeros(3)}, tmp_path / "model.safetensors")
    assert "not a fedmerge client file" in one_line_error(tmp_path / "model.safetensors")
    future = {"format": "fedmerge-client", "format_version": "9"}
    save_file({"w": torch.zeros(3)}, tmp_path / "v9.safetensors", metadata=future)
    assert "version 9" in one_line_error(tmp_path / "v9.safetensors")


def tiny_dataset(num_classes: int = 3, shape: tuple[int, ...] = (2,), cids: tuple[int, ...] = (0, 1)):
    def client(cid: int) -> ClientData:
        g = torch.Generator().manual_seed(cid)
        x = torch.randn((6, *shape), generator=g)
        y = torch.arange(6) % num_classes
        return ClientData(cid, x[:4], y[:4], x[4:5], y[4:5], x[5:], y[5:])

    return FederatedDataset([client(c) for c in cids], num_classes, shape, "tiny", None)


def metas_of(data: FederatedDataset, folder: Path, digest: str = "d") -> list:
    paths = export_clients(data, folder, source_digest=digest)
    return [load_client_file(p)[1] for p in paths]


def test_nodes_that_disagree_are_detected_and_named(tmp_path):
    base = metas_of(tiny_dataset(), tmp_path / "a")
    check_consistent(base)  # agreeing files pass
    other = {
        "number of classes": metas_of(tiny_dataset(num_classes=4), tmp_path / "b")[1:],
        "input shape": metas_of(tiny_dataset(shape=(3,)), tmp_path / "c")[1:],
        "source": metas_of(tiny_dataset(), tmp_path / "d", digest="other export")[1:],
        "number of clients": metas_of(tiny_dataset(cids=(0, 1, 2)), tmp_path / "e")[1:2],
    }
    for what, odd in other.items():
        with pytest.raises(ClientFileError, match=what) as info:
            check_consistent([base[0], *odd])
        assert "client 0" in str(info.value) and "client(s) 1" in str(info.value)
        assert "\n" not in str(info.value)
    with pytest.raises(ClientFileError, match="two files claim client id 1") as info:
        check_consistent([*base, replace(base[1], path=tmp_path / "copy.safetensors")])
    assert str(base[1].path) in str(info.value) and "copy.safetensors" in str(info.value)
    with pytest.raises(ClientFileError, match="disagree on the input shape"):
        load_client_files([base[0].path, other["input shape"][0].path])


def test_groups_and_class_names_round_trip(tmp_path):
    data = tiny_dataset()
    data = replace(data, clients=[replace(c, group=7) for c in data.clients], class_names=["a", "b", "c"])
    _, meta = load_client_file(export_clients(data, tmp_path / "o")[1])
    assert (meta.group, meta.class_names) == (7, ["a", "b", "c"])
    assert json.loads(json.dumps(meta.input_shape)) == [2]


def test_export_refuses_a_non_empty_folder_unless_forced_and_force_drops_stale_files(tmp_path):
    out = tmp_path / "o"
    export_clients(tiny_dataset(cids=(0, 1, 2)), out)
    with pytest.raises(ClientFileError, match="not empty.*--force"):
        export_clients(tiny_dataset(), out)
    export_clients(tiny_dataset(), out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["client-0000.safetensors", "client-0001.safetensors"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ClientFileError, match="not a folder"):
        export_clients(tiny_dataset(), tmp_path / "file")
    with pytest.raises(ClientFileError, match="cannot create the folder"):
        export_clients(tiny_dataset(), tmp_path / "file" / "sub")


def test_an_interrupted_export_leaves_only_whole_files(tmp_path, monkeypatch):
    import os

    real, calls = os.fsync, []

    def fail_on_second(fd):  # the disk fails while the second file is being written
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fail_on_second)
    with pytest.raises(ClientFileError, match="client-0001.safetensors: cannot write: No space left"):
        export_clients(tiny_dataset(cids=(0, 1, 2)), tmp_path / "o")
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["client-0000.safetensors"]  # no temporary file
    load_client_file(tmp_path / "o" / "client-0000.safetensors")


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "missing OUT_DIR"),
        (["rounds=1"], "missing OUT_DIR"),
        (["partition.alpha=-1", "OUT"], "alpha"),
        (["missing.yaml", "OUT"], "missing.yaml"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path, args, needle):
    args = [str(tmp_path / "o") if a == "OUT" else a for a in args]
    result = CliRunner().invoke(app, ["export-clients", *args])
    assert result.exit_code == 2 and needle in result.output, result.output
    assert result.output.strip().count("\n") == 0
    assert not (tmp_path / "o").exists()  # nothing written


def test_cli_refuses_a_non_empty_folder_before_building_the_data(tmp_path, monkeypatch):
    (tmp_path / "keep.txt").write_text("mine")
    monkeypatch.setattr("fedmerge.run.prepare.load_data", lambda cfg: pytest.fail("data was built"))
    result = CliRunner().invoke(app, ["export-clients", "partition.num_clients=2", str(tmp_path)])
    assert result.exit_code == 2 and "--force" in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
