"""FedMerge's options (`FedMergeConfig`) and its two presets: the paper's forms and the reference code's
exact server step (``PRESETS``), with what the reference preset sets unless written (``PRESET_UNLESS_WRITTEN``).
The method itself, and what each option means, is in [`fedmerge.algorithms.fedmerge`][fedmerge.algorithms.fedmerge]."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, ValidationInfo, model_serializer, model_validator

from fedmerge.core.algorithm import AlgorithmConfig, keys_set_by_user

# The largest merge-logit change per round (fixed_magnitude): the default, and the reference code's
# learning_rate_W, which preset=reference keeps (docs/reproductions/fedmerge/logit_lr/ has the evidence).
DEFAULT_LOGIT_LR = 0.3
REFERENCE_LOGIT_LR = 0.01


class FedMergeConfig(AlgorithmConfig):
    name: Literal["fedmerge"] = "fedmerge"
    num_models: int = Field(5, ge=1, description="d, the number of global models on the server")
    prox_mu: float = Field(0.01, ge=0, description="proximal coefficient (see prox_form)")
    prox_form: Literal["reference", "fedprox"] = Field(
        "reference", description="reference: prox_mu*||w-w0||^2 (authors' code); fedprox: prox_mu/2*||w-w0||^2"
    )
    theta_lr: float = Field(1.0, gt=0, description="learning rate of the global models")
    theta_update: Literal["normalized", "sum"] = Field(
        "normalized", description="normalized: convex combination per model (reference); sum: paper's Eq. 5"
    )
    logit_step: Literal["fixed_magnitude", "gradient"] = Field(
        "fixed_magnitude", description="fixed_magnitude: largest logit change logit_lr per round; gradient: SGD"
    )
    logit_lr: float = Field(
        DEFAULT_LOGIT_LR,
        gt=0,
        description="merge-logit step (max change per round, or SGD lr); the default lets the weights move within "
        "20-50 rounds (the paper's 0.01 is for 200-500 rounds: docs/reproductions/fedmerge/logit_lr); "
        "preset=reference: 0.01 unless written",
    )
    merge_grad: Literal["all", "head", "from_key", "topk"] = Field(
        "all",
        description="entries in the merge-weight inner product: all parameters, the last Linear layer (head), "
        "every parameter from the first state-dict key containing merge_grad_key on (from_key), top-k |g|",
    )
    merge_grad_key: str = Field(
        "linear",
        min_length=1,
        description="from_key: the word that starts the entries (the reference's models name their head 'linear', "
        "this project's 'classifier'); no key containing it: every parameter",
    )
    merge_grad_topk: float = Field(0.1, gt=0, le=1, description="fraction of entries kept per client for topk")
    merge_weights: Literal["dynamic", "fixed"] = Field(
        "dynamic", description="dynamic: learned; fixed: fixed_k random models per client, uniform, frozen"
    )
    fixed_k: int = Field(1, ge=1, description="models per client when merge_weights=fixed")
    theta_weights: Literal["before", "after"] = Field(
        "before",
        description="merge weights in the Theta step: before (paper: one gradient step at one point) or after "
        "the logit update (reference code)",
    )
    logit_increment: float | None = Field(
        None,
        gt=0,
        description="fixed_magnitude: increment of each grid step (reference: 0.01, logit_lr is then only the stop "
        "threshold); default: equal to logit_lr",
    )
    onboard_lr: float = Field(
        1.0,
        gt=0,
        description="clients that never trained: SGD step size of the merge logits a newcomer fits on its own data "
        "(split.unseen_clients)",
    )
    preset: Literal["paper", "reference"] | None = Field(
        None,
        description="fill the server-step options with the paper's forms or the reference code's exact behaviour "
        "(server options set explicitly must agree with it); reference also sets the client's SGD (lr 0.01, 2 "
        "epochs, batch 32, no momentum or weight decay) unless set explicitly",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        preset = data["preset"]
        if preset not in PRESETS:
            return data  # the Literal check reports it
        out = dict(data)
        for key, value in PRESETS[preset].items():
            if (preset, key, out.get(key)) in FORMER_PRESET_VALUES:
                continue  # a run folder (or study row) written under the former rule keeps it
            if key in out and out[key] != value:
                msg = f"{key}={out[key]!r} contradicts preset {preset!r} ({key}={value!r}); drop one of them"
                raise ValueError(msg)
            out[key] = value
        written = keys_set_by_user(data, info.context)
        for key, value in PRESET_UNLESS_WRITTEN.get(preset, {}).items():
            if key not in written:  # a value the user wrote wins; a built-in default does not
                out[key] = value
        return out

    @model_serializer(mode="wrap")
    def _without_default_onboard_lr(self, handler: SerializerFunctionWrapHandler) -> dict:
        # left out at its default so that config.yaml and the config digest of older run folders stay unchanged
        out = handler(self)
        if self.onboard_lr == 1.0:
            out.pop("onboard_lr", None)
        return out

    @model_validator(mode="after")
    def _check_fixed_k(self) -> FedMergeConfig:
        if self.fixed_k > self.num_models:
            raise ValueError(f"fixed_k ({self.fixed_k}) cannot exceed num_models ({self.num_models})")
        return self


# The server step of each preset (an explicit option that contradicts it is refused). ``paper``: Eqs.
# 5-6 at one point (both updates use the current weights), the inner product over every parameter, the
# fixed-magnitude logit step whose increment is its threshold, Theta by the column-normalised convex
# combination ("learning rate 1: the global model is replaced with the local update model").
# ``reference``: shutong043/FedMerge @ac60469 exactly: the inner product over the parameters from the
# first state-dict key containing ``merge_grad_key`` on (its get_top_layers_from_key with 'linear': the
# head of its ResNet; every parameter when no key contains the word), a 0.01 increment with logit_lr as
# the stop threshold (10,000 steps at most), and Theta weights read from the updated logits. The
# defaults are the paper's forms: the paper is the authority on the method; the reference preset is for
# reproducing the authors' numbers.
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "theta_update": "normalized",
        "logit_step": "fixed_magnitude",
        "logit_increment": None,
        "merge_grad": "all",
        "theta_weights": "before",
    },
    "reference": {
        "prox_form": "reference",
        "theta_update": "normalized",
        "logit_step": "fixed_magnitude",
        "logit_increment": 0.01,
        "merge_grad": "from_key",
        "theta_weights": "after",
    },
}

# Values a preset set before it followed the reference more closely, still accepted when written: the
# reference preset took the last Linear layer (``merge_grad: head``) until it took the reference's key rule
# (``from_key``), and run folders and study rows of that time must keep loading and resuming as they ran.
FORMER_PRESET_VALUES = {("reference", "merge_grad", "head")}

# What each preset sets unless the user wrote it (an explicit value wins: studies tune the learning rate
# and logit_lr under the reference preset). The reference code hard-codes SGD with lr 0.01, no momentum or
# weight decay (whatever --lr says), defaults to 2 local epochs of batch 32, and stops its logit grid at
# learning_rate_W = 0.01 (only its default is usable: the option is declared type=int). The paper preset
# sets forms, not step sizes: it keeps the default logit_lr (the paper's 0.01 is for runs of 200-500 rounds).
PRESET_UNLESS_WRITTEN: dict[str, dict[str, Any]] = {
    "reference": {
        "lr": 0.01,
        "local_epochs": 2,
        "batch_size": 32,
        "momentum": 0.0,
        "weight_decay": 0.0,
        "logit_lr": REFERENCE_LOGIT_LR,
    },
}
