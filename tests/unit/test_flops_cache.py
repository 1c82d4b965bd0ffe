"""Model FLOPs are counted once per config and kept on disk; a kept count that cannot be read is
counted again, and one from other versions is never found."""

import importlib.metadata

import pytest

from bench.cost import flops
from models.bert import BertConfig


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("HETBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "_counted", {})
    return tmp_path


def _counts(monkeypatch) -> list[int]:
    """Counts FlopCounterMode runs from here on."""
    runs = []
    real = flops.FlopCounterMode

    def counting(*a, **k):
        runs.append(1)
        return real(*a, **k)

    monkeypatch.setattr(flops, "FlopCounterMode", counting)
    return runs


def test_a_count_is_kept_and_read_back_in_a_later_process(fresh, monkeypatch):
    cfg = BertConfig.from_preset("tiny")
    runs = _counts(monkeypatch)
    first = flops.train_flops_per_sample(cfg)
    (kept,) = (fresh / "flops").glob("*.json")
    monkeypatch.setattr(flops, "_counted", {})  # a new process
    assert flops.train_flops_per_sample(cfg) == first and len(runs) == 1
    assert kept.exists()


@pytest.mark.parametrize("damage", ["", "{not json", '{"flops_per_sample": "many"}', '{"flops_per_sample": -1}'])
def test_a_damaged_count_is_counted_again_and_rewritten(fresh, monkeypatch, damage):
    cfg = BertConfig.from_preset("tiny")
    first = flops.train_flops_per_sample(cfg)
    (kept,) = (fresh / "flops").glob("*.json")
    kept.write_text(damage)
    monkeypatch.setattr(flops, "_counted", {})
    runs = _counts(monkeypatch)
    assert flops.train_flops_per_sample(cfg) == first and len(runs) == 1
    assert flops._load(kept) == first


def test_another_torch_or_config_is_another_entry(fresh, monkeypatch):
    cfg = BertConfig.from_preset("tiny")
    path = flops._flops_file(cfg, 2)
    assert flops._flops_file(BertConfig.from_preset("paper"), 2) != path
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.0" if d == "torch" else real(d))
    assert flops._flops_file(cfg, 2) != path
    monkeypatch.setenv("HETBENCH_FLOPS_CACHE", "0")
    assert flops._flops_file(cfg, 2) is None


def test_a_loss_without_a_gradient_is_one_line_naming_the_cause(fresh, monkeypatch):
    """A forward that trains part of the model by a custom autograd.Function under no_grad
    (reversible layers) loses that backward in torch.export: its meta loss has no gradient."""
    import torch

    cfg = BertConfig.from_preset("tiny")
    real_build = flops.build_on_meta

    def no_grad_loss(model_cfg):
        model = real_build(model_cfg)
        return lambda *batch: model(*batch).detach()

    monkeypatch.setattr(flops, "build_on_meta", no_grad_loss)
    monkeypatch.setenv("HETBENCH_FLOPS_CACHE", "0")
    with pytest.raises(ValueError) as err:
        flops.train_flops_per_sample(cfg)
    msg = str(err.value)
    assert "\n" not in msg and "has no gradient" in msg and "custom autograd.Function" in msg
    assert torch.is_grad_enabled()
