"""XNLI and XQuAD as the instruction records of FedMerge's Table 5 (one client per language).

FedMerge (Section 4.7) trains Alpaca-LoRA on XNLI and XQuAD with one language per client, "the content of
the client data identical across languages", 300 + 200 random XNLI samples per language and 600 XQuAD
samples for training, but gives no prompt wording, and its code release has no language-model part. So the
records use the closest published templates, FLAN's (google-research/FLAN, ``flan/v2/flan_templates_branched.py``):

* XNLI: the first ``mnli`` template, "Premise: {premise}\\n\\nHypothesis: {hypothesis}\\n\\nDoes the premise
  entail the hypothesis?\\n\\n{options_}", with FLAN's MNLI answers (yes / it is not possible to tell / no);
* XQuAD: the second ``squad_v1`` template, "Read this and answer the question\\n\\n{context}\\n\\n{question}",
  answered with the first gold answer.

Each is cut into Alpaca's parts (Alpaca-LoRA's template, which the paper names, puts the instruction before
the input): the question (and options) is the ``instruction``, the passage the ``input``. Instructions and
answer words stay in English for every language (the passages are the language's own). Records are
``{instruction, input, output, category: <language>, id}``; the ``instructions`` dataset reads them
(``category_field: category`` gives one client per language). A sample draws the same ids in every
language, so the clients hold the same content in different languages.
"""

from __future__ import annotations

import csv
import io
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedmerge.core.seeding import numpy_rng
from fedmerge.data.errors import DataUnavailable

XNLI_INSTRUCTION = "Does the premise entail the hypothesis?\n\nOPTIONS:\n- yes\n- it is not possible to tell\n- no"
XNLI_ANSWERS = {"entailment": "yes", "neutral": "it is not possible to tell", "contradiction": "no"}
XQUAD_INSTRUCTION = "Read this and answer the question"


def xnli_input(premise: str, hypothesis: str) -> str:
    return f"Premise: {premise}\n\nHypothesis: {hypothesis}"


def xquad_input(context: str, question: str) -> str:
    return f"{context}\n\n{question}"


def read_xnli(path: Path, split: str) -> dict[str, dict[str, dict]]:
    """``XNLI-1.0.zip`` -> language -> pairID -> row (``XNLI-1.0/xnli.<split>.tsv``, as the release has it)."""
    member = f"XNLI-1.0/xnli.{split}.tsv"
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith(f"xnli.{split}.tsv")]
            if not names:
                raise DataUnavailable(f"{path}: no {member} (not the XNLI 1.0 release); fetch it again")
            text = zf.read(names[0]).decode("utf-8")
    except zipfile.BadZipFile as exc:
        raise DataUnavailable(f"{path}: unreadable archive ({exc}); delete it and fetch it again") from None
    rows: dict[str, dict[str, dict]] = {}
    # quotes are part of the sentences: no CSV quoting (as every XNLI reader does)
    for row in csv.DictReader(io.StringIO(text), delimiter="\t", quoting=csv.QUOTE_NONE):
        if row.get("gold_label") in XNLI_ANSWERS:
            rows.setdefault(row["language"], {})[row["pairID"]] = row
    return rows


def read_xquad(paths: dict[str, Path]) -> dict[str, dict[str, dict]]:
    """``xquad.<lang>.json`` files (SQuAD v1.1 layout) -> language -> question id -> record."""
    out: dict[str, dict[str, dict]] = {}
    for lang, path in paths.items():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))["data"]
        except (ValueError, KeyError) as exc:
            raise DataUnavailable(f"{path}: not a SQuAD-format file ({exc}); fetch it again") from None
        questions = out.setdefault(lang, {})
        for article in data:
            for paragraph in article["paragraphs"]:
                for qa in paragraph["qas"]:
                    if qa.get("answers"):
                        questions[qa["id"]] = {
                            "context": paragraph["context"],
                            "question": qa["question"],
                            "answer": qa["answers"][0]["text"],
                        }
    return out


def parallel_ids(by_language: dict[str, dict[str, dict]], per_language: int | None, seed: int) -> list[str]:
    """Ids present in every language (sorted), or a seeded draw of ``per_language`` of them."""
    if not by_language:
        raise DataUnavailable("no language to build records from")
    common = sorted(set.intersection(*(set(rows) for rows in by_language.values())))
    if per_language is None:
        return common
    if per_language > len(common):
        raise ValueError(f"--per-language {per_language}: only {len(common)} items are in every language")
    rng = numpy_rng(seed, purpose="multilingual-sample")
    return [common[i] for i in np.sort(rng.choice(len(common), size=per_language, replace=False))]


def chosen(by_language: dict[str, dict[str, dict]], languages: Sequence[str] | None) -> dict[str, dict[str, dict]]:
    if languages is None:
        return dict(sorted(by_language.items()))
    unknown = [lang for lang in languages if lang not in by_language]
    if unknown:
        raise ValueError(f"languages {unknown} are not in the data; it has {', '.join(sorted(by_language))}")
    return {lang: by_language[lang] for lang in languages}


def xnli_records(
    path: Path, split: str = "test", languages: Sequence[str] | None = None, per_language: int | None = None,
    seed: int = 0,
) -> list[dict[str, str]]:  # fmt: skip
    """XNLI pairs as instruction records, language by language, the same pairs in every language."""
    rows = chosen(read_xnli(path, split), languages)
    ids = parallel_ids(rows, per_language, seed)
    return [
        {
            "instruction": XNLI_INSTRUCTION,
            "input": xnli_input(rows[lang][i]["sentence1"], rows[lang][i]["sentence2"]),
            "output": XNLI_ANSWERS[rows[lang][i]["gold_label"]],
            "category": lang,
            "id": i,
        }
        for lang in rows
        for i in ids
    ]


def xquad_records(
    paths: dict[str, Path], languages: Sequence[str] | None = None, per_language: int | None = None, seed: int = 0
) -> list[dict[str, str]]:
    """XQuAD questions as instruction records, language by language, the same questions in every language."""
    rows = chosen(read_xquad(paths), languages)
    ids = parallel_ids(rows, per_language, seed)
    return [
        {
            "instruction": XQUAD_INSTRUCTION,
            "input": xquad_input(rows[lang][i]["context"], rows[lang][i]["question"]),
            "output": rows[lang][i]["answer"],
            "category": lang,
            "id": i,
        }
        for lang in rows
        for i in ids
    ]


def build_instructions(
    name: str,
    data_dir: str | Path | None,
    download: bool,
    split: str = "test",
    languages: Sequence[str] | None = None,
    per_language: int | None = None,
    seed: int = 0,
) -> list[dict[str, str]]:
    """The records of the fetched ``xnli`` or ``xquad`` files (checked against their checksums first)."""
    from pooch.hashes import hash_matches

    from fedmerge.data.catalog import CATALOG, dataset_files
    from fedmerge.data.download import expected_checksum

    if name not in ("xnli", "xquad"):
        raise ValueError(f"instruction records are built for xnli and xquad, not {name!r}")
    entry = CATALOG.get(name)
    files = dataset_files(name, data_dir, download)
    for remote in entry.files:
        known = expected_checksum(remote, entry.folder(data_dir))
        if known is None or not hash_matches(str(files[remote.name]), known):
            raise DataUnavailable(f"{files[remote.name]} does not match {known}; delete it and fetch {name} again")
    if name == "xnli":
        return xnli_records(files["XNLI-1.0.zip"], split, languages, per_language, seed)
    paths = {f.removeprefix("xquad.").removesuffix(".json"): p for f, p in files.items()}
    return xquad_records(paths, languages, per_language, seed)
