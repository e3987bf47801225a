"""Metrics of generated text: ROUGE-1 (``rouge-score``) and the answer tokens' cross-entropy."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, Literal

RougeTokens = Literal["rouge_score", "unicode"]
HINT = 'pip install "fedmerge[llm]" (rouge-score)'


class UnicodeTokenizer:
    """Lowercase runs of word characters in any script (rouge_score's own tokenizer keeps only ASCII
    letters and digits, so Greek, Cyrillic, Arabic or Chinese answers would score 0)."""

    def tokenize(self, text: str) -> list[str]:
        return re.findall(r"\w+", text.lower())


def rouge1_scores(
    predictions: Sequence[str], references: Sequence[str], tokenizer: RougeTokens = "rouge_score"
) -> list[float]:
    """ROUGE-1 F-measure of each prediction against its reference (``rouge_score``, no stemming)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    try:
        from rouge_score import rouge_scorer
    except ImportError as exc:
        raise RuntimeError(f"ROUGE-1 needs the rouge-score package: {HINT}") from exc
    tok: Any = UnicodeTokenizer() if tokenizer == "unicode" else None
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=False, tokenizer=tok)
    return [scorer.score(ref, pred)["rouge1"].fmeasure for pred, ref in zip(predictions, references)]


def generation_metrics(
    nll_sum: float,
    tokens: int,
    predictions: Sequence[str],
    references: Sequence[str],
    tokenizer: RougeTokens = "rouge_score",
) -> dict[str, float]:
    """rouge1 (mean F-measure over examples), nll (cross-entropy per answer token) and the example count n."""
    scores = rouge1_scores(predictions, references, tokenizer)
    return {
        "rouge1": sum(scores) / len(scores) if scores else math.nan,
        "nll": nll_sum / tokens if tokens else math.nan,
        "n": float(len(scores)),
    }
