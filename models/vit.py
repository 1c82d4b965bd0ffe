"""Vision Transformer for 32x32 CIFAR-10 images (the HAP paper's ViT benchmark sizes).

What it does: a Conv2d(3, d, 4, stride 4) patch embedding gives 8x8 = 64 patch tokens; a
learned class token is prepended (65 tokens) and a learned position embedding (1, 65, d)
added; then ``num_layers`` pre-LN transformer blocks from ``models.common`` (no attention
mask), a final LayerNorm, and Linear(d, num_classes) on the class token.
``forward(images, labels)`` returns the cross-entropy summed over the local batch.

What it doesn't do: no image-size flexibility at run time (the position embedding is used
whole, so inputs must be 32x32), no MoE variant, no pre-training heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.common import INIT_STD, FeedForward, ImageClassifierConfig, TransformerBlock, init_transformer_weights


@dataclasses.dataclass
class ViTConfig(ImageClassifierConfig):
    """Sizes of the ViT.

    Attributes:
        patch_size: side of the square patches in pixels (must divide 32).
        num_layers: transformer blocks (the planner benchmarks 4..48).
        d_model, num_heads, d_ff: block sizes.
        num_classes: number of classes (10 for CIFAR-10).
        dropout: attention/residual/embedding dropout probability.
    """

    name: ClassVar[str] = "vit"

    patch_size: int = 4
    num_layers: int = 12
    d_model: int = 768
    num_heads: int = 12
    d_ff: int = 3072
    num_classes: int = 10
    dropout: float = 0.0

    def __post_init__(self) -> None:
        self._check_positive(
            patch_size=self.patch_size,
            num_layers=self.num_layers,
            d_model=self.d_model,
            num_heads=self.num_heads,
            d_ff=self.d_ff,
            num_classes=self.num_classes,
        )
        if self.image_size % self.patch_size:
            raise ValueError(f"vit: patch_size={self.patch_size} does not divide the image size {self.image_size}")
        if self.d_model % self.num_heads:
            raise ValueError(f"vit: d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        self._check_dropout()

    @classmethod
    def _preset_values(cls, preset: str, num_devices: int) -> dict[str, dict[str, Any]]:
        return {
            "paper": {},
            "tiny": {"num_layers": 2, "d_model": 64, "num_heads": 4, "d_ff": 128},
        }

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def build(self) -> nn.Module:
        return ViT(self)


class ViT(nn.Module):
    """forward(images: (B,3,32,32) float, labels: (B,) int64) -> summed CE loss (scalar)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        d = config.d_model
        self.patch_embed = nn.Conv2d(config.in_channels, d, kernel_size=config.patch_size, stride=config.patch_size)
        self.cls = nn.Parameter(torch.empty(1, 1, d))
        self.pos_embedding = nn.Parameter(torch.empty(1, config.num_patches + 1, d))
        self.emb_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(d, config.num_heads, config.dropout, FeedForward(d, config.d_ff))
            for _ in range(config.num_layers)
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.num_classes)
        self.apply(self.init_module)

    def init_module(self, module: nn.Module) -> None:
        """The model's initialiser of `module`'s own parameters (bench.core.weights runs it one
        parameter at a time)."""
        init_transformer_weights(module)
        if module is self:
            nn.init.normal_(self.cls, mean=0.0, std=INIT_STD)
            nn.init.normal_(self.pos_embedding, mean=0.0, std=INIT_STD)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # (B,d,8,8) -> (B,64,d): one token per patch, row-major.
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.emb_dropout(x + self.pos_embedding)
        for block in self.blocks:
            x = block(x)
        # LayerNorm is per token, so normalising only the class token is equivalent and cheaper.
        logits = self.head(self.ln_f(x[:, 0]))
        return F.cross_entropy(logits, labels, reduction="sum")
