"""VGG-19 (configuration "E", no batch norm) for 32x32 CIFAR-10 images.

What it does: 16 3x3 convolutions (padding 1, ReLU) in five stages separated by 2x2 max
pools, so a 32x32 image reaches 1x1; ``AdaptiveAvgPool2d((7, 7))`` then replicates that
map to 7x7 (512*49 = 25088 features, as in the HAP authors' benchmark), followed by the
classifier Linear(25088, 4096)-ReLU-Dropout-Linear(4096, 4096)-ReLU-Dropout-Linear(4096, 10).
``forward(images, labels)`` returns the cross-entropy summed over the local batch.

What it doesn't do: no batch norm (its batch statistics would couple samples and break the
exact summation of per-shard losses), no data augmentation, no torchvision.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.common import ImageClassifierConfig

# Configuration E of Simonyan & Zisserman: output channels per conv, "M" = 2x2 max pool.
VGG19_E_WIDTHS: tuple[int | str, ...] = (
    64,
    64,
    "M",
    128,
    128,
    "M",
    256,
    256,
    256,
    256,
    "M",
    512,
    512,
    512,
    512,
    "M",
    512,
    512,
    512,
    512,
    "M",
)

# Side of the feature map the classifier sees (AdaptiveAvgPool2d output).
POOL_SIZE = 7


def _normalise_widths(widths: Any) -> tuple[int | str, ...]:
    """Accepts "M" or -1 as the pooling marker and positive ints as conv widths."""
    out: list[int | str] = []
    for item in widths:
        if item == "M" or item == -1:
            out.append("M")
        elif isinstance(item, int) and not isinstance(item, bool) and item > 0:
            out.append(item)
        else:
            raise ValueError(f"vgg19: widths entry {item!r} must be a positive int, 'M' or -1")
    if not any(isinstance(item, int) for item in out):
        raise ValueError("vgg19: widths has no convolution")
    return tuple(out)


@dataclasses.dataclass
class VGG19Config(ImageClassifierConfig):
    """Sizes of the VGG model.

    Attributes:
        widths: conv output channels in order, "M" (or -1) for a 2x2 max pool.
        hidden: width of the two hidden classifier layers.
        num_classes: number of classes (10 for CIFAR-10).
        dropout: dropout probability after each hidden classifier layer.
    """

    name: ClassVar[str] = "vgg19"

    widths: tuple[int | str, ...] = VGG19_E_WIDTHS
    hidden: int = 4096
    num_classes: int = 10
    dropout: float = 0.0

    def __post_init__(self) -> None:
        self.widths = _normalise_widths(self.widths)
        self._check_positive(hidden=self.hidden, num_classes=self.num_classes)
        self._check_dropout()
        pools = sum(1 for item in self.widths if item == "M")
        if self.image_size >> pools < 1:
            raise ValueError(f"vgg19: {pools} max pools shrink a {self.image_size}x{self.image_size} image to nothing")

    @classmethod
    def _preset_values(cls, preset: str, num_devices: int) -> dict[str, dict[str, Any]]:
        return {
            "paper": {},
            # Widths / 4 with fewer convs per stage (7 instead of 16); five pools so 32x32
            # still reaches 1x1. Forward+backward at batch 8 on one thread stays well under
            # 100 ms (tests/unit/test_models.py).
            "tiny": {
                "widths": (16, "M", 32, "M", 64, 64, "M", 128, 128, "M", 128, 128, "M"),
                "hidden": 128,
            },
        }

    def build(self) -> nn.Module:
        return VGG(self.widths, self.hidden, self.num_classes, self.dropout, self.in_channels)


class VGG(nn.Module):
    """VGG network; forward(images: (B,C,H,W) float, labels: (B,) int64) -> summed CE loss."""

    def __init__(
        self, widths: tuple[int | str, ...], hidden: int, num_classes: int, dropout: float, in_channels: int = 3
    ):
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for item in widths:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers.append(nn.Conv2d(channels, item, kernel_size=3, padding=1))
                layers.append(nn.ReLU())
                channels = item
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((POOL_SIZE, POOL_SIZE))
        self.classifier = nn.Sequential(
            nn.Linear(channels * POOL_SIZE * POOL_SIZE, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )
        self.apply(self.init_module)

    def init_module(self, module: nn.Module) -> None:
        """The model's initialiser of `module`'s own parameters (bench.core.weights runs it one
        parameter at a time): He init for the ReLU convs (fan_out, as torchvision's VGG), a small
        normal for Linear."""
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.01)
            nn.init.zeros_(module.bias)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(images))
        logits = self.classifier(torch.flatten(x, 1))
        return F.cross_entropy(logits, labels, reduction="sum")
