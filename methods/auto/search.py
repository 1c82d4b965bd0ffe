"""auto's search: one best-first loop over the candidates, each priced once, pruned by a bound.

Every candidate (methods.auto.space) is priced by its part's own plan (hap's planner, FSDP2's
program, the pipeline's planner) and the simulator, exactly as the runner prices that method's
plan, so auto's price of a candidate is the composed method's. The loop pops the candidate of
least lower bound; it stops when that bound reaches the fastest candidate that fits. A
candidate's bound is the largest of
  - the compute-only time: the iteration's FLOPs over the cluster's effective FLOP/s, with
    checkpointing the forward FLOPs it runs again added (`recompute_share`), and
  - the priced time of the same composition with a subset of its memory tools (a tool adds
    recompute, launches or collectives to a plan and never removes any), or where that part
    probes (below) that lighter plan's price without its probe: two probes time the host apart,
    and a heavier plan's can come out below a lighter one's; and
  - on an emulated CPU cluster, for a part that times its own host work there before pricing it
    (FSDP2's work probe, DeepSpeed's engine probe, the pipeline's work probe: seconds of worker
    processes each), the price of its plan without that probe: the probe only adds host work
    (never less than none).
    Such a candidate is popped after the others of its bound, and probed only where that price
    is below the fastest found; and
  - for a pipeline of hap stages, its schedule replayed with its stages' data-parallel compute
    and nothing else (methods.auto.stage_plan.HapStages.floor_s), popped after the others of
    its bound and planned only where that is below the fastest found; and
  - on an emulated CPU cluster, for a pipeline with sharded state whose work probe is off, the
    price of the same pipeline with replicated state where that fits: there FSDP2's own work on
    the CPU ranks (hooks, copies in and out of the gathered buffers), which then nothing
    measures, makes the sharded pipeline measure slower than the replicated one
    (docs/methods.md, "Whole-space planner (auto)"), so it is taken only where the replicated
    one does not fit.
The second is exact where the lighter plan's part was not held back by memory (hap's LP memory
rows, the pipeline's fitting cuts); where it was, a tool could free a faster plan, which this
prunes (`prune=false` prices every candidate, to check). Memory is in the search: a candidate
whose per-device peak passes its device's memory (or the budget) is never returned while any
fits; where none fits, the plan is refused as `oom` with the smallest peak found. A hap or
DeepSpeed candidate whose memory floor (methods.auto.floors) already passes memory is `oom`
without its part planning it (`floored`; no time, so it bounds no candidate). It does not
build parts (methods.auto.space) or run them (the part's runtime).
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from dataclasses import dataclass

from bench.core.cluster import ClusterSpec
from bench.core.errors import PlanningError
from bench.core.interfaces import Plan, Workload
from bench.cost import simulate
from methods.auto.floors import hap_gpus_only, oom_floor
from methods.auto.space import Candidate, make_part
from methods.common import capture_batch_norm, checkpoint_units
from methods.graph import capture_config
from methods.pipeline import SharedCosts, save_traces

# The parts that time their own host work on an emulated CPU cluster, by the option that does it.
PROBES = {"fsdp": "work_probe", "deepspeed": "engine_probe", "pipeline": "work_probe"}


class NoPlanFits(PlanningError):
    """Every candidate that planned passes some device's memory."""

    status = "oom"


@dataclass
class Priced:
    """A candidate as its part planned and the simulator priced it."""

    cand: Candidate
    status: str  # "fits" | "oom" (planned, some device over its memory, or refused so) | "refused"
    bound_s: float
    iter_time_s: float | None = None
    peak_gib: tuple[float, ...] = ()
    over: float = float("inf")  # the worst device's peak over its memory (oom only)
    plan: Plan | None = None
    part: object = None
    reason: str | None = None
    planning_s: float = 0.0
    floored: bool = False  # oom by its memory floor (methods.auto.floors), its part never planned
    gpus_only: bool = False  # hap planned over GPUs only, the machines' floor over memory (floors.hap_gpus_only)

    def row(self) -> dict:
        return {
            "candidate": self.cand.describe(),
            "status": self.status,
            "iter_time_s": self.iter_time_s,
            "peak_gib": max(self.peak_gib) if self.peak_gib else None,
            "bound_s": self.bound_s,
            "planning_s": round(self.planning_s, 3),
            **({"reason": self.reason} if self.reason else {}),
            **({"floored": True} if self.floored else {}),
            **({"levels": "gpu (the machines' floor passes memory)"} if self.gpus_only else {}),
        }

    def bounds_heavier(self) -> bool:
        """Whether its time bounds its composition with more tools: a time it has, and not that of
        a hap plan over GPUs only that does not fit (over machines hap may have kept a faster
        one, also over memory: methods.auto.floors)."""
        return self.iter_time_s is not None and not (self.gpus_only and self.status != "fits")


@dataclass
class Found:
    """What the search found: the chosen candidate, and every one priced or pruned."""

    best: Priced
    priced: list[Priced]
    pruned: list[tuple[Candidate, float]]  # with the bound it was pruned at
    ideal_s: float

    def details(self) -> dict:
        return {
            "chosen": self.best.cand.to_json(),
            "chosen_as": self.best.cand.describe(),
            "part": self.best.cand.part,
            "compute_only_s": self.ideal_s,
            "candidates": [p.row() for p in self.priced],
            "pruned": [{"candidate": c.describe(), "bound_s": b} for c, b in self.pruned],
            "num_priced": len(self.priced),
            "num_pruned": len(self.pruned),
        }


def with_memory(cluster: ClusterSpec, budget_gib: float | None) -> ClusterSpec:
    """`cluster` with every device's memory at most `budget_gib` (itself without a budget)."""
    if budget_gib is None:
        return cluster
    groups = tuple(
        dataclasses.replace(g, memory_gib=min(budget_gib, cluster.device_type(g.device).memory_gib))
        if g.memory_gib is None
        else dataclasses.replace(g, memory_gib=min(budget_gib, g.memory_gib))
        for g in cluster.machines
    )
    return dataclasses.replace(cluster, machines=groups)


def price(
    auto, cand: Candidate, workload: Workload, cluster: ClusterSpec, bound_s: float, shared: SharedCosts | None = None
) -> Priced:
    """`cand` planned by its part on `cluster` (memory as budgeted) and priced by the simulator.
    `shared`: the pipeline's costs of this workload and cluster, kept across candidates (the
    same plan as the part's alone)."""
    t0 = time.perf_counter()
    gpus_only = hap_gpus_only(auto, cand, workload, cluster)
    part = make_part(auto, cand, gpus_only)
    try:
        pipelined = cand.part in ("pipeline", "hap_stages")  # the pipeline planner's costs, shared
        if pipelined:
            plan = part.plan(workload, cluster, shared)
        else:
            plan = part.plan(workload, dataclasses.replace(cluster, virtual_device="gpu") if gpus_only else cluster)
    except ValueError as exc:  # ConfigError, PlanningError (StageOOM: status oom)
        status = "oom" if getattr(exc, "status", None) == "oom" else "refused"
        return Priced(cand, status, bound_s, reason=str(exc), planning_s=time.perf_counter() - t0, gpus_only=gpus_only)
    known = getattr(part, "simulated", None)  # the pipeline's simulation of the program it chose
    sim = known[1] if known is not None and known[0] is plan.program else simulate(plan.program, cluster, plan.ratios)
    limits = [d.type.memory_gib for d in cluster.devices]
    peaks = tuple(sim.peak_mem_gib)
    over = max(p / m for p, m in zip(peaks, limits))
    return Priced(
        cand,
        "fits" if over <= 1.0 else "oom",
        bound_s,
        sim.iter_time_s,
        peaks,
        over,
        plan,
        part,
        planning_s=time.perf_counter() - t0,
        gpus_only=gpus_only,
    )


def probes(auto, cand: Candidate, cluster: ClusterSpec) -> bool:
    """Whether `cand`'s part times its own host work before it prices its plan on `cluster`."""
    flag = PROBES.get(cand.part)
    template = getattr(auto, cand.part, None)
    return (
        flag is not None and bool(getattr(template, flag, False)) and cpu_emulated(cluster) and bool(cluster.host_flops)
    )


def cpu_emulated(cluster: ClusterSpec) -> bool:
    """Whether `cluster`'s devices are emulated on this host's CPU cores."""
    return cluster.emulated and cluster.device == "cpu"


def unprobed_price(auto, cand: Candidate, workload: Workload, cluster: ClusterSpec) -> float | None:
    """`cand`'s price with its part's host-work probe off: a lower bound of its price with it (the
    probe adds host work, `bench.runtime.method_step.added_host_work_flops`, never less than none).
    None where it does not plan."""
    part = make_part(auto, cand)
    setattr(part, PROBES[cand.part], False)
    try:
        plan = part.plan(workload, cluster)
    except ValueError:
        return None
    return simulate(plan.program, cluster, plan.ratios).iter_time_s


def floored(auto, cand: Candidate, workload: Workload, cluster: ClusterSpec, bound_s: float) -> Priced | None:
    """`cand` as `oom` where its memory floor passes device memory (methods.auto.floors), its part
    not planned; None where the floor does not show it."""
    t0 = time.perf_counter()
    reason = oom_floor(auto, cand, workload, cluster)
    if reason is None:
        return None
    return Priced(cand, "oom", bound_s, reason=reason, planning_s=time.perf_counter() - t0, floored=True)


def search(auto, cands: list[Candidate], workload: Workload, cluster: ClusterSpec) -> Found:
    """The fastest candidate that fits (module docstring).

    Raises:
        NoPlanFits: candidates planned, none fits; the smallest peak found in one line.
        PlanningError: no candidate planned at all (the first part's reason).
    """
    ideal = workload.flops_per_iter / cluster.total_effective_flops()
    again = None  # recompute_share, worked out where a checkpointed candidate is first bounded

    def compute_only(c: Candidate) -> float:
        nonlocal again
        if not c.checkpointing:
            return ideal
        if again is None:
            again = recompute_share(workload)
        return ideal * (1.0 + again)

    priced: dict[Candidate, Priced] = {}
    floors: dict[Candidate, float] = {}  # what a candidate cannot beat, known before its price
    shared = SharedCosts(workload, cluster)  # the pipelines' costs, priced once for every stage count and state

    def bound(c: Candidate) -> float:
        # A tool adds to what the simulator prices; a probe adds what it measured of the host, which
        # differs from one probe to the next: a probed lighter candidate bounds by its unprobed price.
        lighter = [
            p.iter_time_s for d, p in priced.items() if p.bounds_heavier() and d not in probing and d.lighter_than(c)
        ]
        lighter += [f for d, f in floors.items() if d.lighter_than(c)]
        return max([compute_only(c), *lighter, floors.get(c, ideal)])

    def floor(c: Candidate) -> float:
        # What `c` cannot beat, known before its price (module docstring): its price without its
        # part's probe, or a sharded pipeline's replicated twin's on CPU ranks where that fits.
        if c in probing:
            unprobed = unprobed_price(auto, c, workload, cluster)
            return ideal if unprobed is None else unprobed
        if c.part == "hap_stages":  # its stages' data-parallel compute in its schedule (HapStages.floor_s)
            return max(ideal, make_part(auto, c).floor_s(workload, cluster, shared))
        twin = priced.get(dataclasses.replace(c, state="replicated"))
        return twin.iter_time_s if twin is not None and twin.status == "fits" else ideal

    probing = {c for c in cands if probes(auto, c, cluster)}
    cpu = cpu_emulated(cluster)
    later = {
        c: c in probing or (cpu and c.part == "pipeline" and c.state == "sharded") or c.part == "hap_stages"
        for c in cands
    }
    heap = [(ideal, later[c], i, c) for i, c in enumerate(cands)]
    heapq.heapify(heap)
    best: Priced | None = None
    pruned: list[tuple[Candidate, float]] = []
    try:
        while heap:
            was, _, i, c = heapq.heappop(heap)
            now = bound(c)
            if now > was:
                heapq.heappush(heap, (now, later[c], i, c))
                continue
            if auto.prune and best is not None and now >= best.iter_time_s:
                pruned = [(c, now)] + [(x[3], bound(x[3])) for x in sorted(heap)]
                break
            if auto.prune and (p := floored(auto, c, workload, cluster, now)) is not None:
                priced[c] = p
                continue
            if auto.prune and best is not None and later[c] and c not in floors:
                floors[c] = floor(c)
                if floors[c] > now:
                    heapq.heappush(heap, (floors[c], True, i, c))
                    continue
            p = priced[c] = price(auto, c, workload, cluster, now, shared)
            if p.status == "fits" and (best is None or p.iter_time_s < best.iter_time_s):
                best = p
    finally:
        save_traces()  # what torch traced for the pipelines (planned on `shared`), kept once
    tried = list(priced.values())
    if best is None:
        raise _refusal(tried, cluster, auto.memory_budget_gib)
    return Found(best, tried, pruned, ideal)


def recompute_share(workload: Workload) -> float:
    """The forward FLOPs activation checkpointing runs again, over the iteration's: every part
    that checkpoints recomputes at least the ops of `checkpoint_units` (hap, FSDP2, DDP and
    DeepSpeed those; a pipeline stage all of its groups'), each priced as its forward is, so a
    checkpointed candidate's compute-only time is the plain one's times 1 + this."""
    graph = capture_config(workload.model_cfg, workload.global_batch, batch_norm=capture_batch_norm(workload))
    recomputed = graph.with_recompute([u.nodes for u in checkpoint_units(graph)]).recomputed
    return sum(graph[name].flops for name in recomputed) / graph.train_flops()


def _refusal(tried: list[Priced], cluster: ClusterSpec, budget_gib: float | None) -> PlanningError:
    """Why nothing fits, in one line: the candidate whose worst device is least over."""
    planned = [p for p in tried if p.status == "oom" and p.peak_gib]
    budget = f" (method.memory_budget_gib={budget_gib:g})" if budget_gib is not None else ""
    fix = (
        "raise method.memory_budget_gib or set it to null"
        if budget_gib is not None
        else "use a smaller batch (preset.batch_per_device) or more devices"
    )
    if planned:
        p = min(planned, key=lambda x: x.over)
        rank = max(range(len(p.peak_gib)), key=lambda r: p.peak_gib[r] / cluster.devices[r].type.memory_gib)
        dev = cluster.devices[rank].type
        return NoPlanFits(
            f"no plan of the {len(tried)} auto priced fits device memory{budget}: the smallest peak found "
            f"is {p.peak_gib[rank]:.1f} GiB on rank {rank}, a {dev.name} of {dev.memory_gib:g} GiB, with "
            f"{p.cand.describe()}; {fix}"
        )
    oom = [p for p in tried if p.status == "oom"]
    if oom:
        what = f"{oom[0].cand.describe()}: " if oom[0].floored else ""
        return NoPlanFits(f"no plan auto priced fits device memory{budget}: {what}{oom[0].reason}")
    if tried:
        return PlanningError(f"no candidate of auto planned: {tried[0].cand.describe()}: {tried[0].reason}")
    return PlanningError("auto's options leave no candidate to price")
