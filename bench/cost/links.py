"""Alpha-beta cost of collectives on one link level, shared by emulation and the simulator.

Time only; what a collective does is torch.distributed's business.
"""

from __future__ import annotations

from bench.core.cluster import Link

# Bytes that cross each rank's link, as a multiple of `nbytes`, for ring-style algorithms over
# n ranks. `nbytes` is the size of the full tensor: the all-reduced buffer, the gathered output,
# the reduce-scattered input, or what one rank sends in an all-to-all / broadcast.
_RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,  # reduce-scatter then all-gather
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,  # pipelined: the root's link carries the tensor once
    "reduce": lambda n: 1.0,
    # To one rank and back (a machine's leader, hierarchical collectives): the root receives
    # (or sends) every other rank's part of the full tensor.
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
}

COLLECTIVE_KINDS = tuple(_RING_FACTOR)


def link_bytes(kind: str, nbytes: float, num_ranks: int) -> float:
    """Bytes that cross each rank's link in one collective of `nbytes` (see _RING_FACTOR)."""
    return _RING_FACTOR[kind](num_ranks) * nbytes if num_ranks > 1 else 0.0


def collective_time_s(kind: str, nbytes: float, num_ranks: int, link: Link) -> float:
    """Seconds for one collective over `num_ranks` ranks on `link`: latency + bytes / bandwidth,
    from the link's measured fit for `kind` where it has one (Link.alpha_bandwidth). The
    simulator, the LP and the emulated links all price a call here."""
    if num_ranks <= 1:
        return 0.0
    latency, bytes_per_s = link.alpha_bandwidth(kind)
    return latency + link_bytes(kind, nbytes, num_ranks) / bytes_per_s


def collective_linear_cost(kind: str, impl: str, num_ranks: int, link: Link) -> tuple[float, float, str]:
    """The collective's time as alpha + beta * agg(per-device bytes), for the simulator and the LP.

    `agg` is "max" (the largest device's bytes: ring, padded and all-to-all algorithms wait for
    the largest shard) or "sum" (grouped calls: one broadcast / reduce per device, no padding).
    Per-device bytes are what bench.core.program.Collective.nbytes means for `kind`.

    Returns:
        (alpha_s, beta_s_per_byte, agg); all zero for a single rank.
    """
    if num_ranks <= 1:
        return 0.0, 0.0, "max"
    if impl == "grouped":
        if kind not in ("all_gather", "reduce_scatter"):
            raise ValueError(f"grouped calls exist for all_gather and reduce_scatter, not {kind}")
        single = "broadcast" if kind == "all_gather" else "reduce"
        alpha = num_ranks * collective_time_s(single, 0.0, num_ranks, link)
        beta = collective_time_s(single, 1.0, num_ranks, link) - collective_time_s(single, 0.0, num_ranks, link)
        return alpha, beta, "sum"
    alpha = collective_time_s(kind, 0.0, num_ranks, link)
    beta = collective_time_s(kind, 1.0, num_ranks, link) - alpha
    if kind in ("all_gather", "reduce_scatter"):
        # Padded: every device's shard is padded to the largest; the full tensor is n x that.
        beta *= num_ranks
    return alpha, beta, "max"
