"""The layer groups' time on this host's emulated CPU workers (forward, backward, Adam per group
at a micro-batch, beside a plain step), which prices an emulated cluster's stages. Measured
through the runtime's host_measurement service; it plans nothing."""

from __future__ import annotations

import time

import torch

from bench.core.interfaces import Workload
from methods.common import group_table
from methods.graph import capture_config
from methods.pipeline.cut import cut_graph, model_graph

# -- the layer groups on this host ---------------------------------------------------------------
# 6: at the case's precision; 5: the groups run as ATen graphs (torch.export), zero-bubble's split backward timed
PROFILE_VERSION = 6
PROFILE_REPEATS = 9


def group_profile(workload: Workload, micro_batch: int, seed: int = 0, repeats: int = PROFILE_REPEATS) -> dict:
    """What each layer group takes on one host worker at `micro_batch` samples: {"forward",
    "backward", "optimizer", "input_backward", "weight_backward": seconds per group, "step_s": a
    plain training step of the whole model at the micro-batch}, each the fastest of `repeats` in
    thread CPU time (as the emulator's reference and the workers' yardstick are timed). Each
    group runs as a stage would: its fx module on its inputs, its backward from its output's
    gradient, then Adam over its parameters; and again, its backward as a zero-bubble schedule
    runs it, in torch's two passes (torch.distributed.pipelining's stage_backward_input, then
    stage_backward_weight), which together cost more than one backward on a CPU (each walks
    the graph; the first group, whose input needs no gradient, is left at 0: torch runs its
    whole backward as the weights' pass). Every round times the groups and then plain steps at the micro-batch and at
    twice it, taking turns as the workers' yardstick does (bench.runtime.hostspeed.yardstick),
    so that a change of the host's speed during the profile hits both alike: timed one after
    the other, a profile's groups and its plain step once came out 30% apart in their ratio.
    All of it runs at the workload's precision (bench.runtime.precision.applied: bf16's autocast
    around each round, as a worker's step_context is around its step), as the workers' yardstick
    that scales it does.

    FLOPs are an uneven yardstick between layer groups on a CPU (tiny VGG19's classifier: 8% of
    the FLOPs, 26% of the time), so the pipeline prices an emulated cluster's stages from this,
    scaled by the plain step now over `step_s` (bench.cost.pipeline.measured_scale). Measured
    once per host, workload and micro-batch (bench.runtime.method_step.host_measurement)."""
    from bench.runtime.method_step import host_measurement

    return host_measurement(
        "layer_groups",
        [workload.name, repr(workload.model_cfg), micro_batch, seed, repeats, workload.precision, PROFILE_VERSION],
        lambda: _measure_groups(workload, micro_batch, seed, repeats),
    )


def _measure_groups(workload: Workload, micro_batch: int, seed: int, repeats: int) -> dict:
    """group_profile's measurement (its docstring), uncached."""
    from bench.runtime.precision import applied

    with torch.random.fork_rng(devices=[]), applied(workload.precision, "cpu"):
        model = workload.build(seed)
        graph = capture_config(workload.model_cfg, micro_batch)
        table = group_table(graph)
        tensors = {n.name for n in graph.nodes if n.is_tensor}
        gm = model_graph(model, workload.model_cfg, micro_batch, seed)
        G = table.num_groups
        mods = [cut_graph(gm, table, tensors, list(range(G + 1)), s) for s in range(G)]
        opts = [torch.optim.Adam(m.parameters(), lr=1e-6) if list(m.parameters()) else None for m, _ in mods]
        batch = workload.model_cfg.synthetic_batch(micro_batch, torch.Generator().manual_seed(seed))
        plain = workload.build(seed)
        plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-6)
        sizes = [
            workload.model_cfg.synthetic_batch(b, torch.Generator().manual_seed(seed))
            for b in (micro_batch, 2 * micro_batch)
        ]
        times = [[[], [], [], [], []] for _ in range(G)]
        steps: list[float] = []
        for rep in range(repeats + 2):
            _time_groups(mods, opts, batch, times)
            _time_split_backward(mods, batch, times)
            for opt in opts:
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
            for i, inputs in enumerate(sizes):
                start = time.thread_time()
                plain_opt.zero_grad(set_to_none=True)
                plain(*inputs).backward()
                plain_opt.step()
                if i == 0 and rep >= 2:  # the first rounds allocate
                    steps.append(time.thread_time() - start)
    kinds = ("forward", "backward", "optimizer", "input_backward", "weight_backward")
    out = {kind: [min(t[k][2:]) for t in times] for k, kind in enumerate(kinds)}
    out["step_s"] = min(steps)
    return {**out, "workload": workload.name, "micro_batch": micro_batch}


def _time_groups(mods, opts, batch, times) -> None:
    """One round of group_profile: every group's forward, backward (last first) and Adam step."""
    G = len(mods)
    x, kept = batch[:-1], []
    for s, (mod, loss) in enumerate(mods):
        ins = x if s == 0 else tuple(t.detach().requires_grad_(t.is_floating_point()) for t in x)
        start = time.thread_time()
        y = mod(*ins)
        if loss is not None:
            y = loss(*(y if isinstance(y, tuple) else (y,)), batch[-1])
        times[s][0].append(time.thread_time() - start)
        kept.append((ins, y))
        x = y if isinstance(y, tuple) else (y,)
    grads = None
    for s in reversed(range(G)):
        ins, y = kept[s]
        start = time.thread_time()
        if grads is None:
            y.backward()
        else:  # from the outputs whose gradient the next group took (a rotary table from a buffer needs none)
            pairs = [
                (o, g) for o, g in zip(y if isinstance(y, tuple) else (y,), grads) if g is not None and o.requires_grad
            ]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        times[s][1].append(time.thread_time() - start)
        grads = tuple(t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in ins)
    for s, opt in enumerate(opts):
        start = time.thread_time()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        times[s][2].append(time.thread_time() - start)


def _time_split_backward(mods, batch, times) -> None:
    """One round of group_profile's zero-bubble backward: every group's forward (untimed), then
    from the last group down torch's input pass and its weights' pass, timed apart."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    x, kept = batch[:-1], []
    for s, (mod, loss) in enumerate(mods):
        ins = x if s == 0 else tuple(t.detach().requires_grad_(t.is_floating_point()) for t in x)
        y = mod(*ins)
        if loss is not None:
            y = loss(*(y if isinstance(y, tuple) else (y,)), batch[-1])
        kept.append((ins, y))
        x = y if isinstance(y, tuple) else (y,)
    grads = None
    for s in reversed(range(len(mods))):
        ins, y = kept[s]
        if s == 0:  # torch's first stage: no input pass, its whole backward as the weights'
            times[s][3].append(0.0)
            times[s][4].append(0.0)
            break
        outs = list(y) if isinstance(y, tuple) else [y]
        params = list(mods[s][0].parameters())
        start = time.thread_time()
        dinputs, groups = stage_backward_input(outs, grads, list(ins), iter(params))
        mid = time.thread_time()
        stage_backward_weight(iter(params), groups)
        times[s][3].append(mid - start)
        times[s][4].append(time.thread_time() - mid)
        grads = list(dinputs)
