"""torch.distributed names that differ between the torch versions hetbench runs on (>= 2.4).

torch 2.13 (this project's pin) has all_gather_single and reduce_scatter_single and warns on
the older all_gather_into_tensor and reduce_scatter_tensor; torch 2.11 (the GPU host's image)
has only the older two. Looked up at call time.
"""

import torch.distributed as dist


def all_gather_single():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
