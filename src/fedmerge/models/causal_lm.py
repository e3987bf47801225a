"""A frozen pretrained causal language model with LoRA adapters (``causal_lm_lora``): instruction tuning.

FedMerge's foundation-model setting (Alpaca-LoRA on LLaMA3-8B, rank 8). The backbone is shared and
frozen as in ``minilm_lora`` (``lora.py``): only the adapters train and travel, so FedAvg is FedIT,
FedMerge merges flat adapter vectors, FedLoRA adds a personal adapter, Local trains alone.

The model is not a classifier, and owns its task instead (see docs/architecture.md, "Tasks other than
classification"):

* inputs ``x`` are int64 ``(N, 2, T)``: ``x[:, 0]`` token ids, right-padded; ``x[:, 1]`` each token's
  role, ``PAD``, ``PROMPT`` or ``ANSWER`` (the prompt comes first, then the answer and its EOS);
  ``y`` is the example's task category (what partitioners and splits use), not a prediction target;
* ``forward(x)`` returns next-token logits ``(N, L, V)`` (``L``: the batch's longest sequence);
* `task_loss()` is the next-token cross-entropy on the answer tokens (the mean over the batch's
  answer tokens), which ``local_sgd`` uses instead of a classification loss;
* evaluation asks `answer_nll()` (the same loss, summed over a split), `generate_answers()`
  (greedy decoding from each prompt) and `reference_answers()`, and scores ROUGE-1
  (``fedmerge.metrics.generation``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, field_validator
from torch import Tensor, nn

from fedmerge.core.registry import ComponentConfig

from .lora import CACHE_LOCK, LoRAAdapters, LoRASpec, LoRAUnavailable, hub_error, register_loader, require_hf
from .registry import MODELS

HINT = 'pip install "fedmerge[llm]" (transformers, peft and rouge-score)'
PAD, PROMPT, ANSWER = 0, 1, 2  # token roles, x[:, 1]

_TOKENIZERS: dict[str, Any] = {}


def resolve_name(name: str) -> str:
    """A local folder as an absolute path; anything else is a Hub name."""
    local = os.path.expanduser(name)
    return os.path.abspath(local) if os.path.isdir(local) else name


def load_causal_tokenizer(name: str) -> Any:
    """The (cached) tokenizer of a causal LM: a local folder, or a Hub name (from the Hugging Face cache,
    downloaded there on first use)."""
    require_hf(HINT)
    name = resolve_name(name)
    with CACHE_LOCK:
        if name not in _TOKENIZERS:
            from transformers import AutoTokenizer

            try:
                _TOKENIZERS[name] = AutoTokenizer.from_pretrained(name)
            except OSError as exc:
                raise hub_error(name, exc, "tokenizer") from None
        return _TOKENIZERS[name]


def special_ids(tokenizer: Any) -> tuple[int, int]:
    """(eos id, pad id); a tokenizer without a pad token (LLaMA) pads with EOS, which the roles make harmless."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token; a causal LM needs one")
    pad = tokenizer.pad_token_id
    return int(eos), int(eos if pad is None else pad)


def encode_examples(
    prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], max_tokens: int, pad_id: int
) -> np.ndarray:
    """``(N, 2, max_tokens)`` int64 rows of prompt then answer tokens with their roles, right-padded.

    A prompt longer than ``max_tokens - 1`` keeps its *last* tokens (the end of the template, which
    cues the answer, survives); the answer (with its EOS) fills what is left and is cut at the end.
    Every row therefore has at least one answer token.
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
    out = np.zeros((len(prompts), 2, max_tokens), dtype=np.int64)
    out[:, 0] = pad_id
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        if not a:
            raise ValueError(f"example {i} has an empty answer (it needs at least an EOS token)")
        p = list(p)[-(max_tokens - 1) :]
        a = list(a)[: max_tokens - len(p)]
        out[i, 0, : len(p) + len(a)] = p + a
        out[i, 1, : len(p)] = PROMPT
        out[i, 1, len(p) : len(p) + len(a)] = ANSWER
    return out


@register_loader("causal_lm")
def _load_causal_lm(spec: LoRASpec) -> tuple[nn.Module, dict[str, Any]]:
    require_hf(HINT)
    from transformers import AutoModelForCausalLM

    try:
        module = AutoModelForCausalLM.from_pretrained(spec.path, dtype=getattr(torch, spec.dtype))
    except OSError as exc:
        raise hub_error(spec.path, exc) from None
    eos, pad = special_ids(load_causal_tokenizer(spec.path))
    return module, {"hidden": module.config.get_text_config().hidden_size, "pad_id": pad, "eos_id": eos}


class _Generate(nn.Module):
    """``generate`` as a forward pass, so that ``functional_call`` can substitute the adapters in it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs: Any) -> Tensor:
        return self.inner.generate(**kwargs)


class CausalLMLoRA(LoRAAdapters):
    """Frozen shared causal LM + this instance's LoRA adapters; no head (``classifier`` holds nothing)."""

    head_prefix = "classifier"

    def __init__(
        self,
        spec: LoRASpec,
        max_new_tokens: int = 128,
        eval_batch_size: int = 8,
        rouge_tokenizer: str = "rouge_score",
    ) -> None:
        super().__init__()
        bb = self.init_adapters(spec)
        self.classifier = nn.Identity()  # FedLoRA's "personal head" is then the personal adapter alone
        self.eos_id, self.pad_id = int(bb.info["eos_id"]), bb.pad_id
        self.max_new_tokens, self.eval_batch_size = max_new_tokens, eval_batch_size
        self.rouge_tokenizer = rouge_tokenizer

    def tokenizer(self) -> Any:
        return load_causal_tokenizer(self.spec.path)

    # --- training ------------------------------------------------------------------------
    def forward(self, x: Tensor, personal: Mapping[str, Tensor] | None = None) -> Tensor:
        """Next-token logits ``(N, L, V)`` over the batch's longest sequence ``L``."""
        if x.ndim != 3 or x.shape[1] != 2:
            raise ValueError(f"causal_lm_lora needs (N, 2, T) token ids and roles, got shape {tuple(x.shape)}")
        role = x[:, 1]
        length = max(int((role != PAD).sum(1).max()), 1) if x.shape[0] else 1
        ids, mask = x[:, 0, :length], (role[:, :length] != PAD).long()
        out = self.run_backbone(x.device, personal, input_ids=ids, attention_mask=mask, use_cache=False)
        return out.logits

    @staticmethod
    def _answer_logits(output: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        """(logits at the positions that predict an answer token (K, V), those tokens (K,))."""
        length = output.shape[1]
        target, role = x[:, 0, 1:length], x[:, 1, 1:length]
        keep = role == ANSWER
        return output[:, :-1][keep].float(), target[keep]

    def task_loss(self, output: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """Next-token cross-entropy on the answer tokens, averaged over the batch's answer tokens."""
        logits, target = self._answer_logits(output, x)
        if target.numel() == 0:
            return output.sum() * 0.0
        return F.cross_entropy(logits, target)

    # --- evaluation ----------------------------------------------------------------------
    @torch.no_grad()
    def answer_nll(self, predict: Callable[[Tensor], Tensor], x: Tensor, batch_size: int) -> tuple[float, int]:
        """(summed cross-entropy, number of answer tokens) of ``predict`` over the rows of ``x``."""
        total, count = 0.0, 0
        for i in range(0, x.shape[0], batch_size):
            xb = x[i : i + batch_size]
            logits, target = self._answer_logits(predict(xb), xb)
            total += float(F.cross_entropy(logits, target, reduction="sum").double()) if target.numel() else 0.0
            count += int(target.numel())
        return total, count

    def reference_answers(self, x: Tensor) -> list[str]:
        """Each row's answer tokens as text (special tokens, such as EOS, left out)."""
        tok = self.tokenizer()
        return [tok.decode(row[0][row[1] == ANSWER].tolist(), skip_special_tokens=True) for row in x.cpu()]

    @torch.no_grad()
    def generate_answers(self, predict: Callable[[Tensor], Tensor], x: Tensor, batch_size: int) -> list[str]:
        """Greedy answers to each row's prompt, up to ``max_new_tokens`` or EOS, as text. ``predict`` is
        this model (decoded with a key-value cache by ``generate``) or any function with its signature
        (e.g. FedLoRA's shared + personal adapters), decoded by recomputing the sequence each step."""
        tok = self.tokenizer()
        out: list[str] = []
        for i in range(0, x.shape[0], batch_size):
            xb = x[i : i + batch_size]
            tokens = self._generate_cached(xb) if predict is self else self._generate_stepwise(predict, xb)
            out.extend(tok.decode(t, skip_special_tokens=True) for t in tokens)
        return out

    def _prompts(self, x: Tensor) -> list[Tensor]:
        return [row[0][row[1] == PROMPT] for row in x]

    def _cut(self, tokens: list[int]) -> list[int]:
        return tokens[: tokens.index(self.eos_id)] if self.eos_id in tokens else tokens

    def _generate_stepwise(self, predict: Callable[[Tensor], Tensor], x: Tensor) -> list[list[int]]:
        """Greedy decoding with right-padded rows, one full forward per new token: causal attention makes
        the logits at a row's last real position independent of what follows it."""
        prompts = self._prompts(x)
        n, new = len(prompts), self.max_new_tokens
        lengths = torch.tensor([len(p) for p in prompts], device=x.device)
        buf = torch.full((n, 2, int(lengths.max()) + new), self.pad_id, dtype=torch.int64, device=x.device)
        buf[:, 1] = PAD
        for r, p in enumerate(prompts):
            buf[r, 0, : len(p)], buf[r, 1, : len(p)] = p, PROMPT
        rows = torch.arange(n, device=x.device)
        active = torch.ones(n, dtype=torch.bool, device=x.device)
        generated: list[list[int]] = [[] for _ in range(n)]
        for _ in range(new):
            nxt = predict(buf)[rows, lengths - 1].argmax(-1)
            active &= nxt != self.eos_id
            if not bool(active.any()):
                break
            at = rows[active]
            buf[at, 0, lengths[at]] = nxt[at]
            buf[at, 1, lengths[at]] = ANSWER
            lengths[at] += 1
            for r in at.tolist():
                generated[r].append(int(nxt[r]))
        return generated

    def _generate_cached(self, x: Tensor) -> list[list[int]]:
        """Greedy decoding by ``generate`` (key-value cache), prompts left-padded as it expects."""
        from transformers import GenerationConfig

        prompts = self._prompts(x)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.int64, device=x.device)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :], mask[r, width - len(p) :] = p, 1
        config = GenerationConfig(
            max_new_tokens=self.max_new_tokens, do_sample=False, num_beams=1,
            eos_token_id=self.eos_id, pad_token_id=self.pad_id,
        )  # fmt: skip
        bb = self.backbone(x.device)
        weights = {f"inner.{k}": v for k, v in self.adapter_weights().items()}
        with bb.lock:
            out = torch.func.functional_call(
                _Generate(bb.module), weights, args=(),
                kwargs={"input_ids": ids, "attention_mask": mask, "generation_config": config}, strict=False,
            )  # fmt: skip
        return [self._cut(row.tolist()) for row in out[:, width:]]


class CausalLMLoRAConfig(ComponentConfig):
    name: Literal["causal_lm_lora"] = "causal_lm_lora"
    model: str = Field(
        description="a causal LM: a Hub name (e.g. meta-llama/Meta-Llama-3-8B; from the Hugging Face cache, HF_HOME, "
        "downloaded there on first use) or a local folder; the dataset must be tokenized with its tokenizer"
    )
    r: int = Field(8, ge=1, description="LoRA rank")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scaling alpha / r)")
    target_modules: tuple[str, ...] | None = Field(
        ("q_proj", "v_proj"),
        min_length=1,
        description="module-name suffixes to adapt (Alpaca-LoRA's q_proj, v_proj); null: peft's default for the "
        "architecture",
    )
    layers: tuple[int, ...] | None = Field(None, description="adapt only these decoder layers (default: all)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the frozen model (bfloat16 for an 8B model on one GPU); adapters are float32"
    )
    max_new_tokens: int = Field(128, ge=1, description="evaluation: the longest generated answer, in tokens")
    eval_batch_size: int = Field(8, ge=1, description="evaluation: prompts per forward pass or generate call")
    rouge_tokenizer: Literal["rouge_score", "unicode"] = Field(
        "rouge_score",
        description="ROUGE-1 tokens: rouge_score's (lowercase ASCII letters and digits: other scripts vanish) or "
        "unicode (lowercase \\w+ runs, for non-Latin scripts)",
    )

    @field_validator("model")
    @classmethod
    def _folder_has_config(cls, model: str) -> str:
        local = os.path.expanduser(model)
        if os.path.isdir(local) and not os.path.isfile(os.path.join(local, "config.json")):
            raise ValueError("a folder without config.json; give a Hugging Face model folder or a Hub name")
        return model


def causal_spec(cfg: CausalLMLoRAConfig) -> LoRASpec:
    targets = tuple(cfg.target_modules) if cfg.target_modules is not None else None
    return LoRASpec(resolve_name(cfg.model), cfg.r, float(cfg.alpha), targets, cfg.layers, "causal_lm", cfg.dtype)


@MODELS.register(
    "causal_lm_lora",
    config=CausalLMLoRAConfig,
    description="frozen pretrained causal LM (any transformers name, e.g. LLaMA3-8B) + LoRA adapters; instruction "
    "data, next-token loss on the answers, ROUGE-1 of greedy answers",
)
def build_causal_lm_lora(cfg: CausalLMLoRAConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(input_shape) != 2 or input_shape[0] != 2:
        raise ValueError(
            f"model 'causal_lm_lora' needs instruction data: (2, T) token ids and roles per example, got {input_shape}"
        )
    if importlib.util.find_spec("rouge_score") is None:  # refused now, not after the first rounds
        raise LoRAUnavailable(f"ROUGE-1 needs the rouge-score package: {HINT}")
    return CausalLMLoRA(causal_spec(cfg), cfg.max_new_tokens, cfg.eval_batch_size, cfg.rouge_tokenizer)
