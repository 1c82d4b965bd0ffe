"""The cp_vs_ev figure's parts: the tensor-parallel program space really keeps the whole batch
on every device and shards the weights, the method reaches the runner through the experiment
file (not conf/method/), the LP's ratios are never slower than EV or CP, and the figure writes
the data it plots (simulated half only: no workers here)."""

from __future__ import annotations

import pandas as pd
import pytest
from hydra.utils import instantiate

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.cost import simulate
from bench.runner.case import build_workload, new_record, prepare_case
from bench.runner.configs import group_options, instantiate_plugin, methods_supporting
from bench.studies import paper_figures
from methods.graph import capture_config
from methods.hap import tensor_parallel as tp
from methods.hap.runtime import FixedPlanMethod
from methods.hap.theory import IDENTITY, REDUCE, derive_theory, tensor_parallel_theory
from models.bert import BertConfig

BATCH = 3  # no other dim of the tiny BERT is 3 or 3 x 64 long


def batch_dims(graph, name: str) -> set[int]:
    """Dims of a tensor that run over the samples: length B, or B x S after a flatten."""
    node = graph[name]
    shape = node.shape if node.shape is not None else node.tuple_shapes[0]
    seq = BertConfig.from_preset("tiny").seq_len
    return {d for d, n in enumerate(shape) if n in (BATCH, BATCH * seq)}


def test_the_tensor_parallel_theory_never_splits_the_batch_and_shards_every_weight_matrix():
    graph = capture_config(BertConfig.from_preset("tiny"), BATCH)
    full = derive_theory(graph, sfb=True, grouped=False)
    theory = tensor_parallel_theory(full)

    def batch_split(rule) -> list:
        layouts = list(zip(graph[rule.node].inputs, rule.pre)) + list(rule.shape_pre) + [(rule.node, rule.post)]
        return [(t, lay) for t, lay in layouts if isinstance(lay, int) and lay in batch_dims(graph, t)]

    assert any(batch_split(r) for rs in full.rules.values() for r in rs)  # the full space has them
    for name, rules in theory.rules.items():
        assert rules, f"{name} has no rule left"
        for r in rules:
            assert not batch_split(r) and not r.sfb, r.describe()
    for t, layouts in theory.sources.items():
        node = graph[t]
        if node.kind == "placeholder":
            assert layouts == [IDENTITY]
        elif node.is_param and sum(n > 1 for n in node.shape) >= 2:
            assert layouts and IDENTITY not in layouts, t

    # The program the search finds: Megatron-style, every linear sharded, activations moved.
    cluster = ClusterSpec.from_config(paper_figures._cfg("cluster=motivation").cluster)
    point = tp.synthesize_at(theory, cluster, [[0.25] * 4], "EV")
    linears = [s for s in point.result.steps if graph[s.node].op == "linear"]
    assert linears and all(isinstance(s.rule.pre[1], int) for s in linears)
    # column parallel (weight rows split, output features split) and row parallel (weight
    # columns split, partial sums)
    out_dims = {len(graph[s.node].shape) - 1 for s in linears}
    assert {(s.rule.pre[1], s.rule.post if s.rule.post == REDUCE else "last") for s in linears} == {
        (0, "last"),
        (1, REDUCE),
    } and len(out_dims) == 1
    kinds = {c.kind for s in point.result.steps for c in s.comms}
    assert {"all_reduce", "all_gather"} <= kinds
    assert all(c.impl in ("padded", "ring") for s in point.result.steps for c in s.comms)


def tp_cases(setting: dict, d_model: int, mode: str) -> dict:
    """Each ratio choice's case of conf/experiment/cp_vs_ev.yaml, prepared by the runner."""
    cases = {}
    for point in paper_figures.tp_points(setting, d_model, mode):
        cfg = paper_figures._cfg(*point)
        cases[cfg.method["ratios"]] = prepare_case(cfg, new_record(cfg))
    return cases


def test_the_tensor_parallel_method_is_an_experiments_not_a_compared_one():
    cfg = paper_figures._cfg("experiment=cp_vs_ev")
    method = instantiate(cfg.method)
    assert type(method) is tp.TensorParallel and method.ratios == "EV" and set(method.modes) == {"sim", "real"}
    assert method.name not in group_options("method")  # bench.compare runs conf/method options only
    assert method.name not in methods_supporting("sim") and method.name not in methods_supporting("real")
    assert [p[1] for p in paper_figures.sweep_points("cp_vs_ev")] == [f"method.ratios={c}" for c in tp.CHOICES]
    with pytest.raises(ConfigError, match=r"^method.ratios='XY' is invalid; valid: EV, CP, LP$"):
        instantiate_plugin(paper_figures._cfg("experiment=cp_vs_ev", "method.ratios=XY").method, "method")


@pytest.mark.parametrize("d_model,faster", [(128, "EV"), (4096, "CP")])
def test_lp_ratios_are_never_slower_than_even_or_compute_proportional(d_model, faster):
    cases = tp_cases({**paper_figures.CP_VS_EV_SIM, "num_layers": 1}, d_model, "sim")
    times = {c: simulate(case.plan.program, case.cluster, case.plan.ratios).iter_time_s for c, case in cases.items()}
    assert times["LP"] <= min(times["EV"], times["CP"]) * (1 + 1e-6), times
    # Communication-bound: even shards win; compute-bound: compute-proportional ones.
    assert times[faster] < times["CP" if faster == "EV" else "EV"], times
    # The LP lands on EV's or CP's ratios here (two speeds): then it plans their very program.
    assert cases["LP"].plan.details["steps"] == cases[faster].plan.details["steps"]
    assert cases["LP"].plan.ratios == cases[faster].plan.ratios


def test_every_ratio_choice_plans_a_plan_the_runtime_accepts():
    cfg = paper_figures._cfg(*paper_figures.tp_points(paper_figures.CP_VS_EV_REAL, 16, "real")[0])
    cluster = ClusterSpec.from_config(cfg.cluster).with_host_speed(1e10)
    workload = build_workload(cfg, cluster)
    for choice in tp.CHOICES:
        plan = tp.TensorParallel(ratios=choice).plan(workload, cluster)
        assert plan.method == "tensor_parallel" and sum(plan.batch_shares) == workload.global_batch
        assert FixedPlanMethod(plan).plan(workload, cluster) is plan  # checks it fits, no workers


def test_a_machine_level_cluster_is_refused_in_one_line():
    cfg = paper_figures._cfg("experiment=cp_vs_ev", "mode=sim", "cluster=paper_hetero")
    with pytest.raises(
        ConfigError,
        match=r"^cluster.virtual_device=machine \(cluster=paper_hetero\).*"
        r"use cluster.virtual_device=gpu$",
    ):
        prepare_case(cfg, new_record(cfg))


def test_the_figure_writes_png_pdf_and_the_csv_it_plots(tmp_path, monkeypatch):
    monkeypatch.setitem(paper_figures.CP_VS_EV_SIM, "num_layers", 1)
    paper_figures.fig_cp_vs_ev(tmp_path, sim_dims=(64, 256), real_dims=())
    data = pd.read_csv(tmp_path / "cp_vs_ev.csv")
    assert list(data.columns) == [
        "origin",
        "cluster",
        "d_model",
        "num_heads",
        "num_layers",
        "global_batch",
        "ratios",
        "ratio_values",
        "iter_time_s",
        "iter_time_std_s",
        "samples_per_s",
        "predicted_iter_time_s",
        "predicted_comm_s",
        "predicted_compute_s",
        "oom",
        "measured_run_of",
    ]
    assert len(data) == 6 and set(data.ratios) == {"EV", "CP", "LP"} and set(data.origin) == {"simulated"}
    assert (data.samples_per_s > 0).all() and (data.iter_time_s == data.predicted_iter_time_s).all()
    assert (tmp_path / "cp_vs_ev.png").stat().st_size > 0 and (tmp_path / "cp_vs_ev.pdf").stat().st_size > 0
