"""LIVAR's G_SHAP: quantile bins of the layer importances (s_A, s_B) -> LoRA merge coefficients.

A table holds quantile edges (in percent, over all (client, layer) pairs of one round) for s_A and
for s_B, and one value per (A bin, B bin) cell. Each round the server turns every client's per-layer
(s_A, s_B) into a cell value g and normalises over clients per layer: alpha_i^l = g_i^l / sum_k g_k^l.

The default is the paper's Appendix A Table A with the reference code's digits (SHAP base value
0.06313978 plus the per-feature SHAP values read off its Fig. 2). ``fedmerge livar calibrate`` writes
a new table as JSON ([`save()`][fedmerge.algorithms.shap_table.ShapTable.save]); a LIVAR run loads it with
``algorithm.shap_table=PATH``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import Tensor


class ShapTable(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    a_edges: tuple[float, ...] = Field(min_length=1, description="quantile edges of s_A, in percent, increasing")
    b_edges: tuple[float, ...] = Field(min_length=1, description="quantile edges of s_B, in percent, increasing")
    values: tuple[tuple[float, ...], ...] = Field(description="g per (A bin, B bin): len(a_edges)+1 rows")
    base: float | None = Field(None, description="the SHAP base value the cells were built from (information)")
    source: str = "paper Table A"

    @model_validator(mode="after")
    def _check(self) -> ShapTable:
        for name, edges in (("a_edges", self.a_edges), ("b_edges", self.b_edges)):
            if list(edges) != sorted(edges) or not all(0 <= e <= 100 for e in edges):
                raise ValueError(f"{name} must be increasing percentages in [0, 100], got {list(edges)}")
        if len(self.values) != len(self.a_edges) + 1 or any(len(r) != len(self.b_edges) + 1 for r in self.values):
            raise ValueError(
                f"values must be {len(self.a_edges) + 1} x {len(self.b_edges) + 1} (A bins x B bins) for these edges"
            )
        if any(v <= 0 for row in self.values for v in row):
            raise ValueError("table values must be positive (they are normalised into merge coefficients)")
        return self

    @classmethod
    def paper(cls) -> ShapTable:
        # rows: Q_A < 25, 25 <= Q_A <= 50, Q_A > 50; columns: Q_B < 60, 60 <= Q_B <= 80, Q_B > 80
        return cls(
            a_edges=(25.0, 50.0),
            b_edges=(60.0, 80.0),
            values=(
                (0.03813978, 0.09813978, 0.19313978),
                (0.03813978, 0.08813978, 0.11813978),
                (0.03813978, 0.07813978, 0.09313978),
            ),
            base=0.06313978,
        )

    @classmethod
    def load(cls, path: str | Path | None) -> ShapTable:
        if path is None:
            return cls.paper()
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"no G_SHAP table at {p} (write one with `fedmerge livar calibrate`)")
        try:
            return cls.model_validate(json.loads(p.read_text()))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: not JSON ({exc})") from None
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err["loc"]) or "table"
            raise ValueError(f"{p}: not a G_SHAP table ({where}: {err['msg']})") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(), indent=2) + "\n")

    def lookup(self, s_a: Tensor, s_b: Tensor) -> Tensor:
        """g for every entry of ``s_a``/``s_b`` (same shape), with quantiles over all the entries."""
        rows = quantile_bins(s_a, self.a_edges)
        cols = quantile_bins(s_b, self.b_edges)
        table = torch.tensor(self.values, dtype=torch.float64)
        return table[rows, cols]


def quantile_bins(values: Tensor, edges_pct: tuple[float, ...]) -> Tensor:
    """Bin of each value against the quantiles (percent) of all the values (see
    [`bins_against()`][fedmerge.algorithms.shap_table.bins_against])."""
    q = torch.quantile(values.double().reshape(-1), torch.tensor(edges_pct, dtype=torch.float64) / 100.0)
    return bins_against(values, q)


def bins_against(values: Tensor, thresholds: Tensor | tuple[float, ...]) -> Tensor:
    """Below the first threshold -> 0, above the last -> len(thresholds), in between -> 1 + the
    interior thresholds exceeded (thresholds inclusive, as the reference's ``s < q_lo``,
    ``s > q_hi``, else middle)."""
    flat = values.double().reshape(-1)
    t = torch.as_tensor(thresholds, dtype=torch.float64)
    bins = torch.ones_like(flat, dtype=torch.long)
    for e in t[1:-1]:
        bins += (flat > e).long()
    bins = torch.where(flat < t[0], 0, bins)
    bins = torch.where(flat > t[-1], len(t), bins)
    return bins.reshape(values.shape)


def layer_coefficients(table: ShapTable, s_a: Tensor, s_b: Tensor, num_examples: Tensor) -> Tensor:
    """alpha (clients x layers): G_SHAP cells normalised over clients per layer; a layer whose cells
    sum to zero or are not finite falls back to the sample-count weights n_i / n."""
    g = table.lookup(s_a, s_b)
    total = g.sum(0, keepdim=True)
    alpha = g / torch.where(total > 0, total, torch.ones_like(total))
    fallback = (num_examples.double() / num_examples.double().sum())[:, None].expand_as(alpha)
    bad = ~torch.isfinite(alpha).all(0, keepdim=True) | (total <= 0)
    return torch.where(bad, fallback, alpha)
