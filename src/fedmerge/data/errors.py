"""Errors raised by the data layer."""

from __future__ import annotations


class DataUnavailable(RuntimeError):
    """A dataset's files are not on this machine; the message says how to install or point to them."""
