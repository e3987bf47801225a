"""Deprecated: ``fedmerge study STUDY.yaml [options]`` replaces ``python scripts/reproduce.py STUDY.yaml [options]``
(a revision reuses its earlier revisions' runs by itself, so ``--share-runs-from`` is dropped)."""

import sys

from fedmerge.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--share-runs-from" in args:
        del args[args.index("--share-runs-from") : args.index("--share-runs-from") + 2]
    print("scripts/reproduce.py is deprecated; use: fedmerge study " + " ".join(args), file=sys.stderr)
    sys.argv = ["fedmerge", "study", *args]
    main()
