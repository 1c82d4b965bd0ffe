"""methods.hap.theory: every Hoare triple, executed on 2-3 emulated shards in one process, turns
inputs satisfying its pre-condition into an output satisfying its post-condition."""

from __future__ import annotations

import importlib
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from bench.core.shares import offsets, round_shares
from methods.graph import capture
from methods.hap.theory import IDENTITY, REDUCE, NoRuleError, comm_rules, derive_theory, local_size_args

# Uneven shards, one of them empty.
WEIGHTS = {2: [0.7, 0.3], 3: [0.55, 0.0, 0.45]}


def lengths(size: int, n: int, unit: int = 1) -> list[int]:
    return [unit * s for s in round_shares(size // unit, WEIGHTS[n])]


def split(t: torch.Tensor, d: int, n: int, unit: int = 1) -> list[torch.Tensor]:
    return [t.narrow(d, a, b - a) for a, b in offsets(lengths(t.shape[d], n, unit))]


def distribute(t, layout, n: int, gen: torch.Generator, unit: int = 1):
    """Local values of the full tensor `t` under `layout` on n devices."""
    if isinstance(t, (tuple, list)):
        parts = [distribute(x, layout, n, gen, unit) for x in t]
        return [type(t)(p[i] for p in parts) for i in range(n)]
    if layout == IDENTITY:
        return [t.clone() for _ in range(n)]
    if layout == REDUCE:
        if not t.is_floating_point():
            return [t.clone()] + [torch.zeros_like(t) for _ in range(n - 1)]
        parts = [torch.randn(t.shape, generator=gen).to(t.dtype) for _ in range(n - 1)]
        return parts + [t - sum(parts)]
    return split(t, layout, n, unit)


def satisfies(locals_, ref, layout) -> bool:
    if isinstance(ref, (tuple, list)):
        return all(satisfies([loc[i] for loc in locals_], ref[i], layout) for i in range(len(ref)))
    if layout == IDENTITY:
        got = locals_
    elif layout == REDUCE:
        got = [sum(locals_[1:], locals_[0])]
    else:
        got = [torch.cat(locals_, dim=layout)]
    ref = ref.to(torch.float64)
    return all(g.shape == ref.shape and torch.allclose(g.to(torch.float64), ref, rtol=1e-7, atol=1e-9) for g in got)


def run_local(fx_node: fx.Node, env: dict, node=None, rule=None, full_shape=None, local_shape=None):
    """Execute one fx node with local values; non-tensor inputs (sizes, dtypes) are
    re-evaluated from local values, like the generated per-device program would; a size a
    device makes from nothing (expand's broadcast-split) is its local shape's."""

    def value(a):
        if a.name in env:
            return env[a.name]
        env[a.name] = run_local(a, env)
        return env[a.name]

    args = fx.node.map_arg(fx_node.args, value)
    kwargs = fx.node.map_arg(fx_node.kwargs, value)
    if rule is not None:
        args = local_size_args(node, rule, tuple(args), local_shape)

    def call(args, kwargs):
        if fx_node.op == "call_method":
            return getattr(args[0], fx_node.target)(*args[1:], **kwargs)
        return fx_node.target(*args, **kwargs)

    try:
        out = call(args, kwargs)
        if (
            rule is not None
            and rule.post == REDUCE
            and isinstance(out, torch.Tensor)
            and tuple(out.shape) != tuple(full_shape)
        ):
            # conv2d with a zero-length input-channel shard returns an empty tensor instead
            # of zeros of the output shape: codegen must guard this too.
            return torch.zeros(full_shape)
        return out
    except RuntimeError:
        # Some kernels (conv2d) refuse a zero-length weight shard; a device with an empty
        # shard gets an empty output of the right shape (what codegen must also do).
        flat = [a for a in fx.node.map_aggregate(args, lambda a: a) if isinstance(a, torch.Tensor)]
        if not any(a.numel() == 0 for a in flat):
            raise
        if rule is not None and rule.post == REDUCE:  # an empty part of a sum contributes zeros
            return torch.zeros(full_shape)

        def to_meta(a):  # empty dims -> 1 to learn the shape, then the split dim -> 0
            if not isinstance(a, torch.Tensor):
                return a
            return torch.empty([max(n, 1) for n in a.shape], dtype=a.dtype, device="meta")

        out = call(fx.node.map_aggregate(args, to_meta), fx.node.map_aggregate(kwargs, to_meta))
        shape = list(out.shape)
        shape[rule.post] = 0
        return torch.zeros(shape, dtype=out.dtype)


def reference_values(gm: fx.GraphModule, inputs) -> dict:
    values = {}

    class Rec(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.no_grad():
        Rec(gm).run(*inputs)
    return values


def check_all_triples(model: nn.Module, inputs, sfb=True, device_counts=(2, 3)) -> int:
    model.eval()  # dropout off: masks are random per device
    # float64: Reduce partials are random, so sums cancel; float32 rounding would dominate.
    model.double()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    graph = capture(model, inputs)
    theory = derive_theory(graph, sfb=sfb)
    ref = reference_values(graph.gm, inputs)
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for name, rules in theory.rules.items():
        node = graph[name]
        for rule in rules:
            for n in device_counts:
                per_input = [
                    distribute(ref[i], lay, n, gen, rule.unit if k == 0 else 1)
                    for k, (i, lay) in enumerate(zip(node.inputs, rule.pre))
                ]
                outs = []
                for dev in range(n):
                    env = {}
                    shape_layouts = dict(rule.shape_pre)
                    for t in node.shape_inputs:
                        env[t] = distribute(ref[t], shape_layouts.get(t, IDENTITY), n, gen)[dev]
                    for k, i in enumerate(node.inputs):
                        v = per_input[k][dev]
                        if k in rule.first_device_only and dev > 0:
                            v = torch.zeros_like(v)
                        env[i] = v
                    local_shape = None
                    if rule.name == "broadcast-split":
                        local_shape = list(node.shape)
                        local_shape[rule.post] = lengths(node.shape[rule.post], n)[dev]
                    with torch.no_grad():
                        outs.append(run_local(node.fx_node, env, node, rule, node.shape, local_shape))
                assert satisfies(outs, ref[name], rule.post), f"{rule.describe()} on {n} devices"
                checked += 1
    return checked


class AllOps(nn.Module):
    """Small module using the ops the models use, plus row/column parallel candidates."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.ln = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 6, bias=False)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.w = nn.Parameter(torch.randn(3, 6, 5))

    def forward(self, tokens, images, labels):
        x = self.ln(self.emb(tokens))  # (B,S,6)
        h = F.gelu(self.fc(x)) * 0.5
        q = h.unflatten(-1, (2, 4)).transpose(1, 2)  # (B,2,S,4)
        att = torch.softmax(torch.matmul(q, q.transpose(-2, -1)), dim=-1)
        ctx = torch.matmul(att, q).transpose(1, 2).flatten(2)  # (B,S,8)
        y = x + self.fc2(ctx)
        e = torch.einsum("bsd,edh->bseh", y, self.w)
        route = torch.cumsum(F.one_hot(tokens % 3, 3), dim=1)
        gate = (route < 2).to(y.dtype).unsqueeze(-1) * e
        top = torch.topk(gate.sum(dim=-1), 2, dim=-1)
        img = F.max_pool2d(F.relu(self.conv(images)), 2)
        img = F.adaptive_avg_pool2d(img, (2, 2)).flatten(1)  # (B,16)
        logits = torch.cat([top[0].sum(dim=1), img[:, 0:1].expand(img.shape[0], 3)], dim=1)
        return F.cross_entropy(logits, labels, reduction="sum") + y.sum()


def test_every_triple_of_a_mixed_op_module_holds_numerically():
    torch.manual_seed(0)
    model = AllOps()
    inputs = (torch.randint(0, 11, (5, 4)), torch.randn(5, 3, 4, 4), torch.randint(0, 5, (5,)))
    assert check_all_triples(model, inputs) > 300


def test_linear_offers_row_column_batch_and_sfb_triples():
    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 8)

        def forward(self, x):
            return self.fc(x).sum()

    torch.manual_seed(0)
    graph = capture(Wrap(), (torch.randn(4, 5, 6),))
    rules = derive_theory(graph, sfb=True).rules["linear"]
    forms = {(r.pre, r.post, r.first_device_only, r.sfb) for r in rules}
    assert ((2, 1, IDENTITY), REDUCE, (2,), False) in forms  # row parallel, bias on the first device
    assert ((IDENTITY, 0, 0), 2, (), False) in forms  # column parallel: weight rows and bias split
    assert ((0, IDENTITY, IDENTITY), 0, (), False) in forms and ((0, IDENTITY, IDENTITY), 0, (), True) in forms
    assert not any(r.pre[1] == REDUCE for r in rules)
    assert all(r.name.startswith(("dtensor", "replicated")) for r in rules if not r.sfb)
    assert check_all_triples(Wrap(), (torch.randn(4, 5, 6),)) >= 2 * len(rules)


@pytest.mark.parametrize("n", [2, 3])
def test_communication_triples_emulated_with_cat_and_sum_reach_their_post_condition(n):
    gen = torch.Generator().manual_seed(1)

    class One(nn.Module):
        def forward(self, x):
            return (x * 2).sum()

    graph = capture(One(), (torch.randn(5, 4, 3),))
    node = graph["mul"]
    full = torch.randn(5, 4, 3, generator=gen, dtype=torch.float64)
    kinds = set()
    for src in [IDENTITY, REDUCE, 0, 1, 2]:
        for rule in comm_rules(node, src):
            kinds.add((rule.kind, rule.impl))
            local = distribute(full, src, n, gen)
            if rule.kind == "all_gather":  # padded or grouped: same values, different cost
                out = [torch.cat(local, dim=src)] * n
            elif rule.kind == "all_reduce":
                out = [sum(local)] * n
            elif rule.kind == "reduce_scatter":
                out = split(sum(local), rule.dst, n)
            elif rule.kind == "all_to_all":
                out = split(torch.cat(local, dim=src), rule.dst, n)
            elif rule.kind == "slice":
                out = split(local[0], rule.dst, n)
            else:
                assert rule.kind == "keep_first"
                out = [local[0]] + [torch.zeros_like(local[0])] * (n - 1)
            assert satisfies(out, full, rule.dst), rule.describe()
    assert {k for k, _ in kinds} == {"all_gather", "all_reduce", "reduce_scatter", "all_to_all", "slice", "keep_first"}
    assert ("all_gather", "grouped") in kinds and ("reduce_scatter", "grouped") in kinds


def test_an_op_without_a_rule_runs_replicated_and_is_named_in_the_coverage():
    class Odd(nn.Module):
        def forward(self, x):
            return torch.renorm(x * 2, 2, 0, 1.0).sum()

    graph = capture(Odd(), (torch.randn(3, 2),))
    theory = derive_theory(graph)  # no error: the op keeps its tensors whole
    assert [r.name for r in theory.rules["renorm"]] == ["replicated"]
    assert theory.uncovered == {"renorm": "renorm"}
    cov = theory.coverage()
    assert cov["uncovered_ops"] == {"renorm": 1} and cov["ops"] == 3 and cov["ops_covered"] == 2
    assert 0 < cov["flops_share"] < 1
    assert theory.origins["mul"].startswith("dtensor")


def test_mean_reduction_loss_is_rejected_with_the_fix():
    class MeanLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 4)

        def forward(self, x, y):
            return F.cross_entropy(self.fc(x), y)

    graph = capture(MeanLoss(), (torch.randn(4, 3), torch.randint(0, 4, (4,))))
    with pytest.raises(NoRuleError, match="reduction='sum'"):
        derive_theory(graph)


def test_operator_and_functional_namespaces_map_to_the_same_rules():
    class Mixed(nn.Module):
        def forward(self, a, b):
            return (operator.matmul(a, b) + torch.matmul(a, b)).sum()

    graph = capture(Mixed(), (torch.randn(3, 4), torch.randn(4, 2)))
    theory = derive_theory(graph)
    ops = {graph[n].op for n in theory.rules}
    assert ops == {"matmul", "add", "sum"}


ZOO = [
    ("models.vgg19", "VGG19Config"),
    ("models.vit", "ViTConfig"),
    ("models.bert", "BertConfig"),
    ("models.bert_moe", "BertMoEConfig"),
]


@pytest.mark.parametrize("arch", ["gpt2", "resnet", "swin"])
def test_every_triple_of_a_tiny_hugging_face_model_holds_numerically(arch):
    """Triples derived from DTensor on export's ATen graph of library models (GPT-2's Conv1D as
    addmm and its split heads, ResNet's batch norm as its statistics, Swin's window partition)."""
    pytest.importorskip("transformers", reason="model=hf needs the optional extra .[zoo]")
    from models.hf import HFModelConfig

    cfg = HFModelConfig.from_preset("tiny", arch=arch, seq_len=8, image_size=16 if arch == "swin" else None)
    torch.manual_seed(0)
    model = cfg.build()
    batch = cfg.synthetic_batch(3, torch.Generator().manual_seed(0))
    assert check_all_triples(model, batch, device_counts=(3,)) > 100


@pytest.mark.parametrize("module,cls", ZOO)
def test_every_triple_of_each_tiny_zoo_model_holds_numerically(module, cls):
    mod = importlib.import_module(module)  # the project's own: an import error fails, never skips
    cfg = getattr(mod, cls).from_preset("tiny", num_devices=2)
    if hasattr(cfg, "dropout"):
        cfg.dropout = 0.0
    torch.manual_seed(0)
    model = cfg.build()
    batch = cfg.synthetic_batch(3, torch.Generator().manual_seed(0))
    assert check_all_triples(model, batch, device_counts=(3,)) > 100


class ShiftRight(nn.Module):
    """Tokens shifted one place right behind a start token (mBART's and ProphetNet's decoder
    inputs): a slice assigned into a tensor read later, captured functionalised as aten.copy."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 11)

    def forward(self, tokens, labels):
        shifted = tokens.new_zeros(tokens.shape)
        shifted[:, 1:] = tokens[:, :-1].clone()
        return F.cross_entropy(self.fc(self.emb(shifted)).flatten(0, 1), labels.flatten(), reduction="sum")


def test_a_functional_copy_has_its_in_place_twins_triples_and_data_parallelism_runs_through_it():
    """DTensor registers copy_ but not the functional copy torch.export's functionalisation
    makes of it: the copy takes its in-place twin's triples, so a batch split runs through it
    without an all-gather (a data-parallel program exists), and every triple holds."""
    from methods.hap.search import dead_end
    from methods.hap.theory import data_parallel_theory

    model = ShiftRight()
    inputs = (torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5)))
    graph = capture(model, inputs)
    theory = derive_theory(graph)
    copies = [n.name for n in graph.nodes if n.op == "copy"]
    assert copies
    for name in copies:
        assert (0, 0) in {r.pre for r in theory.rules[name] if r.post == 0}, theory.rules[name]
    assert dead_end(data_parallel_theory(theory)) is None
    assert check_all_triples(model, inputs) > 20


def _contraction_node(equation: str | None, shapes, computed: bool) -> fx.Node:
    """An einsum node (a matmul where `equation` is None) over placeholders (sources) or over
    values computed from them."""
    g = fx.Graph()
    args = []
    for i, shape in enumerate(shapes):
        a = g.placeholder(f"x{i}")
        a.meta["val"] = torch.empty(shape, device="meta")
        if computed:
            a = g.call_function(torch.ops.aten.clone.default, (a,))
            a.meta["val"] = torch.empty(shape, device="meta")
        args.append(a)
    vals = [a.meta["val"] for a in args]
    if equation is None:
        node = g.call_function(torch.ops.aten.matmul.default, tuple(args))
        node.meta["val"] = torch.matmul(*vals)
    else:
        node = g.call_function(torch.ops.aten.einsum.default, (equation, args))
        node.meta["val"] = torch.einsum(equation, *vals)
    return node


@pytest.mark.parametrize(
    "equation, shapes",
    [
        ("bsec,bsd->becd", [(4, 5, 3, 2), (4, 5, 6)]),  # BERT-MoE's dispatch
        ("becd,edh->bech", [(4, 3, 2, 6), (3, 6, 7)]),  # its experts
        ("bech,ehd->becd", [(4, 3, 2, 7), (3, 7, 6)]),
        ("bsec,becd->bsd", [(4, 5, 3, 2), (4, 3, 2, 6)]),  # its combine
        ("ij,kj->ik", [(3, 4), (5, 4)]),
        ("bij,jk->bk", [(2, 3, 4), (4, 5)]),  # i summed out of one operand alone
        ("abcd,dcbe->ea", [(2, 3, 4, 5), (5, 4, 3, 6)]),
        ("i,j->ij", [(3,), (4,)]),
        ("ij,ij->", [(3, 4), (3, 4)]),
        ("ij,jk->ik", [(1, 4), (4, 5)]),  # a dim of length 1: the decomposition traced whole
        (None, [(4, 3, 5, 6), (4, 3, 6, 5)]),  # matmul: attention's scores
        (None, [(4, 5, 6), (6, 7)]),
        (None, [(5, 6), (6, 7)]),
        (None, [(5, 6), (4, 6, 7)]),  # broadcast batch dims: the decomposition traced whole
        (None, [(2, 4, 5, 6), (4, 6, 5)]),
    ],
)
def test_contraction_triples_from_their_letters_are_those_of_the_traced_decomposition(equation, shapes, monkeypatch):
    from methods.hap import dtensor_rules

    for computed in (False, True):
        node = _contraction_node(equation, shapes, computed)
        args = dtensor_rules.tensor_args(node)
        with dtensor_rules._whole_on_one_device():
            read = dtensor_rules._derive(node, args)
        with monkeypatch.context() as m:
            m.setattr(dtensor_rules, "_contraction", lambda node, args: None)
            with dtensor_rules._whole_on_one_device():
                traced = dtensor_rules._derive(node, args)
        assert read[1] == traced[1] == "decomposition"
        assert sorted(map(repr, read[0])) == sorted(map(repr, traced[0]))
        assert len(read[0]) == len(set(read[0]))


def test_without_torchs_decomposition_strategy_the_traced_decomposition_gives_the_same_triples(monkeypatch):
    # torch 2.11 (the GPU host's) has no ShardingPropagator.decomp_strategy: every op DTensor
    # reads through its decomposition had no triple there, and hap planned from a third fewer.
    from methods.hap import dtensor_rules

    class Layers(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Dropout(0.1), nn.Softmax(-1), nn.Flatten())

        def forward(self, x):
            return self.body(x).sum()

    graph = capture(Layers(), (torch.randn(4, 3, 6),))
    ops = [
        n
        for n in graph.nodes
        if n.kind == "call_function" and n.op in ("linear", "layer_norm", "dropout", "softmax", "flatten")
    ]
    assert len(ops) == 5
    d = dtensor_rules._dtensor()
    for node in ops:
        args = dtensor_rules.tensor_args(node.fx_node)
        with dtensor_rules._whole_on_one_device():
            torchs = dtensor_rules._derive(node.fx_node, args)
        with monkeypatch.context() as m:
            m.setitem(d, "decomp", None)
            with dtensor_rules._whole_on_one_device():
                traced = dtensor_rules._derive(node.fx_node, args)
        assert (torchs[1], traced[1]) == ("decomposition", "decomposition traced here"), node.op
        assert torchs[0] and sorted(map(repr, torchs[0])) == sorted(map(repr, traced[0])), node.op


def test_a_views_shape_argument_made_local_is_no_redistribution_where_placements_stay():
    # torch 2.11's placement tracking refused every view whose shape argument DTensor rewrites
    # (a list made a tuple), so hap's traced decompositions of linear lost their sharded triples
    # there; only a change of an input's placement is a redistribution (as torch 2.12 reads it).
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
    from torch.distributed.tensor.placement_types import Replicate, Shard

    from methods.hap import dtensor_rules

    d = dtensor_rules._dtensor()
    prop = dtensor_rules._PlacementsOnly(d["prop"])
    x = torch.empty(8, 6, 4, device="meta")
    meta = TensorMeta(x.shape, x.stride(), x.dtype)
    sharded = DTensorSpec(d["mesh"], (Shard(0),), meta)
    schema = OpSchema(torch.ops.aten.view.default, (sharded, [48, 4]), {})
    schema.schema_info = d["prop"].op_to_schema_info.get(torch.ops.aten.view.default)
    schema._recompute_comparison_key()
    with dtensor_rules._whole_on_one_device():
        raw = d["prop"].propagate_op_sharding_non_cached(schema)
        read = prop.propagate_op_sharding_non_cached(schema)
    assert raw.needs_redistribute and not read.needs_redistribute  # only the shape argument changed
    assert read.output_spec.placements == (Shard(0),)
    # an input whose placement must change stays a redistribution
    whole = OpSchema(torch.ops.aten.view.default, (DTensorSpec(d["mesh"], (Replicate(),), meta), (48, 4)), {})
    moved = OutputSharding(read.output_spec, redistribute_schema=whole, needs_redistribute=True)
    assert prop._settled(schema, moved).needs_redistribute


def test_an_op_with_only_an_old_style_dtensor_rule_fails_a_trace_on_older_torch():
    # torch 2.11's convolution rule hands the input's placement to the output whatever the
    # weight's: traced, it made hap shard VGG19's convolutions wrongly (caught at run time).
    from methods.hap import dtensor_rules

    conv = torch.ops.aten.convolution.default

    class Prop:
        op_to_rules = {conv: None}

        def propagate_op_sharding_non_cached(self, schema):
            return None

    schema = type("Schema", (), {"op": conv})()
    with pytest.raises(NotImplementedError, match="old-style"):
        dtensor_rules._PlacementsOnly(Prop()).propagate_op_sharding_non_cached(schema)


def test_where_dtensor_has_no_strategy_for_a_convolution_or_pooling_hap_splits_them_as_dtensor_does(monkeypatch):
    # torch before 2.12 (the GPU hosts') gives these ops no triple (their DTensor rules are
    # old-style): VGG19 had no data parallelism there. HAP's spatial-split gives DTensor's own.
    from methods.hap import dtensor_rules

    torch.manual_seed(0)
    model = AllOps()
    inputs = (torch.randint(0, 11, (5, 4)), torch.randn(5, 3, 4, 4), torch.randint(0, 5, (5,)))
    graph = capture(model, inputs)
    theirs = derive_theory(graph, sfb=False)
    spatial = {"conv2d", "max_pool2d", "adaptive_avg_pool2d"}
    real = dtensor_rules.derive
    monkeypatch.setattr(dtensor_rules, "derive", lambda n: None if n.target._opname in spatial else real(n))
    ours = derive_theory(graph, sfb=False)
    ops = [n for n in graph.nodes if n.op in spatial]
    assert {n.op for n in ops} == spatial
    for n in ops:
        dtensor = {(r.pre, r.post) for r in theirs.rules[n.name] if r.name == "dtensor"}
        assert dtensor and {(r.pre, r.post) for r in ours.rules[n.name] if r.name == "spatial-split"} == dtensor
        assert not any(r.name == "spatial-split" for r in theirs.rules[n.name]), n.op
    assert check_all_triples(model, inputs) > 300
