"""``log.tensorboard: true``: per-round scalars in RUN_DIR/tensorboard (``tensorboard --logdir runs``).

train/loss every round; at evaluated rounds the mean and worst-10% client accuracy on test (and on
validation), the mean validation loss. A resumed run first drops the events past its checkpoint
(``purge_step``), as it truncates metrics.jsonl, so no round appears twice.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedmerge.config.schema import ExperimentConfig
from fedmerge.run.results import TENSORBOARD_DIR
from fedmerge.run.run_records import RoundRecord, Stats

INSTALL_HINT = "log.tensorboard needs TensorBoard: pip install -e '.[tensorboard]'"
FOLDER = TENSORBOARD_DIR
# tag -> (metric of the round's summary, its statistic across clients)
SCALARS: dict[str, tuple[str, Callable[[Stats], float]]] = {
    "test/acc_mean": ("test_acc", lambda s: s.mean),
    "test/acc_worst10": ("test_acc", lambda s: s.worst10),
    "val/acc_mean": ("val_acc", lambda s: s.mean),
    "val/acc_worst10": ("val_acc", lambda s: s.worst10),
    "val/nll_mean": ("val_nll", lambda s: s.mean),
}


def tensorboard_problem(cfg: ExperimentConfig) -> str | None:
    """``log.tensorboard: true`` where TensorBoard is not installed."""
    if cfg.log is None or not cfg.log.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


class ScalarLog:
    def __init__(self, run_dir: Path, start_round: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / FOLDER), purge_step=start_round + 1)

    def __enter__(self) -> ScalarLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.writer.close()

    def round(self, rnd: int, record: RoundRecord) -> None:
        self.writer.add_scalar("train/loss", record.train_loss, rnd)
        summary = record.summary or {}
        for tag, (key, stat) in SCALARS.items():
            if key in summary:
                self.writer.add_scalar(tag, stat(summary[key]), rnd)
        self.writer.flush()
