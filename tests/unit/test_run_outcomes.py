"""The runner's exit status comes from the outcomes its jobs return (bench.runner.outcome), in
this process: a failed case gives 1, a refused config 2, and a second run starts from nothing; a
sweep shows each error once."""

from __future__ import annotations

import sys

import pytest

from bench import run as run_cmd
from bench.records.rows import RunRecord, load_records
from bench.runner.outcome import Outcome, add_outcome, collecting

SIM = ["mode=sim", "model=bert", "preset=tiny", "cluster=local_hetero2", "method=dp_ev", "wandb.mode=disabled"]


def _run_cli(monkeypatch, tmp_path, *args: str) -> int:
    dirs = [f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    monkeypatch.setattr(sys, "argv", ["bench.run", *args, *dirs, f"results_dir={tmp_path}"])
    return run_cmd.run_cli()


def test_an_outcome_counts_the_rows_not_ok_and_leaves_out_rows_older_than_its_job():
    ok = RunRecord(
        model="bert",
        preset="tiny",
        cluster="c",
        method="dp_ev",
        mode="sim",
        status="ok",
        timestamp="2026-12-02T09:00:00",
    )
    oom = RunRecord(
        model="bert",
        preset="tiny",
        cluster="c",
        method="hap",
        mode="sim",
        status="oom",
        timestamp="2026-12-02T08:00:00",
    )
    assert Outcome.of([ok]).exit_status == 0
    assert Outcome.of([ok, oom]).failed == ("bert/c/hap",) and Outcome.of([vars(oom)]).exit_status == 1
    assert Outcome.of([oom], since="2026-12-02T08:30:00").exit_status == 0  # resume=true skipped it
    assert (Outcome() + Outcome(failed=("config",))).exit_status == 1


def test_outcomes_are_collected_only_inside_a_collection():
    add_outcome(Outcome(failed=("x",)))  # none open: nowhere to go, nothing kept
    with collecting() as outcomes:
        assert outcomes.total.exit_status == 0
        add_outcome(Outcome(failed=("a/b/c",)))
        with collecting() as inner:
            add_outcome(Outcome(failed=("d/e/f",)))
        assert inner.total.failed == ("d/e/f",)
    assert outcomes.total.failed == ("a/b/c",)


def test_a_failed_case_exits_1_and_the_next_run_in_the_process_starts_from_nothing(monkeypatch, tmp_path, capsys):
    assert _run_cli(monkeypatch, tmp_path / "a", *SIM, "precision=fp16") == 1
    assert [r["status"] for r in load_records(tmp_path / "a" / "records.jsonl")] == ["failed"]
    assert _run_cli(monkeypatch, tmp_path / "b", *SIM) == 0
    assert [r["status"] for r in load_records(tmp_path / "b" / "records.jsonl")] == ["ok"]
    assert _run_cli(monkeypatch, tmp_path / "c", *SIM, "cluster=local_hetero9") == 2  # no case at all


@pytest.mark.timeout(300)
def test_a_sweep_exits_1_for_its_failed_case_and_shows_its_error_once(monkeypatch, tmp_path, capsys):
    assert _run_cli(monkeypatch, tmp_path, "-m", *SIM, "precision=fp32,fp16") == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "precision='fp16' is invalid" in err[0]
    assert sorted(r["status"] for r in load_records(tmp_path / "records.jsonl")) == ["failed", "ok"]
