"""Running one case to its row: launch the workers, fill the metrics, write and mirror the row.

A failed case is a row too (failed, oom, timeout), never an exception for the caller.
"""

from __future__ import annotations

import copy
import importlib
import logging
import sys
import time
import traceback
from collections.abc import Iterable
from pathlib import Path

from hydra.utils import instantiate

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError, PlanningError
from bench.core.interfaces import Workload
from bench.records.progress import progress_bar
from bench.records.rows import (
    RunRecord,
    append_record,
    finished_record,
    summarize_times,
)
from bench.records.tracking import Tracker, track_case
from bench.runner.case import new_record, predict_at_run_speed, prepare_case
from bench.runner.configs import results_file
from bench.runner.settings import Settings, as_settings, recorded_config
from bench.runtime.emulation import DILATION_TOLERANCE, achieved_speeds, links_ok
from bench.runtime.launch import (
    CaseTimeout,
    CaseWorkers,
    WorkerError,
    WorkerOutOfMemory,
    expect_modules,
    forks_workers,
    method_modules,
    start_server,
)
from bench.runtime.worker import (
    Case,
)

log = logging.getLogger(__name__)


def make_trackers(cfg: Settings) -> list[Tracker]:
    """The loggers chosen by `logger=...` (conf/logger/), instantiated. `logger=none` (an option
    with no _target_) adds none; one that cannot start is a warning, never a failed case. (A
    sweep's config, which Hydra hands over as composed, needs no other option to be valid.)"""
    trackers = []
    for name, node in (recorded_config(cfg).get("logger") or {}).items():
        if not node or "_target_" not in node:
            continue
        try:
            trackers.append(instantiate(node))
        except Exception as exc:
            cause = exc.__cause__ or exc
            log.warning("logger=%s not started (%s: %s); the JSONL row is kept", name, type(cause).__name__, cause)
    return trackers


def write_record(cfg: Settings, record: RunRecord, track: bool = True) -> None:
    """Append the row, then mirror it to the loggers: a logger's failure never costs the row.
    A config refused before anything ran (track=False) is its one error line and its row."""
    record.__post_init__()  # a failed case keeps no metrics
    append_record(results_file(cfg), record)
    if record.output_dir:  # the job's own copy: `report <sweep dir>` reads these
        append_record(Path(record.output_dir) / "records.jsonl", record)
    if track:
        track_case(make_trackers(cfg), record, results_file(cfg))


def expect_cases(configs: Iterable[Settings]) -> None:
    """Before a series of cases in this process (a comparison's methods, the regression check's
    rounds, a calibration): the server their CPU workers fork from, started by the first case,
    preloads what every case's method imports in its workers (bench.runtime.launch.expect_modules), not
    the first's alone. (A model's module is small: each worker imports its own.)"""
    expect_methods(cfg.method_target for cfg in configs)


def start_server_early(cfg: Settings, targets: Iterable[str | None]) -> None:
    """Before a series of measured cases is composed (a comparison): the server their CPU
    workers fork from starts now, preloading the methods of `targets` (their `_target_` paths),
    so that its imports overlap the compositions. Nothing where the cases do not fork workers or
    the cluster cannot be read (the first case then says why)."""
    try:
        cluster = ClusterSpec.from_config(cfg.cluster, cfg.config_roots())
    except Exception:
        return
    if cfg.mode == "real" and forks_workers(cluster):
        expect_methods(t for t in targets if t)
        start_server()


def expect_methods(targets) -> None:
    """expect_cases for the methods' `_target_` paths."""
    for path in targets:
        module, _, name = path.rpartition(".")
        try:
            target = getattr(importlib.import_module(module), name)
        except Exception:  # a method that cannot load: its case says so, in one line
            continue
        expect_modules(*method_modules(target))


def run_config(config) -> RunRecord:
    """A composed config (the edge where a DictConfig becomes Settings) run to its row: a value
    Settings refuses fails the case with its row and one line; the rest is run_case's."""
    try:
        settings = as_settings(config)
    except ConfigError as exc:
        return record_refused(config, exc)
    return run_case(settings)


def record_refused(config, exc: ConfigError) -> RunRecord:
    """The failed row of a config refused before anything ran, and its one line (the config
    as composed: what could not be read into Settings is recorded as given)."""
    record = new_record(config)
    record.error = str(exc)
    print(f"error: {exc}", file=sys.stderr)
    write_record(config, record, track=False)
    return record


def run_case(cfg: Settings, repeat: int | None = None, sweep_id: str | None = None) -> RunRecord:
    """Run one case and append its row (ok or not). Never raises for a failed case.

    `repeat` marks the row as one round of a repeated comparison (bench.compare aggregates); a
    comparison's rounds run through CaseRunner, which keeps the case's preparation and workers
    from one round to the next.
    """
    with CaseRunner(cfg, sweep_id) as runner:
        return runner.run(repeat)


class CaseRunner:
    """One case, run once or round after round: validated and planned once (prepare_case), its
    workers started once and kept (bench.runtime.launch.CaseWorkers), one row per run.

    A later round of a case repeats only its warm-up and measured iterations on the workers the
    first round set up; a round that fails ends them, and the next starts fresh ones. Each case
    has a runner and workers of its own: no state passes from one case (method) to another.
    """

    def __init__(self, cfg: Settings, sweep_id: str | None = None):
        self.cfg, self.sweep_id = cfg, sweep_id
        self._template: RunRecord | None = None  # the prepared row, copied for each run
        self._case: Case | None = None
        self._refused: BaseException | None = None  # preparation failed: every run records why
        self._workers: CaseWorkers | None = None

    def __enter__(self) -> CaseRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def run(self, repeat: int | None = None, track: bool = True) -> RunRecord:
        """One run of the case, as a row: written, mirrored to the loggers (unless `track` is
        false: a comparison mirrors its rounds together), returned; never raises for a failed case."""
        cfg = self.cfg
        record = self._row()
        if repeat is not None:
            record.row_kind, record.repeat, record.repeats = "repeat", repeat, cfg.repeats
        done = finished_record(results_file(cfg), record.case_key) if cfg.resume and repeat is None else None
        if done is not None:
            print(
                f"skip: {record.model}/{record.cluster}/{record.method} already recorded ({done.status}, run {done.run_id})"
            )
            return done
        refused = False
        try:
            case = self._prepared(cfg, record)
            if cfg.mode == "sim":
                fill_predicted_metrics(record, case.workload)
            else:
                self._measure(cfg, record, case)
        except ConfigError as exc:
            record.error, refused = str(exc), True
            print(f"error: {exc}", file=sys.stderr)
        except PlanningError as exc:
            record.status, record.error = exc.status, str(exc)
            print(f"error: {exc} (case recorded as {exc.status})", file=sys.stderr)
        except WorkerOutOfMemory as exc:
            record.status, record.error = "oom", str(exc)
            record.oom_rank = exc.rank
            record.peak_mem_gib = [
                exc.peak_mem_gib if r == exc.rank else None for r in range(record.num_devices or exc.rank + 1)
            ]
            print(
                f"{exc.detail}error: rank {exc.rank} ran out of memory (peak {exc.peak_mem_gib:.2f} "
                "GiB); case recorded as oom",
                file=sys.stderr,
            )
        except WorkerError as exc:
            record.error = str(exc)
            print(f"{exc.detail}\nerror: rank {exc.rank} failed; case recorded as failed", file=sys.stderr)
        except CaseTimeout as exc:
            record.status, record.error = "timeout", str(exc)
            print(f"error: {exc}", file=sys.stderr)
        except Exception:  # a bug in planning or setup: the case fails, the sweep goes on
            record.error = traceback.format_exc()
            print(f"{record.error}error: case failed before training; recorded as failed", file=sys.stderr)
        write_record(cfg, record, track=track and not refused)
        return record

    def _row(self) -> RunRecord:
        """A new row for the next run: the prepared row's copy (its own run id and time), or,
        before preparation, the case's row as composed."""
        if self._template is None:
            record = new_record(self.cfg)
            record.sweep_id = self.sweep_id or record.sweep_id
            return record
        record = copy.deepcopy(self._template)
        fresh = RunRecord(model="", preset="", cluster="", method="", mode="", status="failed", origin="")
        record.run_id, record.timestamp = fresh.run_id, fresh.timestamp
        return record

    def _prepared(self, cfg: Settings, record: RunRecord) -> Case:
        """The case, prepared at the first run (filling `record`); a later run's row is a copy
        of the first's as prepared, and one that could not be prepared fails every run alike."""
        if self._refused is not None:
            raise self._refused
        if self._case is None:
            start = time.perf_counter()
            try:
                self._case = prepare_case(cfg, record, launching=cfg.mode == "real")
            except BaseException as exc:
                self._refused = exc
                raise
            self._template = copy.deepcopy(record)
            record.timings = {"prepare_s": time.perf_counter() - start}
        return self._case

    def _measure(self, cfg: Settings, record: RunRecord, case: Case) -> None:
        """Train the prepared case for one round on its workers and fill the row's measured metrics
        (a worker's failure raises; run records it)."""
        if self._workers is None:
            self._workers = CaseWorkers(case, case.cluster.num_devices)
        start = time.perf_counter()
        results = launch_with_progress(case, cfg, self._workers)
        fill_metrics(record, results, case.workload, cfg.measured_iters)
        predict_at_run_speed(record, case)
        ranks = [r.get("timings") or {} for r in results]
        record.timings = {
            **(record.timings or {}),
            "workers_s": time.perf_counter() - start,
            **{k: max(t.get(k, 0.0) for t in ranks) for k in ("setup_s", "untimed_s", "iterations_s")},
        }
        record.worker_pids = [r.get("pid") for r in results]


def measure_case(cfg: Settings, record: RunRecord, case: Case) -> None:
    """Train a prepared case (bench.runner.case.prepare_case) on fresh workers for one round and
    fill its row's measured metrics; a worker's failure raises."""
    with CaseWorkers(case, case.cluster.num_devices) as workers:
        results = launch_with_progress(case, cfg, workers)
    fill_metrics(record, results, case.workload, cfg.measured_iters)
    predict_at_run_speed(record, case)


def launch_with_progress(case: Case, cfg: Settings, workers: CaseWorkers) -> list[dict]:
    total = case.warmup_iters + case.measured_iters
    with progress_bar(transient=True) as progress:
        task = progress.add_task(f"{cfg.method_name} on {case.cluster.name}", total=total)
        return workers.run_round(cfg.timeout_s, on_progress=lambda it: progress.update(task, completed=it))


def fill_rates(record: RunRecord, iter_time_s: float, global_batch: int, tokens_per_sample: float | None) -> None:
    """Throughput and efficiency from an iteration time (measured, predicted or aggregated)."""
    record.samples_per_s = global_batch / iter_time_s
    record.tokens_per_s = None if tokens_per_sample is None else global_batch * tokens_per_sample / iter_time_s
    record.efficiency = record.ideal_iter_time_s / iter_time_s


def fill_metrics(record: RunRecord, results: list[dict], workload: Workload, measured: int) -> None:
    """Metrics as docs/records.md ("Metrics") defines them, from every rank's per-iteration times."""
    per_iter, mean, std = summarize_times([r["iter_times_s"] for r in results], measured)
    record.iter_times_s = per_iter
    record.iter_time_s_mean, record.iter_time_s_std = mean, std
    fill_rates(record, mean, workload.global_batch, workload.model_cfg.tokens_per_sample)
    record.peak_mem_gib = [r["peak_mem_gib"] for r in results]
    if any(r.get("tensor_peak_gib") is not None for r in results):
        record.tensor_peak_gib = [r.get("tensor_peak_gib") for r in results]
    loss_sums = [sum(step) for step in zip(*(r["loss_sums"] for r in results))]
    record.loss_first = loss_sums[0] / workload.targets_per_iter
    record.loss_last = loss_sums[-1] / workload.targets_per_iter
    record.loss_per_iter = [s / workload.targets_per_iter for s in loss_sums[-measured:]]
    mems = [r.get("peak_mem_gib_per_iter") for r in results]
    if all(mems):
        record.peak_mem_gib_per_iter = [max(m) for m in zip(*mems)][-measured:]
    record.host = ", ".join(sorted({r["host"] for r in results}))
    record.rank_hardware = [r.get("hardware") for r in results]
    record.precision = results[0].get("precision")
    ranks = [r.get("emulation") for r in results]
    if record.emulation is not None and all(ranks) and not all(r.get("paced", True) for r in ranks):
        fill_gpu_emulation(record, ranks)
    elif record.emulation is not None and all(ranks):
        errors = [r["error"] for r in ranks if r["error"] is not None]
        worst = max(errors, key=abs, default=0.0)
        # How far the real collectives ran past their emulated link time, per iteration (the
        # rank that saw most): the declared links were not what ran when it is a visible share.
        overrun = max(r.get("link_overrun_s") or 0.0 for r in ranks) / measured
        record.emulation = {
            **record.emulation,
            "ranks": ranks,
            "max_error": worst,
            "ok": abs(worst) <= DILATION_TOLERANCE,
            "link_overrun_s": overrun,
            "links_ok": links_ok(overrun, mean),
        }
    record.status = "ok"


def fill_gpu_emulation(record: RunRecord, ranks: list[dict]) -> None:
    """Emulated ranks on one GPU: each rank's achieved speed (from its matmul probe) against its
    configured speed; `ok` when every rank is within DILATION_TOLERANCE."""
    speeds = [r["speed"] for r in ranks]
    achieved = achieved_speeds(speeds, [r["probe_flops_per_s"] for r in ranks])
    ranks = [{**r, "achieved_speed": a, "error": a / r["speed"] - 1.0} for r, a in zip(ranks, achieved)]
    worst = max((r["error"] for r in ranks), key=abs)
    record.emulation = {**record.emulation, "ranks": ranks, "max_error": worst, "ok": abs(worst) <= DILATION_TOLERANCE}


def fill_predicted_metrics(record: RunRecord, workload: Workload) -> None:
    """Sim mode: the same metrics, from the simulator's predicted iteration time."""
    if record.predicted_iter_time_s is None:
        raise ConfigError(f"method={record.method} returned no Program: it cannot be simulated")
    fill_rates(record, record.predicted_iter_time_s, workload.global_batch, workload.model_cfg.tokens_per_sample)
    record.peak_mem_gib = record.predicted_peak_mem_gib
    record.status = "oom" if record.predicted_oom else "ok"
    if record.predicted_oom:
        record.error = f"predicted out of memory: peak {max(record.peak_mem_gib):.1f} GiB per GPU exceeds device memory"
