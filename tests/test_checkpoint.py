import json

import pytest
import torch

from fedmerge.core.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fedmerge.core.types import ClientState, ServerState


def _states():
    server = ServerState({"w": torch.randn(5), "step": torch.tensor(3)}, {"k": 1})
    clients = {0: ClientState({"v": torch.randn(2)}, {"alpha": 0.5}), 7: ClientState(meta={"cluster": 2})}
    return server, clients


def test_round_trip_and_rotation(tmp_path):
    server, clients = _states()
    for rnd in (1, 2, 3):
        save_checkpoint(tmp_path, rnd, server, clients, {"digest": "abc"}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("round-*")) == [
        "round-000002.safetensors",
        "round-000003.safetensors",
    ]
    ck = load_checkpoint(tmp_path)
    assert ck.round == 3 and ck.meta == {"digest": "abc"}
    assert torch.equal(ck.server_state.tensors["w"], server.tensors["w"]) and ck.server_state.meta == {"k": 1}
    assert torch.equal(ck.client_states[0].tensors["v"], clients[0].tensors["v"])
    assert ck.client_states[7].meta == {"cluster": 2} and ck.client_states[7].tensors == {}
    assert not list(tmp_path.glob(".*tmp*"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "pointer"])
def test_corrupt_checkpoint_is_refused(tmp_path, damage):
    server, clients = _states()
    path = save_checkpoint(tmp_path, 1, server, clients)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "delete":
        path.unlink()
    else:
        (tmp_path / "latest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt|missing|unreadable"):
        load_checkpoint(tmp_path)


def test_missing_checkpoint_message(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path)


def test_pointer_records_checksum(tmp_path):
    server, clients = _states()
    save_checkpoint(tmp_path, 4, server, clients)
    pointer = json.loads((tmp_path / "latest.json").read_text())
    assert pointer["round"] == 4 and len(pointer["sha256"]) == 64
