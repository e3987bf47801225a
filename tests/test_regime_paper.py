"""What the paper studies ask of the study runner (#35): the central reference trains on the study's device,
a causal LM's reference is scored like its rows (ROUGE-1 of generated answers, epochs by the answer tokens'
validation loss), the report prints that check, and ``select: val_loss`` picks a row's grid point by the
lowest validation loss."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from fedmerge.core.training import LocalTraining, local_sgd
from fedmerge.data.federated import ClientData, FederatedDataset
from fedmerge.run import data_plan
from fedmerge.study import protocol, regime, report
from fedmerge.study.protocol import Conducted, choose
from fedmerge.study.spec import StudyFile, run_key

HAVE_LLM = all(importlib.util.find_spec(m) is not None for m in ("transformers", "peft", "rouge_score"))
needs_llm = pytest.mark.skipif(not HAVE_LLM, reason='needs pip install "fedmerge[llm]"')


def two_groups(n: int = 24) -> FederatedDataset:
    gen = torch.Generator().manual_seed(0)
    clients = []
    for cid in range(4):
        splits = []
        for _ in range(3):
            x = torch.randn(n, 2, generator=gen)
            splits += [x, (x[:, 0] > 0).long()]
        clients.append(ClientData(cid, *splits, group=cid // 2))
    return FederatedDataset(clients, 2, (2,), "synthetic")


# --- the device ---------------------------------------------------------------------------------


def test_the_reference_trains_and_scores_on_the_device_it_is_given(monkeypatch):
    """On the meta device (no values, so every computation is a spy): the model and every tensor it trains,
    validates and is tested on are on that device, none left on the CPU."""
    seen: list[tuple[str, set[str]]] = []

    def devices(*tensors: torch.Tensor) -> set[str]:
        return {t.device.type for t in tensors}

    def fake_sgd(model, x, y, cfg, gen):
        seen.append(("train", devices(x, y, *model.parameters())))

    def fake_val(model, x, y):
        seen.append(("val", devices(x, y, *model.parameters())))
        return 1.0

    def fake_acc(logits, y):
        seen.append(("test", devices(logits, y)))
        return 0.5

    monkeypatch.setattr(regime, "local_sgd", fake_sgd)
    monkeypatch.setattr(regime, "_val_loss", fake_val)
    monkeypatch.setattr(regime, "_accuracy", fake_acc)
    ref = regime.central_reference(two_groups(), {"name": "mlp", "hidden": [4]}, LocalTraining(), 0, max_epochs=2,
                                   device="meta")  # fmt: skip
    assert ref.client_acc == [0.5] * 4 and ref.epochs == [1, 1]
    # scored: 4 clients x (test, validation) x (plain, with the client prior)
    assert [what for what, _ in seen].count("train") == 4 and [what for what, _ in seen].count("test") == 16
    assert all(d == {"meta"} for _, d in seen), seen


class NoData:
    """Stands for a dataset that a spy reference never reads (moving it to a device is all it allows)."""

    def to(self, device: torch.device) -> NoData:
        return self


def test_the_study_hands_the_configs_device_to_the_reference(tmp_path, monkeypatch):
    """A paper study's base config says ``device: cuda``: its reference is asked to train there (CUDA faked
    available here; the reference itself is a spy)."""
    base = tmp_path / "base.yaml"
    base.write_text("device: cuda\nrounds: 2\n")
    spec = StudyFile.model_validate(
        {"title": "t", "base": str(base), "seeds": [0], "regime": {"max_epochs": 3},
         "methods": [{"label": "Local", "overrides": ["algorithm.name=local"]}]}
    )  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(data_plan, "load_data", lambda cfg: NoData())  # the reference is a spy: no data needed
    asked = {}

    def spy(data, model_cfg, training, seed, **kw):
        asked.update(kw)
        return regime.CentralReference("all", [1], [0.1], [0.5], [0.5], [0.4], [0.4])

    monkeypatch.setattr(protocol, "central_reference", spy)
    out = protocol.regime(spec.at(), tmp_path / "runs")
    assert asked["device"] == torch.device("cuda") and asked["max_epochs"] == 3
    assert out[0]["mean"] == 0.5 and out[0]["metric"] == "acc"


def test_a_study_on_a_machine_without_its_device_is_refused_in_one_line(tmp_path, monkeypatch):
    from fedmerge.config.schema import ConfigError

    base = tmp_path / "base.yaml"
    base.write_text("device: cuda\n")
    spec = StudyFile.model_validate({"title": "t", "base": str(base), "seeds": [0], "methods": [{"label": "Local"}]})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(data_plan, "load_data", lambda cfg: NoData())
    with pytest.raises(ConfigError, match="CUDA is not available"):
        protocol.regime(spec.at(), tmp_path / "runs")


# --- a causal LM's reference ---------------------------------------------------------------------

RECORDS = [
    {"instruction": i, "input": x, "output": o, "category": c}
    for c, rows in {
        "en": [("is it true", "the sky is blue", "yes"), ("is it true", "the sky is green", "no")],
        "fr": [("est ce vrai", "le ciel est bleu", "oui"), ("est ce vrai", "le ciel est vert", "non")],
        "de": [("ist es wahr", "der himmel ist blau", "ja"), ("ist es wahr", "der himmel ist grün", "nein")],
    }.items()
    for i, x, o in rows
] * 5  # 10 per language


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    if not HAVE_LLM:
        pytest.skip('needs pip install "fedmerge[llm]"')
    from tiny_hf import tiny_llama

    from fedmerge.config.schema import load_config
    from fedmerge.run.prepare import load_data

    root = tmp_path_factory.mktemp("lm-ref")
    (root / "data.json").write_text(json.dumps(RECORDS))
    folder = tiny_llama(root / "llama", [t for r in RECORDS for t in (r["instruction"], r["input"], r["output"])])
    cfg = load_config(None, [
        "dataset.name=instructions", f"dataset.path={root / 'data.json'}", f"dataset.tokenizer={folder}",
        "dataset.max_tokens=32", "partition.name=natural", "partition.num_clients=null", "split.val_fraction=0.2",
        "split.test_fraction=0.2", "model.name=causal_lm_lora", f"model.model={folder}", "model.r=2",
        "model.max_new_tokens=3", "algorithm.lr=0.5", "algorithm.batch_size=4",
    ])  # fmt: skip
    return cfg, load_data(cfg)


@needs_llm
def test_a_causal_lms_reference_is_its_pooled_model_scored_by_rouge1_of_its_answers(lm_data):
    """Recomputed by hand from the lower pieces: the model the reference builds, one epoch of local SGD on
    every client's pooled training data, then each client's ROUGE-1 of greedy answers to its test prompts."""
    from fedmerge.metrics.generation import rouge1_scores
    from fedmerge.models import build_model

    cfg, data = lm_data
    ref = regime.central_reference(data, cfg.model, cfg.algorithm, 0, scope="all", max_epochs=1)
    assert ref.metric == "rouge1" and ref.scope == "all" and ref.epochs == [1]
    assert all(math.isnan(v) for v in ref.client_acc_prior) and math.isnan(ref.mean_prior)

    model = build_model(cfg.model, data.input_shape, data.num_classes, generator=regime._gen(0, "init"))
    x = torch.cat([c.x_train for c in data.clients])
    y = torch.cat([c.y_train for c in data.clients])
    training = cfg.algorithm.model_copy(update={"local_epochs": 1, "local_steps": None})
    local_sgd(model, x, y, training, regime._gen(0, "central/None/1"))
    model.eval()
    want = []
    for c in data.clients:
        answers = model.generate_answers(model, c.x_test, min(1024, model.eval_batch_size))
        scores = rouge1_scores(answers, model.reference_answers(c.x_test), model.rouge_tokenizer)
        want.append(sum(scores) / len(scores))
    assert len(want) == 3 and ref.client_acc == pytest.approx(want, abs=1e-12)


@needs_llm
def test_a_causal_lms_reference_chooses_its_epoch_by_the_runs_val_nll(lm_data):
    """The validation loss the reference's epochs are chosen by is the runs' ``val_nll``: the same number
    ``generative_metrics`` gives a client's evaluation; the chosen epoch is the one where it is lowest."""
    from fedmerge.engines.evaluation import generative_metrics
    from fedmerge.models import build_model

    cfg, data = lm_data
    model = build_model(cfg.model, data.input_shape, data.num_classes, generator=regime._gen(0, "init"))
    c = data.clients[0]
    assert regime._val_loss(model, c.x_val, c.y_val) == pytest.approx(
        generative_metrics(model, model, c.x_val, 1024)["nll"], rel=1e-12
    )
    losses = []
    real = regime._val_loss

    def record(model, x, y):
        losses.append(real(model, x, y))
        return losses[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(regime, "_val_loss", record)
        ref = regime.central_reference(data, cfg.model, cfg.algorithm, 0, scope="all", max_epochs=3)
    assert len(losses) == 3 and ref.epochs == [1 + min(range(3), key=losses.__getitem__)]


# --- the report ------------------------------------------------------------------------------------


ROWS = [
    {"label": "Local", "grid": {"algorithm.lr": [0.1, 0.3]}},
    {"label": "FedAvg", "grid": {"algorithm.lr": [0.1, 0.3]}},
]


def rouge_study(**extra) -> StudyFile:
    fields = {"title": "LM", "base": "b.yaml", "seeds": [0], "metric": {"name": "rouge1"}, "methods": ROWS}
    return StudyFile.model_validate(fields | extra)


def summary(val_rouge: float, val_nll: float, test_rouge: float) -> dict:
    clients = {"val_rouge1": {"mean": val_rouge}, "test_rouge1": {"mean": test_rouge}, "test_nll": {"mean": 1.0}}
    return {"best_val": {"round": 3, "val_nll": val_nll, "clients": clients, "global": None},
            "last": {"round": 5, "clients": clients, "global": None}}  # fmt: skip


REF = {"scope": "all", "mean": 0.60, "mean_prior": float("nan"), "metric": "rouge1"}  # a reference's JSON


def test_the_report_checks_a_causal_lms_regime_on_rouge1(monkeypatch, tmp_path):
    study = rouge_study(regime={"scope": "all"}).at()
    summaries = {run_key("Local", 0, 0): summary(0.3, 2.0, 0.40), run_key("FedAvg", 0, 0): summary(0.3, 2.0, 0.45)}
    monkeypatch.setattr(report, "summary_of", lambda runs, key: summaries.get(key))
    done = Conducted(study, [study], tmp_path, {"Local": 0, "FedAvg": 0}, {0: REF})
    text = report.report(done)
    assert "| 0 | all | 60.0 | - | 40.0 | 45.0 | 20.0 | 15.0 | yes |" in text
    assert "ROUGE-1 of the greedy answers generated for each client's prompts" in text
    assert "label distribution reaches" not in text  # the classifier's prior sentence
    checks = report.results_json(done)["regime"]
    assert checks[0]["local_gap"] == pytest.approx(20.0) and checks[0]["passes"] and checks[0]["split"] == "test"
    # a reference that kept validation scores: the check reads the rows' validation ROUGE-1 (0.3) instead
    with_val = {**REF, "val_mean": 0.55, "val_mean_prior": float("nan")}
    done = Conducted(study, [study], tmp_path, {"Local": 0, "FedAvg": 0}, {0: with_val})
    (check,) = report.results_json(done)["regime"]
    assert check["split"] == "val" and check["local_gap"] == pytest.approx(25.0) == check["fedavg_gap"]


def test_an_earlier_reference_without_a_metric_is_read_as_top1(monkeypatch, tmp_path):
    study = rouge_study(metric={"name": "acc"}).at()
    s = {"best_val": {"clients": {"test_acc": {"mean": 0.5}}}}
    monkeypatch.setattr(report, "summary_of", lambda runs, key: s)
    done = Conducted(study, [study], tmp_path, {"Local": 0, "FedAvg": 0}, {0: {"scope": "all", "mean": 0.8}})
    assert report._regime_checks(done)[0]["local_gap"] == pytest.approx(30.0)


# --- select: val_loss --------------------------------------------------------------------------------


def test_select_val_loss_chooses_the_point_of_lowest_validation_loss(monkeypatch, tmp_path):
    """Point 0 has the better validation ROUGE-1, point 1 the lower validation loss: the default picks 0,
    ``select: val_loss`` picks 1, and the tuning table shows the losses."""
    summaries = {
        run_key(label, i, 0): summary(*vals)
        for label in ("Local", "FedAvg")
        for i, vals in enumerate([(0.5, 2.0, 0.4), (0.4, 1.5, 0.3)])
    }
    monkeypatch.setattr(protocol, "summary_of", lambda runs, key: summaries.get(key))
    monkeypatch.setattr(report, "summary_of", lambda runs, key: summaries.get(key))
    assert choose(rouge_study().at(), tmp_path) == {"Local": 0, "FedAvg": 0}
    by_loss = rouge_study(select="val_loss").at()
    assert choose(by_loss, tmp_path) == {"Local": 1, "FedAvg": 1}
    text = report.report(Conducted(by_loss, [by_loss], tmp_path, choose(by_loss, tmp_path), {0: REF}))
    assert "## Tuning (lowest mean client validation loss over the rounds, tuning seed)" in text
    assert "| Local | lr=0.3 (chosen) | 1.5000 |" in text and "| Local | lr=0.1 | 2.0000 |" in text
    assert "the point whose best round has the lowest mean client validation loss" in text


def test_select_takes_only_its_two_values():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="val_metric"):
        rouge_study(select="val_acc")


def test_the_table_5_studies_select_by_validation_loss_and_check_their_regime_pooled(monkeypatch):
    from fedmerge.study.spec import load_study_file

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # a study's base is relative to the working folder
    for name in ("fedmerge_t5_xnli", "fedmerge_t5_xquad"):
        study = load_study_file(root / "studies" / "paper" / f"{name}.yaml").at()
        assert study.select == "val_loss" and study.metric.name == "rouge1"
        assert study.regime.scope == "all" and study.regime.max_epochs == 20  # = 20 rounds x 1 local epoch
