"""The main job: run every implemented method as its own case and print the comparison.

    python -m bench.compare                          # tiny BERT on local_hetero2, all methods
    python -m bench.compare model=vit cluster=local_hetero4 method=dp_ev,dp_cp
    python -m bench.compare repeats=10               # more rounds, narrower intervals

Takes the runner's overrides; `method=a,b` picks a subset (default: every conf/method option).
Measured comparisons run `repeats` rounds (default 6, a 97% interval for each median),
interleaved: round r runs every method once, each in its own worker processes (A B C, A B C,
...), so a drift of the machine hits every method alike. Each run is a `repeat` row; each method
then gets an `aggregate` row: the median of its repeats' mean iteration times, the order-statistic
interval of that median (bench.records.stats), the MLPerf-style trimmed mean, and its speedup over dp_ev
computed round by round (same round, same machine state) with its own interval.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from hydra.errors import HydraException

from bench.core.errors import ConfigError
from bench.records.rows import RunRecord
from bench.records.table import BASELINE, print_table
from bench.records.tracking import track_sweep
from bench.runner.configs import (
    check_group_choices,
    compose_settings,
    group_options,
    method_target,
    plugin_modes,
    print_help_if_asked,
    results_file,
    take_config_dirs,
)
from bench.runner.execute import expect_cases, make_trackers, run_case, start_server_early
from bench.runner.rounds import run_rounds

DEFAULT_REPEATS = 6  # measured comparisons; mode=sim is deterministic and runs once


def compare(overrides: list[str]) -> list[RunRecord]:
    """Run the comparison; returns one row per method (the aggregate where repeated)."""
    check_group_choices(overrides)
    rest = [o for o in overrides if not o.startswith("method=")]
    base = compose_settings(*rest)
    repeats = base.repeats
    if not any(o.lstrip("+").startswith("repeats=") for o in rest) and base.mode == "real":
        repeats = DEFAULT_REPEATS
    if base.mode == "sim":
        repeats = 1
    chosen = [o.split("=", 1)[1].split(",") for o in overrides if o.startswith("method=")]
    # by default every implemented method that can run in this mode: conf/method is the registry
    methods = chosen[-1] if chosen else sorted(group_options("method"), key=lambda m: (m != BASELINE, m))
    start_server_early(base, [method_target(m) for m in methods])
    configs = {m: compose_settings(*rest, f"method={m}", f"repeats={repeats}") for m in methods}
    if not chosen:
        for m, cfg in list(configs.items()):
            modes = plugin_modes(cfg.method)
            if base.mode not in modes:
                print(f"note: {m} skipped: it supports mode={','.join(modes)} only")
                del configs[m]
        methods = list(configs)
    expect_cases(configs.values())
    if repeats == 1:
        return [run_case(configs[m]) for m in methods]
    return run_rounds(configs, repeats)


def main(argv: list[str]) -> int:
    if print_help_if_asked(argv, __doc__):
        return 0
    try:
        argv = take_config_dirs(argv)
        records = compare(argv)
    except (ConfigError, HydraException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = [r.__dict__ for r in records]
    print_table(
        rows,
        title=f"hetbench compare: {rows[0]['model']}-{rows[0]['preset']} on {rows[0]['cluster']} ({rows[0]['mode']})",
    )
    cfg = compose_settings(*(o for o in argv if not o.startswith("method=")))
    track_sweep(make_trackers(cfg), [asdict(r) for r in records], results_file(cfg))
    return 0 if all(r.status == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
