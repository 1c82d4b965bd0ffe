"""torch.distributed.pipelining's schedules traced: the actions (bench.cost.pipeline.ACTIONS) a
schedule makes each position of a pipeline run in one step, recorded from torch's own
`_step_microbatches` on stand-in stages, so the planner prices the calls the runtime makes, in
their order, and where torch places each stage (its stage-to-rank map: looped for the
interleaved schedules, a V for ZBV and DualPipeV). It runs no model and sends nothing.
What torch traced is kept on disk (save_traces), so that a later process plans a shape it has
seen without importing torch.distributed.pipelining (about a second: it imports dynamo and
DTensor)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from bench.core.errors import ConfigError
from bench.core.kept_json import KeptJson
from bench.cost.pipeline import COMPUTE, MULTI_STAGE, SCHEDULES


def schedule_class(name: str):
    """torch's class for a schedule name (torch's get_schedule_class, which ignores case)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    return get_schedule_class(name)


def is_multi_stage(name: str) -> bool:
    """Whether torch's schedule runs several stages per rank (a PipelineScheduleMulti): read
    from bench.cost.pipeline.MULTI_STAGE for the schedules this method runs, from torch's class
    for any other."""
    if name in SCHEDULES:
        return name in MULTI_STAGE
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return issubclass(schedule_class(name), PipelineScheduleMulti)


def check_schedule(name: str) -> None:
    """`name` is "auto" or a schedule this method runs; else one line naming the known ones."""
    if name == "auto" or name in SCHEDULES:
        return
    from torch.distributed.pipelining.schedules import get_schedule_class

    try:
        get_schedule_class(name)
        what = "is torch's, but not one this method runs"
    except ValueError:
        what = "is not a schedule torch.distributed.pipelining has"
    raise ConfigError(f"method.schedule={name!r} {what}; use auto or one of {', '.join(SCHEDULES)}")


# -- the schedule, traced ------------------------------------------------------------------------
class _Op:
    """Stands in for a dist.P2POp: what it moves, which way, for which stage."""

    def __init__(self, direction: str, what: str, stage: int, mb: int):
        self.direction, self.what, self.stage, self.mb = direction, what, stage, mb
        self.op, self.peer, self.group, self.tag, self.group_peer, self.tensor = None, 0, None, 0, 0, None


class _TracedStage:
    """Stands in for a PipelineStage: records what the schedule asks of it."""

    def __init__(self, index: int, num_stages: int, group_size: int, group_rank: int, log_: list):
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = group_size, group_rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.has_backward = True
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.log = log_

    def clear_runtime_states(self) -> None:
        pass

    def get_fwd_recv_ops(self, mb: int) -> list:
        return [] if self.is_first else [_Op("recv", "act", self.stage_index, mb)]

    def get_fwd_send_ops(self, mb: int) -> list:
        return [] if self.is_last else [_Op("send", "act", self.stage_index, mb)]

    def get_bwd_recv_ops(self, mb: int) -> list:
        return [] if self.is_last else [_Op("recv", "grad", self.stage_index, mb)]

    def get_bwd_send_ops(self, mb: int) -> list:
        return [] if self.is_first else [_Op("send", "grad", self.stage_index, mb)]

    def forward_one_chunk(self, mb: int, *args, **kwargs):
        self.log.append(("F", self.stage_index, mb))

    def backward_one_chunk(self, mb: int, loss=None, full_backward: bool = True, last_backward: bool = False):
        self.log.append(("B" if full_backward else "I", self.stage_index, mb))

    def backward_weight_one_chunk(self, mb: int, last_backward: bool = False):
        self.log.append(("W", self.stage_index, mb))

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        pass

    def set_local_fwd_input(self, output, mb: int) -> None:
        pass

    def set_local_bwd_input(self, grads, mb: int) -> None:
        pass

    def get_local_bwd_output(self, mb: int):
        return None


@dataclass(frozen=True)
class Trace:
    """One position's actions in one step, and where torch places every stage."""

    actions: tuple[tuple, ...]
    stage_rank: tuple[int, ...]  # the position of each stage (torch's stage_index_to_group_rank)
    stages: tuple[int, ...]  # the stages this position holds, in order


class ScheduleRefused(ValueError):
    """torch's schedule does not run this shape (its own check's message)."""


_traces: dict[tuple, tuple[Trace, ...]] = {}


def trace_schedule(schedule: str, num_ranks: int, num_micro_batches: int, position: int, stages_per_rank: int = 1):
    """What torch's `schedule` makes position `position` of a pipeline of `num_ranks` ranks
    (`stages_per_rank` stages each) run in one step of `num_micro_batches` (a Trace): its
    `_step_microbatches` run on stand-in stages, with the module's batching of point-to-point
    calls recorded instead of made. Cached per argument.

    Raises:
        ScheduleRefused: where torch refuses the shape (its message).
    """
    key = (schedule, num_ranks, num_micro_batches, stages_per_rank)
    if key not in _traces:
        found = _kept("trace", key, lambda *k: tuple((t.actions, t.stage_rank, t.stages) for t in _trace(*k)))
        _traces[key] = found if isinstance(found, ScheduleRefused) else tuple(Trace(*t) for t in found)
    found = _traces[key]
    if isinstance(found, ScheduleRefused):
        raise found
    return found[position]


def _trace(schedule: str, R: int, m: int, V: int) -> tuple[Trace, ...]:
    """Every position's Trace (trace_schedule). A schedule lowers every rank's actions when
    made; each position's step then runs on its own stand-ins."""
    import contextlib
    from unittest import mock

    from torch.distributed.pipelining import schedules as torch_schedules

    multi = is_multi_stage(schedule)
    if multi != (V > 1):
        raise ScheduleRefused(f"{schedule} runs {'several stages' if multi else 'one stage'} per rank, not {V}")
    events: list[tuple] = []
    ids = [itertools.count()]  # per position

    def batch_p2p(ops, desc=None):
        works = []
        for op in ops:
            ident = next(ids[0])
            events.append((op.direction, ident, op.what, op.stage, op.mb))
            works.append(ident)
        return works

    def sorted_batch_p2p(ops, desc=None):
        return {0: batch_p2p(ops)} if ops else {}

    def wait_batch_p2p(works):
        if works:
            events.append(("wait", tuple(works)))

    cls = schedule_class(schedule)
    K = R * V
    out = []
    with (
        mock.patch.object(torch_schedules, "_batch_p2p", batch_p2p),
        mock.patch.object(torch_schedules, "_sorted_batch_p2p", sorted_batch_p2p),
        mock.patch.object(torch_schedules, "_wait_batch_p2p", wait_batch_p2p),
        # the profiler's labels around each action record nothing here
        mock.patch.object(torch_schedules, "record_function", lambda *args: contextlib.nullcontext()),
    ):
        try:
            if multi:
                # Which stages a position holds is torch's to say (the V schedules move them).
                sched = cls(
                    [_TracedStage(R * v, K, R, 0, []) for v in range(V)], m, loss_fn=_no_loss, scale_grads=False
                )
                sched._initialize_stages = lambda *args, **kwargs: None
                placed = dict(sched.stage_index_to_group_rank)
            else:
                placed = {k: k for k in range(K)}
                # Made once for every position, without the table of all the ranks' actions
                # (R x m of them) torch's single-stage __init__ lays out: their steps never read it.
                with mock.patch.object(cls, "_get_pipeline_order", lambda self: None):
                    sched = cls(_TracedStage(0, R, R, 0, events), m, loss_fn=_no_loss, scale_grads=False)
                sched._initialize_stage = lambda *args, **kwargs: None
            for r in range(R):
                events.clear()
                ids[0] = itertools.count()
                mine = [k for k in range(K) if placed[k] == r]
                if multi:
                    sched._stages = [_TracedStage(k, K, R, r, events) for k in mine]
                    sched.rank = r
                else:
                    sched._stage = _TracedStage(r, R, R, r, events)
                sched._step_microbatches([()] * m, [{}] * m, [None] * m, None, return_outputs=False)
                out.append(Trace(tuple(events), tuple(placed[k] for k in range(K)), tuple(mine)))
        except (ValueError, AssertionError, RuntimeError, KeyError, IndexError) as exc:
            raise ScheduleRefused(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    return tuple(out)


_orders: dict[tuple, tuple[tuple[tuple, ...], ...] | ScheduleRefused] = {}


def compute_order(schedule: str, num_ranks: int, num_micro_batches: int, stages_per_rank: int = 1):
    """Per position, the forwards and backwards alone (("F" | "B" | "I" | "W", stage, mb), in
    the order trace_schedule records them), and the position of each stage: for the planner's
    memory check of many shapes. A multi-stage schedule's order is torch's compute-only
    pipeline_order (the one its lowering to communication keeps, read here without lowering
    it: that lowering is the trace's cost); a single-stage one's is its trace's. Cached.

    Raises:
        ScheduleRefused: where torch refuses the shape when it makes the schedule.
    """
    key = (schedule, num_ranks, num_micro_batches, stages_per_rank)
    if key not in _orders:
        if _untraced(*key):
            _orders[key] = _untraced_order(*key)
        else:
            _orders[key] = _kept("order", key, _compute_order)
    found = _orders[key]
    if isinstance(found, ScheduleRefused):
        raise found
    return found


def _untraced(schedule: str, R: int, m: int, V: int) -> bool:
    """Shapes whose order is known without torch: GPipe's and 1F1B's on one stage a rank (where
    torch runs them)."""
    return V == 1 and (schedule == "gpipe" or (schedule == "1f1b" and m >= R))


def _untraced_order(schedule: str, R: int, m: int, V: int):
    return tuple(_single_stage_order(schedule, R, m, r) for r in range(R)), tuple(range(R))


def _compute_order(schedule: str, R: int, m: int, V: int):
    if not is_multi_stage(schedule):
        traces = [trace_schedule(schedule, R, m, r, V) for r in range(R)]
        return tuple(tuple(a for a in t.actions if a[0] in COMPUTE) for t in traces), traces[0].stage_rank
    from unittest import mock

    from torch.distributed.pipelining import schedules as torch_schedules

    if V < 2:
        raise ScheduleRefused(f"{schedule} runs several stages per rank, not {V}")
    cls = schedule_class(schedule)
    K = R * V
    runtime = torch_schedules._PipelineScheduleRuntime
    with mock.patch.object(runtime, "_prepare_schedule_with_comms", lambda self, actions, format="compute_only": None):
        try:
            sched = cls([_TracedStage(R * v, K, R, 0, []) for v in range(V)], m, loss_fn=_no_loss, scale_grads=False)
        except (ValueError, AssertionError, RuntimeError, KeyError, IndexError) as exc:
            raise ScheduleRefused(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    orders, placed = [], {}
    for r in range(R):
        mine = []
        for a in sched.pipeline_order[r]:
            for sub in (a.sub_actions or ()) if a is not None and a.sub_actions else (a,):
                if sub is not None and sub.computation_type.value in COMPUTE:
                    mine.append((sub.computation_type.value, sub.stage_index, sub.microbatch_index))
                    placed[sub.stage_index] = r
        orders.append(tuple(mine))
    return tuple(orders), tuple(placed[k] for k in range(K))


def _single_stage_order(schedule: str, R: int, m: int, r: int) -> tuple[tuple, ...]:
    """Position r's forwards and backwards under torch's GPipe (every forward, then every
    backward) or 1F1B (min(m, R - r) forwards, then a backward and a forward in turn until the
    forwards are done, then the backwards left), as its `_step_microbatches` calls them: the
    trace's, without tracing (tests/unit/test_pipeline_plan.py checks them against it)."""
    if schedule == "gpipe":
        return tuple(("F", r, i) for i in range(m)) + tuple(("B", r, i) for i in range(m))
    warmup = min(m, R - r)
    out = [("F", r, i) for i in range(warmup)]
    f = warmup
    for b in range(m):
        out.append(("B", r, b))
        if f < m:
            out.append(("F", r, f))
            f += 1
    return tuple(out)


def _no_loss(output, target):
    return None


# -- what torch traced, kept on disk ---------------------------------------------------------------
# A trace of more values than this is traced again by each process: its entry would cost more to
# read than to trace.
KEPT_MAX_VALUES = 100_000
# One file per torch version and version of this module: the traces are torch's schedules.
_KEPT = KeptJson("schedules", __file__, "schedule trace cache")
_unsaved: dict[str, dict] = {}


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _at_most(value, limit: int) -> bool:
    """Whether `value` (nested lists and tuples) holds at most `limit` values, counted until
    they pass it."""
    count, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(v)
        else:
            count += 1
            if count > limit:
                return False
    return True


def _kept(kind: str, key: tuple, make):
    """`make(*key)` (nested tuples of JSON values), or the ScheduleRefused it raised: as a
    process kept it on disk, else made (and kept, up to KEPT_MAX_VALUES values)."""
    text = json.dumps([kind, *key])
    entry = _unsaved.get(text) or _KEPT.load().get(text)
    if isinstance(entry, dict) and "refused" in entry:
        return ScheduleRefused(str(entry["refused"]))
    if isinstance(entry, dict) and isinstance(entry.get("found"), (list, tuple)):
        return _tuples(entry["found"])  # a list as read back; this process's own is kept as made
    try:
        made = make(*key)
    except ScheduleRefused as exc:
        _unsaved[text] = {"refused": str(exc)}
        return exc
    if _at_most(made, KEPT_MAX_VALUES):
        _unsaved[text] = {"found": made}  # JSON writes its tuples as lists
    return made


def save_traces() -> None:
    """Keep the traces this process made on disk, beside those other processes kept
    (bench.core.kept_json)."""
    if _KEPT.save(_unsaved):
        _unsaved.clear()
