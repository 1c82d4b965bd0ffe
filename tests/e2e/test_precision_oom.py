"""Precision, out-of-memory rows and the MPS daemon's lifecycle, with real CPU workers."""

import dataclasses
import os
import stat

import pytest

from bench.core.errors import ConfigError
from bench.records.rows import load_records
from bench.runner import case as runner_case
from bench.runner import execute as runner
from bench.runner.configs import results_file
from bench.runtime.launch import launch

pytestmark = pytest.mark.e2e
QUICK = ["warmup_iters=0", "measured_iters=2", "emulation.reference_iters=0"]


def test_bf16_trains_for_real_and_the_row_says_so(cfg_factory):
    rows = {p: runner.run_case(cfg_factory("method=dp_ev", f"precision={p}", *WATCHED)) for p in ("fp32", "bf16")}
    for p, row in rows.items():
        assert row.status == "ok", row.error
        assert row.precision["precision"] == p
        assert len(row.rank_hardware) == 2
        assert all(h["device"] == "cpu" and h["name"] and h["cores"] >= 1 for h in row.rank_hardware)
    assert rows["bf16"].precision["autocast_dtype"] == "bfloat16"
    assert rows["fp32"].precision == {
        "precision": "fp32",
        "autocast_dtype": None,
        "matmul_allow_tf32": False,
        "cudnn_allow_tf32": False,
        "forward_matmul_dtypes": rows["fp32"].precision["forward_matmul_dtypes"],
    }
    assert set(rows["fp32"].precision["forward_matmul_dtypes"]) == {"float32"}
    assert set(rows["bf16"].precision["forward_matmul_dtypes"]) == {"bfloat16"}
    # bf16 rounds the forward: the same first step's loss moves, but only by bf16's precision.
    first = rows["fp32"].loss_first, rows["bf16"].loss_first
    assert first[0] != first[1] and first[1] == pytest.approx(first[0], rel=0.05)


# One warm-up step: the worker watches the dtypes of the first, unmeasured, step's forward; one
# reference step, through which a rank counts its tensors (bench.runtime.pacing).
WATCHED = ["warmup_iters=1", "measured_iters=1", "emulation.reference_iters=1"]
METHODS = ("dp_ev", "dp_cp", "deepspeed", "sfb", "hap", "pipeline", "fsdp_cp")  # fsdp: fsdp_cp's engine, even shares


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_its_forward_matmuls_in_bf16_when_asked(cfg_factory, method):
    # the pipeline's cut from the cost model, two stages of VGG19, whose every layer group convolves:
    # each rank runs matmuls wherever the host's measured speed puts the cut (BERT's first group,
    # the embedding, has none)
    fixed = ("model=vgg19", "method.profile=false", "method.num_stages=2") if method == "pipeline" else ()
    cfg = cfg_factory(f"method={method}", "precision=bf16", *WATCHED, *fixed)
    record = runner_case.new_record(cfg)
    case = runner_case.prepare_case(cfg, record, launching=True)
    ranks = launch(case, case.cluster.num_devices, timeout_s=600)
    # what every rank's matrix products and convolutions made in forward, not what the row says
    seen = [r["precision"]["forward_matmul_dtypes"] for r in ranks]
    assert all(s and set(s) == {"bfloat16"} for s in seen), seen
    # and every rank held the tensors the plan priced at autocast's dtypes (docs/cost-model.md,
    # "Memory"): within 0.4% for the data-parallel plans and DeepSpeed, 2.2% for fsdp_cp. The
    # pipeline's last VGG19 stage holds 1.5 MiB more than its price at fp32 too: not compared.
    if method != "pipeline":
        counted = [r["tensor_peak_gib"] for r in sorted(ranks, key=lambda r: r["rank"])]
        assert counted == pytest.approx(record.predicted_peak_mem_gib, rel=0.03)
    if method == "deepspeed":
        assert case.plan.details["ds_config"]["torch_autocast"]["enabled"]


def test_a_rank_out_of_memory_is_an_oom_row_with_its_peak_and_resume_keeps_it(cfg_factory, capsys, monkeypatch):
    cfg = cfg_factory("test.oom_rank=1", *QUICK)
    row = runner.run_case(cfg)
    assert row.status == "oom" and row.oom_rank == 1
    assert row.peak_mem_gib[0] is None and row.peak_mem_gib[1] > 0  # GiB of host RSS on CPU
    assert "can't allocate memory" in row.error and row.samples_per_s is None
    assert "case recorded as oom" in capsys.readouterr().err
    [written] = load_records(results_file(cfg))
    assert written["status"] == "oom" and written["peak_mem_gib"][1] == row.peak_mem_gib[1]

    def refuse(*args, **kwargs):
        raise AssertionError("resume ran a case already recorded oom")

    monkeypatch.setattr(runner, "CaseWorkers", refuse)
    again = runner.run_case(cfg_factory("test.oom_rank=1", "resume=true", *QUICK))
    assert again.status == "oom" and again.run_id == row.run_id


FAKE_CONTROL = """#!/bin/sh
# Stands in for nvidia-cuda-mps-control: logs how it was called and with which directories.
if [ "$1" = "-d" ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$LOG"
else read cmd; echo "$cmd $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$LOG"; fi
"""


def test_the_mps_daemon_gets_private_directories_and_is_stopped_when_the_case_fails(cfg_factory, tmp_path, monkeypatch):
    control = tmp_path / "bin" / "nvidia-cuda-mps-control"
    control.parent.mkdir()
    control.write_text(FAKE_CONTROL)
    control.chmod(control.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "mps.log"
    monkeypatch.setenv("PATH", f"{control.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LOG", str(log))
    # The workers must fail at their first CUDA call, as on a host without a GPU, also where
    # there is one (they inherit this; the fake daemon serves no MPS clients).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cfg = cfg_factory(*QUICK)
    case = runner_case.prepare_case(cfg, runner_case.new_record(cfg))
    case.cluster = dataclasses.replace(case.cluster, device="cuda")
    # The daemon's client check fails in one line, before any worker; the daemon must still be stopped.
    with pytest.raises(ConfigError, match="the MPS daemon started .* but a client could not use the GPU"):
        launch(case, 2, timeout_s=120)
    start, stop = [line.split() for line in log.read_text().splitlines()]
    assert start[0] == "start" and stop[0] == "quit" and start[1:] == stop[1:]
    assert all(os.path.basename(d).startswith("hetbench-mps-") for d in start[1:])
    assert not any(os.path.exists(d) for d in start[1:])  # temporary directories removed
