"""Write the confirmation study of an exploration study: its rows at the points they chose, on fresh seeds.

    python -m fedmerge.study.confirmation studies/STUDY.yaml --revision REV --seeds 100-104 \
        --set split.test_per_client=150 --set dataset.subsample_seed=run

From the repository root (``scripts/confirmation_study.py`` runs the same with its checkout as the root; the
files it writes still name that script, so they stay as they were).

Reads the exploration study (at ``--revision``, default its latest) and the points its report's JSON
says each row chose (``docs/reproductions/*/*/STUDY[_REV].json``), and writes
``configs/repro/confirm/NAME.yaml`` (the base config with ``--set`` keys) and
``studies/confirm/NAME.yaml``: one point per row, the exploration's reference settings (its learning
rates written out, since the Local row now has one), ``explored_on`` = every seed the exploration
used, ``confirms`` = the study and revision, and its ``claims``. The chosen points are never chosen again.

A second confirmation of the same study (``--name``, e.g. ``STUDY_REV_confirm2``) must use seeds no earlier
confirmation in studies/confirm/ ran; its description names them. Existing files are never overwritten
(without ``--force``): a confirmation is committed, claims included, before any of its runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from fedmerge.config.schema import parse_override
from fedmerge.study.spec import LATEST, load_study_file

GENERATOR = "scripts/confirmation_study.py"  # named in the files written, as before the move


def seeds(text: str) -> list[int]:
    """``100-104`` (both ends included) or one seed."""
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def earlier_confirmations(root: Path, confirms: str, skip: Path) -> list[tuple[str, list[int]]]:
    """The other confirmation files in studies/confirm/ of the same study and revision, with their seeds."""
    found = []
    for path in sorted((root / "studies" / "confirm").glob("*.yaml")):
        if path == skip:
            continue
        data = yaml.safe_load(path.read_text()) or {}
        if data.get("confirms") == confirms:
            used = {*data.get("seeds", []), data.get("tune_seed", None)} - {None}
            found.append((path.relative_to(root).as_posix(), sorted(used)))
    return found


def main(argv: list[str] | None = None, root: Path | None = None) -> None:
    """The command; ``root``: the repository root (default: the current folder)."""
    root = Path.cwd() if root is None else root
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path)
    ap.add_argument("--revision", default=LATEST)
    ap.add_argument("--seeds", type=seeds, default=seeds("100-104"))
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE added to the base config")
    ap.add_argument(
        "--name",
        help="the files' name (default STUDY[_REV]_confirm); a second confirmation on other seeds needs its own",
    )
    ap.add_argument("--force", action="store_true", help="overwrite files of that name")
    args = ap.parse_args(argv)

    history = load_study_file(args.study).history(args.revision)
    study = history[-1]
    name = args.study.stem + (f"_{study.revision}" if study.revision else "")
    found = list((root / "docs" / "reproductions").glob(f"*/*/{name}.json"))
    if len(found) != 1:
        raise SystemExit(f"error: expected one report JSON named {name}.json under docs/reproductions, found {found}")
    chosen = {label: row["chosen"] for label, row in json.loads(found[0].read_text())["rows"].items()}

    base = yaml.safe_load((root / study.base).read_text())
    for text in args.set:
        path, value = parse_override(text)
        node = base
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    base["name"] = f"{base['name']}-confirm"
    confirm_name = args.name or f"{name}_confirm"
    base_path = root / "configs" / "repro" / "confirm" / f"{confirm_name}.yaml"
    out = root / "studies" / "confirm" / f"{confirm_name}.yaml"
    if not args.force and (out.exists() or base_path.exists()):
        # a confirmation's file is committed before its runs; writing over it would silently change what they test
        raise SystemExit(f"error: {out.relative_to(root)} exists; give another --name (or --force to replace it)")
    confirms = f"{args.study.as_posix()}{f' revision {study.revision}' if study.revision else ''}"
    earlier = earlier_confirmations(root, confirms, skip=out)
    for path, used in earlier:
        if both := sorted(set(used) & set(args.seeds)):
            raise SystemExit(f"error: seeds {both} already confirmed this study in {path}")
    base_path.parent.mkdir(parents=True, exist_ok=True)
    head = f"# The base of {args.study.name}'s runs ({study.base}) with: {', '.join(args.set) or 'nothing changed'}.\n"
    base_path.write_text(head + f"# Written by {GENERATOR}.\n" + yaml.safe_dump(base, sort_keys=False))

    explored = sorted({s for st in history for s in [*st.seeds, st.tuning_seed]})
    regime = study.regime.model_dump(exclude_defaults=False)
    regime["lrs"] = study.reference_lrs()
    rows, kept_head_rule = [], False
    for m in study.methods:
        point = chosen[m.label]
        overrides = list(m.overrides)
        if "algorithm.preset=reference" in overrides and not any(
            o.startswith("algorithm.merge_grad=") for o in overrides
        ):
            # the exploration ran the reference preset's former head rule (FedMerge's FORMER_PRESET_VALUES)
            overrides.append("algorithm.merge_grad=head")
            kept_head_rule = True
        rows.append({"label": m.label, "overrides": overrides, "grid": {k: [v] for k, v in point.items()}})
    spec = {
        "title": f"Confirmation on fresh seeds: {study.title}",
        "description": (
            f"The rows of {args.study.name}{f' (revision {study.revision})' if study.revision else ''} at the points "
            f"they chose on seed {study.tuning_seed}, run on seeds {args.seeds[0]}-{args.seeds[-1]}, none of which "
            f"informed any setting (the study was explored on seeds {explored}). "
            + "".join(
                f"An earlier confirmation ({path}) ran seeds {', '.join(map(str, used))}; these seeds are new to it. "
                for path, used in earlier
            )
            + "Base changes: "
            f"{', '.join(args.set) or 'none'}. "
            + (
                "Reference-mode rows keep the former head rule they were explored with (algorithm.merge_grad=head). "
                if kept_head_rule
                else ""
            )
            + f"The exploration study: {study.description}"
        ),
        "base": str(base_path.relative_to(root)),
        "seeds": args.seeds,
        "tune_seed": args.seeds[0],
        "explored_on": explored,
        "confirms": confirms,
        "columns": study.columns,
        "metric": study.metric.model_dump(),
        "regime": regime,
        "local_row": study.local_row,
        "fedavg_row": study.fedavg_row,
        "claims": [claim.model_dump() for claim in study.claims],  # judged again, on the fresh seeds
        "methods": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"# Written by {GENERATOR}; do not tune on these seeds.\n" + yaml.safe_dump(spec, sort_keys=False, width=110)
    )
    load_study_file(out)  # validates (fresh seeds, one point per row)
    print(f"wrote {out.relative_to(root)} and {base_path.relative_to(root)}")


if __name__ == "__main__":
    main()
