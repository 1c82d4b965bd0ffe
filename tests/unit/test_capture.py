"""methods.capture: a meta call seen before is answered from its description, and the graph is
exactly the one that running every op gives."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from methods import capture as C
from tests.conftest import compose_config


def _facts(graph) -> list[tuple]:
    return [(n.name, n.kind, n.op, n.inputs, n.shape, n.dtype, n.flops, n.backward_factor, n.is_param,
             n.tuple_shapes, n.shape_inputs) for n in graph.nodes]


def _every_op_run(monkeypatch):
    monkeypatch.setattr(C._ShapeRecorder, "_once", lambda self, target, args, kwargs, call: call(target, args, kwargs))


@pytest.mark.parametrize("model", ["vgg19", "vit", "bert", "bert_moe"])
def test_a_zoo_model_captures_as_with_every_op_run(model, monkeypatch):
    cfg = compose_config(f"model={model}", "preset=tiny")
    model_cfg = instantiate(cfg.model.spec, num_devices=2)
    batch = 2 * cfg.preset.batch_per_device
    remembered = _facts(C.capture_config(model_cfg, batch))
    _every_op_run(monkeypatch)
    assert remembered == _facts(C.capture_config(model_cfg, batch))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x):
        y = self.proj(x).clone()
        y.unsqueeze_(0)  # in place, and it changes y's shape: must run every time
        top, _ = torch.topk(y, 2, dim=-1)  # a named tuple, of y as the in-place op left it
        return x + top.sum(-1).squeeze(0).unsqueeze(-1) * x[:, :1] + x.size(1)


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum()


def test_the_second_of_two_alike_blocks_is_answered_from_the_first(monkeypatch):
    with torch.device("meta"):
        model = _Twice()
    x = torch.randn(4, 6, device="meta")
    runs = []
    original = torch.fx.Interpreter.call_function
    monkeypatch.setattr(torch.fx.Interpreter, "call_function",
                        lambda self, target, args, kwargs: runs.append(target) or original(self, target, args, kwargs))
    remembered = _facts(C.capture(model, [x]))
    ran = len(runs)
    runs.clear()
    _every_op_run(monkeypatch)
    assert remembered == _facts(C.capture(model, [x]))
    assert ran < len(runs)
    # the in-place op ran in both blocks, and its shape change was seen
    graph = C.capture(model, [x])
    inplace = [n for n in graph.nodes if n.op == "unsqueeze_"]
    assert len(inplace) == 2 and all(n.shape == (1, 4, 6) for n in inplace)
