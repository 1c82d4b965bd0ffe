"""auto: one planner over the space the other methods cover apart; docs/methods.md, "Whole-space planner (auto)".

A candidate is a composition of the other methods' parts: how many stages (one over the whole
cluster, or pipelines of several), how the state of a stage's data-parallel devices is held
(replicated, sharded as FSDP2 shards it, or as DeepSpeed's ZeRO-1 and ZeRO-2 shard it) and which
memory tools run (activation checkpointing, gradient accumulation). One stage with replicated
state is hap's synthesis (sharding, LP ratios, collective choice, SFB); one stage with sharded
state is FSDP2's data parallel; one stage with ZeRO-1 or ZeRO-2 state is the DeepSpeed engine
(optimizer state, then gradients too, sharded; parameters replicated); several stages are the
pipeline's planner. Each candidate is planned by its part and priced by the one simulator, and
the search returns the fastest that fits. The plan records the composition it chose
(`details["auto"]`), and at run time each rank runs that part's runtime (hap's, FSDP2's,
DeepSpeed's engine, the pipeline trainer, hap stages' trainer) with the chosen options.
Pipelines whose stages run hap's synthesis over their group (one machine a stage, rank-aligned
pipelines: methods.auto.stage_plan) are a family of their own (`stage_synthesis`). Not in the
space: hap's synthesis over a stage of several machines, sharded state inside hap's programs,
ZeRO state inside a pipeline stage, memory tools inside hap stages.

This method composes the others, so it imports them; none of them imports it.

    space   the candidates (stages, state, memory tools) and the part that plans and runs each
    search  the best-first loop: price each candidate once by its part, bound, prune, memory
"""

from __future__ import annotations

import time

from torch import nn

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.interfaces import Plan, RankContext, Workload
from methods.auto.search import NoPlanFits, search, with_memory
from methods.auto.space import (
    STATES,
    ZERO_STATES,
    Candidate,
    accumulation_steps,
    candidates,
    make_part,
    stage_counts,
)
from methods.auto.stage_plan import machine_groups
from methods.common import check_training_options, group_table, no_cyclic_gc
from methods.graph import capture_config

__all__ = ["Auto", "Candidate", "NoPlanFits"]

STAGE_LEVELS = ("auto", "device", "machine")
# What the chosen part's plan says of its own planning (hap's: its capture, theory, search, LP,
# plan cache), kept under details["auto"]["part_planning"].
PART_TIMINGS = ("capture_time_s", "theory_time_s", "search_time_s", "lp_time_s", "planned_in_s", "cache")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Auto:
    """The whole-space planner (module docstring).

    Args:
        hap, pipeline, fsdp, deepspeed: the parts, configured as their own methods
            (conf/method/auto.yaml composes conf/method/hap.yaml, pipeline.yaml, fsdp_cp.yaml
            and deepspeed.yaml); each candidate takes its part's options with its own over them.
        name: the method's name in records.
        stages: "auto", 1 (one stage over the whole cluster) or the ranks of a pipeline (2 or
            more: pipelines only).
        stage_level: what a pipeline rank's slot is cut from: "device", "machine" or "auto".
        state: "auto", "replicated", "sharded" (FSDP2), "zero1" or "zero2" (DeepSpeed's
            ZeRO-1 / ZeRO-2, one stage only): a stage's data-parallel state.
        activation_checkpointing: "auto" (searched), true or false.
        grad_accumulation: "auto" (searched, single stages) or the micro-steps of every single
            stage; pipelines are left out when it is forced above 1.
        max_grad_accumulation: the most micro-steps "auto" tries (divisors of the batch that
            leave a sample per device).
        memory_budget_gib: each device's memory for the plan is at most this (GiB); null: the
            devices' own.
        prune: stop at the bound (methods.auto.search); false prices every candidate.
        stage_synthesis: "auto" (pipelines of hap stages priced where the cluster is machines
            of 2 or more GPUs alike in number), true (only those) or false (none).
        lr, grad_clip: Adam's learning rate and the max global gradient norm (0 = off), for
            every part.
    """

    mirror_full_state = False  # tests: the part writes the full parameters and gradients into the model
    # DeepSpeed itself is left to the workers of a plan that runs it (its import costs every
    # server seconds: methods.ds_zero's worker_modules).
    worker_modules = (
        "methods.hap.runtime",
        "methods.fsdp",
        "methods.pipeline",
        "methods.auto.hap_stages_runtime",
        "methods.ds_zero",
        "torch.distributed.pipelining",
    )

    def __init__(
        self,
        hap,
        pipeline,
        fsdp,
        deepspeed,
        name: str = "auto",
        stages="auto",
        stage_level: str = "auto",
        state: str = "auto",
        activation_checkpointing="auto",
        grad_accumulation="auto",
        max_grad_accumulation: int = 8,
        memory_budget_gib: float | None = None,
        prune: bool = True,
        lr: float = 5e-4,
        grad_clip: float = 0.0,
        stage_synthesis="auto",
    ):
        if stages != "auto" and (not _whole(stages) or stages < 1):
            raise ConfigError(
                f"method.stages={stages!r} is invalid; use auto, 1 (one stage over the cluster) or the ranks "
                "of a pipeline, e.g. method.stages=2"
            )
        if stage_level not in STAGE_LEVELS:
            raise ConfigError(
                f"method.stage_level={stage_level!r} names no stage level; use one of {', '.join(STAGE_LEVELS)}"
            )
        if state not in ("auto", *STATES):
            raise ConfigError(f"method.state={state!r} is unknown; use one of auto, {', '.join(STATES)}")
        if state in ZERO_STATES and _whole(stages) and stages > 1:
            raise ConfigError(
                f"method.state={state} is one stage's (DeepSpeed's ZeRO over the whole cluster), but "
                f"method.stages={stages} runs pipelines; use method.stages=1 or auto, or method.state=sharded"
            )
        if activation_checkpointing != "auto" and not isinstance(activation_checkpointing, bool):
            raise ConfigError(
                f"method.activation_checkpointing={activation_checkpointing!r} is invalid; use auto, true or false"
            )
        if grad_accumulation != "auto" and (not _whole(grad_accumulation) or grad_accumulation < 1):
            raise ConfigError(
                f"method.grad_accumulation={grad_accumulation!r} is invalid; use auto or an integer >= 1, "
                "e.g. method.grad_accumulation=2"
            )
        if not _whole(max_grad_accumulation) or max_grad_accumulation < 1:
            raise ConfigError(f"method.max_grad_accumulation={max_grad_accumulation!r} must be an integer >= 1")
        if _whole(stages) and stages > 1 and grad_accumulation not in ("auto", 1):
            raise ConfigError(
                f"method.grad_accumulation={grad_accumulation} applies to one stage, but method.stages={stages} "
                "runs pipelines (their micro-batches are the schedule's); use method.grad_accumulation=auto or "
                "method.stages=1"
            )
        if memory_budget_gib is not None and (isinstance(memory_budget_gib, bool) or not memory_budget_gib > 0):
            raise ConfigError(
                f"method.memory_budget_gib={memory_budget_gib!r} must be a number of GiB > 0, or null (the "
                "devices' own memory)"
            )
        if not (stage_synthesis == "auto" or isinstance(stage_synthesis, bool)):
            raise ConfigError(f"method.stage_synthesis={stage_synthesis!r} is invalid; use auto, true or false")
        if stage_synthesis is True:
            against = [
                (f"method.stages={stages}", stages == 1),
                (f"method.state={state}", state not in ("auto", "replicated")),
                ("method.activation_checkpointing=true", activation_checkpointing is True),
                (f"method.grad_accumulation={grad_accumulation}", grad_accumulation not in ("auto", 1)),
            ]
            for what, clash in against:
                if clash:
                    raise ConfigError(
                        f"method.stage_synthesis=true plans pipelines of hap stages (replicated state, no memory "
                        f"tools), which {what} rules out; use method.stage_synthesis=auto or drop {what}"
                    )
        check_training_options(lr, grad_clip)
        self.hap, self.pipeline, self.fsdp, self.deepspeed = hap, pipeline, fsdp, deepspeed
        self.name = name
        self.modes = ("real", "sim")
        self.stages = stages
        self.stage_level = stage_level
        self.state = state
        self.activation_checkpointing = activation_checkpointing
        self.grad_accumulation = grad_accumulation
        self.max_grad_accumulation = max_grad_accumulation
        self.memory_budget_gib = None if memory_budget_gib is None else float(memory_budget_gib)
        self.prune = bool(prune)
        self.lr = lr
        self.grad_clip = grad_clip
        self.stage_synthesis = stage_synthesis

    def space(self, workload: Workload, cluster: ClusterSpec) -> list[Candidate]:
        """The candidates these options admit on `cluster` (one line where none can exist)."""
        table = group_table(capture_config(workload.model_cfg, workload.global_batch))
        groups = table.num_groups
        if _whole(self.stages) and self.stages > groups:
            raise ConfigError(
                f"method.stages={self.stages} is more than the {groups} layer groups {workload.name} can be cut "
                f"at; use method.stages<={groups} or method.stages=auto"
            )
        offered = stage_counts(cluster, self.stage_level, groups)
        if _whole(self.stages) and self.stages > 1 and self.stages not in offered:
            raise ConfigError(
                f"method.stages={self.stages} is no pipeline cluster={cluster.name} can be cut into at "
                f"method.stage_level={self.stage_level} (ranks a pipeline: "
                f"{', '.join(map(str, offered)) or 'none'}); use one of those, 1, or auto"
            )
        accumulation = accumulation_steps(workload.global_batch, cluster.num_devices, self.max_grad_accumulation)
        synthesis: list[int] = []
        if self.stage_synthesis is not False:
            machines, why = machine_groups(cluster)
            if machines and len(machines) > groups:
                machines, why = (
                    [],
                    f"{len(machines)} machines are more stages than {workload.name}'s {groups} layer groups",
                )
            if machines:
                synthesis = [len(machines)]
            elif self.stage_synthesis is True:
                raise ConfigError(
                    f"method.stage_synthesis=true needs one stage per machine of 2 or more GPUs, but {why}; use "
                    "method.stage_synthesis=auto or false"
                )
        found = candidates(
            self.stages,
            self.state,
            self.activation_checkpointing,
            self.grad_accumulation,
            offered,
            accumulation,
            synthesis,
            self.stage_synthesis,
        )
        if not found:
            raise ConfigError(
                f"method.stages={self.stages}, method.state={self.state} leave auto nothing to plan on "
                f"cluster={cluster.name}; use method.stages=auto"
            )
        return found

    def plan(self, workload: Workload, cluster: ClusterSpec) -> Plan:
        t0 = time.perf_counter()
        with no_cyclic_gc():  # the capture and every candidate's plan (the parts' memos live until it ends)
            capture_config(workload.model_cfg, workload.global_batch)  # the graph every part reads
            captured = time.perf_counter() - t0
            cands = self.space(workload, cluster)
            found = search(self, cands, workload, with_memory(cluster, self.memory_budget_gib))
        plan = found.best.plan
        assert plan is not None
        finish = getattr(found.best.part, "finish", None)  # a part that completes the plan it keeps
        if finish is not None:
            plan = finish(plan, cluster)
        plan.method = self.name
        planned_in = time.perf_counter() - t0
        # The planning times at the top are this plan's, auto's: its capture, then its search
        # (every candidate's planning and pricing). The chosen part's own are kept beside it.
        part = {k: plan.details[k] for k in PART_TIMINGS if k in plan.details}
        plan.details = {
            **{k: v for k, v in plan.details.items() if k not in PART_TIMINGS},
            "capture_time_s": captured,
            "search_time_s": planned_in - captured,
            "auto": {
                **found.details(),
                "memory_budget_gib": self.memory_budget_gib,
                "planned_in_s": planned_in,
                "part_planning": part,
            },
        }
        return plan

    def part_of(self, plan: Plan):
        """The component method that made `plan` and runs it."""
        return make_part(self, Candidate.from_json(plan.details["auto"]["chosen"]))

    def setup(self, plan: Plan, model: nn.Module, ctx: RankContext):
        part = self.part_of(plan)
        part.mirror_full_state = self.mirror_full_state
        return part.setup(plan, model, ctx)
