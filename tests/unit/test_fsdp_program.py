"""FSDP's units and Program (methods/fsdp.py): which modules each layer group shards, the
collectives an iteration prices, FSDP2's padded shards, and prefetching on GPUs."""

from __future__ import annotations

import functools

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from bench.core.cluster import ClusterSpec
from bench.core.interfaces import Workload
from bench.cost import simulate
from methods.common import group_table
from methods.fsdp import FullyShardedDP, fsdp_program, fsdp_units, shard_bytes
from methods.graph import capture_config
from tests.conftest import compose_config


@functools.cache
def _graph(model: str, batch: int = 8, preset: str = "tiny"):
    spec = instantiate(compose_config(f"model={model}", f"preset={preset}").model.spec, num_devices=2)
    graph = capture_config(spec, batch)
    return spec, graph, group_table(graph)


def _params(graph) -> list[str]:
    return [str(n.fx_node.target) for n in graph.nodes if n.is_param]


def test_each_layer_group_is_one_unit_and_the_models_own_parameters_stay_with_the_root():
    _, graph, table = _graph("bert")
    units, root = fsdp_units(table, _params(graph))
    assert [mods for _, mods in units] == [["tok_embedding"], ["blocks.0"], ["blocks.1"], ["ln_f", "head"]]
    assert root == ["pos_embedding"]


@pytest.mark.parametrize("model", ["vgg19", "vit", "bert", "bert_moe"])
def test_every_parameter_is_sharded_by_exactly_one_unit_or_the_root(model):
    _, graph, table = _graph(model)
    params = _params(graph)
    units, root = fsdp_units(table, params)
    owned = [p for _, mods in units for p in params if any(p.startswith(m + ".") for m in mods)] + root
    assert sorted(owned) == sorted(params)


def test_shards_pad_dim_0_to_the_ranks():
    assert shard_bytes((10, 4), 4, 4) == 3 * 4 * 4  # ceil(10 / 4) rows of 4 floats
    assert shard_bytes((8,), 4, 2) == 16 and shard_bytes((), 4, 8) == 4


@pytest.mark.parametrize("reshard", [True, False])
def test_an_iteration_gathers_each_unit_before_use_and_scatters_its_gradients_once(reshard):
    _, graph, table = _graph("bert")
    units, _root = fsdp_units(table, _params(graph))
    program = fsdp_program(graph, table, 2, 16, reshard_after_forward=reshard)
    kinds = [c.kind for st in program.stages for c in st.collectives]
    assert kinds.count("all_gather") == 1 + len(units) * (2 if reshard else 1)  # the root's once
    assert kinds.count("reduce_scatter") == 1 + len(units)
    # A unit is gathered before its forward and (resharded) again before its backward, and its
    # gradients are scattered after its backward.
    events = [e for st in program.stages for e in [c.label for c in st.collectives] + [st.label]]
    for g, _ in units:
        gathers = [i for i, e in enumerate(events) if e == f"unit {g} params"]
        assert gathers[0] < events.index(f"forward group {g}")
        if reshard:
            assert (
                events.index(f"forward group {len(table.groups) - 1}")
                < gathers[1]
                < events.index(f"backward group {g}")
            )
        assert events.index(f"unit {g} grads") > events.index(f"backward group {g}")


def test_on_gpus_the_next_units_gather_hides_behind_this_units_compute():
    spec, _, _ = _graph("bert", preset="paper")
    cfg = compose_config("cluster=paper_hetero", "cluster.gpus_per_machine=1")
    cluster = ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))
    workload = Workload("bert", "paper", spec, 8 * 64, 1.0)
    graph = capture_config(spec, workload.global_batch)
    table = group_table(graph)
    ratios = [[1 / 8] * 8]
    sync = simulate(fsdp_program(graph, table, 8, 512, prefetch=False), cluster, ratios).iter_time_s
    prefetched = simulate(fsdp_program(graph, table, 8, 512, prefetch=True), cluster, ratios).iter_time_s
    assert prefetched < sync
    plan = FullyShardedDP("fsdp", work_probe=False).plan(workload, cluster)
    assert any(st.overlap for st in plan.program.stages)  # paper_hetero's GPUs prefetch
