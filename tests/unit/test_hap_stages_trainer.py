"""What `HapStagesTrainer` (methods/auto/hap_stages_runtime.py) refuses before it makes a process
group, and the samples it asks the runner for (`rank_batches`). The training itself:
tests/e2e/test_hap_stage_pipeline.py."""

from __future__ import annotations

import functools

import pytest
import torch

from bench.core.interfaces import Plan, RankContext, Workload
from bench.runtime.emulation import Emulator
from methods.auto.hap_stages import rank_batches
from methods.auto.hap_stages_runtime import HapStagesTrainer, stage_graphs
from models.custom import CustomModelConfig
from tests.e2e.test_hap_equivalence import make_cluster


@functools.cache
def _workload(factory: str) -> Workload:
    """A tiny model of tests/zoo_custom.py (4 layer groups: the first layer, 2 blocks, the head),
    global batch 8: a decoder, or `build_early_loss` (its loss computed in its forward)."""
    if factory == "build_early_loss":
        inputs = [{"shape": [16], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 16}]
        cfg = CustomModelConfig.from_preset("tiny", factory=f"tests.zoo_custom:{factory}", inputs=inputs)
    else:
        cfg = CustomModelConfig.from_preset("tiny", factory=f"tests.zoo_custom:{factory}", task="causal_lm", seq_len=8)
    return Workload("custom", "tiny", cfg, 8, 1.0)


def _plan(cuts_, **changes) -> Plan:
    """One rank a stage, 2 micro-batches of 4 (every rank loads the global batch); of the stages'
    own plans only their ratio row and granularity are read here."""
    S = len(cuts_) - 1
    hs = {
        "cuts": list(cuts_),
        "groups": [[s] for s in range(S)],
        "batch_shares": [4],
        "micro_batch": 4,
        "num_micro_batches": 2,
        "schedule": "1F1B",
        "stages": [{"ratios": [[1.0]], "granularity": "gpu"} for _ in range(S)],
        **changes,
    }
    world = sum(len(g) for g in hs["groups"])
    return Plan("auto", [4] * world, {"hap_stages": hs}, data_slices=[(0, 8)] * world)


def _trainer(factory: str, plan: Plan) -> HapStagesTrainer:
    workload = _workload(factory)
    world = len(plan.details["hap_stages"]["groups"]) * len(plan.details["hap_stages"]["groups"][0])
    cluster = make_cluster(world)
    ctx = RankContext(0, world, torch.device("cpu"), cluster, workload, Emulator(cluster, 0, enabled=False))
    return HapStagesTrainer(plan, workload.build(0), ctx)


def test_a_stage_reading_a_tensor_made_two_stages_before_it_is_refused():
    """The head reads the embedding's output: cut between the two blocks too, stage 2 would read
    what stage 0 made, which stage 1 does not hand on. Cut once, it is stage 0's output."""
    with pytest.raises(ValueError, match=r"stage 2 \(layer groups \[2, 4\)\) reads embedding \(layer group 0\)"):
        _trainer("build_long_skip", _plan([0, 1, 2, 4], schedule="GPipe"))
    _, _, stages = stage_graphs(_workload("build_long_skip").model_cfg, _plan([0, 2, 4]).details["hap_stages"])
    assert "embedding" in stages[0].crossing_out and "embedding" in stages[1].crossing_in


def test_a_loss_reading_a_tensor_the_last_stage_does_not_make_is_refused():
    """A loss term reads the first layer's output: the pipeline's loss function gets only the
    last stage's outputs."""
    with pytest.raises(ValueError, match=r"the loss reads linear \(layer group 0\), which the last stage"):
        _trainer("build_early_loss", _plan([0, 2, 4]))


def test_a_parameter_two_stages_read_is_refused():
    """The head's weight is the embedding's: any cut puts its readers in two stages."""
    with pytest.raises(
        ValueError, match=r"tied parameter is read by several stages \(m.out.weight by stages \[0, 1\]\)"
    ):
        _trainer("build_tied_decoder", _plan([0, 2, 4]))


@pytest.mark.parametrize(
    "changes,data_slices,message",
    [
        ({}, None, r"plan.data_slices=None must be each rank's samples of this plan, \[\(0, 8\), \(0, 8\)\]"),
        ({}, [(0, 4), (4, 8)], r"plan.data_slices=\[\(0, 4\), \(4, 8\)\] must be"),
        ({"groups": [[0], [0]]}, "keep", r"\['groups'\]=\[\[0\], \[0\]\] must give every stage"),
        ({"groups": [[0]], "cuts": [0, 4]}, "keep", r"holds 1 stage; a pipeline of hap stages has 2 or more"),
        ({"batch_shares": [3]}, "keep", r"\['batch_shares'\]=\[3\] must give"),
        ({"cuts": [0, 2, 3]}, "keep", r"\['cuts'\]=\[0, 2, 3\] must end at the model's 4 layer groups"),
        ({"num_micro_batches": 3}, "keep", r"num_micro_batches=3 x micro_batch=4 is not the global batch 8"),
        ({"schedule": "Interleaved1F1B"}, "keep", r"\['schedule'\]='Interleaved1F1B' runs several stages a rank"),
        ({"schedule": "2F2B"}, "keep", r"\['schedule'\]='2F2B': Unknown schedule name"),
        ({"num_micro_batches": 1}, "keep", r"\['num_micro_batches'\]=1: 1F1B needs one micro-batch a stage"),
        ({"stages": [{"ratios": [[1.0]]}, {"ratios": [[0.5]]}]}, "keep", r"their 'ratios' .* must be one row"),
        ({"stages": [{"ratios": [[1.0]], "granularity": "machine"}] * 2}, "keep", r"granularity \['machine'\]"),
    ],
    ids=[
        "no-slices",
        "other-slices",
        "a-rank-twice",
        "one-stage",
        "shares",
        "cuts",
        "batch",
        "several-stages-a-rank",
        "unknown-schedule",
        "too-few-micro-batches",
        "rows",
        "machine-level",
    ],
)
def test_a_malformed_plan_of_hap_stages_is_refused_in_one_line(changes, data_slices, message):
    plan = _plan([0, 2, 4], **changes)
    if data_slices != "keep":
        plan.data_slices = data_slices
    with pytest.raises(ValueError, match=message):
        _trainer("build_decoder", plan)


def test_every_rank_of_a_pipeline_loads_its_share_of_every_micro_batch_in_one_run():
    """Pipeline i (rank i of each group, the groups' ranks in any order) loads m x its share,
    the pipelines' runs one after another; a rank's batch share is what it loads."""
    hs = {"groups": [[1, 0], [5, 3], [2, 4]], "batch_shares": [1, 3], "num_micro_batches": 3}
    shares, slices = rank_batches(hs)
    assert shares == [9, 3, 3, 9, 9, 3]
    assert slices == [(3, 12), (0, 3), (0, 3), (3, 12), (3, 12), (0, 3)]
