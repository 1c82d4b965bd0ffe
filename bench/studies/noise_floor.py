"""The noise floor: one case repeated, and how much its measurements move.

The library behind `bench.noise` (usage there): the run-to-run coefficient of variation of the
repeats' mean iteration times, the median within-run CV, and the width of the median's
interval relative to it, the gap below which two methods cannot be ordered with that many
repeats (bench.compare shows them as a tie).
"""

from __future__ import annotations

import statistics

from rich.table import Table

from bench.core.errors import ConfigError
from bench.runner.configs import check_group_choices, compose_settings
from bench.runner.rounds import run_rounds

DEFAULT_REPEATS = 10


def noise_floor(overrides: list[str]) -> tuple[Table, bool]:
    check_group_choices(overrides)
    if not any(o.lstrip("+").startswith("repeats=") for o in overrides):
        overrides = [*overrides, f"repeats={DEFAULT_REPEATS}"]
    cfg = compose_settings(*overrides)
    repeats = cfg.repeats
    if repeats < 2:
        raise ConfigError(
            f"repeats={repeats} gives no spread; the noise floor needs repeats>=2, e.g. repeats={DEFAULT_REPEATS}"
        )
    if cfg.mode != "real":
        raise ConfigError(f"mode={cfg.mode}: the simulator has no noise; use mode=real")
    agg = run_rounds({cfg.method_name: cfg}, repeats)[0]
    table = Table(
        title=f"noise floor: {cfg.model['name']}-{cfg.preset.name} on {cfg.cluster['name']}, "
        f"{cfg.method_name}, {repeats} runs"
    )
    for col in ("runs ok", "median iter ms", "interval", "CV run to run", "CV within runs", "interval width / median"):
        table.add_column(col, justify="right")
    if agg.status != "ok":
        table.add_row(f"0 of {repeats}", "-", "-", "-", "-", f"{agg.status}: {agg.error}")
        return table, False
    it = agg.aggregate["iter_time_s"]
    within = statistics.median(agg.aggregate["within_run_cv"])
    table.add_row(
        str(repeats),
        f"{it['median'] * 1e3:.2f}",
        f"[{it['low'] * 1e3:.2f}, {it['high'] * 1e3:.2f}] ({it['coverage']:.0%})",
        f"{it['cv']:.1%}",
        f"{within:.1%}",
        f"{(it['high'] - it['low']) / it['median']:.1%}",
    )
    return table, True
