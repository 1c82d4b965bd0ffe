"""bench.core.weights: every parameter's initial value is a pure function of (seed, its name,
its module's initialiser), so any part of a model materialised alone equals that part of the
single-device model (Workload.build)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.core.weights import Weights, build_meta, build_model
from models.bert import BertConfig
from models.bert_moe import BertMoEConfig
from models.custom import CustomModelConfig
from models.vgg19 import VGG19Config
from models.vit import ViTConfig

IMAGES = [{"shape": [3, 32, 32], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 10}]


def _configs():
    yield "vgg19", VGG19Config.from_preset("tiny")
    yield "vit", ViTConfig.from_preset("tiny")
    yield "bert", BertConfig.from_preset("tiny")
    yield "bert_moe", BertMoEConfig.from_preset("tiny", num_devices=2)
    yield "custom", CustomModelConfig(factory="tests.zoo_custom:build", inputs=IMAGES)


def _hf(arch: str):
    from models.hf import HFModelConfig

    return HFModelConfig.from_preset("tiny", arch=arch)


@pytest.mark.parametrize("name,cfg", list(_configs()), ids=[n for n, _ in _configs()])
def test_every_second_parameter_materialised_alone_equals_the_single_device_model(name, cfg):
    full = build_model(cfg, seed=7)
    part = build_meta(cfg, seed=7)
    names = [n for n, _ in part.named_parameters()]
    mine = nn.ParameterList([part.get_parameter(n) for n in names[1::2]])  # their own objects
    Weights(part, 7, cfg).materialize(mine)
    for n, p in part.named_parameters():
        if n in names[1::2]:
            assert torch.equal(p, full.get_parameter(n)), n
        else:
            assert p.is_meta, n
    for (n, a), b in zip(part.named_buffers(), full.buffers()):
        assert torch.equal(a, b), n
    assert all(torch.isfinite(p).all() for p in full.parameters())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_hugging_face_model_part_equals_the_whole_with_its_init_weights_and_tied_head(arch):
    cfg = _hf(arch)
    full = build_model(cfg, seed=3)
    part = build_meta(cfg, seed=3)
    weights = Weights(part, 3, cfg)
    tail = [p for _, p in list(part.named_parameters())[-3:]]
    weights.materialize(nn.ParameterList(tail))
    for n, p in list(part.named_parameters())[-3:]:
        assert torch.equal(p, full.get_parameter(n)), n
    # transformers' _init_weights: Linear and Embedding weights N(0, initializer_range), not torch's default
    linear = next(m for m in full.modules() if isinstance(m, nn.Linear))
    assert linear.weight.std().item() == pytest.approx(cfg.hf_config().initializer_range, rel=0.2)
    if arch == "gpt2":  # the tied head is the embedding, one tensor
        tied = dict(full.named_parameters(remove_duplicate=False))
        assert len(tied) > len(dict(full.named_parameters()))


@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_a_hugging_face_model_starts_as_transformers_initialises_it_parents_last(arch):
    """transformers initialises a module's children before it, and T5's attention, feed-forward
    and model set their children's weights (q with std (d_model * d_kv)**-0.5, not a Linear's
    own std 1): every parameter has the spread and mean of the model transformers builds, and a
    part materialised alone still equals the whole."""
    cfg = _hf(arch)
    torch.manual_seed(0)
    theirs = dict(cfg.build().named_parameters())
    ours = build_model(cfg, seed=0)
    for n, p in ours.named_parameters():
        ref = theirs[n]
        spread = max(ref.std().item(), 1e-3)
        assert p.std().item() == pytest.approx(ref.std().item(), rel=0.25, abs=1e-6), n
        assert abs(p.mean().item() - ref.mean().item()) < 0.25 * spread, n
    part = build_meta(cfg, seed=0)
    names = [n for n, _ in part.named_parameters()][::3]
    Weights(part, 0, cfg).materialize(nn.ParameterList([part.get_parameter(n) for n in names]))
    for n in names:
        assert torch.equal(part.get_parameter(n), ours.get_parameter(n)), n


def test_a_value_depends_on_the_seed_and_the_name_not_on_what_else_is_materialised():
    cfg = BertConfig.from_preset("tiny")
    meta = build_meta(cfg, 0)
    a = Weights(meta, 0).value("blocks.1.attn.query.weight")
    other = build_meta(cfg, 0)
    torch.manual_seed(123)  # the global generator plays no part, and is left as it was
    state = torch.get_rng_state()
    assert torch.equal(Weights(other, 0).value("blocks.1.attn.query.weight"), a)
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(Weights(meta, 1).value("blocks.1.attn.query.weight"), a)
    assert not torch.equal(Weights(meta, 0).value("blocks.0.attn.query.weight"), a)


def test_build_meta_holds_no_parameter_storage_and_leaves_torch_seeded():
    cfg = BertConfig.from_preset("tiny")
    model = build_meta(cfg, 5)
    after_build = torch.get_rng_state()
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # the causal mask, as the constructor made it
    build_model(cfg, 5)
    assert torch.equal(torch.get_rng_state(), after_build)


class _RawParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x * self.scale)


class _RawConfig:
    def build(self):
        return _RawParameter()


def test_a_parameter_no_initialiser_sets_takes_its_constructors_value():
    full = build_model(_RawConfig(), seed=2)
    torch.manual_seed(2)
    assert torch.equal(full.scale, _RawParameter().scale)
    with pytest.raises(ValueError, match="parameter scale of _RawParameter is set by no initialiser"):
        Weights(build_meta(_RawConfig(), 2), 2).value("scale")
