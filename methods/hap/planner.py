"""The HAP planner as a method: synthesis (A*) and load balancing (LP) iterated to a fixed point.

`plan` runs on the CPU and returns a bench Plan whose `program` the simulator scores and whose
`details["steps"]` per-rank codegen rebuilds the program from (docs/planner.md "Plan format").
Real execution lives in methods.hap.runtime; this module only decides. It is one class, the
planner's decision loop (levels, starting ratios, search and LP in turn, the candidates kept),
long because the loop is; each piece it calls is a module of its own (search, bounds, balance,
lowering, segments, hierarchy).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError, PlanningError
from bench.core.interfaces import Plan, Workload
from bench.core.plan_cache import load_plan, plan_key, save_plan
from bench.core.program import Program
from bench.core.shares import round_shares
from bench.cost import (
    compute_proportional_ratios,
    even_ratios,
    memory_proportional_ratios,
    simulate,
    virtual_devices,
)
from methods.common import MemoryTools, capture_batch_norm, layer_groups, no_cyclic_gc
from methods.graph import Graph, capture_priced
from methods.hap.balance import InfeasibleError, RatioLP, batch_shares
from methods.hap.hierarchy import unsplittable_share
from methods.hap.lowering import build_program
from methods.hap.pricing import CostModel
from methods.hap.search import NoProgramError, SearchResult, dead_end, synthesize
from methods.hap.segments import check_segmentation
from methods.hap.steps import comm_to_json, describe_steps, shard_units
from methods.hap.theory import data_parallel_theory, derive_theory

log = logging.getLogger(__name__)

PLAN_FORMAT_VERSION = 1  # bump when details["steps"] changes shape (docs/planner.md)

# Code whose content decides a plan: a change to any of these files invalidates cached plans.
_CODE_GLOBS = (
    "methods/graph.py",
    "methods/export.py",
    "methods/common.py",
    "methods/hap/*.py",
    "bench/core/program.py",
    "bench/cost/*.py",
)
_ROOT = Path(__file__).resolve().parents[2]


def _library_versions() -> dict[str, str]:
    """The libraries a plan also depends on: torch.export's graph and DTensor's strategies are
    torch's; a Hugging Face model's forward is transformers' (its version read from its
    installed metadata: importing it takes seconds)."""
    import torch

    out = {"torch": torch.__version__}
    try:
        out["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    return out


def _code_version() -> str:
    h = hashlib.sha256()
    for pattern in _CODE_GLOBS:
        for path in sorted(_ROOT.glob(pattern)):
            h.update(path.relative_to(_ROOT).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:12]


@dataclass
class Candidate:
    """One (program, ratios) pair the planner scored with the simulator."""

    kind: str  # "synthesis" | "data parallel" (the data-parallel incumbent, methods.hap.search.synthesize)
    program: Program
    ratios: list[list[float]]
    iter_time_s: float
    oom_devices: tuple[int, ...]  # the devices it overflows
    result: SearchResult | None = None  # the synthesized program's steps

    @property
    def oom(self) -> bool:
        return bool(self.oom_devices)

    @property
    def key(self) -> tuple[bool, float]:
        return (self.oom, self.iter_time_s)  # fitting in memory first, then speed


DEFAULT_SEGMENTS = 4  # ratio rows where method.num_segments is null (HapPlanner)
EXACT_RETRY_EXPANSIONS = 200_000  # the exact search after the beam found no program (HapPlanner._synthesize)


@dataclass
class HapPlanner:
    """Options of the planner (each part can be switched off for ablations).

    Attributes:
        name: method name in records ("hap" or "sfb").
        sfb: offer sufficient-factor-broadcasting triples for linear layers.
        lp: optimise ratios by LP, alternating with synthesis; off = compute-proportional.
        collective_choice: offer grouped broadcast / reduce besides padded collectives.
        num_segments: ratio rows: ops are cut into this many groups (see segmentation), each
            sharded by its own row; a Gather'd tensor read in another group is resharded (an
            all-to-all of what changes owner). 1 = one ratio vector. None: DEFAULT_SEGMENTS
            rows, or one per layer group where a model has fewer (segmentation "layers"); a
            number given is kept, and refused where the model has fewer layer groups.
        segmentation: how the ops are cut (methods.hap.segments): "layers" at layer-group
            borders (transformer blocks, conv stages) balancing FLOPs, "flops" at equal FLOPs
            anywhere, "metis" by METIS graph partitioning (needs pymetis).
        max_rounds: cap on synthesis + LP rounds (stops earlier at no strict improvement).
        memory_limit: the LP keeps every device within its GPU memory.
        grad_overlap: replicated parameters' gradient all-reduces overlap the rest of
            backward in buckets (as DDP does) when the program is scored.
        bucket_cap_mb: gradient bucket size (MiB) for that overlap; 0 = one per parameter.
        fuse_routing: search MoE routers in one layout family (methods.hap.theory.routing_region).
        levels: "both": on a cluster with a machine of several GPUs, synthesize over machines
            (DP inside each) and over GPUs, and keep the faster by the simulator
            (details["levels"]); "cluster": only the cluster's virtual_device.
        max_expansions: A* gives up (NoProgramError) after this many expanded states.
        beam_width: A* expands at most this many states per op (the cheapest prefixes);
            None = exact. details["search_exact"] says whether the cap ever bit.
        cache_dir: plans are cached here as JSON by a hash of (model, preset, cluster, batch,
            these options, planner code); None = no cache.
        lr, grad_clip: the optimiser of mode=real (read by methods.hap.runtime).
        interpret: mode=real interprets the plan node by node at every step instead of running
            the fx module recorded from the first step (the reference; slower).
        activation_checkpointing, grad_accumulation: the memory tools (methods.common.MemoryTools).
            Checkpointed layer groups run in the rank's program as checkpointed sub-modules
            (methods.hap.codegen), priced with their recompute. With k micro-steps the planner
            plans one micro-step (global_batch / k samples, split by the same ratios) and the
            iteration runs it k times, the replicated parameters' gradient buckets all-reduced
            in the last (bench.core.program.micro_step_stages).
        label_micro_steps: the priced programs' stages labelled per micro-step; False (a
            planner whose programs are only priced, never recorded: auto's hap stages) shares
            one micro-step's stages among the micro-steps. Not a planning option.
    """

    name: str = "hap"
    sfb: bool = True
    lp: bool = True
    collective_choice: bool = True
    num_segments: int | None = 1
    segmentation: str = "layers"
    max_rounds: int = 6
    memory_limit: bool = False
    grad_overlap: bool = True
    bucket_cap_mb: float = 25.0
    fuse_routing: bool = True
    levels: str = "both"
    max_expansions: int = 2_000_000
    beam_width: int | None = 40
    cache_dir: str | None = None
    lr: float = 5e-4  # Adam, for mode=real (methods.hap.runtime); not a planning option
    grad_clip: float = 0.0  # max global grad norm in mode=real; 0 = off
    interpret: bool = False  # mode=real: interpret every step (no recorded module); not a planning option
    activation_checkpointing: bool = False
    grad_accumulation: int = 1
    label_micro_steps: bool = True  # not a planning option: labels are not priced

    def __post_init__(self) -> None:
        self.tools = MemoryTools(self.activation_checkpointing, self.grad_accumulation)
        # (theory, cluster, granularity, ratios) -> its CostModel while a plan is made
        # (_cost_model); emptied when it is: kept in the theory, they would make a cycle
        # that only the cyclic collector frees, walking every memo of the search.
        self._costs: dict = {}
        # (program, ratios as run) -> its simulation while a plan is made (docs/planner.md, "Search")
        self._simulated: dict = {}
        if self.activation_checkpointing and self.interpret:
            raise ConfigError(
                "method.activation_checkpointing=true needs the recorded program (its checkpoints are "
                "sub-modules of it); set method.interpret=false"
            )
        if self.num_segments is not None and (not isinstance(self.num_segments, int) or self.num_segments < 1):
            raise ValueError(
                f"method.num_segments={self.num_segments!r} must be an integer >= 1 (ratio rows) or null "
                f"({DEFAULT_SEGMENTS}, fewer for a model with fewer layer groups), e.g. method.num_segments=4"
            )
        check_segmentation(self.segmentation)
        if self.max_rounds < 1:
            raise ValueError(f"method.max_rounds={self.max_rounds} must be >= 1")
        if self.bucket_cap_mb < 0:
            raise ValueError(f"method.bucket_cap_mb={self.bucket_cap_mb} must be >= 0 (MiB; 0 = per parameter)")
        if not self.lr > 0 or self.grad_clip < 0:
            raise ValueError(f"method.lr={self.lr!r} must be > 0 and method.grad_clip={self.grad_clip!r} >= 0")
        if self.beam_width is not None and self.beam_width < 1:
            raise ValueError(f"method.beam_width={self.beam_width} must be >= 1, or null for an exact search")
        if self.max_expansions < 1:
            raise ValueError(f"method.max_expansions={self.max_expansions} must be >= 1")
        if self.levels not in ("both", "cluster"):
            raise ValueError(
                f"method.levels={self.levels!r} is invalid; use 'both' (machines and GPUs, "
                "the faster kept) or 'cluster' (the cluster's virtual_device)"
            )

    @property
    def modes(self) -> tuple[str, ...]:
        """ "sim" always; "real" once methods.hap.runtime (per-rank codegen) exists."""
        return ("sim", "real") if importlib.util.find_spec("methods.hap.runtime") else ("sim",)

    @property
    def _grad_bucket_bytes(self) -> float:
        """The gradient bucket the search prices replicated parameters' syncs by: the one
        build_program buckets them in (none without overlap: one all-reduce per parameter)."""
        return self.bucket_cap_mb * 2**20 if self.grad_overlap else 0.0

    def options(self) -> dict:
        """The options that decide a plan (the cache key's)."""
        skip = ("cache_dir", "lr", "grad_clip", "interpret", "label_micro_steps")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}

    # -- planning ---------------------------------------------------------------------------
    def plan(self, workload: Workload, cluster: ClusterSpec) -> Plan:
        key_fields = None
        if self.cache_dir:
            key_fields = self._key_fields(workload, cluster)
            key = plan_key(key_fields)
            cached = load_plan(self.cache_dir, key)
            if cached is not None:
                cached.details["cache"] = {"status": "hit", "key": key, "dir": str(self.cache_dir)}
                log.info("%s: plan loaded from cache %s/%s.json", self.name, self.cache_dir, key)
                return cached
        t0 = time.perf_counter()
        with no_cyclic_gc():
            try:
                plan = self._plan(workload, cluster)
            finally:
                self._costs.clear()
                self._simulated.clear()
        plan.details["planned_in_s"] = time.perf_counter() - t0
        if key_fields is not None:
            plan.details["cache"] = {"status": "miss", "key": key, "dir": str(self.cache_dir)}
            save_plan(self.cache_dir, key, plan, key_fields)
        return plan

    def _key_fields(self, workload: Workload, cluster: ClusterSpec) -> dict:
        cfg = workload.model_cfg
        model = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg)
        return {
            "model": workload.name,
            "preset": workload.preset,
            "model_config": model,
            "cluster": cluster.name,
            "cluster_hash": cluster.fingerprint(),
            # The numbers of its device types (conf/device/*.yaml can change under a name).
            "device_types": sorted(
                {
                    (d.type.name, d.type.effective_flops, d.type.memory_gib, repr(d.type.compute))
                    for d in cluster.devices
                }
            ),
            "host_flops": cluster.host_flops,
            # Adam's per-byte part of the per-step time prices a rank's parameter shard
            "host_step": [cluster.host_step_overhead_s, cluster.host_optimizer_s_per_byte, cluster.host_param_bytes],
            "link_floor": cluster.link_floor,  # the host transport's, under emulated links
            "global_batch": workload.global_batch,
            "batch_norm": workload.batch_norm,
            "precision": workload.precision,  # bf16 prices each tensor at autocast's dtype
            "method": self.options(),
            "plan_format": PLAN_FORMAT_VERSION,
            "code": _code_version(),
            "libraries": _library_versions(),
        }

    def _plan(self, workload: Workload, cluster: ClusterSpec) -> Plan:
        t0 = time.perf_counter()
        k = self.grad_accumulation
        self.tools.check_batch(workload.global_batch)
        full_batch = workload.global_batch
        workload = dataclasses.replace(workload, global_batch=full_batch // k)  # one micro-step
        batch_norm = capture_batch_norm(workload)
        graph = capture_priced(
            workload.model_cfg, workload.global_batch, workload.precision, cluster.device, batch_norm
        )
        t_capture = time.perf_counter() - t0
        units = self.tools.units(graph)
        graph = graph.with_recompute([u.nodes for u in units])
        theory = derive_theory(graph, sfb=self.sfb, grouped=self.collective_choice, fuse_routing=self.fuse_routing)
        t_theory = time.perf_counter() - t0 - t_capture
        meta = {"method": self.name, "model": workload.name}
        bucket = self.bucket_cap_mb * 2**20
        levels = [cluster.virtual_device]
        if self.levels == "both" and cluster.num_machines < cluster.num_devices:
            levels = ["machine", "gpu"]  # a machine of several GPUs: both levels differ
        rounds: list[dict] = []
        stats = {"expanded": 0, "pruned": 0, "beam_pruned": 0, "search_s": 0.0, "lp_s": 0.0}
        best, level_rows = self._search_levels(theory, workload, cluster, levels, meta, rounds, stats, "")
        if self.collective_choice and any(r.get("grouped") for r in rounds):
            # The search picks padded or grouped per collective by its serial price; with
            # gradient syncs overlapping backward the simulator can rank whole programs
            # otherwise (VGG19, 8 GPUs per machine; docs/planner.md, "Planner").
            # The padded-only search is the planner with collective choice off; keeping the
            # better makes the option never cost time. When no round used a grouped collective
            # both searches agree.
            padded = derive_theory(graph, sfb=self.sfb, grouped=False, fuse_routing=self.fuse_routing)
            alt, alt_rows = self._search_levels(padded, workload, cluster, levels, meta, rounds, stats, "padded only, ")
            level_rows += alt_rows
            if alt is not None and (best is None or _better(alt, best)):
                best = alt
        if best is None:
            raise PlanningError(
                f"{level_rows[0]['error']}; raise the global batch (preset.batch_per_device) or plan "
                "per GPU as well (method.levels=both)"
            )
        expanded, pruned, beam_pruned = stats["expanded"], stats["pruned"], stats["beam_pruned"]
        t_search, t_lp = stats["search_s"], stats["lp_s"]
        assert best is not None and best.result is not None
        gran = best.program.granularity
        micro_shares = _rank_shares(workload.global_batch, best.ratios[0], cluster, gran)
        shares = [s * k for s in micro_shares]
        details = {
            "granularity": gran,
            "batch_norm": batch_norm,  # how the graph the steps name captured batch norm
            # GPUs of each machine the plan was made for (a machine-level plan runs only there)
            "machine_gpus": [v.num_gpus for v in virtual_devices(cluster, "machine")],
            "ratios": best.ratios,
            "predicted_iter_time_s": best.iter_time_s,
            "oom": best.oom,
            "chosen": best.kind,  # "data parallel" when the data-parallel incumbent won
            # the incumbent's theory: "batch split" (data_parallel_theory), "gathers" where no op
            # may stop the batch split (gathers=True), None where neither has a program
            "data_parallel": stats.get("data_parallel"),
            "levels": level_rows,  # the best synthesized program over machines and over GPUs
            "rounds": rounds,
            "states_expanded": expanded,
            "states_pruned": pruned,
            "search_exact": beam_pruned == 0,
            "states_beam_pruned": beam_pruned,
            "capture_time_s": t_capture,  # the model's graph (from the graph cache: a load)
            "theory_time_s": t_theory,  # its triples (DTensor's strategies, HAP's rules)
            # Ops with no triple but the replicated one (named once), and where triples came from.
            "rule_coverage": {**theory.coverage(), "origins": _origin_counts(theory)},
            "dropped_buffer_updates": list(graph.gm.meta.get("dropped_buffer_updates", [])),
            "search_time_s": t_search,
            "lp_time_s": t_lp,
            **step_fields(best.result, graph),
            "grad_sync": {"overlap": self.grad_overlap, "bucket_cap_bytes": bucket if self.grad_overlap else None},
            "memory_tools": {**self.tools.details(units), "micro_batch_shares": micro_shares},
            "options": self.options(),
        }
        log.info(
            "%s: %d rounds, chose %s, predicted %.4f s/iter",
            self.name,
            len(rounds),
            details["chosen"],
            best.iter_time_s,
        )
        return Plan(self.name, shares, details, best.program, best.ratios)

    def _search_levels(
        self,
        theory,
        workload: Workload,
        cluster: ClusterSpec,
        levels: list[str],
        meta: dict,
        rounds: list,
        stats: dict,
        prefix: str,
    ) -> tuple[Candidate | None, list[dict]]:
        """The best synthesized program over `levels` (machines, GPUs) and starts, by the
        simulator; per level its best (with the reason when its batch cannot be split)."""
        best: Candidate | None = None
        level_rows: list[dict] = []
        balanced: dict = {}  # (granularity, steps) -> the LP's candidate: starts often meet one program
        built: dict = {}  # (granularity, steps) -> its Program
        segments = self.segment_count(theory)
        for granularity in levels:
            starts = [("compute-proportional", compute_proportional_ratios(cluster, granularity, segments))]
            if self.lp:
                starts += [
                    ("even", even_ratios(len(virtual_devices(cluster, granularity)), segments)),
                    ("memory-proportional", memory_proportional_ratios(cluster, granularity, segments)),
                ]
            seen: set = set()
            level_best: Candidate | None = None
            for label, ratios in starts:
                key = _ratios_key(ratios)
                if key in seen:
                    continue  # the same start as another (e.g. a homogeneous cluster)
                seen.add(key)
                start = prefix + (label if len(levels) == 1 else f"{granularity}, {label}")
                cand = self._alternate(
                    theory, cluster, granularity, meta, start, ratios, rounds, stats, seen, balanced, built
                )
                if level_best is None or _better(cand, level_best):
                    level_best = cand
            assert level_best is not None
            row = {"granularity": granularity, "iter_time_s": level_best.iter_time_s, "oom": level_best.oom}
            if prefix:
                row["theory"] = prefix.rstrip(", ")
            unsplit = _unsplittable(workload.global_batch, level_best.ratios[0], cluster, granularity)
            if unsplit:
                row["error"] = unsplit
            level_rows.append(row)
            if not unsplit and (best is None or _better(level_best, best)):
                best = level_best
        return best, level_rows

    def segment_count(self, theory) -> int:
        """The ratio rows: num_segments, or where it is None, DEFAULT_SEGMENTS capped at the
        model's layer groups (segmentation "layers")."""
        if self.num_segments is not None:
            return self.num_segments
        if self.segmentation != "layers":
            return DEFAULT_SEGMENTS
        order = [n.name for n in theory.graph.nodes if n.name in theory.rules]
        groups = layer_groups(theory.graph, order)
        return max(1, min(DEFAULT_SEGMENTS, groups[-1] + 1 if groups else 1))

    def _alternate(
        self,
        theory,
        cluster: ClusterSpec,
        granularity: str,
        meta: dict,
        start: str,
        ratios,
        rounds: list,
        stats: dict,
        seen: set,
        balanced: dict,
        built: dict,
    ) -> Candidate:
        """Synthesis at fixed ratios, then the LP at a fixed program, until a round brings no
        strict gain (or max_rounds); the best (program, ratios) by the simulator. `seen` holds
        the ratios already searched from: reaching one ends this start (its rounds are known).
        `balanced` holds the LP's answer per program already balanced and `built` the program
        (a program is its steps: its stages and memory are symbolic in the ratios, so the LP
        would answer the same)."""
        best: Candidate | None = None
        bucket = self.bucket_cap_mb * 2**20
        for i in range(self.max_rounds):
            cost = self._cost_model(theory, cluster, granularity, ratios)
            t1 = time.perf_counter()
            dp = self._data_parallel(theory, cluster, granularity, ratios, stats)
            if dp is not None and stats["data_parallel"] == "gathers":
                # not the search's incumbent (its bound would prune the beam's prefixes
                # otherwise): a candidate beside the search's program, and its fallback
                res = self._synthesize(theory, cost, fallback=dp)
            else:
                res = self._synthesize(theory, cost, dp)
            stats["search_s"] += time.perf_counter() - t1
            _count(stats, res)
            found = [res] if dp is None or dp.steps == res.steps else [res, dp]
            cand = None
            for r in found:  # the search prices gradient syncs serially; the simulator overlaps them
                key = (granularity, tuple(r.steps))
                program = built.get(key)
                if program is None:  # its stages and memory are symbolic in the ratios: built once
                    program = built[key] = build_program(
                        r.steps, cost, meta, self.grad_overlap, bucket, self.grad_accumulation, self.label_micro_steps
                    )
                kind = "data parallel" if dp is not None and r.steps == dp.steps else "synthesis"
                c = _score(kind, program, cluster, ratios, theory.graph.batch_size, r, self._simulated)
                rounds.append(
                    {
                        "start": start,
                        "round": i,
                        "stage": kind,
                        "granularity": granularity,
                        "iter_time_s": c.iter_time_s,
                        "oom": c.oom,
                        "grouped": _uses_grouped(r),
                        "search_cost_s": self._search_cost(theory, cluster, granularity, c.ratios, r),
                    }
                )
                if cand is None or _better(c, cand):
                    cand = c
            assert cand is not None and cand.result is not None
            res = cand.result
            key = (granularity, tuple(res.steps))
            seen.add(_ratios_key(cand.ratios))  # searched from, as they run
            improved = best is None or _better(cand, best)
            if improved:
                best = cand
            if not self.lp or not improved:
                break
            if key in balanced:
                lp = balanced[key]
                rounds.append(
                    {
                        "start": start,
                        "round": i,
                        "stage": "lp (this program was balanced before)",
                        "iter_time_s": lp and lp.iter_time_s,
                        "oom": lp and lp.oom,
                    }
                )
            else:
                t1 = time.perf_counter()
                lp = balanced[key] = self._balance(cand, theory, cluster, start, i, rounds)
                stats["lp_s"] += time.perf_counter() - t1
            if lp is None or not _better(lp, best):
                break
            best = lp
            ratios = lp.ratios
            key = _ratios_key(ratios)
            if key in seen:
                break
            seen.add(key)
        assert best is not None
        return best

    def _data_parallel(
        self, theory, cluster: ClusterSpec, granularity: str, ratios, stats: dict
    ) -> SearchResult | None:
        """The cheapest data-parallel program of `theory` at these ratios, priced as the full
        search prices (the incumbent its search must beat). A model with an op that no batch
        shard can run (a sort over every token of the batch) has none: then the cheapest that
        gathers such an op's inputs and runs it replicated (data_parallel_theory, gathers=True).
        None if there is neither."""
        for gathers in (False, True):
            key = ("data_parallel", gathers)
            dp_theory = theory.search_cache.get(key)
            if dp_theory is None:
                dp_theory = data_parallel_theory(theory, gathers=gathers)
                theory.search_cache[key] = dp_theory if dead_end(dp_theory) is None else False
            if dp_theory is False:  # no program: not searched again at other ratios
                continue
            cost = self._cost_model(dp_theory, cluster, granularity, ratios)
            try:
                res = self._synthesize(dp_theory, cost)
            except NoProgramError:
                continue
            _count(stats, res)
            stats["data_parallel"] = "gathers" if gathers else "batch split"
            return res
        return None

    def _synthesize(
        self,
        theory,
        cost: CostModel,
        incumbent: SearchResult | None = None,
        fallback: SearchResult | None = None,
    ) -> SearchResult:
        """A* with the beam; where the beam kept only prefixes that no program completes (a
        model whose ops leave few ways through, e.g. a relative-position bucket that runs
        replicated), the exact search, with at most EXACT_RETRY_EXPANSIONS states (the models
        that needed it took about 5,000; one that needs more has no plan in reach). Given a
        `fallback` (the data-parallel program that gathers, _data_parallel), the beam again
        with it as the incumbent instead: at least that program, at once."""
        try:
            return synthesize(theory, cost, self.max_expansions, self.beam_width, incumbent=incumbent)
        except NoProgramError as beam:
            if fallback is not None:
                return synthesize(theory, cost, self.max_expansions, self.beam_width, incumbent=fallback)
            if self.beam_width is None:
                raise
            budget = min(self.max_expansions, EXACT_RETRY_EXPANSIONS)
            try:
                return synthesize(theory, cost, budget, None, incumbent=incumbent)
            except NoProgramError:
                raise NoProgramError(
                    f"{beam}; the exact search found none in {budget} expanded states either"
                ) from None

    def _search_cost(self, theory, cluster: ClusterSpec, granularity: str, ratios, result: SearchResult) -> float:
        """What the search charges `result`'s program at `ratios` (CostModel.program_cost): the
        price it ranks programs by, beside the simulator's (planner_check's agreement table)."""
        return self._cost_model(theory, cluster, granularity, ratios).program_cost(result.steps, result.final_comms)

    def _cost_model(self, theory, cluster: ClusterSpec, granularity: str, ratios) -> CostModel:
        """The cost model of `theory` at these ratios, one per plan: the search at a round's
        ratios and the pricing of the candidates found at them (the LP's ratios are the next
        round's) share its prices, which depend on nothing else."""
        key = (id(theory), id(cluster), granularity, tuple(tuple(float(x) for x in row) for row in ratios))
        cost = self._costs.get(key)
        if cost is None or cost.theory is not theory or cost.cluster is not cluster:
            cost = self._costs[key] = CostModel(
                theory,
                cluster,
                granularity,
                ratios,
                self.segmentation,
                self._grad_bucket_bytes,
                self.grad_overlap,
                self.grad_accumulation,
            )
        return cost

    def _balance(
        self, found: Candidate, theory, cluster: ClusterSpec, start: str, i: int, rounds: list
    ) -> Candidate | None:
        """The LP's ratios for a fixed program, the best by the simulator of: rows tied (every
        segment the same row: the LP's objective is exactly the simulator's time) and rows
        free (reshards priced from above), each with memory rows (slack where the fastest
        ratios fit: one solve answers both), or, when no ratios fit and method.memory_limit is
        off, without them (the fastest ratios, flagged OOM). None when no LP is feasible."""
        program, res, program_kind = found.program, found.result, found.kind
        batch, granularity = theory.graph.batch_size, program.granularity
        best = None
        for tied in (True, False) if program.num_segments > 1 else (False,):
            lp = RatioLP(program, cluster, tied_rows=tied)
            lp.add_memory_rows(ask_first=False)
            try:
                ratios, objective = lp.solve()
            except InfeasibleError:
                if self.memory_limit:
                    continue
                lp = RatioLP(program, cluster, tied_rows=tied)  # nothing fits: the fastest ratios
                try:
                    ratios, objective = lp.solve()
                except InfeasibleError:
                    continue
            cand = _score(program_kind, program, cluster, ratios, batch, res, self._simulated)
            over = list(cand.oom_devices) if lp.memory_limit else []
            wider = ""
            if over:  # fits as the LP split it, not in whole samples: hold those a sample more
                try:
                    lp.hold_one_sample_more(over, batch)
                    ratios, objective = lp.solve()
                    cand = _score(program_kind, program, cluster, ratios, batch, res, self._simulated)
                    wider = f", a sample wider on devices {over}"
                except InfeasibleError:
                    pass
            rows = (", rows tied" if tied else (", rows free" if program.num_segments > 1 else "")) + wider
            rounds.append(
                {
                    "start": start,
                    "round": i,
                    "stage": f"lp{' with memory rows' if lp.memory_limit else ''}{rows}",
                    "granularity": granularity,
                    "lp_objective_s": objective,
                    "iter_time_s": cand.iter_time_s,
                    "oom": cand.oom,
                    "search_cost_s": self._search_cost(theory, cluster, granularity, cand.ratios, res),
                }
            )
            if best is None or _better(cand, best):
                best = cand
        return best

    def setup(self, plan, model, ctx):
        from methods.hap.runtime import setup_trainer  # the workers' side: codegen, collectives

        return setup_trainer(self, plan, model, ctx)


def step_fields(result: SearchResult, graph: Graph) -> dict:
    """The plan-format fields per-rank codegen rebuilds a synthesized program from
    (docs/planner.md "Plan format"), with its readable summary."""
    return {
        "program": describe_steps(result.steps, graph),
        "plan_format": PLAN_FORMAT_VERSION,
        "loss": graph.loss,
        "steps": [s.to_json(graph) for s in result.steps],
        "final_comms": [comm_to_json(c) for c in result.final_comms],
        "shard_units": {str(k): v for k, v in sorted(shard_units(result.steps, graph).items())},
        "graph_fingerprint": _graph_fingerprint(graph),
    }


def _graph_fingerprint(graph: Graph) -> str | None:
    """methods.hap.codegen's check that a plan belongs to the model it is run with."""
    try:
        from methods.hap.codegen import graph_fingerprint
    except ImportError:
        return None
    return graph_fingerprint(graph)


def _origin_counts(theory) -> dict[str, int]:
    """Ops by where their triples came from (methods.hap.theory.node_rules)."""
    out: dict[str, int] = {}
    for origin in theory.origins.values():
        out[origin] = out.get(origin, 0) + 1
    return dict(sorted(out.items()))


def _count(stats: dict, res: SearchResult) -> None:
    stats["expanded"] += res.stats.expanded
    stats["beam_pruned"] += res.stats.beam_pruned
    stats["pruned"] += res.stats.pruned_bound + res.stats.pruned_dedup


def _score(
    kind: str,
    program: Program,
    cluster: ClusterSpec,
    ratios,
    batch: int,
    result: SearchResult | None = None,
    simulated: dict | None = None,
) -> Candidate:
    """A candidate priced by the simulator at its ratios as the runtime splits the batch (the
    faster of the roundings _as_run offers); `simulated` keeps each (program, ratios) pair's
    simulation for the rest of the plan (the program object is the plan's one per steps)."""
    best = None
    for rounded in _as_run(ratios, batch, program.granularity, cluster):
        key = (id(program), tuple(map(tuple, rounded)))
        sim = None if simulated is None else simulated.get(key)
        if sim is None or sim[0] is not program:
            sim = (program, simulate(program, cluster, rounded))
            if simulated is not None:
                simulated[key] = sim
        sim = sim[1]
        cand = Candidate(kind, program, rounded, sim.iter_time_s, tuple(sim.oom_devices), result)
        if best is None or _better(cand, best):
            best = cand
    assert best is not None
    return best


def _as_run(
    ratios, batch: int, granularity: str = "gpu", cluster: ClusterSpec | None = None
) -> list[list[list[float]]]:
    """The ways to round `ratios` to whole samples of the batch, as the runtime splits it
    (balance.batch_shares; tokens split in whole samples too, search.shard_units): each row per
    virtual device; for machines of several GPUs also per GPU, each GPU weighted by its
    machine's ratio over its GPU count, a machine's share the sum of its GPUs'. A machine
    splits its share evenly in whole samples (hierarchy.intra_lengths) and is as fast as its
    busiest GPU (bench.cost.price.busiest_gpu_ratios): rounded per machine, local_2x2's
    21.3 / 10.7 samples of 32 became 21 / 11, run as 11 + 10 and 6 + 5, where per GPU they
    become 11 + 11 and 5 + 5. Exact for a row that splits only the batch; a row that also
    splits d_model, heads or experts cuts each in whole units of its own
    (balance.shard_lengths), so there the price is off by up to one such unit or one sample.
    Every row is rounded alike, so rows the LP tied stay tied."""
    per_device = [[k / batch for k in batch_shares(batch, row)] for row in ratios]
    if granularity != "machine" or cluster is None:
        return [per_device]
    gpus = [v.num_gpus for v in virtual_devices(cluster, "machine")]
    if all(g == 1 for g in gpus):
        return [per_device]
    per_gpu = []
    for row in ratios:
        parts = iter(round_shares(batch, [max(r, 0.0) / g for r, g in zip(row, gpus) for _ in range(g)]))
        shares = [sum(next(parts) for _ in range(g)) for g in gpus]
        if unsplittable_share(batch, shares, gpus):
            return [per_device]
        per_gpu.append([k / batch for k in shares])
    return [per_device] if per_gpu == per_device else [per_device, per_gpu]


def _uses_grouped(res: SearchResult) -> bool:
    """Whether a synthesized program has a grouped (broadcast-based) collective."""
    return any(c.impl == "grouped" for step in res.steps for c in step.comms) or any(
        c.impl == "grouped" for c in res.final_comms
    )


def _ratios_key(ratios) -> tuple:
    return tuple(tuple(round(x, 6) for x in row) for row in ratios)


def _better(a: Candidate, b: Candidate) -> bool:
    """a strictly better than b: fits where b does not, or (same fit) faster by > 1e-9."""
    if a.oom != b.oom:
        return not a.oom
    return a.iter_time_s < b.iter_time_s * (1 - 1e-9)


def _unsplittable(global_batch: int, ratios: list[float], cluster: ClusterSpec, granularity: str) -> str | None:
    """Why a machine-level split of the batch cannot run data parallel inside the machines (a
    machine with fewer samples than GPUs, but some), or None."""
    if granularity != "machine":
        return None
    return unsplittable_share(
        global_batch, batch_shares(global_batch, ratios), [v.num_gpus for v in virtual_devices(cluster, "machine")]
    )


def _rank_shares(global_batch: int, ratios: list[float], cluster: ClusterSpec, granularity: str) -> list[int]:
    """Samples per physical rank: the first segment's split, evenly inside a machine."""
    per_vdev = batch_shares(global_batch, ratios)
    if granularity == "gpu":
        return per_vdev
    out = []
    machines = sorted({d.machine for d in cluster.devices})
    for m, share in zip(machines, per_vdev):
        ranks = [d for d in cluster.devices if d.machine == m]
        out += round_shares(share, [1.0] * len(ranks))
    return out


def SfbPlanner(**kwargs) -> HapPlanner:
    """The TAG-like baseline: synthesis with SFB rules at compute-proportional ratios, no LP."""
    return HapPlanner(**{"name": "sfb", "sfb": True, "lp": False, **kwargs})
