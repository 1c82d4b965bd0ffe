"""Pipeline parallelism on mixed devices, run by torch.distributed.pipelining.

The model is cut into stages at layer-group borders (methods.common: embeddings, blocks, conv
stages, head). A stage runs on a slot of the cluster: a device, a machine, or a group of alike
devices or machines (`stage_level`, `num_stages`); a slot of several devices runs one pipeline
per device, data parallel across the pipelines (a stage's replicas sum their gradients once the
schedule is through). Which slot holds which stage, where the cuts fall and how many
micro-batches an iteration has are chosen by pricing: for each order of the slots a dynamic
program over the layer groups' costs (the same price the planner's Programs get, or on an
emulated CPU cluster the groups' measured time) finds the cuts whose slowest stage is fastest
among those that fit their devices' memory, and the simulator (bench.cost.pipeline) replays the
best candidates' schedules to pick one. The schedule is torch's own (Schedule1F1B, or
ScheduleGPipe): the planner traces it with a stand-in stage, so the actions it prices are the
ones the runtime calls, in the same order.

At run time each rank traces the model with torch.fx (methods.capture's tracer, the graph the
planner priced), keeps the nodes of its stage as a GraphModule (the parameters it reads, the
values that cross its borders as inputs and outputs), and runs it as a PipelineStage. The
ops that read the targets (the loss) run as the schedule's loss function on the last stage.
It does not interleave several stages per rank (no looped or zero-bubble schedules) and does
not mix tensor parallelism into a stage.
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError, PlanningError
from bench.core.interfaces import Plan, RankContext, Workload
from bench.core.program import Affine, Stage
from bench.cost import FloatAlgebra, virtual_devices
from bench.cost.pipeline import (
    SCHEDULES,
    PipelineProgram,
    PipeStage,
    in_flight,
    simulate_pipeline,
    stage_memory,
    stage_peak_bytes,
    transfer_s,
)
from bench.cost.price import device_compute
from methods.capture import FunctionalTracer, Graph, capture_config
from methods.common import GroupTable, StageActivations, gradient_buckets, group_table

log = logging.getLogger(__name__)

STAGE_LEVELS = ("auto", "device", "machine")
MAX_ORDERS = 2000  # device orders tried per layout; past it, a few heuristic ones
SIMULATED = 8  # candidates (order, micro-batches, cuts) replayed exactly, the best priced first


class StageOOM(PlanningError):
    status = "oom"


# -- the schedule, traced ------------------------------------------------------------------------
class _Op:
    """Stands in for a dist.P2POp: what it moves and which way."""

    def __init__(self, direction: str, what: str, mb: int):
        self.direction, self.what, self.mb = direction, what, mb
        self.op, self.peer, self.group, self.tag, self.group_peer, self.tensor = None, 0, None, 0, 0, None


class _TracedStage:
    """Stands in for a PipelineStage: records what the schedule asks of it."""

    def __init__(self, index: int, num_stages: int, log_: list):
        self.stage_index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.has_backward = True
        self.submod = None
        self.log = log_

    def clear_runtime_states(self) -> None:
        pass

    def get_fwd_recv_ops(self, mb: int) -> list:
        return [] if self.is_first else [_Op("recv", "act", mb)]

    def get_fwd_send_ops(self, mb: int) -> list:
        return [] if self.is_last else [_Op("send", "act", mb)]

    def get_bwd_recv_ops(self, mb: int) -> list:
        return [] if self.is_last else [_Op("recv", "grad", mb)]

    def get_bwd_send_ops(self, mb: int) -> list:
        return [] if self.is_first else [_Op("send", "grad", mb)]

    def forward_one_chunk(self, mb: int, *args, **kwargs):
        self.log.append(("F", mb))

    def backward_one_chunk(self, mb: int, loss=None, full_backward: bool = True, last_backward: bool = False):
        self.log.append(("B", mb))

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        pass


_traces: dict[tuple[str, int, int, int], tuple[tuple, ...]] = {}


def trace_schedule(schedule: str, num_stages: int, num_micro_batches: int, stage: int) -> tuple[tuple, ...]:
    """The actions (bench.cost.pipeline.ACTIONS) torch's schedule makes stage `stage` of
    `num_stages` run in one step of `num_micro_batches`: its `_step_microbatches` run on a
    stand-in stage, with the module's batching of point-to-point calls recorded instead of
    made. Cached per argument."""
    key = (schedule, num_stages, num_micro_batches, stage)
    if key in _traces:
        return _traces[key]
    from unittest import mock

    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining import schedules as torch_schedules

    events: list[tuple] = []
    ids = itertools.count()

    def batch_p2p(ops, desc=None):
        works = []
        for op in ops:
            ident = next(ids)
            events.append((op.direction, ident, op.what, op.mb))
            works.append(ident)
        return works

    def sorted_batch_p2p(ops, desc=None):
        return {0: batch_p2p(ops)} if ops else {}

    def wait_batch_p2p(works):
        if works:
            events.append(("wait", tuple(works)))

    fake = _TracedStage(stage, num_stages, events)
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    with mock.patch.object(torch_schedules, "_batch_p2p", batch_p2p), \
            mock.patch.object(torch_schedules, "_sorted_batch_p2p", sorted_batch_p2p), \
            mock.patch.object(torch_schedules, "_wait_batch_p2p", wait_batch_p2p):
        sched = cls(fake, num_micro_batches, loss_fn=lambda out, target: None, scale_grads=False)
        sched._initialize_stage = lambda *args, **kwargs: None
        m = num_micro_batches
        sched._step_microbatches([()] * m, [{}] * m, [None] * m, None, return_outputs=False)
    _traces[key] = tuple(events)
    return _traces[key]


# -- the layer groups on this host ---------------------------------------------------------------
PROFILE_VERSION = 3
PROFILE_REPEATS = 9


def group_profile(workload: Workload, micro_batch: int, seed: int = 0, repeats: int = PROFILE_REPEATS) -> dict:
    """What each layer group takes on one host worker at `micro_batch` samples: {"forward",
    "backward", "optimizer": seconds per group, "step_s": a plain training step of the whole
    model at the micro-batch}, each the fastest of `repeats` in thread CPU time (as the
    emulator's reference and the workers' yardstick are timed). Each group runs as a stage
    would: its fx module on its inputs, its backward from its output's gradient, then Adam over
    its parameters. Every round times the groups and then plain steps at the micro-batch and at
    twice it, taking turns as the workers' yardstick does (bench.runtime.hostspeed.yardstick),
    so that a change of the host's speed during the profile hits both alike: timed one after
    the other, a profile's groups and its plain step once came out 30% apart in their ratio.

    FLOPs are an uneven yardstick between layer groups on a CPU (tiny VGG19's classifier: 8% of
    the FLOPs, 26% of the time), so the pipeline prices an emulated cluster's stages from this,
    scaled by the plain step now over `step_s` (bench.cost.pipeline.measured_scale). Measured
    once per host, workload and micro-batch (bench.runtime.method_step.host_measurement)."""
    from bench.runtime.method_step import host_measurement

    return host_measurement("layer_groups", [workload.name, repr(workload.model_cfg), micro_batch, seed, repeats,
                                             PROFILE_VERSION],
                            lambda: _measure_groups(workload, micro_batch, seed, repeats))


def _measure_groups(workload: Workload, micro_batch: int, seed: int, repeats: int) -> dict:
    """group_profile's measurement (its docstring), uncached."""
    with torch.random.fork_rng(devices=[]):
        model = workload.build(seed)
        graph = capture_config(workload.model_cfg, micro_batch)
        table = group_table(graph)
        tensors = {n.name for n in graph.nodes if n.is_tensor}
        gm = fx.GraphModule(model, FunctionalTracer().trace(model))
        G = table.num_groups
        mods = [cut_graph(gm, table, tensors, list(range(G + 1)), s) for s in range(G)]
        opts = [torch.optim.Adam(m.parameters(), lr=1e-6) if list(m.parameters()) else None for m, _ in mods]
        batch = workload.model_cfg.synthetic_batch(micro_batch, torch.Generator().manual_seed(seed))
        plain = workload.build(seed)
        plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-6)
        sizes = [workload.model_cfg.synthetic_batch(b, torch.Generator().manual_seed(seed))
                 for b in (micro_batch, 2 * micro_batch)]
        times = [[[], [], []] for _ in range(G)]
        steps: list[float] = []
        for rep in range(repeats + 2):
            _time_groups(mods, opts, batch, times)
            for i, inputs in enumerate(sizes):
                start = time.thread_time()
                plain_opt.zero_grad(set_to_none=True)
                plain(*inputs).backward()
                plain_opt.step()
                if i == 0 and rep >= 2:  # the first rounds allocate
                    steps.append(time.thread_time() - start)
    out = {kind: [min(t[k][2:]) for t in times] for k, kind in enumerate(("forward", "backward", "optimizer"))}
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
        else:
            torch.autograd.backward(y if isinstance(y, tuple) else (y,), grads)
        times[s][1].append(time.thread_time() - start)
        grads = tuple(t.grad for t in ins if isinstance(t, torch.Tensor) and t.requires_grad)
    for s, opt in enumerate(opts):
        start = time.thread_time()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        times[s][2].append(time.thread_time() - start)


# -- planning ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Stage slots of one kind: each slot is the ranks a stage takes, one per pipeline."""

    level: str
    slots: tuple[tuple[int, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.slots)

    @property
    def num_pipelines(self) -> int:
        return len(self.slots[0])


def layouts(cluster: ClusterSpec, level: str, num_stages, num_groups: int) -> tuple[list[Layout], list[str]]:
    """The stage slots a cluster offers (and why others are refused): at `level` "device" the
    devices, at "machine" the machines (all of one size), cut into `num_stages` slots of equal
    size ("auto": every number of slots from 2 to the layer groups that divides them), alike
    hardware together (a slot's devices are a stage's replicas, which run in step). A slot of
    k units of g devices gives k * g pipelines."""
    units: dict[str, list[tuple[int, ...]]] = {}
    refusals = []
    if level in ("auto", "device"):
        units["device"] = [(d.rank,) for d in cluster.devices]
    if level in ("auto", "machine"):
        machines: dict[int, list[int]] = {}
        for d in cluster.devices:
            machines.setdefault(d.machine, []).append(d.rank)
        if len({len(r) for r in machines.values()}) == 1:
            units["machine"] = [tuple(r) for _, r in sorted(machines.items())]
        elif level == "machine":
            raise ConfigError(f"method.stage_level=machine needs machines of one size, but cluster={cluster.name} "
                              f"has machines of {sorted(len(r) for r in machines.values())} devices; use "
                              "method.stage_level=device")
    out, seen = [], set()
    for lvl, us in units.items():
        count = len(us)
        if num_stages == "auto":
            choices = [k for k in range(2, min(count, num_groups) + 1) if count % k == 0] or (
                [1] if count == 1 else [])
            if not choices:
                refusals.append(f"method.stage_level={lvl} gives {count} {lvl}s to cut into stages (a divisor of them, "
                                f"from 2 to the {num_groups} layer groups), and no such number exists; use "
                                "another method.stage_level or method.num_stages")
        else:
            if count % num_stages:
                divisors = [k for k in range(1, count + 1) if count % k == 0]
                refusals.append(f"method.num_stages={num_stages} does not divide the {count} {lvl}s of "
                                f"cluster={cluster.name} (method.stage_level={lvl}); try "
                                f"{', '.join(map(str, divisors))}")
                continue
            if num_stages > num_groups:
                refusals.append(f"method.num_stages={num_stages} is more than the {num_groups} layer groups the model "
                                f"can be cut at; use method.num_stages<={num_groups}")
                continue
            choices = [num_stages]
        ordered = sorted(us, key=lambda u: (_hardware(cluster, u), u))
        for k in choices:
            size = count // k
            slots = tuple(tuple(r for u in ordered[i * size:(i + 1) * size] for r in u) for i in range(k))
            key = frozenset(slots)
            if key not in seen:
                seen.add(key)
                out.append(Layout(lvl, slots))
    return out, refusals


def _hardware(cluster: ClusterSpec, ranks: tuple[int, ...]) -> tuple:
    devs = [cluster.devices[r] for r in ranks]
    return tuple((d.type.name, d.speed, d.type.memory_gib) for d in devs)


def slot_orders(cluster: ClusterSpec, layout: Layout) -> list[tuple[tuple[int, ...], ...]]:
    """Orders of the slots that price differently: alike slots (same hardware) are
    interchangeable where every neighbour is joined by the same link; otherwise every
    permutation up to MAX_ORDERS, and past that the slots in rank order, fastest first and
    slowest first."""
    slots = list(layout.slots)
    signature = [_hardware(cluster, s) for s in slots]
    one_link = len({cluster.devices[s[0]].machine for s in slots}) == len(slots)
    if one_link:
        orders = []
        by_sig: dict[tuple, list] = {}
        for sig, slot in zip(signature, slots):
            by_sig.setdefault(sig, []).append(slot)
        for perm in _multiset_permutations(signature, MAX_ORDERS + 1):
            pools = {k: list(v) for k, v in by_sig.items()}
            orders.append(tuple(pools[sig].pop(0) for sig in perm))
        if len(orders) <= MAX_ORDERS:
            return orders
    elif math.factorial(len(slots)) <= MAX_ORDERS:
        seen, orders = set(), []
        for perm in itertools.permutations(slots):
            key = tuple((_hardware(cluster, s), cluster.devices[s[0]].machine) for s in perm)
            links = tuple(cluster.link_between([a[0], b[0]]) is cluster.intra_machine for a, b in zip(perm, perm[1:]))
            key = (tuple(k[0] for k in key), links)
            if key not in seen:
                seen.add(key)
                orders.append(perm)
        return orders
    speed = {s: sum(cluster.devices[r].speed for r in s) for s in slots}
    return list(dict.fromkeys([tuple(slots), tuple(sorted(slots, key=lambda s: -speed[s])),
                               tuple(sorted(slots, key=lambda s: speed[s]))]))


def _multiset_permutations(items: list, limit: int):
    """Distinct permutations of `items` (equal items interchangeable), at most `limit`."""
    counts: dict = {}
    for x in items:
        counts[x] = counts.get(x, 0) + 1
    keys = list(counts)
    out: list = []
    n = len(items)

    def walk(prefix: list) -> None:
        if len(out) >= limit:
            return
        if len(prefix) == n:
            out.append(tuple(prefix))
            return
        for k in keys:
            if counts[k]:
                counts[k] -= 1
                prefix.append(k)
                walk(prefix)
                prefix.pop()
                counts[k] += 1

    walk([])
    return out


def micro_batch_choices(batch: int, num_stages: int, schedule: str, requested) -> list[int]:
    """The numbers of micro-batches to price: the requested one (checked), or (auto) the
    divisors of the pipeline's batch from the stages (1F1B needs one per stage; GPipe from 1)
    to four times them."""
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    least = num_stages if schedule == "1f1b" else 1
    if requested != "auto":
        if requested not in divisors:
            raise ConfigError(f"method.num_micro_batches={requested} must divide the pipeline's batch of {batch} "
                              f"samples; try {', '.join(map(str, divisors))}")
        if requested < least:
            raise ConfigError(f"method.num_micro_batches={requested} is fewer than the {num_stages} stages: "
                              "1F1B needs a micro-batch per stage; try "
                              f"{', '.join(str(d) for d in divisors if d >= least) or 'a larger batch'} "
                              "(or method.schedule=gpipe)")
        return [requested]
    return [d for d in divisors if least <= d <= max(least, 4 * num_stages)]


@dataclass
class _Costs:
    """Per slot hardware and micro-batch size, the priced costs of runs of layer groups.

    `profiles`: per micro-batch size, the layer groups' measured seconds (group_profile) on an
    emulated CPU cluster; a stage is then priced at those, scaled by the host's plain step now
    over the profile's (bench.cost.pipeline.measured_scale)."""

    graph: Graph
    table: GroupTable
    cluster: ClusterSpec
    model_launches: float
    profiles: dict | None = None
    flops_per_sample: float = 0.0
    bucket_bytes: float = 25 * 2**20  # the gradient bucket replicas all-reduce at a time

    def __post_init__(self) -> None:
        self._acts = StageActivations(self.graph, self.table)
        self._prefix_params = [0.0]
        for g in self.table.groups:
            self._prefix_params.append(self._prefix_params[-1] + g.param_bytes)
        self._slot: dict = {}
        self._reps: dict = {}
        self._peaks: dict = {}
        self._send: dict = {}
        self.vdevs = virtual_devices(self.cluster, "gpu")
        self.alg = FloatAlgebra([[1.0 / len(self.vdevs)] * len(self.vdevs)])
        self._cache: dict = {}

    def passes(self, first: int, end: int, mb: int) -> tuple[tuple[Stage, ...], tuple[Stage, ...], float, float]:
        """(forward Stages, backward Stages, forward kernels, backward kernels) of groups
        [first, end) at `mb` samples: a Stage per op class, as Programs price compute."""
        groups = self.table.span(first, end)
        label = f"groups {first}-{end - 1}"
        out = []
        for flops, launches in (("forward_flops", "forward_launches"), ("backward_flops", "backward_launches")):
            by_class: dict[str, list[float]] = {}
            for g in groups:
                for cls, f in getattr(g, flops).items():
                    by_class.setdefault(cls, [0.0, 0.0])[0] += f * mb
                for cls, k in getattr(g, launches).items():
                    by_class.setdefault(cls, [0.0, 0.0])[1] += k
            out.append(tuple(Stage(flops=Affine(f), op_class=cls, launches=k, label=label)
                             for cls, (f, k) in sorted(by_class.items())))
        fwd_k = sum(sum(g.forward_launches.values()) for g in groups)
        bwd_k = sum(sum(g.backward_launches.values()) for g in groups)
        return out[0], out[1], float(fwd_k), float(bwd_k)

    def measured(self, first: int, end: int, mb: int) -> tuple[float, float, float] | None:
        """(forward, backward, Adam) seconds of groups [first, end) at `mb` samples where the
        groups were timed on this host (group_profile), else None."""
        if self.profiles is None:
            return None
        prof = self.profiles[mb]
        return tuple(float(sum(prof[k][first:end])) for k in ("forward", "backward", "optimizer"))

    def scale(self, mb: int) -> float:
        """The host's plain step at `mb` as the cluster's speed prices it over the profile's."""
        if self.profiles is None:
            return 1.0
        now = self.flops_per_sample * mb / self.cluster.host_flops + self.cluster.host_step_overhead_s
        return now / self.profiles[mb]["step_s"]

    def slot_seconds(self, slot: tuple[int, ...], first: int, end: int, mb: int) -> float:
        """Forward and backward of groups [first, end) at `mb` samples on a slot's slowest rank."""
        key = (slot, first, end, mb)
        if key not in self._slot:
            self._slot[key] = max(self.seconds(r, first, end, mb) for r in self._distinct(slot))
        return self._slot[key]

    def _distinct(self, slot: tuple[int, ...]) -> list[int]:
        if slot not in self._reps:
            reps: dict = {}
            for r in slot:
                reps.setdefault(_hardware(self.cluster, (r,)), r)
            self._reps[slot] = list(reps.values())
        return self._reps[slot]

    def seconds(self, rank: int, first: int, end: int, mb: int) -> float:
        """Forward and backward of groups [first, end) on `rank` at `mb` samples."""
        key = (_hardware(self.cluster, (rank,)), first, end, mb)
        if key not in self._cache:
            v, dev = self.vdevs[rank], self.cluster.devices[rank]
            measured = self.measured(first, end, mb)
            if measured is not None:
                self._cache[key] = (measured[0] + measured[1]) * self.scale(mb) / dev.speed
            else:
                fwd, bwd, fk, bk = self.passes(first, end, mb)
                per_kernel = dev.step_overhead_s / self.model_launches if self.model_launches else 0.0
                self._cache[key] = float(sum(device_compute(s, self.cluster, v, self.alg) for s in fwd + bwd)
                                         + per_kernel * (fk + bk))
        return self._cache[key]

    def memory(self, first: int, end: int, mb: int, flight: int, m: int, replicated: bool, last: bool):
        kept, backward = self._acts(first, end)
        groups = self.table.span(first, end)
        return stage_memory(
            param_bytes=sum(g.param_bytes for g in groups),
            largest_param_bytes=max((g.largest_param_bytes for g in groups), default=0.0),
            kept_bytes=mb * kept, backward_bytes=mb * backward,
            received_bytes=mb * self.table.border_bytes(first, end),
            sent_bytes=0.0 if last else mb * groups[-1].out_bytes,
            in_flight=flight, num_micro_batches=m,
            bucket_bytes=min(sum(g.param_bytes for g in groups), self.bucket_bytes) if replicated else 0.0)

    def peak(self, first: int, end: int, mb: int, flight: int, m: int, replicated: bool, last: bool) -> float:
        """Bytes a rank of the stage holds at its peak (stage_memory's backward or Adam's step)."""
        key = (first, end, mb, flight, m, replicated, last)
        if key in self._peaks:
            return self._peaks[key]
        kept, backward = self._acts(first, end)
        params = self._prefix_params[end] - self._prefix_params[first]
        self._peaks[key] = stage_peak_bytes(
            param_bytes=params, largest_param_bytes=max(g.largest_param_bytes for g in self.table.span(first, end)),
            kept_bytes=mb * kept, backward_bytes=mb * backward,
            received_bytes=mb * self.table.border_bytes(first, end),
            sent_bytes=0.0 if last else mb * self.table.groups[end - 1].out_bytes,
            in_flight=flight, num_micro_batches=m, bucket_bytes=min(params, self.bucket_bytes) if replicated else 0.0,
            foreach=self.cluster.device == "cuda")
        return self._peaks[key]

    def fits(self, slot: tuple[int, ...], peak: float) -> bool:
        """Whether every device of the slot holds `peak` bytes (and its libraries' own)."""
        return all(peak + (self.vdevs[r].compute.workspace_bytes if self.vdevs[r].compute is not None else 0.0)
                   <= self.vdevs[r].memory_bytes for r in self._distinct(slot))

    def send(self, a: tuple[int, ...], b: tuple[int, ...], end: int, mb: int) -> float:
        """Sending the output of groups [., end) from slot a to slot b and its gradient back."""
        key = (a[0], b[0], end, mb)
        if key not in self._send:
            self._send[key] = 2.0 * transfer_s(mb * self.table.groups[end - 1].out_bytes, self.cluster, a[0], b[0])
        return self._send[key]

    def seconds_matrix(self, slot: tuple[int, ...], mb: int) -> list[list[float]]:
        """slot_seconds(slot, i, j, mb) for every run [i, j) of groups, as [i][j]."""
        key = ("sec", tuple(_hardware(self.cluster, (r,)) for r in self._distinct(slot)), mb)
        if key not in self._send:
            G = self.table.num_groups
            self._send[key] = [[self.slot_seconds(slot, i, j, mb) if j > i else 0.0 for j in range(G + 1)]
                               for i in range(G)]
        return self._send[key]


def best_cuts(costs: _Costs, order, mb: int, m: int, flights: list[int],
              replicated: bool) -> tuple[float, float, list[int]] | None:
    """The cuts of the layer groups into len(order) non-empty runs, run s on slot order[s], whose
    slowest stage (forward + backward of a micro-batch, plus sending its output) is fastest,
    ties broken by the sum, among those whose every stage fits its devices' memory (dynamic
    program over the groups). (slowest, sum, cut points) or None when nothing fits."""
    num_groups, num_stages = costs.table.num_groups, len(order)
    if num_stages > num_groups:
        return None
    inf = (math.inf, math.inf)
    best = [[inf] * (num_groups + 1) for _ in range(num_stages + 1)]
    back = [[0] * (num_groups + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, num_stages + 1):
        slot = order[s - 1]
        last = s == num_stages
        sec = costs.seconds_matrix(slot, mb)
        prev_row, row, links = best[s - 1], best[s], back[s]
        for j in range(s, num_groups - (num_stages - s) + 1) if not last else (num_groups,):
            send = 0.0 if last else costs.send(slot, order[s], j, mb)
            for i in range(s - 1, j):
                prev = prev_row[i]
                if prev[0] == math.inf:
                    continue
                c = sec[i][j] + send
                cand = (prev[0] if prev[0] > c else c, prev[1] + c)
                if cand < row[j] and costs.fits(slot, costs.peak(i, j, mb, flights[s - 1], m, replicated, last)):
                    row[j], links[j] = cand, i
    if best[num_stages][num_groups][0] == math.inf:
        return None
    cuts = [num_groups]
    for s in range(num_stages, 0, -1):
        cuts.append(back[s][cuts[-1]])
    return (*best[num_stages][num_groups], cuts[::-1])


class PipelineParallel:
    """Pipeline parallelism over the cluster's devices (module docstring).

    Args:
        name: the method's name in records.
        schedule: "1f1b" (torch's Schedule1F1B) or "gpipe" (ScheduleGPipe).
        num_micro_batches: micro-batches per pipeline and iteration, or "auto" (priced).
        stage_level: what a stage's slot is cut from: "device", "machine" or "auto" (both).
        num_stages: stages per pipeline, a divisor of the devices (machines); "auto": the
            fastest priced of those up to the model's layer groups.
        bucket_cap_mb: the gradient bucket a stage's replicas all-reduce at a time (MiB).
        lr: Adam's learning rate (the paper: 5e-4).
        grad_clip: max global gradient norm; 0 disables clipping.
        profile: emulated CPU clusters: price the stages from the layer groups' time on this
            host (group_profile, cached) instead of their FLOPs.
    """

    worker_modules = ("torch.distributed.pipelining",)
    mirror_full_state = False  # tests: write every stage's parameters and gradients into the full model

    def __init__(self, name: str = "pipeline", schedule: str = "1f1b", num_micro_batches="auto",
                 stage_level: str = "auto", num_stages="auto", bucket_cap_mb: float = 25.0, lr: float = 5e-4,
                 grad_clip: float = 0.0, profile: bool = True):
        if schedule not in SCHEDULES:
            raise ConfigError(f"method.schedule={schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
        whole = isinstance(num_micro_batches, int) and not isinstance(num_micro_batches, bool)
        if num_micro_batches != "auto" and (not whole or num_micro_batches < 1):
            raise ConfigError(f"method.num_micro_batches={num_micro_batches!r} must be auto or an integer >= 1; "
                              "e.g. method.num_micro_batches=4")
        whole = isinstance(num_stages, int) and not isinstance(num_stages, bool)
        if num_stages != "auto" and (not whole or num_stages < 1):
            raise ConfigError(f"method.num_stages={num_stages!r} must be auto or an integer >= 1; "
                              "e.g. method.num_stages=2")
        if stage_level not in STAGE_LEVELS:
            raise ConfigError(f"method.stage_level={stage_level!r} is unknown; use one of {', '.join(STAGE_LEVELS)}")
        if not bucket_cap_mb > 0:
            raise ConfigError(f"method.bucket_cap_mb={bucket_cap_mb!r} must be > 0 (MiB)")
        if not lr > 0 or grad_clip < 0:
            raise ConfigError(f"method.lr={lr!r} must be > 0 and method.grad_clip={grad_clip!r} >= 0")
        self.name = name
        self.modes = ("real", "sim")
        self.schedule = schedule
        self.num_micro_batches = num_micro_batches
        self.stage_level = stage_level
        self.num_stages = num_stages
        self.bucket_cap_mb = bucket_cap_mb
        self.lr = lr
        self.grad_clip = grad_clip
        self.profile = profile

    # -- plan ------------------------------------------------------------------------------------
    def plan(self, workload: Workload, cluster: ClusterSpec) -> Plan:
        graph = capture_config(workload.model_cfg, workload.global_batch)
        table = group_table(graph)
        model_launches = float(sum(g.launches for g in table.groups))
        found, layouts_, refusals = [], *layouts(cluster, self.stage_level, self.num_stages, table.num_groups)
        oom: list[str] = []
        profiled = self.profile and cluster.emulated and cluster.device == "cpu" and cluster.host_flops is not None
        if profiled:  # the layer groups on this host, at every micro-batch a layout may use
            sizes = sorted({mb for layout in layouts_ for mb in self._micro_batches(layout, table, workload)})
            costs = _Costs(graph, table, cluster, 0.0, {mb: group_profile(workload, mb) for mb in sizes},
                           workload.flops_per_sample, self.bucket_cap_mb * 2**20)
        else:
            costs = _Costs(graph, table, cluster, model_launches, bucket_bytes=self.bucket_cap_mb * 2**20)
        for layout in layouts_:
            found += self._candidates(layout, table, costs, workload, cluster, refusals, oom)
        if not found:
            if oom:  # the layout that came closest to fitting
                raise StageOOM(min(oom)[1])
            raise ConfigError(refusals[0] if refusals else f"{workload.name} cannot be pipelined on "
                              f"cluster={cluster.name}")
        found.sort(key=lambda c: c[0])
        best = None
        for _, layout, order, m, cuts in found[:SIMULATED]:
            program = self._program(layout, order, m, cuts, table, costs, workload, cluster, costs.model_launches)
            t = simulate_pipeline(program, cluster).iter_time_s
            if best is None or t < best[0]:
                best = (t, layout, order, m, cuts, program)
        _, layout, order, m, cuts, program = best
        return self._plan(layout, order, m, cuts, program, table, workload)

    def _micro_batches(self, layout: Layout, table: GroupTable, workload: Workload) -> list[int]:
        """The micro-batch sizes a layout may run at (none where it cannot run)."""
        S, D = layout.num_stages, layout.num_pipelines
        if table.num_groups < S or workload.global_batch % D:
            return []
        per_pipeline = workload.global_batch // D
        try:
            return [per_pipeline // m for m in micro_batch_choices(per_pipeline, S, self.schedule,
                                                                   self.num_micro_batches)]
        except ConfigError:
            return []

    def _candidates(self, layout: Layout, table: GroupTable, costs: _Costs, workload: Workload,
                    cluster: ClusterSpec, refusals: list, oom: list) -> list:
        S, D = layout.num_stages, layout.num_pipelines
        where = f"{S} stages of {len(layout.slots[0])} device(s), method.stage_level={layout.level}"
        if workload.global_batch % D:
            refusals.append(f"global_batch={workload.global_batch} must be a multiple of the {D} pipelines of "
                            f"{where}; e.g. global_batch={D * max(1, workload.global_batch // D)}")
            return []
        per_pipeline = workload.global_batch // D
        choices = micro_batch_choices(per_pipeline, S, self.schedule, self.num_micro_batches)
        if not choices:
            refusals.append(f"the pipeline's batch of {per_pipeline} samples is smaller than its {S} stages "
                            f"({where}); use a larger batch (preset.batch_per_device) or method.schedule=gpipe")
            return []
        found = []
        orders = slot_orders(cluster, layout)
        for m in choices:
            mb = per_pipeline // m
            flights = [in_flight(trace_schedule(self.schedule, S, m, s)) for s in range(S)]
            for order in orders:
                best = best_cuts(costs, order, mb, m, flights, D > 1)
                if best is None:
                    continue
                slowest, total, cuts = best
                # The makespan of a balanced pipeline: one micro-batch through every stage, then
                # the slowest stage for each of the others.
                found.append((total + (m - 1) * slowest, layout, order, m, cuts))
        if not found:
            oom.append(self._oom_message(layout, costs, table, per_pipeline, choices, cluster, workload, where))
        return found

    def _oom_message(self, layout, costs: _Costs, table: GroupTable, per_pipeline: int, choices, cluster, workload,
                     where: str) -> tuple[float, str]:
        """(bytes, one line): an even split of the groups, what its fullest stage needs and the fix."""
        m = min(choices)
        mb = per_pipeline // m
        S = layout.num_stages
        flights = [in_flight(trace_schedule(self.schedule, S, m, s)) for s in range(S)]
        cuts = [round(i * table.num_groups / S) for i in range(S + 1)]
        worst, need = 0, 0.0
        for s in range(S):
            peak = costs.peak(cuts[s], cuts[s + 1], mb, flights[s], m, layout.num_pipelines > 1, s == S - 1)
            if peak > need:
                worst, need = s, peak
        dev = cluster.devices[layout.slots[0][0]]
        return need, (f"no split of {workload.name}'s {table.num_groups} layer groups into {where} fits "
                f"device memory: stage {worst} (groups {cuts[worst]}-{cuts[worst + 1] - 1}) needs "
                f"{need / 2**30:.1f} GiB at method.num_micro_batches={m}, more than a {dev.type.name}'s "
                f"{dev.type.memory_gib:g} GiB; use a smaller batch (preset.batch_per_device) or more devices")

    def _program(self, layout: Layout, order, m: int, cuts: list[int], table: GroupTable, costs: _Costs,
                 workload: Workload, cluster: ClusterSpec, model_launches: float) -> PipelineProgram:
        S, D = layout.num_stages, layout.num_pipelines
        mb = workload.global_batch // D // m
        actions = tuple(trace_schedule(self.schedule, S, m, s) for s in range(S))
        stages = []
        for s in range(S):
            first, end = cuts[s], cuts[s + 1]
            fwd, bwd, fk, bk = costs.passes(first, end, mb)
            groups = table.span(first, end)
            buckets: tuple = ()
            if D > 1:  # the buckets the replicas all-reduce, as the runtime makes them
                sizes = [b for g in groups for b in g.param_sizes]
                buckets = tuple(sum(sizes[i] for i in run) for run in gradient_buckets(sizes, self.bucket_cap_mb))
            stages.append(PipeStage(
                groups=(first, end), ranks=tuple(order[s]), forward=fwd, backward=bwd, launches=(fk, bk),
                send_bytes=0.0 if s == S - 1 else mb * groups[-1].out_bytes,
                param_bytes=sum(g.param_bytes for g in groups),
                memory=costs.memory(first, end, mb, in_flight(actions[s]), m, D > 1, s == S - 1),
                grad_buckets=buckets, measured=costs.measured(first, end, mb)))
        return PipelineProgram(tuple(stages), actions, m, mb, D, cluster.num_devices, self.schedule,
                               model_launches, workload.global_batch,
                               meta={"method": self.name, "model": workload.name},
                               profile_step_s=costs.profiles[mb]["step_s"] if costs.profiles else 0.0,
                               flops_per_sample=workload.flops_per_sample)

    def _plan(self, layout: Layout, order, m: int, cuts: list[int], program: PipelineProgram, table: GroupTable,
              workload: Workload) -> Plan:
        S, D = layout.num_stages, layout.num_pipelines
        per_pipeline = workload.global_batch // D
        stage_of, slices = {}, {}
        for s, slot in enumerate(order):
            for p, r in enumerate(slot):
                stage_of[r] = (p, s)
                slices[r] = (p * per_pipeline, (p + 1) * per_pipeline)
        n = len(stage_of)
        details = {
            "schedule": self.schedule, "stage_level": layout.level, "num_stages": S, "num_pipelines": D,
            "num_micro_batches": m, "micro_batch": per_pipeline // m,
            "stages": [{"groups": [cuts[s], cuts[s + 1] - 1], "ranks": list(order[s])} for s in range(S)],
            "pipelines": [[order[s][p] for s in range(S)] for p in range(D)],
            "layer_groups": table.num_groups, "optimizer": f"torch.optim.Adam(lr={self.lr:g})",
        }
        return Plan(self.name, [per_pipeline // m] * n, details, program, None,
                    data_slices=[slices[r] for r in range(n)])

    # -- run ---------------------------------------------------------------------------------------
    def setup(self, plan: Plan, model: nn.Module, ctx: RankContext) -> PipelineTrainer:
        return PipelineTrainer(self, plan, model, ctx)


# -- running -------------------------------------------------------------------------------------
def cut_graph(gm: fx.GraphModule, table: GroupTable, tensors: set[str], cuts: list[int],
              stage: int) -> tuple[fx.GraphModule, fx.GraphModule | None]:
    """Stage `stage`'s module (the nodes of layer groups [cuts[stage], cuts[stage + 1])), and on
    the last stage the loss module (the nodes that read the targets: loss(*outputs, targets)).

    A stage's inputs are the values made before it (or the model's inputs) that it or a later
    stage reads; its outputs the next stage's inputs. Parameters and buffers are read where they
    are used (get_attr): each stage holds only its own. `tensors`: the nodes that make tensors
    (only those can cross a border). Returns (stage module, loss module or None)."""
    node_group, tail, targets = table.node_group, set(table.tail), set(table.targets)
    num_stages = len(cuts) - 1
    group_stage = {}
    for s in range(num_stages):
        for g in range(cuts[s], cuts[s + 1]):
            group_stage[g] = s
    nodes = list(gm.graph.nodes)
    where: dict[str, int] = {}  # node -> stage that makes it (placeholders: -1), or num_stages for the loss
    for n in nodes:
        if n.op == "placeholder":
            where[n.name] = num_stages if n.name in targets else -1
        elif n.name in tail or n.op == "output":
            where[n.name] = num_stages
        elif n.op in ("call_function", "call_method", "call_module"):
            if n.name not in node_group:
                raise ValueError(f"fx node {n.name!r} of the model has no layer group: the traced graph differs "
                                 "from the planner's")
            where[n.name] = group_stage[node_group[n.name]]
    readers: dict[str, list[int]] = {}
    for n in nodes:
        if n.op == "get_attr":
            continue
        for a in n.all_input_nodes:
            if a.op != "get_attr":
                readers.setdefault(a.name, []).append(where[n.name])

    def crossing(s: int) -> list[fx.Node]:
        """Values made before stage s (model inputs included) that stage s or later reads."""
        return [n for n in nodes if n.op not in ("get_attr", "output") and where.get(n.name, num_stages) < s
                and n.name not in targets and any(r >= s for r in readers.get(n.name, []))]

    def build(members: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for x in inputs:
            env[x] = g.placeholder(x.name)
        for n in members:
            for a in n.all_input_nodes:
                if a not in env:
                    if a.op != "get_attr":
                        raise ValueError(f"fx node {n.name!r} reads {a.name!r}, which does not reach its stage")
                    env[a] = g.get_attr(a.target)
            env[n] = g.node_copy(n, lambda a: env[a])
        result = [env[x] for x in outputs]
        g.output(result[0] if len(result) == 1 else tuple(result))
        return fx.GraphModule(gm, g)

    inputs = [n for n in nodes if n.op == "placeholder" and n.name not in targets] if stage == 0 else crossing(stage)
    members = [n for n in nodes if where.get(n.name) == stage and n.op != "placeholder"]
    outputs = crossing(stage + 1)
    if stage == num_stages - 1:
        outputs = [n for n in nodes if n.op not in ("get_attr", "output") and where.get(n.name, num_stages) < num_stages
                   and n.name not in targets and num_stages in readers.get(n.name, [])]
    for x in [*inputs, *outputs] if stage else outputs:
        if x.name not in tensors:
            raise ValueError(f"fx node {x.name!r} crosses a stage border but is not a tensor")
    module = build(members, inputs, outputs)
    loss = None
    if stage == num_stages - 1:
        tail_nodes = [n for n in nodes if where.get(n.name) == num_stages and n.op not in ("placeholder", "output")]
        out = next(n for n in nodes if n.op == "output")
        g = fx.Graph()
        env = {x: g.placeholder(x.name) for x in outputs}
        target_nodes = [n for n in nodes if n.name in targets]
        env.update({t: g.placeholder(t.name) for t in target_nodes})
        for n in tail_nodes:
            for a in n.all_input_nodes:
                if a not in env:
                    env[a] = g.get_attr(a.target)
            env[n] = g.node_copy(n, lambda a: env[a])
        g.output(env[out.all_input_nodes[0]])
        loss = fx.GraphModule(gm, g)
    return module, loss


class PipelineTrainer:
    """One rank's stage: its GraphModule as a PipelineStage, the schedule, the gradients summed
    over its replicas, Adam over its parameters."""

    def __init__(self, method: PipelineParallel, plan: Plan, model: nn.Module, ctx: RankContext):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from bench.runtime.p2p import install_p2p

        d = plan.details
        self.rank, self.emulator = ctx.rank, ctx.emulator
        pipelines = d["pipelines"]
        S, D, m = d["num_stages"], d["num_pipelines"], d["num_micro_batches"]
        self.pipeline = next(p for p, ranks in enumerate(pipelines) if ctx.rank in ranks)
        self.stage_index = pipelines[self.pipeline].index(ctx.rank)
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == S - 1
        if ctx.emulator.enabled:
            install_p2p(ctx.emulator)  # activations' sends go over the emulated links
        # Every rank makes every group, in the same order (torch.distributed.new_group).
        groups = [dist.new_group(sorted(ranks)) for ranks in pipelines] if D > 1 else [None]
        replicas = [dist.new_group([pipelines[p][s] for p in range(D)]) for s in range(S)] if D > 1 else None
        group = groups[self.pipeline]
        members = sorted(pipelines[self.pipeline]) if D > 1 else list(range(ctx.world_size))
        # The planner's graph of the model, for its layer groups (node names match a fresh trace).
        graph = capture_config(ctx.workload.model_cfg, max(d["micro_batch"], 1))
        table = group_table(graph)
        gm = fx.GraphModule(model, FunctionalTracer().trace(model))
        cuts = [st["groups"][0] for st in d["stages"]] + [d["stages"][-1]["groups"][1] + 1]
        tensors = {n.name for n in graph.nodes if n.is_tensor}
        module, loss_module = cut_graph(gm, table, tensors, cuts, self.stage_index)
        self.module = module
        self.params = list(module.parameters())
        self.model = model if method.mirror_full_state else None
        # Replicas of this stage (data parallel across pipelines) sum their gradients once the
        # schedule is through, in buckets (gradient_buckets, as the plan prices them).
        self.replica_group = replicas[self.stage_index] if D > 1 else None
        self.buckets = ([[self.params[i] for i in run] for run in gradient_buckets(
            [p.numel() * p.element_size() for p in self.params], method.bucket_cap_mb)] if D > 1 else [])
        # Each pipeline's summed loss over the global targets; the replicas' gradients add up.
        self.loss_scale = 1.0 / ctx.workload.targets_per_iter

        def loss_fn(output, target):
            outs = output if isinstance(output, tuple) else (output,)
            return loss_module(*outs, target) * self.loss_scale

        stage = PipelineStage(module, self.stage_index, S, ctx.device, group=group)
        stage.stage_index_to_group_rank = {s: members.index(pipelines[self.pipeline][s]) for s in range(S)}
        schedule = Schedule1F1B if d["schedule"] == "1f1b" else ScheduleGPipe
        # Every stage gets the loss function (the schedule runs backward where there is one);
        # only the last calls it.
        self.schedule = schedule(stage, m, loss_fn=loss_fn, scale_grads=False)
        self.optimizer = torch.optim.Adam(self.params, lr=method.lr)
        self.grad_clip = method.grad_clip
        self.world = ctx.world_size
        # torch.fx's tracer leaves reference cycles that hold the whole model (its patched
        # methods' closures keep the tracer, the tracer its root) until a collection: collected
        # now, a rank holds its stage alone (tiny VGG19's last stage held the other stage's
        # 2.2 MiB of convolutions through its set-up iterations).
        del gm
        gc.collect()

    def step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        inputs, targets = batch[:-1], batch[-1]
        losses: list[torch.Tensor] = []
        args = inputs if self.is_first else ()
        kwargs = {"target": targets, "losses": losses} if self.is_last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self.sync_replicas()
        if self.grad_clip:
            self.clip_global_norm(self.grad_clip)
        self.optimizer.step()
        self.emulator.stretch()  # the optimizer's compute (and what followed the last wait)
        if self.model is not None:
            self.write_full_state()
        if losses:  # the micro-batches' scaled losses, back to the summed loss
            return (torch.stack([x.detach() for x in losses]).sum() / self.loss_scale).detach()
        return torch.zeros(())

    def sync_replicas(self) -> None:
        """Sum the stage's gradients over its replicas, bucket by bucket (a flat copy each)."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.replica_group)
            for p, value in zip(bucket, _unflatten_dense_tensors(flat, grads)):
                p.grad = value if p.grad is None else p.grad.copy_(value)

    def clip_global_norm(self, max_norm: float) -> None:
        """Every stage's gradients scaled by one factor: the norm over the whole model (a
        stage's replicas hold the same gradients once summed, so one pipeline's stages count)."""
        sq = torch.zeros((), dtype=torch.float64)
        if self.pipeline == 0:
            for p in self.params:
                if p.grad is not None:
                    sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq)
        coef = min(1.0, max_norm / (float(sq.sqrt()) + 1e-6))
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)

    def write_full_state(self) -> None:
        """Tests: every stage's parameters and gradients written into this rank's full model."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        mine = {names[id(p)]: (p.detach().clone(), None if p.grad is None else p.grad.detach().clone())
                for p in self.params} if self.pipeline == 0 else {}
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine)
        with torch.no_grad():
            for part in everyone:
                for name, (value, grad) in part.items():
                    p = self.model.get_parameter(name)
                    p.copy_(value)
                    p.grad = grad
