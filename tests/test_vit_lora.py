"""``vit_lora`` on a tiny randomly initialised ViT written to a folder here (no network): the same code as
ViT-B/16 in21k (only the checkpoint differs), through LoRA, LIVAR, FedMerge, FedLoRA, FedIT and Local."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import quick_config, run
from tiny_hf import TINY_VIT, VIT_MEAN, VIT_STD, tiny_vit
from torch import nn

from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.run.results import RunStore

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "peft")),
    reason='vit_lora needs pip install "fedmerge[lora]" (transformers, peft)',
)
LAYERS = TINY_VIT["num_hidden_layers"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_vit(tmp_path_factory.mktemp("vit") / "tiny-vit")


def build(folder, input_shape=(1, 8, 8), classes=10, seed=0, **cfg):
    from fedmerge.models import build_model

    gen = torch.Generator().manual_seed(seed)
    return build_model({"name": "vit_lora", "model": folder, **cfg}, input_shape, classes, gen)


def test_adapters_sit_on_qkv_attention_projection_and_mlp_of_every_block(folder):
    model = build(folder, r=4)
    keys = list(model.state_dict())
    assert keys == [n for n, _ in model.named_parameters()]  # no backbone weight, no buffer
    lora = [k for k in keys if k.startswith("lora.")]
    assert set(keys) - set(lora) == {"classifier.weight", "classifier.bias"}
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp_fc1", "mlp_fc2")
    for layer in range(LAYERS):
        for t in targets:
            assert sum(k.startswith(f"lora.layers_{layer}_") and t in k for k in lora) == 2, (layer, t)  # A and B
    assert len(lora) == LAYERS * len(targets) * 2
    d, h, r = TINY_VIT["hidden_size"], TINY_VIT["intermediate_size"], 4
    per_block = 4 * (r * d + d * r) + (r * d + h * r) + (r * h + d * r)
    assert sum(model.state_dict()[k].numel() for k in lora) == LAYERS * per_block
    assert model.classifier.in_features == d and model.image_size == (16, 16)


def test_inputs_are_resized_and_normalised_as_the_checkpoint_expects(folder):
    from transformers import ViTModel

    model = build(folder)
    reference = ViTModel.from_pretrained(folder, add_pooling_layer=False).eval()
    x = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    pixels = F.interpolate(x.expand(-1, 3, -1, -1), size=(16, 16), mode="bilinear", antialias=True)
    pixels = (pixels - torch.tensor(VIT_MEAN).view(1, 3, 1, 1)) / torch.tensor(VIT_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        want = reference(pixel_values=pixels).last_hidden_state[:, 0]  # B = 0: the adapters are no-ops
        torch.testing.assert_close(model.features(x), want)
        torch.testing.assert_close(model(x), model.classifier(want))


def test_one_step_trains_only_adapters_and_head(folder):
    from fedmerge.core.training import LocalTraining, local_sgd

    model = build(folder, input_shape=(3, 16, 16), classes=3)
    backbone = model.backbone(torch.device("cpu")).module
    frozen = {k: v.clone() for k, v in backbone.state_dict().items()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.rand(8, 3, 16, 16), torch.arange(8) % 3
    local_sgd(model, x, y, LocalTraining(lr=0.5, local_steps=2, batch_size=8), torch.Generator().manual_seed(0))
    assert all(torch.equal(v, frozen[k]) for k, v in backbone.state_dict().items())
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert {"classifier.weight", "classifier.bias"} <= changed
    assert any("lora_B" in k for k in changed)  # B starts at 0: only a gradient through the backbone moves it


def vit_config(folder, tmp_path, *overrides):
    return quick_config(
        "dataset.name=digits", "dataset.max_samples=160", "partition.name=dirichlet", "partition.alpha=0.5",
        "partition.num_clients=2", "model.name=vit_lora", f"model.model={folder}", "model.r=4", "rounds=2",
        "algorithm.batch_size=16", "algorithm.lr=0.05", *overrides, output_dir=tmp_path,
    )  # fmt: skip


@pytest.mark.parametrize("algorithm", ["livar", "fedmerge", "fedlora", "fedavg", "local"])
def test_methods_run_through_the_runner(folder, tmp_path, algorithm):
    extra = ["algorithm.num_models=3"] if algorithm == "fedmerge" else []
    res = run(vit_config(folder, tmp_path, f"algorithm.name={algorithm}", *extra), tmp_path / algorithm)
    rows = RunStore(res.run_dir).read_metrics()
    assert [r["round"] for r in rows] == [1, 2]
    acc = res.summary["last"]["clients"]["test_acc"]["mean"]
    assert 0.0 <= acc <= 1.0
    adapters_and_head = res.summary["parameters"]["model"]
    assert adapters_and_head == sum(p.numel() for p in build(folder, r=4).parameters())
    assert res.summary["parameters"]["model_full"] > adapters_and_head  # the frozen backbone never travels
    if algorithm == "livar":  # G_SHAP coefficients for every LoRA layer (A, B pair) of every client
        coef = res.server_state.meta["layer_coefficients"]
        assert set(coef) == {"0", "1"} and all(len(v) == LAYERS * 6 for v in coef.values())
        assert any(len(set(v)) > 1 for v in coef.values())  # layers are weighted, not all alike
    if algorithm == "fedmerge":
        assert tuple(res.server_state.tensors["theta"].shape) == (3, adapters_and_head)
    if algorithm == "fedlora":  # the shared adapter travels; the personal one and the head stay home
        states = load_checkpoint(res.run_dir / "checkpoints").client_states
        personal = {k.removeprefix("personal.") for k in states[0].tensors if k.startswith("personal.")}
        assert personal == set(res.server_state.tensors) and all(k.startswith("lora.") for k in personal)


def test_timm_backend_without_timm_fails_in_one_line(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError, as without torchvision
    with pytest.raises(RuntimeError, match=r"pip install timm torchvision") as err:
        build("vit_tiny_patch16_224", backend="timm")
    assert "\n" not in str(err.value)


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn.qkv(t).chunk(3, -1)
        t = t + self.attn.proj(torch.softmax(q @ k.transpose(1, 2), -1) @ v)
        return t + self.mlp.fc2(torch.relu(self.mlp.fc1(t)))


class _FakeTimmViT(nn.Module):
    """What the timm backend relies on: ``pretrained_cfg``, ``num_features``, pooled features from
    ``forward`` (num_classes=0) and timm's block names (attn.qkv, attn.proj, mlp.fc1, mlp.fc2)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, 16, 4, 4)
        self.blocks = nn.Sequential(_Block(16), _Block(16))
        self.num_features = 16
        self.pretrained_cfg = {"input_size": (3, 12, 12), "mean": (0.1, 0.2, 0.3), "std": (0.5, 0.5, 0.5)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.patch_embed.proj(x).flatten(2).transpose(1, 2)).mean(1)


def test_timm_backend_adapts_timm_block_layers_and_uses_its_pretrained_cfg(monkeypatch):
    # Real timm needs torchvision, which this CPU torch cannot have: the glue is checked on a stand-in.
    calls = []

    def create_model(name, pretrained, num_classes):
        calls.append((name, pretrained, num_classes))
        torch.manual_seed(0)
        return _FakeTimmViT()

    monkeypatch.setitem(sys.modules, "timm", types.SimpleNamespace(create_model=create_model))
    model = build("fake_vit_for_test", input_shape=(3, 8, 8), classes=4, backend="timm")
    assert calls == [("fake_vit_for_test", True, 0)]
    lora = [k for k in model.state_dict() if k.startswith("lora.")]
    assert len(lora) == 2 * 4 * 2 and not any("patch_embed" in k for k in lora)
    assert model.image_size == (12, 12) and model.mean == (0.1, 0.2, 0.3)
    x = torch.rand(2, 3, 8, 8)
    pixels = (F.interpolate(x, size=(12, 12), mode="bilinear", antialias=True) - torch.tensor([0.1, 0.2, 0.3]).view(
        1, 3, 1, 1)) / 0.5  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        torch.testing.assert_close(model.features(x), _FakeTimmViT()(pixels))


def test_a_model_neither_cached_nor_downloadable_is_refused_in_one_line(tmp_path):
    # A fresh process: the Hub library reads HF_HUB_OFFLINE when it is imported.
    import os
    import subprocess

    env = dict(
        os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "empty-cache"), PYTHONPATH=os.pathsep.join(sys.path)
    )
    cmd = [sys.executable, "-m", "fedmerge.cli", "run", "dataset.name=digits", "model.name=vit_lora",
           "model.model=no-such-org/no-such-vit", f"output_dir={tmp_path}", "--no-progress"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert "'no-such-org/no-such-vit'" in lines[0] and "hf download no-such-org/no-such-vit" in lines[0]
    assert "HF_HOME" in lines[0] and "local folder" in lines[0]
    assert not list(tmp_path.glob("*/metrics.jsonl"))  # refused before a run folder exists
