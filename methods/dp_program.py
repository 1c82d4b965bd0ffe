"""The Program of data-parallel training (DDP's buckets, its overlap, its memory), built from a
model's per-layer costs: what dp_ev and dp_cp run and what their plans are priced as."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.core.program import (
    Affine,
    Collective,
    Memory,
    Program,
    Stage,
    backward_sweep,
    bucket_runs,
    micro_step_stages,
)


def data_parallel_program(
    num_devices: int,
    global_batch: int,
    layers: Sequence[tuple],
    activation_bytes_per_sample: float,
    *,
    bucket_cap_bytes: float = 25 * 2**20,
    overlap: bool = True,
    optimizer_bytes_per_param_byte: float = 2.0,
    backward_factor: float = 2.0,
    granularity: str = "gpu",
    bucket_copies: bool = False,
    backward_memory: tuple[Sequence, ...] | None = None,
    grads_before_backward: bool = False,
    largest_param_bytes: float | None = None,
    micro_steps: int = 1,
    cast_bytes: float = 0.0,
    meta: dict[str, Any] | None = None,
) -> Program:
    """The Program of DDP training with the batch split by the (single segment) ratios.

    Args:
        num_devices: data-parallel ranks.
        global_batch: samples per iteration; device d computes ratio[d] of them.
        layers: (forward FLOPs per sample, parameter bytes[, op class, forward ops[, backward
            FLOPs per sample[, forward ops run again in backward]]]) per layer in forward order
            (methods.graph.Graph.layer_profile); FLOPs of parameter-free ops belong to some
            neighbouring layer. Without class and ops a layer is one "other" op; without
            backward FLOPs its backward is backward_factor x forward; the ops an activation
            checkpoint runs again add their kernels to backward's.
        activation_bytes_per_sample: bytes forward keeps for backward, per sample.
        bucket_cap_bytes: DDP gradient bucket size (DDP's default 25 MiB).
        overlap: bucket all-reduces run during the rest of backward (DDP) or after it.
        optimizer_bytes_per_param_byte: optimizer state per parameter byte (Adam: 2).
        backward_factor: backward FLOPs / forward FLOPs of layers that do not give theirs.
        granularity: whether a device is a GPU or a machine (DP inside it).
        bucket_copies: the gradients' buckets are a copy of them (torch's DDP), not the
            gradients' own storage (hap's runtime: methods.hap.runtime.GradBuckets).
        backward_memory: (gradients, activations[, gradients in flight]) as
            methods.graph.Graph.backward_memory gives them, activations at the whole batch:
            where the peak of backward is (backward_sweep); None: every gradient beside every
            activation.
        grads_before_backward: the gradients' storage exists before backward (hap's buckets
            with more than one device), not made as backward goes (DDP, which sets them to
            None each step).
        largest_param_bytes: the largest parameter tensor's bytes (Memory.largest_param).
        micro_steps: gradient accumulation: forward and backward over global_batch /
            micro_steps samples that many times, the gradients all-reduced in the last
            (micro_step_stages); backward_memory's activations are scaled to the micro-batch.
        cast_bytes: autocast's casts of the parameters every rank keeps (Memory.casts).

    Stages: forward + the backward of the last layers up to the first full bucket; then one
    stage per bucket whose all-reduce overlaps the backward of the layers before it.
    """
    if global_batch < 1 or num_devices < 1 or micro_steps < 1 or global_batch % micro_steps:
        raise ValueError(
            f"global_batch={global_batch}, num_devices={num_devices} and micro_steps={micro_steps} must be >= 1, "
            "and micro_steps must divide global_batch"
        )
    micro = global_batch // micro_steps  # samples per micro-step
    layers = [
        tuple(layer[:4])
        + ("other", 1.0)[len(layer) - 2 :]
        + (layer[4] if len(layer) > 4 else backward_factor * layer[0], layer[5] if len(layer) > 5 else 0)
        for layer in layers
    ]
    param_bytes = sum(layer[1] for layer in layers)
    fwd_launches = sum(layer[3] for layer in layers)
    # Walk backward, layers bucketed by their gradients (bucket_runs). A bucket keeps its FLOPs
    # per class and its kernels (backward: two per parameter op, one otherwise).
    backward = list(reversed(layers))
    buckets: list[tuple[dict, float, float]] = []  # (backward FLOPs per sample by class, bytes, launches)
    for run in bucket_runs([(layer[1], None) for layer in backward], bucket_cap_bytes):
        by_class: dict[str, float] = {}
        for _, _, cls, _, bwd, _ in (backward[i] for i in run):
            by_class[cls] = by_class.get(cls, 0.0) + bwd
        buckets.append(
            (
                by_class,
                sum(backward[i][1] for i in run),
                float(sum(backward[i][3] + (1 if backward[i][1] else 0) + backward[i][5] for i in run)),
            )
        )
    if len(buckets) > 1 and not buckets[-1][1] and not sum(buckets[-1][0].values()):
        buckets.pop()  # nothing after the last full bucket
    if not buckets:
        buckets.append(({}, 0.0, 0.0))
    fwd_class: dict[str, float] = {}
    for f, _, cls, _, _, _ in layers:
        fwd_class[cls] = fwd_class.get(cls, 0.0) + f
    stages = []
    pending: Collective | None = None
    for i, (classes, nbytes, launches) in enumerate(buckets):
        if i == 0:
            for cls, f in fwd_class.items():
                classes = {**classes, cls: classes.get(cls, 0.0) + f}
        bflops = sum(classes.values())
        flops = Affine.sharded(bflops * micro)
        stages.append(
            Stage(
                (pending,) if pending else (),
                flops,
                overlap=overlap and pending is not None,
                grad_bytes=Affine(nbytes),
                label="forward+backward" if i == 0 else f"backward, all_reduce bucket {i - 1}",
                op_class=max(classes, key=classes.get) if classes else "other",
                launches=launches + (fwd_launches if i == 0 else 0.0),
            )
        )
        pending = Collective("all_reduce", Affine(nbytes), label=f"grad bucket {i}", grad=True) if nbytes else None
    if pending:
        stages.append(Stage((pending,), overlap=overlap, label=f"all_reduce bucket {len(buckets) - 1}"))
    # Accumulating, every micro-step after the first finds every gradient made before its
    # backward, beside the activations of its micro-batch: the larger peak.
    ready = grads_before_backward or micro_steps > 1
    memory = Memory(
        params=Affine(param_bytes),
        grads=Affine(param_bytes),
        optimizer=Affine(param_bytes * optimizer_bytes_per_param_byte),
        activations=Affine.sharded(activation_bytes_per_sample * micro),
        buckets=Affine(param_bytes if bucket_copies else 0.0),
        casts=Affine(cast_bytes),
        backward=()
        if backward_memory is None
        else backward_sweep(
            [] if ready else [(p, Affine(b)) for p, b in backward_memory[0]],
            [(p, Affine.sharded(b / micro_steps)) for p, b in backward_memory[1]],
            Affine(param_bytes) if ready else Affine(),
            [
                (a, b, Affine.sharded(x / micro_steps))
                for a, b, x in (backward_memory[2] if len(backward_memory) > 2 else ())
            ],
        ),
        largest_param=None if largest_param_bytes is None else Affine(largest_param_bytes),
    )
    return Program(
        micro_step_stages(stages, micro_steps),
        num_devices,
        1,
        granularity,
        memory,
        dict(meta or {}),
        batch=micro,
        micro_steps=micro_steps,
    )
