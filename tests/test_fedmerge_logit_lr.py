"""FedMerge's default logit_lr (the evidence: docs/reproductions/fedmerge/logit_lr/), and what it must not touch:
the reference preset keeps the reference code's threshold 0.01, and fixed merge weights never read logit_lr."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedmerge.algorithms.fedmerge import FedMerge, FedMergeConfig
from fedmerge.config.schema import load_config
from fedmerge.core.types import Update

CHOSEN = 0.3  # the value docs/reproductions/fedmerge/logit_lr/HISTORY.md chose and confirmed
REFERENCE_W = 0.01  # the reference code's learning_rate_W (its only usable value: declared type=int)


def test_the_default_and_the_paper_preset_use_the_chosen_logit_lr():
    assert FedMergeConfig().logit_lr == CHOSEN
    assert FedMergeConfig(preset="paper").logit_lr == CHOSEN  # the paper preset sets forms, not step sizes
    assert load_config(None, ["algorithm.name=fedmerge"]).algorithm.logit_lr == CHOSEN
    assert load_config(None, ["algorithm.name=fedmerge", "algorithm.preset=paper"]).algorithm.logit_lr == CHOSEN


def test_the_reference_preset_keeps_the_reference_threshold_unless_written(tmp_path):
    assert FedMergeConfig(preset="reference").logit_lr == REFERENCE_W
    cli = load_config(None, ["algorithm.name=fedmerge", "algorithm.preset=reference"]).algorithm
    assert cli.logit_lr == REFERENCE_W
    file = tmp_path / "reference.yaml"
    file.write_text("algorithm: {name: fedmerge, preset: reference}\n")
    assert load_config(file).algorithm.logit_lr == REFERENCE_W
    # A value the user wrote wins, the default's own value included (studies tune it under the preset).
    assert FedMergeConfig(preset="reference", logit_lr=0.3).logit_lr == 0.3
    written = load_config(
        None, ["algorithm.name=fedmerge", "algorithm.preset=reference", f"algorithm.logit_lr={CHOSEN}"]
    )
    assert written.algorithm.logit_lr == CHOSEN
    # A run folder's config.yaml (every option written out) loads back as it ran.
    again = load_config(None, [f"algorithm.{k}={v}" for k, v in cli.model_dump().items() if v is not None])
    assert again.algorithm == cli


def _tiny(gen: torch.Generator | None = None) -> nn.Module:
    """Each global model from its own generator, so that the d models differ and learned logits can move."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen or torch.Generator().manual_seed(0)))
    return model


@pytest.mark.parametrize("merge_weights", ["fixed", "dynamic"])
def test_fixed_merge_weights_never_read_logit_lr(merge_weights):
    """Three rounds of aggregate with the same updates at logit_lr 0.01, the default and 1.0: with fixed weights
    the server state is the same bit for bit and the logits stay the seeded 0 / -inf pattern; with learned
    weights (the control) the logits at 0.01 and 1.0 differ, so these updates do move them."""
    m, d, k = 5, 4, 2
    gen = torch.Generator().manual_seed(3)
    layout_model = _tiny()
    shapes = {name: t.shape for name, t in layout_model.state_dict().items()}
    rounds = [
        {cid: {name: 0.1 * torch.randn(shape, generator=gen) for name, shape in shapes.items()} for cid in range(m)}
        for _ in range(3)
    ]
    states = {}
    for lr in (0.01, None, 1.0):
        extra = {} if lr is None else {"logit_lr": lr}
        algo = FedMerge(FedMergeConfig(num_models=d, merge_weights=merge_weights, fixed_k=k, **extra), _tiny, m, 0)
        state = algo.init_server_state()
        start = state.tensors["logits"].clone()
        for rnd, deltas in enumerate(rounds, 1):
            updates = {cid: Update(delta, {"num_examples": 10 + cid}) for cid, delta in deltas.items()}
            state = algo.aggregate(state, rnd, updates)
        states[lr] = (start, state.tensors["theta"].clone(), state.tensors["logits"].clone())
    if merge_weights == "fixed":
        start = states[None][0]
        assert all(torch.isinf(row).sum() == d - k and (row[~torch.isinf(row)] == 0).all() for row in start)
        for lr in (0.01, 1.0):
            assert torch.equal(states[lr][1], states[None][1]) and torch.equal(states[lr][2], states[None][2])
        assert torch.equal(states[None][2], start)  # frozen
    else:
        assert not torch.equal(states[0.01][2], states[1.0][2])


def test_every_fedmerge_row_of_every_study_writes_its_logit_lr():
    """A study's run folder is refused when its config differs from what the study asks now, so a row that
    took the default logit_lr would stop matching its published runs when the default changes. Every FedMerge
    row (fixed ablations included: they ignore the value, but their config.yaml records it) writes it, or
    takes the reference preset's own 0.01."""
    from pathlib import Path

    from fedmerge.config.schema import read_yaml
    from fedmerge.study.spec import StudyFile, base_path, run_overrides

    root = Path(__file__).resolve().parents[1]
    loose = []
    for path in sorted((root / "studies").rglob("*.yaml")):
        data = read_yaml(path)  # the rows as written (load_study_file would also validate every point: slow)
        spec = StudyFile.model_validate({**data, "base": base_path(path, data["base"])})
        for revision in ["first", *(r.name for r in spec.revisions)]:
            study = spec.at(revision)
            base = (read_yaml(root / study.base).get("algorithm") or {}) if (root / study.base).is_file() else {}
            for row in study.methods:
                for point in row.points():
                    written = {**base, **dict(o.split("=", 1) for o in run_overrides(row, point, 0))}
                    written = {k.removeprefix("algorithm."): v for k, v in written.items()}
                    if written.get("name") == "fedmerge" and "logit_lr" not in written:
                        if written.get("preset") != "reference":
                            loose.append(f"{path.relative_to(root)} ({revision}): {row.label}")
    assert not loose, sorted(set(loose))


def test_the_evidence_scripts_movement_figures_against_a_hand_computation():
    """benchmarks/fedmerge_logit_lr.py: rows (1/2, 1/2) and (1, 0) have largest weights 1/2 and 1 (mean 3/4) and
    normalised entropies 1 and 0 (mean 1/2); the warning's test (no weight reaches 1.5/d) holds only for uniform
    rows. Its block writer replaces what lies between the markers and nothing else."""
    import math
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from fedmerge_logit_lr import into_block, movement

    got = movement([[0.5, 0.5], [1.0, 0.0]])
    assert got["d"] == 2 and got["max_weight"] == 0.75 and got["entropy"] == 0.5 and got["warns"] is False
    third = movement([[0.25, 0.25, 0.5]])  # H = 1.5 ln 2, over ln 3
    assert math.isclose(third["entropy"], 1.5 * math.log(2) / math.log(3)) and third["warns"] is False
    assert movement([[0.2] * 5, [0.29, 0.2, 0.2, 0.2, 0.11]])["warns"] is True  # 0.29 < 1.5 / 5
    page = "a\n<!-- generated: x -->\nold\n<!-- end generated: x -->\nb\n"
    assert into_block(page, "x", "new") == "a\n<!-- generated: x -->\nnew\n<!-- end generated: x -->\nb\n"


def test_the_choice_rule_takes_the_smallest_silent_value_within_half_a_point_of_the_best():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from fedmerge_logit_lr import rule

    def runs(lr: float, warns: bool, a: float, b: float) -> list[dict]:
        row = f"FedMerge logit_lr={lr}"
        return [{"row": row, "study": s, "warns": warns, "val_acc": v} for s, v in (("x", a), ("y", b))]

    # means over the two studies: 0.01 -> 90.0 (warns), 0.1 -> 91.0, 0.3 -> 92.5, 1.0 -> 92.0
    records = runs(0.01, True, 0.90, 0.90) + runs(0.1, False, 0.90, 0.92) + runs(0.3, False, 0.93, 0.92)
    assert rule(records + runs(1.0, False, 0.92, 0.92)).endswith("**0.3** (92.50).")  # 1.0 is 0.5 below: not within
    assert rule(records + runs(1.0, False, 0.925, 0.92)).endswith("**0.3** (92.50).")  # 1.0 ties within, 0.3 smaller
    assert rule(runs(0.01, True, 0.9, 0.9) + runs(0.1, False, 0.92, 0.93) + runs(0.3, False, 0.93, 0.93)).endswith(
        "**0.1** (92.50)."  # 0.1 within 0.5 of 0.3's 93.0
    )
    assert rule(runs(0.01, False, 0.95, 0.95) + runs(0.1, False, 0.90, 0.90)).endswith("**0.01** (95.00).")
    assert "stays" in rule(runs(0.01, True, 0.95, 0.95) + runs(0.1, False, 0.90, 0.90))  # 5 points below 0.01
    assert "stays" in rule(runs(0.01, True, 0.9, 0.9) + runs(0.1, True, 0.9, 0.9))  # nothing silent
