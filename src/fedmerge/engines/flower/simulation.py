"""Flower's simulation runtime (Ray) in this process, driven from the caller's thread.

``run_simulation`` blocks its thread and runs the ServerApp in another one. The round loop stays in
the caller's thread (so progress, checkpoints and Ctrl-C behave as with the local engine): here the
ServerApp is a thin relay that executes Grid calls handed to it through a queue.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from fedmerge.core.loop import RoundFailed

from .client import app as client_app

_STOP = object()


@dataclass(frozen=True)
class SimulationOptions:
    num_cpus: int | None = None  # CPUs Ray may use (None: all of this machine's)
    client_cpus: float = 1.0  # per ClientApp: num_cpus / client_cpus ClientApps run at once
    client_gpus: float = 0.0
    start_timeout: float = 300.0  # seconds for Ray and the ServerApp thread to come up
    ray_address: str | None = None  # a running Ray cluster to join ("auto" or HOST:PORT); None: a private Ray


class RayClusterUnreachable(RoundFailed):
    """``flower.ray_address`` names no Ray cluster that answers (one line, before Ray is asked to join it)."""


def cluster_address(address: str, timeout: float = 10.0) -> str:
    """The HOST:PORT of the running cluster that ``address`` ("auto" or HOST:PORT) names, found as ``ray.init``
    finds it, and checked to answer: ``ray.init`` waits for ever for a head that is not there."""
    # Ray's own resolution of "auto" (RAY_ADDRESS, then the cluster `ray start` recorded on this machine)
    from ray._private.services import canonicalize_bootstrap_address_or_die

    try:
        resolved = canonicalize_bootstrap_address_or_die(address)
    except (ConnectionError, ValueError) as exc:
        raise RayClusterUnreachable(f"flower.ray_address={address}: {str(exc).splitlines()[0]}") from None
    host, port = resolved.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise RayClusterUnreachable(
            f"flower.ray_address={address}: no Ray cluster answers at {resolved} ({exc.strerror or exc}); "
            "start one (ray start --head) or name a running one"
        ) from None
    return resolved


def ray_init_args(options: SimulationOptions) -> dict[str, Any]:
    """``ray.init``'s arguments (Flower's ``init_args``): a private Ray instance, or the cluster to join."""
    args: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,  # ClientApp errors reach the server as error replies
        "logging_level": logging.ERROR,
    }
    if options.ray_address is not None:  # the cluster's own CPUs and GPUs: ray.init refuses num_cpus there
        return {**args, "address": cluster_address(options.ray_address)}
    # a private Ray instance: never a cluster already running on this machine or named by RAY_ADDRESS
    # (ray.init would join it, and refuses num_cpus there)
    return {**args, "address": "local", "num_cpus": options.num_cpus or os.cpu_count() or 1}


class GridRelay:
    """A Grid stand-in for the caller's thread: each call runs on the real Grid in the ServerApp thread."""

    def __init__(self, start_timeout: float) -> None:
        self._calls: queue.Queue[Any] = queue.Queue()
        self._results: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._started = threading.Event()
        self.start_timeout = start_timeout
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # Called in the ServerApp thread.
    def serve(self, grid: Grid) -> None:
        self._started.set()
        while (call := self._calls.get()) is not _STOP:
            try:
                self._results.put((True, call(grid)))
            except BaseException as exc:  # handed back to the caller's thread
                self._results.put((False, exc))

    # Called in the caller's thread.
    def _call(self, fn: Callable[[Grid], Any]) -> Any:
        deadline = time.monotonic() + self.start_timeout
        while not self._started.wait(0.2):
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"Flower simulation did not start within {self.start_timeout:.0f}s")
        self._calls.put(fn)
        while True:
            try:
                ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                self._check_alive()
                continue
            if ok:
                return value
            raise value

    def _check_alive(self) -> None:
        if self.thread is not None and not self.thread.is_alive():
            raise RuntimeError(f"Flower simulation stopped: {self.error!r}") from self.error

    def get_node_ids(self) -> Iterable[int]:
        return self._call(lambda grid: list(grid.get_node_ids()))

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        return self._call(lambda grid: list(grid.send_and_receive(messages, timeout=timeout)))

    def stop(self) -> None:
        self._calls.put(_STOP)


@contextmanager
def simulation(num_supernodes: int, options: SimulationOptions) -> Iterator[GridRelay]:
    """Start Flower's simulation with ``num_supernodes`` virtual SuperNodes (partition-id 0..N-1)."""
    relay = GridRelay(options.start_timeout)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        relay.serve(grid)

    backend_config: dict[str, Any] = {
        "client_resources": {"num_cpus": options.client_cpus, "num_gpus": options.client_gpus},
        "init_args": ray_init_args(options),
    }

    def run() -> None:
        # Ray's notice about a future default for GPU visibility; nothing to act on here.
        warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
        try:
            run_simulation(server, client_app, num_supernodes, backend_config=backend_config)
        except BaseException as exc:
            relay.error = exc

    # Flower's Ray backend appends sys.path to PYTHONPATH on every start; keep the caller's value.
    saved_pythonpath = os.environ.get("PYTHONPATH")
    flwr_logger = logging.getLogger("flwr")
    saved_level = flwr_logger.level
    flwr_logger.setLevel(logging.ERROR)  # no INFO chatter or deprecation notice next to the progress bar
    relay.thread = threading.Thread(target=run, name="flower-simulation", daemon=True)
    relay.thread.start()
    try:
        yield relay
    finally:
        relay.stop()
        relay.thread.join(timeout=120)
        flwr_logger.setLevel(saved_level)
        if saved_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_pythonpath
