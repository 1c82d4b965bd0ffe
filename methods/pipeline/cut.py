"""A captured model cut into pipeline stages at layer-group borders: each stage's nodes as an fx
GraphModule with the values that cross its borders as inputs and outputs (or, with activation
checkpointing, its layer groups' modules in a row, each checkpointed), and the loss's nodes as
the last stage's loss module. It plans nothing and runs no schedule."""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from methods.common import GroupTable


def cut_graph(
    gm: fx.GraphModule, table: GroupTable, tensors: set[str], cuts: list[int], stage: int
) -> tuple[fx.GraphModule, fx.GraphModule | None]:
    """Stage `stage`'s module (the nodes of layer groups [cuts[stage], cuts[stage + 1])), and on
    the last stage the loss module (the nodes that read the targets: loss(*outputs, targets)).

    A stage's inputs are the values made before it (or the model's inputs) that it or a later
    stage reads; its outputs the next stage's inputs. Parameters and buffers are read where they
    are used (get_attr): each stage holds only its own. `tensors`: the nodes that make tensors
    (only those can cross a border). Returns (stage module, loss module or None)."""
    node_group, tail, targets = table.node_group, set(table.tail), set(table.targets)
    num_stages = len(cuts) - 1
    group_stage = {}
    for s in range(num_stages):
        for g in range(cuts[s], cuts[s + 1]):
            group_stage[g] = s
    nodes = list(gm.graph.nodes)
    where: dict[str, int] = {}  # node -> stage that makes it (placeholders: -1), or num_stages for the loss
    for n in nodes:
        if n.op == "placeholder":
            where[n.name] = num_stages if n.name in targets else -1
        elif n.name in tail or n.op == "output":
            where[n.name] = num_stages
        elif n.op in ("call_function", "call_method", "call_module"):
            if n.name not in node_group:
                raise ValueError(
                    f"fx node {n.name!r} of the model has no layer group: the traced graph differs from the planner's"
                )
            where[n.name] = group_stage[node_group[n.name]]
    readers: dict[str, list[int]] = {}
    for n in nodes:
        if n.op == "get_attr":
            continue
        for a in n.all_input_nodes:
            if a.op != "get_attr":
                readers.setdefault(a.name, []).append(where[n.name])

    def crossing(s: int) -> list[fx.Node]:
        """Values made before stage s (model inputs included) that stage s or later reads."""
        return [
            n
            for n in nodes
            if n.op not in ("get_attr", "output")
            and where.get(n.name, num_stages) < s
            and n.name not in targets
            and any(r >= s for r in readers.get(n.name, []))
        ]

    def build(members: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for x in inputs:
            env[x] = g.placeholder(x.name)
        for n in members:
            for a in n.all_input_nodes:
                if a not in env:
                    if a.op != "get_attr":
                        raise ValueError(f"fx node {n.name!r} reads {a.name!r}, which does not reach its stage")
                    env[a] = g.get_attr(a.target)
            env[n] = g.node_copy(n, lambda a: env[a])
        result = [env[x] for x in outputs]
        g.output(result[0] if len(result) == 1 else tuple(result))
        return fx.GraphModule(gm, g)

    inputs = [n for n in nodes if n.op == "placeholder" and n.name not in targets] if stage == 0 else crossing(stage)
    members = [n for n in nodes if where.get(n.name) == stage and n.op != "placeholder"]
    outputs = crossing(stage + 1)
    if stage == num_stages - 1:
        outputs = [
            n
            for n in nodes
            if n.op not in ("get_attr", "output")
            and where.get(n.name, num_stages) < num_stages
            and n.name not in targets
            and num_stages in readers.get(n.name, [])
        ]
    for x in [*inputs, *outputs] if stage else outputs:
        if x.name not in tensors:
            raise ValueError(f"fx node {x.name!r} crosses a stage border but is not a tensor")
    module = build(members, inputs, outputs)
    loss = None
    if stage == num_stages - 1:
        tail_nodes = [n for n in nodes if where.get(n.name) == num_stages and n.op not in ("placeholder", "output")]
        out = next(n for n in nodes if n.op == "output")
        g = fx.Graph()
        env = {x: g.placeholder(x.name) for x in outputs}
        target_nodes = [n for n in nodes if n.name in targets]
        env.update({t: g.placeholder(t.name) for t in target_nodes})
        for n in tail_nodes:
            for a in n.all_input_nodes:
                if a not in env:
                    env[a] = g.get_attr(a.target)
            env[n] = g.node_copy(n, lambda a: env[a])
        g.output(env[out.all_input_nodes[0]])
        loss = fx.GraphModule(gm, g)
    return module, loss


class CheckpointedStage(nn.Module):
    """A stage as its layer groups' modules in a row, each under torch.utils.checkpoint: a group
    keeps only its inputs for backward and recomputes its activations there (non-reentrant, the
    random state of its forward restored, so dropout draws the same masks)."""

    def __init__(self, groups: list[fx.GraphModule]):
        super().__init__()
        self.groups = nn.ModuleList(groups)

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint

        out = None
        for group in self.groups:
            out = checkpoint(group, *args, use_reentrant=False)
            args = out if isinstance(out, tuple) else (out,)
        return out


def checkpointed_stage(gm: fx.GraphModule, table: GroupTable, tensors: set[str], first: int, end: int):
    """Layer groups [first, end) as a CheckpointedStage: each group cut on its own (cut_graph at
    every group border), so a group's inputs are what crosses into it and its outputs what
    crosses out: at the stage's ends, the stage's own."""
    cuts = list(range(table.num_groups + 1))
    return CheckpointedStage([cut_graph(gm, table, tensors, cuts, g)[0] for g in range(first, end)])


def model_graph(model: nn.Module, model_cfg, batch_size: int, seed: int = 0, device=None) -> fx.GraphModule:
    """`model` (its own parameters and buffers, on meta where not materialised yet) as the
    planner's ATen graph at `batch_size` samples: the graph of methods.graph.capture_config(
    model_cfg, batch_size) (kept on disk, or traced from the model), so its nodes are the ones
    the planner's layer groups name; its constants on `device` (default: the model's)."""
    from methods.graph import capture_config
    from methods.graph_cache import with_tensors

    return with_tensors(capture_config(model_cfg, batch_size, seed, model=model).gm, model, device)
