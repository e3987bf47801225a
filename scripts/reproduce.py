"""Deprecated: ``fedmerge study`` replaces this script (same options; revisions inside one study file
replace ``--share-runs-from``: a former ``STUDY_wide.yaml`` is revision ``wide`` of ``STUDY.yaml``).

    python scripts/reproduce.py STUDY.yaml [options]   ->   fedmerge study STUDY.yaml [options]
"""

from __future__ import annotations

import sys

from fedmerge.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--share-runs-from" in args:  # a revision reuses its earlier revisions' runs by itself
        i = args.index("--share-runs-from")
        del args[i : i + 2]
    print("scripts/reproduce.py is deprecated; use: fedmerge study " + " ".join(args), file=sys.stderr)
    sys.argv = ["fedmerge", "study", *args]
    main()
