"""The paper's evaluation figures, one command each: PNG + PDF with the data as CSV beside them.

    python -m bench.figures main            # or: homogeneous allgather_skew synthesis_time
    python -m bench.figures all             #     ablation sim_accuracy cp_vs_ev

Simulated figures run the runner's own planning and simulation (bench.runner.case.prepare_case), so a
point is exactly what `python -m bench.run mode=sim ...` would record for that case (cp_vs_ev's:
the cases of conf/experiment/cp_vs_ev.yaml). Measured figures (allgather_skew's gloo half,
sim_accuracy, cp_vs_ev's measured half) come from real runs on this host.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from bench.core.errors import ConfigError
from bench.records.progress import track
from bench.runner.configs import command_argv
from bench.studies.paper_figures import EXPERIMENT_FIGURES, FIGURE_DIR, FIGURES

matplotlib.use("Agg")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names",
        nargs="+",
        help=f"figure names or 'all': {', '.join(FIGURES)}; then "
        f"runner overrides for the experiment figures ({', '.join(EXPERIMENT_FIGURES)}), "
        "e.g. model=bert method=dp_ev,hap",
    )
    parser.add_argument("--out", type=Path, default=FIGURE_DIR)
    argv = command_argv(argv)
    if argv is None:
        return 2
    args = parser.parse_args(argv)
    overrides = [n for n in args.names if "=" in n]
    names = [n for n in args.names if "=" not in n]
    names = list(FIGURES) if names == ["all"] else names
    unknown = [n for n in names if n not in FIGURES]
    if unknown or not names:
        print(
            f"error: figure {', '.join(unknown) or '(none)'} is unknown; known: {', '.join(FIGURES)}", file=sys.stderr
        )
        return 2
    fixed = [n for n in names if n not in EXPERIMENT_FIGURES]
    if overrides and fixed:
        print(
            f"error: figure {', '.join(fixed)} takes no overrides ({' '.join(overrides)}); only "
            f"{', '.join(EXPERIMENT_FIGURES)} do: run those alone with overrides",
            file=sys.stderr,
        )
        return 2
    try:
        for name in track(names, "figures"):
            FIGURES[name](args.out, *overrides)
    except ConfigError as exc:  # an override no case can take
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
