"""The background theory of HAP (Sec. 4.2): Hoare triples over per-tensor sharding properties.

For every node of the reference graph, per-op rules list the ways the op can run SPMD:
{pre-condition: a layout per input} op {post-condition: a layout of the output}. Communication
triples turn one layout of a tensor into another. This module says what is *valid*; what it
costs is methods.hap.search's business, and nothing here runs on real devices.

Layouts of a tensor t across the devices:
    "I"    Identity: every device holds all of t.
    "R"    Reduce:   every device holds a full-shape partial; their sum is t.
    d:int  Gather(d): device i holds slice i of t along dim d; concatenated they are t.
A dim of length 1 is never sharded. Adding a rule: write a function (node, graph) -> list of
Rule and register it in RULES under the op's canonical name (methods.capture.op_name).
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.core.errors import PlanningError
from methods.capture import VIEW_OPS, Graph, Node

Layout = str | int
IDENTITY: Layout = "I"
REDUCE: Layout = "R"


class NoRuleError(PlanningError):
    """An op of the model has no sharding rule."""


def layout_name(layout: Layout) -> str:
    return {"I": "Identity", "R": "Reduce"}.get(layout, f"Gather({layout})") if isinstance(layout, str) else f"Gather({layout})"


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


def _pointwise(node: Node, g: Graph, linear: str = "") -> list[Rule]:
    """Element-wise op with broadcasting. linear: "" (not linear), "add" (sum of operands:
    all Reduce, or Reduce + Identity added on the first device), "mul" (one Reduce factor, the
    others Identity), "unary" (one input, Reduce passes through)."""
    out_shape = node.shape
    shapes = [_shape(g, i) for i in node.inputs]
    rules = [_replicated(node)]
    if out_shape is None:
        return rules
    nd = len(out_shape)
    for d in range(nd):
        if out_shape[d] <= 1:
            continue
        pre = []
        for s in shapes:
            e = d - (nd - len(s))
            pre.append(e if e >= 0 and s[e] > 1 else IDENTITY)
        rules.append(Rule(node.name, tuple(pre), d, f"split{d}", True))
    k = len(shapes)
    # A scalar constant in a sum would be added once per device: no Reduce through it.
    scalars = any(isinstance(a, (int, float)) and not isinstance(a, bool) for a in node.fx_node.args)
    if linear == "add" and scalars:
        return rules
    if linear in ("unary", "add") and k >= 1:
        rules.append(Rule(node.name, tuple(REDUCE for _ in shapes), REDUCE, "partial", False))
    if linear == "add" and k == 2:
        for r in range(2):
            pre = tuple(REDUCE if i == r else IDENTITY for i in range(2))
            rules.append(Rule(node.name, pre, REDUCE, f"partial+first{1 - r}", False, (1 - r,)))
    if linear in ("mul", "div"):
        for r in range(k if linear == "mul" else 1):
            pre = tuple(REDUCE if i == r else IDENTITY for i in range(k))
            rules.append(Rule(node.name, pre, REDUCE, "partial", False))
    return rules


def _pointwise_rule(linear: str = "") -> Callable[[Node, Graph], list[Rule]]:
    return lambda node, g: _pointwise(node, g, linear)


def _keep_dims(node: Node, g: Graph, fixed: Sequence[int], reduce_to_partial: Sequence[int] = (), map_dim=None) -> list[Rule]:
    """Single-tensor-input op that works independently along every dim except `fixed`.
    Dims in `reduce_to_partial` are summed over: sharding them gives a Reduce output."""
    shape = _shape(g, node.inputs[0])
    others = tuple(IDENTITY for _ in node.inputs[1:])
    rules = [_replicated(node)]
    for d in range(len(shape)):
        if not _splittable(shape, d):
            continue
        if d in reduce_to_partial:
            rules.append(Rule(node.name, (d,) + others, REDUCE, f"sum-split{d}", True))
        elif d not in fixed:
            out = map_dim(d) if map_dim else d
            if out is not None:
                rules.append(Rule(node.name, (d,) + others, out, f"split{d}", True))
    return rules


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


# -- rules per op ----------------------------------------------------------------------------------


def _rule_reshape(node: Node, g: Graph) -> list[Rule]:
    in_shape = _shape(g, node.inputs[0])
    mapping = _dim_map(in_shape, node.shape)
    rules = _keep_dims(node, g, fixed=[d for d in range(len(in_shape)) if d not in mapping], map_dim=mapping.get)
    rules = [
        Rule(r.node, r.pre, r.post, r.name, r.sharded, unit=max(1, in_shape[r.pre[0]] // node.shape[r.post]))
        if isinstance(r.post, int) else r
        for r in rules
    ]
    rules.append(Rule(node.name, (REDUCE,) + tuple(IDENTITY for _ in node.inputs[1:]), REDUCE, "partial", False))
    return rules


def _rule_transpose(node: Node, g: Graph) -> list[Rule]:
    nd = len(_shape(g, node.inputs[0]))
    if node.op == "permute":
        dims = node.fx_node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = dims[0]
        perm = [_norm(int(d), nd) for d in dims]
    elif node.op == "t":
        perm = list(range(nd))[::-1]
    else:
        a, b = (_norm(int(x), nd) for x in node.fx_node.args[1:3])
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
    inverse = {src: dst for dst, src in enumerate(perm)}
    rules = _keep_dims(node, g, fixed=[], map_dim=inverse.get)
    rules.append(Rule(node.name, (REDUCE,), REDUCE, "partial", False))
    return rules


def _size_sources(node: Node, g: Graph) -> dict[int, tuple[str, int]]:
    """expand(...) sizes read from another tensor's shape: output dim -> (tensor, its dim)."""
    out = {}
    for pos, a in enumerate(node.fx_node.args[1:]):
        src = a
        if hasattr(src, "op") and src.op == "call_function" and len(src.args) == 2 and hasattr(src.args[0], "op"):
            holder, index = src.args
            if holder.op == "call_function" and len(holder.args) == 2 and holder.args[1] == "shape":
                out[pos] = (holder.args[0].name, int(index))
        elif hasattr(src, "op") and src.op == "call_method" and src.target == "size" and len(src.args) == 2:
            out[pos] = (src.args[0].name, int(src.args[1]))
    return out


def _rule_expand(node: Node, g: Graph) -> list[Rule]:
    in_shape = _shape(g, node.inputs[0])
    out_shape = node.shape
    lead = len(out_shape) - len(in_shape)
    sources = _size_sources(node, g)
    # Sizes read from other tensors are full-size only if those tensors are Identity.
    full = tuple((t, IDENTITY) for t, _ in dict.fromkeys(sources.values()))
    rules = [Rule(node.name, (IDENTITY,), IDENTITY, "replicated", False, shape_pre=full)]
    for d in range(len(out_shape)):
        if out_shape[d] <= 1:
            continue
        e = d - lead
        if e >= 0 and in_shape[e] == out_shape[d] and d not in sources:
            rules.append(Rule(node.name, (e,), d, f"split{d}", True, shape_pre=full))
        elif d in sources:
            # Broadcast dim sized by another tensor's dim: the local size follows that shard.
            src, sd = sources[d]
            shape_pre = tuple((t, sd if t == src else IDENTITY) for t, _ in full)
            pre = (e,) if e >= 0 and in_shape[e] == out_shape[d] else (IDENTITY,)
            rules.append(Rule(node.name, pre, d, f"expand-split{d}", True, shape_pre=shape_pre))
    return rules


def _rule_unsqueeze(node: Node, g: Graph) -> list[Rule]:
    nd_out = len(node.shape)
    u = _norm(int(_arg(node, 1, "dim")), nd_out)
    rules = _keep_dims(node, g, fixed=[], map_dim=lambda d: d if d < u else d + 1)
    rules.append(Rule(node.name, (REDUCE,), REDUCE, "partial", False))
    return rules


def _rule_getitem(node: Node, g: Graph) -> list[Rule]:
    src = g[node.inputs[0]]
    if src.tuple_shapes is not None:  # element of a multi-output op: layout passes through
        nd = len(src.tuple_shapes[0])
        rules = [_replicated(node)] + [
            Rule(node.name, (d,), d, f"split{d}", True) for d in range(nd) if node.shape[d] > 1
        ]
        return rules + [Rule(node.name, (REDUCE,), REDUCE, "partial", False)]
    index = node.fx_node.args[1]
    index = index if isinstance(index, tuple) else (index,)
    in_shape = src.shape
    n_real = sum(1 for x in index if x is not None and x is not Ellipsis)
    mapping: dict[int, int] = {}
    i = j = 0
    for x in index:
        if x is Ellipsis:
            for _ in range(len(in_shape) - n_real):
                mapping[i] = j
                i += 1
                j += 1
        elif x is None:
            j += 1
        elif isinstance(x, slice):
            if x == slice(None):
                mapping[i] = j
            i += 1
            j += 1
        elif isinstance(x, int):
            i += 1
        else:
            raise NoRuleError(
                f"no sharding rule for getitem index {x!r} at {node.where}; only ints, ':', '...' "
                "and None; add one in methods/hap/theory.py (_rule_getitem)"
            )
    while i < len(in_shape):
        mapping[i] = j
        i += 1
        j += 1
    rules = _keep_dims(node, g, fixed=[d for d in range(len(in_shape)) if d not in mapping], map_dim=mapping.get)
    return rules + [Rule(node.name, (REDUCE,), REDUCE, "partial", False)]


def _rule_sum(node: Node, g: Graph) -> list[Rule]:
    shape = _shape(g, node.inputs[0])
    dim = _arg(node, 1, "dim")
    keepdim = bool(_arg(node, 2, "keepdim", False))
    if dim is None:
        rules = [_replicated(node)] + [Rule(node.name, (d,), REDUCE, f"sum-split{d}", True) for d in range(len(shape)) if shape[d] > 1]
        return rules + [Rule(node.name, (REDUCE,), REDUCE, "partial", False)]
    dims = {_norm(int(d), len(shape)) for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}

    def after(d: int) -> int:
        return d if keepdim else d - sum(1 for r in dims if r < d)

    rules = _keep_dims(node, g, fixed=[], reduce_to_partial=sorted(dims) if node.op == "sum" else (), map_dim=after)
    if node.op == "mean":
        rules = [r for r in rules if r.post != REDUCE or not r.sharded]
        rules = [r for r in rules if not (isinstance(r.pre[0], int) and r.pre[0] in dims)]
    return rules + [Rule(node.name, (REDUCE,), REDUCE, "partial", False)]


def _rule_along_dim(key: str, index: int, default: int | None = None) -> Callable[[Node, Graph], list[Rule]]:
    """Ops that mix values along one dim (softmax, cumsum, topk): every other dim splits."""

    def rule(node: Node, g: Graph) -> list[Rule]:
        nd = len(_shape(g, node.inputs[0]))
        dim = _arg(node, index, key, default)
        return _keep_dims(node, g, fixed=[_norm(int(dim), nd)])

    return rule


def _rule_one_hot(node: Node, g: Graph) -> list[Rule]:
    return _keep_dims(node, g, fixed=[])


def _rule_layer_norm(node: Node, g: Graph) -> list[Rule]:
    shape = _shape(g, node.inputs[0])
    normalized = _arg(node, 1, "normalized_shape")
    k = len(normalized)
    # Weight and bias (if present) stay Identity: their gradients are all-reduced.
    return _keep_dims(node, g, fixed=list(range(len(shape) - k, len(shape))))


def _rule_pool(node: Node, g: Graph) -> list[Rule]:
    rules = _keep_dims(node, g, fixed=[2, 3])
    if node.op in ("avg_pool2d", "adaptive_avg_pool2d"):
        rules.append(Rule(node.name, (REDUCE,), REDUCE, "partial", False))
    return rules


def _einsum_rules(node: Node, specs: Sequence[str], out_spec: str, shapes: Sequence[Sequence[int]], first_only: Sequence[int] = ()) -> list[Rule]:
    """A multilinear contraction: split any index (output index -> Gather, contracted -> Reduce);
    one Reduce operand with the rest Identity -> Reduce."""
    sizes: dict[str, int] = {}
    for spec, s in zip(specs, shapes):
        for ch, n in zip(spec, s):
            sizes[ch] = max(sizes.get(ch, 1), n)
    k = len(specs)
    rules = [Rule(node.name, tuple(IDENTITY for _ in range(k)), IDENTITY, "replicated", False)]
    for ch, n in sizes.items():
        if n <= 1:
            continue
        pre = []
        for spec, s in zip(specs, shapes):
            p = spec.find(ch)
            pre.append(p if p >= 0 and s[p] > 1 else IDENTITY)
        if ch in out_spec:
            rules.append(Rule(node.name, tuple(pre), out_spec.index(ch), f"split-{ch}", True))
        else:
            rules.append(Rule(node.name, tuple(pre), REDUCE, f"reduce-{ch}", True, tuple(first_only)))
    for r in range(k):
        if r in first_only:
            continue
        pre = tuple(REDUCE if i == r else IDENTITY for i in range(k))
        rules.append(Rule(node.name, pre, REDUCE, "partial", False, tuple(first_only)))
    return rules


def _rule_einsum(node: Node, g: Graph) -> list[Rule]:
    eq = node.fx_node.args[0].replace(" ", "")
    if "..." in eq or "->" not in eq:
        raise NoRuleError(f"einsum {eq!r} at {node.where}: write the equation with explicit indices and '->'")
    lhs, out_spec = eq.split("->")
    specs = lhs.split(",")
    return _einsum_rules(node, specs, out_spec, [_shape(g, i) for i in node.inputs])


def _rule_matmul(node: Node, g: Graph) -> list[Rule]:
    a, b = (_shape(g, i) for i in node.inputs)
    letters = iter(string.ascii_lowercase)
    nd = max(len(a), len(b), 2)
    batch = [next(letters) for _ in range(nd - 2)]
    m, k, n = next(letters), next(letters), next(letters)
    sa = "".join(batch[len(batch) - (len(a) - 2):]) + m + k if len(a) >= 2 else k
    sb = "".join(batch[len(batch) - (len(b) - 2):]) + k + n if len(b) >= 2 else k
    out = "".join(batch) + (m if len(a) >= 2 else "") + (n if len(b) >= 2 else "")
    return _einsum_rules(node, [sa, sb], out, [a, b])


def _rule_linear(node: Node, g: Graph, sfb: bool) -> list[Rule]:
    x = _shape(g, node.inputs[0])
    letters = string.ascii_lowercase[: len(x) - 1]
    specs = [letters + "k", "nk"] + (["n"] if len(node.inputs) > 2 else [])
    shapes = [_shape(g, i) for i in node.inputs]
    # y = x W^T + b is x W^T (multilinear) plus b: the bias joins any Gather of n, and only the
    # first device adds it to Reduce partials.
    has_bias = len(node.inputs) > 2
    rules = _einsum_rules(node, specs[:2], letters + "n", shapes[:2])
    out = []
    for r in rules:
        if not has_bias:
            out.append(r)
            continue
        if r.post == REDUCE:
            if r.pre[1] == REDUCE:
                continue  # a Reduce weight is not a trainable layout
            out.append(Rule(node.name, r.pre + (IDENTITY,), REDUCE, r.name, r.sharded, (2,)))
        elif r.post == len(x) - 1:
            out.append(Rule(node.name, r.pre + (0,), r.post, r.name, r.sharded))
        else:
            out.append(Rule(node.name, r.pre + (IDENTITY,), r.post, r.name, r.sharded))
    out = [r for r in out if r.pre[1] != REDUCE]
    if sfb:
        for r in list(out):
            if isinstance(r.post, int) and r.post < len(x) - 1 and r.pre[1] == IDENTITY:
                out.append(Rule(node.name, r.pre, r.post, r.name + "-sfb", True, r.first_device_only, sfb=True))
    return out


def _rule_conv2d(node: Node, g: Graph) -> list[Rule]:
    groups = _arg(node, 6, "groups", 1)
    if groups != 1:
        raise NoRuleError(f"conv2d with groups={groups} at {node.where}: only groups=1 has rules (methods/hap/theory.py _rule_conv2d)")
    has_bias = len(node.inputs) > 2
    b = (IDENTITY,) if has_bias else ()
    rules = [_replicated(node)]
    x = _shape(g, node.inputs[0])
    w = _shape(g, node.inputs[1])
    if x[0] > 1:
        rules.append(Rule(node.name, (0, IDENTITY) + b, 0, "split-batch", True))
    if w[0] > 1:
        rules.append(Rule(node.name, (IDENTITY, 0) + ((0,) if has_bias else ()), 1, "split-out-channel", True))
    if w[1] > 1:
        rules.append(Rule(node.name, (1, 1) + b, REDUCE, "reduce-in-channel", True, (2,) if has_bias else ()))
    rules.append(Rule(node.name, (REDUCE, IDENTITY) + b, REDUCE, "partial", False, (2,) if has_bias else ()))
    return rules


def _rule_embedding(node: Node, g: Graph) -> list[Rule]:
    idx = _shape(g, node.inputs[0])
    w = _shape(g, node.inputs[1])
    rules = [_replicated(node)]
    rules += [Rule(node.name, (d, IDENTITY), d, f"split{d}", True) for d in range(len(idx)) if idx[d] > 1]
    if w[1] > 1:
        rules.append(Rule(node.name, (IDENTITY, 1), len(idx), "split-embedding-dim", True))
    return rules


def _rule_cat(node: Node, g: Graph) -> list[Rule]:
    shapes = [_shape(g, i) for i in node.inputs]
    nd = len(node.shape)
    dim = _norm(int(_arg(node, 1, "dim", 0)), nd)
    rules = [_replicated(node), Rule(node.name, tuple(REDUCE for _ in shapes), REDUCE, "partial", False)]
    for d in range(nd):
        if d != dim and node.shape[d] > 1:
            rules.append(Rule(node.name, tuple(d for _ in shapes), d, f"split{d}", True))
    return rules


def _rule_cross_entropy(node: Node, g: Graph) -> list[Rule]:
    reduction = _arg(node, 7, "reduction", "mean")
    if reduction != "sum":
        raise NoRuleError(
            f"cross_entropy with reduction={reduction!r} at {node.where}: the planner needs "
            "reduction='sum' (shard losses add up); see methods/hap/theory.py _rule_cross_entropy"
        )
    logits, _target = (_shape(g, i) for i in node.inputs[:2])
    rules = [_replicated(node)]
    if logits[0] > 1:
        rules.append(Rule(node.name, (0, 0) + tuple(IDENTITY for _ in node.inputs[2:]), REDUCE, "split-batch", True))
    for k in range(2, len(logits)):  # (N, C, d1, ...) against (N, d1, ...)
        if logits[k] > 1:
            rules.append(Rule(node.name, (k, k - 1), REDUCE, f"split{k}", True))
    return rules


def _rule_meta(node: Node, g: Graph) -> list[Rule]:
    return []


_UNARY_LINEAR = ("neg", "to", "type", "float", "contiguous", "detach", "clone")
_UNARY = ("relu", "gelu", "tanh", "sigmoid", "exp", "dropout", "silu", "log", "sqrt", "rsqrt")
_COMPARE = ("lt", "gt", "le", "ge", "eq", "ne", "mod", "floordiv")

RULES: dict[str, Callable[[Node, Graph], list[Rule]]] = {
    **{op: _pointwise_rule("unary") for op in _UNARY_LINEAR},
    **{op: _pointwise_rule() for op in _UNARY + _COMPARE},
    "add": _pointwise_rule("add"),
    "sub": _pointwise_rule("add"),
    "mul": _pointwise_rule("mul"),
    "truediv": _pointwise_rule("div"),
    "div": _pointwise_rule("div"),
    "matmul": _rule_matmul,
    "bmm": _rule_matmul,
    "einsum": _rule_einsum,
    "conv2d": _rule_conv2d,
    "max_pool2d": _rule_pool,
    "avg_pool2d": _rule_pool,
    "adaptive_avg_pool2d": _rule_pool,
    "layer_norm": _rule_layer_norm,
    "softmax": _rule_along_dim("dim", 1),
    "log_softmax": _rule_along_dim("dim", 1),
    "cumsum": _rule_along_dim("dim", 1),
    "topk": _rule_along_dim("dim", 2, -1),
    "one_hot": _rule_one_hot,
    "sum": _rule_sum,
    "mean": _rule_sum,
    "embedding": _rule_embedding,
    "cross_entropy": _rule_cross_entropy,
    "cat": _rule_cat,
    "view": _rule_reshape,
    "reshape": _rule_reshape,
    "flatten": _rule_reshape,
    "unflatten": _rule_reshape,
    "squeeze": _rule_reshape,
    "transpose": _rule_transpose,
    "permute": _rule_transpose,
    "t": _rule_transpose,
    "unsqueeze": _rule_unsqueeze,
    "expand": _rule_expand,
    "getitem": _rule_getitem,
    "getattr": _rule_meta,
    "size": _rule_meta,
}


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
    _comm_cache: dict = field(default_factory=dict, repr=False)
    # What methods.hap.search derives from the graph and the rules alone, not from the ratios
    # (the op order, where tensors die, its bound's trees, the segments, each move without its
    # price): once per theory, not once per search.
    search_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def comm(self, tensor: str, src: Layout) -> list[CommRule]:
        key = (tensor, src)
        if key not in self._comm_cache:
            rules = comm_rules(self.graph[tensor], src, self.grouped)
            self._comm_cache[key] = [c for c in rules if c.free] if self.free_comms_only else rules
        return self._comm_cache[key]


def data_parallel_theory(theory: Theory) -> Theory:
    """The same graph restricted to data parallelism: parameters and buffers replicated,
    inputs split along the batch (dim 0), no SFB, no collective but the free ones; the
    replicated gradients are all-reduced. The incumbent of methods.hap.planner's every search."""
    g = theory.graph
    sources: dict[str, list[Layout]] = {}
    for t in theory.sources:
        node = g[t]
        batch_like = node.kind == "placeholder" and node.shape and node.shape[0] == g.batch_size and node.shape[0] > 1
        sources[t] = [0] if batch_like else [IDENTITY]
    rules = {name: [r for r in rs if not r.sfb] for name, rs in theory.rules.items()}
    return Theory(g, rules, sources, False, theory.grouped, theory.no_comm, free_comms_only=True)


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
            r for r in rs
            if not r.sfb and not splits_batch(name, r.post)
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


def routing_region(graph: Graph) -> tuple[set[str], set[str]]:
    """The MoE routers of `graph`: (nodes inside, exit tensors).

    A router is what a `topk` over gate scores feeds through non-contraction ops: one-hot,
    cumsum, comparisons, masks, up to the dispatch / combine tensors that einsums read (the
    exits). Its tensors are many and cheap; laying each out separately multiplies A*'s states
    (every live tensor x every layout) without changing the cost, so the search keeps the
    inside of a router in one layout family: no collective on a tensor whose consumers are
    all inside (the exits may still be re-laid out, e.g. all-to-all to expert parallel).
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
            if node.kind in ("call_function", "call_method") and node.op not in _CONTRACTIONS:
                stack.append(u)
    exits = {t for t in inside if any(u not in inside for u in graph.users[t])}
    return inside, exits


def derive_theory(graph: Graph, sfb: bool = True, grouped: bool = True, fuse_routing: bool = True) -> Theory:
    """Apply the per-op rules to every node of `graph`.

    Args:
        fuse_routing: keep MoE routers in one layout family (see routing_region).

    Raises:
        NoRuleError: an op has no rule (the message names the op, the fx node and where
            rules are added).
    """
    rules: dict[str, list[Rule]] = {}
    sources: dict[str, list[Layout]] = {}
    for n in graph.nodes:
        if n.kind in ("placeholder", "get_attr"):
            if n.shape is None:
                continue
            # Sources are created directly in any layout (Placeholder-Shard / Parameter-Shard):
            # never communicated. Length-1 dims are never split.
            sources[n.name] = [IDENTITY] + [d for d, s in enumerate(n.shape) if s > 1]
        elif n.kind in ("call_function", "call_method"):
            fn = RULES.get(n.op)
            if fn is None:
                raise NoRuleError(
                    f"no sharding rule for op {n.op!r} at {n.where}; add a rule function to "
                    f"RULES in methods/hap/theory.py (known ops: {', '.join(sorted(RULES))})"
                )
            if not n.is_tensor:
                continue
            node_rules = _rule_linear(n, graph, sfb) if n.op == "linear" else fn(n, graph)
            for r in node_rules:
                assert len(r.pre) == len(n.inputs), f"rule {r.name} of {n.name}: {len(r.pre)} pre for {len(n.inputs)} inputs"
            rules[n.name] = list(dict.fromkeys(node_rules))
    no_comm: frozenset = frozenset()
    if fuse_routing:
        inside, exits = routing_region(graph)
        no_comm = frozenset(inside - exits)
    return Theory(graph, rules, sources, sfb, grouped, no_comm)


RULES["linear"] = lambda node, g: _rule_linear(node, g, False)


def non_tensor_ops(graph: Graph) -> list[str]:
    return [n.name for n in graph.nodes if n.kind in ("call_function", "call_method") and not n.is_tensor]


def is_view(node: Node) -> bool:
    return node.op in VIEW_OPS


def sharded_numel(node: Node) -> float:
    return float(math.prod(node.shape)) if node.shape is not None else float(node.numel)


def local_size_args(node: Node, rule: Rule, args: tuple) -> tuple:
    """The positional args of `node` as a device runs it under `rule`: a size argument at a
    sharded output dim becomes -1 (inferred from the local shard), so the same op runs on
    every device whatever its shard length. Codegen and the numeric tests both use it."""
    if not isinstance(rule.post, int) or node.op not in ("view", "reshape", "unflatten", "expand"):
        return args
    args = list(args)
    if node.op == "unflatten":
        dim = _norm(int(args[1]), len(node.shape) - len(args[2]) + 1)
        sizes = list(args[2])
        k = rule.post - dim
        if 0 <= k < len(sizes):
            sizes[k] = -1
        args[2] = tuple(sizes)
        return tuple(args)
    if node.op == "expand" and rule.name.startswith("expand-split"):
        return tuple(args)  # the size is read from the sharded tensor's local shape
    sizes = args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = list(sizes[0])
    else:
        sizes = list(sizes)
    if rule.post < len(sizes) and isinstance(sizes[rule.post], int):
        sizes[rule.post] = -1
    return (args[0], *sizes)
