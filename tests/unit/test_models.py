"""Unit tests of the model zoo: tracing, summed-loss additivity, gradients, speed of the
tiny presets, parameter counts of the paper presets, MoE routing and the config API."""

from __future__ import annotations

import math
import re
import statistics
import time

import pytest
import torch
import torch.fx

from models.bert import BertConfig
from models.bert_moe import BertMoEConfig, MoE, moe_capacity, replace_moe_layers
from models.common import FeedForward, TransformerBlock
from models.vgg19 import VGG19_E_WIDTHS, VGG19Config
from models.vit import ViTConfig

CONFIGS = [VGG19Config, ViTConfig, BertConfig, BertMoEConfig]
IDS = [c.name for c in CONFIGS]


def _tiny(config_cls, **overrides):
    cfg = config_cls.from_preset("tiny", **overrides)
    torch.manual_seed(0)
    return cfg, cfg.build()


def _batch(cfg, size, seed=0):
    return cfg.synthetic_batch(size, torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- tiny presets


@pytest.mark.parametrize("config_cls", CONFIGS, ids=IDS)
def test_tiny_traces_and_matches_eager(config_cls):
    cfg, model = _tiny(config_cls)
    graph_module = torch.fx.symbolic_trace(model)
    batch = _batch(cfg, 4)
    loss = model(*batch)
    assert loss.dim() == 0
    torch.testing.assert_close(graph_module(*batch), loss)


@pytest.mark.parametrize("config_cls", CONFIGS, ids=IDS)
def test_loss_of_concatenation_is_sum_of_halves(config_cls):
    # Uneven halves: checks that samples do not interact (MoE routing included).
    cfg, model = _tiny(config_cls)
    batch = _batch(cfg, 8)
    with torch.no_grad():
        full = model(*batch)
        first = model(*(t[:3] for t in batch))
        second = model(*(t[3:] for t in batch))
    torch.testing.assert_close(first + second, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config_cls", CONFIGS, ids=IDS)
def test_backward_gives_finite_grads_for_every_parameter(config_cls):
    cfg, model = _tiny(config_cls)
    model(*_batch(cfg, 4)).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("config_cls", CONFIGS, ids=IDS)
def test_empty_batch(config_cls):
    cfg, model = _tiny(config_cls)
    batch = _batch(cfg, 0)
    assert all(t.shape[0] == 0 for t in batch)
    loss = model(*batch)
    assert loss.dim() == 0 and loss.item() == 0.0
    loss.backward()


@pytest.mark.parametrize("config_cls", CONFIGS, ids=IDS)
def test_tiny_forward_backward_is_fast(config_cls):
    cfg, model = _tiny(config_cls)
    batch = _batch(cfg, 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model(*batch).backward()  # warm-up
        times = []
        for _ in range(5):
            start = time.perf_counter()
            model(*batch).backward()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    assert statistics.median(times) < 0.1


@pytest.mark.parametrize("config_cls", CONFIGS, ids=IDS)
def test_same_seed_same_parameters(config_cls):
    _, a = _tiny(config_cls)
    _, b = _tiny(config_cls)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_transformer_init_is_realistic():
    _, model = _tiny(BertConfig, d_model=256, d_ff=512, num_heads=4)
    block = model.blocks[0]
    assert abs(block.ffn.fc1.weight.std().item() - 0.02) < 0.002
    assert torch.equal(block.ffn.fc1.bias, torch.zeros_like(block.ffn.fc1.bias))
    assert torch.equal(block.ln1.weight, torch.ones_like(block.ln1.weight))
    assert abs(model.tok_embedding.weight.std().item() - 0.02) < 0.002


def test_causal_mask_blocks_the_future():
    # Changing the last input token must not change the loss terms of earlier positions.
    cfg, model = _tiny(BertConfig)
    tokens, targets = _batch(cfg, 1)
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % cfg.vocab_size
    mask = model.causal_mask
    assert mask.shape == (cfg.seq_len, cfg.seq_len)
    assert "causal_mask" not in model.state_dict()
    with torch.no_grad():
        # Loss of all but the last position: zero the last target's weight via ignore_index.
        cut = targets.clone()
        cut[0, -1] = -100
        assert torch.equal(model(tokens, cut), model(changed, cut))
        assert not torch.equal(model(tokens, targets), model(changed, targets))


# ---------------------------------------------------------------- paper presets


def _linear(fan_in, fan_out, bias=True):
    return fan_in * fan_out + (fan_out if bias else 0)


def _block(d, ffn_params):
    # Two LayerNorms (weight + bias), q/k/v/out projections with bias, then the FFN.
    return 2 * 2 * d + 4 * _linear(d, d) + ffn_params


def _dense_ffn(d, d_ff):
    return _linear(d, d_ff) + _linear(d_ff, d)


def _moe_ffn(d, d_ff, experts):
    return _linear(d, experts, bias=False) + experts * (d * d_ff + d_ff + d_ff * d + d)


def _meta_build(cfg):
    with torch.device("meta"):
        model = cfg.build()
    torch.fx.symbolic_trace(model)
    return sum(p.numel() for p in model.parameters())


def test_paper_vgg19_parameter_count():
    cfg = VGG19Config.from_preset("paper")
    assert cfg.widths == VGG19_E_WIDTHS and cfg.hidden == 4096 and cfg.num_classes == 10
    expected, channels = 0, 3
    for width in VGG19_E_WIDTHS:
        if width != "M":
            expected += channels * width * 9 + width
            channels = width
    expected += _linear(512 * 7 * 7, 4096) + _linear(4096, 4096) + _linear(4096, 10)
    # torchvision's vgg19 has 143,667,240 parameters with 1000 classes; 10 classes -> 139.6M.
    assert expected == 143_667_240 - _linear(4096, 1000) + _linear(4096, 10)
    assert _meta_build(cfg) == expected


def test_paper_vit_parameter_count():
    cfg = ViTConfig.from_preset("paper")
    d, ff = 768, 3072
    expected = (
        _linear(3 * 4 * 4, d)  # patch embedding conv
        + d  # class token
        + 65 * d  # position embedding
        + 12 * _block(d, _dense_ffn(d, ff))
        + 2 * d  # final LayerNorm
        + _linear(d, 10)
    )
    assert 85e6 < expected < 86e6  # the 85M of a ViT-Base body
    assert _meta_build(cfg) == expected


def test_vit_num_layers_overridable():
    cfg = ViTConfig.from_preset("paper", num_layers=48)
    with torch.device("meta"):
        assert len(cfg.build().blocks) == 48


def _lm_embeddings_and_head(vocab, seq_len, d):
    return vocab * d + seq_len * d + 2 * d + _linear(d, vocab)


def test_paper_bert_parameter_count():
    cfg = BertConfig.from_preset("paper")
    assert (cfg.vocab_size, cfg.seq_len, cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.d_ff) == (
        33280,
        128,
        12,
        768,
        12,
        3072,
    )
    d = 768
    body = 12 * _block(d, _dense_ffn(d, 3072))
    assert 84e6 < body < 86e6  # BERT-Base encoder body
    expected = body + _lm_embeddings_and_head(33280, 128, d)
    assert _meta_build(cfg) == expected


def test_paper_bert_moe_parameter_count():
    cfg = BertMoEConfig.from_preset("paper", num_devices=8)
    assert cfg.num_experts == 16 and cfg.capacity == 20
    d, ff = 768, 3072
    expected = (
        6 * _block(d, _dense_ffn(d, ff)) + 6 * _block(d, _moe_ffn(d, ff, 16)) + _lm_embeddings_and_head(33280, 128, d)
    )
    assert _meta_build(cfg) == expected


# ---------------------------------------------------------------- MoE


def _moe_layers(model):
    return [m for m in model.modules() if isinstance(m, MoE)]


@pytest.mark.parametrize("num_devices", [1, 3])
def test_moe_experts_per_device(num_devices):
    cfg, model = _tiny(BertMoEConfig, num_layers=4, num_devices=num_devices)
    assert cfg.num_experts == 2 * num_devices
    assert cfg.moe_layer_indices == (1, 3)
    for index, block in enumerate(model.blocks):
        assert isinstance(block.ffn, MoE) == (index % 2 == 1)
    for layer in _moe_layers(model):
        assert layer.num_experts == 2 * num_devices
        assert layer.w1.shape == (2 * num_devices, cfg.d_model, cfg.d_ff)
        assert layer.capacity == cfg.capacity


def test_moe_capacity_formula():
    assert moe_capacity(128, 16, 2.5) == 20  # the HAP authors' value
    assert moe_capacity(128, 2, 2.5) == 128  # capped at seq_len
    assert moe_capacity(64, 8, 1.0) == 8


def test_replace_moe_layers():
    cfg, model = _tiny(BertMoEConfig, num_layers=4)
    replaced = replace_moe_layers(model, lambda moe: FeedForward(cfg.d_model, cfg.d_ff))
    assert replaced == cfg.num_layers // 2
    assert not _moe_layers(model)
    loss = torch.fx.symbolic_trace(model)(*_batch(cfg, 2))
    assert torch.isfinite(loss)
    assert replace_moe_layers(model, lambda moe: moe) == 0


def _expert(moe, e, x):
    hidden = moe.act(x @ moe.w1[e] + moe.b1[e])
    return hidden @ moe.w2[e] + moe.b2[e]


def test_moe_matches_per_token_reference_without_drops():
    torch.manual_seed(0)
    seq_len, d = 6, 8
    moe = MoE(d, 16, num_experts=4, capacity=seq_len)
    x = torch.randn(2, seq_len, d)
    with torch.no_grad():
        out = moe(x)
        probs = torch.softmax(moe.gate(x), dim=-1)
        expected = torch.zeros_like(x)
        for b in range(2):
            for s in range(seq_len):
                gates, experts = probs[b, s].topk(2)
                for g, e in zip(gates, experts):
                    expected[b, s] += g * _expert(moe, int(e), x[b, s])
    torch.testing.assert_close(out, expected)


def test_moe_capacity_drops_over_capacity_tokens():
    # Every token's first choice is expert 0 and its second expert 1 (only 2 experts), so
    # each expert receives all seq_len tokens; only the first `capacity` fit.
    torch.manual_seed(0)
    seq_len, d, capacity = 10, 8, 4
    moe = MoE(d, 16, num_experts=2, capacity=capacity)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0].fill_(1.0)
        moe.b2.normal_()  # so a kept token's expert output is surely non-zero
    x = torch.ones(2, seq_len, d) + 0.01 * torch.randn(2, seq_len, d)
    with torch.no_grad():
        dispatch, _ = moe.routing(x)
        out = moe(x)
    # Slots 0..capacity-1 of both experts are used, each exactly once.
    assert torch.equal(dispatch.sum(dim=1), torch.ones(2, 2, capacity))
    assert torch.equal(out[:, capacity:], torch.zeros(2, seq_len - capacity, d))
    assert (out[:, :capacity].abs().sum(dim=-1) > 0).all()
    # Kept tokens get p0 * expert0 + p1 * expert1.
    probs = torch.softmax(moe.gate(x), dim=-1)
    with torch.no_grad():
        kept = probs[..., :1] * _expert(moe, 0, x) + probs[..., 1:] * _expert(moe, 1, x)
    torch.testing.assert_close(out[:, :capacity], kept[:, :capacity])


def test_moe_traces_alone_and_handles_empty_batch():
    moe = MoE(8, 16, num_experts=4, capacity=3)
    graph_module = torch.fx.symbolic_trace(moe)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(graph_module(x), moe(x))
    assert moe(torch.randn(0, 5, 8)).shape == (0, 5, 8)


def test_block_holds_ffn_attribute():
    block = TransformerBlock(16, 2, 0.0, FeedForward(16, 32))
    assert isinstance(block.ffn, FeedForward)


# ---------------------------------------------------------------- config API


def test_unknown_preset_message():
    with pytest.raises(ValueError, match=re.escape("preset='x' is unknown for model bert; known: paper, tiny")):
        BertConfig.from_preset("x")


@pytest.mark.parametrize("config_cls", CONFIGS, ids=IDS)
def test_unknown_override_names_key_and_fields(config_cls):
    with pytest.raises(ValueError) as info:
        config_cls.from_preset("tiny", no_such_field=1)
    message = str(info.value)
    assert "'no_such_field'" in message and "dropout" in message


def test_invalid_values_rejected():
    with pytest.raises(ValueError, match="num_heads"):
        BertConfig.from_preset("tiny", num_heads=5)
    with pytest.raises(ValueError, match="widths"):
        VGG19Config.from_preset("tiny", widths=(16, "X"))
    with pytest.raises(ValueError, match="num_devices"):
        BertMoEConfig.from_preset("tiny", num_devices=0)


def test_vgg_widths_accept_minus_one_marker():
    cfg = VGG19Config.from_preset("tiny", widths=[8, -1, 8, -1, 8, -1, 8, -1, 8, -1])
    assert cfg.widths == (8, "M", 8, "M", 8, "M", 8, "M", 8, "M")


def test_config_properties():
    assert [c.name for c in CONFIGS] == ["vgg19", "vit", "bert", "bert_moe"]
    for cls in (VGG19Config, ViTConfig):
        cfg = cls.from_preset("tiny")
        assert cfg.targets_per_sample == 1 and cfg.tokens_per_sample is None
        assert cfg.dropout == 0.0
    for cls in (BertConfig, BertMoEConfig):
        cfg = cls.from_preset("tiny", dropout=0.1)
        assert cfg.targets_per_sample == cfg.seq_len == cfg.tokens_per_sample
        assert cfg.dropout == 0.1


@pytest.mark.parametrize("config_cls", CONFIGS, ids=IDS)
def test_synthetic_batch_shapes(config_cls):
    cfg = config_cls.from_preset("tiny")
    inputs, targets = _batch(cfg, 5)
    if cfg.tokens_per_sample is None:
        assert inputs.shape == (5, 3, 32, 32) and inputs.dtype == torch.float32
        assert targets.shape == (5,) and targets.dtype == torch.int64
        assert targets.max() < cfg.num_classes
    else:
        assert inputs.shape == targets.shape == (5, cfg.seq_len)
        assert inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        assert inputs.max() < cfg.vocab_size


@pytest.mark.parametrize("config_cls", CONFIGS, ids=IDS)
def test_synthetic_dataset_determinism_and_rank_slices(config_cls):
    cfg = config_cls.from_preset("tiny")
    a = cfg.dataset("synthetic", None, "train", seed=7)
    b = cfg.dataset("synthetic", None, "train", seed=7)
    full = a.batch(3, 0, 8, 8)
    for x, y in zip(full, b.batch(3, 0, 8, 8)):
        assert torch.equal(x, y)
    head, tail = a.batch(3, 0, 3, 8), b.batch(3, 3, 8, 8)
    for x, h, t in zip(full, head, tail):
        assert torch.equal(torch.cat([h, t]), x)
    assert not torch.equal(a.batch(4, 0, 8, 8)[0], full[0])
    assert not torch.equal(cfg.dataset("synthetic", None, "train", seed=8).batch(3, 0, 8, 8)[0], full[0])
    assert all(t.shape[0] == 0 for t in a.batch(3, 8, 8, 8))
    with pytest.raises(ValueError):
        a.batch(3, 5, 9, 8)


@pytest.mark.parametrize(
    "config_cls,source,valid",
    [
        (VGG19Config, "wikitext2", "cifar10"),
        (ViTConfig, "imagenet", "cifar10"),
        (BertConfig, "cifar10", "wikitext2"),
        (BertMoEConfig, "cifar10", "wikitext2"),
    ],
)
def test_mismatched_data_source(config_cls, source, valid):
    cfg = config_cls.from_preset("tiny")
    with pytest.raises(ValueError) as info:
        cfg.dataset(source, "/nonexistent", "train", 0)
    message = str(info.value)
    assert "data.source" in message and repr(source) in message
    assert "synthetic" in message and valid in message


def test_real_source_needs_path():
    with pytest.raises(ValueError, match="data.path"):
        BertConfig.from_preset("tiny").dataset("wikitext2", None, "train", 0)


@pytest.mark.parametrize("config_cls", CONFIGS, ids=IDS)
def test_initial_loss_is_near_uniform_prediction(config_cls):
    # With the realistic init the logits are small, so each summed term is close to ln(classes).
    cfg, model = _tiny(config_cls)
    with torch.no_grad():
        loss = model(*_batch(cfg, 2))
    classes = cfg.num_classes if cfg.tokens_per_sample is None else cfg.vocab_size
    assert abs(loss.item() / (2 * cfg.targets_per_sample) - math.log(classes)) < 0.5


def test_an_expert_taken_out_of_the_moe_computes_what_it_computes_inside():
    import torch

    from models.bert_moe import BertMoEConfig, MoE

    torch.manual_seed(0)
    model = BertMoEConfig.from_preset("tiny", num_devices=2).build()
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    x = torch.randn(5, moe.w1.shape[1])
    inside = torch.nn.functional.gelu(x @ moe.w1[3] + moe.b1[3]) @ moe.w2[3] + moe.b2[3]
    torch.testing.assert_close(moe.expert(3)(x), inside)
