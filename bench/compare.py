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

import copy
import statistics
import sys
import uuid
from dataclasses import asdict

from hydra.errors import HydraException
from omegaconf import OmegaConf

from bench.core.errors import ConfigError
from bench.runtime.emulation import emulated_compute_s, links_ok
from bench.records.progress import progress_bar
from bench.records.rows import RunRecord, case_key, finished_record
from bench.run import (
    check_group_choices,
    check_repeats,
    compose_config,
    expect_cases,
    fill_rates,
    group_options,
    make_trackers,
    method_modes,
    print_help_if_asked,
    results_file,
    run_case,
    write_record,
)
from bench.records.stats import ranks, summarize
from bench.records.table import BASELINE, print_table
from bench.records.tracking import track_sweep

DEFAULT_REPEATS = 6  # measured comparisons; mode=sim is deterministic and runs once


def _methods(overrides: list[str], mode: str) -> list[str]:
    chosen = [o for o in overrides if o.startswith("method=")]
    if chosen:
        return chosen[-1].split("=", 1)[1].split(",")
    methods = []  # every implemented method that can run in this mode: conf/method is the registry
    for m in sorted(group_options("method"), key=lambda m: (m != BASELINE, m)):
        modes = method_modes(m)
        if mode in modes:
            methods.append(m)
        else:
            print(f"note: {m} skipped: it supports mode={','.join(modes)} only")
    return methods


def compare(overrides: list[str]) -> list[RunRecord]:
    """Run the comparison; returns one row per method (the aggregate where repeated)."""
    check_group_choices(overrides)
    rest = [o for o in overrides if not o.startswith("method=")]
    base = compose_config(*rest)
    repeats = check_repeats(base.repeats)
    if not any(o.lstrip("+").startswith("repeats=") for o in rest) and base.mode == "real":
        repeats = DEFAULT_REPEATS
    if base.mode == "sim":
        repeats = 1
    methods = _methods(overrides, base.mode)
    configs = {m: compose_config(*rest, f"method={m}", f"repeats={repeats}") for m in methods}
    expect_cases(configs.values())
    if repeats == 1:
        return [run_case(configs[m]) for m in methods]
    return run_rounds(configs, repeats)


def run_rounds(configs: dict, repeats: int) -> list[RunRecord]:
    """`repeats` interleaved rounds over the methods, then one aggregate row per method."""
    sweep_id = uuid.uuid4().hex[:12]
    done = {}
    for m, cfg in configs.items():  # resume=true: a method whose aggregate is recorded is done
        key = case_key(OmegaConf.to_container(cfg, resolve=True))
        row = finished_record(results_file(cfg), key) if cfg.resume else None
        if row is not None:
            print(f"skip: {m} already recorded ({row.status}, run {row.run_id})")
            done[m] = row
    todo = [m for m in configs if m not in done]
    runs: dict[str, list[RunRecord]] = {m: [] for m in todo}
    with progress_bar() as bar:  # a terminal sees progress with an ETA; CI logs stay quiet
        task = bar.add_task("interleaved rounds", total=repeats * len(todo))
        for r in range(repeats):
            for m in todo:
                bar.update(task, description=f"round {r + 1}/{repeats}: {m}")
                runs[m].append(run_case(configs[m], repeat=r, sweep_id=sweep_id))
                bar.advance(task)
    aggregates = aggregate_rounds(runs, sweep_id)
    for m in todo:
        write_record(configs[m], aggregates[m])
    return [done.get(m) or aggregates[m] for m in configs]


def aggregate_rounds(runs: dict[str, list[RunRecord]], sweep_id: str | None = None) -> dict[str, RunRecord]:
    """One aggregate row per method from its repeat rows (round r of every method ran together)."""
    times = {m: [r.iter_time_s_mean if r.status == "ok" else None for r in rows]
             for m, rows in runs.items()}
    out, summaries = {}, {}
    for m, rows in runs.items():
        ok = [r for r in rows if r.status == "ok"]
        agg = copy.deepcopy(ok[-1] if ok else rows[-1])
        agg.row_kind, agg.repeat, agg.repeats, agg.sweep_id = "aggregate", None, len(rows), sweep_id
        agg.run_id = uuid.uuid4().hex[:12]
        agg.iter_times_s = agg.loss_per_iter = agg.peak_mem_gib_per_iter = None
        if len(ok) < len(rows):  # a failed round fails the aggregate: no numbers from a subset
            statuses = sorted({r.status for r in rows if r.status != "ok"})
            agg.status = "oom" if statuses == ["oom"] else "failed"
            agg.error = (f"{len(rows) - len(ok)} of {len(rows)} repeats ended "
                         f"{'/'.join(statuses)}: {next(r.error for r in rows if r.status != 'ok')}")
            agg.aggregate = None
            agg.__post_init__()
            out[m] = agg
            continue
        summary = summaries[m] = summarize(times[m])
        agg.iter_time_s_mean, agg.iter_time_s_std = summary.median, None
        planned = [r.planner_time_s for r in ok if r.planner_time_s is not None]
        if planned:  # the median round's, not the last round's (a cache load once took 219 ms)
            agg.planner_time_s = statistics.median(planned)
        # The prediction each run priced at its own ranks' host speed (bench.run.predict_at_run_speed):
        # the median over the repeats, like the measurement it is compared with.
        for field in ("predicted_iter_time_s", "predicted_compute_s", "planned_iter_time_s"):
            values = [getattr(r, field) for r in ok if getattr(r, field) is not None]
            if len(values) == len(ok):
                setattr(agg, field, statistics.median(values))
        last = ok[-1]
        fill_rates(agg, summary.median, agg.global_batch,
                   last.tokens_per_s and last.tokens_per_s / last.samples_per_s)
        agg.aggregate = {"iter_time_s": summary.as_dict(),
                         "repeat_run_ids": [r.run_id for r in rows],
                         "within_run_cv": [r.iter_time_s_std / r.iter_time_s_mean for r in rows],
                         "interval": "order-statistic interval of the median (bench/stats.py)"}
        base = times.get(BASELINE)
        if base and all(t is not None for t in base):
            agg.aggregate["speedup_vs_dp_ev"] = summarize([b / t for b, t in zip(base, times[m])]).as_dict()
        flags = [r.emulation for r in rows if r.emulation and "ok" in r.emulation]
        if flags:
            worst = max((f["max_error"] for f in flags), key=abs)
            computes = [emulated_compute_s(r.emulation) for r in ok]
            # The links' overrun is the program's on this host, not a run's accident: the median
            # run's, flagged against the median iteration.
            overruns = [r.emulation.get("link_overrun_s") for r in ok]
            overrun = statistics.median(overruns) if overruns and None not in overruns else None
            agg.emulation = {**last.emulation, "ranks": None, "max_error": worst,
                             "ok": all(f["ok"] for f in flags),
                             "compute_s": statistics.median(computes) if all(computes) else None,
                             "link_overrun_s": overrun,
                             "links_ok": overrun is None or links_ok(overrun, summary.median)}
        out[m] = agg
    for m, rank in ranks(summaries).items():
        out[m].aggregate["rank"] = rank
    return out


def main(argv: list[str]) -> int:
    if print_help_if_asked(argv, __doc__):
        return 0
    try:
        records = compare(argv)
    except (ConfigError, HydraException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = [r.__dict__ for r in records]
    print_table(rows, title=f"hetbench compare: {rows[0]['model']}-{rows[0]['preset']} on "
                            f"{rows[0]['cluster']} ({rows[0]['mode']})")
    cfg = compose_config(*(o for o in argv if not o.startswith("method=")))
    track_sweep(make_trackers(cfg), [asdict(r) for r in records], results_file(cfg))
    return 0 if all(r.status == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
