"""What the ``privacy:`` mechanisms publish: each round's figures (the server report's ``privacy``), the run's
guarantees at its end (``summary.json``'s ``privacy``), the server's record of each DP-SGD client, and a round
record with its participants hidden. All of it is read from the ledgers that
[`PrivateAlgorithm`][fedmerge.algorithms.privacy.PrivateAlgorithm] keeps in the server state (``book``)."""

from __future__ import annotations

from typing import Any

from fedmerge.algorithms.privacy_settings import NOT_PRIVATE, PrivacySettings
from fedmerge.core.privacy import Ledger


def round_figures(book: dict[str, Any], settings: PrivacySettings, private: bool, poisson_clients: bool) -> dict:
    """The round's privacy figures: the DP-SGD clients' epsilons (by id unless the clients are Poisson-sampled,
    whose ids would tell a reader who took part) and central DP's last release."""
    figures: dict[str, Any] = {} if private else {"not_private": NOT_PRIVATE}
    if "dp_sgd" in book:
        eps = book["dp_sgd"]["epsilon"]
        figures["dp_sgd"] = {
            "delta": settings.dp_sgd.delta,
            "epsilon_max": max(eps.values(), default=0.0),
        }
        if not poisson_clients:
            figures["dp_sgd"]["epsilon"] = {str(c): eps[str(c)] for c in book["dp_sgd"]["clients"]}
    if "central" in book and "last" in book["central"]:
        figures["central"] = {"delta": settings.central.delta, **book["central"]["last"]}
    return figures


def run_guarantees(
    book: dict[str, Any],
    settings: PrivacySettings,
    private: bool,
    central_noise_multiplier: float | None,
    client_rate: float,
) -> dict[str, Any]:
    """The run's guarantees at its end: RDP epsilon (Opacus's RDP accountant, the bound the runs are planned
    with) and PRV epsilon (Opacus's PRV accountant) beside it. ``central_noise_multiplier``: central DP's, when
    the book has a central ledger."""
    out: dict[str, Any] = {"private": private}
    if not private:
        out["not_private"] = NOT_PRIVATE
    if "dp_sgd" in book:
        eps = book["dp_sgd"]["epsilon"]
        values = list(eps.values())
        worst = max(eps, key=eps.__getitem__, default=None)
        history = book["dp_sgd"].get("ledger", {}).get(worst) if worst is not None else None
        out["dp_sgd"] = {
            "delta": settings.dp_sgd.delta,
            "clip": settings.dp_sgd.clip,
            "sampling": "Poisson, rate batch_size / n per sample; add/remove one sample",
            "epsilon_max": max(values, default=0.0),
            # the same client's epsilon by the PRV accountant (its constant noise and rate: one ledger entry)
            "epsilon_max_prv": Ledger([history]).epsilon_prv(settings.dp_sgd.delta) if history else None,
            "epsilon_mean": sum(values) / len(values) if values else 0.0,
            "epsilon": eps,
        }
    if "central" in book:
        last = book["central"].get("last", {})
        ledger = Ledger(book["central"]["history"])
        out["central"] = {
            "delta": settings.central.delta,
            "epsilon": last.get("epsilon", 0.0),
            "epsilon_prv": ledger.epsilon_prv(settings.central.delta),
            "noise_multiplier": central_noise_multiplier,
            "rounds": ledger.steps,
            "client_rate": client_rate,
            "sampling": "Poisson, rate participation per client; add/remove one client",
            "final_clip": book["central"]["clip"],
        }
    return out


def book_client(ledger: dict[str, Any], cid: int, figures: dict[str, Any]) -> None:
    """The server's record of a DP-SGD client: its epsilon, and (for the summary's PRV figure) its ledger as one
    entry when its noise and rate never changed."""
    ledger["epsilon"][str(cid)] = float(figures["epsilon"])
    if "sample_rate" in figures:
        entry = [float(figures["noise_multiplier"]), float(figures["sample_rate"]), int(figures["steps"])]
        ledger.setdefault("ledger", {})[str(cid)] = entry


def redact_participants(record: dict[str, Any]) -> dict[str, Any]:
    """A round record as published under central DP with Poisson client sampling: which clients took part
    stays secret (the sampling's amplification assumes a reader does not know it), so only their number is
    logged; per-client communication, the failed clients' ids and per-client epsilons are left out."""
    out = {k: v for k, v in record.items() if k not in ("selected", "comm_clients")}
    out["participants"] = len(record.get("selected", []))
    if "failed_clients" in record:
        out["failed_clients"] = [{k: v for k, v in f.items() if k != "cid"} for f in record["failed_clients"]]
    return out
