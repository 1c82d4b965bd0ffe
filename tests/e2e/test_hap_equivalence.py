"""Synthesized HAP programs run on 2-3 gloo workers train exactly like one device: same loss,
same (reassembled) gradients, same parameters after 3 Adam steps, with uneven and empty shards,
both all-gather implementations and SFB."""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.core.cluster import ClusterSpec
from bench.core.interfaces import Plan, Workload
from bench.core.shares import round_shares
from bench.cost import virtual_devices
from bench.cost.flops import train_flops_per_sample
from bench.runtime.launch import launch
from bench.runtime.pacing import RankHooks
from bench.runtime.worker import Case
from methods.graph import capture_config
from methods.hap.balance import batch_shares
from methods.hap.planner import PLAN_FORMAT_VERSION
from methods.hap.pricing import CostModel
from methods.hap.runtime import FixedPlanMethod
from methods.hap.search import synthesize
from methods.hap.steps import comm_to_json, shard_units
from methods.hap.theory import derive_theory

pytestmark = pytest.mark.e2e

MODELS = {"vgg19": "VGG19Config", "vit": "ViTConfig", "bert": "BertConfig", "bert_moe": "BertMoEConfig"}
STEPS = 3


def make_cluster(n: int, machines: list[int] | None = None) -> ClusterSpec:
    """n devices, one machine each (or `machines` devices per machine), not emulated
    (equivalence needs no timing); machine-level virtual devices when `machines` is given."""
    machines = machines or [1] * n
    assert sum(machines) == n
    return ClusterSpec.from_config(
        {
            "name": f"test{n}",
            "emulated": False,
            "virtual_device": "machine" if len(machines) < n else "gpu",
            "machines": [{"count": 1, "device": "cpu", "num_devices": k} for k in machines],
            "links": {
                level: {"bandwidth_gbps": 1.0, "latency_s": 5e-5} for level in ("intra_machine", "inter_machine")
            },
        }
    ).with_host_speed(1e10)


def make_workload(model: str, n: int, global_batch: int) -> Workload:
    cfg = getattr(importlib.import_module(f"models.{model}"), MODELS[model]).from_preset("tiny", num_devices=n)
    return Workload(model, "tiny", cfg, global_batch, train_flops_per_sample(cfg))


def plan_at_ratios(
    workload: Workload, cluster: ClusterSpec, ratios: list, sfb: bool = True, segmentation: str = "layers"
) -> Plan:
    """A HAP plan synthesized at fixed ratios per virtual device (the planner's pieces, without
    its LP); batch shares per rank as the planner gives them (a machine's share split evenly).
    `ratios` is one row, or one row per segment (then segments are cut as the planner does, by
    `segmentation`)."""
    granularity = cluster.virtual_device
    rows = ratios if isinstance(ratios[0], list) else [ratios]
    ratios = rows[0]
    graph = capture_config(workload.model_cfg, workload.global_batch)
    theory = derive_theory(graph, sfb=sfb)
    res = synthesize(theory, CostModel(theory, cluster, granularity, rows, segmentation))
    details = {
        "plan_format": PLAN_FORMAT_VERSION,
        "loss": graph.loss,
        "ratios": rows,
        "granularity": granularity,
        "steps": [s.to_json(graph) for s in res.steps],
        "final_comms": [comm_to_json(c) for c in res.final_comms],
        "shard_units": {str(k): v for k, v in shard_units(res.steps, graph).items()},
    }
    shares = []
    for v, share in zip(virtual_devices(cluster, granularity), batch_shares(workload.global_batch, ratios)):
        shares += round_shares(share, [1.0] * len(v.ranks))
    return Plan("hap", shares, details, None, rows)


def single_device(workload: Workload, seed: int, steps: int, lr: float, grad_clip: float = 0.0):
    """Losses of every step, gradients of the last step (after clipping), parameters after
    `steps` Adam steps of single-device training on the global batch, and per parameter the
    smallest |gradient| of each element over the steps relative to that step's largest."""
    model = workload.build(seed)
    data = workload.model_cfg.dataset("synthetic", None, "train", seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    floors: dict[str, torch.Tensor] = {}
    for it in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(*data.batch(it, 0, workload.global_batch, workload.global_batch)) / workload.targets_per_iter
        loss.backward()
        losses.append(loss.item())
        if grad_clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            assert norm > grad_clip, "the test clips nothing: lower grad_clip"
        scale = max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
        for n, p in model.named_parameters():
            if p.grad is not None:
                rel = p.grad.detach().abs() / scale
                floors[n] = rel if n not in floors else torch.minimum(floors[n], rel)
        opt.step()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, floors


def run_case(
    model: str,
    ratios: list,
    global_batch: int = 7,
    machines: list[int] | None = None,
    segmentation: str = "layers",
    **options,
):
    n = sum(machines) if machines else len(ratios[0] if isinstance(ratios[0], list) else ratios)
    workload = make_workload(model, n, global_batch)
    cluster = make_cluster(n, machines)
    plan = plan_at_ratios(workload, cluster, ratios, segmentation=segmentation)
    method = FixedPlanMethod(plan, mirror_full_state=True, **options)
    case = Case(
        workload,
        cluster,
        method,
        method.plan(workload, cluster),
        seed=0,
        warmup_iters=0,
        measured_iters=STEPS,
        hooks=RankHooks(return_state=True),
    )
    results = launch(case, n, timeout_s=120)
    return workload, plan, results


def check_equivalence(
    workload: Workload,
    results: list[dict],
    lr: float = 5e-4,
    grad_clip: float = 0.0,
    reference=None,
    steps: int = STEPS,
) -> None:
    """`results` (rank 0 returning the reassembled state) against single-device training: the
    CPU's, or `reference` = single_device's (losses, grads, params[, floors]) computed elsewhere (a GPU)."""
    reference = reference or single_device(workload, 0, steps, lr, grad_clip)
    losses, grads, params = reference[:3]
    floors = reference[3] if len(reference) > 3 else {}
    dist_losses = [sum(r["loss_sums"][i] for r in results) / workload.targets_per_iter for i in range(steps)]
    np.testing.assert_allclose(dist_losses, losses, rtol=1e-5)
    got = results[0]["grads"]  # the last step's gradients, reassembled from every rank's shards
    assert set(got) == set(grads)
    # fp32 sums in another order differ by a few ulps of the terms summed, not of the result:
    # the absolute floor is relative to the model's largest gradient.
    scale = max(g.abs().max().item() for g in grads.values())
    for name, ref in grads.items():
        np.testing.assert_allclose(got[name], ref.numpy(), rtol=1e-5, atol=1e-5 * scale, err_msg=name)
    for name, ref in params.items():
        if grads[name].abs().max() < 1e-3 * scale:
            continue  # zero in exact arithmetic (attention key bias): float noise Adam scales up
        # Adam moves an element by ~lr per step whatever its gradient's size, so an element
        # whose gradient is near zero turns fp32 noise into up to a few 1e-6: atol is 2% of lr.
        # An element whose gradient was at fp32 noise in some step (below 1e-6 of that step's
        # largest, e.g. 5e-9 against 0.17: zero in exact arithmetic, a dead unit) has no defined
        # update: Adam turns the noise's sign and size into up to lr. Such elements are left out.
        keep = (floors[name] >= 1e-6).numpy() if name in floors else np.ones(ref.shape, dtype=bool)
        np.testing.assert_allclose(
            np.asarray(results[0]["params"][name])[keep], ref.numpy()[keep], rtol=1e-5, atol=lr / 50, err_msg=name
        )


def compiled(model: str, ratios: list[float], **options):
    """Rank 0's compiled program, built in this process (no collectives run)."""
    from methods.hap.codegen import CodegenOptions, RankProgram

    workload = make_workload(model, len(ratios), 7)
    plan = plan_at_ratios(workload, make_cluster(len(ratios)), ratios)
    graph = capture_config(workload.model_cfg, workload.global_batch)
    return RankProgram(
        graph,
        plan.details,
        plan.ratios,
        plan.batch_shares,
        workload.build(0),
        0,
        len(ratios),
        CodegenOptions(**options),
    )


# Every model on 3 devices with an empty shard (on the first, middle or last rank), one model on
# 2 devices; each all-gather implementation forced in two cases, SFB forced in three, the plan's
# own choices in one, global-norm clipping in one; replicated gradients all-reduced in DDP-like
# buckets (one bucket, many small ones) or, in one case, by replicate() per use. Plans over
# machine-level virtual devices (data parallel inside a machine, collectives in three steps):
# SFB and grouped forced with a machine of 2 GPUs beside one of 1, and with an empty machine;
# the planner's own machine-level plans are in test_planned_machine_level_program_...
CASES = [
    pytest.param("vgg19", [0.6, 0.0, 0.4], dict(force_impl="padded"), id="vgg19-3dev-empty1-padded"),
    pytest.param(
        "vgg19",
        [0.7, 0.3],
        dict(force_impl="grouped", force_sfb=True, bucket_grads=False),
        id="vgg19-2dev-grouped-sfb-replicate",
    ),
    pytest.param(
        "vit",
        [0.0, 0.5, 0.5],
        dict(force_impl="grouped", force_sfb=True, bucket_cap_mb=0.01),
        id="vit-3dev-empty0-grouped-sfb-small-buckets",
    ),
    pytest.param(
        "bert",
        [0.5, 0.0, 0.5],
        dict(force_impl="padded", force_sfb=True, grad_clip=0.05),
        id="bert-3dev-empty1-padded-sfb-clip",
    ),
    pytest.param("bert_moe", [0.5, 0.3, 0.0], dict(), id="bert_moe-3dev-empty2-planned"),
    pytest.param(
        "vit",
        [0.65, 0.35],
        dict(machines=[2, 1], force_impl="grouped", force_sfb=True),
        id="vit-3dev-2machines-grouped-sfb",
    ),
    pytest.param(
        "bert", [0.0, 1.0], dict(machines=[1, 2], bucket_grads=False), id="bert-3dev-2machines-empty0-replicate"
    ),
    # Every model on 2 devices as well, with the all-gather its 3-device case does not force.
    pytest.param("vit", [0.65, 0.35], dict(force_impl="padded"), id="vit-2dev-padded"),
    pytest.param("bert", [0.3, 0.7], dict(force_impl="grouped"), id="bert-2dev-grouped"),
    pytest.param("bert_moe", [0.6, 0.4], dict(force_impl="grouped"), id="bert_moe-2dev-grouped"),
]

# Segments: a ratio row per group of ops, shards resharded where a tensor crosses into a group
# with another row (a zero-length shard in some rows, rows that move every boundary). Cut at
# layer groups (the default) unless a case says otherwise: at equal FLOPs inside a block, or
# METIS parts that need not be contiguous in op order.
SEGMENT_CASES = [
    pytest.param("bert", [[0.5, 0.0, 0.5], [0.2, 0.5, 0.3], [0.0, 0.6, 0.4]], dict(), id="bert-3dev-3seg"),
    pytest.param("vit", [[0.7, 0.3], [0.25, 0.75]], dict(force_impl="grouped"), id="vit-2dev-2seg"),
    pytest.param("bert_moe", [[0.4, 0.3, 0.3], [0.1, 0.3, 0.6]], dict(), id="bert_moe-3dev-2seg"),
    pytest.param("vit", [[0.3, 0.7], [0.6, 0.4]], dict(segmentation="flops"), id="vit-2dev-2seg-flops"),
    pytest.param(
        "bert",
        [[0.5, 0.2, 0.3], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]],
        dict(segmentation="metis"),
        id="bert-3dev-3seg-metis",
    ),
    pytest.param("bert_moe", [[0.6, 0.4], [0.3, 0.7]], dict(machines=[2, 2]), id="bert_moe-2x2machines-2seg"),
]


@pytest.mark.parametrize("model,rows,options", SEGMENT_CASES)
def test_program_with_segments_trains_exactly_like_one_device(model, rows, options):
    if options.get("segmentation") == "metis":
        pytest.importorskip("pymetis")
    workload, plan, results = run_case(model, rows, **options)
    steps = plan.details["steps"]
    assert {s["segment"] for s in steps} == set(range(len(rows)))
    assert any(c["kind"] == "reshard" for s in steps for c in s["comms"]), "no tensor crosses a segment border"
    assert sum(plan.batch_shares) == 7
    check_equivalence(workload, results)


@pytest.mark.parametrize("model,ratios,options", CASES)
def test_synthesized_program_trains_exactly_like_one_device(model, ratios, options):
    workload, plan, results = run_case(model, ratios, **options)
    assert [r["rank"] for r in results] == list(range(sum(options.get("machines") or [1] * len(ratios))))
    assert sum(plan.batch_shares) == 7 and (0 in plan.batch_shares) == (0.0 in ratios)
    check_equivalence(workload, results, grad_clip=options.get("grad_clip", 0.0))


def _conf_cluster(name: str) -> ClusterSpec:
    """A shipped cluster (conf/cluster), not emulated: equivalence needs no timing."""
    import yaml

    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "cluster" / f"{name}.yaml").read_text())
    return ClusterSpec.from_config({**cfg, "emulated": False}).with_host_speed(1e10)


# The planner's machine-level plans (LP ratios, its segments and gradient buckets) for every
# model, on the shipped emulated clusters of 2 machines x 2 devices and of 3 machines of 1, 2
# and 1 devices; 11 samples, so machines and their GPUs get uneven shares.
MACHINE_CASES = [
    pytest.param("vgg19", "local_3m", id="vgg19-local_3m"),
    pytest.param("vit", "local_2x2", id="vit-local_2x2"),
    pytest.param("bert", "local_3m", id="bert-local_3m"),
    pytest.param("bert_moe", "local_2x2", id="bert_moe-local_2x2"),
]


@pytest.mark.parametrize("model,cluster_name", MACHINE_CASES)
def test_planned_machine_level_program_trains_exactly_like_one_device(model, cluster_name):
    from methods.hap.planner import HapPlanner

    cluster = _conf_cluster(cluster_name)
    workload = make_workload(model, cluster.num_devices, 11)
    plan = HapPlanner(cache_dir=None, levels="cluster").plan(workload, cluster)
    assert plan.details["granularity"] == "machine" and len(plan.ratios[0]) == cluster.num_machines
    method = FixedPlanMethod(plan, mirror_full_state=True)
    case = Case(
        workload,
        cluster,
        method,
        method.plan(workload, cluster),
        seed=0,
        warmup_iters=0,
        measured_iters=STEPS,
        hooks=RankHooks(return_state=True),
    )
    results = launch(case, cluster.num_devices, timeout_s=120)
    check_equivalence(workload, results)


def test_a_machine_shard_of_partial_samples_is_refused_before_workers_start():
    """Inside a machine a tensor is split in whole samples: a plan whose machine shards of a
    merged batch x sequence dim are not whole sequences (its shard unit removed) is refused
    in one line naming the tensor and the fix, by FixedPlanMethod.plan (no worker started)."""
    from methods.hap.codegen import PlanMismatchError

    workload, cluster = make_workload("bert", 4, 7), make_cluster(4, [2, 2])
    plan = plan_at_ratios(workload, cluster, [0.6, 0.4])
    FixedPlanMethod(plan).plan(workload, cluster)  # as planned: whole samples
    plan.details["shard_units"] = {}
    with pytest.raises(
        PlanMismatchError,
        match=r"tensor '.*': a machine's \d+ rows along the batch dim are not "
        r"whole samples.*re-plan \(details.shard_units",
    ) as err:
        FixedPlanMethod(plan).plan(workload, cluster)
    assert "\n" not in str(err.value)


def test_forced_options_reach_the_generated_code():
    sfb = compiled("bert", [0.5, 0.0, 0.5], force_sfb=True, force_impl="grouped").summary()
    assert len(sfb["sfb"]) >= 4 and sfb["sfb_impl"] == "grouped"
    assert all(not k.endswith("/padded") for k in sfb["collectives"])
    vgg = compiled("vgg19", [0.6, 0.0, 0.4], force_impl="padded").summary()
    kinds = {k.split("/")[0] for k in vgg["collectives"]}
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= kinds or {"all_to_all", "reduce_scatter"} <= kinds
    assert vgg["sharded_params"] and vgg["replicated_params"]
    assert all(not k.endswith("/grouped") for k in vgg["collectives"])


@contextlib.contextmanager
def _one_rank(model):
    """(workload, plan, graph, batch) of tiny `model` planned for one rank, inside a one-rank
    gloo group (a RankProgram's collectives need one even alone)."""
    import torch.distributed as dist

    from bench.runtime.launch import _free_port

    workload = make_workload(model, 1, 3)
    plan = plan_at_ratios(workload, make_cluster(1), [1.0])
    graph = capture_config(workload.model_cfg, workload.global_batch)
    batch = workload.model_cfg.synthetic_batch(3, torch.Generator().manual_seed(1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield workload, plan, graph, batch
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_recorded_module_runs_what_the_interpreter_runs(model):
    """After its first call a program runs the fx module it recorded: three Adam steps give
    bit-identical losses, gradients and parameters to interpreting the plan at every step (one
    rank; the multi-rank equivalence tests above run the recorded module from step 2 on)."""
    from methods.hap.codegen import CodegenOptions, RankProgram

    with _one_rank(model) as (workload, plan, graph, batch):
        runs = []
        for compile_ in (True, False):
            program = RankProgram(
                graph,
                plan.details,
                plan.ratios,
                plan.batch_shares,
                workload.build(0),
                0,
                1,
                CodegenOptions(compile=compile_),
            )
            optimizer = torch.optim.Adam(list(program.params.values()), lr=1e-3)
            losses = []
            for _ in range(STEPS):
                optimizer.zero_grad()
                loss = program(*batch)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            runs.append((program, losses, {k: p.detach().clone() for k, p in program.params.items()}))
    (recorded, losses, params), (interpreted, ref_losses, ref_params) = runs
    assert recorded.module is not None and interpreted.module is None
    assert "load_" not in recorded.module.code  # one rank holds the whole batch: nothing gathered
    assert losses == ref_losses
    for name, ref in ref_params.items():
        assert torch.equal(params[name], ref), name


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_first_call_holds_no_more_than_the_recorded_module(model):
    """The first call interprets the plan while recording it; it drops each value after its
    last reader, so at no point of its forward does it hold more tensors than a later call of
    the recorded module (fx frees a value after its last use), not every value it made (the
    interpreter's environment kept them all: hap's first step on one H200 peaked 1.05 GiB
    above every later one for BERT-Base at 64 samples, 0.4-1 GiB for ViT and BERT-MoE)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from methods.hap.codegen import CodegenOptions, RankProgram

    class Made(TorchDispatchMode):  # every tensor an op returns (weakly), and the most alive at once
        def __init__(self):
            super().__init__()
            self.refs, self.peak = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.refs += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.peak = max(self.peak, sum(1 for r in self.refs if r() is not None))
            return out

    with _one_rank(model) as (workload, plan, graph, batch):
        program = RankProgram(
            graph, plan.details, plan.ratios, plan.batch_shares, workload.build(0), 0, 1, CodegenOptions()
        )
        held = []
        for _ in range(2):  # the first call records, the second runs the recorded module
            with Made() as made:
                loss = program(*batch)
            held.append((made.peak, len(made.refs)))
            loss.backward()
            del loss
    (first, made_first), (later, made_later) = held
    assert made_first == made_later  # the same ops ran
    assert first == later, held


def test_plan_for_another_model_or_batch_fails_before_workers_start():
    from methods.hap.codegen import PlanMismatchError

    workload = make_workload("bert", 2, 7)
    cluster = make_cluster(2)
    plan = plan_at_ratios(make_workload("vit", 2, 7), cluster, [0.5, 0.5])
    with pytest.raises(PlanMismatchError, match="another model or preset"):
        FixedPlanMethod(plan).plan(workload, cluster)
    plan = plan_at_ratios(workload, cluster, [0.5, 0.5])
    with pytest.raises(PlanMismatchError, match="global batch is 9"):
        FixedPlanMethod(plan).plan(make_workload("bert", 2, 9), cluster)
    with pytest.raises(PlanMismatchError, match="3 ranks"):
        FixedPlanMethod(plan).plan(workload, make_cluster(3))


def test_nan_loss_stops_the_step_naming_step_and_rank_before_the_update():
    from types import SimpleNamespace

    from bench.runtime.emulation import Emulator
    from methods.hap.runtime import HapTrainer

    weight = torch.nn.Parameter(torch.ones(2))

    class NanProgram:  # what a rank's program returns when its shard's loss overflowed
        params, grad_sync, sharded, param_layouts, machines = {"w": weight}, [], {"w"}, {"w": 0}, None

        def __call__(self, x):
            return (weight * x).sum() * float("nan")

    ctx = SimpleNamespace(
        rank=1,
        world_size=2,
        device=torch.device("cpu"),
        emulator=Emulator(make_cluster(2), 1, enabled=False),
        workload=make_workload("bert", 2, 7),
    )
    trainer = HapTrainer(NanProgram(), ctx)
    with pytest.raises(FloatingPointError, match="loss is nan at step 0 on rank 1"):
        trainer.step((torch.ones(2),))
    assert torch.equal(weight.detach(), torch.ones(2))  # no update


def test_a_reshard_between_equal_rows_is_no_op_in_the_program(monkeypatch):
    """Segments whose rows cut a tensor alike move nothing, and the cost model charges nothing
    for it: the program holds no reshard call, not even an autograd node (the function it runs
    returns its input); rows that differ keep the real collective."""
    from methods.hap import collectives
    from methods.hap.codegen import CodegenOptions, RankProgram

    monkeypatch.setattr(collectives, "reshard", lambda x, *args: ("reshard", args))
    workload = make_workload("bert", 2, 4)
    graph = capture_config(workload.model_cfg, workload.global_batch)
    x = torch.ones(2, 3, requires_grad=True)
    for rows, moves in (([[0.5, 0.5], [0.5, 0.5]], False), ([[0.5, 0.5], [0.75, 0.25]], True)):
        plan = plan_at_ratios(workload, make_cluster(2), rows)
        program = RankProgram(
            graph, plan.details, plan.ratios, plan.batch_shares, workload.build(0), 0, 2, CodegenOptions()
        )
        reshards = [c for s in program.steps for c in s.comms if c.kind == "reshard"]
        assert reshards, rows
        for c in reshards:
            fn = program._comm(c)[2]
            assert fn(x)[0] == "reshard" if moves else fn(x) is x, (rows, c)


# The planner's own plans with the memory tools (methods.common.MemoryTools): checkpointed layer
# groups run as checkpointed sub-modules of the recorded program (their collectives issued again
# in backward), and with 2 micro-steps the program planned for 7 of the 14 samples runs twice,
# the gradient buckets all-reduced in the second; per GPU on local_hetero2 and per machine on
# local_2x2 (data parallel inside the machines, their gradient sums held to the last micro-step).
# Two steps, as the DeepSpeed test: the second step's loss checks the first update. A third step's
# gradients drift past the tolerance where the summation order differs from one device's (bert,
# 2 micro-steps: 1.7e-5 of the largest gradient after three steps, 7e-6 after two, 1.5e-8 after
# one): Adam turns elements whose gradient is fp32 noise into updates of up to lr.
TOOL_STEPS = 2
MEMORY_TOOL_CASES = [
    pytest.param(
        "vgg19", "local_hetero2", dict(activation_checkpointing=True, grad_accumulation=2), id="vgg19-ckpt-accum"
    ),
    pytest.param("vit", "local_hetero2", dict(activation_checkpointing=True), id="vit-ckpt"),
    pytest.param("bert", "local_hetero2", dict(grad_accumulation=2), id="bert-accum"),
    pytest.param(
        "bert_moe",
        "local_2x2",
        dict(activation_checkpointing=True, grad_accumulation=2, levels="cluster"),
        id="bert_moe-machines-ckpt-accum",
    ),
]


@pytest.mark.parametrize("model,cluster_name,options", MEMORY_TOOL_CASES)
def test_planned_program_with_memory_tools_trains_exactly_like_one_device(model, cluster_name, options):
    from methods.hap.planner import HapPlanner

    cluster = _conf_cluster(cluster_name)
    workload = make_workload(model, cluster.num_devices, 14)
    plan = HapPlanner(cache_dir=None, **options).plan(workload, cluster)
    tools = plan.details["memory_tools"]
    assert bool(tools["checkpointed_groups"]) == options.get("activation_checkpointing", False)
    k = options.get("grad_accumulation", 1)
    assert sum(plan.batch_shares) == 14 and plan.batch_shares == [k * s for s in tools["micro_batch_shares"]]
    method = FixedPlanMethod(plan, mirror_full_state=True)
    case = Case(
        workload,
        cluster,
        method,
        method.plan(workload, cluster),
        seed=0,
        warmup_iters=0,
        measured_iters=TOOL_STEPS,
        hooks=RankHooks(return_state=True),
    )
    results = launch(case, cluster.num_devices, timeout_s=180)
    check_equivalence(workload, results, steps=TOOL_STEPS)


@pytest.mark.parametrize("model", ["vgg19", "bert"])
def test_a_checkpointed_program_runs_what_the_plain_program_runs_and_keeps_less(model):
    """With activation checkpoints the recorded module runs each unit as a checkpointed
    sub-module from the first step on: three Adam steps give bit-identical losses and
    parameters to the plain program, and forward leaves alive for backward what the
    checkpointed graph counts less (methods.graph.Graph.recompute)."""
    from bench.runtime.tensor_memory import TensorBytes
    from methods.common import checkpoint_units
    from methods.hap.codegen import CodegenOptions, RankProgram, _Checkpointed

    with _one_rank(model) as (workload, plan, graph, batch):
        runs = []
        for units in ([], checkpoint_units(graph)):
            program = RankProgram(
                graph,
                plan.details,
                plan.ratios,
                plan.batch_shares,
                workload.build(0),
                0,
                1,
                CodegenOptions(),
                checkpoints=[u.nodes for u in units],
            )
            optimizer = torch.optim.Adam(list(program.params.values()), lr=1e-3)
            losses, kept = [], []
            for _ in range(STEPS):
                optimizer.zero_grad()
                tensors = TensorBytes()
                with tensors:
                    before = tensors.live
                    loss = program(*batch)
                    kept.append(tensors.live - before)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            runs.append((program, losses, kept, {k: p.detach().clone() for k, p in program.params.items()}))
    (plain, ref_losses, ref_kept, ref_params), (ckpt, losses, kept, params) = runs
    assert not any(isinstance(m, _Checkpointed) for m in plain.module.modules())
    assert sum(isinstance(m, _Checkpointed) for m in ckpt.module.modules()) == len(checkpoint_units(graph))
    assert losses == ref_losses
    for name, ref in ref_params.items():
        assert torch.equal(params[name], ref), name
    units = checkpoint_units(graph)
    saved = graph.activation_bytes() - graph.with_recompute([u.nodes for u in units]).activation_bytes()
    assert saved > 0 and max(kept) == min(kept) and max(ref_kept) == min(ref_kept)
    assert ref_kept[0] - kept[0] == pytest.approx(saved, rel=0.02), (kept, ref_kept, saved)
