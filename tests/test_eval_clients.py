"""``eval_clients``: which clients' personalised models are evaluated (all, a fixed sample, participants)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_runs_identical, quick_config, run

from fedmerge.config.schema import ConfigError, load_config
from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.core.loop import Schedule
from fedmerge.run.results import RunStore


def evaluated(run_dir) -> list[list[int]]:
    return [sorted(int(c) for c in r["eval"]["clients"]) for r in RunStore(run_dir).read_metrics() if "eval" in r]


def test_all_is_the_default_and_leaves_config_and_numbers_unchanged(tmp_path):
    default = run(quick_config("rounds=2"), tmp_path / "default")
    explicit = run(quick_config("rounds=2", "eval_clients=all"), tmp_path / "all")
    assert_runs_identical(default.run_dir, explicit.run_dir)
    assert evaluated(default.run_dir) == [list(range(6))] * 2
    # old run folders stay resumable: the default is not written to config.yaml
    assert "eval_clients" not in (default.run_dir / "config.yaml").read_text()


def test_sample_is_the_same_clients_in_every_round_and_for_every_method(tmp_path):
    common = ["partition.num_clients=10", "rounds=3", "participation=0.3", "eval_clients=sample:4"]
    fedavg = run(quick_config(*common), tmp_path / "fedavg")
    ditto = run(quick_config(*common, "algorithm.name=ditto"), tmp_path / "ditto")
    rounds = evaluated(fedavg.run_dir)
    assert len(rounds) == 3 and len(rounds[0]) == 4 and all(r == rounds[0] for r in rounds)
    assert evaluated(ditto.run_dir) == rounds
    assert rounds[0] == list(Schedule(3, 10, seed=0, eval_clients="sample:4").evaluated(1, []))
    # the summaries are computed over the evaluated clients only
    rows = RunStore(fedavg.run_dir).read_metrics()
    assert rows[-1]["summary"]["test_acc"]["mean"] == pytest.approx(
        sum(rows[-1]["eval"]["clients"][str(c)]["test_acc"] for c in rounds[0]) / 4
    )
    assert fedavg.summary["last"]["clients"]["test_acc"] == rows[-1]["summary"]["test_acc"]
    assert "best_val" in fedavg.summary


def test_sample_depends_on_the_seed_and_covers_everyone_when_k_is_large():
    a, b = (Schedule(1, 1000, seed=s, eval_clients="sample:20").evaluated(1, []) for s in (0, 1))
    assert len(set(a)) == 20 and a != b and all(0 <= c < 1000 for c in a)
    assert Schedule(1, 5, eval_clients="sample:50").evaluated(1, []) == [0, 1, 2, 3, 4]


def test_participants_evaluates_exactly_the_round_s_sampled_clients(tmp_path):
    res = run(quick_config("partition.num_clients=8", "participation=0.5", "eval_clients=participants"), tmp_path / "p")
    rows = RunStore(res.run_dir).read_metrics()
    assert all(sorted(int(c) for c in r["eval"]["clients"]) == r["selected"] for r in rows)
    assert len({tuple(r["selected"]) for r in rows}) > 1


def test_the_choice_does_not_change_training(tmp_path):
    common = ["rounds=3", "participation=0.5", "algorithm.name=ditto"]  # personal models made on first use
    every = load_checkpoint(run(quick_config(*common), tmp_path / "all").run_dir / "checkpoints")
    some = load_checkpoint(run(quick_config(*common, "eval_clients=sample:2"), tmp_path / "s").run_dir / "checkpoints")
    assert all(torch.equal(v, some.server_state.tensors[k]) for k, v in every.server_state.tensors.items())
    assert set(some.client_states) < set(every.client_states)  # a client neither sampled nor evaluated has none
    for cid, state in some.client_states.items():
        assert all(torch.equal(v, every.client_states[cid].tensors[k]) for k, v in state.tensors.items())


def test_sample_gives_the_same_numbers_on_one_and_two_workers(tmp_path):
    common = ["partition.num_clients=8", "rounds=2", "participation=0.5", "eval_clients=sample:3", "model.name=twonn"]
    one = run(quick_config(*common, "workers=1"), tmp_path / "one")
    two = run(quick_config(*common, "workers=2"), tmp_path / "two")
    assert_runs_identical(one.run_dir, two.run_dir)
    assert len(evaluated(one.run_dir)[0]) == 3


@pytest.mark.parametrize(
    "value, needle",
    [
        ("sample:0", r"^eval_clients: sample:K needs K >= 1 clients \(all: every client\)"),
        ("sample:-2", r"^eval_clients: sample:K needs K >= 1 clients"),
        ("sample:x", r"^eval_clients: expected all, participants .* sample:K"),
        ("some", r"^eval_clients: expected all, participants .* sample:K"),
        ("sample:1.5", r"^eval_clients: expected all, participants .* sample:K"),
    ],
)
def test_bad_values_are_one_line_config_errors(value, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(None, [f"eval_clients={value}"])
    assert "\n" not in str(err.value)


def test_a_sample_logs_the_merge_weights_of_the_evaluated_clients_only(tmp_path):
    common = ["partition.name=cluster", "partition.num_clients=10", "rounds=2", "participation=0.5"]
    common += ["algorithm.name=ifca", "algorithm.num_clusters=2"]
    every = RunStore(run(quick_config(*common), tmp_path / "all").run_dir).read_metrics()
    some_run = run(quick_config(*common, "eval_clients=sample:4"), tmp_path / "some")
    some = RunStore(some_run.run_dir).read_metrics()
    sample = Schedule(2, 10, seed=0, eval_clients="sample:4").evaluated(1, [])
    for full, part in zip(every, some, strict=True):
        assert len(full["server"]["merge_weights"]) == 10 and "merge_weights" not in part["server"]
        assert part["server"]["merge_weights_clients"] == {str(c): full["server"]["merge_weights"][c] for c in sample}
        assert part["server"]["cluster_sizes"] == full["server"]["cluster_sizes"]
    # cluster recovery is then scored on the sample
    assert set(some_run.summary["cluster_recovery"]["ari_by_round"]) == {"1", "2"}
