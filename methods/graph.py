"""The planner's reference graph of a single-device model: ATen ops, shapes, FLOPs per node.

The model is exported with torch.export (non-strict, methods.export) on the device its
parameters live on, the meta device for paper-size models, so nothing is allocated; every node
gets its shape and dtype from export's fake values, and its FLOPs from a table over ATen ops. It
does not decide any sharding (methods.hap.theory does); FLOP conventions are in docs/cost-model.md.
Most of its length is `Graph`, the one structure every planner, pricer and code generator reads
(nodes, layer groups, per-layer costs, memory); the export itself is methods.export.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.fx as fx
from torch import nn
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.utils._python_dispatch import TorchDispatchMode

from bench.core.meta import build_on_meta
from bench.core.program import op_class
from bench.cost.flops import ELEMENTWISE_FLOPS
from methods import graph_cache
from methods.export import CaptureError, count_flops, export_model, op_name

__all__ = [
    "VIEW_OPS",
    "CaptureError",
    "Graph",
    "Node",
    "capture",
    "capture_config",
    "capture_priced",
    "graph_of",
    "op_name",
]


@dataclass
class Node:
    """One node of the reference graph (a thin view of an fx node with planner facts)."""

    name: str
    kind: str  # fx op: placeholder | get_attr | call_function | call_method | output
    op: str  # canonical op name (op_name)
    fx_node: fx.Node = field(repr=False)
    inputs: list[str]  # names of the tensor (or tuple-of-tensor) nodes it reads, in order
    shape: tuple[int, ...] | None  # None for non-tensor values (sizes, dtypes, tuples)
    dtype: torch.dtype | None
    flops: float = 0.0  # forward FLOPs of the node on the full (unsharded) inputs
    backward_factor: float = 2.0  # backward FLOPs / forward FLOPs
    is_param: bool = False  # get_attr of an nn.Parameter (trained, optimizer state)
    tuple_shapes: tuple[tuple[int, ...], ...] | None = None  # for tuple outputs (topk)
    # Tensors read only through non-tensor nodes (x.shape[0], x.dtype): they must exist
    # before this node runs, and a shape read from a shard is the shard's shape.
    shape_inputs: list[str] = field(default_factory=list)

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None or self.tuple_shapes is not None

    @property
    def numel(self) -> int:
        if self.shape is not None:
            return math.prod(self.shape)
        if self.tuple_shapes is not None:
            return sum(math.prod(s) for s in self.tuple_shapes)
        return 0

    @functools.cached_property
    def nbytes(self) -> int:
        """(Cached: the search reads it for every priced move; a node's shape and dtype are
        set when capture builds it and never change.)"""
        if self.dtype is None:
            return 0
        return self.numel * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        shape = self.shape if self.shape is not None else (self.tuple_shapes or [()])[0]
        return len(shape)

    @property
    def where(self) -> str:
        target = self.fx_node.target
        return f"fx node {self.name!r} (op {self.kind}, target {getattr(target, '__module__', '')}.{self.op})"


@dataclass
class Graph:
    """The reference graph: nodes in topological order, the loss node, parameter shapes.

    `recompute` lists the activation-checkpointed units (methods.common.checkpoint_units), each
    as the names of its ops, contiguous in forward order: backward runs a unit's forward again
    before its own, so a unit's ops keep nothing from forward to backward but the unit's
    inputs, which the checkpoint holds (kept_until), their saved tensors live again from the
    start of the unit's backward (recompute_windows), and their forward FLOPs are spent twice
    (backward_flops). Empty: plain training (with_recompute makes the checkpointed view; the
    nodes are shared).
    """

    gm: fx.GraphModule
    nodes: list[Node]
    loss: str
    batch_size: int
    recompute: tuple[tuple[str, ...], ...] = ()
    # op -> the dtype autocast ran it in, where its floating inputs were of another
    # (at_autocast): what such an op keeps of them is their casts, of that dtype
    casts: dict[str, torch.dtype] = field(default_factory=dict)
    # op -> the parameters it casts anew at every call (at_autocast): autocast caches the cast
    # of a parameter it casts itself, for the step, but an op it does not list (CPU's einsum)
    # casts a view of the parameter inside its decomposition, once per call, and keeps that
    call_casts: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_name = {n.name: n for n in self.nodes}
        users: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in dict.fromkeys(n.inputs):
                users[i].append(n.name)
        self.users = users

    def __getitem__(self, name: str) -> Node:
        return self.by_name[name]

    def with_recompute(self, units: Sequence[Sequence[str]]) -> Graph:
        """This graph with `units` checkpointed (none: the plain graph); the nodes are shared."""
        units = tuple(tuple(u) for u in units)
        return self if units == self.recompute else dataclasses.replace(self, recompute=units)

    def at_autocast(self, device_type: str, dtype: torch.dtype) -> Graph:
        """This graph as it runs under autocast to `dtype` on `device_type` (autocast_dtypes):
        each node at the dtype autocast gives it, and `casts` set."""
        dtypes, casts, direct = autocast_dtypes(self.gm, device_type, dtype)
        nodes = [
            dataclasses.replace(n, dtype=dtypes[n.name]) if dtypes.get(n.name, n.dtype) != n.dtype else n
            for n in self.nodes
        ]
        graph = dataclasses.replace(self, nodes=nodes, casts=casts)
        call_casts = {op: tuple(p for p in graph._cast_params(op) if p not in direct[op]) for op in casts}
        return dataclasses.replace(graph, call_casts={op: ps for op, ps in call_casts.items() if ps})

    def _cast_params(self, op: str) -> list[str]:
        """The parameters op `op` reads that autocast cast for it (`casts`), each once."""
        cast = self.casts[op]
        return [i for i in dict.fromkeys(self[op].inputs) if self[i].is_param and self[i].dtype != cast]

    @functools.cached_property
    def param_casts(self) -> dict[str, int]:
        """Parameter -> the bytes of autocast's cast of it (`casts`: an op that runs in another
        dtype than the parameter's): autocast casts a parameter once a step and keeps the cast
        until it exits, after the optimizer step here (bench.runtime.precision.step_context);
        the ops that read it keep that one cast. A step that calls each op once holds one cast
        of a parameter cast anew per call (`call_casts`) too, from forward to its backward,
        counted here alike. Empty outside autocast."""
        out: dict[str, int] = {}
        for op, dtype in self.casts.items():
            for p in self._cast_params(op):
                out[p] = max(out.get(p, 0), self[p].numel * dtype.itemsize)
        return out

    def cached_casts(self) -> dict[str, int]:
        """param_casts of the parameters autocast casts itself at least once (cached for the
        step): one cast a step however often the ops run (a pipeline's micro-batches)."""
        direct = {p for op in self.casts for p in self._cast_params(op) if p not in self.call_casts.get(op, ())}
        return {p: b for p, b in self.param_casts.items() if p in direct}

    def call_cast_bytes(self, op: str) -> float:
        """Bytes of the parameter casts `op` makes anew at each call and keeps for its backward
        (`call_casts`)."""
        return float(sum(self[p].numel * self.casts[op].itemsize for p in self.call_casts.get(op, ())))

    @functools.cached_property
    def recomputed(self) -> frozenset[str]:
        """The ops a checkpointed unit runs again in backward."""
        return frozenset(name for unit in self.recompute for name in unit)

    def backward_flops(self, node: Node) -> float:
        """An op's backward FLOPs on the full inputs: its forward's times its backward factor,
        plus its forward again where a checkpointed unit recomputes it."""
        return node.flops * node.backward_factor + (node.flops if node.name in self.recomputed else 0.0)

    @property
    def ops(self) -> list[Node]:
        """Nodes that compute a tensor (not inputs, parameters, output or size bookkeeping)."""
        return [n for n in self.nodes if n.kind in ("call_function", "call_method") and n.is_tensor]

    def forward_flops(self) -> float:
        return sum(n.flops for n in self.nodes)

    def train_flops(self) -> float:
        return sum(n.flops * (1.0 + n.backward_factor) for n in self.nodes)

    def param_bytes(self) -> int:
        return sum(n.nbytes for n in self.nodes if n.is_param)

    def largest_param_bytes(self) -> int:
        return max((n.nbytes for n in self.nodes if n.is_param), default=0)

    def saved_bytes_factor(self) -> dict[str, float]:
        """Tensors autograd keeps from forward for backward: name -> fraction of the tensor's
        bytes kept (1.0, or 1/itemsize for a dropout's boolean mask).

        A floating tensor is kept when an op's backward reads it: an input of a contraction
        (linear, matmul, einsum, conv2d), of mul / div, gelu, layer norm, max-pool or the loss,
        or the output of relu / tanh / sigmoid / exp / softmax. add, sub, views, sums, casts,
        concatenation and integer bookkeeping (one-hot, cumsum, comparisons) keep nothing.

        A dropout that drops nothing (p = 0, or not training) returns its input itself: what
        keeps its output keeps that input, and there is no mask. A product or quotient with a
        number keeps nothing (only the number; each tensor operand is kept for the other's
        gradient); counted per tensor it priced tiny ViT's ranks over what they hold
        (docs/cost-model.md, "Memory").

        A layer norm keeps its mean and reciprocal deviation beside (two floats a row), a
        max-pool where each maximum was (an int64 per output element); a slice
        kept (x[:, 0]) keeps its base's storage. The gradients backward holds besides, among
        them cross-entropy's (where the vocabulary is large, backward's peak), are
        grads_in_flight's.
        """
        return {t: f for t, (f, _) in self.kept_until().items()}

    def kept_until(self) -> dict[str, tuple[float, str]]:
        """saved_bytes_factor's tensors with, for each, the first op (in forward) that keeps it:
        autograd frees it once backward has passed that op, the last of its keepers to run
        backward. A tensor an op keeps as its own output is kept by that op."""
        keepers, masks = self.keepers(), self.own_saves()
        position = self._positions
        out = {
            t: (
                (self.kept_factor(t, keepers[t]) if t in keepers else 0.0) + masks.get(t, 0.0),
                min([*keepers.get(t, ()), *([t] if t in masks else [])], key=position.__getitem__),
            )
            for t in {**keepers, **masks}
        }
        for t in list(out):
            # A slice autograd keeps (ViT's class token, x[:, 0]) keeps its base's whole
            # storage: counted at the base's size, once, unless the base is kept itself.
            base = self._sliced_from(t)
            if base is not None:
                factor, keeper = out.pop(t)
                if base not in out:
                    out[t] = (factor * self[base].nbytes / max(self[t].nbytes, 1), keeper)
        return out

    def kept_factor(self, t: str, ops: Sequence[str], recomputing: bool = False) -> float:
        """What ops `ops`, each of which keeps `t`, keep of it, as a fraction of its bytes: the
        tensor once where one keeps it as it is, and each cast that one of them made of it
        (kept_casts). A checkpointed op keeps what the checkpoint holds, the tensor itself,
        unless `recomputing` (its unit's recompute, which makes the casts again)."""
        gone = () if recomputing else self.recomputed
        casts = [self.kept_casts[(t, k)] for k in ops if (t, k) in self.kept_casts and k not in gone]
        return (1.0 if len(casts) < len(ops) else 0.0) + sum(casts)

    @functools.cached_property
    def kept_casts(self) -> dict[tuple[str, str], float]:
        """(tensor, op) -> the bytes of the cast op keeps of tensor instead of it, as a
        fraction of its bytes: an op autocast ran in another dtype than the tensor's (`casts`)
        keeps the cast it made (a product keeps bf16 casts of its fp32 inputs)."""
        out: dict[tuple[str, str], float] = {}
        for t, ops in self._plain_saves[0].items():
            for k in ops:
                cast = self.casts.get(k)
                if cast is not None and cast != self[t].dtype:
                    out[(t, k)] = cast.itemsize / self[t].dtype.itemsize
        return out

    def keepers(self) -> dict[str, tuple[str, ...]]:
        """Floating tensor -> the ops whose backward reads its value (saved_bytes_factor's
        rules): the op itself for one that keeps its own output, its consumers for inputs. A
        dropout that drops nothing is its input."""
        return self._saves[0]

    def own_saves(self) -> dict[str, float]:
        """Tensor -> bytes, as a fraction of its own, that the op making it keeps beside the
        value: a dropout's boolean mask, a max-pool's int64 indices (one per output element),
        a layer norm's mean and reciprocal deviation (two floats per normalised row)."""
        return self._saves[1]

    @functools.cached_property
    def _saves(self) -> tuple[dict[str, tuple[str, ...]], dict[str, float]]:
        """(keepers, own saves) of training as it runs: a checkpointed unit's ops keep nothing
        for backward (their saves are made again by the recompute), and the first op of the
        unit stands for the checkpoint, which holds the unit's inputs until backward has passed
        the unit."""
        keepers, masks = self._plain_saves
        if not self.recompute:
            return keepers, masks
        gone = self.recomputed
        out = {t: [k for k in ops if k not in gone] for t, ops in keepers.items()}
        for unit in self.recompute:
            for t in self.unit_inputs(unit):
                out.setdefault(t, []).append(unit[0])
        return (
            {t: tuple(ops) for t, ops in out.items() if ops},
            {t: f for t, f in masks.items() if t not in gone},
        )

    def unit_inputs(self, unit: Sequence[str]) -> list[str]:
        """The tensors a checkpointed unit reads that are made before it (parameters and
        buffers aside): what the checkpoint keeps for the recompute. A dropout that drops
        nothing is its input."""
        inside = set(unit)
        out: dict[str, None] = {}
        for name in unit:
            for i in self[name].inputs:
                src = self[i]
                if i in inside or src.kind == "get_attr" or src.is_param or not src.is_tensor:
                    continue
                out[self._alias_base(i)] = None
        return list(out)

    def _alias_base(self, name: str) -> str:
        alias = self._dropout_alias
        while name in alias:
            name = alias[name]
        return name

    @functools.cached_property
    def _dropout_alias(self) -> dict[str, str]:
        return {n.name: n.inputs[0] for n in self.ops if n.op == "dropout" and self._is_view(n.name)}

    def recompute_windows(self) -> list[tuple[str, str, str, float]]:
        """What a checkpointed unit's recompute holds in its backward: (tensor, from, to,
        bytes) per tensor the unit makes and its ops keep, live while backward is at an op
        from `from` (its first keeper in the unit: backward frees it there) to `to` (the unit's
        last op, where backward recomputes the unit), as grads_in_flight's spans."""
        if not self.recompute:
            return []
        keepers, masks = self._plain_saves
        position = self._positions
        out = []
        for unit in self.recompute:
            inside = set(unit)
            last = max(unit, key=position.__getitem__)
            for t in unit:
                ks = [k for k in keepers.get(t, ()) if k in inside]
                mask = masks.get(t, 0.0)
                if not ks and not mask:
                    continue
                first = min([*ks, *([t] if mask else [])], key=position.__getitem__)
                kept = self.kept_factor(t, ks, recomputing=True) if ks else 0.0
                out.append((t, first, last, self[t].nbytes * (kept + mask)))
        return out

    @functools.cached_property
    def _plain_saves(self) -> tuple[dict[str, tuple[str, ...]], dict[str, float]]:
        base, alias = self._alias_base, self._dropout_alias
        keepers: dict[str, list[str]] = {}
        masks: dict[str, float] = {}
        for n in self.ops:
            if n.op in _SAVES_OUTPUT:
                keepers.setdefault(n.name, []).append(n.name)
            if n.op == "dropout" and n.name not in alias and n.shape is not None and n.dtype is not None:
                masks[n.name] = 1.0 / n.dtype.itemsize
            if n.op == "max_pool2d" and n.shape:
                masks[n.name] = 8.0 / n.dtype.itemsize
            if n.op == "layer_norm" and n.shape:
                masks[n.name] = 2.0 / math.prod(_normalized_shape(n))
            operands = [i for i in n.inputs if self[i].is_tensor]
            if n.op in _SAVES_INPUTS and not (n.op in _BY_A_NUMBER and len(operands) < 2):
                for i in dict.fromkeys(map(base, operands)):
                    src = self[i]
                    if not src.is_param and src.dtype is not None and src.dtype.is_floating_point:
                        keepers.setdefault(i, []).append(n.name)
        return {t: tuple(ops) for t, ops in keepers.items()}, masks

    def _sliced_from(self, name: str) -> str | None:
        """The tensor whose storage `name` is a smaller view of (a select or slice, then any
        views), or None when it is not one."""
        n = self[name]
        if n.op not in ("select", "slice") or not n.inputs or self[n.inputs[0]].shape is None:
            return None
        base = n.inputs[0]
        while self[base].op in VIEW_OPS and self[base].op != "getitem" and self[base].inputs:
            base = self[base].inputs[0]
        return base if self[base].nbytes > n.nbytes else None

    def _last_use(self, name: str) -> str:
        """The op of `name`'s last use in forward, through views (`name` itself if unused)."""
        position = self._positions
        users = [self._last_use(u) if self._is_view(u) else u for u in self.users.get(name, [])]
        return max(users, key=position.__getitem__, default=name)

    @functools.cached_property
    def _positions(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}

    def _is_view(self, name: str) -> bool:
        """Whether `name` shares its input's storage (and its gradient the input's gradient's):
        a view op, or an element of a split's tuple, but not an element of another op's tuple
        (topk's values are their own tensor)."""
        n = self[name]
        if n.op == "dropout":
            return not _drops(n)  # returns its input itself
        if n.op == "getitem" and n.inputs and self[n.inputs[0]].shape is None:
            return self[n.inputs[0]].op in VIEW_OPS
        return n.op in VIEW_OPS

    def grad_ready(self) -> dict[str, str]:
        """Parameter -> the op of its last use in forward, through views: backward makes the
        parameter's gradient there (the first of its uses backward reaches)."""
        return {n.name: self._last_use(n.name) for n in self.nodes if n.is_param}

    def grads_in_flight(self) -> list[tuple[str, str, str, float]]:
        """The gradients of activations backward holds: (tensor, from, to, factor) each live
        while backward is at an op from `from` to `to` (forward order), its bytes `tensor`'s
        times `factor`.

        A tensor's gradient is made by the backward of its last use (through views) and
        consumed by that of the op that made it. Where that last use is a sum of same-shaped
        operands (a residual connection: x + f(x)), backward hands the sum's gradient itself
        to them: one storage, live until the last of them is consumed. Only tensors that need
        a gradient (floating, made from a parameter) have one. cross_entropy's one op is two
        inside (log_softmax, nll_loss): its backward also holds the log-probabilities'
        gradient, the size of its input. Under autocast (`casts`) an op's backward makes the
        gradient of each input it cast at the cast's dtype, then casts it back: that first
        gradient is held at the op too. cross_entropy's then holds the log-probabilities' and
        the cast's gradients (two of the cast's size), and the cast's beside its input's once
        the first is freed: its extra is what the larger of the two leaves beside the cast's
        and the input's (docs/cost-model.md, "Memory")."""
        needs: dict[str, bool] = {}
        owner: dict[str, str] = {}  # tensor -> the tensor whose gradient storage it shares
        span: dict[str, list] = {}  # owner -> [from, to] (op names)
        extra: list[tuple[str, str, str, float]] = []
        for n in self.nodes:
            floating = n.dtype is not None and n.dtype.is_floating_point
            needs[n.name] = n.is_param or (
                floating and n.kind in ("call_function", "call_method") and any(needs.get(i, False) for i in n.inputs)
            )
            cast = self.casts.get(n.name)
            if n.op == "cross_entropy" and n.inputs and needs.get(n.inputs[0], False):
                first = self[n.inputs[0]]
                size = first.dtype.itemsize
                extra.append((first.name, n.name, n.name, 1.0 if cast is None else max(cast.itemsize - size, 0) / size))
            if cast is not None:
                for i in dict.fromkeys(n.inputs):
                    src = self[i]
                    if needs.get(i, False) and not src.is_param and src.dtype is not None and src.dtype != cast:
                        extra.append((i, n.name, n.name, cast.itemsize / src.dtype.itemsize))
        for n in reversed(self.nodes):  # a sum's gradient exists before its operands'
            if not needs[n.name] or n.is_param or not n.shape or self._is_view(n.name):
                continue
            last = self._last_use(n.name)
            if last == n.name:
                continue
            user = self[last]
            shares = (
                (user.op == "add" or (user.op == "sub" and self._operand(last, 0) == n.name))
                and user.shape == n.shape
                and user.name in owner
            )
            if shares:
                owner[n.name] = owner[user.name]
                span[owner[n.name]][0] = n.name  # consumed later in backward: earlier in forward
            else:
                owner[n.name] = n.name
                span[n.name] = [n.name, last]
        return [(t, a, b, 1.0) for t, (a, b) in span.items()] + extra

    def _operand(self, name: str, k: int) -> str | None:
        """The tensor (through views) that is operand `k` of op `name`."""
        args = [a for a in self[name].fx_node.args if isinstance(a, fx.Node)]
        if k >= len(args):
            return None
        t = args[k].name
        while self._is_view(t) and self[t].inputs:
            t = self[t].inputs[0]
        return t

    def backward_memory(self) -> tuple[list[tuple[int, float]], list[tuple[int, float]], list[tuple[int, int, float]]]:
        """(gradients, activations, gradients in flight) as bench.core.program.backward_sweep reads
        them: each parameter's bytes at the position its gradient is made (grad_ready), each
        kept tensor's bytes (activation_bytes' share) at the position after which backward
        frees it, each activation gradient's bytes over the positions it lives (grads_in_flight),
        and with checkpointed units what their recomputes hold, over the same kind of span
        (recompute_windows)."""
        position = self._positions
        grads = [(position[op], float(self[t].nbytes)) for t, op in self.grad_ready().items()]
        acts = [(position[op], self[t].nbytes * f) for t, (f, op) in self.kept_until().items()]
        flight = [(position[a], position[b], self[t].nbytes * f) for t, a, b, f in self.grads_in_flight()]
        flight += [(position[a], position[b], x) for _, a, b, x in self.recompute_windows()]
        return grads, acts, flight

    def peak_bytes_in_flight(self) -> float:
        """The most bytes of activation gradients backward holds at once (grads_in_flight), and
        of a checkpointed unit's recompute beside them (recompute_windows)."""
        change: dict[int, float] = {}
        for a, b, nbytes in self.backward_memory()[2]:
            change[b] = change.get(b, 0.0) + nbytes  # made there
            change[a - 1] = change.get(a - 1, 0.0) - nbytes  # gone after it
        held = peak = 0.0
        for pos in sorted(change, reverse=True):  # backward's order
            held += change[pos]
            peak = max(peak, held)
        return peak

    def activation_bytes(self) -> float:
        """Bytes forward keeps for backward at this batch (saved_bytes_factor), parameters excluded."""
        return sum(self[t].nbytes * f for t, f in self.saved_bytes_factor().items())

    def layer_profile(self) -> list[tuple[float, float, str, int, float, int]]:
        """(forward FLOPs per sample, parameter bytes, op class of most of its FLOPs, ops that
        compute, backward FLOPs per sample, of those ops the ones a checkpointed unit runs again
        in backward) per parameter-holding op in forward order; parameter-free ops are counted
        with the next op that holds parameters. Backward FLOPs are backward_flops', as the
        planner prices them. The input of methods.dp_program.data_parallel_program."""
        out: list[tuple[float, float, str, int, float, int]] = []
        classes: dict[str, float] = {}
        ops = again = 0
        bwd = 0.0
        batch = max(self.batch_size, 1)
        for n in self.nodes:
            f = n.flops / batch
            if f:
                classes[op_class(n.op)] = classes.get(op_class(n.op), 0.0) + f
                ops += 1
                again += n.name in self.recomputed
                bwd += self.backward_flops(n) / batch
            params = [self[i] for i in n.inputs if self[i].is_param]
            if params and n.kind != "output":
                out.append(
                    (
                        sum(classes.values()),
                        float(sum(p.nbytes for p in params)),
                        max(classes, key=classes.get) if classes else "other",
                        ops,
                        bwd,
                        again,
                    )
                )
                classes, ops, again, bwd = {}, 0, 0, 0.0
        if out and (classes or ops):
            f, p, cls, k, b, r = out[-1]
            out[-1] = (f + sum(classes.values()), p, cls, k + ops, b + bwd, r + again)
        elif not out:
            cls = max(classes, key=classes.get) if classes else "other"
            out.append((sum(classes.values()), 0.0, cls, ops, bwd, again))
        return out


# Ops whose output aliases or merely re-labels the input (no FLOPs, no new activation).
VIEW_OPS = {
    "view",
    "reshape",
    "flatten",
    "unflatten",
    "transpose",
    "permute",
    "unsqueeze",
    "squeeze",
    "expand",
    "contiguous",
    "getitem",
    "t",
    "to",
    "type",
    "float",
    "detach",
    "size",
    "getattr",
    "alias",
    "select",
    "slice",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "narrow",
    "clone",
    "view_as",
    "expand_as",
    "movedim",
    "type_as",
    "lift_fresh_copy",
}

# Ops whose backward reads their floating, non-parameter inputs, and ops whose backward reads
# their own output (Graph.saved_bytes_factor; PyTorch's autograd formulas).
_SAVES_INPUTS = {
    "linear",
    "matmul",
    "bmm",
    "mm",
    "addmm",
    "baddbmm",
    "einsum",
    "conv2d",
    "mul",
    "truediv",
    "div",
    "gelu",
    "silu",
    "layer_norm",
    "batch_norm",
    "max_pool2d",
    "log",
    "cross_entropy",
    "nll_loss",
    "pow",
    "cos",
    "sin",
    "scaled_dot_product_attention",
}
_SAVES_OUTPUT = {
    "relu",
    "tanh",
    "sigmoid",
    "exp",
    "softmax",
    "log_softmax",
    "sqrt",
    "rsqrt",
    "scaled_dot_product_attention",
}
_BY_A_NUMBER = {"mul", "truediv", "div"}  # with one tensor operand, their backward keeps none


def _normalized_shape(node: Node) -> tuple[int, ...]:
    """A layer_norm node's normalized_shape (aten.layer_norm's second argument)."""
    args = node.fx_node.args
    shape = args[1] if len(args) > 1 else node.shape[-1:]
    return (shape,) if isinstance(shape, int) else tuple(int(x) for x in shape)


def _drops(node: Node) -> bool:
    """Whether a dropout node drops anything: p > 0 while training (aten.dropout(input, p, train))."""
    args = node.fx_node.args
    p = args[1] if len(args) > 1 else 0.5
    training = args[2] if len(args) > 2 else True
    return bool(training) and float(p) > 0.0


def _is_tensorish(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or (
        isinstance(v, (tuple, list)) and bool(v) and all(isinstance(x, torch.Tensor) for x in v)
    )


def autocast_dtypes(
    gm: fx.GraphModule, device_type: str, dtype: torch.dtype
) -> tuple[dict[str, torch.dtype], dict[str, torch.dtype], dict[str, frozenset[str]]]:
    """(node -> the dtype of its value, op -> the dtype autocast ran it in where its floating
    inputs were of another, such an op -> the inputs autocast cast themselves rather than a
    view of them inside the op) when `gm` runs under autocast to `dtype` on `device_type`: its
    nodes run again on fake tensors of that device type with autocast on, so every op takes
    the dtype autocast's own rules for that device give it (a matrix product's lower, a
    CUDA layer norm's fp32), with no device of that type needed. An op that cannot run on fake
    tensors (a shape that depends on values) keeps its captured value."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_flatten, tree_map

    def fake(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty(v.shape, dtype=v.dtype, device=device_type)
        return v

    def on_device(v: Any) -> Any:
        return torch.device(device_type) if isinstance(v, torch.device) and v.type == "meta" else v

    def first_tensor(v: Any) -> torch.Tensor | None:  # a value's (a tuple's first) tensor
        return next((t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)), None)

    env: dict[fx.Node, Any] = {}
    dtypes: dict[str, torch.dtype] = {}
    casts: dict[str, torch.dtype] = {}
    direct: dict[str, frozenset[str]] = {}
    copies = _CastsSeen()
    was = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    with FakeTensorMode(), torch.no_grad():
        torch.set_autocast_enabled(device_type, True)  # (torch.autocast refuses a type this host lacks)
        torch.set_autocast_dtype(device_type, dtype)
        torch.autocast_increment_nesting()
        try:
            for n in gm.graph.nodes:
                if n.op == "output":
                    continue
                if n.op == "get_attr":
                    value = fake(functools.reduce(getattr, n.target.split("."), gm))
                elif n.op == "call_function":
                    args = tree_map(on_device, fx.node.map_arg(n.args, env.__getitem__))
                    kwargs = tree_map(on_device, fx.node.map_arg(n.kwargs, env.__getitem__))
                    copies.seen.clear()
                    try:
                        with copies:
                            value = n.target(*args, **kwargs)
                    except Exception:  # a value-dependent shape: the captured value
                        value = tree_map(fake, n.meta.get("val"))
                    ins = [a.dtype for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
                    floats = [d for d in ins if d.is_floating_point]
                    out = first_tensor(value)
                    if out is not None and out.dtype.is_floating_point and any(d != out.dtype for d in floats):
                        # autocast cast its inputs where the op alone gives another dtype (or refuses them)
                        torch.set_autocast_enabled(device_type, False)
                        quiet = logging.getLogger("torch._subclasses.fake_tensor")
                        level = quiet.level
                        quiet.setLevel(logging.CRITICAL)  # (it logs what the op refuses)
                        try:
                            alone = first_tensor(n.target(*args, **kwargs))
                        except Exception:  # inputs of unlike dtypes it takes only cast
                            alone = None
                        finally:
                            quiet.setLevel(level)
                            torch.set_autocast_enabled(device_type, True)
                        if alone is None or alone.dtype != out.dtype:
                            casts[n.name] = out.dtype
                            direct[n.name] = frozenset(
                                i.name for i in n.all_input_nodes if id(env.get(i)) in copies.seen
                            )
                else:
                    value = tree_map(fake, n.meta.get("val"))
                env[n] = value
                first = first_tensor(value)
                if first is not None:
                    dtypes[n.name] = first.dtype
        finally:
            torch.autocast_decrement_nesting()
            torch.set_autocast_enabled(device_type, was[0])
            torch.set_autocast_dtype(device_type, was[1])
    return dtypes, casts, direct


class _CastsSeen(TorchDispatchMode):
    """The tensors an op's dispatch copied to another dtype (by id): what autocast cast itself,
    where an input it casts inside the op's decomposition is a view of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args:
            self.seen.add(id(args[0]))
        return func(*args, **(kwargs or {}))


def capture(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    batch_size: int | None = None,
    what: str = "the model",
    batch_norm: str = "sync",
) -> Graph:
    """Export `model` and give every node its shape and FLOPs.

    Args:
        model: the single-device model whose forward returns the summed loss. Put it on the
            meta device (``with torch.device('meta'): model = cfg.build()``) for big models.
        example_inputs: positional inputs of forward at the global batch (meta or real).
        batch_size: samples in the inputs (default: dim 0 of the first input).
        what: how error messages name the model.
        batch_norm: "sync" (statistics over the whole batch) or "local" (each shard's own),
            methods.export.export_model.

    Raises:
        CaptureError: export refused the model, or its forward is not one summed loss.
    """
    gm = export_model(model, example_inputs, what, batch_norm)
    if batch_size is None:
        first = next((t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim()), None)
        batch_size = int(first.shape[0]) if first is not None else 1
    return graph_of(gm, batch_size, what)


def graph_of(gm: fx.GraphModule, batch_size: int, what: str = "the model") -> Graph:
    """The Graph of a planner's module (methods.export.export_model's, or the cache's):
    every node with its shape, dtype and FLOPs."""
    params = {name for name, _ in gm.named_parameters()}
    nodes = []
    loss = None
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        tuple_shapes = None
        if isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val):
            tuple_shapes = tuple(tuple(v.shape) for v in val)
        dtype = val.dtype if isinstance(val, torch.Tensor) else (val[0].dtype if tuple_shapes else None)
        inputs_of = [a.name for a in n.all_input_nodes if _is_tensorish(a.meta.get("val"))]
        name = op_name(n)
        flops, bwd = 0.0, 0.0
        if n.op == "call_function" and name != "getitem":
            args = fx.node.map_arg(n.args, lambda a: a.meta.get("val"))
            flops, bwd = count_flops(name, args, val, ELEMENTWISE_FLOPS, VIEW_OPS)
        if n.op == "output":
            loss = n.all_input_nodes[0].name
        nodes.append(
            Node(
                n.name,
                n.op,
                name,
                n,
                inputs_of,
                shape,
                dtype,
                flops,
                bwd,
                n.op == "get_attr" and n.target in params,
                tuple_shapes,
                [],
            )
        )
    assert loss is not None, "exported graph has no output"
    graph = Graph(gm, nodes, loss, batch_size)
    if graph[loss].shape != ():
        raise CaptureError(
            f"{what}: forward returns shape {graph[loss].shape}; the planner needs a scalar loss "
            "summed over the batch (reduction='sum') computed inside forward"
        )
    return graph


# Graphs of model configs captured in this process: a case captures its model for the FLOP
# count, each method's plan and the runtime's check; a comparison does so for every method.
_captured: OrderedDict[tuple, Graph] = OrderedDict()
_CAPTURED_KEEP = 8  # a bf16 case keeps its priced view (capture_priced) beside each capture


def capture_config(
    model_cfg: Any, batch_size: int, seed: int = 0, batch_norm: str = "sync", model: nn.Module | None = None
) -> Graph:
    """Build `model_cfg` on the meta device and capture it at `batch_size` samples: the graph of
    an equal config, batch and batch_norm is captured once per process, and kept on disk
    (methods.graph_cache) for later processes.

    `model`: the model already built from `model_cfg` (a worker's), whose meta-device twin is
    exported where no graph is kept: about 1.5 s faster in a fresh process than building the
    model on the meta device, whose initialisers pull in torch's reference kernels."""
    key = (type(model_cfg), repr(model_cfg), int(batch_size), batch_norm)
    graph = _captured.get(key)
    if graph is not None:
        _captured.move_to_end(key)
        return graph
    what = f"model {getattr(model_cfg, 'name', type(model_cfg).__name__)}"
    stored = graph_cache.graph_key(model_cfg, batch_size, batch_norm) if graph_cache.enabled() else None
    gm = None if stored is None else graph_cache.load_module(stored)
    if gm is None:
        gm = _export_config(model_cfg, batch_size, seed, batch_norm, what, model)
        if stored is not None:
            graph_cache.save_module(stored, gm)
            if not module_has_batch_norm(gm):  # both captures of batch norm are this graph
                for other in {"sync", "local"} - {batch_norm}:
                    graph_cache.save_module(graph_cache.graph_key(model_cfg, batch_size, other), gm)
    graph = graph_of(gm, int(batch_size), what)
    _captured[key] = graph
    if not module_has_batch_norm(gm):
        # Both captures of batch norm are this graph (as the graph cache keeps it): the other is
        # not read back from disk in this process (auto's space and hap's plan capture them both).
        for other in {"sync", "local"} - {batch_norm}:
            _captured.setdefault(key[:3] + (other,), graph)
    while len(_captured) > _CAPTURED_KEEP:
        _captured.popitem(last=False)
    return graph


def capture_priced(
    model_cfg: Any, batch_size: int, precision: str, device_type: str, batch_norm: str = "sync"
) -> Graph:
    """The graph a plan is priced on: capture_config's, as it runs at `precision` on devices
    of `device_type` (a cluster's `device`): under bf16 autocast's dtypes (Graph.at_autocast),
    so each tensor's bytes, in memory and on the wire, are those the ranks hold and send.
    Kept per process beside the captures."""
    graph = capture_config(model_cfg, batch_size, batch_norm=batch_norm)
    if precision != "bf16":
        return graph
    key = (type(model_cfg), repr(model_cfg), int(batch_size), batch_norm, "bf16", device_type)
    view = _captured.get(key)
    if view is None or view.gm is not graph.gm:
        view = _captured[key] = graph.at_autocast(device_type, torch.bfloat16)
        while len(_captured) > _CAPTURED_KEEP:
            _captured.popitem(last=False)
    return view


def module_has_batch_norm(gm: fx.GraphModule) -> bool:
    """Whether a captured model ran a batch norm module (under either capture of it)."""
    for n in gm.graph.nodes:
        for _path, kind in (n.meta.get("nn_module_stack") or {}).values():
            if "BatchNorm" in str(kind):
                return True
    return False


def _export_config(
    model_cfg: Any,
    batch_size: int,
    seed: int,
    batch_norm: str,
    what: str,
    model: nn.Module | None,
    stack_traces: bool = False,
) -> fx.GraphModule:
    """The planner's module of `model_cfg` at `batch_size` (capture_config).

    Exported without the nodes' stack traces (torch symbolizes a traceback per node, a
    noticeable part of an export), unless `stack_traces`: nothing the planner reads of a graph
    holds them (one read back from the graph cache has none either), only the messages of a
    capture that is refused quote them, so a capture that fails is made again with them. The
    export's own intermediate graph modules write their Python code only where it runs
    (torch's lazy graph modules); the module returned is a plain fx.GraphModule either way."""
    # One sample says each input's dtype and shape past the batch dim; the values are never
    # read, and drawing a whole paper-size batch would cost a noticeable part of a plan
    sample = model_cfg.synthetic_batch(1, torch.Generator().manual_seed(seed))
    batch = [torch.empty((batch_size, *t.shape[1:]), dtype=t.dtype, device="meta") for t in sample]
    given = model
    if model is None:
        model = build_on_meta(model_cfg)
    else:  # a twin on the meta device that shares nothing with the model
        memo: dict[int, Any] = {
            id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()
        }
        memo.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
        model = copy.deepcopy(model, memo)
    if stack_traces:
        return export_model(model, batch, what, batch_norm)
    try:
        with mock.patch.object(torch.fx.config, "do_not_emit_stack_traces", True), _use_lazy_graph_module(True):
            return export_model(model, batch, what, batch_norm)
    except Exception:  # refused: captured again for the message as it reads with them
        return _export_config(model_cfg, batch_size, seed, batch_norm, what, given, stack_traces=True)
