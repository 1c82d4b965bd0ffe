"""The background theory of HAP (Sec. 4.2): Hoare triples over per-tensor sharding properties.

For every node of the reference graph (ATen ops, methods.graph), the triples list the ways
the op can run SPMD: {pre-condition: a layout per input} op {post-condition: a layout of the
output}. Communication triples turn one layout of a tensor into another. This module says what
is *valid*; what it costs is methods.hap.search's business, and nothing here runs on devices.

Where the triples come from: the sharding strategies DTensor registers per ATen op
(methods.hap.dtensor_rules), and a few rules of HAP's own, each named (HAND_RULES): what HAP's
uneven shards and its replicated operands need, which DTensor, with its even shards and its
partial-sum operands, does not say. An op with no triple from either runs replicated (every
device does all its work on whole tensors); the theory names such ops (`Theory.uncovered`).

Layouts of a tensor t across the devices:
    "I"    Identity: every device holds all of t.
    "R"    Reduce:   every device holds a full-shape partial; their sum is t.
    d:int  Gather(d): device i holds slice i of t along dim d; concatenated they are t.
A dim of length 1 is never sharded.

Long because the theory is one vocabulary: layouts, triples, communication triples, HAP's own
rules and the derived theories (data parallel, tensor parallel) are written in terms of each
other; DTensor's side lives in methods.hap.dtensor_rules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from bench.core.errors import PlanningError
from methods.graph import VIEW_OPS, Graph, Node
from methods.hap import dtensor_rules

Layout = str | int
IDENTITY: Layout = "I"
REDUCE: Layout = "R"


class NoRuleError(PlanningError):
    """An op of the model has no sharding rule."""


def layout_name(layout: Layout) -> str:
    return (
        {"I": "Identity", "R": "Reduce"}.get(layout, f"Gather({layout})")
        if isinstance(layout, str)
        else f"Gather({layout})"
    )


@dataclass(frozen=True)
class Rule:
    """One computation triple of a node: {inputs in `pre` layouts} node {output in `post`}.

    sharded: the node's work splits with the ratios (some operand is a Gather); otherwise
        every device does the full work.
    first_device_only: indices (into the node's tensor inputs) of Identity operands that only
        the first device adds in (biases and residuals added to Reduce partials).
    sfb: sufficient factor broadcasting: a replicated weight's gradient is rebuilt on every
        device from all-gathered input and output-gradient, instead of being all-reduced.
    """

    node: str
    pre: tuple[Layout, ...]  # one layout per tensor input of the node (Graph Node.inputs)
    post: Layout
    name: str
    sharded: bool
    first_device_only: tuple[int, ...] = ()
    sfb: bool = False
    # Shards of a Gather'd first input must be multiples of `unit` (a reshape that splits the
    # sharded dim, e.g. d_model -> (heads, head_dim) needs whole heads per device).
    unit: int = 1
    # Layouts required of tensors whose shape the node reads (Node.shape_inputs); tensors
    # not named may be in any layout (only their dtype is read).
    shape_pre: tuple[tuple[str, Layout], ...] = ()

    def describe(self) -> str:
        ins = ", ".join(layout_name(p) for p in self.pre)
        return f"{{{ins}}} {self.node}:{self.name} {{{layout_name(self.post)}}}"


# -- communication -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommRule:
    """{t: src} collective {t: dst}. impl: padded | grouped for all-gather and reduce-scatter."""

    tensor: str
    src: Layout
    dst: Layout
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | slice | keep_first | reshard
    impl: str = "ring"
    # reshard only (Gather(d) -> Gather(d)): the segment whose ratio row the shards move to,
    # from the row of the segment the tensor was made in (methods.hap.search segments).
    to_segment: int | None = None

    @property
    def free(self) -> bool:
        return self.kind in ("slice", "keep_first")

    def describe(self) -> str:
        if self.kind == "reshard":
            return f"reshard({self.tensor}: {layout_name(self.src)} -> rows of segment {self.to_segment})"
        impl = f", {self.impl}" if self.impl not in ("ring",) else ""
        return f"{self.kind}({self.tensor}: {layout_name(self.src)} -> {layout_name(self.dst)}{impl})"


def comm_rules(node: Node, src: Layout, grouped: bool = True) -> list[CommRule]:
    """Every collective (or free re-layout) from layout `src` of `node`'s output.

    slice: Identity -> Gather(d), every device keeps its part (free; backward pads with zeros).
    keep_first: Identity -> Reduce, the first device keeps the value, the others zeros (free).
    """
    if node.shape is None:
        return []
    dims = [d for d, n in enumerate(node.shape) if n > 1]
    impls = ("padded", "grouped") if grouped else ("padded",)
    out: list[CommRule] = []
    if src == IDENTITY:
        out += [CommRule(node.name, src, d, "slice") for d in dims]
        out.append(CommRule(node.name, src, REDUCE, "keep_first"))
    elif src == REDUCE:
        out.append(CommRule(node.name, src, IDENTITY, "all_reduce"))
        out += [CommRule(node.name, src, d, "reduce_scatter", impl) for d in dims for impl in impls]
    else:
        out += [CommRule(node.name, src, IDENTITY, "all_gather", impl) for impl in impls]
        out += [CommRule(node.name, src, d, "all_to_all") for d in dims if d != src]
    return out


# -- helpers ---------------------------------------------------------------------------------------


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _arg(node: Node, i: int, key: str, default=None):
    n = node.fx_node
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(key, default)


def _shape(g: Graph, name: str) -> tuple[int, ...]:
    node = g[name]
    if node.shape is not None:
        return node.shape
    assert node.tuple_shapes is not None
    return node.tuple_shapes[0]


def _replicated(node: Node) -> Rule:
    return Rule(node.name, tuple(IDENTITY for _ in node.inputs), IDENTITY, "replicated", False)


def _splittable(shape: Sequence[int], d: int) -> bool:
    return 0 <= d < len(shape) and shape[d] > 1


def _dim_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[int, int]:
    """For a reshape: input dim -> output dim where sharding carries over (the outermost dim
    of each group of dims that reshape into each other, both longer than 1)."""
    out: dict[int, int] = {}
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        if in_shape[i] == 1 and (j >= len(out_shape) or out_shape[j] != 1):
            i += 1
            continue
        if out_shape[j] == 1 and in_shape[i] != 1:
            j += 1
            continue
        gi, gj = i, j
        pi, pj = in_shape[i], out_shape[j]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                pi *= in_shape[i]
                i += 1
            else:
                pj *= out_shape[j]
                j += 1
        if in_shape[gi] > 1 and out_shape[gj] > 1:
            out[gi] = gj
    return out


# -- HAP's own rules (beside DTensor's) ---------------------------------------------------------

# The rules this module adds to DTensor's triples, by the name each Rule carries. Each says why
# DTensor's strategies cannot give it.
HAND_RULES = {
    "first-device-only": "an Identity operand where DTensor needs partial sums (a bias or residual added "
    "to a Reduce output) is added by the first device only, the others add zeros",
    "shard-unit": "a view that splits a sharded dim (d_model -> heads x head_dim, B*S -> B x S) keeps whole "
    "units per device; DTensor's even shards never cut a unit, HAP's ratios can",
    "broadcast-split": "expand of a dim of length 1 makes the output split along it, each device expanding "
    "to its own shard's length (DTensor keeps such outputs whole)",
    "sfb": "sufficient factor broadcasting of a linear layer with a replicated weight (HAP Sec. 4)",
    "tuple-item": "an item of a tuple output (split, topk) is laid out as the tuple",
    "local-statistics": "batch norm kept whole (the workload's batch_norm=local) splits the batch, each "
    "device normalising its shard by its own statistics, as DDP's ranks do (batch_norm=global "
    "captures it as statistics DTensor's rules split exactly)",
    "conv-channels": "a convolution also splits its output channels (the weight along dim 0) or its input "
    "channels (partial sums), and runs on partial inputs; DTensor's convolution strategy splits "
    "only the batch",
    "spatial-split": "where DTensor gives a convolution or a pooling no strategy (torch before 2.12, whose "
    "rules for them are old-style: docs/gpu.md), each sample, and for pooling each channel, is "
    "computed apart: the batch split of a convolution, the batch and channel splits of a pooling "
    "(partial sums through an average), as DTensor's strategies give them from 2.12",
}
# Ops spatial-split covers: whether partial sums pass through (a pooling that averages).
_SPATIAL = {"conv2d": False, "max_pool2d": False, "adaptive_avg_pool2d": True, "avg_pool2d": True}
_VIEWS = ("view", "reshape", "flatten", "unflatten", "squeeze")


def _rules_from_triples(node: Node, triples, origin: str, g: Graph) -> list[Rule]:
    """DTensor's triples (a layout per tensor argument, in argument order) as Rules over the
    node's distinct tensor inputs, with the first-device-only variants of partial operands."""
    args = [a.name for a in dtensor_rules.tensor_args(node.fx_node)]
    out: list[Rule] = []
    for pre_args, post in triples:
        per: dict[str, Layout] = {}
        ok = True
        for name, lay in zip(args, pre_args):
            if per.setdefault(name, lay) != lay:
                ok = False  # one tensor in two places, wanted in two layouts
        if not ok or any(t not in per for t in node.inputs):
            continue
        pre = tuple(per[t] for t in node.inputs)
        sharded = any(isinstance(p, int) for p in pre)
        partial = [k for k, p in enumerate(pre) if p == REDUCE]
        sources = [k for k in partial if g[node.inputs[k]].kind in ("placeholder", "get_attr")]
        if not sources:
            out.append(Rule(node.name, pre, post, origin, sharded))
        # first-device-only: the partial operands given whole, added by device 0 alone, where
        # another operand still carries the split (else it is the replicated op made partial).
        for k in partial:
            rest = [p for j, p in enumerate(pre) if j != k]
            if all(p == IDENTITY for p in rest):
                continue
            if any(p == REDUCE for j, p in enumerate(pre) if j != k and j in sources):
                continue
            fixed = tuple(IDENTITY if j == k else p for j, p in enumerate(pre))
            if any(p == REDUCE and j in sources for j, p in enumerate(fixed)):
                continue
            out.append(Rule(node.name, fixed, post, origin + "+first-device-only", sharded, (k,)))
    return out


def _shard_units(node: Node, rules: list[Rule], g: Graph) -> list[Rule]:
    """shard-unit: a view's Gather rule splits its input in whole units of the dims it splits
    the sharded dim into (HAND_RULES)."""
    in_shape = _shape(g, node.inputs[0])
    out = []
    for r in rules:
        if isinstance(r.post, int) and isinstance(r.pre[0], int):
            unit = max(1, in_shape[r.pre[0]] // node.shape[r.post])
            r = Rule(
                r.node,
                r.pre,
                r.post,
                r.name + ("+shard-unit" if unit > 1 else ""),
                r.sharded,
                r.first_device_only,
                r.sfb,
                unit,
                r.shape_pre,
            )
        out.append(r)
    return out


def _broadcast_split(node: Node, g: Graph) -> list[Rule]:
    """broadcast-split (HAND_RULES): expand's dims that come from a length-1 (or missing) input
    dim may be split; the other dims follow the input's layout (DTensor's rules give those)."""
    in_shape = _shape(g, node.inputs[0])
    lead = len(node.shape) - len(in_shape)
    out = []
    for d, n in enumerate(node.shape):
        e = d - lead
        if n > 1 and (e < 0 or in_shape[e] == 1):
            out.append(Rule(node.name, (IDENTITY,), d, "broadcast-split", True))
    return out


def _conv_channels(node: Node, g: Graph) -> list[Rule]:
    """conv-channels (HAND_RULES), for groups == 1: weight split along its output channels ->
    output split along dim 1; input and weight split along the input channels -> partial sums
    (the bias added by the first device)."""
    args = node.fx_node.args
    if (args[6] if len(args) > 6 else 1) != 1 or len(node.inputs) < 2:
        return []
    has_bias = len(node.inputs) > 2
    w = _shape(g, node.inputs[1])
    rules = []
    if w[0] > 1:
        rules.append(Rule(node.name, (IDENTITY, 0) + ((0,) if has_bias else ()), 1, "conv-channels-out", True))
    if w[1] > 1:
        rules.append(
            Rule(
                node.name,
                (1, 1) + ((IDENTITY,) if has_bias else ()),
                REDUCE,
                "conv-channels-in",
                True,
                (2,) if has_bias else (),
            )
        )
    # Linear in its input: partial inputs give partial outputs.
    rules.append(
        Rule(
            node.name,
            (REDUCE, IDENTITY) + ((IDENTITY,) if has_bias else ()),
            REDUCE,
            "conv-partial",
            False,
            (2,) if has_bias else (),
        )
    )
    return rules


def _spatial_split(node: Node, g: Graph) -> list[Rule]:
    """spatial-split (HAND_RULES): a convolution's batch split (its weight and bias whole); a
    pooling's batch and channel splits, and for an average partial sums in, partial sums out."""
    shape = _shape(g, node.inputs[0])
    rest = tuple(IDENTITY for _ in node.inputs[1:])
    dims = (0,) if node.op == "conv2d" else (0, 1)
    rules = [Rule(node.name, (d, *rest), d, "spatial-split", True) for d in dims if len(shape) > d and shape[d] > 1]
    if _SPATIAL[node.op] and len(node.inputs) == 1:
        rules.append(Rule(node.name, (REDUCE,), REDUCE, "spatial-split", False))
    return rules


def _tuple_item(node: Node, g: Graph) -> list[Rule]:
    """tuple-item (HAND_RULES): an item of a tuple output has the tuple's layout."""
    src = g[node.inputs[0]]
    nd = len(node.shape)
    rules = [_replicated(node)] + [
        Rule(node.name, (d,), d, f"tuple-item{d}", True)
        for d in range(nd)
        if node.shape[d] > 1 and d < len(src.tuple_shapes[0])
    ]
    return rules + [Rule(node.name, (REDUCE,), REDUCE, "tuple-item-partial", False)]


def _sfb_rules(node: Node, rules: list[Rule]) -> list[Rule]:
    """sfb (HAND_RULES): a linear whose weight (and bias) is replicated and whose output is split
    along a batch-like dim also runs with the weight gradient rebuilt from gathered factors."""
    nd = len(node.shape)
    out = []
    for r in rules:
        if (
            isinstance(r.post, int)
            and r.post < nd - 1
            and r.pre[0] == r.post
            and all(p == IDENTITY for p in r.pre[1:])
            and not r.first_device_only
        ):
            out.append(Rule(node.name, r.pre, r.post, r.name + "+sfb", True, r.first_device_only, sfb=True))
    return out


def _check_loss_contract(node: Node, g: Graph) -> None:
    """The harness's loss is summed over the batch inside forward: a mean makes shard losses
    that do not add up (the runtime divides the sum by the global number of targets)."""
    if node.op != "cross_entropy" or node.name != g.loss:
        return
    args = node.fx_node.args
    reduction = args[3] if len(args) > 3 else node.fx_node.kwargs.get("reduction", 1)
    if reduction != 2:  # at::Reduction::Sum
        raise NoRuleError(
            f"cross_entropy with reduction={['none', 'mean', 'sum'][reduction]!r} at {node.where}: the loss must be "
            "summed over the batch (reduction='sum'), as the harness divides it by the global number of targets"
        )


def node_rules(node: Node, g: Graph, sfb: bool) -> tuple[list[Rule], str]:
    """The triples of one op node, and where they came from: "dtensor: <how>", "hand",
    "constant" (an op reading no tensor: its value is made whole on every device) or "none"
    (replicated only)."""
    rep = _replicated(node)
    if node.op == "getitem" and g[node.inputs[0]].tuple_shapes is not None:
        return _tuple_item(node, g), "hand"
    if not node.inputs:
        return [rep], "constant"
    derived = dtensor_rules.derive(node.fx_node)
    rules = [rep]
    origin = "none"
    from_dtensor: list[Rule] = []
    if derived is not None:
        triples, how = derived
        from_dtensor = _rules_from_triples(node, triples, "dtensor", g)
        rules += from_dtensor
        origin = f"dtensor: {how}"
    if node.op in _VIEWS and node.shape is not None:
        rules = _shard_units(node, rules, g)
    if node.op == "expand":
        extra = _broadcast_split(node, g)
        rules += extra
        if extra and origin == "none":
            origin = "hand"
    if node.op in _SPATIAL and not from_dtensor:
        rules += _spatial_split(node, g)
        origin = "hand"
    if node.op == "conv2d":
        rules += _conv_channels(node, g)
    if node.op == "batch_norm" and node.shape is not None and node.shape[0] > 1:
        pre = (0,) + tuple(IDENTITY for _ in node.inputs[1:])
        rules.append(Rule(node.name, pre, 0, "local-statistics", True))
    if node.op == "linear" and sfb:
        rules += _sfb_rules(node, rules)
    if origin == "none" and len(rules) > 1:
        origin = "hand"
    return list(dict.fromkeys(rules)), origin


@dataclass
class Theory:
    """All triples of a graph: computation rules per op node and source layouts."""

    graph: Graph
    rules: dict[str, list[Rule]]  # op node name -> its computation triples
    sources: dict[str, list[Layout]]  # placeholder / parameter -> layouts it can be created in
    sfb: bool = True
    grouped: bool = True  # offer grouped-broadcast all-gather / reduce-scatter
    # Tensors the search never communicates (the inside of an MoE router, see routing_region):
    # they are recomputed in whatever layout their producer ran, never re-laid out.
    no_comm: frozenset = frozenset()
    # Only free re-layouts (slice, keep_first): the space of data-parallel programs.
    free_comms_only: bool = False
    # With free_comms_only, also the collectives that make a tensor whole (all-gather,
    # all-reduce): data parallelism that runs replicated the ops no batch shard can run
    # (data_parallel_theory, gathers=True).
    whole_comms: bool = False
    _comm_cache: dict = field(default_factory=dict, repr=False)
    # What methods.hap.search derives from the graph and the rules alone, not from the ratios
    # (the op order, where tensors die, its bound's trees, the segments, each move without its
    # price): once per theory, not once per search.
    search_cache: dict = field(default_factory=dict, repr=False, compare=False)
    # Op nodes with no triple but the replicated one: name -> op (Theory docstring of module).
    uncovered: dict = field(default_factory=dict, repr=False, compare=False)
    # Op node -> where its triples came from (node_rules).
    origins: dict = field(default_factory=dict, repr=False, compare=False)

    def coverage(self) -> dict:
        """Share of the ops that read tensors, and of their forward FLOPs, that have a triple
        besides the replicated one; the ops without (by op name, with their count)."""
        ops = [n for n in self.rules if self.origins.get(n) != "constant"]
        flops = sum(self.graph[n].flops for n in ops)
        missing = [n for n in ops if n in self.uncovered]
        missing_flops = sum(self.graph[n].flops for n in missing)
        by_op: dict[str, int] = {}
        for n in missing:
            by_op[self.graph[n].op] = by_op.get(self.graph[n].op, 0) + 1
        return {
            "ops": len(ops),
            "ops_covered": len(ops) - len(missing),
            "ops_share": (len(ops) - len(missing)) / len(ops) if ops else 1.0,
            "flops_share": 1.0 - missing_flops / flops if flops else 1.0,
            "uncovered_ops": dict(sorted(by_op.items())),
        }

    def comm(self, tensor: str, src: Layout) -> list[CommRule]:
        key = (tensor, src)
        if key not in self._comm_cache:
            rules = comm_rules(self.graph[tensor], src, self.grouped)
            if self.free_comms_only:
                rules = [c for c in rules if c.free or (self.whole_comms and c.dst == IDENTITY)]
            self._comm_cache[key] = rules
        return self._comm_cache[key]


def data_parallel_theory(theory: Theory, gathers: bool = False) -> Theory:
    """The same graph restricted to data parallelism: parameters and buffers replicated,
    inputs split along the batch (dim 0), no SFB, no collective but the free ones; the
    replicated gradients are all-reduced. The incumbent of methods.hap.planner's every search.

    gathers: also the collectives that make a tensor whole (all-gather, all-reduce), so that
    an op no batch shard can run (a sort over every token of the batch, an unfold without a
    rule) runs replicated on the gathered tensor and the rest stays data parallel: the
    incumbent of a model with such an op, which has no data-parallel program otherwise. The
    inside of an MoE router may then be gathered as well (no `no_comm`).
    """
    g = theory.graph
    sources: dict[str, list[Layout]] = {}
    for t in theory.sources:
        node = g[t]
        batch_like = node.kind == "placeholder" and node.shape and node.shape[0] == g.batch_size and node.shape[0] > 1
        sources[t] = [0] if batch_like else [IDENTITY]
    rules = {name: [r for r in rs if not r.sfb] for name, rs in theory.rules.items()}
    # With gathers, a router's tensors may be gathered too: its sort may be the op to run whole.
    no_comm = frozenset() if gathers else theory.no_comm
    return Theory(g, rules, sources, False, theory.grouped, no_comm, free_comms_only=True, whole_comms=gathers)


def tensor_parallel_theory(theory: Theory) -> Theory:
    """The same graph restricted to tensor (Megatron-style) parallelism: every device sees the
    whole batch and every weight matrix is sharded.

    Inputs are created Identity only, and no tensor is ever split along a dim that comes from
    the batch (dim 0 of the inputs, followed through the rules: a Gather of a batch dim of an
    input that a rule carries to a Gather of the output makes that output dim a batch dim too);
    rules that would split one are dropped. Parameters with two or more dims longer than 1
    (linear and embedding weights) must be created sharded; vectors (biases, LayerNorm) may stay
    replicated. No SFB. The search still chooses how each matrix is split (rows or columns,
    heads) and how activations move between them (all-gather, reduce-scatter, all-reduce; the
    sequence dim may be split, as in Megatron's sequence parallelism). Collectives are those of
    `theory` (padded only if it was derived with grouped=False)."""
    g = theory.graph
    batch: dict[str, set[int]] = {}
    for t in theory.sources:
        node = g[t]
        if node.kind == "placeholder" and node.shape and node.shape[0] == g.batch_size:
            batch[t] = {0}
    for node in g.nodes:  # topological order: inputs are marked before their readers
        for r in theory.rules.get(node.name, ()):
            needs = list(zip(node.inputs, r.pre)) + list(r.shape_pre)
            if isinstance(r.post, int) and any(isinstance(lay, int) and lay in batch.get(t, ()) for t, lay in needs):
                batch.setdefault(node.name, set()).add(r.post)

    def splits_batch(t: str, layout: Layout) -> bool:
        return isinstance(layout, int) and layout in batch.get(t, ())

    rules = {}
    for name, rs in theory.rules.items():
        inputs = g[name].inputs
        rules[name] = [
            r
            for r in rs
            if not r.sfb
            and not splits_batch(name, r.post)
            and not any(splits_batch(t, lay) for t, lay in list(zip(inputs, r.pre)) + list(r.shape_pre))
        ]
    sources: dict[str, list[Layout]] = {}
    for t, layouts in theory.sources.items():
        node = g[t]
        if node.kind == "placeholder":
            sources[t] = [IDENTITY]
        elif node.is_param and sum(1 for n in node.shape if n > 1) >= 2:
            sources[t] = [lay for lay in layouts if lay != IDENTITY]
        else:
            sources[t] = list(layouts)
    return Theory(g, rules, sources, False, theory.grouped, theory.no_comm)


# Ops that end an MoE routing region: contractions consume dispatch / combine tensors.
_CONTRACTIONS = ("linear", "matmul", "bmm", "einsum", "conv2d", "embedding", "cross_entropy")


def routing_region(graph: Graph, outside: frozenset[str] = frozenset()) -> tuple[set[str], set[str]]:
    """The MoE routers of `graph`: (nodes inside, exit tensors).

    A router is what a `topk` over gate scores feeds through non-contraction ops: one-hot,
    cumsum, comparisons, masks, up to the dispatch / combine tensors that einsums read (the
    exits). Its tensors are many and cheap; laying each out separately multiplies A*'s states
    (every live tensor x every layout) without changing the cost, so the search keeps the
    inside of a router in one layout family: no collective on a tensor whose consumers are
    all inside (the exits may still be re-laid out, e.g. all-to-all to expert parallel).
    `outside`: ops the region stops at as at a contraction (those without a rule of their own:
    they run replicated, so what they read must be gathered first).
    """
    inside: set[str] = set()
    stack = [n.name for n in graph.nodes if n.op == "topk"]
    while stack:
        name = stack.pop()
        if name in inside:
            continue
        inside.add(name)
        for u in graph.users[name]:
            node = graph[u]
            if node.kind in ("call_function", "call_method") and node.op not in _CONTRACTIONS and u not in outside:
                stack.append(u)
    exits = {t for t in inside if any(u not in inside for u in graph.users[t])}
    return inside, exits


def derive_theory(graph: Graph, sfb: bool = True, grouped: bool = True, fuse_routing: bool = True) -> Theory:
    """The triples of every node of `graph` (node_rules): DTensor's, HAP's own, or, for an op
    with neither, the replicated one alone (named in `Theory.uncovered`, never an error).

    Args:
        fuse_routing: keep MoE routers in one layout family (see routing_region).

    Raises:
        NoRuleError: the loss is not summed over the batch (the harness's contract).
    """
    rules: dict[str, list[Rule]] = {}
    sources: dict[str, list[Layout]] = {}
    uncovered: dict[str, str] = {}
    origins: dict[str, str] = {}
    for n in graph.nodes:
        if n.kind in ("placeholder", "get_attr"):
            if n.shape is None:
                continue
            # Sources are created directly in any layout (Placeholder-Shard / Parameter-Shard):
            # never communicated. Length-1 dims are never split.
            sources[n.name] = [IDENTITY] + [d for d, s in enumerate(n.shape) if s > 1]
        elif n.kind in ("call_function", "call_method"):
            if not n.is_tensor:
                continue
            _check_loss_contract(n, graph)
            node_rules_, origin = node_rules(n, graph, sfb)
            for r in node_rules_:
                assert len(r.pre) == len(n.inputs), (
                    f"rule {r.name} of {n.name}: {len(r.pre)} pre for {len(n.inputs)} inputs"
                )
            rules[n.name] = node_rules_
            origins[n.name] = origin
            if origin == "none":
                uncovered[n.name] = n.op
    no_comm: frozenset = frozenset()
    if fuse_routing:
        inside, exits = routing_region(graph, frozenset(uncovered))
        no_comm = frozenset(inside - exits)
    dtensor_rules.save_derivations()
    return Theory(graph, rules, sources, sfb, grouped, no_comm, uncovered=uncovered, origins=origins)


def non_tensor_ops(graph: Graph) -> list[str]:
    return [n.name for n in graph.nodes if n.kind in ("call_function", "call_method") and not n.is_tensor]


def is_view(node: Node) -> bool:
    return node.op in VIEW_OPS


def sharded_numel(node: Node) -> float:
    return float(math.prod(node.shape)) if node.shape is not None else float(node.numel)


# Ops that make a tensor of a size given in their args, like their input (x.new_zeros(size)).
_NEW_FACTORIES = ("new_zeros", "new_ones", "new_empty", "new_full")


def local_size_args(node: Node, rule: Rule, args: tuple, local_shape: Sequence[int] | None = None) -> tuple:
    """The positional args of `node` as a device runs it under `rule`: a size argument at a
    sharded output dim becomes -1 (inferred from the local shard), the others the global sizes,
    so the same op runs on every device whatever its shard length. A dim that the op makes
    from nothing (expand's broadcast-split) needs the device's own length: `local_shape`, the
    local output shape (codegen knows it). Codegen and the numeric tests both use it."""
    if local_shape is not None and node.op in ("view", "reshape", "expand", "unflatten"):
        return explicit_size_args(node, tuple(local_shape), args)
    if node.op in _NEW_FACTORIES and isinstance(rule.post, int):
        # split only where the size is its input's (DTensor's new_factory_strategy): the local input's
        return (args[0], list(local_shape if local_shape is not None else args[0].shape), *args[2:])
    if not isinstance(rule.post, int) or node.op not in ("view", "reshape", "unflatten", "expand"):
        return args
    args = list(args)
    if node.op == "unflatten":
        dim = _norm(int(args[1]), len(node.shape) - len(args[2]) + 1)
        sizes = list(args[2])
        k = rule.post - dim
        if 0 <= k < len(sizes):
            sizes[k] = -1
        args[2] = list(sizes)
        return tuple(args)
    sizes = list(node.shape)  # the global output shape: every -1 of the original resolved
    if rule.post < len(sizes):
        sizes[rule.post] = -1
    return (args[0], sizes, *args[2:])


def explicit_size_args(node: Node, out_shape: tuple, args: tuple) -> tuple:
    """The positional args of a view, reshape, expand, unflatten or new-tensor op (new_zeros,
    ...) with every size given as this device's local output shape (a machine-level plan
    splits two dims: the machine's and, inside the machine, the batch dim, which one -1
    cannot both express)."""
    if node.op in _NEW_FACTORIES:
        return (args[0], list(out_shape), *args[2:])
    if node.op in ("view", "reshape", "expand"):
        if len(args) > 1 and isinstance(args[1], torch.dtype):
            return args  # x.view(dtype)
        return (args[0], list(out_shape), *args[2:])
    if node.op == "unflatten":
        sizes = list(args[2])
        dim = int(args[1]) % (len(out_shape) - len(sizes) + 1)
        return (args[0], args[1], list(out_shape[dim : dim + len(sizes)]), *args[3:])
    return args
