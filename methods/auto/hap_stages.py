"""hap's synthesis inside each pipeline stage: a stage's graph and theory, its plan, its price, its program.

In the pipeline method a stage held by a slot of several devices (its R ranks, one per pipeline) runs
the stage's layer groups data parallel: each rank the whole stage at its pipeline's
micro-batch, the ranks all-reducing their gradients once the schedule is through. Here the
slot is one group of devices that runs ONE program for the stage, synthesized by hap's
planner over the group (sharding, tensor-parallel and expert-parallel rules, collective
choice), on the group's micro-batch (the sum of the replicas' micro-batches), with
activations crossing stage borders rank-aligned: rank r of stage s sends its share of the
border tensors to rank r of stage s + 1 (torchtitan's PP x TP).

Boundary conditions:
  - precondition: every tensor crossing into a stage (not a model input) is created batch-split,
    Gather(0) at the group's ratio row: the rank's samples of the micro-batch, as the previous
    stage's rank r sent them (`StageGraph.crossing_in`, sources restricted to layout 0, or
    Identity where the tensor has no batch dim);
  - postcondition: every tensor crossing out ends batch-split, Gather(0), at the same row. A
    middle stage has no loss, so its graph ends in a synthetic node (`BOUNDARY`) that reads the
    crossing tensors and whose only triple is {Gather(0), ...} BOUNDARY {Reduce}: hap's goal
    (the loss as Reduce) then holds exactly when every output is batch-split. Its backward hands
    each output's gradient back in Gather(0), as the next stage's rank r sends it;
  - the ratio row that splits the batch is the same at every stage (a replica's micro-batch is
    the same at every stage): planned here over groups of alike devices of the same size,
    with compute-proportional ratios (`lp=False`, even within an alike group), so the row is
    tied by construction; one segment.

The planner is hap's own (`HapPlanner._search_levels`: its levels, starts, A* with its
data-parallel incumbent, collective choice), over a ClusterSpec of the group's machines, on the
stage's graph instead of the model's. A stage's price per micro-batch is its program's forward
and backward stages (collectives included) without the gradient all-reduce, which runs once
after the schedule (`StagePrice.grad_sync_s`); the pipeline is then priced by the pipeline's
own replay of torch's schedule (torch's traced actions, one pipeline standing for a group's
ranks in lockstep), with rank-aligned sends: bench.cost.group_pipeline, the simulator's.

A stage's program runs as hap's per-rank code (`stage_program`: methods.hap.codegen's
RankProgram of the stage's plan over the stage's process group, its inputs the stage's
placeholders, its outputs the crossing tensors); tests/e2e/test_hap_stages_runtime.py holds two
stages of tiny BERT, each on 2 gloo ranks, to one device's activations, loss and gradients.
methods/auto/hap_stages_runtime.py runs a pipeline of any number of them under torch's schedule
(each rank's program a PipelineStage, the last stage's graph ending where the loss's tail
begins: `stage_graph(..., loss=False)`), from the plan format `details["hap_stages"]` and the
samples each rank loads (`rank_batches`); tests/e2e/test_hap_stage_pipeline.py trains 2 and 3
stages like one device. auto plans such pipelines as a family of its candidates
(methods/auto/stage_plan.py; docs/methods.md, "Pipelines of hap stages"), priced by the
simulator as a bench.cost.GroupPipelineProgram (`pipeline_program`), whose per-stage and lockstep
pricing `price_stage` and `price_pipeline` share.

It lives under methods/auto because it composes two methods (hap's planner and the pipeline's
schedule), which only auto may (a method never imports another: pyproject's import contracts).
scripts/hap_in_stages.py prices pipelines with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from bench.core.cluster import ClusterSpec
from bench.core.interfaces import Workload
from bench.core.program import Affine, Program, Stage, op_class
from bench.core.shares import offsets
from bench.cost.group_pipeline import (
    GroupPipelineProgram,
    GroupStage,
    lockstep,
    replay_stages,
    stage_price,
)
from bench.cost.group_pipeline import (
    StagePrice as GroupStagePrice,
)
from bench.cost.group_pipeline import group_cluster as group_cluster  # the stage's group: planned over here
from bench.cost.pipeline import PipelineProgram, in_flight, transfer_s
from methods.common import GroupTable
from methods.graph import Graph, Node
from methods.hap.codegen import CodegenOptions, RankProgram
from methods.hap.lowering import build_program
from methods.hap.planner import Candidate, HapPlanner, _better, _score, step_fields
from methods.hap.search import SearchResult, SearchStats
from methods.hap.steps import Step
from methods.hap.theory import IDENTITY, REDUCE, Rule, Theory, derive_theory
from methods.pipeline.schedule import trace_schedule

BOUNDARY = "stage_boundary"  # the synthetic last node of a middle stage's graph


@dataclass
class StageGraph:
    """Layer groups [first, end) of a model's graph as a graph of their own."""

    graph: Graph
    first: int
    end: int
    crossing_in: list[str]  # tensors made by earlier stages that this one reads (its placeholders)
    crossing_out: list[str]  # tensors it makes that later stages read (BOUNDARY's inputs)
    model_inputs: list[str]  # the model's own inputs it reads (free layouts: loaded per rank)
    # The last stage without the loss's tail: crossing_out are the tensors the tail reads (the
    # pipeline's loss_fn computes it per rank), handed on in whole samples.
    ends_at_loss: bool = False
    # The model's graph and its layer groups the stage was cut from: plan_stage also plans the
    # stage as its layer groups in a row (plan_chain).
    source: tuple[Graph, GroupTable] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def last(self) -> bool:
        return not self.crossing_out

    @property
    def inputs(self) -> list[str]:
        """Its placeholders in graph order: what its program (stage_program) takes, in that order."""
        return [n.name for n in self.graph.nodes if n.kind == "placeholder"]


def stage_graph(graph: Graph, table: GroupTable, first: int, end: int, loss: bool = True) -> StageGraph:
    """The ops of layer groups [first, end) (and on the last stage the loss's tail), the
    parameters they read, the tensors crossing in as placeholders and, on a middle stage, a
    BOUNDARY node reading the tensors crossing out, which is the graph's loss.

    `loss=False` (the last stage as a pipeline runs it): the loss's tail (`table.tail`, which
    reads the targets) is left out and the graph ends in a BOUNDARY over the tensors the tail
    reads, handed on batch-split in whole samples; torch's schedule hands the targets to its
    loss_fn, which runs the tail on each rank's shard (methods/auto/hap_stages_runtime.py)."""
    last_group = table.num_groups - 1
    members = {n for n, g in table.node_group.items() if first <= g < end}
    with_loss = end - 1 == last_group and loss
    if with_loss:
        members |= set(table.tail)
    elif end - 1 == last_group:
        members -= set(table.tail)
    nodes, names = [], set()
    crossing_in, model_inputs = [], []

    def reads(n: Node) -> list[str]:
        return [*n.inputs, *n.shape_inputs]

    needed = {i for n in graph.nodes if n.name in members for i in reads(n)}
    for n in graph.nodes:
        if n.name in members or (n.name in needed and n.kind == "get_attr"):
            nodes.append(n)
        elif n.name in needed and n.kind == "placeholder":
            nodes.append(n)
            model_inputs.append(n.name)
        elif n.name in needed:
            if not n.is_tensor:
                raise ValueError(f"{n.where} crosses into stage [{first}, {end}) but is not a tensor")
            nodes.append(dataclasses.replace(n, kind="placeholder", inputs=[], flops=0.0, shape_inputs=[]))
            crossing_in.append(n.name)
        else:
            continue
        names.add(n.name)
    crossing_out = [
        n.name
        for n in graph.nodes
        if n.name in members and n.is_tensor and any(u not in members for u in graph.users.get(n.name, ()))
    ]
    if with_loss:
        crossing_out = []
        loss_node = graph.loss
    else:
        if not crossing_out:
            raise ValueError(f"stage [{first}, {end}) hands nothing to the next stage")
        nodes.append(_boundary_node(crossing_out))
        loss_node = BOUNDARY
    # keep the graph's topological order (crossing tensors were made before every member)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    nodes.sort(key=lambda n: order.get(n.name, len(order)))
    sub = Graph(graph.gm, nodes, loss_node, graph.batch_size, casts=graph.casts, call_casts=graph.call_casts)
    return StageGraph(
        sub, first, end, crossing_in, crossing_out, model_inputs, end - 1 == last_group and not loss, (graph, table)
    )


def _boundary_node(outputs: list[str]) -> Node:
    g = fx.Graph()
    fx_node = g.call_function(torch.ops.aten.sum.default, ())
    fx_node.name = BOUNDARY
    return Node(BOUNDARY, "call_function", BOUNDARY, fx_node, list(outputs), (), torch.float32, 0.0, 0.0)


def stage_theory(stage: StageGraph, sfb: bool = True, grouped: bool = True, fuse_routing: bool = True) -> Theory:
    """hap's triples of the stage's ops, with the boundary conditions: crossing tensors created
    batch-split (Gather(0); Identity where dim 0 is not the batch), and on a middle stage the
    BOUNDARY triple {Gather(0) each} -> Reduce, the only way to the goal."""
    g = stage.graph
    core_nodes = [n for n in g.nodes if n.name != BOUNDARY]
    core = Graph(
        g.gm,
        core_nodes,
        g.loss if stage.last else stage.crossing_out[0],
        g.batch_size,
        casts=g.casts,
        call_casts=g.call_casts,
    )
    theory = derive_theory(core, sfb=sfb, grouped=grouped, fuse_routing=fuse_routing)
    sources = dict(theory.sources)
    for t in stage.crossing_in:
        node = g[t]
        sources[t] = [0] if node.shape and node.shape[0] == g.batch_size and node.shape[0] > 1 else [IDENTITY]
    rules = dict(theory.rules)
    if not stage.last:
        batch_split = _whole_samples if stage.ends_at_loss else _batch_like
        pre = tuple(0 if batch_split(g[t], g.batch_size) else IDENTITY for t in stage.crossing_out)
        post = REDUCE if 0 in pre else IDENTITY
        rules[BOUNDARY] = [Rule(BOUNDARY, pre, post, "boundary: batch-split outputs", sharded=0 in pre)]
    return dataclasses.replace(
        theory, graph=g, rules=rules, sources=sources, _comm_cache={}, search_cache={}, origins=dict(theory.origins)
    )


def _batch_like(node: Node, batch: int) -> bool:
    return bool(node.shape) and node.shape[0] == batch and batch > 1


def _whole_samples(node: Node, batch: int) -> bool:
    """Dim 0 runs over whole samples (the batch, or samples x positions flattened, as a loss
    reads its logits)."""
    return bool(node.shape) and batch > 1 and node.shape[0] % batch == 0


@dataclass(frozen=True)
class StagePrice(GroupStagePrice):
    """One stage's hap program over its group, per micro-batch of the group: the simulator's
    parts (bench.cost.group_pipeline.StagePrice) and what the study prints of the program."""

    granularity: str = "gpu"
    chosen: str = ""  # "synthesis" or "data parallel"
    summary: str = ""  # what it does (collectives, non-batch layouts)


def plan_stage(
    planner: HapPlanner, stage: StageGraph, workload: Workload, group: ClusterSpec, micro_batches: int = 1
) -> tuple[Candidate, Program]:
    """hap's best (program, ratios) for the stage over `group`, and that program as one
    micro-batch runs it: the better by the simulator of stage_options."""
    found = stage_options(planner, stage, workload, group, micro_batches)
    return found[best_option(found)]


def stage_options(
    planner: HapPlanner, stage: StageGraph, workload: Workload, group: ClusterSpec, micro_batches: int = 1
) -> list[tuple[Candidate, Program]]:
    """The stage's programs over `group` (each with its program as one micro-batch runs it):
    hap's search of the whole stage (search_stage) and, on a stage of several layer groups,
    those groups each planned alone in a row (plan_chain), both scored with the schedule's
    `micro_batches` (best_option: the better by that score).

    The search's A* prices a program as one step runs it (each gradient all-reduced once a
    micro-batch), and only its result and its data-parallel incumbent are scored with the
    schedule's micro-batches. On a stage of dense blocks and an MoE block neither is the best
    program there: the one step's best shards the dense blocks' weights too (their collectives
    then run every micro-batch), the incumbent replicates the experts (their all-reduce once
    after the schedule). Each group planned alone gets the simulator's choice for it, and the
    groups' programs, each starting and ending batch-split, run in a row as one program of the
    stage. A stage's own score does not see its place in the pipeline (a slower micro-batch on
    the slowest stage against a gradient sync that hides after the schedule), so a pipeline's
    planner prices both there (methods.auto.stage_plan)."""
    found = [search_stage(planner, stage, workload, group, micro_batches)]
    chained = plan_chain(planner, stage, workload, group, micro_batches)
    if chained is not None:
        found.append(chained)
    return found


def best_option(found: Sequence[tuple[Candidate, Program]]) -> int:
    """The index of the better of stage_options' programs by the stage's own score (the first
    where they tie)."""
    best = 0
    for i, (cand, _) in enumerate(found):
        if _better(cand, found[best][0]):
            best = i
    return best


def search_stage(
    planner: HapPlanner, stage: StageGraph, workload: Workload, group: ClusterSpec, micro_batches: int = 1
) -> tuple[Candidate, Program]:
    """hap's search of the whole stage over `group` (its levels and starts), as
    `HapPlanner._plan` searches a whole model, on the stage's graph and theory; and that
    program as one micro-batch runs it.

    `micro_batches`: the schedule's micro-batches per iteration. The candidates are scored by
    the simulator as hap's gradient accumulation prices them (the micro-batch's forward and
    backward that many times, the gradient all-reduce once), which is what a stage runs in a
    schedule: scored as one step, a program that shards weights to save their all-reduce wins
    where its collectives per micro-batch cost far more over the iteration."""
    if micro_batches > 1:
        planner = dataclasses.replace(planner, grad_accumulation=micro_batches)
    theory = stage_theory(stage, planner.sfb, planner.collective_choice, planner.fuse_routing)
    wl = dataclasses.replace(workload, global_batch=stage.graph.batch_size)
    levels = [group.virtual_device]
    if planner.levels == "both" and group.num_machines < group.num_devices:
        levels = ["machine", "gpu"]
    meta = {"method": "hap-in-stage", "model": workload.name, "groups": [stage.first, stage.end]}
    rounds: list = []
    stats = {"expanded": 0, "pruned": 0, "beam_pruned": 0, "search_s": 0.0, "lp_s": 0.0}
    try:
        best, rows = planner._search_levels(theory, wl, group, levels, meta, rounds, stats, "")
        if best is None:
            raise ValueError(f"stage [{stage.first}, {stage.end}): {rows[0].get('error')}")
        cost = planner._cost_model(theory, group, best.program.granularity, best.ratios)
        one = build_program(best.result.steps, cost, meta, planner.grad_overlap, planner.bucket_cap_mb * 2**20, 1)
    finally:
        planner._costs.clear()
        planner._simulated.clear()
    return best, one


CHAIN = "layer groups in a row"  # a Candidate's kind: plan_chain's program


def plan_chain(
    planner: HapPlanner, stage: StageGraph, workload: Workload, group: ClusterSpec, micro_batches: int = 1
) -> tuple[Candidate, Program] | None:
    """The stage as its layer groups in a row: each group planned alone (search_stage of its
    own stage graph), and their steps run one after another as one program of the stage
    (hap's step format: the steps of the stage's graph, in its order), scored by the simulator
    with `micro_batches` as search_stage scores; and that program as one micro-batch runs it.

    Each group's program starts with the tensors crossing into it batch-split (Gather(0)) and
    ends with those crossing out batch-split, so in a row each group reads what the one before
    made, in the layout it planned for: a middle group's boundary step is dropped and its
    collectives (an output brought to Gather(0)) run before the next group's first step that
    reads the tensor; a tensor the stage makes is no source of the group that reads it; a
    source two groups create alike is created once. None where that does not make one
    program: a stage of one group (or not cut from a model's graph), groups planned at other
    ratio rows or levels, a source two groups create in other layouts, or a stage whose
    outputs are not its last group's."""
    if stage.source is None or stage.end - stage.first < 2:
        return None
    graph, table = stage.source
    groups = [stage_graph(graph, table, i, i + 1, loss=not stage.ends_at_loss) for i in range(stage.first, stage.end)]
    if groups[-1].crossing_out != stage.crossing_out:
        return None
    parts = [search_stage(planner, g, workload, group, micro_batches)[0] for g in groups]
    granularity, rows = parts[0].program.granularity, parts[0].ratios
    if any(p.program.granularity != granularity or p.ratios != rows for p in parts):
        return None
    result = chain_steps(stage, [p.result for p in parts])
    if result is None:
        return None
    if micro_batches > 1:
        planner = dataclasses.replace(planner, grad_accumulation=micro_batches)
    theory = stage_theory(stage, planner.sfb, planner.collective_choice, planner.fuse_routing)
    meta = {"method": "hap-in-stage", "model": workload.name, "groups": [stage.first, stage.end]}
    bucket = planner.bucket_cap_mb * 2**20
    try:
        cost = planner._cost_model(theory, group, granularity, rows)
        program = build_program(
            result.steps, cost, meta, planner.grad_overlap, bucket, planner.grad_accumulation, planner.label_micro_steps
        )
        cand = _score(CHAIN, program, group, rows, stage.graph.batch_size, result)
        one = build_program(result.steps, cost, meta, planner.grad_overlap, bucket, 1)
    finally:
        planner._costs.clear()
        planner._simulated.clear()
    return cand, one


def chain_steps(stage: StageGraph, parts: Sequence[SearchResult]) -> SearchResult | None:
    """The programs of the stage's layer groups (`parts[i]`: a program of group first + i's own
    stage graph, stage_graph(..., first + i, first + i + 1)) run in a row as one program of the
    stage's graph (plan_chain); None where they do not make one."""
    if len(parts) != stage.end - stage.first:
        raise ValueError(f"{len(parts)} programs for the {stage.end - stage.first} layer groups of the stage")
    sources = {n.name for n in stage.graph.nodes if n.kind in ("placeholder", "get_attr")}
    steps: list[Step] = []
    created: dict[str, object] = {}
    carried: list = []  # a dropped boundary's collectives, not yet run
    for k, part in enumerate(parts):
        for step in part.steps:
            if step.node == BOUNDARY and k + 1 < len(parts):
                carried += step.comms
                continue
            own = []
            for t, lay in step.sources:
                if t not in sources:
                    continue  # made by an earlier group of the stage
                if t in created and created[t] != lay:
                    return None
                if t not in created:
                    created[t] = lay
                    own.append((t, lay))
            reads = {*stage.graph[step.node].inputs, *(t for t, _ in step.sources), *(c.tensor for c in step.comms)}
            now = tuple(c for c in carried if c.tensor in reads)
            carried = [c for c in carried if c.tensor not in reads]
            steps.append(dataclasses.replace(step, sources=tuple(own), comms=now + step.comms))
    if carried:
        return None
    return SearchResult(steps, sum(p.cost_s for p in parts), SearchStats(), parts[-1].final_comms)


def stage_details(cand: Candidate, stage: StageGraph) -> dict:
    """The plan-format fields (docs/planner.md "Plan format") of the stage's program, as
    `RankProgram` reads them: hap's own `step_fields` of the stage's graph, its ratio rows and
    granularity."""
    return {**step_fields(cand.result, stage.graph), "ratios": cand.ratios, "granularity": cand.program.granularity}


def rank_batches(hs: dict) -> tuple[list[int], list[tuple[int, int]]]:
    """The Plan's `batch_shares` and `data_slices` of a plan of hap stages, per global rank: what
    the runner hands each rank (bench.runtime.worker loads `data_slices[rank]` of each global
    batch). Every rank of pipeline i (rank i of every stage's group) loads the samples
    [m x start_i, m x stop_i), (start_i, stop_i) its share's place in a micro-batch (the first
    stage reads their inputs, the last their targets); its batch share is what it loads, m x its part of one micro-batch."""
    m = hs["num_micro_batches"]
    spans = offsets(hs["batch_shares"])
    world = sum(len(g) for g in hs["groups"])
    shares, slices = [0] * world, [(0, 0)] * world
    for group in hs["groups"]:
        for i, rank in enumerate(group):
            shares[rank] = m * hs["batch_shares"][i]
            slices[rank] = (m * spans[i][0], m * spans[i][1])
    return shares, slices


def stage_program(
    stage: StageGraph,
    details: dict,
    batch_shares: Sequence[int],
    model: torch.nn.Module,
    rank: int,
    world_size: int,
    options: CodegenOptions | None = None,
    group=None,
) -> RankProgram:
    """Rank `rank` of the stage group's program of the stage: hap's per-rank code of its plan
    (`details`, stage_details), over the process group `group` of the stage's ranks (`rank`
    its place there; None: the default group). Called
    with the rank's shards of the stage's inputs (`stage.inputs`, in that order: the model's
    inputs it reads at the rank's batch share, the crossing tensors as rank `rank` of the
    stage before made them), it returns on a middle stage (and on a last stage without its
    loss) its shards of `crossing_out` (Gather(0) at the ratio row, or whole where a tensor has
    no batch dim) and on a last stage with its loss its part of the summed loss. Its parameters
    are the rank's shards of the model's (`params`)."""
    if details.get("granularity", "gpu") != "gpu":
        raise ValueError("a stage's program runs per GPU; machine-level stage plans have no runtime yet")
    return RankProgram(
        stage.graph,
        details,
        details["ratios"],
        batch_shares,
        model,
        rank,
        world_size,
        options,
        outputs=stage.crossing_out,
        group=group,
    )


@dataclass(frozen=True)
class LossTail:
    """The loss's tail (GroupTable.tail) of a micro-batch, which a pipeline's last stage runs in
    its loss_fn beside its program (data parallel over each rank's samples): its forward and
    backward compute, a Stage per op class (the micro-batch's FLOPs, split by the ratio row),
    and the bytes kept for it until backward (the micro-batch's): its ops' saved tensors and
    the stage's output it reads."""

    forward: tuple[Stage, ...] = ()
    backward: tuple[Stage, ...] = ()
    kept_bytes: float = 0.0


def loss_tail(graph: Graph, table: GroupTable) -> LossTail:
    """The tail of `graph` (captured at the group's micro-batch) as LossTail."""
    tail = set(table.tail)
    flops: list[dict[str, float]] = [{}, {}]
    for name in table.tail:
        n = graph[name]
        if n.flops:
            cls = op_class(n.op)
            flops[0][cls] = flops[0].get(cls, 0.0) + n.flops
            flops[1][cls] = flops[1].get(cls, 0.0) + graph.backward_flops(n)
    kept = sum(graph[t].nbytes * factor for t, (factor, keeper) in graph.kept_until().items() if keeper in tail)
    # and the stage's output the tail reads, which torch's schedule keeps for its loss_fn: as
    # the pipeline method counts a last stage's (methods.common.StageActivations)
    kept += sum(
        graph[n].nbytes
        for n in table.node_group
        if n not in tail and graph[n].is_tensor and any(u in tail for u in graph.users.get(n, []))
    )
    forward, backward = (
        tuple(Stage(flops=Affine.sharded(f), op_class=c, label="loss tail") for c, f in sorted(d.items()))
        for d in flops
    )
    return LossTail(forward, backward, float(kept))


def group_stage(
    cand: Candidate,
    one: Program,
    ranks: Sequence[int],
    send_bytes: Sequence[float] = (),
    buffer_bytes: Sequence[float] = (),
    tail: LossTail | None = None,
) -> GroupStage:
    """The stage as bench.cost.group_pipeline prices it: its program as one micro-batch runs it
    (`one`), over the group of `ranks`, at its ratio rows; hap's forward steps are its first
    stages (one a step: methods.hap.lowering). `tail`: on a last stage planned without the
    loss's tail (stage_graph(..., loss=False)), that tail."""
    tail = tail or LossTail()
    return GroupStage(
        one,
        tuple(ranks),
        tuple(tuple(r) for r in cand.ratios),
        len(cand.result.steps),
        tuple(send_bytes),
        tuple(buffer_bytes),
        tail.forward,
        tail.backward,
        tail.kept_bytes,
    )


def price_stage(cand: Candidate, one: Program, group: ClusterSpec, tail: LossTail | None = None) -> StagePrice:
    """The stage's per-micro-batch parts (StagePrice) from its program (`one`: as one
    micro-batch runs it) at its ratios (and on a last stage without the loss, its `tail`):
    bench.cost.group_pipeline.stage_price, the simulator's."""
    p = stage_price(group_stage(cand, one, range(group.num_devices), tail=tail), group)
    steps = cand.result.steps
    comms = sorted({f"{c.kind}" for s in steps for c in s.comms if not c.free})
    layouts = sorted({f"{s.node}:{s.rule.post}" for s in steps if isinstance(s.rule.post, int) and s.rule.post != 0})
    summary = f"comms {comms or 'none'}; {len(layouts)} ops with a non-batch split"
    parts = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    return StagePrice(**parts, granularity=one.granularity, chosen=cand.kind, summary=summary)


@dataclass(frozen=True)
class PipelinePrice:
    iter_time_s: float
    peaks_gib: tuple[float, ...]  # per stage: its state and the micro-batches its schedule keeps in flight
    oom: bool
    ends_s: tuple[float, ...]  # per position: when its schedule is through (before sync and optimizer)


def lockstep_program(schedule: str, num_stages: int, num_micro_batches: int, micro_batch: int) -> PipelineProgram:
    """One pipeline of `num_stages` positions running torch's `schedule` (its traced actions,
    methods.pipeline.schedule.trace_schedule): the stand-in for a pipeline of hap stages, whose
    groups move in lockstep (bench.cost.group_pipeline.lockstep)."""
    return lockstep(traced_actions(schedule, num_stages, num_micro_batches), schedule, num_micro_batches, micro_batch)


def traced_actions(schedule: str, num_stages: int, num_micro_batches: int) -> tuple[tuple[tuple, ...], ...]:
    """Per position, torch's `schedule` traced for one stage a position (what
    GroupPipelineProgram.actions holds)."""
    traces = [trace_schedule(schedule, num_stages, num_micro_batches, r) for r in range(num_stages)]
    if traces[0].stage_rank != tuple(range(num_stages)):
        raise ValueError(f"a pipeline of hap stages runs one stage per rank; {schedule} places {traces[0].stage_rank}")
    return tuple(tuple(t.actions) for t in traces)


def even_shares(micro_batch: int, size: int) -> list[int]:
    """A micro-batch split evenly over `size` ranks in whole samples (the first ranks a sample more)."""
    return [micro_batch // size + (i < micro_batch % size) for i in range(size)]


def border_bytes(
    table: GroupTable, cuts: Sequence[int], shares: Sequence[int]
) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]]]:
    """(sends, buffers): per stage and group rank i (its `shares[i]` samples of a micro-batch),
    the bytes it sends rank i of the next stage per micro-batch (none on the last stage), and its
    receive buffers of one micro-batch: its share of its input (from the stage before) and of its
    output's gradient (from the stage after). torch's stage keeps one of each for every
    micro-batch of the step (the pipeline's `StageBytes.received_bytes` and `sent_bytes`)."""
    S = len(cuts) - 1
    sends, buffers = [], []
    for k in range(S):
        received = table.groups[cuts[k] - 1].out_bytes if k else 0.0
        sent = table.groups[cuts[k + 1] - 1].out_bytes if k + 1 < S else 0.0
        sends.append(tuple(n * sent for n in shares) if k + 1 < S else ())
        buffers.append(tuple(n * (received + sent) for n in shares))
    return sends, buffers


def rank_aligned_sends(
    table: GroupTable, cuts: Sequence[int], groups: Sequence[Sequence[int]], micro_batch: int, cluster: ClusterSpec
) -> list[float]:
    """Per stage, seconds of its rank-aligned send of one micro-batch's border tensors, the
    micro-batch split evenly over the group (bench.cost.group_pipeline.stage_sends)."""
    sends, _ = border_bytes(table, cuts, even_shares(micro_batch, len(groups[0])))
    out = []
    for k in range(len(groups)):
        if k + 1 == len(groups):
            out.append(0.0)
            continue
        out.append(max(transfer_s(b, cluster, a, c) for b, a, c in zip(sends[k], groups[k], groups[k + 1])))
    return out


def rank_aligned_buffers(
    table: GroupTable, cuts: Sequence[int], groups: Sequence[Sequence[int]], micro_batch: int
) -> list[float]:
    """Per stage, the bytes of one micro-batch's receive buffers on its busiest rank (border_bytes
    at an even split of the micro-batch)."""
    _, buffers = border_bytes(table, cuts, even_shares(micro_batch, len(groups[0])))
    return [max(b) for b in buffers]


def pipeline_program(
    stages: Sequence[tuple[Candidate, Program]],
    groups: Sequence[Sequence[int]],
    cuts: Sequence[int],
    table: GroupTable,
    shares: Sequence[int],
    schedule: str,
    num_micro_batches: int,
    num_devices: int,
    meta: dict | None = None,
    tail: LossTail | None = None,
) -> GroupPipelineProgram:
    """The pipeline of hap stages as the simulator prices it (bench.cost.GroupPipelineProgram):
    per stage its hap plan (`stages[s]`: plan_stage's candidate and program) over the ranks
    `groups[s]`, the border bytes of each rank's share (`shares`, one row for every stage), and
    torch's `schedule` traced for len(stages) positions and `num_micro_batches`. `tail`: the
    loss's tail where the last stage was planned without it (loss_tail)."""
    sends, buffers = border_bytes(table, cuts, shares)
    S = len(stages)
    return GroupPipelineProgram(
        stages=tuple(
            group_stage(cand, one, groups[s], sends[s], buffers[s], tail if s + 1 == S else None)
            for s, (cand, one) in enumerate(stages)
        ),
        actions=traced_actions(schedule, len(stages), num_micro_batches),
        num_micro_batches=num_micro_batches,
        micro_batch=sum(shares),
        num_devices=num_devices,
        schedule=schedule,
        batch=num_micro_batches * sum(shares),
        meta=dict(meta or {}),
    )


def price_pipeline(
    schedule: str,
    num_micro_batches: int,
    micro_batch: int,
    prices: Sequence[StagePrice],
    sends: Sequence[float],
    memory_gib: float,
    cluster: ClusterSpec,
    buffer_bytes: Sequence[float] = (),
) -> PipelinePrice:
    """A pipeline of stages priced as bench.cost.group_pipeline prices a GroupPipelineProgram
    (replay_stages of the traced schedule in lockstep), from each stage's parts (`prices`:
    price_stage's, or a study's sums of them) instead of its program: the time, and per stage
    its busiest rank's peak with the micro-batches its schedule keeps in flight and its receive
    buffers (`buffer_bytes` a micro-batch, rank_aligned_buffers) for every micro-batch."""
    K = len(prices)
    program = lockstep_program(schedule, K, num_micro_batches, micro_batch)
    total, lines = replay_stages(program, cluster, prices, sends)
    ends = tuple(line.end_s for line in lines)
    peaks = []
    for k, p in enumerate(prices):
        flight = in_flight(program.actions[k])
        buffers = num_micro_batches * buffer_bytes[k] / 2**30 if buffer_bytes else 0.0
        peaks.append(p.peak_gib + (flight - 1) * p.activations_gib + buffers)
    return PipelinePrice(total, tuple(peaks), any(x > memory_gib for x in peaks), ends)
