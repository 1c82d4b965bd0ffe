"""One step of the pipeline and of FSDP on emulated devices == one step on the whole batch.

As tests/e2e/test_dp_equivalence.py checks DDP: the summed loss, every gradient and every
parameter after Adam's step, against the single-device model on the global batch, for the plans
really made (the pipeline's stage cuts, device order, schedule, micro-batches and pipelines' shares;
FSDP's units and shares).
"""

import numpy as np
import pytest
import torch

from bench.cost.pipeline import SCHEDULES
from bench.runner.case import new_record, prepare_case
from bench.runtime.launch import launch
from bench.runtime.pacing import RankHooks

pytestmark = pytest.mark.e2e


def _single_device_step(case):
    workload = case.workload
    model = workload.build(case.seed)
    data = workload.model_cfg.dataset("synthetic", None, "train", case.seed)
    batch = data.batch(0, 0, workload.global_batch, workload.global_batch)
    optimizer = torch.optim.Adam(model.parameters(), lr=case.method.lr)
    loss = model(*batch) / workload.targets_per_iter
    loss.backward()
    if case.method.grad_clip:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case.method.grad_clip)
        assert norm > case.method.grad_clip, "the test clips nothing: lower method.grad_clip"
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    return loss.item(), grads, dict(model.named_parameters())


def _check_one_step(cfg_factory, *overrides, ranks=2):
    cfg = cfg_factory(*overrides, "warmup_iters=0", "measured_iters=1")
    case = prepare_case(cfg, new_record(cfg))
    case.hooks = RankHooks(return_state=True)
    case.method.mirror_full_state = True
    results = launch(case, ranks, timeout_s=180)
    loss, grads, params = _single_device_step(case)
    dist_loss = sum(r["loss_sums"][0] for r in results) / case.workload.targets_per_iter
    assert dist_loss == pytest.approx(loss, rel=1e-5)
    got = results[0]["grads"]
    assert set(got) == set(grads)
    scale = max(g.abs().max().item() for g in grads.values())
    for name, ref in grads.items():
        np.testing.assert_allclose(got[name], ref.numpy(), rtol=1e-5, atol=1e-5 * scale, err_msg=name)
    for name, ref in params.items():  # elements whose gradient is float noise have no defined update
        kept = grads[name].abs().numpy() >= 1e-4 * scale
        np.testing.assert_allclose(
            np.asarray(results[0]["params"][name])[kept], ref.detach().numpy()[kept], rtol=1e-5, atol=1e-6, err_msg=name
        )
    return case


@pytest.mark.parametrize("model", ["vgg19", "vit", "bert", "bert_moe"])
def test_one_pipeline_step_equals_single_device_training(cfg_factory, model):
    """The planner's own choice of schedule, stages per rank and micro-batches."""
    case = _check_one_step(cfg_factory, f"model={model}", "method=pipeline", "method.profile=false", "global_batch=8")
    assert case.plan.details["num_stages"] == 2


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_the_planner_can_choose_equals_single_device_training(cfg_factory, schedule):
    """torch's single-stage, looped, interleaved and zero-bubble schedules, several stages per
    rank where the schedule runs them (tiny BERT's four layer groups on two ranks)."""
    case = _check_one_step(
        cfg_factory,
        "model=bert",
        "method=pipeline",
        f"method.schedule={schedule}",
        "method.profile=false",
        "global_batch=8",
    )
    d = case.plan.details
    assert d["schedule"] == schedule and d["num_stages"] == 2
    assert d["stages_per_rank"] == (1 if schedule in ("1f1b", "gpipe") else 2)


def test_a_gpipe_pipeline_over_four_devices_in_a_priced_order_equals_single_device_training(cfg_factory):
    case = _check_one_step(
        cfg_factory,
        "model=bert",
        "cluster=local_hetero4",
        "method=pipeline",
        "method.schedule=gpipe",
        "method.num_stages=4",
        "method.profile=false",
        "global_batch=8",
        ranks=4,
    )
    assert case.plan.details["num_stages"] == 4


def test_pipelines_replicated_over_machines_equal_single_device_training(cfg_factory):
    case = _check_one_step(
        cfg_factory,
        "model=vit",
        "cluster=local_2x2",
        "method=pipeline",
        "method.stage_level=machine",
        "method.profile=false",
        "global_batch=8",
        ranks=4,
    )
    assert case.plan.details["num_pipelines"] == 2


def test_two_stage_pipelines_replicated_over_unlike_devices_equal_single_device_training(cfg_factory):
    case = _check_one_step(
        cfg_factory,
        "model=bert_moe",
        "cluster=local_hetero4",
        "method=pipeline",
        "method.stage_level=device",
        "method.num_stages=2",
        "method.schedule=1f1b",
        "method.profile=false",
        "global_batch=16",
        ranks=4,
    )
    assert case.plan.details["num_pipelines"] == 2 and case.plan.details["num_micro_batches"] >= 2


@pytest.mark.parametrize("schedule", ["1f1b", "zbvzerobubble"])
def test_checkpointed_stages_equal_single_device_training(cfg_factory, schedule):
    """Every layer group under torch.utils.checkpoint (recomputed in backward), with a whole
    backward and with zero-bubble's two passes."""
    case = _check_one_step(
        cfg_factory,
        "model=bert",
        "method=pipeline",
        f"method.schedule={schedule}",
        "method.activation_checkpointing=true",
        "method.profile=false",
        "global_batch=8",
    )
    assert case.plan.details["activation_checkpointing"] is True


@pytest.mark.parametrize(
    "model,cluster,extra",
    [
        # two pipelines, one per machine (0.5x and 1x devices): a 5 / 11 split of 16 samples; two
        # stages a pipeline, whatever the host's measured speed prices
        ("bert", "local_2x2", ("method.stage_level=device", "method.num_stages=2", "global_batch=16")),
        # pipelines of the 0.25x and 0.5x devices and of the two 1x ones
        ("bert", "local_hetero4", ("method.num_stages=2",)),
    ],
)
def test_pipelines_with_uneven_batches_equal_single_device_training(cfg_factory, model, cluster, extra):
    """Each pipeline's share in proportion to its priced speed, as the planner makes them for
    pipelines of alike devices whose replicas are unlike (method.alike=pipeline)."""
    case = _check_one_step(
        cfg_factory,
        f"model={model}",
        f"cluster={cluster}",
        "method=pipeline",
        "method.alike=pipeline",
        "method.profile=false",
        *extra,
        ranks=4,
    )
    d = case.plan.details
    assert d["num_pipelines"] == 2 and len(set(d["pipeline_batches"])) == 2, d
    assert sum(d["pipeline_batches"]) == case.workload.global_batch


def test_clipped_pipelines_replicated_over_machines_equal_clipped_single_device_training(cfg_factory):
    # The global norm: every stage of one pipeline counted once, its replicas not again.
    case = _check_one_step(
        cfg_factory,
        "model=bert",
        "cluster=local_2x2",
        "method=pipeline",
        "method.stage_level=machine",
        "method.profile=false",
        "method.grad_clip=0.05",
        "global_batch=8",
        ranks=4,
    )
    assert case.plan.details["num_pipelines"] == 2 and case.plan.details["num_stages"] == 2


@pytest.mark.parametrize("model", ["vgg19", "bert_moe"])  # convolutions, experts; bert below
def test_one_fsdp_step_with_uneven_shares_equals_single_device_training(cfg_factory, model):
    case = _check_one_step(cfg_factory, f"model={model}", "method=fsdp_cp", "method.work_probe=false", "global_batch=7")
    assert len(set(case.plan.batch_shares)) == 2


def test_one_even_fsdp_step_equals_single_device_training(cfg_factory):
    _check_one_step(cfg_factory, "model=bert", "method=fsdp", "method.work_probe=false", "global_batch=8")


# Each model with a memory tool or both (methods.common.MemoryTools): the checkpoints run inside
# FSDP2's units (a block, VGG19's conv stages through their nn.Sequential), and every micro-step
# gathers the units and reduce-scatters into the shards; uneven shares (10 and 4 of 14) for fsdp_cp.
FSDP_MEMORY_TOOLS = [
    ("fsdp_cp", "vgg19", ("method.activation_checkpointing=true", "method.grad_accumulation=2")),
    ("fsdp", "vit", ("method.activation_checkpointing=true",)),
    ("fsdp_cp", "bert", ("method.grad_accumulation=2",)),
    ("fsdp_cp", "bert_moe", ("method.activation_checkpointing=true", "method.grad_accumulation=2")),
]


@pytest.mark.parametrize("method,model,tools", FSDP_MEMORY_TOOLS)
def test_one_fsdp_step_with_memory_tools_equals_single_device_training(cfg_factory, method, model, tools):
    case = _check_one_step(
        cfg_factory, f"model={model}", f"method={method}", "method.work_probe=false", "global_batch=14", *tools
    )
    memory = case.plan.details["memory_tools"]
    assert bool(memory["checkpointed_groups"]) == ("method.activation_checkpointing=true" in tools)
    assert memory["grad_accumulation"] == (2 if "method.grad_accumulation=2" in tools else 1)


# Hugging Face models tie their embedding and head: one parameter read by the first layer group
# and the last. FSDP2 keeps it in the root's unit (methods.fsdp.fsdp_units); a pipeline's first
# and last stages each hold it and must sum its gradient.
@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_one_fsdp_step_of_a_model_with_tied_weights_equals_single_device_training(cfg_factory, arch):
    pytest.importorskip("transformers", reason="model=hf needs the optional extra .[zoo]")
    case = _check_one_step(
        cfg_factory, "model=hf", f"model.arch={arch}", "method=fsdp_cp", "method.work_probe=false", "global_batch=8"
    )
    assert case.plan.details["root_params"]  # the tied parameter


# (extra overrides, ranks, the positions holding the tied parameter): two stages at device
# level and the schedule fixed, whatever the host's measured speed prices: the embedding and the
# head on one position of a V (one tensor, no all-reduce), or on two positions with several stages
# per rank; a clipped global norm that counts the parameter once; two pipelines with sharded state.
TIED = [
    (("method.schedule=zbvzerobubble",), 2, []),
    (("method.schedule=interleaved1f1b", "method.stages_per_rank=2", "method.grad_clip=0.05"), 2, [0, 1]),
    (("cluster=local_2x2", "method.sharded_state=true", "method.grad_clip=0.05", "global_batch=16"), 4, [0, 1]),
]


@pytest.mark.parametrize(
    "extra,ranks,positions",
    TIED,
    ids=["v_one_position", "interleaved_clipped", "sharded_clipped"],
)
def test_one_pipeline_step_of_a_model_with_tied_weights_equals_single_device_training(
    cfg_factory, extra, ranks, positions
):
    pytest.importorskip("transformers", reason="model=hf needs the optional extra .[zoo]")
    case = _check_one_step(
        cfg_factory,
        "model=hf",
        "model.arch=gpt2",
        "method=pipeline",
        "method.profile=false",
        "method.stage_level=device",
        "method.num_stages=2",
        "global_batch=8",
        *extra,
        ranks=ranks,
    )
    d = case.plan.details
    assert d["num_pipelines"] == ranks // 2 and d["sharded_state"] == ("method.sharded_state=true" in extra), d
    assert [t["positions"] for t in d["tied_params"]] == ([positions] if positions else []), d
    tie = [a for actions in case.plan.program.actions for a in actions if a[0] == "tie"]
    assert len(tie) == len(positions)


# Sharded state: each stage's parameters, gradients and Adam state sharded over its replicas
# (FSDP2 over the ranks that hold it in the other pipelines), with equal and priced shares,
# checkpointed stages and a clipped global norm.
SHARDED = [
    ("vit", "local_2x2", ("method.stage_level=machine", "global_batch=8")),
    # two stages a pipeline, so that each stage has a replica whatever the host's measured speed prices
    (
        "bert",
        "local_2x2",
        ("method.stage_level=device", "method.num_stages=2", "method.alike=pipeline", "global_batch=16"),
    ),
    ("bert_moe", "local_2x2", ("method.stage_level=machine", "method.shares=equal", "global_batch=8")),
    ("bert", "local_2x2", ("method.stage_level=machine", "method.activation_checkpointing=true", "global_batch=8")),
    (
        "bert",
        "local_2x2",
        ("method.stage_level=device", "method.num_stages=2", "method.grad_clip=0.05", "global_batch=16"),
    ),
]


@pytest.mark.parametrize("model,cluster,extra", SHARDED)
def test_pipelines_with_sharded_state_equal_single_device_training(cfg_factory, model, cluster, extra):
    case = _check_one_step(
        cfg_factory,
        f"model={model}",
        f"cluster={cluster}",
        "method=pipeline",
        "method.sharded_state=true",
        "method.profile=false",
        *extra,
        ranks=4,
    )
    d = case.plan.details
    assert d["sharded_state"] is True and d["num_pipelines"] == 2, d
    assert case.plan.program.sharded_state
    if "method.alike=pipeline" in extra:
        assert len(set(d["pipeline_batches"])) == 2, d  # uneven shares


def test_a_pipeline_of_a_model_with_rotary_tables_equals_single_device_training(cfg_factory):
    """Llama's rotary embedding moves its frequencies `to` the device in forward (a positional
    device, which the captured graph holds as meta: retargeted to the rank's by with_tensors),
    and the cos and sin tables it makes from that buffer cross into later stages needing no
    gradient (methods.pipeline.profile times each layer group's backward from the gradients of
    its outputs that need one: tests/unit/test_pipeline_plan.py)."""
    pytest.importorskip("transformers", reason="model=hf needs the optional extra .[zoo]")
    case = _check_one_step(
        cfg_factory,
        "model=hf",
        "model.arch=llama",
        "method=pipeline",
        "method.stage_level=device",
        "method.num_stages=2",
        "method.profile=false",
        "global_batch=8",
    )
    assert case.plan.details["num_stages"] == 2
