"""Memory floors: what a candidate's plan must hold, worked out before its part plans it.

A floor is a lower bound of what the simulator will say a candidate's plan holds, read from the
graph auto captured for its space (the global batch) and the cluster, with no plan made. Where
the floor already passes device memory as auto's search judges it (`search.price`: a device's
peak over its memory), the candidate is `oom` without its part planning it; elsewhere it says
nothing (None). Two parts have one:

- DeepSpeed's ZeRO-1 and ZeRO-2 keep every parameter whole on every device, ZeRO-1 every
  gradient too (ZeRO-2 a 1/n share), beside a gradient reduce bucket of its configured size:
  each device's peak is at least those bytes (`methods.ds_zero.program.zero_program`'s Memory;
  its optimizer state and activations only add), so where they pass the smallest device's
  memory that device is over. A model with experts has no floor here: DeepSpeed's expert
  parallelism spreads its experts over the devices.
- hap's synthesis may shard any tensor, a parameter too, so no one device has a floor; the
  devices together do. Every parameter is held on some device in some layout (a shard by the
  ratio row, which sums to 1 over the devices, or whole), with Adam's two moments of the same
  layout; every tensor autograd keeps (`Graph.kept_until`, the checkpointed graph's where
  checkpointing is on) is held as the lowering keeps it (`methods.hap.lowering._held`: in its
  own layout, or a re-laid copy an op keeps in its stead, each summing over the devices to at
  least its bytes). At the start of backward every kept activation is held beside the
  parameters and moments (`Memory.backward_points`' first point), so the devices' peaks sum to
  at least 3 x parameters + activations at the level of GPUs. Over machines a device's
  activations are its busiest GPU's share (`busiest_gpu_ratios`, at least the machine's over
  its GPUs) and its state is whole on each GPU, so the peaks sum to at least 3 x parameters +
  activations / the most GPUs a machine. With k micro-steps hap plans one micro-step of
  global_batch / k samples; a kept tensor's bytes are a part that does not grow with the batch
  plus a part that grows in proportion (the batch is a dimension of it, or not in it), so its
  activations are at least 1/k of the global batch's. Where the sum passes the devices'
  memory summed (as the search pairs peaks with devices), some device is over, at every level
  hap plans at.

Where the floor over machines passes memory and the one over GPUs does not, auto has hap plan
over GPUs only (`hap_gpus_only`): a plan over memory never wins over one that fits, so where
the GPUs' plan fits it is the plan hap would make at both levels; where it does not, the
candidate is `oom` either way, and its time (perhaps slower than the machines' plan hap would
have kept) bounds no heavier candidate (`methods.auto.search`).

`tests/unit/test_auto_floors.py` checks each floor against the priced plans of zoo cases.
"""

from __future__ import annotations

from bench.core.cluster import ClusterSpec
from bench.core.interfaces import Workload
from bench.cost import virtual_devices
from methods.auto.space import ZERO_STATES, Candidate, make_part
from methods.common import capture_batch_norm
from methods.ds_zero.program import FP32_BYTES
from methods.graph import Graph, capture_config, capture_priced

GIB = 2**30
# What a hap device holds at the start of backward per parameter byte: the parameter and Adam's
# two moments (methods.hap.pricing.ADAM_STATE_PER_PARAM); its gradients only add.
HAP_STATE_PER_PARAM = 3.0


def param_bytes(graph: Graph) -> float:
    """Bytes of the parameters some op of `graph` reads, each once."""
    used = {i for node in graph.nodes if node.kind != "output" for i in node.inputs}
    return float(sum(n.nbytes for n in graph.nodes if n.is_param and n.name in used))


def activation_bytes(graph: Graph) -> float:
    """Bytes autograd keeps from forward for backward in `graph` (its recompute as it is)."""
    return float(sum(f * graph[t].nbytes for t, (f, _) in graph.kept_until().items()))


def oom_floor(auto, cand: Candidate, workload: Workload, cluster: ClusterSpec) -> str | None:
    """Why `cand` cannot fit `cluster` (memory as budgeted), in one line, where its floor shows
    it; None where the floor does not (module docstring)."""
    if cand.part == "deepspeed":
        return _zero_floor(auto, cand, workload, cluster)
    if cand.part == "hap":
        return _hap_floor(auto, cand, workload, cluster)
    return None


def _limits(cluster: ClusterSpec) -> list[float]:
    """Each device's memory (GiB) in the order the search pairs it with a plan's peaks."""
    return [d.type.memory_gib for d in cluster.devices]


def zero_floor_gib(auto, cand: Candidate, workload: Workload, cluster: ClusterSpec) -> float:
    """What every device holds of a ZeRO-1 or ZeRO-2 plan of `cand` at least, GiB, for a model
    without experts: whole parameters, whole gradients (ZeRO-1) or a 1/n share (ZeRO-2), and
    the gradient reduce bucket at its configured size."""
    params = param_bytes(capture_config(workload.model_cfg, workload.global_batch))
    grads = params if ZERO_STATES[cand.state] == 1 else params / cluster.num_devices
    bucket = make_part(auto, cand).reduce_bucket_size * FP32_BYTES
    return (params + grads + bucket) / GIB


def _zero_floor(auto, cand: Candidate, workload: Workload, cluster: ClusterSpec) -> str | None:
    if getattr(workload.model_cfg, "num_experts", None):
        return None  # DeepSpeed's expert parallelism spreads the experts over the devices
    floor = zero_floor_gib(auto, cand, workload, cluster)
    least = min(_limits(cluster))
    if floor <= least:
        return None
    return (
        f"its parameters, gradients and reduce bucket alone are {floor:.1f} GiB on every device (floor, not planned), "
        f"more than the smallest device's {least:g} GiB"
    )


def hap_floor_gib(auto, cand: Candidate, workload: Workload, cluster: ClusterSpec) -> list[tuple[str, float, float]]:
    """(level, floor of the devices' peaks summed, their memory summed as the search pairs it),
    GiB, per level hap plans `cand` at (module docstring)."""
    hap = make_part(auto, cand)
    graph = capture_priced(
        workload.model_cfg, workload.global_batch, workload.precision, cluster.device, capture_batch_norm(workload)
    )
    graph = graph.with_recompute([u.nodes for u in hap.tools.units(graph)])
    state = HAP_STATE_PER_PARAM * param_bytes(graph)
    acts = activation_bytes(graph) / cand.grad_accumulation
    levels = ["machine", "gpu"] if both_levels(hap, cluster) else [cluster.virtual_device]
    limits = _limits(cluster)
    out = []
    for level in levels:
        vdevs = virtual_devices(cluster, level)
        gpus = max(v.num_gpus for v in vdevs)
        out.append((level, (state + acts / gpus) / GIB, sum(limits[v.index] for v in vdevs)))
    return out


def hap_gpus_only(auto, cand: Candidate, workload: Workload, cluster: ClusterSpec) -> bool:
    """Whether hap would plan `cand` over machines and over GPUs, and only the GPUs' floor is
    within memory: a plan over memory never wins over one that fits (`HapPlanner`'s `_better`),
    so the machines' need not be planned."""
    if cand.part != "hap" or workload.global_batch % cand.grad_accumulation:
        return False
    if not both_levels(make_part(auto, cand), cluster):
        return False
    within = [level for level, floor, memory in hap_floor_gib(auto, cand, workload, cluster) if floor <= memory]
    return within == ["gpu"]


def both_levels(hap, cluster: ClusterSpec) -> bool:
    """Whether `hap` (a HapPlanner) plans over machines and over GPUs on `cluster` (as its _plan)."""
    return hap.levels == "both" and cluster.num_machines < cluster.num_devices


def _hap_floor(auto, cand: Candidate, workload: Workload, cluster: ClusterSpec) -> str | None:
    if workload.global_batch % cand.grad_accumulation:
        return None  # hap refuses it itself
    levels = hap_floor_gib(auto, cand, workload, cluster)
    if any(floor <= memory for _, floor, memory in levels):
        return None
    said = "; ".join(
        f"over {level}s at least {floor:.1f} GiB, more than their {memory:g} GiB" for level, floor, memory in levels
    )
    return f"its devices' peaks summed (floor, not planned): {said}"
