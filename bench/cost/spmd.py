"""One iteration of an SPMD Program (every device runs its share of every stage) on a ClusterSpec:
time per stage, memory, OOM. bench.cost.simulate dispatches here; a pipeline of group stages
(bench.cost.group_pipeline) prices each stage's Program with it.
"""

from __future__ import annotations

from bench.core.cluster import ClusterSpec
from bench.core.program import Program, Ratios
from bench.cost.algebra import FloatAlgebra
from bench.cost.devices import GIB, virtual_devices
from bench.cost.price import busiest_gpu_ratios, iteration_time, per_step_s
from bench.cost.result import SimResult


def simulate_program(
    program: Program, cluster: ClusterSpec, ratios: Ratios | None, memory_reserve_gib: float = 0.0
) -> SimResult:
    """bench.cost.simulate of a Program (its docstring)."""
    vdevs = virtual_devices(cluster, program.granularity)
    if len(vdevs) != program.num_devices:
        raise ValueError(
            f"the program is for {program.num_devices} {program.granularity} devices, but cluster "
            f"{cluster.name!r} has {len(vdevs)}; plan for this cluster"
        )
    program.check_ratios(ratios)
    stage_times: list[tuple[float, float]] = []
    busiest = busiest_gpu_ratios(ratios, vdevs, program.batch)
    iter_time = iteration_time(program, cluster, vdevs, FloatAlgebra(ratios, busiest), stage_times)
    per_gpu = ratios if busiest is None else busiest  # what each GPU of a machine holds of the activations
    memory, peaks, oom_devices = [], [], []
    points = program.memory.backward_points()
    step = program.memory.optimizer_step(foreach=cluster.device == "cuda")
    alike: dict = {}  # (its ratios, its GPUs) -> (memory, peak): a device type's devices hold alike
    for v in vdevs:
        key = (tuple(row[v.index] for row in ratios), v.num_gpus)  # per_gpu follows from these
        if key not in alike:
            parts = {
                "params": program.memory.params.at(ratios, v.index),
                "grads": program.memory.grads.at(ratios, v.index),
                "optimizer": program.memory.optimizer.at(ratios, v.index),
                "buckets": program.memory.buckets.at(ratios, v.index),
                # Data parallel inside a machine: each GPU keeps the activations of its
                # samples (the busiest GPU's: busiest_gpu_ratios).
                "activations": program.memory.activations.at(per_gpu, v.index) / v.num_gpus,
            }
            # The larger of backward's peak (activations included) and Adam's step.
            alike[key] = (
                {k: val / GIB for k, val in parts.items()},
                max(
                    max(held.at(ratios, v.index) + acts.at(per_gpu, v.index) / v.num_gpus for held, acts in points)
                    / GIB,
                    step.at(ratios, v.index) / GIB,
                ),
            )
        gib, peak = alike[key]
        memory.append(dict(gib))
        if v.compute is not None:
            peak += v.compute.workspace_bytes / GIB  # the libraries' own (bench.runtime.probes.workspace_bytes)
        peaks.append(peak)
        if peak > v.memory_bytes / GIB - memory_reserve_gib:
            oom_devices.append(v.index)
    return SimResult(
        iter_time_s=iter_time,
        stage_times=stage_times,
        comm_time_s=sum(c for c, _ in stage_times),
        compute_time_s=sum(p for _, p in stage_times),
        per_step_s=per_step_s(program, cluster, vdevs, FloatAlgebra(ratios)),
        memory_gib=memory,
        peak_mem_gib=peaks,
        oom=bool(oom_devices),
        oom_devices=oom_devices,
    )
