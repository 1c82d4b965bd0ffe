"""torch.export's ATen graph of a model, made ready for the planner: parameters as get_attr
nodes, value semantics, canonical op names and FLOPs per op.

What it does: exports the single-device model (non-strict: its Python runs as written, on fake
tensors, so shape-dependent control flow, slicing and library code are fine), then rewrites the
exported graph so every node computes a new tensor from its inputs: parameter and buffer inputs
become get_attr nodes named by their module path, export's bookkeeping nodes go, in-place ops
whose input nobody reads afterwards become their functional twins, and training-mode batch norm
becomes its statistics (two sums over the batch) and an element-wise normalisation, so a batch
split all-reduces the statistics instead of normalising each shard alone. Buffer updates that
forward does not read (batch norm's running statistics and counter) are left out: the planner's
programs train as the model does, but do not keep those statistics for evaluation. What it does not do:
sharding (methods.hap.theory) or memory accounting (methods.graph.Graph).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from bench.core.errors import PlanningError
from models.tasks import describe_export_error, export

aten = torch.ops.aten

# Canonical names of ATen ops whose overload-packet name says something else than the torch
# function the planner's rules and cost tables speak of.
_ALIASES = {
    "cross_entropy_loss": "cross_entropy",
    "_unsafe_view": "view",
    "_softmax": "softmax",
    "_log_softmax": "log_softmax",
    "_to_copy": "to",
    "true_divide": "div",
    "convolution": "conv2d",
}

# Nodes export adds that compute nothing the program needs.
_DROP = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}
# Ops that make a tensor from nothing but their arguments; their `device` is the capture's.
FACTORY_OPS = {
    "arange",
    "zeros",
    "ones",
    "full",
    "empty",
    "rand",
    "randn",
    "randint",
    "tensor",
    "scalar_tensor",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty",
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_like",
    "rand_like",
    "randn_like",
    "eye",
    "linspace",
}


class CaptureError(PlanningError):
    """torch.export refused the model, or its graph holds what the planner cannot run (the
    case is recorded failed with this one line)."""


def op_name(node: fx.Node) -> str:
    """The op a node runs: an ATen op's packet name (aliased), or a callable's name."""
    if node.op != "call_function":
        return node.op
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        name = target._overloadpacket.__name__
        return _ALIASES.get(name, name)
    return getattr(target, "__name__", str(target))


BATCH_NORM = ("sync", "local")


def export_model(
    model: nn.Module, example_inputs: Sequence[Any], what: str = "the model", batch_norm: str = "sync"
) -> fx.GraphModule:
    """The planner's graph of `model` (see the module docstring).

    Args:
        batch_norm: "sync": training-mode batch norm as its statistics over the whole batch
            (a batch split all-reduces them: every program is exact); "local": kept whole, a
            batch split normalising each shard by its own statistics, as DDP does.

    Raises:
        CaptureError: one line naming the model, the first construct export refused and the fix.
    """
    inputs = tuple(example_inputs)
    quiet = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # a refusal's guard is logged, and its graph printed: it is raised instead
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            ep = export(model, inputs)  # models.tasks': a model captured on a real sample is so here too
    except Exception as exc:  # export raises many types; each becomes one line
        raise CaptureError(
            f"{what}: torch.export (non-strict) refused {describe_export_error(exc)}; use another task "
            "adapter (model.task=...) or wrap the model in model=custom with a forward export can "
            "trace"
        ) from exc
    finally:
        quiet.setLevel(level)
    try:
        return planner_module(ep, model, what, batch_norm)
    except CaptureError as exc:
        if not isinstance(exc.__cause__, _NotPlannerForm):
            raise
    # An in-place write into a tensor read again (a slice assigned, x[:, 1:] = y), or a region
    # exported as a submodule: the same program functionalised by torch.export (scatters into
    # copies instead of writes, regions inlined), which keeps what each op computes; only the
    # models that need it get its other op names.
    return planner_module(ep.run_decompositions({}), model, what, batch_norm)


def planner_module(
    ep: torch.export.ExportedProgram, model: nn.Module, what: str, batch_norm: str = "sync"
) -> fx.GraphModule:
    """Rewrite an ExportedProgram's graph for the planner (module docstring)."""
    sig = ep.graph_signature
    params = dict(sig.inputs_to_parameters)
    buffers = dict(sig.inputs_to_buffers)
    constants = dict(sig.inputs_to_lifted_tensor_constants)
    user_out = [s.arg.name for s in sig.output_specs if s.kind.name == "USER_OUTPUT"]
    if len(user_out) != 1:
        raise CaptureError(
            f"{what}: forward returns {len(user_out)} outputs; the planner needs one, the loss summed "
            "over the batch (reduction='sum') computed inside forward"
        )
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    attrs: dict[str, Any] = {}
    dropped: list[str] = []
    named = dict(model.named_parameters(remove_duplicate=False))
    named_buffers = dict(model.named_buffers(remove_duplicate=False))
    # Reads after a node, to tell whether an in-place op's input is still wanted.
    order = {n: i for i, n in enumerate(ep.graph.nodes)}
    last_read = {n: max((order[u] for u in n.users), default=-1) for n in ep.graph.nodes}
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            fqn = params.get(n.name) or buffers.get(n.name)
            if fqn is not None:
                value = named.get(fqn) if n.name in params else named_buffers.get(fqn)
                attrs[fqn] = value if value is not None else _lookup(model, fqn)
                new = graph.create_node("get_attr", fqn, name=_identifier(fqn))
            elif n.name in constants:
                target = f"_const_{len([k for k in attrs if k.startswith('_const_')])}"
                attrs[target] = ep.constants[constants[n.name]]
                new = graph.get_attr(target)
            else:
                new = graph.create_node("placeholder", n.name, name=n.name)
            new.meta = dict(n.meta)
            env[n] = new
            continue
        if n.op == "output":
            graph.output(env[_find(ep.graph, user_out[0])])
            continue
        if n.op == "get_attr":
            raise CaptureError(
                f"{what}: forward holds a region exported as a submodule ({n.target}: torch.no_grad() or "
                "another context inside forward), which the planner cannot split"
            ) from _NotPlannerForm()
        target = n.target
        if target in _DROP:
            continue
        if target in (aten.lift_fresh_copy.default, aten.detach_.default) and _is_constant(n.args[0], env):
            env[n] = env[n.args[0]]
            continue
        if _updates_buffer(n, buffers):
            # A buffer's update nobody reads in forward (batch norm's counter of batches): the
            # planner's program trains without it, as it does without running statistics.
            dropped.append(f"{n.target} on {buffers[n.args[0].name]}")
            continue
        args = fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            target = _functional(target, n, last_read, order, what)
        if target is aten.batch_norm.default and batch_norm == "sync":
            env[n] = _batch_norm(graph, n, args)
            continue
        new = graph.create_node("call_function", target, args, kwargs, name=n.name)
        new.meta = dict(n.meta)
        env[n] = new
    graph.eliminate_dead_code()
    _check_shapes_known(graph, what)
    for n in graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if stack:  # module paths as keys, outermost first (what torch.fx's tracer records)
            n.meta["nn_module_stack"] = {path: (path, cls) for path, cls in stack.values() if path}
    gm = fx.GraphModule(attrs, graph)
    gm.meta["dropped_buffer_updates"] = dropped
    gm.meta["param_aliases"] = _aliases(model, {name for name, _ in gm.named_parameters()})
    return gm


def _check_shapes_known(graph: fx.Graph, what: str) -> None:
    """CaptureError unless every tensor's shape is known before a step: a length torch.export
    leaves as a symbol (x[mask], nonzero: as many rows as the mask has true values) depends on
    the values, and the planner splits and prices tensors by their lengths."""
    for n in graph.nodes:
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        for v in vals:
            if isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape):
                frame = (n.meta.get("stack_trace") or "").strip().splitlines()
                line = f" ({frame[-1].strip()})" if frame else ""
                raise CaptureError(
                    f"{what}: the shape {tuple(v.shape)} of {n.name} ({op_name(n)}){line} is data-dependent "
                    "(it depends on tensor values); the planner needs every length before a step: use another "
                    "task adapter (model.task=...) or wrap the model in model=custom without it"
                )


def _aliases(model: nn.Module, kept: set[str]) -> dict[str, str]:
    """Other names of the graph's parameters: {alias: the name the graph module keeps} (a tied
    embedding and head is one parameter with two names; the graph may read it by both, but
    holds it once)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out = {}
    for group in names.values():
        canonical = next((n for n in group if n in kept), None)
        if canonical is not None:
            out.update({n: canonical for n in group if n != canonical})
    return out


def _updates_buffer(n: fx.Node, buffers: dict) -> bool:
    """An in-place op on a buffer input whose result nothing reads."""
    op = n.target
    return (
        isinstance(op, torch._ops.OpOverload)
        and op._schema.is_mutable
        and not n.users
        and bool(n.args)
        and isinstance(n.args[0], fx.Node)
        and n.args[0].name in buffers
    )


def _lookup(model: nn.Module, fqn: str) -> Any:
    obj = model
    for part in fqn.split("."):
        obj = getattr(obj, part)
    return obj


def _identifier(fqn: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in fqn)


def _find(graph: fx.Graph, name: str) -> fx.Node:
    return next(n for n in graph.nodes if n.name == name)


def _is_constant(a: Any, env: dict) -> bool:
    return (
        isinstance(a, fx.Node)
        and env.get(a) is not None
        and env[a].op == "get_attr"
        and str(env[a].target).startswith("_const_")
    )


def _functional(target: torch._ops.OpOverload, n: fx.Node, last_read: dict, order: dict, what: str):
    """The functional twin of an in-place op whose written input nobody reads after it (then
    the op's output stands for the written tensor); else a CaptureError naming the op."""
    schema = target._schema
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    name = schema.name.split("::")[-1]
    twin = None
    if name.endswith("_") and written == [0]:
        packet = getattr(aten, name[:-1], None)
        overload = target._overloadname
        if packet is not None and overload in packet.overloads():
            twin = getattr(packet, overload)
    src = n.args[0] if n.args else None
    bases = []  # the written tensor and what it is a view of
    while isinstance(src, fx.Node):
        bases.append(src)
        op = src.target if src.op == "call_function" else None
        viewing = (
            isinstance(op, torch._ops.OpOverload)
            and op._schema.returns
            and op._schema.returns[0].alias_info is not None
        )
        src = src.args[0] if viewing else None
    later = any(last_read.get(b, -1) > order[n] for b in bases)
    state = any(b.op == "placeholder" for b in bases)
    if twin is None or later or state:
        reason = (
            "writes into an input, parameter or buffer"
            if state
            else "writes into a tensor read again afterwards"
            if later
            else "has no functional twin"
        )
        raise CaptureError(
            f"{what}: op {target} at node {n.name!r} {reason}; the planner needs a forward without "
            "in-place writes there (write x = x + y, not x += y), or model=custom with such a forward"
        ) from _NotPlannerForm()
    return twin


class _NotPlannerForm(Exception):
    """The cause of a CaptureError export_model answers with the functionalised program: an
    in-place write into a tensor read again, or a region of forward exported as a submodule
    (torch.no_grad() inside forward: a higher-order op), which functionalising inlines."""


def _batch_norm(graph: fx.Graph, n: fx.Node, args: tuple) -> fx.Node:
    """Training-mode batch norm as its statistics and an element-wise normalisation (module
    docstring); in eval mode, the running statistics normalise element-wise. The running
    statistics are not updated by the captured program (only evaluation reads them)."""
    x, weight, bias, running_mean, running_var, training, _momentum, eps = args[:8]
    val = n.meta["val"]
    channels = val.shape[1]
    dims = [0] + list(range(2, val.dim()))
    shape = [1, channels] + [1] * (val.dim() - 2)
    count = val.numel() // channels
    meta = dict(n.meta)

    def call(op, *a):
        node = graph.call_function(op, a)
        node.meta = {k: v for k, v in meta.items() if k in ("nn_module_stack", "stack_trace")}
        vals = fx.node.map_arg(a, lambda m: m.meta["val"])
        node.meta["val"] = op(*_to_meta(vals))
        return node

    if training or running_mean is None:
        total = call(aten.sum.dim_IntList, x, dims)
        squares = call(aten.sum.dim_IntList, call(aten.mul.Tensor, x, x), dims)
        mean = call(aten.div.Tensor, total, float(count))
        var = call(aten.sub.Tensor, call(aten.div.Tensor, squares, float(count)), call(aten.mul.Tensor, mean, mean))
    else:
        mean, var = running_mean, running_var
    rstd = call(aten.rsqrt.default, call(aten.add.Tensor, var, float(eps)))
    out = call(
        aten.mul.Tensor,
        call(aten.sub.Tensor, x, call(aten.view.default, mean, shape)),
        call(aten.view.default, rstd, shape),
    )
    if weight is not None:
        out = call(aten.mul.Tensor, out, call(aten.view.default, weight, shape))
    if bias is not None:
        out = call(aten.add.Tensor, out, call(aten.view.default, bias, shape))
    return out


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    return x


# -- FLOPs of ATen ops ------------------------------------------------------------------------

# Forward FLOPs per output element of element-wise and normalising ops that the older table
# (bench.flops.ELEMENTWISE_FLOPS) does not name; backward factor 1 for them.
EXTRA_ELEMENTWISE_FLOPS = {
    "div": 1,
    "pow": 1,
    "rsqrt": 1,
    "sqrt": 1,
    "silu": 4,
    "cos": 1,
    "sin": 1,
    "where": 1,
    "masked_fill": 1,
    "clamp": 1,
    "abs": 1,
    "floor": 1,
    "log": 1,
    "ne": 1,
    "logical_not": 1,
    "bitwise_not": 1,
    "maximum": 1,
    "minimum": 1,
    "max": 1,
    "min": 1,
    "amax": 1,
    "var_mean": 4,
    "_native_batch_norm_legit_functional": 8,
    "adaptive_avg_pool1d": 1,
    "batch_norm": 8,
    "gather": 0,
    "index": 0,
    "index_select": 0,
    "pad": 0,
    "constant_pad_nd": 0,
    "roll": 0,
    "repeat": 0,
    "tril": 0,
    "triu": 0,
    "scatter": 0,
    "embedding": 0,
}
# Ops whose work follows their (first) input, not their output: reductions and losses.
REDUCTIONS = {
    "sum",
    "mean",
    "cross_entropy",
    "nll_loss",
    "max_pool2d",
    "adaptive_avg_pool2d",
    "avg_pool2d",
    "adaptive_avg_pool1d",
    "amax",
    "max",
    "min",
    "var_mean",
    "logsumexp",
}
# Ops with 2 FLOPs per multiply-add whose backward does about twice the forward's work.
MATMUL_OPS = {
    "linear",
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "einsum",
    "conv2d",
    "conv1d",
    "scaled_dot_product_attention",
}


def count_flops(name: str, args: Sequence[Any], out: Any, elementwise: dict, views: set) -> tuple[float, float]:
    """(forward FLOPs, backward factor) of one ATen op from its (meta or fake) arguments and
    output (docs/planner.md "FLOP counter")."""
    tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
    out_numel = out.numel() if isinstance(out, torch.Tensor) else 0
    if name == "linear":
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else None
        return 2.0 * x.numel() * w.shape[0] + (out_numel if bias is not None else 0), 2.0
    if name in ("matmul", "mm", "bmm"):
        return 2.0 * out_numel * args[0].shape[-1], 2.0
    if name in ("addmm", "baddbmm"):
        return 2.0 * out_numel * args[1].shape[-1] + out_numel, 2.0
    if name in ("conv2d", "conv1d"):
        w = args[1]
        per_out = math.prod(w.shape[1:])  # (C_in / groups) * kernel
        bias = args[2] if len(args) > 2 else None
        return 2.0 * out_numel * per_out + (out_numel if isinstance(bias, torch.Tensor) else 0), 2.0
    if name == "einsum":
        eq = args[0].replace(" ", "")
        sizes: dict[str, int] = {}
        for spec, t in zip(eq.split("->")[0].split(","), args[1]):
            for ch, n in zip(spec, t.shape):
                sizes[ch] = max(sizes.get(ch, 1), n)
        return 2.0 * math.prod(sizes.values()), 2.0
    if name == "scaled_dot_product_attention":
        q, k, v = args[0], args[1], args[2]
        scores = q.numel() // q.shape[-1] * k.shape[-2]  # (..., S_q, S_kv)
        # Q K^T and P V as two matmuls, the softmax over the scores as its own table entry.
        return 2.0 * scores * q.shape[-1] + 2.0 * scores * v.shape[-1] + elementwise.get("softmax", 5) * scores, 2.0
    if name in views or not tensors:
        return 0.0, 0.0
    per = elementwise.get(name, EXTRA_ELEMENTWISE_FLOPS.get(name, 1))
    numel = tensors[0].numel() if name in REDUCTIONS else (out_numel or sum(t.numel() for t in tensors))
    return float(per * numel), 1.0


def _flat(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    return [x]
