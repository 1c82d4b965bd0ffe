"""One step of auto's plans on emulated devices == one step on the whole batch.

auto runs the part it chose (hap's runtime, FSDP2, the pipeline trainer) with the chosen
options; these check the summed loss, every gradient and every parameter after Adam's step
against the single-device model, for the plans auto really makes on local_hetero2 and
local_2x2 (the paper's models, tiny), and for each composition forced through its options.
"""

import pytest

from tests.e2e.test_pipeline_fsdp_equivalence import _check_one_step

pytestmark = pytest.mark.e2e

MODELS = ["vgg19", "vit", "bert", "bert_moe"]


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
    case = _check_one_step(cfg_factory, f"model={model}", "method=auto", "global_batch=8")
    _auto(case)


@pytest.mark.parametrize("model", MODELS)
def test_auto_on_local_2x2_equals_single_device_training(cfg_factory, model):
    """Whatever auto chooses on two machines of two devices each."""
    case = _check_one_step(cfg_factory, f"model={model}", "cluster=local_2x2", "method=auto", "global_batch=8", ranks=4)
    _auto(case)


@pytest.mark.parametrize(
    "forced, part",
    [
        (("method.stages=1", "method.state=replicated"), "hap"),
        (("method.stages=1", "method.state=sharded"), "fsdp"),
        (("method.stages=2",), "pipeline"),
        (("method.stages=1", "method.state=replicated", "method.activation_checkpointing=true"), "hap"),
        (("method.stages=1", "method.state=sharded", "method.grad_accumulation=2"), "fsdp"),
    ],
)
def test_each_composition_auto_can_choose_equals_single_device_training(cfg_factory, forced, part):
    case = _check_one_step(cfg_factory, "model=bert", "method=auto", "global_batch=8", *forced)
    d = _auto(case)
    assert d["part"] == part
    chosen = d["chosen"]
    if "method.activation_checkpointing=true" in forced:
        assert chosen["checkpointing"] and case.plan.details["memory_tools"]["checkpointed_groups"]
    if "method.grad_accumulation=2" in forced:
        assert chosen["grad_accumulation"] == 2
