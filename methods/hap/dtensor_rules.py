"""Sharding triples of ATen ops read from the strategies DTensor registers for them.

torch.distributed.tensor knows, per ATen op, which placements of the inputs (Replicate,
Shard(dim), Partial(sum)) let the op run on local shards and what placement the output then
has. On a one-dimensional mesh that is exactly a Hoare triple of HAP's theory (Identity,
Gather(dim), Reduce). `derive` asks DTensor the way its own dispatcher would, without a process
group: an op's single-dimension strategy when it has one, else its strategy function given every
candidate placement of every input, else the strategies DTensor derives by tracing the op's
decomposition (CompositeImplicitAutograd ops such as linear, layer_norm, conv2d, matmul,
cross_entropy; a plain two-operand einsum's, and a matmul's without broadcasting, are read
from their letters, tracing only the few placements the letters do not decide). Attention
(scaled_dot_product_attention), whose CPU kernel has no strategy, is asked as DTensor's
fused-attention ops. It says nothing about cost, and nothing about HAP's
uneven shard lengths (methods.hap.theory adds what those need).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import sys
from typing import Any

import torch
from torch import fx

from bench.core.kept_json import KeptJson

log = logging.getLogger(__name__)

Layout = str | int
aten = torch.ops.aten

# At most this many input placement combinations are tried for one op (an op with many
# tensor inputs, a long cat, keeps combinations with few sharded inputs).
_MAX_COMBOS = 2048


@functools.cache
def _dtensor():
    """DTensor's propagator, spec types and a one-device mesh without a process group (as
    DTensor's own decomposition tracing uses: a size-1 mesh makes every length divisible)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo, TupleStrategy
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    mesh = DeviceMesh("cpu", [0], _init_backend=False, _rank=0)
    prop = DTensor._op_dispatcher.sharding_propagator
    return dict(
        prop=prop,
        # DTensor's strategies read through an op's decomposition, the propagator's own object
        # from torch 2.12; None before it (the decomposition is then traced here: _decomposition)
        decomp=getattr(prop, "decomp_strategy", None),
        mesh=mesh,
        DTensorSpec=DTensorSpec,
        TensorMeta=TensorMeta,
        OpSchema=OpSchema,
        OpSpec=OpSpec,
        OpStrategy=OpStrategy,
        TupleStrategy=TupleStrategy,
        RuntimeSchemaInfo=RuntimeSchemaInfo,
        Partial=Partial,
        Replicate=Replicate,
        Shard=Shard,
    )


def _decomposition(op):
    """The op's decomposition where torch registers one, else its CompositeImplicitAutograd
    kernel; None if it has neither."""
    from torch._decomp import decomposition_table

    if op in decomposition_table:
        return decomposition_table[op]
    return op.decompose if op._can_decompose() else None


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor arguments in argument order (repeats kept: mul(x, x) has two)."""
    out: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: out.append(a) if _is_tensor(a) else None)
    return out


def _is_tensor(a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _is_source(a: fx.Node) -> bool:
    return a.op in ("placeholder", "get_attr")


def derive(node: fx.Node) -> tuple[list[tuple[tuple[Layout, ...], Layout]], str] | None:
    """(triples, how DTensor was asked) for one ATen node, or None when DTensor has no strategy
    for its op. A triple is (a layout per tensor argument in argument order, the output's
    layout); the all-Identity triple is implied and not listed. Layouts: "I", "R", or a dim."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):
        return None
    args = tensor_args(node)
    if not args:
        return None
    key = _signature(node, args)
    return _derive_cached(key, node, args)


# Ops whose triples depend on the lengths of the dims (which dims a view merges or splits,
# where a slice starts): derived per exact shape. Every other op's triples depend only on its
# arguments' ranks and which of their dims have length 1 (DTensor's strategies and
# decompositions do not look further on a one-device mesh), so one derivation serves every
# node of that pattern: a deep model repeats its layers' ops at a few shapes.
_SHAPE_DEPENDENT = {
    "view",
    "reshape",
    "_unsafe_view",
    "flatten",
    "unflatten",
    "expand",
    "expand_as",
    "split",
    "split_with_sizes",
    "slice",
    "select",
    "narrow",
    "pad",
    "constant_pad_nd",
    "index",
    "repeat",
    "roll",
    "unfold",
    "as_strided",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty",
    "view_as",
    "reshape_as",
    "tile",
    "unbind",
    "chunk",
    "movedim",
    "squeeze",
    "index_select",
    "gather",
    "scatter",
    "take_along_dim",
    "diagonal",
    "tensor_split",
}


def _signature(node: fx.Node, args: list[fx.Node]) -> tuple:
    """What a derivation reads: the op, each tensor argument's shape (or its pattern: rank and
    which dims have length 1), dtype and whether it is a source, and the other arguments."""

    def plain(a):
        return "T" if _is_tensor(a) else repr(a)

    exact = node.target._overloadpacket.__name__ in _SHAPE_DEPENDENT
    rest = repr(fx.node.map_arg((node.args, node.kwargs), plain))

    def shape(v):
        return tuple(v.shape) if exact else tuple(int(n) == 1 for n in v.shape)

    tensors = tuple((shape(a.meta["val"]), a.meta["val"].dtype, _is_source(a)) for a in args)
    out = node.meta.get("val")
    outs = tuple(shape(o) for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor))
    return (node.target, tensors, outs, rest)


_cache: dict[tuple, Any] = {}
# Derivations by their signature's text, as kept on disk for later processes (save_derivations).
# One file per torch version and version of this module: DTensor's strategies are torch's.
_STORE = KeptJson("dtensor_rules", __file__, "DTensor rule cache")
_unsaved: dict[str, Any] = {}


def _derive_cached(key: tuple, node: fx.Node, args: list[fx.Node]):
    if key not in _cache:
        text = repr(key)
        stored = _STORE.load()
        if text in stored:
            _cache[key] = _from_json(stored[text])
            return _cache[key]
        try:
            with _whole_on_one_device():
                _cache[key] = _derive(node, args)
        except Exception:  # a strategy that cannot be evaluated here: no rule, never a crash
            _cache[key] = None
        _unsaved[text] = _cache[key]
    return _cache[key]


def save_derivations() -> None:
    """Keep the derivations this process made on disk, beside those other processes kept
    (bench.core.kept_json)."""
    if _STORE.save({k: _to_json(v) for k, v in _unsaved.items()}):
        _unsaved.clear()


def _to_json(value):
    if value is None:
        return None
    triples, how = value
    return [[[list(ins), post] for ins, post in triples], how]


def _from_json(value):
    if value is None:
        return None
    triples, how = value
    return [(tuple(ins), post) for ins, post in triples], how


@contextlib.contextmanager
def _whole_on_one_device():
    """DTensor's propagator works out the local shape of an op's output shape argument
    (views, new_empty) for the mesh's rank; for a strided shard it chunks a list as long as the
    sharded dim, on every call: seconds per op at a batch of 10^5 samples. On this one-device
    mesh every local shape is the global one, so it is answered at once."""
    module = sys.modules.get("torch.distributed.tensor._sharding_prop")
    original = getattr(module, "compute_local_shape_and_global_offset", None)
    if original is None:
        yield
        return

    def local_shape(global_shape, mesh, placements, skip_offset=False):
        if mesh.size() != 1:
            return original(global_shape, mesh, placements, skip_offset=skip_offset)
        return tuple(global_shape), (() if skip_offset else (0,) * len(global_shape))

    module.compute_local_shape_and_global_offset = local_shape
    try:
        yield
    finally:
        module.compute_local_shape_and_global_offset = original


# Functional ops DTensor registers only in their in-place form, whose strategy is the same (the
# in-place op's output is its first argument, as the functional op's output is the new tensor).
IN_PLACE_TWINS = {aten.copy.default: aten.copy_.default}


def _derive(node: fx.Node, args: list[fx.Node]):
    d = _dtensor()
    prop, op = d["prop"], IN_PLACE_TWINS.get(node.target, node.target)
    if op is aten.scaled_dot_product_attention.default:
        return _attention(node, args)
    n_out = _num_outputs(node)
    if op in prop.op_single_dim_strategy_funcs:
        info = prop.op_single_dim_strategy_funcs[op]
        args_meta, kwargs_meta = _substitute(node, lambda a, i: _meta(a))
        strategies = info.func(op, args_meta, kwargs_meta)
        triples = []
        for s in strategies:
            outs, ins = s[:n_out], s[n_out:]
            if len(ins) != len(args):
                continue
            triples.append((tuple(_layout(p) for p in ins), _out_layout(outs)))
        return _valid(triples, node, args), "single-dim strategy"
    if op in prop.op_strategy_funcs:
        schema = _strategy_schema(node, args, prop.op_to_schema_info.get(op))
        if schema is None:
            return None
        return _valid(_read(prop.op_strategy_funcs[op](schema), n_out), node, args), "strategy"
    if op in EXTRA_DECOMPOSITIONS:
        return _valid(_trace(EXTRA_DECOMPOSITIONS[op](node), node, args), node, args), "decomposition given here"
    if op in _CONTRACTIONS and (triples := _contraction(node, args)) is not None:
        return _valid(triples, node, args), "decomposition"
    if d["decomp"] is None:  # torch < 2.12: each placement combination through the decomposition
        fn = _decomposition(op)
        return None if fn is None else (_valid(_trace(fn, node, args), node, args), "decomposition traced here")
    if d["decomp"].has_decomp(op):
        d["decomp"].ensure_schema_info(op)
        info = prop.op_to_schema_info.get(op)
        if any(isinstance(x, (list, tuple)) and any(_is_tensor(y) for y in x) for x in node.args):
            info = d["RuntimeSchemaInfo"](
                static_argnum=info.static_argnum if info else 100,
                static_kwargkey=info.static_kwargkey if info else None,
                needs_pytree=True,
            )
        seeds = _seeds(args)
        triples = []
        for seed in seeds:
            specs = iter(seed)
            a, k = _substitute(node, lambda a, i, specs=specs: _spec(a, next(specs)))
            schema = d["OpSchema"](op, a, k, schema_info=info)
            strategy = d["decomp"].propagate_strategy(schema)
            if strategy is None:
                return None
            triples += _read(strategy, n_out)
        return _valid(triples, node, args), "decomposition"
    return None


def _letters(node: fx.Node, args: list[fx.Node]) -> tuple[list[str], str] | None:
    """The letters of a contraction's two operands and its output, where `_contraction` reads
    its triples from them: an einsum in plain letters (no ellipsis, none twice in one operand),
    or a matmul whose operands have the same batch dims or whose second is a matrix (a batch
    dim one operand lacks broadcasts, and the decomposition then splits less than the letters
    say); in both, floating operands without a dim of length 1 (one broadcasts too)."""
    if len(args) != 2:
        return None
    if node.target is aten.matmul.default:
        ra, rb = (a.meta["val"].dim() for a in args)
        if ra < 2 or not (rb == 2 or rb == ra):
            return None
        batch = "abcdefghijklmnopqrstuvw"[: ra - 2]
        ins, out = [batch + "xy", (batch if rb == ra else "") + "yz"], batch + "xz"
    else:
        equation = node.args[0] if node.args else None
        if not isinstance(equation, str) or "." in equation or "->" not in equation:
            return None
        lhs, out = equation.replace(" ", "").split("->")
        ins = lhs.split(",")
        if len(ins) != 2 or not all(spec.isalpha() for spec in ins) or not (out.isalpha() or out == ""):
            return None
        if any(len(set(spec)) != len(spec) for spec in (*ins, out)):
            return None
        if not set(out) <= set(ins[0]) | set(ins[1]):
            return None
    for spec, a in zip(ins, args):
        v = a.meta["val"]
        if v.dim() != len(spec) or not v.dtype.is_floating_point or any(int(n) == 1 for n in v.shape):
            return None
    return ins, out


# Contractions whose triples `_contraction` reads from their letters.
_CONTRACTIONS = (aten.einsum.default, aten.matmul.default)


def _contraction(node: fx.Node, args: list[fx.Node]) -> list[tuple[tuple, Layout | None]] | None:
    """An einsum's or a matmul's triples from its letters (`_letters`), the ones tracing its
    decomposition gives: a letter of both operands, or of one operand and the output, split in
    the operands that have it splits the output along it, or makes it partial sums where the
    output lacks it (each operand's other letters whole). What the decomposition does with a
    partial operand (its reshapes copy some, which DTensor refuses for partial sums) and with a
    letter summed out of one operand alone (partial sums before the product) is traced: those
    few placements only. None where the letters do not say (`_letters`): the whole
    decomposition is traced then."""
    parsed = _letters(node, args)
    if parsed is None:
        return None
    ins, out = parsed
    d = _dtensor()
    triples: list[tuple[tuple, Layout | None]] = []
    traced: list[tuple] = [(d["Partial"](), d["Replicate"]()), (d["Replicate"](), d["Partial"]())]
    for letter in sorted(set(ins[0]) | set(ins[1])):
        pre = tuple(spec.index(letter) if letter in spec else "I" for spec in ins)
        if letter in out:
            triples.append((pre, out.index(letter)))
        elif all(letter in spec for spec in ins):
            triples.append((pre, "R"))
        else:  # summed out of one operand before the product
            traced.append(tuple(d["Shard"](p) if isinstance(p, int) else d["Replicate"]() for p in pre))
    triples += _trace_placements(node.target.decompose, node, args, traced)
    return sorted(triples, key=lambda t: [(0, p) if isinstance(p, int) else (1, p) for p in (*t[0], t[1])])


def _one_hot(node: fx.Node):
    """one_hot as a comparison with the class indices (what it computes), for DTensor to trace;
    the indices (made from nothing, whole on every device) are made before tracing starts."""
    classes = torch.arange(node.meta["val"].shape[-1], device="meta")
    classes._spec = _dtensor()["DTensorSpec"](
        _dtensor()["mesh"],
        (_dtensor()["Replicate"](),),
        tensor_meta=_dtensor()["TensorMeta"](classes.shape, (1,), classes.dtype),
    )
    return lambda x, num_classes=-1: torch.eq(x.unsqueeze(-1), classes).to(torch.int64)


# Ops DTensor neither registers a strategy for nor can decompose: a decomposition of our own,
# whose ops DTensor knows, is traced the way DTensor traces its own decompositions (each entry
# makes the function to trace for a node).
EXTRA_DECOMPOSITIONS = {aten.one_hot.default: _one_hot}


def _trace(fn, node: fx.Node, args: list[fx.Node]) -> list[tuple[tuple, Layout | None]]:
    """Each candidate placement combination of the arguments run through `fn` on meta tensors
    under DTensor's placement tracking; a combination that needs a redistribution fails."""
    combos = list(itertools.islice(itertools.product(*[_candidates(a) for a in args]), _MAX_COMBOS))
    return _trace_placements(fn, node, args, combos)


class _PlacementsOnly:
    """DTensor's propagator as torch 2.12's placement tracking reads it, for torch before it:
    where an op's inputs keep their placements, a redistribution is none (a view's shape
    argument made local, which torch 2.11's tracking refuses, so that every flattening view
    failed there); and an op DTensor answers with an old-style rule (2.11: convolution, its
    backward, index, index_select) fails the trace: 2.11's convolution rule gives the input's
    placement to the output whatever the weight's, which a trace would take for a triple."""

    def __init__(self, prop):
        self._prop = prop

    def __getattr__(self, name):
        return getattr(self._prop, name)

    def propagate_op_sharding(self, schema):
        return self._settled(schema, self._prop.propagate_op_sharding(schema))

    def propagate_op_sharding_non_cached(self, schema):
        return self._settled(schema, self._prop.propagate_op_sharding_non_cached(schema))

    def _settled(self, schema, out):
        if schema.op in getattr(self._prop, "op_to_rules", {}):
            raise NotImplementedError(f"{schema.op} has only an old-style DTensor rule here")
        wanted = out.redistribute_schema
        if (
            out.needs_redistribute
            and wanted is not None
            and all(a.placements == b.placements for a, b in zip(schema.args_spec, wanted.args_spec))
        ):
            return dataclasses.replace(out, needs_redistribute=False)
        return out


def _trace_placements(fn, node: fx.Node, args: list[fx.Node], combos) -> list[tuple[tuple, Layout | None]]:
    """`_trace` of the given placement combinations alone."""
    from torch.distributed.tensor._decompositions import PlacementTrackingMode

    d = _dtensor()
    prop = d["prop"] if d["decomp"] is not None else _PlacementsOnly(d["prop"])  # torch < 2.12
    triples = []
    for combo in combos:
        places = iter(combo)

        def meta(a, i, places=places):
            p = next(places)
            t = torch.empty(tuple(a.meta["val"].shape), dtype=a.meta["val"].dtype, device="meta")
            t._spec = _spec(a, p)
            return t

        call_args, call_kwargs = _substitute(node, meta)
        try:
            with PlacementTrackingMode(prop, d["mesh"]):
                out = fn(*call_args, **call_kwargs)
        except Exception:
            continue
        spec = getattr(out, "_spec", None)
        if spec is not None:
            triples.append((tuple(_layout(p) for p in combo), _layout(spec.placements[0])))
    return triples


def _num_outputs(node: fx.Node) -> int:
    val = node.meta.get("val")
    return len(val) if isinstance(val, (tuple, list)) else 1


def _substitute(node: fx.Node, fn):
    """The node's args and kwargs with the i-th tensor argument replaced by fn(arg, i)."""
    counter = itertools.count()
    return fx.node.map_arg(
        (node.args, node.kwargs), lambda a: fn(a, next(counter)) if _is_tensor(a) else a.meta.get("val", a)
    )


def _meta(a: fx.Node):
    """The argument's shape and dtype, contiguous: placements do not depend on strides, and
    DTensor's decomposition tracing makes contiguous tensors (a transposed stride then fails
    the views of the decomposition)."""
    v = a.meta["val"]
    strides, step = [], 1
    for n in reversed(v.shape):
        strides.append(step)
        step *= max(int(n), 1)
    return _dtensor()["TensorMeta"](v.shape, tuple(reversed(strides)), v.dtype)


def _spec(a: fx.Node, placement):
    d = _dtensor()
    return d["DTensorSpec"](d["mesh"], (placement,), tensor_meta=_meta(a))


def _candidates(a: fx.Node) -> list:
    """Placements an argument may come in: whole, split along a dim longer than 1, or (a
    numeric tensor) partial sums. A source (input, parameter) is never made partial, but a
    triple that wants it partial is one the first device can run with it whole
    (methods.hap.theory, first-device-only)."""
    d = _dtensor()
    v = a.meta["val"]
    out = [d["Replicate"]()] + [d["Shard"](i) for i in range(v.dim()) if v.shape[i] > 1]
    if v.dtype != torch.bool:
        out.append(d["Partial"]())
    return out


def _seeds(args: list[fx.Node]) -> list[tuple]:
    """Input placements whose union makes DTensor's decomposition tracing try every candidate:
    it tries Replicate, each placement it is shown on any input, and every Shard of every
    input once it is shown one; so one input partial and another split, or, with a single
    input that could be both, one seed of each."""
    d = _dtensor()
    shardable = [a for a in args if any(s > 1 for s in a.meta["val"].shape)]
    numeric = [a for a in args if a.meta["val"].dtype != torch.bool]
    partial = next((a for a in numeric if not _is_source(a)), numeric[-1] if numeric else None)

    def seed(p_arg, s_arg):
        out = []
        for a in args:
            if a is p_arg:
                out.append(d["Partial"]())
            elif a is s_arg:
                out.append(d["Shard"](next(i for i, s in enumerate(a.meta["val"].shape) if s > 1)))
            else:
                out.append(d["Replicate"]())
        return tuple(out)

    other = next((a for a in shardable if a is not partial), None)
    if partial is None or other is not None:
        return [seed(partial, other)]
    return [seed(partial, None), seed(None, partial)]


def _strategy_schema(node: fx.Node, args: list[fx.Node], schema_info):
    """The op's schema with every tensor argument as an OpStrategy of all its candidates."""
    d = _dtensor()
    combos = 1
    for a in args:
        combos *= len(_candidates(a))
    if combos > _MAX_COMBOS:
        return None

    def strategy(a, i):
        return d["OpStrategy"]([d["OpSpec"](_spec(a, p)) for p in _candidates(a)])

    a, k = _substitute(node, strategy)
    a = tuple(
        d["TupleStrategy"](tuple(x))
        if isinstance(x, (list, tuple)) and x and all(isinstance(y, d["OpStrategy"]) for y in x)
        else x
        for x in a
    )
    return d["OpSchema"](node.target, a, k, schema_info=schema_info)


def _read(strategy, n_out: int, first_only: bool = False) -> list[tuple[tuple, Layout | None]]:
    """Triples of an OpStrategy (a TupleStrategy, for a list output, gives none); with
    `first_only`, the first output's placement is the output's."""
    d = _dtensor()
    if isinstance(strategy, d["TupleStrategy"]):
        return []
    triples = []
    for spec in strategy.strategies:
        outs = spec.output_specs
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        out_places = [o.placements[0] if o is not None else None for o in outs]
        if first_only:
            out_places = out_places[:1]
        if spec.input_specs is None:
            ins = None
        else:
            ins = tuple(_layout(s.placements[0]) for s in spec.input_specs)
        triples.append((ins, _out_layout(out_places)))
    return triples


def _layout(p) -> Layout | None:
    d = _dtensor()
    if type(p) is d["Replicate"]:
        return "I"
    if type(p) is d["Partial"]:
        return "R" if p.reduce_op == "sum" else None
    if type(p) is d["Shard"]:
        return p.dim
    if type(p).__name__ == "_ShardingPlaceholder":
        return p.dim
    return None  # strided shards, masked partials (vocabulary-parallel), avg / max partials


def _out_layout(outs) -> Layout | None:
    layouts = {_layout(p) for p in outs if p is not None}
    return layouts.pop() if len(layouts) == 1 else None


def _valid(triples, node: fx.Node, args: list[fx.Node]) -> list[tuple[tuple[Layout, ...], Layout]]:
    """Triples HAP's layouts can express: every placement known, no split along a dim of
    length 1 (HAP keeps those whole on every device), the all-Identity triple left out."""
    out_val = node.meta["val"]
    out_shape = out_val.shape if isinstance(out_val, torch.Tensor) else out_val[0].shape
    good = []
    for ins, post in triples:
        if ins is None:
            ins = tuple(post for _ in args)
        if post is None or any(p is None for p in ins) or len(ins) != len(args):
            continue
        if isinstance(post, int) and out_shape[post] <= 1:
            continue
        if any(isinstance(p, int) and a.meta["val"].shape[p] <= 1 for p, a in zip(ins, args)):
            continue
        if post == "I" and all(p == "I" for p in ins):
            continue
        if post == "R" and all(p == "I" for p in ins):
            continue
        good.append((tuple(ins), post))
    return list(dict.fromkeys(good))


def _attention(node: fx.Node, args: list[fx.Node]):
    """scaled_dot_product_attention as DTensor's fused attention: the memory-efficient kernel's
    strategy when a mask is given (its attention bias), the flash kernel's otherwise."""
    d = _dtensor()
    prop = d["prop"]
    a = node.args
    kw = node.kwargs
    mask = a[3] if len(a) > 3 else kw.get("attn_mask")
    dropout = a[4] if len(a) > 4 else kw.get("dropout_p", 0.0)
    causal = a[5] if len(a) > 5 else kw.get("is_causal", False)
    gqa = a[7] if len(a) > 7 else kw.get("enable_gqa", False)
    q, k, v = a[0], a[1], a[2]
    if gqa and q.meta["val"].shape[1] != k.meta["val"].shape[1]:
        return None  # grouped-query heads: no fused strategy lines them up
    if isinstance(mask, fx.Node) and mask.meta["val"].dtype != torch.bool:
        fused, fargs = aten._scaled_dot_product_efficient_attention.default, (q, k, v, mask, False, dropout, causal)
    elif isinstance(mask, fx.Node):
        # A boolean mask is an additive bias of 0 and -inf: the same placements.
        fused, fargs = aten._scaled_dot_product_efficient_attention.default, (q, k, v, mask, False, dropout, causal)
    else:
        fused, fargs = aten._scaled_dot_product_flash_attention.default, (q, k, v, dropout, causal, False)
    fake = fx.Graph().create_node("call_function", fused, fargs)
    fake.meta["val"] = node.meta["val"]
    fn = prop.op_strategy_funcs.get(fused)
    if fn is None:
        return None
    targs = [x for x in fargs if _is_tensor(x)]
    schema = _strategy_schema(fake, targs, prop.op_to_schema_info.get(fused))
    if schema is None:
        return None
    triples = []
    for ins, post in _read(fn(schema), 1, True):
        if ins is not None and isinstance(mask, fx.Node):
            # A mask that broadcasts along a dim (heads: length 1) is whole on every device.
            m = list(ins[3:4])
            if m and isinstance(m[0], int) and mask.meta["val"].shape[m[0]] == 1:
                ins = ins[:3] + ("I",) + ins[4:]
        triples.append((ins[: len(targs)] if ins is not None else None, post))
    triples = _valid(triples, fake, targs)
    # Back to the node's own tensor arguments (q, k, v[, mask]).
    return [(ins[: len(args)], post) for ins, post in triples if len(ins) >= len(args)], "fused-attention strategy"
