"""Adapter-training throughput: fedmerge's local training of ``minilm_lora`` vs a plain peft loop.

Both train LoRA (r=8 on query/value) + a linear head with SGD over the same token ids (WordNet
definitions when installed, else synthetic sentences), batch 16, token cap 32. The plain loop is what a
user would write: ``get_peft_model`` on the backbone, padded batches with an attention mask, mean pooling.

    python benchmarks/lora_step.py [--steps 30] [--threads 1]

Prints samples/s of each and the ratio fedmerge / plain (target >= 0.9).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from torch.nn import functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def samples(n: int, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    from fedmerge.data.sources.text import WORDNET_NOUNS, parse_wordnet_nouns, tokenize

    if os.path.exists(WORDNET_NOUNS):
        with open(WORDNET_NOUNS, encoding="utf-8", errors="replace") as f:
            texts, labels = parse_wordnet_nouns(f.read())
        gen = torch.Generator().manual_seed(0)
        idx = torch.randperm(len(texts), generator=gen)[:n].tolist()
        texts, y = [texts[i] for i in idx], torch.as_tensor(labels[idx])
    else:
        texts = [f"a sentence number {i} about {'cats' if i % 2 else 'ships'} and other things" for i in range(n)]
        y = torch.arange(n) % 26
    return torch.as_tensor(tokenize(texts, None, max_tokens)), y


def bench_fedmerge(x: torch.Tensor, y: torch.Tensor, steps: int, batch: int) -> float:
    from fedmerge.core.training import LocalTraining, local_sgd
    from fedmerge.models import build_model

    model = build_model({"name": "minilm_lora"}, (x.shape[1],), 26, torch.Generator().manual_seed(0))
    cfg = LocalTraining(lr=0.05, batch_size=batch, local_steps=steps)
    local_sgd(model, x, y, cfg.model_copy(update={"local_steps": 2}), torch.Generator().manual_seed(1))  # warm-up
    t = time.perf_counter()
    stats = local_sgd(model, x, y, cfg, torch.Generator().manual_seed(0))
    return stats.samples / (time.perf_counter() - t)


class PlainPeft(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModel

        from fedmerge.models.text import default_model_path

        base = AutoModel.from_pretrained(default_model_path())
        self.encoder = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"]))
        self.head = nn.Linear(base.config.hidden_size, num_classes)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).float()
        return self.head((hidden * m).sum(1) / m.sum(1))


def bench_plain(x: torch.Tensor, y: torch.Tensor, steps: int, batch: int) -> float:
    torch.manual_seed(0)
    model = PlainPeft(26)
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    mask = (x != 0).long()
    gen = torch.Generator().manual_seed(0)

    def run(n_steps: int) -> int:
        seen = 0
        for _ in range(n_steps):
            idx = torch.randint(len(y), (batch,), generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x[idx], mask[idx]), y[idx])
            loss.backward()
            opt.step()
            seen += batch
        return seen

    run(2)  # warm-up
    t = time.perf_counter()
    seen = run(steps)
    return seen / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x, y = samples(args.steps * args.batch, args.max_tokens)
    print(f"{len(y)} samples, {args.max_tokens} tokens max, mean length {float((x != 0).sum(1).float().mean()):.1f}")
    plain = bench_plain(x, y, args.steps, args.batch)
    ours = bench_fedmerge(x, y, args.steps, args.batch)
    print(f"plain peft loop : {plain:8.1f} samples/s")
    print(f"fedmerge local  : {ours:8.1f} samples/s")
    print(f"ratio fedmerge / plain = {ours / plain:.2f} (target >= 0.9)")


if __name__ == "__main__":
    main()
