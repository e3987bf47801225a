"""Instruction data in the Alpaca format (instruction, input, output), tokenized for a causal LM.

``instructions`` reads a JSON file (a list of records, or JSON Lines) such as Alpaca's
``alpaca_data.json``, Dolly (``fields: {input: context, output: response}``) or a multilingual set
whose records name their language. Each record becomes one example for ``causal_lm_lora``:

* the prompt is Alpaca's template (with or without its ``### Input:`` section), the answer is the
  output followed by the tokenizer's EOS;
* ``Pool.x`` is int64 ``(N, 2, max_tokens)``: token ids and each token's role (pad, prompt, answer;
  see ``fedmerge.models.causal_lm.encode_examples`` for the truncation rule);
* ``y`` and ``natural_id`` are the record's task category (``category_field``, e.g. Dolly's
  ``category`` or a language), so ``partition.name=natural`` gives one client per category and
  ``partition.name=dirichlet`` a Dirichlet split over categories; ``y`` is never a prediction target.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from fedmerge.data.errors import DataUnavailable
from fedmerge.data.pool import DATASETS, DatasetConfig, Pool

# Alpaca's prompt templates (tloen/alpaca-lora, templates/alpaca.json)
PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def alpaca_prompt(instruction: str, input_text: str = "") -> str:
    if input_text.strip():
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return PROMPT_NO_INPUT.format(instruction=instruction)


class InstructionFields(BaseModel):
    """The record keys holding each part (Dolly: input=context, output=response)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instruction: str = Field("instruction", description="key of the instruction")
    input: str = Field("input", description="key of the optional context")
    output: str = Field("output", description="key of the answer")


class InstructionsConfig(DatasetConfig):
    name: Literal["instructions"] = "instructions"
    path: str = Field(description="a JSON file: a list of records, or one record per line (JSON Lines)")
    tokenizer: str = Field(
        description="the causal LM whose tokenizer to use (a Hub name or a local folder): the same as model.model"
    )
    max_tokens: int = Field(512, ge=2, description="prompt + answer length cap in tokens (the paper: 512)")
    fields: InstructionFields = Field(default_factory=InstructionFields, description="record keys of the parts")
    category_field: str | None = Field(
        "category", description="record key of the task category (clients split by it); null: one category"
    )
    categories: tuple[str, ...] | None = Field(
        None, min_length=1, description="keep only these categories, labelled in this order (default: all, sorted)"
    )
    over_length: Literal["truncate", "drop"] = Field(
        "truncate",
        description="a record whose prompt + answer exceed max_tokens: truncate it, or drop it (FedMerge's XQuAD "
        "skips those)",
    )


def read_records(path: str) -> list[dict]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataUnavailable(f"instruction file not found: {file} (check dataset.path)")
    text = file.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:  # JSON Lines
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}: neither JSON nor JSON Lines ({exc})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{file}: expected a list of records (objects)")
    if not data:
        raise ValueError(f"{file}: no records")
    return data


def parse_records(
    records: list[dict], fields: InstructionFields, category_field: str | None, categories: tuple[str, ...] | None
) -> tuple[list[str], list[str], np.ndarray, list[str]]:
    """(prompts, answers, category label per record, category names) of the records kept."""
    for key in (fields.instruction, fields.output):
        missing = next((i for i, r in enumerate(records) if not isinstance(r.get(key), str)), None)
        if missing is not None:
            raise ValueError(f"record {missing} has no text field {key!r} (set dataset.fields)")
    if category_field is None:
        cats = ["all"] * len(records)
    else:
        missing = next((i for i, r in enumerate(records) if category_field not in r), None)
        if missing is not None:
            raise ValueError(f"record {missing} has no {category_field!r} (set dataset.category_field, or null)")
        cats = [str(r[category_field]) for r in records]
    names = list(categories) if categories is not None else sorted(set(cats))
    unknown = sorted(set(names) - set(cats))
    if unknown:
        raise ValueError(f"dataset.categories: {unknown} occur in no record; found {sorted(set(cats))}")
    index = {c: i for i, c in enumerate(names)}
    kept = [i for i, c in enumerate(cats) if c in index]
    prompts = [alpaca_prompt(records[i][fields.instruction], str(records[i].get(fields.input) or "")) for i in kept]
    answers = [records[i][fields.output] for i in kept]
    return prompts, answers, np.asarray([index[cats[i]] for i in kept], dtype=np.int64), names


def fitting(prompt_ids: list[list[int]], answer_ids: list[list[int]], max_tokens: int) -> list[int]:
    """Indices of the records whose prompt and answer (with its EOS) fit in ``max_tokens`` whole."""
    return [i for i, (p, a) in enumerate(zip(prompt_ids, answer_ids, strict=True)) if len(p) + len(a) <= max_tokens]


@DATASETS.register(
    "instructions",
    config=InstructionsConfig,
    description="Alpaca-format instruction JSON (instruction, input, output, category), tokenized for "
    "causal_lm_lora; clients by category",
)
def load_instructions(cfg: InstructionsConfig) -> Pool:
    x, y, names = _instructions_cached(cfg.path, cfg.tokenizer, cfg.max_tokens, cfg.fields, cfg.category_field,
                                       cfg.categories, cfg.over_length)  # fmt: skip
    return Pool(x.copy(), y.copy(), len(names), "instructions", natural_id=y.copy(), class_names=list(names))


@functools.lru_cache(maxsize=4)
def _instructions_cached(
    path: str,
    tokenizer: str,
    max_tokens: int,
    fields: InstructionFields,
    category_field: str | None,
    categories: tuple[str, ...] | None,
    over_length: str = "truncate",
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    from fedmerge.models.causal_lm import encode_examples, load_causal_tokenizer, special_ids
    from fedmerge.models.lora import LoRAUnavailable

    prompts, answers, y, names = parse_records(read_records(path), fields, category_field, categories)
    try:
        tok = load_causal_tokenizer(tokenizer)
    except LoRAUnavailable as exc:
        raise DataUnavailable(f"instruction data is tokenized for its causal LM: {exc}") from exc
    eos, pad = special_ids(tok)
    prompt_ids = tok(prompts, add_special_tokens=True)["input_ids"]
    answer_ids = [ids + [eos] for ids in tok(answers, add_special_tokens=False)["input_ids"]]
    if over_length == "drop":
        keep = fitting(prompt_ids, answer_ids, max_tokens)
        if not keep:
            raise ValueError(f"dataset.over_length=drop: no record fits in max_tokens={max_tokens}")
        prompt_ids, answer_ids, y = [prompt_ids[i] for i in keep], [answer_ids[i] for i in keep], y[keep]
    x = encode_examples(prompt_ids, answer_ids, max_tokens, pad)
    x.setflags(write=False)
    return x, y, tuple(names)
