"""BERT-Base-sized causal language model (the HAP paper's "BERT" benchmark).

What it does: token embeddings plus learned position embeddings, ``num_layers`` pre-LN
transformer blocks with GELU FFNs (``models.common.TransformerBlock``), a final LayerNorm
and an untied LM head Linear(d, vocab). The objective is next-token prediction at every
position with a causal attention mask; the targets (the inputs shifted by one) come with
the data. ``forward(tokens, targets)`` returns the cross-entropy summed over all B*S
positions.

Why causal: the HAP authors' "BERT" benchmark is a GPT-style causal LM with BERT-Base sizes
(12 layers, d=768, 12 heads, d_ff=3072, seq_len 128, vocabulary 33,280 = the 33,278-word
WikiText-2 dictionary padded), not a masked LM. This model reproduces that workload.

What it doesn't do: no masked-LM or next-sentence objective, no segment embeddings, no
post-LN (we use pre-LN, which trains stably without warm-up tricks), no weight tying,
no variable sequence length (inputs must have exactly ``seq_len`` tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from torch import nn

from models.common import FeedForward, LanguageModelConfig, TransformerBlock, TransformerLM

# Shared with bert_moe, which has the same body sizes. tiny: forward+backward at batch 8 on one
# CPU thread stays well under 100 ms (tests/unit/test_models.py).
LM_PRESETS: dict[str, dict[str, Any]] = {
    "paper": {},
    "tiny": {"vocab_size": 512, "seq_len": 64, "num_layers": 2, "d_model": 64, "num_heads": 4, "d_ff": 128},
}


@dataclasses.dataclass
class BertConfig(LanguageModelConfig):
    """Sizes of the dense causal LM.

    Attributes:
        vocab_size: embedding rows and LM-head outputs (token ids must be below it).
        seq_len: tokens per sample (fixed).
        num_layers, d_model, num_heads, d_ff: transformer sizes.
        dropout: attention/residual/embedding dropout probability.
    """

    name: ClassVar[str] = "bert"

    vocab_size: int = 33280
    seq_len: int = 128
    num_layers: int = 12
    d_model: int = 768
    num_heads: int = 12
    d_ff: int = 3072
    dropout: float = 0.0

    def __post_init__(self) -> None:
        self._check_lm()

    @classmethod
    def _preset_values(cls, preset: str, num_devices: int) -> dict[str, dict[str, Any]]:
        return {key: dict(values) for key, values in LM_PRESETS.items()}

    def ffn(self, index: int) -> nn.Module:
        """The feed-forward part of block `index` (bert_moe swaps some for experts)."""
        return FeedForward(self.d_model, self.d_ff)

    def build(self) -> nn.Module:
        blocks = [
            TransformerBlock(self.d_model, self.num_heads, self.dropout, self.ffn(index))
            for index in range(self.num_layers)
        ]
        return TransformerLM(self.vocab_size, self.seq_len, self.d_model, blocks, self.dropout)
