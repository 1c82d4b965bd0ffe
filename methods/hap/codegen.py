"""Per-rank code of a synthesized program: the captured fx graph run on local shards.

`RankProgram` is built once per rank from the plan (docs/planner.md "Plan format"): it slices
the parameters of the full, seeded single-device model to this rank's shards, and compiles the
plan's steps into a list of instructions over the fx graph's nodes, with the collectives of
methods.hap.collectives inserted where the plan puts them. Calling it with this rank's share of
a batch returns this rank's part of the summed loss (Reduce: the parts add up to the loss of the
global batch). It does not plan, train or time anything (methods.hap.runtime does).

The first call interprets the instructions and records every tensor it makes as a node of a
new fx graph (shard lengths, sizes and which ops see an empty shard are fixed for a rank, so
they become constants); later calls run that GraphModule, straight-line code with no per-node
dispatch (`RankProgram.module.code`). With activation checkpoints, the recording is cut into
sub-modules at the checkpointed units' borders and each unit's runs under
torch.utils.checkpoint (its collectives with it: the recompute issues them again in backward).

One module because it is one class: compiling the steps, interpreting them once and recording
the result share the instruction format and the rank's fixed shard sizes; split, each part
would reach into the others' state.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from bench.core.shares import offsets
from methods.graph import Graph, Node
from methods.hap import collectives as C
from methods.hap import hierarchy as H
from methods.hap.balance import shard_lengths
from methods.hap.steps import Step, comm_from_json
from methods.hap.theory import IDENTITY, REDUCE, CommRule, Layout, Rule, derive_theory, explicit_size_args

SUPPORTED_PLAN_FORMAT = 1
_MOVES = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "slice", "keep_first", "reshard"}


class PlanMismatchError(ValueError):
    """A plan that does not fit the model, batch or world it is asked to run on."""


@dataclass
class CodegenOptions:
    """Overrides for tests and ablations (default: run the plan as it is).

    Attributes:
        force_impl: "padded" | "grouped": every all-gather / reduce-scatter (and SFB's
            factor gathers) uses this implementation instead of the plan's choice.
        force_sfb: run every data-parallel linear with a replicated weight as SFB (gather the
            input and output gradient, rebuild the full weight gradient) instead of
            all-reducing its weight gradient.
        check_shapes: compare every op's local output shape with the plan's (cheap; the first
            mismatch names the node).
        bucket_grads: replicated parameters' gradients are left partial by the program and
            listed in `RankProgram.grad_sync` for the trainer to all-reduce in buckets (as DDP
            and the simulator do); off: every use goes through `replicate`, whose backward
            all-reduces that use's gradient alone.
        compile: the first call interprets the plan and records what it ran as an fx
            GraphModule (`RankProgram.module`), which every later call runs; off: every call
            interprets (the reference the recording is made from).
    """

    force_impl: str | None = None
    force_sfb: bool = False
    check_shapes: bool = True
    bucket_grads: bool = True
    compile: bool = True

    def __post_init__(self) -> None:
        if self.force_impl is not None and self.force_impl not in C.IMPLS:
            raise ValueError(f"force_impl={self.force_impl!r} is unknown; known: {', '.join(C.IMPLS)}")


@dataclass
class _Instr:
    """One compiled step: its source creations, collectives and the op."""

    step: Step
    node: Node
    sfb: bool
    comms: list[CommRule]
    sources: list[tuple[str, Layout]]
    layouts: dict[str, Layout]  # input tensor -> layout it is read in
    out_shape: tuple | None  # expected local shape (tensor outputs), tuple of shapes for tuples
    replicate: set[str] = field(default_factory=set)  # Identity parameters whose use all-reduces


def plan_units(details: dict) -> dict[int, int]:
    """Dim length -> shard unit, from the plan's `shard_units` (docs/planner.md)."""
    return {int(k): int(v) for k, v in details.get("shard_units", {}).items()}


def graph_fingerprint(graph: Graph) -> str:
    """A short hash of the reference graph's node names, ops and shapes: a plan records it, and
    codegen refuses a plan whose graph (model, preset or global batch) is another one."""
    h = hashlib.sha256()
    for n in graph.nodes:
        h.update(f"{n.name}|{n.op}|{n.shape}|{n.tuple_shapes};".encode())
    return h.hexdigest()[:16]


def check_plan(
    details: dict, ratios, batch_shares: Sequence[int], graph: Graph, world_size: int, num_devices: int | None = None
) -> None:
    """Raise PlanMismatchError unless the plan fits `graph` (the model at its preset and global
    batch) and `world_size` ranks over `num_devices` virtual devices (default: one per rank;
    machine-level plans: one per machine). Cheap: call it before starting workers."""
    fmt = details.get("plan_format")
    if fmt != SUPPORTED_PLAN_FORMAT:
        raise PlanMismatchError(f"plan_format={fmt!r}: this codegen reads plan format {SUPPORTED_PLAN_FORMAT}; re-plan")
    if "steps" not in details:
        raise PlanMismatchError("the plan has no synthesized steps (details['steps']); re-plan")
    segments = 1 + max((int(s["segment"] if isinstance(s, dict) else s.segment) for s in details["steps"]), default=0)
    if not ratios or len(ratios) < segments or any(len(row) != len(ratios[0]) for row in ratios):
        raise PlanMismatchError(
            f"ratios {ratios!r}: the plan's steps use {segments} ratio rows (segments) of equal length"
        )
    num_devices = world_size if num_devices is None else num_devices
    if len(ratios[0]) != num_devices or len(batch_shares) != world_size:
        raise PlanMismatchError(
            f"the plan has {len(ratios[0])} virtual devices and {len(batch_shares)} batch shares; the run has "
            f"{num_devices} virtual devices and {world_size} ranks (one batch share per rank)"
        )
    if sum(batch_shares) != graph.batch_size:
        raise PlanMismatchError(
            f"batch shares {list(batch_shares)} sum to {sum(batch_shares)}, but the global batch is {graph.batch_size}"
        )
    want = details.get("graph_fingerprint")
    if want is not None and want != graph_fingerprint(graph):
        raise PlanMismatchError(
            "the plan was made for another graph (model, preset or global batch): "
            "its graph_fingerprint differs; re-plan"
        )
    if details.get("loss", graph.loss) != graph.loss:
        raise PlanMismatchError(f"plan loss {details['loss']!r} is not the model's loss node {graph.loss!r}")
    known = {n.name: n for n in graph.nodes}
    for s in details["steps"]:
        name = s["node"] if isinstance(s, dict) else s.node
        pre = s["pre"] if isinstance(s, dict) else s.rule.pre
        if name not in known:
            raise PlanMismatchError(
                f"plan step for fx node {name!r}, which the model's graph does not have; "
                "the plan was made for another model or preset"
            )
        if len(pre) != len(known[name].inputs):
            raise PlanMismatchError(
                f"plan step {name!r} has {len(pre)} input layouts, the model's node has "
                f"{len(known[name].inputs)} tensor inputs"
            )


class RankProgram:
    """The synthesized program as rank `rank` of `world_size` runs it.

    Args:
        graph: the reference graph (methods.graph.capture of the model at the global batch).
        details: plan.details of a HAP plan (steps, final_comms, loss, shard_units).
        ratios: plan.ratios (one row per segment; a step's Gather shards follow its segment's
            row, inputs are loaded by row 0).
        batch_shares: plan.batch_shares (samples each rank loads).
        model: the full single-device model, initialised as on every other rank.
        rank, world_size: this process's place in `group`.
        machines: for a machine-level plan (one ratio per machine), this rank's place among the
            machines (methods.hap.hierarchy): the program then runs data parallel inside each
            machine, its collectives in three steps. None: one virtual device per rank.
        checkpoints: the activation checkpoints, each the ops of one unit (contiguous steps):
            the recorded program runs each as a checkpointed sub-module.
        outputs: for a program of part of a model (a pipeline stage: `graph` is its ops, the
            tensors crossing into it placeholders), the tensors it hands on; empty for a whole
            model. The program then returns them (a tuple, in `outputs` order) instead of a
            loss, each in the layout the graph's loss step reads it in: that step is a node
            that reads exactly these tensors and only states their layouts (its collectives
            run, its op does not).
        group: the process group the program's ranks are (its collectives, the gather of
            inputs it wants in another layout, `full_tensors`); None: the default group, all
            ranks. A pipeline stage's program runs over its stage's ranks.
    """

    def __init__(
        self,
        graph: Graph,
        details: dict,
        ratios: Sequence[Sequence[float]],
        batch_shares: Sequence[int],
        model: nn.Module,
        rank: int,
        world_size: int,
        options: CodegenOptions | None = None,
        machines: H.Machines | None = None,
        checkpoints: Sequence[Sequence[str]] = (),
        outputs: Sequence[str] = (),
        group=None,
    ):
        self.graph = graph
        self.group = group
        self.options = options or CodegenOptions()
        self.rank, self.world_size = rank, world_size
        self.machines = machines
        # This rank's virtual device (its machine for a machine-level plan) and their number.
        self.vrank = rank if machines is None else machines.index
        self.vworld = world_size if machines is None else machines.count
        check_plan(details, ratios, batch_shares, graph, world_size, self.vworld)
        self.ratios = [[float(x) for x in row] for row in ratios]
        self.batch_shares = [int(x) for x in batch_shares]
        self.steps = [Step.from_json(s) if isinstance(s, dict) else s for s in details["steps"]]
        self.final_comms = [comm_from_json(c) if isinstance(c, dict) else c for c in details.get("final_comms", [])]
        self.loss = graph.loss
        self.outputs = list(outputs)
        if self.outputs and (graph[self.loss].inputs != self.outputs or self.final_comms):
            raise PlanMismatchError(
                f"outputs {self.outputs}: the plan's last step {self.loss!r} must read exactly them "
                f"(it reads {graph[self.loss].inputs}) and no collective may follow it"
            )
        self.units = plan_units(details)
        self._placeholders = [n.name for n in graph.nodes if n.kind == "placeholder"]
        self.params: dict[str, nn.Parameter] = {}  # qualified name -> local parameter
        self.param_layouts: dict[str, Layout] = {}
        self.param_segments: dict[str, int] = {}  # whose row a Gather'd parameter is sliced by
        self.sharded: set[str] = set()  # parameters whose local value is a slice
        self.home: dict[str, int] = {}  # tensor -> the segment whose row its Gather shards follow
        self._source_values: dict[str, Any] = {}
        # Machine-level plans: each tensor's layout inside a machine (its batch dim, or IDENTITY
        # for what does not depend on the samples; REDUCE for a sum over them, the loss).
        self.intra: dict[str, Layout] = {}
        # Machine-level plans: per op, its inputs whole inside the machine that it reads cut
        # along their batch dim (_set_intra).
        self._cuts: dict[str, dict[str, int]] = {}
        # Where this rank computes: ops that make tensors from nothing (arange, ones) were
        # captured with the capture's device (often meta) and run on this one.
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._instrs = self._compile(model)
        self._dead_after = self._last_reads()
        self._module: fx.GraphModule | None = None
        self._rec: _Recorder | None = None
        self._unit_of = self._checkpoint_instrs(checkpoints)

    def _checkpoint_instrs(self, checkpoints: Sequence[Sequence[str]]) -> dict[int, int]:
        """Instruction -> the checkpoint it is in (each unit's instructions are consecutive)."""
        out: dict[int, int] = {}
        for u, names in enumerate(checkpoints):
            names = set(names)
            idx = [i for i, ins in enumerate(self._instrs) if ins.node.name in names]
            if idx and idx[-1] - idx[0] + 1 != len(idx):
                raise PlanMismatchError(
                    f"checkpoint {u}'s ops are not consecutive steps of the plan; re-plan "
                    "(method.activation_checkpointing=false runs it without checkpoints)"
                )
            out.update((i, u) for i in idx)
        return out

    # -- shapes ----------------------------------------------------------------------------
    def lengths(self, length: int, segment: int = 0) -> list[int]:
        """Every rank's shard length of a Gather'd dim of `length` under a segment's ratio row
        (docs/planner.md)."""
        return shard_lengths(int(length), self.ratios[segment], self.units.get(int(length), 1))

    def _read_layout(self, tensor: str, layout: Layout, segment: int) -> Layout | tuple:
        """The env key's layout an op of `segment` reads `tensor` in: a Gather from another
        segment's row is the resharded copy (layout, segment)."""
        other_row = isinstance(layout, int) and self.home.get(tensor, segment) != segment
        return (layout, segment) if other_row and self._dim_len(tensor, layout) > 1 else layout

    def _dim_len(self, tensor: str, dim: int) -> int:
        node = self.graph[tensor]
        shape = node.shape if node.shape is not None else node.tuple_shapes[0]
        return int(shape[dim])

    def _machine_shape(self, shape: Sequence[int], layout: Layout, segment: int = 0) -> list[int]:
        """The shape of this rank's virtual device's shard (a machine's, for machine-level plans)."""
        shape = list(shape)
        if isinstance(layout, int) and shape[layout] > 1:
            shape[layout] = self.lengths(shape[layout], segment)[self.vrank]
        return shape

    def _intra_lengths(self, tensor: str, machine_shape: Sequence[int]) -> list[int]:
        """Each GPU's part, along `tensor`'s batch dim, of its machine's shard of shape
        `machine_shape` (whole samples, split evenly)."""
        dim = self.intra[tensor]
        full = self._dim_len(tensor, dim)
        per_sample, rest = divmod(full, self.graph.batch_size)
        if rest or per_sample == 0:
            raise PlanMismatchError(
                f"tensor {tensor!r}: dim {dim} of length {full} is not a batch dim of "
                f"{self.graph.batch_size} samples; the plan cannot run data parallel inside a machine"
            )
        try:
            return H.intra_lengths(machine_shape[dim], per_sample, self.machines.size, f"tensor {tensor!r}")
        except ValueError as e:
            raise PlanMismatchError(
                f"{e}; re-plan (details.shard_units must cut dim length {full} in whole samples, "
                f"{per_sample} rows each)"
            ) from None

    def _local_shape(
        self, shape: Sequence[int], layout: Layout, segment: int = 0, tensor: str | None = None
    ) -> tuple[int, ...]:
        shape = self._machine_shape(shape, layout, segment)
        if self.machines is not None and isinstance(self.intra.get(tensor), int):
            shape[self.intra[tensor]] = self._intra_lengths(tensor, shape)[self.machines.local]
        return tuple(shape)

    # -- compile ---------------------------------------------------------------------------
    def _compile(self, model: nn.Module) -> list[_Instr]:
        g = self.graph
        instrs = []
        seen_source: dict[str, Layout] = {}
        uses: dict[str, set[str]] = {}  # replicated parameter -> kinds of use (plain | sfb)
        intra_rules: dict = {}
        if self.machines is not None:  # derived once per graph (runtime.check_machine_plan compiles every rank)
            if getattr(g, "_dp_rules", None) is None:
                g._dp_rules = derive_theory(g, sfb=False, fuse_routing=False).rules
            intra_rules = g._dp_rules
        for step in self.steps:
            node = g[step.node]
            for c in step.comms:
                if c.kind not in _MOVES:
                    raise PlanMismatchError(
                        f"collective {c.kind!r} at step {step.node!r} is not supported "
                        f"(only {', '.join(sorted(_MOVES))}; reshard needs num_segments > 1)"
                    )
            seg = step.segment
            if not 0 <= seg < len(self.ratios):
                raise PlanMismatchError(f"step {step.node!r} is in segment {seg}; the plan has {len(self.ratios)} rows")
            for t, lay in step.sources:
                if t in seen_source and seen_source[t] != lay:
                    raise PlanMismatchError(f"source {t!r} is created as {seen_source[t]!r} and {lay!r}")
                if t not in seen_source:
                    self.home[t] = 0 if g[t].kind == "placeholder" else seg
                    if self.machines is not None:
                        shape = g[t].shape
                        batch_like = g[t].kind == "placeholder" and shape and shape[0] == g.batch_size > 1
                        self.intra[t] = 0 if batch_like else IDENTITY
                seen_source[t] = lay
                self._make_source(model, t, lay, self.home[t])
            if self.machines is not None:
                self._set_intra(step, node, intra_rules.get(node.name, ()))
            self.home[step.node] = seg
            sfb = step.rule.sfb or (self.options.force_sfb and self._sfb_candidate(step, node))
            layouts = {t: self._read_layout(t, lay, seg) for t, lay in zip(node.inputs, step.rule.pre)}
            replicate = {
                t
                for t, lay in layouts.items()
                if lay == IDENTITY and g[t].is_param and not (sfb and t in node.inputs[1:3])
            }
            for t, lay in layouts.items():
                if lay == IDENTITY and g[t].is_param:
                    uses.setdefault(t, set()).add("sfb" if t not in replicate else "plain")
            if node.tuple_shapes is not None:
                out_shape = tuple(self._local_shape(s, step.rule.post, seg, node.name) for s in node.tuple_shapes)
            elif node.shape is not None:
                out_shape = self._local_shape(node.shape, step.rule.post, seg, node.name)
            else:
                out_shape = None
            instrs.append(_Instr(step, node, sfb, list(step.comms), list(step.sources), layouts, out_shape, replicate))
        # Replicated parameters with only plain uses: the trainer all-reduces their gradients
        # in buckets. A parameter also used by an SFB linear (whose weight gradient is already
        # whole) keeps a replicate() per plain use instead.
        self.grad_sync = [
            g[t].fx_node.target for t, kinds in uses.items() if kinds == {"plain"} and self.options.bucket_grads
        ]
        bucketed = {t for t, kinds in uses.items() if kinds == {"plain"} and self.options.bucket_grads}
        for ins in instrs:
            ins.replicate -= bucketed
        # Machine-level plans: every parameter's gradient is summed inside its machine (data
        # parallel there); those in grad_sync (replicated over machines) also among the leaders.
        self.param_order = list(self.params)  # creation order = order of first use
        for name in self._placeholders:
            if name not in seen_source and g.users.get(name):
                raise PlanMismatchError(f"input {name!r} is read by the model but created by no plan step")
        return instrs

    def _set_intra(self, step: Step, node: Node, rules: Sequence[Rule]) -> None:
        """The op's layout inside a machine: the data-parallel rule whose inputs are laid out
        as they are inside the machine (the batch dim followed through the op); a rule whose
        shape reads agree, then a Gather or Identity output before a partial sum, then an
        Identity output where no input carries the batch."""
        have = tuple(self.intra.get(t) for t in node.inputs)
        if any(h is None for h in have):
            missing = [t for t, h in zip(node.inputs, have) if h is None]
            raise PlanMismatchError(f"step {node.name!r} reads {missing}, which no earlier step made")
        fits = [r for r in rules if tuple(r.pre) == have and not r.first_device_only]
        cuts: dict[str, int] = {}
        if not fits:
            # An input whole inside the machine (a constant grown to the batch, made whole at the
            # machine level and sliced there) is cut locally to a rule's split along its batch
            # dim: each GPU keeps the part of the samples it holds of the other inputs.
            def cut(r: Rule) -> dict | None:
                out = {}
                for t, p, h in zip(node.inputs, r.pre, have):
                    if p == h:
                        continue
                    if h != IDENTITY or not isinstance(p, int) or not self._batch_dim(t, p):
                        return None
                    out[t] = p
                return out

            fits = [r for r in rules if not r.first_device_only and cut(r) is not None]
            if fits:
                chosen = min(fits, key=lambda r: len(cut(r)))
                fits, cuts = [chosen], cut(chosen)
        self._cuts[node.name] = cuts
        if not fits:
            raise PlanMismatchError(
                f"machine-level plan: op {node.name!r} ({node.op}) has no data-parallel rule for inputs laid out "
                f"{have} inside a machine; plan over GPUs (method.levels=both or a GPU-level cluster)"
            )
        batch_in = any(isinstance(h, int) for h in have)

        def score(r: Rule) -> tuple:
            shape_mismatch = any(self.intra.get(t, lay) != lay for t, lay in r.shape_pre)
            batch_read = any(isinstance(lay, int) for _, lay in r.shape_pre)
            # an expand that makes the dim the machine's shard splits (a buffer grown to the
            # batch) splits it inside the machine too, in whole samples
            made = r.name == "broadcast-split" and r.post == step.rule.post
            return (
                shape_mismatch,
                r.post == REDUCE,
                isinstance(r.post, int) and not (batch_in or batch_read or made),
                not made,
            )

        post = min(fits, key=score).post
        if self.intra.setdefault(node.name, post) != post:
            raise PlanMismatchError(f"op {node.name!r} runs in two layouts inside a machine")

    def _batch_dim(self, tensor: str, dim: int) -> bool:
        """Whether `tensor`'s dim runs over whole samples of the global batch."""
        length = self._dim_len(tensor, dim)
        return length > 1 and length % self.graph.batch_size == 0

    def _sfb_candidate(self, step: Step, node: Node) -> bool:
        r = step.rule
        if node.op != "linear":
            return False
        nd = len(self.graph[node.inputs[0]].shape)
        return (
            node.op == "linear"
            and isinstance(r.post, int)
            and r.post < nd - 1
            and r.pre[0] == r.post
            and all(p == IDENTITY for p in r.pre[1:])
            and not r.first_device_only
        )

    def _make_source(self, model: nn.Module, t: str, lay: Layout, segment: int = 0) -> None:
        node = self.graph[t]
        if lay == REDUCE:
            raise PlanMismatchError(f"source {t!r} in layout Reduce: sources are Identity or Gather")
        if node.kind == "placeholder":
            return  # created per batch in _input
        target = node.fx_node.target
        try:
            full = model.get_parameter(target)
            is_param = True
        except AttributeError:
            try:
                full = model.get_buffer(target)
            except AttributeError:  # a constant export lifted out of forward: the graph's own
                full = getattr(self.graph.gm, target)
                if full.is_meta and self.device.type != "meta":
                    raise PlanMismatchError(
                        f"constant {target!r} (a tensor forward makes from data, torch.tensor(...)) was captured on "
                        "the meta device, where its values are unknown; make it a buffer of the model"
                    ) from None
                full = full.to(self.device)
            is_param = False
        if tuple(full.shape) != tuple(node.shape):
            raise PlanMismatchError(f"{target}: model has shape {tuple(full.shape)}, the plan {tuple(node.shape)}")
        if isinstance(lay, int) and full.shape[lay] > 1:
            start, stop = offsets(self.lengths(full.shape[lay], segment))[self.vrank]
            local = full.detach().narrow(lay, start, stop - start).clone()
            value = nn.Parameter(local) if is_param else local
            if is_param:
                self.sharded.add(target)
        else:
            value = full  # Identity (or a length-1 dim): the model's own tensor
        if is_param:
            self.params[target] = value
            self.param_layouts[target] = lay
            self.param_segments[target] = segment
        self._source_values[t] = value

    # -- run -------------------------------------------------------------------------------
    def _input(self, name: str, lay: Layout, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's share of input `name` (batch dim 0) in the layout the plan wants."""
        x = batch[self._placeholders.index(name)]
        full_len = self.graph[name].shape[0] if self.graph[name].shape else 0
        if lay == 0 and full_len > 1 and self.machines is None and self.lengths(full_len) == self.batch_shares:
            return x
        if self.machines is not None and lay == 0 and full_len > 1 and self.intra.get(name) == 0:
            per_machine = [sum(self.batch_shares[r] for r in ranks) for ranks in self.machines.ranks]
            mine = self._intra_lengths(name, self._machine_shape(self.graph[name].shape, 0))
            if self.lengths(full_len) == per_machine and mine == [
                self.batch_shares[r] for r in self.machines.ranks[self.machines.index]
            ]:
                return x  # the loaded samples are this GPU's part of its machine's shard
        # Another layout than the loaded share (or other shard lengths): gather the whole input
        # (data only, no gradient), then keep what the layout asks for.
        whole = (
            x
            if self.batch_shares[self.rank] == self.graph.batch_size
            else C._gather_impl(x.contiguous(), 0, self.batch_shares, "padded", self.group)
        )
        if isinstance(lay, int) and whole.shape[lay] > 1:
            whole = C.shard(whole, lay, self.lengths(whole.shape[lay]), self.vrank)
        if self.machines is not None and isinstance(self.intra.get(name), int):
            dim = self.intra[name]
            whole = C.shard(whole, dim, self._intra_lengths(name, list(whole.shape)), self.machines.local)
        return whole

    def _impl(self, impl: str) -> str:
        return self.options.force_impl or (impl if impl in C.IMPLS else "padded")

    def _comm(self, c: CommRule) -> tuple[tuple, tuple, Callable[[torch.Tensor], torch.Tensor]]:
        """(the env key it reads, the env key it writes, the function of that tensor) of one
        collective of the plan, its shard lengths resolved now: they are fixed for a rank."""
        home = self.home[c.tensor]

        def lengths(dim: int, segment: int = home) -> list[int]:
            return self.lengths(self._dim_len(c.tensor, dim), segment)

        src = (c.tensor, c.src)
        dst = (c.tensor, (c.dst, c.to_segment)) if c.kind == "reshard" else (c.tensor, c.dst)
        if c.kind == "reshard" and lengths(c.src) == lengths(c.src, c.to_segment):
            # Rows that cut this dim alike: nothing changes owner, and the cost model charges
            # nothing, so the program holds no call (not even an autograd node, which costs time
            # every step; docs/hap-runtime.md, "Codegen").
            return src, dst, _named(lambda x: x, c.kind)
        if self.machines is not None:
            return src, dst, _named(self._machine_comm(c, lengths), c.kind)
        group = self.group
        if c.kind == "reshard":
            old, new = lengths(c.src), lengths(c.src, c.to_segment)
            fn = lambda x: C.reshard(x, c.src, old, new, group)  # noqa: E731
        elif c.kind == "all_gather":
            parts, impl = lengths(c.src), self._impl(c.impl)
            fn = lambda x: C.all_gather(x, c.src, parts, impl, group)  # noqa: E731
        elif c.kind == "reduce_scatter":
            parts, impl = lengths(c.dst), self._impl(c.impl)
            fn = lambda x: C.reduce_scatter(x, c.dst, parts, impl, group)  # noqa: E731
        elif c.kind == "all_reduce":
            fn = lambda x: C.all_reduce(x, group)  # noqa: E731
        elif c.kind == "all_to_all":
            old, new = lengths(c.src), lengths(c.dst)
            fn = lambda x: C.all_to_all(x, c.src, old, c.dst, new, group)  # noqa: E731
        elif c.kind == "slice":
            parts, rank = lengths(c.dst), self.rank
            fn = lambda x: C.shard(x, c.dst, parts, rank)  # noqa: E731
        else:
            fn = lambda x: C.keep_first(x, group)  # noqa: E731
        return src, dst, _named(fn, c.kind)

    def _machine_comm(self, c: CommRule, lengths: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
        """A collective among machines: local where no data crosses a GPU (keep_first, or a
        slice along another dim than the batch dim inside the machine), else in three steps
        (methods.hap.hierarchy)."""
        layout, home = self.intra[c.tensor], self.home[c.tensor]
        node = self.graph[c.tensor]
        full = node.shape if node.shape is not None else node.tuple_shapes[0]
        if c.kind == "keep_first":
            return (lambda x: x) if self.vrank == 0 else (lambda x: x * 0)
        if c.kind == "slice" and layout != c.dst:
            parts, vrank = lengths(c.dst), self.vrank
            return lambda x: C.shard(x, c.dst, parts, vrank)
        src_seg, dst_seg = (home, c.to_segment) if c.kind == "reshard" else (home, home)
        if c.kind == "all_gather":
            op = H.MachineOp("all_gather", (c.src,), (tuple(lengths(c.src)),), self._impl(c.impl))
        elif c.kind == "reduce_scatter":
            op = H.MachineOp("reduce_scatter", (c.dst,), (tuple(lengths(c.dst)),), self._impl(c.impl))
        elif c.kind == "all_to_all":
            op = H.MachineOp("all_to_all", (c.src, c.dst), (tuple(lengths(c.src)), tuple(lengths(c.dst))))
        elif c.kind == "reshard":
            op = H.MachineOp("reshard", (c.src,), (tuple(lengths(c.src)), tuple(lengths(c.src, c.to_segment))))
        elif c.kind == "slice":
            op = H.MachineOp("slice", (c.dst,), (tuple(lengths(c.dst)),))
        else:
            op = H.MachineOp("all_reduce")
        in_shape = self._machine_shape(full, c.src, src_seg)
        out_shape = self._machine_shape(full, c.dst, dst_seg)
        if isinstance(layout, int):
            in_lengths, out_lengths = self._intra_lengths(c.tensor, in_shape), self._intra_lengths(c.tensor, out_shape)
        else:
            in_lengths = out_lengths = [0] * self.machines.size
        machines = self.machines
        return lambda x: H.hierarchical(x, machines, op, layout, in_lengths, out_lengths, in_shape, out_shape)

    def _value(self, arg: fx.Node, ins: _Instr, env: dict, batch, shape_read: bool = False) -> Any:
        """The local value of an fx argument: a tensor in the step's layout, or a non-tensor
        (size, dtype) evaluated from local tensors (whose shapes are the local shards')."""
        name = arg.name
        if shape_read:
            want = dict(ins.step.rule.shape_pre).get(name)
            want = ins.layouts.get(name) if want is None else self._read_layout(name, want, ins.step.segment)
            if want is not None and (name, want) in env:
                return env[(name, want)]
        elif name in ins.layouts:
            v = env[(name, ins.layouts[name])]
            cut = self._cuts.get(ins.node.name, {}).get(name)
            if cut is not None:  # this GPU's samples of a tensor whole inside its machine
                parts = H.intra_lengths(
                    v.shape[cut],
                    self._dim_len(name, cut) // self.graph.batch_size,
                    self.machines.size,
                    f"tensor {name!r}",
                )
                fn = _named(lambda x, cut=cut, parts=parts: C.shard(x, cut, parts, self.machines.local), f"cut_{name}")
                v = self._note(fn(v), fn, (v,))
            if name in ins.replicate:
                keep, group = self.machines is None or self.machines.is_leader, self.group
                fn = _named(lambda x: C.replicate(x, keep, group), "replicate")
                v = self._note(fn(v), fn, (v,))
            return v
        if self.graph[name].is_tensor:
            have = [v for (t, _), v in env.items() if t == name]
            if have:
                return have[0]
            raise PlanMismatchError(f"step {ins.node.name!r} reads {name!r}, which no earlier step made")
        n = arg
        if n.op == "placeholder" or n.op == "get_attr":
            raise PlanMismatchError(f"non-tensor source {name!r} is not supported")
        args = fx.node.map_arg(n.args, lambda a: self._value(a, ins, env, batch, True))
        kwargs = fx.node.map_arg(n.kwargs, lambda a: self._value(a, ins, env, batch, True))
        return _call(n, args, kwargs)  # a size or dtype: the same at every step (a constant when recorded)

    def _empty_result(self, ins: _Instr, args, tensors: list[torch.Tensor]) -> Any:
        """What an op over an empty shard contributes: zeros of the plan's local shape (plus a
        conv2d's bias for a Reduce output), connected to the inputs with zero gradients, so
        every rank's backward reaches the same collectives and no kernel sees an empty grad."""
        device = tensors[0].device if tensors else self.device
        anchor = torch.zeros((), device=device)
        for t in tensors:
            if t.is_floating_point() and t.requires_grad:
                anchor = anchor + t.sum() * 0
        dtype = ins.node.dtype or torch.float32

        def zeros(shape):
            z = torch.zeros(shape, dtype=dtype, device=device)
            return z + anchor.to(dtype) if dtype.is_floating_point else z

        if ins.node.tuple_shapes is not None:
            return tuple(zeros(s) for s in ins.out_shape)
        out = zeros(ins.out_shape)
        bias = args[2] if ins.node.op == "conv2d" and len(args) > 2 else None
        if ins.step.rule.post == REDUCE and isinstance(bias, torch.Tensor):
            out = out + bias.view(1, -1, 1, 1)
        return out

    @property
    def module(self) -> fx.GraphModule | None:
        """The recorded program (after the first call; None before, or with compile off):
        `print(program.module.code)` shows this rank's step as straight-line Python."""
        return self._module

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """This rank's part of the summed loss of the global batch (its share in `batch`), or
        with `outputs` its shards of them."""
        if len(batch) != len(self._placeholders):
            raise PlanMismatchError(f"{len(batch)} inputs for a model with {len(self._placeholders)}")
        for x, share in zip(batch, [self.batch_shares[self.rank]] * len(batch)):
            if x.dim() and x.shape[0] != share:
                raise PlanMismatchError(f"rank {self.rank} got {x.shape[0]} samples; its batch share is {share}")
        if self._module is not None:
            return self._module(*batch)
        if not self.options.compile:
            return self._interpret(batch)
        self._rec = _Recorder(self._placeholders, batch)
        try:
            # With checkpoints the recording runs without autograd, so that the first step,
            # which runs the recorded (checkpointed) module, holds no more than the others.
            with torch.no_grad() if self._unit_of else contextlib.nullcontext():
                loss = self._interpret(batch)
            module = self._rec.module(loss)
        finally:
            self._rec.close()
            self._rec = None
        if not self._unit_of:
            self._module = module
            return loss
        self._module = _with_checkpoints(module, self._unit_of)
        return self._module(*batch)

    def _note(self, value: Any, target: Callable | str, args: tuple = (), kwargs: dict | None = None) -> Any:
        """`value`, which target(*args, **kwargs) just made; recorded as a node when recording.
        A str target is a method of args[0]."""
        if self._rec is not None:
            self._rec.call(value, target, args, kwargs or {})
        return value

    def _reads(self, ins: _Instr) -> set[str]:
        """The tensors an instruction may read from the environment: what it creates or
        communicates, its op's tensor arguments, and the tensors a size argument is computed
        from (sizes are evaluated from local shards when the op runs)."""
        names = {t for t, _ in ins.sources} | {c.tensor for c in ins.comms} | set(ins.layouts)
        stack, seen = list(ins.node.fx_node.all_input_nodes), set()
        while stack:
            a = stack.pop()
            if a.name in seen:
                continue
            seen.add(a.name)
            names.add(a.name)
            if a.name not in self.graph.by_name or not self.graph[a.name].is_tensor:
                stack.extend(a.all_input_nodes)
        return names

    def _last_reads(self) -> list[set[str]]:
        """Per instruction, the tensors no later instruction reads (the loss and what the
        final collectives read excepted): the interpreter drops them once it has run it, so
        a first step holds what autograd saves, as the recorded program's later steps do,
        not every value of the forward pass."""
        last: dict[str, int] = {}
        for i, ins in enumerate(self._instrs):
            for t in self._reads(ins) | {ins.node.name}:
                last[t] = i
        keep = {self.loss} | {c.tensor for c in self.final_comms}
        dead: list[set[str]] = [set() for _ in self._instrs]
        for t, i in last.items():
            if t not in keep:
                dead[i].add(t)
        return dead

    def _interpret(self, batch: Sequence[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run the plan step by step (recording each tensor made, when compiling), dropping
        each value after its last reader."""
        env: dict = {}
        handed: tuple | None = None
        for i, (ins, dead) in enumerate(zip(self._instrs, self._dead_after)):
            if self._rec is not None:
                self._rec.instr = i
            for t, lay in ins.sources:
                if (t, lay) in env:
                    continue
                if self.graph[t].kind == "placeholder":
                    x = self._input(t, lay, batch)
                    load = _named(lambda *b, t=t, lay=lay: self._input(t, lay, b), f"load_{t}")
                    env[(t, lay)] = x if any(x is b for b in batch) else self._note(x, load, tuple(batch))
                else:
                    env[(t, lay)] = self._source_values[t]
                    if self._rec is not None:
                        self._rec.attr(env[(t, lay)], t)
            for c in ins.comms:
                self._run_comm(c, env)
            if self.outputs and ins.node.name == self.loss:
                handed = tuple(env[(t, ins.layouts[t])] for t in self.outputs)
            else:
                env[(ins.node.name, ins.step.rule.post)] = self._run_op(ins, env, batch)
            if dead:
                for key in [k for k in env if k[0] in dead]:
                    del env[key]
        if self._rec is not None:
            self._rec.instr = len(self._instrs)
        if self.outputs:
            if handed is None:
                raise PlanMismatchError(f"the plan has no step for {self.loss!r}, which hands the outputs on")
            return handed
        for c in self.final_comms:
            self._run_comm(c, env)
        if (self.loss, REDUCE) not in env:
            raise PlanMismatchError(f"the plan leaves the loss {self.loss!r} in no Reduce layout")
        return env[(self.loss, REDUCE)]

    def _run_comm(self, c: CommRule, env: dict) -> None:
        src, dst, fn = self._comm(c)
        env[dst] = self._note(fn(env[src]), fn, (env[src],))

    def _run_op(self, ins: _Instr, env: dict, batch) -> Any:
        n = ins.node.fx_node
        rule = ins.step.rule
        first_only = {ins.node.inputs[i] for i in rule.first_device_only}

        def value(a: fx.Node):
            v = self._value(a, ins, env, batch)
            if a.name in first_only and self.vrank > 0:
                v = self._note(v * 0, operator.mul, (v, 0))  # the output is Reduce: only rank 0 adds this operand
            return v

        args = _on_device(fx.node.map_arg(n.args, value), self.device)
        kwargs = _on_device(fx.node.map_arg(n.kwargs, value), self.device)
        if ins.sfb:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            dim = rule.pre[0]
            impl = self.options.force_impl or "padded"
            lengths = self.lengths(self._dim_len(ins.node.inputs[0], dim), ins.step.segment)
            gathers = None
            if self.machines is not None:
                xname, seg = ins.node.inputs[0], ins.step.segment
                gathers = tuple(
                    H.sfb_factor(
                        self.machines,
                        dim,
                        lengths,
                        lay,
                        self._intra_lengths(t, self._machine_shape(self.graph[t].shape, dim, seg))
                        if isinstance(lay, int)
                        else [0] * self.machines.size,
                        impl,
                        self.graph[t].shape,
                    )
                    for t, lay in ((xname, self.intra[xname]), (ins.node.name, self.intra[ins.node.name]))
                )
            group = self.group
            sfb = _named(lambda x, w, b: C.sfb_linear(x, w, b, dim, lengths, impl, gathers, group), "sfb_linear")
            return self._note(sfb(x, w, b), sfb, (x, w, b))
        if ins.out_shape is not None and ins.node.tuple_shapes is None:
            # Sizes baked into the graph are the global ones: this rank's are its local shape.
            args = explicit_size_args(ins.node, ins.out_shape, tuple(args))
        tensors = [a for a in _flatten((args, kwargs)) if isinstance(a, torch.Tensor)]
        empty = any(t.numel() == 0 for t in tensors)
        target = n.target if n.op != "call_method" else str(n.target)
        try:
            out = _call(n, args, kwargs)
        except RuntimeError:
            if not empty:
                raise
            return self._empty(ins, args, tensors)
        if ins.out_shape is None:
            return self._note(out, target, args, kwargs)
        is_tuple = ins.node.tuple_shapes is not None
        got = tuple(tuple(o.shape) for o in out) if is_tuple else tuple(out.shape)
        if got != ins.out_shape:
            if empty:  # e.g. conv2d over zero input channels returns an empty tensor
                return self._empty(ins, args, tensors)
            if self.options.check_shapes:
                raise PlanMismatchError(
                    f"rank {self.rank}: op {ins.node.name!r} ({rule.describe()}) made local shape {got}, "
                    f"the plan's shard is {ins.out_shape}"
                )
        if any(o.numel() == 0 for o in (out if is_tuple else (out,))) and (empty or not is_tuple):
            # Backward kernels of some ops (pooling) refuse empty gradients.
            return self._empty(ins, args, tensors)
        return self._note(out, target, args, kwargs)

    def _empty(self, ins: _Instr, args: tuple, tensors: list[torch.Tensor]) -> Any:
        """_empty_result, recorded as one call: which ops are empty is fixed for a rank."""
        fn = _named(lambda args, tensors: self._empty_result(ins, args, tensors), f"empty_{ins.node.name}")
        return self._note(fn(args, tensors), fn, (args, tensors))

    def summary(self) -> dict:
        """What this rank's code runs: collectives by kind and impl (as executed, after any
        forcing), SFB linears, sharded and replicated parameters."""
        comms: dict[str, int] = {}
        for ins in self._instrs:
            for c in ins.comms:
                impl = self._impl(c.impl) if c.kind in ("all_gather", "reduce_scatter") else c.impl
                key = f"{c.kind}/{impl}" if c.kind in ("all_gather", "reduce_scatter") else c.kind
                comms[key] = comms.get(key, 0) + 1
        return {
            "collectives": comms,
            "sfb": [ins.node.name for ins in self._instrs if ins.sfb],
            "sfb_impl": self.options.force_impl or "padded",
            "sharded_params": sorted(self.sharded),
            "replicated_params": sorted(set(self.params) - self.sharded),
        }

    # -- reassembly ------------------------------------------------------------------------
    def full_tensors(self, which: Callable[[nn.Parameter], torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Every trained parameter's `which(p)` reassembled to full size (collective: every rank
        calls it, in the same order). Gather'd shards are all-gathered; Identity ones are whole."""
        out = {}
        for name in sorted(self.params):
            p, lay = self.params[name], self.param_layouts[name]
            local = which(p)
            if local is None:
                continue
            local = local.detach()
            if name in self.sharded:
                full_len = self.graph.gm.get_parameter(name).shape[lay]
                lengths = self.lengths(full_len, self.param_segments[name])
                if self.machines is not None:  # each machine's shard once, from its leader
                    m = self.machines
                    lengths = [lengths[i] if r == ranks[0] else 0 for i, ranks in enumerate(m.ranks) for r in ranks]
                    local = local if m.is_leader else local.narrow(lay, 0, 0)
                local = C._gather_impl(local.contiguous(), lay, lengths, "padded", self.group)
            out[name] = local
        return out


def _on_device(x: Any, device: torch.device) -> Any:
    """`x` with every device argument (a factory's or a copy's) replaced by `device`."""
    if isinstance(x, torch.device):
        return device
    if isinstance(x, (tuple, list)):
        return type(x)(_on_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _on_device(v, device) for k, v in x.items()}
    return x


def _call(n: fx.Node, args, kwargs):
    if n.op == "call_method":
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    return n.target(*args, **kwargs)


def _flatten(x) -> list:
    if isinstance(x, (tuple, list)):
        return [y for v in x for y in _flatten(v)]
    if isinstance(x, dict):
        return [y for v in x.values() for y in _flatten(v)]
    return [x]


def _holds_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or (isinstance(x, (tuple, list)) and any(map(_holds_tensor, x)))


def _named(fn: Callable, name: str) -> Callable:
    """`fn` under a name that is a valid identifier (fx names a node and its code's global after it)."""
    fn.__name__ = fn.__qualname__ = "".join(ch if ch.isalnum() else "_" for ch in name)
    return fn


class _Recorder:
    """Records the tensors one interpreted step makes as an fx graph: each value produced is
    bound (by identity) to the node that makes it, so an op's tensor arguments become the
    nodes that made them and everything else (sizes, dtypes, lengths) becomes a constant."""

    def __init__(self, placeholders: Sequence[str], batch: Sequence[torch.Tensor]):
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.instr: int | None = None  # the instruction being recorded: each node's meta["instr"]
        self._nodes: dict[int, fx.Node] = {}
        # A tensor's id is forgotten when it is freed (before the id can be reused), so
        # recording keeps no value alive that the step itself would have freed.
        self._watch: list[weakref.finalize] = []
        self._items: dict[int, tuple[fx.Node, int]] = {}  # id of an item of a recorded tuple -> (node, index)
        for name, x in zip(placeholders, batch):
            self._bind(x, self.graph.placeholder(name))

    def _bind(self, value: Any, node: fx.Node) -> None:
        if isinstance(value, torch.Tensor):
            self._nodes[id(value)] = node
            self._watch.append(weakref.finalize(value, self._forget, id(value)))
            return
        # A tuple or list an op returned is found through its items (it cannot be watched,
        # and a freed one's id may come back as another tuple's): an item read later
        # becomes a getitem node, the whole passed on becomes a tuple of them.
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor) and id(item) not in self._nodes:
                self._items[id(item)] = (node, i)
                self._watch.append(weakref.finalize(item, self._forget, id(item)))

    def attr(self, value: Any, name: str) -> None:
        """A parameter, buffer or constant tensor of the program: an attribute of the module."""
        if id(value) in self._nodes:
            return
        field_name = f"src_{name}"  # an fx node name: a unique identifier
        if isinstance(value, nn.Parameter):
            self.root.register_parameter(field_name, value)
        elif isinstance(value, torch.Tensor):
            self.root.register_buffer(field_name, value)
        else:
            raise RuntimeError(f"source {name!r} is a {type(value).__name__}, not a tensor; cannot record it")
        self._bind(value, self._tagged(self.graph.get_attr(field_name)))

    def _tagged(self, node: fx.Node) -> fx.Node:
        node.meta["instr"] = self.instr
        return node

    def arg(self, x: Any) -> Any:
        """x with every recorded value replaced by its node (sizes become plain tuples)."""
        node = self._nodes.get(id(x))
        if node is not None:
            return node
        if id(x) in self._items:
            self._bind(x, self._tagged(self.graph.call_function(operator.getitem, self._items.pop(id(x)))))
            return self._nodes[id(x)]
        if isinstance(x, torch.Tensor):
            raise RuntimeError(
                f"a tensor argument of shape {tuple(x.shape)} that no recorded step made; "
                "cannot record this program (run it with CodegenOptions(compile=False))"
            )
        if isinstance(x, torch.Size):
            return tuple(int(v) for v in x)
        if isinstance(x, (tuple, list)):
            return type(x)(self.arg(v) for v in x)
        if isinstance(x, dict):
            return {k: self.arg(v) for k, v in x.items()}
        return x

    def call(self, value: Any, target: Callable | str, args: tuple, kwargs: dict) -> None:
        if not _holds_tensor(value):
            return  # a size or dtype: a constant of this rank, folded where it is used
        args, kwargs = self.arg(tuple(args)), self.arg(dict(kwargs))
        if isinstance(target, str):
            node = self.graph.call_method(target, args, kwargs)
        else:
            node = self.graph.call_function(target, args, kwargs)
        self._bind(value, self._tagged(node))

    def _forget(self, key: int) -> None:
        self._nodes.pop(key, None)
        self._items.pop(key, None)

    def module(self, loss: torch.Tensor) -> fx.GraphModule:
        self.graph.output(self.arg(loss))
        return fx.GraphModule(self.root, self.graph, class_name="RankStep")

    def close(self) -> None:
        """Done recording: the tensors still alive no longer point at this recorder."""
        for f in self._watch:
            f.detach()
        self._watch = []


class _Checkpointed(nn.Module):
    """A sub-module of the recorded program run under torch.utils.checkpoint (non-reentrant):
    forward keeps its inputs, backward runs it again before its own backward."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return checkpoint(self.inner, *args, use_reentrant=False)


def _with_checkpoints(gm: fx.GraphModule, unit_of: dict[int, int]) -> fx.GraphModule:
    """The recorded program cut into sub-modules at the checkpoints' borders (each run of nodes
    recorded for one checkpoint's instructions, or for none), each checkpoint's sub-module run
    under torch.utils.checkpoint; the tensors one passes to the next are its inputs."""
    part: dict[str, int] = {}
    ckpt: set[int] = set()
    current, key = -1, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        unit = unit_of.get(node.meta.get("instr"))
        if unit != key or current < 0:
            current, key = current + 1, unit
            if unit is not None:
                ckpt.add(current)
        part[node.name] = current
    top = split_module(gm, gm, lambda n: part[n.name], keep_original_order=True)
    for p in ckpt:
        name = f"submod_{p}"
        setattr(top, name, _Checkpointed(getattr(top, name)))
    return top
