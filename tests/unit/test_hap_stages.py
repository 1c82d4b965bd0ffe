"""The hap-in-stages prototype (methods/auto/hap_stages.py): a stage's sub-graph, its
boundary conditions, hap's plan of it over a group, and the lockstep replay of a pipeline."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from bench.core.cluster import ClusterSpec
from bench.core.interfaces import Workload
from methods.auto.hap_stages import (
    BOUNDARY,
    CHAIN,
    StagePrice,
    group_cluster,
    plan_chain,
    plan_stage,
    price_pipeline,
    price_stage,
    rank_aligned_buffers,
    search_stage,
    stage_details,
    stage_graph,
    stage_options,
    stage_program,
    stage_theory,
)
from methods.common import group_table
from methods.graph import capture_config
from methods.hap.balance import batch_shares
from methods.hap.codegen import PlanMismatchError, RankProgram
from methods.hap.planner import HapPlanner
from methods.hap.theory import REDUCE
from tests.conftest import compose_config

BATCH = 8


@functools.cache
def _case():
    cfg = compose_config("model=bert", "cluster=paper_hetero", "cluster.gpus_per_machine=2")
    spec = instantiate(cfg.model.spec, num_devices=4)
    workload = Workload("bert", "tiny", spec, BATCH, flops_per_sample=1.0)
    cluster = ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))
    graph = capture_config(spec, BATCH)
    return workload, cluster, graph, group_table(graph)


def test_a_middle_stage_reads_its_border_and_ends_in_the_boundary():
    _, _, graph, table = _case()
    assert table.num_groups >= 3
    st = stage_graph(graph, table, 1, 2)
    assert st.crossing_in and st.crossing_out and not st.model_inputs
    assert st.graph.loss == BOUNDARY and st.graph[BOUNDARY].inputs == st.crossing_out
    assert all(st.graph[t].kind == "placeholder" for t in st.crossing_in)
    ops = [n for n in st.graph.nodes if n.name in table.node_group and n.name not in st.crossing_in]
    assert {table.node_group[n.name] for n in ops} == {1}
    flops = sum(n.flops for n in ops) / BATCH
    assert flops == pytest.approx(sum(table.groups[1].forward_flops.values()))


def test_the_last_stage_keeps_the_models_loss():
    _, _, graph, table = _case()
    last = table.num_groups - 1
    st = stage_graph(graph, table, last, last + 1)
    assert st.last and st.graph.loss == graph.loss and st.crossing_in


def test_a_last_stage_without_its_loss_hands_on_what_the_loss_reads_in_whole_samples():
    _, _, graph, table = _case()
    last = table.num_groups - 1
    st = stage_graph(graph, table, last, last + 1, loss=False)
    assert st.ends_at_loss and not st.last and st.graph.loss == BOUNDARY
    tail = set(table.tail)
    assert not tail & {n.name for n in st.graph.nodes}
    assert not set(table.targets) & set(st.inputs)  # the targets go to the schedule's loss_fn
    read = {i for t in tail for i in graph[t].inputs} - tail - set(table.targets)
    assert set(st.crossing_out) == read
    (rule,) = stage_theory(st).rules[BOUNDARY]
    # the logits flattened to samples x positions: batch-split all the same
    assert any(graph[t].shape[0] > BATCH for t in st.crossing_out)
    assert rule.pre == (0,) * len(st.crossing_out) and rule.post == REDUCE


def test_the_boundary_conditions_are_batch_splits():
    _, _, graph, table = _case()
    st = stage_graph(graph, table, 1, 2)
    theory = stage_theory(st)
    for t in st.crossing_in:
        assert theory.sources[t] == [0]
    (rule,) = theory.rules[BOUNDARY]
    assert rule.pre == (0,) * len(st.crossing_out) and rule.post == REDUCE


def test_a_stage_planned_over_a_group_starts_and_ends_batch_split():
    workload, cluster, graph, table = _case()
    group = group_cluster(cluster, [0, 1])
    assert group.num_devices == 2 and group.devices[0].type.name == cluster.devices[0].type.name
    st = stage_graph(graph, table, 1, 2)
    cand, one = plan_stage(HapPlanner(lp=False, num_segments=1), st, workload, group, micro_batches=4)
    steps = {s.node: s for s in cand.result.steps}
    created = {t: layout for s in cand.result.steps for t, layout in s.sources}
    assert all(created[t] == 0 for t in st.crossing_in)
    boundary = steps[BOUNDARY]
    for t, pre in zip(st.crossing_out, boundary.rule.pre):
        assert pre == 0
        moved = [c for c in boundary.comms if c.tensor == t]
        assert steps[t].rule.post == 0 or (moved and moved[-1].dst == 0)
    price = price_stage(cand, one, group)
    assert price.forward_s > 0 and price.backward_s > price.forward_s * 0.5
    assert one.micro_steps == 1 and price.peak_gib > price.state_gib > 0


def test_a_group_is_whole_machines_of_one_kind():
    _, cluster, _, _ = _case()
    with pytest.raises(ValueError, match="whole machines"):
        group_cluster(cluster, [0])
    with pytest.raises(ValueError, match="mix"):
        group_cluster(cluster, list(range(cluster.num_devices)))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_uniform_stages_replay_to_the_textbook_pipeline(schedule: str):
    _, cluster, _, _ = _case()
    S, m = 4, 8
    p = StagePrice(1.0, 2.0, 0.5, 0.25, 1.0, 0.1, 0.5, chosen="synthesis")
    got = price_pipeline(schedule, m, BATCH, [p] * S, [0.0] * S, 16.0, cluster)
    assert got.iter_time_s == pytest.approx((m + S - 1) * 3.0 + 0.5 + 0.25)
    flights = [min(m, S - k) for k in range(S)] if schedule == "1f1b" else [m] * S
    assert got.peaks_gib == pytest.approx(tuple(1.0 + (f - 1) * 0.1 for f in flights))
    held = price_pipeline(schedule, m, BATCH, [p] * S, [0.0] * S, 16.0, cluster, [2**27] * S)
    assert held.peaks_gib == pytest.approx(tuple(x + m / 8 for x in got.peaks_gib))


def test_receive_buffers_are_the_busiest_ranks_share_of_both_borders():
    table = _case()[3]
    cuts = [0, 1, 2, table.num_groups]
    groups = [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    got = rank_aligned_buffers(table, cuts, groups, 8)
    out = [table.groups[c - 1].out_bytes for c in cuts[1:-1]]
    assert got == pytest.approx([3 * out[0], 3 * (out[0] + out[1]), 3 * out[1]])


def test_a_stage_program_returns_what_its_boundary_reads():
    """A middle stage's program hands on its crossing tensors (tests/e2e/test_hap_stages_runtime.py
    runs it); other outputs than the boundary's inputs, or a machine-level plan, are refused."""
    workload, cluster, graph, table = _case()
    st = stage_graph(graph, table, 0, 1)
    cand, _ = plan_stage(
        HapPlanner(lp=False, num_segments=1, levels="cluster"), st, workload, group_cluster(cluster, [0, 1])
    )
    details = stage_details(cand, st)
    shares = batch_shares(BATCH, details["ratios"][0])
    model = workload.build(0)
    assert stage_program(st, details, shares, model, 1, 2).outputs == st.crossing_out
    with pytest.raises(PlanMismatchError, match="must read exactly"):
        RankProgram(st.graph, details, details["ratios"], shares, model, 0, 2, outputs=["tokens"])
    with pytest.raises(ValueError, match="machine-level"):
        stage_program(st, {**details, "granularity": "machine"}, shares, model, 0, 2)


@functools.cache
def _moe_case():
    cfg = compose_config("model=bert_moe", "cluster=paper_hetero", "cluster.gpus_per_machine=2")
    spec = instantiate(cfg.model.spec, num_devices=4)
    workload = Workload("bert_moe", "tiny", spec, BATCH, flops_per_sample=1.0)
    cluster = ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))
    graph = capture_config(spec, BATCH)
    return workload, cluster, graph, group_table(graph)


@pytest.mark.parametrize("m", [1, 4])
def test_a_stage_as_its_layer_groups_in_a_row_is_one_program_priced_as_their_sum(m):
    """plan_chain: the groups' own programs joined into one program of the stage's graph (each
    op and each source once), whose forward and backward a micro-batch are the groups' summed;
    plan_stage keeps the faster of it and the search of the whole stage."""
    workload, cluster, graph, table = _moe_case()
    group = group_cluster(cluster, [0, 1])
    planner = HapPlanner(lp=False, num_segments=1, cache_dir=None, levels="cluster")
    st = stage_graph(graph, table, 1, table.num_groups, loss=False)
    chained = plan_chain(planner, st, workload, group, m)
    assert chained is not None and chained[0].kind == CHAIN
    steps = chained[0].result.steps
    assert [s.node for s in steps] == [n for n in (x.name for x in st.graph.nodes) if n in {s.node for s in steps}]
    assert len({s.node for s in steps}) == len(steps)
    sources = [t for s in steps for t, _ in s.sources]
    assert len(set(sources)) == len(sources) and set(sources) <= {
        n.name for n in st.graph.nodes if n.kind != "call_function"
    }
    parts = []
    for i in range(1, table.num_groups):
        own = stage_graph(graph, table, i, i + 1, loss=False)
        parts.append(price_stage(*search_stage(planner, own, workload, group, m), group))
    whole = price_stage(*chained, group)
    assert whole.forward_s == pytest.approx(sum(p.forward_s for p in parts), rel=1e-9)
    assert whole.backward_s == pytest.approx(sum(p.backward_s for p in parts), rel=1e-9)
    searched = search_stage(planner, st, workload, group, m)[0]
    kept = plan_stage(planner, st, workload, group, m)[0]
    assert kept.iter_time_s == min(searched.iter_time_s, chained[0].iter_time_s)
    assert plan_chain(planner, stage_graph(graph, table, 1, 2), workload, group, m) is None  # one group


def test_a_planner_with_unlabelled_micro_steps_plans_and_prices_a_stage_alike():
    """HapStages' planner (label_micro_steps=False: the schedule's micro-batches share one
    micro-step's stages) finds the same options, at the same prices, as a labelled one."""
    workload, cluster, graph, table = _moe_case()
    group = group_cluster(cluster, [0, 1])
    labelled = HapPlanner(lp=False, num_segments=1, cache_dir=None, levels="cluster")
    bare = dataclasses.replace(labelled, label_micro_steps=False)
    assert bare.options() == labelled.options()
    st = stage_graph(graph, table, 1, table.num_groups, loss=False)
    a, b = (stage_options(p, st, workload, group, 16) for p in (labelled, bare))
    assert len(a) == len(b) == 2
    for (ca, oa), (cb, ob) in zip(a, b):
        assert (ca.kind, ca.ratios, ca.iter_time_s, ca.oom_devices) == (
            cb.kind,
            cb.ratios,
            cb.iter_time_s,
            cb.oom_devices,
        )
        assert ca.result.steps == cb.result.steps and oa == ob
        assert len(ca.program.stages) == len(cb.program.stages)
        assert len({id(s) for s in cb.program.stages}) < len({id(s) for s in ca.program.stages})
