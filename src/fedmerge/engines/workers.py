"""Client work in forked worker processes (``engine: local`` with ``workers: N``), and thread counts.

Why fork: a forked worker inherits the client data, the model object and the algorithm from the
engine at no cost (copy-on-write: nothing is pickled, reloaded or copied per round) and starts in
milliseconds. Fork is unsafe with torch in two cases, both refused by
[`workers_problem()`][fedmerge.engines.workers.workers_problem]: CUDA
(it cannot be re-initialised in a forked child) and OpenMP thread pools (GNU libgomp hangs in a
forked child that opens a parallel region with more than one thread once the parent has used one).
So every worker runs one intra-op thread, as does the parent: ``workers: N`` with ``threads: 1``.

Each client's work is self-contained (its RNGs are seeded by (seed, round, client, purpose), its
weights come from its payload, its state travels with the task), so which worker runs which client
does not change a bit of the result: ``workers: N`` gives exactly the numbers of ``workers: 1``.
That is what lets ``workers: auto`` (the default) pick the count from the machine
([`resolve_workers()`][fedmerge.engines.workers.resolve_workers]).
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from fedmerge.core.loop import RoundFailed

log = logging.getLogger(__name__)

Task = tuple[str, int, int, Any, Any]  # (kind, round, client id, payload, state)
RunTask = Callable[[str, int, int, Any, Any], Any]


def set_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count for client and server work (None: leave torch's default).

    The count is part of the numbers: it fixes how reductions are split, so every engine and every
    worker applies the configured value instead of the machine's default.
    """
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def workers_problem(workers: int | str, threads: int | None, device: torch.device, engine: str = "local") -> str | None:
    """Why ``workers`` cannot run with these settings (one line), or None when it can (``auto`` always can)."""
    if workers in (1, "auto"):
        return None
    if engine != "local":
        return (
            f"workers: {workers} worker processes are an option of engine=local; Flower's simulation runs "
            "flower.num_cpus / flower.client_cpus ClientApps at once"
        )
    if device.type != "cpu":
        return f"workers: {workers} worker processes run on the CPU only (device={device.type}); use workers=1"
    if threads != 1:
        return (
            f"workers: each of the {workers} worker processes runs one thread (forked OpenMP thread pools "
            f"hang), so threads must be 1 (got {threads})"
        )
    if "fork" not in mp.get_all_start_methods():
        return f"workers: {workers} worker processes need the 'fork' start method, which this platform lacks"
    return None


# A launcher that runs several jobs at once (``fedmerge sweep -j``, ``fedmerge study``) gives each its share
CORES_ENV = "FEDMERGE_CORES"
# ``workers: auto`` keeps a run's clients in this process until a round's client work, timed there,
# reaches this. Starting the workers costs about 0.1 s and a round's messages about 1 ms per client for a
# small model (docs/performance/workers.md): a round of 0.5 s of client work on 2 cores saves 0.25 s
# each round, so the start is paid back in the first parallel round. Tiny runs (tests, smoke runs,
# rounds of milliseconds) never fork, where fork, messages and the parent's wait would cost more than
# they save.
AUTO_MIN_ROUND_SECONDS = 0.5


def available_cores() -> int:
    """Cores this process may use: its CPU affinity, at most ``FEDMERGE_CORES`` when a launcher set it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    share = os.environ.get(CORES_ENV, "")
    return max(1, min(cores, int(share))) if share.isdigit() and int(share) > 0 else cores


@dataclass(frozen=True)
class WorkerCount:
    """How many worker processes run a run's clients, and why (the line a run prints)."""

    count: int
    auto: bool  # resolved from ``workers: auto``: clients stay in this process while rounds are tiny
    reason: str

    @property
    def min_round_seconds(self) -> float:
        """The client work per round from which the workers are used (0: from the first round)."""
        return AUTO_MIN_ROUND_SECONDS if self.auto and self.count > 1 else 0.0

    def started(self, rnd: int) -> str:
        """What a run prints when ``workers: auto`` starts its workers in round ``rnd`` (tiny runs never do)."""
        return (
            f"round {rnd}: clients run in {self.count} worker processes from here on (workers: auto = {self.count}: "
            f"{self.reason}; a round's client work reached {AUTO_MIN_ROUND_SECONDS:g} s)"
        )


def resolve_workers(
    workers: int | str,
    threads: int | None,
    device: torch.device,
    clients_per_round: int,
    engine: str = "local",
    vectorize: bool = False,
) -> WorkerCount:
    """``workers`` as a count: a number is kept ([`workers_problem()`][fedmerge.engines.workers.workers_problem]
    refuses impossible ones); ``auto``
    is one process per available core, at most the clients per round, and 1 where forking cannot help.
    Any count gives the same numbers, so the choice is free to depend on the machine."""
    if workers != "auto":
        return WorkerCount(int(workers), False, "as configured")
    cores = available_cores()
    why_one = (
        "engine=flower runs its own ClientApps" if engine != "local"
        else f"device {device.type}" if device.type != "cpu"
        else f"threads={threads}: workers need threads=1" if threads != 1
        else "vectorize: one batched computation" if vectorize
        else "no fork on this platform" if "fork" not in mp.get_all_start_methods()
        else "one client per round" if clients_per_round <= 1
        else "one core" if cores <= 1
        else None
    )  # fmt: skip
    if why_one is not None:
        return WorkerCount(1, True, why_one)
    count = min(cores, clients_per_round)
    return WorkerCount(count, True, f"{cores} cores, {clients_per_round} clients per round")


# --- transport: pickled messages with tensors out of band -------------------------------------------
@dataclass(frozen=True)
class _Spec:
    key: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


class _Pickler(pickle.Pickler):
    """Replaces each tensor by a key; tensors the other end does not hold yet are collected in ``new``."""

    def __init__(self, file: io.BytesIO, held: dict[int, torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.held = held
        self.new: dict[int, torch.Tensor] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        key = id(obj)
        if key not in self.held and key not in self.new:
            if obj.device.type != "cpu" or obj.layout != torch.strided:
                raise TypeError(f"worker processes exchange dense CPU tensors only (got {obj.device}, {obj.layout})")
            self.new[key] = obj
        return key


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: dict[int, torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self.tensors[pid]


def _raw(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's storage (numpy holds no bfloat16: view as bytes)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        data = data[os.write(fd, data) :]


def _read_into(fd: int, data: memoryview) -> None:
    """Fill ``data`` from ``fd``: the kernel copies straight into the tensor, no intermediate bytes."""
    while data.nbytes:
        n = os.readv(fd, [data])
        if n == 0:
            raise EOFError
        data = data[n:]


class Channel:
    """One end of a worker pipe.

    A message is a pickle in which every tensor is a key, followed by the raw bytes of the tensors the
    other end does not hold yet (unframed: the pickle gives their sizes), each received straight into
    a new tensor's storage. Within a batch
    (one round's fit or evaluation) a tensor already sent travels as its key only: clients of a
    global-model method share one payload, which then crosses each pipe once per round.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._sent: dict[int, torch.Tensor] = {}  # what the other end holds (kept alive: ids stay unique)
        self._held: dict[int, torch.Tensor] = {}  # what this end received in the current batch
        self._batch_out: int | None = None
        self._batch_in: int | None = None

    def send(self, obj: Any, batch: int | None = None) -> None:
        if batch is None or batch != self._batch_out:
            self._sent, self._batch_out = {}, batch
        buf = io.BytesIO()
        pickler = _Pickler(buf, self._sent)
        pickler.dump(obj)
        specs = [_Spec(k, t.dtype, tuple(t.shape), t.requires_grad) for k, t in pickler.new.items()]
        new = {k: t.detach().contiguous() for k, t in pickler.new.items()}
        self.conn.send_bytes(pickle.dumps((batch, specs, buf.getvalue()), protocol=pickle.HIGHEST_PROTOCOL))
        for k, t in new.items():
            _write_all(self.conn.fileno(), _raw(t))
            if batch is not None:
                self._sent[k] = pickler.new[k]

    def recv(self) -> Any:
        batch, specs, body = pickle.loads(self.conn.recv_bytes())
        if batch is None or batch != self._batch_in:
            self._held, self._batch_in = {}, batch
        tensors = dict(self._held)
        for spec in specs:
            t = torch.empty(spec.shape, dtype=spec.dtype)
            _read_into(self.conn.fileno(), _raw(t))
            tensors[spec.key] = t.requires_grad_(spec.requires_grad)
        if batch is not None:
            self._held = tensors
        return _Unpickler(io.BytesIO(body), tensors).load()


# --- the worker processes ---------------------------------------------------------------------------
@dataclass
class _Worker:
    process: Any  # multiprocessing's fork Process
    channel: Channel


class WorkerPool:
    """``workers`` forked processes, each calling ``run_task(kind, rnd, cid, payload, state)``.

    Tasks go to whichever worker is idle, in the order given; results come back keyed by client id.
    A client that raises stops the call with its exception, as it would in-process; a worker that
    dies (killed, out of memory, crashed) stops it with a one-line `RoundFailed`. Either
    way the pool is closed (a later call forks a fresh one), so nothing waits forever.
    """

    def __init__(self, workers: int, run_task: RunTask) -> None:
        self.workers = workers
        self.run_task = run_task
        self._pool: list[_Worker] = []
        self._batch = 0

    def _start(self) -> None:
        ctx = mp.get_context("fork")
        pipes = [ctx.Pipe(duplex=True) for _ in range(self.workers)]
        for i, (parent_end, child_end) in enumerate(pipes):
            others = [end for pair in pipes for end in pair if end is not child_end and not end.closed]
            process = ctx.Process(
                target=_serve,
                args=(child_end, self.run_task, os.getpid(), others),
                name=f"fedmerge-worker-{i}",
                daemon=True,
            )
            process.start()
            child_end.close()
            self._pool.append(_Worker(process, Channel(parent_end)))

    def map(self, tasks: Sequence[Task], on_result: Callable[[int, Any], None] | None = None) -> dict[int, Any]:
        """Run ``tasks``; returns {client id: result}. ``on_result(cid, result)`` runs as each arrives."""
        if not self._pool:
            self._start()
        self._batch += 1
        pending = deque(tasks)
        idle = list(reversed(self._pool))
        busy: dict[int, tuple[_Worker, Task]] = {}  # keyed by the worker's pipe fileno
        results: dict[int, Any] = {}
        try:
            while pending or busy:
                while idle and pending:
                    worker, task = idle.pop(), pending.popleft()
                    busy[worker.channel.conn.fileno()] = (worker, task)
                    try:
                        worker.channel.send(task, self._batch)
                    except OSError:
                        raise self._died(worker, task) from None
                waiting = [w.channel.conn for w, _ in busy.values()] + [w.process.sentinel for w, _ in busy.values()]
                ready = wait(waiting)
                for worker, task in list(busy.values()):
                    conn = worker.channel.conn
                    if conn not in ready:
                        if worker.process.sentinel in ready and not conn.poll(0):
                            raise self._died(worker, task)
                        continue
                    try:
                        status, value = worker.channel.recv()
                    except (EOFError, OSError):
                        raise self._died(worker, task) from None
                    del busy[conn.fileno()]
                    idle.append(worker)
                    if status == "error":
                        raise _client_error(value, task)
                    results[task[2]] = value
                    if on_result is not None:
                        on_result(task[2], value)
        except BaseException:
            self.close(wait=0.0)  # the run stops: do not wait for clients still training
            raise
        return results

    def _died(self, worker: _Worker, task: Task) -> RoundFailed:
        worker.process.join(timeout=5)
        code = worker.process.exitcode
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
        else:
            how = f"exit code {code}"
        kind, rnd, cid = task[:3]
        return RoundFailed(
            f"round {rnd}: worker process {worker.process.pid} died ({how}) while running client {cid}'s {kind}; "
            "resume the run from its last checkpoint with fedmerge run --resume RUN_DIR"
        )

    def close(self, wait: float = 5.0) -> None:
        """Stop the workers: ask them to exit, then kill those still running after ``wait`` seconds."""
        for w in self._pool:
            try:
                w.channel.send(None)
            except OSError:
                pass
        for w in self._pool:
            w.process.join(timeout=wait)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.channel.conn.close()
        self._pool = []


def _client_error(value: tuple[bytes | None, str, str], task: Task) -> BaseException:
    """The client's exception as raised in the worker (re-created here), with the worker's traceback."""
    pickled, text, trace = value
    exc: BaseException | None = None
    if pickled is not None:
        try:
            exc = pickle.loads(pickled)
        except Exception:
            exc = None
    if exc is None:
        exc = RuntimeError(text)
    exc.__cause__ = _RemoteTraceback(f"in a worker process, client {task[2]}'s {task[0]} in round {task[1]}:\n{trace}")
    return exc


class _RemoteTraceback(Exception):
    """Shows the worker's traceback as the cause of the re-raised exception (as concurrent.futures does)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _serve(conn: Connection, run_task: RunTask, parent_pid: int, others: list[Connection]) -> None:
    """A worker's loop: run tasks until told to stop, or until the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    for end in others:  # pipe ends of the parent and of other workers: each pipe then reads EOF
        end.close()  # as soon as one of its two processes is gone
    # Streams inherited from the parent may hold a lock taken by one of its threads at fork time.
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115  (lives as long as the process)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    torch.set_num_threads(1)
    channel = Channel(conn)
    while True:
        while not conn.poll(1.0):
            if os.getppid() != parent_pid:
                return
        try:
            task = channel.recv()
        except (EOFError, OSError):  # the parent is gone (killed: its end was reset)
            return
        if task is None:
            return
        try:
            reply: tuple[str, Any] = ("ok", run_task(*task))
        except Exception as exc:
            reply = ("error", _error(exc))
        try:
            channel.send(reply)
        except OSError:
            return  # the parent is gone
        except Exception as exc:  # a result that cannot travel (pickling fails before anything is sent)
            channel.send(("error", _error(exc)))


def _error(exc: BaseException) -> tuple[bytes | None, str, str]:
    return _pickled(exc), f"{type(exc).__name__}: {exc}", traceback.format_exc()


def _pickled(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:
        return None
