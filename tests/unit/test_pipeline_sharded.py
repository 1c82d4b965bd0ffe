"""The pipeline's sharded state (method.sharded_state, methods/pipeline/ and
bench/cost/pipeline.py): what a rank holds, the collectives the schedule's replay prices, the
planner's memory check against the simulator's, the plans it makes, and bad input."""

from __future__ import annotations

import dataclasses

import pytest

from bench.core.errors import ConfigError
from bench.cost import simulate
from bench.cost.pipeline import (
    COMPUTE,
    StageBytes,
    in_flight,
    rank_memory,
    shard_collective_s,
    stage_peak,
    stage_peak_bytes,
)
from bench.records.rows import load_records
from bench.runner.execute import run_case
from methods.pipeline import PipelineParallel, trace_schedule
from tests.unit.test_pipeline_plan import _paper_cluster, _workload, assert_planner_peaks_are_simulated

PARTS = StageBytes(800.0, 80.0, kept_bytes=300.0, backward_bytes=500.0, received_bytes=3.0, sent_bytes=2.0)


@pytest.mark.parametrize("shards", [2, 4, 8])
@pytest.mark.parametrize("foreach", [False, True])
def test_a_sharded_rank_holds_what_the_planners_arithmetic_says(shards, foreach):
    for schedule, micro in (("1f1b", 4), ("gpipe", 4)):
        actions = trace_schedule(schedule, 3, micro, 1).actions
        memory = rank_memory(actions, {1: PARTS}, micro, bucket_bytes=0.0, shards=shards)
        expected = stage_peak_bytes(
            param_bytes=PARTS.param_bytes,
            largest_param_bytes=PARTS.largest_param_bytes,
            kept_bytes=PARTS.kept_bytes,
            backward_bytes=PARTS.backward_bytes,
            received_bytes=PARTS.received_bytes,
            sent_bytes=PARTS.sent_bytes,
            in_flight=in_flight(actions),
            num_micro_batches=micro,
            bucket_bytes=0.0,
            foreach=foreach,
            shards=shards,
        )
        assert stage_peak(memory, foreach=foreach) == pytest.approx(expected)


def test_sharded_state_holds_a_share_of_the_state_beside_the_gathered_stage():
    """1F1B's middle rank of three holds two micro-batches' activations (800 bytes) at its
    peak; replicated it adds four copies of its parameters (P: weights, gradients, two moments);
    sharded over r, 3P/r (its shard, two moments' shards) and the gathered parameters and their
    unsharded gradients (2P): smaller by 2P - 3P/r. The replicas' bucket copy comes after the
    schedule, beside the gradients alone: it sets the replicated peak only where it outweighs
    the activations."""
    actions = trace_schedule("1f1b", 3, 4, 1).actions
    P, bucket, r = PARTS.param_bytes, 5.0, 4
    replicated = stage_peak(rank_memory(actions, {1: PARTS}, 4, bucket), foreach=False)
    sharded = stage_peak(rank_memory(actions, {1: PARTS}, 4, bucket, shards=r), foreach=False)
    assert replicated - sharded == pytest.approx(2 * P - 3 * P / r)
    big = 2000.0  # a bucket larger than the 800 bytes of activations
    assert stage_peak(rank_memory(actions, {1: PARTS}, 4, big), foreach=False) == pytest.approx(replicated - 800 + big)
    memory = rank_memory(actions, {1: PARTS}, 4, bucket, shards=r)
    assert memory.params.const == memory.grads.const == P / r and memory.optimizer.const == 2 * P / r
    assert memory.buckets.const == 4 * (PARTS.received_bytes + PARTS.sent_bytes)  # no all-reduce bucket


def _machine_plans(**method):
    """Paper BERT on paper_hetero with 2 GPUs a machine, stages of 2 machines: 4 pipelines."""
    cluster = _paper_cluster(**{"cluster.gpus_per_machine": 2})
    workload = _workload("bert", 16 * 64, "preset=paper")
    plans = {
        sharded: PipelineParallel(
            stage_level="machine", num_stages=4, schedule="1f1b", num_micro_batches=16, sharded_state=sharded, **method
        ).plan(workload, cluster)
        for sharded in (False, True)
    }
    return plans, cluster


def test_a_sharded_plan_gathers_before_the_schedule_and_scatters_after_it():
    plans, cluster = _machine_plans()
    program = plans[True].program
    assert plans[True].details["sharded_state"] is True and program.sharded_state
    assert plans[False].details["stages"] == plans[True].details["stages"]
    assert program.num_pipelines == 4 and not any(program.grad_buckets)
    for r, actions in enumerate(program.actions):
        assert actions[0] == ("gather", r) and actions[-1] == ("scatter", r)
        assert [a for a in actions if a[0] in COMPUTE] == [
            a for a in plans[False].program.actions[r] if a[0] in COMPUTE
        ]
    sim = simulate(program, cluster, None)
    plain = simulate(plans[False].program, cluster, None)
    for rank in range(cluster.num_devices):  # a quarter of the state (FSDP2's padding aside)
        for part in ("params", "grads", "optimizer"):
            quarter = plain.memory_gib[rank][part] / 4
            assert quarter <= sim.memory_gib[rank][part] <= 1.01 * quarter
        # held for the step: the receive buffers alone (the replicas' bucket copy comes after the schedule)
        assert sim.memory_gib[rank]["buckets"] == pytest.approx(plain.memory_gib[rank]["buckets"])


def test_the_sharded_iteration_pays_its_collectives_where_the_schedule_runs_them():
    """The same program with stages of no parameters runs no collective bytes (and no Adam):
    the first stage's gather comes before every forward and its scatter after its last
    backward, both on the critical path."""
    plans, cluster = _machine_plans()
    program = plans[True].program
    empty = dataclasses.replace(
        program, stages=tuple(dataclasses.replace(st, param_bytes=0.0, shard_bytes=0.0) for st in program.stages)
    )
    first = program.stages[0]
    collectives = sum(  # their bytes' time (the empty program's pay the latency alone)
        shard_collective_s(kind, 4 * first.shard_bytes, first.ranks, cluster)
        - shard_collective_s(kind, 0.0, first.ranks, cluster)
        for kind in ("gather", "scatter")
    )
    assert collectives > 0.01
    gap = simulate(program, cluster, None).iter_time_s - simulate(empty, cluster, None).iter_time_s
    assert gap >= collectives * (1 - 1e-9)


def test_the_memory_the_planner_checks_is_the_memory_the_simulator_prices_when_sharded():
    plans, cluster = _machine_plans()
    program = plans[True].program
    assert program.num_pipelines > 1  # sharded over its replicas
    assert_planner_peaks_are_simulated(
        program, _workload("bert", 16 * 64, "preset=paper"), cluster, program.num_pipelines
    )


def test_auto_shards_the_state_where_only_then_the_faster_cut_fits():
    """0.8 GiB devices: paper BERT's four-stage cut needs 1.0 GiB a rank replicated, 0.6
    sharded; replicated, only eight stages fit, slower than four sharded."""
    memory = {"+cluster.machines.0.memory_gib": 0.8, "+cluster.machines.1.memory_gib": 0.8}
    cluster = _paper_cluster(**{"cluster.gpus_per_machine": 8, **memory})
    workload = _workload("bert", 64 * 64, "preset=paper")
    plans = {
        sharded: PipelineParallel(stage_level="machine", schedule="1f1b", sharded_state=sharded).plan(workload, cluster)
        for sharded in (False, "auto")
    }
    assert plans[False].details["sharded_state"] is False and plans["auto"].details["sharded_state"] is True
    assert plans[False].details["num_stages"] > plans["auto"].details["num_stages"]
    sims = {k: simulate(plan.program, cluster, None) for k, plan in plans.items()}
    assert not any(sim.oom for sim in sims.values())
    assert sims["auto"].iter_time_s < sims[False].iter_time_s


def test_with_one_pipeline_sharded_state_changes_nothing():
    cluster = _paper_cluster(**{"cluster.gpus_per_machine": 1})
    workload = _workload("bert", 8 * 64, "preset=paper")
    plan = PipelineParallel(stage_level="machine", num_stages=8, schedule="1f1b", sharded_state=True).plan(
        workload, cluster
    )
    plain = PipelineParallel(stage_level="machine", num_stages=8, schedule="1f1b").plan(workload, cluster)
    assert plan.details["num_pipelines"] == 1 and plan.details["sharded_state"] is False
    assert plan.program == plain.program


def test_a_sharded_state_the_method_does_not_know_is_one_line():
    with pytest.raises(ConfigError, match=r"^method.sharded_state='yes' is unknown; use false, true or auto$"):
        PipelineParallel(sharded_state="yes")
    with pytest.raises(ConfigError, match=r"not method.schedule=interleaved1f1b; use method.schedule=1f1b"):
        PipelineParallel(sharded_state=True, schedule="interleaved1f1b")


def test_bad_sharded_state_is_a_failed_row(cfg_factory):
    cfg = cfg_factory("method=pipeline", "mode=sim", "method.profile=false", "method.sharded_state=sometimes")
    record = run_case(cfg)
    assert record.status == "failed" and "method.sharded_state='sometimes' is unknown" in record.error
    assert "\n" not in record.error.strip()
    rows = load_records(f"{cfg.results_dir}/records.jsonl")
    assert [r["status"] for r in rows] == ["failed"]
