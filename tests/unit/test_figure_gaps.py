"""A case that is not ok (OOM, failed) has no throughput: the bar figures draw it as a marked gap,
never as a bar (not even one of height 0), and their CSV leaves its throughput empty."""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.records import drawing
from bench.studies import paper_figures


def test_an_oom_case_is_a_marked_gap_and_an_empty_throughput_in_the_csv(tmp_path):
    lines = [
        {"value": 120.0, "status": "ok", "low": None, "high": None},
        {"value": None, "status": "oom", "low": None, "high": None},
        {"value": 300.0, "status": "ok", "low": None, "high": None},
    ]
    fig, ax = plt.subplots()
    drawing.draw_bars(ax, [0.0, 1.0, 2.0], lines, 0.4, "dp_ev")

    bars = [bar for container in ax.containers for bar in container]
    assert len(ax.patches) == len(bars) == 2  # nothing at all drawn for the OOM case
    assert [(bar.get_x() + bar.get_width() / 2, bar.get_height()) for bar in bars] == [(0.0, 120.0), (2.0, 300.0)]
    assert [(t.get_text(), tuple(t.get_position())) for t in ax.texts] == [("OOM", (1.0, 0))]
    plt.close(fig)


def test_a_simulated_oom_case_carries_no_throughput(monkeypatch):
    """The simulator predicts an iteration time for an OOM case too; the figure's point must not
    turn it into a throughput. Planning is stubbed: only what simulate_case does with it runs."""

    def plan_that_runs_out_of_memory(cfg, record):
        record.predicted_iter_time_s, record.predicted_oom = 0.5, True
        record.predicted_peak_mem_gib, record.ideal_iter_time_s = [99.0], 0.4
        model_cfg = SimpleNamespace(tokens_per_sample=128)
        return SimpleNamespace(workload=SimpleNamespace(global_batch=16, model_cfg=model_cfg))

    monkeypatch.setattr(paper_figures, "prepare_case", plan_that_runs_out_of_memory)
    row = paper_figures.simulate_case("preset=paper", "cluster=paper_hetero", "model=bert", "method=dp_ev")
    assert row["status"] == "oom" and row["samples_per_s"] is None
    assert row["predicted_iter_time_s"] == 0.5  # the prediction itself is kept
