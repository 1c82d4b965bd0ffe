"""Profile this host: FLOP/s per op class on one worker thread, alpha-beta per collective kind.

    python -m bench.profile                       # 2 ranks; results/profiles/<host>.json
    python -m bench.profile --ranks 4 --cluster-out conf/cluster/profiled_local.yaml
    python -m bench.profile --device cuda --device-type H100-80 --compute-out results/profiles/H100-80.json

With --compute-out it profiles one device's compute only (op microbenchmarks over batch sizes:
per op class a fixed cost per kernel and a FLOP/s rate, and the Adam step's rate over the
parameter bytes), the file a device type's `profile:` names (bench.core.cluster.ComputeProfile).

Collectives are real gloo (or NCCL) calls between local worker processes, from 4 KB to 64 MB,
with even and skewed shards, padded and grouped all-gather / reduce-scatter. Each kind is fitted
as t = alpha + bytes_on_link / bandwidth (bench.cost's ring factors). It measures; it does not
change any cluster file unless asked to write one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from bench.core.paths import PROJECT_DIR
from bench.cost import link_bytes
from bench.cost.flops import ELEMENTWISE_FLOPS
from bench.runtime.compat import all_gather_single, reduce_scatter_single
from bench.runtime.hostcpu import emulated_device
from bench.runtime.hostspeed import host_probe
from bench.runtime.launch import _free_port

PROFILE_DIR = PROJECT_DIR / "results" / "profiles"
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
            def step():
                op().sum().backward()
            with FlopCounterMode(display=False) as counter:
                step()
            flops = counter.get_total_flops()
            seconds = _timed(step, repeats)
            out[name] = {"seconds": seconds, "flops": float(flops),
                         "flops_per_s": flops / seconds if flops else None}
    return out


# -- compute profile of a device type (bench.core.cluster.ComputeProfile) ------------------------
CHAIN = 8  # ops per forward+backward call: one autograd run per call, as in a step


def _class_benchmarks(device: str):
    """(op class, kernels per call as the planner counts them, batches, make(batch) -> (call,
    FLOPs)) per class: forward + backward of a chain of CHAIN nn.Linear layers, 3x3
    nn.Conv2d layers, or nn.LayerNorm + nn.GELU pairs (FLOPs counted as the planner's graph
    counts them: bench.runtime.hostspeed). A chain, not one op: a training step runs one autograd pass
    over many ops, so the pass's own start-up should not be charged to each kernel; modules
    with biases, not bare functions: the models call modules, and their hosts pay for it."""
    gpu = device != "cpu"
    d, side = (1024, 32) if gpu else (256, 16)
    # On a GPU the largest call takes ~10 ms (the rate); the smallest a few us per kernel
    # (the fixed cost). A 2048-row linear on an H200 took no longer than its fixed cost.
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
        return chain(x, [torch.nn.Conv2d(64, 64, 3, padding=1) for _ in range(CHAIN)],
                     CHAIN * 3 * 2.0 * n * 64 * side * side * 64 * 9)

    def other(b):
        x = torch.randn(b, d, generator=g, device=device, requires_grad=True)
        per = ELEMENTWISE_FLOPS["layer_norm"] + ELEMENTWISE_FLOPS["gelu"]
        layers = [m for _ in range(CHAIN) for m in (torch.nn.LayerNorm(d), torch.nn.GELU())]
        return chain(x, layers, CHAIN * 2.0 * per * b * d)  # backward factor 1

    # kernels per link of the chain as the planner counts them: forward 1, backward 2 (input
    # and weight gradients) for linear and conv; layer norm 1 + 2, GELU 1 + 1
    return [("matmul", CHAIN * 3, batches, linear), ("conv", CHAIN * 3, batches, conv),
            ("other", CHAIN * 5, batches, other)]


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


def view_entry(points: list[tuple[int, float, float]]) -> dict:
    """The host's seconds per view call (forward and its backward node) from the two chains'
    (views, device seconds, host seconds); on a GPU the host's clock, on the CPU the wall."""
    (n1, _, h1), (n2, _, h2) = points
    return {"dispatch_s": max(h2 - h1, 0.0) / (n2 - n1), "points": points}


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
    kernels alone, as in a step whose host runs ahead (timed one by one, each call also paid
    the queue's start and a sync: 0.2-0.5 ms on an H200, whatever its size); and the host's
    wall clock to queue one call (what a step costs when its kernels are too small to keep
    the GPU busy): the fastest call of the burst, since behind the sleep the driver's launch
    queue can fill, and a call that waits for room times the GPU, not the host (timed as a
    whole burst, the conv chain's host cost on an H200 came out at 46 us per kernel in one
    profile and at 153 in the next)."""
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


def _fit_affine(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept_s, units per second) of t = intercept + x / rate, least squares of the
    relative error (so the small points set the intercept and the large ones the rate, over
    sizes three orders apart); a non-positive intercept is 0 (the rate is then refitted
    through the origin)."""
    x, t = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    slope, intercept = np.polyfit(x, t, 1, w=1.0 / t)
    if intercept <= 0 or slope <= 0:
        intercept, slope = 0.0, float((x @ t) / (x @ x))
    return float(intercept), float(1.0 / slope)


def profile_device(device: str, device_type: str, repeats: int = 20) -> dict:
    """A compute profile of `device` ("cpu": one thread, as an emulated worker; "cuda[:i]"):
    per op class the device's fixed seconds per kernel and FLOP/s, fitted over batch sizes,
    and on a GPU the host's seconds to queue a kernel; the Adam step's fixed seconds and
    parameter bytes per second (and its host seconds); the host's seconds per view call
    (`views`, view_entry). `points` keep every measurement: (FLOPs, bytes or views, device
    seconds, host seconds)."""
    timed = _device_timer(device, repeats)
    gpu = device != "cpu"
    allocated = torch.cuda.memory_allocated(device) if gpu else 0
    out: dict = {"device_type": device_type, "host": platform.node(), "torch": torch.__version__,
                 "device": device if not gpu else torch.cuda.get_device_name(device),
                 "compute": {}, "measured": time.strftime("%Y-%m-%d"),
                 "timing": (f"median of {repeats} calls" if not gpu else
                            f"median of {repeats} bursts of {GPU_BURST} calls queued behind a GPU sleep, "
                            "between CUDA events (device) and on the host's clock (dispatch)")}
    if gpu:  # the host's dispatch speed when its dispatch costs were measured (bench.runtime.hostspeed.host_probe)
        out["host_probe_s"] = host_probe(device)

    with emulated_device() if not gpu else contextlib.nullcontext():
        for cls, launches, batches, make in _class_benchmarks(device):
            points = []
            for b in batches:
                call, flops = make(b)
                points.append((flops, *timed(call)))
                del call
            out["compute"][cls] = {**fit_entry(points, "flops_per_s", launches, gpu), "kernels_per_call": launches,
                                   "points": points}
        points = []
        for n in ((1 << 20, 1 << 22, 1 << 24, 1 << 26) if gpu else (1 << 14, 1 << 16, 1 << 18, 1 << 20)):
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


def fit_entry(points: list, units: str, per: int, host: bool) -> dict:
    """A profile entry from its points (size, device seconds, host seconds): the device's
    fixed seconds per kernel and rate (_fit_affine), and with `host` the host's seconds per
    kernel. Queueing a call costs the host the same at any size, but a large call can also
    make it wait for the device (a launch queue full behind the GPU sleep, or an allocation
    that synchronises: on an H200 the conv chain's host time grew from 1.1 to 16.8 ms with
    the size, tracking the sleep), so the dispatch cost is the smallest of them."""
    intercept, rate = _fit_affine([(x, t) for x, t, _ in points])
    e = {"fixed_s": intercept / per, units: rate}
    if host:
        e["dispatch_s"] = min(h for _, _, h in points) / per
    return e


def refit(prof: dict) -> dict:
    """The profile with every entry fitted again from its stored points (today's fit_entry),
    for a profile measured before a change of the fit; no device needed."""
    gpu = prof.get("device", "cpu") != "cpu"  # "cpu", or the GPU's name
    out = {**prof, "compute": {}, "refit": f"fitted again from its points on {time.strftime('%Y-%m-%d')}"}
    for cls, e in prof["compute"].items():
        out["compute"][cls] = {**e, **fit_entry(e["points"], "flops_per_s", e["kernels_per_call"], gpu)}
    out["optimizer"] = {**prof["optimizer"], **fit_entry(prof["optimizer"]["points"], "bytes_per_s", 1, gpu)}
    if "views" in prof:  # profiles before 2026-11-26 did not measure them
        out["views"] = view_entry(prof["views"]["points"])
    return out


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
            ("all_to_all", "ring", full, lambda r: (lambda t, o: lambda: dist.all_to_all_single(o, t))(
                buf(), torch.empty(elements))),
        ]
    return cases


def _collective_worker(rank: int, n: int, port: int, sizes: list[int], repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
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
                    rows.append({"kind": kind, "impl": impl, "size": elements * 4,
                                 "bytes": model_bytes, "first_share": first, "seconds": float(t)})
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def profile_collectives(n: int, sizes: list[int], repeats: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_collective_worker, args=(n, _free_port(), sizes, repeats, queue),
                       nprocs=n, start_method="spawn")
    return queue.get(timeout=10)


def fit_alpha_beta(rows: list[dict], n: int) -> dict[str, dict[str, float]]:
    """Least-squares t = alpha + link_bytes / bandwidth per (kind, impl), even shards only."""
    fits = {}
    for key in sorted({(r["kind"], r["impl"]) for r in rows}):
        pts = [r for r in rows if (r["kind"], r["impl"]) == key and r["first_share"] is None]
        # Grouped calls move each shard once over the root's link: bytes, not a ring's share.
        x = np.array([r["bytes"] if key[1] == "grouped" else link_bytes(key[0], r["bytes"], n)
                      for r in pts])
        t = np.array([r["seconds"] for r in pts])
        slope, alpha = np.polyfit(x, t, 1)
        if slope > 0:
            fit = {"latency_s": max(float(alpha), 0.0), "bytes_per_s": float(1 / slope),
                   "bandwidth_from": "fit"}
        else:  # sizes too small to see the bandwidth through the noise: a lower bound
            fit = {"latency_s": float(t.min()), "bytes_per_s": float(x.max() / t[x.argmax()]),
                   "bandwidth_from": "largest size"}
        fits[f"{key[0]}/{key[1]}"] = fit
    return fits


def cluster_yaml(name: str, n: int, compute: dict, fits: dict, profile_path: Path) -> str:
    """A cluster file describing this host as one machine of n worker devices; its links read
    every collective kind's fit from the profile file, all-reduce's numbers are the default."""
    ar = fits["all_reduce/ring"]
    gbps = ar["bytes_per_s"] * 8 / 1e9
    profile = _repo_relative(profile_path)
    return (
        f"# Profiled by `python -m bench.profile` on {platform.node()} "
        f"({time.strftime('%Y-%m-%d')}): one machine of {n} worker processes.\n"
        f"# effective_flops: linear forward+backward on one thread; links: each collective kind's\n"
        f"# fit from the profile file (the all-reduce's numbers for kinds it did not measure).\n"
        f"name: {name}\nemulated: true\nvirtual_device: gpu\nmachines:\n"
        f"  - {{count: 1, device: cpu, num_devices: {n}, "
        f"effective_flops: {_yaml_float(compute['linear']['flops_per_s'])}}}\n"
        f"links:\n"
        f"  intra_machine: {{bandwidth_gbps: {_yaml_float(gbps)}, latency_s: {_yaml_float(ar['latency_s'])}, profile: {profile}}}\n"
        f"  inter_machine: {{bandwidth_gbps: {_yaml_float(gbps)}, latency_s: {_yaml_float(ar['latency_s'])}, profile: {profile}}}\n"
    )


def _yaml_float(x: float) -> str:
    """x to 4 significant digits in a form every YAML loader reads as a number: YAML 1.1
    (PyYAML) takes `1e+11` and `5e-05` for strings, so the mantissa always has a point (a
    host whose linear rate came out at 1.000e11 wrote a cluster file its own loader refused)."""
    return f"{x:.3e}"


def _repo_relative(path: Path) -> str:
    """`path` relative to the project (the checkout; installed: the working directory) when
    inside it: cluster files resolve relative profile paths from there."""
    try:
        return str(path.resolve().relative_to(PROJECT_DIR.resolve()))
    except ValueError:
        return str(path.resolve())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="worker processes for collectives")
    parser.add_argument("--max-mb", type=float, default=64, help="largest collective (MB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON output (default results/profiles/<host>.json)")
    parser.add_argument("--cluster-out", type=Path, default=None, help="also write a cluster yaml here")
    parser.add_argument("--compute-out", type=Path, default=None,
                        help="only profile compute of one device type and write it here (a device type's `profile`)")
    parser.add_argument("--device-type", default=None, help="the conf/device type the profile describes (with --compute-out)")
    parser.add_argument("--device", default="cpu", help="cpu (one worker thread) or cuda[:i] (with --compute-out)")
    parser.add_argument("--refit", type=Path, default=None,
                        help="a compute profile: fit its stored points again and write it to --compute-out (no device)")
    args = parser.parse_args(argv)
    if args.refit is not None:
        if args.compute_out is None:
            parser.error("--refit needs --compute-out PATH (where the refitted profile goes)")
        try:
            prof = refit(json.loads(args.refit.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"error: --refit={args.refit}: {exc!r}; give a file written by bench.profile --compute-out",
                  file=sys.stderr)
            return 2
        args.compute_out.write_text(json.dumps(prof, indent=1) + "\n")
        print(f"wrote {args.compute_out}")
        return 0
    if args.compute_out is not None:
        if not args.device_type:
            parser.error("--compute-out needs --device-type NAME (the conf/device type it describes, e.g. H100-80)")
        if args.device != "cpu" and not torch.cuda.is_available():
            parser.error(f"--device={args.device} but torch sees no CUDA device; use --device cpu")
        prof = profile_device(args.device, args.device_type, args.repeats)
        host = "dispatch_s" in prof["optimizer"]
        print(f"{'op class':10} {'us/kernel':>10} {'GFLOP/s':>10}" + (f" {'host us/kernel':>15}" if host else "")
              + f"   ({prof['device']})")
        for cls, c in prof["compute"].items():
            print(f"{cls:10} {c['fixed_s'] * 1e6:10.2f} {c['flops_per_s'] / 1e9:10.2f}"
                  + (f" {c['dispatch_s'] * 1e6:15.2f}" if host else ""))
        o = prof["optimizer"]
        print(f"optimizer  {o['fixed_s'] * 1e6:10.2f} us + {o['bytes_per_s'] / 1e9:.2f} GB/s of parameters"
              + (f"; host {o['dispatch_s'] * 1e6:.2f} us" if host else ""))
        print(f"view call  {prof['views']['dispatch_s'] * 1e6:10.2f} us on the host (forward and backward; no kernel)")
        args.compute_out.parent.mkdir(parents=True, exist_ok=True)
        args.compute_out.write_text(json.dumps(prof, indent=1) + "\n")
        print(f"wrote {args.compute_out}")
        return 0
    if args.ranks < 2:
        parser.error(f"--ranks={args.ranks} must be >= 2 (collectives need two processes)")
    sizes = [s for s in SIZES if s <= args.max_mb * 2**20]
    compute = profile_compute()
    rows = profile_collectives(args.ranks, sizes, args.repeats)
    fits = fit_alpha_beta(rows, args.ranks)
    print(f"{'op class':18} {'ms':>8} {'GFLOP/s':>9}")
    for name, c in compute.items():
        speed = "-" if c["flops_per_s"] is None else f"{c['flops_per_s'] / 1e9:.2f}"
        print(f"{name:18} {c['seconds'] * 1e3:8.3f} {speed:>9}")
    print(f"\n{'collective':24} {'latency us':>10} {'GB/s':>8}   ({args.ranks} ranks)")
    for key, f in fits.items():
        print(f"{key:24} {f['latency_s'] * 1e6:10.1f} {f['bytes_per_s'] / 1e9:8.3f}")
    print(f"\n{'all-gather of the largest size':30} {'padded ms':>10} {'grouped ms':>10}   by the first rank's share")
    big = max(r["size"] for r in rows)
    for first in SKEW_SHARES:
        pick = {r["impl"]: r["seconds"] for r in rows if r["kind"] == "all_gather"
                and r["first_share"] == first and r["size"] == big}
        label = "even" if first is None else f"{first:.0%}"
        print(f"{label:30} {pick['padded'] * 1e3:10.2f} {pick['grouped'] * 1e3:10.2f}")
    out = args.out or PROFILE_DIR / f"{platform.node()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": platform.node(), "ranks": args.ranks,
                               "torch": torch.__version__, "compute": compute,
                               "collectives": rows, "fits": fits}, indent=1) + "\n")
    print(f"\nwrote {out}")
    if args.cluster_out:
        args.cluster_out.write_text(cluster_yaml(args.cluster_out.stem, args.ranks, compute, fits, out))
        print(f"wrote {args.cluster_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
