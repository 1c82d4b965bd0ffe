"""auto's memory floors (methods.auto.floors): each at most what the simulator says of the plan its
candidate's part makes, and the search's rows and refusal where a floor shows a candidate `oom`."""

import dataclasses

import pytest
from hydra.utils import instantiate

from bench.core.cluster import ClusterSpec
from bench.cost import simulate
from bench.runner.case import build_workload
from methods.auto import NoPlanFits
from methods.auto.floors import hap_floor_gib, hap_gpus_only, oom_floor, zero_floor_gib
from methods.auto.search import price, search, with_memory
from methods.auto.space import make_part
from tests.conftest import compose_settings


def _case(tmp_path, *overrides):
    cfg = compose_settings("method=auto", "mode=sim", *overrides, results_dir=str(tmp_path))
    cluster = ClusterSpec.from_config(cfg.cluster, cfg.config_roots())
    return instantiate(cfg.method), build_workload(cfg, cluster), cluster


CASES = [  # (model, preset, GPUs a machine of paper_hetero, hap's micro-steps planned)
    ("vgg19", "tiny", 2, (1, 2)),
    ("vit", "tiny", 1, (1, 2)),
    ("bert", "tiny", 2, (1, 2)),
    ("bert_moe", "tiny", 2, (1, 2)),
    ("bert", "paper", 1, (1, 2)),
    # DeepSpeed's ZeRO-1 fits here: its experts are spread over the devices. hap at two
    # micro-steps is checked on the cases above; here its two plans took about 7 s each.
    ("bert_moe", "paper", 8, (1,)),
]


@pytest.mark.parametrize("model, preset, k, hap_steps", CASES)
def test_each_floor_is_at_most_the_peak_of_the_plan_its_part_makes(tmp_path, model, preset, k, hap_steps):
    """Sound floors: for every hap and DeepSpeed candidate (memory tools, micro-steps too), the
    plan its part makes holds at least the floor: DeepSpeed's on every device (a model without
    experts), hap's summed over the devices of the level the plan was made at; and a candidate
    its floor calls oom is over memory as planned."""
    auto, wl, cl = _case(
        tmp_path,
        f"model={model}",
        f"preset={preset}",
        "cluster=paper_hetero",
        f"cluster.gpus_per_machine={k}",
        "method.max_grad_accumulation=2",
    )
    cands = [c for c in auto.space(wl, cl) if c.part in ("hap", "deepspeed")]
    assert {c.grad_accumulation for c in cands} == {1, 2} and {c.checkpointing for c in cands} == {False, True}
    for cand in (c for c in cands if c.part == "deepspeed" or c.grad_accumulation in hap_steps):
        plan = make_part(auto, cand).plan(wl, cl)
        peaks = simulate(plan.program, cl, plan.ratios).peak_mem_gib
        over = max(p / d.type.memory_gib for p, d in zip(peaks, cl.devices))  # as the search judges it
        assert oom_floor(auto, cand, wl, cl) is None or over > 1, cand.describe()
        if cand.part == "deepspeed":
            if not getattr(wl.model_cfg, "num_experts", None):
                assert zero_floor_gib(auto, cand, wl, cl) <= min(peaks), cand.describe()
            continue
        floors = {level: floor for level, floor, _ in hap_floor_gib(auto, cand, wl, cl)}
        assert 0 < floors[plan.program.granularity] <= sum(peaks), cand.describe()


def test_a_floored_candidate_is_an_oom_row_and_the_refusal_names_a_priced_peak(tmp_path):
    """Under a budget that no plan meets, every hap and DeepSpeed candidate is `oom` by its floor
    (no plan made, no peak), and the refusal names the smallest peak of a candidate priced."""
    auto, wl, cl = _case(
        tmp_path,
        "model=bert",
        "preset=tiny",
        "cluster=paper_hetero",
        "cluster.gpus_per_machine=2",
        "method.max_grad_accumulation=2",
    )
    budgeted = with_memory(cl, 1e-4)
    cands = auto.space(wl, cl)
    with pytest.raises(
        NoPlanFits, match="smallest peak found is .* with 1 stage, FSDP2|smallest peak found .*pipelines"
    ):
        search(auto, cands, wl, budgeted)
    floored = [c for c in cands if oom_floor(auto, c, wl, budgeted) is not None]
    assert {c.part for c in floored} == {"hap", "deepspeed"}


def test_where_every_candidate_is_floored_the_refusal_says_the_floor(tmp_path):
    auto, wl, cl = _case(
        tmp_path,
        "model=bert",
        "preset=tiny",
        "cluster=paper_hetero",
        "cluster.gpus_per_machine=2",
        "method.stages=1",
        "method.state=zero1",
    )
    with pytest.raises(
        NoPlanFits,
        match=r"DeepSpeed ZeRO-1 .*: its parameters, gradients and reduce bucket alone are .* GiB on every device",
    ):
        search(auto, auto.space(wl, cl), wl, with_memory(cl, 1e-4))


def test_hap_plans_over_gpus_only_where_the_machines_floor_alone_passes_memory(tmp_path):
    """Between the two floors (the machines' summed over memory, the GPUs' within), auto's hap
    part plans over GPUs only: the plan hap makes at both levels where that fits, and otherwise
    an `oom` whose time bounds no heavier candidate (hap's plan over machines might be faster)."""
    auto, wl, cl = _case(tmp_path, "model=bert", "preset=tiny", "cluster=paper_hetero", "cluster.gpus_per_machine=2")
    cand = next(c for c in auto.space(wl, cl) if c.part == "hap" and not c.checkpointing and c.grad_accumulation == 1)
    assert not hap_gpus_only(auto, cand, wl, cl)  # both floors within the devices' own memory
    (_, machines, _), (_, gpus, _) = hap_floor_gib(auto, cand, wl, cl)
    per_machine, per_gpu = machines / cl.num_machines, gpus / cl.num_devices
    assert per_gpu < per_machine
    budgeted = with_memory(cl, (per_gpu + per_machine) / 2)
    assert hap_gpus_only(auto, cand, wl, budgeted)
    priced = price(auto, cand, wl, budgeted, 0.0)
    assert priced.gpus_only and priced.plan.program.granularity == "gpu" and "levels" in priced.row()
    both = make_part(auto, cand).plan(wl, budgeted)  # hap at both levels
    sim = simulate(both.program, budgeted, both.ratios)
    if not sim.oom:
        assert priced.status == "fits" and priced.iter_time_s == sim.iter_time_s and priced.bounds_heavier()
    else:
        assert priced.status == "oom" and priced.iter_time_s >= sim.iter_time_s and not priced.bounds_heavier()
    assert dataclasses.replace(priced, status="fits").bounds_heavier()
