"""``python -m fedmerge``: the ``fedmerge`` command (how ``fedmerge sweep`` starts its runs)."""

from fedmerge.cli import main

main()
