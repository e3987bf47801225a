"""fedmerge records <-> Flower records: tensors in an ArrayRecord, metadata as JSON in a ConfigRecord."""

from __future__ import annotations

import json
from typing import TypeVar

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedmerge.core.types import ClientState, Record

R = TypeVar("R", bound=Record)

# dtypes numpy cannot hold travel as same-width integers and are viewed back on arrival.
_VIEW_AS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8}
_DTYPES = {str(d): d for d in _VIEW_AS}


def put_record(content: RecordDict, key: str, record: Record) -> None:
    """Store ``record`` in ``content`` under ``key`` (arrays) and ``key + '.meta'`` (JSON)."""
    arrays, views = ArrayRecord(), {}
    for name, tensor in record.tensors.items():
        t = tensor.detach().cpu().contiguous()
        if t.dtype in _VIEW_AS:
            views[name] = str(t.dtype)
            t = t.view(_VIEW_AS[t.dtype])
        arrays[name] = Array(t.numpy())
    content[key] = arrays
    content[f"{key}.meta"] = ConfigRecord({"json": json.dumps(record.meta, sort_keys=True), "views": json.dumps(views)})


def get_record(content: RecordDict, key: str, cls: type[R]) -> R:
    arrays, meta = content.array_records[key], content.config_records[f"{key}.meta"]
    views = json.loads(str(meta["views"]))
    tensors = {}
    for name, array in arrays.items():
        t = torch.from_numpy(array.numpy())
        tensors[name] = t.view(_DTYPES[views[name]]) if name in views else t
    return cls(tensors, json.loads(str(meta["json"])))


def has_record(content: RecordDict, key: str) -> bool:
    return key in content.array_records


# Client state kept in ``context.state`` (protocol.STATE_KEY): the ClientState's own bytes (safetensors).


def state_to_config(state: ClientState) -> ConfigRecord:
    return ConfigRecord({"bytes": state.to_bytes()})


def state_from_config(record: ConfigRecord) -> ClientState:
    return ClientState.from_bytes(bytes(record["bytes"]))
