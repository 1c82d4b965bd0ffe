"""`hetbench report PATH`: figures and tables from recorded rows (yours or the paper's).

    hetbench report results/runs                         # a results_dir (its records.jsonl[.gz])
    hetbench report results/runs/hydra/multirun-2026...  # one Hydra sweep (its jobs' rows)
    hetbench report my.jsonl --x cluster.gpus_per_machine --metric planner_time_s

Draws one panel per model, one group of bars per value of `--x` (a config key; default the
cluster), one bar per method: throughput with its interval where the row is an aggregate of
repeats, and a gap with the status written at its base for a case that did not end ok (no
height: an OOM case has no throughput). Writes NAME.png, NAME.pdf and NAME.csv (one line per
case, with the commit and origin of its row) and NAME_speedup.csv, and prints the speedup table.
The same rows give the same bytes: the CSVs depend on the rows alone.

An experiment config may set the layout (`report: {name, x, metric, title}` in its yaml); the
options here override it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.records.drawing import METRICS, ReportError, layout, read_rows, report


def _trackers(names: str, out: Path) -> list:
    """The loggers of `--logger` (conf/logger options), writing under `out`."""
    if names in ("", "none"):
        return []
    from bench.core.errors import ConfigError
    from bench.runner.configs import check_group_choices, compose_settings
    from bench.runner.execute import make_trackers

    try:
        check_group_choices([f"logger={names}"])
        return make_trackers(compose_settings(f"logger=[{names}]", f"results_dir={out}"))
    except ConfigError as exc:
        raise ReportError(f"--logger: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hetbench report",
        description=__doc__.split("\n\n")[0],
        epilog="Reads rows written by `hetbench run`/`compare` (any mode); docs/records.md describes them.",
    )
    parser.add_argument("path", help="a records.jsonl, a results_dir, or a Hydra sweep directory")
    parser.add_argument("--out", help="where to write the figure and CSVs (default: beside PATH)")
    parser.add_argument("--name", help="file name stem (default: the experiment's, else 'report')")
    parser.add_argument("--x", help="config key on the x axis (default: the experiment's, else cluster)")
    parser.add_argument("--metric", help=f"one of {', '.join(METRICS)} (default samples_per_s)")
    parser.add_argument("--title")
    parser.add_argument("--sweep", help="only rows of this sweep_id")
    parser.add_argument("--no-figure", action="store_true", help="CSVs and the table only")
    parser.add_argument(
        "--logger",
        default="none",
        help="also keep the figure and CSVs as an artifact of these loggers "
        "(conf/logger, comma list, e.g. wandb,csv; they write under --out)",
    )
    from bench.runner.configs import command_argv

    argv = command_argv(argv)  # --config-dir: the loggers of a folder of your own
    if argv is None:
        return 2
    args = parser.parse_args(argv)
    try:
        rows = read_rows(args.path)
        if args.sweep:
            rows = [r for r in rows if r.get("sweep_id") == args.sweep]
            if not rows:
                raise ReportError(
                    f"--sweep {args.sweep}: no row of {args.path} has this sweep_id; "
                    "the rows' sweep_id column lists the sweeps"
                )
        spec = layout(rows)
        path = Path(args.path)
        out = Path(args.out) if args.out else (path.parent if path.is_file() else path)
        trackers = _trackers(args.logger, out)
        name = args.name or spec.get("name", "report")
        report(
            rows,
            out,
            name,
            args.x or spec.get("x", "cluster"),
            args.metric or spec.get("metric", "samples_per_s"),
            args.title or spec.get("title"),
            figure=not args.no_figure,
        )
        if trackers:
            from bench.records.tracking import track_figure

            files = [out / f"{name}{suffix}" for suffix in (".png", ".pdf", ".csv", "_speedup.csv")]
            track_figure(trackers, name, [f for f in files if f.exists()])
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
