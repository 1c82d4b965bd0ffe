"""Building blocks and the config base class shared by every model in the zoo.

What it does:
  * ``ModelConfig``: the base of every model config (presets, override checks, the
    synthetic data source and the ``data.source`` dispatch). Subclasses are dataclasses.
  * ``ImageClassifierConfig`` / ``LanguageModelConfig``: the input conventions of the two
    model families (CIFAR-sized images with a class label; token windows with next-token
    targets) and the real-data source that belongs to each family.
  * ``SelfAttention``, ``FeedForward``, ``TransformerBlock`` and ``TransformerLM``: one
    hand-written pre-LN transformer implementation reused by vit, bert and bert_moe.
  * ``init_transformer_weights``: the initialisation used by all transformer models.

What it doesn't do:
  * No built-in torch attention layers (``nn.MultiheadAttention``, SDPA): attention is
    written with Linear, unflatten, transpose, matmul and softmax so that
    ``torch.fx.symbolic_trace`` with the default tracer sees every operation.
  * No Python control flow on tensor shapes, so every model traces to one static graph.
  * No data downloads; real data is read by ``models.data``.

Every model computes its loss inside ``forward`` with ``reduction='sum'`` over the local
batch, so the losses of batch shards add up to the loss of the whole batch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.data import Cifar10, SyntheticDataset, WikiText2

# Standard deviation of the normal initialisation of transformer weights (BERT / GPT-2 value).
INIT_STD = 0.02


class ModelConfig:
    """Base class of the model configs (each subclass is a ``@dataclass``).

    Subclasses set ``name`` and ``real_sources`` and implement ``_preset_values``,
    ``build``, ``targets_per_sample``, ``tokens_per_sample``, ``synthetic_batch`` and
    ``_real_dataset``.
    """

    name: ClassVar[str] = ""
    # Real-data sources this model accepts besides "synthetic".
    real_sources: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _preset_values(cls, preset: str, num_devices: int) -> dict[str, dict[str, Any]]:
        """Returns {preset name: field values} (fields not named keep their defaults)."""
        raise NotImplementedError

    @classmethod
    def from_preset(cls, preset: str, num_devices: int = 1, **overrides: Any):
        """Returns the config of a named preset with some fields overridden.

        Args:
            preset: "paper" (the sizes of the HAP paper) or "tiny" (a fast test model).
            num_devices: number of devices of the run; only models whose size depends on it
                (bert_moe: experts per device) use it.
            **overrides: field name -> value, applied after the preset.

        Raises:
            ValueError: unknown preset, unknown override key, or invalid values.
        """
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
            raise ValueError(f"num_devices={num_devices!r} must be an int >= 1")
        presets = cls._preset_values(preset, num_devices)
        if preset not in presets:
            known = ", ".join(sorted(presets))
            raise ValueError(f"preset={preset!r} is unknown for model {cls.name}; known: {known}")
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in overrides:
            if key not in valid:
                raise ValueError(
                    f"override {key!r} is not a field of {cls.__name__} (model {cls.name}); "
                    f"valid fields: {', '.join(valid)}"
                )
        return cls(**{**presets[preset], **overrides})

    def build(self) -> nn.Module:
        """Builds the model; the caller seeds torch first (same seed -> same parameters)."""
        raise NotImplementedError

    @property
    def targets_per_sample(self) -> int:
        """Number of loss terms one sample contributes to the summed loss."""
        raise NotImplementedError

    @property
    def tokens_per_sample(self) -> int | None:
        """Sequence length for language models, None for image models."""
        raise NotImplementedError

    def synthetic_batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        """Random positional inputs of ``forward`` (batch dim first) for ``batch_size`` samples."""
        raise NotImplementedError

    def _real_dataset(self, source: str, path: str, split: str):
        raise NotImplementedError

    def dataset(self, source: str, path: str | None, split: str, seed: int):
        """Returns a dataset object with ``batch(step, start, stop, global_batch)``.

        Args:
            source: "synthetic" or one of ``real_sources`` ("cifar10" / "wikitext2").
            path: directory of the real data files (ignored for "synthetic").
            split: "train", "valid" or "test" (CIFAR-10 has no "valid").
            seed: seeds the synthetic data; real data is read in file order and ignores it.

        Raises:
            ValueError: a source this model cannot use (the message names ``data.source``),
                a missing path, or missing/corrupt data files.
        """
        valid = ("synthetic",) + tuple(self.real_sources)
        if source not in valid:
            raise ValueError(f"data.source={source!r} is not valid for model {self.name}; valid: {', '.join(valid)}")
        if source == "synthetic":
            return SyntheticDataset(self, seed, split)
        if path is None:
            raise ValueError(f"data.path is required for data.source={source!r} (model {self.name})")
        return self._real_dataset(source, str(path), split)

    def _check_positive(self, **values: Any) -> None:
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {key}={value!r} must be an int >= 1")

    def _check_dropout(self) -> None:
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"{self.name}: dropout={self.dropout!r} must be in [0, 1)")


class ImageClassifierConfig(ModelConfig):
    """Conventions of the CIFAR-10 classifiers: inputs (B,3,32,32) float and (B,) int64 labels."""

    image_size: ClassVar[int] = 32
    in_channels: ClassVar[int] = 3
    real_sources: ClassVar[tuple[str, ...]] = ("cifar10",)

    @property
    def targets_per_sample(self) -> int:
        return 1

    @property
    def tokens_per_sample(self) -> int | None:
        return None

    def synthetic_batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        # Standard normal pixels match the scale of per-channel normalised real images.
        shape = (batch_size, self.in_channels, self.image_size, self.image_size)
        images = torch.randn(shape, generator=generator)
        labels = torch.randint(0, self.num_classes, (batch_size,), generator=generator)
        return images, labels

    def _real_dataset(self, source: str, path: str, split: str):
        return Cifar10(path, split)


class LanguageModelConfig(ModelConfig):
    """Conventions of the language models: int64 tokens (B,S) and next-token targets (B,S)."""

    real_sources: ClassVar[tuple[str, ...]] = ("wikitext2",)

    @property
    def targets_per_sample(self) -> int:
        return self.seq_len

    @property
    def tokens_per_sample(self) -> int | None:
        return self.seq_len

    def synthetic_batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        # Draw S+1 tokens per sample so that the targets are the inputs shifted by one, as
        # with real data.
        window = torch.randint(0, self.vocab_size, (batch_size, self.seq_len + 1), generator=generator)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def _real_dataset(self, source: str, path: str, split: str):
        return WikiText2(path, split, vocab_size=self.vocab_size, seq_len=self.seq_len)

    def _check_lm(self) -> None:
        self._check_positive(
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            num_layers=self.num_layers,
            d_model=self.d_model,
            num_heads=self.num_heads,
            d_ff=self.d_ff,
        )
        if self.vocab_size < 2:
            raise ValueError(f"{self.name}: vocab_size={self.vocab_size} must be >= 2 ('<unk>' + a word)")
        if self.d_model % self.num_heads:
            raise ValueError(f"{self.name}: d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        self._check_dropout()


def init_transformer_weights(module: nn.Module) -> None:
    """BERT-style init: N(0, 0.02) Linear/Embedding/Conv weights, zero biases, unit LayerNorms.

    Apply with ``model.apply(init_transformer_weights)``; parameters owned directly by a
    module (class token, position embeddings, expert weights) are initialised by it. A module
    wholly on the meta device (the planner's capture: shapes only) has no values to set; one
    whose other parameters are (bench.core.weights sets one at a time) sets its real one.
    """
    if all(p.is_meta for p in module.parameters(recurse=False)):
        return
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def causal_mask(seq_len: int) -> torch.Tensor:
    """Additive attention mask (seq_len, seq_len): 0 on and below the diagonal, -inf above."""
    return torch.full((seq_len, seq_len), float("-inf")).triu(1)


class SelfAttention(nn.Module):
    """Multi-head self-attention written out op by op.

    forward(x: (B,S,d), mask: (S,S) additive or None) -> (B,S,d). The mask is added to the
    attention scores whole, so inputs must have exactly the length the mask was built for.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        # Folded into the query instead of dividing the (B,H,S,S) scores.
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # (B,S,d) -> (B,H,S,d/H); unflatten needs no batch or sequence sizes.
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q = self._heads(self.query(x) * self.scale)
        k = self._heads(self.key(x))
        v = self._heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        probs = self.attn_dropout(torch.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).transpose(1, 2).flatten(2)
        return self.out(context)


class FeedForward(nn.Module):
    """Position-wise FFN: Linear(d, d_ff) -> GELU -> Linear(d_ff, d); (B,S,d) -> (B,S,d)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-LN block: x + Drop(Attn(LN(x))), then x + Drop(ffn(LN(x))).

    Args:
        d_model: model width.
        num_heads: attention heads (d_model must be divisible by it).
        dropout: dropout on attention probabilities and on both residual branches.
        ffn: the feed-forward module, any (B,S,d) -> (B,S,d) module (a MoE, for example).
            It is held as ``self.ffn`` so it can be swapped after building.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float, ffn: nn.Module):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, num_heads, dropout)
        self.drop1 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = ffn
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x), mask))
        return x + self.drop2(self.ffn(self.ln2(x)))


class TransformerLM(nn.Module):
    """Causal language model: token + learned position embeddings, pre-LN blocks, final
    LayerNorm, untied LM head, summed next-token cross-entropy.

    forward(tokens: int64 (B,S), targets: int64 (B,S)) -> scalar loss summed over B*S.
    S must equal ``seq_len``: the causal mask and position embeddings are used whole.

    Args:
        vocab_size, seq_len, d_model: embedding sizes.
        blocks: the transformer blocks, applied in order with the causal mask.
        dropout: dropout after the embedding sum.
    """

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, blocks: list[nn.Module], dropout: float):
        super().__init__()
        self.vocab_size = vocab_size
        self.tok_embedding = nn.Embedding(vocab_size, d_model)
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_len, d_model))
        self.emb_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        # Non-persistent: derived from seq_len, so it is not part of checkpoints.
        self.register_buffer("causal_mask", causal_mask(seq_len), persistent=False)
        self.apply(self.init_module)

    def init_module(self, module: nn.Module) -> None:
        """The model's initialiser of `module`'s own parameters (bench.core.weights runs it one
        parameter at a time; an expert layer's are its reset_parameters')."""
        init_transformer_weights(module)
        if module is self:
            nn.init.normal_(self.pos_embedding, mean=0.0, std=INIT_STD)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb_dropout(self.tok_embedding(tokens) + self.pos_embedding)
        for block in self.blocks:
            x = block(x, self.causal_mask)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
