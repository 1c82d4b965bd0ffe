"""A user's own models for `model=custom` in the tests (models/custom.py): ones whose forward
returns the summed loss (one with batch norm, one whose loss also reads its first layer), ones that
return logits for a task adapter (one with a skip past its blocks, one with its head tied to its
embedding), and broken factories."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TinyConvNet(nn.Module):
    """Conv -> GELU -> pooled features -> LayerNorm -> classifier; forward returns the summed loss."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.norm = nn.LayerNorm(width * 4)
        self.head = nn.Linear(width * 4, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv(images))
        x = F.adaptive_avg_pool2d(x, 2).flatten(1)
        return F.cross_entropy(self.head(self.norm(x)), labels, reduction="sum")


def build(width: int = 8, classes: int = 10) -> nn.Module:
    return TinyConvNet(width, classes)


class TinyBatchNormNet(nn.Module):
    """Conv -> BatchNorm -> ReLU -> pooled features -> classifier; forward returns the summed loss."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(images)))
        return F.cross_entropy(self.head(F.adaptive_avg_pool2d(x, 1).flatten(1)), labels, reduction="sum")


def build_bn(width: int = 8, classes: int = 10) -> nn.Module:
    return TinyBatchNormNet(width, classes)


class TinyDecoder(nn.Module):
    """Embedding -> two residual MLP blocks -> logits over the vocabulary (for task=causal_lm)."""

    def __init__(self, vocab: int = 512, width: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                for _ in range(2)
            ]
        )
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def build_decoder(vocab: int = 512, width: int = 32) -> nn.Module:
    return TinyDecoder(vocab, width)


class LongSkipDecoder(TinyDecoder):
    """TinyDecoder whose head also reads the embedding's output (a skip past both blocks)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = h = self.emb(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h + x)


def build_long_skip(vocab: int = 512, width: int = 32) -> nn.Module:
    return LongSkipDecoder(vocab, width)


def build_tied_decoder(vocab: int = 512, width: int = 32) -> nn.Module:
    """TinyDecoder whose head is its embedding's weight (one tensor read at both ends)."""
    model = TinyDecoder(vocab, width)
    model.out.weight = model.emb.weight
    return model


class EarlyLoss(nn.Module):
    """Input layer -> two residual MLP blocks -> head; forward returns the summed loss of the
    head's scores and of the input layer's output (a loss term that reads the first layer)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)) for _ in range(2)]
        )
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h0 = h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.head(h), labels, reduction="sum") + F.cross_entropy(h0, labels, reduction="sum")


def build_early_loss(width: int = 16) -> nn.Module:
    return EarlyLoss(width)


def not_a_module():
    return [1, 2, 3]


class Branchy(nn.Module):
    """A forward export cannot trace: a Python branch on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:
            h = h * 2
        return F.cross_entropy(h, y, reduction="sum")


def build_branchy() -> nn.Module:
    return Branchy()
