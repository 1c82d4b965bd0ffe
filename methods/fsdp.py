"""Fully sharded data parallelism with PyTorch's FSDP2 (`fully_shard`), one unit per layer group.

fsdp splits the global batch evenly, fsdp_cp in proportion to each device's effective FLOP/s
(as dp_ev and dp_cp do). Each layer group (methods.common: embeddings, blocks, conv stages,
head) is one `fully_shard` unit: the modules that hold its parameters and nothing else; what is
left (parameters of the model itself, modules read by several groups) is the root's unit.
A unit's parameters are sharded over all ranks (dim 0, padded to equal shards), all-gathered
before its forward and again before its backward, and its gradients reduce-scattered after
its backward; the root's are gathered once and kept until backward ends. Adam updates each
rank's shards.

The Program the simulator prices is that sequence: on the CPU (gloo) FSDP2's collectives are
synchronous, each before the compute that needs it; on GPUs it prefetches the next unit's
all-gather and reduce-scatters beside the next backward, which the Program prices as overlap.
It does not offload to the CPU, mix precisions or shard hybrid (inside a machine only).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import torch
from torch import nn

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.interfaces import Plan, RankContext, Workload
from bench.core.program import Affine, Collective, Memory, Program, Stage, backward_sweep, micro_step_stages
from bench.core.shares import round_shares
from bench.runtime.method_step import added_host_work_flops, time_method_step
from methods.common import (
    GroupTable,
    MemoryTools,
    apply_checkpointing,
    check_training_options,
    group_table,
    memory_tools_of,
    micro_batches,
    refuse_global_batch_norm,
)
from methods.graph import Graph, capture_priced

SPLITS = ("even", "compute")
WORK_PROBE_VERSION = 2  # what the probe of FSDP2's own work times; a change measures again


def fsdp_units(
    table: GroupTable, param_names: list[str], aliases: dict[str, str] | None = None
) -> tuple[list[tuple[int, list[str]]], list[str]]:
    """(units, root's parameters): per layer group that has parameters, the group and the
    modules that cover exactly its parameters (the largest module all of whose parameters are
    the group's), in forward order; the parameters no such module covers stay with the root
    (the model's own, and those of a module read by several groups: a tied embedding and head
    is one parameter read first by the embeddings' group and last by the head's, which FSDP2
    cannot gather as two units). `aliases`: the parameters' other names ({alias: name}, the
    capture's `param_aliases`): a module holding a parameter under another name holds it too."""
    aliases = aliases or {}
    shared = set(table.shared_params)
    owner_group = {p: g.index for g in table.groups for p in g.params if p not in shared}
    owner_group.update({a: owner_group[c] for a, c in aliases.items() if c in owner_group})
    param_names = list(param_names) + [a for a in aliases if a not in param_names]
    # Per module path, the parameters inside it (names that start with it and a dot), in order.
    inside: dict[str, list[str]] = {}
    for q in param_names:
        parts = q.split(".")
        for i in range(1, len(parts)):
            inside.setdefault(".".join(parts[:i]), []).append(q)
    covered: set[str] = set()
    units = []
    for g in table.groups:
        mods: list[str] = []
        for p in g.params:
            if "." not in p:
                continue  # the model's own parameter: the root's
            path = p.rsplit(".", 1)[0]
            best = None
            parts = path.split(".")
            for i in range(1, len(parts) + 1):  # the outermost module whose parameters are all this group's
                prefix = ".".join(parts[:i])
                held = inside.get(prefix, ())
                if held and all(owner_group.get(q) == g.index for q in held):
                    best = prefix
                    break
            if best is not None and best not in mods:
                mods.append(best)
        mods = [m for m in mods if not any(m.startswith(o + ".") for o in mods if o != m)]
        if mods:
            units.append((g.index, mods))
            covered |= {q for m in mods for q in inside.get(m, ())}
    root = [p for p in param_names if p not in covered and p not in aliases]
    return units, root


def shard_bytes(shape: tuple[int, ...], itemsize: int, n: int) -> float:
    """A rank's shard of a parameter under FSDP2: dim 0 padded to a multiple of the ranks."""
    if not shape:
        return float(itemsize)
    rest = math.prod(shape[1:])
    return float(math.ceil(shape[0] / n) * rest * itemsize)


class FullyShardedDP:
    """FSDP2 (`fully_shard`) per layer group with a configurable batch split.

    Args:
        name: the method's name in records (fsdp, fsdp_cp).
        split: "even" (equal shares) or "compute" (shares proportional to effective FLOP/s).
        reshard_after_forward: free each unit's gathered parameters after its forward (and
            gather them again for backward), FSDP2's default; false keeps them to backward.
        lr: Adam learning rate (the paper: 5e-4).
        grad_clip: max global gradient norm; 0 disables clipping.
        work_probe: emulated CPU clusters: time FSDP2's own work once per host, workload and
            plan (cached) and price it (bench.runtime.method_step).
        activation_checkpointing, grad_accumulation: the memory tools (methods.common.MemoryTools):
            layer groups recomputed in backward (checkpointed before fully_shard, as torchtitan
            does); micro-steps per iteration, each gathering parameters and reduce-scattering
            gradients into the shards (deferring the reduce-scatter, FSDP2's
            set_requires_gradient_sync(False), would hold every unit's whole gradient).
    """

    worker_modules = ("torch.distributed.fsdp",)
    materializes = True  # a rank materialises its shards alone (FSDPTrainer)
    mirror_full_state = False  # tests: write the gathered parameters and gradients into the full model

    def __init__(
        self,
        name: str,
        split: str = "even",
        reshard_after_forward: bool = True,
        lr: float = 5e-4,
        grad_clip: float = 0.0,
        work_probe: bool = True,
        activation_checkpointing: bool = False,
        grad_accumulation: int = 1,
    ):
        if split not in SPLITS:
            raise ConfigError(f"method.split={split!r} is invalid; use one of {', '.join(SPLITS)}")
        if not isinstance(reshard_after_forward, bool):
            raise ConfigError(f"method.reshard_after_forward={reshard_after_forward!r} must be true or false")
        check_training_options(lr, grad_clip)
        self.tools = MemoryTools(activation_checkpointing, grad_accumulation)
        self.name = name
        self.modes = ("real", "sim")
        self.split = split
        self.reshard_after_forward = reshard_after_forward
        self.lr = lr
        self.grad_clip = grad_clip
        self.work_probe = work_probe

    def plan(self, workload: Workload, cluster: ClusterSpec) -> Plan:
        n = cluster.num_devices
        weights = [1.0] * n if self.split == "even" else [d.effective_flops for d in cluster.devices]
        shares = round_shares(workload.global_batch, weights, min_share=1)
        self.tools.check_shares(shares)
        graph = capture_priced(workload.model_cfg, workload.global_batch, workload.precision, cluster.device)
        refuse_global_batch_norm(workload, graph, self.name, "each rank's share")
        checkpoints = self.tools.units(graph)
        graph = graph.with_recompute([u.nodes for u in checkpoints])
        table = group_table(graph)
        program = fsdp_program(
            graph,
            table,
            n,
            workload.global_batch,
            self.reshard_after_forward,
            prefetch=cluster.device == "cuda",
            micro_steps=self.tools.grad_accumulation,
            meta={"method": self.name, "model": workload.name},
        )
        params = [str(p.fx_node.target) for p in graph.nodes if p.is_param]
        units, root = fsdp_units(table, params, graph.gm.meta.get("param_aliases"))
        details = {
            "split": self.split,
            "batch_shares": shares,
            "units": [mods for _, mods in units],
            "root_params": root,
            "reshard_after_forward": self.reshard_after_forward,
            "optimizer": f"torch.optim.Adam(lr={self.lr:g}) over each rank's shards",
            "memory_tools": self.tools.details(checkpoints),
        }
        ratios = [[s / workload.global_batch for s in shares]]
        plan = Plan(self.name, shares, details, program, ratios)
        if self.work_probe and cluster.host_flops and cluster.emulated and cluster.device == "cpu" and n > 1:
            # FSDP2's own work on a CPU worker (hooks, copies in and out of the gathered buffers,
            # DTensor bookkeeping): twice the model's for the tiny models, priced as host work
            work = time_method_step(
                self,
                plan,
                workload,
                cluster,
                cache="fsdp_work",
                config=[self.name, shares, self.reshard_after_forward, self.lr, details["units"]]
                + ([details["memory_tools"]] if checkpoints or self.tools.grad_accumulation > 1 else []),
                version=WORK_PROBE_VERSION,
                what="FSDP2's own work",
            )
            if work is not None:
                details["work"] = work
                plan.program = dataclasses.replace(
                    program,
                    host_work_flops=added_host_work_flops(
                        work["plain_s"], work["method_s"], workload, sorted(shares)[len(shares) // 2], cluster
                    ),
                )
        return plan

    def setup(self, plan: Plan, model: nn.Module, ctx: RankContext) -> FSDPTrainer:
        return FSDPTrainer(self, plan, model, ctx)


def fsdp_program(
    graph: Graph,
    table: GroupTable,
    num_devices: int,
    global_batch: int,
    reshard_after_forward: bool = True,
    prefetch: bool = False,
    micro_steps: int = 1,
    meta: dict | None = None,
) -> Program:
    """The Program of one FSDP2 iteration (module docstring), per rank, at batch ratios.

    `graph` may hold activation checkpoints (methods.graph.Graph.recompute): their groups'
    backward runs their forward again (the group table's FLOPs), without collectives of its own
    (FSDP2 leaves the unit gathered from its pre-backward hook through the recompute).
    `micro_steps` > 1 accumulates gradients: that many micro-steps at global_batch / micro_steps
    samples, each issuing all of the collectives (micro_step_stages(sync_each=True)), the
    shards' gradients existing from the first micro-step on.

    Stages, synchronous (CPU): the collectives before each group's forward and backward, in the
    order FSDP2 issues them (below). With `prefetch` (GPUs), each stage's collectives are those
    of the next step, beside this one's compute (overlap), and the compute after waits for them.

    Memory per rank: the shards of every parameter, of its gradient and of Adam's moments; the
    root's gathered parameters for the whole iteration and, beside them, the largest unit twice:
    gathered and the all-gather's output it is copied out of (forward), its full gradients
    and their copy into the reduce-scatter's input (backward; tiny VGG19's classifier unit,
    3.1 MiB, added 8.9 MiB to a rank's tensors at the start of backward, activations
    included); activations as data parallelism keeps them (its share of the batch)."""
    n = num_devices
    shapes = {str(p.fx_node.target): (tuple(p.shape or ()), p.dtype.itemsize) for p in graph.nodes if p.is_param}
    units, root = fsdp_units(table, list(shapes), graph.gm.meta.get("param_aliases"))
    unit_of_group = dict(units)

    def unit_params(mods: list[str]) -> list[str]:
        return [p for p in shapes if any(p.startswith(m + ".") for m in mods)]

    full = {g: sum(math.prod(shapes[p][0]) * shapes[p][1] for p in unit_params(mods)) for g, mods in units}
    shard = {g: sum(shard_bytes(*shapes[p], n) for p in unit_params(mods)) for g, mods in units}
    root_shard = sum(shard_bytes(*shapes[p], n) for p in root)
    root_full = sum(math.prod(shapes[p][0]) * shapes[p][1] for p in root)
    if micro_steps < 1 or global_batch % micro_steps:
        raise ValueError(f"micro_steps={micro_steps} must be >= 1 and divide global_batch={global_batch}")
    B = global_batch // micro_steps  # samples per micro-step

    def gather(g: int | None) -> Collective:
        return Collective(
            "all_gather",
            Affine(root_shard if g is None else shard[g]),
            label="root params" if g is None else f"unit {g} params",
        )

    def scatter(g: int | None) -> Collective:
        return Collective(
            "reduce_scatter",
            Affine(root_shard if g is None else shard[g]),
            label="root grads" if g is None else f"unit {g} grads",
        )

    def compute(g, which: str) -> tuple[Affine, str, float]:
        flops = getattr(g, which + "_flops")
        launches = getattr(g, which + "_launches")
        cls = max(flops, key=flops.get) if flops else "other"
        return Affine.sharded(sum(flops.values()) * B), cls, float(sum(launches.values()))

    # Each step: (collectives issued before it, its compute), in the order FSDP2 issues them on
    # a CPU (tests/e2e/test_priced_is_run.py records them). Forward: the root's gather, then each
    # unit's before its group. Backward, in reverse: a unit's gather (unless prefetched) and the
    # prefetch of the next unit's, its group's backward, its reduce-scatter before the next
    # group's backward; the first unit, whose inputs (the data) need no gradient, and the root
    # reduce-scatter in FSDP2's final callback of backward, the root first.
    steps: list[tuple[list[Collective], object, str]] = []
    gathers = n > 1
    first = [gather(None)] if root and gathers else []
    for g in table.groups:
        pre = [gather(g.index)] if g.index in unit_of_group and gathers else []
        steps.append((first + pre, (g, "forward"), f"forward group {g.index}"))
        first = []
    order = [g.index for g in reversed(table.groups) if g.index in unit_of_group]
    deferred = order[-1] if order else None  # the first unit in forward
    prefetched: set[int] = set()
    pending: list[Collective] = []
    for g in reversed(table.groups):
        colls = pending
        pending = []
        if g.index in unit_of_group and gathers:
            if reshard_after_forward:
                if g.index not in prefetched:
                    colls = colls + [gather(g.index)]
                nxt = order.index(g.index) + 1
                if nxt < len(order):
                    colls = colls + [gather(order[nxt])]
                    prefetched.add(order[nxt])
            if g.index != deferred:
                pending = [scatter(g.index)]
        steps.append((colls, (g, "backward"), f"backward group {g.index}"))
    tail = (
        pending
        + ([scatter(None)] if root and gathers else [])
        + ([scatter(deferred)] if deferred is not None and gathers else [])
    )
    stages = []
    if prefetch:  # each stage's collectives are the next step's, beside this step's compute
        stages.append(Stage(tuple(steps[0][0]), label="first gather"))
        for i, (_, (g, which), label) in enumerate(steps):
            nxt = steps[i + 1][0] if i + 1 < len(steps) else tail
            flops, cls, launches = compute(g, which)
            stages.append(Stage(tuple(nxt), flops, overlap=bool(nxt), label=label, op_class=cls, launches=launches))
    else:
        for colls, (g, which), label in steps:
            flops, cls, launches = compute(g, which)
            stages.append(Stage(tuple(colls), flops, label=label, op_class=cls, launches=launches))
        if tail:
            stages.append(Stage(tuple(tail), label="last reduce-scatter"))
    sharded = sum(shard.values()) + root_shard
    largest = max(full.values(), default=0.0)
    gathered = Affine(root_full + 2.0 * largest)  # in use at once during forward and backward
    grads, acts, flight = graph.backward_memory()
    per_sample = 1.0 / graph.batch_size * B
    largest_shard = max((shard_bytes(*shapes[p], n) for p in shapes), default=0.0)
    ready = micro_steps > 1  # every shard's gradient exists before a later micro-step's backward
    memory = Memory(
        params=Affine(sharded),
        grads=Affine(sharded),
        optimizer=Affine(2.0 * sharded),
        # autocast casts each gathered parameter once a step and keeps the cast: all of them
        casts=Affine(sum(graph.param_casts.values())),
        activations=gathered + Affine.sharded(graph.activation_bytes() * per_sample),
        # A shard's gradient appears where backward makes the parameter's (its reduce-scatter
        # follows the unit's backward); what is gathered is held beside the activations.
        backward=tuple(
            (g, a + gathered)
            for g, a in backward_sweep(
                [] if ready else [(p, Affine(b / n)) for p, b in grads],
                [(p, Affine.sharded(b * per_sample)) for p, b in acts],
                Affine(sharded) if ready else Affine(),
                [(a, b, Affine.sharded(x * per_sample)) for a, b, x in flight],
            )
        ),
        largest_param=Affine(largest_shard),
    )
    return Program(
        micro_step_stages(stages, micro_steps, sync_each=True),
        n,
        1,
        "gpu",
        memory,
        dict(meta or {}),
        batch=B,
        micro_steps=micro_steps,
    )


class _ShardAdam:
    """torch's Adam over this rank's local shards (plain tensors): the same update as Adam over
    the sharded DTensor parameters, without DTensor's dispatch on every op of every step (on a
    CPU worker it tripled the optimizer's time: 6.5 against 1.7-2.1 ms for tiny BERT)."""

    def __init__(self, params: list[nn.Parameter], lr: float):
        self.params = params
        self.local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        self.local = [t.detach() for t in self.local]
        for t in self.local:
            t.requires_grad_(True)
        self.optimizer = torch.optim.Adam(self.local, lr=lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        for t, p in zip(self.local, self.params):
            t.grad = None if p.grad is None else (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
        self.optimizer.step()
        for t in self.local:  # the gradients stay the parameters' alone (zero_grad frees them)
            t.grad = None


def materialize_shards(model: nn.Module, weights, device: torch.device) -> None:
    """A model sharded by fully_shard on the meta device gets storage for its shards (to_empty,
    which FSDP2 follows) and each shard its slice of the parameter's canonical value
    (bench.core.weights.Weights; the whole parameter exists one at a time, on the CPU). Buffers
    keep the values the model's constructor gave them (to_empty would drop them)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    buffers = [(m, k, b) for m in model.modules() for k, b in m._buffers.items() if b is not None]
    model.to_empty(device=device)
    for m, k, b in buffers:
        m._buffers[k] = b.to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = weights.value(name).to(device)
            if isinstance(p, DTensor):  # the canonical value split as the shard is, locally
                value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(value)
            else:
                p.copy_(value)


class FSDPTrainer:
    def __init__(self, method: FullyShardedDP, plan: Plan, model: nn.Module, ctx: RankContext):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # FSDP2 warns on every unit whose output is a view (a head's flattened logits): an in-place
        # op on it would skip the unit's backward all-gather. The zoo's forwards make none, and
        # the equivalence tests check every gradient.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        self.emulator = ctx.emulator
        on_meta = any(p.is_meta for p in model.parameters())
        self.full_model = model if method.mirror_full_state else None
        sharded = copy.deepcopy(model) if method.mirror_full_state else model
        if self.full_model is not None and on_meta:
            ctx.weights.materialize(self.full_model, ctx.device)
        units, self.micro_steps = memory_tools_of(plan.details)
        apply_checkpointing(sharded, units)  # before fully_shard, so FSDP2's hooks see the recompute
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for mods in plan.details["units"]:
            fully_shard(
                [sharded.get_submodule(m) for m in mods], mesh=mesh, reshard_after_forward=method.reshard_after_forward
            )
        # The root keeps FSDP2's own rule: its parameters stay gathered from forward to backward.
        fully_shard(sharded, mesh=mesh)
        if on_meta:  # fully_shard on meta, then each rank's shards alone (torchtitan's order)
            materialize_shards(sharded, ctx.weights, ctx.device)
        self.model = sharded
        self.params = list(sharded.parameters())
        self.optimizer = _ShardAdam(self.params, method.lr)
        self.grad_clip = method.grad_clip
        # reduce-scatter averages over ranks (as DDP): world_size / global targets per rank
        self.loss_scale = ctx.world_size / ctx.workload.targets_per_iter

    def step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for part in micro_batches(batch, self.micro_steps):  # FSDP2 adds each reduce-scatter into the shards
            loss = self.model(*part)
            self.emulator.stretch()  # forward compute since the last all-gather
            (loss * self.loss_scale).backward()
            self.emulator.stretch()  # backward compute since the last reduce-scatter
            losses.append(loss.detach())
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.emulator.stretch()  # optimizer compute
        if self.full_model is not None:
            self.write_full_state()
        return losses[0] if len(losses) == 1 else torch.stack(losses).sum()

    def write_full_state(self) -> None:
        """Tests: the gathered parameters and gradients written into the unsharded model
        (collective: every rank)."""
        with torch.no_grad():
            for (_name, p), q in zip(self.model.named_parameters(), self.full_model.parameters()):
                q.copy_(p.full_tensor())
                q.grad = None if p.grad is None else p.grad.full_tensor().clone()
