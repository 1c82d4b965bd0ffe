import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bench.core.cluster import ClusterSpec

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_profile_measures_collectives_and_writes_a_valid_cluster(tmp_path):
    out, cluster = tmp_path / "profile.json", tmp_path / "profiled.yaml"
    cmd = [
        sys.executable,
        "-m",
        "bench.profile",
        "--max-mb",
        "0.25",
        "--repeats",
        "2",
        "--out",
        str(out),
        "--cluster-out",
        str(cluster),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    profile = json.loads(out.read_text())
    kinds = {(r["kind"], r["impl"]) for r in profile["collectives"]}
    assert {
        ("all_gather", "padded"),
        ("all_gather", "grouped"),
        ("all_reduce", "ring"),
        ("all_to_all", "ring"),
        ("reduce_scatter", "grouped"),
    } <= kinds
    assert all(r["seconds"] > 0 for r in profile["collectives"])
    assert profile["compute"]["linear"]["flops_per_s"] > 1e8
    spec = ClusterSpec.from_config(yaml.safe_load(cluster.read_text()))
    assert spec.num_devices == 2 and spec.emulated
