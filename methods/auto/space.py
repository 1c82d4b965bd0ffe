"""The space auto searches: candidates of (stages, state, memory tools), and the part that runs each.

A candidate names a composition of the other methods' parts: one stage over the whole cluster
with replicated state (hap's synthesis: sharding, LP ratios, collective choice, SFB), one stage
with sharded state (FSDP2's data parallel, its batch split by compute or evenly), one stage with
DeepSpeed's ZeRO-1 or ZeRO-2 state (the DeepSpeed engine: optimizer state, then gradients too,
sharded over the devices, parameters replicated, the batch split evenly), or pipelines of
several stages (the pipeline's planner at that many ranks a pipeline: cuts, slots, schedule,
micro-batches, priced shares), each with the memory tools that part offers, or pipelines whose
stages each run hap's synthesis over one machine (methods.auto.stage_plan). `make_part` builds
the configured component method of a candidate, so that the search prices it by that method's
own plan and the simulator. This module does not search (methods.auto.search).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from methods.auto.stage_plan import HapStages
from methods.pipeline.planning import layouts

STATES = ("replicated", "sharded", "zero1", "zero2")
ZERO_STATES = {"zero1": 1, "zero2": 2}  # a single stage's DeepSpeed state: its ZeRO stage
PIPELINE_STATES = ("replicated", "sharded")
SPLITS = ("compute", "even")  # a sharded stage's batch split: fsdp_cp's, fsdp's


@dataclass(frozen=True)
class Candidate:
    """One point of the space.

    Attributes:
        stages: ranks a pipeline; 1 = one stage over the whole cluster (no pipeline).
        state: "replicated" (every data-parallel device keeps whole parameters, gradients and
            Adam's moments), "sharded" (FSDP2's shards over the data-parallel devices), or for
            one stage "zero1" / "zero2" (DeepSpeed's ZeRO-1: Adam's state sharded; ZeRO-2:
            gradients too; parameters replicated).
        split: a sharded single stage's batch split, "compute" or "even"; "" elsewhere.
        checkpointing: activation checkpointing per layer group.
        grad_accumulation: micro-steps per iteration (1 for pipelines: their micro-batches are
            the schedule's).
        synthesis: pipelines only: each stage runs hap's synthesis over its group (one
            machine) instead of data parallelism over its replicas (methods.auto.stage_plan).
    """

    stages: int
    state: str
    split: str = ""
    checkpointing: bool = False
    grad_accumulation: int = 1
    synthesis: bool = False

    @property
    def part(self) -> str:
        """The component that plans and runs it: hap, fsdp, deepspeed, pipeline or hap_stages."""
        if self.stages > 1:
            return "hap_stages" if self.synthesis else "pipeline"
        if self.state in ZERO_STATES:
            return "deepspeed"
        return "hap" if self.state == "replicated" else "fsdp"

    @property
    def composition(self) -> tuple:
        """The candidate without its memory tools."""
        return (self.stages, self.state, self.split, self.synthesis)

    def lighter_than(self, other: Candidate) -> bool:
        """Whether `self` is `other`'s composition with a subset of its memory tools."""
        return (
            self != other
            and self.composition == other.composition
            and self.checkpointing <= other.checkpointing
            and self.grad_accumulation <= other.grad_accumulation
            and other.grad_accumulation % self.grad_accumulation == 0
        )

    def describe(self) -> str:
        what = {
            "hap": "1 stage, hap's synthesis (replicated state)",
            "fsdp": f"1 stage, FSDP2 sharded state ({self.split} split)",
            "deepspeed": f"1 stage, DeepSpeed ZeRO-{ZERO_STATES.get(self.state)} (even split)",
            "pipeline": f"{self.stages}-stage pipelines ({self.state} state)",
            "hap_stages": f"{self.stages}-stage pipelines, hap's synthesis inside each stage (one machine a stage)",
        }[self.part]
        tools = [t for t, on in (("checkpointing", self.checkpointing),) if on]
        if self.grad_accumulation > 1:
            tools.append(f"grad_accumulation={self.grad_accumulation}")
        return what + (f" + {', '.join(tools)}" if tools else "")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict) -> Candidate:
        return Candidate(**d)


def stage_counts(cluster: ClusterSpec, stage_level: str, num_groups: int) -> list[int]:
    """Ranks a pipeline the pipeline's planner can cut the cluster into at `stage_level` (2 or
    more, up to the layer groups), ascending."""
    try:
        found, _ = layouts(cluster, stage_level, "auto", num_groups)
    except ConfigError:  # machines of unlike sizes at stage_level=machine
        return []
    return sorted({lay.num_stages for lay in found if lay.num_stages > 1})


def accumulation_steps(global_batch: int, num_devices: int, most: int) -> list[int]:
    """Micro-steps that cut the global batch into whole micro-batches of at least one sample a
    device: the divisors k of the batch with k <= most and batch / k >= devices."""
    return [k for k in range(1, most + 1) if global_batch % k == 0 and global_batch // k >= num_devices]


def candidates(
    stages,
    state: str,
    checkpointing,
    grad_accumulation,
    pipeline_stages: list[int],
    accumulation: list[int],
    synthesis_stages: Sequence[int] = (),
    synthesis="auto",
) -> list[Candidate]:
    """Every candidate the options admit, compositions without tools first, then each with more
    tools (the order the search prices equal bounds in).

    Args:
        stages: "auto", 1 or a pipeline's ranks (the option method.stages).
        state: "auto", "replicated", "sharded", "zero1" or "zero2".
        checkpointing: "auto", True or False.
        grad_accumulation: "auto" or an integer (the micro-steps of single stages).
        pipeline_stages: the stage counts the cluster offers (stage_counts).
        accumulation: the micro-steps to try under "auto" (accumulation_steps).
        synthesis_stages: the stage counts of pipelines of hap stages the cluster offers
            (methods.auto.stage_plan.machine_groups: one stage a machine).
        synthesis: "auto", True (only pipelines of hap stages) or False (none): the option
            method.stage_synthesis.
    """
    states = STATES if state == "auto" else (state,)
    ckpt = (False, True) if checkpointing == "auto" else (bool(checkpointing),)
    ks = accumulation if grad_accumulation == "auto" else [grad_accumulation]
    # hap's synthesis in every stage: replicated state only, no memory tool (its runtime has none)
    family: list[Candidate] = []
    if synthesis is not False and "replicated" in states and checkpointing is not True:
        family = [Candidate(n, "replicated", synthesis=True) for n in synthesis_stages if stages in ("auto", n)]
    if synthesis is True:
        return family
    comps: list[Candidate] = []
    if stages in ("auto", 1):
        if "replicated" in states:
            comps.append(Candidate(1, "replicated"))
        if "sharded" in states:
            comps += [Candidate(1, "sharded", s) for s in SPLITS]
        comps += [Candidate(1, st) for st in ZERO_STATES if st in states]
    counts = pipeline_stages if stages == "auto" else [s for s in pipeline_stages if s == stages]
    for n in counts:
        for st in states:
            if st in PIPELINE_STATES:
                comps.append(Candidate(n, st))
    comps += family
    out = []
    for comp in comps:
        for c in ckpt:
            for k in ks:
                if comp.part in ("pipeline", "hap_stages") and k != 1:
                    continue  # a pipeline's micro-batches are its schedule's
                if comp.synthesis and c:
                    continue
                out.append(dataclasses.replace(comp, checkpointing=c, grad_accumulation=k))
    return sorted(out, key=lambda x: (x.checkpointing + (x.grad_accumulation > 1), x.grad_accumulation))


def _rebuild(template, name: str, **changes):
    """A new instance of `template`'s class with its constructor's arguments read from the
    template's same-named attributes, `changes` over them (so the class validates them)."""
    cls = type(template)
    if dataclasses.is_dataclass(template):
        return dataclasses.replace(template, name=name, **changes)
    params = inspect.signature(cls.__init__).parameters
    kwargs = {p: getattr(template, p) for p in params if p != "self" and hasattr(template, p)}
    kwargs.update(name=name, **changes)
    return cls(**kwargs)


def make_part(auto, cand: Candidate, gpus_only: bool = False):
    """The component method that plans and runs `cand`, configured as auto's templates
    (`auto.hap`, `auto.fsdp`, `auto.deepspeed`, `auto.pipeline`: conf/method/auto.yaml composes
    their own files), auto's optimizer and the candidate's options over them. `gpus_only`: hap
    plans the cluster's level only (`levels=cluster`), for a cluster whose virtual device is the
    GPU (methods.auto.floors.hap_gpus_only)."""
    common = {"lr": auto.lr, "grad_clip": auto.grad_clip, "activation_checkpointing": cand.checkpointing}
    if cand.part == "hap":
        levels = {"levels": "cluster"} if gpus_only else {}
        return _rebuild(auto.hap, "hap", grad_accumulation=cand.grad_accumulation, **levels, **common)
    if cand.part == "fsdp":
        name = "fsdp_cp" if cand.split == "compute" else "fsdp"
        return _rebuild(auto.fsdp, name, split=cand.split, grad_accumulation=cand.grad_accumulation, **common)
    if cand.part == "deepspeed":
        zero = ZERO_STATES[cand.state]
        return _rebuild(
            auto.deepspeed, "deepspeed", zero_stage=zero, grad_accumulation=cand.grad_accumulation, **common
        )
    if cand.part == "hap_stages":
        return HapStages(auto.hap, auto.pipeline, cand.stages, lr=auto.lr, grad_clip=auto.grad_clip)
    sharded = cand.state == "sharded"  # the pipeline's sharded state: FSDP2 over each stage's replicas
    return _rebuild(
        auto.pipeline, "pipeline", num_stages=cand.stages, stage_level=auto.stage_level, sharded_state=sharded, **common
    )
