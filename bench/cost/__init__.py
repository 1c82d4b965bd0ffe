"""The cost model: what a Program costs on a cluster, priced one way for everyone.

    links     alpha-beta time of collectives on one link level (also paces emulated links)
    devices   the virtual devices a plan shards over, and starting ratios
    price     the one price of an iteration (numbers for the simulator and the search,
              LP expressions for the load balancer)
    simulate  time per stage, memory and OOM of a program at given ratios
    pipeline  the price of a pipeline's schedule (stages on their own devices, micro-batches)
    group_pipeline  a pipeline whose stages are each one Program over a group of devices

Callers import from here: `from bench.cost import simulate, virtual_devices, ...`.
"""

from bench.cost.algebra import FloatAlgebra, LpAlgebra, alike
from bench.cost.devices import (
    GIB,
    VirtualDevice,
    compute_proportional_ratios,
    device_classes,
    even_ratios,
    memory_proportional_ratios,
    virtual_devices,
)
from bench.cost.group_pipeline import GroupPipelineProgram, GroupStage
from bench.cost.links import COLLECTIVE_KINDS, collective_linear_cost, collective_time_s, link_bytes
from bench.cost.pipeline import PipelineProgram, PipeStage
from bench.cost.price import (
    collective_cost,
    collective_link,
    collective_time,
    host_time,
    iteration_time,
    stage_time,
)
from bench.cost.simulate import SimResult, simulate

__all__ = [
    "COLLECTIVE_KINDS",
    "GIB",
    "FloatAlgebra",
    "GroupPipelineProgram",
    "GroupStage",
    "LpAlgebra",
    "PipeStage",
    "PipelineProgram",
    "SimResult",
    "VirtualDevice",
    "alike",
    "collective_cost",
    "collective_linear_cost",
    "collective_link",
    "collective_time",
    "collective_time_s",
    "compute_proportional_ratios",
    "device_classes",
    "even_ratios",
    "host_time",
    "iteration_time",
    "link_bytes",
    "memory_proportional_ratios",
    "simulate",
    "stage_time",
    "virtual_devices",
]
