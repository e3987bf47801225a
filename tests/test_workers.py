"""``workers: N``: clients in forked worker processes, bit-identical to ``workers: 1``; failures stop
the run with a clear message instead of hanging; the pipe transport keeps every tensor exactly."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from functools import partial
from pathlib import Path
from typing import Literal

import pytest
import torch
from helpers import assert_runs_identical, quick_config, run
from typer.testing import CliRunner

from fedmerge.algorithms.fedavg import FedAvg, FedAvgConfig
from fedmerge.cli import app
from fedmerge.config.schema import ConfigError, load_config
from fedmerge.core.algorithm import ALGORITHMS
from fedmerge.core.loop import RoundFailed
from fedmerge.core.registry import ComponentConfig
from fedmerge.core.seeding import torch_generator
from fedmerge.core.training import LocalTraining, local_sgd
from fedmerge.engines import workers
from fedmerge.engines.grouped_eval import forward_batches
from fedmerge.engines.local import LocalEngine
from fedmerge.engines.workers import Channel
from fedmerge.models import MODELS, build_model
from fedmerge.models.cnn import TwoCNN
from fedmerge.models.mlp import MLP
from fedmerge.models.registry import flat_size
from fedmerge.run.runner import run_experiment

# The TwoNN of the shipped SuPerFed config, 5 clients x 2 classes: big enough for multi-threaded kernels.
SUPERFED = Path(__file__).parent.parent / "configs" / "superfed_digits_pathological.yaml"
SMALL_SUPERFED = ["rounds=2", "eval_every=2", "partition.num_clients=5", "algorithm.start_round=2"]


class FaultyConfig(FedAvgConfig):
    name: Literal["test_fedavg_faulty"] = "test_fedavg_faulty"
    fault: Literal["raise", "kill"] = "raise"


@ALGORITHMS.register("test_fedavg_faulty", config=FaultyConfig, description="test only: client 1 fails in round 2")
class FaultyFedAvg(FedAvg):
    name = "test_fedavg_faulty"

    def client_update(self, payload, data, state, ctx):
        if ctx.cid == 1 and ctx.round == 2:
            if self.config.fault == "kill":  # only ever run in a worker process
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("injected failure of client 1 in round 2")
        return super().client_update(payload, data, state, ctx)


class DropoutMLPConfig(ComponentConfig):
    name: Literal["test_dropout_mlp"] = "test_dropout_mlp"


@MODELS.register("test_dropout_mlp", config=DropoutMLPConfig, description="test only: an MLP with dropout")
def build_dropout_mlp(cfg: DropoutMLPConfig, input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """Training draws from torch's global RNG (dropout masks): a worker that seeded it otherwise than the
    client's own (seed, round, client) changes the numbers."""
    model = MLP(flat_size(input_shape), (32,), num_classes)
    model.body.append(torch.nn.Dropout(0.5))
    return model


DROPOUT = ["model.name=test_dropout_mlp"]


@pytest.fixture(autouse=True)
def no_leftover_workers():
    yield
    assert mp.active_children() == [], "worker processes outlived their run"


def test_superfed_with_default_threads_same_on_one_and_two_workers(tmp_path):
    torch.set_num_threads(2)  # what a fresh process has on this machine; the config's threads=1 applies
    one = run(load_config(SUPERFED, [*SMALL_SUPERFED, "workers=1"]), tmp_path / "one")
    two = run(load_config(SUPERFED, [*SMALL_SUPERFED, "workers=2"]), tmp_path / "two")
    assert_runs_identical(one.run_dir, two.run_dir)


@pytest.mark.parametrize(
    "algorithm",
    [
        ["algorithm.name=local", "participation=0.5"],  # client state: the whole model, created on first visit
        ["algorithm.name=scaffold"],  # control variates in the client state and the update
        ["algorithm.name=fedmerge"],  # a different payload per client
        ["algorithm.name=fedem"],  # several models in the payload, weights in the state
    ],
    ids=lambda a: a[0].split("=")[1],
)
def test_workers_match_sequential_bit_for_bit(tmp_path, algorithm):
    one = run(quick_config(*algorithm, "rounds=3", "model.name=twonn", "workers=1"), tmp_path / "one")
    two = run(quick_config(*algorithm, "rounds=3", "model.name=twonn", "workers=2"), tmp_path / "two")
    assert_runs_identical(one.run_dir, two.run_dir)


@pytest.mark.parametrize("method", ["fedavg", "ditto"])
def test_evaluation_passes_shared_by_the_workers_match_one_process_bit_for_bit(tmp_path, monkeypatch, method):
    # FedAvg's grouped pass over every client's rows and Ditto's pooled test of its global model run as whole
    # batches in the workers (eval_batch_size 32: several batches each); every metric stays that of one process
    spread: list[bool] = []
    shared = LocalEngine._forward_in_workers

    def counted(engine, *args):
        out = shared(engine, *args)
        spread.append(out is not None)
        return out

    monkeypatch.setattr(LocalEngine, "_forward_in_workers", counted)
    case = [f"algorithm.name={method}", "rounds=2", "model.name=twonn", "eval_batch_size=32"]
    one = run(quick_config(*case, "workers=1"), tmp_path / "one")
    assert not any(spread)
    two = run(quick_config(*case, "workers=2"), tmp_path / "two")
    assert any(spread), "no evaluation pass ran in the workers"
    assert_runs_identical(one.run_dir, two.run_dir)


def test_a_pass_in_the_workers_keeps_the_rows_layout_and_every_bit():
    # Fashion-MNIST's rows have channels-last strides (one channel: (784, 1, 28, 1)); the pipe sends them
    # contiguous, and a convolution over the other layout takes another kernel (other last bits)
    torch.set_num_threads(1)
    model = TwoCNN(1, (28, 28), 10)
    x = torch.randn(300, 28, 28, 1, generator=torch.Generator().manual_seed(0)).permute(0, 3, 1, 2)
    assert x.stride() == (784, 1, 28, 1)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = LocalEngine([], model, torch.device("cpu"), 0, workers=2)
    engine._pool = workers.WorkerPool(2, partial(engine._run_task, None))  # as a round's fit leaves it
    try:
        ends = [64, 128, 192, 256, 300]
        spread = engine._forward_in_workers(weights, x, ends)
        assert spread is not None
        assert torch.equal(spread, forward_batches(model, x, ends))
    finally:
        engine.close()


def test_the_dropout_model_draws_from_the_global_rng_in_training():
    """What makes the two tests below able to fail: its training depends on the global RNG's state."""
    x, y = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)), torch.arange(64) % 2
    trained = []
    for global_seed in (1, 2):
        model = build_model({"name": "test_dropout_mlp"}, (4,), 2, torch.Generator().manual_seed(0))
        torch.manual_seed(global_seed)
        local_sgd(model, x, y, LocalTraining(lr=0.1, batch_size=16), torch_generator(0, 1, 0, "train"))
        trained.append(model.state_dict())
    assert any(not torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


@pytest.mark.parametrize("algorithm", ["fedavg", "ditto"])
def test_a_model_with_dropout_gives_the_same_bits_on_one_and_two_workers(tmp_path, algorithm):
    case = [*DROPOUT, f"algorithm.name={algorithm}", "rounds=3", "participation=0.5"]
    one = run(quick_config(*case, "workers=1"), tmp_path / "one")
    two = run(quick_config(*case, "workers=2"), tmp_path / "two")
    assert_runs_identical(one.run_dir, two.run_dir)


@pytest.mark.parametrize("model", [[], DROPOUT], ids=["mlp", "dropout"])
def test_resume_on_workers_is_bit_identical(tmp_path, model):
    case = [*model, "algorithm.name=ditto", "participation=0.5", "rounds=4"]
    full = run(quick_config(*case, "workers=1"), tmp_path / "full")  # uninterrupted
    run(quick_config(*case, "workers=2"), tmp_path / "cut", stop_after=2)
    # the worker count may change on resume: it changes no number
    resumed = run_experiment(quick_config(*case, "workers=3"), tmp_path / "cut", resume=True, show_progress=False)
    assert_runs_identical(full.run_dir, resumed.run_dir)


def test_client_exception_in_a_worker_is_raised_as_in_process(tmp_path):
    cfg = quick_config("algorithm.name=test_fedavg_faulty", "workers=2")
    with pytest.raises(ValueError, match="injected failure of client 1 in round 2") as info:
        run(cfg, tmp_path / "r")
    assert "client_update" in str(info.value.__cause__)  # the worker's traceback


def test_dead_worker_stops_the_run_with_one_line(tmp_path):
    cfg = quick_config("algorithm.name=test_fedavg_faulty", "algorithm.fault=kill", "workers=2")
    with pytest.raises(RoundFailed, match=r"round 2: worker process \d+ died \(killed by SIGKILL"):
        run(cfg, tmp_path / "r")
    result = CliRunner().invoke(
        app,
        ["run", "algorithm.name=test_fedavg_faulty", "algorithm.fault=kill", "workers=2", "rounds=3", "--no-progress"]
        + [f"output_dir={tmp_path}", "partition.num_clients=4"],
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "client 1's fit" in result.output and "--resume" in result.output


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["workers=2", "threads=2"], "threads must be 1"),
        (["workers=2", "threads=null"], "threads must be 1"),
        (["workers=2", "engine=flower"], "option of engine=local"),
    ],
)
def test_impossible_worker_settings_are_config_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run(quick_config(*overrides), tmp_path / "r")


def test_channel_round_trips_tensors_exactly_and_sends_shared_ones_once(monkeypatch):
    a, b = mp.Pipe()
    sender, receiver = Channel(a), Channel(b)
    shared = torch.randn(4, 3)
    obj = {
        "f": torch.randn(5, 2).t(),  # non-contiguous
        "h": torch.randn(3).bfloat16(),
        "i": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "b": torch.tensor([True, False]),
        "s": torch.tensor(2.5, dtype=torch.float64),  # 0-dim
        "e": torch.empty(0, 7),
        "g": torch.ones(2, requires_grad=True),
        "same": [shared, shared],
        "meta": {"round": 3, "loss": 0.25},
    }
    sender.send(obj, batch=1)
    got = receiver.recv()
    for k in ("f", "h", "i", "b", "s", "e", "g"):
        assert got[k].dtype == obj[k].dtype and got[k].shape == obj[k].shape and torch.equal(got[k], obj[k]), k
    assert got["g"].requires_grad and got["meta"] == obj["meta"]
    assert got["same"][0] is got["same"][1] and torch.equal(got["same"][0], shared)

    # Within a batch, a tensor sent before crosses as a key only; a new batch sends its bytes again.
    raw: list[int] = []
    write_all = workers._write_all
    monkeypatch.setattr(workers, "_write_all", lambda fd, data: (raw.append(data.nbytes), write_all(fd, data)))
    sender.send({"w": shared}, batch=1)
    assert receiver.recv()["w"] is got["same"][0] and raw == []
    sender.send({"w": shared}, batch=2)
    assert torch.equal(receiver.recv()["w"], shared) and raw == [shared.numel() * 4]
