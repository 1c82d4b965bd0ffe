"""One rank of a pipeline of hap stages at run time: its stage's hap program (methods.auto.hap_stages
`stage_program`) as a torch PipelineStage, torch's schedule over the micro-batches, the stage's
replicated gradients summed over the stage's ranks once the schedule is through, Adam over the
rank's parameters.

The ranks: a pipeline of S stages, each held by a group of R ranks (one program per stage,
planned by hap over its group); rank r of every stage is pipeline r, whose ranks run torch's
schedule among themselves (rank-aligned: rank r of stage s sends its shards of the border tensors
to rank r of stage s + 1). A rank is in two process groups, both made by the caller (every
process creates every group, in the same order): its stage's (the program's collectives, the
gradient sum) and its pipeline's (the schedule's sends).

The micro-batches: the stage graphs are captured at the group's micro-batch (the global batch /
m), which rank r holds its share of (the plan's batch shares, the same at every stage). Pipeline
r's batch is its shares of the m micro-batches one after another, which torch's schedule cuts
back into m chunks of the share.

The loss: torch's schedule hands the targets to `loss_fn`, not to the last stage's forward. The
last stage's hap graph therefore ends where the loss's tail begins (`stage_graph(...,
loss=False)`: a BOUNDARY over the tensors the tail reads, batch-split in whole samples), and
loss_fn runs the tail (the pipeline method's loss module, methods.pipeline.cut) on the rank's
shard and its targets, scaled as the pipeline method scales it (1 / the global batch's targets):
a sum over samples, so the ranks' and micro-batches' parts add up to the global loss. hap does
not plan the tail (it runs data parallel in its rank's samples), as the pipeline method's loss
module does not belong to a stage either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from methods.auto.hap_stages import StageGraph, _batch_like, _whole_samples, stage_program
from methods.common import GroupTable
from methods.graph import Graph
from methods.hap.codegen import CodegenOptions, RankProgram
from methods.pipeline.cut import cut_graph
from methods.pipeline.schedule import schedule_class


class HapStageModule(nn.Module):
    """A stage's program as the nn.Module torch's PipelineStage wraps: it holds the program's
    parameters (the rank's shards, registered so that the schedule's backward and the optimizer
    see them) and runs the program on one micro-batch's inputs. `arg_names`: what its positional
    arguments are (the model's inputs on the first stage, the stage before's outputs on the
    others); it hands the program those its stage reads, in `stage.inputs` order."""

    def __init__(self, stage: StageGraph, program: RankProgram, arg_names: Sequence[str]):
        super().__init__()
        missing = [n for n in stage.inputs if n not in arg_names]
        if missing:
            raise ValueError(
                f"stage [{stage.first}, {stage.end}) reads {missing}, which its pipeline stage does not receive "
                f"(it receives {list(arg_names)}): a tensor made before the stage before cannot reach it yet"
            )
        self.stage, self.program, self.arg_names = stage, program, list(arg_names)
        self.names = list(program.param_order)
        self.params = nn.ParameterList([program.params[n] for n in self.names])

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        named = dict(zip(self.arg_names, args))
        out = self.program(*(named[n] for n in self.stage.inputs))
        return tuple(x.contiguous() for x in out)  # the layouts PipelineStage was told (contiguous)


def _shard_meta(node, length: int | None, requires_grad: bool) -> torch.Tensor:
    """A meta tensor of a rank's shard of a border tensor: `length` along dim 0 (its part of the
    batch split), or whole (None)."""
    shape = list(node.shape)
    if length is not None:
        shape[0] = length
    return torch.empty(shape, dtype=node.dtype or torch.float32, device="meta").requires_grad_(requires_grad)


def _no_loss(output, target):
    raise RuntimeError("the loss is computed on the last stage only")


class HapStageRank:
    """One rank of a pipeline of hap stages: rank `rank` of stage `stage_index`'s group.

    Args:
        graph, table: the model's graph at the group's micro-batch and its layer groups.
        stages: every stage's StageGraph (the last one made with `loss=False`).
        details: every stage's plan (stage_details); one ratio row, the same at every stage.
        batch_shares: the samples of a micro-batch each rank of a group holds.
        model: the full model, initialised as on every other rank.
        stage_group, pipeline_group: the process groups of the rank's stage and its pipeline.
        num_micro_batches, schedule: torch's schedule (one stage per rank: 1F1B, GPipe).
        loss_scale: what loss_fn multiplies the summed loss by (1 / the global batch's targets).
    """

    def __init__(
        self,
        graph: Graph,
        table: GroupTable,
        stages: Sequence[StageGraph],
        details: Sequence[dict],
        batch_shares: Sequence[int],
        model: nn.Module,
        stage_index: int,
        rank: int,
        stage_group,
        pipeline_group,
        num_micro_batches: int,
        schedule: str = "1F1B",
        lr: float = 5e-4,
        loss_scale: float = 1.0,
        options: CodegenOptions | None = None,
        device: torch.device | None = None,
    ):
        from torch.distributed.pipelining import PipelineStage

        S, R = len(stages), len(batch_shares)
        if not stages[-1].ends_at_loss:
            raise ValueError("the last stage must end where the loss's tail begins: stage_graph(..., loss=False)")
        rows = {tuple(map(tuple, d["ratios"])) for d in details}
        if len(rows) != 1 or len(next(iter(rows))) != 1:
            raise ValueError(f"the stages' plans must share one ratio row (a micro-batch is split alike): {rows}")
        stage = stages[stage_index]
        self.stage, self.stage_index = stage, stage_index
        self.is_first, self.is_last = stage_index == 0, stage_index == S - 1
        self.stage_group = stage_group
        self.program = stage_program(stage, details[stage_index], batch_shares, model, rank, R, options, stage_group)
        targets = set(table.targets)
        inputs = [n.name for n in graph.nodes if n.kind == "placeholder" and n.name not in targets]
        arg_names = inputs if self.is_first else stages[stage_index - 1].crossing_out
        self.module = HapStageModule(stage, self.program, arg_names)
        # What the stage receives and sends, told to PipelineStage (static: it runs no forward
        # to find out, which would run the program's collectives on made-up inputs): the rank's
        # shards, of its samples where dim 0 is the batch.
        g, share = stage.graph, batch_shares[rank]

        def length(node) -> int | None:
            return share if node.shape and node.shape[0] == g.batch_size else None

        if self.is_first:
            example_in = tuple(_shard_meta(graph[n], length(graph[n]), False) for n in inputs)
        else:
            example_in = tuple(_shard_meta(g[n], length(g[n]), True) for n in arg_names)
        split = _whole_samples if stage.ends_at_loss else _batch_like  # as stage_theory's BOUNDARY reads them
        example_out = tuple(
            _shard_meta(g[n], self.program.lengths(g[n].shape[0])[rank] if split(g[n], g.batch_size) else None, True)
            for n in stage.crossing_out
        )
        device = device or torch.device("cpu")
        pipe = PipelineStage(self.module, stage_index, S, device, example_in, example_out, group=pipeline_group)
        self.loss_scale = loss_scale
        # Every stage gets a loss function: torch's schedule runs backward where there is one
        # (only the last stage calls it).
        loss_fn = self._loss_fn(graph, table, stage, batch_shares) if self.is_last else _no_loss
        self.schedule = schedule_class(schedule)(pipe, num_micro_batches, loss_fn=loss_fn, scale_grads=False)
        self.params = [self.program.params[n] for n in self.program.param_order]
        self.replicated = [self.program.params[n] for n in self.program.grad_sync]
        self.optimizer = torch.optim.Adam(self.params, lr=lr)

    def _loss_fn(self, graph: Graph, table: GroupTable, stage: StageGraph, shares: Sequence[int]):
        """The loss's tail on the rank's shard of what it reads (the pipeline method's loss
        module), times loss_scale. The shards must be the rank's whole samples."""
        tensors = {n.name for n in graph.nodes if n.is_tensor}
        _, tail = cut_graph(graph.gm, table, tensors, [0, stage.first, table.num_groups], 1)
        reads = [n.name for n in tail.graph.nodes if n.op == "placeholder"]
        if reads[: len(stage.crossing_out)] != stage.crossing_out:
            raise ValueError(f"the loss reads {reads}; the last stage hands on {stage.crossing_out}")
        for t in stage.crossing_out:
            full = stage.graph[t].shape[0]
            per_sample = full // graph.batch_size
            if self.program.lengths(full) != [s * per_sample for s in shares]:
                raise ValueError(
                    f"{t!r}: its shards ({self.program.lengths(full)} of {full}) are not the ranks' samples "
                    f"({list(shares)} of {graph.batch_size}); the loss cannot be computed per rank"
                )
        scale = self.loss_scale

        def loss_fn(output, target):
            outs = output if isinstance(output, tuple) else (output,)
            return tail(*outs, target) * scale

        return loss_fn

    def step(self, inputs: Sequence[torch.Tensor], targets: torch.Tensor | None) -> float:
        """One training step over the pipeline's batch: `inputs` (first stage) and `targets`
        (last stage) are its shares of every micro-batch, one after another. Returns this
        rank's part of the summed loss (the last stage; 0 elsewhere)."""
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = tuple(inputs) if self.is_first else ()
        kwargs = {"target": targets, "losses": losses} if self.is_last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self.sync_grads()
        self.optimizer.step()
        return float(sum(x.item() for x in losses) / self.loss_scale) if losses else 0.0

    def sync_grads(self) -> None:
        """The replicated parameters' gradients (the program's `grad_sync`: each rank's part of
        the sum, accumulated over the micro-batches) summed over the stage's ranks, one
        all-reduce of them all; sharded parameters' gradients are whole on their rank already."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        if not self.replicated or dist.get_world_size(self.stage_group) == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.replicated]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.stage_group)
        for p, value in zip(self.replicated, _unflatten_dense_tensors(flat, grads)):
            p.grad = value if p.grad is None else p.grad.copy_(value)

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(gradients, parameters) of the stage reassembled to full size, by the model's names
        (collective among the stage's ranks: each calls it)."""
        return self.program.full_tensors(lambda p: p.grad), self.program.full_tensors(lambda p: p)
