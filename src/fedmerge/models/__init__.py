"""Model builders by name. Every model names its last layer ``classifier`` (see ``head_prefix``)."""

from . import auto, causal_lm, cnn, lstm, mlp, mobilenet, resnet, text, vgg, vit  # noqa: F401  (imports register the models)
from .auto import AutoConfig
from .cnn import TwoCNN, TwoCNNConfig
from .lstm import CharLSTM, LSTMConfig
from .mlp import MLP, MLPConfig, TwoNNConfig
from .mobilenet import MobileNetV1, MobileNetV1Config, MobileNetV2, MobileNetV2Config
from .registry import MODELS, Classifier, build_model, count_parameters
from .resnet import (
    ResNet,
    ResNet9Config,
    ResNet18Config,
    ResNet34Config,
    ResNet50Config,
    ResNet101Config,
    ResNet152Config,
)
from .vgg import VGG, VGG11Config

__all__ = [
    "MODELS",
    "MLP",
    "VGG",
    "AutoConfig",
    "CharLSTM",
    "Classifier",
    "LSTMConfig",
    "MLPConfig",
    "MobileNetV1",
    "MobileNetV1Config",
    "MobileNetV2",
    "MobileNetV2Config",
    "ResNet",
    "ResNet9Config",
    "ResNet18Config",
    "ResNet34Config",
    "ResNet50Config",
    "ResNet101Config",
    "ResNet152Config",
    "TwoCNN",
    "TwoCNNConfig",
    "TwoNNConfig",
    "VGG11Config",
    "build_model",
    "count_parameters",
]
