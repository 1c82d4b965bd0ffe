import json
import multiprocessing as mp
import shutil
import subprocess

import pytest

from bench.records.rows import (
    RunRecord,
    append_record,
    case_key,
    code_dirty,
    finished_case_keys,
    load_records,
    summarize_times,
)
from bench.records.table import speedup


def _row(**kw):
    base = dict(
        model="bert",
        preset="tiny",
        cluster="c",
        method="dp_ev",
        mode="real",
        status="ok",
        global_batch=16,
        samples_per_s=100.0,
        iter_time_s_mean=0.16,
    )
    base.update(kw)
    return RunRecord(**base)


def _writer(path, worker, n):
    for i in range(n):
        append_record(path, _row(method=f"m{worker}", error="x" * (i * 997 % 20000)))


def test_concurrent_appends_never_interleave(tmp_path):
    path = tmp_path / "records.jsonl"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, w, 40)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    lines = path.read_text().splitlines()
    assert len(lines) == 160
    assert all(json.loads(line)["model"] == "bert" for line in lines)


def test_a_row_appended_after_a_torn_line_is_kept(tmp_path):
    path = tmp_path / "records.jsonl"
    fragment = '{"model": "be'
    path.write_text(fragment)  # a writer killed mid-line: no newline after it
    append_record(path, _row())
    append_record(path, _row(method="dp_cp"))
    assert [r["method"] for r in load_records(path)] == ["dp_ev", "dp_cp"]
    assert path.read_text().splitlines()[0] == fragment  # what was there is left as it was


def test_a_file_that_is_not_jsonl_loads_as_no_rows(tmp_path, caplog):
    path = tmp_path / "records.jsonl"
    path.write_bytes(b'not json\n\xff\xfe binary\n42\n[1, 2]\n{"unclosed": \n\n')
    with caplog.at_level("WARNING", logger="bench.records.rows"):
        assert load_records(path) == []
    assert len(caplog.records) == 5  # one per line, the blank one aside


def test_failed_rows_carry_no_numbers():
    row = _row(status="failed", error="boom")
    assert row.samples_per_s is None and row.iter_time_s_mean is None and row.efficiency is None


def test_resume_skips_only_cases_with_a_final_answer(tmp_path):
    path = tmp_path / "records.jsonl"
    append_record(path, _row(case_key="a"))
    append_record(path, _row(case_key="b", status="failed"))
    append_record(path, _row(case_key="c", status="oom"))
    assert finished_case_keys(path) == {"a", "c"}


def test_case_key_ignores_bookkeeping_but_not_the_case():
    cfg = {"model": {"name": "bert"}, "seed": 0, "wandb": {"mode": "offline"}, "resume": False, "results_dir": "x"}
    same = dict(cfg, wandb={"mode": "disabled"}, resume=True, results_dir="y")
    assert case_key(cfg) == case_key(same)
    assert case_key(cfg) != case_key(dict(cfg, seed=1))


def test_iteration_time_is_the_max_over_ranks_of_the_measured_iterations():
    per_iter, mean, std = summarize_times([[9.0, 1.0, 2.0, 3.0], [0.0, 2.0, 1.0, 5.0]], measured=3)
    assert per_iter == [2.0, 2.0, 5.0]
    assert mean == pytest.approx(3.0)
    assert std == pytest.approx(3**0.5)  # sample std of 2, 2, 5


def test_speedup_is_throughput_over_dp_ev_on_the_same_case():
    rows = [
        vars(_row()),
        vars(_row(method="dp_cp", samples_per_s=150.0)),
        vars(_row(method="dp_ev", cluster="other", samples_per_s=10.0)),
    ]
    assert speedup(rows[1], rows) == pytest.approx(1.5)
    assert speedup(rows[0], rows) == pytest.approx(1.0)
    assert speedup(vars(_row(cluster="none")), rows) is None


def test_a_wandb_failure_keeps_the_row(tmp_path, monkeypatch):
    import wandb

    from bench.records.tracking import WandbLogger, track_case

    def broken_init(**kwargs):
        raise RuntimeError("network down")

    monkeypatch.setattr(wandb, "init", broken_init)
    path = tmp_path / "records.jsonl"
    row = _row()
    append_record(path, row)
    track_case([WandbLogger("offline", "hetbench-test", str(tmp_path))], row, path)  # must not raise
    assert load_records(path)[0]["run_id"] == row.run_id


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_row_is_dirty_when_the_code_changed_not_when_results_did(tmp_path):
    def git(*args):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True, capture_output=True
        )

    (tmp_path / "bench").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "bench" / "code.py").write_text("x = 1\n")
    (tmp_path / "results" / "main.csv").write_text("a\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    assert code_dirty(tmp_path / "bench") is False
    (tmp_path / "results" / "main.csv").write_text("b\n")  # a figure redrawn
    (tmp_path / "new.txt").write_text("untracked\n")
    assert code_dirty(tmp_path / "bench") is False
    (tmp_path / "bench" / "code.py").write_text("x = 2\n")
    assert code_dirty(tmp_path / "bench") is True
    assert code_dirty(tmp_path.parent / "no-such-dir") is None
