"""The runner and the main job as a user runs them: subprocesses, rows on disk, exit codes."""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from bench.records.rows import load_records
from bench.runtime.emulation import ArrivalBoard

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
QUICK = ["warmup_iters=1", "measured_iters=3", "emulation.reference_iters=2"]  # pacing is timed in test_emulation.py


def run(module, *args, results_dir, env=None, timeout=600):
    cmd = [sys.executable, "-m", module, *args, f"results_dir={results_dir}"]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def rows(results_dir):
    return load_records(Path(results_dir) / "records.jsonl")


# Every model with every data-parallel method, W&B offline and resumable: one sweep, run once
# (shared_run) and read by the tests of its rows and of resuming it.
EVERY_DP = ["-m", "model=vgg19,vit,bert,bert_moe", "method=dp_ev,dp_cp", "wandb.mode=offline", "resume=true", *QUICK]


@pytest.fixture
def every_dp_sweep(shared_run):
    """The results folder of the EVERY_DP sweep and the sweep's exit status and stderr."""

    def sweep(folder):
        out = run("bench.run", *EVERY_DP, results_dir=folder)
        return {"returncode": out.returncode, "stderr": out.stderr[-3000:]}

    return shared_run("every-dp-sweep", sweep)


def test_every_model_trains_with_every_dp_method(every_dp_sweep):
    results, out = every_dp_sweep
    assert out["returncode"] == 0, out["stderr"]
    got = rows(results)
    assert sorted((r["model"], r["method"]) for r in got) == sorted(
        (m, d) for m in ("vgg19", "vit", "bert", "bert_moe") for d in ("dp_ev", "dp_cp")
    )
    for r in got:
        assert r["status"] == "ok" and r["origin"] == "measured" and r["cluster"] == "local_hetero2"
        assert len(r["iter_times_s"]) == 3 and len(r["peak_mem_gib"]) == 2
        assert r["samples_per_s"] == pytest.approx(r["global_batch"] / r["iter_time_s_mean"])
        assert r["efficiency"] == pytest.approx(r["ideal_iter_time_s"] / r["iter_time_s_mean"])
        assert r["versions"]["torch"] == torch.__version__ and r["host"] and r["cluster_hash"]
        assert r["config"]["model"]["name"] == r["model"] and len(r["plan_hash"]) == 16
        # Each CPU rank's peak of live tensor bytes (deterministic: the same ops every run)
        # against the cost model's for its device, DDP's buckets and the loss's gradients
        # counted; 1-7% over on the transformers, whose peak comes before any gradient exists.
        assert r["tensor_peak_gib"] == pytest.approx(r["predicted_peak_mem_gib"], rel=0.1), r["model"]
    cp = {r["model"]: r["batch_shares"] for r in got if r["method"] == "dp_cp"}
    assert all(shares == [11, 5] for shares in cp.values())  # 16 samples by speed 1 : 0.4


def _processes_with(tag):
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if tag.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_failing_worker_ends_its_case_fast_and_the_sweep_goes_on(tmp_path):
    tag = f"HETBENCH_TEST_TAG={uuid.uuid4().hex}"
    start = time.monotonic()
    # Case 0 trains; in case 1 rank 1 raises while rank 0 waits in an all-reduce forever.
    out = run(
        "bench.run",
        "-m",
        "test.fail_rank=null,1",
        "wandb.mode=disabled",
        "timeout_s=300",
        *QUICK,
        results_dir=tmp_path,
        env=dict([tag.split("=", 1)]),
    )
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    got = {r["config"]["test"]["fail_rank"]: r for r in rows(tmp_path)}
    assert got[None]["status"] == "ok"
    assert got[1]["status"] == "failed" and got[1]["samples_per_s"] is None
    assert "deliberate failure of rank 1" in got[1]["error"] and "Traceback" in got[1]["error"]
    assert "deliberate failure of rank 1" in out.stderr
    assert elapsed < 90, f"the sweep took {elapsed:.0f} s: the failing case was not ended fast"
    time.sleep(0.5)
    assert _processes_with(tag) == [], "worker processes outlived their case"


def test_a_worker_that_dies_in_native_code_is_named_by_its_signal_and_leaves_its_stack(tmp_path):
    tag = f"HETBENCH_TEST_TAG={uuid.uuid4().hex}"
    cmd = [sys.executable, "-m", "bench.run", "wandb.mode=disabled", "measured_iters=100000", f"results_dir={tmp_path}"]
    log = tmp_path / "stderr.log"  # a file, not a pipe: nobody reads it while the case runs
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**os.environ, **dict([tag.split("=", 1)])}, stdout=subprocess.DEVNULL, stderr=stderr
        )

    # the workers: tagged processes whose parent is one the runner started (the server), once
    # each has installed its handler for fatal signals. Not any process the runner did not start:
    # a command a worker runs holds the worker's handlers until it execs (a suite run once saw
    # three "workers", when each worker still ran `ldconfig -p` as it set up)
    def servers():
        return {p for p in _processes_with(tag) if _status(p, "PPid") == proc.pid}

    def workers():
        return [p for p in _processes_with(tag) if _status(p, "PPid") in servers()]

    def ready():
        # a process gone between the listing and the read (a probe the server forked) has no mask
        return [p for p in workers() if int(_status(p, "SigCgt") or "0", 16) >> (signal.SIGABRT - 1) & 1]

    try:
        deadline = time.monotonic() + 90
        while len(ready()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ready()) == 2, "the workers never set up faulthandler"
        os.kill(ready()[-1], signal.SIGABRT)  # as a C++ exception escaping a destructor ends it
        assert proc.wait(timeout=60) != 0
    finally:  # a long case: never left running when the test fails
        proc.kill()
        proc.wait()
    (row,) = rows(tmp_path)
    assert row["status"] == "failed" and "killed by SIGABRT" in row["error"], row["error"]
    printed = log.read_text()
    assert "Fatal Python error: Aborted" in printed and "most recent call first" in printed


def _status(pid, field):
    """A field of /proc/<pid>/status (PPid as an int), None once the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    value = next(line.split()[1] for line in lines if line.startswith(f"{field}:"))
    return int(value) if field == "PPid" else value


def test_resume_skips_recorded_cases_and_wandb_offline_writes_a_run(every_dp_sweep, tmp_path):
    first, out = every_dp_sweep
    assert out["returncode"] == 0, out["stderr"]
    assert len(rows(first)) == 8
    assert list((first / "wandb").glob("offline-run-*")), "no offline W&B run directory"
    shutil.copytree(first, tmp_path, dirs_exist_ok=True)  # the sweep's folder stays as it ran
    again = run("bench.run", *EVERY_DP, results_dir=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("skip:") == 8
    assert len(rows(tmp_path)) == 8


def test_real_wikitext_files_train_through_the_runner(tmp_path):
    data = tmp_path / "wikitext"
    data.mkdir()
    words = " ".join(f"w{i % 97}" for i in range(20000))
    (data / "wiki.train.tokens").write_text("\n".join([words[:5000], "", words]) + "\n")
    out = run(
        "bench.run",
        "data.source=wikitext2",
        f"data.path={data}",
        "wandb.mode=disabled",
        *QUICK,
        results_dir=tmp_path / "runs",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert rows(tmp_path / "runs")[0]["status"] == "ok"


def test_unknown_names_and_bad_values_fail_in_one_line(tmp_path):
    # three runners at once, each with its own results: none reaches a worker
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.run", *args, "wandb.mode=disabled", f"results_dir={tmp_path / str(i)}"],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i, args in enumerate([["cluster=local_hetero9"], ["precision=fp16"], ["global_batch=1"]])
    ]
    unknown, precision, batch = [(proc.communicate(timeout=300)[1], proc.returncode)[::-1] for proc in procs]
    assert unknown == (
        2,
        "error: cluster=local_hetero9 is unknown; known: h100x1, local_2x2, local_3m, "
        "local_cpu1, local_gpu_hetero2, local_gpu_paper, local_hetero2, local_hetero4, "
        "local_homo2, motivation, paper_hetero, paper_homo\n",
    )
    assert precision[0] != 0 and precision[1].strip().splitlines() == [
        "error: precision='fp16' is invalid; valid: fp32, tf32, bf16 (fp32 as in the paper; e.g. precision=bf16)"
    ]
    assert batch[0] != 0 and batch[1].strip().splitlines() == [
        "error: global_batch=1 is smaller than the 2 devices of cluster=local_hetero2; every "
        "device needs a sample: set global_batch>=2 (or preset.batch_per_device>=1)"
    ]
    assert not rows(tmp_path / "0")  # an unknown name: no case to record
    assert [r["status"] for i in (1, 2) for r in rows(tmp_path / str(i))] == ["failed", "failed"]


def test_the_main_job_compares_methods_in_interleaved_rounds(tmp_path, dp_cp_by_torchrun):
    # four of the methods, one per engine family (the README's command runs all of them; each
    # method's own case is tested elsewhere): the rounds, ranks and aggregates are the same code
    methods = "method=dp_ev,dp_cp,hap,pipeline"
    out = run("bench.compare", "wandb.mode=disabled", "repeats=2", methods, *QUICK, results_dir=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "speedup vs dp_ev" in out.stdout and "rank" in out.stdout
    assert "RuntimeWarning" not in out.stderr  # e.g. runpy's, in forked workers (bench.runtime.launch)
    recorded = rows(tmp_path)
    repeats = [r for r in recorded if r["row_kind"] == "repeat"]
    methods = [r["method"] for r in repeats]
    n = len(methods) // 2
    assert methods[0] == "dp_ev" and {"dp_ev", "dp_cp"} <= set(methods)
    assert methods[:n] == methods[n:] and [r["repeat"] for r in repeats] == [0] * n + [1] * n
    aggregates = [r for r in recorded if r["row_kind"] == "aggregate"]
    assert [r["method"] for r in aggregates] == methods[:n]
    for agg in aggregates:
        assert agg["aggregate"]["iter_time_s"]["n"] == 2
        assert agg["aggregate"]["repeat_run_ids"] == [r["run_id"] for r in repeats if r["method"] == agg["method"]]
        assert len({r["sweep_id"] for r in recorded}) == 1
    # A case's fixed cost is paid once: its first round prepares it and sets its workers up, the
    # second reuses both; each method has processes of its own.
    first, second = repeats[:n], repeats[n:]
    for a, b in zip(first, second):
        assert a["worker_pids"] == b["worker_pids"] and len(set(a["worker_pids"])) == 2
        assert a["timings"]["prepare_s"] > 0 and a["timings"]["setup_s"] > 0 and a["timings"]["untimed_s"] > 0
        # each round sets its pacing reference again (emulation.reference_each_round)
        assert "prepare_s" not in b["timings"] and b["timings"]["setup_s"] == 0 and b["timings"]["untimed_s"] > 0
        references = [[rank["reference_s"] for rank in r["emulation"]["ranks"]] for r in (a, b)]
        assert references[0] != references[1]
        assert b["timings"]["iterations_s"] > 0 and a["plan_hash"] == b["plan_hash"]
    pids = [set(r["worker_pids"]) for r in first]
    assert all(not (p & q) for i, p in enumerate(pids) for q in pids[i + 1 :])
    # Nothing passes from one method to the next: dp_cp's first round, run after dp_ev's in the
    # same comparison, trains exactly as dp_cp alone (torchrun's run: the same case as the local
    # launcher's, test_torchrun_runs_the_same_case_as_the_local_launcher).
    alone, by_torchrun = dp_cp_by_torchrun
    assert by_torchrun["returncode"] == 0, by_torchrun["stderr"]
    (single,) = rows(alone)
    (cp_first,) = [r for r in first if r["method"] == "dp_cp"]
    assert cp_first["loss_per_iter"] == single["loss_per_iter"] and cp_first["loss_first"] == single["loss_first"]


@pytest.fixture
def dp_cp_by_torchrun(shared_run):
    """The results folder of one dp_cp case launched by torchrun, run once (shared_run), and
    torchrun's exit status and stderr."""

    def launch(folder):
        torchrun = Path(sys.executable).parent / "torchrun"
        cmd = [
            str(torchrun),
            "--standalone",
            "--nproc-per-node=2",
            f"--log-dir={folder / 'torchrun'}",
            "-m",
            "bench.run",
            "method=dp_cp",
            "wandb.mode=disabled",
            *QUICK,
            f"results_dir={folder}",
        ]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        return {"returncode": out.returncode, "stderr": out.stderr[-3000:]}

    return shared_run("dp-cp-torchrun", launch)


def test_torchrun_runs_the_same_case_as_the_local_launcher(dp_cp_by_torchrun):
    """One dp_cp case under torchrun: its row (the comparison's dp_cp, run by the local launcher,
    trains exactly as it: test_the_main_job_compares_methods_in_interleaved_rounds)."""
    results, out = dp_cp_by_torchrun
    assert out["returncode"] == 0, out["stderr"]
    (row,) = rows(results)  # rank 0 alone writes the row
    assert row["status"] == "ok" and row["batch_shares"] == [11, 5] and len(row["peak_mem_gib"]) == 2


_SERVERS = """
import os, sys
import multiprocessing, multiprocessing.forkserver
from bench.runner.configs import compose_settings
from bench.runner.execute import expect_cases
from bench.runner.case import new_record, prepare_case

def servers():  # running fork servers this process started (a fork of it or a fresh interpreter)
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    return int(pid is not None and os.waitpid(pid, os.WNOHANG) == (0, 0))

if __name__ == "__main__":
    cfg = compose_settings("wandb.mode=disabled", f"results_dir={sys.argv[1]}")
    prepare_case(cfg, new_record(cfg))  # as bench.plan does: nothing to launch
    print(servers())
    expect_cases([compose_settings("method=deepspeed")])  # as bench.compare does for later cases
    prepare_case(cfg, new_record(cfg), launching=True)  # as the runner does before it launches
    print(servers())
    # a process forked from the server finds what the later case's workers import already there
    probe = multiprocessing.get_context("forkserver").Process(target=exec, args=(
        "import sys; sys.exit(0 if 'deepspeed.runtime.zero.muon.muon_optimizer' in sys.modules else 3)",))
    probe.start()
    probe.join()
    print(probe.exitcode)
"""


def test_the_workers_server_starts_while_the_runner_prepares_a_case_it_launches(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _SERVERS, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # (the server's import of DeepSpeed logs a line of its own to stdout)
    assert [line for line in out.stdout.splitlines() if line.isdigit()] == ["0", "1", "0"]


# Tagged processes when the launcher is killed: the runner, multiprocessing's resource tracker
# and the server the workers fork from (bench.runtime.launch), still importing torch; then the workers,
# given time to set up and train (a second is plenty on a 2-core machine).
@pytest.mark.parametrize("processes, settle_s", [(3, 0.0), (5, 5.0)], ids=["server-starting", "training"])
def test_workers_of_a_killed_launcher_do_not_linger_nor_their_files(tmp_path, processes, settle_s):
    tag = f"HETBENCH_TEST_TAG={uuid.uuid4().hex}"
    # A long case: an orphaned worker would go on training well past the wait below.
    cmd = [sys.executable, "-m", "bench.run", "wandb.mode=disabled", "measured_iters=100000", f"results_dir={tmp_path}"]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, **dict([tag.split("=", 1)])},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 90
    while len(_processes_with(tag)) < processes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_processes_with(tag)) >= processes, "the case never got that far"
    time.sleep(settle_s)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while _processes_with(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(tag) == [], "workers outlived their killed launcher"
    board = ArrivalBoard.path(proc.pid, "*")
    assert not list(board.parent.glob(board.name)), "the workers' arrival board was left behind"
