"""``causal_lm_lora`` on instruction data, with a tiny randomly initialised LLaMA and a word-level tokenizer
written to a folder here (no network): encoding, the answer-token loss, greedy generation, ROUGE-1, and
FedIT / FedMerge / FedLoRA / Local through the runner."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import quick_config, run
from tiny_hf import tiny_llama

from fedmerge.metrics.generation import rouge1_scores
from fedmerge.run.results import RunStore

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "peft", "rouge_score")),
    reason='causal_lm_lora needs pip install "fedmerge[llm]" (transformers, peft, rouge-score)',
)

TASKS = {  # category -> (instruction, input, output)
    "colors": [("name a color", "", "red"), ("name a warm color", "", "orange"), ("name a cold color", "", "blue"),
               ("name the sky color", "", "blue"), ("name the grass color", "", "green"),
               ("name a dark color", "", "black")],
    "math": [("add two and two", "", "four"), ("add one and one", "", "two"), ("add two and one", "", "three"),
             ("add three and one", "", "four"), ("add one and zero", "", "one"), ("add zero and two", "", "two")],
    "french": [("translate to french", "cat", "le chat"), ("translate to french", "dog", "le chien"),
               ("translate to french", "house", "la maison"), ("translate to french", "water", "de l eau"),
               ("translate to french", "bread", "du pain"), ("translate to french", "red", "rouge")],
}  # fmt: skip
RECORDS = [{"instruction": i, "input": x, "output": o, "category": c} for c, rows in TASKS.items() for i, x, o in rows]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    data = root / "tasks.json"
    data.write_text(json.dumps(RECORDS * 2))  # 36 examples, 12 per category
    texts = [t for r in RECORDS for t in (r["instruction"], r["input"], r["output"])]
    return str(data), tiny_llama(root / "tiny-llama", texts)


@pytest.fixture(scope="module")
def lm(files):
    from fedmerge.data import load_pool
    from fedmerge.models import build_model

    data, folder = files
    pool = load_pool({"name": "instructions", "path": data, "tokenizer": folder, "max_tokens": 64})
    cfg = {"name": "causal_lm_lora", "model": folder, "r": 4, "max_new_tokens": 5}
    model = build_model(cfg, pool.x.shape[1:], pool.num_classes, torch.Generator().manual_seed(0))
    return model, torch.as_tensor(pool.x), torch.as_tensor(pool.y), pool


# --- ROUGE-1 and the encoding -------------------------------------------------------------
def test_rouge1_matches_hand_computed_values():
    # "the cat sat" vs "the cat ran away": 2 shared unigrams, P = 2/3, R = 2/4, F = 2PR/(P+R) = 4/7
    assert rouge1_scores(["the cat sat"], ["the cat ran away"]) == [pytest.approx(4 / 7)]
    assert rouge1_scores(["The CAT!"], ["the cat"]) == [pytest.approx(1.0)]  # lowercased, punctuation dropped
    # rouge_score keeps only ASCII letters and digits: Greek vanishes; the unicode tokenizer keeps it
    assert rouge1_scores(["καλή μέρα"], ["καλή νύχτα"]) == [0.0]
    assert rouge1_scores(["καλή μέρα"], ["καλή νύχτα"], "unicode") == [pytest.approx(0.5)]


def test_examples_encode_prompt_then_answer_with_roles():
    from fedmerge.models.causal_lm import ANSWER, PAD, PROMPT, encode_examples

    x = encode_examples([[5, 6, 7], [1, 2, 3, 4, 5, 6]], [[8, 9, 2], [10, 2]], max_tokens=5, pad_id=0)
    assert x[0].tolist() == [[5, 6, 7, 8, 9], [PROMPT] * 3 + [ANSWER] * 2]  # the answer is cut at the end
    assert x[1].tolist() == [[3, 4, 5, 6, 10], [PROMPT] * 4 + [ANSWER]]  # a long prompt keeps its last tokens
    y = encode_examples([[5]], [[8, 2]], max_tokens=5, pad_id=0)
    assert y[0].tolist() == [[5, 8, 2, 0, 0], [PROMPT, ANSWER, ANSWER, PAD, PAD]]


def test_pool_holds_categories_as_labels_and_client_ids(lm, files):
    from fedmerge.data.sources.instructions import alpaca_prompt
    from fedmerge.models.causal_lm import ANSWER, PROMPT, load_causal_tokenizer

    _, x, y, pool = lm
    assert pool.class_names == ["colors", "french", "math"] and pool.num_classes == 3
    assert torch.equal(torch.as_tensor(pool.natural_id), y)
    tok = load_causal_tokenizer(files[1])
    r = RECORDS[12]  # "translate to french" / "cat" -> "le chat"
    assert y[12] == pool.class_names.index("french")
    prompt = x[12, 0][x[12, 1] == PROMPT].tolist()
    assert prompt == tok(alpaca_prompt(r["instruction"], r["input"]))["input_ids"]
    assert "### Input:" in alpaca_prompt(r["instruction"], r["input"]) and "### Input:" not in alpaca_prompt("x")
    assert x[12, 0][x[12, 1] == ANSWER].tolist() == tok("le chat", add_special_tokens=False)["input_ids"] + [2]


# --- the loss -------------------------------------------------------------------------------
def test_task_loss_is_next_token_cross_entropy_on_answer_tokens_only(lm, files):
    from transformers import LlamaForCausalLM

    from fedmerge.models.causal_lm import ANSWER

    model, x, y, _ = lm
    reference = LlamaForCausalLM.from_pretrained(files[1]).eval()  # B = 0: the adapters are no-ops
    xb = x[:4]
    with torch.no_grad():
        got = model.task_loss(model(xb), xb, y[:4])
        terms = []
        for row in xb:  # by hand, one example at a time, without padding
            n = int((row[1] != 0).sum())
            logits = reference(input_ids=row[0, :n][None]).logits[0]
            for t in range(1, n):
                if row[1, t] == ANSWER:  # position t-1 predicts token t
                    terms.append(F.cross_entropy(logits[t - 1], row[0, t]))
    assert len(terms) == int((xb[:, 1] == ANSWER).sum())
    torch.testing.assert_close(got, torch.stack(terms).mean())


def test_training_moves_only_the_adapters_and_lowers_the_loss(lm):
    from fedmerge.core.training import LocalTraining, local_sgd

    model, x, y, _ = lm
    before = {k: v.clone() for k, v in model.state_dict().items()}
    backbone = model.backbone(torch.device("cpu")).module
    frozen = {k: v.clone() for k, v in backbone.state_dict().items()}
    try:
        with torch.no_grad():
            start = float(model.task_loss(model(x), x, y))
        local_sgd(model, x, y, LocalTraining(lr=1.0, local_epochs=8, batch_size=12), torch.Generator().manual_seed(0))
        with torch.no_grad():
            end = float(model.task_loss(model(x), x, y))
        assert end < start - 0.2
        assert all(torch.equal(v, frozen[k]) for k, v in backbone.state_dict().items())
        assert list(model.state_dict()) == model.adapter_keys()  # nothing but adapters, no head
    finally:
        model.load_state_dict(before)


# --- generation and ROUGE-1 ---------------------------------------------------------------------
def test_cached_and_stepwise_greedy_decoding_agree(lm):
    model, x, _, _ = lm
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = model.generate_answers(model, x, 8)
    try:  # random B matrices: adapters that change the answers
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen))
        cached = model.generate_answers(model, x, 8)  # generate() with a key-value cache
        stepwise = model.generate_answers(lambda b: model(b), x, 8)  # one full forward per token
        assert cached == stepwise
        assert cached != plain  # the adapters are in the generation
        assert len(set(cached)) > 1 and all(len(a.split()) <= 5 for a in cached)  # max_new_tokens=5
    finally:
        model.load_state_dict(before)


def oracle(x, final_id, scale=30.0):
    """A predictor whose next token at each position is the row's next reference token (EOS after the
    answer), recognising rows by their prompt: what a model that learned the data perfectly does."""
    from fedmerge.models.causal_lm import ANSWER, PROMPT

    answers = {}
    for row in x:
        prompt = tuple(row[0][row[1] == PROMPT].tolist())
        answers[prompt] = [*prompt, *row[0][row[1] == ANSWER].tolist()]

    def predict(b):
        out = torch.full((b.shape[0], b.shape[2], final_id + 1), -scale)
        for r, row in enumerate(b):
            seq = answers[tuple(row[0][row[1] == PROMPT].tolist())]
            for t in range(min(len(seq) - 1, b.shape[2])):
                out[r, t, seq[t + 1]] = scale
        return out

    return predict


def test_a_model_that_answers_the_references_scores_rouge1_one(lm):
    from fedmerge.engines.evaluation import generative_metrics

    model, x, _, _ = lm
    vocab = model.backbone(torch.device("cpu")).module.config.vocab_size
    predict = oracle(x, vocab - 1)
    assert model.generate_answers(predict, x, 64) == model.reference_answers(x)  # token for token, EOS stops it
    m = generative_metrics(model, predict, x, 64)
    assert m["rouge1"] == pytest.approx(1.0) and m["n"] == len(x)
    assert m["nll"] < 1e-6
    # the references are the records' outputs, decoded (EOS left out)
    assert model.reference_answers(x[:18]) == [r["output"] for r in RECORDS]


def test_rouge1_of_the_models_answers_is_the_mean_over_examples(lm):
    from fedmerge.engines.evaluation import generative_metrics

    model, x, _, _ = lm
    with torch.no_grad():
        nll_sum, tokens = model.answer_nll(model, x, 5)
        answers = model.generate_answers(model, x, 5)
        m = generative_metrics(model, model, x, 1024)
    by_hand = [rouge1_scores([a], [r["output"]])[0] for a, r in zip(answers, RECORDS * 2)]
    assert m["rouge1"] == pytest.approx(sum(by_hand) / len(by_hand))
    with torch.no_grad():
        assert m["nll"] == pytest.approx(float(model.task_loss(model(x), x, None)), rel=1e-5)  # all answer tokens
    assert m["nll"] == pytest.approx(nll_sum / tokens) and tokens == int((x[:, 1] == 2).sum())


# --- runs -----------------------------------------------------------------------------------
def lm_config(files, tmp_path, *overrides):
    data, folder = files
    return quick_config(
        "dataset.name=instructions", f"dataset.path={data}", f"dataset.tokenizer={folder}", "dataset.max_tokens=64",
        "model.name=causal_lm_lora", f"model.model={folder}", "model.r=4", "model.max_new_tokens=4",
        "partition.name=natural", "partition.num_clients=null", "rounds=2", "algorithm.lr=0.5",
        "algorithm.batch_size=4", *overrides, output_dir=tmp_path,
    )  # fmt: skip


@pytest.mark.parametrize("algorithm", ["fedavg", "fedmerge", "fedlora", "local"])
def test_methods_run_through_the_runner(files, tmp_path, algorithm):
    extra = ["algorithm.num_models=2"] if algorithm == "fedmerge" else []
    res = run(lm_config(files, tmp_path, f"algorithm.name={algorithm}", *extra), tmp_path / algorithm)
    rows = RunStore(res.run_dir).read_metrics()
    assert [r["round"] for r in rows] == [1, 2]
    clients = rows[-1]["eval"]["clients"]
    assert sorted(clients, key=int) == ["0", "1", "2"]  # one client per category
    for m in clients.values():
        assert 0.0 <= m["test_rouge1"] <= 1.0 and 0.0 <= m["val_rouge1"] <= 1.0
        assert math.isfinite(m["val_nll"]) and math.isfinite(m["test_nll"]) and "test_acc" not in m
    val = [sum(c["val_nll"] for c in r["eval"]["clients"].values()) / 3 for r in rows]
    assert res.summary["best_val"]["val_nll"] == pytest.approx(min(val))  # the paper's selection: lowest val loss
    assert res.summary["best_val"]["round"] == rows[val.index(min(val))]["round"]
    assert math.isfinite(rows[-1]["train_loss"])
    if algorithm == "fedmerge":
        assert tuple(res.server_state.tensors["theta"].shape) == (2, res.summary["parameters"]["model"])


def test_dirichlet_over_categories(files, tmp_path):
    res = run(lm_config(files, tmp_path, "partition.name=dirichlet", "partition.num_clients=2", "rounds=1"),
              tmp_path / "dir")  # fmt: skip
    assert len(RunStore(res.run_dir).read_metrics()[-1]["eval"]["clients"]) == 2
