"""auto's part for pipelines whose stages run hap's synthesis (methods.auto.hap_stages).

The layout: one stage per machine, every machine of the cluster one stage's group, each of
R GPUs (the same R on every machine, R >= 2); pipeline i is GPU i of every machine
(rank-aligned). Groups spanning machines priced slower on every model tried (docs/methods.md,
"Pipelines of hap stages"), so no other layout is offered.

The cuts, the order of the machines and the number of micro-batches are the pipeline
planner's for the same layout (PipelineParallel at stage_level=machine, alike=stage, one stage
a rank, replicated state): its dynamic program over the layer groups' costs, its slot orders
and micro-batch counts. Each stage is then planned by hap over its machine (HapPlanner at the
GPU level, lp=False: compute-proportional ratios, even over a machine of alike GPUs, so the
row is the same at every stage; one segment), on the stage's graph at the group's micro-batch
and scored with the schedule's micro-batches (stage_options: the search of the whole stage and,
on a stage of several layer groups, the groups planned alone in a row), and the pipeline is
priced by the simulator (bench.cost.GroupPipelineProgram) under 1F1B and GPipe, each stage's
program chosen among its options by that price (_choose); the faster that fits is kept.
Stages alike in structure (stage_signature) on alike machines are priced by one plan; where
auto keeps the plan, `finish` plans each of them on its own graph (the format's steps name the
stage's own nodes) and rebuilds the program from those plans.
A cut that leaves a tied parameter (an embedding and head read as one tensor) on two stages is
refused: the stages' programs hold no copies of it.

The plan's details["hap_stages"] is the plan format the runtime reads
(methods.auto.hap_stages_runtime.HapStagesTrainer; docs/methods.md, "Pipelines of hap
stages"): cuts, groups, batch_shares, micro_batch, num_micro_batches, schedule, stages (each
stage's stage_details). Its other keys follow the pipeline method's (stages, schedule,
num_micro_batches, pipelines) for the runner and the records.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Sequence

import torch.fx as fx
from torch import nn

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError, PlanningError
from bench.core.interfaces import Plan, RankContext, Workload
from bench.cost import simulate
from bench.cost.group_pipeline import StagePrice, lockstep, replay_stages
from bench.cost.pipeline import action_times
from methods.auto.hap_stages import (
    StageGraph,
    best_option,
    group_cluster,
    loss_tail,
    pipeline_program,
    plan_chain,
    rank_batches,
    search_stage,
    stage_details,
    stage_graph,
    stage_options,
    traced_actions,
)
from methods.common import group_table
from methods.graph import capture_priced
from methods.hap.balance import batch_shares
from methods.pipeline import PipelineParallel, SharedCosts
from methods.pipeline.planning import tied_params
from methods.pipeline.schedule import ScheduleRefused

SCHEDULES = ("1f1b", "gpipe")  # one stage per rank: what the runtime runs
# The cutter's plan per SharedCosts (a search's costs of one case) and stage count
_cuts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stage_signature(st: StageGraph) -> tuple:
    """What hap's plan of a stage depends on, without its nodes' names: per node (in order) its
    kind, op, shape, dtype, FLOPs and arguments (nodes as positions), and its borders. Stages of
    equal signatures over alike machines get the same program."""
    nodes = st.graph.nodes
    pos = {n.name: i for i, n in enumerate(nodes)}

    def arg(a):
        if isinstance(a, fx.Node):
            return ("node", pos.get(a.name, -1))
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, arg(v)) for k, v in a.items()))
        return repr(a)

    return (
        st.last,
        st.ends_at_loss,
        tuple(pos[t] for t in st.crossing_in),
        tuple(pos[t] for t in st.crossing_out),
        tuple(
            (
                n.kind,
                n.op,
                n.shape,
                str(n.dtype),
                n.flops,
                n.backward_factor,
                n.is_param,
                n.tuple_shapes,
                tuple(pos.get(i, -1) for i in n.inputs),
                tuple(pos.get(i, -1) for i in n.shape_inputs),
                arg(n.fx_node.args) if n.kind != "get_attr" else (),
                arg(dict(n.fx_node.kwargs)) if n.kind != "get_attr" else (),
            )
            for n in nodes
        ),
    )


def machine_groups(cluster: ClusterSpec) -> tuple[list[list[int]], str]:
    """The stages' groups (one per machine, in machine order) where the cluster admits them, and
    else ([], why in one line)."""
    per: dict[int, list[int]] = {}
    for r, d in enumerate(cluster.devices):
        per.setdefault(d.machine, []).append(r)
    groups = [per[m] for m in sorted(per)]
    sizes = {len(g) for g in groups}
    if len(groups) < 2:
        return [], f"cluster={cluster.name} has one machine: no pipeline of machines"
    if len(sizes) != 1:
        return [], f"cluster={cluster.name}'s machines hold unlike numbers of GPUs {sorted(sizes)}"
    if sizes == {1}:
        return [], f"cluster={cluster.name}'s machines hold one GPU each: a stage of one GPU is the pipeline's own"
    return groups, ""


class HapStages:
    """Pipelines of hap stages (module docstring), as one of auto's parts.

    Args:
        hap: the hap planner auto's hap candidates use (its search options: SFB, collective
            choice, routing, beam); planned here at the GPU level, lp=False, one segment.
        pipeline: the pipeline method auto's pipelines use (its schedule, micro-batches,
            profile), for the cuts and the micro-batches.
        num_stages: the pipeline's stages (the cluster's machines).
        lr, grad_clip: Adam's learning rate and the max global gradient norm (0 = off).
    """

    name = "hap_stages"

    def __init__(self, hap, pipeline, num_stages: int, lr: float = 5e-4, grad_clip: float = 0.0):
        self.hap, self.pipeline = hap, pipeline
        self.num_stages = num_stages
        self.lr, self.grad_clip = lr, grad_clip
        self.modes = ("real", "sim")
        self.mirror_full_state = False

    def planner(self):
        """hap's planner for a stage: the template's search at the GPU level, ratios
        compute-proportional (lp=False), one segment, no plan cache, no memory tools; its
        programs' micro-steps unlabelled (the plan records each stage's program as one
        micro-batch runs it)."""
        return dataclasses.replace(
            self.hap,
            lp=False,
            num_segments=1,
            levels="cluster",
            cache_dir=None,
            activation_checkpointing=False,
            grad_accumulation=1,
            label_micro_steps=False,  # its programs at the schedule's micro-batches are only priced
        )

    def cutter(self) -> PipelineParallel:
        """The pipeline planner that cuts the stages: machine slots, one stage a rank,
        replicated state, alike hardware kept in a stage's replicas."""
        p = self.pipeline
        return PipelineParallel(
            name="pipeline",
            schedule=p.schedule if p.schedule in SCHEDULES else "auto",
            num_micro_batches=p.num_micro_batches,
            stage_level="machine",
            num_stages=self.num_stages,
            stages_per_rank=1,
            shares="equal",
            alike="stage",
            activation_checkpointing=False,
            bucket_cap_mb=p.bucket_cap_mb,
            lr=self.lr,
            grad_clip=self.grad_clip,
            profile=p.profile,
            sharded_state=False,
            work_probe=False,
        )

    def cut(self, workload: Workload, cluster: ClusterSpec, shared: SharedCosts | None = None) -> Plan:
        """The pipeline planner's plan for this layout (cutter), made once per `shared` (the
        search's costs of the case: its floor and its plan read the same)."""
        machines, why = machine_groups(cluster)
        if not machines:
            raise ConfigError(f"hap stages need whole machines of 2 or more GPUs each: {why}")
        if len(machines) != self.num_stages:
            raise ConfigError(
                f"hap stages run one stage per machine: {self.num_stages} stages on cluster={cluster.name}'s "
                f"{len(machines)} machines"
            )
        if shared is None:
            return self.cutter().plan(workload, cluster)
        kept = _cuts.setdefault(shared, {})
        if self.num_stages not in kept:
            kept[self.num_stages] = self.cutter().plan(workload, cluster, shared)
        return kept[self.num_stages]

    def floor_s(self, workload: Workload, cluster: ClusterSpec, shared: SharedCosts | None = None) -> float:
        """What this part's price cannot beat, before any stage is planned: the schedule (the
        faster of 1F1B and GPipe) replayed with each stage's forward and backward at its
        data-parallel compute (the pipeline planner's, at a replica's micro-batch: a hap program
        over the machine splits or replicates every op, so its slowest GPU computes at least
        that), no send, no gradient sync, no optimizer step. Where the cutter's stages were
        timed on this host (an emulated CPU cluster's profile) their seconds are no FLOP price
        of hap's programs: 0 (no floor). The search prices the family only where this is below
        the fastest found (methods.auto.search)."""
        try:
            cut = self.cut(workload, cluster, shared)
        except (ConfigError, PlanningError):
            return 0.0
        program = cut.program
        if any(w.measured is not None for st in program.stages for w in st.work):
            return 0.0
        times = action_times(program, cluster)
        S, m = program.num_stages, program.num_micro_batches
        prices = [
            StagePrice(min(t.forward for t in row), min(t.backward for t in row), 0.0, 0.0, 0.0, 0.0, 0.0)
            for row in times
        ]
        mb = sum(program.micro_batches)
        found = []
        for sc in SCHEDULES:
            try:
                actions = traced_actions(sc, S, m)
            except ScheduleRefused:  # torch's own check of the shape (micro-batches below stages)
                continue
            found.append(replay_stages(lockstep(actions, sc, m, mb), cluster, prices, [0.0] * S)[0])
        return min(found, default=0.0)

    def plan(self, workload: Workload, cluster: ClusterSpec, shared: SharedCosts | None = None) -> Plan:
        t0 = time.perf_counter()
        cut = self.cut(workload, cluster, shared)
        d = cut.details
        S, R, m = d["num_stages"], d["num_pipelines"], d["num_micro_batches"]
        G = d["layer_groups"]
        cuts = [st["groups"][0] for st in d["stages"]] + [G]
        groups = [list(st["ranks"]) for st in d["stages"]]
        if len(set(d["micro_batches"])) != 1:
            raise PlanningError(
                f"the pipelines' micro-batches {d['micro_batches']} are unlike; hap stages split one row"
            )
        mb = sum(d["micro_batches"])
        graph = capture_priced(workload.model_cfg, mb, workload.precision, cluster.device)
        table = group_table(graph)
        tied = tied_params(table, cuts, list(range(S)))
        if tied:
            raise ConfigError(
                f"the cuts {cuts} leave tied parameter {tied[0][0]!r} on stages {list(tied[0][1])}; hap stages "
                "hold no copies of a tied parameter"
            )
        planner = self.planner()
        stages, options, alike = [], [], []
        memo: dict[tuple, list] = {}  # stages alike in structure on alike machines: planned once
        for s in range(S):
            st = stage_graph(graph, table, cuts[s], cuts[s + 1], loss=s + 1 < S)
            group = group_cluster(cluster, groups[s])
            key = (stage_signature(st), group.machines)
            if key not in memo:
                memo[key] = stage_options(planner, st, workload, group, m)
            else:
                alike.append(s)
            stages.append(st)
            options.append(memo[key])
        plans = [opts[0] for opts in options]  # the searches: their rows (_choose takes no other row)
        rows = [tuple(round(x, 9) for x in cand.ratios[0]) for cand, _ in plans]
        if len(set(rows)) != 1 or any(len(cand.ratios) != 1 for cand, _ in plans):
            raise PlanningError(f"the stages' ratio rows differ ({sorted(set(rows))}); hap stages split one row")
        shares = batch_shares(mb, plans[0][0].ratios[0])
        if min(shares) < 1:
            raise PlanningError(f"a micro-batch of {mb} samples leaves a rank of {R} none (shares {shares})")
        meta = {"method": "auto", "model": workload.name, "part": self.name}
        tail = loss_tail(graph, table)  # the last stage's loss_fn runs it beside the stage's program
        best = None
        for schedule in SCHEDULES:
            try:
                got = self._choose(options, groups, cuts, table, shares, schedule, m, cluster, meta, tail)
            except ScheduleRefused:  # torch's own check of the shape (micro-batches below stages)
                continue
            if best is None or got[0] < best[0]:
                best = got
        if best is None:
            raise PlanningError(f"neither of {', '.join(SCHEDULES)} runs {S} stages at {m} micro-batches")
        _, schedule, program, choice = best
        plans = [opts[c] for opts, c in zip(options, choice)]
        # The stages planned as an alike one's are priced by its plan; their own plans (their
        # nodes' names in the format's steps) are made where this plan is kept (finish).
        self._made = (
            workload,
            cluster,
            planner,
            stages,
            plans,
            alike,
            groups,
            cuts,
            table,
            shares,
            m,
            meta,
            tail,
            choice,
        )
        details = self.details(stages, plans, groups, cuts, shares, mb, m, schedule, alike)
        details["cut_by"] = {"schedule": d["schedule"], "num_micro_batches": m}
        details["planned_in_s"] = time.perf_counter() - t0
        loads, slices = rank_batches(details["hap_stages"])
        return Plan(self.name, loads, details, program, None, data_slices=slices)

    def _choose(self, options, groups, cuts, table, shares, schedule: str, m: int, cluster, meta, tail) -> tuple:
        """(key, schedule, program, choice): per stage one of its options (stage_options),
        from two starts (every stage's search of the whole stage; every stage's better option by
        its own score), changed for the stages alike in structure together or for one stage
        while the pipeline's price (simulate of its program: fits first, then time) improves;
        the better end. Raises ScheduleRefused."""

        priced: dict[tuple, tuple] = {}  # a choice's price: the starts and the moves meet the same choices

        def price(choice):
            key = tuple(choice)
            if key not in priced:
                plans = [opts[c] for opts, c in zip(options, choice)]
                program = pipeline_program(
                    plans, groups, cuts, table, shares, schedule, m, cluster.num_devices, meta, tail
                )
                sim = simulate(program, cluster, None)
                priced[key] = (sim.oom, sim.iter_time_s if not sim.oom else max(sim.peak_mem_gib)), program
            return priced[key]

        # a move: the stages alike in structure (one options list) together, or one stage
        classes = {id(opts): [s for s, o in enumerate(options) if o is opts] for opts in options}
        moves = [g for g in classes.values() if len(g) > 1] + [[s] for s in range(len(options))]
        best = None
        for start in ([0] * len(options), [best_option(opts) for opts in options]):
            choice = start
            key, program = price(choice)
            changed = True
            while changed:
                changed = False
                for move in moves:
                    opts = options[move[0]]
                    for c in range(len(opts)):
                        if all(choice[s] == c for s in move) or opts[c][0].ratios != opts[0][0].ratios:
                            continue
                        trial = [c if s in move else x for s, x in enumerate(choice)]
                        got = price(trial)
                        if got[0] < key:
                            choice, (key, program), changed = trial, got, True
            if best is None or key < best[0]:
                best = (key, schedule, program, choice)
        return best

    def details(
        self,
        stages: Sequence,
        plans: Sequence,
        groups: Sequence[Sequence[int]],
        cuts: Sequence[int],
        shares: Sequence[int],
        mb: int,
        m: int,
        schedule: str,
        pending: Sequence[int] = (),
    ) -> dict:
        """The plan's details: `hap_stages` in the agreed format, beside the pipeline method's keys
        (a stage in `pending`: None until finish plans it)."""
        S, R = len(groups), len(groups[0])
        return {
            "hap_stages": {
                "cuts": list(cuts),
                "groups": [list(g) for g in groups],
                "batch_shares": list(shares),
                "micro_batch": mb,
                "num_micro_batches": m,
                "schedule": schedule,
                "stages": [
                    None if s in pending else stage_details(cand, st)
                    for s, (st, (cand, _)) in enumerate(zip(stages, plans))
                ],
            },
            "schedule": schedule,
            "num_stages": S,
            "num_pipelines": R,
            "num_micro_batches": m,
            "micro_batch": mb,
            "stages": [
                {"groups": [cuts[s], cuts[s + 1] - 1], "ranks": list(groups[s]), "chosen": plans[s][0].kind}
                for s in range(S)
            ],
            "pipelines": [[groups[s][i] for s in range(S)] for i in range(R)],
            "layer_groups": cuts[-1],
            "optimizer": f"torch.optim.Adam(lr={self.lr:g})",
        }

    def finish(self, plan: Plan, cluster: ClusterSpec) -> Plan:
        """The plan made whole where it is kept: each stage that was priced by an alike stage's
        plan planned on its own graph, the program rebuilt from the stages' own plans and its
        details filled in (the price is then simulate's of that program, as for every plan)."""
        workload, planned_on, planner, stages, plans, alike, groups, cuts, table, shares, m, meta, tail, choice = (
            self._made
        )
        if not alike:
            return plan
        plans = list(plans)
        for s in alike:  # the option the price chose, alone (stage_options' order: the search, then the chain)
            group = group_cluster(planned_on, groups[s])
            option = plan_chain if choice[s] else search_stage
            plans[s] = option(planner, stages[s], workload, group, m)
            if plans[s] is None:
                raise PlanningError(
                    f"stage {s} was priced as a chain of its layer groups, which its own graph does not make"
                )
        schedule = plan.details["schedule"]
        program = pipeline_program(plans, groups, cuts, table, shares, schedule, m, cluster.num_devices, meta, tail)
        details = self.details(stages, plans, groups, cuts, shares, sum(shares), m, schedule)
        keep = {k: v for k, v in plan.details.items() if k not in details}
        return dataclasses.replace(plan, details={**details, **keep}, program=program)

    def setup(self, plan: Plan, model: nn.Module, ctx: RankContext):
        from methods.auto.hap_stages_runtime import HapStagesTrainer

        return HapStagesTrainer(
            plan, model, ctx, lr=self.lr, grad_clip=self.grad_clip, mirror_full_state=self.mirror_full_state
        )
