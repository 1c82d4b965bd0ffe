"""scripts/zoo_census.py without models: the cause of each failure, the counts per reason, the
sample of architectures trained for real, and a worker's architecture lost to a hang."""

from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def census():
    loader = SourceFileLoader("zoo_census", str(ROOT / "scripts" / "zoo_census.py"))
    module = module_from_spec(spec_from_loader("zoo_census", loader))
    loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "row,reason",
    [
        (
            {"stage": "build", "error": "ConfigError: ... DinatForImageClassification requires the natten library"},
            "a library that is not installed",
        ),
        (
            {
                "stage": "build",
                "error": "ConfigError: ... refused GuardOnDataDependentSymNode at m.py:9 (if x.any()): "
                "Could not guard on data-dependent expression Eq(u0, 1)",
            },
            "forward reads tensor values (data-dependent control flow or shapes)",
        ),
        (
            {
                "stage": "build",
                "paper_builds": False,
                "error": "ConfigError: model.arch=dbrx (preset=tiny, shallow "
                "sizes): transformers could not build DbrxForCausalLM from its config: AttributeError ...",
            },
            "does not build at its own size either (transformers)",
        ),
        (
            {
                "stage": "build",
                "error": "ConfigError: model.arch=voxtral_realtime (task seq2seq_lm): torch.export (non-strict) "
                "refused ValueError at m.py:956 (raise ValueError(...)): You must specify exactly one of "
                "input_features or encoder_inputs_embeds",
            },
            "the model takes other inputs than the task's alone (text beside an image, audio features)",
        ),
        (
            {
                "stage": "build",
                "error": "ConfigError: ... refused ValueError at m.py:173 (raise ValueError(...)): inputs_embeds "
                "and shared_kv_states cannot be None.",
            },
            "a draft model: it takes the main model's key-value states",
        ),
        (
            {
                "stage": "build",
                "error": "ConfigError: model.arch=jetmoe (task causal_lm): captured on a real sample, forward "
                "computes with a value it reads from a tensor (item at m.py:3); on meta tensors torch.export "
                "(non-strict) refused RuntimeError ...: Tensor.item() cannot be called on meta tensors",
            },
            "forward reads tensor values that change with the batch (refused on a real sample too)",
        ),
        (
            {"stage": "capture", "error": "NotImplementedError: Cannot copy out of meta tensor"},
            "capture: NotImplementedError",
        ),
    ],
)
def test_a_failure_is_named_by_its_cause_else_by_its_stage_and_type(census, row, reason):
    assert census.reason_of({"status": "failed", **row}) == reason


def test_the_table_counts_each_reason_and_lists_every_failure_on_one_line(census):
    rows = [
        {"arch": "gpt2", "task": "causal_lm", "status": "ok", "build_s": 1.0, "capture_s": 1.0, "plan_s": 2.0},
        {"arch": "a", "task": "causal_lm", "status": "failed", "stage": "build", "error": "X: needs the timm library"},
        {
            "arch": "b",
            "task": "image_cls",
            "status": "failed",
            "stage": "build",
            "error": "X: requires the timm library",
        },
        {"arch": "c", "status": "timeout", "stage": "worker", "reason": "worker hung past the timeout", "error": "-9"},
    ]
    lines = census.table_lines(rows)
    assert lines[0].startswith("1 of 4 architectures (25.0%)")
    assert "| a library that is not installed | 1 | b |" in lines
    assert "| worker hung past the timeout | 1 | c |" in lines
    assert sum(1 for x in lines if x.startswith(("| a |", "| b |", "| c |"))) == 3


def test_the_real_sample_spreads_over_the_tasks_in_proportion(census):
    rows = [{"arch": f"lm{i}", "task": "causal_lm", "status": "ok"} for i in range(12)]
    rows += [{"arch": f"img{i}", "task": "image_cls", "status": "ok"} for i in range(4)]
    rows += [{"arch": "broken", "task": "seq_cls", "status": "failed"}]
    picked = census.sample_for_real(rows, 4)
    tasks = [r["task"] for r in picked]
    assert len(picked) == 4 and tasks.count("causal_lm") == 3 and tasks.count("image_cls") == 1
    assert all(r["status"] == "ok" for r in picked) and picked[0]["arch"] == "lm0"


def test_a_worker_that_hangs_loses_only_the_architecture_it_is_on(census, tmp_path, monkeypatch):
    # A stand-in worker: writes a row for `fast`, then starts `slow` and never finishes it.
    script = tmp_path / "worker.py"
    script.write_text(
        "import json, sys, time\n"
        "out = sys.argv[sys.argv.index('--worker-out') + 1]\n"
        "archs = sys.argv[sys.argv.index('--archs') + 1:]\n"
        "with open(out, 'a') as f:\n"
        "    for a in archs:\n"
        "        f.write(json.dumps({'start': a}) + '\\n'); f.flush()\n"
        "        if a == 'slow':\n"
        "            time.sleep(60)\n"
        "        f.write(json.dumps({'row': {'arch': a, 'status': 'ok'}}) + '\\n'); f.flush()\n"
    )
    monkeypatch.setattr(census, "__file__", str(script))
    args = SimpleNamespace(chunk=3, jobs=1, timeout=1, cluster="paper_hetero", gpus_per_machine=1)
    monkeypatch.setattr(census, "_GRACE_S", 1.0)
    done, saved = {}, []
    census.survey(["fast", "slow", "after"], args, done, saved.append)
    assert done["fast"]["status"] == "ok" and done["after"]["status"] == "ok"
    assert done["slow"]["status"] == "timeout" and done["slow"]["reason"] == "worker hung past the timeout"
    assert [r["arch"] for r in saved] == ["fast", "slow", "after"]  # each row saved as it came
