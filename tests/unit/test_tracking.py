"""conf/logger: each logger writes what it should, several run at once, an unknown name stops
the run with one line, and a logger's failure never costs the row (bench/records/tracking.py)."""

from __future__ import annotations

import csv
import json
import logging
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import cli
from bench.core.errors import ConfigError
from bench.core.paths import CONF_DIR
from bench.records.rows import RunRecord, append_record, load_records
from bench.records.tracking import (
    CsvLogger,
    TensorBoardLogger,
    Tracker,
    WandbLogger,
    step_metrics,
    track_case,
    track_sweep,
)
from bench.runner.configs import check_group_choices
from bench.runner.execute import fill_metrics, make_trackers, run_case
from bench.runner.sweep import SweepSummary
from tests.conftest import compose_config, compose_settings
from tests.unit.wandb_offline import read_run

REPO = CONF_DIR.parent
STEP_KEYS = {"train/loss", "time/iter_s", "throughput/samples_per_s", "throughput/tokens_per_s", "mem/peak_gib"}
# A simulated case on a real-GPU cluster: no worker processes, no host-speed measurement.
SIM = ("mode=sim", "cluster=paper_hetero")


def _row(**kw) -> RunRecord:
    base = dict(
        model="bert",
        preset="tiny",
        cluster="local_hetero2",
        method="dp_ev",
        mode="real",
        status="ok",
        global_batch=16,
        iter_times_s=[0.5, 0.25, 0.4],
        loss_per_iter=[6.0, 5.5, 5.25],
        peak_mem_gib_per_iter=[0.25, 0.5, 0.5],
        iter_time_s_mean=0.38,
        iter_time_s_std=0.1,
        samples_per_s=16 / 0.38,
        tokens_per_s=64 * 16 / 0.38,
        plan={"shares": [8, 8], "note": "even"},
        case_key="abc",
        config={"seed": 0},
    )
    base.update(kw)
    return RunRecord(**base)


def _records_file(tmp_path: Path, *rows: RunRecord) -> Path:
    path = tmp_path / "records.jsonl"
    for row in rows:
        append_record(path, row)
    return path


def test_step_metrics_derive_throughput_from_each_step_time():
    steps = step_metrics(_row())
    assert [s["time/iter_s"] for s in steps] == [0.5, 0.25, 0.4]
    assert steps[1]["throughput/samples_per_s"] == pytest.approx(64.0)
    assert steps[1]["throughput/tokens_per_s"] == pytest.approx(64.0 * 64)
    assert [s["train/loss"] for s in steps] == [6.0, 5.5, 5.25]
    assert set(steps[0]) == STEP_KEYS
    vision = step_metrics(_row(tokens_per_s=None, loss_per_iter=None, peak_mem_gib_per_iter=None))
    assert set(vision[0]) == {"time/iter_s", "throughput/samples_per_s"}
    assert step_metrics(_row(iter_times_s=None, status="failed")) == []


def test_fill_metrics_keeps_loss_and_memory_of_each_measured_iteration():
    workload = SimpleNamespace(global_batch=4, targets_per_iter=2, model_cfg=SimpleNamespace(tokens_per_sample=None))
    results = [
        {
            "iter_times_s": [9.0, 1.0, 2.0],
            "loss_sums": [8.0, 6.0, 4.0],
            "peak_mem_gib": 0.5,
            "peak_mem_gib_per_iter": [0.1, 0.2, 0.5],
            "host": "h",
        },
        {
            "iter_times_s": [9.0, 2.0, 1.0],
            "loss_sums": [2.0, 2.0, 2.0],
            "peak_mem_gib": 0.3,
            "peak_mem_gib_per_iter": [0.3, 0.3, 0.3],
            "host": "h",
        },
    ]
    record = _row(ideal_iter_time_s=1.0, loss_per_iter=None, peak_mem_gib_per_iter=None)
    fill_metrics(record, results, workload, measured=2)
    assert record.loss_per_iter == [4.0, 3.0]
    assert record.peak_mem_gib_per_iter == [0.3, 0.5]
    assert record.loss_first == 5.0 and record.loss_last == 3.0


def test_csv_logger_writes_steps_plan_and_sweep_table(tmp_path):
    row = _row()
    path = _records_file(tmp_path, row)
    logger = CsvLogger(dir=str(tmp_path / "csv"))
    logger.log_case(row, path)
    with (tmp_path / "csv" / "steps" / f"{row.run_id}.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert list(lines[0]) == ["step", "loss", "iter_time_s", "samples_per_s", "tokens_per_s", "peak_mem_gib"]
    assert [float(line["loss"]) for line in lines] == [6.0, 5.5, 5.25]
    assert float(lines[1]["samples_per_s"]) == pytest.approx(64.0)
    plan = json.loads((tmp_path / "csv" / "plans" / f"{row.run_id}.json").read_text())
    assert plan == row.plan
    logger.log_sweep(load_records(path), path)
    (sweep,) = (tmp_path / "csv" / "sweeps").glob("*.csv")
    with sweep.open() as f:
        (line,) = list(csv.DictReader(f))
    assert line["method"] == "dp_ev" and line["run_id"] == row.run_id and line["status"] == "ok"


def _tensorboard_tags(logdir: Path) -> dict[str, list]:
    """tag -> values (scalars) or text, from the TFRecord event files under `logdir`."""
    from tensorboardX.proto.event_pb2 import Event

    tags: dict[str, list] = {}
    for path in logdir.glob("events.out.tfevents.*"):
        data, pos = path.read_bytes(), 0
        while pos < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 16 + length
            for value in event.summary.value:
                content = (
                    value.simple_value if value.HasField("simple_value") else b"".join(value.tensor.string_val).decode()
                )
                tags.setdefault(value.tag.removesuffix("/text_summary"), []).append(content)
    return tags


def test_tensorboard_logger_writes_scalars_per_step_and_text(tmp_path):
    pytest.importorskip("tensorboardX")
    row = _row()
    path = _records_file(tmp_path, row)
    logger = TensorBoardLogger(dir=str(tmp_path / "tb"))
    logger.log_case(row, path)
    (run_dir,) = (tmp_path / "tb").iterdir()
    assert run_dir.name.endswith(row.run_id)
    tags = _tensorboard_tags(run_dir)
    assert tags["time/iter_s"] == pytest.approx([0.5, 0.25, 0.4])
    assert tags["train/loss"] == pytest.approx([6.0, 5.5, 5.25])
    assert set(tags) >= STEP_KEYS
    assert '"even"' in tags["plan"][0] and "dp_ev" in tags["row"][0]
    logger.log_sweep(load_records(path), path)
    (sweep_dir,) = (tmp_path / "tb").glob("sweep-*")
    assert row.run_id in _tensorboard_tags(sweep_dir)["sweep/rows"][0]


def test_tensorboard_logger_without_tensorboardx_warns_and_writes_nothing(tmp_path, monkeypatch, caplog):
    import bench.records.tracking

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if not installed
    monkeypatch.setattr(bench.records.tracking, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="bench.records.tracking"):
        loggers = [TensorBoardLogger(dir=str(tmp_path / "tb")) for _ in range(2)]
        for logger in loggers:
            logger.log_case(_row(), tmp_path / "records.jsonl")
    assert not (tmp_path / "tb").exists()
    (warning,) = caplog.records  # once per process, not once per case
    assert "pip install 'tensorboardX==" in warning.getMessage()


def test_wandb_offline_run_holds_steps_summary_and_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    row = _row()
    path = _records_file(tmp_path, row)
    logger = WandbLogger(mode="offline", project="hetbench-test", dir=str(tmp_path))
    logger.log_case(row, path)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    run = read_run(run_dir)
    assert run["history_keys"] == STEP_KEYS
    assert [s["train/loss"] for s in run["history"]] == [6.0, 5.5, 5.25]
    assert run["summary"]["run_id"] == row.run_id and run["summary"]["status"] == "ok"
    assert "plan" not in run["summary"] and "iter_times_s" not in run["summary"]
    assert run["artifacts"][f"case-{row.run_id}"] == ["plan.json", "records.jsonl", "row.json"]

    logger.log_sweep(load_records(path), path)
    (sweep_dir,) = set((tmp_path / "wandb").glob("offline-run-*")) - {run_dir}
    sweep = read_run(sweep_dir)
    assert {"sweep/rows/_type", "sweep/rows/nrows"} <= sweep["history_keys"]
    assert sweep["history"][0]["sweep/rows/nrows"] == 1
    assert any(files == ["sweep/rows.table.json"] for files in sweep["artifacts"].values())
    assert any(files == ["records.jsonl"] for files in sweep["artifacts"].values())


def test_wandb_mode_disabled_and_logger_none_log_nothing(tmp_path):
    for overrides in (["wandb.mode=disabled"], ["logger=none", "wandb.mode=offline"]):
        cfg = compose_settings(*SIM, *overrides, results_dir=str(tmp_path))
        assert run_case(cfg).status == "ok"
        assert not (tmp_path / "wandb").exists()
        assert all(not isinstance(t, WandbLogger) or t.mode == "disabled" for t in make_trackers(cfg))
    assert len(load_records(tmp_path / "records.jsonl")) == 2


def test_several_loggers_at_once(tmp_path, monkeypatch):
    pytest.importorskip("tensorboardX")
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_settings(*SIM, "logger=[wandb,csv,tensorboard]", "wandb.mode=offline", results_dir=str(tmp_path))
    assert [type(t).__name__ for t in make_trackers(cfg)] == ["WandbLogger", "CsvLogger", "TensorBoardLogger"]
    record = run_case(cfg)
    assert record.status == "ok"
    assert (tmp_path / "csv" / "plans" / f"{record.run_id}.json").exists()
    assert list((tmp_path / "tensorboard").glob(f"*_{record.run_id}/events.out.tfevents.*"))
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert read_run(run_dir)["summary"]["run_id"] == record.run_id
    assert "logger" in load_records(tmp_path / "records.jsonl")[0]["config"]


def test_the_sweep_callback_logs_one_table_of_the_sweeps_rows(tmp_path):
    rows = [_row(method="dp_ev"), _row(method="dp_cp")]
    _records_file(tmp_path, *rows)
    callback = SweepSummary()
    callback._started = ""  # every row in the file belongs to this sweep
    callback.on_multirun_end(compose_config("logger=csv", results_dir=str(tmp_path)))
    (sweep,) = (tmp_path / "csv" / "sweeps").glob("*.csv")
    with sweep.open() as f:
        assert [line["method"] for line in csv.DictReader(f)] == ["dp_ev", "dp_cp"]


class BrokenLogger(Tracker):
    """A logger whose every call raises (the row must survive it)."""

    def __init__(self, **_):
        pass

    def log_case(self, record, records_path):
        raise RuntimeError("tracking server down")

    def log_sweep(self, rows, records_path):
        raise RuntimeError("tracking server down")


class UnstartableLogger(Tracker):
    def __init__(self, **_):
        raise ImportError("no module named 'tracker_sdk'")


def test_a_failing_logger_is_a_warning_and_the_others_still_run(tmp_path, caplog):
    row = _row()
    path = _records_file(tmp_path, row)
    with caplog.at_level(logging.WARNING, logger="bench.records.tracking"):
        track_case([BrokenLogger(), CsvLogger(dir=str(tmp_path / "csv"))], row, path)
        track_sweep([BrokenLogger()], [vars(row)], path)
    assert (tmp_path / "csv" / "steps" / f"{row.run_id}.csv").exists()
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    assert "tracking server down" in caplog.records[0].getMessage()
    assert load_records(path)[0]["run_id"] == row.run_id


def test_a_logger_that_raises_keeps_the_row_and_the_case_exits_0(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            *SIM,
            "logger=none",
            f"results_dir={tmp_path}",
            "+logger.broken._target_=tests.unit.test_tracking.BrokenLogger",
            "+logger.unstartable._target_=tests.unit.test_tracking.UnstartableLogger",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = load_records(tmp_path / "records.jsonl")
    assert row["status"] == "ok"
    text = out.stdout + out.stderr
    assert "BrokenLogger failed" in text and "tracking server down" in text
    assert "logger=unstartable not started" in text


def test_unknown_logger_is_one_line_and_exit_2_before_anything_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bench.run", "logger=[wandb,tensorbord]", f"results_dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == ("error: logger=tensorbord is unknown; known: csv, none, tensorboard, wandb")
    assert not (tmp_path / "records.jsonl").exists()


def test_hetbench_run_checks_logger_names_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["hetbench"])
    assert cli.main(["run", "logger=mlflow", f"results_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: logger=mlflow is unknown") and "\n" not in err


@pytest.mark.parametrize("value", ["csv", "[wandb,csv]", "[ wandb , tensorboard ]", "wandb,csv", "none", "[]", "null"])
def test_known_logger_choices_pass_the_check(value):
    check_group_choices([f"logger={value}"])


def test_a_bad_wandb_mode_is_refused_by_the_logger_too():
    with pytest.raises(ValueError, match="wandb.mode='maybe' is invalid"):
        WandbLogger(mode="maybe")
    with pytest.raises(ConfigError, match="logger=x is unknown"):
        check_group_choices(["logger=[csv,x]"])
