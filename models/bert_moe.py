"""BERT-Base-sized causal LM with top-k gated mixture-of-experts FFNs (HAP's "BERT-MoE").

What it does: the model of ``models.bert`` (causal next-token LM, pre-LN blocks) in which
the FFN of every odd block (zero-based 1, 3, 5, ...) is a ``MoE`` layer:
  * ``num_experts = experts_per_device * num_devices`` experts (2 per device by default),
    each a GELU FFN d -> d_ff -> d, stored as batched weights w1 (E,d,h), b1 (E,h),
    w2 (E,h,d), b2 (E,d) and applied with einsum.
  * Gate: Linear(d, E, bias=False), softmax over the experts, top-k (k = 2). The chosen
    probabilities weight the expert outputs as they are, without renormalising them to
    sum to one (as the HAP authors do).
  * Routing groups are single sequences: each expert takes at most ``capacity`` tokens of
    each sequence, where capacity = min(seq_len, ceil(capacity_factor * seq_len / E)) is a
    Python int fixed at build time. With capacity_factor = 2.5 (the default; it already
    contains the factor 2 of top-2 routing, i.e. 1.25 slots per routed token) this is the
    HAP authors' capacity (20 for 16 experts at seq_len 128). Capping at seq_len changes
    nothing (an expert never gets more than seq_len tokens of one sequence) but saves work.
  * A token's slot in an expert is its rank among the tokens of its sequence routed to
    that expert: all first choices in sequence order (slots 0, 1, ...), then all second
    choices. Assignments at slot >= capacity are dropped: they contribute 0 to the MoE
    output; the block's residual connection still carries the token.
  * Because routing never looks across sequences, one sample's output does not depend
    on the other samples in the batch, so data-parallel shards add up exactly.

What it doesn't do: no auxiliary load-balancing loss, no gate noise/jitter, no expert
parallel communication (the planner or a baseline such as DeepSpeed decides that; use
``replace_moe_layers`` to swap in another MoE implementation without copying the model).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.bert import LM_PRESETS, BertConfig
from models.common import INIT_STD, FeedForward, init_transformer_weights


def moe_capacity(seq_len: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert per sequence: min(seq_len, ceil(capacity_factor * seq_len / num_experts))."""
    return max(1, min(seq_len, math.ceil(capacity_factor * seq_len / num_experts)))


class MoE(nn.Module):
    """Top-k gated mixture of expert FFNs with per-sequence capacity.

    forward(x: (B,S,d)) -> (B,S,d). Works for B = 0 and traces with torch.fx.

    Args:
        d_model: token width d.
        d_ff: hidden width h of every expert.
        num_experts: number of experts E.
        capacity: slots per expert per sequence (a Python int).
        top_k: experts per token.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, capacity: int, top_k: int = 2):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be in [1, num_experts={num_experts}]")
        if capacity < 1:
            raise ValueError(f"MoE: capacity={capacity} must be >= 1")
        self.num_experts = num_experts
        self.capacity = int(capacity)
        self.top_k = top_k
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.b1 = nn.Parameter(torch.empty(num_experts, d_ff))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.b2 = nn.Parameter(torch.empty(num_experts, d_model))
        self.act = nn.GELU()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_transformer_weights(self.gate)
        nn.init.normal_(self.w1, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.w2, mean=0.0, std=INIT_STD)
        nn.init.zeros_(self.b1)
        nn.init.zeros_(self.b2)

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (dispatch, combine), both (B,S,E,C) in x's dtype.

        dispatch[b,s,e,c] = 1 if token s of sequence b occupies slot c of expert e;
        combine is dispatch weighted by the token's gate probability for that expert.
        """
        probs = torch.softmax(self.gate(x), dim=-1)
        top = torch.topk(probs, self.top_k, dim=-1)
        gates, experts = top[0], top[1]
        dispatch = None
        combine = None
        # Slots of each expert already used by earlier choices in the sequence: (B,1,E).
        used = None
        for k in range(self.top_k):
            chosen = F.one_hot(experts[..., k], self.num_experts)
            # Rank of the token among this choice's tokens routed to the same expert.
            slot = torch.cumsum(chosen, dim=1) - 1
            count = chosen.sum(dim=1, keepdim=True)
            if used is not None:
                slot = slot + used
                count = count + used
            used = count
            kept = chosen * (slot < self.capacity)
            # Dropped tokens have kept == 0 everywhere, so their slot index becomes 0 and
            # their one-hot row is multiplied away below.
            slot_hot = F.one_hot((slot * kept).sum(dim=-1), self.capacity)
            route = (kept.unsqueeze(-1) * slot_hot.unsqueeze(-2)).to(x.dtype)
            weighted = gates[..., k].unsqueeze(-1).unsqueeze(-1) * route
            dispatch = route if dispatch is None else dispatch + route
            combine = weighted if combine is None else combine + weighted
        return dispatch, combine

    def expert(self, e: int) -> FeedForward:
        """Expert `e` as a standalone FeedForward with a copy of its weights (for another MoE
        implementation to start from the same experts)."""
        ffn = FeedForward(self.w1.shape[1], self.w1.shape[2]).to(self.w1.device)
        with torch.no_grad():
            ffn.fc1.weight.copy_(self.w1[e].t())
            ffn.fc1.bias.copy_(self.b1[e])
            ffn.fc2.weight.copy_(self.w2[e].t())
            ffn.fc2.bias.copy_(self.b2[e])
        return ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dispatch, combine = self.routing(x)
        # Gather each expert's tokens: (B,E,C,d); empty slots are zero rows.
        expert_in = torch.einsum("bsec,bsd->becd", dispatch, x)
        hidden = self.act(torch.einsum("becd,edh->bech", expert_in, self.w1) + self.b1.unsqueeze(1))
        expert_out = torch.einsum("bech,ehd->becd", hidden, self.w2) + self.b2.unsqueeze(1)
        # Scatter back, weighted by the gate; empty slots have combine weight 0.
        return torch.einsum("bsec,becd->bsd", combine, expert_out)


@dataclasses.dataclass
class BertMoEConfig(BertConfig):
    """BertConfig's sizes with every other FFN a mixture of experts.

    Attributes:
        (BertConfig's), d_ff being also every expert's hidden width, and
        experts_per_device: experts per device; num_experts = experts_per_device * num_devices.
        num_devices: devices of the run (set by ``from_preset``).
        capacity_factor: see ``moe_capacity`` (includes the top-k factor; 2.5 for top-2).
        top_k: experts per token.
    """

    name: ClassVar[str] = "bert_moe"

    experts_per_device: int = 2
    num_devices: int = 1
    capacity_factor: float = 2.5
    top_k: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_positive(experts_per_device=self.experts_per_device, num_devices=self.num_devices, top_k=self.top_k)
        if not float(self.capacity_factor) > 0:
            raise ValueError(f"bert_moe: capacity_factor={self.capacity_factor!r} must be > 0")
        if self.top_k > self.num_experts:
            raise ValueError(f"bert_moe: top_k={self.top_k} exceeds num_experts={self.num_experts}")

    @classmethod
    def _preset_values(cls, preset: str, num_devices: int) -> dict[str, dict[str, Any]]:
        return {key: {**values, "num_devices": num_devices} for key, values in LM_PRESETS.items()}

    @property
    def num_experts(self) -> int:
        return self.experts_per_device * self.num_devices

    @property
    def capacity(self) -> int:
        """Slots per expert per sequence, fixed at build time."""
        return moe_capacity(self.seq_len, self.num_experts, self.capacity_factor)

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """Zero-based indices of the blocks whose FFN is a MoE (the odd ones)."""
        return tuple(range(1, self.num_layers, 2))

    def ffn(self, index: int) -> nn.Module:
        if index in self.moe_layer_indices:
            return MoE(self.d_model, self.d_ff, self.num_experts, self.capacity, self.top_k)
        return super().ffn(index)


def replace_moe_layers(model: nn.Module, factory: Callable[[MoE], nn.Module]) -> int:
    """Replaces every ``MoE`` held as ``<module>.ffn`` by ``factory(moe)``.

    The replacement must have the MoE call signature, forward(x: (B,S,d)) -> (B,S,d).
    Use it to run the same model with another MoE implementation (e.g. DeepSpeed's,
    wrapped to return only its output tensor).

    Returns:
        The number of layers replaced (num_layers // 2 for a built BertMoEConfig).
    """
    parents = [module for module in model.modules() if isinstance(getattr(module, "ffn", None), MoE)]
    for parent in parents:
        replacement = factory(parent.ffn)
        if not isinstance(replacement, nn.Module):
            raise TypeError(f"replace_moe_layers: factory returned {type(replacement).__name__}, not an nn.Module")
        parent.ffn = replacement
    return len(parents)
