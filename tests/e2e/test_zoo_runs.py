"""Bringing a model through the runner as a user does: bad input fails in one line with a failed
row and leaves the rows already recorded alone; a zoo model trains with hap for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers", reason="model=hf needs the optional extra .[zoo]")


def _run(results: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.run", *args, "wandb.mode=disabled", "logger=none", f"results_dir={results}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _rows(results: Path) -> list[dict]:
    path = results / "records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# The runner's path for a bad model: the config's one-line error, exit != 0, a failed row. One
# case of each adapter (a misspelt architecture; a module export refuses); every message of both
# adapters is checked in tests/unit/test_zoo_models.py.
@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["model=hf", "model.arch=gtp2"],
            "error: model.arch='gtp2' is not a transformers model type or a config.json; did you mean gpt2",
        ),
        (
            [
                "model=custom",
                "model.factory=tests.zoo_custom:build_branchy",
                "model.inputs=[{shape:[4]},{shape:[],dtype:int64,high:4}]",
            ],
            "error: model.factory=tests.zoo_custom:build_branchy: torch.export (non-strict) refused",
        ),
    ],
)
def test_bad_model_input_fails_in_one_line_with_a_failed_row_and_earlier_rows_untouched(tmp_path, args, line):
    earlier = {"run_id": "earlier", "status": "ok", "model": "bert"}
    (tmp_path / "records.jsonl").write_text(json.dumps(earlier) + "\n")
    out = _run(tmp_path, "mode=sim", "method=hap", *args)
    assert out.returncode != 0
    errors = [x for x in out.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(line), out.stderr[-2000:]
    rows = _rows(tmp_path)
    assert rows[0] == earlier and [r["status"] for r in rows[1:]] == ["failed"]


def test_a_hugging_face_model_trains_with_hap_on_an_emulated_cluster(tmp_path):
    out = _run(
        tmp_path,
        "model=hf",
        "model.arch=llama",
        "method=hap",
        "cluster=local_hetero2",
        "warmup_iters=1",
        "measured_iters=2",
        "emulation.reference_iters=0",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = _rows(tmp_path)
    assert row["status"].startswith("ok") and row["model"] == "hf-llama" and row["origin"] == "measured"
    assert row["plan"]["rule_coverage"]["flops_share"] == 1.0
