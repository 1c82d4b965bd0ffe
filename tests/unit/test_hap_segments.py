"""How ops are cut into segments (methods/hap/segments.py): layer groups, FLOP-balanced cuts at
their borders, equal-FLOP cuts, METIS parts, and the errors of a segmentation that cannot be made."""

from __future__ import annotations

import itertools
import sys

import pytest

from methods.graph import capture_config
from methods.hap.segments import (
    SegmentationError,
    balanced_cuts,
    layer_groups,
    segment_ops,
)
from methods.hap.theory import derive_theory
from models.bert import BertConfig
from models.vgg19 import VGG19Config


def _ops(cfg, batch=4):
    graph = capture_config(cfg, batch)
    theory = derive_theory(graph, sfb=True)
    return graph, [n.name for n in graph.nodes if n.name in theory.rules]


@pytest.fixture(scope="module")
def vgg():
    return _ops(VGG19Config.from_preset("tiny"))


@pytest.fixture(scope="module")
def bert():
    return _ops(BertConfig.from_preset("tiny"))


def _starts(graph, order, groups):
    return [order[i] for i in range(len(order)) if i == 0 or groups[i] != groups[i - 1]]


def test_vgg19_layer_groups_are_its_conv_stages_and_the_classifier(vgg):
    graph, order = vgg
    groups = layer_groups(graph, order)
    pools = [i for i, name in enumerate(order) if graph[name].op == "max_pool2d"]
    assert len(pools) == 5
    # A new group starts right after each pooling op and nowhere else.
    assert [i for i in range(1, len(order)) if groups[i] != groups[i - 1]] == [p + 1 for p in pools]
    starts = _starts(graph, order, groups)
    assert all(graph[s].op == "conv2d" for s in starts[:5]) and graph[starts[5]].op == "adaptive_avg_pool2d"
    assert all(graph[n].op != "linear" for n, g in zip(order, groups) if g < 5)  # classifier: last group


def test_bert_layer_groups_are_embedding_blocks_and_head(bert):
    graph, order = bert
    groups = layer_groups(graph, order)
    layers = BertConfig.from_preset("tiny").num_layers
    assert groups[-1] + 1 == layers + 2
    for name, g in zip(order, groups):
        stack = graph[name].fx_node.meta.get("nn_module_stack") or {}
        block = next((p for p in stack if p.startswith("blocks.")), None)
        if block is not None:  # every op of block i is in group i + 1, and only those
            assert g == int(block.split(".")[1]) + 1, name
        else:
            assert g in (0, layers + 1), name


def test_layers_cut_only_at_group_borders_with_balanced_flops(bert):
    graph, order = bert
    groups = layer_groups(graph, order)
    for g in (2, 3, 4):
        seg = segment_ops(graph, order, g, "layers")
        assert seg == sorted(seg) and set(seg) == set(range(g))
        cuts = {i for i in range(1, len(order)) if seg[i] != seg[i - 1]}
        assert cuts <= {i for i in range(1, len(order)) if groups[i] != groups[i - 1]}
    # Two segments of tiny BERT (4 groups: embedding ~0 %, two blocks, head): the cut between the blocks.
    seg = segment_ops(graph, order, 2, "layers")
    assert {g for g, s in zip(groups, seg) if s == 0} == {0, 1}


@pytest.mark.parametrize("weights,k", [([5, 1, 1, 1, 4, 2], 3), ([0, 3, 3, 0, 9, 1, 1], 4), ([1, 1], 2)])
def test_balanced_cuts_is_the_least_sum_of_squares(weights, k):
    seg = balanced_cuts(weights, k)
    assert seg == sorted(seg) and set(seg) == set(range(k))

    def cost(cuts):
        bounds = (0, *cuts, len(weights))
        return sum(sum(weights[a:b]) ** 2 for a, b in zip(bounds, bounds[1:]))

    best = min(cost(c) for c in itertools.combinations(range(1, len(weights)), k - 1))
    got = [i for i in range(1, len(weights)) if seg[i] != seg[i - 1]]
    assert cost(got) == best


def test_flops_cuts_equal_flops_anywhere(vgg):
    graph, order = vgg
    seg = segment_ops(graph, order, 4, "flops")
    assert seg == sorted(seg) and set(seg) == set(range(4))
    total = sum(graph[n].flops for n in order)
    for s in range(4):
        share = sum(graph[n].flops for n, x in zip(order, seg) if x == s) / total
        assert 0.1 < share < 0.4  # tiny VGG19's conv layers are a third of its FLOPs at most


def test_more_segments_than_layer_groups_is_one_clear_error(vgg):
    graph, order = vgg
    with pytest.raises(SegmentationError) as err:
        segment_ops(graph, order, 7, "layers")
    msg = str(err.value)
    assert "method.num_segments=7 is more than the 6 layer groups" in msg
    assert "method.num_segments<=6 or method.segmentation=flops" in msg and "\n" not in msg
    assert len(set(segment_ops(graph, order, 6, "layers"))) == 6


def test_unknown_segmentation_is_refused(bert):
    graph, order = bert
    with pytest.raises(
        SegmentationError, match=r"method.segmentation='random' is unknown; valid: layers, flops, metis"
    ):
        segment_ops(graph, order, 2, "random")


def test_metis_parts_cover_every_segment_and_are_deterministic(bert):
    pytest.importorskip("pymetis")
    graph, order = bert
    seg = segment_ops(graph, order, 3, "metis")
    assert set(seg) == {0, 1, 2} and seg[0] == 0
    assert segment_ops(graph, order, 3, "metis") == seg
    # Balanced by FLOPs: no part holds more than about half of the model.
    total = sum(graph[n].flops for n in order)
    assert max(sum(graph[n].flops for n, x in zip(order, seg) if x == s) for s in range(3)) < 0.6 * total


def test_metis_without_pymetis_names_the_option_and_the_fix(bert, monkeypatch):
    graph, order = bert
    monkeypatch.setitem(sys.modules, "pymetis", None)  # import pymetis raises ImportError
    with pytest.raises(SegmentationError, match=r"method.segmentation=metis needs pymetis.*pip install"):
        segment_ops(graph, order, 2, "metis")


def test_blocks_are_indexed_modules_with_modules_inside_whatever_their_class():
    import torch
    import torch.nn.functional as F
    from torch import nn

    from methods.graph import capture

    class Stack(nn.Module):  # blocks of torch.nn classes: nn.Sequential(Linear, ReLU) in a ModuleList
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3))
            self.out = nn.Linear(16, 4)

        def forward(self, x, y):
            x = self.inp(x)
            for layer in self.layers:
                x = x + layer(x)
            return F.cross_entropy(self.out(x), y, reduction="sum")

    with torch.device("meta"):
        model = Stack()
    graph = capture(model, (torch.empty(4, 8, device="meta"), torch.empty(4, dtype=torch.long, device="meta")))
    theory = derive_theory(graph, sfb=True)
    order = [n.name for n in graph.nodes if n.name in theory.rules]
    groups = layer_groups(graph, order)
    assert groups[-1] + 1 == 5  # input layer, 3 blocks, output layer and loss
    linears = [g for n, g in zip(order, groups) if graph[n].op == "linear"]
    assert linears == [0, 1, 2, 3, 4]  # one Linear of a Sequential is not a block of its own


def test_hap_left_at_its_default_takes_four_rows_or_one_per_layer_group_where_fewer(bert):
    """conf/method/hap.yaml leaves num_segments null: tiny BERT's 4 layer groups get 4 rows, a
    model of one layer group (SqueezeBERT's blocks are not indexed modules) gets 1, where a
    number given would be refused (test_more_segments_than_layer_groups_is_one_clear_error)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from methods.graph import capture
    from methods.hap.planner import DEFAULT_SEGMENTS, HapPlanner

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x, y):
            return F.cross_entropy(self.fc(x), y, reduction="sum")

    graph, _ = bert
    assert HapPlanner(num_segments=None).segment_count(derive_theory(graph)) == DEFAULT_SEGMENTS == 4
    flat = derive_theory(capture(Flat(), (torch.randn(4, 8), torch.randint(0, 4, (4,)))))
    assert HapPlanner(num_segments=None).segment_count(flat) == 1
    assert HapPlanner(num_segments=None, segmentation="flops").segment_count(flat) == DEFAULT_SEGMENTS
    assert HapPlanner(num_segments=3).segment_count(flat) == 3  # given: kept (and refused when planned)
