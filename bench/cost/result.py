"""What the simulator says of one iteration: time per stage, memory, OOM (bench.cost.simulate).

A plain record; nothing here prices anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SimResult:
    iter_time_s: float
    stage_times: list[tuple[float, float]]  # (comm_s, compute_s) per stage
    comm_time_s: float  # sum over stages, before overlap
    compute_time_s: float  # sum over stages of the slowest device's compute
    per_step_s: float  # charged once after the stages (bench.cost.price.per_step_s)
    memory_gib: list[dict[str, float]]  # per virtual device, per GPU of it: params, grads, ...
    peak_mem_gib: list[float]  # per virtual device, per GPU
    oom: bool
    oom_devices: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "predicted_iter_time_s": self.iter_time_s,
            "comm_time_s": self.comm_time_s,
            "compute_time_s": self.compute_time_s,
            "peak_mem_gib": self.peak_mem_gib,
            "oom": self.oom,
            "oom_devices": self.oom_devices,
        }
