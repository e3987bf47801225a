"""LEAF's Shakespeare next-character model (StackedLSTM)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import Tensor, nn

from fedmerge.core.registry import ComponentConfig

from .registry import MODELS, Classifier


class CharLSTM(Classifier):
    """embedding -> stacked LSTM -> ``classifier`` on the last time step's output."""

    reads_tokens = True  # int64 token ids: float features or pixels are refused before a run (run/prepare.py)

    def __init__(self, vocab_size: int, num_classes: int, embed_dim: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=num_layers, batch_first=True)
        self.feature_dim = hidden
        self.classifier = nn.Linear(hidden, num_classes)

    def features(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(self.embedding(x.long()))
        return out[:, -1]


class LSTMConfig(ComponentConfig):
    name: Literal["lstm"] = "lstm"
    embed_dim: int = Field(default=8, ge=1, description="size of each token's embedding")
    hidden: int = Field(default=256, ge=1, description="LSTM state size")
    num_layers: int = Field(default=2, ge=1, description="stacked LSTM layers")
    vocab_size: int | None = Field(default=None, ge=1, description="input vocabulary; None = num_classes")


@MODELS.register(
    "lstm",
    config=LSTMConfig,
    description="LEAF Shakespeare char model: embed 8, 2-layer LSTM 256, (T,) int64 tokens",
)
def build_lstm(cfg: LSTMConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(input_shape) != 1:
        raise ValueError(f"model 'lstm' needs (T,) token inputs, got shape {input_shape}")
    vocab = cfg.vocab_size or num_classes
    return CharLSTM(vocab, num_classes, cfg.embed_dim, cfg.hidden, cfg.num_layers)
