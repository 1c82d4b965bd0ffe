"""The price of a pipeline whose stages are each one SPMD Program over a group of devices.

A GroupPipelineProgram is a pipeline of S stages, each held by a group of R devices (whole
machines of one device kind) that runs ONE Program for the stage, over the group (its
sharding, tensor-parallel and expert-parallel collectives among the group's devices), on the
group's micro-batch; the pipelines are rank-aligned: rank i of stage s sends its share of the
border tensors to rank i of stage s + 1, so pipeline i is rank i of every group, and every
rank of a group runs the same action list (torch's schedule traced for S positions, one stage
a position: 1F1B, GPipe). The groups move in lockstep (each stage's collectives join its
group's ranks), so one pipeline's replay stands for all (bench.cost.pipeline.replay).

The price, per stage (stage_price), from its Program as one micro-batch runs it, over its
group's ClusterSpec (group_cluster) at its ratio rows:
  - forward: its forward stages one after another (collectives, then the slowest device's
    compute: bench.cost.price.stage_time); backward: its backward stages without the gradient
    all-reduce (without_grad_sync); the gradient sync: the replicated parameters' all-reduce
    (and on machine-level devices the sum inside each machine), once after the schedule; the
    optimizer step and per-step terms once;
  - on a last stage, the loss's tail beside its Program (each rank runs it on its samples):
    its forward and backward compute, and the bytes it keeps for backward;
  - memory per device: the simulator's peak of the Program with one micro-batch in flight,
    plus that device's activations of one micro-batch for each further one its position keeps
    in flight (in_flight of the schedule's actions), plus its receive buffers (its share of the
    border it receives and of the gradient it receives back) for every micro-batch.
The pipeline (replay_stages): the pipeline's replay of the traced actions with each stage's
forward and backward seconds and each border's rank-aligned send (the slowest pair of ranks:
all pairs at once, each over its own link); each position then adds its gradient sync and its
optimizer step after its last action, and the iteration ends with the last position.

Nothing here plans: methods/auto/hap_stages.py makes the stages' Programs (hap's synthesis over
each group) and the traced actions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.core.cluster import ClusterSpec, MachineGroup
from bench.core.program import Memory, Program, Stage, without_grad_sync
from bench.cost.algebra import FloatAlgebra
from bench.cost.devices import GIB, virtual_devices
from bench.cost.pipeline import (
    MULTI_STAGE,
    SCHEDULES,
    PipelineProgram,
    PipeStage,
    RankTimeline,
    StageTimes,
    StageWork,
    in_flight,
    replay,
    transfer_s,
)
from bench.cost.price import collective_time, intra_grad_sync, optimizer_time, per_step_s, stage_time
from bench.cost.result import SimResult
from bench.cost.spmd import simulate_program


@dataclass(frozen=True)
class GroupStage:
    """One stage of the pipeline: its Program over its group, and what crosses its borders."""

    program: Program  # as one micro-batch of the group runs it (micro_steps 1)
    ranks: tuple[int, ...]  # the cluster's ranks of its group, in group order (rank i: pipeline i)
    ratios: tuple[tuple[float, ...], ...]  # the program's ratio rows (over its virtual devices)
    forward_stages: int  # program.stages[:forward_stages] are forward's, the rest backward's
    # Per group rank i: bytes it sends rank i of the next stage per micro-batch (() on the last)
    send_bytes: tuple[float, ...] = ()
    # Per group rank i: its receive buffers of one micro-batch (its share of the border it
    # receives and of its output's gradient it receives back), held for every micro-batch
    buffer_bytes: tuple[float, ...] = ()
    # Work beside the program on a last stage: the loss's tail, which each rank runs on its own
    # samples (data parallel, split by the ratio row): its forward and backward compute (Stages
    # of FLOPs sharded by row 0) and the bytes it keeps for backward (the whole micro-batch's)
    tail_forward: tuple[Stage, ...] = ()
    tail_backward: tuple[Stage, ...] = ()
    tail_kept_bytes: float = 0.0


@dataclass(frozen=True)
class GroupPipelineProgram:
    """One training iteration of a pipeline of group stages (module docstring)."""

    stages: tuple[GroupStage, ...]
    actions: tuple[tuple[tuple, ...], ...]  # per position: torch's schedule traced (bench.cost.pipeline.ACTIONS)
    num_micro_batches: int
    micro_batch: int  # samples of one micro-batch over a group (the stages' Programs' batch)
    num_devices: int
    schedule: str = "1f1b"
    batch: int = 0  # the global batch: num_micro_batches x micro_batch
    meta: dict = field(default_factory=dict, compare=False)
    granularity: str = "gpu"  # every device is a rank of its own (the runner's memory rows)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES or self.schedule in MULTI_STAGE:
            raise ValueError(f"schedule {self.schedule!r} is not one stage per rank; use 1f1b or gpipe")
        S = len(self.stages)
        if S < 2 or len(self.actions) != S:
            raise ValueError(f"{S} stages need 2 or more and one action list each (got {len(self.actions)})")
        R = len(self.stages[0].ranks)
        flat = [r for st in self.stages for r in st.ranks]
        if any(len(st.ranks) != R for st in self.stages) or sorted(flat) != list(range(self.num_devices)):
            raise ValueError(
                f"the stages' groups {[list(st.ranks) for st in self.stages]} must be of one size and hold "
                f"each of the {self.num_devices} devices once"
            )
        for k, st in enumerate(self.stages):
            if len(st.send_bytes) != (R if k + 1 < S else 0) or len(st.buffer_bytes) not in (0, R):
                raise ValueError(
                    f"stage {k}: send_bytes per rank to the next stage (none on the last), buffers per rank"
                )
            if not 0 < st.forward_stages <= len(st.program.stages):
                raise ValueError(f"stage {k}: forward_stages={st.forward_stages} of {len(st.program.stages)}")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_pipelines(self) -> int:
        return len(self.stages[0].ranks)

    def to_json(self) -> dict:
        return {
            "kind": "group_pipeline",
            "schedule": self.schedule,
            "num_micro_batches": self.num_micro_batches,
            "micro_batch": self.micro_batch,
            "stages": [
                {
                    "ranks": list(st.ranks),
                    "ratios": [list(r) for r in st.ratios],
                    "forward_stages": st.forward_stages,
                    "send_bytes": list(st.send_bytes),
                    "buffer_bytes": list(st.buffer_bytes),
                    "program": st.program.to_json(),
                }
                for st in self.stages
            ],
        }


def group_cluster(
    cluster: ClusterSpec, ranks: Sequence[int], name: str = "", memory_gib: float | None = None
) -> ClusterSpec:
    """A cluster of the machines holding `ranks` (whole machines of one device kind), with the
    cluster's links: the group a stage's Program runs over (its rank i is `ranks[i]`).
    `memory_gib`: each device's memory (a planner's budget); None: the devices' own."""
    devs = [cluster.devices[r] for r in ranks]
    machines = sorted({d.machine for d in devs})
    per = {m: [d for d in cluster.devices if d.machine == m] for m in machines}
    if sum(len(v) for v in per.values()) != len(ranks):
        raise ValueError(f"ranks {list(ranks)} are not whole machines")
    kinds = {(d.type.name, d.speed, d.type.memory_gib) for d in devs}
    if len(kinds) != 1:
        raise ValueError(f"ranks {list(ranks)} mix device kinds {sorted(kinds)}")
    d0 = devs[0]
    memory = d0.type.memory_gib if memory_gib is None else memory_gib
    group = MachineGroup(len(machines), d0.type.name, len(per[machines[0]]), d0.speed, memory)
    return dataclasses.replace(
        cluster, name=name or f"{cluster.name}[{ranks[0]}..{ranks[-1]}]", machines=(group,), virtual_device="gpu"
    )


@dataclass(frozen=True)
class StagePrice:
    """One stage's Program over its group, per micro-batch of the group (stage_price)."""

    forward_s: float  # its forward stages, collectives included, one after another
    backward_s: float  # its backward stages without the gradient all-reduce
    grad_sync_s: float  # the replicated parameters' gradient all-reduce, once after the schedule
    optimizer_s: float  # the optimizer step and per-step terms
    peak_gib: float  # the busiest device's peak with one micro-batch in flight
    activations_gib: float  # one micro-batch's activations on the busiest device
    state_gib: float  # parameters, gradients and Adam state on the busiest device
    # Per group rank: its peak with one micro-batch in flight, its memory parts (GiB, as
    # SimResult.memory_gib), and its bytes of one micro-batch's activations
    peaks_gib: tuple[float, ...] = ()
    memory_gib: tuple[dict, ...] = ()


def stage_price(stage: GroupStage, group: ClusterSpec) -> StagePrice:
    """The stage's per-micro-batch parts (StagePrice) from its Program over its group."""
    program, ratios = stage.program, [list(r) for r in stage.ratios]
    vdevs = virtual_devices(group, program.granularity)
    alg = FloatAlgebra(ratios)
    fwd, bwd = program.stages[: stage.forward_stages], program.stages[stage.forward_stages :]
    forward = sum(stage_time(st, group, vdevs, ratios) for st in (*fwd, *stage.tail_forward))
    backward = sum(stage_time(st, group, vdevs, ratios) for st in (*stage.tail_backward, *without_grad_sync(bwd)))
    sync = 0.0
    for st in bwd:
        sync += sum(collective_time(c, group, vdevs, ratios) for c in st.collectives if c.grad)
        sync += float(intra_grad_sync(st, group, vdevs, alg))
    opt = float(optimizer_time(program, vdevs, alg)) + float(per_step_s(program, group, vdevs, alg))
    sim = simulate_program(program, group, ratios)
    # per group rank (a machine-level device's GPUs each hold what it reports per GPU)
    of_rank: dict[int, int] = {r: v.index for v in vdevs for r in v.ranks}
    n = group.num_devices
    # the loss's tail keeps its share of the micro-batch's bytes beside the program's activations
    tail = [stage.tail_kept_bytes * ratios[0][of_rank[i]] / vdevs[of_rank[i]].num_gpus / GIB for i in range(n)]
    peaks = [sim.peak_mem_gib[of_rank[i]] + tail[i] for i in range(n)]
    memory = [dict(sim.memory_gib[of_rank[i]]) for i in range(n)]
    for i in range(n):
        memory[i]["activations"] += tail[i]
    d = max(range(n), key=lambda i: peaks[i])
    mem = memory[d]
    return StagePrice(
        forward,
        backward,
        sync,
        opt,
        peaks[d],
        mem["activations"],
        mem["params"] + mem["grads"] + mem["optimizer"],
        tuple(peaks),
        tuple(memory),
    )


def lockstep(actions: Sequence[Sequence[tuple]], schedule: str, num_micro_batches: int, micro_batch: int):
    """One pipeline of len(actions) positions running the traced `actions` (one stage a
    position), its stages carrying no work: replay_stages gives the replay each stage's seconds."""
    S = len(actions)
    empty = StageWork((), (), (0.0, 0.0), 0.0)
    stages = tuple(PipeStage((k, k + 1), (k,), (empty,), 0.0) for k in range(S))
    return PipelineProgram(
        stages=stages,
        actions=tuple(tuple(a) for a in actions),
        num_micro_batches=num_micro_batches,
        micro_batches=(micro_batch,),
        num_devices=S,
        memory=tuple((Memory(),) for _ in range(S)),
        schedule=schedule,
    )


def replay_stages(
    pipe: PipelineProgram, cluster: ClusterSpec, prices: Sequence[StagePrice], sends: Sequence[float]
) -> tuple[float, list[RankTimeline]]:
    """(iteration seconds, each position's timeline) of `pipe` (lockstep) with each stage's
    forward and backward its price's (on a first stage torch's input backward does nothing and
    its weights' does all; elsewhere half each) and each border's send `sends[k]`, then per
    position its gradient sync and optimizer step."""
    times = [
        StageTimes(p.forward_s, p.backward_s, 0.0 if k == 0 else p.backward_s / 2, p.backward_s / (1 if k == 0 else 2))
        for k, p in enumerate(prices)
    ]
    lines = replay(pipe, cluster, 0, times, list(sends))
    total = max(line.end_s + p.grad_sync_s + p.optimizer_s for line, p in zip(lines, prices))
    return total, lines


def stage_sends(program: GroupPipelineProgram, cluster: ClusterSpec) -> list[float]:
    """Per stage, seconds of its rank-aligned send of one micro-batch's border tensors: every
    pair (rank i of stage k, rank i of stage k + 1) at once over its own link, the slowest pair
    counted; 0 on the last stage."""
    out = []
    for k, st in enumerate(program.stages):
        if k + 1 == program.num_stages:
            out.append(0.0)
            continue
        nxt = program.stages[k + 1].ranks
        out.append(max(transfer_s(b, cluster, a, c) for b, a, c in zip(st.send_bytes, st.ranks, nxt)))
    return out


def simulate_group_pipeline(
    program: GroupPipelineProgram, cluster: ClusterSpec, memory_reserve_gib: float = 0.0
) -> SimResult:
    """Predicted iteration time and per-device memory of a pipeline of group stages (module
    docstring), as bench.cost.SimResult: one entry per device in rank order."""
    gpus = virtual_devices(cluster, "gpu")
    if len(gpus) != program.num_devices:
        raise ValueError(
            f"the pipeline is for {program.num_devices} devices, but cluster {cluster.name!r} has "
            f"{len(gpus)}; plan for this cluster"
        )
    prices = [stage_price(st, group_cluster(cluster, st.ranks)) for st in program.stages]
    sends = stage_sends(program, cluster)
    pipe = lockstep(program.actions, program.schedule, program.num_micro_batches, program.micro_batch)
    iter_time, lines = replay_stages(pipe, cluster, prices, sends)
    m = program.num_micro_batches
    memory: list[dict] = [{} for _ in range(program.num_devices)]
    peaks = [0.0] * program.num_devices
    for k, (st, p) in enumerate(zip(program.stages, prices)):
        flight = in_flight(program.actions[k])
        for i, rank in enumerate(st.ranks):
            parts = dict(p.memory_gib[i])
            acts = parts.get("activations", 0.0)
            buffers = m * st.buffer_bytes[i] / GIB if st.buffer_bytes else 0.0
            parts["activations"] = flight * acts
            parts["buckets"] = parts.get("buckets", 0.0) + buffers
            memory[rank] = parts
            peaks[rank] = p.peaks_gib[i] + (flight - 1) * acts + buffers
    oom_devices = [v.index for v in gpus if peaks[v.index] > v.memory_bytes / GIB - memory_reserve_gib]
    stage_times = [(s * m, (p.forward_s + p.backward_s) * m) for s, p in zip(sends, prices)]
    busiest = max(range(len(prices)), key=lambda k: lines[k].compute_s + prices[k].optimizer_s)
    return SimResult(
        iter_time_s=iter_time,
        stage_times=stage_times,
        comm_time_s=sum(c for c, _ in stage_times),
        compute_time_s=lines[busiest].compute_s,
        per_step_s=prices[busiest].optimizer_s,
        memory_gib=memory,
        peak_mem_gib=peaks,
        oom=bool(oom_devices),
        oom_devices=oom_devices,
    )
