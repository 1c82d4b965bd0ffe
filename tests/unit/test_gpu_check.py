"""scripts/gpu-check without a GPU: the paper table from the rows bench.compare writes, and the
suite and main job it runs beside the GPU checks."""

import json
import os
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    loader = SourceFileLoader("gpu_check", str(ROOT / "scripts" / "gpu-check"))
    module = module_from_spec(spec_from_loader("gpu_check", loader))
    loader.exec_module(module)
    return module


def test_the_paper_table_reads_each_methods_aggregate_and_marks_a_failed_model(monkeypatch, tmp_path):
    gpu_check = _script()
    medians = {"vgg19": (0.0132, 0.01437), "vit": (0.05955, 0.06387), "bert": (0.1369, 0.1397)}

    def fake_compare(cmd, cwd, **output):
        out = Path(next(c for c in cmd if c.startswith("results_dir=")).split("=", 1)[1])
        model = next(c for c in cmd if c.startswith("model=")).split("=", 1)[1]
        out.mkdir(parents=True)
        rows = [
            {
                "method": m,
                "row_kind": "aggregate",
                "aggregate": {"iter_time_s": {"median": t, "low": t * 0.99, "high": t * 1.01}},
            }
            for m, t in zip(("dp_ev", "hap"), medians.get(model, ()))
        ]
        rows += [
            {"method": m, "row_kind": "repeat", "peak_mem_gib_per_iter": [3.0, gib]}
            for m, gib in zip(("dp_ev", "hap", "hap"), (2.5, 2.25, 2.75))
            if model in medians
        ]
        (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return subprocess.CompletedProcess(cmd, 0 if model in medians else 1)

    monkeypatch.setattr(gpu_check.subprocess, "run", fake_compare)
    checks, lines = gpu_check.paper_steps(tmp_path)
    assert [c[1] for c in checks] == ["pass", "pass", "pass", "fail (exit 1)"]
    table = {line.split()[0]: line for line in lines[1:]}
    assert table["vgg19"].split()[-2] == "1.089" and "13.20 [13.07-13.33]" in table["vgg19"]
    assert table["bert"].split()[-2] == f"{0.1397 / 0.1369:.3f}"
    assert table["vit"].split()[-1] == "2.50/2.75"  # the last iteration's peak, the largest round's
    assert table["bert_moe"].split()[1:] == ["-", "-", "-", "-"]  # no rows: drawn as missing, not a number


def test_background_jobs_get_disjoint_core_pairs_after_the_foregrounds_or_wait_for_it():
    gpu_check = _script()
    assert gpu_check.core_sets(3, list(range(16))) == [{4, 5}, {6, 7}, {8, 9}]
    assert gpu_check.core_sets(7, list(range(16))) is None  # 4 + 14 > 16: they run after the foreground
    assert gpu_check.core_sets(1, [0, 1]) is None  # CI's machine
    assert gpu_check.deal(list("abcdefg"), 3) == [["a", "d", "g"], ["b", "e"], ["c", "f"]]
    assert gpu_check.deal(["a"], 4) == [["a"]]  # no empty pytest process


def test_a_background_job_runs_on_its_cores_and_logs_there(tmp_path):
    gpu_check = _script()
    core = min(os.sched_getaffinity(0))
    job = gpu_check.Background(
        "affinity",
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        tmp_path / "job.log",
        {core},
    )
    name, result, _ = job.finish()  # never begun: it starts now, as on a host with too few cores
    assert (name, result) == (f"affinity (cores {core}-{core})", "pass")
    assert (tmp_path / "job.log").read_text().strip() == f"[{core}]"


def test_the_suite_option_runs_its_groups_and_reports_each_failure_by_name(monkeypatch, tmp_path, capsys):
    gpu_check = _script()
    tests = tmp_path / "test_some.py"
    tests.write_text(
        "def test_passes():\n    pass\n\ndef test_fails():\n    assert 1 == 2\n\n"
        "import pytest\n\n@pytest.mark.skip(reason='no')\ndef test_skipped():\n    pass\n"
    )
    ids = [f"{tests}::{name}" for name in ("test_passes", "test_fails", "test_skipped")]
    monkeypatch.setattr(gpu_check, "collect_suite", lambda: ids)
    code = gpu_check.main(["--skip-tests", "--suite", "2", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert code == 1
    group1 = next(line for line in printed.splitlines() if line.startswith("suite 1/2, 2 tests"))
    assert "1 passed, 0 failed, 1 skipped" in group1 and group1.split()[-2] == "pass"
    group2 = next(line for line in printed.splitlines() if line.startswith("suite 2/2, 1 tests"))
    assert "0 passed, 1 failed, 0 skipped" in group2 and group2.split()[-2] == "fail"
    # named as junit names it: the module's path from where pytest ran, dotted
    assert any(
        line.startswith("    failed: ") and line.endswith("test_some::test_fails") for line in printed.splitlines()
    )
    assert (tmp_path / "out" / "suite-1.xml").exists() and (tmp_path / "out" / "suite-2.log").exists()


def test_nothing_to_run_and_a_negative_suite_are_refused_in_one_line(capsys):
    gpu_check = _script()
    for argv, words in (
        (["--skip-tests"], "--skip-tests leaves nothing to run"),
        (["--suite", "-1"], "--suite -1: the number of test processes is 1 or more"),
        (["--parallel", "0"], "--parallel 0: the number of gpu test processes is 1 or more"),
    ):
        with pytest.raises(SystemExit) as stop:
            gpu_check.main(argv)
        assert stop.value.code == 2 and words in capsys.readouterr().err


def test_a_lease_call_calibrates_at_the_precision_then_tests_then_compares_within_its_budget(
    monkeypatch, tmp_path, capsys
):
    """--calibrate, --tests and --paper in that order, each command at --precision, files and
    logs under --out; a check that would start past --budget-s is skipped, not run."""
    gpu_check = _script()
    ran = []

    def fake_logged(cmd, log, env=None):
        ran.append(cmd)
        log.write_text("ran\n")
        return 0

    clock = iter(range(0, 10_000, 100))  # each look at the clock: 100 s later
    monkeypatch.setattr(gpu_check, "run_logged", fake_logged)
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(
        gpu_check.subprocess, "run", lambda cmd, cwd, **output: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0)
    )
    out = tmp_path / "out"
    code = gpu_check.main(
        [
            "--calibrate",
            "H200",
            "--precision",
            "bf16",
            "--tests",
            "bf16",
            "--paper",
            "--budget-s",
            "750",
            "--out",
            str(out),
        ]
    )
    profile, calibration, tests = ran[:3]
    assert profile[2:] == [
        "bench.profile",
        "--device",
        "cuda",
        "--device-type",
        "H200",
        "--precision",
        "bf16",
        "--compute-out",
        str(out / "profile-H200-bf16.json"),
    ]
    assert calibration[2:] == [
        "bench.calibrate",
        "--device",
        "cuda",
        "--device-type",
        "H200",
        "--precision",
        "bf16",
        "--profile",
        str(out / "profile-H200-bf16.json"),
        "--out",
        str(out / "calibration-H200-bf16.json"),
    ]
    assert tests[tests.index("-k") + 1] == "bf16"
    compares = [c for c in ran[3:] if "bench.compare" in c]
    assert len(compares) == 1 and "precision=bf16" in compares[0] and "model=vgg19" in compares[0]
    summary = (out / "summary.txt").read_text()
    assert summary.count("skip (budget)") == 3  # the budget ran out before the other paper models
    assert summary.strip() in capsys.readouterr().out and code == 1  # the fake tests left no report: a fail


def test_parallel_gpu_tests_run_the_speed_ratio_alone_first_then_the_rest_side_by_side(monkeypatch, tmp_path):
    gpu_check = _script()
    calls = []

    def fake_pytest(cmd, log, env=None):
        calls.append((cmd[cmd.index("-n") + 1], cmd[cmd.index("-k") + 1] if "-k" in cmd else None))
        report = Path(next(c for c in cmd if c.startswith("--junitxml=")).split("=", 1)[1])
        names = [gpu_check.ALONE_TEST] if len(calls) == 1 else ["test_bf16", gpu_check.MAIN_JOB_TEST]
        cases = "".join(f'<testcase name="{n}" time="1.5"/>' for n in names)
        report.write_text(f"<testsuites><testsuite>{cases}</testsuite></testsuites>")
        return 0

    monkeypatch.setattr(gpu_check, "run_logged", fake_pytest)
    checks = gpu_check.gpu_tests(tmp_path, "bf16 or mps", parallel=5)
    assert calls == [
        ("0", f"(bf16 or mps) and {gpu_check.ALONE_TEST}"),
        ("5", f"(bf16 or mps) and not {gpu_check.ALONE_TEST}"),
    ]
    assert [name.split()[0] for name, _, _ in checks] == [gpu_check.ALONE_TEST, "test_bf16", gpu_check.MAIN_JOB_TEST]
    assert all(result == "pass" for _, result, _ in checks)
    calls.clear()
    gpu_check.gpu_tests(tmp_path)  # by default one process runs every gpu test
    assert calls == [("0", None)]


def test_the_memory_check_starts_beside_the_side_by_side_tests_and_tables_measured_against_priced(
    monkeypatch, tmp_path, capsys
):
    gpu_check = _script()
    events = []

    class Job:
        def begin(self):
            events.append("memory begins")

        def finish(self):
            events.append("memory ends")
            rows = [
                {
                    "method": "dp_ev",
                    "status": "ok",
                    "config": {"method": {"activation_checkpointing": False, "grad_accumulation": 1}},
                    "iter_times_s": [0.1436, 0.1458],
                    "peak_mem_gib": [23.49],
                    "predicted_peak_mem_gib": [28.16],
                },
                {
                    "method": "fsdp",
                    "status": "oom",
                    "config": {"method": {"activation_checkpointing": True, "grad_accumulation": 4}},
                    "iter_times_s": None,
                    "peak_mem_gib": [80.5],
                    "predicted_peak_mem_gib": [19.96],
                },
            ]
            (tmp_path / "out" / "memory").mkdir(parents=True)
            (tmp_path / "out" / "memory" / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            return ("memory tools", "pass", 1.0)

    def fake_pytest(cmd, log, env=None):
        events.append(f"pytest -n {cmd[cmd.index('-n') + 1]}")
        return 0

    monkeypatch.setattr(gpu_check, "memory_job", lambda out: Job())
    monkeypatch.setattr(gpu_check, "run_logged", fake_pytest)
    gpu_check.main(["--memory", "--parallel", "3", "--out", str(tmp_path / "out")])
    assert events == ["pytest -n 0", "memory begins", "pytest -n 3", "memory ends"]
    table = capsys.readouterr().out.split("memory tools on a 1B Llama")[1].splitlines()
    assert table[2].split() == ["dp_ev", "no", "1", "ok", "143.6,", "145.8", "23.49", "28.16", "+19.9%"]
    assert table[3].split() == ["fsdp", "yes", "4", "oom", "-", "-", "19.96", "-"]  # a failed case: no number
