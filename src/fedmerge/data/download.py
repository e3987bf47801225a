"""Verified, resumable, atomic downloads of the papers' dataset files (through pooch).

A file reaches its place in the cache only after its checksum matched (pooch downloads into a
temporary name beside it and moves it into place once the hash agrees). Bytes of an
interrupted transfer wait in ``<dataset>/.partial/`` (never at the file's own name) and the next
attempt asks the server for the rest with an HTTP ``Range`` request; a mismatch deletes them. Every
failure is one [`DownloadError`][fedmerge.data.download.DownloadError] line naming the URL, the file, its checksum and
where to put the
file by hand.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fedmerge.data.errors import DataUnavailable

if TYPE_CHECKING:
    from filelock import FileLock

DATA_DIR_ENV = "FEDMERGE_DATA_DIR"
MIRROR_ENV = "FEDMERGE_DATA_MIRROR"
CHUNK = 1 << 16  # small enough that an interrupted transfer keeps nearly all it received


class DownloadError(DataUnavailable):
    """A dataset file could not be downloaded or did not match its checksum (one line)."""


def default_data_dir() -> Path:
    """``$FEDMERGE_DATA_DIR`` if set, else ``~/.cache/fedmerge/data``."""
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedmerge" / "data"


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """The cache root: the option when given, else [`default_data_dir()`][fedmerge.data.download.default_data_dir]."""
    return Path(data_dir).expanduser() if data_dir else default_data_dir()


@dataclass(frozen=True)
class RemoteFile:
    """One file of a dataset: its name in the cache, where to get it, and its checksum.

    ``checksum`` is ``"sha256:<hex>"`` or ``"md5:<hex>"`` (pooch's notation), or None where nobody
    publishes one: then the first download is pinned (its SHA-256 kept in ``<name>.sha256`` beside it)
    and every later use is checked against that. ``urls`` are tried in order (publisher, then mirrors).
    """

    name: str
    urls: tuple[str, ...]
    checksum: str | None
    size: int | None = None  # bytes, as published; shown by `fedmerge data list`
    source: str = ""  # where the checksum comes from (shown in errors and the listing)
    # bytes as a page reports them, rounded (e.g. "94.3 MB"), where nobody publishes the exact size: shown with "~"
    approx_size: int | None = None

    def __post_init__(self) -> None:
        if self.checksum is None:
            return
        algo, _, digest = self.checksum.partition(":")
        if algo not in ("sha256", "md5") or not digest:
            raise ValueError(f"{self.name}: checksum must be 'sha256:<hex>' or 'md5:<hex>', got {self.checksum!r}")


@dataclass
class ResumableDownloader:
    """A pooch downloader that resumes from ``partial`` with an HTTP Range request.

    pooch's own HTTPDownloader restarts from zero into a fresh temporary file, so an interrupted
    multi-GB transfer would be lost. This one keeps the received bytes in ``partial`` (outside the
    verified files' names) and, once the transfer is complete, moves them onto pooch's temporary file
    so that pooch verifies the checksum and moves the file into place.
    """

    partial: Path
    progressbar: bool = True
    timeout: float = 30.0
    resumed_from: int = field(default=0, init=False)

    def __call__(self, url: str, output_file: str, pooch: object, check_only: bool = False) -> None:
        import requests

        self.partial.parent.mkdir(parents=True, exist_ok=True)
        have = self.partial.stat().st_size if self.partial.exists() else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        with requests.get(url, headers=headers, stream=True, timeout=self.timeout) as response:
            if have and response.status_code == 416:  # everything was already received
                response.close()
            else:
                response.raise_for_status()
                if response.headers.get("Content-Type", "").startswith("text/html"):
                    raise requests.exceptions.InvalidURL(
                        "the server answered with a web page, not the file (a login, quota or virus-scan page?)"
                    )
                resumed = have and response.status_code == 206
                self.resumed_from = have if resumed else 0
                remaining = int(response.headers.get("Content-Length", 0)) or None
                total = None if remaining is None else remaining + self.resumed_from
                mode = "ab" if resumed else "wb"
                with open(self.partial, mode) as out, self._bar(total, self.resumed_from) as bar:
                    for chunk in response.iter_content(chunk_size=CHUNK):
                        out.write(chunk)
                        bar.update(len(chunk))
                    out.flush()
                    os.fsync(out.fileno())
        # complete: hand the bytes to pooch, which checks the hash and moves them into place
        os.replace(self.partial, output_file)

    def _bar(self, total: int | None, initial: int):  # noqa: ANN202  (tqdm or a null context)
        from contextlib import nullcontext

        from tqdm.auto import tqdm

        if not self.progressbar:
            return nullcontext(_NullBar())
        name = self.partial.name.removesuffix(".part")
        return tqdm(total=total, initial=initial, unit="B", unit_scale=True, desc=name, file=sys.stderr, leave=True)


class _NullBar:
    def update(self, n: int) -> None:
        pass


def pin_file(folder: Path, remote: RemoteFile) -> Path:
    return folder / f"{remote.name}.sha256"


def registered_file(folder: Path, remote: RemoteFile) -> Path:
    """Where ``fedmerge data add`` records a local copy's own checksum (it replaces the published one)."""
    return folder / f"{remote.name}.registered"


def registered_checksum(remote: RemoteFile, folder: Path) -> str | None:
    path = registered_file(folder, remote)
    if not path.is_file():
        return None
    import json

    return str(json.loads(path.read_text())["checksum"])


def expected_checksum(remote: RemoteFile, folder: Path) -> str | None:
    """The checksum a registered local copy was added with (``fedmerge data add``), else the published one,
    else the one pinned at the first download (None before it)."""
    registered = registered_checksum(remote, folder)
    if registered is not None:
        return registered
    if remote.checksum is not None:
        return remote.checksum
    pin = pin_file(folder, remote)
    return f"sha256:{pin.read_text().split()[0]}" if pin.is_file() else None


def manual_hint(remote: RemoteFile, folder: Path) -> str:
    checksum = expected_checksum(remote, folder) or "no published checksum"
    return (
        f"expected {remote.name} ({checksum}); download it on a machine with access and place it "
        f"at {folder / remote.name}, or register your own copy with `fedmerge data add {folder.name} FILE "
        "--checksum SHA256`"
    )


def mirrors_from_env() -> tuple[str, ...]:
    """``$FEDMERGE_DATA_MIRROR``: mirror base URLs (or folders), separated by spaces."""
    return tuple(os.environ.get(MIRROR_ENV, "").split())


def mirror_urls(mirrors: Sequence[str], dataset: str, remote: RemoteFile) -> tuple[str, ...]:
    """Where each mirror keeps the file: ``<mirror>/<dataset>/<file>``, the cache's own layout (so a copy of
    a data folder served over HTTP, or the folder itself, is a mirror)."""
    return tuple(f"{m.rstrip('/')}/{dataset}/{remote.name}" for m in mirrors)


def sources(remote: RemoteFile, dataset: str, mirrors: Sequence[str] | None) -> tuple[str, ...]:
    """Every place to try, in order: the user's mirrors (option, else ``$FEDMERGE_DATA_MIRROR``), then the
    catalog's URLs (publisher, then its mirrors)."""
    chosen = tuple(mirrors) if mirrors else mirrors_from_env()
    return (*mirror_urls(chosen, dataset, remote), *remote.urls)


@contextmanager
def quiet_pooch(quiet: bool) -> Iterator[None]:
    """pooch logs each download and, without a known hash, advice to pin one: silenced when quiet."""
    if not quiet:
        yield
        return
    import pooch

    # a filter, not setLevel: pooch's logger is outside logging's manager, so the level cache that
    # setLevel would leave behind is never cleared and pooch would stay silent for the whole process
    logger = pooch.get_logger()
    below_warning = _BelowWarning()
    logger.addFilter(below_warning)
    try:
        yield
    finally:
        logger.removeFilter(below_warning)


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def file_lock(folder: Path, remote: RemoteFile) -> FileLock:
    """One lock per file (the system releases it if its holder dies): two fetches of the same file (two
    runs with ``dataset.download=true``) take turns, and the second finds the first's verified file instead
    of sharing its partial download."""
    from filelock import FileLock

    # beside the dataset folders (<data dir>/.locks/<dataset>/), so that the folder holds only data
    locks = folder.parent / ".locks" / folder.name
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / f"{remote.name}.lock"))


def fetch_file(
    remote: RemoteFile,
    folder: Path,
    progressbar: bool = True,
    mirrors: Sequence[str] | None = None,
) -> Path:
    """``folder/remote.name``, downloaded and verified unless already there and verified.

    A file already present is checked against its checksum (pooch re-downloads a mismatching one). Every
    source is tried in turn (``mirrors`` first) whatever its failure, a checksum mismatch included.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder, remote), quiet_pooch(not progressbar):
        return _fetch_locked(remote, folder, progressbar, sources(remote, folder.name, mirrors))


def _fetch_locked(remote: RemoteFile, folder: Path, progressbar: bool, urls: tuple[str, ...]) -> Path:
    import pooch
    import requests

    target = folder / remote.name
    partial = folder / ".partial" / f"{remote.name}.part"
    _remove_stale_temporaries(folder)
    known = expected_checksum(remote, folder)
    if known is not None and verify_file(remote, folder):
        return target  # verified already (perhaps by a fetch that held the lock before us)
    failures: list[str] = []
    mismatches = 0
    for url in urls:
        try:
            if "://" not in url or url.startswith("file://"):
                _copy_local(url, folder, remote, known)
            else:
                downloader = ResumableDownloader(partial, progressbar=progressbar)
                pooch.retrieve(
                    url, known_hash=known, fname=remote.name, path=folder, downloader=downloader, progressbar=False
                )
        except ValueError as exc:  # pooch: checksum mismatch; the bytes are gone with pooch's temporary
            partial.unlink(missing_ok=True)
            got = _hash_in(str(exc))
            mismatches += 1
            failures.append(
                f"{url}: checksum mismatch for {remote.name}{f' (got {got})' if got else ''}; the file was "
                "discarded (a truncated or altered file)"
            )
            continue
        except (requests.exceptions.RequestException, OSError) as exc:
            failures.append(f"{url} ({_reason(exc)})")
            continue
        if known is None:  # nothing published: pin this download so that any later change is caught
            digest = pooch.file_hash(str(target), alg="sha256")
            pin_file(folder, remote).write_text(f"{digest}  {remote.name}\n")
            print(
                f"{remote.name}: no published checksum exists; pinned sha256:{digest} "
                f"in {pin_file(folder, remote)} (compare it with a colleague's copy)",
                file=sys.stderr,
            )
        return target
    kept = partial.stat().st_size if partial.exists() else 0
    resume = f"; {kept:,} bytes kept, run again to resume" if kept else ""
    if len(failures) == 1 and mismatches == 1:
        raise DownloadError(f"{failures[0]}; {manual_hint(remote, folder)}")
    raise DownloadError(
        f"could not download {remote.name} from {len(failures)} source(s): {'; '.join(failures)}{resume}; "
        f"{manual_hint(remote, folder)}"
    )


def _copy_local(source: str, folder: Path, remote: RemoteFile, known: str | None) -> None:
    """A mirror that is a folder (a plain path or ``file://``): copy the file in, verified like a download."""
    import shutil
    import tempfile

    from pooch.hashes import file_hash, hash_algorithm, hash_matches

    path = Path(source.removeprefix("file://")).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no such file {path}")
    fd, tmp = tempfile.mkstemp(prefix="tmp", dir=folder)
    os.close(fd)
    try:
        shutil.copyfile(path, tmp)
        if known is not None and not hash_matches(tmp, known):
            got = file_hash(tmp, alg=hash_algorithm(known))
            raise ValueError(f"{path} does not match the known hash: expected {known} but got {got}.")
        os.replace(tmp, folder / remote.name)
    finally:
        Path(tmp).unlink(missing_ok=True)


def verify_file(remote: RemoteFile, folder: Path) -> bool:
    """Whether ``folder/remote.name`` exists and matches its checksum (or its pin)."""
    from pooch.hashes import hash_matches

    path = folder / remote.name
    known = expected_checksum(remote, folder)
    return path.is_file() and known is not None and hash_matches(str(path), known)


def _remove_stale_temporaries(folder: Path) -> None:
    # pooch's temporary files (tmpXXXXXXXX) left by a killed process: never valid data
    for stale in folder.glob("tmp*"):
        if stale.is_file():
            stale.unlink(missing_ok=True)


def _hash_in(message: str) -> str | None:
    # pooch: "... does not match the known hash: expected md5:<hex> but got <hex>. Deleted download ..."
    import re

    found = re.search(r"but got ([0-9a-fA-F]+)", message)
    return found.group(1) if found else None


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."
