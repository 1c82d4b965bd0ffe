"""Aggregates over repeats: the median's order-statistic interval, trimming, ranks with ties."""

import random

import pytest

from bench.records.rows import RunRecord
from bench.records.stats import median_interval, ranks, summarize
from bench.runner.rounds import aggregate_rounds


@pytest.mark.parametrize("n,k,coverage", [(5, 1, 0.9375), (6, 1, 0.96875), (9, 2, 0.9609375), (10, 2, 0.978515625)])
def test_the_median_interval_is_the_widest_binomial_one_needed(n, k, coverage):
    assert median_interval(n) == (k, pytest.approx(coverage))


def test_the_interval_covers_the_true_median_about_as_often_as_it_says():
    rng = random.Random(0)
    hits = 0
    for _ in range(2000):
        s = summarize([rng.expovariate(1.0) for _ in range(9)])
        hits += s.low <= 0.6931471805599453 <= s.high  # ln 2: the exponential's median
    assert 0.94 <= hits / 2000 <= 0.98  # 96.1% claimed; 2000 draws: +-0.9% std


def test_summary_trims_like_mlperf_and_reports_the_spread():
    s = summarize([10.0, 1.0, 2.0, 3.0, 4.0])
    assert (s.median, s.low, s.high, s.trimmed_mean) == (3.0, 1.0, 10.0, 3.0)
    assert summarize([2.0, 4.0]).trimmed_mean == 3.0  # too few runs to trim
    assert summarize([5.0]).cv == 0.0


def test_overlapping_intervals_share_a_rank():
    a, b, c = summarize([1.0, 1.1, 1.2]), summarize([1.15, 1.3, 1.4]), summarize([2.0, 2.1, 2.2])
    assert ranks({"a": a, "b": b, "c": c}) == {"a": 1, "b": 1, "c": 3}


def _row(method, mean, status="ok", error=None):
    return RunRecord(
        model="bert",
        preset="tiny",
        cluster="c",
        method=method,
        mode="real",
        status=status,
        error=error,
        global_batch=16,
        iter_time_s_mean=mean,
        iter_time_s_std=mean and mean / 10,
        samples_per_s=mean and 16 / mean,
        ideal_iter_time_s=0.01,
    )


def test_speedups_are_taken_round_by_round_and_a_failed_round_fails_the_aggregate():
    runs = {
        "dp_ev": [_row("dp_ev", t) for t in (0.10, 0.20, 0.10)],
        "dp_cp": [_row("dp_cp", t) for t in (0.05, 0.10, 0.05)],
        "hap": [_row("hap", 0.05), _row("hap", None, "failed", "rank 1 failed"), _row("hap", 0.05)],
    }
    out = aggregate_rounds(runs)
    cp = out["dp_cp"].aggregate
    assert cp["speedup_vs_dp_ev"]["low"] == cp["speedup_vs_dp_ev"]["high"] == 2.0  # drift cancels
    assert out["dp_cp"].iter_time_s_mean == 0.05 and out["dp_cp"].row_kind == "aggregate"
    assert out["hap"].status == "failed" and out["hap"].samples_per_s is None
    assert "1 of 3 repeats ended failed: rank 1 failed" in out["hap"].error
    assert cp["rank"] == 1 and out["dp_ev"].aggregate["rank"] == 1  # overlapping: a tie


def test_the_aggregate_planner_time_is_the_median_round_not_the_last():
    rows = [_row("hap", 0.05) for _ in range(3)]
    for row, planned in zip(rows, (0.002, 0.003, 0.219)):  # the last round's cache load stalled
        row.planner_time_s = planned
    assert aggregate_rounds({"hap": rows})["hap"].planner_time_s == 0.003


def test_the_aggregate_prediction_and_compute_are_the_medians_of_the_rounds():
    """Calibration compares the median measurement with the median prediction (each run priced
    at its own ranks' host speed), not the last round's, and reports the median of the runs'
    emulated compute (the slowest rank's reference over its speed)."""
    rows = [_row("hap", 0.05) for _ in range(3)]
    for row, predicted, reference in zip(rows, (0.043, 0.047, 0.041), (0.010, 0.012, 0.011)):
        row.predicted_iter_time_s = predicted
        row.emulation = {
            "ok": True,
            "max_error": 0.0,
            "ranks": [
                {"speed": 0.5, "reference_s_per_iter": reference},
                {"speed": 1.0, "reference_s_per_iter": reference},
            ],
        }
    agg = aggregate_rounds({"hap": rows})["hap"]
    assert agg.predicted_iter_time_s == 0.043
    assert agg.emulation["compute_s"] == pytest.approx(0.022) and agg.emulation["ranks"] is None


def test_links_that_ran_past_their_emulated_time_are_flagged_in_the_row_and_its_aggregate():
    """An ok row whose real collectives overran the emulated link by more than 5% of the
    iteration says so, as a missed dilation does; the rank that saw most counts."""
    from dataclasses import asdict
    from types import SimpleNamespace

    from bench.records.table import _status
    from bench.runner.execute import fill_metrics

    workload = SimpleNamespace(global_batch=16, targets_per_iter=16, model_cfg=SimpleNamespace(tokens_per_sample=None))

    def run(overruns):  # two ranks, 4 measured iterations of 0.1 s; overrun summed over them
        record = _row("hap", None)
        record.emulation = {"headroom": 0.6}
        results = [
            {
                "iter_times_s": [0.1] * 4,
                "peak_mem_gib": 0.01,
                "loss_sums": [1.0] * 4,
                "host": "h",
                "emulation": {"error": 0.0, "link_overrun_s": o},
            }
            for o in overruns
        ]
        fill_metrics(record, results, workload, measured=4)
        return record

    flagged, quiet = run([0.0, 0.08]), run([0.01, 0.0])
    flagged_dict, quiet_dict = asdict(flagged), asdict(quiet)
    assert flagged.emulation["link_overrun_s"] == pytest.approx(0.02) and flagged.emulation["links_ok"] is False
    assert quiet.emulation["link_overrun_s"] == pytest.approx(0.0025) and quiet.emulation["links_ok"] is True
    assert _status(flagged_dict) == "ok, links +20%" and _status(quiet_dict) == "ok"
    assert (
        _status({**flagged_dict, "emulation": {**flagged.emulation, "ok": False, "max_error": 0.07}})
        == "ok, dilation +7%, links +20%"
    )
    # an aggregate: the median run's overrun against the median iteration
    assert aggregate_rounds({"hap": [flagged, quiet, quiet]})["hap"].emulation["links_ok"] is True
    agg = aggregate_rounds({"hap": [flagged, flagged, quiet]})["hap"]
    assert agg.emulation["link_overrun_s"] == pytest.approx(0.02) and agg.emulation["links_ok"] is False
