import copy

import pytest
import torch

from fedmerge.core.params import flatten, unflatten, weighted_average
from fedmerge.core.registry import ComponentConfig, Registry
from fedmerge.core.seeding import derive_seed, torch_generator
from fedmerge.core.training import LocalTraining, batch_slices, iterate_minibatches, local_sgd
from fedmerge.core.types import ClientState, Payload, Update


def test_records_round_trip_through_bytes():
    p = Payload({"w": torch.randn(3, 4), "n": torch.arange(5), "h": torch.randn(2).half()}, {"round": 3, "x": [1, 2]})
    q = Payload.from_bytes(p.to_bytes())
    assert isinstance(q, Payload)
    assert q.meta == p.meta
    for k in p.tensors:
        assert q.tensors[k].dtype == p.tensors[k].dtype
        assert torch.equal(q.tensors[k], p.tensors[k])
    u = Update.from_bytes(Update({"a": torch.ones(2)}, {"num_examples": 7}).to_bytes())
    assert u.num_examples == 7
    assert ClientState.from_bytes(ClientState().to_bytes()).tensors == {}


def test_num_parameters_counts_floats_only():
    assert Payload({"w": torch.zeros(3, 4), "c": torch.zeros(5, dtype=torch.long)}).num_parameters() == 12


def test_weighted_average_matches_formula_and_rounds_integer_buffers():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(10)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(20)}
    avg = weighted_average([a, b], [1, 3])
    assert torch.allclose(avg["w"], torch.tensor([2.5, 5.0]))
    assert avg["n"].dtype == torch.long and int(avg["n"]) == 18  # round(17.5) -> 18 (banker's: 18)
    with pytest.raises(ValueError):
        weighted_average([a], [0])


def test_flatten_unflatten_inverse():
    s = {"a": torch.randn(2, 3), "b": torch.randn(4)}
    v = flatten(s)
    assert v.shape == (10,)
    back = unflatten(v, s)
    assert all(torch.equal(back[k], s[k]) for k in s)
    with pytest.raises(ValueError):
        unflatten(torch.zeros(11), s)


def test_seeds_depend_on_every_key_part_and_are_stable():
    base = derive_seed(1, 2, 3, "train")
    assert base == derive_seed(1, 2, 3, "train")
    assert (
        len(
            {
                base,
                derive_seed(2, 2, 3, "train"),
                derive_seed(1, 3, 3, "train"),
                derive_seed(1, 2, 4, "train"),
                derive_seed(1, 2, 3, "eval"),
            }
        )
        == 5
    )
    a = torch.rand(4, generator=torch_generator(0, 1, 2, "x"))
    b = torch.rand(4, generator=torch_generator(0, 1, 2, "x"))
    assert torch.equal(a, b)


def test_batches_never_have_a_single_sample_and_cover_everything():
    for n in range(1, 100):
        sl = batch_slices(n, 8)
        sizes = [s.stop - s.start for s in sl]
        assert sum(sizes) == n
        assert n == 1 or min(sizes) > 1
    idx = list(iterate_minibatches(10, 4, torch.Generator().manual_seed(0), epochs=2, max_steps=None))
    assert sum(len(i) for i in idx) == 20
    idx = list(iterate_minibatches(10, 4, torch.Generator().manual_seed(0), epochs=1, max_steps=7))
    assert len(idx) == 7


def test_a_one_sample_client_trains_a_batchnorm_model_on_its_running_statistics():
    # A client with a single training sample has a batch of 1, which BatchNorm cannot normalise in
    # training mode (pFedMoE's gate crashed a study's run on such a client). That step uses the
    # running statistics: the same update as the model in eval mode, statistics left unchanged.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with torch.no_grad():  # statistics unlike the defaults, so that using them is visible
        model[1].running_mean.copy_(torch.tensor([0.5, -0.2, 0.1, 0.3]))
        model[1].running_var.copy_(torch.tensor([2.0, 0.5, 1.5, 0.8]))
    x, y = torch.randn(1, 3), torch.tensor([1])
    expected = copy.deepcopy(model).eval()
    loss = torch.nn.functional.cross_entropy(expected(x), y)
    loss.backward()
    torch.optim.SGD(expected.parameters(), lr=0.1).step()
    stats = local_sgd(model, x, y, LocalTraining(lr=0.1, batch_size=8), torch.Generator().manual_seed(0))
    assert stats.steps == 1 and stats.loss == pytest.approx(loss.item())
    for p, q in zip(model.parameters(), expected.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(model[1].running_mean, torch.tensor([0.5, -0.2, 0.1, 0.3]))
    assert int(model[1].num_batches_tracked) == 0
    assert model.training and model[1].training  # back in training mode for the next client


def test_registry_requires_literal_name_and_rejects_duplicates():
    from typing import Literal

    reg: Registry = Registry("thing")

    class Good(ComponentConfig):
        name: Literal["good"] = "good"

    class Bad(ComponentConfig):
        name: str = "bad"

    reg.register("good", config=Good, description="d")(object())
    with pytest.raises(TypeError):
        reg.register("bad", config=Bad, description="d")
    with pytest.raises(ValueError):
        reg.register("good", config=Good, description="d")(object())
    with pytest.raises(KeyError, match="known: good"):
        reg.get("nope")
