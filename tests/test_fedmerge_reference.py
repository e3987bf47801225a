"""FedMerge's ``preset=reference`` against a literal transcription of the authors' server step.

The transcription follows the reference code (shutong043/FedMerge @ac60469, ``server_merging.aggregate``)
line by line, in its own order and arithmetic: merge weights from the logits, G_ij = w_ij *
<(Theta_j - theta_i)[head], Delta_i[head]> with Delta_i = theta0 - theta (the client's old minus new
model), global L1 normalisation, the stepping loop with a hard-coded 0.01 increment until the largest
logit change exceeds learning_rate_W (or 10,000 steps), then the column-normalised Theta update with
weights read from the *updated* logits. The project's closed-form step must agree to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedmerge.algorithms.fedmerge import FedMerge, FedMergeConfig
from fedmerge.config.schema import ConfigError, load_config
from fedmerge.core.types import ServerState, Update


def tiny_model(generator: torch.Generator) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4))


def reference_aggregate(theta, logits, deltas, n, head, learning_rate_w):
    """The reference's server step, transcribed. theta (d, P) float32; logits (m, d) float64;
    deltas: the project's delta_i = theta_i(after) - theta_i(before), float32. Returns (Theta, W, k)."""
    W = logits.numpy().copy()
    Theta = [theta[j].clone() for j in range(theta.shape[0])]
    m, d = W.shape
    p = n / n.sum()

    def rowsoftmax(a):
        e = np.exp(a - a.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    w = rowsoftmax(W)
    merged = [sum(float(w[i, j]) * Theta[j] for j in range(d)) for i in range(m)]  # what client i received
    Delta = [-deltas[i] for i in range(m)]  # theta0 - theta
    lo, hi = head
    G = np.zeros((m, d))
    for i in range(m):
        for j in range(d):
            G[i, j] = w[i, j] * torch.sum((Theta[j] - merged[i])[lo:hi] * Delta[i][lo:hi]).item()
    G = G / np.abs(G).sum()
    W0 = W.copy()
    k = 0
    while True:
        W = W - 0.01 * p[:, None] * G
        k += 1
        if np.abs(W - W0).max() > learning_rate_w or k > 10000:
            break
    w_new = rowsoftmax(W)  # the updated logits
    for j in range(d):
        omega = w_new[:, j] * p / (w_new[:, j] * p).sum()
        Theta[j] = Theta[j] - sum(float(omega[i]) * Delta[i] for i in range(m))
    return torch.stack(Theta), W, k


def problem(m: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    algo = FedMerge(FedMergeConfig(num_models=d, preset="reference", logit_lr=0.01), tiny_model, m, 0)
    P = algo.layout.num_floats
    theta = torch.randn(d, P, generator=gen)
    logits = 0.5 * torch.randn(m, d, generator=gen, dtype=torch.float64)
    deltas = 0.05 * torch.randn(m, P, generator=gen)
    n = torch.randint(20, 200, (m,), generator=gen).double().numpy()
    return algo, theta, logits, deltas, n


@pytest.mark.parametrize("m", [6, 50, 100])
@pytest.mark.parametrize("d", [4, 30, 60])
@pytest.mark.parametrize("logit_lr", [0.01, 0.05, 0.1])
def test_reference_preset_equals_the_transcribed_reference_step(m, d, logit_lr):
    algo, theta, logits, deltas, n = problem(m, d, seed=m * 1000 + d)
    algo.config = FedMergeConfig(num_models=d, preset="reference", logit_lr=logit_lr)
    lay = algo.layout
    assert algo.config.merge_grad == "head" and algo.config.logit_increment == 0.01
    updates = {
        i: Update(lay.state_dict(deltas[i], torch.zeros(0, dtype=torch.int64)), {"num_examples": int(n[i])})
        for i in range(m)
    }
    state = ServerState({"theta": theta.clone(), "counters": torch.zeros(d, 0, dtype=torch.int64), "logits": logits})
    new = algo.aggregate(state, 1, updates)
    ref_theta, ref_w, k = reference_aggregate(theta, logits, deltas, n, lay.head, logit_lr)

    step, ref_step = new.tensors["logits"] - logits, torch.from_numpy(ref_w) - logits
    # Inner products are float32 sums in both: agreement to float32 rounding of the largest change.
    tol = 1e-5 * float(ref_step.abs().max())
    assert torch.allclose(step, ref_step, rtol=0, atol=tol), (step - ref_step).abs().max()
    scale = float(theta.abs().max())
    assert torch.allclose(new.tensors["theta"], ref_theta, rtol=1e-5, atol=2e-6 * scale)
    if k > 10000:  # the cap binds: the largest change stays below the threshold
        assert float(step.abs().max()) < logit_lr
    else:
        assert float(step.abs().max()) > logit_lr


def test_cap_binds_at_many_clients_and_models():
    """m=100, d=60: the normalised gradient is so small that 10,000 increments do not reach 0.01."""
    algo, theta, logits, deltas, n = problem(100, 60, seed=7)
    _, _, k = reference_aggregate(theta, logits, deltas, n, algo.layout.head, 0.01)
    assert k == 10001


def test_theta_weights_after_differs_from_before():
    """The reference's reading of the updated logits changes Theta (the 0.2-0.8% per-round effect)."""
    algo, theta, logits, deltas, n = problem(6, 4, seed=1)
    lay = algo.layout
    updates = {
        i: Update(lay.state_dict(deltas[i], torch.zeros(0, dtype=torch.int64)), {"num_examples": int(n[i])})
        for i in range(6)
    }
    out = {}
    for weights in ("before", "after"):
        algo.config = FedMergeConfig(num_models=4, merge_grad="head", logit_increment=0.01, theta_weights=weights)
        zero = torch.zeros(4, 0, dtype=torch.int64)
        state = ServerState({"theta": theta.clone(), "counters": zero, "logits": logits})
        out[weights] = algo.aggregate(state, 1, updates)
    assert torch.equal(out["before"].tensors["logits"], out["after"].tensors["logits"])
    assert not torch.allclose(out["before"].tensors["theta"], out["after"].tensors["theta"], rtol=0, atol=1e-7)


def test_presets_fill_options_and_refuse_contradictions():
    ref = FedMergeConfig(preset="reference")
    assert (ref.merge_grad, ref.theta_weights, ref.logit_increment) == ("head", "after", 0.01)
    paper = FedMergeConfig(preset="paper")
    assert (paper.merge_grad, paper.theta_weights, paper.logit_increment) == ("all", "before", None)
    default = FedMergeConfig()
    assert all(getattr(default, k) == v for k, v in paper.model_dump().items() if k != "preset")
    assert FedMergeConfig(preset="reference", logit_lr=0.05).logit_lr == 0.05  # the threshold stays free
    with pytest.raises(ConfigError, match="contradicts preset 'reference'"):
        load_config(None, ["algorithm.name=fedmerge", "algorithm.preset=reference", "algorithm.merge_grad=all"])
    # A resolved config (every option written out) loads back unchanged.
    cfg = load_config(None, ["algorithm.name=fedmerge", "algorithm.preset=reference"])
    again = load_config(None, [f"algorithm.{k}={v}" for k, v in cfg.algorithm.model_dump().items() if v is not None])
    assert again.algorithm == cfg.algorithm
