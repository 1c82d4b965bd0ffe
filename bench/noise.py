"""The noise floor of this machine: one case run N times, and how much its measurements move.

    python -m bench.noise                                # dp_ev, tiny BERT on local_hetero2, 10 runs
    python -m bench.noise method=hap repeats=6 cluster=local_hetero4

Each repeat is a full case in its own worker processes (rows go to records.jsonl as usual). It
prints the coefficient of variation of the repeats' mean iteration times (run to run), the
median within-run CV (iteration to iteration), and the width of the interval of the median
relative to it: two methods closer than about that cannot be ordered with this many repeats
on this machine, and bench.compare shows them as a tie.
"""

from __future__ import annotations

import sys

from hydra.errors import HydraException
from rich.console import Console

from bench.core.errors import ConfigError
from bench.runner.configs import command_argv, print_help_if_asked
from bench.studies.noise_floor import noise_floor


def main(argv: list[str]) -> int:
    if print_help_if_asked(argv, __doc__):
        return 0
    argv = command_argv(argv)
    if argv is None:
        return 2
    try:
        table, ok = noise_floor(argv)
    except (ConfigError, HydraException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Console(width=200).print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
