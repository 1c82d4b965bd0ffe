"""Microbenchmarks of this host's devices and transport: compute per op class, collectives per kind.

Compute: op chains over batch sizes on one worker thread (or one CUDA device, timed with CUDA
events), counted as the planner's graph counts them (bench.cost.flops). Collectives: real gloo
(or NCCL) calls between local worker processes, from 4 KB to 64 MB, with even and skewed shards,
padded and grouped all-gather / reduce-scatter. It measures; bench.cost.profiles fits.
"""

from __future__ import annotations

import contextlib
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from bench.cost.flops import ELEMENTWISE_FLOPS
from bench.cost.profiles import fit_entry, view_entry
from bench.runtime.compat import all_gather_single, reduce_scatter_single
from bench.runtime.hostcpu import emulated_device
from bench.runtime.hostspeed import host_probe
from bench.runtime.launch import _free_port, forking_context
from bench.runtime.precision import applied

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


SKEW_SHARES = [None, 0.6, 0.75, 0.9]  # the first rank's share of an all-gather; None = even


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- compute ---------------------------------------------------------------------------------
def _op_classes():
    """(name, inputs, op) per class, sized like the tiny and small models' layers."""
    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, requires_grad=True)

    x, w = leaf(512, 256), leaf(1024, 256)
    img, k = leaf(8, 64, 16, 16), leaf(64, 64, 3, 3)
    q, kt = leaf(32, 64, 32), leaf(32, 32, 64)
    h, ln = leaf(512, 256), torch.nn.LayerNorm(256)
    return [
        ("linear", lambda: F.linear(x, w)),
        ("conv2d", lambda: F.conv2d(img, k, padding=1)),
        ("bmm", lambda: torch.bmm(q, kt)),
        ("layer_norm+gelu", lambda: F.gelu(ln(h))),
    ]


def profile_compute(repeats: int = 20) -> dict[str, dict[str, float]]:
    """Forward+backward speed per op class on one thread (as an emulated worker runs)."""
    out = {}
    with emulated_device():
        for name, op in _op_classes():

            def step(op=op):
                op().sum().backward()

            with FlopCounterMode(display=False) as counter:
                step()
            flops = counter.get_total_flops()
            seconds = _timed(step, repeats)
            out[name] = {"seconds": seconds, "flops": float(flops), "flops_per_s": flops / seconds if flops else None}
    return out


# -- compute profile of a device type (bench.core.device_types.ComputeProfile) ------------------------
CHAIN = 8  # ops per forward+backward call: one autograd run per call, as in a step


def _class_benchmarks(device: str):
    """(op class, kernels per call as the planner counts them, batches, make(batch) -> (call,
    FLOPs)) per class: forward + backward of a chain of CHAIN nn.Linear layers, 3x3
    nn.Conv2d layers, or nn.LayerNorm + nn.GELU pairs (FLOPs counted as the planner's graph
    counts them: bench.cost.flops). A chain, not one op: a training step runs one autograd pass
    over many ops, so the pass's own start-up should not be charged to each kernel; modules
    with biases, not bare functions: the models call modules, and their hosts pay for it."""
    gpu = device != "cpu"
    d, side = (1024, 32) if gpu else (256, 16)
    # On a GPU the largest call takes ~10 ms (the rate); the smallest a few us per kernel
    # (the fixed cost). Rows go to 16,384: a few thousand rows still cost no more than the fixed
    # cost on a large GPU (docs/cost-model.md, "Device types, host speed and profiles").
    batches = (8, 64, 512, 4096, 16384) if gpu else (4, 16, 64, 256)
    g = torch.Generator(device=device).manual_seed(0)
    torch.manual_seed(0)  # the modules' initial weights

    def chain(x, layers, flops):
        net = torch.nn.Sequential(*layers).to(device)
        g_out = torch.ones_like(net(x))
        return (lambda: net(x).backward(g_out)), flops

    def linear(b):
        x = torch.randn(b, d, generator=g, device=device, requires_grad=True)
        return chain(x, [torch.nn.Linear(d, d) for _ in range(CHAIN)], CHAIN * 3 * 2.0 * b * d * d)

    def conv(b):
        n = max(1, b // (64 if gpu else 16))
        x = torch.randn(n, 64, side, side, generator=g, device=device, requires_grad=True)
        return chain(
            x,
            [torch.nn.Conv2d(64, 64, 3, padding=1) for _ in range(CHAIN)],
            CHAIN * 3 * 2.0 * n * 64 * side * side * 64 * 9,
        )

    def other(b):
        x = torch.randn(b, d, generator=g, device=device, requires_grad=True)
        per = ELEMENTWISE_FLOPS["layer_norm"] + ELEMENTWISE_FLOPS["gelu"]
        layers = [m for _ in range(CHAIN) for m in (torch.nn.LayerNorm(d), torch.nn.GELU())]
        return chain(x, layers, CHAIN * 2.0 * per * b * d)  # backward factor 1

    # kernels per link of the chain as the planner counts them: forward 1, backward 2 (input
    # and weight gradients) for linear and conv; layer norm 1 + 2, GELU 1 + 1
    return [
        ("matmul", CHAIN * 3, batches, linear),
        ("conv", CHAIN * 3, batches, conv),
        ("other", CHAIN * 5, batches, other),
    ]


# Views per call of the two view chains: the host's cost of one view call is the slope between.
VIEW_CHAINS = (64, 256)


def _view_chain(device: str, views: int):
    """Forward + backward of a chain of `views` view calls (unsqueeze, squeeze): each runs the
    dispatcher and records an autograd node, whose backward is a view too, and launches no
    kernel. A step calls many (ViT and BERT at paper sizes: about 1,350 of their 3,800 aten
    calls a step, scripts/step-kernels), and the op count that prices the host's queueing
    counts only kernels. The sum and the backward's start are the same in both chains, so the
    slope leaves them out."""
    x = torch.randn(8, 64, device=device, requires_grad=True)

    def call():
        y = x
        for _ in range(views // 2):
            y = y.unsqueeze(0).squeeze(0)
        y.sum().backward()

    return call


GPU_BURST = 10  # calls queued back to back between two CUDA events


def _sleep_cycles_per_s(device: str) -> float:
    """GPU clock cycles per second as torch.cuda._sleep counts them (timed with events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize(device)
    return 10_000_000 / (start.elapsed_time(end) / 1e3)


def _device_timer(device: str, repeats: int, burst: int = GPU_BURST):
    """fn -> (device seconds per call, host seconds per call), medians after warm-up. On the
    CPU both are the wall clock (the host computes). On a GPU: `burst` calls queued back to
    back behind a GPU sleep longer than their queueing, so the events between them time the
    kernels alone, as in a step whose host runs ahead (timed one by one, each call would also
    pay the queue's start and a sync, whatever its size); and the host's wall clock to queue
    one call (what a step costs when its kernels are too small to keep the GPU busy): the
    fastest call of the burst, since behind the sleep the driver's launch queue can fill, and a
    call that waits for room times the GPU, not the host (timed as a whole burst, one profile's
    host cost came out three times another's; docs/cost-model.md, "Device types, host speed and profiles")."""
    if device == "cpu":

        def timed_cpu(fn):
            t = _timed(fn, repeats)
            return t, t

        return timed_cpu
    cycles_per_s = _sleep_cycles_per_s(device)

    def timed(fn) -> tuple[float, float]:
        for _ in range(3):
            fn()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        torch.cuda.synchronize(device)
        # sleep 3x the burst's whole time (at least 1 ms): the host has queued it all by then
        sleep = int(max(3 * (time.perf_counter() - t0), 1e-3) * cycles_per_s)
        gpu, host = [], []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(sleep)
            start.record()
            queued = []
            for _ in range(burst):
                t0 = time.perf_counter()
                fn()
                queued.append(time.perf_counter() - t0)
            host.append(min(queued))
            end.record()
            torch.cuda.synchronize(device)
            gpu.append(start.elapsed_time(end) / 1e3 / burst)
        return statistics.median(gpu), statistics.median(host)

    return timed


def profile_device(device: str, device_type: str, repeats: int = 20, precision: str = "fp32") -> dict:
    """A compute profile of `device` ("cpu": one thread, as an emulated worker; "cuda[:i]"):
    per op class the device's fixed seconds per kernel and FLOP/s, fitted over batch sizes,
    and on a GPU the host's seconds to queue a kernel; the Adam step's fixed seconds and
    parameter bytes per second (and its host seconds); the host's seconds per view call
    (`views`, view_entry). `points` keep every measurement: (FLOPs, bytes or views, device
    seconds, host seconds). Measured at `precision` (bench.runtime.precision.applied: fp32
    with TF32 off, as a run's default; torch's own default lets cuDNN use TF32), which the
    profile records with the TF32 switches as torch reported them."""
    with applied(precision, device) as in_force:
        out = _profile_device(device, device_type, repeats)
    return {**out, "precision": in_force}


def _profile_device(device: str, device_type: str, repeats: int) -> dict:
    timed = _device_timer(device, repeats)
    gpu = device != "cpu"
    allocated = torch.cuda.memory_allocated(device) if gpu else 0
    out: dict = {
        "device_type": device_type,
        "host": platform.node(),
        "torch": torch.__version__,
        "device": device if not gpu else torch.cuda.get_device_name(device),
        "compute": {},
        "measured": time.strftime("%Y-%m-%d"),
        "timing": (
            f"median of {repeats} calls"
            if not gpu
            else f"median of {repeats} bursts of {GPU_BURST} calls queued behind a GPU sleep, "
            "between CUDA events (device) and on the host's clock (dispatch)"
        ),
    }
    if gpu:  # the host's dispatch speed when its dispatch costs were measured (bench.runtime.hostspeed.host_probe)
        out["host_probe_s"] = host_probe(device)

    with emulated_device() if not gpu else contextlib.nullcontext():
        for cls, launches, batches, make in _class_benchmarks(device):
            points = []
            for b in batches:
                call, flops = make(b)
                points.append((flops, *timed(call)))
                del call
            out["compute"][cls] = {
                **fit_entry(points, "flops_per_s", launches, gpu),
                "kernels_per_call": launches,
                "points": points,
            }
        points = []
        for n in (1 << 20, 1 << 22, 1 << 24, 1 << 26) if gpu else (1 << 14, 1 << 16, 1 << 18, 1 << 20):
            p = torch.nn.Parameter(torch.randn(n, device=device))
            p.grad = torch.randn(n, device=device)
            opt = torch.optim.Adam([p], lr=1e-4)
            points.append((4.0 * n, *timed(opt.step)))
        out["optimizer"] = {**fit_entry(points, "bytes_per_s", 1, gpu), "points": points}
        del p, opt
        if gpu:
            out["workspace_bytes"] = workspace_bytes(device, allocated)
        # Not priced yet (bench.cost counts kernels); measured so that a profile can tell how
        # much of a host-bound step the calls that launch no kernel take.
        out["views"] = view_entry([(n, *timed(_view_chain(device, n))) for n in VIEW_CHAINS])
    return out


def workspace_bytes(device: str, before: int) -> int:
    """Bytes allocated on `device` that no tensor holds, since `before` (its allocation when
    the profile began): what the libraries keep once they have run (cuBLAS and cuBLASLt
    workspaces, one per handle and stream, made at a first matrix product), which every
    training step's peak includes. A forward and backward of a linear layer first, so that
    they exist whatever ran before."""
    x = torch.randn(64, 256, device=device, requires_grad=True)
    layer = torch.nn.Linear(256, 256, device=device)
    layer(x).sum().backward()
    del x, layer
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) - before


# -- collectives -----------------------------------------------------------------------------
def _shards(total: int, n: int, first: float | None) -> list[int]:
    if first is None:
        return [total // n] * n
    rest = (total - int(total * first)) // (n - 1)
    return [total - rest * (n - 1)] + [rest] * (n - 1)


def _allgather_padded(shards, rank):
    local = torch.ones(shards[rank])
    padded = torch.zeros(max(shards))
    padded[: shards[rank]] = local
    out = torch.empty(max(shards) * len(shards))
    return lambda: all_gather_single()(out, padded)


def _allgather_grouped(shards, rank):
    parts = [torch.ones(s) for s in shards]
    return lambda: [dist.broadcast(parts[r], src=r) for r in range(len(shards)) if shards[r]]


def _reduce_scatter_padded(shards, rank):
    full = torch.ones(max(shards) * len(shards))
    out = torch.empty(max(shards))
    return lambda: reduce_scatter_single()(out, full)


def _reduce_scatter_grouped(shards, rank):
    parts = [torch.ones(s) for s in shards]
    return lambda: [dist.reduce(parts[r], dst=r) for r in range(len(shards)) if shards[r]]


def _collective_cases(n: int, elements: int, first: float | None):
    """(kind for the fit, impl, bytes the cost model expects, factory(rank) -> call)."""
    shards = _shards(elements, n, first)
    full = sum(shards) * 4
    cases = [
        ("all_gather", "padded", max(shards) * n * 4, lambda r: _allgather_padded(shards, r)),
        ("all_gather", "grouped", full, lambda r: _allgather_grouped(shards, r)),
        ("reduce_scatter", "padded", max(shards) * n * 4, lambda r: _reduce_scatter_padded(shards, r)),
        ("reduce_scatter", "grouped", full, lambda r: _reduce_scatter_grouped(shards, r)),
    ]
    if first is None:
        buf = lambda: torch.ones(elements)  # noqa: E731 -- fresh buffer per rank
        cases += [
            ("all_reduce", "ring", full, lambda r: (lambda t: lambda: dist.all_reduce(t))(buf())),
            ("broadcast", "ring", full, lambda r: (lambda t: lambda: dist.broadcast(t, 0))(buf())),
            (
                "all_to_all",
                "ring",
                full,
                lambda r: (lambda t, o: lambda: dist.all_to_all_single(o, t))(buf(), torch.empty(elements)),
            ),
        ]
    return cases


def _collective_worker(rank: int, n: int, port: int, sizes: list[int], repeats: int, queue) -> None:
    torch.set_num_threads(1)
    # its own store, rank 0 serving it, as bench.runtime.hostlinks' probe: under torchrun an env
    # rendezvous would wait for the agent's store (TORCHELASTIC_USE_AGENT_STORE, inherited)
    store = dist.TCPStore("127.0.0.1", port, n, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n)
    rows = []
    try:
        for nbytes in sizes:
            elements = max(nbytes // 4, n)
            for first in SKEW_SHARES:
                for kind, impl, model_bytes, factory in _collective_cases(n, elements, first):
                    call = factory(rank)
                    dist.barrier()
                    seconds = _timed(call, repeats)
                    # The slowest rank decides when a collective is done for everyone.
                    t = torch.tensor([seconds])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    rows.append(
                        {
                            "kind": kind,
                            "impl": impl,
                            "size": elements * 4,
                            "bytes": model_bytes,
                            "first_share": first,
                            "seconds": float(t),
                        }
                    )
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def profile_collectives(n: int, sizes: list[int], repeats: int) -> list[dict]:
    queue = forking_context().Queue()
    mp.start_processes(
        _collective_worker, args=(n, _free_port(), sizes, repeats, queue), nprocs=n, start_method="forkserver"
    )
    return queue.get(timeout=10)
