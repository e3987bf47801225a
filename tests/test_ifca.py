"""IFCA: reduction to FedAvg, cluster recovery on two rotated groups, re-drawn initial models,
the weight-sharing variant, exact resume."""

import torch
from helpers import assert_runs_identical, quick_config, run

from fedmerge.algorithms.ifca import IFCA, IFCAConfig
from fedmerge.core.types import Update
from fedmerge.models import build_model
from fedmerge.report.plot_merge_weights import client_groups
from fedmerge.run.results import RunStore
from fedmerge.run.runner import run_experiment

SMALL = ["dataset.max_samples=600"]


def tiny_ifca(**kw) -> IFCA:
    def factory(gen: torch.Generator) -> torch.nn.Module:
        return build_model({"name": "mlp", "hidden": (4,)}, (3,), 2, generator=gen)

    return IFCA(IFCAConfig(**kw), factory, num_clients=4, seed=0)


def fake_updates(alg: IFCA, clusters: list[int]) -> dict[int, Update]:
    models = [alg.initial_weights(f"fake-{c}") for c in range(len(clusters))]
    return {c: Update(models[c], {"num_examples": 10 * (c + 1), "cluster": j}) for c, j in enumerate(clusters)}


def test_one_cluster_is_fedavg(tmp_path):
    a = run(quick_config("rounds=3", *SMALL), tmp_path / "fedavg")
    b = run(quick_config("rounds=3", *SMALL, "algorithm.name=ifca", "algorithm.num_clusters=1"), tmp_path / "ifca")
    assert_runs_identical(a.run_dir, b.run_dir)


def test_assigns_rotated_groups_to_their_own_cluster(tmp_path):
    # digits at 0 and 180 degrees; min_cluster_share re-draws the initial models while they collapse
    cfg = quick_config(
        "partition.name=domain",
        "partition.by=rotation",
        "partition.num_groups=2",
        "algorithm.name=ifca",
        "algorithm.num_clusters=2",
        "algorithm.min_cluster_share=0.3",
    )
    res = run(cfg, tmp_path / "r")
    groups = client_groups(res.run_dir)
    assert groups is not None and sorted(set(groups)) == [0, 1]
    last = RunStore(res.run_dir).read_metrics()[-1]["server"]
    chosen = [max(range(2), key=row.__getitem__) for row in last["merge_weights"]]
    assert all(max(row) == 1.0 for row in last["merge_weights"])  # every client has been assigned
    mapping = {g: c for g, c in zip(groups, chosen)}
    assert len(set(mapping.values())) == 2 and chosen == [mapping[g] for g in groups]
    assert last["init_attempt"] >= 1  # the first draw collapsed and was re-drawn
    assert sorted(last["cluster_sizes"]) == [3, 3]


def test_min_cluster_share_redraws_until_each_cluster_is_used():
    alg = tiny_ifca(num_clusters=2, min_cluster_share=0.25, max_init_attempts=3)
    s0 = alg.init_server_state()
    s1 = alg.aggregate(s0, 1, fake_updates(alg, [0, 0, 0, 0]))  # collapsed: re-drawn, updates dropped
    assert s1.meta["init_attempt"] == 1 and not s1.meta["init_done"]
    assert not torch.equal(s1.tensors["classifier.weight"], s0.tensors["classifier.weight"])
    ups = fake_updates(alg, [0, 1, 0, 0])  # 1 of 4 = the share: accepted and averaged per cluster
    s2 = alg.aggregate(s1, 2, ups)
    assert s2.meta["init_done"] and s2.meta["clusters"] == {"0": 0, "1": 1, "2": 0, "3": 0}
    n = {c: ups[c].num_examples for c in ups}
    expect0 = sum(n[c] * ups[c].tensors["classifier.weight"] for c in (0, 2, 3)) / (n[0] + n[2] + n[3])
    assert torch.allclose(s2.tensors["classifier.weight"], expect0)
    assert torch.equal(s2.tensors["m1/classifier.weight"], ups[1].tensors["classifier.weight"])
    # accepted: a later collapse is not re-drawn any more
    assert alg.aggregate(s2, 3, fake_updates(alg, [1, 1, 1, 1])).meta["init_attempt"] == 1
    # the cap: after max_init_attempts draws the last one is kept
    capped = tiny_ifca(num_clusters=2, min_cluster_share=0.5, max_init_attempts=1)
    assert capped.aggregate(capped.init_server_state(), 1, fake_updates(capped, [0] * 4)).meta["init_done"]


def test_shared_body_keeps_one_body_and_a_head_per_cluster():
    alg = tiny_ifca(num_clusters=3, shared_body=True)
    state = alg.init_server_state()
    assert sorted(k for k in state.tensors if k.startswith("m")) == [
        "m1/classifier.bias", "m1/classifier.weight", "m2/classifier.bias", "m2/classifier.weight",
    ]  # fmt: skip
    ups = fake_updates(alg, [0, 0, 1, 1])
    new = alg.aggregate(state, 1, ups)
    n = [ups[c].num_examples for c in range(4)]
    body = sum(n[c] * ups[c].tensors["body.1.weight"] for c in range(4)) / sum(n)
    assert torch.allclose(new.tensors["body.1.weight"], body)  # the body: all clients
    head1 = (n[2] * ups[2].tensors["classifier.weight"] + n[3] * ups[3].tensors["classifier.weight"]) / (n[2] + n[3])
    assert torch.allclose(new.tensors["m1/classifier.weight"], head1)  # heads: per cluster
    assert torch.equal(new.tensors["m2/classifier.weight"], state.tensors["m2/classifier.weight"])  # unused
    models = alg._models(new.tensors)
    assert all(torch.equal(m["body.1.weight"], new.tensors["body.1.weight"]) for m in models)


def test_resume_is_exact(tmp_path):
    cfg = quick_config(
        *SMALL,
        "algorithm.name=ifca",
        "algorithm.num_clusters=2",
        "algorithm.shared_body=true",
        "algorithm.min_cluster_share=0.3",
        "algorithm.weighting=uniform",
        "participation=0.5",
    )
    full = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "cut", stop_after=2)
    resumed = run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    assert_runs_identical(full.run_dir, resumed.run_dir)
    comm = full.summary["communication_per_client_per_round"]
    model = full.summary["parameters"]["model"]
    assert comm["up"] == model and model < comm["down"] < 2 * model  # body once + 2 heads down
