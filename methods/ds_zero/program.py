"""DeepSpeed ZeRO's iteration as a Program for the simulator: per-op FLOPs and parameter bytes of
the traced model, then the collectives and memory of each ZeRO stage and the MoE all-to-alls.

It prices what the engine does; it imports no deepspeed and runs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.core.interfaces import Workload
from bench.core.program import Affine, Collective, Memory, Program, Stage, micro_step_stages
from methods.ds_zero.moe import deepspeed_capacity

ZERO_STAGES = (0, 1, 2, 3)
FP32_BYTES = 4
# Adam's two moments; ZeRO 1-3 also keep an fp32 copy of the parameter partition (even in fp32
# training), so their optimizer state is three parameter-sized tensors per partition.
ADAM_STATE_COPIES = 2
ZERO_STATE_COPIES = 3


@dataclass(frozen=True)
class OpCost:
    """One parameter-holding op of the traced model, with the parameter-free ops before it."""

    fwd_flops: float  # per sample
    bwd_flops: float  # per sample
    param_bytes: float
    max_param_bytes: float  # the largest single parameter it reads (ZeRO-3 persistence)
    moe_layer: int | None = None  # index of the MoE layer whose experts it belongs to
    recomputed: bool = False  # an activation checkpoint runs it again in backward


@dataclass(frozen=True)
class WorkloadProfile:
    ops: tuple[OpCost, ...]
    activation_bytes_per_sample: float
    # Per MoE layer: bytes one device sends in one all-to-all, per sample of its batch.
    moe_all_to_all_bytes_per_sample: tuple[float, ...] = ()
    checkpoint_units: tuple = ()  # the activation checkpoints (methods.common.CheckpointUnit)
    # autocast's casts of the parameters per parameter byte (Graph.param_casts over
    # Graph.param_bytes): a rank keeps the cast of every parameter it uses (ZeRO-3's gathered
    # ones too, which the ops that read them save), as Memory.casts
    cast_per_param_byte: float = 0.0


def profile_workload(
    workload: Workload, batch: int, moe: dict | None, device_type: str, checkpointing: bool = False
) -> WorkloadProfile:
    """Per-op FLOPs and parameter bytes from the capture of the single-device model (batch norm
    as the engine's ranks run it, each normalising its own samples), at `batch` samples (a
    rank's micro-batch). With `checkpointing`, every layer group that can be is an activation
    checkpoint (methods.common.checkpoint_units): its ops' forward FLOPs count in backward again
    and the activations are the checkpointed graph's.

    The MoE layers' FLOPs are those of models.bert_moe at its slots per sequence, which are
    DeepSpeed's slots too with the default capacity factor (matching_capacity_factor); its
    per-sequence dense dispatch adds a few % to the experts' FLOPs that DeepSpeed's index-based
    dispatch does not spend. An explicit method.moe_capacity_factor or moe_min_capacity that
    gives DeepSpeed other slots changes the all-to-all bytes here, not the FLOPs.
    """
    from methods.common import checkpoint_units, refuse_global_batch_norm
    from methods.graph import capture_priced

    graph = capture_priced(workload.model_cfg, batch, workload.precision, device_type, "local")
    refuse_global_batch_norm(workload, graph, "deepspeed", "each rank's share")
    units = tuple(checkpoint_units(graph)) if checkpointing else ()
    graph = graph.with_recompute([u.nodes for u in units])
    expert_prefixes: dict[str, int] = {}
    if moe:
        from models.bert_moe import MoE as ZooMoE

        with torch.device("meta"):
            model = workload.model_cfg.build()
        names = [name for name, m in model.named_modules() if isinstance(m, ZooMoE)]
        expert_prefixes = {f"{name}.{p}": i for i, name in enumerate(names) for p in ("w1", "b1", "w2", "b2")}
    ops: list[OpCost] = []
    fwd = bwd = 0.0
    for node in graph.nodes:
        fwd += node.flops / batch
        bwd += graph.backward_flops(node) / batch
        params = [graph[i] for i in node.inputs if graph[i].is_param]
        if params and node.kind != "output":
            layers = {expert_prefixes.get(str(p.fx_node.target)) for p in params}
            layer = next(iter(layers)) if len(layers) == 1 else None
            nbytes = [float(p.nbytes) for p in params]
            ops.append(OpCost(fwd, bwd, sum(nbytes), max(nbytes), layer, node.name in graph.recomputed))
            fwd = bwd = 0.0
    if ops and (fwd or bwd):
        last = ops[-1]
        ops[-1] = OpCost(
            last.fwd_flops + fwd,
            last.bwd_flops + bwd,
            last.param_bytes,
            last.max_param_bytes,
            last.moe_layer,
            last.recomputed,
        )
    a2a: tuple[float, ...] = ()
    if moe:
        # DeepSpeed's dispatch buffer: num_experts x capacity x d_model fp32 on every device, with
        # the capacity its gate computes for the device's batch of tokens.
        capacity = deepspeed_capacity(
            batch * workload.model_cfg.seq_len,
            moe["num_experts"],
            moe["capacity_factor"],
            moe["k"],
            moe["min_capacity"],
        )
        per_sample = moe["num_experts"] * capacity * moe["d_model"] * FP32_BYTES / batch
        a2a = tuple(per_sample for _ in range(len(expert_prefixes) // 4))
    # Every activation kept beside the most activation gradients backward holds at once (and,
    # checkpointed, the largest unit's recompute).
    casts = sum(graph.param_casts.values()) / max(graph.param_bytes(), 1)
    return WorkloadProfile(
        tuple(ops), (graph.activation_bytes() + graph.peak_bytes_in_flight()) / batch, a2a, units, casts
    )


def zero_program(
    profile: WorkloadProfile,
    *,
    num_devices: int,
    global_batch: int,
    zero_stage: int,
    reduce_bucket_bytes: float,
    allgather_bucket_bytes: float,
    persistence_bytes: float,
    micro_steps: int = 1,
    meta: dict | None = None,
) -> Program:
    """The Program of one DeepSpeed ZeRO iteration (one segment, even ratios; per GPU).

    `micro_steps` > 1: DeepSpeed's gradient accumulation, forward and backward at
    global_batch / micro_steps samples that many times (the profile's op costs per sample);
    ZeRO 0/1 all-reduce the gradients at the last micro-step only (the engine reduces at the
    accumulation boundary), ZeRO-2 at every one (it reduces into the partitions as it goes),
    ZeRO-3 gathers parameters and reduce-scatters gradients at every one; ZeRO 1/2 gather the
    updated parameters once, after the step. An op an activation checkpoint recomputes costs its
    forward again in backward (the profile's backward FLOPs), and an MoE layer inside a
    checkpoint its two forward all-to-alls again.

    What each stage communicates (P = dense parameter bytes, n = devices):
      * ZeRO 0-2: forward and backward, then the gradients all-reduced in reduce buckets once
        backward is done (overlap_comm is off by default for stages 0-2; DeepSpeed 0.19's
        ZeRO-1/2 all-reduce whole buckets, use_multi_rank_bucket_allreduce=true, rather than
        reduce-scatter). ZeRO 1/2 then all-gather the updated parameters: each device sends
        its P / n partition, in allgather buckets.
      * ZeRO 3: parameters above the persistence threshold are all-gathered before each op in
        forward and again in backward (shard p / n per device), gradients reduce-scattered
        in reduce buckets; overlap_comm and prefetching are on by default, so these overlap
        the computation (an optimistic bound).
      * MoE layers: two all-to-alls in forward (dispatch, combine) and two in backward, each
        moving a device's dispatch buffer (see profile_workload). Expert parameters are not
        reduced across devices: each device owns num_experts / n experts.
    Memory per device (X = this device's expert bytes = expert bytes / n):
      params P + X (ZeRO-3: sharded P / n plus persistent ones and the largest gathered op),
      grads P + X (ZeRO 2/3: P / n + X), plus for ZeRO 1/2 the reduce bucket DeepSpeed allocates
      at its configured size (5e8 fp32 elements = 2 GB by default) and for ZeRO-3 one bucket of
      at most P; optimizer Adam 2 (P + X)
      (ZeRO 1-3: 3 P / n + 3 X, with DeepSpeed's fp32 partition copy).
    """
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage} must be one of {ZERO_STAGES}")
    if micro_steps < 1 or global_batch % micro_steps:
        raise ValueError(f"micro_steps={micro_steps} must be >= 1 and divide global_batch={global_batch}")
    n, B = num_devices, global_batch // micro_steps  # B: samples per micro-step
    ops = profile.ops
    dense = [0.0 if o.moe_layer is not None else o.param_bytes for o in ops]
    dense_bytes = sum(dense)
    expert_bytes = sum(o.param_bytes for o in ops if o.moe_layer is not None) / n
    a2a = profile.moe_all_to_all_bytes_per_sample
    gathered = [0.0] * len(ops)
    if zero_stage == 3:
        gathered = [d if o.max_param_bytes >= persistence_bytes else 0.0 for o, d in zip(ops, dense)]

    def a2a_collective(layer: int, label: str) -> Collective:
        return Collective("all_to_all", Affine.sharded(a2a[layer] * B), label=f"moe {layer} {label}")

    stages: list[Stage] = []
    flops = 0.0
    pending: list[Collective] = []
    overlap3 = zero_stage == 3

    def close(label: str, overlap: bool = False) -> None:
        nonlocal flops, pending
        if flops or pending:
            stages.append(
                Stage(tuple(pending), Affine.sharded(flops * B), overlap=overlap and bool(pending), label=label)
            )
        flops, pending = 0.0, []

    # Forward.
    prev_layer = None
    for i, o in enumerate(ops):
        if o.moe_layer != prev_layer:
            if prev_layer is not None:
                close(f"forward, moe {prev_layer} experts")
                pending.append(a2a_collective(prev_layer, "combine (forward)"))
            if o.moe_layer is not None:
                close("forward")
                pending.append(a2a_collective(o.moe_layer, "dispatch (forward)"))
            prev_layer = o.moe_layer
        if gathered[i]:
            close("forward", overlap3)
            pending.append(Collective("all_gather", Affine(gathered[i] / n), label=f"param all_gather op {i}"))
        flops += o.fwd_flops
    if prev_layer is not None:
        close(f"forward, moe {prev_layer} experts")
        pending.append(a2a_collective(prev_layer, "combine (forward)"))
    # Backward, in reverse; the gradient buckets fill as ops finish.
    prev_layer = None
    bucket = 0.0
    buckets: list[float] = []
    for i in range(len(ops) - 1, -1, -1):
        o = ops[i]
        if o.moe_layer != prev_layer:
            if prev_layer is not None:
                close(f"backward, moe {prev_layer} experts")
                pending.append(a2a_collective(prev_layer, "dispatch (backward)"))
            if o.moe_layer is not None:
                close("backward")
                if o.recomputed:  # the checkpoint's recompute runs the layer's forward again
                    pending.append(a2a_collective(o.moe_layer, "dispatch (recompute)"))
                    pending.append(a2a_collective(o.moe_layer, "combine (recompute)"))
                pending.append(a2a_collective(o.moe_layer, "combine (backward)"))
            prev_layer = o.moe_layer
        if gathered[i]:
            close("backward", overlap3)
            pending.append(Collective("all_gather", Affine(gathered[i] / n), label=f"param all_gather op {i}"))
        if zero_stage == 3 and bucket >= reduce_bucket_bytes:
            close("backward", True)
            pending.append(Collective("reduce_scatter", Affine(bucket / n), label="grad reduce_scatter bucket"))
            bucket = 0.0
        flops += o.bwd_flops
        bucket += dense[i]
        if zero_stage < 3 and bucket >= reduce_bucket_bytes:
            buckets.append(bucket)
            bucket = 0.0
    if prev_layer is not None:
        close(f"backward, moe {prev_layer} experts")
        pending.append(a2a_collective(prev_layer, "dispatch (backward)"))
    close("backward")
    reduce: list[Stage] = []  # the gradients' reduction of a micro-step that reduces them
    if zero_stage == 3:
        if bucket:
            stages.append(
                Stage(
                    (Collective("reduce_scatter", Affine(bucket / n), label="grad reduce_scatter bucket"),),
                    label="gradient reduce_scatter",
                )
            )
    else:
        if bucket:
            buckets.append(bucket)
        colls = tuple(Collective("all_reduce", Affine(b), label=f"grad bucket {k}") for k, b in enumerate(buckets))
        if colls:
            reduce.append(Stage(colls, label="gradient all_reduce"))
    if zero_stage == 2:
        stages = list(micro_step_stages(stages + reduce, micro_steps, sync_each=True))
    else:
        stages = list(micro_step_stages(stages, micro_steps, sync_each=True)) + reduce
    if zero_stage in (1, 2) and dense_bytes:
        # DeepSpeed splits the gather into max(1, P // allgather bucket) calls.
        calls = max(1, int(dense_bytes // allgather_bucket_bytes))
        gather = Collective("all_gather", Affine(dense_bytes / n / calls), label="param all_gather")
        stages.append(Stage((gather,) * calls, label="parameter all_gather"))
    bucket_bytes = min(dense_bytes, reduce_bucket_bytes)
    casts = Affine(profile.cast_per_param_byte * (dense_bytes + expert_bytes))
    if zero_stage == 0:
        memory = Memory(
            Affine(dense_bytes + expert_bytes),
            Affine(dense_bytes + expert_bytes),
            Affine(ADAM_STATE_COPIES * (dense_bytes + expert_bytes)),
            Affine.sharded(profile.activation_bytes_per_sample * B),
            casts=casts,
        )
    else:
        params = dense_bytes + expert_bytes
        if zero_stage == 3:
            persistent = sum(d for d, g in zip(dense, gathered) if not g)
            params = (dense_bytes - persistent) / n + persistent + max(gathered, default=0.0)
        # ZeRO 1/2 stage gradients in a reduce bucket allocated at its full configured size.
        bucket = reduce_bucket_bytes if zero_stage < 3 else bucket_bytes
        grads = (dense_bytes if zero_stage == 1 else dense_bytes / n) + expert_bytes + bucket
        memory = Memory(
            Affine(params),
            Affine(grads),
            Affine(ZERO_STATE_COPIES * (dense_bytes / n + expert_bytes)),
            Affine.sharded(profile.activation_bytes_per_sample * B),
            casts=casts,
        )
    return Program(tuple(stages), n, 1, "gpu", memory, dict(meta or {}), micro_steps=micro_steps)
