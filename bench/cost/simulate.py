"""Predict one iteration of a bench Program on a ClusterSpec: time per stage, memory, OOM.

The time is bench.cost.price's (the same price the search and the load balancer optimise);
nothing here runs a model or touches torch.distributed.
"""

from __future__ import annotations

from bench.core.cluster import ClusterSpec
from bench.core.program import Program, Ratios
from bench.cost.group_pipeline import GroupPipelineProgram, simulate_group_pipeline
from bench.cost.pipeline import PipelineProgram, simulate_pipeline
from bench.cost.result import SimResult
from bench.cost.spmd import simulate_program


def simulate(
    program: Program | PipelineProgram | GroupPipelineProgram,
    cluster: ClusterSpec,
    ratios: Ratios | None,
    memory_reserve_gib: float = 0.0,
) -> SimResult:
    """Predicted iteration time and memory of `program` on `cluster` with these ratios.

    Args:
        program: the Program; its granularity picks GPUs or machines as devices.
        ratios: [segment][device] sharding ratios, each row summing to 1.
        memory_reserve_gib: memory per GPU the framework takes besides the model (CUDA
            context, allocator slack); subtracted from each GPU's capacity for the OOM flag.

    The time is bench.cost.price.iteration_time at these ratios (its docstring says how
    stages and their overlap are timed); the per-step overhead measured for emulated devices
    (bench.runtime.hostspeed) and the method's own host work are added once, on the slowest
    device. A pipeline (bench.cost.pipeline) has no ratios: its stages say what each rank computes;
    nor has a pipeline of group stages (bench.cost.group_pipeline): each stage's Program holds its own.
    """
    if isinstance(program, PipelineProgram):
        return simulate_pipeline(program, cluster, memory_reserve_gib)
    if isinstance(program, GroupPipelineProgram):
        return simulate_group_pipeline(program, cluster, memory_reserve_gib)
    return simulate_program(program, cluster, ratios, memory_reserve_gib)
