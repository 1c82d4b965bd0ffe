"""How faithfully the emulator slows a device down: achieved dilation against 1/speed.

    python -m bench.dilation            # 10 runs at speeds 0.25, 0.4, 0.5: one table
    python -m bench.dilation 3 0.5      # 3 runs at speed 0.5
    python -m bench.dilation 10 emulation.reference_iters=30   # runner overrides, as elsewhere

One spawned worker process trains tiny BERT through the real worker path (bench.runtime.worker.run_rank,
one emulated device) at speed 1, then s, then 1 again, for each speed s; the achieved dilation
is s's median iteration time over the mean of its two speed-1 neighbours, times s (1.0 is
perfect). All of them are paced against one full-pace reference, measured first in the same
process (EmulationSettings.reference): one emulated device, whose speed must not follow the
host's drift from one case to the next. What is left is the emulator's own error: sleep
overshoot, compute that outran its target, time inside the step that pacing does not see.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from bench.records.progress import track
from bench.runner.configs import command_argv
from bench.studies.pacing_fidelity import GOAL, SPEEDS, measure


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__.strip())
        return 0
    argv = command_argv(argv)
    if argv is None:
        return 2
    overrides = tuple(a for a in argv if "=" in a)
    argv = [a for a in argv if "=" not in a]
    try:
        runs = int(argv[0]) if argv else 10
        speeds = tuple(float(s) for s in argv[1:]) or SPEEDS
    except ValueError:
        print(
            f"error: usage: python -m bench.dilation [RUNS] [SPEED ...] [key=value ...]; got {' '.join(argv)}",
            file=sys.stderr,
        )
        return 2
    if runs < 1 or not all(0 < s <= 1 for s in speeds):
        print(
            "error: RUNS must be >= 1 and each SPEED in (0, 1]; e.g. python -m bench.dilation 10 0.5", file=sys.stderr
        )
        return 2
    results = [measure(speeds, overrides) for _ in track(range(runs), "dilation runs")]
    table = Table(title=f"achieved dilation x speed (1.000 = exactly 1/speed), {runs} runs")
    for col in ("speed", *(f"run {i + 1}" for i in range(runs)), f"within {GOAL:.0%}"):
        table.add_column(col, justify="right")
    ok = True
    for s in speeds:
        values = [r[s] for r in results]
        hits = sum(abs(v - 1) <= GOAL for v in values)
        ok &= hits == runs
        table.add_row(f"{s:g}", *(f"{v:.3f}" for v in values), f"{hits}/{runs}")
    Console(width=200).print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
