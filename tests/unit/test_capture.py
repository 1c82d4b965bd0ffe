"""methods.graph: torch.export's ATen graph, rewritten for the planner, computes what the model
computes; its FLOPs are torch's for the contractions; what it cannot capture fails in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from bench.core.program import op_class
from methods import graph as C
from tests.conftest import compose_config

PAPER_MODELS = ["vgg19", "vit", "bert", "bert_moe"]


def _tiny(model: str):
    cfg = compose_config(f"model={model}", "preset=tiny")
    return instantiate(cfg.model.spec, num_devices=2)


@pytest.mark.parametrize("model", PAPER_MODELS)
def test_the_captured_graph_computes_the_models_loss(model):
    model_cfg = _tiny(model)
    torch.manual_seed(0)
    module = model_cfg.build()
    batch = model_cfg.synthetic_batch(4, torch.Generator().manual_seed(1))
    graph = C.capture(module, batch)
    with torch.no_grad():
        assert torch.equal(graph.gm(*batch), module(*batch))
    assert graph[graph.loss].shape == () and all(n.fx_node.op != "call_method" for n in graph.nodes)


@pytest.mark.parametrize("model", PAPER_MODELS)
def test_contraction_flops_are_torchs_flop_counters(model):
    model_cfg = _tiny(model)
    batch = 4
    graph = C.capture_config(model_cfg, batch)
    with torch.device("meta"):
        module = model_cfg.build()
        inputs = model_cfg.synthetic_batch(batch, None)
    with FlopCounterMode(display=False) as counter:
        module(*inputs)
    ours = sum(n.flops for n in graph.nodes if op_class(n.op) in ("matmul", "conv"))
    # ours also counts each bias add (one per output element of a layer with a bias)
    assert counter.get_total_flops() <= ours <= counter.get_total_flops() * 1.02


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.bn(self.fc(x))
        h += x  # in place on a tensor nothing reads afterwards
        return h.relu().sum()


def test_in_place_ops_become_functional_and_batch_norm_its_statistics():
    torch.manual_seed(0)
    model = _Residual()
    x = torch.randn(6, 4)
    graph = C.capture(model, (x,))
    ops = [n.op for n in graph.ops]
    assert "add_" not in ops and "batch_norm" not in ops and ops.count("sum") >= 3
    with torch.no_grad():
        want = model(x)  # training mode: batch statistics
        got = graph.gm(x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_write_into_a_tensor_read_later_is_captured_functionalised_and_computes_the_same():
    class Overwrite(nn.Module):
        def forward(self, x):
            y = x * 2
            z = y.clone()
            y.add_(1)
            return (y + z).sum()

    # y is read after the in-place add only through the add's own result, z is a copy: fine
    C.capture(Overwrite(), (torch.randn(3),))

    class Aliased(nn.Module):
        def forward(self, x):
            y = x * 2
            v = y.view(3)
            v.mul_(3)
            return (y + 1).sum()  # reads y, which the write changed through its view

    # the write through the view is exported functionalised (no in-place op left), same values
    x = torch.randn(3)
    graph = C.capture(Aliased(), (x,))
    assert not any(getattr(n.target, "_schema", None) and n.target._schema.is_mutable for n in graph.gm.graph.nodes)
    assert torch.allclose(graph.gm(x), Aliased()(x))


def test_export_failure_is_one_line_naming_the_construct_and_the_fix():
    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # a branch on a value: export cannot trace it
                return x.sum()
            return -x.sum()

    with pytest.raises(C.CaptureError) as err:
        C.capture(DataDependent(), (torch.randn(3),), what="model custom")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("model custom: torch.export (non-strict) refused")
    assert "test_capture.py" in msg and "model.task=" in msg and "model=custom" in msg


def test_a_forward_that_is_not_a_scalar_loss_is_refused():
    class Logits(nn.Module):
        def forward(self, x):
            return F.linear(x, torch.ones(2, 3))

    with pytest.raises(C.CaptureError, match="scalar loss summed over the batch"):
        C.capture(Logits(), (torch.randn(4, 3),))


def test_an_equal_config_is_captured_once_per_process():
    model_cfg = _tiny("vgg19")
    assert C.capture_config(model_cfg, 4) is C.capture_config(model_cfg, 4)
    assert C.capture_config(model_cfg, 4) is not C.capture_config(model_cfg, 6)


def test_a_shape_that_depends_on_values_is_refused_in_one_line_naming_it():
    class Selects(nn.Module):
        def forward(self, x, keep):
            return x[keep].sum()  # as many rows as `keep` has true values

    with pytest.raises(C.CaptureError) as err:
        C.capture(Selects(), (torch.randn(4, 3), torch.tensor([True, False, True, True])), what="model custom")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("model custom: the shape (u")
    assert "x[keep]" in msg and "data-dependent" in msg and "model.task=" in msg


def _node_facts(graph) -> list[tuple]:
    return [
        (n.name, n.kind, n.op, str(n.fx_node.target), repr(n.fx_node.args), n.inputs, n.shape, n.dtype, n.flops)
        for n in graph.nodes
    ]


@pytest.mark.parametrize("model", PAPER_MODELS)
def test_a_capture_without_stack_traces_is_the_capture_with_them(model):
    """capture_config exports without the nodes' stack traces (and with torch's lazy graph
    modules inside the export): the same graph, code and all (its Python code differs only in
    the comments that quote the lines)."""
    model_cfg = _tiny(model)
    fast = C._export_config(model_cfg, 4, 0, "sync", "model", None)
    traced = C._export_config(model_cfg, 4, 0, "sync", "model", None, stack_traces=True)
    from torch.fx._lazy_graph_module import _LazyGraphModule

    assert isinstance(fast, torch.fx.GraphModule) and not isinstance(fast, _LazyGraphModule)
    assert not any(n.meta.get("stack_trace") for n in fast.graph.nodes)
    assert any(n.meta.get("stack_trace") for n in traced.graph.nodes)
    assert _node_facts(C.graph_of(fast, 4, "model")) == _node_facts(C.graph_of(traced, 4, "model"))

    def code(gm):
        return [line for line in gm.code.splitlines() if line.strip() and not line.strip().startswith("#")]

    assert code(fast) == code(traced)


class _SelectsConfig:
    """A model config whose forward has a shape that depends on values (export refuses it)."""

    name = "selects"

    def build(self) -> nn.Module:
        class Selects(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(3))

            def forward(self, x, keep):
                return (x[keep] * self.w).sum()  # as many rows as `keep` has true values

        return Selects()

    def synthetic_batch(self, batch_size: int, generator: torch.Generator):
        return torch.randn(batch_size, 3, generator=generator), torch.ones(batch_size, dtype=torch.bool)


def test_a_refused_capture_config_quotes_the_line_as_a_capture_with_stack_traces():
    with pytest.raises(C.CaptureError) as err:
        C._export_config(_SelectsConfig(), 4, 0, "sync", "model selects", None)
    with pytest.raises(C.CaptureError) as again:
        C._export_config(_SelectsConfig(), 4, 0, "sync", "model selects", None, stack_traces=True)
    assert str(err.value) == str(again.value)
    assert "x[keep]" in str(err.value)


@pytest.mark.parametrize("model", ["bert", "vgg19"])
def test_both_captures_of_batch_norm_are_one_graph_in_a_process_where_the_model_has_none(model):
    """A model without batch norm has one graph under both captures of it (the graph cache keeps
    it under both keys), so the second is not read back from disk or exported again."""
    cfg = _tiny(model)
    sync = C.capture_config(cfg, 6, batch_norm="sync")
    assert not C.module_has_batch_norm(sync.gm)
    assert C.capture_config(cfg, 6, batch_norm="local") is sync
