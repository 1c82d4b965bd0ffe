"""Throughput regression check against committed baselines (results/baselines/regression.json).

    python -m bench.regress                 # compute the figures, compare, exit 1 on a regression
    python -m bench.regress --rebaseline    # deliberately write new baselines (commit + versions)
    python -m bench.regress --rebaseline --sessions 3 --note "why"   # each figure: median of 3
    python -m bench.regress --rebaseline --no-measured --note "why"  # only the sim figures; the
                                                                     # measured ones are kept
    python -m bench.regress method=hap      # only hap's figures (model=a,b likewise)
    python -m bench.regress --rebaseline method=pipeline --note "why"   # add (or replace) one
                                                                     # method's figures, keep the rest

The figures and the rules they are judged by: bench.studies.regression and docs/regression.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.core.errors import ConfigError
from bench.runner.configs import check_group_choices, command_argv, methods_supporting
from bench.studies.regression import (
    MODELS,
    _selected,
    add_to_baseline,
    baseline_real_methods,
    compare,
    kept_measured,
    load_baseline,
    measured_figures,
    measured_rounds,
    measured_sessions,
    medians,
    planner_retries,
    render,
    report_table,
    sim_sessions,
    write_baseline,
)


def build_parser() -> argparse.ArgumentParser:
    """The command's flags: --rebaseline writes the baseline, else the figures are checked against it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebaseline", action="store_true", help="write new baselines")
    parser.add_argument(
        "--no-measured",
        action="store_true",
        help="skip the measured figures (with "
        "--rebaseline: keep the current baseline's, noting where they were measured)",
    )
    parser.add_argument(
        "--slowdown",
        type=float,
        default=0.0,
        help="demo: stretch every measured iteration by this fraction (e.g. 0.15)",
    )
    parser.add_argument(
        "--sessions",
        type=int,
        default=1,
        help="with --rebaseline: plan, and measure the measured figures, this many times "
        "and keep each figure's median (the measured sessions' values are kept in the file)",
    )
    parser.add_argument("--note", default=None, help="with --rebaseline: why the baseline changed (kept in the file)")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="model=a,b and method=a,b check a subset of the figures (the cases "
        "themselves are fixed: they are what the baseline measured)",
    )
    return parser


def main(argv: list[str]) -> int:
    argv = command_argv(argv)
    if argv is None:
        return 2
    args = build_parser().parse_args(argv)
    chosen = chosen_subset(args)
    if chosen is None:
        return 2
    return rebaseline(args, chosen) if args.rebaseline else check(args, chosen)


def chosen_subset(args: argparse.Namespace) -> dict[str, list[str]] | None:
    """The models and methods the overrides pick ({} for all), or None after one line on what is wrong."""
    chosen: dict[str, list[str]] = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if key not in ("model", "method") or not sep or not value:
            print(
                f"error: {item!r}: regress compares fixed cases with the baseline and takes only "
                "model=a,b and method=a,b to check a subset; e.g. method=hap",
                file=sys.stderr,
            )
            return None
        chosen[key] = value.split(",")
    try:
        check_group_choices([f"{k}={','.join(v)}" for k, v in chosen.items()])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    if args.rebaseline and "model" in chosen:
        print(
            "error: --rebaseline writes every model's figures; drop model= (method=a,b adds or replaces "
            "those methods' figures and keeps the rest)",
            file=sys.stderr,
        )
        return None
    if args.sessions < 1 or (args.sessions > 1 and not args.rebaseline):
        print(
            f"error: --sessions={args.sessions}: it must be >= 1, and more than 1 only with --rebaseline "
            "(e.g. --rebaseline --sessions 3)",
            file=sys.stderr,
        )
        return None
    return chosen


def simulated(sessions: int, chosen: dict[str, list[str]]) -> dict[str, float]:
    """The simulated and planner figures of the chosen models and sim-capable methods."""
    methods = chosen.get("method")
    return sim_sessions(
        sessions,
        chosen.get("model", MODELS),
        None if methods is None else [m for m in methods if m in methods_supporting("sim")],
    )


def rebaseline(args: argparse.Namespace, chosen: dict[str, list[str]]) -> int:
    """--rebaseline: write every figure anew, or with method=a,b add (or replace) those methods' figures."""
    figures = simulated(args.sessions, chosen)
    methods = chosen.get("method")
    sessions = None
    if methods is not None:
        if not args.no_measured:
            real = [m for m in methods if m in methods_supporting("real")]
            sessions = [measured_figures(args.slowdown, real) for _ in range(args.sessions)]
            keys = set.intersection(*(set(r) for r in sessions))
            figures.update({k: statistics.median(r[k] for r in sessions) for k in sorted(keys)})
        add_to_baseline(load_baseline(), figures, methods, sessions, args.note)
        return 0
    origin = None
    if args.no_measured:
        measured, sessions, origin = kept_measured(load_baseline())
    else:
        measured, sessions = measured_sessions(args.sessions, args.slowdown)
    figures.update(measured)
    write_baseline(figures, sessions=sessions, note=args.note, measured_from=origin)
    return 0


def check(args: argparse.Namespace, chosen: dict[str, list[str]]) -> int:
    """The figures now against the baseline's: a table, and 1 on a regression."""
    start = time.perf_counter()
    figures = simulated(1, chosen)
    methods = chosen.get("method")
    rounds, base = None, load_baseline()
    if not args.no_measured and chosen.get("model") in (None, ["bert"]):
        real = baseline_real_methods(base)
        rounds = measured_rounds(
            args.slowdown, real if methods is None else [m for m in methods if m in real], base["figures"]
        )
        figures.update(medians(rounds))
    expected = {k: v for k, v in base["figures"].items() if _selected(k, chosen)}
    if args.no_measured:
        expected = {k: v for k, v in expected.items() if not k.startswith("iter_over_compute:")}
    rounds = {**(rounds or {}), **planner_retries(expected, figures)}
    changes = compare(expected, figures, rounds)
    print(render(report_table(changes, base.get("git_sha"))))
    bad = [c for c in changes if c.regressed]
    print(f"{len(changes)} figures, {len(bad)} regressions, {time.perf_counter() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
