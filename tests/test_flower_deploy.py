"""A real Flower deployment: a SuperLink, three SuperNodes (each with only its own client file) and
``flwr run``, over TLS with SuperNode authentication; in separate network namespaces where they exist,
else on 127.0.0.1. One deployment serves every check (it takes about 2.5 minutes, most of it Flower's
polling and the SuperLink's 60 s wait before it lets a killed node's key in again); the protocol
itself is tested in process in ``test_flower_nodes.py``.

Every process starts in its own process group (SuperLink and SuperNodes spawn SuperExec, ServerApp
and ClientApp children), is bounded in time, and its whole group is stopped by pid in ``finally``.
"""

from __future__ import annotations

import os
import re
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


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


class Processes:
    """Started processes, each the leader of its own process group; ``stop`` ends every group."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs, self.procs = env, logs, []

    def start(self, name: str, *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None):
        log = open(self.logs / f"{name}.log", "wb")
        exe = shutil.which(argv[0], path=str(BIN)) or argv[0]
        proc = subprocess.Popen(
            [exe, *argv[1:]],
            env={**self.env, **(env or {})},
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
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


def write_connection(home: Path, name: str, port: int, extra: str = "insecure = true", host: str = "127.0.0.1") -> None:
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{host}:{port}"\n{extra}\n'
    )


def write_tls_material(folder: Path, nodes: int = 1, address: str = "127.0.0.1") -> None:
    """A CA, a SuperLink certificate for ``address`` signed by it, and ``nodes`` SuperNode key pairs
    (OpenSSH format: ``node.key``/``node.pub``, then ``node1.key``...)."""
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
            san = [x509.IPAddress(ipaddress.ip_address(address)), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = (ec.generate_private_key(ec.SECP384R1()) for _ in range(2))
    ca = cert(
        "fedmerge test CA",
        ca_key,
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedmerge test CA")]),
        ca_key,
        ca=True,
    )
    (folder / "ca.crt").write_bytes(ca.public_bytes(pem))
    (folder / "server.pem").write_bytes(cert(address, server_key, ca.subject, ca_key, ca=False).public_bytes(pem))
    (folder / "server.key").write_bytes(server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, none))
    for i in range(nodes):
        node_key = ec.generate_private_key(ec.SECP384R1())
        name = "node" if i == 0 else f"node{i}"
        (folder / f"{name}.key").write_bytes(node_key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, none))
        (folder / f"{name}.pub").write_bytes(
            node_key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        )


# --- one real deployment: TLS, SuperNode authentication, node-owned data and state, kill -9 ------
NETNS_HINT = "needs root and iproute2 network namespaces: apt-get install -y iproute2 (run as root)"


def netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"fmprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


class Network:
    """Where each process runs: on loopback, or each in its own network namespace joined by a bridge.

    With namespaces the SuperLink listens only on 10.213.X.1 in its namespace, SuperNode i runs in
    another with address 10.213.X.(10+i), and the flwr CLI reaches the SuperLink from this namespace
    through the bridge (10.213.X.254): every connection crosses a (virtual) network, none uses
    loopback except each SuperNode's own ClientApp API, which Flower binds to 127.0.0.1."""

    def __init__(self, namespaces: bool) -> None:
        self.namespaces = namespaces
        tag = os.getpid() % 10000
        self.net = f"10.213.{os.getpid() % 250}"
        self.link_address = f"{self.net}.1" if namespaces else "127.0.0.1"
        self.prefix = f"fm{tag}"
        self.created: list[str] = []
        if namespaces:
            self._ip("link", "add", f"{self.prefix}br", "type", "bridge")
            self._ip("addr", "add", f"{self.net}.254/24", "dev", f"{self.prefix}br")
            self._ip("link", "set", f"{self.prefix}br", "up")
            self._namespace("link", f"{self.net}.1")

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def _namespace(self, name: str, address: str) -> None:
        ns, outer, inner = f"{self.prefix}{name}", f"{self.prefix}{name}o", f"{self.prefix}{name}i"
        self._ip("netns", "add", ns)
        self.created.append(ns)
        self._ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._ip("link", "set", inner, "netns", ns)
        self._ip("link", "set", outer, "master", f"{self.prefix}br")
        self._ip("link", "set", outer, "up")
        self._ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
        self._ip("-n", ns, "link", "set", inner, "up")
        self._ip("-n", ns, "link", "set", "lo", "up")

    def node_address(self, i: int) -> str:
        if not self.namespaces:
            return "127.0.0.1"
        if f"{self.prefix}n{i}" not in self.created:
            self._namespace(f"n{i}", f"{self.net}.{10 + i}")
        return f"{self.net}.{10 + i}"

    def argv(self, where: str, *argv: str) -> list[str]:
        """``argv`` run in the namespace ``where`` ("link" or "n0", "n1", ...)."""
        if not self.namespaces:
            return list(argv)
        exe = shutil.which(argv[0], path=str(BIN)) or argv[0]
        return ["ip", "netns", "exec", f"{self.prefix}{where}", exe, *argv[1:]]

    def close(self) -> None:
        for ns in self.created:  # deleting a namespace deletes its veth end, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.namespaces:
            subprocess.run(["ip", "link", "del", f"{self.prefix}br"], capture_output=True)


def test_network_namespaces_are_available():
    """The deployment test below runs across network namespaces when they exist; say so when not."""
    if not netns_available():
        pytest.skip(NETNS_HINT)


NODES = 3
ROUNDS = 4
RUN = ["partition.num_clients=3", "algorithm.name=ditto", "algorithm.lam=0.1", "algorithm.local_epochs=1"]


def make_dataset(folder: Path) -> Path:
    """The federation's source data as a user's .npz (digits, flattened): deleted after the export,
    so that no process of the deployment could read it even if it tried."""
    import numpy as np

    from fedmerge.data import load_pool

    pool = load_pool({"name": "digits"})
    path = folder / "source.npz"
    np.savez(path, x=pool.x.reshape(len(pool.x), -1), y=pool.y)
    return path


def state_digests(state_dir: Path, cid: int) -> dict[int, str]:
    """sha256 (16 hex digits, as the node prints it) of each version the node's store holds, by round."""
    import hashlib

    from fedmerge.core.state_store import StateStore

    out = {}
    (run_store,) = state_dir.glob("run-*")  # the run's own store (a node keeps one per run)
    with StateStore(run_store) as store:
        newest = store.round_of(cid)
        for rnd in range(newest or 0, -1, -1):
            if store.round_of(cid, max_round=rnd) == rnd:
                out[rnd] = hashlib.sha256(store.get(cid, max_round=rnd).to_bytes()).hexdigest()[:16]
    return out


def wait_for(predicate, what: str, timeout: float, procs: Processes, log: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout:.0f}s:\n{procs.log(log)[-3000:]}")
        time.sleep(0.05)
    return value


@pytest.fixture
def network():
    net = Network(netns_available())
    try:
        yield net
    finally:
        net.close()


@pytest.mark.processes
def test_tls_authenticated_deployment_with_node_owned_data_and_state_survives_kill_9(tmp_path, network, deployment):
    """Three SuperNodes, each its own process with only its own client file and an empty HOME, run
    4 rounds of Ditto over TLS with SuperNode authentication; a SuperNode with an unregistered key is
    refused. Client 1's SuperNode is killed with
    SIGKILL while it trains in round 2 and restarted; the run completes, the restarted node continues
    from the state its store holds, and every per-client metric equals the in-process deployment with
    the same failure, which itself equals the local engine (test_flower_nodes.py). Where network
    namespaces exist (root, iproute2), the SuperLink and each SuperNode run in their own (``Network``)."""
    import re

    from fedmerge.config.schema import load_config
    from fedmerge.data.client_files import export_clients
    from fedmerge.engines.flower.__main__ import write_app
    from fedmerge.run.prepare import load_data
    from fedmerge.run.results import RunStore
    from fedmerge.run.runner import run_experiment

    procs, home = deployment
    source = make_dataset(tmp_path)
    data_args = ["dataset.name=npz", f"dataset.path={source}"]
    files = export_clients(load_data(load_config(None, [*data_args, *RUN])), tmp_path / "export")
    # the local engine on the original data, one round (the deployment's round 1 must equal it)
    local = run_experiment(
        load_config(None, [*data_args, *RUN, "rounds=1", "name=local"]), tmp_path / "local", show_progress=False
    )
    source.unlink()  # from now on the original dataset exists nowhere
    sites = []
    for i, f in enumerate(files):  # one folder per site: its file, its state, an empty HOME
        site = tmp_path / f"site{i}"
        (site / "home").mkdir(parents=True)
        shutil.move(f, site / f.name)
        sites.append(site)

    tls = tmp_path / "tls"
    tls.mkdir()
    address = network.link_address
    write_tls_material(tls, nodes=NODES, address=address)
    port = free_port()
    write_connection(home, "secure", port, f'root-certificates = "{tls / "ca.crt"}"', host=address)
    link = procs.start("superlink", *network.argv(
        "link", "flower-superlink", "--ssl-ca-certfile", str(tls / "ca.crt"), "--ssl-certfile",
        str(tls / "server.pem"), "--ssl-keyfile", str(tls / "server.key"), "--enable-supernode-auth",
        "--host", address, "--port", str(port), "--disable-runtime-dependency-installation",
    ))  # fmt: skip
    wait_for_port(port, link, host=address)
    node_addresses = [network.node_address(i) for i in range(NODES)]
    keys = [tls / ("node" if i == 0 else f"node{i}") for i in range(NODES)]
    for key in keys:
        register = subprocess.run(
            [str(BIN / "flwr"), "supernode", "register", f"{key}.pub", "secure"],
            env=procs.env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert register.returncode == 0, register.stdout + register.stderr

    def start_node(i: int, name: str) -> subprocess.Popen:
        site = sites[i]
        config = f'data-path="{site / files[i].name}" state-dir="{site / "state"}"'  # strings are quoted
        env = {"HOME": str(site / "home"), "FLWR_HOME": str(site / "home" / ".flwr")}
        return procs.start(name, *network.argv(
            f"n{i}", "flower-supernode", "--root-certificates", str(tls / "ca.crt"), "--superlink",
            f"{address}:{port}", "--port", str(free_port()), "--node-config", config,
            "--auth-supernode-private-key", f"{keys[i]}.key",
        ), env=env, cwd=site)  # fmt: skip

    nodes = [start_node(i, f"node{i}") for i in range(NODES)]
    out = tmp_path / "runs"
    settings = "flower.round_timeout=90 flower.connect_timeout=120 eval_every=4 threads=1 name=deployed"
    overrides = f"{' '.join(RUN)} rounds={ROUNDS} {settings}"
    flwr = procs.start(
        "flwr-run", "flwr", "run", str(write_app(tmp_path / "fedmerge-app")), "secure", "--stream",
        "--run-config", f'overrides="{overrides}" output-dir="{out}"',
    )  # fmt: skip

    # kill -9 client 1's SuperNode (and its ClientApp) as soon as it starts training in round 2
    started = "fedmerge node: client 1, round 2 train: starts from"

    def training_round_2() -> bool:
        for i, n in enumerate(nodes):
            assert n.poll() is None, f"SuperNode {i} stopped:\n{procs.log(f'node{i}')[-3000:]}"
        assert flwr.poll() is None, f"flwr run stopped:\n{procs.log('flwr-run')[-3000:]}"
        return started in procs.log("node1")

    wait_for(training_round_2, "round 2 training of client 1", 120, procs, "flwr-run")
    _signal_group(nodes[1].pid, signal.SIGKILL)
    nodes[1].wait(timeout=10)
    saved = state_digests(sites[1] / "state", 1)  # the state file the restarted node must continue from
    assert 1 in saved, saved

    # meanwhile a SuperNode whose key is not registered tries to join, and is refused
    stranger = procs.start("stranger", *network.argv(
        "n0", "flower-supernode", "--root-certificates", str(tls / "ca.crt"), "--superlink", f"{address}:{port}",
        "--port", str(free_port()), "--node-config", f'data-path="{sites[0] / files[0].name}"',
    ))  # fmt: skip

    # restart it; the SuperLink refuses its key until it has marked the killed node offline
    for attempt in range(40):
        name = f"node1-restart{attempt}"
        node = start_node(1, name)
        wait_for(lambda n=node, m=name: n.poll() is not None or "SuperNode ID:" in procs.log(m), name, 60, procs, name)
        if node.poll() is None:
            break
        time.sleep(2)
    try:
        stranger.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"an unregistered SuperNode was not refused:\n{procs.log('stranger')[-2000:]}")
    assert stranger.returncode != 0 and "must be registered" in procs.log("stranger")
    try:
        flwr.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"flwr run did not finish in time:\n{procs.log('flwr-run')[-3000:]}")
    assert flwr.returncode == 0, procs.log("flwr-run")[-3000:]
    (run_dir,) = out.glob("deployed-*")
    rows = RunStore(run_dir).read_metrics()
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    failed = [(f["round"], f["cid"], f["phase"]) for r in rows for f in r.get("failed_clients", [])]
    assert failed in ([], [(2, 1, "train")]), failed

    # the restarted node's first message continued from the state its store held for the last round
    # whose result the server received (round 1 if its round-2 reply was lost, else round 2)
    restarted = procs.log(name)
    first = re.search(r"client 1, round (\d) (\w+): starts from state of round (\d) \(sha256 (\w+)\)", restarted)
    assert first is not None, restarted[-2000:]
    expected_round = 1 if failed else 2
    assert int(first.group(3)) == expected_round and first.group(4) == saved[expected_round], (first.group(0), saved)

    # no node could read anything but its own file: the run equals the in-process deployment with the
    # same failure (bit for bit), which test_flower_nodes.py shows equals the local engine
    from test_flower_nodes import NodeGrid, client_rows

    reference_files = [s / f.name for s, f in zip(sites, files)]
    cfg = load_config(None, [*data_args, *RUN, f"rounds={ROUNDS}", "engine=flower", *settings.split()])
    grid = NodeGrid(reference_files, tmp_path / "reference-state", lose={(r, c) for r, c, _ in failed})
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # as a Flower runtime would
    ref = run_experiment(cfg, tmp_path / "reference", show_progress=False, grid=grid, deployment=True)
    # round 1 (before the kill) equals the local engine's directly: loss, communication, server figures
    first_local = client_rows(local.run_dir)[0]
    first_local.pop("eval", None), first_local.pop("summary", None)  # the local run evaluated its last round
    assert client_rows(run_dir)[0] == first_local
    strip = [{k: v for k, v in r.items() if k != "failed_clients"} for r in client_rows(run_dir)]
    assert strip == [{k: v for k, v in r.items() if k != "failed_clients"} for r in client_rows(ref.run_dir)]
    assert (run_dir / "federation.json").is_file()
    if network.namespaces:  # the SuperLink saw each SuperNode at its own address on the virtual network
        access = procs.log("superlink")
        assert all(f"{a}:" in access for a in node_addresses) and "127.0.0.1:" not in access, node_addresses


def test_the_app_folder_command_refuses_an_unwritable_place_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "fedmerge.engines.flower", str(tmp_path / "file" / "app")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: {tmp_path / 'file' / 'app'}: cannot write the app folder (Not a directory)"


# --- what the operator sees (issue #42): bad nodes, a SuperLink restart, no secret in the run folder --
def fedmerge_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedmerge.cli", *args]


def write_connections(home: Path, connections: dict[str, str]) -> None:
    """``$FLWR_HOME/config.toml`` with one SuperLink connection per entry (name -> TOML body)."""
    text = "".join(f"[superlink.{name}]\n{body}\n\n" for name, body in connections.items())
    (home / "config.toml").write_text(text)


def export_three(folder: Path, *extra: str) -> list[Path]:
    from fedmerge.config.schema import load_config
    from fedmerge.data.client_files import export_clients, source_digest
    from fedmerge.run.prepare import load_data

    cfg = load_config(None, ["partition.num_clients=3", *extra])
    digest = source_digest(cfg.model_dump(mode="json", include={"dataset", "partition", "split", "noise", "seed"}))
    return export_clients(load_data(cfg), folder, source_digest=digest)  # as fedmerge export-clients does


@pytest.mark.processes
def test_bad_nodes_reach_the_operator_as_one_line_and_fail_the_command(tmp_path, deployment):
    """Another client's file, and files of two exports, each on its own SuperLink (in parallel): ``fedmerge
    deploy run`` streams the ServerApp's log, which holds the one line, and exits 1 repeating it with
    Flower's final status; no traceback, no run folder. (A missing, truncated or damaged file takes the same
    path to the operator; their lines are checked in-process, in test_flower_nodes and test_client_files.)"""
    procs, home = deployment
    files = export_three(tmp_path / "a")
    other = export_three(tmp_path / "b", "partition.alpha=5")  # another export: another source digest
    cases = {  # name: (each node's node config, what the line says)
        "other": ([f'data-path="{files[0]}" partition-id=1'], "holds client 0 but this SuperNode has partition-id=1"),
        "export": ([f'data-path="{files[0]}"', f'data-path="{other[1]}"'], "clients disagree on the source"),
    }
    ports = {name: free_port() for name in cases}
    write_connections(home, {name: f'address = "127.0.0.1:{p}"\ninsecure = true' for name, p in ports.items()})
    for name, port in ports.items():
        link = procs.start(f"link-{name}", "flower-superlink", "--insecure", "--port", str(port),
                           "--disable-runtime-dependency-installation")  # fmt: skip
        wait_for_port(port, link)
    for name, (configs, _) in cases.items():
        for i, config in enumerate(configs):
            procs.start(f"node-{name}{i}", "flower-supernode", "--insecure", "--superlink",
                        f"127.0.0.1:{ports[name]}", "--port", str(free_port()), "--node-config", config)  # fmt: skip
    out = tmp_path / "runs"
    launches = {
        name: procs.start(
            f"launch-{name}",
            *fedmerge_cli("deploy", "run", name, "rounds=1", "flower.connect_timeout=120", "--output-dir", str(out)),
        )  # fmt: skip
        for name in cases
    }
    for name, launch in launches.items():
        try:
            launch.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name}: fedmerge deploy run did not end:\n{procs.log(f'launch-{name}')[-3000:]}")
        text = procs.log(f"launch-{name}")
        assert launch.returncode == 1, text[-3000:]
        errors = [ln for ln in text.splitlines() if ln.startswith("fedmerge: error: ")]  # the streamed log
        assert len(errors) == 1 and cases[name][1] in errors[0], text[-3000:]
        line = errors[0].removeprefix("fedmerge: error: ")
        assert re.search(rf"^error: Flower run \d+ finished:failed: {re.escape(line)}$", text, re.M), text[-2000:]
        assert "Traceback" not in text
    assert not out.exists()


def serverapp_token() -> str | None:
    """The token on the command line of a running ``flwr-serverapp`` (what no run file may hold)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(a.endswith("flwr-serverapp") for a in argv[:2]) and "--token" in argv:
            return argv[argv.index("--token") + 1]
    return None


@pytest.mark.processes
def test_superlink_restart_with_its_database_then_resume_equals_an_uninterrupted_run(tmp_path, deployment):
    """TLS, SuperNode authentication, ``--database``. The nodes run under ``fedmerge deploy node`` with
    state folders that already hold another run's states. The SuperLink is killed (SIGKILL, with its
    ServerApp) in round 2: ``fedmerge deploy run`` exits 1 saying so. Restarted on its database, the
    SuperLink knows the nodes' keys and ids; the nodes reconnect by themselves; ``fedmerge deploy run
    --resume`` completes, and the result equals the same run uninterrupted. No file of the run folder
    holds the ServerApp's token; its provenance holds the two commands the operator typed."""
    from test_flower_nodes import NodeGrid, client_rows

    from fedmerge.config.schema import load_config
    from fedmerge.run.provenance import read_provenance
    from fedmerge.run.results import RunStore
    from fedmerge.run.runner import run_experiment

    procs, home = deployment
    files = export_three(tmp_path / "export", "partition.num_clients=2")  # two sites: fewer processes
    sites = []
    for i, f in enumerate(files):
        (tmp_path / f"site{i}").mkdir()
        sites.append(shutil.move(f, tmp_path / f"site{i}" / f.name))
    settings = ["algorithm.name=ditto", "algorithm.lam=0.1", "algorithm.local_epochs=1", "rounds=2", "eval_every=2",
                "threads=1", "flower.connect_timeout=180", "flower.round_timeout=120"]  # fmt: skip
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # as a Flower runtime would
    other = load_config(None, ["partition.num_clients=2", "algorithm.name=fedper", "rounds=1", "engine=flower"])
    states = [s.parent / "state" for s in sites]
    run_experiment(other, tmp_path / "other", show_progress=False, deployment=True,
                   grid=NodeGrid(sites, tmp_path / "unused", state_dirs=states))  # fmt: skip
    reference = run_experiment(
        load_config(None, ["partition.num_clients=2", "engine=flower", *settings]), tmp_path / "reference",
        show_progress=False, deployment=True, grid=NodeGrid(sites, tmp_path / "reference-state"),
    )  # fmt: skip

    tls = tmp_path / "tls"
    tls.mkdir()
    write_tls_material(tls, nodes=len(sites))
    port = free_port()
    write_connections(home, {"secure": f'address = "127.0.0.1:{port}"\nroot-certificates = "{tls / "ca.crt"}"'})

    def start_link(name: str) -> subprocess.Popen:
        link = procs.start(name, "flower-superlink", "--ssl-ca-certfile", str(tls / "ca.crt"), "--ssl-certfile",
                           str(tls / "server.pem"), "--ssl-keyfile", str(tls / "server.key"), "--enable-supernode-auth",
                           "--port", str(port), "--database", str(tmp_path / "superlink.db"),
                           "--disable-runtime-dependency-installation")  # fmt: skip
        wait_for_port(port, link)
        return link

    link = start_link("superlink")
    for i in range(len(sites)):
        key = tls / ("node" if i == 0 else f"node{i}")
        register = subprocess.run([str(BIN / "flwr"), "supernode", "register", f"{key}.pub", "secure"],
                                  env=procs.env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert register.returncode == 0, register.stdout + register.stderr
        procs.start(f"node{i}", *fedmerge_cli(
            "deploy", "node", "--root-certificates", str(tls / "ca.crt"), "--superlink", f"127.0.0.1:{port}",
            "--port", str(free_port()), "--auth-supernode-private-key", f"{key}.key",
            "--node-config", f'data-path="{sites[i]}" state-dir="{sites[i].parent / "state"}"',
        ), cwd=sites[i].parent)  # fmt: skip
    out = tmp_path / "runs"
    first = procs.start("launch", *fedmerge_cli("deploy", "run", "secure", *settings, "name=deployed",
                                                "--output-dir", str(out)))  # fmt: skip
    tokens: set[str] = set()

    def in_round_2() -> bool:
        assert first.poll() is None, procs.log("launch")[-3000:]
        if (token := serverapp_token()) is not None:
            tokens.add(token)
        return any("round 2 train: starts from" in procs.log(f"node{i}") for i in range(len(sites)))

    wait_for(in_round_2, "round 2", 300, procs, "launch")
    _signal_group(link.pid, signal.SIGKILL)  # the SuperLink and its ServerApp
    link.wait(timeout=10)
    start_link("superlink-restarted")
    first.wait(timeout=180)
    text = procs.log("launch")
    assert first.returncode == 1 and "lost the SuperLink while Flower run" in text, text[-3000:]
    (run_dir,) = out.glob("deployed-*")
    assert [r["round"] for r in RunStore(run_dir).read_metrics()] == [1]

    resumed = procs.start("resume", *fedmerge_cli("deploy", "run", "secure", "--resume", str(run_dir)))
    try:
        resumed.wait(timeout=400)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the resumed run did not end:\n{procs.log('resume')[-3000:]}")
    text = procs.log("resume")
    assert resumed.returncode == 0, text[-3000:]
    assert "fedmerge: resuming from round 1 of 2" in text and "fedmerge: round 2/2: " in text
    for i in range(len(sites)):  # each node kept its key's id and its process through the restart
        log = procs.log(f"node{i}")
        assert log.count("SuperNode ID:") == 1, log[-2000:]
        assert len(list((sites[i].parent / "state").glob("run-*"))) == 2  # the other run's store, untouched
    assert client_rows(run_dir) == client_rows(reference.run_dir)

    assert tokens, "no ServerApp token seen"
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert not any(t.encode() in path.read_bytes() for t in tokens), path
    commands = [line["command"] for line in read_provenance(run_dir)]
    assert len(commands) == 2 and commands[1] == f"fedmerge deploy run secure --resume {run_dir}", commands
    assert commands[0].startswith("fedmerge deploy run secure algorithm.name=ditto"), commands


@pytest.mark.processes
def test_a_refused_supernode_ends_its_wrapper_within_seconds_with_no_process_left(tmp_path, deployment):
    """A SuperLink with SuperNode authentication refuses a node whose key is not registered; ``fedmerge deploy
    node`` around that node exits non-zero within seconds (Flower's orphaned ``flower-superexec`` used to keep
    its output pipe open, and the wrapper waited forever), so a restart loop (systemd ``Restart=on-failure``)
    gets its turn; the fixture checks that no process of its group is left."""
    procs, _home = deployment
    tls = tmp_path / "tls"
    tls.mkdir()
    write_tls_material(tls, nodes=1)
    port = free_port()
    link = procs.start("superlink", "flower-superlink", "--ssl-ca-certfile", str(tls / "ca.crt"), "--ssl-certfile",
                       str(tls / "server.pem"), "--ssl-keyfile", str(tls / "server.key"), "--enable-supernode-auth",
                       "--port", str(port), "--disable-runtime-dependency-installation")  # fmt: skip
    wait_for_port(port, link)
    data = export_three(tmp_path / "export")[0]
    wrapper = procs.start("node", *fedmerge_cli(
        "deploy", "node", "--root-certificates", str(tls / "ca.crt"), "--superlink", f"127.0.0.1:{port}",
        "--port", str(free_port()), "--auth-supernode-private-key", str(tls / "node.key"),
        "--node-config", f'data-path="{data}"',
    ))  # fmt: skip
    start = time.monotonic()
    try:
        wrapper.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"fedmerge deploy node still runs after its node was refused:\n{procs.log('node')[-3000:]}")
    log = procs.log("node")
    assert wrapper.returncode != 0, log[-3000:]
    assert "must be registered" in log or "2004" in log, log[-3000:]
    assert time.monotonic() - start < 120
