"""What an operator runs around Flower's own commands, where those alone do not say that something failed.

- :func:`launch` (``fedmerge deploy run``): ``flwr run`` of fedmerge's app, the run's log streamed as
  ``flwr log --stream`` shows it, then the run's final status from ``flwr ls``: exit status 0 only when
  the run completed, else 1 with the ServerApp's one-line reason. (Flower 1.41's ``flwr run --stream``
  exits 0 whatever becomes of the run.)
- :func:`supervise` (``fedmerge deploy node``): ``flower-supernode`` as a child process, with an exit
  status a service manager can act on: a SuperNode that stops by itself is a failure (1, or its own
  non-zero status), one that was asked to stop is not (0). (Flower 1.41's SuperNode exits 0 when the
  SuperLink refuses it with 401, e.g. after a restart that lost its registrations.)
"""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
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
REFUSED = ("401 Unauthorized", "could not be activated", "must be registered")


def supervise(argv: list[str], say: Say, out: IO[str] | None = None) -> int:
    """Run ``argv`` (``flower-supernode ...``), passing its output through and SIGTERM/SIGINT on to it.
    Returns its exit status, except that a clean exit nobody asked for becomes 1, with one line saying
    whether the SuperLink refused this node (a restart lost its registration, or its key was removed)."""
    out = out or sys.stdout
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    asked = threading.Event()
    refused = threading.Event()

    def forward(signum: int, _frame) -> None:
        asked.set()
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert child.stdout is not None
        for line in child.stdout:
            out.write(line)
            out.flush()
            if any(marker in line for marker in REFUSED):
                refused.set()
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if code < 0:  # killed by a signal: the shell's convention
        return 128 - code
    if code != 0 or asked.is_set():
        return code
    why = "the SuperLink refused this node" if refused.is_set() else "it stopped by itself"
    say(
        f"error: {shlex.join(argv[:1])} exited with status 0 but {why}; exiting with 1 so that a service "
        "manager (Restart=on-failure) starts it again"
    )
    return 1
