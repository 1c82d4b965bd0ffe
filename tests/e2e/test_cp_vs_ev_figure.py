"""cp_vs_ev's measured half: each ratio choice's plan trains for real on local_hetero2."""

import pandas as pd
import pytest

from bench.studies import paper_figures

pytestmark = pytest.mark.e2e


def test_the_measured_half_runs_every_ratio_choice_on_workers(tmp_path):
    paper_figures.fig_cp_vs_ev(tmp_path, sim_dims=(), real_dims=(16,), warmup_iters=1, measured_iters=2)
    data = pd.read_csv(tmp_path / "cp_vs_ev.csv")
    assert set(data.origin) == {"measured"} and list(data.ratios) == ["EV", "CP", "LP"]
    assert (data.iter_time_s > 0).all() and (data.predicted_iter_time_s > 0).all()
    # LP is EV's or CP's plan (two speeds): measured once, its row says whose run it is.
    assert set(data.measured_run_of) <= {"EV", "CP", "LP"} and data.measured_run_of.iloc[:2].tolist() == ["EV", "CP"]
