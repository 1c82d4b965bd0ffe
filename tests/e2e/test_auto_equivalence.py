"""One step of auto's plans on emulated devices == one step on the whole batch.

auto runs the part it chose (hap's runtime, FSDP2, DeepSpeed's engine, the pipeline trainer) with the chosen
options; these check the summed loss, every gradient and every parameter after Adam's step
against the single-device model, for the plans auto really makes on local_hetero2 and
local_2x2 (the paper's models, tiny), and for each composition forced through its options.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.records.rows import load_records
from tests.e2e.test_pipeline_fsdp_equivalence import _check_one_step

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODELS = ["vgg19", "vit", "bert", "bert_moe"]
# Priced without timing probes on this host (FSDP2's CPU work, the pipeline's layer-group
# profile, DeepSpeed's engine work): the plans auto makes from the cost model alone, planned in
# seconds.
PRICED = ("method.fsdp.work_probe=false", "method.pipeline.profile=false", "method.deepspeed.engine_probe=false")


def _auto(case) -> dict:
    d = case.plan.details["auto"]
    assert case.plan.method == "auto"
    assert d["num_priced"] >= 1 and d["candidates"]
    fits = [c for c in d["candidates"] if c["status"] == "fits"]
    assert min(c["iter_time_s"] for c in fits) == pytest.approx(
        next(c["iter_time_s"] for c in fits if c["candidate"] == d["chosen_as"])
    ), "auto kept a candidate slower than another that fits"
    print(f"auto chose: {d['chosen_as']} ({case.workload.name} on {case.cluster.name})")
    return d


@pytest.mark.parametrize("model", MODELS)
def test_auto_on_local_hetero2_equals_single_device_training(cfg_factory, model):
    """Whatever auto chooses for the model on two unlike devices."""
    case = _check_one_step(cfg_factory, f"model={model}", "method=auto", "global_batch=8", *PRICED)
    _auto(case)


@pytest.mark.parametrize("model", MODELS)
def test_auto_on_local_2x2_equals_single_device_training(cfg_factory, model):
    """Whatever auto chooses on two machines of two devices each."""
    case = _check_one_step(
        cfg_factory, f"model={model}", "cluster=local_2x2", "method=auto", "global_batch=8", *PRICED, ranks=4
    )
    _auto(case)


@pytest.mark.parametrize(
    "forced, part",
    [
        (("method.stages=1", "method.state=replicated"), "hap"),
        (("method.stages=1", "method.state=sharded"), "fsdp"),
        (("method.stages=2",), "pipeline"),
        (("method.stages=1", "method.state=replicated", "method.activation_checkpointing=true"), "hap"),
        (("method.stages=1", "method.state=sharded", "method.grad_accumulation=2"), "fsdp"),
        (("method.state=zero1",), "deepspeed"),
        (("method.state=zero2",), "deepspeed"),
        (("method.state=zero2", "method.activation_checkpointing=true", "method.grad_accumulation=2"), "deepspeed"),
    ],
)
def test_each_composition_auto_can_choose_equals_single_device_training(cfg_factory, forced, part):
    case = _check_one_step(cfg_factory, "model=bert", "method=auto", "global_batch=8", *PRICED, *forced)
    d = _auto(case)
    assert d["part"] == part
    chosen = d["chosen"]
    if "method.activation_checkpointing=true" in forced:
        assert chosen["checkpointing"] and case.plan.details["memory_tools"]["checkpointed_groups"]
    if "method.grad_accumulation=2" in forced:
        assert chosen["grad_accumulation"] == 2
    if part == "deepspeed":  # the engine at the candidate's ZeRO stage
        assert case.plan.details["zero_stage"] == int(chosen["state"][-1])
        assert case.plan.details["ds_config"]["zero_optimization"]["stage"] == int(chosen["state"][-1])


def test_pipelines_with_sharded_state_auto_chooses_equal_single_device_training(cfg_factory):
    """The pipeline's sharded state (FSDP2 over a stage's replicas) as auto passes it through."""
    case = _check_one_step(
        cfg_factory,
        "model=bert",
        "cluster=local_2x2",
        "method=auto",
        "method.stages=2",
        "method.state=sharded",
        "method.stage_level=machine",
        "global_batch=8",
        *PRICED,
        ranks=4,
    )
    assert _auto(case)["chosen"]["state"] == "sharded" and case.plan.details["sharded_state"] is True


@pytest.mark.parametrize("model", ["bert", "bert_moe"])
def test_pipelines_of_hap_stages_auto_plans_equal_single_device_training(cfg_factory, model):
    """hap's synthesis inside each stage (one machine a stage), as auto plans it and
    HapStagesTrainer runs it on the runner's workers."""
    case = _check_one_step(
        cfg_factory,
        f"model={model}",
        "cluster=local_2x2",
        "method=auto",
        "method.stage_synthesis=true",
        "global_batch=8",
        *PRICED,
        ranks=4,
    )
    d = _auto(case)
    assert d["part"] == "hap_stages" and d["chosen"]["synthesis"]
    hs = case.plan.details["hap_stages"]
    assert len(hs["groups"]) == 2 and all(len(g) == 2 for g in hs["groups"])
    assert all(st is not None for st in hs["stages"])


# A failed and an oom row from the command a user runs (every message of auto's options is
# checked in this process by tests/unit/test_auto.py).
@pytest.mark.parametrize(
    "overrides, status, needle",
    [
        (("method.stages=9",), "failed", "method.stages=9 is more than the 4 layer groups"),
        (("method.memory_budget_gib=0.0001", "method.max_grad_accumulation=2"), "oom", "smallest peak found"),
    ],
)
def test_bad_input_to_auto_exits_non_zero_with_one_line_and_a_row_never_ok(tmp_path, overrides, status, needle):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "model=bert",
            "cluster=paper_hetero",
            "mode=sim",
            "method=auto",
            "wandb.mode=disabled",
            f"results_dir={tmp_path}",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], out.stderr[-2000:]
    rows = load_records(tmp_path / "records.jsonl")
    assert [r["status"] for r in rows] == [status] and rows[0]["samples_per_s"] is None
