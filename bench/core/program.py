"""The method-neutral Program: one training iteration as a sequence of stages for the simulator.

A stage is a list of collectives followed by computation; every per-device quantity (bytes,
FLOPs, memory) is an `Affine` function of the sharding ratios, so the same object feeds the load
balancer's LP and the simulator. It describes cost only: it cannot be executed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

# Collective kinds a stage may hold. `nbytes` of a Collective is always per device:
#   all_reduce:     the full buffer each device holds (usually a constant),
#   all_gather:     the device's shard of the gathered output,
#   reduce_scatter: the device's shard of the output (the input is the full tensor),
#   all_to_all:     the device's local input buffer,
#   reshard:        the whole tensor (a constant): a Gather'd tensor whose shards move from
#                   one segment's ratio row to another's (`rows`), see reshard_fractions.
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "reshard")


# "ring": the library's own algorithm (all_reduce). "padded": uneven shards padded to the
# largest (NCCL all-gather / reduce-scatter need equal sizes). "grouped": one broadcast (or
# reduce) per device in a group call, no padding, one latency per call.
COLLECTIVE_IMPLS = ("ring", "padded", "grouped")


GRANULARITIES = ("gpu", "machine")


# What a stage's FLOPs are priced by, per device type with a compute profile (bench.core.cluster
# ComputeProfile): dense matmuls, convolutions, and everything else (element-wise, norms,
# softmax, ...). A stage that mixes classes takes the class of most of its FLOPs.
OP_CLASSES = ("matmul", "conv", "other")


_OP_CLASS = {
    "linear": "matmul",
    "matmul": "matmul",
    "bmm": "matmul",
    "addmm": "matmul",
    "mm": "matmul",
    "baddbmm": "matmul",
    "einsum": "matmul",
    "scaled_dot_product_attention": "matmul",
    "conv2d": "conv",
    "conv1d": "conv",
    "conv3d": "conv",
}


def op_class(op: str) -> str:
    """The class (OP_CLASSES) an op's FLOPs are priced by."""
    return _OP_CLASS.get(op, "other")


Ratios = Sequence[Sequence[float]]  # ratios[segment][device], each row sums to 1


@dataclass(frozen=True)
class Affine:
    """const + sum over (segment, coef) of coef * ratio[segment][device], for one device.

    The same expression holds on every device (SPMD); only the device's own ratio differs.
    """

    const: float = 0.0
    coef: tuple[tuple[int, float], ...] = ()

    @staticmethod
    def sharded(value: float, segment: int = 0) -> Affine:
        """`value` split over the devices by the ratios of `segment`."""
        return Affine(0.0, ((segment, float(value)),)) if value else Affine()

    def at(self, ratios: Ratios, device: int) -> float:
        return self.const + sum(c * ratios[s][device] for s, c in self.coef)

    def values(self, ratios: Ratios) -> list[float]:
        return [self.at(ratios, d) for d in range(len(ratios[0]))]

    def __add__(self, other: Affine) -> Affine:
        merged: dict[int, float] = dict(self.coef)
        for s, c in other.coef:
            merged[s] = merged.get(s, 0.0) + c
        return Affine(self.const + other.const, tuple(sorted(merged.items())))

    def scale(self, k: float) -> Affine:
        return Affine(self.const * k, tuple((s, c * k) for s, c in self.coef))

    @property
    def is_constant(self) -> bool:
        return not any(c for _, c in self.coef)

    def to_json(self) -> dict:
        return {"const": self.const, "coef": [[s, c] for s, c in self.coef]}

    @staticmethod
    def from_json(d: dict) -> Affine:
        return Affine(float(d.get("const", 0.0)), tuple((int(s), float(c)) for s, c in d.get("coef", ())))


def affine_sum(items: Iterable[Affine]) -> Affine:
    out = Affine()
    for a in items:
        out = out + a
    return out


@dataclass(frozen=True)
class Collective:
    """One collective call (or one group call) over some of the program's devices."""

    kind: str
    nbytes: Affine  # per device, see COLLECTIVE_KINDS
    impl: str = "ring"
    devices: tuple[int, ...] | None = None  # virtual device indices; None = all
    label: str = ""  # the tensor it moves, for readable plans
    rows: tuple[int, int] | None = None  # reshard only: (from segment, to segment)
    # A parameter gradient all-reduce (not an activation): among machine-level devices its
    # GPUs already hold the machine's sum (Stage.grad_bytes), so only the leaders take part
    # and broadcast the result back (bench.cost.price.hierarchical_steps).
    grad: bool = False

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f"collective kind {self.kind!r} is unknown; known: {', '.join(COLLECTIVE_KINDS)}")
        if self.impl not in COLLECTIVE_IMPLS:
            raise ValueError(f"collective impl {self.impl!r} is unknown; known: {', '.join(COLLECTIVE_IMPLS)}")
        if self.impl == "grouped" and self.kind not in ("all_gather", "reduce_scatter"):
            raise ValueError(f"impl 'grouped' exists for all_gather and reduce_scatter only, not {self.kind}")
        if (self.kind == "reshard") != (self.rows is not None):
            raise ValueError(
                f"a {self.kind} collective {'needs' if self.kind == 'reshard' else 'takes no'} rows "
                "(from segment, to segment)"
            )
        if self.kind == "reshard" and (not self.nbytes.is_constant or self.devices is not None):
            raise ValueError("a reshard moves a whole tensor (constant nbytes) among all devices")
        if self.grad and self.kind != "all_reduce":
            raise ValueError(f"a gradient collective is an all_reduce, not {self.kind}")

    def to_json(self) -> dict:
        out = {
            "kind": self.kind,
            "nbytes": self.nbytes.to_json(),
            "impl": self.impl,
            "devices": list(self.devices) if self.devices is not None else None,
            "label": self.label,
            "rows": list(self.rows) if self.rows is not None else None,
        }
        if self.grad:
            out["grad"] = True
        return out

    @staticmethod
    def from_json(d: dict) -> Collective:
        devices, rows = d.get("devices"), d.get("rows")
        return Collective(
            d["kind"],
            Affine.from_json(d["nbytes"]),
            d.get("impl", "ring"),
            tuple(devices) if devices is not None else None,
            d.get("label", ""),
            (int(rows[0]), int(rows[1])) if rows is not None else None,
            bool(d.get("grad", False)),
        )


def reshard_fractions(src: Sequence[float], dst: Sequence[float]) -> list[float]:
    """Per device, the fraction of a tensor it sends or receives (the larger) when shards laid
    out by ratio row `src` (device i holds the i-th interval of [0, 1]) move to row `dst`.

    Each device keeps the overlap of its old and new interval. What it sends or receives is at
    most |prefix_src(i-1) - prefix_dst(i-1)| + |prefix_src(i) - prefix_dst(i)|, the bound the
    load balancer's LP uses (methods.hap.balance)."""
    out = []
    a0 = b0 = 0.0
    for x, y in zip(src, dst):
        a1, b1 = a0 + x, b0 + y
        kept = max(0.0, min(a1, b1) - max(a0, b0))
        out.append(max(x - kept, y - kept, 0.0))
        a0, b0 = a1, b1
    return out


@dataclass(frozen=True)
class Stage:
    """Collectives, then computation. All devices are synchronised at the start of a stage.

    overlap=True: the collectives run concurrently with the computation issued before them
    (what DDP does with gradient buckets during backward); they still must finish before the
    iteration ends, and a later non-overlapped stage waits for them.
    """

    collectives: tuple[Collective, ...] = ()
    flops: Affine = Affine()  # per device
    overlap: bool = False
    # Bytes of parameter gradients produced by this stage's computation, per device. When a
    # virtual device is a whole machine they are all-reduced inside it (data parallel within
    # the machine) beside the rest of backward, as DDP's buckets are (bench.cost.price).
    grad_bytes: Affine = Affine()
    label: str = ""
    op_class: str = "other"  # what its FLOPs are priced by (OP_CLASSES)
    launches: float = 0.0  # kernels each device launches for it (a profile's fixed cost each)

    def __post_init__(self) -> None:
        if self.op_class not in OP_CLASSES:
            raise ValueError(f"stage op_class {self.op_class!r} is unknown; known: {', '.join(OP_CLASSES)}")

    def to_json(self) -> dict:
        return {
            "collectives": [c.to_json() for c in self.collectives],
            "flops": self.flops.to_json(),
            "overlap": self.overlap,
            "grad_bytes": self.grad_bytes.to_json(),
            "label": self.label,
            "op_class": self.op_class,
            "launches": self.launches,
        }

    @staticmethod
    def from_json(d: dict) -> Stage:
        return Stage(
            tuple(Collective.from_json(c) for c in d.get("collectives", ())),
            Affine.from_json(d.get("flops", {})),
            bool(d.get("overlap", False)),
            Affine.from_json(d.get("grad_bytes", {})),
            d.get("label", ""),
            d.get("op_class", "other"),
            float(d.get("launches", 0.0)),
        )


@dataclass(frozen=True)
class Memory:
    """Bytes each device holds at the peak of an iteration (per virtual device, before a
    machine-level device divides activations among its GPUs)."""

    params: Affine = Affine()
    grads: Affine = Affine()  # every gradient, as the optimizer steps
    optimizer: Affine = Affine()  # Adam: two fp32 moments per parameter
    activations: Affine = Affine()  # everything forward keeps for backward
    # What the framework holds besides: DDP's gradient buckets, a flat copy of every gradient
    # (gradient_as_bucket_view off, its default; docs/cost-model.md, "Memory")
    buckets: Affine = Affine()
    # autocast's casts of the parameters (methods.graph.Graph.param_casts), kept the whole step
    casts: Affine = Affine()
    # (gradients made, activations still kept) at the points of backward where a device's
    # peak may fall (backward_sweep); empty: every gradient beside every activation.
    backward: tuple[tuple[Affine, Affine], ...] = ()
    # The largest parameter tensor's bytes on a device (None: not known): what torch's
    # per-tensor Adam needs beside the resident state (optimizer_step)
    largest_param: Affine | None = None

    def resident(self) -> Affine:
        """What a device holds once backward is done: parameters, gradients, optimizer state,
        buckets, autocast's casts."""
        return self.params + self.grads + self.optimizer + self.buckets + self.casts

    def backward_points(self) -> tuple[tuple[Affine, Affine], ...]:
        """(everything but activations, activations) at each point of backward where the peak
        may fall. Gradients are made as backward goes while the activations it has passed are
        freed: a transformer peaks as backward starts, before any gradient exists, well below
        all of both together (docs/cost-model.md, "Memory")."""
        held = self.params + self.optimizer + self.buckets + self.casts
        return tuple((held + g, a) for g, a in (self.backward or ((self.grads, self.activations),)))

    def optimizer_step(self, foreach: bool = True) -> Affine:
        """What a device holds while Adam steps: the resident state plus its temporaries.
        torch's multi-tensor Adam (its default on a GPU, `foreach`) takes the square root of
        every second moment at once (torch/optim/adam.py, _multi_tensor_adam): one more fp32
        buffer per parameter it updates. Where activations are small this is the peak, about
        the parameter bytes above the resident state plus activations. Its per-tensor Adam (the
        default on CPU) steps one parameter at a time, with two temporaries of that parameter's
        size (the square root, then its quotient); without largest_param, the foreach price.
        Both were measured (docs/cost-model.md, "Memory")."""
        if foreach or self.largest_param is None:
            return self.resident() + self.optimizer.scale(0.5)
        return self.resident() + self.largest_param.scale(2.0)

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            k: getattr(self, k).to_json() for k in ("params", "grads", "optimizer", "activations", "buckets")
        }
        if self.casts != Affine():
            out["casts"] = self.casts.to_json()
        if self.backward:
            out["backward"] = [[g.to_json(), a.to_json()] for g, a in self.backward]
        if self.largest_param is not None:
            out["largest_param"] = self.largest_param.to_json()
        return out

    @staticmethod
    def from_json(d: dict) -> Memory:
        backward = tuple((Affine.from_json(g), Affine.from_json(a)) for g, a in d.get("backward", ()))
        return Memory(**{k: Affine.from_json(v) for k, v in d.items() if k != "backward"}, backward=backward)


def backward_sweep(
    grads: Iterable[tuple[int, Affine]],
    activations: Iterable[tuple[int, Affine]],
    made_before: Affine = Affine(),
    in_flight: Iterable[tuple[int, int, Affine]] = (),
) -> tuple[tuple[Affine, Affine], ...]:
    """Memory.backward of one iteration: (gradients made, activations and activation gradients
    held) as backward passes each forward position, reduced to the points where a device's
    peak may fall.

    Args:
        grads: (position, bytes) per parameter: backward makes its gradient at that position,
            its parameter's last use in forward.
        activations: (position, bytes) per kept tensor: held until backward has passed that
            position, the first op that keeps it.
        made_before: gradient storage that exists before backward starts (buckets the
            gradients accumulate into).
        in_flight: (from, to, bytes) per activation gradient: held while backward is at a
            position from `from` to `to` (methods.graph.Graph.grads_in_flight).

    A point is left out when, coefficient by coefficient, it is at most a mixture of two points
    kept: with ratios >= 0 it is then below one of them for every ratio (the points go on a chain
    like a convex hull's, ordered by gradient bytes). Along a stack of equal layers only the
    first and last layer's points remain.
    """
    made: dict[int, Affine] = {}
    freed: dict[int, Affine] = {}
    arrive: dict[int, Affine] = {}  # gradients backward makes at a position (the `to` of in_flight)
    leave: dict[int, Affine] = {}  # and consumes there (the `from`)
    for pos, b in grads:
        made[pos] = made.get(pos, Affine()) + b
    for pos, b in activations:
        freed[pos] = freed.get(pos, Affine()) + b
    for start, end, b in in_flight:
        arrive[end] = arrive.get(end, Affine()) + b
        leave[start] = leave.get(start, Affine()) + b
    positions = sorted(made.keys() | freed.keys() | arrive.keys() | leave.keys())
    kept, a = [], Affine()
    for pos in positions:  # kept while backward is at pos: what is freed there or before it
        a = a + freed.get(pos, Affine())
        kept.append(a)
    g, flying = made_before, Affine()
    points: list[tuple[Affine, Affine]] = []
    for pos, a in zip(reversed(positions), reversed(kept)):
        g = g + made.get(pos, Affine())
        flying = flying + arrive.get(pos, Affine())
        points.append((g, a + flying))
        if pos in leave:
            flying = flying + leave[pos].scale(-1.0)
    segments = sorted({seg for pair in points for x in pair for seg, _ in x.coef})

    def vector(x: Affine) -> tuple[float, ...]:
        coef = dict(x.coef)
        return (x.const, *(coef.get(seg, 0.0) for seg in segments))

    chain: list[tuple[tuple[float, ...], float, tuple[Affine, Affine]]] = []  # (coefficients, gradient bytes, point)
    for g, a in points:
        gv = vector(g)
        vec, t = gv + vector(a), sum(gv)
        if chain and _at_most(vec, chain[-1][0]):
            continue
        while chain and _at_most(chain[-1][0], vec):
            chain.pop()
        while len(chain) >= 2 and _mixture_covers(chain[-2][:2], (vec, t), chain[-1][:2]):
            chain.pop()
        chain.append((vec, t, (g, a)))
    return tuple(p for _, _, p in chain)


def _at_most(x: Sequence[float], y: Sequence[float]) -> bool:
    return all(a <= b + 1e-9 * max(1.0, abs(b)) for a, b in zip(x, y))


def _mixture_covers(
    lo: tuple[Sequence[float], float], hi: tuple[Sequence[float], float], mid: tuple[Sequence[float], float]
) -> bool:
    """Whether `mid` is at most, coefficient by coefficient, the mixture of `lo` and `hi` with
    its gradient bytes; each is (coefficients, gradient bytes)."""
    (x0, t0), (x1, t1), (x, t) = lo, hi, mid
    if not t0 < t < t1:
        return False
    w = (t - t0) / (t1 - t0)
    return _at_most(x, [(1 - w) * a + w * b for a, b in zip(x0, x1)])


@dataclass(frozen=True)
class Program:
    """One training iteration over `num_devices` virtual devices with `num_segments` ratio rows."""

    stages: tuple[Stage, ...]
    num_devices: int
    num_segments: int = 1
    granularity: str = "gpu"  # what a device of this program is: one GPU or one machine
    memory: Memory = Memory()
    meta: dict = field(default_factory=dict, compare=False)  # JSON-ready notes (method, model)
    # The method's own host work per iteration beside the model's, as FLOPs at the host
    # worker's rate (DeepSpeed's engine on CPU workers, methods.ds_zero.engine_work): priced at
    # each device's FLOP/s like the model's work, once per iteration (bench.cost.price.per_step_s).
    host_work_flops: float = 0.0
    # Samples per micro-step, which the rows split (0: not known): the global batch, or with
    # gradient accumulation (micro_step_stages) its part of it. A machine-level device's GPUs
    # split its share in whole samples, evenly (methods.hap.hierarchy.intra_lengths), so one
    # GPU may hold a sample more than an even split of the share: the price of its compute
    # and activations follows that GPU (bench.cost.price.busiest_gpu_ratios).
    batch: int = 0
    # Forward and backward passes per iteration (gradient accumulation, micro_step_stages): an
    # emulated worker's per-step part, its dispatch of every op, is paid once per micro-step
    # (bench.cost.price.per_step_s).
    micro_steps: int = 1

    def __post_init__(self) -> None:
        if self.micro_steps < 1:
            raise ValueError(f"micro_steps={self.micro_steps} must be >= 1")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity={self.granularity!r} is invalid; use 'gpu' or 'machine'")
        if self.num_devices < 1 or self.num_segments < 1:
            raise ValueError(f"num_devices={self.num_devices} and num_segments={self.num_segments} must be >= 1")
        for i, st in enumerate(self.stages):
            for a in _affines(st):
                for s, _ in a.coef:
                    if not 0 <= s < self.num_segments:
                        raise ValueError(f"stage {i} ({st.label!r}) uses segment {s}; program has {self.num_segments}")
            for c in st.collectives:
                if c.rows is not None and not all(0 <= s < self.num_segments for s in c.rows):
                    raise ValueError(
                        f"stage {i} reshard {c.label!r} uses rows {c.rows}; program has {self.num_segments}"
                    )
                if c.devices is not None and any(not 0 <= d < self.num_devices for d in c.devices):
                    raise ValueError(
                        f"stage {i} collective {c.label!r} names devices {c.devices} outside 0..{self.num_devices - 1}"
                    )

    def total_flops(self, ratios: Ratios) -> float:
        """FLOPs of all devices together (replicated work counts once per device)."""
        return sum(sum(st.flops.values(ratios)) for st in self.stages)

    def check_ratios(self, ratios: Ratios) -> None:
        if len(ratios) != self.num_segments or any(len(r) != self.num_devices for r in ratios):
            raise ValueError(
                f"ratios must be {self.num_segments} rows of {self.num_devices} (segments x devices); "
                f"got {[len(r) for r in ratios]}"
            )
        for s, row in enumerate(ratios):
            if any(r < -1e-9 for r in row) or abs(sum(row) - 1.0) > 1e-6:
                raise ValueError(f"ratios[{s}]={list(row)} must be >= 0 and sum to 1")

    def to_json(self) -> dict:
        return {
            "stages": [st.to_json() for st in self.stages],
            "num_devices": self.num_devices,
            "num_segments": self.num_segments,
            "granularity": self.granularity,
            "memory": self.memory.to_json(),
            "meta": self.meta,
            **({"host_work_flops": self.host_work_flops} if self.host_work_flops else {}),
            **({"batch": self.batch} if self.batch else {}),
            **({"micro_steps": self.micro_steps} if self.micro_steps > 1 else {}),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    @staticmethod
    def from_json(d: dict | str) -> Program:
        if isinstance(d, str):
            d = json.loads(d)
        return Program(
            tuple(Stage.from_json(s) for s in d["stages"]),
            int(d["num_devices"]),
            int(d.get("num_segments", 1)),
            d.get("granularity", "gpu"),
            Memory.from_json(d.get("memory", {})),
            dict(d.get("meta", {})),
            float(d.get("host_work_flops", 0.0)),
            int(d.get("batch", 0)),
            int(d.get("micro_steps", 1)),
        )


def _affines(st: Stage) -> list[Affine]:
    return [st.flops, st.grad_bytes] + [c.nbytes for c in st.collectives]


def bucket_runs(grads: Sequence[tuple[float, object]], cap: float | None) -> list[list[int]]:
    """Gradients grouped into all-reduce buckets, as indices into `grads`: (bytes, kind) in the
    order backward makes them. A bucket holds one kind and closes once it holds `cap` bytes or
    more (None: no cap; <= 0: one bucket per gradient): the gradient that reaches the cap is
    its last, as torch's DDP assigns its buckets (torch.distributed's
    _compute_bucket_assignment_by_size, without its smaller first bucket). The one rule for
    DDP's program (data_parallel_program), hap's runtime (methods.hap.runtime.GradBuckets) and
    the programs it runs (methods.hap.lowering.build_program)."""
    runs: list[list[int]] = []
    size, kind = 0.0, None
    for i, (nbytes, k) in enumerate(grads):
        if not runs or k != kind or (cap is not None and (cap <= 0 or size >= cap)):
            runs.append([])
            size, kind = 0.0, k
        runs[-1].append(i)
        size += nbytes
    return runs


def without_grad_sync(stages: Iterable[Stage]) -> list[Stage]:
    """`stages` as a micro-step runs them when it does not synchronise gradients (DDP's
    no_sync, hap's buckets held back): the parameter gradients' all-reduces (Collective.grad)
    and their sums inside machines (Stage.grad_bytes) left out, and a stage left with nothing
    to do dropped."""
    out = []
    for st in stages:
        kept = tuple(c for c in st.collectives if not c.grad)
        if not kept and st.flops.is_constant and not st.flops.const and not st.launches:
            continue
        out.append(replace(st, collectives=kept, overlap=st.overlap and bool(kept), grad_bytes=Affine()))
    return out


def micro_step_stages(
    stages: Sequence[Stage], micro_steps: int, sync_each: bool = False, labelled: bool = True
) -> tuple[Stage, ...]:
    """The stages of an iteration that accumulates gradients over `micro_steps` forward and
    backward passes, from one micro-step's `stages` (at the micro-batch, its gradient syncs
    included): micro_steps - 1 of them without their gradient syncs (without_grad_sync), then
    `stages`, so the FLOPs add up to the whole batch's, every kernel is launched micro_steps
    times and the gradients are synchronised once. `sync_each`: every micro-step is `stages`
    (FSDP, ZeRO-2/3: gradients reduced, or parameters gathered, at every micro-step).
    `labelled=False`: the micro-steps before the last are the same stage objects, their labels
    not prefixed with the micro-step (the simulator's price does not read labels: for a
    program that is only priced, as a pipeline stage's at hundreds of micro-batches)."""
    if micro_steps < 1:
        raise ValueError(f"micro_steps={micro_steps} must be >= 1")
    if micro_steps == 1:
        return tuple(stages)
    quiet = list(stages) if sync_each else without_grad_sync(stages)
    if not labelled:
        return (*quiet * (micro_steps - 1), *stages)
    out: list[Stage] = []
    for j in range(micro_steps):
        out += [replace(st, label=f"micro-step {j}: {st.label}") for st in (stages if j == micro_steps - 1 else quiet)]
    return tuple(out)
