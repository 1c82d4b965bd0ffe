"""The pipeline's planning pieces: the stage slots a cluster offers and their orders, the
numbers of micro-batches to price, the priced cost of a run of layer groups on a slot (time,
memory, sends), and the dynamic program that cuts the groups into stages. It traces no
schedule and runs nothing."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.program import Affine, Stage
from bench.cost import FloatAlgebra, virtual_devices
from bench.cost.pipeline import (
    stage_memory,
    stage_peak_bytes,
    transfer_s,
)
from bench.cost.price import device_compute
from methods.capture import Graph
from methods.common import GroupTable, StageActivations

MAX_ORDERS = 2000  # device orders tried per layout; past it, a few heuristic ones


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
            raise ConfigError(
                f"method.stage_level=machine needs machines of one size, but cluster={cluster.name} "
                f"has machines of {sorted(len(r) for r in machines.values())} devices; use "
                "method.stage_level=device"
            )
    out, seen = [], set()
    for lvl, us in units.items():
        count = len(us)
        if num_stages == "auto":
            choices = [k for k in range(2, min(count, num_groups) + 1) if count % k == 0] or ([1] if count == 1 else [])
            if not choices:
                refusals.append(
                    f"method.stage_level={lvl} gives {count} {lvl}s to cut into stages (a divisor of them, "
                    f"from 2 to the {num_groups} layer groups), and no such number exists; use "
                    "another method.stage_level or method.num_stages"
                )
        else:
            if count % num_stages:
                divisors = [k for k in range(1, count + 1) if count % k == 0]
                refusals.append(
                    f"method.num_stages={num_stages} does not divide the {count} {lvl}s of "
                    f"cluster={cluster.name} (method.stage_level={lvl}); try "
                    f"{', '.join(map(str, divisors))}"
                )
                continue
            if num_stages > num_groups:
                refusals.append(
                    f"method.num_stages={num_stages} is more than the {num_groups} layer groups the model "
                    f"can be cut at; use method.num_stages<={num_groups}"
                )
                continue
            choices = [num_stages]
        ordered = sorted(us, key=lambda u: (_hardware(cluster, u), u))
        for k in choices:
            size = count // k
            slots = tuple(tuple(r for u in ordered[i * size : (i + 1) * size] for r in u) for i in range(k))
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
    return list(
        dict.fromkeys(
            [tuple(slots), tuple(sorted(slots, key=lambda s: -speed[s])), tuple(sorted(slots, key=lambda s: speed[s]))]
        )
    )


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
            raise ConfigError(
                f"method.num_micro_batches={requested} must divide the pipeline's batch of {batch} "
                f"samples; try {', '.join(map(str, divisors))}"
            )
        if requested < least:
            raise ConfigError(
                f"method.num_micro_batches={requested} is fewer than the {num_stages} stages: "
                "1F1B needs a micro-batch per stage; try "
                f"{', '.join(str(d) for d in divisors if d >= least) or 'a larger batch'} "
                "(or method.schedule=gpipe)"
            )
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
            out.append(
                tuple(
                    Stage(flops=Affine(f), op_class=cls, launches=k, label=label)
                    for cls, (f, k) in sorted(by_class.items())
                )
            )
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
                self._cache[key] = float(
                    sum(device_compute(s, self.cluster, v, self.alg) for s in fwd + bwd) + per_kernel * (fk + bk)
                )
        return self._cache[key]

    def memory(self, first: int, end: int, mb: int, flight: int, m: int, replicated: bool, last: bool):
        kept, backward = self._acts(first, end)
        groups = self.table.span(first, end)
        return stage_memory(
            param_bytes=sum(g.param_bytes for g in groups),
            largest_param_bytes=max((g.largest_param_bytes for g in groups), default=0.0),
            kept_bytes=mb * kept,
            backward_bytes=mb * backward,
            received_bytes=mb * self.table.border_bytes(first, end),
            sent_bytes=0.0 if last else mb * groups[-1].out_bytes,
            in_flight=flight,
            num_micro_batches=m,
            bucket_bytes=min(sum(g.param_bytes for g in groups), self.bucket_bytes) if replicated else 0.0,
        )

    def peak(self, first: int, end: int, mb: int, flight: int, m: int, replicated: bool, last: bool) -> float:
        """Bytes a rank of the stage holds at its peak (stage_memory's backward or Adam's step)."""
        key = (first, end, mb, flight, m, replicated, last)
        if key in self._peaks:
            return self._peaks[key]
        kept, backward = self._acts(first, end)
        params = self._prefix_params[end] - self._prefix_params[first]
        self._peaks[key] = stage_peak_bytes(
            param_bytes=params,
            largest_param_bytes=max(g.largest_param_bytes for g in self.table.span(first, end)),
            kept_bytes=mb * kept,
            backward_bytes=mb * backward,
            received_bytes=mb * self.table.border_bytes(first, end),
            sent_bytes=0.0 if last else mb * self.table.groups[end - 1].out_bytes,
            in_flight=flight,
            num_micro_batches=m,
            bucket_bytes=min(params, self.bucket_bytes) if replicated else 0.0,
            foreach=self.cluster.device == "cuda",
        )
        return self._peaks[key]

    def fits(self, slot: tuple[int, ...], peak: float) -> bool:
        """Whether every device of the slot holds `peak` bytes (and its libraries' own)."""
        return all(
            peak + (self.vdevs[r].compute.workspace_bytes if self.vdevs[r].compute is not None else 0.0)
            <= self.vdevs[r].memory_bytes
            for r in self._distinct(slot)
        )

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
            self._send[key] = [
                [self.slot_seconds(slot, i, j, mb) if j > i else 0.0 for j in range(G + 1)] for i in range(G)
            ]
        return self._send[key]


def best_cuts(
    costs: _Costs, order, mb: int, m: int, flights: list[int], replicated: bool
) -> tuple[float, float, list[int]] | None:
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
