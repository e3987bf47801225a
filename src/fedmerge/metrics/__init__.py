"""Classification metrics on logits, metrics of generated text, and their summaries across clients."""

from .classification import calibration_errors, classification_metrics, nll, topk_accuracy
from .generation import generation_metrics, rouge1_scores
from .noise import mean_accuracy_standard_error, required_test_size
from .summary import lower_is_better, summarize, summarize_clients

__all__ = [
    "calibration_errors",
    "classification_metrics",
    "generation_metrics",
    "lower_is_better",
    "mean_accuracy_standard_error",
    "nll",
    "rouge1_scores",
    "required_test_size",
    "summarize",
    "summarize_clients",
    "topk_accuracy",
]
