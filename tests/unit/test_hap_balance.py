"""methods.hap.balance and planner: LP ratios, rounding, fixed-point loop."""

from __future__ import annotations

import pytest

from bench.core.cluster import ClusterSpec
from bench.core.interfaces import Workload
from bench.core.program import Affine, Collective, Memory, Program, Stage
from bench.cost import compute_proportional_ratios, simulate, virtual_devices
from methods.hap.balance import InfeasibleError, RatioLP, balance_ratios, batch_shares, shard_lengths


def make(fast=1, slow=1, inter_gbps=10.0):
    machines = []
    if fast:
        machines.append({"count": fast, "device": "V100-16", "num_devices": 1})
    if slow:
        machines.append({"count": slow, "device": "P100-16", "num_devices": 1})
    return ClusterSpec.from_config(
        {
            "name": "lp",
            "machines": machines,
            "links": {
                "intra_machine": {"bandwidth_gbps": 800.0, "latency_s": 1e-5},
                "inter_machine": {"bandwidth_gbps": inter_gbps, "latency_s": 1e-4},
            },
            "virtual_device": "gpu",
        }
    )


def test_homogeneous_cluster_gets_equal_ratios():
    cl = make(fast=4, slow=0)
    prog = Program((Stage((Collective("all_gather", Affine.sharded(1e8), "padded"),), Affine.sharded(1e13)),), 4)
    ratios, obj = balance_ratios(prog, cl)
    assert ratios[0] == pytest.approx([0.25] * 4, abs=1e-6)
    assert obj == pytest.approx(simulate(prog, cl, ratios).iter_time_s, rel=1e-6)


def test_compute_bound_program_gets_compute_proportional_ratios():
    cl = make(fast=2, slow=2)
    prog = Program((Stage((), Affine.sharded(1e14)), Stage((Collective("all_reduce", Affine(1e3)),), Affine(1e9))), 4)
    ratios, _ = balance_ratios(prog, cl)
    assert sum(ratios[0]) == pytest.approx(1.0)
    assert ratios[0] == pytest.approx(compute_proportional_ratios(cl, "gpu")[0], abs=1e-6)


def test_communication_bound_program_moves_towards_even_shards_and_beats_cp():
    cl = make(fast=1, slow=3, inter_gbps=1.0)
    prog = Program((Stage((Collective("all_gather", Affine.sharded(4e8), "padded"),), Affine.sharded(2e12)),), 4)
    cp = compute_proportional_ratios(cl, "gpu")
    ratios, obj = balance_ratios(prog, cl)
    assert max(ratios[0]) < max(cp[0])
    assert obj < simulate(prog, cl, cp).iter_time_s
    # The constant terms are kept: the objective equals the simulated time, latency included.
    assert obj == pytest.approx(simulate(prog, cl, ratios).iter_time_s, rel=1e-6)


def test_lp_ratios_satisfy_every_stage_constraint():
    cl = make(fast=1, slow=2)
    prog = Program(
        (
            Stage((Collective("reduce_scatter", Affine.sharded(3e8), "grouped"),), Affine(5e10) + Affine.sharded(4e12)),
            Stage((Collective("all_to_all", Affine.sharded(1e8)),), Affine.sharded(1e12)),
        ),
        3,
    )
    ratios, obj = balance_ratios(prog, cl)
    assert all(r >= 0 for r in ratios[0]) and sum(ratios[0]) == pytest.approx(1.0)
    assert obj == pytest.approx(simulate(prog, cl, ratios).iter_time_s, rel=1e-6)


def test_memory_that_fits_nowhere_is_a_clear_infeasible_error():
    cl = make(fast=1, slow=1)
    prog = Program((Stage((), Affine.sharded(1e12)),), 2, memory=Memory(params=Affine(20 * 2**30)))
    with pytest.raises(InfeasibleError, match="does not fit in memory"):
        balance_ratios(prog, cl, memory_limit=True)


def test_memory_limit_shifts_work_off_the_device_that_would_overflow():
    cl = make(fast=1, slow=1)
    act = 24 * 2**30  # all activations: must split roughly in half to fit 16 GiB GPUs
    prog = Program((Stage((), Affine.sharded(1e12)),), 2, memory=Memory(activations=Affine.sharded(act)))
    ratios, _ = balance_ratios(prog, cl, memory_limit=True)
    assert not simulate(prog, cl, ratios).oom


def test_memory_rows_added_after_a_solve_give_the_fresh_lps_answer():
    # Solving for the fastest ratios, then (they overflow) again with memory rows on the same
    # LP: the answer must be the one a fresh LP with the rows gives.
    cl = make(fast=1, slow=1)
    prog = Program(
        (Stage((Collective("all_reduce", Affine(1e6)),), Affine.sharded(1e13)),),
        2,
        memory=Memory(activations=Affine.sharded(28 * 2**30)),
    )
    lp = RatioLP(prog, cl)
    fastest, _ = lp.solve()
    assert simulate(prog, cl, fastest).oom  # the fast V100 takes more than its 16 GiB
    lp.add_memory_rows()
    ratios, objective = lp.solve()
    fresh_ratios, fresh_objective = balance_ratios(prog, cl, memory_limit=True)
    assert ratios[0] == pytest.approx(fresh_ratios[0], abs=1e-9) and objective == pytest.approx(
        fresh_objective, rel=1e-9
    )
    assert not simulate(prog, cl, ratios).oom and objective > simulate(prog, cl, fastest).iter_time_s


def test_one_lp_with_memory_rows_answers_as_the_fastest_where_they_fit():
    # The planner builds the objective and the memory rows together and solves once: where the
    # fastest ratios fit, the rows are slack and the answer is the fastest; where nothing fits,
    # an LP without them gives the fastest ratios (flagged OOM).
    cl = make(fast=1, slow=1)
    fits = Program(
        (Stage((Collective("all_reduce", Affine(1e6)),), Affine.sharded(1e13)),),
        2,
        memory=Memory(activations=Affine.sharded(4 * 2**30)),
    )
    nowhere = Program(fits.stages, 2, memory=Memory(params=Affine(20 * 2**30)))
    for prog in (fits, nowhere):
        fastest, fastest_objective = balance_ratios(prog, cl)
        lp = RatioLP(prog, cl)
        lp.add_memory_rows(ask_first=False)
        if prog is nowhere:
            with pytest.raises(InfeasibleError, match="does not fit in memory"):
                lp.solve()
            lp = RatioLP(prog, cl)
        ratios, objective = lp.solve()
        assert ratios[0] == pytest.approx(fastest[0], abs=1e-9) and objective == pytest.approx(
            fastest_objective, rel=1e-9
        )
        assert simulate(prog, cl, ratios).oom == (prog is nowhere)


def test_a_device_that_overflows_in_whole_samples_is_held_one_sample_more():
    # The fast V100 takes all it can hold: 16 of 28 GiB of activations, 5.71 of 10 samples;
    # run as 6, it overflows. Its rows then hold with one sample more (a margin on both would
    # leave no split: 2 x 13.2 GiB < 28), and 5 samples each fit.
    cl = make(fast=1, slow=1)
    prog = Program((Stage((), Affine.sharded(1e13)),), 2, memory=Memory(activations=Affine.sharded(28 * 2**30)))

    def as_run(ratios):
        return [[k / 10 for k in batch_shares(10, ratios[0])]]

    lp = RatioLP(prog, cl)
    lp.add_memory_rows()
    exact, _ = lp.solve()
    assert not simulate(prog, cl, exact).oom and simulate(prog, cl, as_run(exact)).oom_devices == [0]
    lp.hold_one_sample_more([0], 10)
    held, _ = lp.solve()
    assert not simulate(prog, cl, as_run(held)).oom and as_run(held)[0] == [0.5, 0.5]
    with pytest.raises(InfeasibleError):
        lp.hold_one_sample_more([1], 10)
        lp.solve()


def test_shard_lengths_sum_exactly_and_never_split_length_one():
    assert sum(shard_lengths(1000, [0.3333, 0.3333, 0.3334])) == 1000
    assert shard_lengths(5, [0.5, 0.0, 0.5]) in ([3, 0, 2], [2, 0, 3])
    assert shard_lengths(1, [0.9, 0.1]) == [1, 1]


def test_planner_on_homogeneous_cluster_gives_equal_ratios_and_exact_batch_split():
    from methods.hap.planner import HapPlanner
    from models import bert

    cl = make(fast=4, slow=0)
    cfg = bert.BertConfig.from_preset("tiny", num_devices=4)
    plan = HapPlanner().plan(Workload("bert", "tiny", cfg, 64, 0.0), cl)
    assert plan.details["ratios"][0] == pytest.approx([0.25] * 4, abs=1e-6)
    assert sum(plan.batch_shares) == 64 and len(plan.batch_shares) == 4
    assert plan.details["states_expanded"] > 0
    assert Program.from_json(plan.program.dumps()) == plan.program


def test_planner_never_predicts_slower_than_compute_proportional_synthesis():
    from methods.hap.planner import HapPlanner, SfbPlanner
    from models import bert

    cl = make(fast=1, slow=3, inter_gbps=1.0)
    cfg = bert.BertConfig.from_preset("tiny", num_devices=4)
    wl = Workload("bert", "tiny", cfg, 16, 0.0)
    hap = HapPlanner(max_rounds=2).plan(wl, cl)
    sfb = SfbPlanner().plan(wl, cl)
    assert hap.details["predicted_iter_time_s"] <= sfb.details["predicted_iter_time_s"] * (1 + 1e-9)
    assert len(virtual_devices(cl, "gpu")) == len(hap.batch_shares)


def _two_segment_program(reshard_bytes: float) -> Program:
    """Segment 0 compute-bound, segment 1 bound by a padded all-gather, a reshard between."""
    return Program(
        (
            Stage((), Affine.sharded(1e14, 0)),
            Stage(
                (
                    Collective("reshard", Affine(reshard_bytes), rows=(0, 1)),
                    Collective("all_gather", Affine.sharded(4e8, 1), "padded"),
                ),
                Affine.sharded(2e12, 1),
            ),
        ),
        4,
        num_segments=2,
    )


def test_segments_get_their_own_rows_when_the_reshard_is_cheap():
    cl = make(fast=1, slow=3, inter_gbps=1.0)
    cp = compute_proportional_ratios(cl, "gpu")[0]
    ratios, obj = balance_ratios(_two_segment_program(1e3), cl)
    assert all(sum(row) == pytest.approx(1.0) for row in ratios)
    assert ratios[0] == pytest.approx(cp, abs=1e-6)  # compute-bound: compute-proportional
    assert max(ratios[1]) < max(cp) - 0.05  # gather-bound: towards even shards
    sim = simulate(_two_segment_program(1e3), cl, ratios).iter_time_s
    assert obj >= sim - 1e-9 and obj == pytest.approx(sim, rel=1e-3)  # the LP's reshard term bounds the exact one
    one_row = [cp, cp]
    assert sim < simulate(_two_segment_program(1e3), cl, one_row).iter_time_s


def test_an_expensive_reshard_keeps_the_rows_equal():
    cl = make(fast=1, slow=3, inter_gbps=1.0)
    ratios, _ = balance_ratios(_two_segment_program(1e12), cl)
    assert ratios[0] == ratios[1]
    # Equal rows move nothing: the same time as the best single row for both segments.
    merged = Program(
        (
            Stage((), Affine.sharded(1e14)),
            Stage((Collective("all_gather", Affine.sharded(4e8), "padded"),), Affine.sharded(2e12)),
        ),
        4,
    )
    best_one_row, _ = balance_ratios(merged, cl)
    assert simulate(_two_segment_program(1e12), cl, ratios).iter_time_s == pytest.approx(
        simulate(merged, cl, best_one_row).iter_time_s, rel=1e-6
    )


def test_runs_of_compute_stages_priced_together_keep_the_lp_exact_and_optimal():
    # Compute-only stages between collectives, of several FLOP shapes (sharded, replicated,
    # mixed): the LP adds each run up per shape before the max over devices (price._FlopsRun).
    cl = make(fast=1, slow=1, inter_gbps=1.0)
    ag = Collective("all_gather", Affine.sharded(2e8), "padded")
    run = [
        Stage((), Affine.sharded(3e12)),
        Stage((), Affine(4e11)),
        Stage((), Affine(1e11) + Affine.sharded(2e12)),
        Stage((), Affine.sharded(1e12)),
        Stage((), Affine()),
    ]
    prog = Program(tuple(run + [Stage((ag,), Affine.sharded(5e11))] + run + [Stage((ag,), Affine())]), 2)
    ratios, obj = balance_ratios(prog, cl)
    assert obj == pytest.approx(simulate(prog, cl, ratios).iter_time_s, rel=1e-6)
    grid = [simulate(prog, cl, [[x / 100, 1 - x / 100]]).iter_time_s for x in range(0, 101)]
    assert obj <= min(grid) * (1 + 1e-6)


def test_the_lp_reshard_bound_priced_at_run_ends_is_the_bound_over_every_device():
    """The LP prices a reshard only at the ends of runs of devices that share ratio variables;
    at fixed ratios its value must be the max over every device of the two boundary moves."""
    import random

    import pulp

    from bench.cost.algebra import LpAlgebra

    rng = random.Random(3)
    classes = [0, 0, 0, 1, 1, 2, 2, 2, 2, 0, 0]  # runs of shared variables, a class seen twice
    for _ in range(20):
        prob = pulp.LpProblem("reshard", pulp.LpMinimize)
        per_class = [[prob.add_variable(f"r{s}_{k}", lowBound=0) for k in range(3)] for s in range(2)]
        values = [[rng.uniform(0.1, 1.0) for _ in range(3)] for _ in range(2)]
        values = [[x / sum(row[c] for c in classes) for x in row] for row in values]  # rows sum to 1
        for s in range(2):
            for k in range(3):
                prob += per_class[s][k] == values[s][k]
        alg = LpAlgebra(prob, [[per_class[s][c] for c in classes] for s in range(2)])
        prob += alg.reshard(0.0, 1.0, 0, 1)
        prob.solve(pulp.PULP_CBC_CMD(msg=False))
        rows = [[values[s][c] for c in classes] for s in range(2)]
        prefix = [[sum(row[: i + 1]) for i in range(len(row))] for row in rows]
        gap = [abs(a - b) for a, b in zip(*prefix)]  # the last is 0: both rows sum to 1
        every = max((gap[d - 1] if d else 0.0) + gap[d] for d in range(len(classes)))
        assert pulp.value(prob.objective) == pytest.approx(every, rel=1e-7, abs=1e-9)
        assert len(alg._run_ends) < len(classes)
