"""Real offline text tasks, tokenized once at load for a pretrained transformer (``minilm_lora``).

* ``wordnet_topics``: a WordNet 3.0 noun definition -> its lexicographer file (26 topics such as
  noun.animal, noun.artifact). ``apt-get install -y wordnet-base``.
* ``bible_languages``: parallel Bible verses in several translations (KJV, modern English WEB, Spanish
  Reina-Valera 1909) labelled with the book's genre (8 classes). ``domain`` = ``natural_id`` = the
  translation, so ``partition.name=natural`` (or ``domain``) gives per-language clients with the same
  content: the offline analogue of the XNLI per-language setting. ``apt-get install -y bible-kjv
  diatheke sword-text-web sword-text-sparv``.

``Pool.x`` is int64 token ids ``(N, max_tokens)`` right-padded with the tokenizer's pad id (the model
derives the attention mask from it). Tokenized pools are cached per process.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from fedmerge.data.errors import DataUnavailable
from fedmerge.data.pool import DATASETS, DatasetConfig, Pool


class TextDatasetConfig(DatasetConfig):
    """Options of the tokenized text datasets."""

    max_tokens: int = Field(32, ge=2, description="token-length cap (truncation), [CLS]/[SEP] included")
    tokenizer: str | None = Field(
        None, description="local Hugging Face model folder whose tokenizer to use; default: all-MiniLM-L6-v2"
    )

    def token_length(self) -> int | None:
        return self.max_tokens


def tokenize(texts: list[str], tokenizer_path: str | None, max_tokens: int) -> np.ndarray:
    """(N, max_tokens) int64 token ids, right-padded with the tokenizer's pad id."""
    from fedmerge.models.text import LoRAUnavailable, load_tokenizer

    try:
        tok = load_tokenizer(tokenizer_path)
    except LoRAUnavailable as exc:
        raise DataUnavailable(f"text datasets are tokenized for a pretrained model: {exc}") from exc
    if not texts:
        return np.zeros((0, max_tokens), dtype=np.int64)
    enc = tok(texts, padding="max_length", truncation=True, max_length=max_tokens, return_tensors="np")
    return np.asarray(enc["input_ids"], dtype=np.int64)


# --- WordNet ---------------------------------------------------------------------------------
WORDNET_NOUNS = "/usr/share/wordnet/data.noun"
# Lexicographer files 03..28 (WordNet's lexnames): the 26 noun topics.
NOUN_TOPICS = (
    "Tops act animal artifact attribute body cognition communication event feeling food group location "
    "motive object person phenomenon plant possession process quantity relation shape state substance time"
).split()


def parse_wordnet_nouns(text: str) -> tuple[list[str], np.ndarray]:
    """(definitions, topic 0..25) from a WordNet ``data.noun`` file's text.

    A data line is ``offset lex_filenum ss_type ... | gloss``; the license header lines start with
    spaces. The definition is the gloss before its quoted examples (``; "...``).
    """
    texts, labels = [], []
    for line in text.splitlines():
        if not line or line[0] == " " or "|" not in line:
            continue
        fields = line.split(" ", 2)
        lexfile = int(fields[1])
        if not 3 <= lexfile <= 28:
            continue
        gloss = line.split("|", 1)[1].strip()
        definition = gloss.split('; "', 1)[0].strip().strip(";").strip()
        if definition:
            texts.append(definition)
            labels.append(lexfile - 3)
    return texts, np.asarray(labels, dtype=np.int64)


class WordNetConfig(TextDatasetConfig):
    name: Literal["wordnet_topics"] = "wordnet_topics"
    path: str = Field(WORDNET_NOUNS, description="WordNet 3.0 data.noun")


@DATASETS.register(
    "wordnet_topics",
    config=WordNetConfig,
    description="WordNet noun definition -> 26 lexicographer topics, tokenized (apt: wordnet-base)",
)
def load_wordnet_topics(cfg: WordNetConfig) -> Pool:
    x, y = _wordnet_cached(cfg.path, cfg.tokenizer, cfg.max_tokens)
    return Pool(x.copy(), y.copy(), len(NOUN_TOPICS), "wordnet_topics", class_names=[f"noun.{t}" for t in NOUN_TOPICS])


@functools.lru_cache(maxsize=4)
def _wordnet_cached(path: str, tokenizer: str | None, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    texts, labels = wordnet_texts(path)
    return tokenize(texts, tokenizer, max_tokens), labels


def wordnet_texts(path: str) -> tuple[list[str], np.ndarray]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataUnavailable(f"WordNet noun file not found: {file}; install it with `apt-get install -y wordnet-base`")
    texts, labels = parse_wordnet_nouns(file.read_text(encoding="utf-8", errors="replace"))
    if not texts:
        raise DataUnavailable(f"{file}: no noun definitions found (is it a WordNet 3.0 data.noun file?)")
    return texts, labels


# --- parallel Bibles -------------------------------------------------------------------------
GENRES = ("Law", "History", "Wisdom", "Prophets", "Gospels", "Acts", "Epistles", "Apocalypse")
_GENRE_SPANS = ((0, 5), (5, 17), (17, 22), (22, 39), (39, 43), (43, 44), (44, 65), (65, 66))
# The 66 Protestant-canon books: `bible` (bible-kjv) abbreviation and SWORD/diatheke name.
_BOOKS = [
    ("Ge", "Genesis"), ("Exo", "Exodus"), ("Lev", "Leviticus"), ("Num", "Numbers"), ("Deu", "Deuteronomy"),
    ("Josh", "Joshua"), ("Jdgs", "Judges"), ("Ruth", "Ruth"), ("1Sm", "I Samuel"), ("2Sm", "II Samuel"),
    ("1Ki", "I Kings"), ("2Ki", "II Kings"), ("1Chr", "I Chronicles"), ("2Chr", "II Chronicles"), ("Ezra", "Ezra"),
    ("Neh", "Nehemiah"), ("Est", "Esther"), ("Job", "Job"), ("Psa", "Psalms"), ("Prv", "Proverbs"),
    ("Eccl", "Ecclesiastes"), ("SSol", "Song of Solomon"), ("Isa", "Isaiah"), ("Jer", "Jeremiah"),
    ("Lam", "Lamentations"), ("Eze", "Ezekiel"), ("Dan", "Daniel"), ("Hos", "Hosea"), ("Joel", "Joel"),
    ("Amos", "Amos"), ("Obad", "Obadiah"), ("Jonah", "Jonah"), ("Mic", "Micah"), ("Nahum", "Nahum"),
    ("Hab", "Habakkuk"), ("Zep", "Zephaniah"), ("Hag", "Haggai"), ("Zec", "Zechariah"), ("Mal", "Malachi"),
    ("Mat", "Matthew"), ("Mark", "Mark"), ("Luke", "Luke"), ("John", "John"), ("Acts", "Acts"), ("Rom", "Romans"),
    ("1Cor", "I Corinthians"), ("2Cor", "II Corinthians"), ("Gal", "Galatians"), ("Eph", "Ephesians"),
    ("Phi", "Philippians"), ("Col", "Colossians"), ("1Th", "I Thessalonians"), ("2Th", "II Thessalonians"),
    ("1Tim", "I Timothy"), ("2Tim", "II Timothy"), ("Titus", "Titus"), ("Phmn", "Philemon"), ("Heb", "Hebrews"),
    ("Jas", "James"), ("1Pet", "I Peter"), ("2Pet", "II Peter"), ("1Jn", "I John"), ("2Jn", "II John"),
    ("3Jn", "III John"), ("Jude", "Jude"), ("Rev", "Revelation of John"),
]  # fmt: skip
BOOK_GENRE = {
    name: g for g, (a, b) in enumerate(_GENRE_SPANS) for i in range(a, b) for name in (_BOOKS[i][0], _BOOKS[i][1])
}

# "Ge1:1 text" (bible-kjv) or "Genesis 1:1: text" (diatheke -f plain), optionally indented.
_VERSE = re.compile(r"^\s*(?P<book>\S.*?)\s?(?P<ch>\d+):(?P<v>\d+):?(?:\s+(?P<text>.*))?$")
_TITLE = re.compile(r"<title\b[^>]*>.*?</title>", re.S)
_TAG = re.compile(r"<[^>]*>")
_MODULE = re.compile(r"\([A-Za-z0-9]+\)")  # diatheke's trailing "(module)" line
_BOILERPLATE = 20  # a non-verse line seen this often is a heading, not poetry


def parse_verses(text: str) -> list[tuple[str, int, str]]:
    """(book, genre, verse text) per verse of a Bible dump; books outside the 66 (deuterocanon) are dropped.

    Lines without a reference continue the previous verse (diatheke wraps poetry) up to a blank line;
    SWORD markup is removed, and so are lines repeated many times (headings such as "A praise psalm by
    David." that some modules print before every verse).
    """
    lines = _TAG.sub("", _TITLE.sub("", text)).splitlines()
    counts = Counter(line.strip() for line in lines)
    verses: list[tuple[str, int, str]] = []
    book: str | None = None
    parts: list[str] = []
    open_verse = False

    def flush() -> None:
        if book in BOOK_GENRE and parts:
            verse = " ".join(" ".join(parts).split())
            if verse:
                verses.append((book, BOOK_GENRE[book], verse))

    for raw in lines:
        line = raw.strip()
        m = _VERSE.match(raw)
        if m:
            flush()
            book, parts, open_verse = m["book"].strip(), [m["text"] or ""], True
        elif not line:
            open_verse = False
        elif open_verse and counts[line] < _BOILERPLATE and not _MODULE.fullmatch(line):
            parts.append(line)
    flush()
    return verses


# Translation -> (apt packages, command that prints the whole Bible).
TRANSLATIONS: dict[str, tuple[str, list[str]]] = {
    "kjv": ("bible-kjv", ["bible", "-f", "Gen1:1-Rev22:21"]),
    "web": ("diatheke sword-text-web", ["diatheke", "-b", "engWEB2015eb", "-f", "plain", "-k", "Gen 1:1-Rev 22:21"]),
    "spanish": (
        "diatheke sword-text-sparv",
        ["diatheke", "-b", "spaRV1909eb", "-f", "plain", "-k", "Gen 1:1-Rev 22:21"],
    ),
}


def dump_translation(name: str) -> str:
    if name not in TRANSLATIONS:
        raise ValueError(f"unknown translation {name!r}; known: {sorted(TRANSLATIONS)} (or give dataset.paths)")
    packages, cmd = TRANSLATIONS[name]
    hint = f"install it with `apt-get install -y {packages}`"
    if shutil.which(cmd[0]) is None:
        raise DataUnavailable(f"Bible translation {name!r} needs `{cmd[0]}`: {hint}")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0 or len(out.stdout) < 1000:
        raise DataUnavailable(f"`{' '.join(cmd)}` printed no Bible ({out.stderr.strip()[:200]}): {hint}")
    return out.stdout


class BibleConfig(TextDatasetConfig):
    name: Literal["bible_languages"] = "bible_languages"
    languages: tuple[str, ...] = Field(("kjv", "web", "spanish"), min_length=1, description="translations, in order")
    paths: dict[str, str] = Field(
        default_factory=dict,
        description="translation -> a text dump ('Ge1:1 text' or 'Genesis 1:1: text' lines) instead of the apt tools",
    )
    max_tokens: int = Field(48, ge=2, description="token-length cap (verses are longer than definitions)")


@DATASETS.register(
    "bible_languages",
    config=BibleConfig,
    description="parallel Bible verses -> book genre (8), natural_id = translation (apt: bible-kjv, diatheke)",
)
def load_bible_languages(cfg: BibleConfig) -> Pool:
    xs, ys, ids = [], [], []
    for lang_id, lang in enumerate(cfg.languages):
        x, y = _bible_cached(lang, cfg.paths.get(lang), cfg.tokenizer, cfg.max_tokens)
        xs.append(x)
        ys.append(y)
        ids.append(np.full(len(y), lang_id, dtype=np.int64))
    lang_ids = np.concatenate(ids)
    return Pool(
        np.concatenate(xs), np.concatenate(ys), len(GENRES), "bible_languages",
        domain=lang_ids, natural_id=lang_ids.copy(), class_names=list(GENRES),
    )  # fmt: skip


@functools.lru_cache(maxsize=8)
def _bible_cached(lang: str, path: str | None, tokenizer: str | None, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    if path is not None:
        file = Path(path).expanduser()
        if not file.is_file():
            raise DataUnavailable(f"Bible dump for {lang!r} not found: {file} (check dataset.paths)")
        text = file.read_text(encoding="utf-8", errors="replace")
    else:
        text = dump_translation(lang)
    verses = parse_verses(text)
    if not verses:
        raise DataUnavailable(f"no verses of the 66 canonical books found for translation {lang!r}")
    x = tokenize([v for _, _, v in verses], tokenizer, max_tokens)
    x.setflags(write=False)
    return x, np.asarray([g for _, g, _ in verses], dtype=np.int64)
