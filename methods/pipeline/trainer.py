"""One rank of a pipeline at run time: its stages of the traced model as torch PipelineStages,
torch's schedule, the gradients of its copies of tied parameters summed with the pipeline's
other holders, its replicas' gradients summed in buckets (or, with sharded state, each stage
fully_shard-ed over its replicas), Adam over its parameters."""

from __future__ import annotations

import copy
import gc

import torch
import torch.distributed as dist
from torch import nn

from bench.core.interfaces import Plan, RankContext
from bench.runtime.compat import no_handshake_with_itself, ordered_group
from methods.common import gradient_buckets, group_table, scale_to_norm
from methods.graph import capture_config
from methods.pipeline.cut import checkpointed_stage, cut_graph, model_graph
from methods.pipeline.planning import rank_params, tied_params
from methods.pipeline.schedule import is_multi_stage, schedule_class


class PipelineTrainer:
    """One rank of a pipeline: its stages' GraphModules as PipelineStages, torch's schedule, the
    gradients of tied parameters summed among the pipeline's holders and then every gradient
    over its replicas, Adam over its parameters."""

    def __init__(self, method, plan: Plan, model: nn.Module, ctx: RankContext):
        from torch.distributed.pipelining import PipelineStage

        from bench.runtime.p2p import install_p2p

        d = plan.details
        self.rank, self.emulator, self.device = ctx.rank, ctx.emulator, ctx.device
        pipelines = d["pipelines"]
        R, D, m = d["num_stages"], d["num_pipelines"], d["num_micro_batches"]
        stage_rank = d["stage_rank"]
        K = len(stage_rank)
        self.pipeline = next(p for p, ranks in enumerate(pipelines) if ctx.rank in ranks)
        self.position = pipelines[self.pipeline].index(ctx.rank)
        mine = [k for k in range(K) if stage_rank[k] == self.position]
        self.is_first, self.is_last = 0 in mine, K - 1 in mine
        if ctx.emulator.enabled:
            install_p2p(ctx.emulator)  # activations' sends go over the emulated links
        # The planner's graph of the model, for its layer groups; the model's own graph, captured
        # the same way at the same batch, has the same node names.
        micro_batch = max(d["micro_batches"][self.pipeline], 1)
        graph = capture_config(ctx.workload.model_cfg, micro_batch)
        table = group_table(graph)
        gm = model_graph(model, ctx.workload.model_cfg, micro_batch, device=ctx.device)
        cuts = [st["groups"][0] for st in d["stages"]] + [d["stages"][-1]["groups"][1] + 1]
        tensors = {n.name for n in graph.nodes if n.is_tensor}
        tied = tied_params(table, cuts, stage_rank)
        # Every rank makes every group, in the same order (torch.distributed.new_group). A
        # pipeline's group ranks its members by position, the rank torch's schedules place
        # stages by; a position's replicas by pipeline, so that with sharded state a rank's
        # shard index is its pipeline's and the shards of a tied parameter's copies line up.
        groups = [ordered_group(ranks) for ranks in pipelines]
        replicas = [ordered_group([p[r] for p in pipelines]) for r in range(R)] if D > 1 else None
        tie_groups = {
            positions: [ordered_group([p[r] for r in positions]) for p in pipelines]
            for positions in dict.fromkeys(positions for _, positions in tied)
        }
        group = groups[self.pipeline]
        self.replica_group = replicas[self.position] if D > 1 else None
        self.sharded = bool(d.get("sharded_state")) and D > 1
        model_names = {id(p): n for n, p in model.named_parameters()}
        tied_ids = {id(gm.get_parameter(name)): i for i, (name, _) in enumerate(tied)}
        stages, loss_module, params, self.names = [], None, {}, {}
        held: dict[int, nn.Parameter] = {}  # tied parameter -> this rank's copy
        self.sharded_modules: list[nn.Module] = []
        for k in mine:
            module, loss = cut_graph(gm, table, tensors, cuts, k)
            if method.activation_checkpointing:
                module = checkpointed_stage(gm, table, tensors, cuts[k], cuts[k + 1])
            loss_module = loss or loss_module
            for part in (module, loss):  # the stage's own parameters alone get values (on meta: the rest)
                if part is not None and ctx.weights is not None:
                    ctx.weights.materialize(part, ctx.device)
            names = {n: model_names.get(id(p), n) for n, p in module.named_parameters()}
            copies = {n: tied_ids[id(p)] for n, p in module.named_parameters() if id(p) in tied_ids}
            if self.sharded:
                shard_stage(module, self.replica_group, ctx.device)
                self.sharded_modules.append(module)
            for n, p in module.named_parameters():  # a parameter two of its stages read is one tensor
                params.setdefault(id(p), p)
                self.names[id(p)] = names[n]
                if n in copies:
                    held.setdefault(copies[n], params[id(p)])
            stages.append(no_handshake_with_itself(PipelineStage(module, k, K, ctx.device, group=group)))
        self.params = list(params.values())
        # This rank's copies of tied parameters, each with its holders' group in this pipeline;
        # the clipping norm counts a copy on the first holder only.
        self.tied = [
            (held[i], tie_groups[positions][self.pipeline]) for i, (_, positions) in enumerate(tied) if i in held
        ]
        self.uncounted = {
            id(held[i]) for i, (_, positions) in enumerate(tied) if i in held and self.position != positions[0]
        }
        # Tests: the full model every stage's state is written into, a materialised copy.
        self.full_model = None
        if method.mirror_full_state:
            self.full_model = copy.deepcopy(model)
            if ctx.weights is not None:
                ctx.weights.materialize(self.full_model, ctx.device)
        # Replicas of this rank (data parallel across pipelines) sum their gradients once the
        # schedule is through, in buckets (gradient_buckets, as the plan prices them); sharded,
        # FSDP2 reduce-scatters them at the schedule's end instead.
        self.buckets = []
        if D > 1 and not self.sharded:
            order = {name: i for i, (name, _) in enumerate(rank_params(table, cuts, mine))}
            # a stage's module may name a parameter otherwise (checkpointed groups): by the graph's name
            ranked = {}
            for name, p in gm.named_parameters(remove_duplicate=False):
                if name in order:
                    ranked[id(p)] = min(order[name], ranked.get(id(p), len(order)))
            if set(ranked) != set(params):
                raise RuntimeError(
                    f"rank {ctx.rank}: its stages' parameters differ from the planner's "
                    f"({len(params)} held, {len(ranked)} of them planned): the traced graph differs from the planner's"
                )
            ordered = sorted(self.params, key=lambda p: ranked[id(p)])
            self.buckets = [
                [ordered[i] for i in run]
                for run in gradient_buckets([p.numel() * p.element_size() for p in ordered], method.bucket_cap_mb)
            ]
        # Each pipeline's summed loss over the global targets; the replicas' gradients add up.
        self.loss_scale = 1.0 / ctx.workload.targets_per_iter

        def loss_fn(output, target):
            outs = output if isinstance(output, tuple) else (output,)
            return loss_module(*outs, target) * self.loss_scale

        # Every stage gets the loss function (the schedule runs backward where there is one);
        # only the last calls it.
        schedule = schedule_class(d["schedule"])
        if is_multi_stage(d["schedule"]):
            self.schedule = schedule(stages, m, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = schedule(stages[0], m, loss_fn=loss_fn, scale_grads=False)
        self.optimizer = torch.optim.Adam(self.params, lr=method.lr)
        self.grad_clip = method.grad_clip
        self.world = ctx.world_size
        # The captured graph module holds every parameter of the model (its get_attr targets), and
        # capturing leaves reference cycles: dropped and collected now, a rank holds its stages alone.
        del gm
        gc.collect()

    def step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        inputs, targets = batch[:-1], batch[-1]
        losses: list[torch.Tensor] = []
        args = inputs if self.is_first else ()
        kwargs = {"target": targets, "losses": losses} if self.is_last else {}
        for module in self.sharded_modules:  # every stage gathered at once, before the schedule
            module.unshard()
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self.sum_tied()
        self.sync_replicas()
        if self.grad_clip:
            self.clip_global_norm(self.grad_clip)
        self.optimizer.step()
        self.emulator.stretch()  # the optimizer's compute (and what followed the last wait)
        if self.full_model is not None:
            self.write_full_state()
        if losses:  # the micro-batches' scaled losses, back to the summed loss
            return (torch.stack([x.detach() for x in losses]).sum() / self.loss_scale).detach()
        return torch.zeros(())

    def sum_tied(self) -> None:
        """Sum the gradients of this rank's copies of tied parameters with the pipeline's other
        holders, one all-reduce each (sharded: of the local shards, which hold the same
        elements on every holder)."""
        for p, group in self.tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(_local(p.grad), group=group)

    def sync_replicas(self) -> None:
        """Sum this rank's gradients over its replicas, bucket by bucket (a flat copy each)."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.replica_group)
            for p, value in zip(bucket, _unflatten_dense_tensors(flat, grads)):
                p.grad = value if p.grad is None else p.grad.copy_(value)

    def clip_global_norm(self, max_norm: float) -> torch.Tensor:
        """Every stage's gradients scaled by one factor: the norm over the whole model (a
        stage's replicas hold the same gradients once summed, so one pipeline's stages count;
        sharded, each replica holds its own part of them, and every rank counts its shards; a
        tied parameter's copies hold the same gradient once summed, and its first holder counts).

        The sum of squares lives on the stage's device (NCCL reduces device tensors only) and
        the factor stays a tensor there, as torch.nn.utils.clip_grad_norm_ keeps it: no read
        on the host, and a factor of 1 leaves the gradients as they are. Returns the norm."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.pipeline == 0 or self.sharded:
            for p in self.params:
                if p.grad is not None and id(p) not in self.uncounted:
                    sq += _local(p.grad).detach().double().pow(2).sum()
        dist.all_reduce(sq)
        norm = sq.sqrt()
        scale_to_norm((_local(p.grad) if p.grad is not None else None for p in self.params), norm, max_norm)
        return norm

    def write_full_state(self) -> None:
        """Tests: every stage's parameters and gradients written into this rank's full model
        (sharded: gathered among the replicas first, each of them calling)."""
        mine = {}
        for p in self.params:
            value = _full(p).detach().clone()
            grad = None if p.grad is None else _full(p.grad).detach().clone()
            if self.pipeline == 0:
                mine[self.names[id(p)]] = (value, grad)
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine)
        with torch.no_grad():
            for part in everyone:
                for name, (value, grad) in part.items():
                    p = self.full_model.get_parameter(name)
                    p.copy_(value)
                    p.grad = grad


def shard_stage(module: nn.Module, group, device: torch.device) -> None:
    """FSDP2's fully_shard of a stage's module over its replicas' process group, one unit, as
    torch's pipelining drives it (methods.pipeline's docstring): gathered before the schedule
    (PipelineTrainer.step) and kept through it, its gradients reduce-scattered summed (a
    divide factor of one: each pipeline's loss is already its part of the global loss)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    fully_shard(module, mesh=mesh, reshard_after_forward=False)
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-scaled one)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a tensor: a sharded DTensor's local shard, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded DTensor gathered (collective among its mesh), else itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
