"""Which ratio row (segment) each op of the graph follows (HAP Sec. 5.2; docs/planner.md "Segments").

Three ways to cut the ops, `method.segmentation`:
- `layers` (default): only at layer-group borders, choosing among them the cuts whose groups
  come closest to equal forward FLOPs (least sum of squared segment FLOPs). A layer group is
  one block (the ops inside an indexed child module that has modules of its own, e.g.
  `blocks.3`, a transformer block, with the ops outside blocks up to the next block) or,
  outside blocks, a stage ended by a pooling op
  (`max_pool2d`, `avg_pool2d`: VGG19's five conv stages); the ops before the first block
  (embeddings) and after the last one (final norm, head, loss) are groups of their own.
- `flops`: contiguous groups of about equal forward FLOPs, wherever that falls.
- `metis`: the op graph (vertices weighted by FLOPs, edges by the bytes of the tensor they
  carry) partitioned by METIS (pymetis) into balanced parts with few bytes across parts;
  parts need not be contiguous in op order (the runtime reshards any tensor read from
  another part's row).
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.core.errors import ConfigError
from methods.hap.theory import Theory

SEGMENTATIONS = ("layers", "flops", "metis")
POOLING_OPS = ("max_pool2d", "avg_pool2d")


class SegmentationError(ConfigError):
    """A segmentation that cannot be made (unknown name, too many segments, no pymetis)."""


def check_segmentation(name: str) -> None:
    if name not in SEGMENTATIONS:
        raise SegmentationError(f"method.segmentation={name!r} is unknown; valid: {', '.join(SEGMENTATIONS)} "
                                "(e.g. method.segmentation=layers)")


def segment_ops(graph, order: Sequence[str], num_segments: int, segmentation: str = "layers") -> list[int]:
    """The segment of each op in `order` (topological), in [0, num_segments)."""
    check_segmentation(segmentation)
    flops = [max(float(graph[name].flops), 0.0) for name in order]
    if num_segments == 1 or not order:
        return [0] * len(order)
    if segmentation == "flops":
        return flop_cuts(flops, num_segments)
    if segmentation == "layers":
        groups = layer_groups(graph, order)
        count = groups[-1] + 1
        if num_segments > count:
            raise SegmentationError(
                f"method.num_segments={num_segments} is more than the {count} layer groups of this model "
                f"(method.segmentation=layers); use method.num_segments<={count} or method.segmentation=flops")
        group_flops = [0.0] * count
        for g, f in zip(groups, flops):
            group_flops[g] += f
        seg_of_group = balanced_cuts(group_flops, num_segments)
        return [seg_of_group[g] for g in groups]
    return metis_parts(graph, order, flops, num_segments)


def flop_cuts(flops: Sequence[float], num_segments: int) -> list[int]:
    """Contiguous groups of about equal FLOPs: an op goes to the segment its FLOP midpoint is in."""
    total = sum(flops) or 1.0
    out, done = [], 0.0
    for f in flops:
        out.append(min(num_segments - 1, int(num_segments * (done + f / 2) / total)))
        done += f
    return out


def _stack(node) -> list[str]:
    """Paths of the modules the op runs inside, outermost first (torch.fx's nn_module_stack)."""
    return list(node.fx_node.meta.get("nn_module_stack") or {})


def layer_groups(graph, order: Sequence[str]) -> list[int]:
    """The layer group of each op in `order` (0, 1, ... non-decreasing; module docstring).

    A block is an indexed child module (`blocks.3`, the last part of its path a number) inside
    which another module runs: a transformer block, not a single conv or linear layer of a
    Sequential (`features.3`). An op's key is the outermost block it runs inside; an op outside
    blocks between two blocks (a residual add written in the model's forward) belongs to the
    block before it. A new group starts where the key changes and after every pooling op."""
    paths = {p for name in order for p in _stack(graph[name])}
    parents = {p.rsplit(".", 1)[0] for p in paths if "." in p}
    parents |= {q for p in parents for q in _prefixes(p)}
    blocks = {p for p in parents if p.rsplit(".", 1)[-1].isdigit()}
    keys = [next((p for p in _stack(graph[name]) if p in blocks), None) for name in order]
    last = max((i for i, k in enumerate(keys) if k is not None), default=-1)
    for i in range(1, last):
        if keys[i] is None:
            keys[i] = keys[i - 1]
    out, group = [], 0
    prev_key, after_pool = None, False
    for i, (name, key) in enumerate(zip(order, keys)):
        node = graph[name]
        if i and (after_pool or key != prev_key):
            group += 1
        out.append(group)
        prev_key, after_pool = key, node.op in POOLING_OPS
    return out


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def balanced_cuts(weights: Sequence[float], num_segments: int) -> list[int]:
    """Segment of each item when `weights` (in order) are cut into `num_segments` non-empty
    contiguous runs with the least sum of squared run weights (dynamic programming)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][j]: the least cost of the first j items in k runs; cut[k][j]: where run k starts.
    best = [[inf] * (n + 1) for _ in range(num_segments + 1)]
    cut = [[0] * (n + 1) for _ in range(num_segments + 1)]
    best[0][0] = 0.0
    for k in range(1, num_segments + 1):
        for j in range(k, n - (num_segments - k) + 1):
            for i in range(k - 1, j):
                c = best[k - 1][i] + (prefix[j] - prefix[i]) ** 2
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i
    out = [0] * n
    j = n
    for k in range(num_segments, 0, -1):
        i = cut[k][j]
        out[i:j] = [k - 1] * (j - i)
        j = i
    return out


def metis_parts(graph, order: Sequence[str], flops: Sequence[float], num_segments: int) -> list[int]:
    """METIS's partition of the op graph, parts numbered in the order their first op runs."""
    try:
        import pymetis
    except ImportError:
        raise SegmentationError("method.segmentation=metis needs pymetis, which is not installed; "
                                "pip install 'hetbench[metis]' (or pip install pymetis), "
                                "or use method.segmentation=layers") from None
    index = {name: i for i, name in enumerate(order)}
    edges: dict[tuple[int, int], int] = {}
    biggest = max((graph[t].nbytes for name in order for t in graph[name].inputs if t in index), default=1) or 1
    for name in order:
        for t in graph[name].inputs:
            if t in index and t != name:
                a, b = sorted((index[t], index[name]))
                # METIS takes integer weights: bytes scaled to 1..10^6.
                edges[(a, b)] = edges.get((a, b), 0) + max(1, round(1e6 * graph[t].nbytes / biggest))
    adj: list[list[tuple[int, int]]] = [[] for _ in order]
    for (a, b), w in edges.items():
        adj[a].append((b, w))
        adj[b].append((a, w))
    xadj, adjncy, eweights = [0], [], []
    for row in adj:
        adjncy += [v for v, _ in row]
        eweights += [w for _, w in row]
        xadj.append(len(adjncy))
    top = max(flops) or 1.0
    vweights = [1 + round(1e6 * f / top) for f in flops]
    _, parts = pymetis.part_graph(num_segments, pymetis.CSRAdjacency(xadj, adjncy), vweights=vweights,
                                  eweights=eweights, options=pymetis.Options(seed=0))
    relabel: dict[int, int] = {}
    for p in parts:
        relabel.setdefault(int(p), len(relabel))
    return [relabel[int(p)] for p in parts]


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
