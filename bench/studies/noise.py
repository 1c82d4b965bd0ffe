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
        raise ConfigError(f"repeats={repeats} gives no spread; the noise floor needs repeats>=2, "
                          f"e.g. repeats={DEFAULT_REPEATS}")
    if cfg.mode != "real":
        raise ConfigError(f"mode={cfg.mode}: the simulator has no noise; use mode=real")
    agg = run_rounds({cfg.method_name: cfg}, repeats)[0]
    table = Table(title=f"noise floor: {cfg.model['name']}-{cfg.preset.name} on {cfg.cluster['name']}, "
                        f"{cfg.method_name}, {repeats} runs")
    for col in ("runs ok", "median iter ms", "interval", "CV run to run", "CV within runs",
                "interval width / median"):
        table.add_column(col, justify="right")
    if agg.status != "ok":
        table.add_row(f"0 of {repeats}", "-", "-", "-", "-", f"{agg.status}: {agg.error}")
        return table, False
    it = agg.aggregate["iter_time_s"]
    within = statistics.median(agg.aggregate["within_run_cv"])
    table.add_row(str(repeats), f"{it['median'] * 1e3:.2f}",
                  f"[{it['low'] * 1e3:.2f}, {it['high'] * 1e3:.2f}] ({it['coverage']:.0%})",
                  f"{it['cv']:.1%}", f"{within:.1%}",
                  f"{(it['high'] - it['low']) / it['median']:.1%}")
    return table, True
