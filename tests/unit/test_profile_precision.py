"""Profiles and the single-device calibration run at a precision, record it, and a case at
another precision refuses the profile in one line."""

import json
import logging
from pathlib import Path

import pytest
import torch

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError
from bench.core.interfaces import Workload
from bench.runner.case import check_profile_precision
from bench.runtime import probes
from bench.runtime.hostspeed import device_step
from bench.runtime.precision import ForwardDtypes
from models.bert import BertConfig

FP32 = {"precision": "fp32", "autocast_dtype": None, "matmul_allow_tf32": False, "cudnn_allow_tf32": False}


def _profile(tmp_path, precision: dict | None, name="MyGPU.json") -> str:
    prof = {
        "device_type": "MyGPU",
        "compute": {"other": {"fixed_s": 1e-6, "flops_per_s": 1e11}},
        "optimizer": {"fixed_s": 1e-5, "bytes_per_s": 1e9},
    }
    if precision is not None:
        prof["precision"] = precision
    path = tmp_path / name
    path.write_text(json.dumps(prof))
    return str(path)


def _cluster(profile: str) -> ClusterSpec:
    link = {"bandwidth_gbps": 100.0, "latency_s": 1e-5}
    return ClusterSpec.from_config(
        {
            "name": "prof",
            "virtual_device": "gpu",
            "device_types": {
                "MyGPU": {
                    "memory_gib": 24,
                    "effective_flops": 5e11,
                    "profile": profile,
                    "sources": {"memory_gib": "test", "effective_flops": "test"},
                }
            },
            "machines": [{"count": 1, "device": "MyGPU", "num_devices": 2}],
            "links": {"intra_machine": link, "inter_machine": link},
        }
    )


@pytest.mark.parametrize(
    "precision,tf32,autocast", [("fp32", False, None), ("tf32", True, None), ("bf16", False, "bfloat16")]
)
def test_a_profile_is_measured_at_its_precision_records_it_and_leaves_the_switches_as_they_were(
    monkeypatch, precision, tf32, autocast
):
    inside = {}

    def measure(device, device_type, repeats):
        inside["tf32"] = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        inside["dtype"] = torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype
        return {"device_type": device_type, "compute": {}}

    monkeypatch.setattr(probes, "_profile_device", measure)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    prof = probes.profile_device("cpu", "MyGPU", precision=precision)
    assert prof["precision"] == {
        "precision": precision,
        "autocast_dtype": autocast,
        "matmul_allow_tf32": tf32,
        "cudnn_allow_tf32": tf32,
    }
    assert inside["tf32"] == (tf32, tf32)
    assert inside["dtype"] == (torch.bfloat16 if precision == "bf16" else torch.float32)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_the_calibrations_step_runs_at_the_workloads_precision():
    workload = Workload("bert", "tiny", BertConfig.from_preset("tiny"), 2, 1.0, precision="bf16")
    with ForwardDtypes() as watch:
        seconds, peak = device_step(workload, 2, 0, "cpu", repeats=1)
    assert seconds > 0 and peak is None
    assert set(watch.observed()) == {"bfloat16"}
    with ForwardDtypes() as watch:
        device_step(Workload("bert", "tiny", BertConfig.from_preset("tiny"), 2, 1.0), 2, 0, "cpu", repeats=1)
    assert set(watch.observed()) == {"float32"}


def test_a_profile_measured_at_another_precision_is_refused_in_one_line(tmp_path):
    cluster = _cluster(_profile(tmp_path, FP32))
    assert cluster.devices[0].type.compute.precision == "fp32"
    check_profile_precision(cluster, "fp32")
    with pytest.raises(ConfigError) as info:
        check_profile_precision(cluster, "bf16")
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(
        f"precision=bf16 but the compute profile {tmp_path}/MyGPU.json (device type MyGPU) "
        "was measured at precision=fp32; run at precision=fp32, or profile the device at bf16"
    )
    assert "bench.profile --device cuda --device-type MyGPU --precision bf16 --compute-out" in text


def test_a_profile_that_does_not_record_its_precision_is_used_with_one_warning(tmp_path, caplog):
    cluster = _cluster(_profile(tmp_path, None, "old.json"))
    assert cluster.devices[0].type.compute.precision is None
    with caplog.at_level(logging.WARNING):
        check_profile_precision(cluster, "fp32")
        check_profile_precision(cluster, "bf16")
    warned = [r.getMessage() for r in caplog.records if "does not record its precision" in r.getMessage()]
    assert len(warned) == 1 and "old.json" in warned[0]


def test_a_profile_with_a_precision_that_is_not_bench_profiles_record_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="precision must be the mapping bench.profile records") as info:
        _cluster(_profile(tmp_path, "fp32"))
    assert "\n" not in str(info.value)


def test_the_device_calibration_refuses_a_profile_of_another_precision_before_any_step(tmp_path, capsys):
    from bench.calibrate import main

    path = tmp_path / "T4.json"
    path.write_text(json.dumps({**json.loads(Path(_profile(tmp_path, FP32)).read_text()), "device_type": "T4"}))
    path = str(path)
    code = main(
        [
            "--device",
            "cpu",
            "--device-type",
            "T4",
            "--profile",
            path,
            "--precision",
            "bf16",
            "--out",
            str(tmp_path / "out.json"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: precision=bf16 but the compute profile")
    assert not (tmp_path / "out.json").exists()


def test_a_case_at_another_precision_than_its_clusters_profile_is_a_failed_row_of_one_line(tmp_path, capsys):
    from omegaconf import open_dict

    from bench.records.rows import load_records
    from bench.runner.configs import results_file
    from bench.runner.execute import run_config
    from tests.conftest import compose_config

    cfg = compose_config("mode=sim", "precision=bf16", "cluster=h100x1", results_dir=str(tmp_path / "runs"))
    with open_dict(cfg):
        cfg.cluster.device_types = {
            "MyGPU": {
                "memory_gib": 24,
                "effective_flops": 5e11,
                "profile": _profile(tmp_path, FP32),
                "sources": {"memory_gib": "test", "effective_flops": "test"},
            }
        }
        cfg.cluster.machines[0].device = "MyGPU"
    row = run_config(cfg)
    assert row.status == "failed" and "\n" not in row.error and "was measured at precision=fp32" in row.error
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {row.error}"]
    [written] = load_records(results_file(cfg))
    assert written["status"] == "failed" and written["predicted_iter_time_s"] is None
