"""Preparing one case before any worker starts: validate, build the workload, measure the host, plan.

It fills the case's row with everything known before training (plan, prediction, hardware);
running the workers and reading their results is bench.runner.execute's job.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import multiprocessing as mp
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.interfaces import Workload
from bench.core.paths import shown_config_path
from bench.cost import simulate
from bench.cost.flops import train_flops_per_sample
from bench.records.rows import (
    RunRecord,
    case_key,
    fingerprint,
)
from bench.runner.configs import hydra_job, instantiate_plugin
from bench.runner.settings import Settings, emulation_settings, recorded_config
from bench.runtime.emulation import EmulationSettings
from bench.runtime.hostlinks import host_floor
from bench.runtime.hostspeed import measure_host_speed, split_step
from bench.runtime.launch import (
    forks_workers,
    start_server,
    wait_for_server,
)
from bench.runtime.pacing import RankHooks
from bench.runtime.worker import (
    Case,
)

log = logging.getLogger(__name__)
_unrecorded_warned: set[str] = set()


def build_workload(cfg: Settings, cluster: ClusterSpec) -> Workload:
    return workload_from(cfg, *check_workload(cfg, cluster))


def check_workload(settings: Settings, cluster: ClusterSpec) -> tuple[object, int, dict]:
    """The case's model spec, global batch and data, each checked (a ConfigError of one line)."""
    model_cfg = instantiate_plugin(settings.model["spec"], "model.spec", num_devices=cluster.num_devices)
    n = cluster.num_devices
    batch = settings.global_batch if settings.global_batch is not None else settings.preset.batch_per_device * n
    if batch < n:
        raise ConfigError(
            f"global_batch={batch!r} is smaller than the {n} devices of cluster={cluster.name}; "
            f"every device needs a sample: set global_batch>={n} (or preset.batch_per_device>=1)"
        )
    data = asdict(settings.data)
    try:  # open the data once here: a wrong source, path or file fails before workers start
        model_cfg.dataset(data["source"], data["path"], data["split"], settings.seed)
    except ValueError as exc:
        raise ConfigError(str(exc).replace("\n", " ")) from None
    return model_cfg, batch, data


def workload_from(settings: Settings, model_cfg, batch: int, data: dict) -> Workload:
    """The workload of checked parts (check_workload); counts its FLOPs (seconds for a big model)."""
    return Workload(
        name=settings.model["name"],
        preset=settings.preset.name,
        model_cfg=model_cfg,
        global_batch=batch,
        flops_per_sample=train_flops_per_sample(model_cfg),
        data=data,
        precision=settings.precision,
        batch_norm=settings.batch_norm,
    )


def check_profile_precision(cluster: ClusterSpec, precision: str) -> None:
    """A compute profile prices kernels as they ran when it was measured: one measured at
    another precision than the case's is refused (a ConfigError of one line). A profile made
    before profiles recorded their precision is used, with one warning per profile."""
    for dtype in {d.type.name: d.type for d in cluster.devices}.values():
        prof = dtype.compute
        if prof is None:
            continue
        if prof.precision is None:
            if prof.path not in _unrecorded_warned:
                _unrecorded_warned.add(prof.path)
                log.warning(
                    "the compute profile %s (device type %s) does not record its precision (measured "
                    "with torch's default TF32 switches: cuDNN's on); re-profile it with bench.profile "
                    "--precision %s",
                    prof.path,
                    dtype.name,
                    precision,
                )
        elif prof.precision != precision:
            raise ConfigError(
                f"precision={precision} but the compute profile {prof.path} (device type {dtype.name}) was "
                f"measured at precision={prof.precision}; run at precision={prof.precision}, or profile the "
                f"device at {precision}: python -m bench.profile --device cuda --device-type {dtype.name} "
                f"--precision {precision} --compute-out {prof.path}"
            )


def check_hardware(cluster: ClusterSpec, world_size: int | None) -> None:
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


def new_record(cfg) -> RunRecord:
    """The case's row, failed until it ends well, from its Settings or its config as composed
    (one Settings refused: the row then says why, bench.runner.execute.record_refused)."""
    config = copy.deepcopy(recorded_config(cfg))
    sweep_id, output_dir = hydra_job()
    return RunRecord(
        model=config["model"]["name"],
        preset=config["preset"]["name"],
        cluster=config["cluster"]["name"],
        method=config["method"]["name"],
        mode=config["mode"],
        status="failed",
        origin="measured" if config["mode"] == "real" else "simulated",
        warmup_iters=config["warmup_iters"],
        measured_iters=config["measured_iters"],
        case_key=case_key(config),
        config=config,
        sweep_id=sweep_id,
        output_dir=output_dir,
        **fingerprint(),
    )


def prepare_case(cfg: Settings, record: RunRecord, world_size: int | None = None, launching: bool = False) -> Case:
    """Validate, measure the host, plan: everything before workers start. Fills `record`.

    `launching`: this process launches the case's workers next (bench.runtime.launch.launch); when they
    fork from a server on the CPU, it starts here, as soon as the case is valid, so that its
    seconds of imports overlap the FLOP count (start_server)."""
    cluster = ClusterSpec.from_config(cfg.cluster, cfg.config_roots())
    record.cluster_hash = cluster.fingerprint()
    record.num_devices = cluster.num_devices
    files = record.config.get("config_files")
    if files is not None:  # which device files the cluster's types came from
        files.update({f"device/{name}": shown_config_path(Path(path)) for name, path in cluster.type_files})
    method = instantiate_plugin(cfg.method, "method")
    if cfg.mode not in getattr(method, "modes", ("real",)):
        raise ConfigError(
            f"method={cfg.method_name} does not support mode={cfg.mode} yet; it supports {', '.join(method.modes)}"
        )
    model_cfg, record.global_batch, data = check_workload(cfg, cluster)
    check_profile_precision(cluster, cfg.precision)
    if cfg.mode == "real":
        check_hardware(cluster, world_size)
    # Validated for this cluster before any worker starts (realtime_comm needs a core per rank).
    emulation = emulation_settings(cfg, cluster.num_devices) if cluster.emulated else None
    forked = launching and forks_workers(cluster)
    if forked:
        start_server(method, model_cfg)
    workload = workload_from(cfg, model_cfg, record.global_batch, data)
    record.flops_per_iter = workload.flops_per_iter
    if forked:
        wait_for_server()  # the host's speed and the planner's time are measured on a quiet host
    cluster = _at_host_speed(cfg, record, workload, cluster, forked, emulation)
    record.ideal_iter_time_s = workload.flops_per_iter / cluster.total_effective_flops()
    record.hardware = (
        hardware_description(cluster)
        if cfg.mode == "real"
        else (f"simulated {cluster.describe()}, planned on {platform.node()}")
    )
    plan = _planned(record, method, workload, cluster)
    if emulation is not None and cluster.device == "cuda":
        # Real kernels at MPS shares: no slow motion, no pacing reference (bench.runtime.emulation).
        emulation = EmulationSettings(headroom=1.0, reference_iters=0, pin_cores=False)
    record.emulation = None if emulation is None else _emulation_row(cluster, emulation)
    return Case(
        workload,
        cluster,
        method,
        plan,
        cfg.seed,
        cfg.warmup_iters,
        cfg.measured_iters,
        emulation=emulation,
        precision=cfg.precision,
        hooks=RankHooks(fail_rank=cfg.test.fail_rank, oom_rank=cfg.test.oom_rank, slowdown=cfg.test.slowdown),
    )


def _at_host_speed(cfg: Settings, record: RunRecord, workload, cluster: ClusterSpec, forked: bool, emulation):
    """An emulated CPU cluster priced at this host's measured speed and transport floor (recorded);
    any other cluster as it is."""
    if not (cluster.emulated and cluster.device == "cpu"):
        return cluster
    per_device = -(-workload.global_batch // cluster.num_devices)
    speed = measure_host_speed(workload, per_device, cfg.seed)
    record.host_flops_per_s, record.host_step_overhead_s = speed.flops_per_s, speed.step_overhead_s
    record.host_optimizer_s_per_byte = speed.optimizer_s_per_byte
    cluster = cluster.with_host_speed(*speed)
    if cluster.num_devices > 1:  # what the host's own transport adds to the emulated links
        record.host_link_floor_s = host_floor(
            cluster.num_devices,
            mp.get_context("forkserver") if forked else None,
            emulation.realtime_comm,
            emulation.gloo_workers_first,
        )
        cluster = cluster.with_link_floor(record.host_link_floor_s)
    return cluster


def _planned(record: RunRecord, method, workload, cluster: ClusterSpec):
    """The method's plan, timed, and the simulator's price of its program (recorded)."""
    start = time.perf_counter()
    plan = method.plan(workload, cluster)
    record.planner_time_s = time.perf_counter() - start
    # Of the planner's time (hap's, sfb's, auto's): the capture and the search with its LP; a
    # plan the plan cache held cost neither.
    cached = (plan.details.get("cache") or {}).get("status") == "hit"
    capture, search = plan.details.get("capture_time_s"), plan.details.get("search_time_s")
    if capture is not None and search is not None:
        record.capture_time_s = 0.0 if cached else capture
        record.search_time_s = 0.0 if cached else search + plan.details.get("lp_time_s", 0.0)
    record.plan = plan.details
    record.plan_hash = plan_hash(plan)
    record.batch_shares = plan.batch_shares
    if plan.program is not None:
        sim = simulate(plan.program, cluster, plan.ratios)
        record.predicted_iter_time_s = sim.iter_time_s
        record.predicted_compute_s = compute_s(sim)
        record.predicted_peak_mem_gib = sim.peak_mem_gib
        record.predicted_oom = sim.oom
    return plan


def _emulation_row(cluster: ClusterSpec, emulation) -> dict:
    """The emulation settings a row records."""
    return {
        "device": cluster.device,
        "headroom": emulation.headroom,
        "reference_iters": emulation.reference_iters,
        "round_reference_iters": emulation.round_reference_iters if emulation.reference_each_round else None,
        "pin_cores": emulation.pin_cores,
        "pause_discount": emulation.pause_discount,
        "realtime_comm": emulation.realtime_comm,
        "gloo_workers_first": emulation.gloo_workers_first,
    }


def compute_s(sim) -> float:
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
    record.predicted_compute_s = compute_s(sim)


def plan_hash(plan) -> str:
    """Identity of a plan's decisions (shares, ratios, synthesized steps), not of its
    bookkeeping: timings and predictions from a measured host speed vary between runs."""
    ratios = [[round(r, 6) for r in row] for row in plan.ratios or []]
    body = [plan.method, plan.batch_shares, ratios, plan.details.get("steps")]
    if "stages" in plan.details:  # a pipeline's decisions: its cuts and which ranks run each stage
        body.append([plan.details["stages"], plan.details.get("num_micro_batches"), plan.details.get("schedule")])
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def hardware_description(cluster: ClusterSpec) -> str:
    import torch

    if cluster.emulated and cluster.device == "cuda":
        return (
            f"{torch.cuda.get_device_name(0)} shared by {cluster.num_devices} MPS workers "
            f"(emulated {cluster.describe()})"
        )
    if cluster.emulated:
        return f"cpu x{cluster.num_devices} workers (emulated {cluster.describe()})"
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()} per host"
    return "cpu"
