"""torch.distributed names that differ between the torch versions hetbench runs on (>= 2.4).

torch 2.13 (this project's pin) has all_gather_single and reduce_scatter_single and warns on
the older all_gather_into_tensor and reduce_scatter_tensor; torch 2.11 (the GPU host's image)
has only the older two. Looked up at call time.

A process group whose ranks keep the caller's order (a pipeline's stages by position): torch
2.12 added `new_group(..., sort_ranks=False)`; before it, new_group always sorted the ranks.
"""

import inspect

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def all_gather_single():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def ordered_group(ranks: list[int]):
    """`dist.new_group(ranks)` whose group rank i is ranks[i]. Every rank calls it, in the same
    order, as new_group asks. On torch without `sort_ranks` the one `sorted` new_group applies to
    the ranks is made the identity for the call (the module's own name shadows the builtin), and
    the group is checked: a torch that ranks it otherwise stops the run here, not in training."""
    ranks = list(ranks)
    if ranks == sorted(ranks):
        return dist.new_group(ranks)
    if "sort_ranks" in inspect.signature(dist.new_group).parameters:
        return dist.new_group(ranks, sort_ranks=False)
    c10d.sorted = list
    try:
        group = dist.new_group(ranks)
    finally:
        del c10d.sorted
    if dist.get_rank() in ranks and dist.get_process_group_ranks(group) != ranks:
        raise RuntimeError(
            f"torch {torch.__version__} ranked the process group of {ranks} as "
            f"{dist.get_process_group_ranks(group)}: pipelines need torch >= 2.12 (new_group's sort_ranks)"
        )
    return group


def no_handshake_with_itself(stage):
    """A torch.distributed.pipelining stage whose opening handshake leaves out its own rank.
    Before torch 2.12 a stage opens its links with a send to and a receive from each neighbour
    stage, a neighbour on its own rank too (a V-shaped zero-bubble schedule keeps two adjacent
    stages on one rank), which gloo refuses ("Pair is not connected"); the transfers between
    stages of one rank never go through the process group. Newer torch opens links otherwise."""
    opening = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if opening is not None:
        stage._get_init_p2p_neighbors_ops = lambda: [op for op in opening() if op.group_peer != stage.group_rank]
    return stage
