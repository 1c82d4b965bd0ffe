import csv
import io
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report as report_cmd
from bench.records import drawing
from bench.records.rows import RunRecord, append_record

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "results" / "figures"


def _row(method, k, status="ok", samples=100.0, key=None, **kw):
    config = {
        "cluster": {"gpus_per_machine": k},
        "report": {"name": "fig", "x": "cluster.gpus_per_machine", "metric": "samples_per_s"},
    }
    base = dict(
        model="bert",
        preset="tiny",
        cluster="c",
        method=method,
        mode="real",
        status=status,
        global_batch=16,
        samples_per_s=samples,
        iter_time_s_mean=16 / samples,
        case_key=key or f"{method}-{k}",
        config=config,
        git_sha="abcdef0123456789",
        error=None if status == "ok" else "Traceback...\nRuntimeError: out of memory",
    )
    base.update(kw)
    return RunRecord(**base)


def _aggregate(method, k, median, low, high, speedup=None):
    agg = {
        "iter_time_s": {
            "n": 6,
            "median": median,
            "low": low,
            "high": high,
            "coverage": 0.969,
            "trimmed_mean": median,
            "cv": 0.02,
        }
    }
    if speedup:
        agg["speedup_vs_dp_ev"] = {
            "n": 6,
            "median": speedup[0],
            "low": speedup[1],
            "high": speedup[2],
            "coverage": 0.969,
            "trimmed_mean": speedup[0],
            "cv": 0.02,
        }
    return _row(method, k, samples=16 / median, row_kind="aggregate", aggregate=agg)


@pytest.fixture
def records(tmp_path):
    path = tmp_path / "records.jsonl"
    for row in (
        _row("dp_ev", 1, samples=100.0),
        _row("hap", 1, samples=150.0),
        _row("dp_ev", 2, status="oom"),
        _row("hap", 2, samples=120.0),
        _row("hap", 1, samples=10.0, key="hap-1", row_kind="repeat", repeat=0),
        _aggregate("sfb", 1, 0.1, 0.09, 0.12, speedup=(1.6, 1.5, 1.7)),
    ):
        append_record(path, row)
    return path


def _csv(path):
    return list(csv.DictReader(io.StringIO(path.read_text())))


def test_report_writes_one_line_per_case_with_gaps_intervals_and_speedups(records, tmp_path):
    assert report_cmd.main([str(records), "--out", str(tmp_path / "out")]) == 0
    lines = {(r["method"], r["x"]): r for r in _csv(tmp_path / "out" / "fig.csv")}
    assert set(lines) == {("dp_ev", "1"), ("hap", "1"), ("dp_ev", "2"), ("hap", "2"), ("sfb", "1")}
    assert float(lines["hap", "1"]["speedup_vs_dp_ev"]) == 1.5  # the repeat row is no answer
    oom = lines["dp_ev", "2"]
    assert oom["status"] == "oom" and oom["value"] == "" and oom["error"] == "RuntimeError: out of memory"
    assert lines["hap", "2"]["speedup_vs_dp_ev"] == ""  # no ok baseline: no ratio
    sfb = lines["sfb", "1"]  # an aggregate: interval of the throughput from that of the time
    assert float(sfb["low"]) == pytest.approx(16 / 0.12) and float(sfb["high"]) == pytest.approx(16 / 0.09)
    assert float(sfb["speedup_vs_dp_ev"]) == 1.6 and sfb["repeats"] == "6" and sfb["git_sha"] == "abcdef0123"
    speedups = _csv(tmp_path / "out" / "fig_speedup.csv")
    assert {r["x"]: r["dp_ev"] for r in speedups} == {"1": "1.00", "2": "oom"}
    assert [r["sfb"] for r in speedups if r["x"] == "1"] == ["1.60 [1.50-1.70]"]
    assert (tmp_path / "out" / "fig.png").stat().st_size > 0


def test_the_same_records_give_the_same_bytes(records, tmp_path):
    report_cmd.main([str(records), "--out", str(tmp_path / "a"), "--no-figure"])
    report_cmd.main([str(records), "--out", str(tmp_path / "b"), "--no-figure"])
    for name in ("fig.csv", "fig_speedup.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_a_sweep_directory_is_read_through_its_job_directories(tmp_path):
    for job, method in enumerate(("dp_ev", "hap")):
        append_record(tmp_path / "sweep" / str(job) / "records.jsonl", _row(method, 1))
    assert report_cmd.main([str(tmp_path / "sweep"), "--no-figure"]) == 0
    assert [r["method"] for r in _csv(tmp_path / "sweep" / "fig.csv")] == ["dp_ev", "hap"]


@pytest.mark.parametrize("name", ["main", "homogeneous", "ablation"])
def test_the_committed_paper_figures_regenerate_byte_identical_from_their_records(tmp_path, name):
    rows = drawing.read_rows(FIGURES / name)
    spec = drawing.layout(rows)
    drawing.report(rows, tmp_path, name, spec["x"], spec["metric"], spec.get("title"), figure=False)
    assert (tmp_path / f"{name}.csv").read_bytes() == (FIGURES / f"{name}.csv").read_bytes()


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "bench.report", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_bad_input_is_one_line_naming_the_path_or_option(tmp_path, records, capsys):
    """In this process (the command's own process is test_an_unknown_logger_for_report_is_one_line's)."""
    (tmp_path / "notes.txt").write_text("hello\nworld\n")
    (tmp_path / "empty").mkdir()
    for args, start in (
        ([str(tmp_path / "notes.txt")], f"error: {tmp_path / 'notes.txt'} is not a records file"),
        ([str(tmp_path / "empty")], f"error: {tmp_path / 'empty'} holds no rows"),
        ([str(tmp_path / "nowhere")], f"error: {tmp_path / 'nowhere'} does not exist"),
        ([str(records), "--metric", "speed"], "error: --metric speed is unknown"),
        ([str(records), "--x", "cluster.nodes"], "error: --x cluster.nodes: no row"),
    ):
        assert report_cmd.main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(start) and len(err.strip().splitlines()) == 1, err


def test_report_keeps_the_figure_as_an_artifact_of_the_chosen_loggers(records, tmp_path):
    out = tmp_path / "out"
    assert report_cmd.main([str(records), "--out", str(out), "--logger", "csv,wandb"]) == 0
    kept = sorted(p.name for p in (out / "csv" / "figures" / "fig").iterdir())
    assert kept == ["fig.csv", "fig.pdf", "fig.png", "fig_speedup.csv"]
    assert (out / "csv" / "figures" / "fig" / "fig.csv").read_bytes() == (out / "fig.csv").read_bytes()
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # one W&B run (offline by default) holding the figure artifact


def test_an_unknown_logger_for_report_is_one_line(records, tmp_path):
    done = _cli(str(records), "--out", str(tmp_path), "--logger", "mlflow")
    assert done.returncode == 2 and done.stderr.startswith("error: --logger: logger=mlflow is unknown")
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_metric_a_row_does_not_have_is_a_gap_not_an_error(tmp_path):
    path = tmp_path / "records.jsonl"
    append_record(path, _aggregate("sfb", 1, 0.1, 0.09, 0.12))  # no tokens_per_s (a vision model)
    assert report_cmd.main([str(path), "--out", str(tmp_path), "--metric", "tokens_per_s", "--no-figure"]) == 0
    (line,) = _csv(tmp_path / "fig.csv")
    assert line["value"] == "" and line["low"] == "" and line["status"] == "ok"


def test_an_experiment_sweep_expands_as_hydra_would_with_overrides_replacing_its_values():
    from bench.runner.sweep import sweep_axes
    from bench.studies.paper_figures import sweep_points

    points = sweep_points("fig_main", "model=bert", "cluster.gpus_per_machine=1,2", "preset=tiny")
    assert len(points) == 18  # 9 methods x 2 k, one model
    assert all(p[0] == "experiment=fig_main" and p[-1] == "preset=tiny" for p in points)
    assert [len(axis) for axis in sweep_axes({"a": "1,2", "b": "range(3)", "c": "x"})] == [2, 3, 1]


def test_a_tiny_efficiency_keeps_its_digits():
    from bench.records.table import _efficiency

    assert [_efficiency(v) for v in (None, 0.0, 0.31, 0.00042)] == ["-", "0.00", "0.31", "4.2e-04"]


def test_a_sweep_has_the_workers_server_preload_every_method_it_names(monkeypatch):
    from omegaconf import OmegaConf

    from bench.runner.sweep import SweepSummary
    from bench.runtime import launch

    monkeypatch.setattr(launch, "_expected", [])
    config = OmegaConf.create(
        {
            "hydra": {
                "sweeper": {"params": {"method": "dp_ev,nosuch"}},
                "overrides": {"task": ["method=dp_ev,nosuch,deepspeed", "cluster=a,b"]},
            }
        }
    )
    SweepSummary().on_multirun_start(config)
    assert {"methods.dp", "methods.ds_zero", "deepspeed"} <= set(launch._expected)
    assert not [m for m in launch._expected if "nosuch" in m]  # its job fails in one line, as before


def test_a_method_keeps_its_colour_in_every_panel_and_in_the_legend_where_its_panel_has_no_bar():
    # the last panel (the legend's) has dp_ev only as an OOM gap, as BERT-MoE in the main figure
    lines = [
        {"model": m, "x": 1, "method": meth, "status": st, "value": v, "low": None, "high": None, "origin": "simulated"}
        for m, meth, st, v in [
            ("vgg19", "dp_cp", "ok", 5.0),
            ("vgg19", "dp_ev", "ok", 4.0),
            ("bert_moe", "dp_cp", "ok", 3.0),
            ("bert_moe", "dp_ev", "oom", None),
        ]
    ]
    fig = drawing.draw(lines, "x", "samples_per_s", "t")
    first, last = fig.axes
    bar_colour = {c.get_label(): c.patches[0].get_facecolor() for c in first.containers}
    legend = {
        t.get_text(): h.get_facecolor() for t, h in zip(last.get_legend().texts, last.get_legend().legend_handles)
    }
    assert bar_colour["dp_cp"] != bar_colour["dp_ev"]
    assert legend == bar_colour
