"""``python -m fedmerge.cli``: the ``fedmerge`` command."""

from fedmerge.cli import main

main()
