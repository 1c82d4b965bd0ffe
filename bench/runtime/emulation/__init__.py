"""Emulated heterogeneity on one host: slow devices sleep, links take their declared time.

Compute is paced against a reference, in a closed loop. A burst of compute that follows a
pause (a sleep, a wait on a peer, even a spin) runs slower on a shared VM core than the same
burst run back to back (docs/emulation.md, "Pacing compute against a reference"). So
a rank never stretches the compute it just measured; it first runs `reference_iters`
iterations at full pace and records how long each compute interval of an iteration took (the
k-th interval between communication points, the fastest of those iterations). From then on the
k-th interval must last reference_k / (speed x headroom) of wall time: the rank sleeps what is
left, and whatever it over- or undershoots is carried into the next interval (links are emulated
from then on, not while the reference is measured). A rank that waited on its peers through
its reference iterations measured cold bursts: it divides its reference by how much slower a
plain step runs after such a pause (Emulator.discount_reference). `headroom` < 1
runs the whole emulated cluster in slow motion (links too), so that even a speed-1 rank has
time to absorb a slowed-down burst; reported times are emulated time (wall x headroom).

Links: every torch.distributed collective takes at least the alpha-beta time of the emulated link
(bench.cost), stretched by 1 / headroom, counted from the moment its last member arrived (the
ranks of one host note when they issue each collective on a board in shared memory); back-to-back
collectives queue on one link clock.
Real GPUs run with emulation off. An emulated cluster on a GPU (`cluster.device: cuda`) paces
links only (`pace_compute=False`): its ranks' compute runs real kernels at their MPS share of the
GPU (bench.runtime.mps), at headroom 1, and `measure_matmul_flops` checks the speed each rank achieved.

The package by concern: options.py (the `emulation` options), emulator.py (the Emulator: compute
paced against its reference), link_clock.py (the emulated links and the wrapped collectives), board.py
(the arrival board in shared memory), gpu.py (ranks sharing one GPU under MPS: their matmul probe
and achieved speeds) and readings.py (what a row's emulation record says). Its public names are
importable from here.
"""

from bench.runtime.emulation.board import ArrivalBoard
from bench.runtime.emulation.emulator import Emulator
from bench.runtime.emulation.gpu import achieved_speeds, measure_matmul_flops
from bench.runtime.emulation.options import (
    DILATION_TOLERANCE,
    MAX_PAUSE_PENALTY,
    PAUSE_PROBE_MIN_SHARE,
    EmulationSettings,
)
from bench.runtime.emulation.readings import emulated_compute_s, links_ok, pooled_compute_s

__all__ = [
    "DILATION_TOLERANCE",
    "MAX_PAUSE_PENALTY",
    "PAUSE_PROBE_MIN_SHARE",
    "ArrivalBoard",
    "EmulationSettings",
    "Emulator",
    "achieved_speeds",
    "emulated_compute_s",
    "links_ok",
    "measure_matmul_flops",
    "pooled_compute_s",
]
