"""The step format of synthesized programs: one triple per op plus the collectives fused into it.

A Step is what the search decides, the plan records (as JSON, docs/planner.md "Plan format") and
codegen runs; this module also reads a plan's steps back (shard units, a readable summary). It
does not price steps (methods.hap.pricing) or search for them (methods.hap.search).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from methods.graph import Graph
from methods.hap.theory import CommRule, Layout, Rule


@dataclass(frozen=True)
class Step:
    """One instruction of a synthesized program: a triple plus the collectives fused in."""

    node: str
    rule: Rule
    comms: tuple[CommRule, ...]  # collectives on inputs, run just before the op
    sources: tuple[tuple[str, Layout], ...]  # sources created here (fused), with layouts

    segment: int = 0  # ratio row this op's Gather shards follow (methods.hap.planner segments)

    def describe(self) -> str:
        parts = [c.describe() for c in self.comms] + [self.rule.describe()]
        return "; ".join(parts)

    def to_json(self, graph: Graph | None = None) -> dict:
        """Machine-readable form (docs/planner.md "Plan format"); layouts are "I", "R" or an int dim."""
        r = self.rule
        out = {
            "node": self.node,
            "op": graph[self.node].op if graph is not None else None,
            "inputs": list(graph[self.node].inputs) if graph is not None else None,
            "rule": r.name,
            "pre": list(r.pre),
            "post": r.post,
            "sharded": r.sharded,
            "first_device_only": list(r.first_device_only),
            "sfb": r.sfb,
            "unit": r.unit,
            "shape_pre": [[t, lay] for t, lay in r.shape_pre],
            "segment": self.segment,
            "comms": [comm_to_json(c) for c in self.comms],
            "sources": [[t, lay] for t, lay in self.sources],
        }
        return out

    @staticmethod
    def from_json(d: dict) -> Step:
        rule = Rule(
            d["node"],
            tuple(d["pre"]),
            d["post"],
            d["rule"],
            bool(d["sharded"]),
            tuple(d.get("first_device_only", ())),
            bool(d.get("sfb", False)),
            int(d.get("unit", 1)),
            tuple((t, lay) for t, lay in d.get("shape_pre", ())),
        )
        comms = tuple(comm_from_json(c) for c in d.get("comms", ()))
        sources = tuple((t, lay) for t, lay in d.get("sources", ()))
        return Step(d["node"], rule, comms, sources, int(d.get("segment", 0)))


def comm_to_json(c: CommRule) -> dict:
    out = {"tensor": c.tensor, "src": c.src, "dst": c.dst, "kind": c.kind, "impl": c.impl}
    if c.to_segment is not None:
        out["to_segment"] = c.to_segment
    return out


def comm_from_json(d: dict) -> CommRule:
    seg = d.get("to_segment")
    return CommRule(
        d["tensor"], d["src"], d["dst"], d["kind"], d.get("impl", "ring"), None if seg is None else int(seg)
    )


def describe_steps(steps: Sequence[Step], graph: Graph) -> dict:
    """Readable decisions: layout per tensor, collectives, replicated parameters."""
    layouts: dict[str, str] = {}
    comms = []
    sfb = []
    from methods.hap.theory import layout_name

    for s in steps:
        for t, lay in s.sources:
            layouts[t] = layout_name(lay)
        layouts[s.node] = layout_name(s.rule.post)
        comms += [c.describe() for c in s.comms]
        if s.rule.sfb:
            sfb.append(s.node)
    return {"layouts": layouts, "collectives": comms, "sfb": sfb}


def shard_units(steps: Sequence[Step], graph: Graph) -> dict[int, int]:
    """Dim length -> the unit its Gather shards come in (docs/planner.md "Plan format").

    A reshape that splits a sharded dim (d_model -> heads x head_dim, B*S -> B x S) needs
    whole units per device. Every sharded dim of the same length uses the same unit (their lcm),
    so tensors whose sharded dims must line up (same length) get identical shard lengths.
    """
    units: dict[int, int] = {}
    for s in steps:
        r = s.rule
        if not r.pre or not isinstance(r.pre[0], int):
            continue
        if r.unit > 1:
            length = _dim_len(graph, r.node, r.pre[0])
            units[length] = math.lcm(units.get(length, 1), r.unit)
        node = graph[s.node]
        if node.op in ("view", "reshape", "flatten", "unflatten") and isinstance(r.post, int):
            # A merging reshape ((heads, head_dim) -> d_model with heads sharded): the merged
            # dim is sharded in whole units of the inner size.
            n_in, n_out = _dim_len(graph, r.node, r.pre[0]), int(node.shape[r.post])
            if n_out > n_in and n_out % n_in == 0:
                units[n_out] = math.lcm(units.get(n_out, 1), n_out // n_in)
    return units


def _dim_len(graph: Graph, node: str, dim: int) -> int:
    first = graph[graph[node].inputs[0]]
    shape = first.shape if first.shape is not None else first.tuple_shapes[0]
    return int(shape[dim])
