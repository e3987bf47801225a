"""The study files that ship with the package: the papers' own experiments (``studies/paper/*.yaml`` in the
repository, ``fedmerge/paper/studies/`` in an installed package, with their base configs next to them), so
that ``fedmerge study fedmerge_t2_cluster`` runs from any folder.

A study is named by a path (a file that exists, or a former copy's name ``STUDY_REVISION.yaml``) or, failing
that, by the name of a packaged study (with or without ``.yaml``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fedmerge.config.schema import ConfigError
from fedmerge.study.spec import resolve_path


def packaged_folder() -> Path:
    """The folder of the packaged study files (a link to ``studies/paper`` in a checkout)."""
    return Path(str(resources.files("fedmerge") / "paper" / "studies"))


def packaged_studies() -> dict[str, Path]:
    """Every packaged study file by name, sorted by name."""
    folder = packaged_folder()
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))} if folder.is_dir() else {}


def find_study(arg: Path) -> tuple[Path, str | None]:
    """The study file ``arg`` names and the revision its name picks (None: the caller's choice): a path
    first (``resolve_path``), then a packaged study's name. Refused in one line when neither exists."""
    path, named = resolve_path(arg)
    if path.exists():
        return path, named
    bare = len(arg.parts) == 1 and arg.suffix in ("", ".yaml")
    if bare:
        shipped = packaged_folder() / f"{arg.stem}.yaml"
        path, named = resolve_path(shipped)
        if path.exists():
            return path, named
    where = f" and no packaged study is named {arg.stem!r}" if bare else ""
    raise ConfigError(f"no study file {arg}{where} (the packaged ones: fedmerge list study)")
