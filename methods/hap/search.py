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
choose ratios (methods.hap.balance) and does not generate per-rank code. Its length is the A*
loop with its labels and dominance, and the moves (an op's priced recipes); its bound is
methods.hap.bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from dataclasses import dataclass, field

from bench.core.errors import PlanningError
from bench.cost.lanes import NEG, ZERO_LANES, apply, end, prepend, stage_map
from methods.graph import Graph
from methods.hap.bounds import remaining_bound
from methods.hap.pricing import CostModel
from methods.hap.steps import Step
from methods.hap.theory import IDENTITY, REDUCE, CommRule, Layout, Theory


class NoProgramError(PlanningError):
    """No distributed program satisfies the semantic constraint (loss as Reduce)."""


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


def synthesize(
    theory: Theory,
    cost: CostModel,
    max_expansions: int = 2_000_000,
    beam_width: int | None = None,
    incumbent: SearchResult | None = None,
) -> SearchResult:
    """A*: the cheapest program whose loss ends as Reduce (partial sums on the devices), by the
    simulator's price (CostModel.program_cost: the timeline of bench.cost.price, overlap,
    optimizer step and per-step terms included).

    A prefix is priced as a program of its ops alone would be (its forward stages first, its
    backward last), which every program extending it can only exceed. Its score is the larger
    of that and its compute lane with a lower bound of the remaining ops' compute and
    collectives put in between (remaining_bound: their cheapest triples, the gathers of the
    sources they create and the re-layouts along trees of ops, priced as the moves are), plus
    the optimizer step and per-step terms at their least: a lower bound of the price of every
    program that extends the prefix, so a complete program whose price is at most every score
    left is the cheapest. Ties go to the deeper state, so complete programs come early.

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

    Under gradient accumulation with overlapped syncs the price is two micro-steps'
    (CostModel.pair) and the search _synthesize_pair's.
    """
    if cost.pair is not None:
        return _synthesize_pair(theory, cost, max_expansions, beam_width, incumbent)
    graph = theory.graph
    order, dead, dead_props = _search_order(theory, cost.num_segments)
    n = len(order)
    # Without an incumbent, the bound waits for a state with two moves (docs/planner.md, "Search").
    min_rest = None if incumbent is None else remaining_bound(theory, cost, order)
    host, after, _ = cost.goal()
    per_pos = [0] * (n + 1)
    stats = SearchStats()
    # A label: (state, end row of its backward, its forward's seconds, parent label, step).
    # State: (position, layouts of live tensors, live tensors already communicated). Forward
    # stages wait for their own collectives, so after a forward the network is never busier
    # than the compute lane and the lane inside machines is idle: the forward is one number.
    # The end row (how the iteration's end follows from the lanes where the prefix's backward
    # starts) is three, and its network entry is never above its compute entry (the maps of
    # bench.cost.price). A state keeps every label no other label of it is at or below on all
    # four: a program's price only grows with each, so a label at or below another leads to a
    # program at most as dear, whatever follows.
    # States by number, shared by the theory's searches (docs/planner.md, "Search").
    states, state_ids, state_moves = _state_graph(theory, cost)
    labels: list[tuple] = [(0, *ZERO_LANES, 0.0, -1, None)]
    alive = [True]
    # per state: the numbers of its labels (the dominance test's)
    at_state: dict = {0: [0]}
    # heap entries: (score, -(position + 1), label number): ties go to the deeper state
    heap = [(_score(ZERO_LANES, 0.0, 0.0 if min_rest is None else min_rest[0], host, after), -1, 0)]
    inf = float("inf")
    # Beating the incumbent means beating it beyond float noise: a prefix of the incumbent
    # itself scores its cost up to rounding, and would otherwise be walked to its end.
    best_cost = inf if incumbent is None else incumbent.cost_s * (1 - 1e-9)
    best_label = None
    best_final: tuple[CommRule, ...] = ()
    ready = cost._search_moves  # (op, layouts of its inputs) -> its moves, priced
    pop, push = heapq.heappop, heapq.heappush
    expanded = generated = pruned_bound = pruned_dedup = beam_pruned = 0
    beam = inf if beam_width is None else beam_width
    count = 1  # labels so far
    while heap:
        f, depth, label = pop(heap)
        if not alive[label]:
            pruned_dedup += 1
            continue
        if f >= best_cost:
            # The heap pops in order of score: no label left can beat best_cost either. They
            # are counted as popping each would have counted it.
            pruned_bound += 1
            for _, _, k in heap:
                if alive[k]:
                    pruned_bound += 1
                else:
                    pruned_dedup += 1
            break
        pos = -1 - depth
        if pos == n:
            sid, r0, _, r2, forward, _, _ = labels[label]
            _, props, communicated = states[sid]
            extra = _finish(props, communicated, graph.loss, cost)
            if extra is not None:
                total = cost.complete(max(r0 + forward, r2) + extra[0], _steps(labels, label))
                if total < best_cost:
                    best_cost, best_label, best_final = total, label, extra[1]
                    stats.complete += 1
            continue
        if per_pos[pos] >= beam:
            beam_pruned += 1
            continue
        per_pos[pos] += 1
        expanded += 1
        if expanded > max_expansions:
            raise _gave_up(max_expansions)
        sid, r0, r1, r2, forward, _, _ = labels[label]
        # The state's moves and where they lead (per theory), priced once per key at these ratios.
        moves_to = state_moves.get(sid)
        if moves_to is None:
            moves_to = state_moves[sid] = _state_moves(
                theory, cost, order[pos], states[sid], dead_props[pos], dead[pos], states, state_ids
            )
        key, kids = moves_to
        moves = ready.get(key)
        if moves is None:
            moves = ready[key] = _search_moves(cost, key[0], cost._recipes[key])
        generated += len(kids)
        if min_rest is not None:
            rest = min_rest[pos + 1]
        elif len(kids) > 1:  # the heap is empty: these children are the first scores compared
            min_rest = remaining_bound(theory, cost, order)
            rest = min_rest[pos + 1]
        else:
            rest = 0.0
        depth -= 1
        # No child at an op whose beam is full is kept (docs/planner.md, "Search").
        full = pos + 1 < n and per_pos[pos + 1] >= beam
        for (step, q, p, lanes, m), child in zip(moves, kids):
            forward2 = forward + q + p  # the step's forward stage: its collectives, then its compute
            # its backward stage (and its gradients' syncs) runs before the prefix's backward
            # (bench.cost.lanes.prepend written out for each form of map, _search_form; `x if x
            # >= y else y` being max(x, y))
            if lanes == 1:  # on the compute lane alone: m is its seconds
                s0, s1, s2 = r0 + m, r1, r2
            elif lanes == 2:  # compute and network: m is (m[0], m[3], m[1], m[4])
                s0, a = r0 + m[0], r1 + m[1]
                s0 = s0 if s0 >= a else a
                s1, a = r0 + m[2], r1 + m[3]
                s1 = s1 if s1 >= a else a
                s2 = r2
            else:
                s0, a, b = r0 + m[0], r1 + m[3], r2 + m[6]
                s0 = s0 if s0 >= a else a
                s0 = s0 if s0 >= b else b
                s1, a, b = r0 + m[1], r1 + m[4], r2 + m[7]
                s1 = s1 if s1 >= a else a
                s1 = s1 if s1 >= b else b
                s2, a, b = r0 + m[2], r1 + m[5], r2 + m[8]
                s2 = s2 if s2 >= a else a
                s2 = s2 if s2 >= b else b
            score = s0 + forward2 + rest  # _score, written out
            score = score if score >= s2 else s2
            score = (score if score >= host else host) + after
            if score >= best_cost:
                pruned_bound += 1
                continue
            if full:
                beam_pruned += 1
                continue
            others = at_state.get(child)
            if others is not None:
                # Dominance (written out: it runs for most children): drop the child if a label
                # of its state is at or below it on all four numbers, else drop the state's
                # labels at or above it (_SAME: the iteration's scale).
                tol = _SAME * (abs(s0) + abs(forward2))
                f_tol, s0_tol, s1_tol, s2_tol = forward2 + tol, s0 + tol, s1 + tol, s2 + tol
                dominated = killed = False
                for k in others:
                    if not alive[k]:
                        continue
                    _, t0, t1, t2, fk, _, _ = labels[k]
                    if fk <= f_tol and t0 <= s0_tol and t1 <= s1_tol and t2 <= s2_tol:
                        dominated = True
                        break
                    if forward2 <= fk + tol and s0 <= t0 + tol and s1 <= t1 + tol and s2 <= t2 + tol:
                        alive[k] = False
                        killed = True
                if dominated:
                    pruned_dedup += 1
                    continue
                if killed:
                    others[:] = [k for k in others if alive[k]]
                others.append(count)
            else:
                at_state[child] = [count]
            push(heap, (score, depth, count))
            labels.append((child, s0, s1, s2, forward2, label, step))
            alive.append(True)
            count += 1
    stats.expanded, stats.generated, stats.beam_pruned = expanded, generated, beam_pruned
    stats.pruned_bound, stats.pruned_dedup = pruned_bound, pruned_dedup
    steps = None if best_label is None else _steps(labels, best_label)
    return _result(steps, best_cost, stats, best_final, incumbent, graph.loss)


def _synthesize_pair(
    theory: Theory, cost: CostModel, max_expansions: int, beam_width: int | None, incumbent: SearchResult | None
) -> SearchResult:
    """synthesize under gradient accumulation with overlapped syncs (CostModel.pair): each
    label carries the numbers of both micro-steps (one that syncs nothing, and the last, which
    syncs): their forward seconds and end rows; a prefix's score is their scores (_score)
    weighted as the iteration has them ((k - 1) / k and 1 / k), each a lower bound of its own
    micro-step's price, so the weighted score bounds the iteration's over k; a label is
    dropped where another of its state is at or below it on all eight numbers. Otherwise the
    loop of synthesize."""
    quiet, last = cost.pair
    wq, wl = (cost.micro_steps - 1) / cost.micro_steps, 1.0 / cost.micro_steps
    graph = theory.graph
    order, dead, dead_props = _search_order(theory, cost.num_segments)
    n = len(order)
    rest_q, rest_l = remaining_bound(theory, quiet, order), remaining_bound(theory, last, order)
    (host_q, after_q, _), (host_l, after_l, _) = quiet.goal(), last.goal()
    stats = SearchStats()
    states, state_ids, state_moves = _state_graph(theory, quiet)
    zero = (0.0, *ZERO_LANES, 0.0, *ZERO_LANES)  # (forward, end row) of each micro-step
    # A label: (state, its eight numbers, parent label, step)
    labels: list[tuple] = [(0, zero, -1, None)]
    alive = [True]
    at_state: dict = {0: [0]}
    start = wq * _score(ZERO_LANES, 0.0, rest_q[0], host_q, after_q) + wl * _score(
        ZERO_LANES, 0.0, rest_l[0], host_l, after_l
    )
    heap = [(start, -1, 0)]
    best_cost = float("inf") if incumbent is None else incumbent.cost_s * (1 - 1e-9)
    best_label, best_final = None, ()
    per_pos = [0] * (n + 1)
    beam = float("inf") if beam_width is None else beam_width
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        f, depth, label = pop(heap)
        if not alive[label]:
            stats.pruned_dedup += 1
            continue
        if f >= best_cost:
            stats.pruned_bound += 1 + sum(alive[x] for _, _, x in heap)
            stats.pruned_dedup += sum(not alive[x] for _, _, x in heap)
            break
        pos = -1 - depth
        sid, (fq, q0, q1, q2, fl, l0, l1, l2) = labels[label][:2]
        if pos == n:
            _, props, communicated = states[sid]
            extra = _finish(props, communicated, graph.loss, quiet)
            if extra is not None:
                steps = _steps(labels, label, 2, 3)
                total = wq * quiet.complete(max(q0 + fq, q2) + extra[0], steps)
                total += wl * last.complete(max(l0 + fl, l2) + extra[0], steps)
                if total < best_cost:
                    best_cost, best_label, best_final = total, label, extra[1]
                    stats.complete += 1
            continue
        if per_pos[pos] >= beam:
            stats.beam_pruned += 1
            continue
        per_pos[pos] += 1
        stats.expanded += 1
        if stats.expanded > max_expansions:
            raise _gave_up(max_expansions)
        moves_to = state_moves.get(sid)
        if moves_to is None:
            moves_to = state_moves[sid] = _state_moves(
                theory, quiet, order[pos], states[sid], dead_props[pos], dead[pos], states, state_ids
            )
        key, kids = moves_to
        moves = []
        for c in (quiet, last):
            got = c._search_moves.get(key)
            if got is None:
                got = c._search_moves[key] = _search_moves(c, key[0], c._recipes[key])
            moves.append(got)
        stats.generated += len(kids)
        rq, rl = rest_q[pos + 1], rest_l[pos + 1]
        full = pos + 1 < n and per_pos[pos + 1] >= beam
        for child, (step, qq, pq, lanes_q, mq), (_, ql, pl, lanes_l, ml) in zip(kids, *moves):
            if lanes_q == 1:  # compute alone (_prepend's first form, written out)
                a0, a1, a2 = q0 + mq, q1, q2
            else:
                a0, a1, a2 = _prepend(q0, q1, q2, lanes_q, mq)
            if lanes_l == 1:
                b0, b1, b2 = l0 + ml, l1, l2
            else:
                b0, b1, b2 = _prepend(l0, l1, l2, lanes_l, ml)
            fq2, fl2 = fq + qq + pq, fl + ql + pl
            sq = a0 + fq2 + rq  # _score, written out
            sq = sq if sq >= a2 else a2
            sq = (sq if sq >= host_q else host_q) + after_q
            sl = b0 + fl2 + rl
            sl = sl if sl >= b2 else b2
            sl = (sl if sl >= host_l else host_l) + after_l
            score = wq * sq + wl * sl
            if score >= best_cost:
                stats.pruned_bound += 1
                continue
            if full:
                stats.beam_pruned += 1
                continue
            mine = (fq2, a0, a1, a2, fl2, b0, b1, b2)
            others = at_state.get(child)
            if others is not None:
                tol = _SAME * (abs(a0) + abs(fq2) + abs(b0) + abs(fl2))
                dominated = killed = False
                for x in others:  # (all eight compared, written out)
                    if not alive[x]:
                        continue
                    t0, t1, t2, t3, t4, t5, t6, t7 = labels[x][1]
                    if (
                        t0 <= fq2 + tol
                        and t1 <= a0 + tol
                        and t4 <= fl2 + tol
                        and t5 <= b0 + tol
                        and t2 <= a1 + tol
                        and t3 <= a2 + tol
                        and t6 <= b1 + tol
                        and t7 <= b2 + tol
                    ):
                        dominated = True
                        break
                    if (
                        fq2 <= t0 + tol
                        and a0 <= t1 + tol
                        and fl2 <= t4 + tol
                        and b0 <= t5 + tol
                        and a1 <= t2 + tol
                        and a2 <= t3 + tol
                        and b1 <= t6 + tol
                        and b2 <= t7 + tol
                    ):
                        alive[x] = False
                        killed = True
                if dominated:
                    stats.pruned_dedup += 1
                    continue
                if killed:
                    others[:] = [x for x in others if alive[x]]
                others.append(len(labels))
            else:
                at_state[child] = [len(labels)]
            push(heap, (score, depth - 1, len(labels)))
            labels.append((child, mine, label, step))
            alive.append(True)
    steps = None if best_label is None else _steps(labels, best_label, 2, 3)
    return _result(steps, best_cost, stats, best_final, incumbent, graph.loss)


def _prepend(r0: float, r1: float, r2: float, lanes: int, m) -> tuple[float, float, float]:
    """A backward stage's map in the search's form (_search_form) put before a prefix's end row
    (bench.cost.lanes.prepend), as synthesize's loop writes it out."""
    if lanes == 1:
        return r0 + m, r1, r2
    if lanes == 2:
        return max(r0 + m[0], r1 + m[1]), max(r0 + m[2], r1 + m[3]), r2
    return (
        max(r0 + m[0], r1 + m[3], r2 + m[6]),
        max(r0 + m[1], r1 + m[4], r2 + m[7]),
        max(r0 + m[2], r1 + m[5], r2 + m[8]),
    )


def _search_form(price: tuple) -> tuple:
    """A move's price as the search's loop reads it: (forward collectives' seconds, forward
    compute's seconds, lanes, map). lanes 1: the backward runs on the compute lane alone and
    the map is its seconds; 2: the map leaves the third lane as it is (its third row and
    column the identity's, the network never waits on it) and is (m[0], m[3], m[1], m[4]); 3:
    the whole 3x3 map. The two shorter forms leave out only sums with -inf that max drops, so
    a child's numbers are the same in every form."""
    q, p, m, comp = price
    if comp is not None:
        return q, p, 1, comp
    if m[2] == NEG and m[5] == NEG and m[6] == NEG and m[7] == NEG and m[8] == 0.0:
        return q, p, 2, (m[0], m[3], m[1], m[4])
    return q, p, 3, m


def dead_end(theory: Theory) -> str | None:
    """Where every program of `theory` stops, or None when the layouts reach the goal: the
    first op that no layouts of its inputs let run (each tensor in any layout its source or
    producer can give, or one collective away), or the loss if it cannot end as Reduce. The
    layouts are a superset of those of any one program, so a dead end means there is none,
    found without a search; None does not promise a program (the search decides)."""
    graph = theory.graph
    have: dict[str, set[Layout]] = {t: set(layouts) for t, layouts in theory.sources.items()}

    def reach(t: str) -> set[Layout]:
        out = set(have.get(t, ()))
        if t not in theory.no_comm:
            out |= {c.dst for src in list(out) for c in theory.comm(t, src)}
        return out

    order, _ = _order(graph, theory)
    for name in order:
        node = graph[name]
        ins = [reach(t) for t in node.inputs]
        posts = {
            r.post
            for r in theory.rules[name]
            if all(p in lays for p, lays in zip(r.pre, ins)) and all(p in reach(t) for t, p in r.shape_pre)
        }
        if not posts:
            return f"op {name} ({node.op}) at {node.where}: no triple takes its inputs in any layout they can have"
        have[name] = posts
    if REDUCE not in reach(graph.loss):
        return f"the loss {graph.loss!r} cannot end as partial sums (Reduce)"
    return None


def _score(row: tuple, forward: float, rest: float, host: float, after: float) -> float:
    """A lower bound of the price of every program that extends a prefix whose backward has
    the end row `row` and whose forward takes `forward` seconds: the lanes as they end now (the
    network's part, never above the compute lane's, left out), and the compute lane with `rest`
    (a lower bound of the remaining ops' compute and collectives, remaining_bound) put in
    between; no sooner than the host has queued every kernel (`host`); then the optimizer step
    and per-step terms at their least (`after`; CostModel.goal)."""
    return max(row[0] + forward + rest, row[2], host) + after


# Two labels closer than this (relative) on a number are equal on it: sums of the same prices
# in another order differ in their last bits.
_SAME = 1e-12


def _steps(labels: list, label: int, parent: int = 5, step: int = 6) -> list[Step]:
    """The steps of the program a label is the end of, in order (`parent` and `step`: where a
    label holds its parent's number and its step; _synthesize_pair's labels hold them at 2, 3)."""
    steps = []
    while labels[label][parent] >= 0:
        steps.append(labels[label][step])
        label = labels[label][parent]
    steps.reverse()
    return steps


def _search_order(theory: Theory, num_segments: int) -> tuple[list[str], list[frozenset], list[frozenset]]:
    """The ops in the search's order and, per position, what dies there (_dying), kept in the theory."""
    key = ("order", num_segments)
    if key not in theory.search_cache:
        order, last_use = _order(theory.graph, theory)
        theory.search_cache[key] = order, _dying(theory.graph, order, last_use, num_segments)
    order, (dead, dead_props) = theory.search_cache[key]
    return order, dead, dead_props


def _gave_up(max_expansions: int) -> NoProgramError:
    return NoProgramError(
        f"A* gave up after {max_expansions} expanded states (method.max_expansions); set "
        "method.beam_width (states kept per op, e.g. 200) or raise max_expansions"
    )


def _result(
    steps: list[Step] | None,
    cost_s: float,
    stats: SearchStats,
    final: tuple[CommRule, ...],
    incumbent: SearchResult | None,
    loss: str,
) -> SearchResult:
    """What a search returns: the program it found (`steps`), else the incumbent it could not
    beat, else no program (NoProgramError)."""
    if steps is None and incumbent is not None:
        return dataclasses.replace(incumbent, stats=stats)
    if steps is None:
        raise NoProgramError(
            f"no distributed program leaves the loss {loss!r} as partial sums (Reduce); "
            "check that the loss is summed over the batch inside forward"
        )
    return SearchResult(steps, cost_s, stats, final)


def _dying(
    graph: Graph, order: list[str], last_use: dict[str, int], num_segments: int = 1
) -> tuple[list[frozenset], list[frozenset]]:
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
        relevant = _relevant_pairs(theory, cost, name)
    tensors, pairs = relevant
    key = (name, props & pairs, communicated & tensors)  # set operations in C: no loop over the state
    moves = cost._moves.get(key)
    if moves is None:
        recipes = cost._recipes.get(key)
        if recipes is None:
            recipes = cost._recipes[key] = _recipes_of(theory, cost, key)
        moves = cost._moves[key] = [_priced(cost, name, r) for r in recipes]
    return moves


def _recipes_of(theory: Theory, cost: CostModel, key: tuple) -> list[tuple]:
    """The recipes (_recipes) of op key[0] with its inputs in the layouts key[1] and the
    tensors key[2] already communicated."""
    name, pairs, communicated = key
    have: dict[str, list[Layout]] = {}
    for t, lay in sorted(pairs, key=str):  # a fixed order: ties between moves break alike every run
        have.setdefault(t, []).append(lay)
    return list(_recipes(theory, cost, name, have, communicated))


def _relevant_pairs(theory: Theory, cost: CostModel, name: str) -> tuple[frozenset, frozenset]:
    """The tensors whose layouts decide op `name`'s moves (_relevant) and their (tensor,
    layout) pairs, kept per op and segmentation."""
    ts = _relevant(theory, name)
    out = cost._relevant[name] = (frozenset(ts), _layout_pairs(theory.graph, ts, cost.num_segments))
    return out


def _state_graph(theory: Theory, cost: CostModel) -> tuple[list, dict, dict]:
    """The states the searches of `theory` at the cost model's segmentation have made: a list
    (a state's number is its index), the number of each state, and per number the moves from
    that state (_state_moves). Kept in the theory: none of it depends on the ratios."""
    key = ("states", cost.segments_key)
    graph = theory.search_cache.get(key)
    if graph is None:
        start = (0, frozenset(), frozenset())
        graph = theory.search_cache[key] = ([start], {start: 0}, {})
    return graph


def _state_moves(
    theory: Theory,
    cost: CostModel,
    name: str,
    state: tuple,
    dead_props: frozenset,
    dead: frozenset,
    states: list,
    state_ids: dict,
) -> tuple[tuple, tuple[int, ...]]:
    """The moves of op `name` from `state`: the key of its recipes in `cost._recipes` (the op
    and the layouts of its inputs, _successors) and the number of the state each recipe
    leads to (in `states` / `state_ids`, numbered here when new). The layouts and
    communicated tensors no later op reads (`dead_props`, `dead`) are dropped; what a recipe
    adds that lives on is worked out once per recipe (_live)."""
    pos, props, communicated = state
    relevant = cost._relevant.get(name)
    if relevant is None:
        relevant = _relevant_pairs(theory, cost, name)
    key = (name, props & relevant[1], communicated & relevant[0])  # set operations in C
    lives = cost._live.get(key)
    if lives is None:
        recipes = cost._recipes.get(key)
        if recipes is None:
            recipes = cost._recipes[key] = _recipes_of(theory, cost, key)
        lives = cost._live[key] = [(r[6] - dead_props, r[7] - dead) for r in recipes]
    kept, kept_comm = props - dead_props, communicated - dead
    kids = []
    for live, comm in lives:
        child = (pos + 1, kept | live if live else kept, kept_comm | comm if comm else kept_comm)
        cid = state_ids.get(child)
        if cid is None:
            cid = state_ids[child] = len(states)
            states.append(child)
        kids.append(cid)
    return key, tuple(kids)


def _priced(cost: CostModel, name: str, recipe: tuple) -> tuple:
    """A move of _recipes at the cost model's ratios: its collectives chosen, and its price as
    the seconds of its forward stage's collectives and compute and the map of its backward
    stage with its gradients' syncs (CostModel.step_maps); priced once per what the price
    reads (the ops of a deep model's layers share it)."""
    price = cost._move_price.get(recipe[8])
    if price is None:
        price = _price(cost, name, recipe)
    maps, picks, _ = price
    step = recipe[9].get(picks)
    if step is None:
        step = _step(name, recipe, picks)
    return step, maps, recipe[6], recipe[7]


def _search_moves(cost: CostModel, name: str, recipes: list) -> list[tuple]:
    """The moves of op `name` by `recipes` (the recipes of one key) as synthesize reads them:
    per recipe its Step and its price in the search's form (_priced, _search_form)."""
    prices = cost._move_price
    out = []
    for recipe in recipes:
        price = prices.get(recipe[8])
        if price is None:
            price = _price(cost, name, recipe)
        step = recipe[9].get(price[1])
        if step is None:
            step = _step(name, recipe, price[1])
        out.append((step, *price[2]))
    return out


def _price(cost: CostModel, name: str, recipe: tuple) -> tuple:
    """The price of a recipe (kept under its price number in cost._move_price): its maps
    (CostModel.step_maps), its choice of each collective, and the maps in the search's form."""
    rule, _, terms, choices, sources, _, _, _, price_key, _ = recipe
    # padded vs grouped: the cheaper (the first of equals)
    picks = tuple(min(range(len(options)), key=lambda j: cost.comm_time(options[j])) for options in choices)
    fwd = bwd = 0.0
    for kind, x in terms:
        if kind == "source":
            gather = cost.gather_time(x[0], x[1])
            fwd, bwd = fwd + gather, bwd + cost.source_time(x[0], x[1], rule) - gather
        else:
            f, b = cost.comm_seconds(choices[x][picks[x]] if kind == "chosen" else x)
            fwd, bwd = fwd + f, bwd + b
    maps = cost.step_maps(name, rule, sources, fwd, bwd)
    price = cost._move_price[price_key] = maps, picks, _search_form(maps)
    return price


def _step(name: str, recipe: tuple, picks: tuple) -> Step:
    """The Step of a recipe with its collectives chosen by `picks` (kept in the recipe)."""
    rule, items, _, choices, sources, seg = recipe[:6]
    comms = tuple(choices[c][picks[c]] if isinstance(c, int) else c for c in items)
    step = recipe[9][picks] = Step(name, rule, comms, sources, seg)
    return step


def _recipes(theory: Theory, cost: CostModel, name: str, have: dict, communicated: frozenset):
    """Every way to run op `name` with its inputs in the layouts `have`, without prices: (rule,
    its collectives (a CommRule, or an index into the choices), what its price adds up in order
    (("source", (tensor, layout)), ("comm", CommRule), ("chosen", index)), the choices (the
    collectives that make one layout, padded and grouped), sources, segment, layouts it adds,
    tensors it communicates, the number naming what its price reads (CostModel._price_ids), its
    Steps per choice). Reads the segments of `cost`, never its prices."""
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
        price_key = (
            cost.rule_key(name, rule),
            tuple(
                (
                    kind,
                    cost.source_key(x[0], x[1], rule)
                    if kind == "source"
                    else x
                    if kind == "chosen"
                    else cost.comm_key(x),
                )
                for kind, x in terms
            ),
            tuple(tuple(cost.comm_key(c) for c in options) for options in choices),
        )
        price_key = cost._price_ids.setdefault(price_key, len(cost._price_ids))  # hashed once
        yield (
            rule,
            tuple(items),
            tuple(terms),
            tuple(choices),
            tuple(sources),
            seg,
            frozenset(new_props),
            frozenset(new_comm),
            price_key,
            {},
        )


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

    def walk(pos, props, communicated, row, lanes, steps):
        if pos == len(order):
            extra = _finish(props, communicated, graph.loss, cost)
            count[0] += 1
            if extra is not None:  # with a pair, the two micro-steps' timelines (program_cost)
                price = (
                    cost.program_cost(steps, extra[1])
                    if cost.pair
                    else cost.complete(end(row, lanes) + extra[0], steps)
                )
                best[0] = min(best[0], price)
            return
        for step, (q, p, m, _), add_props, add_comm in _successors(theory, cost, order[pos], props, communicated):
            live = frozenset(p for p in props | add_props if last_use.get(p[0], -1) > pos)
            comm_live = frozenset(t for t in communicated | add_comm if last_use.get(t, -1) > pos)
            walk(
                pos + 1, live, comm_live, prepend(row, m), apply(stage_map(q, p, q > 0.0, False), lanes), steps + [step]
            )

    walk(0, frozenset(), frozenset(), ZERO_LANES, ZERO_LANES, [])
    return BruteForceResult(best[0], count[0])
