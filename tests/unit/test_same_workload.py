"""Every method prices the same workload for the same model and preset (issue 13).

dp_ev, dp_cp, deepspeed and the planner (hap and sfb build their Program with the same synthesis
code; sfb is hap without the LP) are planned for each zoo model at the tiny and the paper preset
on the paper's heterogeneous cluster with k = 8 (64 GPUs on 8 machines, so BERT-MoE has 128
experts and 3 slots per expert per sequence at seq_len 128: the case of the issue, where a
capacity factor not derived from the model's slots gave DeepSpeed 2.5). Their Programs must
count the same FLOPs per iteration, and DeepSpeed's MoE all-to-alls must move the same expert
buffers as the planner's. DeepSpeed's real MoE layer must give every expert the model's slots
per sequence x the micro-batch.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from bench.core.cluster import ClusterSpec
from bench.core.interfaces import Workload
from bench.core.program import Program
from methods.ds_zero import DeepSpeedZeRO, deepspeed_capacity, matching_capacity_factor, swap_moe_layers
from methods.graph import capture_config
from models.bert_moe import BertMoEConfig, moe_capacity
from tests.conftest import compose_config

MODELS = ("vgg19", "vit", "bert", "bert_moe")
PRESETS = ("tiny", "paper")
FP32_BYTES = 4
# The planner with one synthesis round and a narrow beam keeps this file fast.
FAST_PLANNER = (
    "method.lp=false",
    "method.max_rounds=1",
    "method.num_segments=1",
    "method.beam_width=2",
    "method.cache_dir=null",
)


@functools.cache
def paper_cluster() -> ClusterSpec:
    cfg = compose_config("cluster=paper_hetero", "cluster.gpus_per_machine=8")
    return ClusterSpec.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))


@functools.cache
def methods() -> dict:
    return {
        "dp_ev": instantiate(compose_config("method=dp_ev").method),
        "dp_cp": instantiate(compose_config("method=dp_cp").method),
        "deepspeed": instantiate(compose_config("method=deepspeed").method),
        "hap": instantiate(compose_config("method=hap", *FAST_PLANNER).method),
        "fsdp": instantiate(compose_config("method=fsdp").method),
        "fsdp_cp": instantiate(compose_config("method=fsdp_cp").method),
    }


@functools.cache
def workload(model: str, preset: str) -> Workload:
    cfg = compose_config(f"model={model}", f"preset={preset}")
    n = paper_cluster().num_devices
    model_cfg = instantiate(cfg.model.spec, num_devices=n)
    return Workload(model, preset, model_cfg, cfg.preset.batch_per_device * n, flops_per_sample=1.0)


@functools.cache
def plan(model: str, preset: str, method: str):
    return methods()[method].plan(workload(model, preset), paper_cluster())


def work_flops(program: Program) -> float:
    """FLOPs of one copy of the iteration's work: a stage's sharded FLOPs summed over the
    devices (each segment's ratios sum to 1), its replicated FLOPs (the constant) once."""
    return sum(st.flops.const + sum(c for _, c in st.flops.coef) for st in program.stages)


def replicated_flops(program: Program) -> float:
    """FLOPs every device computes whole (ops the planner leaves unsharded)."""
    return sum(st.flops.const for st in program.stages)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("model", MODELS)
def test_every_method_prices_the_same_flops_per_iteration(model, preset):
    """Summed over devices, forward + backward. The one legitimate difference: the planner may
    compute an op whole on every device (replicated: hap's default plan for tiny VGG19 on 8
    single-GPU machines does so with one conv) instead of sharding it, which adds (devices - 1) x that op's FLOPs to its total. So the test checks
    that each total is its work plus exactly that, and that the work is the same for all."""
    work = {}
    for name in methods():
        planned = plan(model, preset, name)
        program = planned.program
        total = program.total_flops(planned.ratios)
        extra = (program.num_devices - 1) * replicated_flops(program)
        assert total == pytest.approx(work_flops(program) + extra, rel=1e-12), name
        if name != "hap":
            assert extra == 0, f"{name} replicates {extra:.3e} FLOPs"
        work[name] = work_flops(program)
    assert work["dp_ev"] > 0
    for name, flops in work.items():
        assert flops == pytest.approx(work["dp_ev"], rel=1e-9), (
            f"{model}-{preset}: {name} prices {flops:.6e} FLOPs of work per iteration, dp_ev {work['dp_ev']:.6e}"
        )


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("model", MODELS)
def test_the_pipeline_prices_the_same_flops_per_iteration(model, preset):
    """Its stages' forward and backward FLOPs at each pipeline's micro-batch, summed over the
    pipelines and times the micro-batches, are the iteration's: every layer group in exactly
    one stage. (At a paper preset
    the stages are priced by FLOPs; an emulated CPU cluster would time them.)"""
    from methods.pipeline import PipelineParallel

    planned = PipelineParallel().plan(workload(model, preset), paper_cluster())
    program = planned.program
    groups = sorted(st.groups for st in program.stages)
    assert groups[0][0] == 0 and all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    # each pipeline's stages at its own micro-batch
    flops = sum(s.flops.const for st in program.stages for w in st.work for s in (*w.forward, *w.backward))
    assert flops * program.num_micro_batches == pytest.approx(
        work_flops(plan(model, preset, "dp_ev").program), rel=1e-9
    )


def test_bert_moe_all_to_alls_move_the_models_expert_slots_in_hap_and_deepspeed():
    wl = workload("bert_moe", "paper")
    cfg = wl.model_cfg
    assert (cfg.num_experts, cfg.capacity) == (128, 3)  # ceil(2.5 x 128 / 128): the rounding at stake
    # The dispatch (or combine) tensor of one MoE layer over the global batch: every expert's slots
    # of every sequence, d_model fp32 each. Both methods' all-to-alls move it whole, summed over devices.
    buffer = wl.global_batch * cfg.num_experts * cfg.capacity * cfg.d_model * FP32_BYTES
    moe_layers = len(cfg.moe_layer_indices)

    def all_to_alls(method: str) -> list[tuple[str, float]]:
        planned = plan("bert_moe", "paper", method)
        return [
            (c.label, sum(c.nbytes.values(planned.ratios)))
            for st in planned.program.stages
            for c in st.collectives
            if c.kind == "all_to_all"
        ]

    ds = all_to_alls("deepspeed")
    assert len(ds) == 4 * moe_layers  # dispatch and combine, forward and backward
    assert [b for _, b in ds] == pytest.approx([buffer] * len(ds), rel=1e-12)

    hap = all_to_alls("hap")
    graph = capture_config(cfg, wl.global_batch)
    expert_shape = (wl.global_batch, cfg.num_experts, cfg.capacity, cfg.d_model)
    experts = [b for label, b in hap if label in graph.by_name and graph[label].shape == expert_shape]
    assert len(experts) == 4 * moe_layers, f"hap did not plan expert parallelism: all-to-alls {hap}"
    assert experts == pytest.approx([buffer] * len(experts), rel=1e-12)
    assert sum(experts) == pytest.approx(sum(b for _, b in ds), rel=1e-12)


def test_deepspeed_gets_the_models_slots_per_sequence_times_the_micro_batch():
    moe = plan("bert_moe", "paper", "deepspeed").details["moe"]
    assert moe["capacity_factor"] == 1.5  # 3 slots x 128 experts / (128 tokens x top-2)
    assert moe["min_capacity"] == 0 and moe["capacity"] == 3 * 32


@pytest.mark.parametrize("experts", [4, 7, 12, 16, 96, 128])
@pytest.mark.parametrize("seq_len", [64, 100, 128])
@pytest.mark.parametrize("top_k", [1, 2])
def test_the_matching_capacity_factor_gives_the_models_slots_at_any_micro_batch(experts, seq_len, top_k):
    # 7 experts: the plain ratio 2.5 x 64 / 7 rounds above the integer in float32 at batch 1.
    slots = moe_capacity(seq_len, experts, 2.5)
    for micro in (1, 2, 3, 7, 32, 100, 1000):
        factor = matching_capacity_factor(slots, seq_len, micro, experts, top_k)
        assert deepspeed_capacity(micro * seq_len, experts, factor, top_k, 0) == slots * micro


def test_capacity_replica_is_deepspeeds_own_arithmetic():
    sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")
    for experts in (4, 7, 128):
        for tokens in (64, 128 * 3, 4096):
            for factor, k, minimum in ((1.25, 2, 4), (1.5, 2, 0), (2.5, 1, 0), (7 * 23 / 128, 2, 0), (0.01, 2, 8)):
                gates = torch.empty(tokens, experts)
                theirs = sharded_moe._capacity(gates, torch.tensor(factor * k), torch.tensor(minimum))
                assert deepspeed_capacity(tokens, experts, factor, k, minimum) == int(theirs)


def test_deepspeeds_moe_layer_dispatches_the_models_slots_at_runtime(micro=3):
    """DeepSpeed's MoE layer as the method builds it (swap_moe_layers) on the tiny model widened to
    the paper case (128 experts, seq_len 128: 3 slots per sequence), one forward on the CPU. All
    experts stay on this process (ep_size 1): the gate's capacity depends on the rank's tokens only."""
    deepspeed = pytest.importorskip("deepspeed")
    pytest.importorskip("deepspeed.moe.layer")
    cfg = BertMoEConfig.from_preset("tiny", num_devices=64, seq_len=128)
    assert cfg.capacity == 3
    wl = Workload("bert_moe", "tiny", cfg, micro * 64, flops_per_sample=1.0)
    moe = DeepSpeedZeRO().moe_settings(wl, paper_cluster())
    torch.manual_seed(0)
    model = cfg.build()
    assert swap_moe_layers(model, {**moe, "ep_size": 1}, 0, deepspeed) == len(cfg.moe_layer_indices)
    shapes = []
    for name, module in model.named_modules():
        if name.endswith("deepspeed_moe.experts"):
            module.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    with torch.no_grad():
        model(*cfg.synthetic_batch(micro, torch.Generator().manual_seed(0)))
    # (expert-parallel ranks, experts per rank, slots per expert, d_model): the dispatch buffer.
    assert shapes == [(1, cfg.num_experts, cfg.capacity * micro, cfg.d_model)] * len(cfg.moe_layer_indices)
