"""Comparing a fresh run's figures with a committed golden file made on another machine.

Counts and every integer compare exactly. Floats agree within float32 rounding, not bit for bit: the
same code on another CPU (another BLAS kernel, another summation order) moves a float32 result by a few
units in its last place (test_ece 0.2980247684 here, 0.2980247654 there). Bit-identity is asserted only
between two runs made on the same machine (docs/guide/workers.md, "What is bit-identical where")."""

from __future__ import annotations

import math
import re
from typing import Any

# float32 has a 24-bit significand (eps 1.2e-7); a few ulps of rounding through a run's sums
REL_TOL = 1e-6
ABS_TOL = 1e-9
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def floats_close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def json_close(got: Any, want: Any) -> bool:
    """Equal structure, strings, booleans and integers; floats within :data:`REL_TOL`."""
    if isinstance(want, bool) or isinstance(got, bool):
        return got == want
    if isinstance(want, float) or isinstance(got, float):
        return isinstance(got, int | float) and isinstance(want, int | float) and floats_close(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(json_close(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(json_close, got, want))
    return got == want


def line_close(got: str, want: str) -> bool:
    """The same text and the same numbers: integers exactly; a printed decimal within one unit of its last
    digit (a float32 difference can round a figure the other way) or within :data:`REL_TOL`."""
    if NUMBER.sub("#", got) != NUMBER.sub("#", want):
        return False
    for g, w in zip(NUMBER.findall(got), NUMBER.findall(want), strict=True):
        if "." not in w and "e" not in w.lower():
            if g != w:
                return False
            continue
        digits = len(w.split(".")[1].split("e")[0].split("E")[0]) if "." in w else 0
        if abs(float(g) - float(w)) > 10.0**-digits * 1.000001 and not floats_close(float(g), float(w)):
            return False
    return True


def in_order_close(want: list[str], got: list[str]) -> bool:
    """Every line of ``want`` is in ``got`` (by :func:`line_close`), in the same order."""
    rest = iter(got)
    return all(any(line_close(candidate, line) for candidate in rest) for line in want)
