"""Pipeline parallelism on mixed devices, run by torch.distributed.pipelining.

The model is cut into stages at layer-group borders (methods.common: embeddings, blocks, conv
stages, head). A stage runs on a slot of the cluster: a device, a machine, or a group of alike
devices or machines (`stage_level`, `num_stages`); a slot of several devices runs one pipeline
per device, data parallel across the pipelines (a stage's replicas sum their gradients once the
schedule is through). Which slot holds which stage, where the cuts fall and how many
micro-batches an iteration has are chosen by pricing: for each order of the slots a dynamic
program over the layer groups' costs (the same price the planner's Programs get, or on an
emulated CPU cluster the groups' measured time) finds the cuts whose slowest stage is fastest
among those that fit their devices' memory, and the simulator (bench.cost.pipeline) replays the
best candidates' schedules to pick one. The schedule is torch's own (Schedule1F1B, or
ScheduleGPipe): the planner traces it with a stand-in stage, so the actions it prices are the
ones the runtime calls, in the same order.

At run time each rank captures the model with torch.export (methods.aten_capture, the graph the
planner priced), keeps the nodes of its stage as a GraphModule (the parameters it reads, the
values that cross its borders as inputs and outputs), and runs it as a PipelineStage. The
ops that read the targets (the loss) run as the schedule's loss function on the last stage.
It does not interleave several stages per rank (no looped or zero-bubble schedules) and does
not mix tensor parallelism into a stage.

The method (PipelineParallel) is here; its parts: schedule (torch's schedules traced),
planning (slots, orders, micro-batches, priced costs, the cuts' dynamic program), profile (the
layer groups timed on this host), cut (a stage of the traced model), trainer (a rank at run time).
"""

from __future__ import annotations

import logging

from torch import nn

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError, PlanningError
from bench.core.interfaces import Plan, RankContext, Workload
from bench.cost.pipeline import SCHEDULES, PipelineProgram, PipeStage, in_flight, simulate_pipeline
from methods.capture import capture_config
from methods.common import GroupTable, check_training_options, gradient_buckets, group_table
from methods.pipeline.cut import cut_graph
from methods.pipeline.planning import Layout, _Costs, best_cuts, layouts, micro_batch_choices, slot_orders
from methods.pipeline.profile import group_profile
from methods.pipeline.schedule import trace_schedule
from methods.pipeline.trainer import PipelineTrainer

__all__ = [
    "PipelineParallel",
    "PipelineTrainer",
    "StageOOM",
    "cut_graph",
    "group_profile",
    "layouts",
    "micro_batch_choices",
    "slot_orders",
    "trace_schedule",
]

log = logging.getLogger(__name__)

STAGE_LEVELS = ("auto", "device", "machine")
SIMULATED = 8  # candidates (order, micro-batches, cuts) replayed exactly, the best priced first


class StageOOM(PlanningError):
    status = "oom"


class PipelineParallel:
    """Pipeline parallelism over the cluster's devices (module docstring).

    Args:
        name: the method's name in records.
        schedule: "1f1b" (torch's Schedule1F1B) or "gpipe" (ScheduleGPipe).
        num_micro_batches: micro-batches per pipeline and iteration, or "auto" (priced).
        stage_level: what a stage's slot is cut from: "device", "machine" or "auto" (both).
        num_stages: stages per pipeline, a divisor of the devices (machines); "auto": the
            fastest priced of those up to the model's layer groups.
        bucket_cap_mb: the gradient bucket a stage's replicas all-reduce at a time (MiB).
        lr: Adam's learning rate (the paper: 5e-4).
        grad_clip: max global gradient norm; 0 disables clipping.
        profile: emulated CPU clusters: price the stages from the layer groups' time on this
            host (group_profile, cached) instead of their FLOPs.
    """

    worker_modules = ("torch.distributed.pipelining",)
    mirror_full_state = False  # tests: write every stage's parameters and gradients into the full model

    def __init__(
        self,
        name: str = "pipeline",
        schedule: str = "1f1b",
        num_micro_batches="auto",
        stage_level: str = "auto",
        num_stages="auto",
        bucket_cap_mb: float = 25.0,
        lr: float = 5e-4,
        grad_clip: float = 0.0,
        profile: bool = True,
    ):
        if schedule not in SCHEDULES:
            raise ConfigError(f"method.schedule={schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
        whole = isinstance(num_micro_batches, int) and not isinstance(num_micro_batches, bool)
        if num_micro_batches != "auto" and (not whole or num_micro_batches < 1):
            raise ConfigError(
                f"method.num_micro_batches={num_micro_batches!r} must be auto or an integer >= 1; "
                "e.g. method.num_micro_batches=4"
            )
        whole = isinstance(num_stages, int) and not isinstance(num_stages, bool)
        if num_stages != "auto" and (not whole or num_stages < 1):
            raise ConfigError(
                f"method.num_stages={num_stages!r} must be auto or an integer >= 1; e.g. method.num_stages=2"
            )
        if stage_level not in STAGE_LEVELS:
            raise ConfigError(f"method.stage_level={stage_level!r} is unknown; use one of {', '.join(STAGE_LEVELS)}")
        check_training_options(lr, grad_clip, bucket_cap_mb)
        self.name = name
        self.modes = ("real", "sim")
        self.schedule = schedule
        self.num_micro_batches = num_micro_batches
        self.stage_level = stage_level
        self.num_stages = num_stages
        self.bucket_cap_mb = bucket_cap_mb
        self.lr = lr
        self.grad_clip = grad_clip
        self.profile = profile

    # -- plan ------------------------------------------------------------------------------------
    def plan(self, workload: Workload, cluster: ClusterSpec) -> Plan:
        graph = capture_config(workload.model_cfg, workload.global_batch)
        table = group_table(graph)
        model_launches = float(sum(g.launches for g in table.groups))
        found, layouts_, refusals = [], *layouts(cluster, self.stage_level, self.num_stages, table.num_groups)
        oom: list[str] = []
        profiled = self.profile and cluster.emulated and cluster.device == "cpu" and cluster.host_flops is not None
        if profiled:  # the layer groups on this host, at every micro-batch a layout may use
            sizes = sorted({mb for layout in layouts_ for mb in self._micro_batches(layout, table, workload)})
            costs = _Costs(
                graph,
                table,
                cluster,
                0.0,
                {mb: group_profile(workload, mb) for mb in sizes},
                workload.flops_per_sample,
                self.bucket_cap_mb * 2**20,
            )
        else:
            costs = _Costs(graph, table, cluster, model_launches, bucket_bytes=self.bucket_cap_mb * 2**20)
        for layout in layouts_:
            found += self._candidates(layout, table, costs, workload, cluster, refusals, oom)
        if not found:
            if oom:  # the layout that came closest to fitting
                raise StageOOM(min(oom)[1])
            raise ConfigError(
                refusals[0] if refusals else f"{workload.name} cannot be pipelined on cluster={cluster.name}"
            )
        found.sort(key=lambda c: c[0])
        best = None
        for _, layout, order, m, cuts in found[:SIMULATED]:
            program = self._program(layout, order, m, cuts, table, costs, workload, cluster, costs.model_launches)
            t = simulate_pipeline(program, cluster).iter_time_s
            if best is None or t < best[0]:
                best = (t, layout, order, m, cuts, program)
        _, layout, order, m, cuts, program = best
        return self._plan(layout, order, m, cuts, program, table, workload)

    def _micro_batches(self, layout: Layout, table: GroupTable, workload: Workload) -> list[int]:
        """The micro-batch sizes a layout may run at (none where it cannot run)."""
        S, D = layout.num_stages, layout.num_pipelines
        if table.num_groups < S or workload.global_batch % D:
            return []
        per_pipeline = workload.global_batch // D
        try:
            return [
                per_pipeline // m for m in micro_batch_choices(per_pipeline, S, self.schedule, self.num_micro_batches)
            ]
        except ConfigError:
            return []

    def _candidates(
        self,
        layout: Layout,
        table: GroupTable,
        costs: _Costs,
        workload: Workload,
        cluster: ClusterSpec,
        refusals: list,
        oom: list,
    ) -> list:
        S, D = layout.num_stages, layout.num_pipelines
        where = f"{S} stages of {len(layout.slots[0])} device(s), method.stage_level={layout.level}"
        if workload.global_batch % D:
            refusals.append(
                f"global_batch={workload.global_batch} must be a multiple of the {D} pipelines of "
                f"{where}; e.g. global_batch={D * max(1, workload.global_batch // D)}"
            )
            return []
        per_pipeline = workload.global_batch // D
        choices = micro_batch_choices(per_pipeline, S, self.schedule, self.num_micro_batches)
        if not choices:
            refusals.append(
                f"the pipeline's batch of {per_pipeline} samples is smaller than its {S} stages "
                f"({where}); use a larger batch (preset.batch_per_device) or method.schedule=gpipe"
            )
            return []
        found = []
        orders = slot_orders(cluster, layout)
        for m in choices:
            mb = per_pipeline // m
            flights = [in_flight(trace_schedule(self.schedule, S, m, s)) for s in range(S)]
            for order in orders:
                best = best_cuts(costs, order, mb, m, flights, D > 1)
                if best is None:
                    continue
                slowest, total, cuts = best
                # The makespan of a balanced pipeline: one micro-batch through every stage, then
                # the slowest stage for each of the others.
                found.append((total + (m - 1) * slowest, layout, order, m, cuts))
        if not found:
            oom.append(self._oom_message(layout, costs, table, per_pipeline, choices, cluster, workload, where))
        return found

    def _oom_message(
        self, layout, costs: _Costs, table: GroupTable, per_pipeline: int, choices, cluster, workload, where: str
    ) -> tuple[float, str]:
        """(bytes, one line): an even split of the groups, what its fullest stage needs and the fix."""
        m = min(choices)
        mb = per_pipeline // m
        S = layout.num_stages
        flights = [in_flight(trace_schedule(self.schedule, S, m, s)) for s in range(S)]
        cuts = [round(i * table.num_groups / S) for i in range(S + 1)]
        worst, need = 0, 0.0
        for s in range(S):
            peak = costs.peak(cuts[s], cuts[s + 1], mb, flights[s], m, layout.num_pipelines > 1, s == S - 1)
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
        layout: Layout,
        order,
        m: int,
        cuts: list[int],
        table: GroupTable,
        costs: _Costs,
        workload: Workload,
        cluster: ClusterSpec,
        model_launches: float,
    ) -> PipelineProgram:
        S, D = layout.num_stages, layout.num_pipelines
        mb = workload.global_batch // D // m
        actions = tuple(trace_schedule(self.schedule, S, m, s) for s in range(S))
        stages = []
        for s in range(S):
            first, end = cuts[s], cuts[s + 1]
            fwd, bwd, fk, bk = costs.passes(first, end, mb)
            groups = table.span(first, end)
            buckets: tuple = ()
            if D > 1:  # the buckets the replicas all-reduce, as the runtime makes them
                sizes = [b for g in groups for b in g.param_sizes]
                buckets = tuple(sum(sizes[i] for i in run) for run in gradient_buckets(sizes, self.bucket_cap_mb))
            stages.append(
                PipeStage(
                    groups=(first, end),
                    ranks=tuple(order[s]),
                    forward=fwd,
                    backward=bwd,
                    launches=(fk, bk),
                    send_bytes=0.0 if s == S - 1 else mb * groups[-1].out_bytes,
                    param_bytes=sum(g.param_bytes for g in groups),
                    memory=costs.memory(first, end, mb, in_flight(actions[s]), m, D > 1, s == S - 1),
                    grad_buckets=buckets,
                    measured=costs.measured(first, end, mb),
                )
            )
        return PipelineProgram(
            tuple(stages),
            actions,
            m,
            mb,
            D,
            cluster.num_devices,
            self.schedule,
            model_launches,
            workload.global_batch,
            meta={"method": self.name, "model": workload.name},
            profile_step_s=costs.profiles[mb]["step_s"] if costs.profiles else 0.0,
            flops_per_sample=workload.flops_per_sample,
        )

    def _plan(
        self,
        layout: Layout,
        order,
        m: int,
        cuts: list[int],
        program: PipelineProgram,
        table: GroupTable,
        workload: Workload,
    ) -> Plan:
        S, D = layout.num_stages, layout.num_pipelines
        per_pipeline = workload.global_batch // D
        stage_of, slices = {}, {}
        for s, slot in enumerate(order):
            for p, r in enumerate(slot):
                stage_of[r] = (p, s)
                slices[r] = (p * per_pipeline, (p + 1) * per_pipeline)
        n = len(stage_of)
        details = {
            "schedule": self.schedule,
            "stage_level": layout.level,
            "num_stages": S,
            "num_pipelines": D,
            "num_micro_batches": m,
            "micro_batch": per_pipeline // m,
            "stages": [{"groups": [cuts[s], cuts[s + 1] - 1], "ranks": list(order[s])} for s in range(S)],
            "pipelines": [[order[s][p] for s in range(S)] for p in range(D)],
            "layer_groups": table.num_groups,
            "optimizer": f"torch.optim.Adam(lr={self.lr:g})",
        }
        return Plan(
            self.name, [per_pipeline // m] * n, details, program, None, data_slices=[slices[r] for r in range(n)]
        )

    # -- run ---------------------------------------------------------------------------------------
    def setup(self, plan: Plan, model: nn.Module, ctx: RankContext) -> PipelineTrainer:
        return PipelineTrainer(self, plan, model, ctx)
