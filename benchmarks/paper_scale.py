"""Memory and speed at the papers' scale, with random weights and random data (no download):

1. a ViT-B/16 LoRA client step (LIVAR: rank 16 on qkv, attention projection and MLP, batch 16, CIFAR-sized
   images resized to 224) and an evaluation pass of the engine's batch of 1,024 images;
2. LIVAR on that ViT through the runner (``configs/paper/livar_cifar100_b10.yaml``, data cut to a few
   clients): each round's seconds and peak GPU memory;
3. a ResNet-9 CIFAR-100 round through the runner at the paper's size (``configs/paper/
   fedmerge_cifar100_personal.yaml``: 50 clients of 900 training images, batch 32, 2 local epochs), FedMerge
   with 5 global models (the Table 2 row): each round's seconds and peak GPU memory.

The runs are the real code path (``run_experiment`` on the config, the data handed in as random tensors of
CIFAR-100's shape). Peak memory is the runner's ``gpu_peak_mib`` of each round (CUDA only): over the rounds
it must not grow. The ViT is built from a ViT-B/16 config (google/vit-base-patch16-224-in21k's sizes) with
random weights written to a temporary folder, so its speed and memory are the pretrained model's.

    python benchmarks/paper_scale.py --device cuda [--rounds 5] [--out paper_scale.json]
    python benchmarks/paper_scale.py --tiny --device cpu     # every step at a cut size (the test runs this)

Prints one table per part; ``--out`` also writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedmerge.config.schema import load_config
from fedmerge.core.training import LocalTraining, local_sgd, predict_logits
from fedmerge.data.federated import ClientData, FederatedDataset
from fedmerge.models import build_model
from fedmerge.run.results import RunStore
from fedmerge.run.runner import run_experiment

ROOT = Path(__file__).resolve().parents[1]
VIT_B16 = dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
               intermediate_size=3072, num_channels=3)  # fmt: skip
VIT_TINY = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, num_channels=3)  # fmt: skip
CIFAR = (3, 32, 32)
MIB = 2**20


def write_vit(folder: Path, sizes: dict[str, int]) -> str:
    """A ViT with random weights and ``sizes``, saved as a Hub checkpoint folder that ``vit_lora`` reads."""
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    ViTModel(ViTConfig(**sizes), add_pooling_layer=False).save_pretrained(folder)
    side = sizes["image_size"]
    pre = {"image_processor_type": "ViTImageProcessor", "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
           "size": {"height": side, "width": side}, "do_normalize": True, "do_rescale": True}  # fmt: skip
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    return str(folder)


def random_clients(clients: int, train: int, evaluate: int, num_classes: int, seed: int = 0) -> FederatedDataset:
    """``clients`` clients of CIFAR-shaped images in [0, 1] and random labels (``evaluate`` val and test each)."""
    gen = torch.Generator().manual_seed(seed)

    def split(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(n, *CIFAR, generator=gen), torch.randint(0, num_classes, (n,), generator=gen)

    out = [ClientData(cid, *split(train), *split(evaluate), *split(evaluate)) for cid in range(clients)]
    return FederatedDataset(out, num_classes, CIFAR, "random-cifar100")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def vit_step(vit: str, device: torch.device, batch: int, steps: int, eval_batch: int) -> dict[str, Any]:
    """ms per LoRA training step at ``batch`` and the peak memory of training, then of one evaluation pass."""
    cfg = load_config(ROOT / "configs/paper/livar_cifar100_b10.yaml", [f"model.model={vit}"])
    model = build_model(cfg.model, CIFAR, 100, generator=torch.Generator().manual_seed(0)).to(device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    gen = torch.Generator().manual_seed(0)
    x, y = (
        torch.rand(batch * steps, *CIFAR, generator=gen).to(device),
        torch.randint(0, 100, (batch * steps,)).to(device),
    )
    training = LocalTraining(lr=cfg.algorithm.lr, batch_size=batch, local_steps=2)
    local_sgd(model, x, y, training, torch.Generator().manual_seed(1))  # warm-up (kernels, allocator)
    sync(device)
    reset_peak(device)
    t0 = time.perf_counter()
    local_sgd(model, x, y, training.model_copy(update={"local_steps": steps}), torch.Generator().manual_seed(2))
    sync(device)
    step_ms = 1000 * (time.perf_counter() - t0) / steps
    train_peak = peak_mib(device)
    reset_peak(device)
    images = torch.rand(eval_batch, *CIFAR, generator=gen).to(device)
    t0 = time.perf_counter()
    predict_logits(model, images, eval_batch)
    sync(device)
    eval_s = time.perf_counter() - t0
    return {"batch": batch, "steps": steps, "trainable": trainable, "step_ms": step_ms,
            "train_peak_mib": train_peak, "eval_batch": eval_batch, "eval_s": eval_s,
            "eval_peak_mib": peak_mib(device)}  # fmt: skip


def run_rounds(config: str, overrides: list[str], data: FederatedDataset, folder: Path) -> list[dict[str, Any]]:
    """The config's run for its rounds on ``data``: per round, seconds (training, evaluation) and peak memory."""
    cfg = load_config(ROOT / config, [*overrides, f"output_dir={folder}", "checkpoint_every=1000"])
    result = run_experiment(cfg, folder / "run", show_progress=False, data=data)
    rows = RunStore(result.run_dir).read_metrics()
    return [{"round": r["round"], "fit_s": r.get("fit_seconds"), "eval_s": r.get("eval_seconds"),
             "peak_mib": r.get("gpu_peak_mib")} for r in rows]  # fmt: skip


def grows(rows: list[dict[str, Any]], tolerance_mib: float = 1.0) -> bool | None:
    """Whether the peak memory of a later round exceeds the second round's by more than ``tolerance_mib`` (the
    first round allocates once: kernels' workspaces, the optimiser pool); None without GPU figures."""
    peaks = [r["peak_mib"] for r in rows if r["peak_mib"] is not None]
    return None if len(peaks) < 3 else max(peaks[2:]) > peaks[1] + tolerance_mib


def cell(value: Any, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def round_table(title: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"\n{title}", "| round | train s | eval s | peak GPU MiB |", "|---|---|---|---|"]
    lines += [f"| {r['round']} | {cell(r['fit_s'], '.2f')} | {cell(r['eval_s'], '.2f')} | {cell(r['peak_mib'])} |"
              for r in rows]  # fmt: skip
    verdict = grows(rows)
    lines.append("peak memory over rounds: " + ("-" if verdict is None else "GROWS" if verdict else "flat"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed ViT training steps")
    ap.add_argument("--tiny", action="store_true", help="cut sizes: a tiny ViT, few clients and images (CPU test)")
    ap.add_argument("--out", default=None, help="also write the numbers here as JSON")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.tiny:
        sizes, batch, eval_batch, steps = VIT_TINY, 4, 8, 2
        vit_data, cnn_data = (2, 8, 4), (2, 8, 4)  # clients, training images, val/test images per client
        cnn, vit_cut = ["model.widths=[4,8,8,8]", "algorithm.local_epochs=1"], ["algorithm.local_epochs=1"]
    else:
        sizes, batch, eval_batch, steps = VIT_B16, 16, 1024, args.steps
        vit_data, cnn_data = (2, 64, 32), (50, 900, 150)  # CIFAR-100 over 50 clients: 45,000 = 50 x 900 training
        cnn, vit_cut = [], []
    rounds = [f"device={args.device}", f"rounds={args.rounds}", "eval_every=1", "threads=2"]
    header = f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}"
    print(header, f"| torch {torch.__version__}", flush=True)
    out: dict[str, Any] = {"device": header, "torch": torch.__version__, "tiny": args.tiny}
    with tempfile.TemporaryDirectory() as tmp:
        vit = write_vit(Path(tmp) / "vit", sizes)
        step = vit_step(vit, device, batch, steps, eval_batch)
        out["vit_step"] = step
        print("\nViT-B/16 LoRA (r=16, qkv + proj + MLP) client step" + (" [tiny]" if args.tiny else ""))
        print("| batch | trainable params | ms / step | train peak MiB | eval batch | eval s | eval peak MiB |")
        print("|---|---|---|---|---|---|---|")
        cells = [step["batch"], f"{step['trainable']:,}", f"{step['step_ms']:.1f}", cell(step["train_peak_mib"]),
                 step["eval_batch"], f"{step['eval_s']:.2f}", cell(step["eval_peak_mib"])]  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
        livar_cfg = [*rounds, *vit_cut, "algorithm.name=livar", f"model.model={vit}",
                     f"partition.num_clients={vit_data[0]}"]  # fmt: skip
        livar = run_rounds("configs/paper/livar_cifar100_b10.yaml", livar_cfg, random_clients(*vit_data, 100),
                           Path(tmp) / "livar")  # fmt: skip
        out["livar_rounds"] = livar
        print(round_table(f"LIVAR on the ViT, {vit_data[0]} clients x {vit_data[1]} images, batch {batch}", livar))
        resnet = run_rounds("configs/paper/fedmerge_cifar100_personal.yaml",
                            [*rounds, *cnn, "algorithm.name=fedmerge", "algorithm.num_models=5",
                             "algorithm.preset=reference", f"partition.num_clients={cnn_data[0]}"],
                            random_clients(*cnn_data, 100), Path(tmp) / "resnet")  # fmt: skip
        out["resnet9_rounds"] = resnet
        print(round_table(f"FedMerge d=5 on ResNet-9, CIFAR-100 shape, {cnn_data[0]} clients x {cnn_data[1]} "
                          "images, the config's batch and epochs", resnet), flush=True)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
