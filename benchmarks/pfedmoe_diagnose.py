"""pFedMoE diagnostics: how much the shared global expert learns, and what the gate does.

    python benchmarks/pfedmoe_diagnose.py [CONFIG] [key=value ...] [--no-share]

Runs pFedMoE (``algorithm.name=pfedmoe`` is forced) on CONFIG (default:
configs/repro/fedmerge_wordnet_cluster6.yaml), every client every round, through the algorithm's own
configure / client_update / aggregate (the local engine's order; seed 0 gives the engine's per-client
accuracies). Per reported round it prints the mean training loss, the relative change of the global
expert in that round (||w_r - w_{r-1}|| / ||w_{r-1}||, all body tensors) and, over each client's
val+test rows (the client mean, as the studies report):

- ``avg``: the client's network with the averaged global expert (what the engine evaluates);
- ``own``: the same with the client's own trained global expert, before averaging;
- ``loc``/``glob``: the head on one expert's features alone;
- ``fixed``: the gate replaced by the client's mean gate weights on its training data;
- the gate weight of the global expert: its client means (min..max) and the per-sample range.

``--no-share`` skips the averaging (each client keeps its own global expert): the same network
trained without federation, to measure what the sharing adds. ``scripts/pfedmoe_diagnose.py``, the path the
docs named first, runs the same.
"""

from __future__ import annotations

import sys

import torch

from fedmerge.algorithms import ALGORITHMS
from fedmerge.algorithms.pfedmoe import PFedMoE
from fedmerge.config.schema import load_config
from fedmerge.core.algorithm import ClientContext
from fedmerge.core.types import ClientState, Payload
from fedmerge.run.data_plan import plan_data

DEFAULT = "configs/repro/fedmerge_wordnet_cluster6.yaml"
REPORT = (1, 2, 3, 5, 10, 20, 30, 40, 50)


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(dim=1) == y).float().mean())


@torch.no_grad()
def client_figures(alg: PFedMoE, payload: Payload, data, state: ClientState, ctx: ClientContext,
                   own: dict[str, torch.Tensor]) -> dict[str, float]:  # fmt: skip
    x, y = torch.cat([data.x_val, data.x_test]), torch.cat([data.y_val, data.y_test])
    moe = alg._load(payload, data, state, ctx)  # the network the engine evaluates
    moe.eval()
    g_train = moe.gate(data.x_train)
    hg, hl = moe.global_expert.features(x), moe.local_expert.features(x)
    head = moe.local_expert.classifier
    mean_g = g_train.mean(dim=0)
    out = {
        "avg": accuracy(moe(x), y),
        "loc": accuracy(head(hl), y),
        "glob": accuracy(head(hg), y),
        "fixed": accuracy(head(mean_g[0] * hg + mean_g[1] * hl), y),
        "g_mean": float(mean_g[0]),
        "g_min": float(g_train[:, 0].min()),
        "g_max": float(g_train[:, 0].max()),
    }
    moe.global_expert.load_state_dict(own, strict=False)
    out["own"] = accuracy(moe(x), y)
    return out


def main(argv: list[str]) -> None:
    no_share = "--no-share" in argv
    args = [a for a in argv if a != "--no-share"]
    path = args.pop(0) if args and "=" not in args[0] else DEFAULT
    cfg = load_config(path, [*args, "algorithm.name=pfedmoe"])
    torch.set_num_threads(cfg.threads)
    planned = plan_data(cfg, device=torch.device("cpu"))
    data, factory = planned.data, planned.build_model

    alg = ALGORITHMS.get("pfedmoe").obj(cfg.algorithm, factory, len(data.clients), cfg.seed)
    model, device = factory(torch.Generator().manual_seed(0)), torch.device("cpu")
    clients = list(range(len(data.clients)))
    server = alg.init_server_state()
    states = {c: alg.init_client_state(c) for c in clients}
    own: dict[int, dict[str, torch.Tensor]] = {}
    print(f"pfedmoe lr={cfg.algorithm.lr} seed={cfg.seed}{' no-share' if no_share else ''}")
    for rnd in range(1, cfg.rounds + 1):
        payloads = alg.configure(server, rnd, clients)
        if no_share and own:
            payloads = {c: Payload(own[c], {"round": rnd}) for c in clients}
        updates = {}
        for c in clients:
            ctx = ClientContext(model, device, cfg.seed, rnd, c)
            updates[c], states[c] = alg.client_update(payloads[c], data.clients[c], states[c], ctx)
        own = {c: u.tensors for c, u in updates.items()}
        new = alg.aggregate(server, rnd, updates)
        change = sum((new.tensors[k] - server.tensors[k]).square().sum() for k in server.tensors) ** 0.5
        change = float(change / sum(v.square().sum() for v in server.tensors.values()) ** 0.5)
        server = new
        if rnd not in REPORT and rnd != cfg.rounds:
            continue
        loss = sum(u.meta["train_loss"] for u in updates.values()) / len(updates)
        rows = []
        for c in clients:
            payload = Payload(own[c], {"round": rnd}) if no_share else alg.configure_evaluate(server, rnd, [c])[c]
            ctx = ClientContext(model, device, cfg.seed, rnd, c)
            rows.append(client_figures(alg, payload, data.clients[c], states[c], ctx, own[c]))
        m = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
        gm = [r["g_mean"] for r in rows]
        accs = " ".join(f"{k} {100 * m[k]:.1f}" for k in ("avg", "own", "loc", "glob", "fixed"))
        gate = f"g_glob {m['g_mean']:.2f} (clients {min(gm):.2f}..{max(gm):.2f}, "
        gate += f"samples {m['g_min']:.2f}..{m['g_max']:.2f})"
        print(f"r{rnd:3d} train CE {loss:.3f}  global expert change {100 * change:.2f}%  acc(val+test) {accs}  {gate}")


if __name__ == "__main__":
    main(sys.argv[1:])
