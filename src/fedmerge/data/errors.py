"""Errors raised by the data layer."""

from __future__ import annotations


class DataUnavailable(RuntimeError):
    """A dataset's files are not on this machine; the message says how to install or point to them."""


class ClientFileError(DataUnavailable):
    """An exported client file (``fedmerge export-clients``) is missing, damaged, not one, or does not
    agree with the other nodes' files. A DataUnavailable: every user-error handler shows it in one line."""


class DataWarning(UserWarning):
    """Data that loads but is most likely not what the user meant (e.g. one class); a run prints it as one
    ``warning:`` line."""
