"""The iteration's timeline as max-plus maps over its lanes (compute, network, intra-machine).

What the search (methods.hap.search) prices a partial program with; bench.cost.price builds a
program's maps (program_maps) from the same stage times iteration_time uses.
"""

from __future__ import annotations

# -- the same timeline as maps: what the search prices a partial program with ---------------
# iteration_time's lanes (compute end, network end, intra-machine end) after a stage are
# max-plus linear in the lanes before it: lane i after = max over lanes j before of (lane j +
# S[i][j]). So a run of stages is one such map (their product), and a program's forward part,
# run first, and its backward part, run last, compose around whatever comes between. The search
# (methods.hap.search) walks ops in forward order: it keeps the lanes after the forward of its
# prefix (apply) and, for the backward of its prefix, which runs at the end of the iteration in
# reverse, only how the iteration's end depends on the lanes where that backward starts
# (prepend: the end row of the map). Stage maps are never below the identity (no lane ends
# earlier), so ops inserted between can only make the iteration longer: the price of a prefix
# is a lower bound of every program that extends it. With every stage in, end(row, lanes) is
# the end iteration_time computes before the host's queueing, the optimizer and the per-step
# terms (tests/unit/test_cost_model.py).
NEG = float("-inf")


IDENTITY_MAP = (0.0, NEG, NEG, NEG, 0.0, NEG, NEG, NEG, 0.0)  # 3x3, row-major: S[i * 3 + j]


ZERO_LANES = (0.0, 0.0, 0.0)


def stage_map(comm: float, comp: float, collectives: bool, overlap: bool, sync: float = 0.0) -> tuple:
    """The map of one stage, as iteration_time times it: `comm` seconds of its collectives one
    after another, `comp` of its slowest device's compute, whether it has collectives, whether
    they overlap its compute (gradient buckets), and `sync` seconds of its gradients'
    all-reduce inside the machines (the third lane, launched once it has computed)."""
    if not collectives or (comm == 0.0 and not overlap):  # the compute lane alone
        c = (comp, NEG, NEG)
        w = (NEG, 0.0, NEG)
    elif overlap:  # its collectives start when both lanes are free, its compute goes on beside
        c = (comp, NEG, NEG)
        w = (comm, comm, NEG)
    else:  # its compute waits for its collectives
        c = (comm + comp, comm + comp, NEG)
        w = (comm, comm, NEG)
    a = (NEG, NEG, 0.0) if sync == 0.0 else (c[0] + sync, c[1] + sync, sync)
    return (*c, *w, *a)


def compose(later: tuple, earlier: tuple) -> tuple:
    """The map of `earlier` then `later` (max-plus product later x earlier)."""
    a0, a1, a2, a3, a4, a5, a6, a7, a8 = later
    b0, b1, b2, b3, b4, b5, b6, b7, b8 = earlier
    return (  # entry (i, j): max over k of later[i][k] + earlier[k][j], written out
        max(a0 + b0, a1 + b3, a2 + b6),
        max(a0 + b1, a1 + b4, a2 + b7),
        max(a0 + b2, a1 + b5, a2 + b8),
        max(a3 + b0, a4 + b3, a5 + b6),
        max(a3 + b1, a4 + b4, a5 + b7),
        max(a3 + b2, a4 + b5, a5 + b8),
        max(a6 + b0, a7 + b3, a8 + b6),
        max(a6 + b1, a7 + b4, a8 + b7),
        max(a6 + b2, a7 + b5, a8 + b8),
    )


def apply(m: tuple, lanes: tuple) -> tuple:
    """The lanes after map `m`, from `lanes`."""
    c, w, a = lanes
    return (max(m[0] + c, m[1] + w, m[2] + a), max(m[3] + c, m[4] + w, m[5] + a), max(m[6] + c, m[7] + w, m[8] + a))


def prepend(row: tuple, m: tuple) -> tuple:
    """The end row of (the map whose end row is `row`) after `m`: how the end depends on the
    lanes before `m` runs, once `m` runs first."""
    r0, r1, r2 = row
    return (
        max(r0 + m[0], r1 + m[3], r2 + m[6]),
        max(r0 + m[1], r1 + m[4], r2 + m[7]),
        max(r0 + m[2], r1 + m[5], r2 + m[8]),
    )


def end(row: tuple, lanes: tuple) -> float:
    """The iteration's end (the last lane done) from an end row and the lanes it starts from."""
    return max(row[0] + lanes[0], row[1] + lanes[1], row[2] + lanes[2])
