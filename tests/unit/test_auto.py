"""auto: its space, its search (each candidate priced as its part prices it, the bound, memory),
and its bad input as one line and a row that is never ok."""

import dataclasses
import importlib

import pytest
from hydra.utils import instantiate

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.cost import simulate
from bench.records.rows import load_records
from bench.runner.execute import run_config
from methods.auto import Auto, NoPlanFits
from methods.auto.search import with_memory
from methods.auto.space import Candidate, accumulation_steps, candidates, make_part
from methods.common import checkpoint_units
from methods.graph import capture_config
from methods.pipeline import SharedCosts
from tests.conftest import compose_config
from tests.unit.test_hap_planner import bert_workload, cluster


def _method(tmp_path, *overrides):
    cfg = compose_config("method=auto", *overrides, results_dir=str(tmp_path))
    return instantiate(cfg.method)


def _part(tmp_path, name, *overrides):
    return instantiate(compose_config(f"method={name}", *overrides, results_dir=str(tmp_path)).method)


def test_the_space_prices_compositions_before_their_memory_tools():
    found = candidates("auto", "auto", "auto", "auto", [2, 4], [1, 2, 4])
    parts = [c.part for c in found]
    assert parts[:7] == ["hap", "fsdp", "fsdp", "deepspeed", "deepspeed", "pipeline", "pipeline"]
    assert [c.state for c in found[3:5]] == ["zero1", "zero2"]
    assert all(not c.checkpointing and c.grad_accumulation == 1 for c in found[:7])
    assert all(c.grad_accumulation == 1 for c in found if c.part == "pipeline")  # their schedule's
    assert {c.state for c in found if c.part == "pipeline"} == {"replicated", "sharded"}  # ZeRO: one stage
    assert len(set(found)) == len(found)
    forced = candidates(1, "sharded", False, 2, [2, 4], [1, 2, 4])
    assert forced == [Candidate(1, "sharded", "compute", False, 2), Candidate(1, "sharded", "even", False, 2)]
    assert [c.part for c in candidates(2, "replicated", "auto", "auto", [2, 4], [1, 2])] == ["pipeline"] * 2
    assert candidates("auto", "zero2", True, 2, [2, 4], [1, 2]) == [Candidate(1, "zero2", "", True, 2)]


def test_a_candidate_is_lighter_only_than_its_own_composition_with_more_tools():
    base = Candidate(1, "replicated")
    assert base.lighter_than(Candidate(1, "replicated", "", True, 2))
    assert not base.lighter_than(base)
    assert not base.lighter_than(Candidate(1, "sharded", "even", True, 2))
    assert not Candidate(1, "replicated", "", True, 1).lighter_than(Candidate(1, "replicated", "", False, 2))


def test_micro_steps_leave_a_sample_per_device():
    assert accumulation_steps(16, 3, 8) == [1, 2, 4]
    assert accumulation_steps(12, 2, 8) == [1, 2, 3, 4, 6]
    assert accumulation_steps(12, 4, 8) == [1, 2, 3]


@pytest.mark.parametrize(
    "forced, part, alone, extra",
    [
        (("method.stages=1", "method.state=replicated", "method.activation_checkpointing=false"), "hap", "hap", ()),
        (("method.stages=1", "method.state=sharded", "method.activation_checkpointing=false"), "fsdp", "fsdp_cp", ()),
        (
            ("method.stages=2", "method.activation_checkpointing=false"),
            "pipeline",
            "pipeline",
            ("method.num_stages=2",),
        ),
        (
            ("method.state=zero1", "method.activation_checkpointing=false", "method.grad_accumulation=1"),
            "deepspeed",
            "deepspeed",
            ("method.zero_stage=1",),
        ),
        (
            ("method.state=zero2", "method.activation_checkpointing=false", "method.grad_accumulation=1"),
            "deepspeed",
            "deepspeed",
            ("method.zero_stage=2",),
        ),
    ],
)
def test_auto_prices_a_composition_as_the_method_alone_does(tmp_path, forced, part, alone, extra):
    """One truth per quantity: auto's candidate and the composed method give the same plan's price."""
    wl, cl = bert_workload(batch=12 if part == "deepspeed" else 16), cluster(k=2)  # DeepSpeed: even shares
    auto = _method(tmp_path, *forced)
    plan = auto.plan(wl, cl)
    d = plan.details["auto"]
    assert d["part"] == part and plan.method == "auto"
    own = _part(tmp_path, alone, *extra).plan(wl, cl)
    ours, theirs = simulate(plan.program, cl, plan.ratios), simulate(own.program, cl, own.ratios)
    chosen = [c for c in d["candidates"] if c["candidate"] == d["chosen_as"]]
    if not d["chosen"]["checkpointing"] and d["chosen"]["grad_accumulation"] == 1:
        assert ours.iter_time_s == pytest.approx(theirs.iter_time_s, rel=1e-9)
    assert chosen[0]["iter_time_s"] == pytest.approx(ours.iter_time_s, rel=1e-9)
    if part == "deepspeed":  # the ZeRO stage and tools the DeepSpeed engine runs with
        assert plan.details["zero_stage"] == own.details["zero_stage"]
        assert plan.details["ds_config"] == own.details["ds_config"]


def test_zero_candidates_are_priced_with_their_tools_and_bounded_below_their_price(tmp_path):
    """Every ZeRO candidate plans and fits on a batch the devices share evenly; its bound (the
    compute-only time, its lighter tools' price) never passes its price; ZeRO-2 holds less."""
    wl, cl = bert_workload(batch=12), cluster(k=2)
    d = _method(tmp_path, "method.prune=false", "method.stages=1").plan(wl, cl).details["auto"]
    rows = {c["candidate"]: c for c in d["candidates"]}
    zero = [c for c in _method(tmp_path).space(wl, cl) if c.part == "deepspeed"]
    assert {c.state for c in zero} == {"zero1", "zero2"} and any(c.checkpointing for c in zero)
    assert any(c.grad_accumulation > 1 for c in zero)
    for cand in zero:
        row = rows[cand.describe()]
        assert row["status"] == "fits" and row["bound_s"] <= row["iter_time_s"] * (1 + 1e-9)
        for lighter in zero:
            if lighter.lighter_than(cand):
                assert rows[lighter.describe()]["iter_time_s"] <= row["iter_time_s"] * (1 + 1e-9)
    one, two = (
        rows[describe]
        for describe in ("1 stage, DeepSpeed ZeRO-1 (even split)", "1 stage, DeepSpeed ZeRO-2 (even split)")
    )
    assert two["peak_gib"] < one["peak_gib"]


def test_zero_candidates_on_a_batch_the_devices_cannot_share_evenly_are_refused_and_another_runs(tmp_path):
    d = _method(tmp_path, "method.stages=1").plan(bert_workload(), cluster(k=2)).details["auto"]
    zero = [c for c in d["candidates"] if "DeepSpeed" in c["candidate"]]
    assert zero and all(c["status"] == "refused" and "is not divisible by the 6 devices" in c["reason"] for c in zero)
    assert d["part"] != "deepspeed"


@pytest.mark.parametrize("budget_gib", [None, 0.0035])  # 0.0035: memory picks the cuts and counts
def test_pipelines_planned_with_shared_costs_equal_each_planned_alone(tmp_path, budget_gib):
    """The costs auto keeps across its pipeline candidates change no plan: each stage count,
    state and checkpointing planned in turn on one SharedCosts gives the plan and price of the
    same candidate planned alone in a fresh planner."""
    wl, cl = bert_workload(), with_memory(cluster(k=2), budget_gib)
    auto = _method(tmp_path)
    pipes = [c for c in auto.space(wl, cl) if c.part == "pipeline"]
    assert {c.stages for c in pipes} >= {2, 3} and {c.state for c in pipes} == {"replicated", "sharded"}
    shared = SharedCosts(wl, cl)
    for cand in pipes:
        try:
            alone = make_part(auto, cand).plan(wl, cl)
        except ValueError as exc:
            with pytest.raises(type(exc)) as got:
                make_part(auto, cand).plan(wl, cl, shared)
            assert str(got.value) == str(exc)
            continue
        with_shared = make_part(auto, cand).plan(wl, cl, shared)
        assert with_shared.details == alone.details and with_shared.batch_shares == alone.batch_shares
        assert with_shared.program == alone.program
        ours, theirs = simulate(with_shared.program, cl, None), simulate(alone.program, cl, None)
        assert ours.iter_time_s == theirs.iter_time_s and ours.peak_mem_gib == theirs.peak_mem_gib
    assert len(shared._costs) == 2  # with and without checkpointing, each priced once


def _counted(wl):
    """`wl` with its FLOPs a sample counted from its graph (bert_workload leaves them 0)."""
    return dataclasses.replace(
        wl, flops_per_sample=capture_config(wl.model_cfg, wl.global_batch).train_flops() / wl.global_batch
    )


def test_auto_is_the_fastest_candidate_that_fits_and_pruning_keeps_it(tmp_path):
    wl, cl = _counted(bert_workload()), cluster(k=2)
    pruned = _method(tmp_path).plan(wl, cl).details["auto"]
    full = _method(tmp_path, "method.prune=false").plan(wl, cl).details["auto"]
    assert full["num_pruned"] == 0 and full["num_priced"] > pruned["num_priced"]
    assert pruned["num_pruned"] > 0
    assert pruned["chosen"] == full["chosen"]
    fits = [c for c in full["candidates"] if c["status"] == "fits"]
    best = min(fits, key=lambda c: c["iter_time_s"])
    assert best["candidate"] == full["chosen_as"]
    share = importlib.import_module("methods.auto.search").recompute_share(wl)
    assert full["compute_only_s"] > 0
    for c in full["candidates"]:  # the bound never passed a price, checkpointing's recompute in it
        if c["iter_time_s"] is not None:
            ckpt = "checkpointing" in c["candidate"]
            assert c["iter_time_s"] >= full["compute_only_s"] * (1 + share * ckpt)


@pytest.mark.parametrize("added", [0.0, 3.0])  # the probes' work over the plain step's
def test_a_probing_part_is_probed_only_where_its_price_without_the_probe_could_win(tmp_path, monkeypatch, added):
    """On an emulated CPU cluster FSDP2 and DeepSpeed time their own work before pricing (worker
    processes, seconds each); auto bounds such a candidate by its price without the probe, which
    only adds host work, and probes it only where that could beat the fastest found. The choice
    is the one pricing every candidate makes, and every bound is below its candidate's price.
    The probe is replaced by a recorded one here (what the real probes time: their own tests)."""
    import methods.ds_zero
    import methods.fsdp
    import methods.pipeline

    probed = []

    def probe(method, plan, workload, cluster, **_):
        probed.append(method.name)
        return {"plain_s": 1.0, "method_s": 1.0 + added}

    monkeypatch.setattr(methods.fsdp, "time_method_step", probe)
    monkeypatch.setattr(methods.ds_zero, "time_method_step", probe)
    # The pipelines' prices are the same in both plans, whatever the host does meanwhile: their
    # layer-group profile timed once for both, their schedule's own work not timed (this test is
    # about FSDP2's and DeepSpeed's probes).
    profiles = {}
    timed = methods.pipeline.group_profile
    monkeypatch.setattr(
        methods.pipeline,
        "group_profile",
        lambda workload, mb, *a, **k: profiles.get(mb) or profiles.setdefault(mb, timed(workload, mb, *a, **k)),
    )
    wl = bert_workload(batch=12)
    cl = ClusterSpec.from_config(compose_config("cluster=local_hetero2").cluster).with_host_speed(2e10, 1e-3)
    off = "method.pipeline.work_probe=false"
    full = _method(tmp_path, "method.prune=false", off).plan(wl, cl).details["auto"]
    every = len(probed)
    probed.clear()
    pruned = _method(tmp_path, off).plan(wl, cl).details["auto"]
    # Here the pipelines price below FSDP2's and ZeRO's plans without their probes (4 ms against
    # 33-44 ms): none is probed, where pricing in bound order alone probed all four.
    assert every > 0 and probed == []
    assert pruned["chosen"] == full["chosen"] and pruned["part"] == "pipeline"
    prices = {c["candidate"]: c["iter_time_s"] for c in full["candidates"]}
    for c in pruned["candidates"] + pruned["pruned"]:
        if prices[c["candidate"]] is not None:
            assert c["bound_s"] <= prices[c["candidate"]] * (1 + 1e-9)


def test_a_probed_candidate_bounds_a_heavier_one_by_its_price_without_the_probe(tmp_path, monkeypatch):
    """Two probes time the host apart: a plan with checkpointing can measure faster than the
    same plan without. The lighter candidate's probed price is then no bound of the heavier's;
    its price without the probe is, and the pruned search still finds the heavier one."""
    search_mod = importlib.import_module("methods.auto.search")  # the package's `search` is the function

    light = Candidate(stages=2, state="replicated")
    heavy = Candidate(stages=2, state="replicated", checkpointing=True)
    probed = {light: 2.0, heavy: 1.5}  # as measured: the heavier plan's probe came out lower
    unprobed = {light: 1.0, heavy: 1.2}  # as the simulator prices them: a tool adds
    monkeypatch.setattr(search_mod, "probes", lambda auto, c, cluster: True)
    monkeypatch.setattr(search_mod, "floored", lambda *a: None)
    monkeypatch.setattr(search_mod, "unprobed_price", lambda auto, c, workload, cluster: unprobed[c])
    monkeypatch.setattr(
        search_mod,
        "price",
        lambda auto, c, workload, cluster, bound_s, shared=None: search_mod.Priced(c, "fits", bound_s, probed[c]),
    )
    wl, cl = bert_workload(), cluster(k=2)
    for prune in ("true", "false"):
        found = search_mod.search(_method(tmp_path, f"method.prune={prune}"), [light, heavy], wl, cl)
        assert found.best.cand == heavy and not found.pruned
        assert all(p.bound_s <= p.iter_time_s for p in found.priced)


def test_a_checkpointed_candidate_is_bounded_by_the_forward_it_runs_again(tmp_path, monkeypatch):
    """With checkpointing the compute-only bound adds the forward FLOPs of the checkpoint units
    (every part that checkpoints runs those again): a checkpointed candidate is not planned
    where that already passes the fastest plan found, and is where it does not."""
    search_mod = importlib.import_module("methods.auto.search")
    wl, cl = _counted(bert_workload()), cluster(k=2)
    graph = capture_config(wl.model_cfg, wl.global_batch)
    units = checkpoint_units(graph)
    again = sum(graph[name].flops for u in units for name in u.nodes) / graph.train_flops()
    share = search_mod.recompute_share(wl)
    assert units and share == pytest.approx(again) and 0.1 < share < 0.5
    ideal = wl.flops_per_iter / cl.total_effective_flops()
    assert ideal > 0
    plain = Candidate(stages=1, state="replicated")
    ckpt = Candidate(stages=2, state="replicated", checkpointing=True)  # no lighter candidate priced
    bounds, plain_s = {}, []

    def price(auto, c, workload, cluster, bound_s, shared=None):
        bounds[c] = bound_s
        return search_mod.Priced(c, "fits", bound_s, plain_s[-1] if c == plain else 2 * bound_s)

    monkeypatch.setattr(search_mod, "floored", lambda *a: None)
    monkeypatch.setattr(search_mod, "price", price)
    for fraction, pruned in ((0.5, True), (1.5, False)):  # the plain plan below, then above, the bound
        bounds.clear()
        plain_s.append(ideal * (1 + share * fraction))
        found = search_mod.search(_method(tmp_path), [plain, ckpt], wl, cl)
        assert bounds[plain] == ideal and [c for c, _ in found.pruned] == ([ckpt] if pruned else [])
        bound = found.pruned[0][1] if pruned else bounds[ckpt]
        assert bound == pytest.approx(ideal * (1 + share), rel=1e-12)


def test_on_cpu_ranks_a_sharded_pipeline_is_taken_only_where_its_replicated_twin_does_not_fit(tmp_path):
    """On an emulated CPU cluster FSDP2's own work makes a sharded pipeline run slower than the
    replicated one (docs/methods.md, "Whole-space planner (auto)"), which its price leaves out
    where the pipeline's work probe is off: where the simulator prices it below its replicated
    twin, auto takes the twin, and lists the sharded one as pruned at the twin's price."""
    off = ("method.fsdp.work_probe=false", "method.deepspeed.engine_probe=false", "method.pipeline.work_probe=false")
    wl = bert_workload(batch=12)
    cl = ClusterSpec.from_config(compose_config("cluster=local_hetero4").cluster).with_host_speed(2e10, 1e-3)
    full = _method(tmp_path, "method.prune=false", *off).plan(wl, cl).details["auto"]
    prices = {c["candidate"]: c["iter_time_s"] for c in full["candidates"]}
    sharded, replicated = "2-stage pipelines (sharded state)", "2-stage pipelines (replicated state)"
    assert prices[sharded] < prices[replicated] and full["chosen_as"] == sharded
    chosen = _method(tmp_path, *off).plan(wl, cl).details["auto"]
    assert chosen["chosen_as"] == replicated
    assert {c["candidate"]: c["bound_s"] for c in chosen["pruned"]}[sharded] == prices[replicated]


def test_a_plan_over_the_memory_budget_is_never_returned_while_one_fits(tmp_path):
    wl, cl = bert_workload(), cluster(k=2)
    free = _method(tmp_path, "method.prune=false").plan(wl, cl).details["auto"]
    fits = [c for c in free["candidates"] if c["status"] == "fits"]
    chosen = next(c for c in fits if c["candidate"] == free["chosen_as"])
    smallest = min(c["peak_gib"] for c in fits)
    assert smallest < chosen["peak_gib"], "the test needs a candidate of smaller peak"
    budget = (smallest + chosen["peak_gib"]) / 2
    plan = _method(tmp_path, f"method.memory_budget_gib={budget}").plan(wl, cl)
    sim = simulate(plan.program, cl, plan.ratios)
    assert max(sim.peak_mem_gib) <= budget  # another candidate, or its part's plan under the budget
    assert sim.iter_time_s >= chosen["iter_time_s"] * (1 - 1e-9)


def test_a_budget_no_plan_meets_is_oom_with_the_smallest_peak(tmp_path):
    with pytest.raises(NoPlanFits, match=r"smallest peak found is [0-9.]+ GiB on rank \d.*memory_budget_gib"):
        _method(tmp_path, "method.memory_budget_gib=0.0001").plan(bert_workload(), cluster(k=2))


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["method.stage_level=rack"], "method.stage_level='rack' names no stage level; use one of auto, device"),
        (["method.stages=0"], "method.stages=0 is invalid; use auto, 1"),
        (
            ["method.stages=9"],
            "method.stages=9 is more than the 4 layer groups bert can be cut at; use method.stages<=4",
        ),
        (
            ["method.state=partly"],
            "method.state='partly' is unknown; use one of auto, replicated, sharded, zero1, zero2",
        ),
        (["method.state=zero2", "method.stages=2"], "method.state=zero2 is one stage's"),
        (["method.memory_budget_gib=-1"], "method.memory_budget_gib=-1 must be a number of GiB > 0"),
        (["method.stages=2", "method.grad_accumulation=2"], "method.grad_accumulation=2 applies to one stage"),
    ],
)
def test_bad_input_is_one_line_and_a_failed_row(config_factory, capsys, overrides, needle):
    cfg = config_factory("method=auto", "mode=sim", "cluster=paper_hetero", *overrides)
    record = run_config(cfg)
    err = capsys.readouterr().err.strip()
    assert record.status == "failed" and needle in record.error
    assert err.startswith("error: ") and "\n" not in err and needle in err
    rows = load_records(f"{cfg.results_dir}/records.jsonl")
    assert [r["status"] for r in rows] == ["failed"] and rows[0]["samples_per_s"] is None


def test_a_memory_budget_no_plan_meets_is_an_oom_row(config_factory, capsys):
    cfg = config_factory(
        "method=auto",
        "mode=sim",
        "cluster=paper_hetero",
        "method.memory_budget_gib=0.0001",
        "method.max_grad_accumulation=2",
        "method.fsdp.work_probe=false",
    )
    record = run_config(cfg)
    err = capsys.readouterr().err.strip()
    assert record.status == "oom" and "smallest peak found" in record.error
    assert "\n" not in err and "memory_budget_gib" in err
    rows = load_records(f"{cfg.results_dir}/records.jsonl")
    assert [r["status"] for r in rows] == ["oom"] and rows[0]["samples_per_s"] is None


def test_auto_refuses_bad_options_at_construction():
    with pytest.raises(ConfigError, match="method.activation_checkpointing='maybe'"):
        Auto(None, None, None, None, activation_checkpointing="maybe")


def test_an_auto_row_reports_autos_own_capture_and_search_even_where_its_part_came_from_the_plan_cache(
    config_factory,
):
    """The row's capture and search seconds are auto's planning (its capture, then every
    candidate planned and priced), not its chosen part's: a hap plan that came from hap's plan
    cache cost auto's search nothing of its own, yet auto priced the other candidates. The part's
    own figures stay in details["auto"]["part_planning"]."""
    overrides = ("method=auto", "mode=sim", "cluster=paper_hetero", "method.stages=1", "method.state=replicated")
    first, again = run_config(config_factory(*overrides)), run_config(config_factory(*overrides))
    for record in (first, again):
        assert record.status == "ok" and record.plan["auto"]["chosen"]["state"] == "replicated"
        assert "cache" not in record.plan and "lp_time_s" not in record.plan
        assert record.capture_time_s > 0 and record.search_time_s > 0
        assert record.capture_time_s + record.search_time_s <= record.planner_time_s
        assert record.search_time_s == pytest.approx(record.plan["auto"]["planned_in_s"] - record.capture_time_s)
    assert [r.plan["auto"]["part_planning"]["cache"]["status"] for r in (first, again)] == ["miss", "hit"]
