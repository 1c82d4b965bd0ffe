"""The planner's graph kept on disk (methods.graph_cache) and DTensor's derivations kept on disk
(methods.hap.dtensor_rules) and torch's pipeline schedules traced (methods.pipeline.schedule): what
comes back equals a fresh capture or trace, and a damaged entry is never trusted."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import compose_config

import methods.graph as graph_module
from bench.runner.configs import instantiate_plugin
from bench.runner.settings import as_settings
from methods import graph_cache
from methods.hap import dtensor_rules
from methods.hap.theory import derive_theory
from methods.pipeline import schedule


def model_config(*overrides: str):
    cfg = as_settings(compose_config(*overrides))
    return instantiate_plugin(cfg.model["spec"], "model.spec", num_devices=2)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of this test's, and no graph kept in this process."""
    monkeypatch.setenv("HETBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("HETBENCH_GRAPH_CACHE", raising=False)
    graph_module._captured.clear()
    yield tmp_path / "graphs"
    graph_module._captured.clear()


def signature(graph) -> list:
    """Everything the planner reads of a graph's nodes, and the module's code."""
    nodes = [
        (
            n.name,
            n.kind,
            n.op,
            tuple(n.inputs),
            n.shape,
            n.dtype,
            n.flops,
            n.backward_factor,
            n.is_param,
            n.tuple_shapes,
        )
        for n in graph.nodes
    ]
    stacks = [n.fx_node.meta.get("nn_module_stack") for n in graph.nodes]
    return [nodes, stacks, graph.gm.code, graph.loss, graph.batch_size, graph.saved_bytes_factor()]


def fresh(model_cfg, batch: int, monkeypatch):
    monkeypatch.setenv("HETBENCH_GRAPH_CACHE", "0")
    graph_module._captured.clear()
    try:
        return graph_module.capture_config(model_cfg, batch)
    finally:
        monkeypatch.delenv("HETBENCH_GRAPH_CACHE")
        graph_module._captured.clear()


@pytest.mark.parametrize(
    "overrides",
    [("model=bert",), ("model=bert_moe",), ("model=vit",), ("model=vgg19",), ("model=hf", "model.arch=gpt2")],
    ids=lambda o: o[-1],
)
def test_a_kept_graph_is_the_capture_and_gives_the_same_triples(cache, monkeypatch, overrides):
    cfg = model_config(*overrides)
    made = graph_module.capture_config(cfg, 6)  # captured, then written (under both batch norm keys: it has none)
    assert len(list(cache.glob("*.pt"))) == 2
    graph_module._captured.clear()
    kept = graph_module.capture_config(cfg, 6)  # read back
    assert kept is not made
    assert signature(kept) == signature(made) == signature(fresh(cfg, 6, monkeypatch))
    assert all(isinstance(n.fx_node.meta["val"], torch.Tensor) for n in kept.nodes if n.shape is not None)
    constants = {k: v for k, v in made.gm.named_buffers() if not v.is_meta}
    assert all(torch.equal(dict(kept.gm.named_buffers())[k], v) for k, v in constants.items())
    assert derive_theory(kept).rules == derive_theory(made).rules


def test_each_thing_a_capture_reads_has_its_own_entry(cache):
    tiny, other = model_config("model=bert"), model_config("model=bert", "+model.spec.num_layers=3")
    keys = {
        graph_cache.graph_key(tiny, 8, "sync"),
        graph_cache.graph_key(tiny, 16, "sync"),
        graph_cache.graph_key(tiny, 8, "local"),
        graph_cache.graph_key(other, 8, "sync"),
    }
    assert len(keys) == 4 and graph_cache.graph_key(tiny, 8, "sync") == graph_cache.graph_key(tiny, 8, "sync")


@pytest.mark.parametrize("damage", ["cut short", "garbage", "another format", "another key", "empty"])
def test_a_damaged_entry_is_captured_again_and_rewritten(cache, damage, caplog):
    cfg = model_config("model=bert")
    good = signature(graph_module.capture_config(cfg, 4))
    path = cache / f"{graph_cache.graph_key(cfg, 4, 'sync')}.pt"
    body = path.read_bytes()
    if damage == "cut short":  # what a process killed mid-write would leave without the rename
        path.write_bytes(body[: len(body) // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a graph" * 10)
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        data = torch.load(path, weights_only=True)
        data["format" if damage == "another format" else "key"] += 1 if damage == "another format" else "x"
        torch.save(data, path)
    graph_module._captured.clear()
    with caplog.at_level("WARNING", logger="methods.graph_cache"):
        again = graph_module.capture_config(cfg, 4)
    assert signature(again) == good
    assert "unreadable" in caplog.text
    assert graph_cache.load_module(path.stem) is not None  # rewritten whole


def test_a_model_without_batch_norm_is_captured_once_for_both_captures_of_it(cache, monkeypatch):
    cfg = model_config("model=bert")
    local = graph_module.capture_config(cfg, 4, batch_norm="local")
    graph_module._captured.clear()
    monkeypatch.setattr(graph_module, "_export_config", lambda *a: pytest.fail("exported again"))
    assert signature(graph_module.capture_config(cfg, 4, batch_norm="sync")) == signature(local)


def test_a_model_with_batch_norm_keeps_each_capture_apart(cache):
    cfg = model_config(
        "model=custom",
        "model.factory=tests.zoo_custom:build_bn",
        "model.inputs=[{shape:[3,8,8],dtype:float32},{shape:[],dtype:int64,high:10}]",
    )
    sync = graph_module.capture_config(cfg, 4)
    assert graph_module.module_has_batch_norm(sync.gm) and len(list(cache.glob("*.pt"))) == 1
    local = graph_module.capture_config(cfg, 4, batch_norm="local")
    assert "batch_norm" in {n.op for n in local.ops} and "batch_norm" not in {n.op for n in sync.ops}


def test_a_half_written_file_is_never_read(cache):
    cfg = model_config("model=bert")
    key = graph_cache.graph_key(cfg, 4, "sync")
    cache.mkdir(parents=True)
    (cache / f".{key}.abc.tmp").write_bytes(b"partial")  # a writer killed before its rename
    assert graph_cache.load_module(key) is None
    graph_module.capture_config(cfg, 4)
    assert graph_cache.load_module(key) is not None


def test_kept_derivations_give_the_same_triples_and_damage_is_derived_again(cache, monkeypatch):
    graph = graph_module.capture_config(model_config("model=bert_moe"), 4)
    monkeypatch.setattr(dtensor_rules, "_cache", {})
    monkeypatch.setattr(dtensor_rules._STORE, "_read", None)
    derived = derive_theory(graph).rules  # derived, then kept on disk
    path = dtensor_rules._STORE.path()
    assert path.is_file()
    monkeypatch.setattr(dtensor_rules, "_cache", {})
    monkeypatch.setattr(dtensor_rules._STORE, "_read", None)
    monkeypatch.setattr(dtensor_rules, "_derive", lambda *a: pytest.fail("derived although kept"))
    assert derive_theory(graph).rules == derived
    monkeypatch.undo()
    monkeypatch.setenv("HETBENCH_CACHE_DIR", str(cache.parent))
    path.write_text("{ not json")
    monkeypatch.setattr(dtensor_rules, "_cache", {})
    monkeypatch.setattr(dtensor_rules._STORE, "_read", None)
    assert derive_theory(graph).rules == derived
    assert dtensor_rules._STORE.load()  # rewritten


def _forget_schedules(monkeypatch) -> None:
    monkeypatch.setattr(schedule, "_orders", {})
    monkeypatch.setattr(schedule, "_traces", {})
    monkeypatch.setattr(schedule, "_unsaved", {})
    monkeypatch.setattr(schedule._KEPT, "_read", None)


SHAPES = [("interleaved1f1b", 2, 3, 2), ("loopedbfs", 2, 4, 2), ("zbvzerobubble", 2, 4, 2)]


def test_kept_schedule_traces_are_torchs_and_damage_is_traced_again(cache, monkeypatch):
    _forget_schedules(monkeypatch)
    traced = {s: (schedule.compute_order(*s), schedule.trace_schedule(s[0], s[1], s[2], 1, s[3])) for s in SHAPES}
    with pytest.raises(schedule.ScheduleRefused) as refused:
        schedule.compute_order("1f1b", 2, 1, 1)  # torch's own check refuses it
    schedule.save_traces()
    path = schedule._KEPT.path()
    assert path.is_file()
    _forget_schedules(monkeypatch)
    monkeypatch.setattr(schedule, "_compute_order", lambda *a: pytest.fail("traced although kept"))
    monkeypatch.setattr(schedule, "_trace", lambda *a: pytest.fail("traced although kept"))
    for s, (order, trace) in traced.items():
        assert schedule.compute_order(*s) == order
        assert schedule.trace_schedule(s[0], s[1], s[2], 1, s[3]) == trace
    with pytest.raises(schedule.ScheduleRefused, match=re.escape(str(refused.value))):
        schedule.compute_order("1f1b", 2, 1, 1)
    monkeypatch.undo()
    monkeypatch.setenv("HETBENCH_CACHE_DIR", str(cache.parent))
    path.write_text('{"[\\"order\\", \\"interleaved1f1b\\", 2, 3, 2]": ')  # a damaged file
    _forget_schedules(monkeypatch)
    assert schedule.compute_order(*SHAPES[0]) == traced[SHAPES[0]][0]
    schedule.save_traces()
    monkeypatch.setattr(schedule._KEPT, "_read", None)
    assert schedule._KEPT.load()  # rewritten whole
