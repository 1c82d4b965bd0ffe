"""Where ranks compute, MPS shares, precision and out-of-memory: the parts that run without a GPU."""

import pytest
import torch

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.records.rows import case_key, load_records
from bench.runner import execute as runner
from bench.runner.configs import results_file
from bench.runtime import mps
from bench.runtime.emulation import Emulator, achieved_speeds
from bench.runtime.launch import rank_envs
from bench.runtime.worker import (
    backend_for,
    is_out_of_memory,
    pick_device,
    precision_in_force,
    set_precision,
    step_context,
)
from tests.conftest import compose_config

LINKS = {level: {"bandwidth_gbps": 1.0, "latency_s": 5e-5} for level in ("intra_machine", "inter_machine")}


def cluster(**fields) -> ClusterSpec:
    body = {
        "name": "t",
        "emulated": True,
        "virtual_device": "gpu",
        "links": LINKS,
        "machines": [
            {"count": 1, "device": "cpu", "num_devices": 1, "speed": 1.0},
            {"count": 1, "device": "cpu", "num_devices": 1, "speed": 0.4},
        ],
    }
    return ClusterSpec.from_config({**body, **fields})


def gpu_machines(*speeds):
    return [{"count": 1, "device": "H100-80", "num_devices": 1, "speed": s} for s in speeds]


def test_emulated_clusters_compute_on_cpu_unless_they_say_cuda():
    assert cluster().device == "cpu"
    assert cluster(device="cuda", machines=gpu_machines(1, 0.4)).device == "cuda"
    real = cluster(emulated=False, machines=gpu_machines(1, 1))
    assert real.device == "cuda"
    # The field enters the hash only where it differs from the default: old hashes hold.
    assert cluster().fingerprint() == cluster(device="cpu").fingerprint()
    assert real.fingerprint() != cluster(emulated=False, machines=gpu_machines(1, 1), device="cpu").fingerprint()


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"device": "gpu"}, "cluster.device='gpu' is invalid; use cpu"),
        ({"device": "cuda"}, "cluster.device=cuda runs the emulated ranks on a GPU, but the machines say device 'cpu'"),
        ({"machines": gpu_machines(1, 0.4)}, "cluster.emulated=true with cluster.device=cpu needs device 'cpu'"),
    ],
)
def test_bad_device_values_name_the_field_and_the_fix(fields, needle):
    with pytest.raises(ConfigError) as err:
        cluster(**fields)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_cpu_emulated_cluster_never_picks_cuda_even_when_cuda_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cpu = cluster()
    assert pick_device(1, cpu) == torch.device("cpu")
    assert backend_for(cpu, pick_device(1, cpu)) == "gloo"
    gpu = cluster(device="cuda", machines=gpu_machines(1, 0.4))
    assert pick_device(1, gpu) == torch.device("cuda", 0)  # all ranks share GPU 0 under MPS
    assert backend_for(gpu, torch.device("cuda", 0)) == "gloo"  # NCCL refuses 2 ranks on 1 GPU
    real = cluster(emulated=False, machines=gpu_machines(1, 1))
    assert pick_device(1, real) == torch.device("cuda", 1)
    assert backend_for(real, torch.device("cuda", 1)) == "nccl"


def test_workers_of_a_cpu_cluster_see_no_gpu_and_deepspeed_follows_the_ranks_device():
    # On a GPU host DeepSpeed took CUDA for cpu ranks and set the device to the local rank.
    assert rank_envs(cluster(), 2, None) == [{"CUDA_VISIBLE_DEVICES": ""}] * 2
    assert rank_envs(cluster(emulated=False, machines=gpu_machines(1, 1)), 1, None) == [{}]
    shared = rank_envs(cluster(device="cuda", machines=gpu_machines(1, 0.4)), 2, ("/p", "/l"))
    assert [e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for e in shared] == ["71", "28"]
    assert all("CUDA_VISIBLE_DEVICES" not in e for e in shared)
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    from methods.ds_zero import use_accelerator

    before = get_accelerator().device_name()
    try:
        use_accelerator("cuda")
        assert get_accelerator().device_name() == "cuda"
        use_accelerator("cpu")
        assert get_accelerator().device_name() == "cpu"
    finally:
        use_accelerator(before)


def test_mps_shares_are_each_speeds_share_of_the_sum_and_never_oversubscribe():
    assert mps.thread_percentages([1.0, 0.4]) == [71, 28]
    paper = mps.thread_percentages([1.0] * 2 + [2.149 / 3.859] * 6)
    assert paper == [18, 18] + [10] * 6 and sum(paper) <= 100
    assert sum(mps.thread_percentages([1.0] * 7)) <= 100
    envs = mps.worker_envs(cluster(device="cuda", machines=gpu_machines(1, 0.4)), "/p", "/l")
    assert [e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for e in envs] == ["71", "28"]
    assert all(e["CUDA_MPS_PIPE_DIRECTORY"] == "/p" and e["CUDA_MPS_LOG_DIRECTORY"] == "/l" for e in envs)


def test_achieved_speeds_put_measured_rates_on_the_configured_scale():
    assert achieved_speeds([1.0, 0.4], [10.0, 4.0]) == pytest.approx([1.0, 0.4])
    assert achieved_speeds([1.0, 0.4], [10.0, 5.0]) == pytest.approx([1.4 * 2 / 3, 1.4 / 3])


def test_an_unpaced_emulator_leaves_compute_alone_and_reports_the_probe():
    spec = cluster()
    emu = Emulator(spec, 1, enabled=True, pace_compute=False)
    assert emu.headroom == 1.0 and emu.dilation == 1.0
    emu.begin_iteration(100)
    emu.stretch()
    assert emu.slept_s == 0.0
    assert emu.report(3e12) == {
        "speed": 0.4,
        "paced": False,
        "probe_flops_per_s": 3e12,
        "mps_active_thread_percentage": None,
    }


def test_out_of_memory_is_recognised_from_cuda_python_and_the_cpu_allocator():
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError) as err:
        torch.empty(2**50, dtype=torch.uint8)  # what the oom_rank hook asks for
    assert is_out_of_memory(err.value)


@pytest.mark.parametrize(
    "precision,autocast,tf32", [("fp32", None, False), ("tf32", None, True), ("bf16", "bfloat16", False)]
)
def test_precision_sets_and_reports_what_torch_has_in_force(precision, autocast, tf32):
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        set_precision(precision)
        with step_context(precision, torch.device("cpu")):
            got = precision_in_force(precision, torch.device("cpu"))
            y = torch.ones(2, 2) @ torch.ones(2, 2)
        assert got == {
            "precision": precision,
            "autocast_dtype": autocast,
            "matmul_allow_tf32": tf32,
            "cudnn_allow_tf32": tf32,
        }
        assert y.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_the_default_precision_keeps_case_keys_of_older_rows():
    assert case_key({"model": {"name": "bert"}, "precision": "fp32"}) == case_key({"model": {"name": "bert"}})
    assert case_key({"model": {"name": "bert"}, "precision": "bf16"}) != case_key({"model": {"name": "bert"}})


class _RefusedWorkers:
    """Stands in for bench.runtime.launch.CaseWorkers: no worker may start."""

    def __init__(self, *args, **kwargs):
        pass

    def run_round(self, *args, **kwargs):
        raise AssertionError("a worker was started")

    def close(self):
        pass


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["precision=fp16"], "precision='fp16' is invalid; valid: fp32, tf32, bf16"),
        (["+cluster.device=gpu"], "cluster.device='gpu' is invalid; use cpu"),
    ],
)
def test_bad_precision_or_device_is_one_line_before_any_worker(config_factory, capsys, monkeypatch, overrides, needle):
    monkeypatch.setattr(runner, "CaseWorkers", _RefusedWorkers)
    record = runner.run_config(config_factory(*overrides))
    err = capsys.readouterr().err.strip()
    assert record.status == "failed" and needle in record.error
    assert err.startswith("error: ") and needle in err and "\n" not in err
    assert [r["status"] for r in load_records(results_file(config_factory()))] == ["failed"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_a_cuda_cluster_without_a_gpu_is_one_line_before_any_worker(cfg_factory, capsys, monkeypatch):
    monkeypatch.setattr(runner, "CaseWorkers", _RefusedWorkers)
    record = runner.run_case(cfg_factory("cluster=local_gpu_hetero2"))
    err = capsys.readouterr().err.strip()
    needle = "cluster.device=cuda (cluster=local_gpu_hetero2) needs a CUDA GPU, but torch"
    assert record.status == "failed" and needle in record.error
    assert err.startswith("error: ") and "device: cpu" in err and "\n" not in err


def test_a_cuda_cluster_without_mps_is_one_line_before_any_worker(cfg_factory, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control there
    monkeypatch.setattr(runner, "CaseWorkers", _RefusedWorkers)
    record = runner.run_case(cfg_factory("cluster=local_gpu_hetero2"))
    err = capsys.readouterr().err.strip()
    assert record.status == "failed" and "nvidia-cuda-mps-control is not on PATH" in record.error
    assert err.startswith("error: cluster.device=cuda") and "\n" not in err


def test_gpu_clusters_plan_and_simulate_like_any_other(cfg_factory):
    for name, n in (("local_gpu_hetero2", 2), ("local_gpu_paper", 8)):
        record = runner.run_case(cfg_factory(f"cluster={name}", "mode=sim", "method=dp_cp"))
        assert record.status == "ok" and record.num_devices == n, record.error
        assert len(set(record.batch_shares)) == 2  # shares follow the two speeds
        assert compose_config(f"cluster={name}").cluster.device == "cuda"


def test_a_gpu_cluster_wanting_more_gpus_than_the_host_has_is_one_line_before_any_worker(
    cfg_factory, capsys, monkeypatch
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(runner, "CaseWorkers", _RefusedWorkers)
    record = runner.run_case(cfg_factory("cluster=paper_homo"))
    err = capsys.readouterr().err.strip()
    assert record.status == "failed" and "\n" not in record.error
    assert record.error.startswith(f"cluster=paper_homo has {record.num_devices} GPUs but this host has 1; ")
    assert err == f"error: {record.error}" and "mode=sim" in err
    assert [r["status"] for r in load_records(results_file(cfg_factory()))] == ["failed"]


# Stands in for nvidia-cuda-mps-control: a daemon that starts and serves no client (the ranks'
# GPU is hidden from them), logging how it was called.
NO_CLIENTS_CONTROL = """#!/bin/sh
if [ "$1" = "-d" ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY" >> "$LOG"
else read cmd; echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> "$LOG"; fi
"""


def test_an_mps_daemon_that_starts_but_serves_no_client_is_one_line_and_is_stopped(
    cfg_factory, capsys, monkeypatch, tmp_path
):
    control = tmp_path / "bin" / mps.CONTROL
    control.parent.mkdir()
    control.write_text(NO_CLIENTS_CONTROL)
    control.chmod(0o755)
    log = tmp_path / "mps.log"
    monkeypatch.setenv("PATH", f"{control.parent}:/usr/bin:/bin")
    monkeypatch.setenv("LOG", str(log))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the client cannot get a GPU, GPU host or not
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the runner's check for one
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")  # the row's hardware

    class NoWorkers(_RefusedWorkers):
        def run_round(self, *args, **kwargs):  # what bench.runtime.launch.CaseWorkers does first
            with mps.mps_daemon():
                raise AssertionError("the daemon was let through to the workers")

    monkeypatch.setattr(runner, "CaseWorkers", NoWorkers)
    record = runner.run_case(cfg_factory("cluster=local_gpu_hetero2", "warmup_iters=0", "measured_iters=1"))
    err = capsys.readouterr().err.strip()
    assert record.status == "failed" and "\n" not in record.error, record.error
    assert record.error.startswith(
        f"cluster.device=cuda: the MPS daemon started ({mps.CONTROL} -d) but a client "
        "could not use the GPU through it ("
    )
    assert err == f"error: {record.error}"
    start, stop = [line.split() for line in log.read_text().splitlines()]
    assert start[0] == "start" and stop[0] == "quit" and start[1:] == stop[1:]  # stopped, its own directory
