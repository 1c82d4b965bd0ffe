"""The A* search's heuristic: a lower bound of what the ops not yet decided must still cost.

The larger of two tree bounds over the remaining ops (each op hangs below the producer of one
of its inputs; the two trees relax opposite edges), each pricing an op's cheapest triple plus
the cheapest collective its inputs need from their producers' layouts. Admissible: never above
the price of any completion (tests/unit/test_hap_search.py), so without a beam the search
stays exact.
"""

from __future__ import annotations

import math

from methods.hap.pricing import CostModel
from methods.hap.theory import Layout, Rule, Theory


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
            k = (
                min(reversed(ks), key=lambda k: readers[inputs[k]])
                if fewest
                else max(ks, key=lambda k: readers[inputs[k]])
            )
            parent[i] = (index[inputs[k]], k)
    return parent


def remaining_bound(theory: Theory, cost: CostModel, order: list[str]) -> list[float]:
    """min_rest[i]: a lower bound on the cost of ops i.. (A*'s heuristic at position i): the
    larger of two tree bounds (_tree, _tree_bound), whose covers relax opposite edges."""
    key = ("trees", tuple(order))
    if key not in theory.search_cache:
        theory.search_cache[key] = (
            _first_reads(theory, order),
            [_tree_walk(theory, order, _tree(theory, order, fewest)) for fewest in (True, False)],
        )
    first, walks = theory.search_cache[key]

    def created(name: str, r: Rule) -> list[int]:  # the sources op `name` creates when it runs r
        inputs = theory.graph[name].inputs
        return [k for k in first.get(name, ()) if r.pre[k] in theory.sources[inputs[k]]]

    key = ("rows", cost.segments_key, tuple(order))
    if key not in theory.search_cache:
        # Per op, what its row reads (ops of a deep model's layers share it), named by a number:
        # each op's number and, per number, its first op.
        ids: dict = {}
        numbers = [
            ids.setdefault(
                tuple(
                    (
                        cost.rule_key(name, r),
                        tuple(cost.source_key(theory.graph[name].inputs[k], r.pre[k], r) for k in created(name, r)),
                    )
                    for r in theory.rules[name]
                ),
                len(ids),
            )
            for name in order
        ]
        firsts: dict[int, int] = {}
        for i, number in enumerate(numbers):
            firsts.setdefault(number, i)
        theory.search_cache[key] = numbers, [order[i] for i in firsts.values()]
    numbers, firsts = theory.search_cache[key]
    rows = []  # per number: per triple, its compute and the sync of the sources it creates
    for name in firsts:
        inputs = theory.graph[name].inputs
        row = []
        for r in theory.rules[name]:
            t = cost.rule_time(name, r)
            for k in created(name, r):
                t += cost.source_time(inputs[k], r.pre[k], r)
            row.append(t)
        rows.append(row)
    own = [rows[number] for number in numbers]
    relayout: dict = {}
    bounds = [_tree_bound(theory, cost, order, walk, own, relayout) for walk in walks]
    return [max(b) for b in zip(*bounds)]


def _tree_walk(theory: Theory, order: list[str], parent: dict[int, tuple[int, int]]) -> tuple:
    """What _tree_bound reads of a tree cover, worked out once per theory: per op its children,
    per triple (the layout of its output, the layout it reads its parent's output in, None at
    a root), and what the price of a re-layout of its output reads besides its home row."""
    graph = theory.graph
    children: list[list[int]] = [[] for _ in order]
    for i, (p, _) in parent.items():
        children[p].append(i)
    triples = []
    for i, name in enumerate(order):
        k = parent[i][1] if i in parent else None
        triples.append(tuple((r.post, None if k is None else r.pre[k]) for r in theory.rules[name]))
    alike = [(graph[name].shape, graph[name].nbytes, name in theory.no_comm) for name in order]
    return [tuple(c) for c in children], triples, alike


def _tree_bound(
    theory: Theory,
    cost: CostModel,
    order: list[str],
    walk: tuple,
    own: list[list[float]],
    relayout: dict,
) -> list[float]:
    """A lower bound on the cost of ops i.. for every i, over the trees of a cover (_tree, as
    _tree_walk gives it).

    Each op hangs below the producer of one of its inputs (_tree). Over a tree the bound
    prices exactly what the search would: each op's cheapest triple with the sync of the
    sources it creates, and per parent the re-layout of its output for the children that
    read it: a tensor is communicated at most once, so every child reads either the layout
    the parent leaves or one other layout, paid for once (the cheapest collective to it).
    Inputs off the trees, reshards between segments and the loss's final collective are
    relaxed to free. At position i the ops i.. form subtrees whose roots' parents have run;
    their edges in are relaxed (an earlier reader may have paid the collective), so the sum of
    the roots' prices is admissible and the same for every state at i."""
    children, triples, alike = walk
    home = cost.home
    n = len(order)
    inf = math.inf

    def price(t: str, have: Layout, want: Layout) -> float:
        options = [] if t in theory.no_comm else [c for c in theory.comm(t, have) if c.dst == want]
        return min((cost.comm_time(c) for c in options), default=math.inf)

    # wants[i]: layout op i reads its parent's output in -> the cheapest price of op i's
    # subtree run by a triple of op i that reads it so.
    wants: list[dict] = [{} for _ in range(n)]
    root = [0.0] * n  # the cheapest price of op i's subtree, its edge in relaxed
    for i in range(n - 1, -1, -1):
        name = order[i]
        kids = [wants[c] for c in children[i]]
        if kids:
            # (layout left, layout read) -> the cheapest re-layout of the output, shared by the
            # tensors whose re-layouts are priced alike (not by the tensor's name)
            shape, nbytes, no_comm = alike[i]
            out_edges = relayout.setdefault((shape, nbytes, home[name], no_comm), {})
        below: dict = {}  # the layout op i leaves -> the cheapest price of its children's subtrees
        best = inf
        w = wants[i]
        for (post, want), t in zip(triples[i], own[i]):
            if kids:
                b = below.get(post)
                if b is None:
                    b = below[post] = _children_price(name, post, kids, out_edges, price)
                t += b
            best = min(best, t)
            if want is not None:
                w[want] = min(w.get(want, inf), t)
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
