"""The price of a pipeline: stages on their own devices, micro-batches in a schedule's order.

A PipelineProgram is not SPMD like a Program: each stage runs its own layers on its own ranks,
in the order its schedule calls them. `actions` are those calls, one list per stage, as the
runtime's schedule makes them (methods.pipeline traces torch.distributed.pipelining's
schedule with a stand-in stage): a micro-batch's forward or backward, a transfer posted
(send or receive of an activation or of its gradient), a wait on posted transfers. The
simulator replays them rank by rank, as the ranks would run them:

  - a forward or backward takes its stage's compute at one micro-batch, priced by
    bench.cost.price.device_compute (the same price as a Program's stage: FLOPs over the
    device's rate, or a profile's kernels and rates). On an emulated CPU worker a stage takes what
    its layer groups took on this host at the micro-batch (methods.pipeline's profile), scaled by
    the host's plain step then and now (measured_scale) and over the device's speed; without
    such a profile a micro-batch also pays its kernels' share of the per-step part of a plain
    step (`model_launches`);
  - a send occupies the sender's link from when it is posted (or the link frees) for the
    alpha-beta time of the link the two ranks span (bench.cost.links), never less than the
    host transport's floor for a point-to-point transfer; a receive completes when that
    transfer has arrived; a wait ends when all it waits on have;
  - stages replicated over several pipelines (data parallel across pipelines) all-reduce
    their gradients among the replicas once every replica is through its schedule, bucket by
    bucket (grad_sync_s);
  - then each rank's optimizer step: Adam's per-byte cost over the stage's parameters on an
    emulated worker, a profile's optimizer time on a GPU, and the method's own host work.

The iteration lasts until the last rank is done. Memory is per rank: its stage's parameters,
gradients and Adam state, a gradient bucket's flat copy, the receive buffers of every micro-batch, and the
activations of the micro-batches in flight at once (Memory.activations, priced by the planner).
It runs no model and touches no process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.core.cluster import ClusterSpec
from bench.core.program import Affine, Memory, Stage
from bench.cost.algebra import FloatAlgebra
from bench.cost.devices import GIB, VirtualDevice, virtual_devices
from bench.cost.links import collective_time_s
from bench.cost.price import device_compute
from bench.cost.result import SimResult

SCHEDULES = ("1f1b", "gpipe")
# The kinds of action a stage's list holds (PipelineProgram.actions):
#   ("F", mb) / ("B", mb): forward / backward of micro-batch mb
#   ("send", id, what, mb) / ("recv", id, what, mb): a transfer posted; what is "act" (the
#       forward's output, to the next stage) or "grad" (the input's gradient, to the one before)
#   ("wait", (id, ...)): wait until those transfers are done
ACTIONS = ("F", "B", "send", "recv", "wait")


@dataclass(frozen=True)
class PipeStage:
    """One stage of a pipeline, per micro-batch, as the cost model prices it."""

    groups: tuple[int, int]  # [first, end) layer groups of the model
    ranks: tuple[int, ...]  # its rank in each pipeline (replicas of the stage)
    forward: tuple[Stage, ...]  # one micro-batch's forward compute (a Stage per op class)
    backward: tuple[Stage, ...]
    launches: tuple[float, float]  # kernels of one micro-batch's forward, backward
    send_bytes: float  # activations it sends the next stage per micro-batch (its gradient comes back)
    param_bytes: float
    memory: Memory  # per rank, at the peak (constants: a stage's ranks are not sharded)
    # The gradient buckets all-reduced among the replicas after the schedule (bytes each, in
    # order); empty with one pipeline
    grad_buckets: tuple[float, ...] = ()
    # Where its layer groups were timed on the host (emulated CPU workers: methods.pipeline's
    # profile): (forward, backward, Adam's step) seconds of one micro-batch there, which the
    # simulator scales by the host's plain step at the micro-batch then and now (measured_scale)
    measured: tuple[float, float, float] | None = None


@dataclass(frozen=True)
class PipelineProgram:
    """One training iteration of `num_pipelines` pipelines of len(stages) stages each."""

    stages: tuple[PipeStage, ...]
    actions: tuple[tuple[tuple, ...], ...]  # per stage (ACTIONS)
    num_micro_batches: int
    micro_batch: int  # samples per micro-batch
    num_pipelines: int
    num_devices: int
    schedule: str = "1f1b"
    model_launches: float = 0.0  # kernels of one forward and backward of the whole model
    batch: int = 0
    meta: dict = field(default_factory=dict, compare=False)
    host_work_flops: float = 0.0  # the method's own host work per iteration (bench.core.program.Program)
    granularity: str = "gpu"  # every device is a rank of its own
    # Where the stages were timed (PipeStage.measured): the host's plain training step at the
    # micro-batch then (seconds), and the model's FLOPs per sample (bench.cost.flops), from which
    # the cluster's host speed gives the same step now
    profile_step_s: float = 0.0
    flops_per_sample: float = 0.0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is unknown; known: {', '.join(SCHEDULES)}")
        if len(self.actions) != len(self.stages):
            raise ValueError(f"{len(self.actions)} action lists for {len(self.stages)} stages")
        ranks = [r for st in self.stages for r in st.ranks]
        if sorted(ranks) != list(range(self.num_devices)):
            raise ValueError(f"the stages' ranks {ranks} are not each of the {self.num_devices} devices once")
        if any(len(st.ranks) != self.num_pipelines for st in self.stages):
            raise ValueError(f"every stage needs a rank in each of the {self.num_pipelines} pipelines")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def to_json(self) -> dict:
        return {
            "kind": "pipeline",
            "schedule": self.schedule,
            "num_micro_batches": self.num_micro_batches,
            "micro_batch": self.micro_batch,
            "num_pipelines": self.num_pipelines,
            "stages": [
                {
                    "groups": list(st.groups),
                    "ranks": list(st.ranks),
                    "send_bytes": st.send_bytes,
                    "param_bytes": st.param_bytes,
                }
                for st in self.stages
            ],
        }


@dataclass
class RankTimeline:
    """What one rank did in a simulated iteration (seconds from its start)."""

    compute_s: float = 0.0  # its forwards and backwards
    end_s: float = 0.0  # its last action, the gradient all-reduce included
    optimizer_s: float = 0.0  # the per-step part after it (optimizer, host work)
    sync_s: float = 0.0  # the gradient all-reduce among replicas (and the wait for them)


def in_flight(actions: tuple[tuple, ...]) -> int:
    """The most micro-batches a stage holds the activations of at once in its action list
    (forwards done whose backward is not): 1F1B's stage s of S holds S - s, GPipe all."""
    most = held = 0
    for a in actions:
        held += 1 if a[0] == "F" else -1 if a[0] == "B" else 0
        most = max(most, held)
    return most


def stage_memory(
    *,
    param_bytes: float,
    largest_param_bytes: float,
    kept_bytes: float,
    backward_bytes: float,
    received_bytes: float,
    sent_bytes: float,
    in_flight: int,
    num_micro_batches: int,
    bucket_bytes: float,
) -> Memory:
    """What one rank of a stage holds at its peak (bench.core.program.Memory, constants), from its
    layers' bytes per micro-batch:

    - its parameters, their gradients (accumulated over the micro-batches: all exist from the
      first backward on), Adam's two moments, and with replicas the flat copy of the gradient
      bucket they all-reduce (`bucket_bytes`: the stage's gradients up to the bucket's cap);
    - a receive buffer per micro-batch of the iteration for its input (`received_bytes`, not
      on the first stage) and for its output's gradient (`sent_bytes`, not on the last), which
      torch.distributed.pipelining allocates once for every micro-batch (held, as buckets are);
    - the most micro-batches it has in flight: while one runs its backward (at most
      `backward_bytes`: what it still keeps and the activation gradients it holds), the others
      keep `kept_bytes` each (autograd's saved tensors and the stage's output)."""
    activations = max(in_flight - 1, 0) * kept_bytes + backward_bytes
    buffers = num_micro_batches * (received_bytes + sent_bytes)
    return Memory(
        params=Affine(param_bytes),
        grads=Affine(param_bytes),
        optimizer=Affine(2.0 * param_bytes),
        activations=Affine(activations),
        buckets=Affine(bucket_bytes + buffers),
        largest_param=Affine(largest_param_bytes),
    )


def stage_peak(memory: Memory, foreach: bool) -> float:
    """Bytes a rank of a stage holds at its peak: the larger of backward's (every gradient, the
    activations in flight) and Adam's step (bench.core.program.Memory.optimizer_step)."""
    return max(max(h.const + a.const for h, a in memory.backward_points()), memory.optimizer_step(foreach).const)


def stage_peak_bytes(
    *,
    param_bytes: float,
    largest_param_bytes: float,
    kept_bytes: float,
    backward_bytes: float,
    received_bytes: float,
    sent_bytes: float,
    in_flight: int,
    num_micro_batches: int,
    bucket_bytes: float,
    foreach: bool,
) -> float:
    """stage_peak(stage_memory(...)) in plain arithmetic, for a planner that checks many cuts."""
    resident = 4.0 * param_bytes + bucket_bytes + num_micro_batches * (received_bytes + sent_bytes)
    activations = max(in_flight - 1, 0) * kept_bytes + backward_bytes
    step = param_bytes if foreach else 2.0 * largest_param_bytes  # Adam's temporaries (Memory.optimizer_step)
    return resident + max(activations, step)


def transfer_s(nbytes: float, cluster: ClusterSpec, src: int, dst: int) -> float:
    """Seconds of one point-to-point transfer of `nbytes` from rank `src` to `dst`: the
    alpha-beta time of the link they span (a broadcast between two ranks: the bytes cross it
    once), never less than the host transport's floor for one (emulated CPU clusters; zero
    elsewhere). The emulated link paces the runtime's sends by the same time (bench.runtime.p2p)."""
    link = cluster.link_between([src, dst])
    return max(collective_time_s("broadcast", nbytes, 2, link), cluster.floor_s("p2p"))


def measured_scale(program: PipelineProgram, cluster: ClusterSpec) -> float:
    """How much longer the host computes now than when the stages were timed: its plain step at
    the micro-batch as the cluster's host speed prices it (per-sample part and per-step part:
    at a run's prediction, the run's own yardstick, bench.runtime.hostspeed.yardstick, which times that step
    at that size), over the same step timed with the stages. A ratio of two whole steps: the
    per-sample rate alone comes from the difference of two timings and moved 50% between runs
    where whole steps moved 10-20%."""
    if not program.profile_step_s or not cluster.host_flops:
        return 1.0
    now = program.flops_per_sample * program.micro_batch / cluster.host_flops + cluster.host_step_overhead_s
    return now / program.profile_step_s


def action_times(
    program: PipelineProgram, cluster: ClusterSpec, vdevs: list[VirtualDevice] | None = None
) -> list[list[tuple[float, float]]]:
    """Per stage and pipeline, (forward, backward) seconds of one micro-batch on its rank."""
    vdevs = vdevs or virtual_devices(cluster, "gpu")
    alg = FloatAlgebra([[1.0 / len(vdevs)] * len(vdevs)])
    scale = measured_scale(program, cluster)
    out = []
    for st in program.stages:
        row = []
        for r in st.ranks:
            v, dev = vdevs[r], cluster.devices[r]
            if st.measured is not None:
                row.append((st.measured[0] * scale / dev.speed, st.measured[1] * scale / dev.speed))
                continue
            # The per-step part of a plain step, spread over the model's kernels (emulated workers).
            per_kernel = dev.step_overhead_s / program.model_launches if program.model_launches else 0.0
            fwd = sum(device_compute(s, cluster, v, alg) for s in st.forward) + per_kernel * st.launches[0]
            bwd = sum(device_compute(s, cluster, v, alg) for s in st.backward) + per_kernel * st.launches[1]
            row.append((float(fwd), float(bwd)))
        out.append(row)
    return out


def replay(
    program: PipelineProgram, cluster: ClusterSpec, pipeline: int, times: list[tuple[float, float]]
) -> list[RankTimeline]:
    """Run one pipeline's action lists (module docstring) and return each stage's timeline.

    `times`: per stage, (forward, backward) seconds of one micro-batch."""
    stages = program.stages
    n = len(stages)
    ranks = [st.ranks[pipeline] for st in stages]
    clock = [0.0] * n
    pc = [0] * n
    link_free = [0.0] * n  # each rank's sending link
    arrived: dict[tuple[str, int, int], float] = {}  # (what, mb, receiving stage) -> when it arrived
    posted: list[dict[int, tuple]] = [{} for _ in range(n)]  # id -> ("done", t) or ("recv", key)
    compute = [0.0] * n
    while True:
        moved = False
        for s in range(n):
            acts = program.actions[s]
            while pc[s] < len(acts):
                a = acts[pc[s]]
                kind = a[0]
                if kind in ("F", "B"):
                    d = times[s][0 if kind == "F" else 1]
                    clock[s] += d
                    compute[s] += d
                elif kind == "send":
                    _, ident, what, mb = a
                    to = s + 1 if what == "act" else s - 1
                    begin = max(clock[s], link_free[s])
                    done = begin + transfer_s(
                        stages[s].send_bytes if what == "act" else stages[to].send_bytes, cluster, ranks[s], ranks[to]
                    )
                    link_free[s] = done
                    arrived[(what, mb, to)] = done
                    posted[s][ident] = ("done", done)
                elif kind == "recv":
                    _, ident, what, mb = a
                    posted[s][ident] = ("recv", (what, mb, s))
                elif kind == "wait":
                    ends = []
                    for ident in a[1]:
                        state, value = posted[s][ident]
                        if state == "recv":
                            if value not in arrived:
                                break
                            ends.append(arrived[value])
                        else:
                            ends.append(value)
                    else:
                        clock[s] = max([clock[s], *ends])
                        pc[s] += 1
                        moved = True
                        continue
                    break  # a transfer it waits on was not sent yet
                else:
                    raise ValueError(f"stage {s}: unknown action {a!r}")
                pc[s] += 1
                moved = True
        if all(pc[s] == len(program.actions[s]) for s in range(n)):
            break
        if not moved:
            stuck = {s: program.actions[s][pc[s]] for s in range(n) if pc[s] < len(program.actions[s])}
            raise ValueError(f"the schedule's actions deadlock: waiting at {stuck}")
    return [RankTimeline(compute_s=compute[s], end_s=clock[s]) for s in range(n)]


def grad_sync_s(stage: PipeStage, cluster: ClusterSpec) -> float:
    """Seconds of the all-reduces of a stage's gradient buckets among its replicas, one after
    another (what the runtime does once its schedule is through)."""
    if len(stage.ranks) < 2:
        return 0.0
    link = cluster.link_between(list(stage.ranks))
    return sum(
        max(collective_time_s("all_reduce", nbytes, len(stage.ranks), link), cluster.floor_s("all_reduce"))
        for nbytes in stage.grad_buckets
    )


def optimizer_s(
    stage: PipeStage, cluster: ClusterSpec, rank: int, v: VirtualDevice, host_work_flops: float, scale: float = 1.0
) -> float:
    """A rank's per-step part after its last action: Adam's step over its stage's parameters
    (emulated workers: as measured, times `scale`, else Adam's per-byte cost), a profile's
    optimizer step (GPUs), the method's host work."""
    dev = cluster.devices[rank]
    t = (
        stage.measured[2] * scale / dev.speed
        if stage.measured is not None
        else dev.optimizer_s_per_byte * stage.param_bytes
    )
    if v.compute is not None and v.compute.optimizer is not None:
        fixed, rate = v.compute.optimizer
        t += fixed + stage.param_bytes / rate
    if host_work_flops:
        t += host_work_flops / dev.effective_flops
    return t


def simulate_pipeline(program: PipelineProgram, cluster: ClusterSpec, memory_reserve_gib: float = 0.0):
    """Predicted iteration time and per-rank memory of a pipeline (bench.cost.SimResult)."""
    vdevs = virtual_devices(cluster, "gpu")
    if len(vdevs) != program.num_devices:
        raise ValueError(
            f"the pipeline is for {program.num_devices} devices, but cluster {cluster.name!r} has "
            f"{len(vdevs)}; plan for this cluster"
        )
    times = action_times(program, cluster, vdevs)
    scale = measured_scale(program, cluster)
    per_rank: dict[int, RankTimeline] = {}
    seen: dict[tuple, list[RankTimeline]] = {}
    for p in range(program.num_pipelines):
        key = tuple(times[s][p] for s in range(program.num_stages))  # pipelines alike price alike
        if key not in seen:
            seen[key] = replay(program, cluster, p, [times[s][p] for s in range(program.num_stages)])
        for s, line in enumerate(seen[key]):
            per_rank[program.stages[s].ranks[p]] = line
    for st in program.stages:  # replicas all-reduce once the last of them is through
        sync = grad_sync_s(st, cluster)
        start = max(per_rank[r].end_s for r in st.ranks)
        for r in st.ranks:
            line = per_rank[r]
            per_rank[r] = RankTimeline(
                line.compute_s,
                start + sync,
                optimizer_s(st, cluster, r, vdevs[r], program.host_work_flops, scale),
                start + sync - line.end_s,
            )
    iter_time = max(t.end_s + t.optimizer_s for t in per_rank.values())
    busiest = max(per_rank.values(), key=lambda t: t.compute_s + t.optimizer_s)
    stage_times = []
    for s, st in enumerate(program.stages):
        r = st.ranks[0]
        last = s + 1 == program.num_stages
        send = 0.0 if last else transfer_s(st.send_bytes, cluster, r, program.stages[s + 1].ranks[0])
        stage_times.append((send * program.num_micro_batches, per_rank[r].compute_s))
    memory, peaks, oom_devices = [], [], []
    foreach = cluster.device == "cuda"
    stage_of = {r: st for st in program.stages for r in st.ranks}
    for v in vdevs:
        mem = stage_of[v.index].memory
        parts = {k: getattr(mem, k).const / GIB for k in ("params", "grads", "optimizer", "buckets", "activations")}
        peak = (
            max(
                max(held.const + acts.const for held, acts in mem.backward_points()),
                mem.optimizer_step(foreach=foreach).const,
            )
            / GIB
        )
        if v.compute is not None:
            peak += v.compute.workspace_bytes / GIB
        memory.append(parts)
        peaks.append(peak)
        if peak > v.memory_bytes / GIB - memory_reserve_gib:
            oom_devices.append(v.index)
    return SimResult(
        iter_time_s=iter_time,
        stage_times=stage_times,
        comm_time_s=sum(c for c, _ in stage_times),
        compute_time_s=busiest.compute_s,
        per_step_s=busiest.optimizer_s,
        memory_gib=memory,
        peak_mem_gib=peaks,
        oom=bool(oom_devices),
        oom_devices=oom_devices,
    )
