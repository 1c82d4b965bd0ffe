"""torch.distributed.pipelining's schedules traced: the actions (bench.cost.pipeline.ACTIONS) a
schedule makes each stage run in one step, recorded from torch's own `_step_microbatches` on a
stand-in stage, so the planner prices the calls the runtime makes, in their order. It runs no
model and sends nothing."""

from __future__ import annotations

import itertools


# -- the schedule, traced ------------------------------------------------------------------------
class _Op:
    """Stands in for a dist.P2POp: what it moves and which way."""

    def __init__(self, direction: str, what: str, mb: int):
        self.direction, self.what, self.mb = direction, what, mb
        self.op, self.peer, self.group, self.tag, self.group_peer, self.tensor = None, 0, None, 0, 0, None


class _TracedStage:
    """Stands in for a PipelineStage: records what the schedule asks of it."""

    def __init__(self, index: int, num_stages: int, log_: list):
        self.stage_index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.has_backward = True
        self.submod = None
        self.log = log_

    def clear_runtime_states(self) -> None:
        pass

    def get_fwd_recv_ops(self, mb: int) -> list:
        return [] if self.is_first else [_Op("recv", "act", mb)]

    def get_fwd_send_ops(self, mb: int) -> list:
        return [] if self.is_last else [_Op("send", "act", mb)]

    def get_bwd_recv_ops(self, mb: int) -> list:
        return [] if self.is_last else [_Op("recv", "grad", mb)]

    def get_bwd_send_ops(self, mb: int) -> list:
        return [] if self.is_first else [_Op("send", "grad", mb)]

    def forward_one_chunk(self, mb: int, *args, **kwargs):
        self.log.append(("F", mb))

    def backward_one_chunk(self, mb: int, loss=None, full_backward: bool = True, last_backward: bool = False):
        self.log.append(("B", mb))

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        pass


_traces: dict[tuple[str, int, int, int], tuple[tuple, ...]] = {}


def trace_schedule(schedule: str, num_stages: int, num_micro_batches: int, stage: int) -> tuple[tuple, ...]:
    """The actions (bench.cost.pipeline.ACTIONS) torch's schedule makes stage `stage` of
    `num_stages` run in one step of `num_micro_batches`: its `_step_microbatches` run on a
    stand-in stage, with the module's batching of point-to-point calls recorded instead of
    made. Cached per argument."""
    key = (schedule, num_stages, num_micro_batches, stage)
    if key in _traces:
        return _traces[key]
    from unittest import mock

    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining import schedules as torch_schedules

    events: list[tuple] = []
    ids = itertools.count()

    def batch_p2p(ops, desc=None):
        works = []
        for op in ops:
            ident = next(ids)
            events.append((op.direction, ident, op.what, op.mb))
            works.append(ident)
        return works

    def sorted_batch_p2p(ops, desc=None):
        return {0: batch_p2p(ops)} if ops else {}

    def wait_batch_p2p(works):
        if works:
            events.append(("wait", tuple(works)))

    fake = _TracedStage(stage, num_stages, events)
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    with (
        mock.patch.object(torch_schedules, "_batch_p2p", batch_p2p),
        mock.patch.object(torch_schedules, "_sorted_batch_p2p", sorted_batch_p2p),
        mock.patch.object(torch_schedules, "_wait_batch_p2p", wait_batch_p2p),
    ):
        sched = cls(fake, num_micro_batches, loss_fn=lambda out, target: None, scale_grads=False)
        sched._initialize_stage = lambda *args, **kwargs: None
        m = num_micro_batches
        sched._step_microbatches([()] * m, [{}] * m, [None] * m, None, return_outputs=False)
    _traces[key] = tuple(events)
    return _traces[key]
