"""The pipeline's plan and price (methods/pipeline/, bench/cost/pipeline.py): torch's schedules
as traced, the replay of a schedule, the stage cuts, device order, schedule and shares the
planner picks, the memory it checks against the memory the simulator prices, and bad input."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.interfaces import Workload
from bench.core.program import Affine, Memory, Stage
from bench.cost import simulate
from bench.cost.pipeline import (
    SCHEDULES,
    PipelineProgram,
    PipeStage,
    StageBytes,
    StageWork,
    activation_peak,
    compute_bound,
    in_flight,
    rank_memory,
    replay,
    stage_peak,
    stage_peak_bytes,
    tied_seconds,
)
from bench.records.rows import load_records
from bench.runner.execute import run_case
from methods.pipeline import PipelineParallel, StageOOM, micro_batch_counts, trace_schedule
from methods.pipeline.schedule import ScheduleRefused, compute_order, is_multi_stage, schedule_class
from tests.conftest import compose_config

SHAPES = [  # (schedule, ranks, stages per rank, micro-batches)
    ("1f1b", 2, 1, 2),
    ("1f1b", 3, 1, 4),
    ("1f1b", 4, 1, 8),
    ("gpipe", 2, 1, 2),
    ("gpipe", 4, 1, 8),
    ("interleaved1f1b", 2, 2, 4),
    ("interleaved1f1b", 2, 3, 6),
    ("loopedbfs", 2, 2, 4),
    ("interleavedzerobubble", 2, 2, 4),
    ("interleavedzerobubble", 4, 2, 8),
    ("zbvzerobubble", 2, 2, 4),
    ("zbvzerobubble", 3, 2, 6),
    ("dualpipev", 2, 2, 4),
]


def test_every_schedule_the_simulator_knows_is_torchs():
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    for name in SCHEDULES:
        cls = schedule_class(name)
        assert cls.__module__ == "torch.distributed.pipelining.schedules", name
        assert is_multi_stage(name) == issubclass(cls, PipelineScheduleMulti), name


@pytest.mark.parametrize("schedule,ranks,per_rank,micro", SHAPES)
def test_traced_schedule_runs_every_micro_batch_once_and_matches_sends_with_receives(schedule, ranks, per_rank, micro):
    traces = [trace_schedule(schedule, ranks, micro, r, per_rank) for r in range(ranks)]
    where = traces[0].stage_rank
    K = ranks * per_rank
    assert sorted(k for t in traces for k in t.stages) == list(range(K))
    for r, t in enumerate(traces):
        assert t.stage_rank == where and all(where[k] == r for k in t.stages)
    for k in range(K):
        actions = [a for a in traces[where[k]].actions if a[0] in ("F", "B", "I", "W") and a[1] == k]
        assert sorted(a[2] for a in actions if a[0] == "F") == list(range(micro))
        # every micro-batch's backward once: whole, or split into the input's and the weights'
        assert sorted(a[2] for a in actions if a[0] in ("B", "W")) == list(range(micro))
        assert sorted(a[2] for a in actions if a[0] in ("B", "I")) == list(range(micro))
        if k + 1 < K and where[k] != where[k + 1]:  # what a stage sends the next receives, in order
            mine, theirs = traces[where[k]].actions, traces[where[k + 1]].actions
            sent = [a[4] for a in mine if a[0] == "send" and a[2] == "act" and a[3] == k]
            received = [a[4] for a in theirs if a[0] == "recv" and a[2] == "act" and a[3] == k + 1]
            assert sent == received == list(range(micro))
            back = [a[4] for a in theirs if a[0] == "send" and a[2] == "grad" and a[3] == k + 1]
            assert back == [a[4] for a in mine if a[0] == "recv" and a[2] == "grad" and a[3] == k]
            assert sorted(back) == list(range(micro))
    if per_rank == 1:  # torch's 1F1B holds a micro-batch per later stage in flight; GPipe all of them
        for s, t in enumerate(traces):
            assert in_flight(t.actions) == (min(micro, ranks - s) if schedule == "1f1b" else micro)


def test_torch_refuses_what_its_schedule_cannot_run():
    with pytest.raises(ScheduleRefused, match=r"microbatches \(2\) must be greater than or equal"):
        trace_schedule("1f1b", 4, 2, 0)
    with pytest.raises(ScheduleRefused, match="ZBV requires exactly 2 stages per rank"):
        trace_schedule("zbvzerobubble", 2, 4, 0, 3)
    with pytest.raises(ScheduleRefused, match="several stages per rank, not 1"):
        trace_schedule("interleaved1f1b", 2, 4, 0, 1)


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


def _uniform_program(
    schedule: str, ranks: int, micro: int, seconds: float, per_rank: int = 1, nbytes: float = 0.0
) -> PipelineProgram:
    """Stages of `seconds` forward and twice that backward each (at the host's 1e9 FLOP/s)."""
    traces = [trace_schedule(schedule, ranks, micro, r, per_rank) for r in range(ranks)]
    where = traces[0].stage_rank
    flops = Affine(seconds * 1e9)
    work = StageWork((Stage(flops=flops),), (Stage(flops=flops.scale(2.0)),), (0.0, 0.0), nbytes)
    stages = tuple(PipeStage((k, k + 1), (where[k],), (work,), 0.0) for k in range(ranks * per_rank))
    return PipelineProgram(
        stages,
        tuple(t.actions for t in traces),
        micro,
        (1,),
        ranks,
        tuple((Memory(),) for _ in range(ranks)),
        schedule=schedule,
        stage_rank=where,
    )


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_balanced_pipeline_without_links_takes_micro_batches_plus_stages_minus_one_steps(schedule):
    """The textbook makespan: (m + S - 1) x (forward + backward) of one stage."""
    stages, micro, f = 4, 8, 0.01
    program = _uniform_program(schedule, stages, micro, f)
    cluster = _cluster(stages)
    lines = replay(program, cluster, 0, [(f, 2 * f, 0.0, 2 * f)] * stages, [0.0] * stages)
    assert max(t.end_s for t in lines) == pytest.approx((micro + stages - 1) * 3 * f)
    assert simulate(program, cluster, None).iter_time_s == pytest.approx((micro + stages - 1) * 3 * f)


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "interleavedzerobubble", "zbvzerobubble"])
def test_several_stages_per_rank_shrink_the_bubble_of_the_same_work(schedule):
    """The same model on the same ranks: cut into two stages per rank (each half the work),
    torch's interleaved and zero-bubble schedules idle less than 1F1B's one stage per rank,
    and never beat the work itself."""
    ranks, micro, f = 4, 8, 0.01
    cluster = _cluster(ranks)
    one = simulate(_uniform_program("1f1b", ranks, micro, f), cluster, None).iter_time_s
    two = simulate(_uniform_program(schedule, ranks, micro, f / 2, per_rank=2), cluster, None).iter_time_s
    work = micro * 3 * f
    assert work < two < one


def test_a_slow_link_delays_every_hop_it_carries():
    stages, micro, f = 2, 2, 0.01
    base = simulate(_uniform_program("1f1b", stages, micro, f), _cluster(stages), None).iter_time_s
    program = _uniform_program("1f1b", stages, micro, f, nbytes=1e6)
    slow = simulate(program, _cluster(stages, gbps=8.0), None).iter_time_s  # 1 ms per MB
    # The critical path crosses the link 2 x m times: each micro-batch's activation and gradient.
    assert slow == pytest.approx(base + 2 * micro * 1e-3, rel=0.02)


def test_a_rank_of_one_stage_holds_what_the_planners_arithmetic_says():
    parts = StageBytes(100.0, 10.0, kept_bytes=7.0, backward_bytes=11.0, received_bytes=3.0, sent_bytes=2.0)
    for schedule, micro in (("1f1b", 4), ("gpipe", 4)):
        actions = trace_schedule(schedule, 3, micro, 1).actions
        memory = rank_memory(actions, {1: parts}, micro, bucket_bytes=5.0)
        expected = stage_peak_bytes(
            param_bytes=100.0,
            largest_param_bytes=10.0,
            kept_bytes=7.0,
            backward_bytes=11.0,
            received_bytes=3.0,
            sent_bytes=2.0,
            in_flight=in_flight(actions),
            num_micro_batches=micro,
            bucket_bytes=5.0,
            foreach=False,
        )
        assert stage_peak(memory, foreach=False) == pytest.approx(expected)


def test_a_rank_of_two_stages_holds_both_stages_micro_batches_in_flight():
    """ZBV's first rank holds stages 0 and 3: at its peak, micro-batches of both are in flight."""
    actions = trace_schedule("zbvzerobubble", 2, 4, 0, 2).actions
    a = StageBytes(0.0, 0.0, kept_bytes=1.0, backward_bytes=1.0, received_bytes=0.0, sent_bytes=0.0)
    b = StageBytes(0.0, 0.0, kept_bytes=100.0, backward_bytes=100.0, received_bytes=0.0, sent_bytes=0.0)
    peak = activation_peak(actions, {0: a, 3: b})
    alone = max(activation_peak(actions, {0: a, 3: StageBytes(0, 0, 0, 0, 0, 0)}), 1.0)
    assert peak > 100.0 and peak >= 100.0 * in_flight(actions, 3) and alone >= in_flight(actions, 0) * 1.0


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
    plan = PipelineParallel(profile=False, stage_level="device", num_stages=4, schedule="1f1b").plan(
        _workload("bert", 32), cluster
    )
    stages = plan.details["stages"]
    assert [st["groups"] for st in stages] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    # tiny BERT's embedding costs almost nothing: the 0.25 device holds it
    assert stages[0]["ranks"] == [3]
    assert sorted(r for st in stages for r in st["ranks"]) == [0, 1, 2, 3]


def _two_speed_plan(shares: str):
    """Two pipelines of two ranks on a machine each (alike="pipeline"): one at full speed, one at half."""
    cluster = _cluster(4, [1.0, 1.0, 0.5, 0.5], gbps=100.0)
    method = PipelineParallel(
        profile=False, num_stages=2, alike="pipeline", schedule="1f1b", num_micro_batches=2, shares=shares
    )
    return method.plan(_workload("bert", 32), cluster), cluster


def test_pipelines_at_unlike_speeds_get_batches_in_proportion_and_finish_sooner():
    plan, cluster = _two_speed_plan("priced")
    equal, _ = _two_speed_plan("equal")
    d = plan.details
    fast = next(p for p, ranks in enumerate(d["pipelines"]) if set(ranks) == {0, 1})
    slow = 1 - fast
    batches = d["pipeline_batches"]
    assert sum(batches) == 32 and equal.details["pipeline_batches"] == [16, 16]
    assert 1.6 <= batches[fast] / batches[slow] <= 2.5  # speeds 1 and 0.5: twice the samples
    assert all(b % d["num_micro_batches"] == 0 for b in batches)
    # each rank loads its pipeline's samples and computes its micro-batch at a time
    starts = {}
    for r, (start, stop) in enumerate(plan.data_slices):
        p = next(p for p, ranks in enumerate(d["pipelines"]) if r in ranks)
        assert stop - start == batches[p] and plan.batch_shares[r] == d["micro_batches"][p]
        starts.setdefault(p, start)
    assert sorted(starts.values()) == [0, min(batches)] if starts[fast] else [0, batches[slow]]
    t_priced = simulate(plan.program, cluster, None).iter_time_s
    t_equal = simulate(equal.program, cluster, None).iter_time_s
    assert t_priced < 0.85 * t_equal


def test_the_program_prices_each_pipeline_at_its_own_batch():
    plan, _ = _two_speed_plan("priced")
    program = plan.program
    mbs = program.micro_batches
    assert len(set(mbs)) == 2 and list(mbs) == plan.details["micro_batches"]
    for st in program.stages:  # FLOPs and sends scale with each pipeline's micro-batch
        flops = [sum(s.flops.const for s in w.forward) for w in st.work]
        assert flops[0] / mbs[0] == pytest.approx(flops[1] / mbs[1])
        sends = [w.send_bytes for w in st.work]
        assert sends[0] * mbs[1] == pytest.approx(sends[1] * mbs[0])


def test_stages_over_machines_replicate_each_stage_on_a_machines_gpus():
    cluster = _paper_cluster(**{"cluster.gpus_per_machine": 2})
    plan = PipelineParallel(stage_level="machine", num_stages=8, schedule="1f1b").plan(
        _workload("bert", 16 * 64, "preset=paper"), cluster
    )
    d = plan.details
    assert d["num_stages"] == 8 and d["num_pipelines"] == 2
    for st in d["stages"]:  # a stage's replicas are the GPUs of one machine
        assert len({cluster.devices[r].machine for r in st["ranks"]}) == 1
    assert plan.data_slices[0] != plan.data_slices[1] and sum(plan.batch_shares) > 0


def test_auto_prices_every_schedule_and_keeps_the_fastest():
    cluster = _cluster(4, [1.0, 1.0, 0.5, 0.25], gbps=10.0)
    workload = _workload("bert", 32)
    auto = PipelineParallel(profile=False, num_stages=2)
    best = simulate(auto.plan(workload, cluster).program, cluster, None).iter_time_s
    for schedule in SCHEDULES:
        try:
            plan = PipelineParallel(profile=False, num_stages=2, schedule=schedule).plan(workload, cluster)
        except ConfigError:
            continue
        assert plan.details["schedule"] == schedule
        assert best <= simulate(plan.program, cluster, None).iter_time_s + 1e-12, schedule


def test_micro_batches_past_four_per_stage_are_priced():
    cluster = _cluster(2, [1.0, 0.5])
    counts = micro_batch_counts(32, 1, "priced", "auto")
    assert counts == [1, 2, 4, 8, 16, 32]
    plan = PipelineParallel(profile=False, schedule="1f1b", num_micro_batches=16).plan(_workload("bert", 32), cluster)
    assert plan.details["num_micro_batches"] == 16 and plan.program.micro_batches == (2,)


def test_interleaved_schedules_hold_several_stages_per_rank_where_torch_places_them():
    cluster = _cluster(2, [1.0, 0.5])
    workload = _workload("bert", 16)
    for schedule, where in (("interleaved1f1b", [0, 1, 0, 1]), ("zbvzerobubble", [0, 1, 1, 0])):
        plan = PipelineParallel(profile=False, schedule=schedule, stages_per_rank=2).plan(workload, cluster)
        d = plan.details
        assert d["stages_per_rank"] == 2 and len(d["stages"]) == 4 and d["stage_rank"] == where
        pipeline = d["pipelines"][0]
        assert [st["ranks"] for st in d["stages"]] == [[pipeline[r]] for r in where]


def test_the_memory_the_planner_checks_is_the_memory_the_simulator_prices():
    cluster = _paper_cluster(**{"cluster.gpus_per_machine": 1})
    method = PipelineParallel(stage_level="machine", schedule="1f1b")
    workload = _workload("bert", 8 * 64, "preset=paper")
    plan = method.plan(workload, cluster)
    sim = simulate(plan.program, cluster, None)
    from methods.common import group_table
    from methods.graph import capture_config
    from methods.pipeline.planning import _Costs

    graph = capture_config(workload.model_cfg, workload.global_batch)
    costs = _Costs(graph, group_table(graph), cluster, 0.0)
    program = plan.program
    for s, st in enumerate(program.stages):
        peak = costs.peak(
            st.groups[0],
            st.groups[1],
            program.micro_batches[0],
            in_flight(program.actions[s]),
            program.num_micro_batches,
            program.num_pipelines > 1,
        )
        assert sim.peak_mem_gib[st.ranks[0]] == pytest.approx(peak / 2**30)


def test_activation_checkpointing_prices_the_recompute_and_keeps_only_the_groups_inputs():
    from methods.common import group_table
    from methods.graph import capture_config
    from methods.pipeline.planning import _Costs

    cluster = _cluster(2, [1.0, 0.5])
    workload = _workload("bert", 16)
    graph = capture_config(workload.model_cfg, 16)
    table = group_table(graph)
    plain, ckpt = (_Costs(graph, table, cluster, 0.0, checkpointing=c) for c in (False, True))
    first, end, mb = 1, 3, 4  # two transformer blocks

    def flops(stages) -> float:
        return sum(s.flops.const for s in stages)

    fwd, bwd, fk, bk = plain.passes(first, end, mb)
    _, bwd_ckpt, _, bk_ckpt = ckpt.passes(first, end, mb)
    assert flops(bwd_ckpt) == pytest.approx(flops(bwd) + flops(fwd)) and bk_ckpt == bk + fk
    assert ckpt.seconds(0, first, end, mb) > plain.seconds(0, first, end, mb)
    (kept, held), (kept_ckpt, held_ckpt) = plain.activations(first, end), ckpt.activations(first, end)
    assert kept_ckpt < kept / 4 and held_ckpt < held
    assert 0 < ckpt.weight_share(first, end) < plain.weight_share(first, end)
    # the plan: a smaller activation peak on every rank, a slower iteration
    kw = dict(profile=False, schedule="gpipe", num_stages=2, num_micro_batches=4)
    programs = [PipelineParallel(activation_checkpointing=c, **kw).plan(workload, cluster).program for c in (0, 1)]
    sims = [simulate(p, cluster, None) for p in programs]
    assert [st.groups for st in programs[0].stages] == [st.groups for st in programs[1].stages]
    for r in range(2):
        assert sims[1].memory_gib[r]["activations"] < sims[0].memory_gib[r]["activations"]
    assert sims[1].iter_time_s > sims[0].iter_time_s


def test_a_checkpointed_stage_computes_the_same_and_runs_each_group_again_in_backward():
    import torch

    from methods.common import group_table
    from methods.graph import capture_config
    from methods.pipeline.cut import checkpointed_stage, cut_graph, model_graph

    workload = _workload("bert", 4)
    graph = capture_config(workload.model_cfg, 4)
    table = group_table(graph)
    tensors = {n.name for n in graph.nodes if n.is_tensor}
    gm = model_graph(workload.build(0), workload.model_cfg, 4)
    cuts = [0, 1, 3, 4]
    first, _ = cut_graph(gm, table, tensors, cuts, 0)
    plain, _ = cut_graph(gm, table, tensors, cuts, 1)
    ckpt = checkpointed_stage(gm, table, tensors, 1, 3)
    calls = []
    for g in ckpt.groups:  # counted around forward itself (module hooks do not see the recompute)
        g.forward = (lambda f: lambda *args: calls.append(1) or f(*args))(g.forward)
    x = first(*workload.model_cfg.synthetic_batch(4, torch.Generator().manual_seed(0))[:-1])
    outs = []
    for stage in (plain, ckpt):
        inp = x.detach().requires_grad_()
        y = stage(inp)
        y.square().sum().backward()
        outs.append((y.detach(), inp.grad, [p.grad.clone() for p in stage.parameters()]))
        for p in stage.parameters():
            p.grad = None
    assert torch.allclose(outs[0][0], outs[1][0]) and torch.allclose(outs[0][1], outs[1][1], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(outs[0][2], outs[1][2]))
    assert len(calls) == 2 * len(ckpt.groups)  # forward, and again in backward


def test_micro_batches_must_divide_the_batch_and_feed_every_pipeline():
    assert micro_batch_counts(16, 1, "equal", "auto") == [1, 2, 4, 8, 16]
    assert micro_batch_counts(16, 2, "equal", "auto") == [1, 2, 4, 8]
    assert micro_batch_counts(16, 2, "priced", "auto") == [1, 2, 4, 8]
    assert micro_batch_counts(24, 2, "priced", "auto") == [1, 2, 3, 4, 6, 8, 12]
    with pytest.raises(
        ConfigError, match=r"method.num_micro_batches=3 must divide the pipeline's batch of 8 samples; try 1, 2, 4, 8"
    ):
        micro_batch_counts(16, 2, "equal", 3)
    with pytest.raises(
        ConfigError,
        match=r"method.num_micro_batches=16 must divide the global batch of 16 samples into "
        r"micro-batches for 2 pipelines; try 1, 2, 4, 8",
    ):
        micro_batch_counts(16, 2, "priced", 16)


@pytest.mark.parametrize(
    "overrides,status,needle",
    [
        (
            ["method.num_micro_batches=3"],
            "failed",
            "method.num_micro_batches=3 must divide the global batch of 16 samples; try 1, 2, 4, 8, 16",
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
        (
            ["method.schedule=zigzag"],
            "failed",
            "method.schedule='zigzag' is not a schedule torch.distributed.pipelining has; use auto or one of 1f1b",
        ),
        (
            ["method.schedule=PipelineScheduleMulti"],
            "failed",
            "method.schedule='PipelineScheduleMulti' is torch's, but not one this method runs; use auto or one of",
        ),
        (
            ["method.schedule=1f1b", "method.num_micro_batches=1"],
            "failed",
            "method.num_micro_batches=1 does not run under method.schedule=1f1b with 2 ranks a pipeline",
        ),
        (
            ["method.schedule=1f1b", "method.stages_per_rank=2"],
            "failed",
            "method.stages_per_rank=2 needs a schedule that runs several stages per rank, but "
            "method.schedule=1f1b runs one",
        ),
        (
            ["method.schedule=zbvzerobubble", "method.stages_per_rank=3"],
            "failed",
            "method.stages_per_rank=3 does not run under method.schedule=zbvzerobubble",
        ),
        (
            ["cluster=local_hetero4", "+model.spec.num_layers=1", "method.schedule=interleaved1f1b"],
            "failed",
            "method.schedule=interleaved1f1b needs at least 2 stages per rank",
        ),
        (["method.shares=uneven"], "failed", "method.shares='uneven' is unknown; use one of priced, equal"),
        (["method.alike=devices"], "failed", "method.alike='devices' is unknown; use one of auto, stage, pipeline"),
        (["method.work_probe=sometimes"], "failed", "method.work_probe='sometimes' is invalid; use true or false"),
        (
            [
                "preset=paper",
                "cluster=paper_hetero",
                "cluster.gpus_per_machine=1",
                "+cluster.machines.0.memory_gib=0.1",
                "+cluster.machines.1.memory_gib=0.1",
            ],
            "oom",
            "fits device memory: ",
        ),
    ],
)
def test_bad_pipeline_input_is_one_line_and_no_ok_row(cfg_factory, overrides, status, needle):
    cfg = cfg_factory("method=pipeline", "mode=sim", "method.profile=false", *overrides)
    record = run_case(cfg)
    assert record.status == status, record.error
    assert needle in record.error and "\n" not in record.error.strip()
    rows = load_records(f"{cfg.results_dir}/records.jsonl")
    assert [r["status"] for r in rows] == [status] and rows[0]["iter_time_s_mean"] is None


@pytest.mark.parametrize(
    "memory_gib, num_stages, needle",
    [
        (
            0.5,
            8,
            r"fits device memory: stage \d+ \(groups \d+-\d+\) needs .* GiB at "
            r"method.num_micro_batches=\d+, more than a [PV]100-16's MEMORY GiB; use",
        ),
        # the state alone (parameters, gradients, Adam) of 1/8 of BERT's passes every device
        (
            0.1,
            "auto",
            r"fits device memory: with replicated state some rank holds at least 1/8 of the parameters, their "
            r"gradients and Adam's two moments, 0.3 GiB, more than the roomiest of them, a [PV]100-16 of 0.1 GiB; use",
        ),
    ],
)
def test_a_stage_that_cannot_fit_is_predicted_oom_not_planned(memory_gib, num_stages, needle):
    cluster = _paper_cluster(
        **{
            "cluster.gpus_per_machine": 1,
            "+cluster.machines.0.memory_gib": memory_gib,
            "+cluster.machines.1.memory_gib": memory_gib,
        }
    )
    with pytest.raises(StageOOM, match=needle.replace("MEMORY", f"{memory_gib:g}")):
        PipelineParallel(stage_level="machine", schedule="1f1b", num_stages=num_stages).plan(
            _workload("bert", 8 * 64, "preset=paper"), cluster
        )


@pytest.mark.parametrize("memory_gib", [0.1, 0.3])
def test_the_state_floor_refuses_only_what_planning_finds_oom(monkeypatch, memory_gib):
    """Where no device holds 1/R of the parameters, gradients and Adam moments, planning each
    replicated layout without the floor finds nothing that fits either."""
    from methods import pipeline as pipeline_module

    cluster = _paper_cluster(
        **{
            "cluster.gpus_per_machine": 1,
            "+cluster.machines.0.memory_gib": memory_gib,
            "+cluster.machines.1.memory_gib": memory_gib,
        }
    )
    wl = _workload("bert", 8 * 64, "preset=paper")
    floored = []
    for stages in (2, 4, 8):
        method = PipelineParallel(stage_level="machine", schedule="1f1b", num_stages=stages)
        with pytest.raises(StageOOM) as got:
            method.plan(wl, cluster)
        floored.append("Adam's two moments" in str(got.value))
        with monkeypatch.context() as m:
            m.setattr(pipeline_module, "_replicated_state_floor", lambda *args: None)
            with pytest.raises(StageOOM):
                method.plan(wl, cluster)
    assert any(floored)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_tied_parameter_on_two_positions_is_all_reduced_after_the_schedule_where_priced(sharded):
    """Tiny GPT-2's embedding and head (one tensor) on a pipeline's two positions: each holder's
    list ends with the all-reduce of its copy's gradient (sharded over two pipelines: the
    rank's chunk of it, the chunks adding up to the whole), and the simulator charges it."""
    pytest.importorskip("transformers", reason="model=hf needs the optional extra .[zoo]")
    from methods.common import group_table
    from methods.graph import capture_config

    cluster = _cluster(4 if sharded else 2, gbps=1.0)
    workload = _workload("hf", 16, "model.arch=gpt2")
    method = PipelineParallel(profile=False, stage_level="device", num_stages=2, schedule="1f1b", sharded_state=sharded)
    program = method.plan(workload, cluster).program
    assert program.sharded_state == sharded and program.num_pipelines == (2 if sharded else 1)
    (tied,) = program.tied
    table = group_table(capture_config(workload.model_cfg, 16))
    whole = dict(zip(table.groups[0].params, table.groups[0].param_sizes))[tied.name]
    assert tied.positions == (0, 1) and tied.name in table.shared_params
    assert sum(tied.nbytes) == whole if sharded else tied.nbytes == (whole,)
    assert all(actions[-1] == ("tie", 0) for actions in program.actions)
    untied = dataclasses.replace(program, tied=(), actions=tuple(actions[:-1] for actions in program.actions))
    tie_s = max(tied_seconds(program, cluster, p)[0] for p in range(program.num_pipelines))
    assert tie_s > 0
    # both holders leave the all-reduce together, after the later one is through
    assert simulate(program, cluster, None).iter_time_s - simulate(untied, cluster, None).iter_time_s >= tie_s * 0.999


@pytest.mark.parametrize(
    "schedule,per_rank,sharded", [("1f1b", 1, False), ("1f1b", 1, True), ("zbvzerobubble", 2, False)]
)
def test_a_later_holder_of_a_tied_parameter_holds_its_copys_state_where_priced(schedule, per_rank, sharded):
    """Tiny GPT-2's embedding and head (one tensor, counted in the first layer group): the
    later holder's state holds its copy beside its own groups' parameters (sharded over two
    pipelines: its padded shard of it, the all-reduce's first chunk) and the planner checks the
    peak the simulator prices; the V's first position holds both readers and the tensor once."""
    pytest.importorskip("transformers", reason="model=hf needs the optional extra .[zoo]")

    cluster = _cluster(4 if sharded else 2, gbps=1.0)
    workload = _workload("hf", 16, "model.arch=gpt2")
    method = PipelineParallel(
        profile=False,
        stage_level="device",
        num_stages=2,
        schedule=schedule,
        stages_per_rank=per_rank,
        sharded_state=sharded,
    )
    program = method.plan(workload, cluster).program
    assert [t.positions for t in program.tied] == ([] if per_rank == 2 else [(0, 1)])
    for r, row in enumerate(program.memory):
        mine = [st for st, x in zip(program.stages, program.stage_rank) if x == r]
        own = sum(st.shard_bytes if sharded else st.param_bytes for st in mine)
        copies = sum(max(t.nbytes) for t in program.tied if r in t.positions[1:])
        assert all(memory.params.const == own + copies for memory in row), (r, own, copies)
    if per_rank == 1:
        assert_planner_peaks_are_simulated(program, workload, cluster, program.num_pipelines if sharded else 1)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_later_holder_of_a_tied_parameter_syncs_and_steps_its_copy_where_priced(sharded):
    """Tiny GPT-2's embedding and head over two pipelines: the later holder's copy of the
    embedding is its own parameter beyond the all-reduce among the holders: in its replicas'
    last bucket (or in its stage's shard collectives) and in its optimizer step, priced so."""
    pytest.importorskip("transformers", reason="model=hf needs the optional extra .[zoo]")
    from bench.cost.pipeline import optimizer_s
    from methods.common import group_table
    from methods.graph import capture_config
    from methods.pipeline.planning import rank_params

    cluster = _cluster(4, gbps=1.0)
    workload = _workload("hf", 16, "model.arch=gpt2")
    method = PipelineParallel(profile=False, stage_level="device", num_stages=2, schedule="1f1b", sharded_state=sharded)
    program = method.plan(workload, cluster).program
    (tied,) = program.tied
    table = group_table(capture_config(workload.model_cfg, 16))
    cuts = [st.groups[0] for st in program.stages] + [program.stages[-1].groups[1]]
    whole = dict(zip(table.groups[0].params, table.groups[0].param_sizes))[tied.name]
    first, last = program.stages
    assert first.copy_bytes == 0 and last.copy_bytes == whole
    names = [n for n, _ in rank_params(table, cuts, [1])]
    assert names[-1] == tied.name and [n for n, _ in rank_params(table, cuts, [0])].count(tied.name) == 1
    if sharded:
        assert 0 < last.copy_shard_bytes < whole and not any(program.grad_buckets)
    else:
        assert sum(program.grad_buckets[1]) == last.param_bytes + whole
        assert sum(program.grad_buckets[0]) == first.param_bytes
    bare = dataclasses.replace(program, stages=(first, dataclasses.replace(last, copy_bytes=0.0, copy_shard_bytes=0.0)))
    from bench.cost.devices import virtual_devices

    v = virtual_devices(cluster, program.granularity)[last.ranks[0]]
    stepped = optimizer_s(program, 1, 0, cluster, v) - optimizer_s(bare, 1, 0, cluster, v)
    copy = last.copy_shard_bytes if sharded else whole
    assert stepped == pytest.approx(cluster.devices[last.ranks[0]].optimizer_s_per_byte * copy)


def assert_planner_peaks_are_simulated(program, workload, cluster, shards: int) -> None:
    """Each rank of a program of one stage a rank: the peak the planner's cut search checks
    (_Costs.peak) is the one the simulator prices."""
    from methods.common import group_table
    from methods.graph import capture_config
    from methods.pipeline.planning import _Costs

    graph = capture_config(workload.model_cfg, workload.global_batch)
    costs = _Costs(graph, group_table(graph), cluster, 0.0)
    sim = simulate(program, cluster, None)
    for s, st in enumerate(program.stages):
        for p, rank in enumerate(st.ranks):
            peak = costs.peak(
                *st.groups,
                program.micro_batches[p],
                in_flight(program.actions[s]),
                program.num_micro_batches,
                program.num_pipelines > 1,
                shards,
            )
            assert sim.peak_mem_gib[rank] == pytest.approx(peak / 2**30)


@pytest.mark.parametrize(
    "schedule,ranks,per_rank,micro",
    SHAPES + [("interleaved1f1b", 4, 2, 16), ("interleavedzerobubble", 4, 3, 12), ("dualpipev", 4, 2, 8)],
)
def test_the_compute_order_is_the_traces_forwards_and_backwards(schedule, ranks, per_rank, micro):
    """What the planner checks a candidate's memory by before tracing it (compute_order) is
    every position's forwards and backwards as the trace holds them, in its order, with the
    stages where the trace places them."""
    orders, stage_rank = compute_order(schedule, ranks, micro, per_rank)
    traces = [trace_schedule(schedule, ranks, micro, r, per_rank) for r in range(ranks)]
    assert stage_rank == traces[0].stage_rank
    for r, t in enumerate(traces):
        assert orders[r] == tuple(a for a in t.actions if a[0] in ("F", "B", "I", "W"))
        assert t.stages == tuple(k for k in range(ranks * per_rank) if stage_rank[k] == r)


@pytest.mark.parametrize(
    "memory_gib,schedule",
    [(1.0, "auto"), (2.0, "auto"), (0.8, "interleaved1f1b"), (1.0, "zbvzerobubble"), (1.0, "interleavedzerobubble")],
)
def test_memory_checked_before_the_trace_refuses_only_what_the_trace_finds_oom(monkeypatch, memory_gib, schedule):
    """A candidate over memory by its compute order is not traced: traced, the same candidates
    are over memory by the same peaks, and the plan (or the oom and its line) is the same."""
    from methods import pipeline as pipeline_module

    cluster = _paper_cluster(
        **{
            "cluster.gpus_per_machine": 1,
            "+cluster.machines.0.memory_gib": memory_gib,
            "+cluster.machines.1.memory_gib": memory_gib,
        }
    )
    wl = _workload("bert", 8 * 64, "preset=paper")
    checked, traced = [], []

    def plan(before: bool, record: list, name: str):
        method = PipelineParallel(stage_level="machine", schedule=schedule)
        seen = getattr(pipeline_module, name)
        with monkeypatch.context() as m:
            m.setattr(PipelineParallel, "memory_before_trace", before)
            m.setattr(pipeline_module, name, lambda *args: record.append(seen(*args)) or record[-1])
            try:
                return method.plan(wl, cluster)
            except StageOOM as exc:
                return str(exc)

    before = plan(True, checked, "ranks_memory")
    after = plan(False, traced, "pipeline_memory")
    skipped = [(h.peak_mem_gib, h.oom_devices) for h in checked if h.oom_devices]
    assert skipped  # the case checks some candidate before its trace
    assert all(s in [(h.peak_mem_gib, h.oom_devices) for h in traced] for s in skipped)
    if isinstance(before, str):
        assert before == after
    else:
        assert before.details == after.details and before.program == after.program
        assert simulate(before.program, cluster, None) == simulate(after.program, cluster, None)


@pytest.mark.parametrize("sharded", [False, "auto"])
def test_a_candidate_is_replayed_only_where_its_compute_bound_is_faster_than_the_best(monkeypatch, sharded):
    """compute_bound is below every replayed candidate's iteration; a candidate whose bound is
    no faster than the best replayed is not replayed, and the plan is the one replaying all."""
    from methods import pipeline as pipeline_module

    cluster = _paper_cluster(**{"cluster.gpus_per_machine": 4})
    wl = _workload("bert", 8 * 64, "preset=paper")
    runs = {}
    for bound in (True, False):
        replayed = []
        seen = pipeline_module.simulate_pipeline

        def simulate_pipeline(program, cluster, replayed=replayed, seen=seen):
            sim = seen(program, cluster)
            replayed.append(sim.iter_time_s)
            assert compute_bound(program, cluster) <= sim.iter_time_s
            return sim

        with monkeypatch.context() as m:
            m.setattr(PipelineParallel, "bound_before_replay", bound)
            m.setattr(pipeline_module, "simulate_pipeline", simulate_pipeline)
            plan = PipelineParallel(stage_level="auto", sharded_state=sharded).plan(wl, cluster)
        runs[bound] = plan, len(replayed)
    (with_bound, fewer), (without, every) = runs[True], runs[False]
    assert fewer < every
    assert with_bound.details == without.details and with_bound.program == without.program


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_single_stage_schedules_compute_order_is_its_trace_at_every_shape(schedule):
    """GPipe's and 1F1B's compute order, written without tracing, is the trace's at every shape
    torch runs, and torch refuses (ScheduleRefused, as the trace) the shapes it does not."""
    shapes = [(R, m) for R in (1, 2, 3, 4, 5, 8) for m in range(1, 13)] + [(8, 16), (16, 16), (16, 40), (32, 64)]
    for R, m in shapes:
        try:
            traces = [trace_schedule(schedule, R, m, r) for r in range(R)]
        except ScheduleRefused:
            with pytest.raises(ScheduleRefused):
                compute_order(schedule, R, m)
            continue
        orders, stage_rank = compute_order(schedule, R, m)
        assert stage_rank == traces[0].stage_rank
        assert orders == tuple(tuple(a for a in t.actions if a[0] in ("F", "B", "I", "W")) for t in traces), (R, m)


def test_the_schedules_own_work_per_action_is_what_the_probe_adds_to_the_profiled_computes(monkeypatch):
    """The work probe's ranks each computed their profiled actions and Adam at the probe's host
    speed plus `a` profiled seconds per compute action: schedule_work_per_action recovers `a`,
    and the probed plan prices every action `a` longer (and keeps the probe in its details)."""
    from bench.cost.pipeline import COMPUTE
    from methods import pipeline as pipeline_module
    from methods.pipeline import schedule_work_per_action

    cluster = _cluster(2)
    workload = _workload("bert", 8)
    a, slower = 2e-4, 1.5  # the probe's host: 1.5x the profile's step

    def probe(method, plan, workload, cluster, **kwargs):
        program = plan.program
        method_s = [0.0] * cluster.num_devices
        for r, actions in enumerate(program.actions):
            for p, rank in enumerate(program.position_ranks(r)):
                mine = [k for k, x in enumerate(program.stage_rank) if x == r]
                t = sum(program.stages[k].work[p].measured[2] for k in mine)
                for kind, k, *_ in (x for x in actions if x[0] in COMPUTE):
                    w = program.stages[k].work[p]
                    t += w.measured[0 if kind == "F" else 1] if kind in "FB" else w.measured_split[kind == "W"]
                    t += a
                method_s[rank] = slower * t
        plain = [slower * program.profile_step_s[p] for p in range(program.num_pipelines)] * cluster.num_devices
        return {"plain_s": plain[0], "method_s": method_s[0], "plain_s_ranks": plain, "method_s_ranks": method_s}

    monkeypatch.setattr(pipeline_module, "time_method_step", probe)
    method = PipelineParallel(stage_level="device", num_stages=2, schedule="1f1b")
    bare = PipelineParallel(stage_level="device", num_stages=2, schedule="1f1b", work_probe=False).plan(
        workload, cluster
    )
    probed = method.plan(workload, cluster)
    assert probed.details["work"]["action_s"] == pytest.approx(a, rel=1e-9)
    assert schedule_work_per_action(bare.program, probe(method, bare, workload, cluster)) == pytest.approx(a, rel=1e-9)
    for got, was in zip(probed.program.stages, bare.program.stages):
        assert got.work[0].measured[0] == pytest.approx(was.work[0].measured[0] + a)
        assert got.work[0].measured[1] == pytest.approx(was.work[0].measured[1] + a)
        assert got.work[0].measured[2] == was.work[0].measured[2]
    assert simulate(probed.program, cluster, None).iter_time_s > simulate(bare.program, cluster, None).iter_time_s


def test_the_candidates_are_searched_again_with_the_schedules_own_work_the_probe_measured(monkeypatch):
    """A schedule whose every action costs ten times a whole micro-batch's profiled compute of
    its own work: the plan first chosen (the most micro-batches) is probed, the search runs
    again with that work per action and takes fewer micro-batches, which are probed and priced
    with their own measurement. The layer groups' profile is linear in the micro-batch (a
    profile timed on a loaded host can make a larger micro-batch look dearer than its samples,
    and the choice then stays at the most micro-batches)."""
    from bench.cost.pipeline import COMPUTE
    from methods import pipeline as pipeline_module

    cluster = _cluster(2)
    workload = _workload("bert", 8)
    seen, work = [], []
    timed = pipeline_module.group_profile

    def linear_profile(workload, mb, *args, **kwargs):
        groups = len(timed(workload, 1)["forward"])  # the groups as timed; their seconds made up
        per = 1e-3 * mb
        kinds = {"forward": per, "backward": 2 * per, "optimizer": 1e-4, "input_backward": per, "weight_backward": per}
        out = {kind: [s] * groups for kind, s in kinds.items()}
        return {**out, "step_s": groups * (3 * per + 1e-4), "workload": workload.name, "micro_batch": mb}

    def probe(method, plan, workload, cluster, **kwargs):
        program = plan.program
        seen.append(program.num_micro_batches)
        if not work:
            work.append(10 * max(w.measured[0] + w.measured[1] for stage in program.stages for w in stage.work))
        a = work[0]
        priced = 0.0 if len(seen) == 1 else a  # the second plan's program prices `a` an action already
        method_s = [0.0] * cluster.num_devices
        for r, actions in enumerate(program.actions):
            for p, rank in enumerate(program.position_ranks(r)):
                t = sum(program.stages[k].work[p].measured[2] for k, x in enumerate(program.stage_rank) if x == r)
                for kind, k, *_ in (x for x in actions if x[0] in COMPUTE):
                    t += program.stages[k].work[p].measured[0 if kind == "F" else 1] - priced + a
                method_s[rank] = t
        plain = [program.profile_step_s[0]] * cluster.num_devices
        return {"plain_s": plain[0], "method_s": method_s[0], "plain_s_ranks": plain, "method_s_ranks": method_s}

    monkeypatch.setattr(pipeline_module, "time_method_step", probe)
    monkeypatch.setattr(pipeline_module, "group_profile", linear_profile)
    plan = PipelineParallel(stage_level="device", num_stages=2, schedule="1f1b").plan(workload, cluster)
    assert len(seen) == 2 and seen[1] < seen[0] == 8, seen
    assert plan.program.num_micro_batches == seen[1]
    assert plan.details["work"]["action_s"] == pytest.approx(work[0], rel=1e-6)


def _best_cuts_reference(costs, slots, mbs, m, flights, replicated, local=(), sharded=False):
    """best_cuts as a dynamic program over (slowest, sum) pairs compared as tuples: the
    planner's own, kept here to check the one it runs (two rows of floats) against."""
    import math

    num_groups, num_stages = costs.table.num_groups, len(slots)
    if num_stages > num_groups:
        return None
    inf = (math.inf, math.inf)
    best = [[inf] * (num_groups + 1) for _ in range(num_stages + 1)]
    back = [[0] * (num_groups + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    D = len(mbs)
    shards = D if sharded else 1
    for s in range(1, num_stages + 1):
        slot = slots[s - 1]
        last = s == num_stages
        reps = [(slot[p], mbs[p]) for p in {(costs._hw[slot[p]], mbs[p]): p for p in range(D)}.values()]
        sec = costs.slowest_matrix(reps)
        sends = None if last or (local and local[s - 1]) else costs.sends(slot, slots[s], mbs)
        for j in range(s, num_groups - (num_stages - s) + 1) if not last else (num_groups,):
            send = sends[j] if sends else 0.0
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev[0] == math.inf:
                    continue
                c = sec[i][j] + send
                cand = (prev[0] if prev[0] > c else c, prev[1] + c)
                if cand < best[s][j]:
                    if flights is not None and not all(
                        costs.fits(r, costs.peak(i, j, mb, flights[s - 1], m, replicated, shards)) for r, mb in reps
                    ):
                        continue
                    best[s][j], back[s][j] = cand, i
    if best[num_stages][num_groups][0] == math.inf:
        return None
    cuts = [num_groups]
    for s in range(num_stages, 0, -1):
        cuts.append(back[s][cuts[-1]])
    return (*best[num_stages][num_groups], cuts[::-1])


@pytest.mark.parametrize("gpus", [1, 2])
def test_best_cuts_is_the_tuple_dynamic_program(gpus):
    """best_cuts keeps its (slowest stage, sum) pairs as two rows of floats and reads the
    stage times a run's end at a time: the same cuts and seconds as the pairs compared as
    tuples, memory checked or not, on paper-size BERT where memory refuses some cuts."""
    from methods.common import group_table
    from methods.graph import capture_config
    from methods.pipeline.planning import _Costs, best_cuts, layouts, slot_orders

    cluster = _paper_cluster(**{"cluster.gpus_per_machine": gpus})
    workload = _workload("bert", 8 * gpus * 64, "preset=paper")
    graph = capture_config(workload.model_cfg, workload.global_batch)
    table = group_table(graph)
    refused = moved = 0
    for ckpt in (False, True):
        costs = _Costs(graph, table, cluster, 0.0, checkpointing=ckpt)
        found, _ = layouts(cluster, "auto", "auto", table.num_groups)
        for layout in found:
            R, D = layout.num_stages, layout.num_pipelines
            for order in slot_orders(cluster, layout)[:3]:
                for mbs in ([workload.global_batch // (D * k)] * D for k in (1, 2, 4, 8)):
                    free = best_cuts(costs, order, mbs, 8, None, D > 1)
                    assert free == _best_cuts_reference(costs, order, mbs, 8, None, D > 1)
                    for m, flights in ((8, (R,) * R), (32, tuple(range(R, 0, -1)))):
                        for replicated, sharded in ((D > 1, False), (False, D > 1)):
                            args = (costs, order, mbs, m, flights, replicated, (), sharded)
                            got = best_cuts(*args)
                            assert got == _best_cuts_reference(*args)
                            refused += got is None
                            moved += got is not None and got != free  # memory chose other cuts
    assert refused and moved


def test_a_trace_is_kept_on_disk_where_its_values_are_at_most_the_limit():
    from methods.pipeline.schedule import _at_most

    def size(value) -> int:
        return sum(size(v) for v in value) if isinstance(value, (list, tuple)) else 1

    values = [(), 7, "F", ((), ()), (("F", 0, 1), ("B", 0, 1)), [[1, [2, (3, 4)]], "x"], (((1,) * 5,) * 4,) * 3]
    for value in values:
        for limit in range(0, 70):
            assert _at_most(value, limit) == (size(value) <= limit)


def test_a_graphs_group_table_is_made_once_and_its_checkpointed_view_has_its_own():
    from methods.common import _group_table, checkpoint_units, group_table
    from methods.graph import capture_config

    graph = capture_config(_workload("bert", 4).model_cfg, 4)
    table = group_table(graph)
    assert group_table(graph) is table  # kept on the graph
    assert table == _group_table(graph)  # what a fresh one says
    view = graph.with_recompute([u.nodes for u in checkpoint_units(graph)])
    recomputed = group_table(view)
    assert recomputed is not table and recomputed == _group_table(view)
    assert sum(g.bwd_flops for g in recomputed.groups) > sum(g.bwd_flops for g in table.groups)


def test_the_layer_groups_are_timed_at_the_cases_precision_and_kept_apart_by_it(monkeypatch):
    """A bf16 case's profile times its groups (forward, backward, Adam) and its plain steps
    under bf16's autocast, as its workers run and their yardstick times; an fp32 case's
    without; each is kept under its own precision."""
    import torch

    from bench.runtime import method_step
    from methods.pipeline import profile

    keys, seen = [], []
    monkeypatch.setattr(method_step, "host_measurement", lambda what, key, measure: keys.append(key) or measure())
    timed = profile._time_groups

    def watched(*args):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return timed(*args)

    monkeypatch.setattr(profile, "_time_groups", watched)
    fp32 = _workload("bert", 4)
    for workload in (fp32, dataclasses.replace(fp32, precision="bf16")):
        seen.clear()
        out = profile.group_profile(workload, 2, repeats=1)
        assert set(seen) == {None if workload.precision == "fp32" else torch.bfloat16} and out["step_s"] > 0
    assert len(keys) == 2 and keys[0] != keys[1] and [k[-2] for k in keys] == ["fp32", "bf16"]
    assert not torch.is_autocast_enabled("cpu")


def test_a_layer_groups_profile_backs_only_the_outputs_that_need_a_gradient():
    """methods.pipeline.profile runs each layer group as a stage would: a group's output made
    from a buffer (Llama's rotary tables) needs no gradient, and the group's backward runs from
    the gradients of the others; the first group's parameters still get theirs."""
    import torch
    from torch import nn

    from methods.pipeline.profile import _time_groups

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("freq", torch.ones(4))

        def forward(self, x):
            return self.lin(x), self.freq * 2.0

    class Last(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, h, table):
            return self.lin(h * table)

    mods = [(First(), None), (Last(), lambda y, t: ((y - t) ** 2).mean())]
    opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m, _ in mods]
    before = mods[0][0].lin.weight.detach().clone()
    times = [[[] for _ in range(5)] for _ in mods]
    _time_groups(mods, opts, (torch.randn(3, 4), torch.randn(3, 4)), times)
    assert all(len(t[0]) == len(t[1]) == len(t[2]) == 1 for t in times)
    assert not torch.equal(mods[0][0].lin.weight, before)  # its backward reached the first group
