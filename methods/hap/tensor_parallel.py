"""Tensor-parallel programs at three choices of sharding ratios (HAP Sec. 2.4, Fig. 2).

EV shards every tensor evenly, CP in proportion to each device's FLOP/s, LP takes the load
balancer's ratios (methods.hap.balance). The program space is methods.hap.theory's
`tensor_parallel_theory`: the whole batch on every device, weight matrices sharded, padded
collectives only. EV and CP each get the program the search finds best at their ratios; LP
alternates synthesis and LP like the planner (`rounds` times), started from both EV and CP, and
keeps the fastest (EV's or CP's own point when it lands on their ratios). Gradient all-reduces
are not overlapped (grad_overlap=False), so the simulated time is exactly what the search and
the LP minimise and LP can never be slower than EV or CP.

`TensorParallel` is the Method of one ratio choice (conf/experiment/cp_vs_ev.yaml names it, not
conf/method/, so that it is no compared method): it plans here and trains with methods.hap.runtime's
trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.interfaces import Plan, Workload
from bench.core.program import Program
from bench.cost import (
    SimResult,
    compute_proportional_ratios,
    even_ratios,
    simulate,
    virtual_devices,
)
from methods.graph import Graph, capture_priced
from methods.hap.balance import balance_ratios, batch_shares
from methods.hap.lowering import build_program
from methods.hap.planner import step_fields
from methods.hap.pricing import CostModel
from methods.hap.search import SearchResult, synthesize
from methods.hap.theory import Theory, derive_theory, tensor_parallel_theory

CHOICES = ("EV", "CP", "LP")


@dataclass
class RatioPoint:
    """One ratio choice: its ratios, the program synthesized for them and its simulation."""

    choice: str
    ratios: list[list[float]]
    result: SearchResult
    program: Program
    sim: SimResult


def tp_theory(graph: Graph) -> Theory:
    """The tensor-parallel program space of `graph`: no SFB, padded collectives only."""
    return tensor_parallel_theory(derive_theory(graph, sfb=False, grouped=False))


def synthesize_at(
    theory: Theory, cluster: ClusterSpec, ratios, choice: str, beam_width: int | None = 100
) -> RatioPoint:
    """The best program of `theory` at fixed `ratios`, simulated at them."""
    granularity = cluster.virtual_device
    cost = CostModel(theory, cluster, granularity, ratios)
    result = synthesize(theory, cost, beam_width=beam_width)
    program = build_program(result.steps, cost, {"method": f"tp-{choice}"}, grad_overlap=False)
    return RatioPoint(choice, [list(r) for r in ratios], result, program, simulate(program, cluster, ratios))


def start_ratios(cluster: ClusterSpec) -> dict[str, list[list[float]]]:
    """The fixed ratio choices: EV (even) and CP (compute-proportional), one segment."""
    n = len(virtual_devices(cluster, cluster.virtual_device))
    return {"EV": even_ratios(n), "CP": compute_proportional_ratios(cluster, cluster.virtual_device)}


def ratio_points(
    graph: Graph, cluster: ClusterSpec, rounds: int = 2, beam_width: int | None = 100
) -> dict[str, RatioPoint]:
    """EV, CP and LP points of `graph` on `cluster` (see the module docstring)."""
    theory = tp_theory(graph)
    points = {c: synthesize_at(theory, cluster, r, c, beam_width) for c, r in start_ratios(cluster).items()}
    best: RatioPoint | None = None
    for start in points.values():
        point = start
        for _ in range(rounds):
            ratios, _ = balance_ratios(point.program, cluster)
            balanced = RatioPoint("LP", ratios, point.result, point.program, simulate(point.program, cluster, ratios))
            if best is None or _faster(balanced, best):
                best = balanced
            point = synthesize_at(theory, cluster, ratios, "LP", beam_width)  # the program for these ratios
            if _faster(point, best):
                best = point
    for p in list(points.values()):
        # The LP landed on EV's or CP's ratios: their program, not an equally fast twin (the
        # search breaks ties between equal-cost programs by float noise in the ratios).
        if _close(p.ratios, best.ratios) and not _faster(best, p):
            best = RatioPoint("LP", p.ratios, p.result, p.program, p.sim)
    points["LP"] = best
    return points


def _close(a, b, tol: float = 1e-6) -> bool:
    return all(abs(x - y) <= tol for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _faster(a: RatioPoint, b: RatioPoint) -> bool:
    if a.sim.oom != b.sim.oom:
        return not a.sim.oom
    return a.sim.iter_time_s < b.sim.iter_time_s * (1 - 1e-9)


def same_plan(a: RatioPoint, b: RatioPoint, tol: float = 1e-6) -> bool:
    """The same program at the same ratios (up to the LP solver's tolerance)."""
    return (
        _close(a.ratios, b.ratios, tol)
        and a.result.steps == b.result.steps
        and a.result.final_comms == b.result.final_comms
    )


def check_gpu_level(cluster: ClusterSpec) -> None:
    """Tensor-parallel plans shard over GPUs; a machine-level cluster is refused in one line."""
    if cluster.virtual_device != "gpu":
        raise ConfigError(
            f"cluster.virtual_device={cluster.virtual_device} (cluster={cluster.name}): tensor-parallel "
            "programs are planned over GPUs only; use cluster.virtual_device=gpu"
        )


def to_plan(
    point: RatioPoint, graph: Graph, workload: Workload, cluster: ClusterSpec, method: str = "tensor_parallel"
) -> Plan:
    """The Plan methods.hap.runtime's trainer runs: the point's steps at its ratios, in the
    planner's plan format (docs/planner.md), for GPU-level virtual devices."""
    check_gpu_level(cluster)
    details = {
        "granularity": "gpu",
        "ratios": point.ratios,
        "predicted_iter_time_s": point.sim.iter_time_s,
        "oom": point.sim.oom,
        "chosen": f"tensor parallel, {point.choice} ratios",
        **step_fields(point.result, graph),
        "grad_sync": {"overlap": False, "bucket_cap_bytes": None},
    }
    shares = batch_shares(workload.global_batch, point.ratios[0])
    return Plan(method, shares, details, point.program, point.ratios)


def workload_points(workload: Workload, cluster: ClusterSpec, rounds: int = 2) -> tuple[Graph, dict[str, RatioPoint]]:
    """ratio_points of a workload's graph at its global batch."""
    graph = capture_priced(workload.model_cfg, workload.global_batch, workload.precision, cluster.device)
    return graph, ratio_points(graph, cluster, rounds)


@dataclass
class TensorParallel:
    """A Method: the tensor-parallel program at one choice of ratios (see the module docstring).

    Args:
        name: the method's name in records.
        ratios: "EV", "CP" or "LP". EV and CP plan one synthesis at their ratios; LP plans both
            and alternates synthesis and LP from each (ratio_points), so its plan is EV's or
            CP's own where the LP lands on their ratios.
        rounds: LP only: rounds of LP and synthesis from each start.
        beam_width: A* expands at most this many states per op; None = exact.
        lr, grad_clip, interpret: mode=real, as methods.hap.runtime reads them from HapPlanner.
    """

    name: str = "tensor_parallel"
    ratios: str = "EV"
    rounds: int = 2
    beam_width: int | None = 100
    lr: float = 5e-4  # Adam, as in the HAP paper
    grad_clip: float = 0.0
    interpret: bool = False
    modes: ClassVar[tuple[str, ...]] = ("sim", "real")

    def __post_init__(self) -> None:
        if self.ratios not in CHOICES:
            raise ValueError(f"method.ratios={self.ratios!r} is invalid; valid: {', '.join(CHOICES)}")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"method.rounds={self.rounds!r} must be an integer >= 1")
        if self.beam_width is not None and self.beam_width < 1:
            raise ValueError(f"method.beam_width={self.beam_width} must be >= 1, or null for an exact search")
        if not self.lr > 0 or self.grad_clip < 0:
            raise ValueError(f"method.lr={self.lr!r} must be > 0 and method.grad_clip={self.grad_clip!r} >= 0")

    def point(self, graph: Graph, cluster: ClusterSpec) -> RatioPoint:
        """This choice's point of `graph` on `cluster`."""
        if self.ratios == "LP":
            return ratio_points(graph, cluster, self.rounds, self.beam_width)["LP"]
        ratios = start_ratios(cluster)[self.ratios]
        return synthesize_at(tp_theory(graph), cluster, ratios, self.ratios, self.beam_width)

    def plan(self, workload: Workload, cluster: ClusterSpec) -> Plan:
        check_gpu_level(cluster)
        graph = capture_priced(workload.model_cfg, workload.global_batch, workload.precision, cluster.device)
        return to_plan(self.point(graph, cluster), graph, workload, cluster, self.name)

    def setup(self, plan, model, ctx):
        from methods.hap.runtime import setup_trainer  # the workers' side: codegen, collectives

        return setup_trainer(self, plan, model, ctx)
