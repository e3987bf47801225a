"""Personal evaluation of many clients in this process, without repeated work.

The per-client path (`evaluate_client()`) loads each client's weights and runs two
small forward passes (val, test) per client. For a global-model method every client is evaluated with
the same weights, so that is one weight load and one forward pass per client and split where one
pass over the concatenated splits would do; and the pooled test of the global model is the same
pass once more. [`GroupedEvaluator`][fedmerge.engines.grouped_eval.GroupedEvaluator] therefore

- evaluates the clients whose personalised model *is* their payload (the same tensor objects, shared
  by every client of a global-model method) in one pass over their concatenated val and test splits,
  and reuses the test pass for the global model's pooled test when it covers the same rows;
- reuses a client's metrics when its personalised weights are the very tensors it was last
  evaluated with, unmodified (e.g. Local's clients that did not train since);
- concatenates the inputs once and keeps them, as long as the same clients are evaluated.

Every client's metrics are those of the per-client path, bit for bit. On the CPUs measured, a row's
logits do not depend on the other rows of its batch once the batch has 4 rows or more (BLAS takes
other kernels for 1 to 3 rows). So the rows that the per-client path predicts in a batch of fewer
than ``SMALL_BATCH`` (16) rows are predicted in that same batch here, and the first grouped pass of
each split is checked against the per-client path on its largest client: on a BLAS where rows do
depend on the batch, grouping switches itself off instead of changing a number. GPU kernels give
no such guarantee, so `LocalEngine` groups on CPU only.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from fedmerge.core.algorithm import Algorithm, ClientContext, ClientDataLike
from fedmerge.core.model_state import load_state, set_train_mode
from fedmerge.core.training import predict_logits
from fedmerge.core.types import ClientState, Payload
from fedmerge.metrics.classification import segment_metrics

from .evaluation import SPLITS, evaluate_client, is_generative

log = logging.getLogger(__name__)

Metrics = dict[str, float]
Weights = dict[str, torch.Tensor]
SMALL_BATCH = 16  # rows predicted in a batch shorter than this are predicted in that batch
Prepare = Callable[[int], tuple[ClientContext, Payload, ClientState]]
# (weights, x, ends) -> forward_batches's logits computed elsewhere (the engine's worker processes), or None;
# ends None: in any batches of SMALL_BATCH to batch_size rows (`even_batches`), which give each row the same logits
Forward = Callable[[Weights, torch.Tensor, list[int] | None], torch.Tensor | None]


def _split(data: ClientDataLike, split: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    x, y = getattr(data, f"x_{split}", None), getattr(data, f"y_{split}", None)
    return None if y is None or y.numel() == 0 else (x, y)


@dataclass
class _Fingerprint:
    """The exact tensors (and their in-place version counters) a client was evaluated with."""

    refs: list[tuple[str, weakref.ref, int]]

    @classmethod
    def of(cls, weights: Weights, on_free: Callable[[weakref.ref], None] | None = None) -> _Fingerprint:
        """``on_free`` runs when one of the tensors is freed (the fingerprint can then never match)."""
        return cls([(k, weakref.ref(v, on_free), v._version) for k, v in weights.items()])

    def matches(self, weights: Weights) -> bool:
        return len(self.refs) == len(weights) and all(
            k in weights and ref() is weights[k] and weights[k]._version == version for k, ref, version in self.refs
        )


@dataclass
class _Inputs:
    """Concatenated split of some clients: rows ``bounds[i]:bounds[i+1]`` are ``cids[i]``'s."""

    cids: tuple[int, ...]
    x: torch.Tensor
    y: torch.Tensor
    bounds: list[int] = field(default_factory=list)


class GroupedEvaluator:
    """Evaluates clients' personalised models on one model object (see the module docstring)."""

    def __init__(
        self, clients: Sequence[ClientDataLike], model: nn.Module, batch_size: int, forward: Forward | None = None
    ) -> None:
        self.clients = clients
        self.model = model
        self.batch_size = batch_size
        self.forward = forward  # the grouped pass's batches elsewhere, whole (the same logits), when it can
        self._inputs: tuple[tuple[int, ...], dict[str, _Inputs]] | None = None  # the last group's splits
        self._seen: dict[int, tuple[_Fingerprint, Metrics]] = {}  # per client, its last weights and metrics
        self._test_pass: tuple[_Fingerprint, _Inputs, torch.Tensor] | None = None  # the last test pass
        self._pooled_match: _Inputs | None = None  # a test concatenation found equal to the pooled test
        self._checked: set[str] = set()  # splits whose grouped logits were checked once
        # False once a check failed, or for a generative model (no logits per class to concatenate):
        # every client takes the per-client path
        self.grouping = not is_generative(model)

    def evaluate(self, algorithm: Algorithm, payloads: dict[int, Payload], prepare: Prepare) -> dict[int, Metrics]:
        """Metrics of each client in ``payloads``. ``prepare(cid)`` does what the per-client path does
        first (seed the client's call, move its payload, make its state if it has none) and returns
        (context, payload, state)."""
        results: dict[int, Metrics] = {}
        groups: dict[tuple[int, ...], tuple[Weights, list[int]]] = {}
        self._test_pass = None
        for cid in sorted(payloads):
            ctx, payload, state = prepare(cid)
            data = self.clients[cid]
            variants = algorithm.personalize_variants(payload, data, state, ctx)
            shared = payload_weights(variants, payload) if self.grouping else None
            if shared is not None:
                key = tuple(id(v) for v in shared.values())
                groups.setdefault(key, (shared, []))[1].append(cid)
                continue
            weights = variants.get("") if len(variants) == 1 else None
            seen = self._seen.get(cid)
            if isinstance(weights, dict) and seen is not None and seen[0].matches(weights):
                results[cid] = dict(seen[1])
                continue
            results[cid] = evaluate_client(algorithm, payload, data, state, ctx, self.batch_size, variants)
            if isinstance(weights, dict):
                # the entry goes when its weights do (e.g. states read from disk are new tensors each time)
                self._seen[cid] = (_Fingerprint.of(weights, partial(_forget, self._seen, cid)), dict(results[cid]))
        for weights, cids in groups.values():
            try:
                results.update(self._evaluate_group(weights, cids))
            except _NotRowIndependent:
                log.info("grouped evaluation is off: this BLAS gives a row other logits in another batch")
                for cid in cids:  # personalize gave the payload's weights: nothing to redo but the passes
                    ctx, payload, state = prepare(cid)
                    variants = {"": weights}
                    results[cid] = evaluate_client(
                        algorithm, payload, self.clients[cid], state, ctx, self.batch_size, variants
                    )
        return {cid: results[cid] for cid in sorted(results)}

    def _evaluate_group(self, weights: Weights, cids: list[int]) -> dict[int, Metrics]:
        load_state(self.model, weights)
        out: dict[int, Metrics] = {cid: {} for cid in cids}
        for split, inputs in self._concatenated(tuple(cids)).items():
            logits, pooled = self._predict(inputs, split, weights)
            if split == "test" and pooled is not None:
                self._test_pass = (_Fingerprint.of(weights), inputs, pooled)
            for cid, metrics in zip(inputs.cids, segment_metrics(logits, inputs.y, inputs.bounds)):
                out[cid].update({f"{split}_{k}": v for k, v in metrics.items()})
        return out

    def _concatenated(self, cids: tuple[int, ...]) -> dict[str, _Inputs]:
        """Each split's rows of ``cids`` (those with any), concatenated once for as long as the same
        clients are evaluated together: a client's data is read once here, not once per evaluation."""
        if self._inputs is not None and self._inputs[0] == cids:
            return self._inputs[1]
        self._inputs = None  # the old concatenation is freed before the new one is built
        parts: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {split: [] for split in SPLITS}
        for c in cids:
            data = self.clients[c]  # for clients that are views of a pool, this gathers the rows
            for split in SPLITS:
                got = _split(data, split)
                if got is not None:
                    parts[split].append((c, *got))
        out = {}
        for split, rows in parts.items():
            if rows:
                bounds = [0, *torch.tensor([int(y.shape[0]) for _, _, y in rows]).cumsum(0).tolist()]
                x, y = torch.cat([x for _, x, _ in rows]), torch.cat([y for _, _, y in rows])
                out[split] = _Inputs(tuple(c for c, _, _ in rows), x, y, bounds)
        self._inputs = (cids, out)
        return out

    def _predict(self, inputs: _Inputs, split: str, weights: Weights) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(each row's logits as the per-client path computes them, the logits as ``predict_logits``
        computes them on the whole concatenation, or None when that would take another pass). ``self.model``
        holds ``weights``; the pass's batches may run elsewhere (``self.forward``), each batch whole."""
        n, bs = int(inputs.y.shape[0]), self.batch_size
        ends = list(range(bs, n, bs)) + [n]  # predict_logits's batches
        merged = len(ends) > 1 and ends[-1] - ends[-2] < SMALL_BATCH
        if merged:  # a short trailing batch joins the one before it (batch size is memory only)
            ends.pop(-2)
        # only the test pass stands for the pooled test, whose logits are predict_logits's batches; the other
        # splits' rows may be cut into any batches of SMALL_BATCH rows or more, e.g. evenly among the workers
        free = split != "test"
        logits = self.forward(weights, inputs.x, None if free else ends) if self.forward is not None else None
        if logits is None:
            logits = forward_batches(self.model, inputs.x, ends)
        pooled = None if merged else logits
        # the rows the per-client path predicts in a short batch (each client's last one, or all of
        # them when batch_size itself is short) are predicted in that batch
        short = [
            (i, min(i + bs, b))
            for a, b in zip(inputs.bounds[:-1], inputs.bounds[1:])
            for i in range(a, b, bs)
            if min(i + bs, b) - i < SMALL_BATCH
        ]
        if short:
            logits = logits.clone()
            for a, b in short:
                logits[a:b] = forward_batches(self.model, inputs.x[a:b], [b - a])
        if split not in self._checked:
            self._checked.add(split)
            self._check(inputs, logits)
        return logits, pooled

    def _check(self, inputs: _Inputs, logits: torch.Tensor) -> None:
        """Once per split: the largest client's logits as the per-client path computes them. Rows of
        batches of SMALL_BATCH rows or more do not depend on their batch on the CPUs measured; where
        they do (another BLAS), grouping is switched off rather than numbers changed."""
        sizes = [b - a for a, b in zip(inputs.bounds[:-1], inputs.bounds[1:])]
        i = max(range(len(sizes)), key=sizes.__getitem__)
        a, b = inputs.bounds[i], inputs.bounds[i + 1]
        if not torch.equal(predict_logits(self.model, inputs.x[a:b], self.batch_size), logits[a:b]):
            self.grouping = False
            raise _NotRowIndependent

    def pooled_test_logits(self, weights: Weights, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """``predict_logits`` of ``weights`` on the pooled test (x, y), when the last evaluation's test
        pass made exactly that: the same weights, unmodified, over the same rows (checked once per
        concatenation: e.g. every client's test split, or those of a fixed ``sample:K``)."""
        if self._test_pass is None or not self._test_pass[0].matches(weights):
            return None
        _, inputs, logits = self._test_pass
        if inputs is not self._pooled_match:
            if inputs.x.shape != x.shape or not (torch.equal(inputs.x, x) and torch.equal(inputs.y, y)):
                return None
            self._pooled_match = inputs
        return logits


def _forget(seen: dict[int, tuple[_Fingerprint, Metrics]], cid: int, ref: weakref.ref) -> None:
    entry = seen.get(cid)
    if entry is not None and any(r is ref for _, r, _ in entry[0].refs):
        del seen[cid]


class _NotRowIndependent(Exception):
    pass


def even_batches(rows: int, parts: int, batch_size: int) -> list[list[int]] | None:
    """``rows`` rows cut into ``parts`` runs of about equal rows, each cut into batches of at most ``batch_size``
    rows (the ends of each run's batches, counted from the run's start), or None when a batch would have fewer
    than SMALL_BATCH rows (a row's logits could then depend on its batch) or there are fewer than 2 runs."""
    parts = min(parts, rows // SMALL_BATCH)
    if parts < 2:
        return None
    runs = []
    for i in range(parts):
        n = rows * (i + 1) // parts - rows * i // parts
        k = -(-n // batch_size)
        ends = [n * j // k for j in range(1, k + 1)]
        if min(b - a for a, b in zip([0, *ends[:-1]], ends)) < SMALL_BATCH:
            return None
        runs.append(ends)
    return runs


@torch.no_grad()
def forward_batches(model: nn.Module, x: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """``model``'s logits of ``x`` in eval mode, in the batches that end at rows ``ends``."""
    if len(ends) == 1:
        return predict_logits(model, x, max(ends[0], 1))
    set_train_mode(model, False)
    return torch.cat([model(x[a:b]) for a, b in zip([0, *ends[:-1]], ends)])


def payload_weights(variants: dict, payload: Payload) -> Weights | None:
    """The only variant's weights when they are the payload's own tensors (a global-model method)."""
    if len(variants) != 1 or "" not in variants:
        return None
    weights = variants[""]
    if not isinstance(weights, dict) or not weights or weights.keys() != payload.tensors.keys():
        return None
    if all(v is payload.tensors[k] for k, v in weights.items()):
        return weights
    return None
