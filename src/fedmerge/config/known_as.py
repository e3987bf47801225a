"""Names the papers give to a registered method with a particular setting (``fedmerge list`` shows them).

A module of its own, importing nothing: the fast ``fedmerge list`` reads it without loading the registries."""

# Methods the papers name that are a registered method with a particular setting.
KNOWN_AS: dict[str, tuple[str, str]] = {
    "fedit": ("fedavg", "FedIT: fedavg with model.name=minilm_lora (LoRA adapters and head averaged)"),
    "local lora": ("local", "Local LoRA: local with model.name=minilm_lora"),
    "fedavg+": ("fedavg_ft", "FedAvg+: fedavg_ft (FedAvg, then local fine-tuning)"),
    "fedmerge-fixed": ("fedmerge", "fixed-weight FedMerge ablation: fedmerge with algorithm.merge_weights=fixed"),
}
