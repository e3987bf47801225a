"""Inputs computed only for the rows a run uses: the held-out data of ``split.test_per_client``.

A dataset whose inputs are expensive to make (``wordnet_features`` encodes every definition with a
sentence encoder) would otherwise compute all of them to hand a few hundred to the test splits. Its
held-out pool instead carries [`LazyRows`][fedmerge.data.lazy_rows.LazyRows] as ``x``: row selections (``Pool.subset``)
stay lazy,
and the inputs of the selected rows are computed when an array is asked for (``np.asarray``,
``np.concatenate``), which [`fedmerge.data.federated.federate()`][fedmerge.data.federated.federate] does once, for the
rows it drew.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

RowMaker = Callable[[np.ndarray], np.ndarray]  # source row ids (ascending or not) -> their inputs, in that order


class LazyRows:
    """An array of ``len(rows)`` inputs, row ``i`` being ``make(rows)[i]``, computed on first use."""

    def __init__(self, make: RowMaker, rows: np.ndarray, row_shape: tuple[int, ...], dtype: Any) -> None:
        self.make = make
        self.rows = np.asarray(rows, dtype=np.int64)
        self.row_shape = tuple(row_shape)
        self.dtype = np.dtype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), *self.row_shape)

    @property
    def ndim(self) -> int:
        return 1 + len(self.row_shape)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: Any) -> LazyRows:
        """Rows only (an index array, a boolean mask or a slice): another lazy selection."""
        if isinstance(idx, tuple):
            raise TypeError("LazyRows selects rows only; make an array first (np.asarray) to index within rows")
        return LazyRows(self.make, self.rows[idx], self.row_shape, self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if not len(self.rows):
            out = np.zeros(self.shape, dtype=self.dtype)
        else:
            out = np.asarray(self.make(self.rows), dtype=self.dtype)
            if out.shape != self.shape:
                raise RuntimeError(f"lazy inputs: made {out.shape} for {len(self.rows)} rows, expected {self.shape}")
        return out if dtype is None else out.astype(dtype, copy=False)
