"""Program synthesis by A* (HAP Sec. 4.3-4.5): pick one triple per op, plus the collectives
that connect them, minimising the modelled iteration time at fixed sharding ratios.

The search walks the reference graph in its topological order, so a partial program is a
prefix of decisions and its state is the set of layouts of the tensors still live. This is
where the paper's three search-time optimisations land:
  1. source triples (Placeholder-Shard / Parameter-Shard, empty pre-condition) are fused into
     their first consumer: a source gets the layout that consumer asks for, for free;
  2. each tensor is communicated at most once, and sources never;
  3. layouts of tensors with no remaining consumer are dropped from the state, so programs
     that reach the same frontier deduplicate.
Costs are those of bench.cost.price (the same stages end up in the emitted Program). Moves are
memoised per (op, layouts of its inputs), MoE routers stay in one layout family
(theory.routing_region) and an optional beam caps the states expanded per op. It does not
choose ratios (methods.hap.balance) and does not generate per-rank code.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Sequence

from bench.core.cluster import ClusterSpec
from bench.core.errors import PlanningError
from bench.core.program import (
    Affine,
    Collective,
    Memory,
    Program,
    Stage,
    affine_sum,
    backward_sweep,
    bucket_runs,
    op_class,
)
from bench.cost import FloatAlgebra, collective_time, stage_time, virtual_devices
from methods.capture import Graph
from methods.hap.segments import segment_ops
from methods.hap.theory import IDENTITY, REDUCE, CommRule, Layout, Rule, Theory

ADAM_STATE_PER_PARAM = 2.0  # two fp32 moments per parameter


class NoProgramError(PlanningError):
    """No distributed program satisfies the semantic constraint (loss as Reduce)."""


@dataclass(frozen=True)
class Step:
    """One instruction of a synthesized program: a triple plus the collectives fused in."""

    node: str
    rule: Rule
    comms: tuple[CommRule, ...]  # collectives on inputs, run just before the op
    sources: tuple[tuple[str, Layout], ...]  # sources created here (fused), with layouts

    segment: int = 0  # ratio row this op's Gather shards follow (methods.hap.planner segments)

    def describe(self) -> str:
        parts = [c.describe() for c in self.comms] + [self.rule.describe()]
        return "; ".join(parts)

    def to_json(self, graph: Graph | None = None) -> dict:
        """Machine-readable form (docs/planner.md "Plan format"); layouts are "I", "R" or an int dim."""
        r = self.rule
        out = {
            "node": self.node,
            "op": graph[self.node].op if graph is not None else None,
            "inputs": list(graph[self.node].inputs) if graph is not None else None,
            "rule": r.name,
            "pre": list(r.pre),
            "post": r.post,
            "sharded": r.sharded,
            "first_device_only": list(r.first_device_only),
            "sfb": r.sfb,
            "unit": r.unit,
            "shape_pre": [[t, lay] for t, lay in r.shape_pre],
            "segment": self.segment,
            "comms": [comm_to_json(c) for c in self.comms],
            "sources": [[t, lay] for t, lay in self.sources],
        }
        return out

    @staticmethod
    def from_json(d: dict) -> "Step":
        rule = Rule(
            d["node"],
            tuple(d["pre"]),
            d["post"],
            d["rule"],
            bool(d["sharded"]),
            tuple(d.get("first_device_only", ())),
            bool(d.get("sfb", False)),
            int(d.get("unit", 1)),
            tuple((t, lay) for t, lay in d.get("shape_pre", ())),
        )
        comms = tuple(comm_from_json(c) for c in d.get("comms", ()))
        sources = tuple((t, lay) for t, lay in d.get("sources", ()))
        return Step(d["node"], rule, comms, sources, int(d.get("segment", 0)))


def comm_to_json(c: CommRule) -> dict:
    out = {"tensor": c.tensor, "src": c.src, "dst": c.dst, "kind": c.kind, "impl": c.impl}
    if c.to_segment is not None:
        out["to_segment"] = c.to_segment
    return out


def comm_from_json(d: dict) -> CommRule:
    seg = d.get("to_segment")
    return CommRule(d["tensor"], d["src"], d["dst"], d["kind"], d.get("impl", "ring"), None if seg is None else int(seg))


def assign_segments(theory: Theory, num_segments: int,
                    segmentation: str = "layers") -> tuple[dict[str, int], dict[str, int]]:
    """(segment of each op, home segment of each tensor) for `num_segments` ratio rows.

    Ops in topological order are cut into groups by `segmentation` (methods.hap.segments:
    `layers` at layer-group borders, `flops` at equal FLOPs, `metis` by graph partitioning). A
    Gather'd tensor is sharded by the row of its home segment: an op output's is its op's, a
    parameter's that of the op that creates it (its first reader), an input's is 0 (each rank
    loads the first row's share of the batch). An op in another segment that reads it in a
    Gather layout reads a resharded copy (a `reshard` collective)."""
    graph = theory.graph
    order = [n.name for n in graph.nodes if n.name in theory.rules]
    op_seg = dict(zip(order, segment_ops(graph, order, num_segments, segmentation)))
    home = dict(op_seg)
    for name in order:
        for t in graph[name].inputs:
            if t in theory.sources and t not in home:
                home[t] = 0 if graph[t].kind == "placeholder" else op_seg[name]
    for t in theory.sources:
        home.setdefault(t, 0)
    return op_seg, home


@dataclass
class SearchStats:
    expanded: int = 0
    generated: int = 0
    pruned_dedup: int = 0
    pruned_bound: int = 0
    complete: int = 0
    beam_pruned: int = 0  # states not expanded because their position hit beam_width


@dataclass
class SearchResult:
    steps: list[Step]
    cost_s: float
    stats: SearchStats
    # Collectives after the last op that bring the loss to Reduce (e.g. keep_first of an
    # Identity loss); empty when the last op already leaves it as Reduce.
    final_comms: tuple[CommRule, ...] = ()


class CostModel:
    """Stage contents and seconds of steps at fixed ratios (cached per triple/collective)."""

    def __init__(self, theory: Theory, cluster: ClusterSpec, granularity: str, ratios: Sequence[Sequence[float]],
                 segmentation: str = "layers", grad_bucket_bytes: float = 0.0):
        self.theory = theory
        # > 0: replicated parameters' gradients are all-reduced in buckets of this many bytes
        # (build_program with grad_overlap), so each is charged its share of a full bucket's
        # all-reduce (source_time); 0: one all-reduce per parameter, as without overlap.
        self.grad_bucket_bytes = float(grad_bucket_bytes)
        self.graph = theory.graph
        self.cluster = cluster
        self.vdevs = virtual_devices(cluster, granularity)
        self.ratios = [list(r) for r in ratios]
        self.prices = FloatAlgebra(self.ratios)  # one for every price at these ratios
        self.num_segments = len(self.ratios)
        key = ("segments", self.num_segments, segmentation)
        if key not in theory.search_cache:  # the ratios do not move them: shared by every search
            theory.search_cache[key] = assign_segments(theory, self.num_segments, segmentation)
        self.op_segment, self.home = theory.search_cache[key]
        # The search's moves without their prices (_successors): they depend on the theory and
        # the segments alone, so every search of this theory at this segmentation shares them.
        self.segments_key = (self.num_segments, segmentation)
        self._recipes: dict = theory.search_cache.setdefault(("moves", self.segments_key), {})
        # op -> (tensors its moves depend on, their (tensor, layout) pairs)
        self._relevant: dict = theory.search_cache.setdefault(("relevant", self.num_segments), {})
        self.granularity = granularity
        self._rule_cost: dict = {}
        self._op_sig: dict = {}  # op -> what its triples' prices read besides the rule (rule_time)
        self._comm_cost: dict = {}  # CommRule -> seconds
        self._comm_price: dict = {}  # what a CommRule's price reads (comm_time) -> seconds
        self._coll_cost: dict = {}  # (kind, bytes, impl, devices, rows, grad) -> seconds
        self._param_cost: dict = {}
        self._moves: dict = {}  # search memo: (op, their layouts) -> moves, priced
        self._move_price: dict = {}  # what a move's price reads (_recipes) -> (seconds, its choices)

    # -- stage contents ----------------------------------------------------------------------
    def _bytes(self, tensor: str, layout: Layout, segment: int | None = None) -> Affine:
        """Bytes of `tensor` per device in `layout` (Gather: by its home segment's row)."""
        nbytes = float(self.graph[tensor].nbytes)
        seg = self.home[tensor] if segment is None else segment
        return Affine.sharded(nbytes, seg) if isinstance(layout, int) else Affine(nbytes)

    def needs_reshard(self, tensor: str, layout: Layout, segment: int) -> bool:
        """Whether an op in `segment` reads `tensor` in `layout` from another row's shards."""
        if not isinstance(layout, int) or self.home[tensor] == segment:
            return False
        shape = self.graph[tensor].shape
        return bool(shape) and int(shape[layout]) > 1

    def reshard(self, tensor: str, layout: Layout, segment: int) -> CommRule:
        return CommRule(tensor, layout, layout, "reshard", to_segment=segment)

    def comm_collectives(self, c: CommRule) -> tuple[list[Collective], list[Collective]]:
        """(forward, backward) collectives of one re-layout; backward runs the dual."""
        if c.free:
            return [], []
        nbytes = float(self.graph[c.tensor].nbytes)
        home = self.home[c.tensor]
        if c.kind == "reshard":
            rows = (home, c.to_segment)
            return ([Collective("reshard", Affine(nbytes), label=c.tensor, rows=rows)],
                    [Collective("reshard", Affine(nbytes), label=f"d{c.tensor}", rows=rows[::-1])])
        shard = Affine.sharded(nbytes, home)
        dual = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather"}
        if c.kind == "all_reduce":
            fwd = Collective("all_reduce", Affine(nbytes), label=c.tensor)
            return [fwd], [fwd]
        if c.kind == "all_to_all":
            fwd = Collective("all_to_all", shard, label=c.tensor)
            return [fwd], [fwd]
        return [Collective(c.kind, shard, c.impl, label=c.tensor)], [Collective(dual[c.kind], shard, c.impl, label=c.tensor)]

    def rule_parts(self, step_node: str, rule: Rule) -> tuple[Affine, Affine, list[Collective]]:
        """(forward FLOPs, backward FLOPs, extra backward collectives for SFB) of a triple."""
        node = self.graph[step_node]
        seg = self.op_segment[step_node]
        f = node.flops
        fwd = Affine.sharded(f, seg) if rule.sharded else Affine(f)
        bwd = fwd.scale(node.backward_factor)
        extra: list[Collective] = []
        if rule.sfb:
            # Gather the sufficient factors (input and output gradient), then every device
            # computes the full weight gradient: half the backward work, unsharded.
            bwd = Affine.sharded(f * node.backward_factor / 2, seg) + Affine(f * node.backward_factor / 2)
            x = node.inputs[0]
            extra = [
                Collective("all_gather", Affine.sharded(float(self.graph[x].nbytes), seg), "padded", label=f"{x} (sfb)"),
                Collective("all_gather", Affine.sharded(float(node.nbytes), seg), "padded", label=f"d{node.name} (sfb)"),
            ]
        return fwd, bwd, extra

    def param_sync(self, step: Step) -> list[Collective]:
        """Gradient all-reduce of replicated parameters created at this step (none with SFB)."""
        out = []
        for t, layout in step.sources:
            if self.graph[t].is_param and layout == IDENTITY and not step.rule.sfb:
                out.append(Collective("all_reduce", Affine(float(self.graph[t].nbytes)), label=f"grad {t}", grad=True))
        return out

    def grad_bytes(self, step: Step) -> Affine:
        total = Affine()
        for t, layout in step.sources:
            if self.graph[t].is_param:
                total = total + self._bytes(t, layout)
        return total

    def stages(self, step: Step, param_sync: bool = True) -> tuple[Stage, Stage]:
        """(forward, backward) stage of a step; param_sync=False leaves out the gradient
        all-reduce of replicated parameters (build_program buckets and overlaps them)."""
        fwd_flops, bwd_flops, sfb = self.rule_parts(step.node, step.rule)
        fwd_c = [g for t, lay in step.sources if (g := self.input_gather(t, lay)) is not None]
        bwd_c: list[Collective] = []
        for c in step.comms:
            f, b = self.comm_collectives(c)
            fwd_c += f
            bwd_c += b
        bwd_c += sfb + (self.param_sync(step) if param_sync else [])
        label = step.describe()
        kind_f, kind_b = self.compute_kind(step.node)
        return (
            Stage(tuple(fwd_c), fwd_flops, label=f"fwd {label}", **kind_f),
            Stage(tuple(bwd_c), bwd_flops, grad_bytes=self.grad_bytes(step), label=f"bwd {label}", **kind_b),
        )

    # -- seconds -----------------------------------------------------------------------------
    def stage_time(self, st: Stage) -> float:
        """The stage alone: its collectives, then its slowest device's compute. The all-reduce
        of its gradients inside machine-level devices is not charged: it runs on the intra-machine
        link beside the rest of backward (bench.cost.price), which only the simulator can price."""
        return stage_time(st, self.cluster, self.vdevs, self.prices)

    def comm_key(self, c: CommRule) -> tuple:
        """What the price of a re-layout reads (comm_collectives): a deep model's layers share it."""
        return (c.kind, c.impl, c.to_segment, self.graph[c.tensor].nbytes, self.home[c.tensor])

    def comm_time(self, c: CommRule) -> float:
        t = self._comm_cost.get(c)
        if t is None:
            key = self.comm_key(c)
            t = self._comm_price.get(key)
            if t is None:
                f, b = self.comm_collectives(c)
                t = self._comm_price[key] = sum(self.collective_time(x) for x in f + b)
            self._comm_cost[c] = t
        return t

    def collective_time(self, x: Collective) -> float:
        """Seconds of one collective at this model's ratios, priced once per distinct call
        (tensors of one size, as in a model's repeated layers, share it: the label is not priced)."""
        key = (x.kind, x.nbytes, x.impl, x.devices, x.rows, x.grad)
        t = self._coll_cost.get(key)
        if t is None:
            t = self._coll_cost[key] = collective_time(x, self.cluster, self.vdevs, self.prices)
        return t

    def rule_key(self, node: str, rule: Rule) -> tuple:
        """What the price of a triple reads (rule_parts, compute_kind), not the op's name: the
        repeated layers of a deep model share one per segment."""
        sig = self._op_sig.get(node)
        if sig is None:  # once per op: the search asks for its triples' prices again and again
            n = self.graph[node]
            first = self.graph[n.inputs[0]].nbytes if n.inputs else 0
            sig = self._op_sig[node] = (self.op_segment[node], n.op, n.flops, n.backward_factor, n.nbytes, first,
                                        any(self.graph[t].is_param for t in n.inputs))
        return (*sig, rule.sharded, rule.sfb)

    def rule_time(self, node: str, rule: Rule) -> float:
        """Compute (fwd + bwd) plus SFB collectives of a triple, without parameter sync
        (cached by rule_key)."""
        key = self.rule_key(node, rule)
        if key not in self._rule_cost:
            fwd, bwd, extra = self.rule_parts(node, rule)
            kind_f, kind_b = self.compute_kind(node)
            self._rule_cost[key] = (self.stage_time(Stage((), fwd, **kind_f))
                                    + self.stage_time(Stage(tuple(extra), bwd, **kind_b)))
        return self._rule_cost[key]

    def compute_kind(self, name: str) -> tuple[dict, dict]:
        """Stage fields that say how an op's compute is priced, (forward, backward): its op
        class and the kernels it launches (backward: input and weight gradients of an op with
        parameters, one kernel otherwise; ops without FLOPs launch none)."""
        node = self.graph[name]
        cls = op_class(node.op)
        if not node.flops:
            return {"op_class": cls}, {"op_class": cls}
        has_params = any(self.graph[t].is_param for t in node.inputs)
        return {"op_class": cls, "launches": 1.0}, {"op_class": cls, "launches": 2.0 if has_params else 1.0}

    def input_gather(self, tensor: str, layout: Layout) -> Collective | None:
        """Each rank loads only its share of an input (batch dim 0); any other layout costs an
        all-gather of the input at run time (methods/hap/codegen.py does a padded one)."""
        node = self.graph[tensor]
        if node.kind != "placeholder" or layout == 0 or not node.shape or node.shape[0] <= 1:
            return None
        return Collective("all_gather", Affine.sharded(float(node.nbytes), 0), "padded",
                          label=f"{tensor} (input)")

    def source_key(self, tensor: str, layout: Layout, rule: Rule) -> tuple:
        """What the price of creating a source reads (source_time), as rule_key for triples."""
        node = self.graph[tensor]
        return (node.kind, node.shape, node.nbytes, node.is_param, self.home[tensor], layout, rule.sfb)

    def source_time(self, tensor: str, layout: Layout, rule: Rule) -> float:
        """Backward gradient sync of a parameter created in `layout` (plus the intra-machine
        all-reduce of its gradient when a device is a machine), or the all-gather of an input
        created in another layout than the one each rank loads."""
        key = self.source_key(tensor, layout, rule)
        if key not in self._param_cost:
            node = self.graph[tensor]
            t = 0.0
            gather = self.input_gather(tensor, layout)
            if gather is not None:
                t = collective_time(gather, self.cluster, self.vdevs, self.prices)
            if node.is_param:
                colls = []
                synced = layout == IDENTITY and not rule.sfb
                if synced and not self.grad_bucket_bytes:
                    colls.append(Collective("all_reduce", Affine(float(node.nbytes)), grad=True))
                st = Stage(tuple(colls), Affine(), grad_bytes=self._bytes(tensor, layout))
                t = self.stage_time(st)
                if synced and self.grad_bucket_bytes:
                    t += self.bucketed_sync_s(float(node.nbytes))
            self._param_cost[key] = t
        return self._param_cost[key]

    def bucketed_sync_s(self, nbytes: float) -> float:
        """Seconds charged for all-reducing a replicated parameter's `nbytes` of gradient that
        rides in a bucket of grad_bucket_bytes with others: its bytes' share of a full bucket's
        all-reduce, the call's latency (and the host transport's floor) shared out by bytes; a
        gradient that fills a bucket alone pays its own all-reduce.

        Summed over a bucket's gradients this is within one call's latency (or floor) of the
        bucket's all-reduce, where a price is affine in the bytes: a full bucket, which passes
        its cap by less than its last gradient (bucket_runs), is charged a little more, the last
        and partial one less. One all-reduce per parameter, each paying the latency, was what
        the runtime runs plus that latency per parameter: tiny BERT on local_hetero2 got heads
        split in its first layer rather than data parallelism, 5.9% slower by the simulator,
        because the search saw 6 fewer all-reduces."""
        cap = self.grad_bucket_bytes
        if nbytes >= cap:
            return self.collective_time(Collective("all_reduce", Affine(nbytes), grad=True))
        return nbytes / cap * self.collective_time(Collective("all_reduce", Affine(cap), grad=True))


def _order(graph: Graph, theory: Theory) -> tuple[list[str], dict[str, int]]:
    """Op nodes in topological order, and each tensor's last use (index into that order)."""
    order = [n.name for n in graph.nodes if n.name in theory.rules]
    index = {name: i for i, name in enumerate(order)}
    last_use: dict[str, int] = {}
    for name in order:
        node = graph[name]
        for t in list(node.inputs) + list(node.shape_inputs):
            last_use[t] = max(last_use.get(t, -1), index[name])
    last_use[graph.loss] = len(order)  # the goal reads the loss
    return order, last_use


def synthesize(theory: Theory, cost: CostModel, max_expansions: int = 2_000_000, beam_width: int | None = None,
               incumbent: SearchResult | None = None) -> SearchResult:
    """A*: the cheapest program whose loss ends as Reduce (partial sums on the devices).

    score = cost so far + a lower bound on the remaining ops' cost (_remaining_bound: their
    cheapest triples, the sync of the sources they create and the re-layouts along trees of
    ops, priced as the moves are). Ties go to the deeper state, so complete programs (and
    their bound) come early.

    beam_width: expand at most this many states per position (None: no cap). States at one
    position share the heuristic, so A* pops them cheapest first and the cap keeps the
    `beam_width` cheapest prefixes: exact while no position needs more (stats.beam_pruned
    == 0), a bounded-effort approximation otherwise.

    incumbent: a program of this theory already priced by this cost model (e.g. the best
    data-parallel program, methods.hap.planner): the search starts with its cost as the bound
    to beat and returns it unless it finds a program cheaper by more than 1e-9 of that cost.
    A beam prunes prefixes by their cost so far, so it may drop the prefix of a program whose
    costs come early (data parallelism pays each gradient's sync at its parameter) for
    prefixes that pay theirs later; with an incumbent the result is never dearer than it.
    """
    graph = theory.graph
    key = ("order", cost.num_segments)
    if key not in theory.search_cache:
        order, last_use = _order(graph, theory)
        theory.search_cache[key] = order, _dying(graph, order, last_use, cost.num_segments)
    order, (dead, dead_props) = theory.search_cache[key]
    n = len(order)
    min_rest = _remaining_bound(theory, cost, order)
    per_pos = [0] * (n + 1)
    stats = SearchStats()
    counter = itertools.count()
    # State: (position, layouts of live tensors, live tensors already communicated).
    start = (0, frozenset(), frozenset())
    best_g: dict = {start: 0.0}
    parents: dict = {start: None}
    heap = [(min_rest[0], 0, next(counter), 0.0, start)]
    inf = float("inf")
    # Beating the incumbent means beating it beyond float noise: a prefix of the incumbent
    # itself scores its cost up to rounding, and would otherwise be walked to its end.
    best_cost = inf if incumbent is None else incumbent.cost_s * (1 - 1e-9)
    best_state = None
    best_final: tuple[CommRule, ...] = ()
    while heap:
        f, _, _, g, state = heapq.heappop(heap)
        if g > best_g.get(state, inf):
            stats.pruned_dedup += 1
            continue
        if f >= best_cost:
            stats.pruned_bound += 1
            continue
        pos, props, communicated = state
        if pos == n:
            extra = _finish(props, communicated, graph.loss, cost)
            if extra is not None and g + extra[0] < best_cost:
                best_cost, best_state, best_final = g + extra[0], state, extra[1]
                stats.complete += 1
            continue
        if beam_width is not None:
            if per_pos[pos] >= beam_width:
                stats.beam_pruned += 1
                continue
            per_pos[pos] += 1
        stats.expanded += 1
        if stats.expanded > max_expansions:
            raise NoProgramError(
                f"A* gave up after {max_expansions} expanded states (method.max_expansions); set "
                "method.beam_width (states kept per op, e.g. 200) or raise max_expansions"
            )
        name = order[pos]
        rest, dead_here, dead_comm = min_rest[pos + 1], dead_props[pos], dead[pos]
        moves = _successors(theory, cost, name, props, communicated)
        stats.generated += len(moves)
        kept, kept_comm = props - dead_here, communicated - dead_comm  # once per state, not per child
        for step, step_cost, add_props, add_comm in moves:
            child_g = g + step_cost
            if child_g + rest >= best_cost:  # before building the child's sets
                stats.pruned_bound += 1
                continue
            live = kept | (add_props - dead_here)
            comm_live = kept_comm | (add_comm - dead_comm) if add_comm else kept_comm
            child = (pos + 1, live, comm_live)
            if child_g >= best_g.get(child, inf):
                stats.pruned_dedup += 1
                continue
            best_g[child] = child_g
            parents[child] = (state, step)
            heapq.heappush(heap, (child_g + rest, -pos - 1, next(counter), child_g, child))
    if best_state is None and incumbent is not None:
        return dataclasses.replace(incumbent, stats=stats)
    if best_state is None:
        raise NoProgramError(
            f"no distributed program leaves the loss {graph.loss!r} as partial sums (Reduce); "
            "check that the loss is summed over the batch inside forward"
        )
    steps = []
    state = best_state
    while parents[state] is not None:
        state, step = parents[state]
        steps.append(step)
    steps.reverse()
    return SearchResult(steps, best_cost, stats, best_final)


def _first_reads(theory: Theory, order: list[str]) -> dict[str, list[int]]:
    """op -> positions (into its inputs) of the sources it is the first op to read: the step
    that creates them (a source is fused into its first consumer)."""
    seen: set[str] = set()
    first: dict[str, list[int]] = {}
    for name in order:
        node = theory.graph[name]
        for k, t in enumerate(node.inputs):
            if t in theory.sources and t not in seen:
                first.setdefault(name, []).append(k)
                seen.add(t)
        seen.update(node.inputs)
        seen.update(node.shape_inputs)
        for r in theory.rules[name]:
            seen.update(t for t, _ in r.shape_pre)
    return first


def _tree(theory: Theory, order: list[str], fewest: bool) -> dict[int, tuple[int, int]]:
    """A cover of the graph by trees: position of an op -> (position of its parent, which of
    its inputs the parent's output is). An op hangs below the producer of the computed input
    with the fewest readers (`fewest`; the last such input on a tie), or with the most (the
    first on a tie): the two covers relax opposite edges where an op reads two computed
    tensors (a residual sum: below its branch, or below the stream the branch began from),
    whatever order the model wrote them in. An op may have several children, all reading its
    one output."""
    index = {name: i for i, name in enumerate(order)}
    readers: dict[str, int] = {}
    for name in order:
        for t in set(theory.graph[name].inputs):
            readers[t] = readers.get(t, 0) + 1
    parent: dict[int, tuple[int, int]] = {}
    for i, name in enumerate(order):
        inputs = theory.graph[name].inputs
        ks = [k for k, t in enumerate(inputs) if index.get(t) is not None]
        if ks:
            k = (min(reversed(ks), key=lambda k: readers[inputs[k]]) if fewest
                 else max(ks, key=lambda k: readers[inputs[k]]))
            parent[i] = (index[inputs[k]], k)
    return parent


def _remaining_bound(theory: Theory, cost: CostModel, order: list[str]) -> list[float]:
    """min_rest[i]: a lower bound on the cost of ops i.. (A*'s heuristic at position i): the
    larger of two tree bounds (_tree, _tree_bound), whose covers relax opposite edges."""
    key = ("trees", tuple(order))
    if key not in theory.search_cache:
        theory.search_cache[key] = _first_reads(theory, order), [_tree(theory, order, fewest) for fewest in (True, False)]
    first, trees = theory.search_cache[key]

    def created(name: str, r: Rule) -> list[int]:  # the sources op `name` creates when it runs r
        inputs = theory.graph[name].inputs
        return [k for k in first.get(name, ()) if r.pre[k] in theory.sources[inputs[k]]]

    key = ("rows", cost.segments_key, tuple(order))
    if key not in theory.search_cache:  # per op: what its row reads (ops of a deep model's layers share it)
        theory.search_cache[key] = [
            tuple((cost.rule_key(name, r), tuple(cost.source_key(theory.graph[name].inputs[k], r.pre[k], r)
                                                  for k in created(name, r)))
                  for r in theory.rules[name])
            for name in order]
    rows: dict = {}
    own = []  # per op, per triple: its compute and the sync of the sources it creates
    for name, row_key in zip(order, theory.search_cache[key]):
        row = rows.get(row_key)
        if row is None:
            inputs = theory.graph[name].inputs
            row = rows[row_key] = []
            for r in theory.rules[name]:
                t = cost.rule_time(name, r)
                for k in created(name, r):
                    t += cost.source_time(inputs[k], r.pre[k], r)
                row.append(t)
        own.append(row)
    relayout: dict = {}
    bounds = [_tree_bound(theory, cost, order, tree, own, relayout) for tree in trees]
    return [max(b) for b in zip(*bounds)]


def _tree_bound(theory: Theory, cost: CostModel, order: list[str], parent: dict[int, tuple[int, int]],
                own: list[list[float]], relayout: dict) -> list[float]:
    """A lower bound on the cost of ops i.. for every i, over the trees of `parent`.

    Each op hangs below the producer of one of its inputs (_tree). Over a tree the bound
    prices exactly what the search would: each op's cheapest triple with the sync of the
    sources it creates, and per parent the re-layout of its output for the children that
    read it: a tensor is communicated at most once, so every child reads either the layout
    the parent leaves or one other layout, paid for once (the cheapest collective to it).
    Inputs off the trees, reshards between segments and the loss's final collective are
    relaxed to free. At position i the ops i.. form subtrees whose roots' parents have run;
    their edges in are relaxed (an earlier reader may have paid the collective), so the sum of
    the roots' prices is admissible and the same for every state at i."""
    graph = theory.graph
    n = len(order)

    def edges(t: str) -> dict:
        """(layout left, layout read) -> the cheapest re-layout of t, shared by the tensors
        whose re-layouts are priced alike (not by the tensor's name)."""
        node = graph[t]
        return relayout.setdefault((node.shape, node.nbytes, cost.home[t], t in theory.no_comm), {})

    def price(t: str, have: Layout, want: Layout) -> float:
        options = [] if t in theory.no_comm else [c for c in theory.comm(t, have) if c.dst == want]
        return min((cost.comm_time(c) for c in options), default=math.inf)

    children: list[list[int]] = [[] for _ in range(n)]
    for i, (p, _) in parent.items():
        children[p].append(i)
    # wants[i]: layout op i reads its parent's output in -> the cheapest price of op i's
    # subtree run by a triple of op i that reads it so.
    wants: list[dict] = [{} for _ in range(n)]
    root = [0.0] * n  # the cheapest price of op i's subtree, its edge in relaxed
    for i in range(n - 1, -1, -1):
        name = order[i]
        kids = [wants[c] for c in children[i]]
        out_edges = edges(name) if kids else {}
        below: dict = {}  # the layout op i leaves -> the cheapest price of its children's subtrees
        best = math.inf
        for r, t in zip(theory.rules[name], own[i]):
            if kids:
                if r.post not in below:
                    below[r.post] = _children_price(name, r.post, kids, out_edges, price)
                t += below[r.post]
            best = min(best, t)
            if i in parent:
                want = r.pre[parent[i][1]]
                wants[i][want] = min(wants[i].get(want, math.inf), t)
        root[i] = best
    out = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):  # op i's subtree replaces its children's as a root
        if math.isinf(root[i]):  # then every subtree above it is too
            out[i] = math.inf
        else:
            out[i] = out[i + 1] + root[i] - sum(root[c] for c in children[i])
    return out


def _children_price(tensor: str, have: Layout, kids: list[dict], edges: dict, price) -> float:
    """The cheapest price of a parent's children (each a map: layout read -> its subtree's
    price) when the parent leaves `tensor` in `have`: all read `have`, or each reads `have` or
    one other layout made by one collective (`edges` memoises those collectives' prices)."""
    inf = math.inf
    if len(kids) == 1:  # one reader: the layout it reads, made from `have` if need be (inlined: hot)
        best = inf
        for lay, v in kids[0].items():
            if lay != have:
                e = edges.get((have, lay))
                if e is None:
                    e = edges[(have, lay)] = price(tensor, have, lay)
                v += e
            if v < best:
                best = v
        return best
    best = sum(k.get(have, inf) for k in kids)
    for other in {lay for k in kids for lay in k if lay != have}:
        e = edges.get((have, other))
        if e is None:
            e = edges[(have, other)] = price(tensor, have, other)
        if e < best:
            best = min(best, e + sum(min(k.get(have, inf), k.get(other, inf)) for k in kids))
    return best


def _dying(graph: Graph, order: list[str], last_use: dict[str, int],
           num_segments: int = 1) -> tuple[list[frozenset], list[frozenset]]:
    """Per position: the tensors not needed after it, and every (tensor, layout) pair of them
    (so the search drops dead layouts with one set difference), resharded copies included."""
    dead: list[set] = [set() for _ in order]
    for i, name in enumerate(order):
        if last_use.get(name, -1) <= i:
            dead[i].add(name)
    for t, i in last_use.items():
        if 0 <= i < len(order):
            dead[i].add(t)
    return [frozenset(d) for d in dead], [_layout_pairs(graph, ts, num_segments) for ts in dead]


def _layout_pairs(graph: Graph, tensors, num_segments: int) -> frozenset:
    """Every (tensor, layout) pair a state can hold for these tensors, resharded copies
    included: intersecting a state's layouts with it keeps exactly theirs."""
    return frozenset().union(*(_tensor_pairs(t, graph[t].ndim, num_segments) for t in tensors))


@functools.lru_cache(maxsize=1 << 16)
def _tensor_pairs(t: str, ndim: int, num_segments: int) -> frozenset:
    """One tensor's pairs (_layout_pairs): the planner's rounds and levels ask for them again."""
    dims = range(max(ndim, 1))
    pairs = {(t, lay) for lay in (IDENTITY, REDUCE, *dims)}
    if num_segments > 1:
        pairs |= {(t, (d, s)) for d in dims for s in range(num_segments)}
    return frozenset(pairs)


def _finish(props, communicated, loss: str, cost: CostModel) -> tuple[float, tuple[CommRule, ...]] | None:
    """Extra cost, and the collective, that bring the loss to Reduce at the end (None: impossible)."""
    layouts = {lay for t, lay in props if t == loss and not isinstance(lay, tuple)}
    if REDUCE in layouts:
        return 0.0, ()
    if loss in communicated:
        return None
    options = [c for src in layouts for c in cost.theory.comm(loss, src) if c.dst == REDUCE]
    if not options:
        return None
    best = min(options, key=cost.comm_time)
    return cost.comm_time(best), (best,)


def _relevant(theory: Theory, name: str) -> tuple[str, ...]:
    """Tensors whose layouts decide the successors of op `name`."""
    node = theory.graph[name]
    ts = list(node.inputs) + list(node.shape_inputs)
    for r in theory.rules[name]:
        ts += [t for t, _ in r.shape_pre]
    return tuple(dict.fromkeys(ts))


def _successors(theory: Theory, cost: CostModel, name: str, props: frozenset, communicated: frozenset) -> list:
    """(step, cost, layouts it adds, tensors it communicates) for every way to run op `name`
    next (the state after is props | added, communicated | communicated now).

    The moves depend only on the layouts of the op's own inputs, so they are memoised per
    (op, those layouts): most states share them. What a move does is the same at any ratios
    (_recipes, once per theory); its price and its choice between padded and grouped
    collectives are the cost model's (_priced).
    """
    relevant = cost._relevant.get(name)
    if relevant is None:
        ts = _relevant(theory, name)
        relevant = cost._relevant[name] = (frozenset(ts), _layout_pairs(theory.graph, ts, cost.num_segments))
    tensors, pairs = relevant
    key = (name, props & pairs, communicated & tensors)  # set operations in C: no loop over the state
    moves = cost._moves.get(key)
    if moves is None:
        recipes = cost._recipes.get(key)
        if recipes is None:
            have: dict[str, list[Layout]] = {}
            for t, lay in sorted(key[1], key=str):  # a fixed order: ties between moves break alike every run
                have.setdefault(t, []).append(lay)
            recipes = cost._recipes[key] = list(_recipes(theory, cost, name, have, key[2]))
        moves = cost._moves[key] = [_priced(cost, name, r) for r in recipes]
    return moves


def _priced(cost: CostModel, name: str, recipe: tuple) -> tuple:
    """A move of _recipes at the cost model's ratios: its collectives chosen and its seconds
    added up in the order the search has always added them (so ties break alike); priced once
    per what the price reads (the ops of a deep model's layers share it)."""
    rule, items, terms, choices, sources, seg, new_props, new_comm, price_key, steps = recipe
    price = cost._move_price.get(price_key)
    if price is None:
        # padded vs grouped: the cheaper (the first of equals)
        picks = tuple(min(range(len(options)), key=lambda j: cost.comm_time(options[j])) for options in choices)
        total = cost.rule_time(name, rule)
        for kind, x in terms:
            if kind == "source":
                total += cost.source_time(x[0], x[1], rule)
            else:
                total += cost.comm_time(choices[x][picks[x]] if kind == "chosen" else x)
        price = cost._move_price[price_key] = total, picks
    total, picks = price
    step = steps.get(picks)
    if step is None:
        comms = tuple(choices[c][picks[c]] if isinstance(c, int) else c for c in items)
        step = steps[picks] = Step(name, rule, comms, sources, seg)
    return step, total, new_props, new_comm


def _recipes(theory: Theory, cost: CostModel, name: str, have: dict, communicated: frozenset):
    """Every way to run op `name` with its inputs in the layouts `have`, without prices: (rule,
    its collectives (a CommRule, or an index into the choices), what its price adds up in order
    (("source", (tensor, layout)), ("comm", CommRule), ("chosen", index)), the choices (the
    collectives that make one layout, padded and grouped), sources, segment, layouts it adds,
    tensors it communicates, what its price reads, its Steps per choice). Reads the segments
    of `cost`, never its prices."""
    graph = theory.graph
    node = graph[name]
    seg = cost.op_segment[name]
    for rule in theory.rules[name]:
        needs = list(zip(node.inputs, rule.pre)) + list(rule.shape_pre)
        items: list = []
        terms: list = []
        choices: list = []
        sources: list[tuple[str, Layout]] = []
        new_props: set = set()
        new_comm: set = set()
        made: set = set()  # (tensor, layout) the collectives so far make
        ok = True
        for t, want in needs:
            present = have.get(t)
            if present is None and t in theory.sources:
                if any(s == t for s, _ in sources):
                    if (t, want) not in sources:
                        ok = False
                        break
                    continue
                if want not in theory.sources[t]:
                    ok = False
                    break
                sources.append((t, want))
                new_props.add((t, want))
                terms.append(("source", (t, want)))
                if cost.needs_reshard(t, want, seg):  # an input loaded by row 0, read in another
                    c = cost.reshard(t, want, seg)
                    items.append(c)
                    made.add((c.tensor, c.dst))
                    new_props.add((t, (want, seg)))
                    terms.append(("comm", c))
                continue
            if present is None:
                ok = False  # an input not computed yet cannot happen in topological order
                break
            if cost.needs_reshard(t, want, seg):
                # Another segment's shards: a resharded copy (made once per segment), from
                # the tensor in `want` at its home row (made first if need be).
                if (want, seg) in present or (t, (want, seg)) in new_props:
                    continue
                if graph[t].is_param:
                    ok = False  # parameters are created once, in one row
                    break
                reshard = cost.reshard(t, want, seg)
                terms.append(("comm", reshard))
                new_props.add((t, (want, seg)))
                if want in present or (t, want) in new_props:
                    items.append(reshard)
                    made.add((t, want))
                    continue
            else:
                reshard = None
            if want in present or (t, want) in made:
                continue
            if t in theory.sources or t in communicated or t in new_comm or t in theory.no_comm:
                ok = False
                break
            options = [c for src in present if not isinstance(src, tuple) for c in theory.comm(t, src) if c.dst == want]
            if not options:
                ok = False
                break
            items.append(len(choices))
            terms.append(("chosen", len(choices)))
            choices.append(options)
            made.add((t, want))
            new_comm.add(t)
            new_props.add((t, want))
            if reshard is not None:
                items.append(reshard)
                made.add((t, want))
        if not ok:
            continue
        for t in node.shape_inputs:
            if t not in have and t in theory.sources and not any(s == t for s, _ in sources):
                sources.append((t, IDENTITY))
                new_props.add((t, IDENTITY))
        new_props.add((name, rule.post))
        price_key = (cost.rule_key(name, rule),
                     tuple((kind, cost.source_key(x[0], x[1], rule) if kind == "source" else
                            x if kind == "chosen" else cost.comm_key(x)) for kind, x in terms),
                     tuple(tuple(cost.comm_key(c) for c in options) for options in choices))
        yield (rule, tuple(items), tuple(terms), tuple(choices), tuple(sources), seg, frozenset(new_props),
               frozenset(new_comm), price_key, {})


DDP_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default gradient bucket (bucket_cap_mb=25)


def build_program(
    steps: Sequence[Step],
    cost: CostModel,
    meta: dict | None = None,
    grad_overlap: bool = True,
    bucket_cap_bytes: float = DDP_BUCKET_BYTES,
) -> Program:
    """The bench Program of a synthesized program: forward stages in order, then backward
    stages in reverse, with the memory each device holds.

    Args:
        grad_overlap: replicated parameters' gradient all-reduces run asynchronously beside
            the rest of backward, in buckets of `bucket_cap_bytes` (what DDP does, and what
            the runtime does with async collectives); a later stage that communicates
            activations waits for them (one network). False: each all-reduce runs in its
            op's backward stage, which is exactly the search's (sequential) cost.
        bucket_cap_bytes: gradient bytes per bucket; 0 = one all-reduce per parameter.
    """
    graph = cost.graph
    kept, keepers, own = graph.kept_until(), graph.keepers(), graph.own_saves()
    ready = graph.grad_ready()
    position = {step.node: i for i, step in enumerate(steps)}
    # Tensors each op reads as a re-laid copy (gathered, exchanged): the op keeps the copy.
    # A reshard between rows is not counted as a copy (with tied rows it is the tensor itself).
    relaid = [{c.tensor for c in step.comms if not c.free and c.kind != "reshard"} for step in steps]
    # With more than one rank the runtime's gradients of replicated parameters are views of
    # its buckets, made before backward (methods.hap.runtime.GradBuckets; on machine-level
    # devices every gradient is); a parameter an SFB linear reads as its weight is not bucketed.
    bucketed = sum(v.num_gpus for v in cost.vdevs) > 1
    sfb_weights = {t for step in steps if step.rule.sfb for t in graph[step.node].inputs[1:3]}
    fwd, bwd = [], []
    params = Affine()
    activations = Affine()
    grads_made: list[tuple[int, Affine]] = []
    kept_bytes: list[tuple[int, Affine]] = []
    grads_before = Affine()
    largest: tuple[int, Affine] | None = None  # (full bytes, bytes on a device) of the largest parameter
    machines = cost.granularity == "machine" and any(v.num_gpus > 1 for v in cost.vdevs)
    for i, step in enumerate(steps):
        if grad_overlap:
            f, b = cost.stages(step, param_sync=False)
            grads = _bucketed_grads(step, cost, machines)
            if machines:  # summed inside the machine in its bucket, not in this stage
                b = dataclasses.replace(b, grad_bytes=Affine())
        else:
            f, b = cost.stages(step)
            grads = []
        fwd.append(f)
        bwd.append((b, grads))
        for t, layout in step.sources:
            if graph[t].is_param:
                nbytes = cost._bytes(t, layout)
                params = params + nbytes
                if largest is None or graph[t].nbytes > largest[0]:
                    largest = (graph[t].nbytes, nbytes)
                if bucketed and (cost.granularity == "machine" or (layout == IDENTITY and t not in sfb_weights)):
                    grads_before = grads_before + nbytes
                else:
                    grads_made.append((position.get(ready[t], i), nbytes))
        node = graph[step.node]
        # What autograd keeps for backward (methods.capture.Graph.saved_bytes_factor), in the
        # layout it exists in, each until backward has passed the first op that keeps it: the
        # op's output (its value while an op that keeps it reads it as it is; what the op
        # keeps beside, always), and the re-laid copies ops that keep them read (a copy made
        # for this op is this op's to keep).
        held: list[tuple[Affine, float, int]] = []
        if node.shape is not None and step.node in kept:
            t = step.node
            read = any(k == t or t not in relaid[position[k]] for k in keepers.get(t, ()) if k in position)
            factor = own.get(t, 0.0) + (kept[t][0] - own.get(t, 0.0) if read else 0.0)
            held.append((cost._bytes(t, step.rule.post), factor, position.get(kept[t][1], i)))
        for c in step.comms:
            if not c.free and c.kind != "reshard" and step.node in keepers.get(c.tensor, ()):
                held.append((cost._bytes(c.tensor, c.dst, c.to_segment), 1.0, i))
        for t, layout in step.sources:
            if t in kept and not graph[t].is_param:
                held.append((cost._bytes(t, layout), kept[t][0], position.get(kept[t][1], i)))
        for nbytes, factor, until in held:
            if factor:
                nbytes = nbytes.scale(factor)
                activations = activations + nbytes
                kept_bytes.append((until, nbytes))
    # Activation gradients, each in the layout of the tensor it is the gradient of.
    layouts = {step.node: step.rule.post for step in steps}
    flying = [(position[a], position[b], cost._bytes(t, layouts[t])) for t, a, b in graph.grads_in_flight()
              if t in layouts and a in position and b in position]
    memory = Memory(params, params, params.scale(ADAM_STATE_PER_PARAM), activations,
                    backward=backward_sweep(grads_made, kept_bytes, grads_before, flying),
                    largest_param=None if largest is None else largest[1])
    stages = fwd + (_overlapped_backward(bwd[::-1], bucket_cap_bytes) if grad_overlap else [b for b, _ in bwd[::-1]])
    return Program(tuple(stages), len(cost.vdevs), cost.num_segments, cost.granularity, memory, dict(meta or {}),
                   batch=cost.graph.batch_size)


def _bucketed_grads(step: Step, cost: CostModel, machines: bool) -> list[tuple[float, bool, Affine]]:
    """The gradients of the parameters `step` creates that the runtime sums in buckets, in the
    order GradBuckets fills them (the reverse of creation; backward reverses the steps): (bytes
    that size a bucket, whether it is all-reduced among the devices, bytes summed inside a
    machine). Over GPUs, those of replicated parameters; over machines of several GPUs, every
    parameter's (data parallel inside the machine), sized by the largest machine's share at
    the search's ratios."""
    out = []
    for t, layout in reversed(step.sources):
        if not cost.graph[t].is_param:
            continue
        across = layout == IDENTITY and not step.rule.sfb  # as param_sync
        if machines:
            local = cost._bytes(t, layout)
            size = max(local.at(cost.ratios, d) for d in range(len(cost.vdevs)))
            out.append((size, across, local))
        elif across:
            out.append((float(cost.graph[t].nbytes), True, Affine()))
    return out


def _overlapped_backward(bwd: list[tuple[Stage, list]], cap: float) -> list[Stage]:
    """Backward stages with bucketed gradient all-reduces that overlap later backward compute.

    The gradients are bucketed as the runtime buckets them (bucket_runs, kinds: all-reduced
    among the devices or only inside machines), and a bucket's sync is launched (as a zero-FLOP
    overlapped stage: the all-reduce among the devices, and inside each machine its
    `grad_bytes`) once the backward stage that made its last gradient is done; compute-only
    stages keep running beside it; a stage with its own collectives waits for the network."""
    grads = [(k, g) for k, (_, gs) in enumerate(bwd) for g in gs]
    runs = bucket_runs([(size, across) for _, (size, across, _) in grads], cap)
    done: dict[int, list[int]] = {}  # backward stage -> the buckets its gradients complete
    for b, run in enumerate(runs):
        done.setdefault(grads[run[-1]][0], []).append(b)
    out: list[Stage] = []
    for k, (st, _) in enumerate(bwd):
        out.append(dataclasses.replace(st, overlap=not st.collectives))
        for b in done.get(k, ()):
            members = [grads[j][1] for j in runs[b]]
            colls = ()
            if members[0][1]:
                nbytes = sum(size for size, _, _ in members)
                colls = (Collective("all_reduce", Affine(nbytes), label=f"grad bucket {b}", grad=True),)
            out.append(Stage(colls, overlap=True, grad_bytes=affine_sum(g for _, _, g in members),
                             label=f"all_reduce grad bucket {b}"))
    return out


def describe_steps(steps: Sequence[Step], graph: Graph) -> dict:
    """Readable decisions: layout per tensor, collectives, replicated parameters."""
    layouts: dict[str, str] = {}
    comms = []
    sfb = []
    from methods.hap.theory import layout_name

    for s in steps:
        for t, lay in s.sources:
            layouts[t] = layout_name(lay)
        layouts[s.node] = layout_name(s.rule.post)
        comms += [c.describe() for c in s.comms]
        if s.rule.sfb:
            sfb.append(s.node)
    return {"layouts": layouts, "collectives": comms, "sfb": sfb}


def shard_units(steps: Sequence[Step], graph: Graph) -> dict[int, int]:
    """Dim length -> the unit its Gather shards come in (docs/planner.md "Plan format").

    A reshape that splits a sharded dim (d_model -> heads x head_dim, B*S -> B x S) needs
    whole units per device. Every sharded dim of the same length uses the same unit (their lcm),
    so tensors whose sharded dims must line up (same length) get identical shard lengths.
    """
    units: dict[int, int] = {}
    for s in steps:
        r = s.rule
        if not r.pre or not isinstance(r.pre[0], int):
            continue
        if r.unit > 1:
            length = _dim_len(graph, r.node, r.pre[0])
            units[length] = math.lcm(units.get(length, 1), r.unit)
        node = graph[s.node]
        if node.op in ("view", "reshape", "flatten", "unflatten") and isinstance(r.post, int):
            # A merging reshape ((heads, head_dim) -> d_model with heads sharded): the merged
            # dim is sharded in whole units of the inner size.
            n_in, n_out = _dim_len(graph, r.node, r.pre[0]), int(node.shape[r.post])
            if n_out > n_in and n_out % n_in == 0:
                units[n_out] = math.lcm(units.get(n_out, 1), n_out // n_in)
    return units


def _dim_len(graph: Graph, node: str, dim: int) -> int:
    first = graph[graph[node].inputs[0]]
    shape = first.shape if first.shape is not None else first.tuple_shapes[0]
    return int(shape[dim])


@dataclass
class BruteForceResult:
    cost_s: float
    programs: int = field(default=0)


def brute_force(theory: Theory, cost: CostModel) -> BruteForceResult:
    """Exhaustive depth-first enumeration of the same program space (tests only)."""
    graph = theory.graph
    order, last_use = _order(graph, theory)
    best = [float("inf")]
    count = [0]

    def walk(pos, props, communicated, g):
        if pos == len(order):
            extra = _finish(props, communicated, graph.loss, cost)
            count[0] += 1
            if extra is not None:
                best[0] = min(best[0], g + extra[0])
            return
        for _, c, add_props, add_comm in _successors(theory, cost, order[pos], props, communicated):
            live = frozenset(p for p in props | add_props if last_use.get(p[0], -1) > pos)
            comm_live = frozenset(t for t in communicated | add_comm if last_use.get(t, -1) > pos)
            walk(pos + 1, live, comm_live, g + c)

    walk(0, frozenset(), frozenset(), 0.0)
    return BruteForceResult(best[0], count[0])
