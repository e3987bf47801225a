"""Client-side pieces shared by every engine: evaluation and per-call RNG seeding."""

from __future__ import annotations

import torch

from fedmerge.core.algorithm import Algorithm, ClientContext, ClientDataLike, Predictor, StateDict
from fedmerge.core.model_state import load_state
from fedmerge.core.training import predict_logits
from fedmerge.core.types import ClientState, Payload
from fedmerge.metrics import classification_metrics, generation_metrics

Metrics = dict[str, float]


def seed_global_rng(seed: int, device: torch.device) -> None:
    """Seed torch's global RNGs for one client call (CPU always, CUDA only when used).

    ``torch.manual_seed`` would also queue lazy seeding of every accelerator backend, which
    costs ~2 ms per call on a CPU-only machine: significant per client with small models.
    """
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


SPLITS = ("val", "test")


def evaluate_client(
    algorithm: Algorithm,
    payload: Payload,
    data: ClientDataLike,
    state: ClientState,
    ctx: ClientContext,
    batch_size: int = 1024,
    variants: dict[str, StateDict | Predictor] | None = None,
) -> Metrics:
    """Metrics of each of the client's personalised models on its val and test splits (``variants``:
    what ``algorithm.personalize_variants`` returned, when the caller already asked)."""
    out: Metrics = {}
    if variants is None:
        variants = algorithm.personalize_variants(payload, data, state, ctx)
    for variant, weights in variants.items():
        if callable(weights):
            predictor = weights
        else:
            load_state(ctx.model, weights)
            predictor = ctx.model
        prefix = f"{variant}/" if variant else ""
        for split in SPLITS:
            x, y = getattr(data, f"x_{split}", None), getattr(data, f"y_{split}", None)
            if y is None or y.numel() == 0:
                continue
            if is_generative(ctx.model):
                metrics = generative_metrics(ctx.model, predictor, x, batch_size)
            else:
                metrics = classification_metrics(predict_batched(predictor, x, batch_size), y)
            out.update({f"{prefix}{split}_{k}": v for k, v in metrics.items()})
    return out


def is_generative(model: torch.nn.Module) -> bool:
    """A model that generates text (``causal_lm_lora``): scored on its answers, not on logits per class."""
    return hasattr(model, "generate_answers")


@torch.no_grad()
def generative_metrics(
    model: torch.nn.Module, predictor: Predictor | torch.nn.Module, x: torch.Tensor, batch_size: int
) -> Metrics:
    """ROUGE-1 of the greedy answers to the split's prompts, the answer tokens' cross-entropy, and n."""
    if isinstance(predictor, torch.nn.Module):
        predictor.eval()
    batch_size = min(batch_size, int(getattr(model, "eval_batch_size", batch_size)))
    nll_sum, tokens = model.answer_nll(predictor, x, batch_size)
    answers = model.generate_answers(predictor, x, batch_size)
    return generation_metrics(nll_sum, tokens, answers, model.reference_answers(x), model.rouge_tokenizer)


@torch.no_grad()
def predict_batched(predictor: Predictor | torch.nn.Module, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    if isinstance(predictor, torch.nn.Module):
        return predict_logits(predictor, x, batch_size)
    return torch.cat([predictor(x[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)])
