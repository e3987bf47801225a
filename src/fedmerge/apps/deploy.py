"""What an operator runs around Flower's own commands, where those alone do not say that something failed.

- [`launch()`][fedmerge.apps.deploy.launch] (``fedmerge deploy run``): ``flwr run`` of fedmerge's app, the run's log
  streamed as
  ``flwr log --stream`` shows it, then the run's final status from ``flwr ls``: exit status 0 only when
  the run completed, else 1 with the ServerApp's one-line reason. (Flower 1.41's ``flwr run --stream``
  exits 0 whatever becomes of the run.)
- [`supervise()`][fedmerge.apps.deploy.supervise] (``fedmerge deploy node``): ``flower-supernode`` as a child process
  in its own
  process group, with an exit status a service manager can act on: a SuperNode that stops by itself is
  a failure (1, or its own non-zero status), one that was asked to stop is not (0); either way its whole
  group is ended within seconds. (Flower 1.41's SuperNode exits 0 when the SuperLink refuses it with
  401, e.g. after a restart that lost its registrations, and may leave its ``flower-superexec`` behind.)
"""

from __future__ import annotations

import json
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO

Say = Callable[[str], None]

COMPLETED = "finished:completed"
RUN_CONFIG_KEYS = ("config", "overrides", "output-dir", "resume", "pooled-test", "command")
ONBOARD_KEYS = ("onboard", "onboard-round", "adapt-epochs", "partition-ids")  # fedmerge deploy onboard


class LaunchError(RuntimeError):
    """``flwr`` could not start or follow the run (one-line message)."""


def flower_command(name: str) -> str:
    """A Flower executable: the one installed next to this Python, else the one on PATH."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        raise LaunchError(f"{name} is not installed: pip install 'flwr==1.41.*' (the 'flower' extra)")
    return found


def run_config_argument(values: dict[str, str]) -> str:
    """``--run-config`` text: ``key="value"`` pairs (TOML strings), the keys that are set."""
    keys = RUN_CONFIG_KEYS + ONBOARD_KEYS
    return " ".join(f"{k}={json.dumps(v)}" for k, v in values.items() if k in keys and v)


def _json_output(proc: subprocess.CompletedProcess) -> dict:
    """The JSON object ``flwr ... --format json`` prints (after any notice lines)."""
    text = proc.stdout
    try:
        return json.loads(text[text.index("{") :])
    except ValueError:
        return {}


def _flwr(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([flower_command("flwr"), *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"flwr {args[0]} did not answer within {timeout:.0f}s; is the SuperLink up?") from None


def _reason(payload: dict, proc: subprocess.CompletedProcess) -> str:
    text = str(payload.get("error-message") or proc.stderr or proc.stdout or f"exit status {proc.returncode}")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else text


def start_run(app: Path, superlink: str | None, values: dict[str, str]) -> int:
    """``flwr run``; the Flower run id."""
    target = [superlink] if superlink else []
    proc = _flwr(["run", str(app), *target, "--run-config", run_config_argument(values), "--format", "json"])
    payload = _json_output(proc)
    if proc.returncode != 0 or not payload.get("success") or payload.get("run-id") is None:
        raise LaunchError(f"flwr run could not start the run: {_reason(payload, proc)}")
    return int(payload["run-id"])


def run_status(run_id: int, superlink: str | None) -> tuple[str, str]:
    """(status, details) of a Flower run, as ``flwr ls --run-id`` gives them."""
    target = [superlink] if superlink else []
    proc = _flwr(["ls", "--run-id", str(run_id), *target, "--format", "json"], timeout=120)
    payload = _json_output(proc)
    runs = payload.get("runs") or []
    if proc.returncode != 0 or not runs:
        raise LaunchError(f"flwr ls could not read run {run_id}: {_reason(payload, proc)}")
    return str(runs[0].get("status", "")), str(runs[0].get("status-details", ""))


FAILED_PREFIX = "ServerApp failed with exception: "


def launch(superlink: str | None, values: dict[str, str], say: Say, app: Path | None = None) -> int:
    """Start the run, stream its log to this process's stdout, and return 0 when it completed, else 1
    (after one line that says why and how to continue)."""
    with tempfile.TemporaryDirectory(prefix="fedmerge-app-") as tmp:
        if app is None:
            from fedmerge.engines.flower.__main__ import write_app

            app = write_app(Path(tmp) / "fedmerge-app")
        run_id = start_run(app, superlink, values)
    say(f"Flower run {run_id} started; its log follows (flwr log {run_id}{' ' + superlink if superlink else ''})")
    target = [superlink] if superlink else []
    stream = subprocess.run([flower_command("flwr"), "log", str(run_id), *target, "--stream"])
    lost = (
        f"lost the SuperLink while Flower run {run_id} was under way; when it is back, continue with "
        "fedmerge deploy run SUPERLINK --resume RUN_DIR"
    )
    try:
        status, details = run_status(run_id, superlink)
    except LaunchError:
        if stream.returncode != 0:  # the SuperLink went away while the run was under way
            raise LaunchError(lost) from None
        raise
    if status == COMPLETED:
        return 0
    if status.startswith("finished"):
        reason = details.removeprefix(FAILED_PREFIX).strip() or f"the run ended as {status}"
        say(f"error: Flower run {run_id} {status}: {reason}")
    elif stream.returncode != 0:  # the stream broke, the SuperLink still lists the run as under way
        say(f"error: {lost}")
    else:
        say(f"error: Flower run {run_id} is {status or 'in an unknown state'}; follow it with flwr log {run_id}")
    return 1


# --- a SuperNode a service manager can restart -------------------------------------------------------
# Flower 1.41's lines when the SuperLink will not have this node: a 401 on a heartbeat (a restart that lost
# the registrations), an unregistered key (2001) or a key not yet let in again (2004)
REFUSED = ("401 Unauthorized", "could not be activated", "must be registered", "Failed to activate SuperNode")
LAST_LINES = 5  # the child's lines a failure repeats (its output also went through as it came)
GRACE_S = 2.0  # after the child exits: for the rest of its output, then for its group to stop on SIGTERM


def superlink_given(args: list[str]) -> bool:
    """Whether ``flower-supernode`` ``args`` name a SuperLink (else it retries a default address forever)."""
    return any(a == "--superlink" or a.startswith("--superlink=") for a in args)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):  # the group is already gone
        pass


def _end_group(pgid: int) -> None:
    """Stop what the child left in its process group (SuperExec, ClientApps): SIGTERM, then SIGKILL."""
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
    _signal_group(pgid, signal.SIGKILL)


class _Output:
    """The child's output, read from its pipe without blocking: passed through, its last lines kept."""

    def __init__(self, fd: int, out: IO[str]) -> None:
        self.fd, self.out, self.partial = fd, out, b""
        self.last: deque[str] = deque(maxlen=LAST_LINES)
        self.refused = False
        self.closed = False

    def read(self, timeout: float) -> None:
        """Pass on what arrives within ``timeout`` seconds (at once when there is something)."""
        if self.closed:  # nothing more will come: just wait
            time.sleep(timeout)
            return
        if not select.select([self.fd], [], [], timeout)[0]:
            return
        try:
            data = os.read(self.fd, 65536)
        except InterruptedError:  # a signal: the caller loops
            return
        if not data:
            self.closed = True
            data, self.partial = self.partial, b""
            if data:
                data += b"\n"
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for raw in lines:
            line = raw.decode(errors="replace")
            self.out.write(line + "\n")
            if line.strip():
                self.last.append(line.strip())
            self.refused = self.refused or any(marker in line for marker in REFUSED)
        self.out.flush()

    def drain(self, seconds: float) -> None:
        """Read until the pipe ends or ``seconds`` pass (a grandchild may hold it open)."""
        deadline = time.monotonic() + seconds
        while not self.closed and time.monotonic() < deadline:
            self.read(max(deadline - time.monotonic(), 0))


def supervise(argv: list[str], say: Say, out: IO[str] | None = None) -> int:
    """Run ``argv`` (``flower-supernode ...``) in its own process group, passing its output through and
    SIGTERM/SIGINT on to the group. When the child exits, for any reason, its whole group is ended and
    this returns within seconds: its exit status, except that a clean exit nobody asked for becomes 1.
    Every unasked exit ends with one line that says why, with the child's last line.

    The child's exit is what is waited for, not the end of its output: a grandchild
    (``flower-superexec``) can outlive it holding the pipe open, and reading to EOF would never return."""
    out = out or sys.stdout
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    assert child.stdout is not None
    output = _Output(child.stdout.fileno(), out)
    asked = threading.Event()

    def forward(signum: int, _frame) -> None:
        asked.set()
        _signal_group(child.pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while child.poll() is None:  # short waits, so that a signal is forwarded at once
            output.read(0.2)
        output.drain(GRACE_S)  # the rest of its output
        _end_group(child.pid)
        output.drain(GRACE_S)  # what the group printed as it stopped
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if child.poll() is None:  # interrupted by an exception: leave nothing behind
            _end_group(child.pid)
            child.wait()
        child.stdout.close()
    code = child.returncode
    if asked.is_set() and code in (0, -signal.SIGTERM, -signal.SIGINT):
        return 0 if code == 0 else 128 - code
    name = shlex.join(argv[:1])
    tail = f"; its last line: {output.last[-1]}" if output.last else "; it printed nothing"
    if code < 0:  # killed by a signal: the shell's convention
        say(f"error: {name} was killed by signal {-code}{tail}")
        return 128 - code
    if code != 0:
        say(f"error: {name} exited with status {code}{tail}")
        return code
    why = "the SuperLink refused this node" if output.refused else "it stopped by itself"
    say(
        f"error: {name} exited with status 0 but {why}; exiting with 1 so that a service "
        f"manager (Restart=on-failure) starts it again{tail}"
    )
    return 1
