"""Real Flower deployment on 127.0.0.1: a SuperLink, SuperNodes (one partition each) and ``flwr run``.

Every process starts in its own process group (SuperLink and SuperNodes spawn SuperExec, ServerApp
and ClientApp children), is bounded in time, and its whole group is stopped by pid in ``finally``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower absent: pip install -e '.[flower]'")
pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class Processes:
    """Started processes, each the leader of its own process group; ``stop`` ends every group."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs, self.procs = env, logs, []

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        exe = shutil.which(argv[0], path=str(BIN)) or argv[0]
        proc = subprocess.Popen(
            [exe, *argv[1:]], env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:  # SIGTERM lets Flower stop its children; SIGKILL whatever is left
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def alive_groups(self, timeout: float = 10) -> list[int]:
        """Process groups that still have a member (orphans reparented to init take a moment to go)."""
        deadline = time.monotonic() + timeout
        while True:
            alive = [p.pid for p in self.procs if _group_exists(p.pid)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


@pytest.fixture
def deployment(tmp_path):
    from fedmerge.engines.flower import OFFLINE_ENV

    home = tmp_path / "flwr-home"
    home.mkdir()
    env = {**os.environ, **OFFLINE_ENV, "FLWR_HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = Processes(env, tmp_path)
    try:
        yield procs, home
    finally:
        procs.stop()
        assert procs.alive_groups() == [], "processes left behind"


def write_connection(home: Path, name: str, port: int, extra: str = "insecure = true") -> None:
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "127.0.0.1:{port}"\n{extra}\n'
    )


def test_superlink_and_two_supernodes_run_two_rounds(tmp_path, deployment):
    from fedmerge.engines.flower.__main__ import write_app

    procs, home = deployment
    port = free_port()
    write_connection(home, "loopback", port)
    app = write_app(tmp_path / "fedmerge-app")

    link = procs.start(
        "superlink", "flower-superlink", "--insecure", "--port", str(port), "--disable-runtime-dependency-installation"
    )
    wait_for_port(port, link)
    for pid in (0, 1):
        procs.start(
            f"supernode{pid}",
            "flower-supernode",
            "--insecure",
            "--superlink",
            f"127.0.0.1:{port}",
            "--port",
            str(free_port()),
            "--node-config",
            f"partition-id={pid}",
            "--max-retries",
            "5",
        )
    out = tmp_path / "runs"
    overrides = "rounds=2 eval_every=2 partition.num_clients=2 algorithm.local_epochs=1 threads=1 name=deployed"
    flwr = procs.start(
        "flwr-run",
        "flwr",
        "run",
        str(app),
        "loopback",
        "--stream",
        "--run-config",
        f'overrides="{overrides}" output-dir="{out}"',
    )
    try:
        flwr.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"flwr run did not finish in time:\n{procs.log('flwr-run')[-3000:]}")
    assert flwr.returncode == 0, procs.log("flwr-run")[-3000:]

    run_dirs = list(out.glob("deployed-*"))
    assert len(run_dirs) == 1, procs.log("flwr-run")[-3000:]
    from fedmerge.experiment.results import RunStore

    rows = RunStore(run_dirs[0]).read_metrics()
    assert [r["round"] for r in rows] == [1, 2]
    assert sorted(rows[-1]["eval"]["clients"]) == ["0", "1"]
    assert "failed_clients" not in rows[-1]
    for name in ("config.yaml", "summary.json", "summary.md", "checkpoints/latest.json"):
        assert (run_dirs[0] / name).exists(), name


def write_tls_material(folder: Path) -> None:
    """A CA, a SuperLink certificate for 127.0.0.1 signed by it, and one SuperNode key pair (SSH format)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    pem, none = serialization.Encoding.PEM, serialization.NoEncryption()

    def cert(subject: str, key, issuer: x509.Name, signer, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key, node_key = (ec.generate_private_key(ec.SECP384R1()) for _ in range(3))
    ca = cert(
        "fedmerge test CA",
        ca_key,
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedmerge test CA")]),
        ca_key,
        ca=True,
    )
    (folder / "ca.crt").write_bytes(ca.public_bytes(pem))
    (folder / "server.pem").write_bytes(cert("127.0.0.1", server_key, ca.subject, ca_key, ca=False).public_bytes(pem))
    (folder / "server.key").write_bytes(server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, none))
    (folder / "node.key").write_bytes(node_key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, none))
    (folder / "node.pub").write_bytes(
        node_key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )


def test_tls_with_supernode_auth_refuses_unregistered_supernode(tmp_path, deployment):
    procs, home = deployment
    tls = tmp_path / "tls"
    tls.mkdir()
    write_tls_material(tls)
    port = free_port()
    write_connection(home, "secure", port, f'root-certificates = "{tls / "ca.crt"}"')
    link = procs.start(
        "superlink", "flower-superlink", "--ssl-ca-certfile", str(tls / "ca.crt"), "--ssl-certfile",
        str(tls / "server.pem"), "--ssl-keyfile", str(tls / "server.key"), "--enable-supernode-auth",
        "--port", str(port), "--disable-runtime-dependency-installation",
    )  # fmt: skip
    wait_for_port(port, link)
    node = ["flower-supernode", "--root-certificates", str(tls / "ca.crt"), "--superlink", f"127.0.0.1:{port}"]

    stranger = procs.start("stranger", *node, "--port", str(free_port()), "--node-config", "partition-id=0")
    try:
        stranger.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"an unregistered SuperNode was not refused:\n{procs.log('stranger')[-2000:]}")
    assert stranger.returncode != 0
    assert "must be registered" in procs.log("stranger")

    register = subprocess.run(
        [str(BIN / "flwr"), "supernode", "register", str(tls / "node.pub"), "secure"],
        env=procs.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert register.returncode == 0, register.stdout + register.stderr
    member = procs.start(
        "member", *node, "--port", str(free_port()), "--node-config", "partition-id=0",
        "--auth-supernode-private-key", str(tls / "node.key"),
    )  # fmt: skip
    deadline = time.monotonic() + 90
    while "SuperNode ID:" not in procs.log("member"):
        assert member.poll() is None, f"registered SuperNode stopped:\n{procs.log('member')[-2000:]}"
        assert time.monotonic() < deadline, "registered SuperNode did not connect over TLS"
        time.sleep(0.5)
