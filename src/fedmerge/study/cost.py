"""The GPU-hour arithmetic a paper study's file states in its header comment (``# GPU hours on one H100``),
read back for ``fedmerge study --dry-run``: the block as written, and the training steps of one run with the
time they take at the stated step floor or FLOP throughput, recomputed from the block's own numbers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

HEAD = "# GPU hours on one H100"
ONE_RUN = re.compile(
    r"one run: ([\d,]+) rounds x ([\d,]+) training samples .*?/ batch (\d+), .*?: ([\d.]+) ([MG])FLOP"
    r"(?:/token x ~([\d,]+) padded tokens)?"
)
ASSUMED = re.compile(
    r"assumed: a training step takes (?:at least ([\d.]+) ms .*? or )?(\d+)x its forward FLOPs at (\d+) TFLOP/s"
)


def block(text: str) -> list[str]:
    """The header's GPU-hours lines (without their ``# ``), or [] when the file has none."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(HEAD)), None)
    if start is None:
        return []
    out = []
    for line in lines[start:]:
        if not line.startswith("#") or line.strip() == "#":
            break
        out.append(line[2:])
    return out


@dataclass(frozen=True)
class Steps:
    """One run's training steps and the time each takes (the longer of the floor and the FLOPs)."""

    rounds: int
    samples: int
    batch: int
    step_flops: float  # the training FLOPs of one step
    floor_ms: float
    tflops: float

    @property
    def steps(self) -> float:
        return self.rounds * self.samples / self.batch

    @property
    def step_seconds(self) -> float:
        return max(self.floor_ms / 1000, self.step_flops / (self.tflops * 1e12))

    @property
    def hours(self) -> float:
        return self.steps * self.step_seconds / 3600


def steps(lines: list[str]) -> Steps | None:
    """The block's one-run arithmetic, or None when it does not state it in the usual words."""
    text = " ".join(line.strip() for line in lines)
    run, assumed = ONE_RUN.search(text), ASSUMED.search(text)
    if run is None or assumed is None:
        return None
    number = lambda s: float(s.replace(",", ""))  # noqa: E731
    rounds, samples, batch = int(number(run.group(1))), int(number(run.group(2))), int(run.group(3))
    forward = number(run.group(4)) * (1e6 if run.group(5) == "M" else 1e9) * number(run.group(6) or "1")
    floor = float(assumed.group(1) or 0)
    return Steps(rounds, samples, batch, int(assumed.group(2)) * forward * batch, floor, float(assumed.group(3)))


def cost_lines(path: Path) -> list[str]:
    """``--dry-run``'s GPU-hour lines: the block as the file states it, then one run's steps recomputed."""
    lines = block(path.read_text())
    if not lines:
        return []
    out = [f"GPU-hour arithmetic ({path.name}):", *(f"  {line}" for line in lines[1:])]
    s = steps(lines)
    if s is not None:
        bound = "the step floor" if s.floor_ms / 1000 >= s.step_flops / (s.tflops * 1e12) else "the FLOPs"
        out.append(
            f"  recomputed: {s.rounds} rounds x {s.samples:,} samples / batch {s.batch} = {s.steps:,.0f} steps x "
            f"{s.step_seconds * 1000:.3g} ms ({bound}) = {s.hours:.2f} h of training per run, before evaluation"
        )
    return out
