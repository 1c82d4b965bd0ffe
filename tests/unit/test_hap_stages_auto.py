"""auto's family of pipelines of hap stages: the program the simulator prices
(bench.cost.GroupPipelineProgram), the candidates (methods.auto.space), the option
method.stage_synthesis, and the part's plan (methods.auto.stage_plan) in the agreed format
(/work/notes/hap_stages_format.md, docs/methods.md)."""

from __future__ import annotations

import functools
import json

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.cost import GroupPipelineProgram, simulate
from bench.cost.pipeline import in_flight
from methods.auto import Auto
from methods.auto.hap_stages import (
    best_option,
    even_shares,
    group_cluster,
    loss_tail,
    pipeline_program,
    plan_stage,
    price_pipeline,
    price_stage,
    rank_aligned_buffers,
    rank_aligned_sends,
    stage_graph,
    stage_options,
)
from methods.auto.space import Candidate, candidates
from methods.auto.stage_plan import HapStages, machine_groups
from methods.common import group_table
from methods.graph import capture_config
from methods.hap.planner import HapPlanner
from methods.pipeline import PipelineParallel, SharedCosts
from tests.conftest import compose_config
from tests.unit.test_hap_planner import bert_workload, cluster

MB, M = 8, 4  # a micro-batch over a group, micro-batches an iteration


@functools.cache
def _stages(cuts: tuple[int, ...], alike: bool = False):
    """Tiny BERT cut at `cuts`, each stage planned by hap over one machine of two GPUs
    (cluster(k=2): a V100 machine, then P100 machines; `alike`: V100 machines only)."""
    wl = bert_workload(batch=MB * M)
    cl = ClusterSpec.from_config(_four_gpus()) if alike else cluster(k=2, fast=1, slow=2, virtual="gpu")
    graph = capture_config(wl.model_cfg, MB)
    table = group_table(graph)
    groups = [[0, 1], [2, 3], [4, 5]][: len(cuts) - 1]
    planner = HapPlanner(lp=False, num_segments=1, levels="cluster")
    S = len(cuts) - 1
    plans = []
    for s in range(S):
        st = stage_graph(graph, table, cuts[s], cuts[s + 1], loss=s + 1 < S)
        plans.append(plan_stage(planner, st, wl, group_cluster(cl, groups[s]), M))
    return wl, cl, table, groups, plans, loss_tail(graph, table)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_programs_simulated_price_is_the_prototypes(schedule):
    _, cl, table, groups, plans, tail = _stages((0, 1, 2, 4))
    cuts = [0, 1, 2, 4]
    assert table.num_groups == 4 and tail.kept_bytes > 0 and tail.forward and tail.backward
    shares = even_shares(MB, 2)
    program = pipeline_program(plans, groups, cuts, table, shares, schedule, M, cl.num_devices, tail=tail)
    sim = simulate(program, cl, None)
    prices = [
        price_stage(cand, one, group_cluster(cl, groups[s]), tail if s == 2 else None)
        for s, (cand, one) in enumerate(plans)
    ]
    sends = rank_aligned_sends(table, cuts, groups, MB, cl)
    held = rank_aligned_buffers(table, cuts, groups, MB)
    proto = price_pipeline(schedule, M, MB, prices, sends, 16.0, cl, held)
    assert sim.iter_time_s == pytest.approx(proto.iter_time_s, rel=1e-12)
    bare = price_stage(*plans[2], group_cluster(cl, groups[2]))  # the last stage's program alone
    assert prices[2].activations_gib == pytest.approx(bare.activations_gib + tail.kept_bytes / 2 / 2**30)
    assert prices[2].forward_s > bare.forward_s and prices[2].backward_s > bare.backward_s
    assert len(sim.peak_mem_gib) == cl.num_devices == len(sim.memory_gib)
    for s, g in enumerate(groups):  # every device its own peak; the busiest of a group the prototype's
        assert max(sim.peak_mem_gib[r] for r in g) == pytest.approx(proto.peaks_gib[s], rel=1e-12)
        flight = in_flight(program.actions[s])
        for r in g:
            assert sim.memory_gib[r]["activations"] == pytest.approx(flight * prices[s].activations_gib, rel=1e-9)
    assert sim.oom is False and sim.oom_devices == []
    tight = simulate(program, cl, None, memory_reserve_gib=16.0 - min(sim.peak_mem_gib) / 2)
    assert tight.oom and tight.oom_devices == list(range(cl.num_devices))


def test_data_parallel_stages_price_close_to_the_pipeline_methods_of_the_same_cuts():
    """hap with data parallelism in every stage (a plan of no collective but the gradients')
    against the pipeline method at the same cuts, ranks and micro-batches (the study's check)."""
    wl, cl = bert_workload(batch=MB * M), ClusterSpec.from_config(_four_gpus())
    theirs = PipelineParallel(
        schedule="1f1b", num_micro_batches=M, stage_level="machine", num_stages=2, work_probe=False, shares="equal"
    ).plan(wl, cl)
    cuts = tuple(st["groups"][0] for st in theirs.details["stages"]) + (4,)
    _, _, table, groups, plans, tail = _stages(cuts, alike=True)
    assert [sorted(st["ranks"]) for st in theirs.details["stages"]] == groups
    assert all(cand.kind == "data parallel" for cand, _ in plans)
    program = pipeline_program(plans, groups, list(cuts), table, even_shares(MB, 2), "1f1b", M, 4, tail=tail)
    mine, other = simulate(program, cl, None), simulate(theirs.program, cl, None)
    assert mine.iter_time_s == pytest.approx(other.iter_time_s, rel=0.05)


def _four_gpus() -> dict:
    return {
        "name": "t4",
        "machines": [{"count": 2, "device": "V100-16", "num_devices": 2}],
        "links": {
            "intra_machine": {"bandwidth_gbps": 66.0, "latency_s": 1e-5},
            "inter_machine": {"bandwidth_gbps": 10.0, "latency_s": 3e-5},
        },
        "virtual_device": "gpu",
    }


def test_a_group_pipeline_program_refuses_groups_that_do_not_cover_the_devices():
    _, cl, table, groups, plans, _ = _stages((0, 2, 4))
    with pytest.raises(ValueError, match="each of the 6 devices once"):
        pipeline_program(plans, groups, [0, 2, 4], table, even_shares(MB, 2), "1f1b", M, cl.num_devices)
    with pytest.raises(ValueError, match="several stages per rank"):
        pipeline_program(plans, groups, [0, 2, 4], table, even_shares(MB, 2), "interleaved1f1b", M, 4)


def test_the_family_is_its_own_composition_and_old_records_read_back():
    found = candidates("auto", "auto", "auto", "auto", [2, 4], [1, 2], [4])
    fam = [c for c in found if c.synthesis]
    assert fam == [Candidate(4, "replicated", synthesis=True)]  # no memory tools, replicated state
    assert fam[0].part == "hap_stages" and "hap's synthesis inside each stage" in fam[0].describe()
    assert Candidate(4, "replicated").part == "pipeline"
    assert not Candidate(4, "replicated").lighter_than(fam[0]) and not fam[0].lighter_than(Candidate(4, "replicated"))
    old = {"stages": 4, "state": "replicated", "split": "", "checkpointing": False, "grad_accumulation": 1}
    assert Candidate.from_json(old) == Candidate(4, "replicated")
    assert Candidate.from_json(json.loads(json.dumps(fam[0].to_json()))) == fam[0]
    assert candidates("auto", "auto", "auto", "auto", [2, 4], [1, 2], [4], True) == fam
    assert not [c for c in candidates("auto", "auto", "auto", "auto", [2, 4], [1, 2], [4], False) if c.synthesis]
    assert not [c for c in candidates("auto", "sharded", "auto", "auto", [2, 4], [1, 2], [4]) if c.synthesis]
    assert not [c for c in candidates(2, "auto", "auto", "auto", [2, 4], [1, 2], [4]) if c.synthesis]


def test_machines_of_one_gpu_or_unlike_sizes_offer_no_family():
    assert machine_groups(cluster(k=2))[0] == [[0, 1], [2, 3], [4, 5]]
    assert machine_groups(cluster(k=1))[1].endswith("one GPU each: a stage of one GPU is the pipeline's own")
    assert machine_groups(cluster(fast=1, slow=0, k=4))[1].endswith("has one machine: no pipeline of machines")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"stage_synthesis": "yes"}, "method.stage_synthesis='yes' is invalid; use auto, true or false"),
        ({"stage_synthesis": 1}, "method.stage_synthesis=1 is invalid"),
        ({"stage_synthesis": True, "stages": 1}, "which method.stages=1 rules out"),
        ({"stage_synthesis": True, "state": "sharded"}, "which method.state=sharded rules out"),
        ({"stage_synthesis": True, "activation_checkpointing": True}, "activation_checkpointing=true rules out"),
    ],
)
def test_the_option_refuses_in_one_line(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")) as e:
        Auto(None, None, None, None, **kwargs)
    assert "\n" not in str(e.value)


def test_forced_on_a_cluster_without_the_layout_is_one_line(tmp_path):
    auto = instantiate(compose_config("method=auto", "method.stage_synthesis=true", results_dir=str(tmp_path)).method)
    with pytest.raises(ConfigError, match="method.stage_synthesis=true needs one stage per machine .* one GPU each"):
        auto.space(bert_workload(), cluster(k=1))


def test_a_forced_plan_on_local_2x2_is_in_the_agreed_format(tmp_path):
    cfg = compose_config(
        "method=auto",
        "method.stage_synthesis=true",
        "method.pipeline.profile=false",
        "cluster=local_2x2",
        results_dir=str(tmp_path),
    )
    auto = instantiate(cfg.method)
    cl = ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True)).with_host_speed(1e10, 0.002)
    wl = bert_workload(batch=16, num_devices=4)
    plan = auto.plan(wl, cl)
    assert plan.details["auto"]["part"] == "hap_stages"
    d = json.loads(json.dumps(plan.details["hap_stages"]))  # plain JSON
    assert set(d) == {"cuts", "groups", "batch_shares", "micro_batch", "num_micro_batches", "schedule", "stages"}
    S, R = len(d["groups"]), len(d["groups"][0])
    assert (S, R) == (2, 2) and sorted(r for g in d["groups"] for r in g) == [0, 1, 2, 3]
    assert d["cuts"][0] == 0 and d["cuts"][-1] == group_table(capture_config(wl.model_cfg, 16)).num_groups
    assert sum(d["batch_shares"]) == d["micro_batch"] and d["micro_batch"] * d["num_micro_batches"] == 16
    assert d["schedule"] in ("1f1b", "gpipe") and len(d["stages"]) == S
    graph = capture_config(wl.model_cfg, d["micro_batch"])
    table = group_table(graph)
    for s, st in enumerate(d["stages"]):
        sg = stage_graph(graph, table, d["cuts"][s], d["cuts"][s + 1], loss=s + 1 < S)
        assert st["granularity"] == "gpu" and len(st["ratios"]) == 1 and len(st["ratios"][0]) == R
        assert {x["node"] for x in st["steps"]} <= {n.name for n in sg.graph.nodes}
        assert st["loss"] == sg.graph.loss and st["graph_fingerprint"]
    # the runner's view: every rank loads its pipeline's samples, and the price is the simulator's
    assert plan.batch_shares == [d["num_micro_batches"] * d["batch_shares"][i] for i in (0, 1, 0, 1)]
    assert plan.data_slices[0] == plan.data_slices[2] and plan.data_slices[1] == plan.data_slices[3]
    assert isinstance(plan.program, GroupPipelineProgram) and plan.ratios is None
    sim = simulate(plan.program, cl, None)
    chosen = plan.details["auto"]["candidates"][0]
    assert chosen["iter_time_s"] == sim.iter_time_s and len(sim.peak_mem_gib) == 4


def test_stages_alike_are_priced_once_and_planned_on_their_own_graphs_where_the_plan_is_kept(tmp_path):
    """Four stages of one layer group each on four alike machines: the two blocks' stages are
    alike, the second priced by the first's plan; the kept plan holds each stage's own."""
    cfg = compose_config("method=auto", "method.stage_synthesis=true", results_dir=str(tmp_path))
    wl, cl = bert_workload(batch=32, num_devices=8), cluster(fast=4, slow=0, k=2, virtual="gpu")
    plan = instantiate(cfg.method).plan(wl, cl)
    d = plan.details["hap_stages"]
    assert d["cuts"] == [0, 1, 2, 3, 4]
    graph = capture_config(wl.model_cfg, d["micro_batch"])
    table = group_table(graph)
    for s, st in enumerate(d["stages"]):
        own = stage_graph(graph, table, s, s + 1, loss=s < 3)
        assert st is not None and {x["node"] for x in st["steps"]} <= {n.name for n in own.graph.nodes}
    steps = [{x["node"] for x in st["steps"]} for st in d["stages"]]
    assert steps[1] != steps[2]  # the blocks' own nodes, not the first block's twice
    assert plan.details["auto"]["candidates"][0]["iter_time_s"] == simulate(plan.program, cl, None).iter_time_s


@pytest.mark.parametrize("fast, slow", [(1, 2), (3, 0)])
def test_the_familys_floor_is_below_its_price(tmp_path, fast, slow):
    """The floor the search prunes the family by (its stages' data-parallel compute in its
    schedule, nothing else) never passes the price of its plan."""
    auto = instantiate(compose_config("method=auto", results_dir=str(tmp_path)).method)
    wl, cl = bert_workload(batch=32, num_devices=6), cluster(fast=fast, slow=slow, k=2, virtual="gpu")
    part = HapStages(auto.hap, auto.pipeline, 3, lr=auto.lr)
    shared = SharedCosts(wl, cl)
    floor = part.floor_s(wl, cl, shared)
    price = simulate(part.plan(wl, cl, shared).program, cl, None).iter_time_s
    assert 0 < floor <= price


def test_cuts_that_leave_a_tied_parameter_on_two_stages_are_refused(tmp_path, monkeypatch):
    """A tied embedding and head read by two stages: the stages' programs hold no copy of it."""
    import methods.auto.stage_plan as stage_plan

    seen = []

    def tied(table, cuts, stage_rank):
        seen.append(list(cuts))
        return [("tok_embedding.weight", (0, len(cuts) - 2))]

    monkeypatch.setattr(stage_plan, "tied_params", tied)
    auto = instantiate(compose_config("method=auto", results_dir=str(tmp_path)).method)
    wl, cl = bert_workload(batch=32, num_devices=6), cluster(fast=3, slow=0, k=2, virtual="gpu")
    with pytest.raises(ConfigError, match=r"leave tied parameter 'tok_embedding.weight' on stages \[0, 2\]"):
        HapStages(auto.hap, auto.pipeline, 3).plan(wl, cl)
    assert seen and seen[0][0] == 0 and seen[0][-1] == 4


def test_each_stage_keeps_the_option_that_makes_the_pipeline_faster(tmp_path):
    """A stage of several layer groups has two programs (the search of the whole stage, the
    groups planned alone in a row); the part keeps per stage the one that prices the pipeline
    lower, never above every stage's search of the whole stage, nor above the options that
    are best by each stage's own score."""
    auto = instantiate(compose_config("method=auto", results_dir=str(tmp_path)).method)
    wl, cl = bert_workload(batch=32, num_devices=4), cluster(fast=1, slow=1, k=2, virtual="gpu")
    part = HapStages(auto.hap, auto.pipeline, 2, lr=auto.lr)
    plan = part.plan(wl, cl)
    price = simulate(plan.program, cl, None).iter_time_s
    _, _, planner, stages, plans, _, groups, cuts, table, shares, m, meta, tail, choice = part._made
    assert any(cuts[s + 1] - cuts[s] > 1 for s in range(len(stages)))
    options = [stage_options(planner, st, wl, group_cluster(cl, g), m) for st, g in zip(stages, groups)]
    assert [len(o) for o in options] == [1 + (cuts[s + 1] - cuts[s] > 1) for s in range(len(stages))]
    assert [o[c][0].kind for o, c in zip(options, choice)] == [c.kind for c, _ in plans]
    schedule = plan.details["schedule"]
    for start in ([o[0] for o in options], [o[best_option(o)] for o in options]):
        program = pipeline_program(start, groups, cuts, table, shares, schedule, m, cl.num_devices, meta, tail)
        assert price <= simulate(program, cl, None).iter_time_s


def test_the_stages_options_are_chosen_by_the_pipelines_price_alike_stages_together(monkeypatch):
    """HapStages._choose: per stage one of its options, changed one stage at a time and for
    the stages alike in structure (one options list) together, while the pipeline's price
    (simulate of its program) falls: here only both alike stages switched make it faster."""
    import types

    import methods.auto.stage_plan as stage_plan

    def option(t):
        return (types.SimpleNamespace(kind=str(t), iter_time_s=t, oom_devices=(), oom=False, ratios=[[0.5, 0.5]]), t)

    alike = [option(1.0), option(2.0)]  # the second worse by the stage's own score
    options = [[option(1.0)], alike, alike]
    prices = {(1.0, 1.0, 1.0): 2.0, (1.0, 2.0, 1.0): 2.1, (1.0, 1.0, 2.0): 2.1, (1.0, 2.0, 2.0): 1.5}
    monkeypatch.setattr(stage_plan, "pipeline_program", lambda plans, *a: tuple(one for _, one in plans))
    sim = lambda program, cluster, ratios: types.SimpleNamespace(oom=False, iter_time_s=prices[program])  # noqa: E731
    monkeypatch.setattr(stage_plan, "simulate", sim)
    part = HapStages(None, None, 3)
    cl = types.SimpleNamespace(num_devices=6)
    key, schedule, program, choice = part._choose(options, None, None, None, None, "gpipe", 4, cl, None, None)
    assert (key, schedule, program, choice) == ((False, 1.5), "gpipe", (1.0, 2.0, 2.0), [0, 1, 1])
