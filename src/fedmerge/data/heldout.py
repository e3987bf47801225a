"""Large test splits from held-out data (``split.test_per_client``).

A client's test split normally is a fraction of its own few samples, so a small federation is evaluated
on a handful of samples per client (several points of standard error per row). Here each client's test
split is drawn instead from the held-out pool, the dataset's samples that ``dataset.max_samples``'
subsample left out, which no client ever holds. The draw follows the client's distribution: the
(domain, class) mix of its own clean training labels, or for a client with a ground-truth group
(cluster and domain partitions) the mix of its whole group's training data, so that e.g. a group owning
six topics is tested on those six topics in the proportions the group holds them. Rotations are applied
afterwards with the client's training images (``federate``), so a rotated group is tested rotated.

Clients' test splits are disjoint: no held-out sample is tested twice, so the clients' accuracies are
independent binomial estimates ([`fedmerge.metrics.noise`][fedmerge.metrics.noise]).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedmerge.data.pool import Pool


def strata(pool: Pool) -> np.ndarray:
    """Each sample's (domain, class) stratum as one integer ``domain * num_classes + class``."""
    if pool.domain is None:
        return pool.y.astype(np.int64)
    return pool.domain.astype(np.int64) * pool.num_classes + pool.y


def num_strata(*pools: Pool) -> int:
    """How many (domain, class) strata the pools' samples fall into (their largest stratum + 1)."""
    domains = [int(p.domain.max()) + 1 for p in pools if p.domain is not None and len(p.domain)]
    return pools[0].num_classes * max(domains, default=1)


def training_mix(pool: Pool, train_rows: Sequence[np.ndarray], groups: Sequence[int] | None, size: int) -> np.ndarray:
    """``clients x strata`` counts of the training samples each client's test split should follow: its own
    (``train_rows[c]``: pool rows, clean labels), or with ``groups`` the sum over its group's clients."""
    keys = strata(pool)
    own = np.stack([np.bincount(keys[rows], minlength=size) for rows in train_rows])
    if groups is None:
        return own
    group = np.asarray(groups, dtype=np.int64)
    per_group = np.zeros((group.max() + 1, size), dtype=np.int64)
    np.add.at(per_group, group, own)
    return per_group[group]


def quotas(mix: np.ndarray, n: int) -> np.ndarray:
    """``n`` samples per row of ``mix`` in its proportions: largest remainder, so a row's quotas sum to
    ``n`` and each lies within one of ``n * proportion`` (ties go to the lower stratum)."""
    exact = mix * (n / mix.sum(axis=1, keepdims=True))
    quota = np.floor(exact).astype(np.int64)
    short = n - quota.sum(axis=1)
    remainder = np.where(mix > 0, exact - quota, -1.0)  # a stratum the client lacks never gets a sample
    order = np.argsort(-remainder, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(mix.shape[1])[None, :].repeat(len(mix), axis=0), axis=1)
    return quota + (rank < short[:, None])


def heldout_tests(heldout: Pool, mix: np.ndarray, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each client's test rows of ``heldout`` (ascending): ``n`` samples in the proportions of its row of
    ``mix``, no row given to two clients. One shuffle of the held-out pool, then each stratum's samples
    are handed out in client order, so a client's draw depends only on the seed and the quotas."""
    size = mix.shape[1]
    keys = strata(heldout)
    supply = np.bincount(keys, minlength=size)[:size]
    want = quotas(mix, n)
    short = np.flatnonzero(want.sum(axis=0) > supply)
    if short.size:
        raise ValueError(_shortage(heldout, mix, n, int(short[0]), int(want[:, short[0]].sum()), supply))
    shuffled = rng.permutation(len(heldout))
    by_stratum = shuffled[np.argsort(keys[shuffled], kind="stable")]
    starts = np.concatenate(([0], np.cumsum(np.bincount(keys, minlength=size))))
    taken: list[list[np.ndarray]] = [[] for _ in range(len(mix))]
    for k in np.flatnonzero(want.sum(axis=0)):
        rows = by_stratum[starts[k] : starts[k] + want[:, k].sum()]
        for client, part in enumerate(np.split(rows, np.cumsum(want[:, k])[:-1])):
            if part.size:
                taken[client].append(part)
    return [np.sort(np.concatenate(parts)) for parts in taken]


def _shortage(heldout: Pool, mix: np.ndarray, n: int, stratum: int, demand: int, supply: np.ndarray) -> str:
    fits, too_many = 0, n  # bisection: ``fits`` per client fit, one more does not
    while too_many - fits > 1:
        mid = (fits + too_many) // 2
        fits, too_many = (mid, too_many) if (quotas(mix, mid).sum(axis=0) <= supply).all() else (fits, mid)
    domain, label = divmod(stratum, heldout.num_classes)
    name = heldout.class_names[label] if heldout.class_names else str(label)
    what = f"class {name}" + ("" if heldout.domain is None else f" of domain {domain}")
    where = "none" if not len(heldout) else f"only {int(supply[stratum])}"
    advice = f"{fits} per client fit" if fits else "none fit"
    return (
        f"split.test_per_client: {len(mix)} clients x {n} test samples need {demand} held-out samples of {what}, "
        f"but {where} lie outside dataset.max_samples' subsample ({advice}); lower split.test_per_client or "
        "dataset.max_samples"
    )
