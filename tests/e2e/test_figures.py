import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from bench import figures

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_the_main_figure_simulates_every_method_and_writes_png_pdf_csv(tmp_path):
    figures.fig_main(tmp_path, models=("bert",), ks=(1, 2), preset="tiny")
    data = pd.read_csv(tmp_path / "main.csv")
    assert set(data.method) == set(figures.sim_methods()) and set(data.k) == {1, 2}
    assert (data.status == "ok").all() and (data.samples_per_s > 0).all()
    assert (tmp_path / "main.png").stat().st_size > 0 and (tmp_path / "main.pdf").stat().st_size > 0


def test_sim_accuracy_plots_the_latest_calibration(tmp_path, monkeypatch):
    calibration = tmp_path / "results" / "calibration"
    calibration.mkdir(parents=True)
    cases = [{"model": "bert", "cluster": "c", "method": m, "iter_time_s_mean": 1.0,
              "predicted_iter_time_s": 1.0 + e, "sim_error": e}
             for m, e in (("dp_ev", 0.1), ("dp_ev", 0.2), ("dp_cp", 0.05))]
    (calibration / "20260101-000000.json").write_text(json.dumps({"cases": cases}))
    monkeypatch.setattr(figures, "PROJECT_DIR", tmp_path)
    figures.fig_sim_accuracy(tmp_path / "out")
    assert len(pd.read_csv(tmp_path / "out" / "sim_accuracy.csv")) == 3


def test_an_unknown_figure_lists_the_known_ones():
    done = subprocess.run([sys.executable, "-m", "bench.figures", "fig9"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: figure fig9 is unknown; known: main,")
