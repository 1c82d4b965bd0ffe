"""methods.hap.search: A* returns the optimal program of the (brute-forceable) space."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench.core.cluster import ClusterSpec
from bench.cost import compute_proportional_ratios, simulate
from bench.studies.planner_quality import paper_planning
from methods.graph import capture, capture_config
from methods.hap.lowering import build_program
from methods.hap.pricing import CostModel
from methods.hap.search import brute_force, synthesize
from methods.hap.theory import data_parallel_theory, derive_theory
from tests.unit.test_hap_planner import bert_workload
from tests.unit.test_hap_planner import cluster as two_machines


def cluster(inter_gbps: float) -> ClusterSpec:
    return ClusterSpec.from_config(
        {
            "name": "two",
            "machines": [
                {"count": 1, "device": "V100-16", "num_devices": 1},
                {"count": 2, "device": "P100-16", "num_devices": 1},
            ],
            "links": {
                "intra_machine": {"bandwidth_gbps": 800.0, "latency_s": 1e-5},
                "inter_machine": {"bandwidth_gbps": inter_gbps, "latency_s": 1e-5},
            },
            "virtual_device": "gpu",
        }
    )


class Mlp(nn.Module):
    def __init__(self, d=64, h=256):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y, reduction="sum")


def setup(batch, inter_gbps, d=64, h=256, sfb=True):
    with torch.device("meta"):
        model = Mlp(d, h)
    graph = capture(model, (torch.empty(batch, d, device="meta"), torch.empty(batch, dtype=torch.long, device="meta")))
    theory = derive_theory(graph, sfb=sfb)
    cl = cluster(inter_gbps)
    cost = CostModel(theory, cl, "gpu", compute_proportional_ratios(cl, "gpu"))
    return theory, cost, cl


@pytest.mark.parametrize("batch,inter_gbps,h", [(4096, 100.0, 256), (8, 1.0, 4096), (512, 10.0, 1024)])
def test_a_star_matches_brute_force_on_a_small_mlp(batch, inter_gbps, h):
    theory, cost, _ = setup(batch, inter_gbps, h=h)
    best = synthesize(theory, cost)
    exhaustive = brute_force(theory, cost)
    assert exhaustive.programs > 100
    assert best.cost_s == pytest.approx(exhaustive.cost_s, rel=1e-12)


def test_search_reports_expanded_and_pruned_states_and_fewer_than_brute_force():
    theory, cost, _ = setup(512, 10.0)
    res = synthesize(theory, cost)
    assert res.stats.expanded > 0 and res.stats.pruned_dedup + res.stats.pruned_bound > 0
    assert res.stats.expanded < brute_force(theory, cost).programs


def test_emitted_program_costs_what_the_search_predicted():
    theory, cost, cl = setup(512, 10.0)
    res = synthesize(theory, cost)
    prog = build_program(res.steps, cost, grad_overlap=False)
    sim = simulate(prog, cl, cost.ratios)
    assert sim.iter_time_s == pytest.approx(res.cost_s, rel=1e-9)
    assert len(prog.stages) == 2 * len(res.steps)
    # Overlapping the gradient all-reduces with backward can only help.
    overlapped = simulate(build_program(res.steps, cost), cl, cost.ratios)
    assert overlapped.iter_time_s <= res.cost_s * (1 + 1e-9)


def test_small_batch_on_slow_link_avoids_all_reducing_big_weights():
    # 8 samples, 4096-wide layers, 1 Gbit/s: all-reducing fc1's 1 MB gradient is slower than
    # sharding the weight (tensor parallel) or gathering the tiny activations (SFB).
    theory, cost, _ = setup(8, 1.0, h=4096)
    res = synthesize(theory, cost)
    fc1 = next(s for s in res.steps if s.node == "linear")
    replicated_weight = dict(fc1.sources).get("fc1_weight") == "I" and not fc1.rule.sfb
    assert not replicated_weight


@pytest.mark.parametrize("rows", [[[0.5, 0.25, 0.25], [0.2, 0.4, 0.4]], [[0.6, 0.4, 0.0], [0.0, 0.5, 0.5]]])
def test_a_star_matches_brute_force_with_two_segments(rows):
    theory, _, cl = setup(256, 10.0, h=512)
    cost = CostModel(theory, cl, "gpu", rows, segmentation="flops")  # an MLP has one layer group
    assert set(cost.op_segment.values()) == {0, 1}
    best = synthesize(theory, cost)
    assert best.cost_s == pytest.approx(brute_force(theory, cost).cost_s, rel=1e-12)
    program = build_program(best.steps, cost, grad_overlap=False)
    assert program.num_segments == 2
    assert simulate(program, cl, rows).iter_time_s == pytest.approx(best.cost_s, rel=1e-9)


class Residual(nn.Module):
    """Tensors with several readers and ops with several computed inputs: the trees cross."""

    def __init__(self, d=32, h=128):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)
        self.gate = nn.Linear(d, d)
        self.out = nn.Linear(d, 10)

    def forward(self, x, y):
        z = self.fc2(torch.relu(self.fc1(x))) + x
        z = z * torch.sigmoid(self.gate(x))
        return F.cross_entropy(self.out(z), y, reduction="sum")


class Shared(nn.Module):
    """One computed tensor read by three ops (attention's query, key and value): a tree with
    several children, whose one re-layout the bound charges once."""

    def __init__(self, d=32, h=128):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.q, self.k, self.v = nn.Linear(h, d), nn.Linear(h, d), nn.Linear(h, d)
        self.out = nn.Linear(d, 10)

    def forward(self, x, y):
        h = torch.relu(self.fc1(x))
        z = self.q(h) * self.k(h) + self.v(h)
        return F.cross_entropy(self.out(z), y, reduction="sum")


def _small(batch, inter_gbps, model, **cost_options):
    """(theory, cost model, op order, each tensor's last use) of a small model on `cluster`."""
    from methods.hap.search import _order

    with torch.device("meta"):
        net = model()
    d = net.fc1.in_features
    graph = capture(net, (torch.empty(batch, d, device="meta"), torch.empty(batch, dtype=torch.long, device="meta")))
    theory = derive_theory(graph)
    cl = cluster(inter_gbps)
    cost = CostModel(theory, cl, "gpu", compute_proportional_ratios(cl, "gpu"), **cost_options)
    return theory, cost, *_order(graph, theory)


def _moves(theory, cost, order, last_use, pos, props, communicated):
    """The search's moves from a state, with the state each leads to."""
    from methods.hap.search import _successors

    for step, maps, add_props, add_comm in _successors(theory, cost, order[pos], props, communicated):
        live = frozenset(p for p in props | add_props if last_use.get(p[0], -1) > pos)
        comm_live = frozenset(t for t in communicated | add_comm if last_use.get(t, -1) > pos)
        yield step, maps, live, comm_live


@pytest.mark.parametrize(
    "batch,inter_gbps,model",
    [
        (512, 10.0, Mlp),
        (8, 1.0, Mlp),
        (256, 10.0, Residual),
        (16, 1.0, Residual),
        (4096, 100.0, Residual),
        (2, 10.0, Shared),
        (256, 10.0, Shared),
        (4096, 100.0, Shared),
    ],
)
def test_the_heuristic_never_exceeds_the_cheapest_completion_of_any_reachable_state(batch, inter_gbps, model):
    """A*'s bound at position i (bounds.remaining_bound) against the cheapest completion's
    compute and collectives on the compute lane (memoised over states), for every state the
    search can reach at i."""
    from methods.hap.bounds import remaining_bound
    from methods.hap.search import _finish

    theory, cost, order, last_use = _small(batch, inter_gbps, model)
    bound = remaining_bound(theory, cost, order)

    @functools.cache
    def rest(pos, props, communicated):
        if pos == len(order):
            extra = _finish(props, communicated, theory.graph.loss, cost)
            return float("inf") if extra is None else extra[0]
        out = float("inf")
        for _, (q, p, m, _), live, comm_live in _moves(theory, cost, order, last_use, pos, props, communicated):
            out = min(out, q + p + m[0] + rest(pos + 1, live, comm_live))  # m[0]: backward's on the compute lane
        assert bound[pos] <= out * (1 + 1e-12), f"bound {bound[pos]} > cheapest completion {out} at {order[pos]}"
        return out

    rest(0, frozenset(), frozenset())
    assert rest.cache_info().currsize > len(order)  # several states per position were checked
    assert bound[0] > min(cost.rule_time(order[0], r) for r in theory.rules[order[0]])  # not trivial


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "batch,inter_gbps,model", [(512, 10.0, Mlp), (8, 1.0, Mlp), (16, 1.0, Residual), (4096, 100.0, Residual)]
)
def test_every_prefixs_score_is_at_most_the_price_of_every_program_that_extends_it(batch, inter_gbps, model, overlap):
    """What makes the first complete program the search pops below every score left the
    cheapest: walking every program (the price of a program depends on its whole timeline, not
    on a state), each prefix's score against the cheapest price of the programs extending it,
    with gradients synced in their ops' backward and beside backward."""
    from bench.cost.lanes import ZERO_LANES, apply, end, prepend, stage_map
    from methods.hap.bounds import remaining_bound
    from methods.hap.search import _finish, _score

    theory, cost, order, last_use = _small(batch, inter_gbps, model, grad_bucket_bytes=2**16, grad_overlap=overlap)
    host, after, _ = cost.goal()
    bound = remaining_bound(theory, cost, order)
    checked = [0]

    def cheapest(pos, props, communicated, row, lanes, steps):
        if pos == len(order):
            extra = _finish(props, communicated, theory.graph.loss, cost)
            return float("inf") if extra is None else cost.complete(end(row, lanes) + extra[0], steps)
        best = min(
            (
                cheapest(
                    pos + 1,
                    live,
                    comm_live,
                    prepend(row, m),
                    apply(stage_map(q, p, q > 0, False), lanes),
                    [*steps, step],
                )
                for step, (q, p, m, _), live, comm_live in _moves(
                    theory, cost, order, last_use, pos, props, communicated
                )
            ),
            default=float("inf"),
        )
        # after a forward the network is no busier than the compute lane, the machines' lane idle
        assert lanes[1] <= lanes[0] and lanes[2] == 0.0
        assert _score(row, lanes[0], bound[pos], host, after) <= best * (1 + 1e-12)
        checked[0] += 1
        return best

    best = cheapest(0, frozenset(), frozenset(), ZERO_LANES, ZERO_LANES, [])
    assert best == pytest.approx(synthesize(theory, cost).cost_s, rel=1e-12) and checked[0] > len(order)


@pytest.mark.parametrize("granularity", ["machine", "gpu"])
def test_a_tensor_several_ops_read_is_charged_its_one_re_layout_once(granularity):
    """BERT's attention reads one layer-norm output three times (query, key, value). A cover
    by chains put one of the three reads on a chain and let the other two read any layout for
    free, so the bound priced two projections split by their weights with no gather of their
    input: 8% under the cheapest program on tiny BERT. Over trees the three reads share the one
    collective the search allows, and the bound at the first op is that program's cost."""
    from methods.hap.bounds import remaining_bound
    from methods.hap.search import _order

    planner, workload, cl = paper_planning("model=bert", "preset=tiny")
    graph = capture_config(workload.model_cfg, workload.global_batch)
    theory = derive_theory(graph)
    cost = CostModel(
        theory,
        cl,
        granularity,
        compute_proportional_ratios(cl, granularity, planner.segment_count(theory)),
        planner.segmentation,
    )
    bound = remaining_bound(theory, cost, _order(graph, theory)[0])
    best = synthesize(theory, cost)
    assert bound[0] == pytest.approx(compute_lane_s(cost, best.steps), rel=1e-9)


def compute_lane_s(cost, steps) -> float:
    """What a program's steps add to the compute lane (forward and backward collectives and
    compute; not what runs beside it): what the search's bound is a lower bound of."""
    total = 0.0
    for step in steps:
        q, p, m, _ = cost.step_maps(step.node, step.rule, step.sources, *cost.step_comms(step))
        total += q + p + m[0]
    return total


def test_a_beam_returns_no_program_dearer_than_its_incumbent():
    """Tiny BERT on two GPUs 1 Gbit/s apart at a 25 MiB gradient bucket: data parallelism is the
    exact optimum, but a beam of 40 keeps the prefixes that defer their costs (heads split, an
    all-to-all later) over data parallelism's, whose gradient syncs, launched at the end of
    backward, are in its price already, and ends 24% dearer. Given the data-parallel program as
    its incumbent, the beam returns it."""
    cl = two_machines(fast=1, slow=1, inter_gbps=1.0, virtual="gpu")
    wl = bert_workload(num_devices=2)
    theory = derive_theory(capture_config(wl.model_cfg, wl.global_batch))
    dp_theory = data_parallel_theory(theory)
    ratios = compute_proportional_ratios(cl, "gpu")
    cost, dp_cost = (
        CostModel(t, cl, "gpu", ratios, grad_bucket_bytes=25 * 2**20, grad_overlap=True) for t in (theory, dp_theory)
    )
    dp = synthesize(dp_theory, dp_cost, beam_width=40)
    exact = synthesize(theory, cost)
    beam = synthesize(theory, cost, beam_width=40)
    assert exact.cost_s == pytest.approx(dp.cost_s, rel=1e-12)
    assert beam.cost_s > 1.1 * dp.cost_s and beam.stats.beam_pruned > 0
    seeded = synthesize(theory, cost, beam_width=40, incumbent=dp)
    assert seeded.steps == dp.steps and seeded.cost_s == dp.cost_s
    # A data-parallel program costs the same under the full theory's cost model as under its
    # own (per-parameter syncs, where the search's price is the simulator's time exactly).
    cost, dp_cost = (CostModel(t, cl, "gpu", ratios) for t in (theory, dp_theory))
    dp = synthesize(dp_theory, dp_cost)
    program = build_program(dp.steps, cost, grad_overlap=False)
    assert simulate(program, cl, ratios).iter_time_s == pytest.approx(dp.cost_s, rel=1e-9)


def test_a_search_whose_bound_meets_its_incumbent_stops_at_once():
    """Paper-size ViT-48 over paper_hetero's 8 machines: the bound proves the data-parallel
    program optimal. The incumbent's own prefixes score its cost up to rounding, so with a
    strict comparison the search walked one of them to its end (at least one state per step);
    beating the incumbent by more than 1e-9 of its cost is what counts."""
    planner, wl, cl = paper_planning("model=vit", "+model.spec.num_layers=48", "cluster.gpus_per_machine=8")
    theory = derive_theory(capture_config(wl.model_cfg, wl.global_batch))
    dp_theory = data_parallel_theory(theory)
    ratios = compute_proportional_ratios(cl, "machine", planner.segment_count(theory))
    bucket = planner.bucket_cap_mb * 2**20
    cost, dp_cost = (
        CostModel(t, cl, "machine", ratios, planner.segmentation, bucket, grad_overlap=True)
        for t in (theory, dp_theory)
    )
    dp = synthesize(dp_theory, dp_cost, beam_width=planner.beam_width)
    seeded = synthesize(theory, cost, beam_width=planner.beam_width, incumbent=dp)
    assert seeded.steps == dp.steps
    assert seeded.stats.expanded < len(dp.steps) / 10


class SortsTheBatch(nn.Module):
    """A sort over every value of the batch (an MoE dispatch sorts all tokens by expert): no
    batch shard can run it, so data parallelism alone has no program."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 5)

    def forward(self, x, y):
        h = self.fc1(x)
        h = torch.sort(h.flatten()).values.view_as(h)
        return F.cross_entropy(self.fc2(torch.relu(h)), y, reduction="sum")


def test_a_model_no_batch_shard_can_run_gets_data_parallelism_that_gathers_for_that_op():
    from methods.hap.planner import HapPlanner
    from methods.hap.search import dead_end

    batch = 6
    with torch.device("meta"):
        model = SortsTheBatch()
    graph = capture(model, (torch.empty(batch, 8, device="meta"), torch.empty(batch, dtype=torch.long, device="meta")))
    theory = derive_theory(graph)
    strict, gathering = data_parallel_theory(theory), data_parallel_theory(theory, gathers=True)
    where = dead_end(strict)
    assert where is not None and "(sort)" in where and "\n" not in where
    assert dead_end(gathering) is None and dead_end(theory) is None
    cl = cluster(10.0)
    ratios = compute_proportional_ratios(cl, "gpu")
    found = synthesize(gathering, CostModel(gathering, cl, "gpu", ratios))
    kinds = {c.kind for s in found.steps for c in s.comms}
    assert "all_gather" in kinds  # the sort's input, gathered: the sort runs replicated
    assert any(s.rule.sharded for s in found.steps)  # the rest stays split by the batch
    stats = {"expanded": 0, "pruned": 0, "beam_pruned": 0}
    incumbent = HapPlanner(levels="cluster")._data_parallel(theory, cl, "gpu", ratios, stats)
    assert incumbent is not None and "all_gather" in {c.kind for s in incumbent.steps for c in s.comms}
    assert stats["data_parallel"] == "gathers"
    assert theory.search_cache[("data_parallel", False)] is False  # known to have none: not searched again


def _tiny_bert(name="bert", virtual="gpu", k=1):
    cl = two_machines(fast=1, slow=1, inter_gbps=1.0, k=k, virtual=virtual)
    wl = bert_workload(name, num_devices=2 * k)
    return derive_theory(capture_config(wl.model_cfg, wl.global_batch)), cl


def test_children_at_a_position_the_beam_has_filled_are_dropped_and_the_beam_expands_the_same():
    """A child made at an op whose beam is full would never be expanded: it is dropped at once
    (counted as pruned by the beam). The states the beam expands, and so its program, are
    those it expanded when such children were kept until popped: tiny BERT on two GPUs 1
    Gbit/s apart, beams of 3 and 40 (the numbers below are what the search expanded then)."""
    theory, cl = _tiny_bert()
    ratios = compute_proportional_ratios(cl, "gpu")
    kept_until_popped = {
        1: (64, 0.004755492493508413),
        3: (169, 0.004456105302097535),
        40: (1099, 0.005538834612371909),
    }
    for width, (expanded, cost_s) in kept_until_popped.items():
        cost = CostModel(theory, cl, "gpu", ratios, grad_bucket_bytes=25 * 2**20, grad_overlap=True)
        res = synthesize(theory, cost, beam_width=width)
        assert res.stats.expanded == expanded and res.stats.beam_pruned > 0
        assert res.cost_s == pytest.approx(cost_s, rel=1e-12)
        assert res.cost_s == pytest.approx(cost.program_cost(res.steps, res.final_comms), rel=1e-12)


@pytest.mark.parametrize("name", ["bert", "bert_moe"])
def test_searches_of_one_theory_share_its_states_and_find_what_a_fresh_theory_finds(name):
    """The states a search makes and the moves between them do not depend on the ratios or
    the level: they are kept in the theory (per segmentation) for its later searches, which
    find the program, price and states of a search on a theory of their own."""
    theory, cl = _tiny_bert(name, k=2)
    cases = [
        ("gpu", compute_proportional_ratios(cl, "gpu")),
        ("machine", compute_proportional_ratios(cl, "machine")),
        ("gpu", compute_proportional_ratios(cl, "gpu", 2)),
        ("machine", [[0.5, 0.5]]),
    ]
    for granularity, ratios in cases:
        shared = synthesize(theory, CostModel(theory, cl, granularity, ratios), beam_width=8)
        fresh_theory = derive_theory(theory.graph)
        fresh = synthesize(fresh_theory, CostModel(fresh_theory, cl, granularity, ratios), beam_width=8)
        assert shared.steps == fresh.steps and shared.cost_s == fresh.cost_s and shared.stats == fresh.stats
    kept = {k[1] for k in theory.search_cache if k[0] == "states"}
    assert kept == {(1, "layers"), (2, "layers")}


def test_a_search_without_incumbent_works_out_its_bound_at_the_first_state_with_two_moves(monkeypatch):
    """Until a state has two moves the heap holds one label and no price is known: the bound
    would decide nothing. A data-parallel search of one move per state never works it out, a
    full one at once, and both find the program, price and states of a search given the bound
    from the start (an incumbent of infinite price asks for it there)."""
    import methods.hap.search as search

    calls = []
    original = search.remaining_bound
    monkeypatch.setattr(search, "remaining_bound", lambda *a: calls.append(1) or original(*a))
    theory, cl = _tiny_bert("bert_moe")
    ratios = compute_proportional_ratios(cl, "gpu")
    nothing = search.SearchResult([], float("inf"), search.SearchStats())
    for t, bounds in ((data_parallel_theory(theory), 0), (theory, 1)):
        cost = CostModel(t, cl, "gpu", ratios)
        calls.clear()
        lazy = synthesize(t, cost, beam_width=40)
        assert len(calls) == bounds
        eager = synthesize(t, cost, beam_width=40, incumbent=nothing)
        assert len(calls) == bounds + 1
        assert lazy.steps == eager.steps and lazy.cost_s == eager.cost_s and lazy.stats == eager.stats


@pytest.mark.parametrize("k, host", [(2, False), (3, False), (3, True)])
def test_under_gradient_accumulation_the_search_prices_the_iteration_over_its_micro_steps(k, host):
    """k micro-steps of the same steps: the syncs, the optimizer step and the per-step terms paid
    once an iteration, so the search's price of one micro-step is the simulator's iteration over
    k, exactly where the syncs wait in their backward stages (`host`: emulated CPU ranks, with
    a per-step part and Adam's per-byte cost)."""
    theory, _, cl = setup(512, 10.0)
    if host:
        machines = [{"count": 1, "device": "cpu", "num_devices": 1, "speed": v} for v in (1.0, 0.5, 0.4)]
        link = {"bandwidth_gbps": 1.0, "latency_s": 5e-5}
        spec = {"name": "cpus", "emulated": True, "virtual_device": "gpu", "machines": machines}
        cl = ClusterSpec.from_config({**spec, "links": {"intra_machine": link, "inter_machine": link}})
        cl = cl.with_host_speed(2e10, 0.004, 2e-9, 1e6)
    ratios = compute_proportional_ratios(cl, "gpu")
    once, each = (CostModel(theory, cl, "gpu", ratios, micro_steps=m) for m in (k, 1))
    res = synthesize(theory, once)
    program = build_program(res.steps, once, grad_overlap=False, micro_steps=k)
    assert simulate(program, cl, ratios).iter_time_s == pytest.approx(k * res.cost_s, rel=1e-9)
    assert res.cost_s == pytest.approx(brute_force(theory, once).cost_s, rel=1e-12)  # the bound still holds
    assert any(each.param_sync(s) for s in res.steps)
    assert once.program_cost(res.steps, res.final_comms) < each.program_cost(res.steps, res.final_comms)


@pytest.mark.parametrize("k, batch, inter_gbps, h", [(2, 512, 10.0, 1024), (4, 512, 10.0, 1024), (8, 4096, 1.0, 256)])
def test_with_overlapped_syncs_the_search_prices_the_last_micro_step_with_the_syncs(k, batch, inter_gbps, h):
    """With overlapped syncs the program syncs every gradient beside the last micro-step's
    backward only: the search prices k - 1 micro-steps without syncs and the last with them
    (CostModel.pair), each on its own timeline, where the simulator runs them on one (a
    micro-step's last collectives beside the next one's compute): within the 5% a price is
    held to (0-3% here), and never further than one timeline with each sync at 1/k (`once`),
    which spreads the syncs over every backward (6-8% under at 4 and 8 micro-steps). A* still
    finds the cheapest program of its price."""
    theory, _, cl = setup(batch, inter_gbps, h=h)
    ratios = compute_proportional_ratios(cl, "gpu")
    cost = CostModel(theory, cl, "gpu", ratios, grad_overlap=True, micro_steps=k)
    spread = CostModel(theory, cl, "gpu", ratios, grad_overlap=True, micro_steps=k, once=1.0 / k)
    assert cost.pair is not None and spread.pair is None
    res = synthesize(theory, cost)
    assert res.cost_s == pytest.approx(brute_force(theory, cost).cost_s, rel=1e-12)
    program = build_program(res.steps, cost, grad_overlap=True, micro_steps=k)
    sim = simulate(program, cl, ratios).iter_time_s / k
    paired, spread_s = cost.program_cost(res.steps), spread.program_cost(res.steps)
    assert res.cost_s == paired and abs(paired / sim - 1) < 0.05
    assert abs(paired / sim - 1) <= abs(spread_s / sim - 1)
    if k > 2:
        assert spread_s < sim * 0.95
