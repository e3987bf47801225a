"""Tiny randomly initialised Hugging Face models written to a folder, for tests with no network:
a ViT with its image processor, and a LLaMA-architecture causal LM with a word-level tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_VIT = dict(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=37, num_channels=3)  # fmt: skip
VIT_MEAN, VIT_STD = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)


def tiny_vit(folder: Path, seed: int = 0) -> str:
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(seed)
    ViTModel(ViTConfig(**TINY_VIT), add_pooling_layer=False).save_pretrained(folder)
    # what ViTImageProcessor.save_pretrained writes, minus the keys this code does not read
    pre = {"image_processor_type": "ViTImageProcessor", "image_mean": list(VIT_MEAN), "image_std": list(VIT_STD),
           "size": {"height": 16, "width": 16}, "do_normalize": True, "do_rescale": True}  # fmt: skip
    (Path(folder) / "preprocessor_config.json").write_text(json.dumps(pre))
    return str(folder)


def tiny_llama(folder: Path, texts: list[str], seed: int = 0) -> str:
    """A 2-layer LLaMA whose word-level vocabulary covers ``texts`` and Alpaca's prompt templates."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from fedmerge.data.sources.instructions import PROMPT_NO_INPUT, PROMPT_WITH_INPUT

    pre = pre_tokenizers.Whitespace()
    words = {w for t in [*texts, PROMPT_NO_INPUT, PROMPT_WITH_INPUT] for w, _ in pre.pre_tokenize_str(t)}
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", *sorted(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)
