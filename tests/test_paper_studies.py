"""The papers' own experiments (``studies/paper/``): every study file is in the study runner's format, every
grid point of every row is a valid config, and one round of every row's code path runs on a stand-in.

A stand-in keeps the row's config and cuts only sizes: the same dataset loader reads tiny archives in the
source's own layout (written here, no network), the same partitioner and label noise split them over a few
clients, the same model family is built small (a tiny ViT or LLaMA written to a folder for the pretrained
ones), and the same algorithm runs one round through the runner on CPU. Rows that share a code path run
once (see ``code_paths``): about 80 runs instead of 500, so that the file stays near a minute of CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import itertools
import json
import math
import pickle
import re
import tarfile
import zipfile
from contextlib import ExitStack
from copy import deepcopy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from fetch_server import sha256

from fedmerge.config import schema
from fedmerge.config.schema import ConfigError, load_config
from fedmerge.data.catalog import CATALOG

ROOT = Path(__file__).resolve().parents[1]
STUDY_FILES = sorted((ROOT / "studies" / "paper").glob("*.yaml"))
NEEDS_HF = ("vit_lora", "causal_lm_lora")
HAVE_HF = all(importlib.util.find_spec(m) is not None for m in ("transformers", "peft", "rouge_score"))


def load_study(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def grid_points(method: dict[str, Any]) -> list[dict[str, Any]]:
    """The runner's tuning points: the product of ``grid``, then ``extra_points`` (scripts/reproduce.py)."""
    grid = method.get("grid") or {}
    keys = list(grid)
    points = [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]
    return points + [dict(p) for p in method.get("extra_points") or []]


def row_overrides(method: dict[str, Any], point: dict[str, Any], seed: int) -> list[str]:
    return [*method.get("overrides", []), *(f"{k}={v}" for k, v in point.items()), f"seed={seed}"]


@functools.cache
def base_config(base: str) -> dict[str, Any]:
    return schema.merge(schema.DEFAULT_CONFIG, schema.read_yaml(ROOT / base))


def resolve(base: str, overrides: list[str]) -> Any:
    """``load_config(base, overrides)`` with the base file read once (YAML parsing is most of its time);
    the validity test checks the two agree."""
    return schema.validate(schema.absolute_paths(schema.apply_overrides(deepcopy(base_config(base)), overrides)))


def test_there_is_a_study_for_every_headline_table():
    names = {p.stem for p in STUDY_FILES}
    tables = {re.match(r"([a-z]+_t\d)", n).group(1) for n in names}
    assert tables == {"fedmerge_t2", "fedmerge_t3", "fedmerge_t4", "fedmerge_t5",
                      "superfed_t1", "superfed_t2", "superfed_t3", "superfed_t4", "superfed_t5",
                      "livar_t1", "livar_t2", "livar_t3", "livar_t4"}  # fmt: skip
    assert len(STUDY_FILES) == 49


@pytest.mark.parametrize("path", STUDY_FILES, ids=lambda p: p.stem)
def test_every_grid_point_of_every_row_is_a_valid_config(path: Path):
    study = load_study(path)
    assert set(study) <= {"title", "description", "base", "seeds", "tune_seed", "metric", "select", "columns",
                          "regime", "methods", "claims"}  # fmt: skip
    assert study["base"].startswith("configs/paper/") and (ROOT / study["base"]).is_file()
    # the description states the cost and the downloads; the comment above shows the arithmetic
    hours = re.search(r"about ([\d,.]+) GPU hours on one H100", study["description"])
    assert hours and "Downloads:" in study["description"]
    assert f"total: about {hours.group(1)} GPU hours" in path.read_text()
    labels = [m["label"] for m in study["methods"]]
    assert len(set(labels)) == len(labels)
    assert len({len(grid_points(m)) for m in study["methods"]}) == 1  # the runner's equal tuning budget
    first = row_overrides(study["methods"][0], grid_points(study["methods"][0])[0], study["tune_seed"])
    want = load_config(ROOT / study["base"], first).model_dump(mode="json")
    assert resolve(study["base"], first).model_dump(mode="json") == want
    for method in study["methods"]:
        for point in grid_points(method):
            cfg = resolve(study["base"], row_overrides(method, point, study["tune_seed"]))
            assert cfg.device == "cuda" and cfg.rounds >= 5  # the papers' scale, on a GPU
    # the runner's regime check and its report read rows named Local and FedAvg
    assert {"Local", "FedAvg"} <= set(labels)


# What the papers state (FedMerge Sec. 4.1 and 4.7; SuPerFed Sec. 4.1 and Table A1; LIVAR Sec. 5.1), written
# out again here from the papers, independently of the files: study-name pattern -> resolved settings.
SF = {"algorithm.momentum": 0.9, "algorithm.weight_decay": 0.0001, "split.test_fraction": 0.2}
PAPER: dict[str, dict[str, Any]] = {
    r"fedmerge_t[234]_(personal|cluster)": {"rounds": 500, "participation": 1.0, "partition.num_clients": 50,
                                            "dataset.name": "cifar100", "model.name": "resnet9"},
    r"fedmerge_t[23]_domain": {"rounds": 500, "participation": 1.0, "partition.num_clients": 4,
                               "partition.name": "domain", "dataset.name": "pacs", "model.name": "resnet9"},
    r"fedmerge_t\d_cluster": {"partition.name": "cluster", "partition.num_groups": 5},
    r"fedmerge_t5": {"rounds": 20, "algorithm.batch_size": 8, "dataset.max_tokens": 512, "model.r": 8,
                     "model.model": "meta-llama/Meta-Llama-3-8B", "partition.name": "natural"},
    r"fedmerge_t5_xquad": {"dataset.over_length": "drop"},  # Sec. 4.7: XQuAD's samples over 512 tokens skipped
    r"superfed_t1_mnist_k(50|100|500)": {**SF, "rounds": 500, "algorithm.local_epochs": 10, "algorithm.batch_size": 10,
                                         "algorithm.lr": 0.01, "model.name": "twonn", "partition.name": "shards"},
    r"superfed_t1_cifar10_k(50|100|500)": {**SF, "rounds": 500, "algorithm.local_epochs": 10,
                                           "algorithm.batch_size": 10, "algorithm.lr": 0.01, "model.name": "twocnn"},
    r"superfed_t2_cifar100": {**SF, "rounds": 1000, "algorithm.local_epochs": 10, "algorithm.batch_size": 10,
                              "partition.num_clients": 100, "partition.name": "dirichlet"},
    r"superfed_t2_tiny_imagenet": {**SF, "rounds": 1000, "algorithm.local_epochs": 10, "algorithm.batch_size": 10,
                                   "partition.num_clients": 200, "model.name": "mobilenet_v1"},
    r"superfed_t3_femnist": {**SF, "rounds": 500, "algorithm.local_epochs": 10, "algorithm.batch_size": 10,
                             "algorithm.lr": 0.01, "dataset.max_clients": 730},
    r"superfed_t3_shakespeare": {**SF, "rounds": 500, "algorithm.local_epochs": 5, "algorithm.batch_size": 50,
                                 "algorithm.lr": 0.8, "dataset.max_clients": 660, "model.name": "lstm"},
    r"superfed_t4_(mnist|cifar10)": {**SF, "rounds": 500, "algorithm.local_epochs": 10, "algorithm.batch_size": 10,
                                     "partition.num_clients": 100, "partition.alpha": 10.0},
    r"superfed_t5": {**SF, "rounds": 200, "algorithm.local_epochs": 10, "algorithm.batch_size": 10},
    r"livar_t": {"rounds": 5, "algorithm.local_epochs": 5, "partition.num_clients": 10, "model.name": "vit_lora",
                 "model.r": 16, "partition.name": "dirichlet"},
    # the authors' code: ImageNet-R's fixed lists, the server scored on the test list, the train list partitioned
    r"livar_t1_imagenet_r": {"dataset.name": "imagenet_r", "dataset.subset": "all", "split.test_from": "publisher"},
}  # fmt: skip
ROWS_OF = {  # the methods each table compares, by registered name (+ Local/FedAvg for the regime check)
    r"fedmerge_t2": {"local", "fedavg", "fedavg_ft", "pfedmoe", "fedmerge"},
    r"fedmerge_t3_(personal|cluster)": {"local", "fedavg", "ifca", "fedem", "fedmerge"},
    r"fedmerge_t3_domain": {"local", "fedavg", "fedem", "fedmerge"},
    r"fedmerge_t4": {"local", "fedavg", "fedmerge"},
    r"fedmerge_t5": {"local", "fedavg", "fedlora", "fedmerge"},
    r"superfed_t[1-4]": {"local", "fedavg", "fedprox", "scaffold", "lg_fedavg", "fedper", "apfl", "pfedme", "ditto",
                         "fedrep", "superfed_mm", "superfed_lm"},
    r"superfed_t5": {"local", "fedavg", "superfed_mm", "superfed_lm"},
    r"livar_t[12]": {"local", "fedavg", "regmean", "fisher_avg", "fedproto", "ccvr", "livar"},
    r"livar_t3": {"local", "fedavg", "ccvr", "livar"},
    r"livar_t4": {"local", "fedavg", "livar"},
}  # fmt: skip


# Stated in the study files: SCAFFOLD's option II needs plain SGD, so it trains without SuPerFed's momentum.
DEPARTURES = {("scaffold", "algorithm.momentum")}


def setting(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("path", STUDY_FILES, ids=lambda p: p.stem)
def test_settings_match_the_papers(path: Path):
    study = load_study(path)
    cfgs = [resolve(study["base"], row_overrides(m, grid_points(m)[0], 0)) for m in study["methods"]]
    checked = 0
    for pattern, want in PAPER.items():
        if re.match(pattern, path.stem):
            for key, value in want.items():
                rows = [c for c in cfgs if (c.algorithm.name, key) not in DEPARTURES]
                assert all(setting(c, key) == value for c in rows), (key, value)
                checked += 1
    assert checked
    [names] = [v for k, v in ROWS_OF.items() if re.match(k, path.stem)]
    assert {c.algorithm.name for c in cfgs} == names
    clients = re.search(r"_k(\d+)$", path.stem)
    if clients:  # SuPerFed Table 1: K clients, 5 of them each round
        assert cfgs[0].partition.num_clients == int(clients.group(1))
    if path.stem.startswith("superfed_t") and not path.stem.startswith("superfed_t5"):
        assert all(round(c.participation * c.partition.num_clients or 0) == 5 for c in cfgs if c.partition.num_clients)
        # personalisation from L = 40% of the rounds
        assert {c.algorithm.start_round for c in cfgs if "superfed" in c.algorithm.name} == {int(0.4 * cfgs[0].rounds)}
    if path.stem == "superfed_t5_start_round":  # L/R = 0, 0.2, ..., 0.8 of R = 200, nu 2, mu 0.01, both mixings
        mixing = [(c.algorithm.name, c.algorithm.start_round, c.algorithm.nu, c.algorithm.mu) for c in cfgs[2:]]
        assert mixing == [(f"superfed_{m}", r, 2.0, 0.01) for m in ("mm", "lm") for r in (0, 40, 80, 120, 160)]


# --- stand-ins ----------------------------------------------------------------------------------------
def jpeg(rng: np.random.Generator, size: int = 8) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def png_gray(value: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (32, 32), value).save(buf, format="PNG")
    return buf.getvalue()


def archive(members: dict[str, bytes], kind: str) -> bytes:
    buf = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(buf, "w") as zf:
            for name, data in members.items():
                zf.writestr(name, data)
    else:
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def idx(array: np.ndarray) -> bytes:
    import gzip

    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes())


def cifar(n: int, key: bytes, classes: int, rng: np.random.Generator) -> bytes:
    labels = (np.arange(n) % classes).tolist()  # every class present: cluster groups own blocks of classes
    return pickle.dumps({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), key: labels})


PLAY = "THE TRAGEDY OF STAND-INS\n\nby William Shakespeare\n\n" + "".join(
    f"  {role}. Speech {i} of {role.lower()}, a line of some forty characters.\n"
    for i in range(3)
    for role in ("ALPHA", "BETA", "GAMMA")
)  # LEAF's rules: a role is a client once it has more than two lines and more than 80 characters


def stand_in_archives(rng: np.random.Generator) -> dict[str, dict[str, bytes]]:
    """Each fetched dataset's files in the source's own layout, a few samples of every class."""
    out: dict[str, dict[str, bytes]] = {}
    c10 = {f"cifar-10-batches-py/data_batch_{i}": cifar(6, b"labels", 10, rng) for i in range(1, 6)}
    c10["cifar-10-batches-py/test_batch"] = cifar(10, b"labels", 10, rng)
    out["cifar10"] = {"cifar-10-python.tar.gz": archive(c10, "tgz")}
    c100 = {f"cifar-100-python/{s}": cifar(100, b"fine_labels", 100, rng) for s in ("train", "test")}
    out["cifar100"] = {"cifar-100-python.tar.gz": archive(c100, "tgz")}
    train, test = rng.integers(0, 256, (30, 28, 28)), rng.integers(0, 256, (10, 28, 28))
    out["mnist"] = {
        "train-images-idx3-ubyte.gz": idx(train), "train-labels-idx1-ubyte.gz": idx(np.arange(30) % 10),
        "t10k-images-idx3-ubyte.gz": idx(test), "t10k-labels-idx1-ubyte.gz": idx(np.arange(10) % 10),
    }  # fmt: skip
    root, wnids = "tiny-imagenet-200/", [f"n{i:02d}" for i in range(6)]
    tin = {root + "wnids.txt": "\n".join(wnids).encode(), root + "val/val_annotations.txt": b""}
    tin |= {f"{root}train/{w}/images/{w}_{i}.JPEG": jpeg(rng) for w in wnids for i in range(5)}
    out["tiny_imagenet"] = {"tiny-imagenet-200.zip": archive(tin, "zip")}
    domains, kinds = ("art_painting", "cartoon", "photo", "sketch"), ("dog", "elephant", "giraffe", "guitar", "horse")
    pacs = {f"kfold/{d}/{c}/{i}.jpg": jpeg(rng) for d in domains for c in (*kinds, "house", "person") for i in range(2)}
    out["pacs"] = {"PACS.zip": archive(pacs, "zip")}
    classes = ["AnnualCrop", "Forest", "River", "SeaLake"]
    euro = {f"2750/{c}/{c}_{i}.jpg": jpeg(rng) for c in classes for i in range(5)}
    out["eurosat"] = {"EuroSAT.zip": archive(euro, "zip")} | {f"eurosat-{s}.txt": b"" for s in ("train", "val", "test")}
    root = "CUB_200_2011/"
    files = {i + 1: f"{c:03d}.bird_{c}/{i}.jpg" for i, c in enumerate(np.repeat(np.arange(1, 7), 5))}
    cub = {root + "images/" + p: jpeg(rng) for p in files.values()}
    cub[root + "images.txt"] = "".join(f"{i} {p}\n" for i, p in files.items()).encode()
    cub[root + "image_class_labels.txt"] = "".join(f"{i} {p[:3].lstrip('0')}\n" for i, p in files.items()).encode()
    cub[root + "train_test_split.txt"] = "".join(f"{i} {i % 2}\n" for i in files).encode()
    out["cub200"] = {"CUB_200_2011.tgz": archive(cub, "tgz")}
    by_class, by_write = {}, {}  # NIST SD19: 2 writers x 3 classes x 3 images, labelled by matching image bytes
    for w in range(2):
        for k, hexcode in enumerate(("30", "41", "61")):
            for i in range(3):
                image = png_gray(10 * w + 3 * k + 40 * i)
                by_class[f"by_class/{hexcode}/hsf_{w}/{hexcode}_{w}_{i}.png"] = image
                by_write[f"by_write/hsf_{w}/f{w:04d}_1{w}/{'dul'[k]}{w:04d}_1{w}/{k}_{i}.png"] = image
    out["femnist"] = {"by_class.zip": archive(by_class, "zip"), "by_write.zip": archive(by_write, "zip")}
    out["shakespeare"] = {"1994-01-100.zip": archive({"100.txt": PLAY.encode("latin-1")}, "zip")}
    # ImageNet-R's tar and LIVAR's authors' lists (data: paths, targets: class numbers): 3 classes, 6 train and
    # 2 test images each
    lists = {s: [(f"n0{c}/{s}_{i}.jpg", c) for c in range(3) for i in range(n)] for s, n in (("train", 6), ("test", 2))}
    inr = {f"imagenet-r/{key}": jpeg(rng) for items in lists.values() for key, _ in items}
    inr_lists = {f"imagenet-r_{s}.yaml": yaml.safe_dump({"data": [f"data/imagenet-r/{k}" for k, _ in items],
                                                          "targets": [t for _, t in items]}).encode()
                 for s, items in lists.items()}  # fmt: skip
    out["imagenet_r"] = {"imagenet-r.tar": archive(inr, "tgz"), **inr_lists}
    return out


LANGUAGES = {  # the instruction stand-in: one client per language, as in FedMerge's Table 5
    "en": [("is it true", "the sky is blue", "entailment"), ("is it true", "the sky is green", "contradiction")],
    "fr": [("est ce vrai", "le ciel est bleu", "implication"), ("est ce vrai", "le ciel est vert", "contradiction")],
    "de": [("ist es wahr", "der himmel ist blau", "folgerung"), ("ist es wahr", "der himmel ist grün", "widerspruch")],
}


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """Paths of every stand-in: the fetched datasets under one data dir (their catalog entries pointed at
    these files' checksums while the module runs), instruction data, tiny HF models."""
    root = tmp_path_factory.mktemp("paper-stand-in")
    rng = np.random.default_rng(0)
    with ExitStack() as stack:
        for name, files in stand_in_archives(rng).items():
            (root / "data" / name).mkdir(parents=True)
            for file, data in files.items():
                (root / "data" / name / file).write_bytes(data)
            entry = CATALOG.get(name).relocated("http://127.0.0.1:9", {f: sha256(b) for f, b in files.items()})
            stack.enter_context(CATALOG.override(entry))
        records = [{"instruction": i, "input": x, "output": o, "category": c}
                   for c, rows in LANGUAGES.items() for i, x, o in rows] * 4  # fmt: skip
        (root / "instructions.json").write_text(json.dumps(records))
        paths = {"data": str(root / "data"), "instructions": str(root / "instructions.json")}
        if HAVE_HF:
            from tiny_hf import tiny_llama, tiny_vit

            paths["vit"] = tiny_vit(root / "tiny-vit")
            texts = [t for r in records for t in (r["instruction"], r["input"], r["output"])]
            paths["llama"] = tiny_llama(root / "tiny-llama", texts)
        yield paths


SMALL_MODELS = {  # the same family with its sizes cut
    "resnet9": {"widths": [4, 8, 8, 8]},
    "twonn": {"hidden": 16},
    "twocnn": {"channels": [4, 8], "hidden": 16},
    "mobilenet_v1": {"width_multiplier": 0.125},
    "lstm": {"hidden": 16},
}


def stand_in_config(cfg: dict[str, Any], paths: dict[str, str], out: Path) -> dict[str, Any]:
    """The row's resolved config with its sizes cut: 1 round on CPU, a few clients, tiny data and model."""
    c = deepcopy(cfg)
    c.update(name="stand-in", rounds=1, eval_every=1, device="cpu", threads=1, workers=1, output_dir=str(out))
    ds = c["dataset"]
    if "data_dir" in ds:
        ds.update(data_dir=paths["data"], download=False, max_samples=None)
        if "image_size" in ds:
            ds["image_size"] = 16
        if "max_clients" in ds:
            ds["max_clients"] = None
    elif ds["name"] == "instructions":
        ds.update(path=paths["instructions"], tokenizer=paths["llama"], max_tokens=48)
    part = c["partition"]
    if part["name"] == "cluster":
        part.update(num_clients=4, num_groups=2)
    elif part["name"] in ("dirichlet", "shards"):
        part.update(num_clients=2, **({"min_samples": 3} if part["name"] == "dirichlet" else {}))
    elif part["name"] == "natural":
        part["num_clients"] = None
    model = c["model"]
    model.update(SMALL_MODELS.get(model["name"], {}))
    if model["name"] == "vit_lora":
        model.update(model=paths["vit"], r=2)
    elif model["name"] == "causal_lm_lora":
        model.update(model=paths["llama"], dtype="float32", r=2, max_new_tokens=3)
    alg = c["algorithm"]
    alg.update(local_epochs=1 + alg.get("body_epochs", 0), batch_size=min(alg["batch_size"], 8))  # FedRep: head + body
    if "start_round" in alg:  # SuPerFed: mixing from the first round (its whole path runs), 3 lambdas evaluated
        alg.update(start_round=0, lambda_steps=2)
    if alg.get("num_clusters"):  # IFCA: no more cluster models than the stand-in's clients (more are refused)
        alg["num_clusters"] = min(alg["num_clusters"], 4)
    if alg.get("ccvr") is not None:
        alg["ccvr"]["samples_per_class"] = 4
    if "samples_per_class" in alg:
        alg["samples_per_class"] = 4
    return c


def non_numeric(section: dict[str, Any]) -> dict[str, Any]:
    """A section's options that choose code (names, modes), not sizes or rates (d, k, M, L, lr, alpha)."""
    return {k: v for k, v in section.items() if isinstance(v, bool) or not isinstance(v, int | float)}


# Models whose layers an algorithm treats alike: no BatchNorm (SuPerFed's bias-free MLP and CNN), BatchNorm
# CNNs, token models, the LoRA models. SuPerFed replaces every layer with a mixed one, so it runs on each.
FAMILY = {"twonn": "plain", "twocnn": "plain", "resnet9": "batchnorm", "mobilenet_v1": "batchnorm",
          "vgg11": "batchnorm", "lstm": "tokens"}  # fmt: skip
PER_MODEL = ("superfed_mm", "superfed_lm")


def code_paths(cfg: dict[str, Any]) -> list[str]:
    """What a row exercises: its algorithm (with its non-numeric options) on its kind of model, and its
    data pipeline (loader options, partitioner, label noise) into its model."""
    model = cfg["model"]["name"]
    kind = model if cfg["algorithm"]["name"] in PER_MODEL else FAMILY.get(model, model)
    data = [non_numeric(cfg["dataset"]), cfg["partition"]["name"], cfg["noise"]["kind"], model]
    return [json.dumps(["algorithm", non_numeric(cfg["algorithm"]), kind], sort_keys=True),
            json.dumps(["data", *data], sort_keys=True)]  # fmt: skip


def rows_by_code_path() -> list[tuple[str, dict[str, Any]]]:
    """(id, resolved config at the first grid point) of the first row of each code path, over all studies."""
    seen: set[str] = set()
    out = []
    for path in STUDY_FILES:
        study = load_study(path)
        for method in study["methods"]:
            point = grid_points(method)[0]
            try:
                cfg = resolve(study["base"], row_overrides(method, point, study["tune_seed"]))
            except ConfigError:
                continue  # test_every_grid_point_of_every_row_is_a_valid_config names it
            data = cfg.model_dump(mode="json")
            keys = set(code_paths(data))
            if not keys <= seen:
                out.append((f"{path.stem}:{method['label']}", data))
                seen |= keys
    return out


ROWS = rows_by_code_path()


@pytest.mark.parametrize("row_id,cfg", ROWS, ids=[r[0] for r in ROWS])
def test_one_round_of_each_row_on_a_stand_in(row_id, cfg, stand_in, tmp_path):
    if cfg["model"]["name"] in NEEDS_HF and not HAVE_HF:
        pytest.skip('needs pip install "fedmerge[llm]"')
    from fedmerge.run.runner import run_experiment

    small = schema.validate(stand_in_config(cfg, stand_in, tmp_path))
    summary = run_experiment(small, tmp_path / "run", show_progress=False).summary
    assert summary["rounds_completed"] == 1
    clients = summary["last"]["clients"]
    metric = "test_rouge1" if cfg["model"]["name"] == "causal_lm_lora" else "test_acc"
    assert 0.0 <= clients[metric]["mean"] <= 1.0 and math.isfinite(clients["test_nll"]["mean"])


@pytest.mark.parametrize("name", ["fedmerge_t5_xnli", "fedmerge_t5_xquad"])
def test_table_5s_regime_reference_runs_from_its_study_file_on_the_stand_in(name, stand_in, tmp_path, monkeypatch):
    """The study runner's own reference step (``protocol.regime``) on the study as written, its base config cut
    to the stand-in by regime overrides (CPU, the tiny LLaMA, 1 epoch): ROUGE-1 of generated answers per client."""
    if not HAVE_HF:
        pytest.skip('needs pip install "fedmerge[llm]"')
    from fedmerge.study.protocol import regime
    from fedmerge.study.spec import load_study

    monkeypatch.chdir(ROOT)
    study = load_study(Path("studies/paper") / f"{name}.yaml")
    cut = ["device=cpu", "threads=1", f"dataset.path={stand_in['instructions']}", "dataset.max_tokens=48",
           f"dataset.tokenizer={stand_in['llama']}", f"model.model={stand_in['llama']}", "model.dtype=float32",
           "model.r=2", "model.max_new_tokens=3", "split.val_fraction=0.25", "split.test_fraction=0.25"]  # fmt: skip
    small = study.model_copy(update={"regime": study.regime.model_copy(update={"overrides": cut, "max_epochs": 1}),
                                     "seeds": [0]})  # fmt: skip
    (ref,) = regime(small, tmp_path).values()
    assert ref["metric"] == "rouge1" and ref["scope"] == "all" and len(ref["client_acc"]) == len(LANGUAGES)
    assert all(0.0 <= v <= 1.0 for v in ref["client_acc"]) and ref["lrs"][0] in study.reference_lrs()


def test_the_docs_list_every_study_with_the_hours_and_downloads_its_file_states():
    """docs/paper_studies.md's and docs/howto/paper-table.md's tables are the one generated from the study files
    (``python -m fedmerge.study.paper_table --write`` after a change), a row per file, with the hours and downloads
    its description states."""
    from fedmerge.study import paper_table as gen

    for doc in ("docs/paper_studies.md", "docs/howto/paper-table.md"):
        assert gen.current((ROOT / doc).read_text()) == gen.section(), doc
    rows = gen.rows()
    assert sorted(r["file"] for r in rows) == sorted(p.name for p in STUDY_FILES)
    for r in rows:
        description = load_study(STUDY_FILES[0].with_name(r["file"]))["description"]
        assert f"about {r['hours']} GPU hours on one H100" in description and r["downloads"] in description
    xquad = next(r for r in rows if r["file"] == "fedmerge_t5_xquad.yaml")
    assert (xquad["paper"], xquad["hours"], xquad["new"]) == ("FedMerge Table 5", "123", "123")
    t3 = next(r for r in rows if r["file"] == "fedmerge_t3_cluster.yaml")
    assert (t3["hours"], t3["new"]) == ("423", "394")
    assert "| FedMerge Table 3 | Cluster Non-IID" in gen.section() and "423 (394 new)" in gen.section()
    # the totals are the files' own: XNLI 33 h (not 27), about 2,616 h in all (not 2,600; 2,625 before ImageNet-R's
    # train list alone was partitioned)
    assert next(r for r in rows if r["name"] == "fedmerge_t5_xnli")["hours"] == "33"
    assert sum(gen.number(r["new"]) for r in rows) == pytest.approx(2616, abs=1)
    readme = (ROOT / "README.md").read_text()
    assert "docs/paper_studies.md" in readme and "| `fedmerge_t5_xnli" not in readme  # one table, in the docs
