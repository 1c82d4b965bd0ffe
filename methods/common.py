"""Helpers shared by the methods: layer groups of a traced model, what each group costs, and
the memory tools every method offers (activation checkpointing per layer group, gradient
accumulation over micro-batches).

A layer group is the unit at which methods cut a model: hap's ratio rows (segmentation
`layers`), the stages of the pipeline, FSDP's `fully_shard` units and the activation
checkpoints all cut at group borders. This module reads the planner's traced graph
(methods.graph); it decides no parallelism.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from methods.graph import Graph

from bench.core.errors import ConfigError
from bench.core.program import op_class

POOLING_OPS = ("max_pool2d", "avg_pool2d")


# -- batch norm (the workload's batch_norm) ------------------------------------------------------


def capture_batch_norm(workload) -> str:
    """How a program split by samples captures training-mode batch norm for the workload's
    choice: "sync" (its statistics as sums over the whole batch, which a batch split
    all-reduces, so the program normalises as one device does) for `global`, "local" (batch
    norm kept whole, each shard normalised by its own statistics) for `local`."""
    return "sync" if workload.batch_norm == "global" else "local"


def refuse_global_batch_norm(workload, graph, method: str, how: str) -> None:
    """A ConfigError of one line where the workload asks batch norm over the whole batch of a
    model that has one, and `method` normalises `how` (each rank's share, each micro-batch)."""
    from methods.graph import module_has_batch_norm

    if workload.batch_norm == "global" and module_has_batch_norm(graph.gm):
        raise ConfigError(
            f"batch_norm=global: method {method} normalises {how}, not the whole batch (torch's "
            "SyncBatchNorm runs on GPUs only and is not priced); use batch_norm=local (as DDP trains) "
            "or method=hap or sfb, whose programs all-reduce the statistics"
        )


def _stack(node) -> list[str]:
    """Paths of the modules the op runs inside, outermost first (torch.fx's nn_module_stack)."""
    return list(node.fx_node.meta.get("nn_module_stack") or {})


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def layer_groups(graph, order: Sequence[str]) -> list[int]:
    """The layer group of each op in `order` (0, 1, ... non-decreasing).

    A block is an indexed child module (`blocks.3`, the last part of its path a number) inside
    which another module runs: a transformer block, not a single conv or linear layer of a
    Sequential (`features.3`). An op's key is the outermost block it runs inside; an op outside
    blocks between two blocks (a residual add written in the model's forward) belongs to the
    block before it. A new group starts where the key changes and after every pooling op
    (`max_pool2d`, `avg_pool2d`: VGG19's five conv stages); the ops before the first block
    (embeddings) and after the last one (final norm, head, loss) are groups of their own."""
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


@dataclass
class GroupCost:
    """What one layer group costs, per sample of the batch unless the name says otherwise.

    FLOPs by op class (bench.core.program.OP_CLASSES), as the planner counts them: backward = each
    op's forward times its backward factor, plus its forward again where an activation checkpoint
    recomputes it. Launches count kernels as the cost model does: one per computing op in forward;
    in backward two for an op that reads a parameter, one otherwise, and one more where recomputed.
    """

    index: int
    forward_flops: dict[str, float] = field(default_factory=dict)
    backward_flops: dict[str, float] = field(default_factory=dict)
    forward_launches: dict[str, int] = field(default_factory=dict)
    backward_launches: dict[str, int] = field(default_factory=dict)
    param_bytes: float = 0.0  # whole, not per sample
    cast_bytes: float = 0.0  # autocast's casts of its parameters, once a step (Graph.cached_casts)
    call_cast_bytes: float = 0.0  # ... those its ops make anew at each call, whole (Graph.call_cast_bytes)
    param_tensors: int = 0
    largest_param_bytes: float = 0.0
    params: list[str] = field(default_factory=list)  # parameter names (module paths), forward order
    param_sizes: list[float] = field(default_factory=list)  # their bytes
    saved_bytes: float = 0.0  # what autograd keeps for backward of the group's ops
    out_bytes: float = 0.0  # what crosses the border after this group (to every later group)

    @property
    def fwd_flops(self) -> float:
        return sum(self.forward_flops.values())

    @property
    def bwd_flops(self) -> float:
        return sum(self.backward_flops.values())

    @property
    def launches(self) -> int:
        """Kernels of one forward and backward of the group."""
        return sum(self.forward_launches.values()) + sum(self.backward_launches.values())


@dataclass
class GroupTable:
    """A traced model cut into layer groups: which group each node is in, and each group's cost.

    `targets` are the placeholders of the loss's targets (the model's last input); `tail` the
    nodes that read them (the loss and what prepares the targets): a pipeline computes those
    as its loss function on the last stage, so they count in the last group and never cross a
    border."""

    groups: list[GroupCost]
    node_group: dict[str, int]  # every call_function/call_method node -> its group
    tail: list[str]
    targets: list[str]
    batch: int
    # parameters read by ops of several groups (a tied embedding and head), listed with the
    # group of their first user like any other
    shared_params: list[str] = field(default_factory=list)
    # each of those: the layer groups whose ops read it, in order
    shared_groups: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def border_bytes(self, first: int, end: int) -> float:
        """Per sample, what stage [first, end) receives from the groups before it."""
        return 0.0 if first == 0 else self.groups[first - 1].out_bytes

    def span(self, first: int, end: int) -> list[GroupCost]:
        return self.groups[first:end]


def gradient_buckets(sizes: Sequence[float], cap_mb: float) -> list[list[int]]:
    """Buckets of gradients to all-reduce, as indices into `sizes` (parameters' bytes in forward
    order): filled in the order backward makes the gradients (the last parameters first),
    each closed once it holds `cap_mb` MiB (bench.core.program.bucket_runs, DDP's rule)."""
    from bench.core.program import bucket_runs

    n = len(sizes)
    return [
        [n - 1 - i for i in run] for run in bucket_runs([(sizes[n - 1 - i], None) for i in range(n)], cap_mb * 2**20)
    ]


def group_table(graph: Graph) -> GroupTable:
    """The layer groups of a captured graph with their costs.

    Parameters (get_attr) and model inputs belong to the group of their first user; a tensor
    crossing a border is counted at every border it crosses (a pipeline passes it stage by
    stage). Made once per graph object and kept on it (auto's space, each pipeline candidate,
    FSDP2 and checkpointing read the same graph): nothing changes a table once made."""
    kept = vars(graph)
    if "_group_table" not in kept:
        kept["_group_table"] = _group_table(graph)
    return kept["_group_table"]


def _group_table(graph) -> GroupTable:
    nodes = graph.nodes
    batch = max(graph.batch_size, 1)
    placeholders = [n.name for n in nodes if n.kind == "placeholder"]
    targets = placeholders[-1:] if len(placeholders) > 1 else []
    tail: set[str] = set()
    for n in nodes:  # what reads the targets, directly or through other such nodes
        if n.kind in ("call_function", "call_method") and any(i in targets or i in tail for i in _all_inputs(n)):
            tail.add(n.name)
    compute = [n.name for n in nodes if n.kind in ("call_function", "call_method")]
    body = [name for name in compute if name not in tail]
    groups_of = dict(zip(body, layer_groups(graph, body))) if body else {}
    last = max(groups_of.values(), default=0)
    node_group = {**groups_of, **{name: last for name in compute if name in tail}}
    table = [GroupCost(g) for g in range(last + 1)]
    users = graph.users
    first_user_group: dict[str, int] = {}
    for n in nodes:
        if n.kind in ("get_attr", "placeholder"):
            groups = [node_group[u] for u in users.get(n.name, []) if u in node_group]
            first_user_group[n.name] = min(groups, default=0)
    for n in nodes:
        if n.name not in node_group:
            continue
        g = table[node_group[n.name]]
        if n.flops:
            cls = op_class(n.op)
            g.forward_flops[cls] = g.forward_flops.get(cls, 0.0) + n.flops / batch
            g.backward_flops[cls] = g.backward_flops.get(cls, 0.0) + graph.backward_flops(n) / batch
            g.forward_launches[cls] = g.forward_launches.get(cls, 0) + 1
            g.backward_launches[cls] = g.backward_launches.get(cls, 0) + (
                (2 if any(graph[i].is_param for i in n.inputs) else 1) + (n.name in graph.recomputed)
            )
        g.call_cast_bytes += graph.call_cast_bytes(n.name)
    cached = graph.cached_casts()
    for n in nodes:
        if n.is_param:
            g = table[first_user_group.get(n.name, 0)]
            g.param_bytes += n.nbytes
            g.cast_bytes += cached.get(n.name, 0)
            g.param_tensors += 1
            g.largest_param_bytes = max(g.largest_param_bytes, float(n.nbytes))
            g.params.append(str(n.fx_node.target))
            g.param_sizes.append(float(n.nbytes))
    for t, (factor, keeper) in graph.kept_until().items():
        if keeper in node_group:
            table[node_group[keeper]].saved_bytes += graph[t].nbytes * factor / batch
    # Borders: a value made in group <= b (or an input) and read after it crosses border b.
    for n in nodes:
        if n.kind == "get_attr" or n.name in targets or n.name in tail or not n.is_tensor:
            continue
        made = node_group.get(n.name, 0 if n.kind == "placeholder" else None)
        if made is None:
            continue
        readers = [node_group[u] for u in users.get(n.name, []) if u in node_group and u not in tail]
        readers += [last for u in users.get(n.name, []) if u in tail]
        for b in range(made, max(readers, default=made)):
            table[b].out_bytes += n.nbytes / batch
    gm = getattr(graph, "gm", None)
    aliases = gm.meta.get("param_aliases", {}) if gm is not None else {}
    readers: dict[str, set[int]] = {}  # a parameter, by the name the graph keeps, and its readers' groups
    for n in nodes:
        if n.kind == "get_attr":
            target = str(n.fx_node.target)
            readers.setdefault(aliases.get(target, target), set()).update(
                node_group[u] for u in users.get(n.name, []) if u in node_group
            )
    shared = [str(n.fx_node.target) for n in nodes if n.is_param and len(readers.get(str(n.fx_node.target), ())) > 1]
    tail_order = sorted(tail, key=list(graph.by_name).index)
    groups = {name: tuple(sorted(readers[name])) for name in shared}
    return GroupTable(table, node_group, tail_order, targets, batch, shared, groups)


def _all_inputs(node) -> list[str]:
    return list(node.inputs) + list(getattr(node, "shape_inputs", []))


class StageActivations:
    """Per sample, (what a pipeline stage of layer groups [first, end) keeps of one micro-batch
    between its forward and its backward, the most it holds of one micro-batch during that
    backward): autograd's saved tensors of its ops (methods.graph.Graph.kept_until) made
    inside the stage (a tensor made before it is its receive buffer, counted as such), its
    output (the stage keeps it to run backward from), and during backward the activation
    gradients it holds (Graph.grads_in_flight, clipped to the stage), walked backward as
    bench.core.program.backward_sweep walks a whole model. The last stage's output is what its loss
    function reads (the schedule keeps it too). The graph is read once; each stage is a filter."""

    def __init__(self, graph, table: GroupTable):
        self.table = table
        position = {n.name: i for i, n in enumerate(graph.nodes)}
        batch = max(graph.batch_size, 1)
        group = table.node_group
        self.group_at = {position[n]: g for n, g in group.items()}
        placeholders = {n.name for n in graph.nodes if n.kind == "placeholder"}
        # (keeper position, keeper group, producer group or -1 for a model input, bytes)
        self.kept = [
            (position[k], group[k], group.get(t, -1 if t in placeholders else None), graph[t].nbytes * f / batch)
            for t, (f, k) in graph.kept_until().items()
            if k in group and graph[t].kind != "placeholder"
        ]
        self.flight = [
            (position[a], position[b], graph[t].nbytes * f / batch) for t, a, b, f in graph.grads_in_flight()
        ]
        tail = set(table.tail)
        self.tail_inputs = (
            sum(
                graph[n].nbytes
                for n, g in group.items()
                if n not in tail and graph[n].is_tensor and any(u in tail for u in graph.users.get(n, []))
            )
            / batch
        )
        self.span = {}
        for pos, g in self.group_at.items():
            lo, hi = self.span.get(g, (pos, pos))
            self.span[g] = (min(lo, pos), max(hi, pos))
        self._cache: dict = {}

    def __call__(self, first: int, end: int) -> tuple[float, float]:
        key = (first, end)
        if key not in self._cache:
            self._cache[key] = self._compute(first, end)
        return self._cache[key]

    def _compute(self, first: int, end: int) -> tuple[float, float]:
        lo = min(self.span[g][0] for g in range(first, end))
        hi = max(self.span[g][1] for g in range(first, end))
        kept = [
            (p, b)
            for p, g, made, b in self.kept
            if first <= g < end and made is not None and (first <= made < end or (first == 0 and made == -1))
        ]
        flight = [(max(a, lo), min(b, hi), x) for a, b, x in self.flight if not (b < lo or a > hi)]
        out = self.tail_inputs if end == self.table.num_groups else self.table.groups[end - 1].out_bytes
        # Backward walks positions from the last down: a kept tensor is freed once backward has
        # passed its first keeper; an activation gradient lives from its last use to its maker.
        held = sum(b for _, b in kept)
        freed_at: dict[int, float] = {}
        for p, b in kept:
            freed_at[p] = freed_at.get(p, 0.0) + b
        arrive: dict[int, float] = {}
        leave: dict[int, float] = {}
        for a, b, x in flight:
            arrive[b] = arrive.get(b, 0.0) + x
            leave[a] = leave.get(a, 0.0) + x
        positions = sorted(set(freed_at) | set(arrive) | set(leave), reverse=True)
        kept_now, flying, peak = held, 0.0, held
        for pos in positions:
            flying += arrive.get(pos, 0.0)
            peak = max(peak, kept_now + flying)
            kept_now -= freed_at.get(pos, 0.0)
            flying -= leave.get(pos, 0.0)
        return held + out, peak + out


def scale_to_norm(grads, norm: torch.Tensor, max_norm: float) -> None:
    """Scale `grads` (a rank's local gradient tensors, None skipped) in place by
    clip_grad_norm_'s factor for the global `norm`: max_norm / (norm + 1e-6), at most 1. The
    factor stays a tensor on the norm's device (no read on the host; a factor of 1 leaves the
    gradients as they are)."""
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        if g is not None:
            g.mul_(coef.to(g.dtype))


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """The cyclic collector off while a planner runs. Planning allocates millions of small
    objects that live until it ends (search states, sets, LP terms, a pipeline's memos, an
    export's nodes), and the collector kept walking them: with it off until the plan is made
    (reference counting still frees what dies; cycles made meanwhile are collected once it is
    back on), the same plans are made in less time (tests/benchmarks/test_planner_bench.py;
    docs/planner.md, "Planner"). Nested uses leave it as the outermost found it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def check_training_options(lr: float, grad_clip: float, bucket_cap_mb: float | None = None) -> None:
    """The optimizer and gradient-bucket options every data-parallel style method shares: one
    line naming the option where one is out of range (ConfigError)."""
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ConfigError(f"method.bucket_cap_mb={bucket_cap_mb!r} must be > 0 (MiB)")
    if not lr > 0 or grad_clip < 0:
        raise ConfigError(f"method.lr={lr!r} must be > 0 and method.grad_clip={grad_clip!r} >= 0")


# -- memory tools -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointUnit:
    """One activation checkpoint: the modules a layer group's ops run inside, which the runtime
    runs under torch.utils.checkpoint (methods.graph.Graph.recompute prices it).

    `modules` is one module (a transformer block), or consecutive children of the nn.Sequential
    `sequential` (a VGG conv stage: convolutions, activations and the pool); `nodes` are the
    ops that run inside them, contiguous in forward order."""

    group: int
    modules: tuple[str, ...]
    nodes: tuple[str, ...]
    sequential: str | None = None

    def to_json(self) -> dict:
        return {"group": self.group, "modules": list(self.modules), "sequential": self.sequential}

    @staticmethod
    def from_json(d: dict, nodes: Sequence[str] = ()) -> CheckpointUnit:
        return CheckpointUnit(int(d["group"]), tuple(d["modules"]), tuple(nodes), d.get("sequential"))


def _module_stack(node) -> list[tuple[str, str]]:
    """(path, type) of the modules an op runs inside, outermost first."""
    return [tuple(v) for v in (node.fx_node.meta.get("nn_module_stack") or {}).values()]


def checkpoint_units(graph, table: GroupTable | None = None) -> list[CheckpointUnit]:
    """The layer groups an activation checkpoint can cover, one unit each, in forward order.

    A group's unit is the module all of its ops inside modules run in (the largest one that
    runs no other group's ops), or where there are several, consecutive children of one
    nn.Sequential; its ops (those inside the unit's modules) must be contiguous in forward
    order. Ops of the group outside the modules (a residual add in the model's forward) are
    not recomputed. A group whose modules are called from elsewhere (embeddings and head,
    called by the model's own forward) has no unit, nor one whose ops keep no more for
    backward than the unit's inputs (a single convolution: a checkpoint would only cost time).
    """
    table = table or group_table(graph)
    compute = graph.ops
    at = {n.name: i for i, n in enumerate(compute)}
    groups_of: dict[str, set[int]] = {}
    first_at: dict[str, int] = {}
    kind: dict[str, str] = {}
    parent: dict[str, str] = {}
    for n in compute:
        stack = _module_stack(n)
        for i, (path, typ) in enumerate(stack):
            groups_of.setdefault(path, set()).add(table.node_group[n.name])
            first_at.setdefault(path, at[n.name])
            kind[path] = typ
            parent[path] = stack[i - 1][0] if i else ""
    plain = graph.with_recompute(())
    keepers, masks = plain.keepers(), plain.own_saves()
    units = []
    for g in range(table.num_groups):
        tops = sorted(
            (p for p, gs in groups_of.items() if gs == {g} and (parent[p] == "" or groups_of[parent[p]] != {g})),
            key=first_at.__getitem__,
        )
        if not tops:
            continue
        sequential = None
        if len(tops) > 1:
            owner = {parent[p] for p in tops}
            if len(owner) != 1 or not kind.get(next(iter(owner)), "").endswith("container.Sequential"):
                continue
            sequential = owner.pop()
            index = [p.rsplit(".", 1)[-1] for p in tops]
            if not all(i.isdigit() for i in index):
                continue
            lo, hi = int(index[0]), int(index[-1])
            siblings = {int(p.rsplit(".", 1)[-1]) for p in groups_of if parent[p] == sequential}
            if any(i in siblings and f"{sequential}.{i}" not in tops for i in range(lo, hi + 1)):
                continue
            tops = [f"{sequential}.{i}" for i in range(lo, hi + 1)]
        inside = set(tops)
        nodes = [n.name for n in compute if inside & _paths(n)]
        span = [at[name] for name in nodes]
        if max(span) - min(span) + 1 != len(nodes):
            continue  # another op runs between the unit's: not one call
        unit = set(nodes)
        saved = sum(
            graph[t].nbytes * (any(k in unit for k in keepers.get(t, ())) + masks.get(t, 0.0) * (t in unit))
            for t in {*keepers, *masks}
        )
        held = sum(graph[t].nbytes for t in plain.unit_inputs(nodes))
        if saved <= held:
            continue
        units.append(CheckpointUnit(g, tuple(tops), tuple(nodes), sequential))
    return units


def _paths(node) -> set[str]:
    return {p for p, _ in _module_stack(node)}


def unit_nodes(graph, units: Sequence[CheckpointUnit]) -> list[CheckpointUnit]:
    """A plan's units (memory_tools_of) with their ops in `graph`: the ops that run inside
    their modules."""
    compute = graph.ops
    return [
        CheckpointUnit(u.group, u.modules, tuple(n.name for n in compute if set(u.modules) & _paths(n)), u.sequential)
        for u in units
    ]


def apply_checkpointing(model: nn.Module, units: Sequence[CheckpointUnit]) -> None:
    """Run each unit's modules under torch.utils.checkpoint (non-reentrant): forward keeps the
    unit's inputs only, backward runs the unit's forward again first. The modules keep their
    names (their parameters' names and FSDP's units are unchanged): a module's own `forward`
    is wrapped, and an nn.Sequential whose children form units runs them through a forward of
    its own. Call it on the model each rank trains, after any copy of it is made."""
    runs: dict[str, list[tuple[int, int]]] = {}
    for u in units:
        if u.sequential is None:
            module = model.get_submodule(u.modules[0])
            module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
        else:
            index = [int(m.rsplit(".", 1)[-1]) for m in u.modules]
            runs.setdefault(u.sequential, []).append((index[0], index[-1]))
    for path, spans in runs.items():
        seq = model.get_submodule(path)
        seq.forward = functools.partial(_sequential_forward, list(seq), sorted(spans))


def _run(modules: Sequence[nn.Module], x):
    for m in modules:
        x = m(x)
    return x


def _sequential_forward(children: list[nn.Module], spans: list[tuple[int, int]], x):
    """nn.Sequential's forward with the children of each span [first, last] run as one checkpoint."""
    i = 0
    starts = dict(spans)
    while i < len(children):
        if i in starts:
            x = checkpoint(_run, children[i : starts[i] + 1], x, use_reentrant=False)
            i = starts[i] + 1
        else:
            x = children[i](x)
            i += 1
    return x


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(values: Sequence[int]) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


@dataclass(frozen=True)
class MemoryTools:
    """The memory tools every method offers, its options `method.activation_checkpointing` and
    `method.grad_accumulation`; the workload (global batch, each rank's share, loss) is the same
    with them or without.

    Attributes:
        activation_checkpointing: run each layer group that can be checkpointed
            (checkpoint_units) under torch.utils.checkpoint: its activations are made again in
            backward from its input.
        grad_accumulation: micro-steps per iteration: each rank's share is cut into this many
            micro-batches of whole samples, each run forward and backward, and the gradients
            (summed) are synchronised once per iteration where the engine allows it.
    """

    activation_checkpointing: bool = False
    grad_accumulation: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.activation_checkpointing, bool):
            raise ConfigError(
                f"method.activation_checkpointing={self.activation_checkpointing!r} is invalid; use true "
                "(checkpoint every layer group that can be) or false"
            )
        k = self.grad_accumulation
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(
                f"method.grad_accumulation={k!r} is invalid; use an integer >= 1 (micro-steps per iteration, 1 = off)"
            )

    def units(self, graph) -> list[CheckpointUnit]:
        """The checkpointed units of `graph` (none with checkpointing off)."""
        return checkpoint_units(graph) if self.activation_checkpointing else []

    def check_shares(self, shares: Sequence[int]) -> None:
        """One line (ConfigError) where a rank's batch share does not split into
        grad_accumulation micro-batches of whole samples."""
        k = self.grad_accumulation
        if all(s % k == 0 for s in shares):
            return
        valid = _divisors(math.gcd(*shares))
        sizes = sorted(set(shares), reverse=True)  # each size once: a cluster of 64 ranks has a few
        raise ConfigError(
            f"method.grad_accumulation={k} cannot cut the ranks' batch shares ({', '.join(map(str, sizes))} "
            f"samples) into {k} micro-batches of whole samples each; use method.grad_accumulation="
            f"{_choices(valid)}, or a global batch whose shares it divides"
        )

    def check_batch(self, global_batch: int) -> None:
        """One line (ConfigError) where the global batch does not split into grad_accumulation
        micro-batches (a planner that plans one micro-step: hap, sfb)."""
        k = self.grad_accumulation
        if global_batch % k:
            raise ConfigError(
                f"method.grad_accumulation={k} does not divide global_batch={global_batch} into micro-batches "
                f"of whole samples; use method.grad_accumulation={_choices(_divisors(global_batch)[:8])}, or a "
                f"global batch that {k} divides"
            )

    def details(self, units: Sequence[CheckpointUnit]) -> dict:
        """What a plan records of the tools (the row's plan.memory_tools)."""
        return {
            "activation_checkpointing": self.activation_checkpointing,
            "checkpointed_groups": [u.group for u in units],
            "checkpoint_units": [u.to_json() for u in units],
            "grad_accumulation": self.grad_accumulation,
        }


def micro_batches(batch: Sequence[torch.Tensor], k: int) -> list[tuple[torch.Tensor, ...]]:
    """A rank's batch (every tensor's dim 0 its samples) cut into k micro-batches of equal,
    whole samples, in order."""
    if k == 1:
        return [tuple(batch)]
    parts = [t.chunk(k) if t.dim() else (t,) * k for t in batch]
    for t, p in zip(batch, parts):
        assert t.dim() == 0 or (t.shape[0] % k == 0 and len(p) == k), (tuple(t.shape), k)
    return list(zip(*parts))


def memory_tools_of(details: dict | None) -> tuple[list[CheckpointUnit], int]:
    """(checkpointed units, without their ops; micro-steps) a plan records (MemoryTools.details):
    none and 1 where it records none."""
    tools = (details or {}).get("memory_tools") or {}
    units = [CheckpointUnit.from_json(d) for d in tools.get("checkpoint_units", [])]
    return units, int(tools.get("grad_accumulation", 1))
