"""The public surface for plugins: everything a method, dataset, partitioner or model of another package needs.

A plugin imports from this module only (`from fedmerge.api import ALGORITHMS, GlobalModelAlgorithm, ...`); the
modules behind it may move, these names stay. Nothing is defined here: every name is re-exported from the module
that owns it, and importing this module registers every built-in component (the registries are complete when a
plugin adds to them).

- **The algorithm**: `Algorithm` and its config base `AlgorithmConfig`; the bases that do most of the work
  (`GlobalModelAlgorithm`: FedAvg's broadcast and mean; `StatisticsAlgorithm`: merges with client statistics);
  what a client update is given (`ClientContext`, `ClientDataLike`) and its helpers (`client_sgd`,
  `train_received`, `fine_tuned`, `adapted_state`, `load_weights`, `model_weights`, `adapt_epochs`,
  `with_epochs`).
- **The records** that travel between server and clients: `Payload`, `Update`, `ClientState`, `ServerState`.
- **Local training**: `local_sgd` with its hooks (`Step`, `ExtraLoss`, `StepHook`), its options
  (`LocalTraining`) and statistics (`TrainStats`); `predict_logits`, `mean_loss`; averaging: `weighted_average`,
  `weighted_merge`.
- **Registries**: `ALGORITHMS`, `DATASETS`, `PARTITIONERS`, `MODELS` (each
  `@REGISTRY.register(name, config=..., description=...)`), the config base `ComponentConfig`, a dataset's
  `DatasetConfig` and `Pool`, a partitioner's `PartitionConfig` and `Partition`.
- **Models**: the base `Classifier` (a `features` body and a `classifier` head), `flat_size`, `image_shape`,
  `build_model`, `count_parameters`.
- **What a method knows about its outputs**: `MethodHooks` (``ALGORITHMS.register(..., hooks=MethodHooks(...))``:
  summary fields and lines, report figures), `ReportFigure`, and the run folder they read, `RunFolder`
  (`read_run_folder` reads one, e.g. in a plugin's command group).

How to write and load a plugin: docs/extending.md; every name with its documentation: docs/api/plugins.md.
"""

from fedmerge.algorithms.base import (
    GlobalModelAlgorithm,
    StatisticsAlgorithm,
    adapted_state,
    client_sgd,
    fine_tuned,
    load_weights,
    model_weights,
    train_received,
)
from fedmerge.core.algorithm import (
    ALGORITHMS,
    Algorithm,
    AlgorithmConfig,
    ClientContext,
    ClientDataLike,
    ClientRows,
    ModelFactory,
    PlainSGD,
    Predictor,
    StateDict,
    adapt_epochs,
    with_epochs,
)
from fedmerge.core.merge import weighted_merge
from fedmerge.core.method_hooks import MethodHooks, ReportFigure, RunFolder
from fedmerge.core.params import weighted_average
from fedmerge.core.registry import ComponentConfig, Registry
from fedmerge.core.training import (
    ExtraLoss,
    LocalTraining,
    Step,
    StepHook,
    TrainStats,
    local_sgd,
    mean_loss,
    predict_logits,
)
from fedmerge.core.types import ClientState, Payload, ServerState, Update
from fedmerge.data import DATASETS, PARTITIONERS, DatasetConfig, Partition, PartitionConfig, Pool
from fedmerge.models import MODELS, Classifier, build_model, count_parameters
from fedmerge.models.registry import flat_size, image_shape
from fedmerge.report.method_figures import read_run_folder

__all__ = [
    # the algorithm
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmConfig",
    "ClientContext",
    "ClientDataLike",
    "ClientRows",
    "GlobalModelAlgorithm",
    "ModelFactory",
    "PlainSGD",
    "Predictor",
    "StateDict",
    "StatisticsAlgorithm",
    "adapt_epochs",
    "adapted_state",
    "client_sgd",
    "fine_tuned",
    "load_weights",
    "model_weights",
    "train_received",
    "with_epochs",
    # the records
    "ClientState",
    "Payload",
    "ServerState",
    "Update",
    # local training and averaging
    "ExtraLoss",
    "LocalTraining",
    "Step",
    "StepHook",
    "TrainStats",
    "local_sgd",
    "mean_loss",
    "predict_logits",
    "weighted_average",
    "weighted_merge",
    # registries and component configs
    "DATASETS",
    "MODELS",
    "PARTITIONERS",
    "ComponentConfig",
    "DatasetConfig",
    "Partition",
    "PartitionConfig",
    "Pool",
    "Registry",
    # models
    "Classifier",
    "build_model",
    "count_parameters",
    "flat_size",
    "image_shape",
    # what a method knows about its outputs
    "MethodHooks",
    "ReportFigure",
    "RunFolder",
    "read_run_folder",
]
