"""Interleaved rounds: every method of a comparison once per round, then one aggregate row each.

Round r runs every method once, each in its own worker processes (A B C, A B C, ...), so a drift
of the machine hits every method alike. Each method's case is prepared and its workers set up
once, at its first round; its later rounds repeat only the warm-up and measured iterations on
those workers (bench.runner.execute.CaseRunner). The aggregate row holds the median of the repeats' mean
iteration times with its order-statistic interval (bench.records.stats), the MLPerf-style trimmed
mean, and the speedup over dp_ev computed round by round, with its own interval.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import uuid

from bench.records.progress import progress_bar
from bench.records.rows import RunRecord, case_key, finished_record
from bench.records.stats import ranks, summarize
from bench.records.table import BASELINE
from bench.records.tracking import track_rounds
from bench.runner.configs import results_file
from bench.runner.execute import CaseRunner, fill_rates, make_trackers, write_record
from bench.runner.settings import Settings
from bench.runtime.emulation import emulated_compute_s, links_ok


def run_rounds(configs: dict[str, Settings], repeats: int) -> list[RunRecord]:
    """`repeats` interleaved rounds over the methods, then one aggregate row per method."""
    sweep_id = uuid.uuid4().hex[:12]
    done = {}
    for m, cfg in configs.items():  # resume=true: a method whose aggregate is recorded is done
        key = case_key(cfg.config)
        row = finished_record(results_file(cfg), key) if cfg.resume else None
        if row is not None:
            print(f"skip: {m} already recorded ({row.status}, run {row.run_id})")
            done[m] = row
    todo = [m for m in configs if m not in done]
    runs: dict[str, list[RunRecord]] = {m: [] for m in todo}
    runners = {m: CaseRunner(configs[m], sweep_id) for m in todo}
    with contextlib.ExitStack() as stack, progress_bar() as bar:  # a terminal sees progress with an ETA
        for runner in runners.values():
            stack.enter_context(runner)
        task = bar.add_task("interleaved rounds", total=repeats * len(todo))
        for r in range(repeats):
            for m in todo:
                bar.update(task, description=f"round {r + 1}/{repeats}: {m}")
                runs[m].append(runners[m].run(repeat=r, track=False))
                bar.advance(task)
    aggregates = aggregate_rounds(runs, sweep_id)
    for m in todo:  # the loggers get each case once: its rounds and their aggregate
        write_record(configs[m], aggregates[m], track=False)
        track_rounds(make_trackers(configs[m]), aggregates[m], runs[m], results_file(configs[m]))
    return [done.get(m) or aggregates[m] for m in configs]


def aggregate_rounds(runs: dict[str, list[RunRecord]], sweep_id: str | None = None) -> dict[str, RunRecord]:
    """One aggregate row per method from its repeat rows (round r of every method ran together)."""
    times = {m: [r.iter_time_s_mean if r.status == "ok" else None for r in rows] for m, rows in runs.items()}
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
            agg.error = (
                f"{len(rows) - len(ok)} of {len(rows)} repeats ended "
                f"{'/'.join(statuses)}: {next(r.error for r in rows if r.status != 'ok')}"
            )
            agg.aggregate = None
            agg.__post_init__()
            out[m] = agg
            continue
        summary = summaries[m] = summarize(times[m])
        agg.iter_time_s_mean, agg.iter_time_s_std = summary.median, None
        planned = [r.planner_time_s for r in ok if r.planner_time_s is not None]
        if planned:  # the median round's, not the last round's: one round's plan-cache load can be slow
            agg.planner_time_s = statistics.median(planned)
        # The prediction each run priced at its own ranks' host speed (bench.runner.case.predict_at_run_speed):
        # the median over the repeats, like the measurement it is compared with.
        for field in ("predicted_iter_time_s", "predicted_compute_s", "planned_iter_time_s"):
            values = [getattr(r, field) for r in ok if getattr(r, field) is not None]
            if len(values) == len(ok):
                setattr(agg, field, statistics.median(values))
        last = ok[-1]
        fill_rates(agg, summary.median, agg.global_batch, last.tokens_per_s and last.tokens_per_s / last.samples_per_s)
        agg.aggregate = {
            "iter_time_s": summary.as_dict(),
            "repeat_run_ids": [r.run_id for r in rows],
            "within_run_cv": [r.iter_time_s_std / r.iter_time_s_mean for r in rows],
            "interval": "order-statistic interval of the median (bench/records/stats.py)",
        }
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
            agg.emulation = {
                **last.emulation,
                "ranks": None,
                "max_error": worst,
                "ok": all(f["ok"] for f in flags),
                "compute_s": statistics.median(computes) if all(computes) else None,
                "link_overrun_s": overrun,
                "links_ok": overrun is None or links_ok(overrun, summary.median),
            }
        out[m] = agg
    for m, rank in ranks(summaries).items():
        out[m].aggregate["rank"] = rank
    return out
