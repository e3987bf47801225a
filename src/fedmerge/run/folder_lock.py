"""One writer per run folder: the lock that a run, a resume, and every sweep, study or tune job holds.

``RUN_DIR/.writer.lock`` is an OS lock (``filelock``: ``flock`` on POSIX), so it dies with its process:
a run killed by ``kill -9`` or a power cut leaves nothing to clean up, and the next writer takes the
folder over. ``RUN_DIR/.writer.json`` says who holds it (pid, host, start), for the refusal and for
``fedmerge report``; the holder writes it once the lock is its own and deletes it before letting go,
so one left behind belongs to a writer that died. The lock file itself is never deleted: deleting it
would let a writer lock a name that another has already replaced.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from fedmerge.config.schema import ConfigError
from fedmerge.core.checkpoint import atomic_write_bytes

LOCK_FILE = ".writer.lock"
HOLDER_FILE = ".writer.json"


class RunFolderBusy(ConfigError):
    """Another live process is writing the run folder (``str`` is one line naming it)."""


@dataclass(frozen=True)
class Writer:
    """Who holds a run folder's lock, as its holder file says."""

    pid: int | None
    host: str | None
    started: str | None = None

    def __str__(self) -> str:
        since = f", since {self.started}" if self.started else ""
        return f"pid {self.pid if self.pid is not None else '?'} on host {self.host or '?'}{since}"


@contextmanager
def writing_run_folder(run_dir: str | Path) -> Iterator[Path]:
    """Hold ``run_dir``'s lock for the ``with`` block, or raise
    [`RunFolderBusy`][fedmerge.run.folder_lock.RunFolderBusy] at once (no
    waiting: two writers of one folder are a mistake to report, not a queue)."""
    folder = Path(run_dir)
    lock = FileLock(str(folder / LOCK_FILE), timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        raise RunFolderBusy(
            f"{folder} is being written by another fedmerge process ({holder_of(folder, wait=True)}); "
            "let it finish or stop it, then run this again"
        ) from None
    try:
        # whatever a dead writer left here is replaced: the lock is ours now
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        atomic_write_bytes(folder / HOLDER_FILE, (json.dumps(info) + "\n").encode())
        yield folder
    finally:
        with suppress(OSError):
            (folder / HOLDER_FILE).unlink()
        lock.release()


def holder_of(run_dir: Path, wait: bool = False) -> Writer:
    """The holder file's writer; ``wait``: give a writer that has just taken the lock a moment to write it."""
    for _ in range(20 if wait else 1):
        try:
            info = json.loads((run_dir / HOLDER_FILE).read_text())
            return Writer(info.get("pid"), info.get("host"), info.get("started"))
        except (OSError, ValueError, AttributeError):
            time.sleep(0.05)
    return Writer(None, None)


def active_writer(run_dir: str | Path) -> Writer | None:
    """The live process writing ``run_dir``, or None. For readers (``fedmerge report``): it creates no
    file, and it tries the lock only when a holder file says a writer may be there."""
    folder = Path(run_dir)
    if not (folder / HOLDER_FILE).is_file() or not (folder / LOCK_FILE).is_file():
        return None
    writer = holder_of(folder)
    probe = FileLock(str(folder / LOCK_FILE), timeout=0, thread_local=False)
    try:
        probe.acquire()
    except Timeout:
        return writer
    except OSError:  # a folder this user may only read: nobody writes it from here
        return None
    probe.release()
    return None  # the holder file of a writer that died
