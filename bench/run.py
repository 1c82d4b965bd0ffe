"""The runner: one case = (model, preset, cluster, method, mode) from a Hydra config -> one row.

    python -m bench.run model=bert preset=tiny cluster=local_hetero2 method=dp_cp
    python -m bench.run -m method=dp_ev,dp_cp cluster=local_hetero2,local_hetero4

Only this module and the tests see a DictConfig; everything below gets typed objects. It does
not know any concrete method or model: `_target_` in conf/ wires them.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.runtime.emulation import DILATION_TOLERANCE, EmulationSettings, achieved_speeds, links_ok
from bench.runtime.hostspeed import measure_host_speed, split_step
from bench.cost.flops import train_flops_per_sample
from bench.runtime.hostcpu import host_cores
from bench.runtime.hostlinks import host_floor
from bench.core.errors import PlanningError
from bench.core.interfaces import Workload
from bench.runtime.launch import (
    CaseTimeout,
    WorkerError,
    WorkerOutOfMemory,
    expect_modules,
    forks_workers,
    launch,
    method_modules,
    start_server,
    wait_for_server,
)
from bench.runtime.multinode import (
    RUN_ID_ENV,
    NodeTask,
    current_task,
    devices_per_node,
    run_torchrun,
    torchrun_command,
)
from bench.core.paths import CONF_DIR, CONF_PACKAGE, CONF_SOURCE, IN_CHECKOUT
from bench.records.progress import interactive, progress_bar
from bench.records.rows import (
    RunRecord,
    append_record,
    case_key,
    fingerprint,
    finished_record,
    load_records,
    summarize_times,
)
from bench.cost import simulate
from bench.records.table import print_table
from bench.records.tracking import WANDB_MODES, Tracker, track_case, track_sweep
from bench.runtime.worker import (
    CPU_ONLY_ENV,
    PRECISIONS,
    Case,
    backend_for,
    init_process_group,
    pick_device,
    run_rank,
)

log = logging.getLogger("bench.run")

MODES = ("real", "sim")
DATA_SOURCES = ("synthetic", "cifar10", "wikitext2")
_failed_cases: list[str] = []  # cases of this process that did not end "ok" (sets the exit code)
_recorded_here: set[str] = set()  # run_ids of the rows this process wrote (errors already shown)


GROUPS = ("model", "preset", "cluster", "method", "logger", "experiment", "ablation")


def group_options(group: str) -> list[str]:
    """The options of a config group: the yaml files in its conf/ folder (CONF_DIR: the
    checkout's conf/ or the installed package bench.conf)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def compose_config(*overrides: str) -> DictConfig:
    """The runner's config for these overrides, composed as the CLI would (for the commands
    that run cases without being Hydra apps themselves)."""
    with initialize_configs():
        return compose("config", overrides=list(overrides))


def initialize_configs():
    """Hydra's initialize context for the runner's configs, in a checkout or installed."""
    if IN_CHECKOUT:
        return initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")
    return initialize_config_module(config_module=CONF_PACKAGE, version_base="1.3")


def method_modes(name: str) -> tuple[str, ...]:
    """The modes the method of conf/method/<name>.yaml supports (it is instantiated to ask)."""
    return tuple(getattr(instantiate(compose_config(f"method={name}").method), "modes", ("real",)))


def methods_supporting(mode: str) -> list[str]:
    """The conf/method options whose method supports `mode`, in name order."""
    return [m for m in group_options("method") if mode in method_modes(m)]


def print_help_if_asked(argv: list[str], doc: str) -> bool:
    """-h/--help for the commands that take the runner's overrides (Hydra would try to parse
    it as an override and fail): the command's docstring and where the options are listed."""
    if not {"-h", "--help"} & set(argv):
        return False
    print(doc.strip())
    print("\nOverrides are the runner's (`python -m bench.run --help` lists every config group "
          "and key; the README's option table explains them).")
    return True


def check_group_choices(overrides: list[str]) -> None:
    """One clear line for an unknown model/preset/cluster/method/logger, before Hydra composes."""
    for item in overrides:
        key, sep, value = item.lstrip("+~").partition("=")
        if not sep or key not in GROUPS or value in ("", "null") or "(" in value:
            continue  # sweeper functions such as glob(...) are Hydra's to expand
        known = group_options(key)
        # A list (logger=[wandb,csv]) selects several options; a,b sweeps over them.
        names = [v.strip() for v in value.strip().removeprefix("[").removesuffix("]").split(",")]
        unknown = [v for v in names if v and v not in known]
        if unknown:
            raise ConfigError(f"{key}={','.join(unknown)} is unknown; known: {', '.join(known)}")


def results_file(cfg: DictConfig) -> Path:
    return Path(cfg.results_dir) / "records.jsonl"


def _instantiate(node, where: str, **kwargs):
    """hydra.utils.instantiate, with a plugin's ValueError surfaced as a one-line ConfigError."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, ValueError):
            raise ConfigError(str(cause)) from None
        raise ConfigError(f"{where}: {cause}") from exc


def _check_protocol(cfg: DictConfig) -> None:
    if cfg.mode not in MODES:
        raise ConfigError(f"mode={cfg.mode!r} is invalid; valid: {', '.join(MODES)}")
    for key, low in (("measured_iters", 1), ("warmup_iters", 0)):
        value = cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"{key}={value!r} must be an integer >= {low}; e.g. {key}={max(low, 10)}")
    check_repeats(cfg.repeats)
    emulation_settings(cfg, 1)  # validates the emulation node
    if cfg.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"wandb.mode={cfg.wandb.mode!r} is invalid; valid: {', '.join(WANDB_MODES)}")
    if cfg.data.source not in DATA_SOURCES:
        raise ConfigError(f"data.source={cfg.data.source!r} is invalid; valid: {', '.join(DATA_SOURCES)}")
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"precision={cfg.precision!r} is invalid; valid: {', '.join(PRECISIONS)} "
                          "(fp32 as in the paper; e.g. precision=bf16)")


def check_repeats(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"repeats={value!r} must be an integer >= 1; e.g. repeats=5")
    return value


def emulation_settings(cfg: DictConfig, num_ranks: int) -> EmulationSettings:
    """The `emulation` node, validated; headroom=auto resolved for `num_ranks` on this host."""
    node = cfg.emulation
    headroom, refs = node.headroom, node.reference_iters
    if headroom == "auto":
        headroom = EmulationSettings.auto_headroom(num_ranks)
    elif isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 < headroom <= 1:
        raise ConfigError(f"emulation.headroom={headroom!r} must be auto or a number in (0, 1]; "
                          "e.g. emulation.headroom=0.8")
    if not isinstance(refs, int) or isinstance(refs, bool) or refs < 0:
        raise ConfigError(f"emulation.reference_iters={refs!r} must be an integer >= 0 "
                          "(0: pace the compute just measured); e.g. emulation.reference_iters=12")
    pin = node.get("pin_cores", True)
    if not isinstance(pin, bool):
        raise ConfigError(f"emulation.pin_cores={pin!r} must be true or false; e.g. emulation.pin_cores=false")
    discount = node.get("pause_discount", True)
    if not isinstance(discount, bool):
        raise ConfigError(f"emulation.pause_discount={discount!r} must be true or false; "
                          "e.g. emulation.pause_discount=false")
    realtime = node.get("realtime_comm", False)
    if not isinstance(realtime, bool):
        raise ConfigError(f"emulation.realtime_comm={realtime!r} must be true or false; "
                          "e.g. emulation.realtime_comm=false")
    if realtime and num_ranks > host_cores():
        # Two ranks' real-time gloo threads on one core held it for a second (docs/emulation.md).
        raise ConfigError(f"emulation.realtime_comm=true needs a core per rank: {num_ranks} ranks on "
                          f"{host_cores()} cores; use emulation.realtime_comm=false")
    workers_first = node.get("gloo_workers_first", True)
    if not isinstance(workers_first, bool):
        raise ConfigError(f"emulation.gloo_workers_first={workers_first!r} must be true or false; "
                          "e.g. emulation.gloo_workers_first=false")
    return EmulationSettings(headroom=float(headroom), reference_iters=refs, pin_cores=pin,
                             pause_discount=discount, realtime_comm=realtime,
                             gloo_workers_first=workers_first)


def build_workload(cfg: DictConfig, cluster: ClusterSpec) -> Workload:
    return workload_from(cfg, *check_workload(cfg, cluster))


def check_workload(cfg: DictConfig, cluster: ClusterSpec) -> tuple[object, int, dict]:
    """The case's model spec, global batch and data, each checked (a ConfigError of one line)."""
    model_cfg = _instantiate(cfg.model.spec, "model.spec", num_devices=cluster.num_devices)
    n = cluster.num_devices
    batch = cfg.global_batch if cfg.global_batch is not None else cfg.preset.batch_per_device * n
    if not isinstance(batch, int) or batch < n:
        raise ConfigError(
            f"global_batch={batch!r} is smaller than the {n} devices of cluster={cluster.name}; "
            f"every device needs a sample: set global_batch>={n} (or preset.batch_per_device>=1)"
        )
    data = OmegaConf.to_container(cfg.data, resolve=True)
    try:  # open the data once here: a wrong source, path or file fails before workers start
        model_cfg.dataset(data["source"], data["path"], data["split"], cfg.seed)
    except ValueError as exc:
        raise ConfigError(str(exc).replace("\n", " ")) from None
    return model_cfg, batch, data


def workload_from(cfg: DictConfig, model_cfg, batch: int, data: dict) -> Workload:
    """The workload of checked parts (check_workload); counts its FLOPs (seconds for a big model)."""
    return Workload(
        name=cfg.model.name, preset=cfg.preset.name, model_cfg=model_cfg, global_batch=batch,
        flops_per_sample=train_flops_per_sample(model_cfg), data=data,
    )


def _check_hardware(cluster: ClusterSpec, world_size: int | None) -> None:
    import torch

    if cluster.emulated and cluster.device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"cluster.device=cuda (cluster={cluster.name}) needs a CUDA GPU, but torch "
                f"{torch.__version__} sees none (CUDA build: {torch.version.cuda or 'no'}); use "
                "an emulated cluster with device: cpu (e.g. cluster=local_hetero2) or run on a GPU host"
            )
        from bench.runtime.mps import control_binary

        control_binary()  # one line when MPS is not installed
        return
    if world_size is not None:  # torchrun: one process per device, possibly across hosts
        if world_size != cluster.num_devices:
            raise ConfigError(
                f"cluster={cluster.name} has {cluster.num_devices} devices but torchrun started "
                f"{world_size} processes; set --nnodes x --nproc-per-node to {cluster.num_devices}"
            )
        return
    if cluster.emulated or torch.cuda.device_count() >= cluster.num_devices:
        return
    raise ConfigError(
        f"cluster={cluster.name} has {cluster.num_devices} GPUs but this host has "
        f"{torch.cuda.device_count()}; use an emulated cluster (local_*), run under torchrun "
        "on the real cluster, or mode=sim"
    )


def new_record(cfg: DictConfig) -> RunRecord:
    config = OmegaConf.to_container(cfg, resolve=True)
    sweep_id, output_dir = hydra_job()
    return RunRecord(
        model=cfg.model.name, preset=cfg.preset.name, cluster=cfg.cluster.name,
        method=cfg.method.name, mode=cfg.mode, status="failed",
        origin="measured" if cfg.mode == "real" else "simulated",
        warmup_iters=cfg.warmup_iters, measured_iters=cfg.measured_iters,
        case_key=case_key(config), config=config, sweep_id=sweep_id, output_dir=output_dir,
        **fingerprint(),
    )


def hydra_job() -> tuple[str | None, str | None]:
    """(sweep id, output directory) of the Hydra job this process runs, if any: a --multirun
    sweep is identified by its sweep directory; a single run has no sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None, None
    hc = HydraConfig.get()
    # A config composed for a tool (compose_config) has a Hydra node but no job: no output dir.
    output_dir = OmegaConf.select(hc, "runtime.output_dir", default=None, throw_on_missing=False)
    if output_dir is None:
        return None, None
    return (hc.sweep.dir if hc.mode == RunMode.MULTIRUN else None), output_dir


def prepare_case(cfg: DictConfig, record: RunRecord, world_size: int | None = None,
                 launching: bool = False) -> Case:
    """Validate, measure the host, plan: everything before workers start. Fills `record`.

    `launching`: this process launches the case's workers next (bench.runtime.launch.launch); when they
    fork from a server on the CPU, it starts here, as soon as the case is valid, so that its
    seconds of imports overlap the FLOP count (start_server)."""
    _check_protocol(cfg)
    cluster = ClusterSpec.from_config(record.config["cluster"])
    record.cluster_hash = cluster.fingerprint()
    record.num_devices = cluster.num_devices
    method = _instantiate(cfg.method, "method")
    if cfg.mode not in getattr(method, "modes", ("real",)):
        raise ConfigError(f"method={cfg.method.name} does not support mode={cfg.mode} yet; it "
                          f"supports {', '.join(method.modes)}")
    model_cfg, record.global_batch, data = check_workload(cfg, cluster)
    if cfg.mode == "real":
        _check_hardware(cluster, world_size)
    # Validated for this cluster before any worker starts (realtime_comm needs a core per rank).
    emulation = emulation_settings(cfg, cluster.num_devices) if cluster.emulated else None
    forked = launching and forks_workers(cluster)
    if forked:
        start_server(method, model_cfg)
    workload = workload_from(cfg, model_cfg, record.global_batch, data)
    record.flops_per_iter = workload.flops_per_iter
    if forked:
        wait_for_server()  # the host's speed and the planner's time are measured on a quiet host
    if cluster.emulated and cluster.device == "cpu":
        per_device = -(-workload.global_batch // cluster.num_devices)
        speed = measure_host_speed(workload, per_device, cfg.seed)
        record.host_flops_per_s, record.host_step_overhead_s = speed.flops_per_s, speed.step_overhead_s
        record.host_optimizer_s_per_byte = speed.optimizer_s_per_byte
        cluster = cluster.with_host_speed(*speed)
        if cluster.num_devices > 1:  # what the host's own transport adds to the emulated links
            record.host_link_floor_s = host_floor(cluster.num_devices, mp.get_context("forkserver") if forked else None,
                                                  emulation.realtime_comm, emulation.gloo_workers_first)
            cluster = cluster.with_link_floor(record.host_link_floor_s)
    record.ideal_iter_time_s = workload.flops_per_iter / cluster.total_effective_flops()
    record.hardware = _hardware(cluster) if cfg.mode == "real" else (
        f"simulated {cluster.describe()}, planned on {platform.node()}")
    start = time.perf_counter()
    plan = method.plan(workload, cluster)
    record.planner_time_s = time.perf_counter() - start
    record.plan = plan.details
    record.plan_hash = plan_hash(plan)
    record.batch_shares = plan.batch_shares
    if plan.program is not None:
        sim = simulate(plan.program, cluster, plan.ratios)
        record.predicted_iter_time_s = sim.iter_time_s
        record.predicted_compute_s = _compute_s(sim)
        record.predicted_peak_mem_gib = sim.peak_mem_gib
        record.predicted_oom = sim.oom
    if emulation is not None and cluster.device == "cuda":
        # Real kernels at MPS shares: no slow motion, no pacing reference (bench.runtime.emulation).
        emulation = EmulationSettings(headroom=1.0, reference_iters=0, pin_cores=False)
    record.emulation = None if emulation is None else {
        "device": cluster.device, "headroom": emulation.headroom,
        "reference_iters": emulation.reference_iters, "pin_cores": emulation.pin_cores,
        "pause_discount": emulation.pause_discount, "realtime_comm": emulation.realtime_comm,
        "gloo_workers_first": emulation.gloo_workers_first}
    return Case(workload, cluster, method, plan, cfg.seed, cfg.warmup_iters, cfg.measured_iters,
                fail_rank=cfg.test.fail_rank, emulation=emulation, slowdown=cfg.test.slowdown,
                precision=cfg.precision, oom_rank=cfg.test.oom_rank)


def _compute_s(sim) -> float:
    """The compute part of a prediction: per stage the slowest device's, summed, plus the
    per-step part of a device's compute (optimizer, dispatch, the method's host work), which
    is charged once at the end."""
    return sim.compute_time_s + sim.per_step_s


def predict_at_run_speed(record: RunRecord, case: Case) -> None:
    """An emulated CPU run's prediction priced at the host speed its own ranks measured just
    before their reference iterations (bench.runtime.hostspeed.yardstick: plain steps of the model, not the
    method's program; the median over ranks). `planned_iter_time_s` keeps the price at the
    parent's probe, which the planner planned with."""
    ranks = (record.emulation or {}).get("ranks") or []
    sticks = [r.get("yardstick") for r in ranks]
    if case.plan.program is None or not sticks or not all(sticks):
        return
    models = [split_step(case.workload, s["batch"], s["seconds"]) for s in sticks]
    record.run_host_flops_per_s = statistics.median(m[0] for m in models)
    record.run_host_step_overhead_s = statistics.median(m[1] for m in models)
    cluster = case.cluster.at_run_speed(record.run_host_flops_per_s, record.run_host_step_overhead_s)
    sim = simulate(case.plan.program, cluster, case.plan.ratios)
    record.planned_iter_time_s = record.predicted_iter_time_s
    record.predicted_iter_time_s = sim.iter_time_s
    record.predicted_compute_s = _compute_s(sim)


def plan_hash(plan) -> str:
    """Identity of a plan's decisions (shares, ratios, synthesized steps), not of its
    bookkeeping: timings and predictions from a measured host speed vary between runs."""
    ratios = [[round(r, 6) for r in row] for row in plan.ratios or []]
    body = [plan.method, plan.batch_shares, ratios, plan.details.get("steps")]
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def make_trackers(cfg: DictConfig) -> list[Tracker]:
    """The loggers chosen by `logger=...` (conf/logger/), instantiated. `logger=none` (an option
    with no _target_) adds none; one that cannot start is a warning, never a failed case."""
    trackers = []
    for name, node in (cfg.get("logger") or {}).items():
        if not node or "_target_" not in node:
            continue
        try:
            trackers.append(instantiate(node))
        except Exception as exc:
            cause = exc.__cause__ or exc
            log.warning("logger=%s not started (%s: %s); the JSONL row is kept",
                        name, type(cause).__name__, cause)
    return trackers


def write_record(cfg: DictConfig, record: RunRecord, track: bool = True) -> None:
    """Append the row, then mirror it to the loggers: a logger's failure never costs the row.
    A config refused before anything ran (track=False) is its one error line and its row."""
    record.__post_init__()  # a failed case keeps no metrics
    append_record(results_file(cfg), record)
    if record.output_dir:  # the job's own copy: `report <sweep dir>` reads these
        append_record(Path(record.output_dir) / "records.jsonl", record)
    _recorded_here.add(record.run_id)
    if track:
        track_case(make_trackers(cfg), record, results_file(cfg))
    if record.status != "ok":
        _failed_cases.append(f"{record.model}/{record.cluster}/{record.method}")


def expect_cases(configs) -> None:
    """Before a series of cases in this process (a comparison's methods, the regression check's
    rounds, a calibration): the server their CPU workers fork from, started by the first case,
    preloads what every case's method imports in its workers (bench.runtime.launch.expect_modules), not
    the first's alone. (A model's module is small: each worker imports its own.)"""
    expect_methods(str(cfg.method.get("_target_", "")) for cfg in configs)


def expect_methods(targets) -> None:
    """expect_cases for the methods' `_target_` paths."""
    for path in targets:
        module, _, name = path.rpartition(".")
        try:
            target = getattr(importlib.import_module(module), name)
        except Exception:  # a method that cannot load: its case says so, in one line
            continue
        expect_modules(*method_modules(target))


def run_case(cfg: DictConfig, repeat: int | None = None, sweep_id: str | None = None) -> RunRecord:
    """Run one case and append its row (ok or not). Never raises for a failed case.

    `repeat` marks the row as one round of a repeated comparison (bench.compare aggregates).
    """
    record = new_record(cfg)
    record.sweep_id = sweep_id or record.sweep_id
    if repeat is not None:
        record.row_kind, record.repeat, record.repeats = "repeat", repeat, cfg.repeats
    path = results_file(cfg)
    done = finished_record(path, record.case_key) if cfg.resume and repeat is None else None
    if done is not None:
        print(f"skip: {record.model}/{record.cluster}/{record.method} already recorded "
              f"({done.status}, run {done.run_id})")
        return done
    refused = False
    try:
        case = prepare_case(cfg, record, launching=cfg.mode == "real")
        if cfg.mode == "sim":
            fill_predicted_metrics(record, case.workload)
        else:
            results = _launch_with_progress(case, cfg)
            fill_metrics(record, results, case.workload, cfg.measured_iters)
            predict_at_run_speed(record, case)
    except ConfigError as exc:
        record.error, refused = str(exc), True
        print(f"error: {exc}", file=sys.stderr)
    except PlanningError as exc:
        record.status, record.error = exc.status, str(exc)
        print(f"error: {exc} (case recorded as {exc.status})", file=sys.stderr)
    except WorkerOutOfMemory as exc:
        record.status, record.error = "oom", str(exc)
        record.oom_rank = exc.rank
        record.peak_mem_gib = [exc.peak_mem_gib if r == exc.rank else None
                               for r in range(record.num_devices or exc.rank + 1)]
        print(f"{exc.detail}error: rank {exc.rank} ran out of memory (peak {exc.peak_mem_gib:.2f} "
              "GiB); case recorded as oom", file=sys.stderr)
    except WorkerError as exc:
        record.error = str(exc)
        print(f"{exc.detail}\nerror: rank {exc.rank} failed; case recorded as failed", file=sys.stderr)
    except CaseTimeout as exc:
        record.status, record.error = "timeout", str(exc)
        print(f"error: {exc}", file=sys.stderr)
    except Exception:  # a bug in planning or setup: the case fails, the sweep goes on
        record.error = traceback.format_exc()
        print(f"{record.error}error: case failed before training; recorded as failed", file=sys.stderr)
    write_record(cfg, record, track=not refused)
    return record


def _hardware(cluster: ClusterSpec) -> str:
    import torch

    if cluster.emulated and cluster.device == "cuda":
        return (f"{torch.cuda.get_device_name(0)} shared by {cluster.num_devices} MPS workers "
                f"(emulated {cluster.describe()})")
    if cluster.emulated:
        return f"cpu x{cluster.num_devices} workers (emulated {cluster.describe()})"
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()} per host"
    return "cpu"


def _launch_with_progress(case: Case, cfg: DictConfig) -> list[dict]:
    total = case.warmup_iters + case.measured_iters
    with progress_bar(transient=True) as progress:
        task = progress.add_task(f"{cfg.method.name} on {case.cluster.name}", total=total)
        return launch(case, case.cluster.num_devices, cfg.timeout_s,
                      on_progress=lambda it: progress.update(task, completed=it))


def fill_rates(record: RunRecord, iter_time_s: float, global_batch: int,
               tokens_per_sample: float | None) -> None:
    """Throughput and efficiency from an iteration time (measured, predicted or aggregated)."""
    record.samples_per_s = global_batch / iter_time_s
    record.tokens_per_s = (None if tokens_per_sample is None
                           else global_batch * tokens_per_sample / iter_time_s)
    record.efficiency = record.ideal_iter_time_s / iter_time_s


def fill_metrics(record: RunRecord, results: list[dict], workload: Workload, measured: int) -> None:
    """Metrics exactly as DESIGN.md defines them, from every rank's per-iteration times."""
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
        _fill_gpu_emulation(record, ranks)
    elif record.emulation is not None and all(ranks):
        errors = [r["error"] for r in ranks if r["error"] is not None]
        worst = max(errors, key=abs, default=0.0)
        # How far the real collectives ran past their emulated link time, per iteration (the
        # rank that saw most): the declared links were not what ran when it is a visible share.
        overrun = max(r.get("link_overrun_s") or 0.0 for r in ranks) / measured
        record.emulation = {**record.emulation, "ranks": ranks, "max_error": worst,
                            "ok": abs(worst) <= DILATION_TOLERANCE, "link_overrun_s": overrun,
                            "links_ok": links_ok(overrun, mean)}
    record.status = "ok"


def _fill_gpu_emulation(record: RunRecord, ranks: list[dict]) -> None:
    """Emulated ranks on one GPU: each rank's achieved speed (from its matmul probe) against its
    configured speed; `ok` when every rank is within DILATION_TOLERANCE."""
    speeds = [r["speed"] for r in ranks]
    achieved = achieved_speeds(speeds, [r["probe_flops_per_s"] for r in ranks])
    ranks = [{**r, "achieved_speed": a, "error": a / r["speed"] - 1.0} for r, a in zip(ranks, achieved)]
    worst = max((r["error"] for r in ranks), key=abs)
    record.emulation = {**record.emulation, "ranks": ranks, "max_error": worst,
                        "ok": abs(worst) <= DILATION_TOLERANCE}


def fill_predicted_metrics(record: RunRecord, workload: Workload) -> None:
    """Sim mode: the same metrics, from the simulator's predicted iteration time."""
    if record.predicted_iter_time_s is None:
        raise ConfigError(f"method={record.method} returned no Program: it cannot be simulated")
    fill_rates(record, record.predicted_iter_time_s, workload.global_batch,
               workload.model_cfg.tokens_per_sample)
    record.peak_mem_gib = record.predicted_peak_mem_gib
    record.status = "oom" if record.predicted_oom else "ok"
    if record.predicted_oom:
        record.error = (f"predicted out of memory: peak {max(record.peak_mem_gib):.1f} GiB per GPU "
                        "exceeds device memory")


def _run_under_torchrun(cfg: DictConfig) -> None:
    """torchrun started this process: rank 0 prepares the case once and broadcasts it; every
    rank trains; rank 0 writes the row. torchrun itself stops all ranks if one fails."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    try:  # where the ranks compute: a cluster on cpu runs on gloo and hides the GPUs
        cluster = ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))
    except ConfigError:
        cluster = None  # rank 0's prepare_case reports it below, on a process group of GPUs
    if cluster is not None and cluster.device == "cpu":
        # Before anything asks CUDA for its devices (the row's fingerprint does): from then on
        # the process keeps the devices it saw.
        os.environ.update(CPU_ONLY_ENV)
    device = pick_device(local_rank, cluster)
    init_process_group(rank, world, device, None if cluster is None else backend_for(cluster, device))
    record = new_record(cfg)
    record.run_id = os.environ.get(RUN_ID_ENV) or record.run_id  # a multi-node job's, if any
    box: list = [None, None]
    if rank == 0:
        try:
            box[0] = prepare_case(cfg, record, world_size=world)
        except ConfigError as exc:
            box[1] = str(exc)
    dist.broadcast_object_list(box, src=0)
    case, error = box
    if error is not None:
        if rank == 0:
            record.error = error
            print(f"error: {error}", file=sys.stderr)
            write_record(cfg, record)
        dist.destroy_process_group()
        _failed_cases.append(record.method)
        return
    results = run_rank(case, rank, world, local_rank, gather=True)
    if rank == 0:
        fill_metrics(record, results, case.workload, cfg.measured_iters)
        write_record(cfg, record)
        print_table([record.__dict__])


def _run_across_nodes(cfg: DictConfig, task: NodeTask) -> None:
    """One task of a multi-node job (bench.runtime.multinode): start this node's torchrun on the same
    overrides and wait. Task 0 makes sure the case gets its row: torchrun's rank 0 writes it,
    and task 0 writes a failed (or timeout) row if torchrun ended before that."""
    from hydra.core.hydra_config import HydraConfig

    record = new_record(cfg)
    if cfg.mode == "sim":  # nothing to run on the other nodes
        if task.rank == 0:
            run_case(cfg)
        return
    try:
        if cfg.repeats != 1:
            raise ConfigError(f"repeats={cfg.repeats!r}: a multi-node job runs one case once; set "
                              "repeats=1 (and sweep, e.g. -m +round=1,2,3, to repeat it)")
        cluster = ClusterSpec.from_config(record.config["cluster"])
        nproc = devices_per_node(task, cluster)[task.rank]
    except ConfigError as exc:  # every task sees it; task 0 reports and records it
        if task.rank == 0:
            record.error = str(exc)
            print(f"error: {exc}", file=sys.stderr)
            write_record(cfg, record)
        return
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir) / f"node{task.rank}"
    overrides = [*hydra_cfg.overrides.task, f"hydra.run.dir={run_dir}"]
    code = run_torchrun(torchrun_command(task, nproc, overrides, run_dir / "torchrun"), record.run_id,
                        cfg.timeout_s)
    if task.rank != 0:
        return
    if any(row.get("run_id") == record.run_id for row in load_records(results_file(cfg))):
        if code != 0:
            _failed_cases.append(f"{record.model}/{record.cluster}/{record.method}")
        return
    if code is None:
        record.status, record.error = "timeout", f"case did not finish within timeout_s={cfg.timeout_s:g}"
    else:
        record.error = (f"torchrun on node 0 exited with code {code} before rank 0 recorded the "
                        f"case; its output is in the job's log ({run_dir} and the submitit folder)")
    print(f"error: {record.error}", file=sys.stderr)
    write_record(cfg, record)


class SweepSummary(Callback):
    """Hydra callback: progress of a --multirun sweep (cases done, ETA; on a terminal only),
    then one table of every row the sweep recorded."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._started = datetime.now(timezone.utc).isoformat()
        self._t0, self._done, self._total = time.monotonic(), 0, sweep_size(config)
        # The basic launcher runs the jobs in this process: the workers' server that the first
        # job starts preloads the methods of the later ones too (expect_cases).
        expect_methods(swept_method_targets(config))

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        if not hasattr(self, "_t0") or not interactive():
            return
        self._done += 1
        elapsed = time.monotonic() - self._t0
        eta = elapsed / self._done * (self._total - self._done) if self._total else None
        print(f"sweep: {self._done}/{self._total or '?'} cases, {elapsed:.0f} s"
              + (f", eta {eta:.0f} s" if eta is not None else ""), file=sys.stderr, flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        path = Path(config.results_dir) / "records.jsonl"
        rows = [r for r in load_records(path) if r.get("timestamp", "") >= self._started]
        # Launchers that run jobs in other processes (submitit) report their failures here only:
        # the exit status, and one line each for errors this process has not shown yet.
        for r in rows:
            if r.get("status") == "ok":
                continue
            case = f"{r['model']}/{r['cluster']}/{r['method']}"
            _failed_cases.append(case)
            if r.get("run_id") not in _recorded_here and r.get("error"):
                print(f"error: {case}: {r['error'].strip().splitlines()[-1]}", file=sys.stderr)
        if rows:
            print_table(rows, title=f"hetbench sweep: {len(rows)} cases")
            track_sweep(make_trackers(config), rows, path)


def sweep_axes(params: dict[str, str]) -> list[list[str]]:
    """Each key's `key=value` choices, as Hydra's basic sweeper expands `key=a,b` (or range(),
    choice(), ...); a key with one value has one choice. A sweep is their product."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    axes = []
    for key, values in params.items():
        override = parser.parse_override(f"{key}={values}")
        choices = (override.sweep_string_iterator() if override.is_sweep_override()
                   else [override.get_value_element_as_str()])
        axes.append([f"{key}={v}" for v in choices])
    return axes


def sweep_params(config: DictConfig) -> dict[str, str]:
    """A --multirun sweep's `key: values` (command line and the experiment's
    hydra.sweeper.params; the command line wins for a key)."""
    params = {str(k): str(v) for k, v in (config.hydra.sweeper.get("params") or {}).items()}
    for item in config.hydra.overrides.task:
        key, _, value = str(item).partition("=")
        params[key] = value
    return params


def sweep_size(config: DictConfig) -> int | None:
    """How many cases a --multirun sweep has: the product of its swept values."""
    try:
        return math.prod(len(axis) for axis in sweep_axes(sweep_params(config)))
    except Exception:  # progress is a courtesy: a sweep syntax it cannot count shows no total
        return None


def swept_method_targets(config: DictConfig) -> list[str]:
    """The `_target_` of each method a --multirun sweep names (conf/method/<name>.yaml); none
    where the sweep's syntax or a method's file cannot be read (its job then says why)."""
    try:
        axis = next((a for a in sweep_axes(sweep_params(config)) if a[0].startswith("method=")), [])
    except Exception:
        return []
    targets = []
    for choice in axis:
        try:
            targets.append(str(OmegaConf.load(CONF_DIR / "method" / f"{choice.partition('=')[2]}.yaml")["_target_"]))
        except Exception:
            continue
    return targets


@hydra.main(config_path=CONF_SOURCE, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _run_under_torchrun(cfg)
        return
    task = current_task()
    if task is not None:  # a task of a multi-node submitit job
        _run_across_nodes(cfg, task)
        return
    repeats = cfg.repeats  # an invalid value fails in run_case, as a failed row with the fix
    if isinstance(repeats, int) and not isinstance(repeats, bool) and repeats > 1 and cfg.mode == "real":
        from bench.compare import run_rounds

        record = run_rounds({cfg.method.name: cfg}, cfg.repeats)[0]
    else:
        record = run_case(cfg)
    print_table([record.__dict__])


def run_cli() -> int:
    """`python -m bench.run` and `hetbench run`: check the group choices, run (Hydra reads
    sys.argv), and return the exit status: 1 when a case of this process did not end ok."""
    try:
        check_group_choices(sys.argv[1:])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    main()
    return 1 if _failed_cases else 0


if __name__ == "__main__":
    # Run as the module bench.run, not as __main__: Hydra instantiates SweepSummary from
    # bench.run, and the failures it collects must be the ones run_cli reads.
    from bench.run import run_cli as _run_cli

    sys.exit(_run_cli())
