import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from bench import report as report_cmd
from bench.records.rows import load_records
from bench.studies import paper_figures

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_the_main_figure_runs_its_experiment_sweep_and_draws_it_from_the_records(tmp_path):
    paper_figures.fig_main(tmp_path, "model=bert", "cluster.gpus_per_machine=1,2", "preset=tiny")
    data = pd.read_csv(tmp_path / "main.csv")
    assert set(data.method) == set(paper_figures.sim_methods()) and set(data.x) == {1, 2}
    assert (data.status == "ok").all() and (data.value > 0).all() and (data.origin == "simulated").all()
    assert (tmp_path / "main.png").stat().st_size > 0 and (tmp_path / "main.pdf").stat().st_size > 0
    rows = load_records(tmp_path / "main" / "records.jsonl.gz")
    assert len(rows) == len(data) and {r["config"]["report"]["name"] for r in rows} == {"main"}
    # The same records give the same bytes.
    again = tmp_path / "again"
    report_cmd.main([str(tmp_path / "main"), "--out", str(again), "--no-figure"])
    assert (again / "main.csv").read_bytes() == (tmp_path / "main.csv").read_bytes()


def test_a_hydra_sweep_records_its_id_and_job_dirs_and_report_reads_the_sweep_dir(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "-m",
            "experiment=fig_main",
            "model=bert",
            "preset=tiny",
            "method=dp_ev,dp_cp",
            "cluster.gpus_per_machine=1",
            f"results_dir={tmp_path}",
            f"hydra.sweep.dir={tmp_path}/sweep",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert {r["sweep_id"] for r in rows} == {f"{tmp_path}/sweep"}
    assert sorted(Path(r["output_dir"]).name for r in rows) == ["0", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "bench.report", f"{tmp_path}/sweep", "--no-figure"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    data = pd.read_csv(tmp_path / "sweep" / "main.csv")
    assert sorted(data.method) == ["dp_cp", "dp_ev"] and set(data.x) == {1}


def test_sim_accuracy_plots_the_latest_calibration(tmp_path, monkeypatch):
    calibration = tmp_path / "results" / "calibration"
    calibration.mkdir(parents=True)
    cases = [
        {
            "model": "bert",
            "cluster": "c",
            "method": m,
            "iter_time_s_mean": 1.0,
            "predicted_iter_time_s": 1.0 + e,
            "sim_error": e,
        }
        for m, e in (("dp_ev", 0.1), ("dp_ev", 0.2), ("dp_cp", 0.05))
    ]
    (calibration / "20260101-000000.json").write_text(json.dumps({"cases": cases, "written_at": "2026-01-01T00:00:00"}))
    # later by name, but written before the field existed: older; a --device calibration has no cases
    (calibration / "20260101-machines.json").write_text(json.dumps({"cases": cases[:1]}))
    (calibration / "20260102-000000-H100-80.json").write_text(json.dumps({"rows": [], "written_at": "2026-01-02"}))
    monkeypatch.setattr(paper_figures, "PROJECT_DIR", tmp_path)
    paper_figures.fig_sim_accuracy(tmp_path / "out")
    assert len(pd.read_csv(tmp_path / "out" / "sim_accuracy.csv")) == 3
    # Another set of clusters calibrated later: a panel each, the newest of each set.
    machines = [{**c, "cluster": "m"} for c in cases[:2]]
    (calibration / "20260103-old-m.json").write_text(json.dumps({"cases": machines, "written_at": "2026-01-03"}))
    (calibration / "20260104-m.json").write_text(json.dumps({"cases": machines[:1], "written_at": "2026-01-04"}))
    paper_figures.fig_sim_accuracy(tmp_path / "out")
    drawn = pd.read_csv(tmp_path / "out" / "sim_accuracy.csv")
    assert drawn.groupby("calibration").size().to_dict() == {"20260101-000000": 3, "20260104-m": 1}


def test_an_unknown_figure_lists_the_known_ones():
    done = subprocess.run(
        [sys.executable, "-m", "bench.figures", "fig9"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: figure fig9 is unknown; known: main,")
