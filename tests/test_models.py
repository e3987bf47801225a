"""Model registry, seeded construction and architecture checks (kept small for a 2-core CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from fedmerge.models import MODELS, build_model, count_parameters

IMAGE_MODELS = [
    "twocnn",
    "resnet9",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "vgg11",
    "mobilenet_v1",
    "mobilenet_v2",
]
# Fast models for tests that build several copies.
SMALL = {
    "mlp": (20,),
    "twonn": (1, 8, 8),
    "twocnn": (1, 8, 8),
    "resnet9": (3, 16, 16),
    "vgg11": (1, 8, 8),
    "mobilenet_v1": (3, 8, 8),
    "lstm": (6,),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(name: str, shape: tuple[int, ...], batch: int, num_classes: int) -> torch.Tensor:
    if name == "lstm":
        return torch.randint(0, num_classes, (batch, *shape), generator=_gen(1))
    return torch.randn(batch, *shape, generator=_gen(1))


def _cases() -> list[tuple[str, tuple[int, ...]]]:
    cases = [(n, s) for n in IMAGE_MODELS for s in [(3, 32, 32), (1, 8, 8)]]
    cases += [("mlp", (20,)), ("mlp", (1, 8, 8)), ("twonn", (784,)), ("twonn", (1, 8, 8))]
    cases += [("auto", (20,)), ("auto", (1, 8, 8)), ("lstm", (5,)), ("lstm", (12,))]
    return cases


# pretrained backbones: tests/test_lora.py, tests/test_vit_lora.py, tests/test_causal_lm_lora.py
TESTED_ELSEWHERE = {"minilm_lora", "vit_lora", "causal_lm_lora"}


def test_every_registered_model_is_covered() -> None:
    # the built-in models (test modules and plugins may register their own at collection)
    builtin = {e.name for e in MODELS.entries() if e.config.__module__.startswith("fedmerge.")}
    assert {n for n, _ in _cases()} == builtin - TESTED_ELSEWHERE


@pytest.mark.parametrize(("name", "shape"), _cases(), ids=lambda v: str(v))
def test_forward_shape_head_and_features(name: str, shape: tuple[int, ...]) -> None:
    num_classes = 7
    model = build_model(MODELS.get(name).config(), shape, num_classes, generator=_gen(0)).eval()
    x = _inputs(name, shape, 2, num_classes)
    with torch.no_grad():
        logits = model(x)
        feats = model.features(x)
        assert logits.shape == (2, num_classes)
        assert torch.isfinite(logits).all()
        # The head applied to the penultimate features is the whole model.
        torch.testing.assert_close(model.classifier(feats), logits)
    keys = model.state_dict().keys()
    assert model.head_prefix == "classifier"
    assert {f"{model.head_prefix}.weight", f"{model.head_prefix}.bias"} <= set(keys)
    assert feats.shape == (2, model.feature_dim)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_seeded_build_is_reproducible_and_leaves_global_rng_alone(name: str) -> None:
    cfg, shape = MODELS.get(name).config(), SMALL[name]
    before = torch.get_rng_state()
    a = build_model(cfg, shape, 5, generator=_gen(123)).state_dict()
    b = build_model(cfg, shape, 5, generator=_gen(123)).state_dict()
    c = build_model(cfg, shape, 5, generator=_gen(124)).state_dict()
    assert torch.equal(torch.get_rng_state(), before)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


def test_build_does_not_touch_batchnorm_buffers() -> None:
    model = build_model(MODELS.parse({"name": "vgg11"}), (3, 8, 8), 10, generator=_gen(0))
    sd = model.state_dict()
    assert all(int(v) == 0 for k, v in sd.items() if k.endswith("num_batches_tracked"))
    assert all(torch.equal(v, torch.zeros_like(v)) for k, v in sd.items() if k.endswith("running_mean"))


def test_resnet9_parameter_count_matches_fedmerge() -> None:
    # FedMerge's tiny ResNet-9 on CIFAR-100: stem 232 + stages 1,184 / 3,680 / 14,528 / 57,728
    # + linear 64*100+100 = 6,500 -> 83,852 trainable parameters ("about 84k").
    model = build_model(MODELS.parse({"name": "resnet9"}), (3, 32, 32), 100)
    assert count_parameters(model) == 83_852
    # Fashion-MNIST (in_channels=1, 10 classes): the stem loses 2*8*9 weights and the head 90 rows.
    fmnist = build_model(MODELS.parse({"name": "resnet9"}), (1, 28, 28), 10)
    assert count_parameters(fmnist) == 83_852 - 144 - 90 * 65


def test_resnet9_adaptive_pool_equals_reference_avg_pool4() -> None:
    # The reference pools the last 4x4 map with avg_pool2d(4); 32x32 and 28x28 inputs both give 4x4.
    for shape in [(3, 32, 32), (1, 28, 28)]:
        model = build_model(MODELS.parse({"name": "resnet9"}), shape, 10, generator=_gen(0)).eval()
        x = torch.randn(2, *shape, generator=_gen(2))
        with torch.no_grad():
            out = F.relu(model.bn1(model.conv1(x)))
            for i in range(1, 5):
                out = getattr(model, f"layer{i}")(out)
            assert out.shape[-2:] == (4, 4)
            torch.testing.assert_close(model.features(x), F.avg_pool2d(out, 4).flatten(1))


@pytest.mark.parametrize(
    ("name", "shape", "classes", "expected"),
    [
        # Counts of the well-known reference implementations (kuangliu/pytorch-cifar, torchvision,
        # McMahan et al.), checked so that the layouts stay exact on their native input sizes.
        ("twonn", (1, 28, 28), 10, 199_210),
        ("twocnn", (1, 28, 28), 10, 1_663_370),
        ("resnet18", (3, 32, 32), 10, 11_173_962),
        ("vgg11", (3, 32, 32), 10, 9_231_114),
        ("mobilenet_v1", (3, 32, 32), 10, 3_217_226),
        ("mobilenet_v2", (3, 32, 32), 10, 2_236_682),
        # LEAF Shakespeare: embedding 80*8 + LSTM(8->256) 272,384 + LSTM(256->256) 526,336 + 256*80+80.
        ("lstm", (80,), 80, 640 + 272_384 + 526_336 + 20_560),
    ],
)
def test_reference_parameter_counts(name: str, shape: tuple[int, ...], classes: int, expected: int) -> None:
    assert count_parameters(build_model(MODELS.get(name).config(), shape, classes)) == expected


def test_resnet_layouts() -> None:
    r50 = build_model(MODELS.parse({"name": "resnet50"}), (3, 32, 32), 10)
    assert [len(getattr(r50, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    assert r50.classifier.in_features == 2048
    r34 = build_model(MODELS.parse({"name": "resnet34", "width_multiplier": 0.25}), (3, 32, 32), 10)
    assert [len(getattr(r34, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    assert r34.classifier.in_features == 128
    assert r34.conv1.out_channels == 16


def test_vgg_skips_pools_on_small_inputs() -> None:
    def n_pools(shape: tuple[int, ...]) -> int:
        model = build_model(MODELS.parse({"name": "vgg11"}), shape, 10)
        return sum(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())

    assert n_pools((3, 32, 32)) == 5
    assert n_pools((1, 8, 8)) == 3


def test_mobilenet_width_multiplier_shrinks_model() -> None:
    full = build_model(MODELS.parse({"name": "mobilenet_v1"}), (3, 8, 8), 10)
    half = build_model(MODELS.parse({"name": "mobilenet_v1", "width_multiplier": 0.5}), (3, 8, 8), 10)
    assert count_parameters(half) < 0.35 * count_parameters(full)


def test_auto_picks_mlp_for_features_and_twocnn_for_images() -> None:
    auto = MODELS.parse({"name": "auto"})
    assert build_model(auto, (20,), 3).__class__.__name__ == "MLP"
    assert build_model(auto, (1, 8, 8), 3).__class__.__name__ == "TwoCNN"
    with pytest.raises(ValueError):
        build_model(auto, (4, 4), 3)


def test_configs_are_strict_and_builders_check_shapes() -> None:
    with pytest.raises(ValidationError):
        MODELS.parse({"name": "mlp", "hiden": [10]})
    with pytest.raises(ValueError):
        build_model(MODELS.parse({"name": "resnet9"}), (20,), 3)
    with pytest.raises(TypeError):
        build_model(MODELS.get("mlp").config().model_copy(update={"name": "twonn"}), (20,), 3)
    # A plain mapping is accepted and validated.
    model = build_model({"name": "mlp", "hidden": [16, 8]}, (20,), 3)
    assert [m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)] == [16, 8, 3]


def test_mlp_without_bias_for_superfed() -> None:
    model = build_model({"name": "twonn", "bias": False}, (1, 28, 28), 10)
    assert not any(k.endswith("bias") for k in model.state_dict())
