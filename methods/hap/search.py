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
Costs are those of bench.simulate (the same stages end up in the emitted Program). It does
not choose ratios (methods.hap.balance) and does not generate per-rank code.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Sequence

from bench.cluster import ClusterSpec
from bench.program import Affine, Collective, Memory, Program, Stage
from bench.simulate import collective_time, device_compute_times, virtual_devices
from methods.capture import VIEW_OPS, Graph
from methods.hap.theory import IDENTITY, REDUCE, CommRule, Layout, Rule, Theory

ADAM_STATE_PER_PARAM = 2.0  # two fp32 moments per parameter


class NoProgramError(ValueError):
    """No distributed program satisfies the semantic constraint (loss as Reduce)."""


@dataclass(frozen=True)
class Step:
    """One instruction of a synthesized program: a triple plus the collectives fused in."""

    node: str
    rule: Rule
    comms: tuple[CommRule, ...]  # collectives on inputs, run just before the op
    sources: tuple[tuple[str, Layout], ...]  # sources created here (fused), with layouts

    def describe(self) -> str:
        parts = [c.describe() for c in self.comms] + [self.rule.describe()]
        return "; ".join(parts)


@dataclass
class SearchStats:
    expanded: int = 0
    generated: int = 0
    pruned_dedup: int = 0
    pruned_bound: int = 0
    complete: int = 0


@dataclass
class SearchResult:
    steps: list[Step]
    cost_s: float
    stats: SearchStats


class CostModel:
    """Stage contents and seconds of steps at fixed ratios (cached per triple/collective)."""

    def __init__(self, theory: Theory, cluster: ClusterSpec, granularity: str, ratios: Sequence[Sequence[float]]):
        self.theory = theory
        self.graph = theory.graph
        self.cluster = cluster
        self.vdevs = virtual_devices(cluster, granularity)
        self.ratios = [list(r) for r in ratios]
        self.granularity = granularity
        self._rule_cost: dict = {}
        self._comm_cost: dict = {}
        self._param_cost: dict = {}

    # -- stage contents ----------------------------------------------------------------------
    def _bytes(self, tensor: str, layout: Layout) -> Affine:
        nbytes = float(self.graph[tensor].nbytes)
        return Affine.sharded(nbytes) if isinstance(layout, int) else Affine(nbytes)

    def comm_collectives(self, c: CommRule) -> tuple[list[Collective], list[Collective]]:
        """(forward, backward) collectives of one re-layout; backward runs the dual."""
        if c.free:
            return [], []
        nbytes = float(self.graph[c.tensor].nbytes)
        shard = Affine.sharded(nbytes)
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
        f = node.flops
        fwd = Affine.sharded(f) if rule.sharded else Affine(f)
        bwd = fwd.scale(node.backward_factor)
        extra: list[Collective] = []
        if rule.sfb:
            # Gather the sufficient factors (input and output gradient), then every device
            # computes the full weight gradient: half the backward work, unsharded.
            bwd = Affine.sharded(f * node.backward_factor / 2) + Affine(f * node.backward_factor / 2)
            x = node.inputs[0]
            extra = [
                Collective("all_gather", Affine.sharded(float(self.graph[x].nbytes)), "padded", label=f"{x} (sfb)"),
                Collective("all_gather", Affine.sharded(float(node.nbytes)), "padded", label=f"d{node.name} (sfb)"),
            ]
        return fwd, bwd, extra

    def param_sync(self, step: Step) -> list[Collective]:
        """Gradient all-reduce of replicated parameters created at this step (none with SFB)."""
        out = []
        for t, layout in step.sources:
            if self.graph[t].is_param and layout == IDENTITY and not step.rule.sfb:
                out.append(Collective("all_reduce", Affine(float(self.graph[t].nbytes)), label=f"grad {t}"))
        return out

    def grad_bytes(self, step: Step) -> Affine:
        total = Affine()
        for t, layout in step.sources:
            if self.graph[t].is_param:
                total = total + self._bytes(t, layout)
        return total

    def stages(self, step: Step) -> tuple[Stage, Stage]:
        fwd_flops, bwd_flops, sfb = self.rule_parts(step.node, step.rule)
        fwd_c: list[Collective] = []
        bwd_c: list[Collective] = []
        for c in step.comms:
            f, b = self.comm_collectives(c)
            fwd_c += f
            bwd_c += b
        bwd_c += sfb + self.param_sync(step)
        label = step.describe()
        return (
            Stage(tuple(fwd_c), fwd_flops, label=f"fwd {label}"),
            Stage(tuple(bwd_c), bwd_flops, grad_bytes=self.grad_bytes(step), label=f"bwd {label}"),
        )

    # -- seconds -----------------------------------------------------------------------------
    def stage_time(self, st: Stage) -> float:
        comm = sum(collective_time(c, self.cluster, self.vdevs, self.ratios) for c in st.collectives)
        return comm + max(device_compute_times(st, self.cluster, self.vdevs, self.ratios))

    def comm_time(self, c: CommRule) -> float:
        if c not in self._comm_cost:
            f, b = self.comm_collectives(c)
            self._comm_cost[c] = sum(collective_time(x, self.cluster, self.vdevs, self.ratios) for x in f + b)
        return self._comm_cost[c]

    def rule_time(self, node: str, rule: Rule) -> float:
        """Compute (fwd + bwd) plus SFB collectives of a triple, without parameter sync."""
        key = (node, rule)
        if key not in self._rule_cost:
            fwd, bwd, extra = self.rule_parts(node, rule)
            self._rule_cost[key] = self.stage_time(Stage((), fwd)) + self.stage_time(Stage(tuple(extra), bwd))
        return self._rule_cost[key]

    def source_time(self, tensor: str, layout: Layout, rule: Rule) -> float:
        """Backward gradient sync of a parameter created in `layout` (plus the intra-machine
        all-reduce of its gradient when a device is a machine)."""
        key = (tensor, layout, rule.sfb)
        if key not in self._param_cost:
            node = self.graph[tensor]
            t = 0.0
            if node.is_param:
                colls = []
                if layout == IDENTITY and not rule.sfb:
                    colls.append(Collective("all_reduce", Affine(float(node.nbytes))))
                st = Stage(tuple(colls), Affine(), grad_bytes=self._bytes(tensor, layout))
                t = self.stage_time(st)
            self._param_cost[key] = t
        return self._param_cost[key]


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


def synthesize(theory: Theory, cost: CostModel, max_expansions: int = 2_000_000) -> SearchResult:
    """A*: the cheapest program whose loss ends as Reduce (partial sums on the devices).

    score = cost so far + the remaining ops' cheapest computation at infinite bandwidth
    (admissible: every remaining op runs one of its triples and collectives cost >= 0).
    """
    graph = theory.graph
    order, last_use = _order(graph, theory)
    n = len(order)
    min_rest = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        name = order[i]
        min_rest[i] = min_rest[i + 1] + min(cost.rule_time(name, r) for r in theory.rules[name])
    stats = SearchStats()
    counter = itertools.count()
    # State: (position, layouts of live tensors, live tensors already communicated).
    start = (0, frozenset(), frozenset())
    best_g: dict = {start: 0.0}
    parents: dict = {start: None}
    heap = [(min_rest[0], next(counter), 0.0, start)]
    best_cost = float("inf")
    best_state = None
    while heap:
        f, _, g, state = heapq.heappop(heap)
        if g > best_g.get(state, float("inf")):
            stats.pruned_dedup += 1
            continue
        if f >= best_cost:
            stats.pruned_bound += 1
            continue
        pos, props, communicated = state
        if pos == n:
            extra = _finish(props, communicated, graph.loss, cost)
            if extra is not None and g + extra < best_cost:
                best_cost, best_state = g + extra, state
                stats.complete += 1
            continue
        stats.expanded += 1
        if stats.expanded > max_expansions:
            raise NoProgramError(f"A* gave up after {max_expansions} expansions; reduce the graph or devices")
        name = order[pos]
        for step, step_cost, new_props, new_comm in _successors(theory, cost, name, props, communicated):
            live = frozenset(p for p in new_props if last_use.get(p[0], -1) > pos)
            comm_live = frozenset(t for t in new_comm if last_use.get(t, -1) > pos)
            child = (pos + 1, live, comm_live)
            child_g = g + step_cost
            stats.generated += 1
            if child_g >= best_g.get(child, float("inf")):
                stats.pruned_dedup += 1
                continue
            if child_g + min_rest[pos + 1] >= best_cost:
                stats.pruned_bound += 1
                continue
            best_g[child] = child_g
            parents[child] = (state, step)
            heapq.heappush(heap, (child_g + min_rest[pos + 1], next(counter), child_g, child))
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
    return SearchResult(steps, best_cost, stats)


def _finish(props, communicated, loss: str, cost: CostModel) -> float | None:
    """Extra cost to bring the loss to Reduce at the end (None: impossible)."""
    layouts = {lay for t, lay in props if t == loss}
    if REDUCE in layouts:
        return 0.0
    if loss in communicated:
        return None
    for src in layouts:
        for c in cost.theory.comm(loss, src):
            if c.dst == REDUCE:
                return cost.comm_time(c)
    return None


def _successors(theory: Theory, cost: CostModel, name: str, props: frozenset, communicated: frozenset):
    graph = theory.graph
    node = graph[name]
    have: dict[str, list[Layout]] = {}
    for t, lay in props:
        have.setdefault(t, []).append(lay)
    for rule in theory.rules[name]:
        needs = list(zip(node.inputs, rule.pre)) + list(rule.shape_pre)
        total = cost.rule_time(name, rule)
        comms: list[CommRule] = []
        sources: list[tuple[str, Layout]] = []
        new_props = set(props)
        new_comm = set(communicated)
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
                total += cost.source_time(t, want, rule)
                continue
            if present is None:
                ok = False  # an input not computed yet cannot happen in topological order
                break
            if want in present or any(c.tensor == t and c.dst == want for c in comms):
                continue
            if t in theory.sources or t in new_comm:
                ok = False
                break
            options = [c for src in present for c in theory.comm(t, src) if c.dst == want]
            if not options:
                ok = False
                break
            best = min(options, key=cost.comm_time)  # padded vs grouped: the cheaper one
            comms.append(best)
            new_comm.add(t)
            new_props.add((t, want))
            total += cost.comm_time(best)
        if not ok:
            continue
        for t in node.shape_inputs:
            if t not in have and t in theory.sources and not any(s == t for s, _ in sources):
                sources.append((t, IDENTITY))
                new_props.add((t, IDENTITY))
        new_props.add((name, rule.post))
        yield Step(name, rule, tuple(comms), tuple(sources)), total, frozenset(new_props), frozenset(new_comm)


def build_program(steps: Sequence[Step], cost: CostModel, meta: dict | None = None) -> Program:
    """The bench Program of a synthesized program: forward stages in order, then backward
    stages in reverse, with the memory each device holds."""
    graph = cost.graph
    fwd, bwd = [], []
    params = Affine()
    activations = Affine()
    for step in steps:
        f, b = cost.stages(step)
        fwd.append(f)
        bwd.append(b)
        for t, layout in step.sources:
            if graph[t].is_param:
                params = params + cost._bytes(t, layout)
        node = graph[step.node]
        if node.op not in VIEW_OPS and node.shape is not None:
            activations = activations + cost._bytes(step.node, step.rule.post)
        for c in step.comms:
            if not c.free:
                activations = activations + cost._bytes(c.tensor, c.dst)
    memory = Memory(params, params, params.scale(ADAM_STATE_PER_PARAM), activations)
    stages = tuple(fwd + bwd[::-1])
    return Program(stages, len(cost.vdevs), 1, cost.granularity, memory, dict(meta or {}))


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
                best[0] = min(best[0], g + extra)
            return
        for _, c, new_props, new_comm in _successors(theory, cost, order[pos], props, communicated):
            live = frozenset(p for p in new_props if last_use.get(p[0], -1) > pos)
            comm_live = frozenset(t for t in new_comm if last_use.get(t, -1) > pos)
            walk(pos + 1, live, comm_live, g + c)

    walk(0, frozenset(), frozenset(), 0.0)
    return BruteForceResult(best[0], count[0])
