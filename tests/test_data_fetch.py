"""Verified, resumable, atomic downloads against a loopback server; the `fedmerge data` commands."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from fetch_server import serve, served_dataset, sha256
from typer.testing import CliRunner

from fedmerge.cli.data import data_app as app
from fedmerge.data import DataUnavailable
from fedmerge.data.catalog import CATALOG, check_dataset, dataset_files, fetch_dataset
from fedmerge.data.download import DownloadError, RemoteFile, default_data_dir, fetch_file, verify_file

PAYLOAD = bytes(range(256)) * 1600  # 400 KB: several 64 KiB chunks


def remote(base: str, data: bytes = PAYLOAD, checksum: str | None = None, name: str = "a.bin") -> RemoteFile:
    return RemoteFile(name, (f"{base}/{name}",), checksum or sha256(data))


def only_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_fetch_verifies_and_caches(tmp_path: Path) -> None:
    with serve({"a.bin": PAYLOAD}) as (base, files):
        path = fetch_file(remote(base), tmp_path, progressbar=False)
        assert path.read_bytes() == PAYLOAD
        fetch_file(remote(base), tmp_path, progressbar=False)  # verified copy present: no request
    assert len(files.requests) == 1
    assert only_files(tmp_path) == ["a.bin"]


def test_md5_checksums_work_too(tmp_path: Path) -> None:
    import hashlib

    with serve({"a.bin": PAYLOAD}) as (base, _):
        fetch_file(remote(base, checksum="md5:" + hashlib.md5(PAYLOAD).hexdigest()), tmp_path, progressbar=False)
    assert (tmp_path / "a.bin").read_bytes() == PAYLOAD


def test_interrupted_download_resumes_with_range(tmp_path: Path) -> None:
    with serve({"a.bin": PAYLOAD}) as (base, files):
        files.cut_after["a.bin"] = 300_000
        with pytest.raises(DownloadError, match=r"bytes kept, run again to resume") as err:
            fetch_file(remote(base), tmp_path, progressbar=False)
        assert "\n" not in str(err.value)
        assert not (tmp_path / "a.bin").exists()  # nothing half-written at the file's name
        kept = (tmp_path / ".partial" / "a.bin.part").stat().st_size
        assert 0 < kept <= 300_000 and f"{kept:,} bytes kept" in str(err.value)
        assert (tmp_path / ".partial" / "a.bin.part").read_bytes() == PAYLOAD[:kept]
        fetch_file(remote(base), tmp_path, progressbar=False)
    assert files.requests[-1] == ("a.bin", f"bytes={kept}-")  # only the rest was asked for
    assert (tmp_path / "a.bin").read_bytes() == PAYLOAD
    assert only_files(tmp_path) == ["a.bin"]


def test_a_resume_answered_with_the_whole_file_replaces_the_partial_bytes(tmp_path: Path) -> None:
    """A server without range support answers the Range request with status 200 and every byte: those bytes
    are the file, so they must replace the kept part, not follow it."""
    with serve({"a.bin": PAYLOAD}) as (base, files):
        files.cut_after["a.bin"] = 300_000
        with pytest.raises(DownloadError, match=r"bytes kept"):
            fetch_file(remote(base), tmp_path, progressbar=False)
        kept = (tmp_path / ".partial" / "a.bin.part").stat().st_size
        assert kept > 0
        files.ignore_range.add("a.bin")
        fetch_file(remote(base), tmp_path, progressbar=False)
    assert files.requests[-1] == ("a.bin", f"bytes={kept}-")  # a resume was asked for, the whole file came
    assert (tmp_path / "a.bin").read_bytes() == PAYLOAD
    assert only_files(tmp_path) == ["a.bin"]


def test_checksum_mismatch_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    wrong = "sha256:" + "0" * 64
    with serve({"a.bin": PAYLOAD}) as (base, _):
        with pytest.raises(DownloadError) as err:
            fetch_file(remote(base, checksum=wrong), tmp_path, progressbar=False)
    message = str(err.value)
    assert "\n" not in message
    assert f"{base}/a.bin" in message and "checksum mismatch for a.bin" in message and wrong in message
    assert f"place it at {tmp_path / 'a.bin'}" in message
    assert sha256(PAYLOAD).removeprefix("sha256:") in message  # what was received
    assert only_files(tmp_path) == []


def test_truncated_archive_is_refused(tmp_path: Path) -> None:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        info = tarfile.TarInfo("x/data")
        info.size = len(PAYLOAD)
        tf.addfile(info, io.BytesIO(PAYLOAD))
    archive = buf.getvalue()
    with serve({"a.tar.gz": archive[: len(archive) // 2]}) as (base, _):  # the server holds a truncated copy
        with pytest.raises(DownloadError, match=r"checksum mismatch for a\.tar\.gz .*truncated or altered"):
            fetch_file(remote(base, archive, name="a.tar.gz"), tmp_path, progressbar=False)
    assert only_files(tmp_path) == []


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_failure_names_url_file_checksum_and_manual_step(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}/a.bin"
    with pytest.raises(DownloadError) as err:
        fetch_file(RemoteFile("a.bin", (url,), sha256(PAYLOAD)), tmp_path, progressbar=False)
    message = str(err.value)
    assert "\n" not in message
    assert url in message and "a.bin" in message and sha256(PAYLOAD) in message
    assert f"place it at {tmp_path / 'a.bin'}" in message
    assert only_files(tmp_path) == []


def test_mirrors_are_tried_in_order(tmp_path: Path) -> None:
    with serve({"a.bin": PAYLOAD}) as (base, files):
        r = RemoteFile("a.bin", (f"{base}/gone/a.bin", f"{base}/a.bin"), sha256(PAYLOAD))
        fetch_file(r, tmp_path, progressbar=False)
    assert [p for p, _ in files.requests] == ["gone/a.bin", "a.bin"]


def test_an_altered_cached_file_is_downloaded_again(tmp_path: Path) -> None:
    with serve({"a.bin": PAYLOAD}) as (base, files):
        fetch_file(remote(base), tmp_path, progressbar=False)
        (tmp_path / "a.bin").write_bytes(b"altered")
        assert not verify_file(remote(base), tmp_path)
        fetch_file(remote(base), tmp_path, progressbar=False)
    assert len(files.requests) == 2 and (tmp_path / "a.bin").read_bytes() == PAYLOAD


def test_unpublished_checksum_is_pinned_at_first_download(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with serve({"a.bin": PAYLOAD}) as (base, _):
        r = RemoteFile("a.bin", (f"{base}/a.bin",), None)
        fetch_file(r, tmp_path, progressbar=False)
    assert "no published checksum exists; pinned " + sha256(PAYLOAD) in capsys.readouterr().err
    assert verify_file(r, tmp_path)
    (tmp_path / "a.bin").write_bytes(PAYLOAD[:-1])
    assert not verify_file(r, tmp_path)


def test_data_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FEDMERGE_DATA_DIR", str(tmp_path / "d"))
    assert default_data_dir() == tmp_path / "d"
    monkeypatch.delenv("FEDMERGE_DATA_DIR")
    assert default_data_dir() == Path.home() / ".cache" / "fedmerge" / "data"


def test_missing_data_without_download_names_the_fetch_command(tmp_path: Path) -> None:
    with pytest.raises(DataUnavailable) as err:
        dataset_files("cifar10", tmp_path, download=False)
    assert "\n" not in str(err.value)
    assert f"fedmerge data fetch cifar10 --dir {tmp_path}" in str(err.value)


UNPUBLISHED = {("pacs", "PACS.zip"), ("imagenet_r", "imagenet-r_train.yaml"), ("imagenet_r", "imagenet-r_test.yaml")}


def test_every_catalog_file_has_a_checksum_or_is_declared_unpublished() -> None:
    for entry in CATALOG.entries():
        for f in entry.files:
            assert f.urls and all(u.startswith(("http://", "https://")) for u in f.urls)
            # nobody publishes a checksum for PACS or ImageNet-R's split lists: pinned at the first download
            assert f.checksum is not None or f.source.startswith("none published"), f.name
            assert f.checksum is not None or (entry.name, f.name) in UNPUBLISHED, f.name
            assert f.source, f.name


def test_cli_fetch_and_list(tmp_path: Path) -> None:
    runner = CliRunner()
    with served_dataset("mnist", {n.name: n.name.encode() * 100 for n in CATALOG.get("mnist").files}):
        result = runner.invoke(app, ["fetch", "mnist", "--dir", str(tmp_path), "--quiet"])
        assert result.exit_code == 0, result.output
        assert f"mnist: 4 file(s) verified in {tmp_path / 'mnist'}" in result.output
        listed = runner.invoke(app, ["list", "--dir", str(tmp_path), "--verify"])
        assert check_dataset("mnist", tmp_path) == []
    assert listed.exit_code == 0, listed.output
    rows = {line.split()[0]: line for line in listed.output.splitlines()[2:-1]}
    assert set(rows) == set(CATALOG.names())
    assert rows["mnist"].split()[1] == "cached" and rows["cifar10"].split()[1] == "-"
    assert "CC BY-SA 3.0" in rows["mnist"]


def test_cli_fetch_failure_is_one_line(tmp_path: Path) -> None:
    with served_dataset("cifar10", {"cifar-10-python.tar.gz": b"x"}) as files:
        files.content["cifar-10-python.tar.gz"] = b"y"  # the server's copy changed: mismatch
        result = CliRunner().invoke(app, ["fetch", "cifar10", "--dir", str(tmp_path), "-q"])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and result.output.startswith("error: ")
    assert "checksum mismatch for cifar-10-python.tar.gz" in result.output


def test_fetch_dataset_uses_the_override_only_inside_it(tmp_path: Path) -> None:
    original = CATALOG.get("mnist")
    with served_dataset("mnist", {f.name: b"1" for f in original.files}):
        fetch_dataset("mnist", tmp_path, progressbar=False)
    assert CATALOG.get("mnist") is original


def test_list_dataset_shows_the_download_size_licence_and_fetch_command(monkeypatch):
    from fedmerge import cli
    from fedmerge.cli import app as main_app
    from fedmerge.data.catalog import CATALOG

    monkeypatch.setattr(cli.out, "width", 400)  # one line per sentence

    for name in ("cifar100", "tiny_imagenet", "femnist"):
        result = CliRunner().invoke(main_app, ["list", "dataset", name])
        assert result.exit_code == 0, result.output
        assert f"fedmerge data fetch {name}" in result.output
        assert CATALOG.get(name).licence in result.output
    result = CliRunner().invoke(main_app, ["list", "dataset", "digits"])
    assert result.exit_code == 0 and "fedmerge data fetch" not in result.output  # nothing to fetch


# --- mirrors, fall-through, the per-file lock, registered copies, quiet ------------------------------
def test_a_checksum_mismatch_falls_through_to_the_next_source(tmp_path: Path) -> None:
    with serve({"bad/a.bin": PAYLOAD[:-1] + b"x", "a.bin": PAYLOAD}) as (base, files):
        r = RemoteFile("a.bin", (f"{base}/bad/a.bin", f"{base}/a.bin"), sha256(PAYLOAD))
        fetch_file(r, tmp_path, progressbar=False)
    assert [p for p, _ in files.requests] == ["bad/a.bin", "a.bin"]
    assert (tmp_path / "a.bin").read_bytes() == PAYLOAD and only_files(tmp_path) == ["a.bin"]


def test_every_source_failing_is_one_line_naming_each(tmp_path: Path) -> None:
    with serve({"bad/a.bin": b"corrupt"}) as (base, _):
        r = RemoteFile("a.bin", (f"{base}/bad/a.bin", f"{base}/gone/a.bin"), sha256(PAYLOAD))
        with pytest.raises(DownloadError) as err:
            fetch_file(r, tmp_path, progressbar=False)
    message = str(err.value)
    assert "\n" not in message and "from 2 source(s)" in message
    assert f"{base}/bad/a.bin: checksum mismatch for a.bin" in message and f"{base}/gone/a.bin (" in message
    assert "fedmerge data add" in message


def test_mirrors_from_the_environment_come_first_corrupt_one_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ds"  # the dataset's folder: mirrors hold <mirror>/<dataset>/<file>
    with serve({"m1/ds/a.bin": b"corrupt", "m2/ds/a.bin": PAYLOAD, "a.bin": PAYLOAD}) as (base, files):
        monkeypatch.setenv("FEDMERGE_DATA_MIRROR", f"{base}/m1 {base}/m2/")
        fetch_file(remote(base), folder, progressbar=False)
    assert [p for p, _ in files.requests] == ["m1/ds/a.bin", "m2/ds/a.bin"]  # the publisher was not needed
    assert (folder / "a.bin").read_bytes() == PAYLOAD


def test_a_folder_is_a_mirror_too_and_the_option_wins_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "institute" / "ds"
    copy.mkdir(parents=True)
    (copy / "a.bin").write_bytes(PAYLOAD)
    monkeypatch.setenv("FEDMERGE_DATA_MIRROR", "http://127.0.0.1:9/never")
    url = f"http://127.0.0.1:{closed_port()}/a.bin"
    r = RemoteFile("a.bin", (url,), sha256(PAYLOAD))
    fetch_file(r, tmp_path / "data" / "ds", progressbar=False, mirrors=[str(tmp_path / "institute")])
    assert (tmp_path / "data" / "ds" / "a.bin").read_bytes() == PAYLOAD


def test_cli_fetch_with_mirror(tmp_path: Path) -> None:
    content = {f.name: f.name.encode() * 100 for f in CATALOG.get("mnist").files}
    with served_dataset("mnist", content) as files:
        mirrored = {f"copy/mnist/{n}": b for n, b in content.items()}
        files.content = mirrored  # only the mirror has them now
        base = CATALOG.get("mnist").files[0].urls[0].rsplit("/", 1)[0]
        result = CliRunner().invoke(app, ["fetch", "mnist", "--dir", str(tmp_path), "-q", "--mirror", f"{base}/copy"])
    assert result.exit_code == 0, result.output
    assert sorted(p for p, _ in files.requests) == sorted(mirrored)


def test_two_fetches_of_one_file_at_once_download_it_once(tmp_path: Path) -> None:
    import threading

    with serve({"a.bin": PAYLOAD}) as (base, files):
        files.delay = 0.5  # both start while the first transfer is under way
        errors: list[BaseException] = []

        def fetch() -> None:
            try:
                fetch_file(remote(base), tmp_path, progressbar=False)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=fetch) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert len(files.requests) == 1
    assert (tmp_path / "a.bin").read_bytes() == PAYLOAD and only_files(tmp_path) == ["a.bin"]


def test_data_add_registers_a_local_copy_with_its_own_checksum(tmp_path: Path) -> None:
    import hashlib

    own = tmp_path / "mirror-copy.tar.gz"
    own.write_bytes(b"an institute's repacked archive")
    digest = hashlib.sha256(own.read_bytes()).hexdigest()
    data = tmp_path / "data"
    runner = CliRunner()
    wrong = runner.invoke(app, ["add", "cifar10", str(own), "--checksum", "0" * 64, "--dir", str(data)])
    assert wrong.exit_code == 1 and "not the " + "0" * 64 in wrong.output
    assert not (data / "cifar10" / "cifar-10-python.tar.gz").exists()
    result = runner.invoke(app, ["add", "cifar10", str(own), "--checksum", digest, "--dir", str(data)])
    assert result.exit_code == 0, result.output
    assert "registered with its own checksum" in result.output
    entry = CATALOG.get("cifar10")
    folder = data / "cifar10"
    assert (folder / "cifar-10-python.tar.gz").read_bytes() == own.read_bytes()
    assert verify_file(entry.files[0], folder)  # against the registered checksum, not the publisher's
    assert check_dataset("cifar10", data) == []
    assert fetch_dataset("cifar10", data, progressbar=False) == folder  # verified: nothing downloaded
    (folder / "cifar-10-python.tar.gz").write_bytes(b"altered later")
    assert check_dataset("cifar10", data) == ["cifar-10-python.tar.gz"]


def test_data_add_of_the_published_file_registers_nothing(tmp_path: Path) -> None:
    content = {f.name: f.name.encode() * 100 for f in CATALOG.get("mnist").files}
    name = "train-labels-idx1-ubyte.gz"
    copy = tmp_path / "labels.gz"
    copy.write_bytes(content[name])
    with served_dataset("mnist", content):
        digest = sha256(content[name]).removeprefix("sha256:")
        result = CliRunner().invoke(
            app, ["add", "mnist", str(copy), "--as", name, "--checksum", digest, "--dir", str(tmp_path)]
        )
        assert result.exit_code == 0, result.output
        assert "the published file" in result.output
        assert not (tmp_path / "mnist" / f"{name}.registered").exists()
        unnamed = CliRunner().invoke(app, ["add", "mnist", str(copy), "--checksum", digest, "--dir", str(tmp_path)])
    assert unnamed.exit_code == 1 and "name it with --as" in unnamed.output


def test_quiet_silences_pooch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import pooch

    logger = pooch.get_logger()  # pooch's logger does not propagate: listen to it directly
    logger.addHandler(caplog.handler)
    try:
        with serve({"a.bin": PAYLOAD, "b.bin": PAYLOAD}) as (base, _), caplog.at_level(logging.INFO, logger="pooch"):
            fetch_file(remote(base), tmp_path, progressbar=False)
            assert not [r for r in caplog.records if r.name == "pooch"]
            fetch_file(remote(base, name="b.bin"), tmp_path, progressbar=True)  # not quiet: pooch says what it does
            assert any("Downloading data from" in r.getMessage() for r in caplog.records if r.name == "pooch")
    finally:
        logger.removeHandler(caplog.handler)
