"""The price of a pipeline: stages on their own devices, micro-batches in a schedule's order.

A PipelineProgram is not SPMD like a Program: each stage runs its own layers on its own ranks,
in the order its schedule calls them. The ranks of one pipeline are its positions; a position
holds one stage (1F1B, GPipe) or several (torch's looped, interleaved and V-shaped schedules:
`stage_rank` says which position holds each stage). `actions` are the calls one position
makes, as the runtime's schedule makes them (methods.pipeline traces
torch.distributed.pipelining's schedule with stand-in stages): a micro-batch's forward or
backward on one of its stages (zero-bubble schedules split backward into the input's gradient
and the weights'), a transfer posted (send or receive of an activation or of its gradient), a
wait on posted transfers. Pipelines run side by side, each on its own share of the batch
(`micro_batches`: its micro-batch, the same number of them in every pipeline). The simulator
replays the actions rank by rank, as the ranks would run them:

  - a forward or backward takes its stage's compute at the pipeline's micro-batch, priced by
    bench.cost.price.device_compute (the same price as a Program's stage: FLOPs over the
    device's rate, or a profile's kernels and rates). On an emulated CPU worker a stage takes what
    its layer groups took on this host at the micro-batch (methods.pipeline's profile), scaled by
    the host's plain step then and now (measured_scale) and over the device's speed; without
    such a profile a micro-batch also pays its kernels' share of the per-step part of a plain
    step (`model_launches`). A zero-bubble schedule's backward for the input and for the
    weights take torch's two passes as timed on the host where the groups were
    (StageWork.measured_split), else the part of the stage's backward that is not the weights'
    gradient and that part (StageWork.weight_share); on a pipeline's first stage torch runs the
    whole backward as the weights' (its input needs no gradient);
  - a send occupies the sender's link from when it is posted (or the link frees) for the
    alpha-beta time of the link the two ranks span (bench.cost.links), never less than the
    host transport's floor for a point-to-point transfer; a receive completes when that
    transfer has arrived; a wait ends when all it waits on have. Two stages of one position
    pass their tensors in memory (torch sends nothing between them);
  - the positions replicated over several pipelines (data parallel across pipelines) all-reduce
    their gradients among the replicas once every replica is through its schedule, bucket by
    bucket (grad_sync_s); with sharded state (`sharded_state`, FSDP2 over a stage's replicas)
    a stage's replicas instead all-gather its parameters before the schedule ("gather")
    and reduce-scatter its gradients once the schedule is through ("scatter"): both are
    actions of the position's list, collectives that start when the last replica reaches them,
    so the pipelines are replayed together (replay_all);
  - a parameter that stages on several positions read (a tied embedding and head: `tied`)
    has a copy on each; once through its schedule (and its scatter) each of those positions
    all-reduces the copy's gradient among the pipeline's holders ("tie"), a collective that
    starts when the last holder reaches it, before the replicas' all-reduce;
  - then each rank's optimizer step: Adam's per-byte cost over its stages' parameters on an
    emulated worker, a profile's optimizer time on a GPU, and the method's own host work.

The iteration lasts until the last rank is done. Memory is per rank (rank_memory): its stages'
parameters, gradients and Adam state (with sharded state its 1/r share of each, and during
the schedule the gathered parameters and the unsharded gradients they accumulate), a gradient
bucket's flat copy, the receive buffers of every micro-batch, and the activations of the
micro-batches its action list holds at once.
It runs no model and touches no process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from bench.core.cluster import ClusterSpec
from bench.core.program import Affine, Memory, Stage
from bench.cost.algebra import FloatAlgebra
from bench.cost.devices import GIB, VirtualDevice, virtual_devices
from bench.cost.links import collective_time_s
from bench.cost.price import device_compute
from bench.cost.result import SimResult

# torch.distributed.pipelining's schedules by the name its get_schedule_class takes (lower case):
# what `PipelineProgram.schedule` may say. methods.pipeline.schedule maps them to torch's classes.
SCHEDULES = (
    "1f1b",
    "gpipe",
    "interleaved1f1b",
    "loopedbfs",
    "interleavedzerobubble",
    "zbvzerobubble",
    "dualpipev",
)
# Those of SCHEDULES that run several stages per rank (torch's PipelineScheduleMulti), named here
# so that planning a cached case never imports torch.distributed.pipelining (a test checks it
# against torch's classes).
MULTI_STAGE = frozenset({"interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev"})
# The kinds of action a position's list holds (PipelineProgram.actions); k is a stage index:
#   ("F", k, mb) / ("B", k, mb): forward / backward of micro-batch mb on stage k
#   ("I", k, mb) / ("W", k, mb): zero-bubble's backward for the input / for the weights
#   ("send", id, what, k, mb) / ("recv", id, what, k, mb): a transfer posted by stage k; what is
#       "act" (the forward's output, to stage k + 1) or "grad" (the input's gradient, to k - 1)
#   ("wait", (id, ...)): wait until those transfers are done
#   ("gather", k) / ("scatter", k): sharded state only: stage k's parameters all-gathered among
#       its replicas (FSDP2's unshard, before the schedule) / its gradients reduce-scattered
#       among them (torch's perform_reduce_grad once the schedule is through)
#   ("tie", i): tied parameter i's gradient (PipelineProgram.tied[i]) all-reduced among the
#       positions of the rank's pipeline that hold a copy, after the schedule (and the scatter)
ACTIONS = ("F", "B", "I", "W", "send", "recv", "wait", "gather", "scatter", "tie")
COLLECTIVES = ("gather", "scatter")
COMPUTE = ("F", "B", "I", "W")


@dataclass(frozen=True)
class StageWork:
    """One stage's work on one pipeline's rank, per micro-batch of that pipeline."""

    forward: tuple[Stage, ...]  # one micro-batch's forward compute (a Stage per op class)
    backward: tuple[Stage, ...]
    launches: tuple[float, float]  # kernels of one micro-batch's forward, backward
    send_bytes: float  # activations it sends the next stage per micro-batch (its gradient comes back)
    # Where its layer groups were timed on the host (emulated CPU workers: methods.pipeline's
    # profile): (forward, backward, Adam's step) seconds of one micro-batch there, which the
    # simulator scales by the host's plain step at the micro-batch then and now (measured_scale)
    measured: tuple[float, float, float] | None = None
    # The part of backward that makes the weights' gradients (a zero-bubble schedule's W): each
    # parameter-reading op's half of its backward FLOPs (x @ w: dx and dw alike), over the
    # stage's backward FLOPs
    weight_share: float = 0.5
    # Where timed on the host: (input, weights) seconds of torch's two zero-bubble passes
    # (they cost more than one backward on a CPU), scaled as `measured`
    measured_split: tuple[float, float] | None = None


@dataclass(frozen=True)
class TiedParam:
    """A parameter that stages on several positions of a pipeline read (a tied embedding and
    head): each of those positions holds a copy, and once its schedule is through sums the
    copies' gradients with an all-reduce among them (the "tie" action), so that every copy
    takes the whole gradient and the same optimizer step."""

    name: str  # the parameter, as the traced graph names it
    positions: tuple[int, ...]  # the positions holding a copy, in order
    # per pipeline, the bytes each holder all-reduces: the gradient at its dtype, or with sharded
    # state the rank's own shard of it (FSDP2's chunk of dim 0 at its index among the replicas)
    nbytes: tuple[float, ...]


@dataclass(frozen=True)
class PipeStage:
    """One stage of the pipelines: its layer groups, its rank and work in each pipeline."""

    groups: tuple[int, int]  # [first, end) layer groups of the model
    ranks: tuple[int, ...]  # its rank in each pipeline (replicas of the stage)
    work: tuple[StageWork, ...]  # per pipeline, at that pipeline's micro-batch
    param_bytes: float
    # With sharded state: one replica's shard of its parameters (FSDP2 pads each parameter's dim
    # 0 to a multiple of the replicas); 0: param_bytes over the replicas
    shard_bytes: float = 0.0
    # The copies of tied parameters (TiedParam) its rank holds for it, which the layer groups of
    # another position list: their whole bytes, and with sharded state one replica's shard. A
    # copy is the rank's own parameter: in its buckets (PipelineProgram.grad_buckets) or shard
    # collectives, and in its optimizer step.
    copy_bytes: float = 0.0
    copy_shard_bytes: float = 0.0


@dataclass(frozen=True)
class PipelineProgram:
    """One training iteration of len(micro_batches) pipelines of len(stages) stages each."""

    stages: tuple[PipeStage, ...]
    actions: tuple[tuple[tuple, ...], ...]  # per position of a pipeline (ACTIONS)
    num_micro_batches: int  # per pipeline
    micro_batches: tuple[int, ...]  # samples per micro-batch, per pipeline
    num_devices: int
    memory: tuple[tuple[Memory, ...], ...]  # per position and pipeline: its rank at the peak (constants)
    # The gradient buckets a position's replicas all-reduce after the schedule (bytes each, in
    # order), per position; empty with one pipeline
    grad_buckets: tuple[tuple[float, ...], ...] = ()
    schedule: str = "1f1b"
    stage_rank: tuple[int, ...] = ()  # the position of each stage; () = stage k at position k
    model_launches: float = 0.0  # kernels of one forward and backward of the whole model
    batch: int = 0
    meta: dict = field(default_factory=dict, compare=False)
    host_work_flops: float = 0.0  # the method's own host work per iteration (bench.core.program.Program)
    granularity: str = "gpu"  # every device is a rank of its own
    # Where the stages were timed (StageWork.measured): per pipeline, the host's plain training
    # step at its micro-batch then (seconds), and the model's FLOPs per sample (bench.cost.flops),
    # from which the cluster's host speed gives the same step now
    profile_step_s: tuple[float, ...] = ()
    flops_per_sample: float = 0.0
    # Each stage's parameters, gradients and Adam state sharded over its replicas (FSDP2): its
    # actions gather and scatter (ACTIONS), the replicas all-reduce nothing after the schedule
    sharded_state: bool = False
    # Parameters held on several positions of a pipeline (TiedParam), each position's "tie"
    # actions in this order
    tied: tuple[TiedParam, ...] = ()

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is unknown; known: {', '.join(SCHEDULES)}")
        if not self.stage_rank:
            object.__setattr__(self, "stage_rank", tuple(range(len(self.stages))))
        if len(self.stage_rank) != len(self.stages) or sorted(set(self.stage_rank)) != list(range(len(self.actions))):
            raise ValueError(
                f"stage_rank {self.stage_rank} must give each of the {len(self.stages)} stages one of the "
                f"{len(self.actions)} positions, every position at least one"
            )
        D = self.num_pipelines
        ranks = [self.position_ranks(r) for r in range(self.num_ranks)]
        flat = [x for row in ranks for x in row]
        if sorted(flat) != list(range(self.num_devices)):
            raise ValueError(f"the positions' ranks {ranks} are not each of the {self.num_devices} devices once")
        for k, st in enumerate(self.stages):
            if len(st.ranks) != D or len(st.work) != D:
                raise ValueError(f"stage {k} needs a rank and its work in each of the {D} pipelines")
            if st.ranks != ranks[self.stage_rank[k]]:
                raise ValueError(f"stage {k}'s ranks {st.ranks} are not its position's {ranks[self.stage_rank[k]]}")
        if len(self.memory) != self.num_ranks or any(len(row) != D for row in self.memory):
            raise ValueError(f"memory needs one entry per position ({self.num_ranks}) and pipeline ({D})")
        for i, t in enumerate(self.tied):
            if len(set(t.positions)) < 2 or not set(t.positions) <= set(range(self.num_ranks)) or len(t.nbytes) != D:
                raise ValueError(
                    f"tied parameter {t.name!r} needs two or more of the {self.num_ranks} positions "
                    f"(got {t.positions}) and its bytes in each of the {D} pipelines (got {len(t.nbytes)})"
                )
            for r, actions in enumerate(self.actions):
                if actions.count(("tie", i)) != (r in t.positions):
                    raise ValueError(
                        f"position {r} must tie {t.name!r} once if it holds it ({t.positions}), else never"
                    )

    @property
    def num_pipelines(self) -> int:
        return len(self.micro_batches)

    @property
    def num_stages(self) -> int:
        """Stages of a pipeline (its positions times the stages each holds)."""
        return len(self.stages)

    @property
    def num_ranks(self) -> int:
        """Positions (ranks) of a pipeline."""
        return len(self.actions)

    @property
    def stages_per_rank(self) -> int:
        return len(self.stages) // len(self.actions)

    def position_ranks(self, position: int) -> tuple[int, ...]:
        """The rank of `position` in each pipeline."""
        k = self.stage_rank.index(position)
        return self.stages[k].ranks

    def pipeline_batches(self) -> list[int]:
        """Samples each pipeline takes of the global batch."""
        return [self.num_micro_batches * mb for mb in self.micro_batches]

    def to_json(self) -> dict:
        return {
            "kind": "pipeline",
            "schedule": self.schedule,
            "num_micro_batches": self.num_micro_batches,
            "micro_batches": list(self.micro_batches),
            "num_pipelines": self.num_pipelines,
            "stage_rank": list(self.stage_rank),
            **({"sharded_state": True} if self.sharded_state else {}),
            **({"tied": [{"name": t.name, "positions": list(t.positions)} for t in self.tied]} if self.tied else {}),
            "stages": [
                {
                    "groups": list(st.groups),
                    "ranks": list(st.ranks),
                    "send_bytes": [w.send_bytes for w in st.work],
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


def in_flight(actions: Sequence[tuple], stage: int | None = None) -> int:
    """The most micro-batches of one stage (`stage`; None: every stage of the list) a position
    holds the activations of at once (forwards done whose backward is not; a zero-bubble
    backward keeps them until its weights' part): 1F1B's stage s of S holds S - s, GPipe all."""
    most = held = 0
    for a in actions:
        if a[0] not in COMPUTE or (stage is not None and a[1] != stage):
            continue
        held += 1 if a[0] == "F" else -1 if a[0] in ("B", "W") else 0
        most = max(most, held)
    return most


@dataclass(frozen=True)
class StageBytes:
    """What one stage's layers hold on a rank, at its pipeline's micro-batch (stage_memory)."""

    param_bytes: float
    largest_param_bytes: float
    kept_bytes: float  # autograd's saved tensors and the output, of one micro-batch between its passes
    backward_bytes: float  # the most of one micro-batch during its backward
    received_bytes: float  # its input's receive buffer per micro-batch (0 on the first stage)
    sent_bytes: float  # its output's gradient's receive buffer per micro-batch (0 on the last)
    shard_bytes: float = 0.0  # with sharded state, as PipeStage.shard_bytes
    cast_bytes: float = 0.0  # autocast's casts of its parameters, kept the whole step (Memory.casts)


def activation_peak(actions: Sequence[tuple], parts: dict[int, StageBytes]) -> float:
    """The most activation bytes a position holds over its action list: every micro-batch in
    flight keeps `kept_bytes` of its stage, and the one in backward (B, I, or W, which on a
    first stage runs the whole backward) holds `backward_bytes` instead."""
    held = {k: 0 for k in parts}
    total = most = 0.0
    for a in actions:
        kind = a[0]
        if kind not in COMPUTE:
            continue
        k = a[1]
        p = parts[k]
        if kind == "F":
            held[k] += 1
            total += p.kept_bytes
            most = max(most, total)
            continue
        most = max(most, total - p.kept_bytes + p.backward_bytes)
        if kind in ("B", "W"):
            held[k] -= 1
            total -= p.kept_bytes
    return most


def rank_memory(
    actions: Sequence[tuple],
    parts: dict[int, StageBytes],
    num_micro_batches: int,
    bucket_bytes: float,
    shards: int = 1,
) -> Memory:
    """What one rank holds at its peak (bench.core.program.Memory, constants), from its stages'
    bytes at its pipeline's micro-batch:

    - its parameters, their gradients (accumulated over the micro-batches: all exist from the
      first backward on), Adam's two moments, and with replicas the flat copy of the gradient
      bucket they all-reduce (`bucket_bytes`: its gradients up to the bucket's cap), made one
      bucket at a time once the schedule is through (methods.pipeline.trainer): beside every
      gradient, never beside the activations, gone before Adam steps (Memory.backward's second
      point);
    - a receive buffer per micro-batch of the iteration for each stage's input (not on the
      first stage) and for its output's gradient (not on the last), which
      torch.distributed.pipelining allocates once for every micro-batch (held for the step);
    - the activations of the micro-batches in flight at once (activation_peak);
    - under autocast, its parameters' casts (StageBytes.cast_bytes, Memory.casts).

    `shards` > 1: sharded state over that many replicas (FSDP2, as torch's pipelining drives
    it): the rank keeps 1/shards of its parameters, gradients and moments; during the schedule
    it also holds the gathered parameters (the all-gather's padded output, shards x its shard)
    and their unsharded gradients, accumulated over the micro-batches (two points of
    Memory.backward: beside the activations, and at the reduce-scatter, the gathered
    parameters freed and the gradients copied into its padded flat input, the shard of its
    output beside them)."""
    params = sum(p.param_bytes for p in parts.values())
    buffers = num_micro_batches * sum(p.received_bytes + p.sent_bytes for p in parts.values())
    largest = max((p.largest_param_bytes for p in parts.values()), default=0.0)
    casts = Affine(sum(p.cast_bytes for p in parts.values()))
    activations = activation_peak(actions, parts)
    if shards > 1:
        shard = sum(p.shard_bytes or p.param_bytes / shards for p in parts.values())
        gathered = shards * shard
        return Memory(
            params=Affine(shard),
            grads=Affine(shard),
            optimizer=Affine(2.0 * shard),
            activations=Affine(activations),
            buckets=Affine(buffers),
            casts=casts,
            backward=(
                (Affine(gathered + params), Affine(activations)),
                (Affine(params + gathered + shard), Affine()),
            ),
            largest_param=Affine(largest / shards),
        )
    return Memory(
        params=Affine(params),
        grads=Affine(params),
        optimizer=Affine(2.0 * params),
        activations=Affine(activations),
        buckets=Affine(buffers),
        casts=casts,
        backward=((Affine(params), Affine(activations)), (Affine(params + bucket_bytes), Affine())),
        largest_param=Affine(largest),
    )


def stage_peak(memory: Memory, foreach: bool) -> float:
    """Bytes a rank holds at its peak: the larger of backward's (every gradient, the
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
    shards: int = 1,
    shard_bytes: float = 0.0,
    cast_bytes: float = 0.0,
) -> float:
    """stage_peak(rank_memory(...)) of a rank that holds one stage with `in_flight` micro-batches
    at its peak, in plain arithmetic, for a planner that checks many cuts."""
    buffers = num_micro_batches * (received_bytes + sent_bytes)
    activations = max(in_flight - 1, 0) * kept_bytes + backward_bytes
    if shards > 1:  # rank_memory's sharded state: no bucket
        shard = shard_bytes or param_bytes / shards
        step = shard if foreach else 2.0 * largest_param_bytes / shards
        held = 3.0 * shard + buffers + cast_bytes
        gathered = shards * shard
        return max(
            held + gathered + param_bytes + activations, held + gathered + param_bytes + shard, held + shard + step
        )
    resident = 4.0 * param_bytes + buffers + cast_bytes
    step = param_bytes if foreach else 2.0 * largest_param_bytes  # Adam's temporaries (Memory.optimizer_step)
    return resident + max(activations, bucket_bytes, step)


def transfer_s(nbytes: float, cluster: ClusterSpec, src: int, dst: int) -> float:
    """Seconds of one point-to-point transfer of `nbytes` from rank `src` to `dst`: the
    alpha-beta time of the link they span (a broadcast between two ranks: the bytes cross it
    once), never less than the host transport's floor for one (emulated CPU clusters; zero
    elsewhere). The emulated link paces the runtime's sends by the same time (bench.runtime.p2p)."""
    link = cluster.link_between([src, dst])
    return max(collective_time_s("broadcast", nbytes, 2, link), cluster.floor_s("p2p"))


def measured_scale(program: PipelineProgram, cluster: ClusterSpec, pipeline: int = 0) -> float:
    """How much longer the host computes now than when the stages were timed: its plain step at
    the pipeline's micro-batch as the cluster's host speed prices it (per-sample part and
    per-step part: at a run's prediction, the run's own yardstick,
    bench.runtime.hostspeed.yardstick, which times that step at that size), over the same step
    timed with the stages. A ratio of two whole steps: the per-sample rate alone comes from the
    difference of two timings and moved 50% between runs where whole steps moved 10-20%."""
    if not program.profile_step_s or not program.profile_step_s[pipeline] or not cluster.host_flops:
        return 1.0
    mb = program.micro_batches[pipeline]
    now = program.flops_per_sample * mb / cluster.host_flops + cluster.host_step_overhead_s
    return now / program.profile_step_s[pipeline]


class StageTimes(NamedTuple):
    """Seconds of one micro-batch's passes of a stage on one rank, in COMPUTE's order."""

    forward: float
    backward: float
    input: float  # zero-bubble's backward for the input
    weight: float  # and for the weights


_PASS = {kind: i for i, kind in enumerate(COMPUTE)}


def action_times(
    program: PipelineProgram, cluster: ClusterSpec, vdevs: list[VirtualDevice] | None = None
) -> list[list[StageTimes]]:
    """Per stage and pipeline, the passes of one micro-batch on its rank (StageTimes)."""
    vdevs = vdevs or virtual_devices(cluster, "gpu")
    alg = FloatAlgebra([[1.0 / len(vdevs)] * len(vdevs)])
    scales = [measured_scale(program, cluster, p) for p in range(program.num_pipelines)]
    out = []
    for k, st in enumerate(program.stages):
        row = []
        for p, (r, w) in enumerate(zip(st.ranks, st.work)):
            v, dev = vdevs[r], cluster.devices[r]
            split = None
            if w.measured is not None:
                fwd, bwd = w.measured[0] * scales[p] / dev.speed, w.measured[1] * scales[p] / dev.speed
                if w.measured_split is not None:
                    split = tuple(x * scales[p] / dev.speed for x in w.measured_split)
            else:
                # The per-step part of a plain step, spread over the model's kernels (emulated workers).
                per_kernel = dev.step_overhead_s / program.model_launches if program.model_launches else 0.0
                fwd = float(sum(device_compute(s, cluster, v, alg) for s in w.forward) + per_kernel * w.launches[0])
                bwd = float(sum(device_compute(s, cluster, v, alg) for s in w.backward) + per_kernel * w.launches[1])
            if k == 0:  # torch's input backward on a first stage does nothing; its weights' does all
                row.append(StageTimes(fwd, bwd, 0.0, bwd))
            elif split is not None:
                row.append(StageTimes(fwd, bwd, *split))
            else:
                row.append(StageTimes(fwd, bwd, bwd * (1.0 - w.weight_share), bwd * w.weight_share))
        out.append(row)
    return out


def transfer_times(program: PipelineProgram, cluster: ClusterSpec, pipeline: int) -> list[float]:
    """Per stage of one pipeline, seconds of sending its output to the next stage (and of its
    gradient back: the same bytes over the same link); 0 where the next stage is on the same
    rank (torch passes it in memory) or there is none."""
    out = []
    K = program.num_stages
    for k, st in enumerate(program.stages):
        if k + 1 == K or program.stage_rank[k] == program.stage_rank[k + 1]:
            out.append(0.0)
        else:
            nxt = program.stages[k + 1].ranks[pipeline]
            out.append(transfer_s(st.work[pipeline].send_bytes, cluster, st.ranks[pipeline], nxt))
    return out


def replay(
    program: PipelineProgram, cluster: ClusterSpec, pipeline: int, times: list[StageTimes], sends: list[float]
) -> list[RankTimeline]:
    """Run one pipeline's action lists (module docstring) and return each position's timeline.

    `times`: per stage, its passes of one micro-batch; `sends`: per stage, seconds of a transfer
    of its output (or of that output's gradient back)."""
    n = program.num_ranks
    where = program.stage_rank
    clock = [0.0] * n
    pc = [0] * n
    link_free = [0.0] * n  # each rank's sending link
    arrived: dict[tuple[str, int, int], float] = {}  # (what, mb, receiving stage) -> when it arrived
    posted: list[dict[int, tuple]] = [{} for _ in range(n)]  # id -> ("done", t) or ("recv", key)
    compute = [0.0] * n
    tie_s = tied_seconds(program, cluster, pipeline)
    while True:
        moved = False
        for r in range(n):
            acts = program.actions[r]
            while pc[r] < len(acts):
                a = acts[pc[r]]
                kind = a[0]
                if kind in COMPUTE:
                    d = times[a[1]][_PASS[kind]]
                    clock[r] += d
                    compute[r] += d
                elif kind == "tie":
                    holders = program.tied[a[1]].positions
                    if any(pc[q] == len(program.actions[q]) or program.actions[q][pc[q]] != a for q in holders):
                        break  # a holder is not through its schedule yet
                    done = max(clock[q] for q in holders) + tie_s[a[1]]
                    for q in holders:
                        clock[q] = done
                        pc[q] += 1
                    moved = True
                    continue
                elif kind == "send":
                    _, ident, what, k, mb = a
                    to = k + 1 if what == "act" else k - 1
                    assert where[to] != r, f"stage {k} sends to stage {to} on its own rank"
                    begin = max(clock[r], link_free[r])
                    done = begin + sends[k if what == "act" else to]
                    link_free[r] = done
                    arrived[(what, mb, to)] = done
                    posted[r][ident] = ("done", done)
                elif kind == "recv":
                    _, ident, what, k, mb = a
                    posted[r][ident] = ("recv", (what, mb, k))
                elif kind == "wait":
                    ends = _waited(posted[r], a[1], arrived)
                    if ends is None:
                        break  # a transfer it waits on was not sent yet
                    clock[r] = max([clock[r], *ends])
                    pc[r] += 1
                    moved = True
                    continue
                else:
                    raise ValueError(f"position {r}: unknown action {a!r}")
                pc[r] += 1
                moved = True
        if all(pc[r] == len(program.actions[r]) for r in range(n)):
            break
        if not moved:
            stuck = {r: program.actions[r][pc[r]] for r in range(n) if pc[r] < len(program.actions[r])}
            raise ValueError(f"the schedule's actions deadlock: waiting at {stuck}")
    return [RankTimeline(compute_s=compute[r], end_s=clock[r]) for r in range(n)]


def tied_seconds(program: PipelineProgram, cluster: ClusterSpec, pipeline: int) -> list[float]:
    """Per tied parameter (PipelineProgram.tied), seconds of its gradient's all-reduce among the
    ranks of pipeline `pipeline` that hold it (grad_sync_s of one bucket of its bytes)."""
    return [
        grad_sync_s((t.nbytes[pipeline],), [program.position_ranks(r)[pipeline] for r in t.positions], cluster)
        for t in program.tied
    ]


def shard_collective_s(kind: str, nbytes: float, ranks: Sequence[int], cluster: ClusterSpec) -> float:
    """Seconds of one all-gather ("gather") or reduce-scatter ("scatter") of a stage's `nbytes`
    (the whole parameters) among its replicas `ranks`, over the link they span (sharded state)."""
    if len(ranks) < 2:
        return 0.0
    name = "all_gather" if kind == "gather" else "reduce_scatter"
    link = cluster.link_between(list(ranks))
    return max(collective_time_s(name, nbytes, len(ranks), link), cluster.floor_s(name))


def replay_all(
    program: PipelineProgram,
    cluster: ClusterSpec,
    times: list[list[StageTimes]],
    sends: list[list[float]],
) -> dict[tuple[int, int], RankTimeline]:
    """Every pipeline's action lists replayed together (replay's rules), for a program whose
    lists hold collectives among a stage's replicas (COLLECTIVES): one starts when the last of
    the stage's replicas reaches it, and all of them leave it together, its time later.
    `times[p][k]`, `sends[p][k]`: pipeline p's (replay). Pipelines of equal times, sends and
    tied all-reduces run in step, so one of each kind is replayed and stands for the others (a
    collective waits for the latest of the kinds). Returns (position, pipeline) -> RankTimeline."""
    n, D = program.num_ranks, program.num_pipelines
    where = program.stage_rank
    tie_s = [tuple(tied_seconds(program, cluster, p)) for p in range(D)]
    kind_of: dict[tuple, int] = {}
    alike = [kind_of.setdefault((tuple(times[p]), tuple(sends[p]), tie_s[p]), p) for p in range(D)]
    kinds = list(kind_of.values())  # a pipeline of each kind, the first
    lanes = [(r, p) for p in kinds for r in range(n)]
    index = {lane: x for x, lane in enumerate(lanes)}  # each lane's state at its index below
    clock = [0.0] * len(lanes)
    pc = [0] * len(lanes)
    link_free = [0.0] * len(lanes)
    compute = [0.0] * len(lanes)
    arrived: dict[tuple, float] = {}  # (pipeline, what, mb, receiving stage) -> when it arrived
    posted: list[dict[int, tuple]] = [{} for _ in lanes]
    acts_of = [program.actions[r] for r, _ in lanes]
    count = [len(acts) for acts in acts_of]
    replicas = [[index[(r, q)] for q in kinds] for r, _ in lanes]  # its position's lanes, by kind
    coll_s = {
        (kind, k): shard_collective_s(
            kind,
            ((st.shard_bytes or st.param_bytes / D) + (st.copy_shard_bytes or st.copy_bytes / D)) * D,
            st.ranks,
            cluster,
        )
        for kind in COLLECTIVES
        for k, st in enumerate(program.stages)
    }
    while True:
        moved = False
        for x, (r, p) in enumerate(lanes):
            acts, end, passes, out = acts_of[x], count[x], times[p], sends[p]
            while pc[x] < end:
                a = acts[pc[x]]
                kind = a[0]
                if kind in COMPUTE:
                    d = passes[a[1]][_PASS[kind]]
                    clock[x] += d
                    compute[x] += d
                elif kind in COLLECTIVES:
                    # every replica at this same action (their lists are one position's)
                    here, peers = pc[x], replicas[x]
                    if any(pc[q] < here for q in peers):
                        break
                    if all(pc[q] == here for q in peers):
                        done = max(clock[q] for q in peers) + coll_s[(kind, a[1])]
                        for q in peers:
                            clock[q] = done
                            pc[q] += 1
                        moved = True
                        continue
                    break
                elif kind == "tie":  # among the holders of this pipeline, as replay
                    holders = [index[(q, p)] for q in program.tied[a[1]].positions]
                    if any(pc[h] == count[h] or acts_of[h][pc[h]] != a for h in holders):
                        break
                    done = max(clock[h] for h in holders) + tie_s[p][a[1]]
                    for h in holders:
                        clock[h] = done
                        pc[h] += 1
                    moved = True
                    continue
                elif kind == "send":
                    _, ident, what, k, mb = a
                    to = k + 1 if what == "act" else k - 1
                    assert where[to] != r, f"stage {k} sends to stage {to} on its own rank"
                    begin = max(clock[x], link_free[x])
                    done = begin + out[k if what == "act" else to]
                    link_free[x] = done
                    arrived[(p, what, mb, to)] = done
                    posted[x][ident] = ("done", done)
                elif kind == "recv":
                    _, ident, what, k, mb = a
                    posted[x][ident] = ("recv", (p, what, mb, k))
                elif kind == "wait":
                    ends = _waited(posted[x], a[1], arrived)
                    if ends is None:
                        break
                    clock[x] = max([clock[x], *ends])
                    pc[x] += 1
                    moved = True
                    continue
                else:
                    raise ValueError(f"position {r}: unknown action {a!r}")
                pc[x] += 1
                moved = True
        if all(pc[x] == count[x] for x in range(len(lanes))):
            break
        if not moved:
            stuck = {lane: acts_of[x][pc[x]] for x, lane in enumerate(lanes) if pc[x] < count[x]}
            raise ValueError(f"the schedule's actions deadlock: waiting at {stuck}")
    return {
        (r, p): RankTimeline(compute_s=compute[index[(r, alike[p])]], end_s=clock[index[(r, alike[p])]])
        for p in range(D)
        for r in range(n)
    }


def grad_sync_s(buckets: Sequence[float], ranks: Sequence[int], cluster: ClusterSpec) -> float:
    """Seconds of the all-reduces of a position's gradient buckets among its replicas (`ranks`),
    one after another (what the runtime does once its schedule is through)."""
    if len(ranks) < 2:
        return 0.0
    link = cluster.link_between(list(ranks))
    return sum(
        max(collective_time_s("all_reduce", nbytes, len(ranks), link), cluster.floor_s("all_reduce"))
        for nbytes in buckets
    )


def optimizer_s(
    program: PipelineProgram, position: int, pipeline: int, cluster: ClusterSpec, v: VirtualDevice, scale: float = 1.0
) -> float:
    """A rank's per-step part after its last action: Adam's step over its stages' parameters
    (emulated workers: as measured, times `scale`, else Adam's per-byte cost), a profile's
    optimizer step (GPUs), the method's host work. With sharded state Adam steps the rank's
    share: 1/r of the bytes (and of the measured step). Its copies of tied parameters
    (PipeStage.copy_bytes) step at its groups' measured rate per byte, or Adam's per-byte cost."""
    mine = [st for k, st in enumerate(program.stages) if program.stage_rank[k] == position]
    rank = mine[0].ranks[pipeline]
    dev = cluster.devices[rank]
    D = program.num_pipelines

    def share(st: PipeStage) -> float:
        if not program.sharded_state:
            return 1.0
        return st.shard_bytes / st.param_bytes if st.shard_bytes and st.param_bytes else 1.0 / D

    def copies(st: PipeStage) -> float:
        if not program.sharded_state:
            return st.copy_bytes
        return st.copy_shard_bytes or st.copy_bytes / D

    param_bytes = sum(share(st) * st.param_bytes + copies(st) for st in mine)
    t = 0.0
    for st in mine:
        w = st.work[pipeline]
        own = w.measured[2] * scale / dev.speed if w.measured is not None else dev.optimizer_s_per_byte * st.param_bytes
        per_byte = own / st.param_bytes if w.measured is not None and st.param_bytes else dev.optimizer_s_per_byte
        t += share(st) * own + per_byte * copies(st)
    if v.compute is not None and v.compute.optimizer is not None:
        fixed, rate = v.compute.optimizer
        t += fixed + param_bytes / rate
    if program.host_work_flops:
        t += program.host_work_flops / dev.effective_flops
    return t


class PipelineMemory(NamedTuple):
    """Per device, what a pipeline's rank holds (simulate_pipeline's memory fields)."""

    memory_gib: list[dict]  # its parts: params, grads, optimizer, buckets, activations
    peak_mem_gib: list[float]
    oom_devices: list[int]  # the devices whose peak passes their memory (less the reserve)


def pipeline_memory(
    program: PipelineProgram,
    cluster: ClusterSpec,
    memory_reserve_gib: float = 0.0,
    vdevs: list[VirtualDevice] | None = None,
) -> PipelineMemory:
    """What each rank of a pipeline holds at its peak, and which pass their memory: the memory
    simulate_pipeline reports, without replaying the schedule (a planner checks it first)."""
    R = program.num_ranks
    return ranks_memory(
        [program.position_ranks(r) for r in range(R)], program.memory, cluster, memory_reserve_gib, vdevs
    )


def ranks_memory(
    position_ranks: Sequence[Sequence[int]],
    memory: Sequence[Sequence[Memory]],
    cluster: ClusterSpec,
    memory_reserve_gib: float = 0.0,
    vdevs: list[VirtualDevice] | None = None,
) -> PipelineMemory:
    """pipeline_memory of the positions' ranks (`position_ranks[r][p]`: position r's rank in
    pipeline p) holding `memory[r][p]` (PipelineProgram.memory), before the program is made."""
    vdevs = vdevs or virtual_devices(cluster, "gpu")
    memory_gib, peaks, oom_devices = [], [], []
    foreach = cluster.device == "cuda"
    mem_of = {ranks[p]: memory[r][p] for r, ranks in enumerate(position_ranks) for p in range(len(ranks))}
    for v in vdevs:
        mem = mem_of[v.index]
        parts = {k: getattr(mem, k).const / GIB for k in ("params", "grads", "optimizer", "buckets", "activations")}
        peak = stage_peak(mem, foreach) / GIB
        if v.compute is not None:
            peak += v.compute.workspace_bytes / GIB
        memory_gib.append(parts)
        peaks.append(peak)
        if peak > v.memory_bytes / GIB - memory_reserve_gib:
            oom_devices.append(v.index)
    return PipelineMemory(memory_gib, peaks, oom_devices)


def compute_bound(program: PipelineProgram, cluster: ClusterSpec) -> float:
    """A lower bound of simulate_pipeline's iteration, without replaying the schedule: the
    busiest rank's forwards and backwards back to back, then its optimizer step. A rank's
    clock in the replay adds the same passes' seconds in the same order (replay, replay_all)
    and only waits beside them, and its iteration ends no sooner than its clock, plus the
    same per-step part, so no rank's end is below this sum of its own."""
    vdevs = virtual_devices(cluster, "gpu")
    times = action_times(program, cluster, vdevs)
    most = 0.0
    for r in range(program.num_ranks):
        acts = [(a[1], _PASS[a[0]]) for a in program.actions[r] if a[0] in COMPUTE]
        for p, rank in enumerate(program.position_ranks(r)):
            compute = 0.0
            for k, i in acts:
                compute += times[k][p][i]
            scale = measured_scale(program, cluster, p)
            most = max(most, compute + optimizer_s(program, r, p, cluster, vdevs[rank], scale))
    return most


def simulate_pipeline(program: PipelineProgram, cluster: ClusterSpec, memory_reserve_gib: float = 0.0):
    """Predicted iteration time and per-rank memory of a pipeline (bench.cost.SimResult)."""
    vdevs = virtual_devices(cluster, "gpu")
    if len(vdevs) != program.num_devices:
        raise ValueError(
            f"the pipeline is for {program.num_devices} devices, but cluster {cluster.name!r} has "
            f"{len(vdevs)}; plan for this cluster"
        )
    times = action_times(program, cluster, vdevs)
    K, R, D = program.num_stages, program.num_ranks, program.num_pipelines
    lines: dict[tuple[int, int], RankTimeline] = {}  # (position, pipeline)
    seen: dict[tuple, list[RankTimeline]] = {}
    sends = [transfer_times(program, cluster, p) for p in range(D)]
    if program.sharded_state:  # collectives among replicas inside the schedule: all at once
        lines = replay_all(program, cluster, [[times[k][p] for k in range(K)] for p in range(D)], sends)
    for p in range(D if not program.sharded_state else 0):
        # pipelines alike price alike
        key = (tuple(times[k][p] for k in range(K)), tuple(sends[p]), tuple(tied_seconds(program, cluster, p)))
        if key not in seen:
            seen[key] = replay(program, cluster, p, [times[k][p] for k in range(K)], sends[p])
        for r, line in enumerate(seen[key]):
            lines[(r, p)] = line
    per_rank: dict[int, RankTimeline] = {}
    for r in range(R):  # replicas all-reduce once the last of them is through
        ranks = program.position_ranks(r)
        sync = grad_sync_s(program.grad_buckets[r] if program.grad_buckets else (), ranks, cluster)
        start = max(lines[(r, p)].end_s for p in range(D))
        for p, rank in enumerate(ranks):
            line = lines[(r, p)]
            scale = measured_scale(program, cluster, p)
            per_rank[rank] = RankTimeline(
                line.compute_s,
                start + sync,
                optimizer_s(program, r, p, cluster, vdevs[rank], scale),
                start + sync - line.end_s,
            )
    iter_time = max(t.end_s + t.optimizer_s for t in per_rank.values())
    busiest = max(per_rank.values(), key=lambda t: t.compute_s + t.optimizer_s)
    stage_times = []
    m = program.num_micro_batches
    for k in range(K):  # pipeline 0's: each stage's sends and compute over the iteration
        t = times[k][0]
        stage_times.append((sends[0][k] * m, (t.forward + t.backward) * m))
    memory, peaks, oom_devices = pipeline_memory(program, cluster, memory_reserve_gib, vdevs)
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


def _waited(posted: dict, idents, arrived: dict) -> list[float] | None:
    """When each transfer a wait names is done (a send: when it left; a receive: when its data
    arrived), or None while one it waits on was not sent yet."""
    ends = []
    for ident in idents:
        state, value = posted[ident]
        if state == "recv":
            if value not in arrived:
                return None
            value = arrived[value]
        ends.append(value)
    return ends
