"""Onboarding deployed SuperNodes that join after training (``fedmerge deploy onboard``, issue #36 item 4),
driven in this process through the fake Grid of the node tests: each newcomer is the real ClientApp with only its
own client file and state folder. The reference is a simulation with ``split.unseen_clients``: the model a node
saves, and the metrics it reports, equal what that simulation's onboarding gives the same client, bit for bit; the
run folder is byte-identical afterwards; no reply carries a tensor."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from helpers import quick_config, run
from test_flower_nodes import NodeGrid, export
from test_flower_operations import server_app

from fedmerge.run.results import RunStore

pytest.importorskip("flwr", reason="Flower absent: pip install -e '.[flower]'")

# 5 clients, of which the seed leaves 2 out of training (ids 3 and 4 once the participants come first)
BASE = ["partition.num_clients=5", "rounds=3", "dataset.name=digits", "algorithm.local_epochs=1", "keep_checkpoints=3"]
UNSEEN = ["split.unseen_clients=2", "unseen.adapt_epochs=1"]
PARTICIPANTS, NEWCOMERS = 3, [3, 4]


def digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder``, by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*")
            if p.is_file()}  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per method: the simulation with newcomers (its run folder is what gets onboarded from) and the exported
    client files (the newcomers' are the last two)."""
    made: dict[str, tuple] = {}

    def make(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            cfg = quick_config(*BASE, *UNSEEN, f"algorithm.name={name}")
            made[name] = (cfg, run(cfg, root / "sim").run_dir, export(cfg, root / "clients"))
        return made[name]

    return make


def onboarded(grid: NodeGrid) -> list[tuple[int, dict, dict]]:
    """(client, metrics, notes) of each onboarding reply the nodes sent."""
    out = []
    for msg, reply in grid.received:
        job = msg.content.config_records["fedmerge.job"]
        if msg.metadata.message_type == "evaluate" and job.get("onboard"):
            assert not reply.has_error(), reply.error.reason
            assert not reply.content.array_records  # metrics and a path only: never a weight
            notes = dict(reply.content.config_records["fedmerge.job"])
            out.append((int(job["cid"]), dict(reply.content.metric_records["metrics"]), notes))
    return out


@pytest.mark.parametrize("name", ["ditto", "fedmerge", "fedem"])
def test_a_deployed_newcomer_keeps_the_model_the_simulation_onboards(tmp_path, trained, task_identity, monkeypatch,
                                                                    capsys, name):  # fmt: skip
    from fedmerge.algorithms.privacy import build_algorithm
    from fedmerge.core.checkpoint import parse_checkpoint
    from fedmerge.core.types import Payload
    from fedmerge.engines.evaluation import predict_batched
    from fedmerge.engines.flower.newcomer import load_onboarded
    from fedmerge.engines.local import LocalEngine
    from fedmerge.metrics import classification_metrics
    from fedmerge.models import build_model
    from fedmerge.run.prepare import load_data

    cfg, run_dir, files = trained(name)
    before = digests(run_dir)
    grid = NodeGrid(files[PARTICIPANTS:], tmp_path / "state")
    server_app(grid, {"onboard": str(run_dir)}, monkeypatch)  # default: the last round (3), the run's budget (1)
    assert digests(run_dir) == before  # read only: not a byte changed, nothing added

    logged = RunStore(run_dir).read_metrics()[-1]
    assert logged["round"] == 3
    replies = onboarded(grid)
    assert sorted(cid for cid, _, _ in replies) == NEWCOMERS
    data = load_data(cfg)
    model = build_model(cfg.model, data.input_shape, data.num_classes, generator=torch.Generator().manual_seed(0))
    printed = capsys.readouterr().out
    for cid, metrics, notes in replies:
        # the node's numbers are the simulation's, bit for bit (the run logged them at its last round)
        assert metrics == logged["eval_unseen"]["clients"][str(cid)]
        path = Path(notes["saved"])
        assert path.parent.parent == tmp_path / "state" / f"node{cid - PARTICIPANTS}" and path.parent.name[:4] == "run-"
        assert f"client {cid}: " in printed and str(path) in printed
        models, meta = load_onboarded(path)
        assert meta["round"] == 3 and meta["adapt_epochs"] == 1 and meta["client_id"] == cid
        # the saved weights give the simulation's test metrics when evaluated again
        client = data.clients[cid]
        saved = models["dominant" if name == "fedem" else ""]
        model.load_state_dict(saved)
        again = classification_metrics(predict_batched(model, client.x_test, cfg.eval_batch_size), client.y_test)
        prefix = "dominant/" if name == "fedem" else ""
        assert {k: again[k] for k in ("acc", "nll")} == {k: metrics[f"{prefix}test_{k}"] for k in ("acc", "nll")}
        if name == "fedem":  # the mixture is a predictor: listed, not saved
            assert meta["not_saved"] == json.loads(notes["not_saved"]) == [""] and "predictor" in printed
        else:
            assert meta["not_saved"] == json.loads(notes["not_saved"]) == []

    # and they equal, tensor for tensor, the simulation's onboarding of the same client from the same state
    ckpt = parse_checkpoint(run_dir / "checkpoints" / "round-000003.safetensors", with_clients=False)

    def factory(generator):
        return build_model(cfg.model, data.input_shape, data.num_classes, generator=generator)

    algorithm = build_algorithm(cfg.algorithm, factory, PARTICIPANTS, cfg.seed, rounds=cfg.rounds)
    sent = algorithm.configure_onboard(ckpt.server_state, 3, NEWCOMERS)
    engine = LocalEngine(data.clients, model, torch.device("cpu"), cfg.seed, eval_batch_size=cfg.eval_batch_size)
    for cid, _, notes in replies:
        payload = Payload(sent[cid].tensors, {**sent[cid].meta, "adapt_epochs": 1})
        _, reference = engine.onboard_client(algorithm, 3, cid, payload, keep=True)
        models, _ = load_onboarded(notes["saved"])
        weights = {k: v for k, v in reference.items() if not callable(v)}
        assert weights.keys() == models.keys()
        for variant, state in weights.items():
            assert state.keys() == models[variant].keys()
            assert all(torch.equal(state[k], models[variant][k]) for k in state), (cid, variant)


def test_onboarding_reads_the_chosen_round_and_leaves_participants_nodes_alone(
    tmp_path, trained, task_identity, monkeypatch, capsys
):
    """Every node online (participants too): only the newcomers get a message; ``best`` onboards from the
    best-validation round (the reference there is that round's logged onboarding), ``partition-ids`` picks
    one newcomer, ``adapt-epochs`` overrides the run's budget."""
    cfg, run_dir, files = trained("ditto")
    best = json.loads((run_dir / "summary.json").read_text())["best_val"]["round"]
    logged = {r["round"]: r for r in RunStore(run_dir).read_metrics()}
    grid = NodeGrid(files, tmp_path / "state")
    server_app(grid, {"onboard": str(run_dir), "onboard-round": "best", "partition-ids": "4"}, monkeypatch)
    assert {int(m.content.config_records["fedmerge.job"]["cid"]) for m, _ in grid.received
            if m.metadata.message_type != "query"} == {4}  # fmt: skip
    ((cid, metrics, notes),) = onboarded(grid)
    assert metrics == logged[best]["eval_unseen"]["clients"]["4"]
    assert Path(notes["saved"]).name == f"onboarded-round-{best:06d}.safetensors"

    grid = NodeGrid(files, tmp_path / "state2")
    server_app(grid, {"onboard": str(run_dir), "onboard-round": "2", "adapt-epochs": "0"}, monkeypatch)
    replies = onboarded(grid)
    assert sorted(c for c, _, _ in replies) == NEWCOMERS
    from fedmerge.engines.flower.newcomer import load_onboarded

    _, meta = load_onboarded(replies[0][2]["saved"])
    assert meta["round"] == 2 and meta["adapt_epochs"] == 0
    assert replies[0][1] != logged[2]["eval_unseen"]["clients"]["3"]  # budget 0: the global model, not adapted
    capsys.readouterr()


def one_line_failure(grid, run_config: dict, monkeypatch, capsys) -> str:
    from fedmerge.apps.flower import DeploymentFailed

    with pytest.raises(DeploymentFailed) as stop:
        server_app(grid, run_config, monkeypatch)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"fedmerge: error: {stop.value}" and "\n" not in str(stop.value)
    return str(stop.value)


def test_onboarding_refusals_are_one_line(tmp_path, trained, task_identity, monkeypatch, capsys):
    from fedmerge.algorithms.ditto import Ditto
    from fedmerge.core.algorithm import Algorithm
    from fedmerge.engines.flower.federation import FlowerOptions

    cfg, run_dir, files = trained("ditto")
    before = digests(run_dir)
    newcomers = NodeGrid(files[PARTICIPANTS:], tmp_path / "state")
    said = one_line_failure(newcomers, {"onboard": str(tmp_path)}, monkeypatch, capsys)
    assert said == f"{tmp_path}: no config.yaml there; is it a run folder?"
    said = one_line_failure(newcomers, {"onboard": str(run_dir), "onboard-round": "7"}, monkeypatch, capsys)
    assert "round 7 was not kept (kept: rounds [1, 2, 3])" in said
    said = one_line_failure(newcomers, {"onboard": str(run_dir), "partition-ids": "1"}, monkeypatch, capsys)
    assert said.startswith("partition-id 1 took part in training (clients 0..2)")
    no_data = NodeGrid([None], tmp_path / "empty")
    said = one_line_failure(no_data, {"onboard": str(run_dir)}, monkeypatch, capsys)
    assert "cannot serve: this SuperNode has no data-path" in said
    import fedmerge.run.onboard as onboard_module

    monkeypatch.setattr(onboard_module, "flower_options", lambda cfg: FlowerOptions(connect_timeout=0.5))
    only_participants = NodeGrid(files[:PARTICIPANTS], tmp_path / "old")
    said = one_line_failure(only_participants, {"onboard": str(run_dir)}, monkeypatch, capsys)
    assert said.startswith("no SuperNode of a client that never trained (client id 3 or more) connected")
    monkeypatch.setattr(Ditto, "configure_onboard", Algorithm.configure_onboard)
    said = one_line_failure(newcomers, {"onboard": str(run_dir)}, monkeypatch, capsys)
    assert said == "ditto has no onboarding rule for clients that never trained: its run cannot onboard newcomers"
    assert digests(run_dir) == before


def test_a_node_that_fails_is_reported_after_the_others(tmp_path, trained, task_identity, monkeypatch, capsys):
    """Client 4's node fails while onboarding (a full disk): client 3 is onboarded and reported, then the ServerApp
    fails with client 4's reason in one line (so ``fedmerge deploy onboard`` exits 1)."""
    import fedmerge.engines.flower.worker as worker

    cfg, run_dir, files = trained("ditto")
    real = worker._onboard_deployed

    def fail_for_4(call, run_key):
        if call.cid == 4:
            raise OSError("disk full")
        return real(call, run_key)

    monkeypatch.setattr(worker, "_onboard_deployed", fail_for_4)
    said = one_line_failure(NodeGrid(files[PARTICIPANTS:], tmp_path / "state"), {"onboard": str(run_dir)},
                            monkeypatch, capsys)  # fmt: skip
    assert said == "client 4 failed: OSError: disk full"


def test_deploy_onboard_submits_the_onboarding_run(tmp_path, monkeypatch):
    """``fedmerge deploy onboard`` against a stand-in ``flwr``: the run config it submits (the app declares
    those keys), and exit status 1 with the ServerApp's line when the run failed."""
    from test_flower_operations import fake_program
    from typer.testing import CliRunner

    import fedmerge.apps.deploy as deploy
    from fedmerge.cli import app
    from fedmerge.engines.flower.__main__ import PYPROJECT

    calls = tmp_path / "calls.jsonl"
    flwr = fake_program(
        tmp_path,
        "flwr",
        f"""
open({str(calls)!r}, "a").write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1] == "run":
    print(json.dumps({{"success": True, "run-id": "42"}}))
elif sys.argv[1] == "ls":
    print(json.dumps({{"success": True, "runs": [{{"run-id": "42", "status": "finished:failed",
          "status-details": "ServerApp failed with exception: client 4 failed: no data"}}]}}))
""",
    )
    monkeypatch.setattr(deploy, "flower_command", lambda name: flwr)
    result = CliRunner().invoke(
        app, ["deploy", "onboard", "secure", "/srv/runs/x", "--round", "best", "--partition-id", "3",
              "--partition-id", "4", "--adapt-epochs", "2"]
    )  # fmt: skip
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == "error: Flower run 42 finished:failed: client 4 failed: no data"
    config = json.loads(calls.read_text().splitlines()[0])
    config = config[config.index("--run-config") + 1]
    for part in ('onboard="/srv/runs/x"', 'onboard-round="best"', 'partition-ids="3,4"', 'adapt-epochs="2"'):
        assert part in config
    for key in ("onboard", "onboard-round", "adapt-epochs", "partition-ids"):
        assert f'\n{key} = ""' in PYPROJECT
    bad = CliRunner().invoke(app, ["deploy", "onboard", "secure", "/srv/runs/x", "--round", "first"])
    assert bad.exit_code == 2 and "give last, best or a round number" in bad.output


def test_a_deployed_runs_newcomer_is_saved_under_that_runs_key(tmp_path, trained, task_identity, monkeypatch, capsys):
    """A run trained on three deployed nodes (federation.json, the run key in its checkpoints), then a site with a
    client id it never trained: onboarded from that run, its model kept under the run's own key."""
    from test_flower_nodes import deploy

    from fedmerge.core.checkpoint import load_checkpoint

    cfg = quick_config(*BASE, "partition.num_clients=3", "rounds=2", "algorithm.name=ditto")
    participants = export(cfg, tmp_path / "participants")
    result = deploy(tmp_path, cfg, NodeGrid(participants, tmp_path / "state"))
    before = digests(result.run_dir)
    _, _, files = trained("ditto")  # client 3 of the 5-client export is a newcomer here
    grid = NodeGrid(files[3:4], tmp_path / "newcomer")
    server_app(grid, {"onboard": str(result.run_dir)}, monkeypatch)
    ((cid, metrics, notes),) = onboarded(grid)
    key = load_checkpoint(result.run_dir / "checkpoints").meta["node_run_key"]
    assert cid == 3 and Path(notes["saved"]).parent == tmp_path / "newcomer" / "node0" / f"run-{key}"
    assert 0 <= metrics["test_acc"] <= 1 and digests(result.run_dir) == before
    assert f"client 3: test_acc={metrics['test_acc']:.4f}" in capsys.readouterr().out
    import shutil

    other = tmp_path / "other-run"  # the same run, as if its federation had had 3 classes
    shutil.copytree(result.run_dir, other)
    federation = json.loads((other / "federation.json").read_text())
    (other / "federation.json").write_text(json.dumps({**federation, "num_classes": 3}))
    said = one_line_failure(NodeGrid(files[3:4], tmp_path / "n2"), {"onboard": str(other)}, monkeypatch, capsys)
    assert said == (
        "the newcomers' data (10 classes, input [1, 8, 8]) differ from the run's federation "
        "(3 classes, input [1, 8, 8])"
    )
