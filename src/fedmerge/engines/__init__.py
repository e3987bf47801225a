"""Execution engines: where client work runs. ``local`` is in-process and sequential."""
