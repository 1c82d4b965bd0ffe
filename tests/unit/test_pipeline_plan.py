"""The pipeline's plan and price (methods/pipeline/, bench/cost/pipeline.py): torch's schedule
as traced, the replay of a schedule, the stage cuts and device order the planner picks, the
memory it checks against the memory the simulator prices, and bad input."""

from __future__ import annotations

import functools

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.interfaces import Workload
from bench.core.program import Affine, Memory, Stage
from bench.cost import simulate
from bench.cost.pipeline import PipelineProgram, PipeStage, in_flight, replay
from bench.records.rows import load_records
from bench.runner.execute import run_case
from methods.pipeline import PipelineParallel, StageOOM, micro_batch_choices, trace_schedule
from tests.conftest import compose_config


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages,micro", [(2, 2), (3, 4), (4, 8)])
def test_traced_schedule_runs_every_micro_batch_once_and_matches_sends_with_receives(schedule, stages, micro):
    traces = [trace_schedule(schedule, stages, micro, s) for s in range(stages)]
    for s, actions in enumerate(traces):
        assert sorted(a[1] for a in actions if a[0] == "F") == list(range(micro))
        assert sorted(a[1] for a in actions if a[0] == "B") == list(range(micro))
        # torch's 1F1B holds a micro-batch per later stage in flight; GPipe all of them
        assert in_flight(actions) == (min(micro, stages - s) if schedule == "1f1b" else micro)
        if s + 1 < stages:  # what a stage sends the next receives, in the same order
            sent = [a[3] for a in actions if a[0] == "send" and a[2] == "act"]
            received = [a[3] for a in traces[s + 1] if a[0] == "recv" and a[2] == "act"]
            assert sent == received == list(range(micro))
            back = [a[3] for a in traces[s + 1] if a[0] == "send" and a[2] == "grad"]
            assert back == [a[3] for a in actions if a[0] == "recv" and a[2] == "grad"]


def _cluster(num: int, speeds=None, gbps: float = 1e6) -> ClusterSpec:
    speeds = speeds or [1.0] * num
    return ClusterSpec.from_config(
        {
            "name": "test",
            "emulated": True,
            "virtual_device": "gpu",
            "machines": [{"count": 1, "device": "cpu", "num_devices": 1, "speed": s} for s in speeds],
            "links": {
                "intra_machine": {"bandwidth_gbps": gbps, "latency_s": 0.0},
                "inter_machine": {"bandwidth_gbps": gbps, "latency_s": 0.0},
            },
        }
    ).with_host_speed(1e9)


def _uniform_program(schedule: str, stages: int, micro: int, seconds: float) -> PipelineProgram:
    flops = Affine(seconds * 1e9)  # at the host's 1e9 FLOP/s
    st = [
        PipeStage(
            (s, s + 1), (s,), (Stage(flops=flops),), (Stage(flops=flops.scale(2.0)),), (0.0, 0.0), 0.0, 0.0, Memory()
        )
        for s in range(stages)
    ]
    actions = tuple(trace_schedule(schedule, stages, micro, s) for s in range(stages))
    return PipelineProgram(tuple(st), actions, micro, 1, 1, stages, schedule)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_balanced_pipeline_without_links_takes_micro_batches_plus_stages_minus_one_steps(schedule):
    """The textbook makespan: (m + S - 1) x (forward + backward) of one stage."""
    stages, micro, f = 4, 8, 0.01
    program = _uniform_program(schedule, stages, micro, f)
    cluster = _cluster(stages)
    lines = replay(program, cluster, 0, [(f, 2 * f)] * stages)
    assert max(t.end_s for t in lines) == pytest.approx((micro + stages - 1) * 3 * f)
    assert simulate(program, cluster, None).iter_time_s == pytest.approx((micro + stages - 1) * 3 * f)


def test_a_slow_link_delays_every_hop_it_carries():
    stages, micro, f = 2, 2, 0.01
    program = _uniform_program("1f1b", stages, micro, f)
    base = simulate(program, _cluster(stages), None).iter_time_s
    nbytes = 1e6
    program = PipelineProgram(
        tuple(
            PipeStage(st.groups, st.ranks, st.forward, st.backward, st.launches, nbytes, 0.0, st.memory)
            for st in program.stages
        ),
        program.actions,
        micro,
        1,
        1,
        stages,
        "1f1b",
    )
    slow = simulate(program, _cluster(stages, gbps=8.0), None).iter_time_s  # 1 ms per MB
    # The critical path crosses the link 2 x m times: each micro-batch's activation and gradient.
    assert slow == pytest.approx(base + 2 * micro * 1e-3, rel=0.02)


@functools.cache
def _workload(model: str, batch: int, *overrides: str) -> Workload:
    cfg = compose_config(f"model={model}", *overrides)
    spec = instantiate(cfg.model.spec, num_devices=4)
    return Workload(model, "tiny", spec, batch, flops_per_sample=1.0)


def _paper_cluster(**changes) -> ClusterSpec:
    cfg = compose_config("cluster=paper_hetero", *(f"{k}={v}" for k, v in changes.items()))
    return ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))


def test_the_slowest_device_gets_the_cheapest_layer_group():
    cluster = _cluster(4, [1.0, 1.0, 0.5, 0.25])
    plan = PipelineParallel(profile=False, stage_level="device", num_stages=4).plan(_workload("bert", 32), cluster)
    stages = plan.details["stages"]
    assert [st["groups"] for st in stages] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    # tiny BERT's embedding costs almost nothing: the 0.25 device holds it
    assert stages[0]["ranks"] == [3]
    assert sorted(r for st in stages for r in st["ranks"]) == [0, 1, 2, 3]


def test_stages_over_machines_replicate_each_stage_on_a_machines_gpus():
    cluster = _paper_cluster(**{"cluster.gpus_per_machine": 2})
    plan = PipelineParallel(stage_level="machine", num_stages=8).plan(
        _workload("bert", 16 * 64, "preset=paper"), cluster
    )
    d = plan.details
    assert d["num_stages"] == 8 and d["num_pipelines"] == 2
    for st in d["stages"]:  # a stage's replicas are the GPUs of one machine
        assert len({cluster.devices[r].machine for r in st["ranks"]}) == 1
    assert plan.data_slices[0] != plan.data_slices[1] and sum(plan.batch_shares) > 0


def test_the_memory_the_planner_checks_is_the_memory_the_simulator_prices():
    cluster = _paper_cluster(**{"cluster.gpus_per_machine": 1})
    method = PipelineParallel(stage_level="machine")
    workload = _workload("bert", 8 * 64, "preset=paper")
    plan = method.plan(workload, cluster)
    sim = simulate(plan.program, cluster, None)
    from methods.capture import capture_config
    from methods.common import group_table
    from methods.pipeline import _Costs

    graph = capture_config(workload.model_cfg, workload.global_batch)
    costs = _Costs(graph, group_table(graph), cluster, 0.0)
    program = plan.program
    for s, st in enumerate(program.stages):
        peak = costs.peak(
            st.groups[0],
            st.groups[1],
            program.micro_batch,
            in_flight(program.actions[s]),
            program.num_micro_batches,
            program.num_pipelines > 1,
            s == program.num_stages - 1,
        )
        assert sim.peak_mem_gib[st.ranks[0]] == pytest.approx(peak / 2**30)


def test_micro_batches_must_divide_the_pipelines_batch_and_feed_every_stage():
    assert micro_batch_choices(16, 2, "1f1b", "auto") == [2, 4, 8]
    assert micro_batch_choices(16, 2, "gpipe", "auto") == [1, 2, 4, 8]
    with pytest.raises(
        ConfigError,
        match=r"method.num_micro_batches=3 must divide the pipeline's batch of 16 "
        r"samples; try 1, 2, 4, 8, 16",
    ):
        micro_batch_choices(16, 2, "1f1b", 3)
    with pytest.raises(
        ConfigError,
        match=r"method.num_micro_batches=2 is fewer than the 4 stages: 1F1B needs a "
        r"micro-batch per stage; try 4, 8, 16 \(or method.schedule=gpipe\)",
    ):
        micro_batch_choices(16, 4, "1f1b", 2)


@pytest.mark.parametrize(
    "overrides,status,needle",
    [
        (
            ["method.num_micro_batches=3"],
            "failed",
            "method.num_micro_batches=3 must divide the pipeline's batch of 16 samples; try 1, 2, 4, 8, 16",
        ),
        (
            ["cluster=local_hetero4", "+model.spec.num_layers=1", "method.num_stages=4"],
            "failed",
            "method.num_stages=4 is more than the 3 layer groups the model can be cut at; use method.num_stages<=3",
        ),
        (
            ["method.num_stages=3"],
            "failed",
            "method.num_stages=3 does not divide the 2 devices of cluster=local_hetero2",
        ),
        (["method.schedule=zigzag"], "failed", "method.schedule='zigzag' is unknown; use one of 1f1b, gpipe"),
        (
            [
                "preset=paper",
                "cluster=paper_hetero",
                "cluster.gpus_per_machine=1",
                "+cluster.machines.0.memory_gib=1",
                "+cluster.machines.1.memory_gib=1",
            ],
            "oom",
            "fits device memory: stage",
        ),
    ],
)
def test_bad_pipeline_input_is_one_line_and_no_ok_row(cfg_factory, overrides, status, needle):
    cfg = cfg_factory("method=pipeline", "mode=sim", "method.profile=false", *overrides)
    record = run_case(cfg)
    assert record.status == status
    assert needle in record.error and "\n" not in record.error.strip()
    rows = load_records(f"{cfg.results_dir}/records.jsonl")
    assert [r["status"] for r in rows] == [status] and rows[0]["iter_time_s_mean"] is None


def test_a_stage_that_cannot_fit_is_predicted_oom_not_planned():
    cluster = _paper_cluster(
        **{"cluster.gpus_per_machine": 1, "+cluster.machines.0.memory_gib": 1, "+cluster.machines.1.memory_gib": 1}
    )
    with pytest.raises(
        StageOOM,
        match=r"fits device memory: stage \d+ \(groups \d+-\d+\) needs .* GiB at "
        r"method.num_micro_batches=\d+, more than a [PV]100-16's 1 GiB; use",
    ):
        PipelineParallel(stage_level="machine").plan(_workload("bert", 8 * 64, "preset=paper"), cluster)
