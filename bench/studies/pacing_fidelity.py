"""The emulator's dilation check: achieved slow-down against 1/speed, in one worker process.

The library behind `bench.dilation` (usage there). Tiny BERT trains through the real worker
path at speed 1, s, 1 for each speed s, all paced against one full-pace reference measured
first; the achieved dilation is the median at s over the mean of its speed-1 neighbours,
times s. What remains off 1.0 is the emulator's own error (sleep overshoot, compute that
outran its target, time in the step that pacing does not see).
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import torch.multiprocessing as mp

SPEEDS = (0.25, 0.4, 0.5)


GOAL = 0.03  # within 3% of 1/speed


def _case(speed: float, overrides: tuple[str, ...] = (), reference: tuple[float, ...] | None = None):
    from bench.runner.case import new_record, prepare_case
    from bench.runner.configs import compose_settings

    cfg = compose_settings(
        "model=bert",
        "preset=tiny",
        "cluster=local_homo2",
        "~cluster.machines",
        f"+cluster.machines=[{{count: 1, device: cpu, num_devices: 1, speed: {speed}}}]",
        "warmup_iters=3",
        "measured_iters=20",
        "wandb.mode=disabled",
        *overrides,
    )
    case = prepare_case(cfg, new_record(cfg))
    return dataclasses.replace(case, emulation=dataclasses.replace(case.emulation, reference=reference))


def _worker(speeds, port, out, overrides=()) -> None:
    from bench.runtime.worker import run_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # The first case measures the device's full-pace reference; every case after is paced
    # against that same one, as one emulated device would be however the host drifts.
    reference = tuple(run_rank(_case(1.0, overrides), 0, 1, 0)["emulation"]["reference_s"])
    cases = {s: _case(s, overrides, reference) for s in {1.0, *speeds}}

    def median_iter(speed):
        result = run_rank(cases[speed], 0, 1, 0)
        return statistics.median(result["iter_times_s"][-cases[speed].measured_iters :])

    before = median_iter(1.0)
    for s in speeds:
        slow = median_iter(s)
        after = median_iter(1.0)
        out.put((s, slow * s / ((before + after) / 2)))
        before = after


def measure(speeds=SPEEDS, overrides: tuple[str, ...] = ()) -> dict[float, float]:
    """One run: {speed: achieved dilation x speed} from one worker process."""
    from bench.runtime.launch import _free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(tuple(speeds), _free_port(), out, tuple(overrides)))
    proc.start()
    try:
        return dict(out.get(timeout=300) for _ in speeds)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
