"""Where a pipeline rank's CPU time goes in one training step, against what its plan prices.

What it does: plans `method=pipeline` for a case (mode=sim, so the plan is the one a run of the
case would train), runs the pipeline's real trainer on one process per device (gloo, pinned to
cores as the workers are, emulation off: every rank at full pace, as the pacing reference
runs), and times per step in thread CPU time: the stages' forward and backward chunks
(torch.distributed.pipelining's forward_one_chunk / backward_one_chunk), the loss, the
schedule's point-to-point batches and waits, Adam, and the schedule's own work between them
(the rest of `schedule.step`). Beside it, the layer groups' profile (methods.pipeline.profile)
taken again now, summed per stage: what the plan prices a chunk at on this host now. Each
figure is the fastest of the steps after the first five. What it doesn't do: price or pace
anything; it is a diagnostic of what the plan's compute leaves out (docs/cost-model.md,
"Pipelines").

    python scripts/pipeline_step_parts.py model=bert cluster=local_homo2
    python scripts/pipeline_step_parts.py model=vit cluster=local_hetero2 method.schedule=1f1b
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS, SKIP = 25, 5


def _timed(record: list, fn):
    def wrapped(*args, **kwargs):
        start = time.thread_time()
        out = fn(*args, **kwargs)
        record.append(time.thread_time() - start)
        return out

    return wrapped


def _rank(rank: int, world: int, port: int, case, out) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining import stage as stage_module

    from bench.core.interfaces import RankContext
    from bench.runtime.emulation import Emulator
    from bench.runtime.hostcpu import pin_to_core

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    pin_to_core(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parts: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "p2p", "loss", "adam", "schedule", "step")}
    base = stage_module._PipelineStageBase
    base.forward_one_chunk = _timed(parts["forward"], base.forward_one_chunk)
    base.backward_one_chunk = _timed(parts["backward"], base.backward_one_chunk)
    for name in ("_batch_p2p", "_wait_batch_p2p"):
        setattr(schedules, name, _timed(parts["p2p"], getattr(schedules, name)))
    ctx = RankContext(
        rank, world, torch.device("cpu"), case.cluster, case.workload, Emulator(case.cluster, rank, enabled=False)
    )
    trainer = case.method.setup(case.plan, case.workload.build(case.seed), ctx)
    trainer.optimizer.step = _timed(parts["adam"], trainer.optimizer.step)
    trainer.schedule.step = _timed(parts["schedule"], trainer.schedule.step)
    trainer.schedule._loss_fn = _timed(parts["loss"], trainer.schedule._loss_fn)
    data = case.workload.model_cfg.dataset("synthetic", None, "train", case.seed)
    start, stop = case.plan.data_slices[rank]
    per_step = []
    for step in range(STEPS):
        marks = {k: len(v) for k, v in parts.items()}
        began = time.thread_time()
        trainer.step(data.batch(step, start, stop, case.workload.global_batch))
        parts["step"].append(time.thread_time() - began)
        per_step.append({k: sum(v[marks[k] :]) for k, v in parts.items()})
    kept = per_step[SKIP:]
    best = {k: min(s[k] for s in kept) for k in parts}
    best["schedule_own"] = min(s["schedule"] - s["forward"] - s["backward"] - s["p2p"] - s["loss"] for s in kept)
    best["actions"] = (len(parts["forward"]) + len(parts["backward"])) / STEPS
    out.put((rank, best))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    from bench.runner.case import new_record, prepare_case
    from bench.runner.configs import compose_settings
    from bench.runtime.launch import forking_context
    from methods.pipeline.profile import _measure_groups

    cfg = compose_settings("mode=sim", "method=pipeline", "logger=none", *argv)
    case = prepare_case(cfg, new_record(cfg))
    program = case.plan.program
    print(
        f"plan: {program.schedule}, {program.num_micro_batches} micro-batches of {list(program.micro_batches)}, "
        f"stages {[st.groups for st in program.stages]} on positions {list(program.stage_rank)}"
    )
    fresh = _measure_groups(case.workload, program.micro_batches[0], case.seed, 9)
    m = program.num_micro_batches
    world = case.cluster.num_devices
    ctx = forking_context()
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, case, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join()
    print("ms a step, the fastest of the kept steps (thread CPU time); profile: the groups timed now, summed")
    for rank in sorted(got):
        position = next(r for r in range(program.num_ranks) if rank in program.position_ranks(r))
        mine = [st for st, x in zip(program.stages, program.stage_rank) if x == position]
        profile = {
            kind: m * sum(sum(fresh[kind][st.groups[0] : st.groups[1]]) for st in mine)
            for kind in ("forward", "backward")
        }
        b = got[rank]
        print(
            f"rank {rank}: step {b['step'] * 1e3:.2f} | forward {b['forward'] * 1e3:.2f} (profile {profile['forward'] * 1e3:.2f})"
            f" | backward {b['backward'] * 1e3:.2f} (profile {profile['backward'] * 1e3:.2f}) | loss {b['loss'] * 1e3:.2f}"
            f" | p2p {b['p2p'] * 1e3:.2f} | adam {b['adam'] * 1e3:.2f} | schedule's own {b['schedule_own'] * 1e3:.2f}"
            f" over {b['actions']:.0f} chunks ({b['schedule_own'] / b['actions'] * 1e3:.3f} each)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
