"""A calibration split over several runs is summarised from the rows they recorded
(bench.calibrate --rows): the last aggregate per model, cluster and method, else the last case."""

import json

from bench.studies.calibration import recorded_rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_rows_of_several_runs_are_the_last_aggregate_else_the_last_case(tmp_path):
    base = {"mode": "real", "cluster": "local_hetero2", "status": "ok"}
    a, b = tmp_path / "a", tmp_path / "b.jsonl"
    a.mkdir()
    _write(
        a / "records.jsonl",
        [
            {**base, "model": "bert", "method": "pipeline", "row_kind": "repeat", "run_id": "r1"},
            {**base, "model": "bert", "method": "pipeline", "row_kind": "aggregate", "run_id": "agg1"},
            {**base, "model": "bert", "method": "fsdp", "row_kind": "case", "run_id": "c1"},
            {**base, "model": "bert", "method": "fsdp", "mode": "sim", "run_id": "sim"},
        ],
    )
    _write(
        b,
        [
            {**base, "model": "bert", "method": "pipeline", "row_kind": "case", "run_id": "c2"},  # an aggregate wins
            {**base, "model": "bert", "method": "fsdp", "row_kind": "case", "run_id": "c3"},  # the later case
            {**base, "model": "vit", "method": "fsdp", "row_kind": "case", "run_id": "c4"},
        ],
    )
    rows = {(r["model"], r["method"]): r["run_id"] for r in recorded_rows([a, b])}
    assert rows == {("bert", "pipeline"): "agg1", ("bert", "fsdp"): "c3", ("vit", "fsdp"): "c4"}
    assert [r["run_id"] for r in recorded_rows([a, b], models=["vit"])] == ["c4"]
    assert {r["run_id"] for r in recorded_rows([a, b], methods=["pipeline"])} == {"agg1"}


def test_rows_with_no_real_row_there_are_one_line_and_exit_2(tmp_path, capsys):
    from bench.calibrate import main

    (tmp_path / "records.jsonl").write_text("")
    assert main(["model=bert", "--rows", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --rows {tmp_path}: no real rows there")


def test_rows_take_the_overrides_written_after_the_paths(tmp_path, capsys):
    """`--rows DIR method=a,b` (as documented): the overrides pick among the rows, not paths."""
    from bench.calibrate import main

    (tmp_path / "records.jsonl").write_text("")
    assert main(["--rows", str(tmp_path), "model=bert", "method=dp_ev"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --rows {tmp_path}: no real rows there")
    assert main(["--rows", str(tmp_path), "model=nosuch"]) == 2
    assert "model=nosuch" in capsys.readouterr().err
