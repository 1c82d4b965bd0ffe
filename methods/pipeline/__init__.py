"""Pipeline parallelism on mixed devices, run by torch.distributed.pipelining.

The model is cut into stages at layer-group borders (methods.common: embeddings, blocks, conv
stages, head). A pipeline's ranks take slots of the cluster: a device, a machine, or a group of
devices or machines (`stage_level`, `num_stages`); a slot of several devices runs one pipeline
per device, data parallel across the pipelines (a rank's replicas sum their gradients once the
schedule is through). Each pipeline takes a share of the global batch in proportion to its
priced speed (`shares`), in the same number of micro-batches, so that pipelines on unlike
devices finish together; the loss of every micro-batch is its summed loss over the global
batch's targets, so the pipelines' gradients add up to single-device training's.

What runs where is chosen by pricing: for each schedule of torch's (1F1B, GPipe, the
interleaved and looped ones with several stages per rank, the zero-bubble ones), each number
of micro-batches torch's schedule takes, each order of the slots, a dynamic program over the
layer groups' costs (the same price the planner's Programs get, or on an emulated CPU cluster
the groups' measured time) finds the cuts whose slowest stage is fastest among those that fit
their devices' memory, and the pipelines' shares are balanced for them; the simulator
(bench.cost.pipeline) replays the best candidates' schedules and the fastest is kept. The
schedule is torch's own: the planner traces it with stand-in stages, so the actions it prices
are the ones the runtime calls, in the same order, with the stages where torch places them.

At run time each rank captures the model with torch.export (methods.export, the graph the
planner priced), keeps the nodes of each of its stages as a GraphModule (the parameters it
reads, the values that cross its borders as inputs and outputs), and runs them as
PipelineStages. The ops that read the targets (the loss) run as the schedule's loss function on
the last stage. It does not mix tensor parallelism into a stage.

Tied parameters (a Hugging Face model's embedding and head, one tensor read by the first layer
group and the last): stages on one position read one tensor, whose gradient autograd sums; where
stages on several positions read it (planning.tied_params), each of those ranks holds a copy,
and once the schedule is through (after the reduce-scatter, with sharded state: the shards line
up, each replica's at its pipeline's index) they sum the copies' gradients with an all-reduce
among the pipeline's holders, before the replicas' sync and the clipping norm (which counts the
parameter once). Every copy then takes the whole gradient and the same Adam step. The
PipelineProgram prices that all-reduce where it runs ("tie" actions, bench.cost.pipeline), and
each holder's memory its copy's weights, gradient and Adam state (planning._Costs.tied_copies).

Sharded state (`sharded_state`): the replicas of a stage (its ranks in the other pipelines)
shard its parameters, gradients and Adam state with FSDP2's fully_shard over a mesh of just
them, the stage's module one unit, as torch's pipelining drives it: the parameters gathered
before the schedule starts (every stage at once, not each at its first forward, where the
pipeline's stages would wait for each other's in turn) and kept through it (no reshard after
forward), the gradients accumulated unsharded over the micro-batches and reduce-scattered
(summed, not averaged: each pipeline's loss is already its part of the global one) once the
schedule is through (torch's perform_reduce_grad); Adam steps the rank's shard. It replaces the replicas'
all-reduce; a rank holds 1/r of its stage's state, plus the gathered parameters and the
unsharded gradients while the schedule runs (bench.cost.pipeline.rank_memory). It runs under
the single-stage schedules (1f1b, gpipe); with one pipeline there are no replicas and it
changes nothing.

The method (PipelineParallel) is here; its parts: schedule (torch's schedules traced),
planning (slots, orders, micro-batches, shares, priced costs, the cuts' dynamic program),
profile (the layer groups timed on this host), cut (a stage of the traced model), trainer (a
rank at run time).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError, PlanningError
from bench.core.interfaces import Plan, RankContext, Workload
from bench.core.program import Memory
from bench.core.shares import offsets
from bench.cost.pipeline import (
    COMPUTE,
    SCHEDULES,
    PipelineProgram,
    PipeStage,
    StageWork,
    TiedParam,
    compute_bound,
    in_flight,
    pipeline_memory,
    rank_memory,
    ranks_memory,
    simulate_pipeline,
)
from bench.runtime.method_step import time_method_step
from methods.common import GroupTable, check_training_options, group_table, refuse_global_batch_norm
from methods.graph import capture_priced
from methods.pipeline.cut import cut_graph
from methods.pipeline.planning import (
    ALIKE,
    Layout,
    _Costs,
    balance_shares,
    best_cuts,
    layouts,
    micro_batch_counts,
    replica_buckets,
    slot_orders,
    sync_seconds,
    tied_params,
)
from methods.pipeline.profile import group_profile
from methods.pipeline.schedule import (
    ScheduleRefused,
    Trace,
    check_schedule,
    compute_order,
    is_multi_stage,
    save_traces,
    trace_schedule,
)
from methods.pipeline.trainer import PipelineTrainer

__all__ = [
    "PipelineParallel",
    "PipelineTrainer",
    "SharedCosts",
    "StageOOM",
    "balance_shares",
    "best_cuts",
    "cut_graph",
    "group_profile",
    "layouts",
    "micro_batch_counts",
    "save_traces",
    "slot_orders",
    "trace_schedule",
]

log = logging.getLogger(__name__)

STAGE_LEVELS = ("auto", "device", "machine")
SHARES = ("priced", "equal")
SHARDED_STATE = (False, True, "auto")
SIMULATED = 4  # candidates per schedule replayed exactly, the best priced first
# The most forwards (micro-batches x stages) a rank of a multi-stage schedule is searched at:
# torch lowers those schedules to communication in time quadratic in a rank's actions (0.1-0.4 s
# a trace at this size), where the single-stage ones are searched at every micro-batch count.
MAX_MULTI_FORWARDS = 256


class StageOOM(PlanningError):
    status = "oom"


@dataclass(frozen=True)
class _Candidate:
    """One way to run the pipelines, with its balanced-pipeline estimate."""

    estimate_s: float
    schedule: str
    layout: Layout
    order: tuple[tuple[int, ...], ...]  # a slot per position
    stages_per_rank: int
    m: int
    micro_batches: tuple[int, ...]  # per pipeline
    cuts: tuple[int, ...]
    stage_rank: tuple[int, ...]  # the position of each stage
    sharded: bool = False  # each stage's state sharded over its replicas


class PipelineParallel:
    """Pipeline parallelism over the cluster's devices (module docstring).

    Args:
        name: the method's name in records.
        schedule: "auto" (the fastest priced) or a torch schedule (bench.cost.pipeline.SCHEDULES:
            "1f1b", "gpipe", "interleaved1f1b", "loopedbfs", "interleavedzerobubble",
            "zbvzerobubble", "dualpipev").
        num_micro_batches: micro-batches per pipeline and iteration, or "auto" (priced).
        stage_level: what a position's slot is cut from: "device", "machine" or "auto" (both).
        num_stages: ranks per pipeline, a divisor of the devices (machines); "auto": the
            fastest priced of those up to the model's layer groups.
        stages_per_rank: stages each rank of a pipeline holds: 1 for torch's single-stage
            schedules, 2 for the V-shaped ones, 2 or more for the looped ones; "auto": priced.
        shares: "priced" (each pipeline's batch in proportion to its priced speed) or "equal".
        alike: what alike hardware is kept together in (planning.layouts): "stage" (a stage's
            replicas), "pipeline" (a pipeline's ranks, its replicas unlike) or "auto" (both).
        activation_checkpointing: each layer group of a stage under torch.utils.checkpoint (its
            activations recomputed in backward: more compute, a smaller activation peak).
        sharded_state: false, true (a stage's state sharded over its replicas, module
            docstring; single-stage schedules only) or "auto" (both priced, the faster that
            fits kept).
        bucket_cap_mb: the gradient bucket a rank's replicas all-reduce at a time (MiB).
        lr: Adam's learning rate (the paper: 5e-4).
        grad_clip: max global gradient norm; 0 disables clipping.
        profile: emulated CPU clusters: price the stages from the layer groups' time on this
            host (group_profile, cached) instead of their FLOPs.
        work_probe: emulated CPU clusters with a profile: time the chosen plan's trainer on
            the cluster's ranks once per host, workload and plan (cached) and price the
            schedule's own work beside the groups' (_probed).
    """

    worker_modules = ("torch.distributed.pipelining",)
    materializes = True  # a rank materialises its stages' parameters alone (PipelineTrainer)
    mirror_full_state = False  # tests: write every stage's parameters and gradients into the full model
    memory_before_trace = True  # check a candidate's memory before tracing it (tests turn it off)
    bound_before_replay = True  # skip the replay of a candidate whose compute_bound is no faster than the best

    def __init__(
        self,
        name: str = "pipeline",
        schedule: str = "auto",
        num_micro_batches="auto",
        stage_level: str = "auto",
        num_stages="auto",
        stages_per_rank="auto",
        shares: str = "priced",
        alike: str = "auto",
        activation_checkpointing: bool = False,
        bucket_cap_mb: float = 25.0,
        lr: float = 5e-4,
        grad_clip: float = 0.0,
        profile: bool = True,
        sharded_state=False,
        work_probe: bool = True,
    ):
        check_schedule(schedule)
        if sharded_state not in SHARDED_STATE:
            raise ConfigError(f"method.sharded_state={sharded_state!r} is unknown; use false, true or auto")
        if sharded_state is True and schedule != "auto" and is_multi_stage(schedule):
            raise ConfigError(
                f"method.sharded_state=true runs under the single-stage schedules (1f1b, gpipe), not "
                f"method.schedule={schedule}; use method.schedule=1f1b, gpipe or auto"
            )
        for field_, value in (
            ("num_micro_batches", num_micro_batches),
            ("num_stages", num_stages),
            ("stages_per_rank", stages_per_rank),
        ):
            whole = isinstance(value, int) and not isinstance(value, bool)
            if value != "auto" and (not whole or value < 1):
                raise ConfigError(f"method.{field_}={value!r} must be auto or an integer >= 1; e.g. method.{field_}=2")
        if stage_level not in STAGE_LEVELS:
            raise ConfigError(f"method.stage_level={stage_level!r} is unknown; use one of {', '.join(STAGE_LEVELS)}")
        if shares not in SHARES:
            raise ConfigError(f"method.shares={shares!r} is unknown; use one of {', '.join(SHARES)}")
        if alike not in ALIKE:
            raise ConfigError(f"method.alike={alike!r} is unknown; use one of {', '.join(ALIKE)}")
        if schedule != "auto" and stages_per_rank != "auto":
            _check_stages_per_rank(schedule, stages_per_rank)
        if not isinstance(work_probe, bool):
            raise ConfigError(f"method.work_probe={work_probe!r} is invalid; use true or false")
        check_training_options(lr, grad_clip, bucket_cap_mb)
        self.name = name
        self.modes = ("real", "sim")
        self.schedule = schedule
        self.num_micro_batches = num_micro_batches
        self.stage_level = stage_level
        self.num_stages = num_stages
        self.stages_per_rank = stages_per_rank
        self.shares = shares
        self.alike = alike
        self.activation_checkpointing = bool(activation_checkpointing)
        self.bucket_cap_mb = bucket_cap_mb
        self.lr = lr
        self.grad_clip = grad_clip
        self.profile = profile
        self.sharded_state = sharded_state
        self.work_probe = work_probe
        # The simulator's result for the program the last search chose (auto prices a plan of this
        # part by it where the plan holds that program, not simulating it again).
        self.simulated = None

    # -- plan ------------------------------------------------------------------------------------
    def plan(self, workload: Workload, cluster: ClusterSpec, shared: SharedCosts | None = None) -> Plan:
        """The fastest pipelines that fit (module docstring). `shared`: the priced costs of
        `workload` on `cluster` kept across plans (SharedCosts; a caller planning several stage
        counts or states of one case), the same plan as without it. With the work probe (on an
        emulated CPU cluster with the profile), the plan chosen is timed on the cluster's ranks,
        the candidates are searched again with the schedule's own work that measured per action,
        and a plan that then differs is timed too and priced with its own (_probed). What torch
        traced is kept on disk for later processes (save_traces) when the plan is done, or with
        `shared`, by the caller once its plans are (each save writes the whole file)."""
        try:
            return self._planned(workload, cluster, shared or SharedCosts(workload, cluster))
        finally:
            if shared is None:
                save_traces()

    def _planned(self, workload: Workload, cluster: ClusterSpec, shared: SharedCosts) -> Plan:
        shared.check(workload, cluster)
        c, program, costs = self._search(workload, cluster, shared, 0.0)
        if not (costs.profile is not None and self.work_probe and cluster.num_devices > 1):
            return self._plan(c, program, workload)
        first = self._probed(c, program, costs, workload, cluster)
        action_s = first.details["work"]["action_s"] if "work" in first.details else 0.0
        if not action_s:
            return first
        again, program, costs = self._search(workload, cluster, shared, action_s)
        if self._plan(again, program, workload).details == {k: v for k, v in first.details.items() if k != "work"}:
            return first  # the same plan: priced with its own measurement already
        return self._probed(again, program, costs, workload, cluster)

    def _search(
        self, workload: Workload, cluster: ClusterSpec, shared: SharedCosts, action_s: float
    ) -> tuple[_Candidate, PipelineProgram, _Costs]:
        """The fastest candidate that fits, its program and the costs that priced it, each
        compute action `action_s` profiled seconds longer (_Costs.action_s); StageOOM or
        ConfigError where none fits or plans."""
        graph = capture_priced(workload.model_cfg, workload.global_batch, workload.precision, cluster.device)
        refuse_global_batch_norm(workload, graph, "pipeline", "each micro-batch")
        table = group_table(graph)
        model_launches = float(sum(g.launches for g in table.groups))
        layouts_, refusals = layouts(cluster, self.stage_level, self.num_stages, table.num_groups, self.alike)
        profiled = self.profile and cluster.emulated and cluster.device == "cpu" and cluster.host_flops is not None
        costs = shared.costs(
            graph,
            table,
            profiled,
            0.0 if profiled else model_launches,
            self.bucket_cap_mb,
            self.activation_checkpointing,
            action_s,
        )
        found: list[_Candidate] = []
        oom: list[tuple[float, str]] = []
        for layout in layouts_:
            found += self._candidates(layout, table, costs, workload, cluster, refusals, oom)
        if not found:
            if oom:  # the layout that came closest to fitting
                raise StageOOM(min(oom)[1])
            raise ConfigError(
                refusals[0] if refusals else f"{workload.name} cannot be pipelined on cluster={cluster.name}"
            )
        # over: (peak GiB, index, candidate, memory) of those over memory; refused: (index, why)
        best, over, refused, untraced = None, [], [], []
        index = 0
        for schedule in dict.fromkeys(c.schedule for c in found):
            ranked = sorted((c for c in found if c.schedule == schedule), key=lambda c: c.estimate_s)
            priced = 0
            for c in ranked[: 3 * SIMULATED]:  # past those that do not fit, SIMULATED that do
                index += 1
                # A rank of several stages checked whole, before its trace and replay; one over
                # memory is traced only where nothing fits (below).
                memory = self._memory(c, table, costs, self._untraced(c)) if self.memory_before_trace else None
                if memory is not None:
                    held = ranks_memory(c.order, memory, cluster)
                    if held.oom_devices:
                        untraced.append((max(held.peak_mem_gib), index, c, held))
                        continue
                try:  # torch's own lowering of the schedule, which may refuse it (its last check)
                    traces = self._traces(c)
                except ScheduleRefused as exc:
                    refused.append((index, self._refused(c, exc)))
                    continue
                program = self._program(c, traces, table, costs, workload, cluster, model_launches, memory)
                held = pipeline_memory(program, cluster)
                if held.oom_devices:
                    over.append((max(held.peak_mem_gib), index, c, held))
                    continue
                # It fits: priced, replayed unless it cannot beat the best (compute_bound)
                if best is None or not self.bound_before_replay or compute_bound(program, cluster) < best[0]:
                    sim = simulate_pipeline(program, cluster)
                    if best is None or sim.iter_time_s < best[0]:
                        best = (sim.iter_time_s, c, program, sim)
                priced += 1
                if priced == SIMULATED:
                    break
        if best is None:
            # Those over memory before their trace count as the trace found them, unless torch
            # refuses their shape: traced now, the closest to fitting first, until the closest
            # of all is known.
            for peak, i, c, held in sorted(untraced, key=lambda x: x[:2]):
                if over and min(x[:2] for x in over) < (peak, i):
                    break
                try:
                    self._traces(c)
                except ScheduleRefused as exc:
                    refused.append((i, self._refused(c, exc)))
                    continue
                over.append((peak, i, c, held))
                break
        if best is None and not over:
            raise ConfigError(min(refused)[1])
        if best is None:
            _, _, c, held = min(over, key=lambda x: x[:2])
            rank = held.oom_devices[0]
            dev = cluster.devices[rank]
            raise StageOOM(
                f"no plan of {workload.name} under method.schedule={self.schedule} fits device memory: "
                f"rank {rank} needs {held.peak_mem_gib[rank]:.1f} GiB at method.num_micro_batches={c.m} "
                f"({c.schedule}, {c.stages_per_rank} stage(s) per rank), more than a {dev.type.name}'s "
                f"{dev.type.memory_gib:g} GiB; use a smaller batch (preset.batch_per_device) or more devices"
            )
        _, c, program, sim = best
        self.simulated = (program, sim)
        return c, program, costs

    def _probed(
        self, c: _Candidate, program: PipelineProgram, costs: _Costs, workload: Workload, cluster: ClusterSpec
    ) -> Plan:
        """The plan of `c`, priced with the schedule's own work (docs/methods.md, "The schedule's
        own work"): its trainer timed on the cluster's ranks (bench.runtime.method_step.time_method_step:
        each rank's compute a step as its pacing reference counts it), less what the profile
        prices of that rank's computes and Adam at the probe's host speed, spread over the
        rank's compute actions; the median rank's, added to every compute action
        (_Costs.action_s) in place of what `costs` added. Without a measurement, the plan as priced."""
        plan = self._plan(c, program, workload)
        work = time_method_step(
            self,
            plan,
            workload,
            cluster,
            cache="pipeline_work",
            config=[self.name, plan.details, self.lr, self.grad_clip, self.bucket_cap_mb],
            version=WORK_PROBE_VERSION,
            what="the pipeline schedule's own work",
            interleave=False,  # a rank's stages stay in its caches from one step to the next, as in a run
        )
        if work is None:
            return plan
        action_s = schedule_work_per_action(program, work, costs.action_s)
        priced = dataclasses.replace(costs, action_s=action_s)  # its memos are the search's: fresh
        # profiled: the program counts no kernels (the profile's times hold them)
        probed = self._program(c, self._traces(c), priced.table, priced, workload, cluster, priced.model_launches)
        plan = self._plan(c, probed, workload)
        plan.details["work"] = {**work, "action_s": action_s}
        return plan

    @staticmethod
    def _traces(c: _Candidate) -> tuple[Trace, ...]:
        """Every position's trace of `c`'s schedule (trace_schedule; ScheduleRefused where torch
        refuses the shape)."""
        return tuple(
            trace_schedule(c.schedule, c.layout.num_stages, c.m, r, c.stages_per_rank)
            for r in range(c.layout.num_stages)
        )

    @staticmethod
    def _untraced(c: _Candidate) -> list[tuple[tuple[tuple, ...], tuple[int, ...]]]:
        """Per position, (its forwards and backwards in the trace's order, the stages it holds in
        order) before the schedule is traced: compute_order's, all that rank_memory reads of a
        position's actions (tests/unit/test_pipeline_plan.py checks them against the traces)."""
        orders, _ = compute_order(c.schedule, c.layout.num_stages, c.m, c.stages_per_rank)
        K = len(c.stage_rank)
        return [(orders[r], tuple(k for k in range(K) if c.stage_rank[k] == r)) for r in range(len(orders))]

    @staticmethod
    def _refused(c: _Candidate, exc: ScheduleRefused) -> str:
        return (
            f"method.schedule={c.schedule} does not run {c.m} micro-batches on {c.layout.num_stages} "
            f"ranks a pipeline, {c.stages_per_rank} stage(s) each (torch: {exc}); try another "
            "method.num_micro_batches or method.schedule"
        )

    def _schedules(self, ranks: int, num_groups: int) -> list[tuple[str, int]]:
        """(schedule, stages per rank) pairs to price for pipelines of `ranks` ranks."""
        names = SCHEDULES if self.schedule == "auto" else (self.schedule,)
        out = []
        for name in names:
            if not is_multi_stage(name):
                choices = [1]
            elif name in V_SHAPED:
                choices = [2]
            else:
                choices = list(range(2, num_groups // ranks + 1))
            if self.stages_per_rank != "auto":
                choices = [v for v in choices if v == self.stages_per_rank]
            out += [(name, v) for v in choices]
        return out

    def _candidates(
        self,
        layout: Layout,
        table: GroupTable,
        costs: _Costs,
        workload: Workload,
        cluster: ClusterSpec,
        refusals: list,
        oom: list,
    ) -> list[_Candidate]:
        R, D = layout.num_stages, layout.num_pipelines
        B = workload.global_batch
        where = f"{R} ranks a pipeline of {len(layout.slots[0])} device(s) each, method.stage_level={layout.level}"
        if B < D or (self.shares == "equal" and B % D):
            refusals.append(
                f"global_batch={B} must be a multiple of the {D} pipelines of {where} "
                f"(method.shares={self.shares}); e.g. global_batch={D * max(1, B // D)}"
            )
            return []
        counts = micro_batch_counts(B, D, self.shares, self.num_micro_batches)
        pairs = self._schedules(R, table.num_groups)
        if not pairs:
            refusals.append(
                f"method.schedule={self.schedule} needs at least 2 stages per rank, 2 x {R} = {2 * R} "
                f"stages ({where}), but {workload.name} has {table.num_groups} layer groups; use "
                f"method.num_stages<={table.num_groups // 2} or method.schedule=1f1b"
            )
            return []
        found: list[_Candidate] = []
        orders = slot_orders(cluster, layout)
        balanced = costs.balanced
        equal = self.shares == "equal"
        runnable = False
        choices = self._state_choices(pairs, D)
        floor = _replicated_state_floor(layout, table, costs)
        if floor is not None:  # no replicated rank can fit: sharded state alone is planned
            choices = [c for c in choices if c[2]]
            if not choices:
                roomiest = max((cluster.devices[r] for slot in layout.slots for r in slot), key=costs.room)
                oom.append(
                    (
                        floor,
                        f"no split of {workload.name}'s {table.num_groups} layer groups into {where} fits device "
                        f"memory: with replicated state some rank holds at least 1/{R} of the parameters, their "
                        f"gradients and Adam's two moments, {floor / 2**30:.1f} GiB, more than the roomiest of "
                        f"them, a {roomiest.type.name} of {roomiest.type.memory_gib:g} GiB; use more stages "
                        "(method.num_stages), method.sharded_state or more devices",
                    )
                )
                return []
        for schedule, V, sharded in choices:
            K = R * V
            if table.num_groups < K:
                refusals.append(
                    f"method.schedule={schedule} with {V} stages per rank needs {K} stages ({where}), "
                    f"more than the {table.num_groups} layer groups of {workload.name}; use a smaller "
                    "method.num_stages or method.stages_per_rank"
                )
                continue
            for m in counts:
                if V > 1 and m * V > MAX_MULTI_FORWARDS:
                    continue
                try:
                    _, stage_rank = compute_order(schedule, R, m, V)
                except ScheduleRefused as exc:
                    refusals.append(
                        f"method.num_micro_batches={m} does not run under method.schedule={schedule} "
                        f"with {R} ranks a pipeline, {V} stage(s) each (torch: {exc}); try another "
                        "method.num_micro_batches or method.schedule"
                    )
                    continue
                runnable = True
                flights = _flights(schedule, R, m, V)
                for order in orders:
                    slots = tuple(order[stage_rank[k]] for k in range(K))
                    key = (slots, stage_rank, m, B // m, flights, equal, sharded)
                    if key not in balanced:
                        balanced[key] = balance_shares(
                            costs, slots, stage_rank, m, B // m, flights, equal, sharded=sharded
                        )
                    got = balanced[key]
                    if got is None:
                        continue
                    estimate, mbs, cuts = got
                    estimate += sync_seconds(costs, order, stage_rank, cuts, self.bucket_cap_mb, sharded)
                    found.append(
                        _Candidate(
                            estimate, schedule, layout, tuple(order), V, m, tuple(mbs), tuple(cuts), stage_rank, sharded
                        )
                    )
        if not found and runnable:
            oom.append(self._oom_message(layout, costs, table, counts, cluster, workload, where))
        return found

    def _state_choices(self, pairs: list[tuple[str, int]], pipelines: int) -> list[tuple[str, int, bool]]:
        """(schedule, stages per rank, sharded state) to price: sharded state where the slots
        have replicas (several pipelines), under a schedule of one stage per rank (true: only
        those schedules there; auto: beside the replicated state)."""
        if pipelines < 2 or self.sharded_state is False:
            return [(schedule, V, False) for schedule, V in pairs]
        out = [(schedule, V, True) for schedule, V in pairs if V == 1]
        if self.sharded_state == "auto":
            out += [(schedule, V, False) for schedule, V in pairs]
        return out

    def _oom_message(
        self, layout: Layout, costs: _Costs, table: GroupTable, counts, cluster, workload, where: str
    ) -> tuple[float, str]:
        """(bytes, one line): an even split of the groups over one stage per rank, GPipe's most
        micro-batches in flight, what its fullest stage needs and the fix."""
        m = min(counts)
        R, D = layout.num_stages, layout.num_pipelines
        mb = max(1, workload.global_batch // m // D)
        cuts = [round(i * table.num_groups / R) for i in range(R + 1)]
        worst, need = 0, 0.0
        shards = D if self.sharded_state and D > 1 else 1
        for s in range(R):
            peak = costs.peak(cuts[s], cuts[s + 1], mb, R - s, m, D > 1, shards)
            if peak > need:
                worst, need = s, peak
        dev = cluster.devices[layout.slots[0][0]]
        return need, (
            f"no split of {workload.name}'s {table.num_groups} layer groups into {where} fits "
            f"device memory: stage {worst} (groups {cuts[worst]}-{cuts[worst + 1] - 1}) needs "
            f"{need / 2**30:.1f} GiB at method.num_micro_batches={m}, more than a {dev.type.name}'s "
            f"{dev.type.memory_gib:g} GiB; use a smaller batch (preset.batch_per_device) or more devices"
        )

    def _program(
        self,
        c: _Candidate,
        traces: tuple[Trace, ...],
        table: GroupTable,
        costs: _Costs,
        workload: Workload,
        cluster: ClusterSpec,
        model_launches: float,
        memory: tuple[tuple[Memory, ...], ...] | None = None,
    ) -> PipelineProgram:
        D = c.layout.num_pipelines
        stage_rank = c.stage_rank
        assert traces[0].stage_rank == stage_rank, "torch placed the stages other than its compute-only order"
        K = len(stage_rank)
        copies = {}  # stage -> the copies of tied parameters its rank holds for it (_Costs.tied_copies)
        for r in sorted(set(stage_rank)):
            mine = [k for k in range(K) if stage_rank[k] == r]
            copies.update(zip(mine, costs.tied_copies([(c.cuts[k], c.cuts[k + 1]) for k in mine])))
        stages = []
        for k in range(K):
            first, end = c.cuts[k], c.cuts[k + 1]
            groups = table.span(first, end)
            work = []
            for mb in c.micro_batches:
                fwd, bwd, fk, bk = costs.passes(first, end, mb)
                work.append(
                    StageWork(
                        forward=fwd,
                        backward=bwd,
                        launches=(fk, bk),
                        send_bytes=0.0 if k == K - 1 else mb * groups[-1].out_bytes,
                        measured=costs.measured(first, end, mb),
                        weight_share=costs.weight_share(first, end),
                        measured_split=costs.measured_split(first, end, mb),
                    )
                )
            stages.append(
                PipeStage(
                    groups=(first, end),
                    ranks=tuple(c.order[stage_rank[k]]),
                    work=tuple(work),
                    param_bytes=sum(g.param_bytes for g in groups),
                    shard_bytes=costs.shard_bytes(first, end, D) if c.sharded else 0.0,
                    copy_bytes=costs.copy_bytes(copies[k], 1),
                    copy_shard_bytes=costs.copy_bytes(copies[k], D) if c.sharded else 0.0,
                )
            )
        if memory is None:  # else made before the trace, from the same computes and stages (_untraced)
            memory = self._memory(c, table, costs, [(t.actions, t.stages) for t in traces])
        buckets = [
            replica_buckets(table, c.cuts, t.stages, self.bucket_cap_mb) if D > 1 and not c.sharded else ()
            for t in traces
        ]
        profiles = [costs.profile_at(mb) for mb in c.micro_batches]
        tied = tuple(
            TiedParam(name, positions, costs.tied_bytes(name, D) if c.sharded else costs.tied_bytes(name, 1) * D)
            for name, positions in tied_params(table, c.cuts, stage_rank)
        )
        actions = tuple(
            with_tied_collectives(with_shard_collectives(t.actions, t.stages) if c.sharded else t.actions, r, tied)
            for r, t in enumerate(traces)
        )
        return PipelineProgram(
            stages=tuple(stages),
            actions=actions,
            num_micro_batches=c.m,
            micro_batches=c.micro_batches,
            num_devices=cluster.num_devices,
            memory=tuple(memory),
            grad_buckets=tuple(buckets),
            schedule=c.schedule,
            stage_rank=stage_rank,
            model_launches=0.0 if costs.profile is not None else model_launches,
            batch=workload.global_batch,
            meta={"method": self.name, "model": workload.name},
            profile_step_s=tuple(p["step_s"] for p in profiles) if all(profiles) else (),
            flops_per_sample=workload.flops_per_sample,
            sharded_state=c.sharded,
            tied=tied,
        )

    def _memory(
        self, c: _Candidate, table: GroupTable, costs: _Costs, ranks: Sequence[tuple[Sequence[tuple], Sequence[int]]]
    ) -> tuple[tuple[Memory, ...], ...]:
        """PipelineProgram.memory of `c`: per position, what its rank holds in each pipeline,
        from `ranks[r]`, position r's actions (its computes are all rank_memory reads) and the
        stages it holds in order."""
        D = c.layout.num_pipelines
        memory = []
        for actions, mine in ranks:
            copies = dict(zip(mine, costs.tied_copies([(c.cuts[k], c.cuts[k + 1]) for k in mine])))
            params = sum(g.param_bytes for k in mine for g in table.span(c.cuts[k], c.cuts[k + 1]))
            params += costs.copy_bytes([name for k in mine for name in copies[k]], 1)
            bucket = min(params, costs.bucket_bytes) if D > 1 and not c.sharded else 0.0
            held = {  # pipelines at equal micro-batches hold alike
                mb: rank_memory(
                    actions,
                    {
                        k: costs.stage_bytes(c.cuts[k], c.cuts[k + 1], mb, D if c.sharded else 1, copies[k])
                        for k in mine
                    },
                    c.m,
                    bucket,
                    D if c.sharded else 1,
                )
                for mb in set(c.micro_batches)
            }
            memory.append(tuple(held[mb] for mb in c.micro_batches))
        return tuple(memory)

    def _plan(self, c: _Candidate, program: PipelineProgram, workload: Workload) -> Plan:
        R, D = c.layout.num_stages, c.layout.num_pipelines
        batches = program.pipeline_batches()
        slices = offsets(batches)
        shares, data = {}, {}
        for slot in c.order:
            for p, rank in enumerate(slot):
                shares[rank] = c.micro_batches[p]
                data[rank] = slices[p]
        n = len(shares)
        details = {
            "schedule": c.schedule,
            "stage_level": c.layout.level,
            "num_stages": R,
            "stages_per_rank": c.stages_per_rank,
            "num_pipelines": D,
            "num_micro_batches": c.m,
            "shares": self.shares,
            "activation_checkpointing": self.activation_checkpointing,
            "sharded_state": c.sharded,
            "micro_batches": list(c.micro_batches),
            "pipeline_batches": batches,
            "stages": [
                {"groups": [c.cuts[k], c.cuts[k + 1] - 1], "ranks": list(program.stages[k].ranks)}
                for k in range(program.num_stages)
            ],
            "stage_rank": list(program.stage_rank),
            "pipelines": [[c.order[r][p] for r in range(R)] for p in range(D)],
            "layer_groups": c.cuts[-1],
            "tied_params": [{"name": t.name, "positions": list(t.positions)} for t in program.tied],
            "optimizer": f"torch.optim.Adam(lr={self.lr:g})",
        }
        return Plan(
            self.name, [shares[r] for r in range(n)], details, program, None, data_slices=[data[r] for r in range(n)]
        )

    # -- run ---------------------------------------------------------------------------------------
    def setup(self, plan: Plan, model: nn.Module, ctx: RankContext) -> PipelineTrainer:
        return PipelineTrainer(self, plan, model, ctx)


class SharedCosts:
    """The priced costs of one workload on one cluster (planning._Costs: the layer groups'
    seconds, peaks, sends, cuts and balanced shares), kept across the pipeline plans of one
    caller, e.g. auto's candidates at each stage count and state: a plan reads the costs of
    its options (checkpointing, gradient bucket, profiled or priced) from here, so plans that
    share them price each run of groups once. It holds nothing of another workload or cluster
    (`check`), and lives as long as its caller keeps it."""

    def __init__(self, workload: Workload, cluster: ClusterSpec):
        self.workload, self.cluster = workload, cluster
        self._costs: dict[tuple, _Costs] = {}

    def check(self, workload: Workload, cluster: ClusterSpec) -> None:
        assert workload is self.workload and cluster is self.cluster, "costs shared across workloads or clusters"

    def costs(
        self,
        graph,
        table: GroupTable,
        profiled: bool,
        model_launches: float,
        bucket_cap_mb: float,
        checkpointing: bool,
        action_s: float = 0.0,
    ) -> _Costs:
        """The costs at these options, made on first use (`graph`, `table`: the workload's
        capture and its layer groups, the same at every use)."""
        key = (profiled, model_launches, bucket_cap_mb, checkpointing, action_s)
        if key not in self._costs:
            workload = self.workload
            self._costs[key] = _Costs(
                graph,
                table,
                self.cluster,
                model_launches,
                (lambda mb: group_profile(workload, mb)) if profiled else None,
                workload.flops_per_sample,
                bucket_cap_mb * 2**20,
                checkpointing,
                action_s,
            )
        return self._costs[key]


WORK_PROBE_VERSION = 2  # what the pipeline's work probe times (PipelineParallel._probed)


def schedule_work_per_action(program: PipelineProgram, work: dict, priced_s: float = 0.0) -> float:
    """Profiled seconds of the schedule's own work per compute action (PipelineParallel._probed):
    each rank's compute a step as the probe timed it (`work["method_s_ranks"]`), over the probe's
    plain step at its micro-batch against the profile's (`plain_s_ranks` over
    `profile_step_s`: the host then and now), less its computes' and Adam's profiled seconds
    (`priced_s` a compute of them already the schedule's work the program prices), over its
    compute actions; the median rank's, never below 0."""
    per_action = []
    for r, actions in enumerate(program.actions):
        computes = [a for a in actions if a[0] in COMPUTE]
        for p, rank in enumerate(program.position_ranks(r)):
            scale = work["plain_s_ranks"][rank] / program.profile_step_s[p]
            priced = sum(program.stages[k].work[p].measured[2] for k, x in enumerate(program.stage_rank) if x == r)
            for kind, k, *_ in computes:
                w = program.stages[k].work[p]
                if kind in ("F", "B"):
                    priced += w.measured[0 if kind == "F" else 1]
                else:
                    priced += w.measured_split[0 if kind == "I" else 1]
            per_action.append((work["method_s_ranks"][rank] / scale - priced) / max(len(computes), 1) + priced_s)
    return max(statistics.median(per_action), 0.0)


V_SHAPED = ("zbvzerobubble", "dualpipev")  # torch's schedules of exactly two stages per rank, in a V


_in_flight: dict[tuple, tuple[int, ...]] = {}


def _flights(schedule: str, R: int, m: int, V: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches in flight at once on its rank (in_flight) under
    `schedule` at this shape (its compute_order, kept per shape as compute_order's are)."""
    key = (schedule, R, m, V)
    if key not in _in_flight:
        orders, stage_rank = compute_order(schedule, R, m, V)
        _in_flight[key] = tuple(in_flight(orders[stage_rank[k]], k) for k in range(R * V))
    return _in_flight[key]


def _replicated_state_floor(layout: Layout, table: GroupTable, costs: _Costs) -> float | None:
    """Bytes no rank of `layout` with replicated state can fit in, or None where one might: the
    positions' parameters add up to the model's, so some position holds at least 1/R of them,
    and a rank keeps its parameters, their gradients and Adam's two moments (rank_memory's
    resident state, below every peak it prices); None unless that is more than every device of
    the layout holds."""
    floor = 4.0 * sum(g.param_bytes for g in table.groups) / layout.num_stages
    if any(costs.fits(r, floor) for slot in layout.slots for r in slot):
        return None
    return floor


def with_shard_collectives(actions: tuple[tuple, ...], stages: tuple[int, ...]) -> tuple[tuple, ...]:
    """A position's actions with sharded state (bench.cost.pipeline.ACTIONS): each of its
    stages' parameters gathered before the schedule (the trainer's unshard; kept gathered
    through it) and its gradients reduce-scattered after the last action (torch's
    perform_reduce_grad, after the schedule's last waits)."""
    return tuple(("gather", k) for k in stages) + tuple(actions) + tuple(("scatter", k) for k in stages)


def with_tied_collectives(actions: tuple[tuple, ...], position: int, tied: tuple[TiedParam, ...]) -> tuple[tuple, ...]:
    """A position's actions with the all-reduce of each tied parameter it holds a copy of
    ("tie", bench.cost.pipeline.ACTIONS) after its last action, in the order of `tied` (the
    trainer's, before the replicas' sync)."""
    return tuple(actions) + tuple(("tie", i) for i, t in enumerate(tied) if position in t.positions)


def _check_stages_per_rank(schedule: str, v: int) -> None:
    """One line where `method.stages_per_rank` is one `method.schedule` cannot run."""
    multi = is_multi_stage(schedule)
    if not multi and v != 1:
        raise ConfigError(
            f"method.stages_per_rank={v} needs a schedule that runs several stages per rank, but "
            f"method.schedule={schedule} runs one; use method.stages_per_rank=1 or one of "
            f"{', '.join(s for s in SCHEDULES if is_multi_stage(s))}"
        )
    if schedule in V_SHAPED and v != 2:
        raise ConfigError(
            f"method.stages_per_rank={v} does not run under method.schedule={schedule}, which places "
            "exactly 2 stages per rank (a V); use method.stages_per_rank=2"
        )
    if multi and v < 2:
        raise ConfigError(
            f"method.stages_per_rank={v} does not run under method.schedule={schedule}, which loops "
            "several stages per rank; use method.stages_per_rank>=2 or method.schedule=1f1b"
        )
