"""``benchmarks/paper_scale.py`` at a cut size on CPU (so the GPU script cannot rot), its growth verdict, and
the runner's per-round peak GPU memory (``gpu_peak_mib``), read and reset through a faked CUDA."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from fedmerge.engines import device as device_module
from fedmerge.engines.device import peak_memory_mib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import paper_scale  # noqa: E402


def rows(*peaks: float | None) -> list[dict]:
    return [{"round": i + 1, "fit_s": 1.0, "eval_s": 0.5, "peak_mib": p} for i, p in enumerate(peaks)]


def test_the_growth_verdict_reads_the_rounds_after_the_first():
    assert paper_scale.grows(rows(900.0, 500.0, 500.5, 500.0, 500.9)) is False  # round 1 allocates once
    assert paper_scale.grows(rows(500.0, 500.0, 510.0, 520.0, 530.0)) is True
    assert paper_scale.grows(rows(None, None, None)) is None and paper_scale.grows(rows(1.0, 2.0)) is None
    table = paper_scale.round_table("t", rows(500.0, 500.0, 530.0))
    assert "| 3 | 1.00 | 0.50 | 530.0 |" in table and table.endswith("peak memory over rounds: GROWS")


def test_the_runners_rounds_carry_their_peak_gpu_memory_only_on_cuda(monkeypatch):
    assert peak_memory_mib(torch.device("cpu")) is None
    calls = []
    monkeypatch.setattr(device_module.torch.cuda, "max_memory_allocated", lambda d: 3 * 2**20)
    monkeypatch.setattr(device_module.torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(d))
    assert peak_memory_mib(torch.device("cuda")) == 3.0 and calls == [torch.device("cuda")]  # read, then reset


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason='needs pip install "fedmerge[lora]"')
def test_the_paper_scale_script_runs_every_part_at_a_cut_size(tmp_path, capsys):
    out = paper_scale.main(["--tiny", "--device", "cpu", "--rounds", "3", "--out", str(tmp_path / "n.json")])
    text = capsys.readouterr().out
    assert "ViT-B/16 LoRA (r=16, qkv + proj + MLP) client step [tiny]" in text
    assert "LIVAR on the ViT, 2 clients" in text and "FedMerge d=5 on ResNet-9" in text
    assert text.count("peak memory over rounds: -") == 2  # no GPU figures on CPU, and no verdict made up
    step = out["vit_step"]
    assert step["batch"] == 4 and step["step_ms"] > 0 and step["train_peak_mib"] is None
    # LoRA r=16 on qkv, the attention output and both MLP layers of each of 2 blocks (hidden 32, MLP 64),
    # and the 100-class head: only these train
    lora = 2 * (3 * 16 * (32 + 32) + 16 * (32 + 32) + 16 * (32 + 64) + 16 * (64 + 32))
    assert step["trainable"] == lora + 32 * 100 + 100
    for part in ("livar_rounds", "resnet9_rounds"):
        assert [r["round"] for r in out[part]] == [1, 2, 3] and all(r["fit_s"] > 0 for r in out[part])
    assert json.loads((tmp_path / "n.json").read_text())["resnet9_rounds"] == out["resnet9_rounds"]
