"""Does each part of the planner pay its way, and how far is the beam from the exact search?

    python -m bench.planner_check                          # 4 paper models x k = 1, 8
    python -m bench.planner_check --models vgg19 --ks 8 -- global_batch=4096
    python -m bench.planner_check --exact                  # also the beam-vs-exact table

Plans (no workers, no records) on paper_hetero with k GPUs per machine, with every part on
and with one part switched off at a time (SFB, collective choice, LP, segments), and prints
the simulated iteration time of each: switching a part off must never make hap faster (a
flagged cell says it did). With --exact it also plans without the beam (method.beam_width=null)
and prints both times, the states expanded and the planning seconds.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from bench.runner.configs import command_argv
from bench.studies.planner_quality import MODELS, agreement_table, beam_vs_exact, monotonicity, print_monotonicity


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ks", default="1,8", help="GPUs per machine of paper_hetero")
    parser.add_argument("--exact", action="store_true", help="also compare the beam with the exact search")
    parser.add_argument(
        "--agreement",
        action="store_true",
        help="only the table of the search's price against the simulator's (which candidate first)",
    )
    parser.add_argument("overrides", nargs="*", help="bench.run overrides, e.g. global_batch=4096")
    argv = command_argv(argv)
    if argv is None:
        return 2
    args = parser.parse_args(argv)
    models, ks = args.models.split(","), [int(k) for k in args.ks.split(",")]
    console = Console(width=200)
    if args.agreement:
        rows = agreement_table(models, ks, args.overrides, console)
        return 0
    rows = monotonicity(models, ks, args.overrides)
    print_monotonicity(rows, console)
    if args.exact:
        beam_vs_exact(models, ks, args.overrides, console)
    return 1 if any(r["faster"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
