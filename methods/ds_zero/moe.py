"""DeepSpeed's MoE layer in place of models.bert_moe's (the same experts, from the same weights),
and the slots per expert its gate gives a rank's tokens, computed without importing deepspeed.

It builds layers; it does not route or train (DeepSpeed's layer does).
"""

from __future__ import annotations

import torch
from torch import nn

from bench.core.errors import ConfigError


class DeepSpeedMoEBlock(nn.Module):
    """DeepSpeed's MoE layer with our MoE's call signature: (B,S,d) -> (B,S,d).

    DeepSpeed returns (output, l_aux, exp_counts). The auxiliary load-balancing loss is not
    added to the training loss, matching models.bert_moe (which has none).
    """

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


def swap_moe_layers(model: nn.Module, moe: dict, rank: int, deepspeed) -> int:
    """Replace every models.bert_moe.MoE by DeepSpeed's MoE with the same experts.

    The gate and this rank's experts (global experts rank * local .. rank * local + local - 1,
    DeepSpeed's expert-parallel layout) start from our layer's weights, so both models start
    from the same parameters. DeepSpeed's routing differs from ours: it normalises the two
    gate weights to sum to one and assigns slots over all of a rank's tokens, not per
    sequence (the same number of slots per expert with the default capacity factor, but a
    busy expert may take more of one sequence's tokens). The second expert is the runner-up,
    not sampled (as in our model).
    """
    # The one model import of this module: the layer type this method rewrites.
    from models.bert_moe import MoE as ZooMoE
    from models.bert_moe import replace_moe_layers

    local = moe["num_experts"] // moe["ep_size"]
    first = rank * local

    def factory(ours: ZooMoE) -> nn.Module:
        if ours.num_experts != moe["num_experts"] or ours.top_k != moe["k"]:
            raise ValueError(
                f"MoE layer with {ours.num_experts} experts, top-{ours.top_k}; the plan "
                f"expected {moe['num_experts']} experts, top-{moe['k']}"
            )
        theirs = deepspeed.moe.layer.MoE(
            hidden_size=moe["d_model"],
            expert=ours.expert(first),  # a template, copied per expert
            num_experts=moe["num_experts"],
            ep_size=moe["ep_size"],
            k=moe["k"],
            capacity_factor=moe["capacity_factor"],
            eval_capacity_factor=moe["eval_capacity_factor"],
            min_capacity=moe["min_capacity"],
            drop_tokens=True,
            use_residual=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        ).to(ours.w1.device)
        with torch.no_grad():
            theirs.deepspeed_moe.gate.wg.weight.copy_(ours.gate.weight)
            for j, expert in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
                expert.load_state_dict(ours.expert(first + j).state_dict())
        return DeepSpeedMoEBlock(theirs)

    return replace_moe_layers(model, factory)


# -- DeepSpeed's MoE capacity (no deepspeed import) ---------------------------------------------
def deepspeed_capacity(tokens: int, num_experts: int, capacity_factor: float, k: int, min_capacity: int) -> int:
    """Slots per expert DeepSpeed's gate gives one rank's `tokens` tokens (with drop_tokens).

    As deepspeed.moe.sharded_moe._capacity (0.19.8) computes it: top1gating passes
    torch.tensor(capacity_factor), top2gating torch.tensor(capacity_factor * 2) and topkgating
    torch.tensor(capacity_factor * k), i.e. a float32 tensor; the capacity is then
    ceil((tokens / num_experts) * factor) in float32, and at least min_capacity.
    """
    factor = torch.tensor(capacity_factor * k)
    return max(int(torch.ceil((tokens / num_experts) * factor)), int(min_capacity))


def matching_capacity_factor(slots_per_seq: int, seq_len: int, micro_batch: int, num_experts: int, k: int) -> float:
    """DeepSpeed's capacity_factor that gives every expert exactly slots_per_seq x micro_batch
    slots over a rank's micro_batch sequences (min_capacity aside).

    The model gives each expert slots_per_seq slots in every sequence (routing groups are
    sequences); DeepSpeed's capacity is ceil(tokens / E * factor * k) over all of a rank's
    tokens, so factor = slots_per_seq * E / (seq_len * k) gives the same count, unless float32
    rounding puts the product just above the integer (e.g. 7 experts). Then the factor
    aims at the middle of the interval the ceil maps to the count. Checked with
    deepspeed_capacity either way.
    """
    target = slots_per_seq * micro_batch
    tokens = seq_len * micro_batch
    exact = slots_per_seq * num_experts / (seq_len * k)
    middle = (target - 0.5) * num_experts / (tokens * k)
    for factor in (exact, middle):
        if deepspeed_capacity(tokens, num_experts, factor, k, 0) == target:
            return factor
    raise ConfigError(
        f"no DeepSpeed capacity_factor gives {target} slots per expert for {tokens} tokens and "
        f"{num_experts} experts in float32; set method.moe_capacity_factor explicitly"
    )
