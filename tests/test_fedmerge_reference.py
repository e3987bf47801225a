"""FedMerge's ``preset=reference`` against a literal transcription of the authors' server step.

The transcription follows the reference code (shutong043/FedMerge @ac60469, ``server_merging.aggregate``
and ``merging_utils``) line by line, in its own order and arithmetic, on state dicts: merge weights
from the logits, G_ij = w_ij * <top(Theta_j - theta_i), top(Delta_i)> with Delta_i = theta0 - theta
(the client's old minus new model), ``top`` the entries from the first key containing 'linear' on (the
whole state dict when none does), the inner product summed key by key in float32 and accumulated as a
Python float, skipping BatchNorm statistics, then global L1 normalisation, the stepping loop with a
hard-coded 0.01 increment until the largest logit change exceeds learning_rate_W (or 10,000 steps),
then the column-normalised Theta update with weights read from the *updated* logits. The project's
closed-form step must agree to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedmerge.algorithms.fedmerge import FedMerge, FedMergeConfig
from fedmerge.config.schema import ConfigError, load_config
from fedmerge.core.types import ServerState, Update


class Tiny(nn.Module):
    """Named like the reference's ResNet: the head is ``linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(6, 5)
        self.linear = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.relu(self.hidden(x)))


def tiny_model(generator: torch.Generator) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
    return Tiny()


def unnamed_model(generator: torch.Generator) -> nn.Module:
    """No key contains 'linear' (as in this project's models): the reference takes the whole model."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4))


def get_top_layers_from_key(state_dict, keyword):
    top, collecting = {}, False
    for key in state_dict:
        collecting = collecting or keyword in key
        if collecting:
            top[key] = state_dict[key]
    return top if collecting else state_dict


def state_dict_inner_product(a, b):
    total = 0.0
    for key in a:
        if not any(word in key for word in ("num_batches_tracked", "running_mean", "running_var")):
            total += torch.sum(a[key] * b[key]).item()
    return total


def reference_aggregate(theta, logits, deltas, n, layout, learning_rate_w):
    """The reference's server step, transcribed. theta (d, P) float32; logits (m, d) float64;
    deltas: the project's delta_i = theta_i(after) - theta_i(before), float32. Returns (Theta, W, k)."""

    def as_state_dict(row):  # in the model's key order, as the reference iterates it
        sd = layout.state_dict(row, torch.zeros(0, dtype=torch.int64))
        return {key: sd[key] for key in layout.state_keys if key in sd}

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
    G = np.zeros((m, d))
    for i in range(m):
        top_delta = get_top_layers_from_key(as_state_dict(Delta[i]), "linear")
        for j in range(d):
            diff = get_top_layers_from_key(as_state_dict(Theta[j] - merged[i]), "linear")
            G[i, j] = w[i, j] * state_dict_inner_product(diff, top_delta)
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


def problem(m: int, d: int, seed: int, model=tiny_model):
    gen = torch.Generator().manual_seed(seed)
    algo = FedMerge(FedMergeConfig(num_models=d, preset="reference", logit_lr=0.01), model, m, 0)
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
    assert algo.config.merge_grad == "from_key" and algo.config.logit_increment == 0.01
    updates = {
        i: Update(lay.state_dict(deltas[i], torch.zeros(0, dtype=torch.int64)), {"num_examples": int(n[i])})
        for i in range(m)
    }
    state = ServerState({"theta": theta.clone(), "counters": torch.zeros(d, 0, dtype=torch.int64), "logits": logits})
    new = algo.aggregate(state, 1, updates)
    ref_theta, ref_w, k = reference_aggregate(theta, logits, deltas, n, lay, logit_lr)

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
    _, _, k = reference_aggregate(theta, logits, deltas, n, algo.layout, 0.01)
    assert k == 10001


def test_reference_preset_on_a_model_without_linear_keys_takes_every_parameter():
    """This project's models name their head ``classifier``: the reference's rule then takes the whole
    model, and the step still equals the transcription."""
    m, d = 6, 4
    algo, theta, logits, deltas, n = problem(m, d, seed=5, model=unnamed_model)
    lay = algo.layout
    assert algo._merge_columns() == slice(0, lay.num_params) != slice(*lay.head)
    updates = {
        i: Update(lay.state_dict(deltas[i], torch.zeros(0, dtype=torch.int64)), {"num_examples": int(n[i])})
        for i in range(m)
    }
    state = ServerState({"theta": theta.clone(), "counters": torch.zeros(d, 0, dtype=torch.int64), "logits": logits})
    new = algo.aggregate(state, 1, updates)
    ref_theta, ref_w, _ = reference_aggregate(theta, logits, deltas, n, lay, 0.01)
    ref_step = torch.from_numpy(ref_w) - logits
    assert torch.allclose(new.tensors["logits"] - logits, ref_step, rtol=0, atol=1e-5 * float(ref_step.abs().max()))
    assert torch.allclose(new.tensors["theta"], ref_theta, rtol=1e-5, atol=2e-6 * float(theta.abs().max()))


class AfterHead(nn.Module):
    """A parameter after the head (the last Linear layer), which the stack moves last."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(6, 5)
        self.bn = nn.BatchNorm1d(5)
        self.linear = nn.Linear(5, 4)
        self.post = nn.LayerNorm(4)


@pytest.mark.parametrize(
    ("model", "word", "keys", "one_range"),
    [
        (Tiny, "linear", ["linear.weight", "linear.bias"], True),
        (Tiny, "nowhere", ["hidden.weight", "hidden.bias", "linear.weight", "linear.bias"], True),
        # BatchNorm statistics are left out; the head moved last still makes one range with the body's suffix
        (AfterHead, "bn", ["bn.weight", "bn.bias", "linear.weight", "linear.bias", "post.weight", "post.bias"], True),
        (AfterHead, "linear.bias", ["linear.bias", "post.weight", "post.bias"], False),
    ],
)
def test_from_key_columns_are_the_parameters_from_the_first_matching_key_on(model, word, keys, one_range):
    lay = FedMerge(FedMergeConfig(num_models=2), lambda g: model(), 3, 0).layout
    cols = lay.param_columns_from_key(word)
    got = torch.arange(lay.num_floats)[cols] if isinstance(cols, slice) else cols
    want = torch.cat([torch.arange(off, off + shape.numel()) for key, shape, off in lay.floats if key in keys])
    assert torch.equal(got.sort().values, want.sort().values)
    assert isinstance(cols, slice) == one_range


def test_theta_weights_after_moves_theta_by_the_change_of_the_column_weights():
    """``after`` steps Theta_j with omega' (the updated logits) instead of omega: the two results differ
    by exactly sum_i (omega'_ij - omega_ij) delta_i, computed here in float64 from the returned logits.
    The largest logit change is 0.01, which moves each weight by about 1% at most, so the difference is
    a small fraction of the Theta step: between 0.1% and 2% of it (0.4% here)."""
    algo, theta, logits, deltas, n = problem(6, 4, seed=1)
    lay = algo.layout
    updates = {
        i: Update(lay.state_dict(deltas[i], torch.zeros(0, dtype=torch.int64)), {"num_examples": int(n[i])})
        for i in range(6)
    }
    out = {}
    for weights in ("before", "after"):
        algo.config = FedMergeConfig(
            num_models=4, merge_grad="head", logit_lr=0.01, logit_increment=0.01, theta_weights=weights
        )
        zero = torch.zeros(4, 0, dtype=torch.int64)
        state = ServerState({"theta": theta.clone(), "counters": zero, "logits": logits})
        out[weights] = algo.aggregate(state, 1, updates)
    new_logits = out["after"].tensors["logits"]
    assert torch.equal(out["before"].tensors["logits"], new_logits)
    p = torch.from_numpy(n / n.sum())

    def omega(a):
        c = p[:, None] * torch.softmax(a, dim=1)
        return c / c.sum(dim=0, keepdim=True)

    want = (omega(new_logits) - omega(logits)).t() @ deltas.double()
    got = (out["after"].tensors["theta"] - out["before"].tensors["theta"]).double()
    assert torch.allclose(got, want, rtol=0, atol=1e-3 * float(want.abs().max()))
    theta_step = (out["before"].tensors["theta"] - theta).double()
    assert 0.001 < float(want.norm() / theta_step.norm()) < 0.02


def test_presets_fill_options_and_refuse_contradictions():
    ref = FedMergeConfig(preset="reference")
    assert (ref.merge_grad, ref.merge_grad_key, ref.theta_weights, ref.logit_increment) == (
        "from_key",
        "linear",
        "after",
        0.01,
    )
    paper = FedMergeConfig(preset="paper")
    assert (paper.merge_grad, paper.theta_weights, paper.logit_increment) == ("all", "before", None)
    default = FedMergeConfig()
    assert all(getattr(default, k) == v for k, v in paper.model_dump().items() if k != "preset")
    assert FedMergeConfig(preset="reference", logit_lr=0.05).logit_lr == 0.05  # the threshold stays free
    with pytest.raises(ConfigError, match="contradicts preset 'reference'"):
        load_config(None, ["algorithm.name=fedmerge", "algorithm.preset=reference", "algorithm.merge_grad=all"])
    # The reference preset's former head rule, as run folders and study rows of that time wrote it, still
    # loads as written (and only that value: any other contradiction is refused above).
    former = load_config(None, ["algorithm.name=fedmerge", "algorithm.preset=reference", "algorithm.merge_grad=head"])
    assert former.algorithm.merge_grad == "head" and former.algorithm.theta_weights == "after"
    with pytest.raises(ConfigError, match="contradicts preset 'paper'"):
        load_config(None, ["algorithm.name=fedmerge", "algorithm.preset=paper", "algorithm.merge_grad=head"])
    # A resolved config (every option written out) loads back unchanged.
    cfg = load_config(None, ["algorithm.name=fedmerge", "algorithm.preset=reference"])
    again = load_config(None, [f"algorithm.{k}={v}" for k, v in cfg.algorithm.model_dump().items() if v is not None])
    assert again.algorithm == cfg.algorithm


def test_reference_preset_sets_the_client_sgd_unless_written(tmp_path):
    """The reference hard-codes SGD lr 0.01 (no momentum, no weight decay), 2 local epochs of batch 32.
    Rule: a value the user wrote (file, override, Python argument) wins; the command line's built-in
    defaults (lr 0.2) do not count as written."""
    client = ("lr", "local_epochs", "batch_size", "momentum", "weight_decay")
    reference = (0.01, 2, 32, 0.0, 0.0)
    assert tuple(getattr(FedMergeConfig(preset="reference"), k) for k in client) == reference
    cli = load_config(None, ["algorithm.name=fedmerge", "algorithm.preset=reference"]).algorithm
    assert tuple(getattr(cli, k) for k in client) == reference
    assert load_config(None, ["algorithm.name=fedmerge"]).algorithm.lr == 0.2  # without the preset: the default
    assert FedMergeConfig(preset="reference", lr=0.1, momentum=0.9).model_dump()["lr"] == 0.1
    assert FedMergeConfig(preset="reference", lr=0.1, momentum=0.9).momentum == 0.9
    written = load_config(None, ["algorithm.name=fedmerge", "algorithm.preset=reference", "algorithm.lr=0.2"])
    assert (written.algorithm.lr, written.algorithm.local_epochs) == (0.2, 2)  # equal to the default, but written
    # The studies' pattern: a base file writes lr and local_epochs, the row switches to FedMerge.
    base = tmp_path / "base.yaml"
    base.write_text("algorithm: {name: fedavg, lr: 0.05, local_epochs: 1, batch_size: 16}\n")
    row = load_config(base, ["algorithm.name=fedmerge", "algorithm.preset=reference", "algorithm.lr=0.1"]).algorithm
    assert (row.lr, row.local_epochs, row.batch_size, row.momentum) == (0.1, 1, 16, 0.0)
    only_file = tmp_path / "fedmerge.yaml"
    only_file.write_text("algorithm: {name: fedmerge, preset: reference, local_epochs: 3}\n")
    mixed = load_config(only_file).algorithm
    assert (mixed.lr, mixed.local_epochs) == (0.01, 3)
