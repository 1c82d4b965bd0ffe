"""A pipeline of hap stages at run time: `HapStagesTrainer`, the Trainer of a plan of hap stages
(`plan.details["hap_stages"]`), and `HapStageRank`, one rank of it: its stage's hap program
(methods.auto.hap_stages `stage_program`) as a torch PipelineStage, torch's schedule over the
micro-batches, the stage's replicated gradients summed over the stage's ranks once the schedule
is through, optional clipping by the global norm over every stage, Adam over the rank's
parameters. It does not plan (methods.auto.hap_stages does).

The ranks: a pipeline of S stages, each held by a group of R ranks (one program per stage,
planned by hap over its group); rank i of every stage's group is pipeline i, whose ranks run
torch's schedule among themselves (rank-aligned: rank i of stage s sends its shards of the
border tensors to rank i of stage s + 1). A rank is in two process groups, made by
`HapStagesTrainer` on every process in one order: its stage's (the program's collectives, the
gradient sum) and its pipeline's (the schedule's sends). A stage receives only what the stage
before hands on: a cut where a stage reads a tensor made two or more stages before it (or a
model input after the first stage), where the loss reads a tensor the last stage does not make,
or where two stages read one parameter (a tied embedding and head), is refused (`check_stages`).

The micro-batches: the stage graphs are captured at the group's micro-batch (the global batch /
m), which rank i holds its share of (the plan's batch shares, the same at every stage). The
runner hands every rank of pipeline i the samples [m x start_i, m x stop_i) of the global batch
(`rank_batches`: the plan's `data_slices`), (start_i, stop_i) its share's place in a
micro-batch; torch's schedule cuts them into m chunks of the share. Micro-batch j of the group
is the ranks' chunks j, a sum over samples like any other: the global batch's loss and
gradients are those of one device.

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

import json
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from bench.core.interfaces import Plan, RankContext
from bench.runtime.compat import no_handshake_with_itself, ordered_group
from methods.auto.hap_stages import (
    StageGraph,
    _batch_like,
    _whole_samples,
    rank_batches,
    stage_graph,
    stage_program,
)
from methods.common import GroupTable, check_training_options, group_table, scale_to_norm
from methods.graph import Graph, capture_config
from methods.hap.codegen import CodegenOptions, RankProgram
from methods.pipeline.cut import cut_graph
from methods.pipeline.schedule import is_multi_stage, schedule_class

# The plan format (plan.details["hap_stages"]; docs/hap-runtime.md, "Pipelines of hap stages").
FORMAT_KEYS = ("cuts", "groups", "batch_shares", "micro_batch", "num_micro_batches", "schedule", "stages")
WHERE = 'plan.details["hap_stages"]'


def check_hap_stages(hs: dict, world_size: int) -> None:
    """Refuse a malformed plan of hap stages: one line naming the field, its value and the rule
    (ValueError)."""
    missing = [k for k in FORMAT_KEYS if k not in hs]
    if missing:
        raise ValueError(f"{WHERE} lacks {missing}; a plan of hap stages has {list(FORMAT_KEYS)}")
    cuts, groups, shares, mb = hs["cuts"], hs["groups"], hs["batch_shares"], hs["micro_batch"]
    S = len(groups)
    if S < 2:
        raise ValueError(
            f"{WHERE}['groups']={groups} holds {S} stage; a pipeline of hap stages has 2 or more "
            "(one stage over the cluster is method=hap's plan)"
        )
    if len(cuts) != S + 1 or cuts[0] != 0 or any(a >= b for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"{WHERE}['cuts']={cuts} must rise from 0 in {S} steps, one a stage of 'groups'")
    if len(hs["stages"]) != S:
        raise ValueError(f"{WHERE}['stages'] holds {len(hs['stages'])} plans for {S} stages; give one a stage")
    R = len(groups[0])
    if any(len(g) != R for g in groups) or sorted(r for g in groups for r in g) != list(range(world_size)):
        raise ValueError(
            f"{WHERE}['groups']={groups} must give every stage the same number of ranks and hold each rank "
            f"0..{world_size - 1} once"
        )
    if len(shares) != R or any(n < 1 for n in shares) or sum(shares) != mb:
        raise ValueError(
            f"{WHERE}['batch_shares']={shares} must give each of a group's {R} ranks at least one sample of "
            f"the micro-batch, micro_batch={mb} in all"
        )
    m, schedule = hs["num_micro_batches"], hs["schedule"]
    if m < 1:
        raise ValueError(f"{WHERE}['num_micro_batches']={m} must be at least 1")
    try:
        cls = schedule_class(schedule)
    except ValueError as err:
        raise ValueError(f"{WHERE}['schedule']={schedule!r}: {err}") from None
    if is_multi_stage(schedule):
        raise ValueError(
            f"{WHERE}['schedule']={schedule!r} runs several stages a rank; a pipeline of hap stages runs one "
            "(1F1B, GPipe)"
        )
    if cls.__name__ == "Schedule1F1B" and m < S:
        raise ValueError(f"{WHERE}['num_micro_batches']={m}: 1F1B needs one micro-batch a stage at least ({S})")
    rows = {json.dumps(d.get("ratios")) for d in hs["stages"]}
    row = hs["stages"][0].get("ratios")
    if len(rows) != 1 or not isinstance(row, list) or len(row) != 1 or len(row[0]) != R:
        raise ValueError(
            f"{WHERE}['stages']: their 'ratios' ({sorted(rows)}) must be one row of {R} ratios, the same at every "
            "stage (a micro-batch is split alike at every stage)"
        )
    grains = sorted({d.get("granularity", "gpu") for d in hs["stages"]})
    if grains != ["gpu"]:
        raise ValueError(
            f"{WHERE}['stages']: granularity {grains}; a stage's program runs per GPU (machine-level stage plans "
            "have no runtime)"
        )


def stage_graphs(model_cfg, hs: dict) -> tuple[Graph, GroupTable, list[StageGraph]]:
    """The stage graphs a plan of hap stages was made on, rebuilt as its format fixes them: the
    model's graph at the micro-batch, each stage `stage_graph` of its cuts, the last without the
    loss's tail (`loss=False`); refused where a pipeline cannot run them (`check_stages`)."""
    graph = capture_config(model_cfg, hs["micro_batch"])
    table = group_table(graph)
    cuts = hs["cuts"]
    if cuts[-1] != table.num_groups:
        raise ValueError(f"{WHERE}['cuts']={cuts} must end at the model's {table.num_groups} layer groups")
    S = len(cuts) - 1
    stages = [stage_graph(graph, table, cuts[s], cuts[s + 1], loss=s + 1 < S) for s in range(S)]
    check_stages(graph, table, stages)
    return graph, table, stages


def check_stages(graph: Graph, table: GroupTable, stages: Sequence[StageGraph]) -> None:
    """Refuse stages of `graph` a pipeline cannot run (ValueError, one line): a stage after the
    first that reads a tensor the stage before does not make (made two or more stages before
    it, or a model input: torch's schedule hands a stage only the stage before's outputs), a
    loss's tail that reads a tensor the last stage does not make (loss_fn gets only the last
    stage's outputs), or a parameter two stages read (a tied embedding and head: each stage's
    ranks would train a copy of their own). The planner avoids such cuts."""
    cuts = [st.first for st in stages] + [stages[-1].end]

    def made(names: Sequence[str]) -> str:
        groups = {t: table.node_group.get(t) for t in names}
        return ", ".join(
            f"{t} (layer group {g})" if g is not None else f"{t} (a model input)" for t, g in groups.items()
        )

    for k in range(1, len(stages)):
        st, before = stages[k], stages[k - 1]
        far = [t for t in st.crossing_in if t not in before.crossing_out] + list(st.model_inputs)
        if far:
            raise ValueError(
                f"{WHERE}['cuts']={cuts}: stage {k} (layer groups [{st.first}, {st.end})) reads {made(far)}, which "
                f"stage {k - 1} does not make; a stage receives only what the stage before hands on: cut so that "
                "no stage reads past the stage before it"
            )
    tail, targets = set(table.tail), set(table.targets)
    read = [i for n in graph.nodes if n.name in tail for i in n.inputs if i not in tail and i not in targets]
    far = [t for t in dict.fromkeys(read) if t not in stages[-1].crossing_out]
    if far:
        raise ValueError(
            f"{WHERE}['cuts']={cuts}: the loss reads {made(far)}, which the last stage (layer groups "
            f"[{stages[-1].first}, {stages[-1].end})) does not make; the loss receives only the last stage's "
            "outputs: cut so that the last stage makes what the loss reads"
        )
    readers: dict[str, list[int]] = {}
    for k, st in enumerate(stages):
        for n in st.graph.nodes:
            if n.kind == "get_attr" and n.is_param:
                readers.setdefault(str(n.fx_node.target), []).append(k)
    tied = [f"{name} by stages {ks}" for name, ks in readers.items() if len(ks) > 1]
    if tied:
        raise ValueError(
            f"{WHERE}['cuts']={cuts}: a tied parameter is read by several stages ({'; '.join(tied)}), each of "
            "which would train a copy of its own: cut so that one stage holds all its readers"
        )


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
                f"(it receives {list(arg_names)}): a tensor made before the stage before cannot reach it (check_stages)"
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
    """One rank of a pipeline of hap stages: rank `rank` of stage `stage_index`'s group, its
    program a PipelineStage of torch's schedule. A step is `run_schedule` (gradients accumulated
    over the micro-batches), `sync_grads`, optionally `clip_global_norm`, then `optimizer.step()`
    (HapStagesTrainer.step runs them in that order).

    Args:
        graph, table: the model's graph at the group's micro-batch and its layer groups.
        stages: every stage's StageGraph (the last one made with `loss=False`).
        details: every stage's plan (stage_details); one ratio row, the same at every stage.
        batch_shares: the samples of a micro-batch each rank of a group holds.
        model: the full model, initialised as on every other rank.
        stage_index, rank: the rank's stage, and its place in the stage's group (its pipeline).
        stage_group, pipeline_group: the process groups of the rank's stage (ranked as the
            group's list) and its pipeline (ranked by stage: torch's schedule places stage s
            on the group's rank s).
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
        check_stages(graph, table, stages)
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
        self.device = device = device or torch.device("cpu")
        self.group_rank = rank
        pipe = no_handshake_with_itself(
            PipelineStage(self.module, stage_index, S, device, example_in, example_out, group=pipeline_group)
        )
        self.loss_scale = loss_scale
        # Every stage gets a loss function: torch's schedule runs backward where there is one
        # (only the last stage calls it).
        loss_fn = self._loss_fn(graph, table, stage, batch_shares) if self.is_last else _no_loss
        self.schedule = schedule_class(schedule)(pipe, num_micro_batches, loss_fn=loss_fn, scale_grads=False)
        self.params = [self.program.params[n] for n in self.program.param_order]
        self.replicated = [self.program.params[n] for n in self.program.grad_sync]
        self.sharded = [self.program.params[n] for n in self.program.param_order if n in self.program.sharded]
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

    def run_schedule(self, inputs: Sequence[torch.Tensor], targets: torch.Tensor | None) -> list[torch.Tensor]:
        """torch's schedule over the pipeline's batch: `inputs` (read on the first stage) and
        `targets` (on the last) are its m micro-batches' samples one after another, which the
        schedule cuts into m chunks. Gradients accumulate into the parameters' `.grad`. Returns
        the micro-batches' scaled losses (the last stage; empty elsewhere)."""
        losses: list[torch.Tensor] = []
        args = tuple(inputs) if self.is_first else ()
        kwargs = {"target": targets, "losses": losses} if self.is_last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        return losses

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

    def clip_global_norm(self, max_norm: float) -> torch.Tensor:
        """Every rank's gradients scaled by one factor, the norm over the whole model: each
        rank's shards of its sharded parameters, and each replicated parameter once per stage
        (on its group's rank 0: after sync_grads every rank of the stage holds it whole), summed
        by one all-reduce over every rank (the default group). The sum of squares lives on the
        rank's device (NCCL reduces device tensors only) and the factor stays a tensor there,
        as torch.nn.utils.clip_grad_norm_ keeps it: no read on the host. Returns the norm."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.params if self.group_rank == 0 else self.sharded:
            if p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq)
        norm = sq.sqrt()
        scale_to_norm((p.grad for p in self.params), norm, max_norm)
        return norm

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(gradients, parameters) of the stage reassembled to full size, by the model's names
        (collective among the stage's ranks: each calls it)."""
        return self.program.full_tensors(lambda p: p.grad), self.program.full_tensors(lambda p: p)


class HapStagesTrainer:
    """The Trainer of a plan of hap stages on this rank: its stage and pipeline read from
    `plan.details["hap_stages"]` (the format: docs/hap-runtime.md, "Pipelines of hap stages"),
    the stage graphs rebuilt as the plan's (`stage_graphs`), every process group made (stage
    groups s = 0..S-1 as `groups[s]` orders them, then pipeline groups i = 0..R-1, on every
    process in that order), and its `HapStageRank`.

    A step takes what the runner hands the rank (its `plan.data_slices` of the global batch:
    `rank_batches`, which the plan must carry): the inputs and targets of its pipeline's m
    micro-batches one after another. It runs torch's schedule, sums the stage's replicated
    gradients, clips by the global norm (`grad_clip` > 0), steps Adam, and returns the rank's
    summed loss (the last stage's ranks; 0 elsewhere), detached: the runner sums the ranks'.
    On an emulated cluster the schedule's sends go over the emulated links (install_p2p) and
    the optimizer's compute is stretched, as the pipeline's trainer does; the program's
    collectives are the emulator's own.

    Args:
        plan: the plan (details["hap_stages"], data_slices).
        model: the full model at its initial values (on meta: materialised from ctx.weights).
        ctx: the rank's RankContext.
        lr: Adam's learning rate.
        grad_clip: the max global gradient norm over every stage (0: off).
        mirror_full_state: tests: after each step every stage's parameters and gradients,
            reassembled, are written into `model` on global rank 0 (`full_model`, which the
            runner reads the state of).
    """

    def __init__(
        self,
        plan: Plan,
        model: nn.Module,
        ctx: RankContext,
        lr: float = 5e-4,
        grad_clip: float = 0.0,
        mirror_full_state: bool = False,
    ):
        check_training_options(lr, grad_clip)
        hs = (plan.details or {}).get("hap_stages")
        if hs is None:
            raise ValueError(f"{WHERE} is missing: plan {plan.method!r} is no plan of hap stages")
        check_hap_stages(hs, ctx.world_size)
        m, mb = hs["num_micro_batches"], hs["micro_batch"]
        if m * mb != ctx.workload.global_batch:
            raise ValueError(
                f"{WHERE}: num_micro_batches={m} x micro_batch={mb} is not the global batch "
                f"{ctx.workload.global_batch}; plan for this workload"
            )
        _, slices = rank_batches(hs)
        given = None if plan.data_slices is None else [tuple(x) for x in plan.data_slices]
        if given != slices:
            raise ValueError(
                f"plan.data_slices={plan.data_slices} must be each rank's samples of this plan, {slices}: set "
                "Plan.batch_shares and Plan.data_slices from methods.auto.hap_stages.rank_batches"
            )
        graph, table, stages = stage_graphs(ctx.workload.model_cfg, hs)
        groups = hs["groups"]
        R = len(groups[0])
        s, i = next((s, g.index(ctx.rank)) for s, g in enumerate(groups) if ctx.rank in g)
        self.stage_index, self.pipeline = s, i
        self.samples = m * hs["batch_shares"][i]
        self.rank, self.world, self.emulator = ctx.rank, ctx.world_size, ctx.emulator
        if any(p.is_meta for p in model.parameters()):
            if ctx.weights is None:
                raise ValueError("the model's parameters are on meta and ctx.weights is None: nothing to train")
            ctx.weights.materialize(model, ctx.device)
        stage_groups = [ordered_group(list(g)) for g in groups]
        pipeline_groups = [ordered_group([g[k] for g in groups]) for k in range(R)]
        if ctx.emulator.enabled:
            from bench.runtime.p2p import install_p2p

            install_p2p(ctx.emulator)  # activations' sends go over the emulated links
        self.stage_rank = HapStageRank(
            graph,
            table,
            stages,
            hs["stages"],
            hs["batch_shares"],
            model,
            s,
            i,
            stage_groups[s],
            pipeline_groups[i],
            m,
            hs["schedule"],
            lr,
            1.0 / ctx.workload.targets_per_iter,
            device=ctx.device,
        )
        self.program = self.stage_rank.program
        self.grad_clip = grad_clip
        self.grad_norm: torch.Tensor | None = None  # the last step's norm before clipping
        self.full_model = model if mirror_full_state else None

    def step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        wrong = [tuple(t.shape) for t in batch if t.shape[0] != self.samples]
        if wrong:
            raise ValueError(
                f"rank {self.rank} got a batch of shapes {wrong}; pipeline {self.pipeline} trains {self.samples} "
                "samples a step (its plan.data_slices entry)"
            )
        engine = self.stage_rank
        engine.optimizer.zero_grad(set_to_none=True)
        losses = engine.run_schedule(batch[:-1], batch[-1])
        engine.sync_grads()
        if self.grad_clip:
            self.grad_norm = engine.clip_global_norm(self.grad_clip)
        engine.optimizer.step()
        self.emulator.stretch()  # the optimizer's compute (and what followed the last wait)
        if self.full_model is not None:
            self.write_full_state()
        if losses:  # the micro-batches' scaled losses, back to the summed loss
            return (torch.stack([x.detach() for x in losses]).sum() / engine.loss_scale).detach()
        return torch.zeros(())

    def write_full_state(self) -> None:
        """Tests: every stage's parameters and gradients, reassembled over its group (rank 0 of
        each group sends them), written into global rank 0's full model. Collective: every rank
        calls it."""
        grads, params = self.stage_rank.full_state()
        mine = {}
        if self.stage_rank.group_rank == 0:
            mine = {n: (v.cpu(), None if n not in grads else grads[n].cpu()) for n, v in params.items()}
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine)
        if self.rank != 0:
            return
        own = {id(p) for p in self.stage_rank.params}
        with torch.no_grad():
            for part in everyone:
                for name, (value, grad) in part.items():
                    p = self.full_model.get_parameter(name)
                    if id(p) in own:  # this rank's replicated parameter itself
                        continue
                    p.copy_(value)
                    p.grad = None if grad is None else grad.to(p.device)
