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
from methods.common import POOLING_OPS, balanced_cuts, layer_groups  # noqa: F401  (re-exported)
from methods.hap.theory import Theory

SEGMENTATIONS = ("layers", "flops", "metis")


class SegmentationError(ConfigError):
    """A segmentation that cannot be made (unknown name, too many segments, no pymetis)."""


def check_segmentation(name: str) -> None:
    if name not in SEGMENTATIONS:
        raise SegmentationError(
            f"method.segmentation={name!r} is unknown; valid: {', '.join(SEGMENTATIONS)} "
            "(e.g. method.segmentation=layers)"
        )


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
                f"(method.segmentation=layers); use method.num_segments<={count} or method.segmentation=flops"
            )
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


def metis_parts(graph, order: Sequence[str], flops: Sequence[float], num_segments: int) -> list[int]:
    """METIS's partition of the op graph, parts numbered in the order their first op runs."""
    try:
        import pymetis
    except ImportError:
        raise SegmentationError(
            "method.segmentation=metis needs pymetis, which is not installed; "
            "pip install 'hetbench[metis]' (or pip install pymetis), "
            "or use method.segmentation=layers"
        ) from None
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
    _, parts = pymetis.part_graph(
        num_segments,
        pymetis.CSRAdjacency(xadj, adjncy),
        vweights=vweights,
        eweights=eweights,
        options=pymetis.Options(seed=0),
    )
    relabel: dict[int, int] = {}
    for p in parts:
        relabel.setdefault(int(p), len(relabel))
    return [relabel[int(p)] for p in parts]


def assign_segments(
    theory: Theory, num_segments: int, segmentation: str = "layers"
) -> tuple[dict[str, int], dict[str, int]]:
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
