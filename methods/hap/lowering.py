"""Lowering a synthesized program to the method-neutral Program that bench.cost simulates.

Forward stages in op order, backward in reverse, replicated gradients bucketed and all-reduced as
DDP does (overlapping the rest of backward where asked), then the optimizer's memory. It prices
nothing itself: every stage comes from methods.hap.pricing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from bench.core.program import (
    Affine,
    Collective,
    Memory,
    Program,
    Stage,
    affine_sum,
    backward_sweep,
    bucket_runs,
    micro_step_stages,
)
from methods.hap.pricing import ADAM_STATE_PER_PARAM, CostModel
from methods.hap.steps import Step
from methods.hap.theory import IDENTITY

DDP_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default gradient bucket (bucket_cap_mb=25)


def build_program(
    steps: Sequence[Step],
    cost: CostModel,
    meta: dict | None = None,
    grad_overlap: bool = True,
    bucket_cap_bytes: float = DDP_BUCKET_BYTES,
    micro_steps: int = 1,
    labelled: bool = True,
) -> Program:
    """The bench Program of a synthesized program: forward stages in order, then backward
    stages in reverse, with the memory each device holds.

    Where the graph holds activation checkpoints (methods.graph.Graph.recompute), a
    checkpointed op's backward stage runs its forward again first (its forward collectives
    and FLOPs: methods.hap.pricing), it keeps nothing from forward but the unit's inputs, which
    the checkpoint keeps in the layout they are made in, and what it would have kept lives
    again from the start of its unit's backward (a window, as activation gradients).

    Args:
        grad_overlap: replicated parameters' gradient all-reduces run asynchronously beside
            the rest of backward, in buckets of `bucket_cap_bytes` (what DDP does, and what
            the runtime does with async collectives); a later stage that communicates
            activations waits for them (one network). False: each all-reduce runs in its
            op's backward stage, which is exactly the search's (sequential) cost.
        bucket_cap_bytes: gradient bytes per bucket; 0 = one all-reduce per parameter.
        micro_steps: gradient accumulation: the steps are one micro-step's (the graph's batch);
            the iteration runs them micro_steps times, gradients summed inside machines and
            all-reduced in the last only (micro_step_stages), every gradient already made
            when a later micro-step's backward starts.
        labelled: False: the micro-steps' stages are not labelled apart (micro_step_stages), for
            a program that is only priced.
    """
    graph = cost.graph
    kept, keepers, own = graph.kept_until(), graph.keepers(), graph.own_saves()
    plain = graph.with_recompute(())
    plain_kept, plain_keepers, plain_own = plain.kept_until(), plain.keepers(), plain.own_saves()
    checkpoints = {u[0] for u in graph.recompute}  # a unit's first op stands for its checkpoint
    ready = graph.grad_ready()
    position = {step.node: i for i, step in enumerate(steps)}
    # Tensors each op reads as a re-laid copy (gathered, exchanged): the op keeps the copy.
    # A reshard between rows is not counted as a copy (with tied rows it is the tensor itself).
    relaid = [{c.tensor for c in step.comms if not c.free and c.kind != "reshard"} for step in steps]
    unit_end = {  # a checkpointed op -> the position where backward recomputes its unit
        name: max(position[n] for n in unit if n in position) for unit in graph.recompute for name in unit
    }
    windows: list[tuple[int, int, Affine]] = []  # what recomputes hold in backward (from, to, bytes)
    # With more than one rank the runtime's gradients of replicated parameters are views of
    # its buckets, made before backward (methods.hap.runtime.GradBuckets; on machine-level
    # devices every gradient is); a parameter an SFB linear reads as its weight is not bucketed.
    bucketed = sum(v.num_gpus for v in cost.vdevs) > 1
    sfb_weights = {t for step in steps if step.rule.sfb for t in graph[step.node].inputs[1:3]}
    fwd, bwd = [], []
    params = Affine()
    casts = Affine()  # autocast's casts of the parameters, each in its parameter's layout
    param_casts = graph.param_casts
    activations = Affine()
    grads_made: list[tuple[int, Affine]] = []
    kept_bytes: list[tuple[int, Affine]] = []
    grads_before = Affine()
    largest: tuple[int, Affine] | None = None  # (full bytes, bytes on a device) of the largest parameter
    machines = cost.granularity == "machine" and any(v.num_gpus > 1 for v in cost.vdevs)
    for i, step in enumerate(steps):
        if grad_overlap:
            f, b = cost.stages(step, param_sync=False)
            grads = _bucketed_grads(step, cost, machines)
            if machines:  # summed inside the machine in its bucket, not in this stage
                b = dataclasses.replace(b, grad_bytes=Affine())
        else:
            f, b = cost.stages(step)
            grads = []
        fwd.append(f)
        bwd.append((b, grads))
        for t, layout in step.sources:
            if graph[t].is_param:
                nbytes = cost._bytes(t, layout)
                params = params + nbytes
                if t in param_casts:
                    casts = casts + nbytes.scale(param_casts[t] / graph[t].nbytes)
                if largest is None or graph[t].nbytes > largest[0]:
                    largest = (graph[t].nbytes, nbytes)
                if bucketed and (cost.granularity == "machine" or (layout == IDENTITY and t not in sfb_weights)):
                    grads_before = grads_before + nbytes
                else:
                    grads_made.append((position.get(ready[t], i), nbytes))
        # What autograd keeps for backward (methods.graph.Graph.saved_bytes_factor), in the
        # layout it exists in, each until backward has passed the first op that keeps it; a
        # checkpointed op's saves (the plain graph's) are a window of its unit's recompute.
        if step.node in unit_end:
            for nbytes, until in _held(step, i, cost, position, relaid, plain_kept, plain_keepers, plain_own, ()):
                windows.append((until, unit_end[step.node], nbytes))
        for nbytes, until in _held(step, i, cost, position, relaid, kept, keepers, own, checkpoints):
            activations = activations + nbytes
            kept_bytes.append((until, nbytes))
    # Activation gradients, each in the layout of the tensor it is the gradient of.
    layouts = {step.node: step.rule.post for step in steps}
    flying = [
        (position[a], position[b], cost._bytes(t, layouts[t]).scale(f))
        for t, a, b, f in graph.grads_in_flight()
        if t in layouts and a in position and b in position
    ] + windows
    if micro_steps > 1:  # a later micro-step's backward starts with every gradient made
        grads_made, grads_before = [], params
    memory = Memory(
        params,
        params,
        params.scale(ADAM_STATE_PER_PARAM),
        activations,
        casts=casts,
        backward=backward_sweep(grads_made, kept_bytes, grads_before, flying),
        largest_param=None if largest is None else largest[1],
    )
    stages = fwd + (_overlapped_backward(bwd[::-1], bucket_cap_bytes) if grad_overlap else [b for b, _ in bwd[::-1]])
    return Program(
        micro_step_stages(stages, micro_steps, labelled=labelled),
        len(cost.vdevs),
        cost.num_segments,
        cost.granularity,
        memory,
        dict(meta or {}),
        batch=cost.graph.batch_size,
        micro_steps=micro_steps,
    )


def _held(
    step: Step,
    i: int,
    cost: CostModel,
    position: dict,
    relaid: list,
    kept: dict,
    keepers: dict,
    own: dict,
    checkpoints: set,
) -> list[tuple[Affine, int]]:
    """(bytes, the position after which backward frees them) of what autograd keeps of step
    `i`, in the layout it exists in: the op's output (its value while an op that keeps it reads
    it as it is, or a checkpoint keeps it as its unit's input; what the op keeps beside,
    always), the re-laid copies ops that keep them read (a copy made for this op is this op's
    to keep), and its sources that ops keep."""
    graph = cost.graph
    node = graph[step.node]
    held: list[tuple[Affine, float, int]] = []
    if node.shape is not None and step.node in kept:
        t = step.node
        read = any(
            k == t or k in checkpoints or t not in relaid[position[k]] for k in keepers.get(t, ()) if k in position
        )
        factor = own.get(t, 0.0) + (kept[t][0] - own.get(t, 0.0) if read else 0.0)
        held.append((cost._bytes(t, step.rule.post), factor, position.get(kept[t][1], i)))
    for c in step.comms:
        if (
            not c.free
            and c.kind != "reshard"
            and step.node in keepers.get(c.tensor, ())
            and step.node not in checkpoints
        ):
            # the copy, or the cast of it autocast made for this op (Graph.kept_casts)
            cast = graph.kept_casts.get((c.tensor, step.node), 1.0)
            held.append((cost._bytes(c.tensor, c.dst, c.to_segment), cast, i))
    for t, layout in step.sources:
        if t in kept and not graph[t].is_param:
            held.append((cost._bytes(t, layout), kept[t][0], position.get(kept[t][1], i)))
    return [(nbytes.scale(factor), until) for nbytes, factor, until in held if factor]


def _bucketed_grads(step: Step, cost: CostModel, machines: bool) -> list[tuple[float, bool, Affine]]:
    """The gradients of the parameters `step` creates that the runtime sums in buckets, in the
    order GradBuckets fills them (the reverse of creation; backward reverses the steps): (bytes
    that size a bucket, whether it is all-reduced among the devices, bytes summed inside a
    machine). Over GPUs, those of replicated parameters; over machines of several GPUs, every
    parameter's (data parallel inside the machine), sized by the largest machine's share at
    the search's ratios."""
    out = []
    for t, layout in reversed(step.sources):
        if not cost.graph[t].is_param:
            continue
        across = layout == IDENTITY and not step.rule.sfb  # as param_sync
        if machines:
            local = cost._bytes(t, layout)
            size = max(local.at(cost.ratios, d) for d in range(len(cost.vdevs)))
            out.append((size, across, local))
        elif across:
            out.append((float(cost.graph[t].nbytes), True, Affine()))
    return out


def _overlapped_backward(bwd: list[tuple[Stage, list]], cap: float) -> list[Stage]:
    """Backward stages with bucketed gradient all-reduces that overlap later backward compute.

    The gradients are bucketed as the runtime buckets them (bucket_runs, kinds: all-reduced
    among the devices or only inside machines), and a bucket's sync is launched (as a zero-FLOP
    overlapped stage: the all-reduce among the devices, and inside each machine its
    `grad_bytes`) once the backward stage that made its last gradient is done; compute-only
    stages keep running beside it; a stage with its own collectives waits for the network."""
    grads = [(k, g) for k, (_, gs) in enumerate(bwd) for g in gs]
    runs = bucket_runs([(size, across) for _, (size, across, _) in grads], cap)
    done: dict[int, list[int]] = {}  # backward stage -> the buckets its gradients complete
    for b, run in enumerate(runs):
        done.setdefault(grads[run[-1]][0], []).append(b)
    out: list[Stage] = []
    for k, (st, _) in enumerate(bwd):
        out.append(dataclasses.replace(st, overlap=not st.collectives))
        for b in done.get(k, ()):
            members = [grads[j][1] for j in runs[b]]
            colls = ()
            if members[0][1]:
                nbytes = sum(size for size, _, _ in members)
                colls = (Collective("all_reduce", Affine(nbytes), label=f"grad bucket {b}", grad=True),)
            out.append(
                Stage(
                    colls,
                    overlap=True,
                    grad_bytes=affine_sum(g for _, _, g in members),
                    label=f"all_reduce grad bucket {b}",
                )
            )
    return out
