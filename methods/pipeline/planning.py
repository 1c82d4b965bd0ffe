"""The pipeline's planning pieces: the stage slots a cluster offers and their orders, the
numbers of micro-batches to price, the priced cost of a run of layer groups on a slot (time,
memory, sends), the dynamic program that cuts the groups into stages, and the pipelines' shares
of the batch. It traces no schedule and runs nothing."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.program import Affine, Stage
from bench.core.shares import round_shares
from bench.cost import FloatAlgebra, virtual_devices
from bench.cost.pipeline import StageBytes, grad_sync_s, shard_collective_s, stage_peak_bytes, transfer_s
from bench.cost.price import device_compute
from methods.common import GroupTable, StageActivations, gradient_buckets
from methods.graph import Graph

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


ALIKE = ("auto", "stage", "pipeline")


def layouts(
    cluster: ClusterSpec, level: str, num_stages, num_groups: int, alike: str = "auto"
) -> tuple[list[Layout], list[str]]:
    """The stage slots a cluster offers (and why others are refused): at `level` "device" the
    devices, at "machine" the machines (all of one size), cut into `num_stages` slots of equal
    size ("auto": every number of slots from 2 to the layer groups that divides them). The
    units sorted by hardware are cut two ways (`alike`, "auto": both): "stage", a slot of
    consecutive units (a stage's replicas alike, pipelines across the kinds), and "pipeline",
    each pipeline of consecutive units (a pipeline's ranks alike, e.g. a machine's devices; its
    replicas, in the other pipelines, unlike), which the pipelines' shares of the batch balance.
    A slot of k units of g devices gives k * g pipelines."""
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
            ways = {
                "stage": tuple(tuple(r for u in ordered[i * size : (i + 1) * size] for r in u) for i in range(k)),
                "pipeline": tuple(tuple(r for u in ordered[i::k] for r in u) for i in range(k)),
            }
            for slots in (ways[a] for a in ways if alike in ("auto", a)):
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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_batch_counts(global_batch: int, num_pipelines: int, shares: str, requested) -> list[int]:
    """The numbers of micro-batches (per pipeline, the same in every pipeline) to price: the
    requested one (checked), or (auto) every one that gives each pipeline a micro-batch of at
    least one sample. With priced shares each pipeline's batch is a multiple of the count (its
    micro-batches equal, as torch's receive buffers need), so the count divides the global
    batch; with equal shares it divides a pipeline's batch. Which of them a schedule runs is
    torch's to say (methods.pipeline.schedule)."""
    if shares == "equal":
        batch, what = global_batch // num_pipelines, "the pipeline's batch"
    else:
        batch, what = global_batch, "the global batch"
    choices = [d for d in divisors(batch) if batch // d >= (1 if shares == "equal" else num_pipelines)]
    if requested != "auto":
        if requested not in choices:
            raise ConfigError(
                f"method.num_micro_batches={requested} must divide {what} of {batch} samples"
                + (
                    ""
                    if shares == "equal" or num_pipelines == 1
                    else f" into micro-batches for {num_pipelines} pipelines"
                )
                + f"; try {', '.join(map(str, choices)) or 'a larger batch'}"
            )
        return [requested]
    return choices


@dataclass
class _Costs:
    """Per slot hardware and micro-batch size, the priced costs of runs of layer groups.

    `profile`: on an emulated CPU cluster, the layer groups' measured seconds at a micro-batch
    size (group_profile, measured on first use); a stage is then priced at those, scaled by the
    host's plain step now over the profile's (bench.cost.pipeline.measured_scale).

    `checkpointing`: each layer group under activation checkpointing (cut.CheckpointedStage): a
    stage's backward also runs its forward again (the recompute: its FLOPs and kernels, or its
    measured forward, in the backward's price and in zero-bubble's input pass, the first to
    reach the saved tensors), and it keeps only its groups' inputs between its passes."""

    graph: Graph
    table: GroupTable
    cluster: ClusterSpec
    model_launches: float
    profile: Callable[[int], dict] | None = None
    flops_per_sample: float = 0.0
    bucket_bytes: float = 25 * 2**20  # the gradient bucket replicas all-reduce at a time
    checkpointing: bool = False
    # Profiled seconds each compute action (a micro-batch's forward, backward, or one of
    # zero-bubble's two backward passes) adds beside its groups' own: the schedule's own work
    # (PipelineParallel's work probe; 0 while the candidates are searched)
    action_s: float = 0.0

    def __post_init__(self) -> None:
        self._acts = StageActivations(self.graph, self.table)
        self._prefix_params, self._prefix_casts, self._prefix_calls = [0.0], [0.0], [0.0]
        for g in self.table.groups:
            self._prefix_params.append(self._prefix_params[-1] + g.param_bytes)
            self._prefix_casts.append(self._prefix_casts[-1] + g.cast_bytes)
            self._prefix_calls.append(self._prefix_calls[-1] + g.call_cast_bytes)
        # each tied parameter's group in the table (its first reader's)
        self._owner = {
            name: g.index for g in self.table.groups for name in g.params if name in self.table.shared_groups
        }
        self._profiles: dict[int, dict] = {}
        self._hw = {d.rank: _hardware(self.cluster, (d.rank,)) for d in self.cluster.devices}
        self._peaks: dict = {}
        self._held: dict = {}  # stage_bytes of a stage alone on its rank, by (first, end, mb, shards)
        self._send: dict = {}
        self._matrix: dict = {}
        self._slowest: dict = {}
        self._columns: dict = {}
        self._sends: dict = {}
        self._fitting: dict = {}
        self.free_cuts: dict = {}  # best_cuts with memory unchecked, by (slots, micro-batches, local)
        self.balanced: dict = {}  # balance_shares, by its arguments (PipelineParallel._candidates)
        self.syncs: dict = {}  # sync_seconds, by its arguments
        self.vdevs = virtual_devices(self.cluster, "gpu")
        self.alg = FloatAlgebra([[1.0 / len(self.vdevs)] * len(self.vdevs)])
        self._cache: dict = {}
        self._weight = self._weight_flops()
        self._shapes = {
            str(n.fx_node.target): (tuple(n.shape or ()), n.dtype.itemsize) for n in self.graph.nodes if n.is_param
        }
        self._shards: dict[int, list[float]] = {}

    def _weight_flops(self) -> list[float]:
        """Per layer group and sample, the backward FLOPs that make the weights' gradients: half
        the backward of each op that reads a parameter (x @ w: dx and dw alike)."""
        out = [0.0] * self.table.num_groups
        batch = max(self.graph.batch_size, 1)
        for n in self.graph.nodes:
            g = self.table.node_group.get(n.name)
            if g is not None and n.flops and any(self.graph[i].is_param for i in n.inputs):
                out[g] += n.flops * n.backward_factor / 2 / batch
        return out

    def weight_share(self, first: int, end: int) -> float:
        """The part of groups [first, end)'s backward (the recompute included) that makes the
        weights' gradients."""
        groups = self.table.span(first, end)
        total = sum(g.bwd_flops + (g.fwd_flops if self.checkpointing else 0.0) for g in groups)
        return sum(self._weight[first:end]) / total if total else 0.5

    def profile_at(self, mb: int) -> dict | None:
        if self.profile is None:
            return None
        if mb not in self._profiles:
            self._profiles[mb] = self.profile(mb)
        return self._profiles[mb]

    def passes(self, first: int, end: int, mb: int) -> tuple[tuple[Stage, ...], tuple[Stage, ...], float, float]:
        """(forward Stages, backward Stages, forward kernels, backward kernels) of groups
        [first, end) at `mb` samples: a Stage per op class, as Programs price compute; with
        checkpointing the backward also holds the forward's Stages and kernels (the recompute)."""
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
        if self.checkpointing:
            return out[0], out[1] + out[0], float(fwd_k), float(bwd_k + fwd_k)
        return out[0], out[1], float(fwd_k), float(bwd_k)

    def measured(self, first: int, end: int, mb: int) -> tuple[float, float, float] | None:
        """(forward, backward, Adam) seconds of groups [first, end) at `mb` samples where the
        groups were timed on this host (group_profile), else None."""
        prof = self.profile_at(mb)
        if prof is None:
            return None
        fwd, bwd, adam = (float(sum(prof[k][first:end])) for k in ("forward", "backward", "optimizer"))
        return fwd + self.action_s, bwd + (fwd if self.checkpointing else 0.0) + self.action_s, adam

    def measured_split(self, first: int, end: int, mb: int) -> tuple[float, float] | None:
        """(input, weights) seconds of torch's zero-bubble backward of groups [first, end) at `mb`
        samples, summed over the groups, where timed on this host (group_profile), else None."""
        prof = self.profile_at(mb)
        if prof is None:
            return None
        recompute = float(sum(prof["forward"][first:end])) if self.checkpointing else 0.0
        return (
            float(sum(prof["input_backward"][first:end])) + recompute + self.action_s,
            float(sum(prof["weight_backward"][first:end])) + self.action_s,
        )

    def scale(self, mb: int) -> float:
        """The host's plain step at `mb` as the cluster's speed prices it over the profile's."""
        prof = self.profile_at(mb)
        if prof is None:
            return 1.0
        now = self.flops_per_sample * mb / self.cluster.host_flops + self.cluster.host_step_overhead_s
        return now / prof["step_s"]

    def seconds(self, rank: int, first: int, end: int, mb: int) -> float:
        """Forward and backward of groups [first, end) on `rank` at `mb` samples: the sum of
        the groups' own (every term of the price adds up over groups: FLOPs by op class over
        their rates, kernels' fixed costs, measured seconds)."""
        prefix = self._prefix(rank, mb)
        return prefix[end] - prefix[first]

    def _prefix(self, rank: int, mb: int) -> list[float]:
        key = (self._hw[rank], mb)
        if key not in self._cache:
            v, dev = self.vdevs[rank], self.cluster.devices[rank]
            out = [0.0]
            for g in range(self.table.num_groups):
                measured = self.measured(g, g + 1, mb)
                if measured is not None:  # the recompute is in the measured backward
                    t = (measured[0] + measured[1]) * self.scale(mb) / dev.speed
                else:
                    fwd, bwd, fk, bk = self.passes(g, g + 1, mb)
                    per_kernel = dev.step_overhead_s / self.model_launches if self.model_launches else 0.0
                    t = float(
                        sum(device_compute(s, self.cluster, v, self.alg) for s in fwd + bwd) + per_kernel * (fk + bk)
                    )
                out.append(out[-1] + t)
            self._cache[key] = out
        return self._cache[key]

    def activations(self, first: int, end: int) -> tuple[float, float]:
        """Per sample, (what stage [first, end) keeps of a micro-batch between its passes, the
        most it holds of one in its backward): methods.common.StageActivations, or under
        checkpointing what crosses into each of its groups but the first (its receive buffer,
        counted as such) and its output, and in backward that plus the most one group holds
        of its own recomputed activations and their gradients."""
        if not self.checkpointing:
            return self._acts(first, end)
        last = self.table.num_groups - 1

        def out(g: int) -> float:
            return self._acts.tail_inputs if g == last else self.table.groups[g].out_bytes

        kept = sum(self.table.groups[g - 1].out_bytes for g in range(first + 1, end)) + out(end - 1)
        inner = max(self._acts(g, g + 1)[1] - out(g) for g in range(first, end))
        return kept, kept + inner

    def stage_bytes(
        self, first: int, end: int, mb: int, shards: int = 1, copies: Sequence[str] | None = None
    ) -> StageBytes:
        """What a rank holds for stage [first, end) at `mb` samples (bench.cost.pipeline.rank_memory),
        its state sharded over `shards` replicas: its layer groups' parameters and its copies of
        tied parameters (`copies`; None: those of a rank holding this stage alone, tied_copies)."""
        kept, backward = self.activations(first, end)
        # Each micro-batch's own casts of parameters autocast casts anew per call: kept with its
        # activations (made again by a checkpoint's recompute, so only in backward there).
        calls = self._prefix_calls[end] - self._prefix_calls[first]
        groups = self.table.span(first, end)
        last = end == self.table.num_groups
        if copies is None:
            (copies,) = self.tied_copies([(first, end)])
        whole = [self.copy_bytes((name,), 1) for name in copies]
        return StageBytes(
            param_bytes=self._prefix_params[end] - self._prefix_params[first] + sum(whole),
            largest_param_bytes=max([g.largest_param_bytes for g in groups] + whole, default=0.0),
            kept_bytes=mb * kept + (0.0 if self.checkpointing else calls),
            backward_bytes=mb * backward + calls,
            received_bytes=mb * self.table.border_bytes(first, end),
            sent_bytes=0.0 if last else mb * groups[-1].out_bytes,
            shard_bytes=self.shard_bytes(first, end, shards) + (self.copy_bytes(copies, shards) if shards > 1 else 0.0),
            cast_bytes=self._prefix_casts[end] - self._prefix_casts[first],
        )

    def tied_copies(self, spans: Sequence[tuple[int, int]]) -> list[tuple[str, ...]]:
        """Per stage of a rank holding runs `spans` of layer groups ([first, end) each), the tied
        parameters it keeps a copy of (tied_params): those it reads that the layer-group table
        counts in none of the rank's stages, each on the first of them that reads it (a rank
        holds one tensor of a parameter, however many of its stages read it)."""
        out, held = [], set()
        for first, end in spans:
            mine = tuple(
                name
                for name in self.table.shared_params
                if name not in held
                and not any(a <= self._owner[name] < b for a, b in spans)
                and any(first <= g < end for g in self.table.shared_groups[name])
            )
            held.update(mine)
            out.append(mine)
        return out

    def copy_bytes(self, names: Sequence[str], shards: int) -> float:
        """Parameters `names`' bytes, or over `shards` replicas one replica's shard of them (FSDP2's)."""
        return sum(_padded_shard(*self._shapes[name], shards) for name in names)

    def shard_prefix(self, shards: int) -> list[float]:
        """Prefix sums over the layer groups of one replica's shard of their parameters over
        `shards` replicas, as FSDP2 pads them (each parameter's dim 0 to a multiple of them)."""
        if shards not in self._shards:
            out = [0.0]
            for g in self.table.groups:
                out.append(out[-1] + sum(_padded_shard(*self._shapes[p], shards) for p in g.params))
            self._shards[shards] = out
        return self._shards[shards]

    def tied_bytes(self, name: str, shards: int) -> tuple[float, ...]:
        """What each of `shards` replicas all-reduces of tied parameter `name`'s gradient: the
        whole gradient (one replica, or replicated state), or its FSDP2 shard at each index
        (torch.chunk of dim 0: equal chunks rounded up, the last ones shorter or empty)."""
        shape, itemsize = self._shapes[name]
        whole = float(math.prod(shape) * itemsize)
        if shards < 2 or not shape:
            return (whole,) * max(shards, 1)
        rows = math.ceil(shape[0] / shards)
        row_bytes = whole / shape[0] if shape[0] else 0.0
        return tuple(max(0, min(rows, shape[0] - i * rows)) * row_bytes for i in range(shards))

    def shard_bytes(self, first: int, end: int, shards: int) -> float:
        """One replica's shard of groups [first, end)'s parameters (0 for one replica)."""
        if shards < 2:
            return 0.0
        prefix = self.shard_prefix(shards)
        return prefix[end] - prefix[first]

    def peak(self, first: int, end: int, mb: int, flight: int, m: int, replicated: bool, shards: int = 1) -> float:
        """Bytes a rank holding only stage [first, end) holds at its peak (backward or Adam's
        step), its copies of tied parameters included (stage_bytes); `shards` > 1: its state
        sharded over that many replicas (rank_memory)."""
        key = (first, end, mb, flight, m, replicated, shards)
        if key not in self._peaks:
            held = (first, end, mb, shards)  # the same for every flight, m and state of the stage
            parts = self._held.get(held)
            if parts is None:
                parts = self._held[held] = self.stage_bytes(first, end, mb, shards)
            self._peaks[key] = stage_peak_bytes(
                **vars(parts),
                in_flight=flight,
                num_micro_batches=m,
                bucket_bytes=min(parts.param_bytes, self.bucket_bytes) if replicated else 0.0,
                foreach=self.cluster.device == "cuda",
                shards=shards,
            )
        return self._peaks[key]

    def fits(self, rank: int, peak: float) -> bool:
        """Whether the device holds `peak` bytes (and its libraries' own)."""
        v = self.vdevs[rank]
        return peak + (v.compute.workspace_bytes if v.compute is not None else 0.0) <= v.memory_bytes

    def fitting(
        self, reps: Sequence[tuple[int, int]], flight: int, m: int, replicated: bool, shards: int
    ) -> dict[tuple[int, int], bool]:
        """Whether stage [i, j) fits each of `reps` (rank, micro-batch) at these arguments (as
        best_cuts checks it), by (i, j), filled by best_cuts as it asks; one per device memory,
        workspace and micro-batch of the replicas, kept for every call alike."""
        room = {}
        for r, mb in reps:
            v = self.vdevs[r]
            room[(v.memory_bytes, v.compute.workspace_bytes if v.compute is not None else 0.0, mb)] = None
        return self._fitting.setdefault((tuple(sorted(room)), flight, m, replicated, shards), {})

    def room(self, device) -> float:
        """Bytes a device holds for a plan: its memory less its libraries' own."""
        v = self.vdevs[device.rank]
        return v.memory_bytes - (v.compute.workspace_bytes if v.compute is not None else 0.0)

    def send(self, a: int, b: int, end: int, mb: int) -> float:
        """Sending the output of groups [., end) from rank a to rank b and its gradient back."""
        key = (a, b, end, mb)
        if key not in self._send:
            self._send[key] = 2.0 * transfer_s(mb * self.table.groups[end - 1].out_bytes, self.cluster, a, b)
        return self._send[key]

    def sends(self, a: tuple[int, ...], b: tuple[int, ...], mbs: Sequence[int]) -> list[float]:
        """Per cut point j, the slowest of the pipelines' send(a[p], b[p], j, mbs[p])."""
        key = (a, b, tuple(mbs))
        if key not in self._sends:
            # transfer_s depends on the ranks only through the link they span (one machine or two)
            machine = {d.rank: d.machine for d in self.cluster.devices}
            pairs = {(machine[x] == machine[y], mb): (x, y, mb) for x, y, mb in zip(a, b, mbs)}.values()
            self._sends[key] = [0.0] + [
                max(self.send(x, y, j, mb) for x, y, mb in pairs) for j in range(1, self.table.num_groups + 1)
            ]
        return self._sends[key]

    def seconds_matrix(self, rank: int, mb: int) -> list[list[float]]:
        """seconds(rank, i, j, mb) for every run [i, j) of groups, as [i][j]."""
        key = (self._hw[rank], mb)
        if key not in self._matrix:
            G = self.table.num_groups
            self._matrix[key] = [
                [self.seconds(rank, i, j, mb) if j > i else 0.0 for j in range(G + 1)] for i in range(G)
            ]
        return self._matrix[key]

    def slowest_matrix(self, reps: Sequence[tuple[int, int]]) -> list[list[float]]:
        """The slowest of (rank, micro-batch) replicas on every run [i, j) of groups, as [i][j]."""
        key = tuple(sorted({(self._hw[r], mb) for r, mb in reps}))
        if key not in self._slowest:
            self._slowest[key] = _elementwise_max([self.seconds_matrix(r, mb) for r, mb in reps])
        return self._slowest[key]

    def slowest_columns(self, reps: Sequence[tuple[int, int]]) -> list[list[float]]:
        """slowest_matrix as [j][i] (best_cuts reads it a run's end at a time)."""
        key = tuple(sorted({(self._hw[r], mb) for r, mb in reps}))
        if key not in self._columns:
            self._columns[key] = [list(col) for col in zip(*self.slowest_matrix(reps))]
        return self._columns[key]


def _padded_shard(shape: tuple[int, ...], itemsize: int, shards: int) -> float:
    """A replica's shard of a parameter under FSDP2: dim 0 padded to a multiple of the shards."""
    if not shape:
        return float(itemsize)
    return float(math.ceil(shape[0] / shards) * math.prod(shape[1:]) * itemsize)


def _elementwise_max(matrices: list[list[list[float]]]) -> list[list[float]]:
    if len(matrices) == 1:
        return matrices[0]
    return [[max(row) for row in zip(*rows)] for rows in zip(*matrices)]


def best_cuts(
    costs: _Costs,
    slots: Sequence[tuple[int, ...]],
    mbs: Sequence[int],
    m: int,
    flights: Sequence[int] | None,
    replicated: bool,
    local: Sequence[bool] = (),
    sharded: bool = False,
) -> tuple[float, float, list[int]] | None:
    """The cuts of the layer groups into len(slots) non-empty runs, run k on slot slots[k] (a
    rank per pipeline, pipeline p at `mbs[p]` samples a micro-batch), whose slowest stage
    (forward + backward of a micro-batch on its slowest replica, plus sending its output) is
    fastest, ties broken by the sum, among those whose every stage fits its devices' memory
    with `flights[k]` micro-batches in flight (None: memory unchecked) (dynamic program over
    the groups; a rank holding several stages is checked stage by stage here, and whole by the
    simulator). `local[k]`: stage k + 1 is on the same rank (no send). `sharded`: each stage's
    state sharded over its len(mbs) replicas (memory as rank_memory prices it). (slowest, sum,
    cut points) or None when nothing fits."""
    num_groups, num_stages = costs.table.num_groups, len(slots)
    if num_stages > num_groups:
        return None
    inf = math.inf
    # best[s][j] = (slowest[s][j], total[s][j]), kept as two rows compared as the pair
    # (lexicographically: the slowest stage, then the sum)
    slowest = [[inf] * (num_groups + 1) for _ in range(num_stages + 1)]
    total = [[inf] * (num_groups + 1) for _ in range(num_stages + 1)]
    back = [[0] * (num_groups + 1) for _ in range(num_stages + 1)]
    slowest[0][0] = total[0][0] = 0.0
    D = len(mbs)
    shards = D if sharded else 1
    for s in range(1, num_stages + 1):
        slot = slots[s - 1]
        last = s == num_stages
        # Replicas alike in hardware and micro-batch price alike: one of each.
        reps = [(slot[p], mbs[p]) for p in {(costs._hw[slot[p]], mbs[p]): p for p in range(D)}.values()]
        sec = costs.slowest_columns(reps)
        prev_slow, prev_total = slowest[s - 1], total[s - 1]
        row_slow, row_total, links = slowest[s], total[s], back[s]
        sends = None if last or (local and local[s - 1]) else costs.sends(slot, slots[s], mbs)
        fitting = None if flights is None else costs.fitting(reps, flights[s - 1], m, replicated, shards)
        for j in range(s, num_groups - (num_stages - s) + 1) if not last else (num_groups,):
            send = sends[j] if sends else 0.0
            col = sec[j]
            b0, b1, at = row_slow[j], row_total[j], links[j]
            for i in range(s - 1, j):
                p0 = prev_slow[i]
                if p0 == inf:
                    continue
                c = col[i] + send
                c0 = p0 if p0 > c else c
                c1 = prev_total[i] + c
                if c0 < b0 or (c0 == b0 and c1 < b1):
                    if fitting is not None:
                        ok = fitting.get((i, j))
                        if ok is None:
                            ok = fitting[(i, j)] = all(
                                costs.fits(r, costs.peak(i, j, mb, flights[s - 1], m, replicated, shards))
                                for r, mb in reps
                            )
                        if not ok:
                            continue
                    b0, b1, at = c0, c1, i
            row_slow[j], row_total[j], links[j] = b0, b1, at
    if slowest[num_stages][num_groups] == inf:
        return None
    cuts = [num_groups]
    for s in range(num_stages, 0, -1):
        cuts.append(back[s][cuts[-1]])
    return (slowest[num_stages][num_groups], total[num_stages][num_groups], cuts[::-1])


def fits(
    costs: _Costs,
    slots: Sequence[tuple[int, ...]],
    mbs: Sequence[int],
    cuts: Sequence[int],
    m: int,
    flights: Sequence[int],
    replicated: bool,
    sharded: bool = False,
) -> bool:
    """Whether every stage of `cuts` fits each of its devices, as best_cuts checks them."""
    shards = len(mbs) if sharded else 1
    return all(
        costs.fits(r, costs.peak(cuts[k], cuts[k + 1], mb, flights[k], m, replicated, shards))
        for k, slot in enumerate(slots)
        for r, mb in {(costs._hw[r], mb): (r, mb) for r, mb in zip(slot, mbs)}.values()
    )


def pipeline_seconds(
    costs: _Costs,
    slots: Sequence[tuple[int, ...]],
    stage_rank: Sequence[int],
    cuts: Sequence[int],
    mb: int,
    p: int,
    m: int,
) -> float:
    """A pipeline's iteration as a balanced pipeline runs it: one micro-batch through every
    stage (forward, backward and sends), then its busiest rank for each of the others."""
    K = len(slots)
    load: dict[int, float] = {}
    total = 0.0
    for k in range(K):
        c = costs.seconds(slots[k][p], cuts[k], cuts[k + 1], mb)
        if k + 1 < K and stage_rank[k] != stage_rank[k + 1]:
            c += costs.send(slots[k][p], slots[k + 1][p], cuts[k + 1], mb)
        total += c
        load[stage_rank[k]] = load.get(stage_rank[k], 0.0) + c
    return total + (m - 1) * max(load.values())


def balance_shares(
    costs: _Costs,
    slots: Sequence[tuple[int, ...]],
    stage_rank: Sequence[int],
    m: int,
    units: int,
    flights: Sequence[int],
    equal: bool,
    rounds: int = 4,
    sharded: bool = False,
) -> tuple[float, list[int], list[int]] | None:
    """The pipelines' micro-batches (samples; `units` in all) and the cuts for them: from even
    ones, each round cuts the groups for the current micro-batches (best_cuts) and gives each
    pipeline a share of `units` in proportion to its priced speed at those cuts (its samples
    over pipeline_seconds; whole samples by largest remainder, at least one each), until the
    shares settle. `equal`: even shares only; `sharded`: the stages' state sharded over their
    replicas (best_cuts). Returns (the slowest pipeline's seconds,
    micro-batches, cuts) of the best round, or None where no cut fits."""
    D = len(slots[0])
    if equal and units % D:
        return None
    mbs = round_shares(units, [1.0] * D, min_share=1)
    replicated = D > 1
    local = [stage_rank[k] == stage_rank[k + 1] for k in range(len(slots) - 1)]
    best = None
    seen = set()
    for _ in range(1 if equal else rounds):
        seen.add(tuple(mbs))
        # The fastest cuts with memory unchecked (the same for every schedule and number of
        # micro-batches at these micro-batches), where they fit; else the fastest that fit.
        key = (tuple(slots), tuple(mbs), tuple(local))
        if key not in costs.free_cuts:
            costs.free_cuts[key] = best_cuts(costs, slots, mbs, m, None, replicated, local)
        found = costs.free_cuts[key]
        if found is None or not fits(costs, slots, mbs, found[2], m, flights, replicated, sharded):
            found = best_cuts(costs, slots, mbs, m, flights, replicated, local, sharded)
        if found is None:
            break
        cuts = found[2]
        times = [pipeline_seconds(costs, slots, stage_rank, cuts, mbs[p], p, m) for p in range(D)]
        slowest = max(times)
        if best is None or slowest < best[0]:
            best = (slowest, list(mbs), cuts)
        if D == 1:
            break
        mbs = round_shares(units, [mbs[p] / times[p] for p in range(D)], min_share=1)
        if tuple(mbs) in seen:
            break
    return best


def rank_params(table: GroupTable, cuts: Sequence[int], stages: Sequence[int]) -> list[tuple[str, float]]:
    """The parameters a rank holding `stages` keeps, each once with its bytes, in the order its
    replicas' buckets take them (the trainer orders its own by this): each stage's layer groups'
    parameters as the layer-group table lists them, then the stage's copies of tied parameters
    that no stage of the rank lists (tied_params)."""
    sizes = {p: b for g in table.groups for p, b in zip(g.params, g.param_sizes)}
    spans = [(cuts[k], cuts[k + 1]) for k in stages]
    listed = {p for first, end in spans for g in table.span(first, end) for p in g.params}
    out: dict[str, float] = {}
    for first, end in spans:
        names = [p for g in table.span(first, end) for p in g.params]
        names += [
            n for n in table.shared_params if n not in listed and any(first <= g < end for g in table.shared_groups[n])
        ]
        for n in names:
            out.setdefault(n, sizes[n])
    return list(out.items())


def replica_buckets(table: GroupTable, cuts: Sequence[int], stages: Sequence[int], cap_mb: float) -> tuple[float, ...]:
    """The gradient buckets (bytes) a rank holding `stages` all-reduces among its replicas, as
    the runtime makes them (rank_params: its stages' parameters and copies, in order)."""
    sizes = [b for _, b in rank_params(table, cuts, stages)]
    return tuple(sum(sizes[i] for i in run) for run in gradient_buckets(sizes, cap_mb))


def tied_params(table: GroupTable, cuts: Sequence[int], stage_rank: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters that stages on several positions read (a tied embedding and head), each
    with those positions in order: (name as the traced graph keeps it, positions). Two stages
    of one position read one tensor and need nothing."""
    group_stage = {g: k for k in range(len(cuts) - 1) for g in range(cuts[k], cuts[k + 1])}
    out = []
    for name in table.shared_params:
        positions = tuple(sorted({stage_rank[group_stage[g]] for g in table.shared_groups[name]}))
        if len(positions) > 1:
            out.append((name, positions))
    return out


def sync_seconds(
    costs: _Costs,
    order: Sequence[tuple[int, ...]],
    stage_rank: Sequence[int],
    cuts: Sequence[int],
    cap_mb: float,
    sharded: bool = False,
) -> float:
    """The slowest position's gradient all-reduce among its replicas (grad_sync_s), or with
    sharded state its stages' all-gathers and reduce-scatters (shard_collective_s), after the
    all-reduces of its tied parameters' gradients among a pipeline's holders (tied_params).
    Kept in `costs` per argument."""
    key = (tuple(order), tuple(stage_rank), tuple(cuts), cap_mb, sharded)
    if key not in costs.syncs:
        costs.syncs[key] = _tied_sync_seconds(costs, order, stage_rank, cuts, sharded) + _replica_sync_seconds(
            costs, order, stage_rank, cuts, cap_mb, sharded
        )
    return costs.syncs[key]


def _tied_sync_seconds(
    costs: _Costs, order: Sequence[tuple[int, ...]], stage_rank: Sequence[int], cuts: Sequence[int], sharded: bool
) -> float:
    """sync_seconds' part among a pipeline's holders of each tied parameter."""
    D = len(order[0])
    tied = 0.0
    for name, positions in tied_params(costs.table, cuts, stage_rank):
        nbytes = costs.tied_bytes(name, D if sharded else 1)
        tied += max(
            grad_sync_s((nbytes[p if sharded else 0],), [order[r][p] for r in positions], costs.cluster)
            for p in range(D)
        )
    return tied


def _replica_sync_seconds(
    costs: _Costs,
    order: Sequence[tuple[int, ...]],
    stage_rank: Sequence[int],
    cuts: Sequence[int],
    cap_mb: float,
    sharded: bool,
) -> float:
    """sync_seconds' part among the replicas: the bucket all-reduces or the shard collectives."""
    if len(order[0]) < 2:
        return 0.0
    if sharded:
        D = len(order[0])
        worst = 0.0
        for r in range(len(order)):
            mine = [k for k, x in enumerate(stage_rank) if x == r]
            copies = costs.tied_copies([(cuts[k], cuts[k + 1]) for k in mine])
            shards = [costs.shard_bytes(cuts[k], cuts[k + 1], D) + costs.copy_bytes(c, D) for k, c in zip(mine, copies)]
            worst = max(
                worst,
                sum(
                    shard_collective_s(kind, D * b, order[r], costs.cluster)
                    for b in shards
                    for kind in ("gather", "scatter")
                ),
            )
        return worst
    return max(
        grad_sync_s(
            replica_buckets(costs.table, cuts, [k for k, x in enumerate(stage_rank) if x == r], cap_mb),
            order[r],
            costs.cluster,
        )
        for r in range(len(order))
    )
