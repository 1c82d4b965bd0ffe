"""scripts/gpu-check's paper table, from the rows bench.compare writes (no GPU needed)."""

import json
import subprocess
from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    loader = SourceFileLoader("gpu_check", str(ROOT / "scripts" / "gpu-check"))
    module = module_from_spec(spec_from_loader("gpu_check", loader))
    loader.exec_module(module)
    return module


def test_the_paper_table_reads_each_methods_aggregate_and_marks_a_failed_model(monkeypatch, tmp_path):
    gpu_check = _script()
    medians = {"vgg19": (0.0132, 0.01437), "vit": (0.05955, 0.06387), "bert": (0.1369, 0.1397)}

    def fake_compare(cmd, cwd):
        out = Path(next(c for c in cmd if c.startswith("results_dir=")).split("=", 1)[1])
        model = next(c for c in cmd if c.startswith("model=")).split("=", 1)[1]
        out.mkdir(parents=True)
        rows = [{"method": m, "row_kind": "aggregate",
                 "aggregate": {"iter_time_s": {"median": t, "low": t * 0.99, "high": t * 1.01}}}
                for m, t in zip(("dp_ev", "hap"), medians.get(model, ()))]
        rows += [{"method": m, "row_kind": "repeat", "peak_mem_gib_per_iter": [3.0, gib]}
                 for m, gib in zip(("dp_ev", "hap", "hap"), (2.5, 2.25, 2.75)) if model in medians]
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
