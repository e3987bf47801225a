"""The data folder found the same way by option, environment and config; torchvision's layouts; ImageNet-R
with LIVAR's split lists; XNLI and XQuAD as instruction records; LEAF's Shakespeare rules; every mirror
tried whatever its failure. Small files the tests build in each upstream layout, served on loopback."""

from __future__ import annotations

import io
import json
import socket
import tarfile
from pathlib import Path

import numpy as np
import pytest
from fetch_server import serve, served_dataset, sha256
from test_paper_datasets import cifar_batch, idx, jpeg, tgz_bytes, zip_bytes
from typer.testing import CliRunner

from fedmerge.cli.data import data_app as app
from fedmerge.data import DataUnavailable, load_pool
from fedmerge.data.catalog import CATALOG
from fedmerge.data.download import DownloadError, RemoteFile, fetch_file
from fedmerge.data.sources.leaf import split_plays
from fedmerge.data.sources.multilingual import XNLI_INSTRUCTION, XQUAD_INSTRUCTION


def mnist_content() -> tuple[dict[str, bytes], np.ndarray]:
    train = np.random.default_rng(0).integers(0, 256, (3, 28, 28))
    return {
        "train-images-idx3-ubyte.gz": idx(train), "train-labels-idx1-ubyte.gz": idx(np.array([1, 2, 3])),
        "t10k-images-idx3-ubyte.gz": idx(train[:1]), "t10k-labels-idx1-ubyte.gz": idx(np.array([7])),
    }, train  # fmt: skip


def place(folder: Path, content: dict[str, bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in content.items():
        (folder / name).write_bytes(data)


# --- the data folder: option, environment, config; torchvision's layouts ------------------------------
def test_mnist_in_torchvision_raw_folder_is_found_by_config_environment_and_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    content, train = mnist_content()
    place(tmp_path / "MNIST" / "raw", content)  # torchvision.datasets.MNIST(root) keeps them there
    with served_dataset("mnist", content) as files:  # the checksums; nothing may be downloaded
        by_config = load_pool({"name": "mnist", "data_dir": str(tmp_path)})
        monkeypatch.setenv("FEDMERGE_DATA_DIR", str(tmp_path))
        by_env = load_pool({"name": "mnist", "subset": "test"})
        listing = CliRunner().invoke(app, ["list"])
    assert not files.requests
    assert by_config.y.tolist() == [1, 2, 3, 7]
    np.testing.assert_allclose(by_config.x[0, 0], train[0] / 255.0, atol=1e-7)
    assert by_env.y.tolist() == [7]
    assert any(line.startswith("mnist") and "cached" in line for line in listing.output.splitlines())


def test_a_damaged_file_in_torchvision_place_is_refused(tmp_path: Path) -> None:
    content, _ = mnist_content()
    place(tmp_path / "MNIST" / "raw", {**content, "t10k-labels-idx1-ubyte.gz": b"damaged"})
    with served_dataset("mnist", content), pytest.raises(DataUnavailable) as err:
        load_pool({"name": "mnist", "data_dir": str(tmp_path)})
    assert "t10k-labels-idx1-ubyte.gz does not match" in str(err.value) and "\n" not in str(err.value)


def test_cifar100_archive_at_the_root_and_extracted_cifar10_through_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    members = {f"cifar-100-python/{s}": cifar_batch(n, b"fine_labels", 100, n) for s, n in (("train", 3), ("test", 2))}
    content = {"cifar-100-python.tar.gz": tgz_bytes(members)}
    place(tmp_path, content)  # torchvision.datasets.CIFAR100(root, download=True) leaves the archive at the root
    with served_dataset("cifar100", content) as files:
        pool = load_pool({"name": "cifar100", "data_dir": str(tmp_path)})
    assert not files.requests and pool.x.shape == (5, 3, 32, 32)
    # an extracted cifar-10-batches-py/ under $FEDMERGE_DATA_DIR, as --data-dir / dataset.data_dir find it
    folder = tmp_path / "cifar-10-batches-py"
    place(folder, {f"data_batch_{i}": cifar_batch(1, b"labels", 10, i) for i in range(1, 6)})
    place(folder, {"test_batch": cifar_batch(2, b"labels", 10, 9)})
    by_option = load_pool({"name": "cifar10", "data_dir": str(tmp_path)})
    monkeypatch.setenv("FEDMERGE_DATA_DIR", str(tmp_path))
    by_env = load_pool({"name": "cifar10"})
    assert by_env.x.shape == (7, 3, 32, 32)
    np.testing.assert_array_equal(by_env.x, by_option.x)


def tiny_imagenet_members() -> dict[str, bytes]:
    root = "tiny-imagenet-200/"
    members = {root + "wnids.txt": b"n01\nn02\n", root + "val/val_annotations.txt": b"v0.JPEG\tn02\t0\t0\t8\t8\n"}
    for c, w in enumerate(["n01", "n02"]):
        members[f"{root}train/{w}/images/{w}_0.JPEG"] = jpeg(60 * c)
    members[root + "val/images/v0.JPEG"] = jpeg(200)
    return members


def test_an_extracted_tiny_imagenet_folder_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, data in tiny_imagenet_members().items():
        place((tmp_path / name).parent, {Path(name).name: data})
    monkeypatch.setenv("FEDMERGE_DATA_DIR", str(tmp_path))
    pool = load_pool({"name": "tiny_imagenet", "image_size": 8})
    assert pool.y.tolist() == [0, 1, 1] and pool.class_names == ["n01", "n02"]
    np.testing.assert_allclose(pool.x[:, 0, 0, 0] * 255, [0, 60, 200], atol=2)
    (tmp_path / "tiny-imagenet-200" / "wnids.txt").unlink()
    with pytest.raises(DataUnavailable, match="fedmerge data fetch tiny_imagenet"):
        load_pool({"name": "tiny_imagenet", "image_size": 8})


# --- ImageNet-R: LIVAR's authors' split lists ---------------------------------------------------------
def tar_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def split_yaml(items: list[tuple[str, int]]) -> bytes:
    # the lists' own layout: data: paths under data/imagenet-r/, targets: class numbers
    data = "".join(f"- data/imagenet-r/{key}\n" for key, _ in items)
    return f"data:\n{data}targets:\n{''.join(f'- {t}' + chr(10) for _, t in items)}".encode()


def imagenet_r_content() -> dict[str, bytes]:
    images = {f"imagenet-r/{w}/{kind}_{i}.jpg": jpeg(10 * c + i) for c, w in enumerate(["n01443537", "n01484850"])
              for kind in ("art", "toy") for i in range(2)}  # fmt: skip
    images["imagenet-r/README.txt"] = b"n01443537 goldfish\nn01484850 great_white_shark\n"
    # not in class-folder order: the lists' order and class numbers are what count
    train = [("n01484850/toy_1.jpg", 1), ("n01443537/art_0.jpg", 0), ("n01443537/toy_0.jpg", 0),
             ("n01484850/art_0.jpg", 1), ("n01484850/art_1.jpg", 1), ("n01443537/toy_1.jpg", 0)]  # fmt: skip
    test = [("n01443537/art_1.jpg", 0), ("n01484850/toy_0.jpg", 1)]
    return {
        "imagenet-r.tar": tar_bytes(images),
        "imagenet-r_train.yaml": split_yaml(train),
        "imagenet-r_test.yaml": split_yaml(test),
    }


def test_imagenet_r_is_fetched_verified_and_split_by_the_lists(tmp_path: Path) -> None:
    content = imagenet_r_content()
    with served_dataset("imagenet_r", content):
        test = load_pool({"name": "imagenet_r", "data_dir": str(tmp_path), "download": True, "subset": "test",
                          "image_size": 8})  # fmt: skip
        train = load_pool({"name": "imagenet_r", "data_dir": str(tmp_path), "subset": "train", "image_size": 8})
        both = load_pool({"name": "imagenet_r", "data_dir": str(tmp_path), "image_size": 8})
    assert sorted(p.name for p in (tmp_path / "imagenet_r").iterdir() if p.is_file()) == sorted(content)
    assert test.y.tolist() == [0, 1] and test.class_names == ["goldfish", "great_white_shark"]
    np.testing.assert_allclose(test.x[:, 0, 0, 0] * 255, [1, 10], atol=2)  # art_1 of class 0, toy_0 of class 1
    assert train.y.tolist() == [1, 0, 0, 1, 1, 0]
    np.testing.assert_allclose(train.x[:, 0, 0, 0] * 255, [11, 0, 0, 10, 11, 1], atol=2)
    assert len(both) == 8 and both.y.tolist() == train.y.tolist() + test.y.tolist()
    # both lists: the test list's rows are the publisher's test set (split.test_from: publisher); one list: none
    assert both.publisher_test.tolist() == [False] * 6 + [True] * 2
    assert train.publisher_test is None and test.publisher_test is None


def test_imagenet_r_scores_the_server_on_the_test_list_and_partitions_the_train_list(tmp_path: Path) -> None:
    from fedmerge.data import NoiseConfig, SplitConfig, build_federated_dataset

    dataset = {"name": "imagenet_r", "data_dir": str(tmp_path), "download": True, "image_size": 8}
    split = SplitConfig(val_fraction=0.0, test_fraction=0.2, test_from="publisher")
    with served_dataset("imagenet_r", imagenet_r_content()):
        data = build_federated_dataset(dataset, {"name": "iid", "num_clients": 2}, split, NoiseConfig(), 0)
    x, y = data.pooled_test()
    assert y.tolist() == [0, 1]  # art_1 of class 0, toy_0 of class 1: the test list, in its order
    np.testing.assert_allclose(x[:, 0, 0, 0].numpy() * 255, [1, 10], atol=2)
    firsts = sorted(round(float(v) * 255) for c in data.clients for t in (c.x_train, c.x_test) for v in t[:, 0, 0, 0])
    np.testing.assert_allclose(firsts, sorted([11, 0, 0, 10, 11, 1]), atol=2)  # the train list's six images


def test_imagenet_r_damaged_tar_or_missing_image_is_one_line(tmp_path: Path) -> None:
    content = imagenet_r_content()
    content["imagenet-r_test.yaml"] = split_yaml([("n01443537/art_9.jpg", 0)])  # not in the archive
    with served_dataset("imagenet_r", content), pytest.raises(DataUnavailable) as err:
        load_pool({"name": "imagenet_r", "data_dir": str(tmp_path), "download": True, "image_size": 8})
    assert "n01443537/art_9.jpg" in str(err.value) and "\n" not in str(err.value)


# --- XNLI and XQuAD as instruction records -------------------------------------------------------------
XNLI_HEADER = "language\tgold_label\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t" \
    "sentence2_parse\tsentence1\tsentence2\tpromptID\tpairID\tgenre\n"  # fmt: skip


def xnli_zip() -> bytes:
    rows = []
    pairs = [("1", "entailment"), ("2", "neutral"), ("3", "contradiction"), ("4", "neutral")]
    for lang in ("en", "de", "sw"):
        for pair, label in pairs:
            if lang == "sw" and pair == "4":
                continue  # not in every language: never drawn
            # quotes are part of the text in the release (no CSV quoting)
            rows.append(f'{lang}\t{label}\t-\t-\t-\t-\t"{lang} premise {pair}\t{lang} hyp {pair}\t9\t{pair}\tfiction\n')
    tsv = XNLI_HEADER + "".join(rows)
    return zip_bytes({"XNLI-1.0/xnli.test.tsv": tsv.encode(), "XNLI-1.0/xnli.dev.tsv": XNLI_HEADER.encode()})


def test_xnli_records_have_the_flan_wording_and_the_same_pairs_in_every_language(tmp_path: Path) -> None:
    out = tmp_path / "xnli.json"
    with served_dataset("xnli", {"XNLI-1.0.zip": xnli_zip()}):
        result = CliRunner().invoke(
            app, ["instructions", "xnli", "--out", str(out), "--dir", str(tmp_path), "--download",
                  "--per-language", "2", "--languages", "en,sw"],
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "4 records in 2 languages" in result.output
    records = json.loads(out.read_text())
    assert [r["category"] for r in records] == ["en", "en", "sw", "sw"]
    assert [r["id"] for r in records[:2]] == [r["id"] for r in records[2:]]  # the same pairs, translated
    assert set(r["id"] for r in records) <= {"1", "2", "3"}
    first = records[0]
    answer = {"1": "yes", "2": "it is not possible to tell", "3": "no"}[first["id"]]
    assert first == {
        "instruction": "Does the premise entail the hypothesis?\n\nOPTIONS:\n- yes\n- it is not possible to tell\n- no",
        "input": f'Premise: "en premise {first["id"]}\n\nHypothesis: en hyp {first["id"]}',
        "output": answer, "category": "en", "id": first["id"],
    }  # fmt: skip
    assert first["instruction"] == XNLI_INSTRUCTION
    labels = {"1": "yes", "2": "it is not possible to tell", "3": "no"}  # entailment, neutral, contradiction
    assert all(r["output"] == labels[r["id"]] for r in records)


def test_xnli_all_pairs_and_a_bad_request_are_one_line(tmp_path: Path) -> None:
    from fedmerge.data.sources.multilingual import build_instructions

    with served_dataset("xnli", {"XNLI-1.0.zip": xnli_zip()}):
        records = build_instructions("xnli", tmp_path, True)
        assert sorted({r["id"] for r in records}) == ["1", "2", "3"] and len(records) == 9  # pair 4 lacks sw
        labels = {"1": "yes", "2": "it is not possible to tell", "3": "no"}
        assert [(r["category"], r["output"]) for r in records[::3]] == [("de", "yes"), ("en", "yes"), ("sw", "yes")]
        assert all(r["output"] == labels[r["id"]] for r in records)
        too_many = CliRunner().invoke(app, ["instructions", "xnli", "-o", str(tmp_path / "x.json"), "--dir",
                                            str(tmp_path), "--per-language", "4"])  # fmt: skip
        unknown = CliRunner().invoke(app, ["instructions", "xnli", "-o", str(tmp_path / "x.json"), "--dir",
                                           str(tmp_path), "--languages", "fr"])  # fmt: skip
    assert too_many.exit_code == 2 and "only 3 items are in every language" in too_many.output
    assert unknown.exit_code == 2 and "['fr'] are not in the data" in unknown.output


def squad(lang: str, answers: dict[str, str]) -> bytes:
    qas = [{"id": q, "question": f"{lang} question {q}?", "answers": [{"answer_start": 0, "text": a}]}
           for q, a in answers.items()]  # fmt: skip
    paragraph = {"context": f"{lang} context", "qas": qas}
    return json.dumps({"version": "1.1", "data": [{"title": "T", "paragraphs": [paragraph]}]}).encode()


def test_xquad_records_read_the_squad_layout(tmp_path: Path) -> None:
    from fedmerge.data.sources.multilingual import build_instructions

    content = {f.name: squad("x", {"q0": "a"}) for f in CATALOG.get("xquad").files}
    content["xquad.en.json"] = squad("en", {"q1": "Denver Broncos", "q2": "Santa Clara"})
    content["xquad.de.json"] = squad("de", {"q1": "die Denver Broncos", "q2": "Santa Clara"})
    with served_dataset("xquad", content):
        records = build_instructions("xquad", tmp_path, True, languages=["en", "de"])
    assert [(r["category"], r["id"], r["output"]) for r in records] == [
        ("en", "q1", "Denver Broncos"), ("en", "q2", "Santa Clara"),
        ("de", "q1", "die Denver Broncos"), ("de", "q2", "Santa Clara"),
    ]  # fmt: skip
    assert records[2]["instruction"] == XQUAD_INSTRUCTION == "Read this and answer the question"
    assert records[2]["input"] == "de context\n\nde question q1?"


# --- LEAF's Shakespeare rules ---------------------------------------------------------------------------
SONNETS = """THE SONNETS header line (LEAF drops the file's first line)
THE SONNETS

by William Shakespeare

  ROMEO. A line that looks like a speech in the sonnets, long enough to count.
  JULIET. Another one, which LEAF never reads because it starts later on.
  ROMEO. And a third.
"""
PLAY = """
THE TRAGEDY OF TESTING

by William Shakespeare

  HAMLET. First speech.
  HORATIO. Second speech.
"""


def test_shakespeare_skips_what_precedes_the_second_author_line_and_stops_at_leaf_last_line() -> None:
    plays = split_plays(SONNETS + PLAY)
    assert [t for t, _ in plays] == ["THE TRAGEDY OF TESTING"]  # the sonnets' "roles" are never read
    text = SONNETS + PLAY + "\n" * 20 + "  HAMLET. After the end of the plays.\n"
    lines = text.splitlines()[1:]
    last = next(i for i, line in enumerate(lines) if "After the end" in line)
    assert split_plays(text, last_line=last)[0][1]["HAMLET"][-1] == "After the end of the plays."
    assert split_plays(text, last_line=last - 1)[0][1]["HAMLET"] == ["First speech."]
    # LEAF's own limit: line 124195 of the file less its first line
    padded = SONNETS + PLAY + "\n" * (124195 - len((SONNETS + PLAY).splitlines()) + 1)
    inside = padded + "  HAMLET. On LEAF's last line.\n"
    assert inside.splitlines()[1:].index("  HAMLET. On LEAF's last line.") == 124195
    assert split_plays(inside)[0][1]["HAMLET"][-1] == "On LEAF's last line."
    assert split_plays("\n" + inside)[0][1]["HAMLET"] == ["First speech."]  # one line later: not read


# --- every source tried, whatever its failure -----------------------------------------------------------
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_source_is_tried_whatever_its_failure(tmp_path: Path) -> None:
    good = bytes(range(256)) * 300
    with serve({"page/a.bin": b"<html>log in</html>", "short/a.bin": good[:1000], "a.bin": good}) as (base, files):
        files.content_type["page/a.bin"] = "text/html"
        files.cut_after["cut/a.bin"] = 100
        files.content["cut/a.bin"] = good
        urls = (
            f"http://127.0.0.1:{closed_port()}/a.bin",  # refused
            f"{base}/gone/a.bin",  # 404
            f"{base}/page/a.bin",  # a web page instead of the file
            f"{base}/short/a.bin",  # a checksum mismatch
            f"{base}/cut/a.bin",  # the connection cut mid-transfer
            f"{base}/a.bin",
        )
        fetch_file(RemoteFile("a.bin", urls, sha256(good)), tmp_path, progressbar=False)
        assert (tmp_path / "a.bin").read_bytes() == good
        assert [p for p, _ in files.requests][-1] == "a.bin"
        files.cut_after["cut/a.bin"] = 100
        with pytest.raises(DownloadError) as err:
            fetch_file(RemoteFile("b.bin", urls[:5], sha256(good)), tmp_path / "b", progressbar=False)
    assert "from 5 source(s)" in str(err.value) and "\n" not in str(err.value)


# --- the listing: a size for every dataset, the papers that use each ----------------------------------
def test_every_dataset_has_a_size_and_approximate_ones_say_so(tmp_path: Path) -> None:
    for entry in CATALOG.entries():
        assert entry.download_size, entry.name
    assert "LIVAR" not in CATALOG.get("tiny_imagenet").papers  # no LIVAR study reads it
    assert CATALOG.get("imagenet_r").papers == "LIVAR"
    listing = CliRunner().invoke(app, ["list", "--dir", str(tmp_path)]).output
    rows = {line.split()[0]: line for line in listing.splitlines()[2:-1]}
    assert "?" not in listing
    assert "~170.0 MB" in rows["pacs"] and "~94.8 MB" in rows["eurosat"] and "~1.6 GB" in rows["femnist"]
    assert " 17.9 MB" in rows["xnli"] and "~" not in rows["xnli"]


def test_instruction_records_over_max_tokens_are_dropped_on_request(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tiny_hf import tiny_llama

    long_input = " ".join(["word"] * 100)  # far over 64 tokens
    records = [
        {"instruction": "answer", "input": "short", "output": "yes", "category": "en"},
        {"instruction": "answer", "input": long_input, "output": "no", "category": "en"},
        {"instruction": "answer", "input": "short", "output": "ja", "category": "de"},
    ]
    data = tmp_path / "records.json"
    data.write_text(json.dumps(records))
    folder = tiny_llama(tmp_path / "lm", ["answer short yes no ja word"])
    options = {"name": "instructions", "path": str(data), "tokenizer": folder, "max_tokens": 64}
    truncated = load_pool(options)
    dropped = load_pool({**options, "over_length": "drop"})
    assert len(truncated) == 3 and len(dropped) == 2
    assert dropped.y.tolist() == [1, 0] and dropped.class_names == ["de", "en"]  # the long "en" record is gone
