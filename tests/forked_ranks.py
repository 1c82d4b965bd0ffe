"""Ranks forked from the test process for tests that hold a program to one device: each rank
takes what the test built before the fork (plans, graphs) as it is, joins gloo on a free port and
sends back one result or its traceback."""

from __future__ import annotations

import queue
import socket
from collections.abc import Callable

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_forked(target: Callable, world: int, *args, timeout_s: float = 60.0) -> list:
    """`target(rank, port, *args, out)` in `world` forked processes; each puts (rank, result,
    None) or (rank, None, traceback) on `out`. Returns the results by rank; fails the test with
    every traceback sent, or with the ranks that sent nothing in `timeout_s` (a rank that failed
    leaves the others waiting in a collective: they are killed)."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args, out), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    got: dict = {}
    try:
        while len(got) < world:
            rank, result, err = out.get(timeout=timeout_s)
            got[rank] = (result, err)
            if err:
                break
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = [f"rank {rank}:\n{err}" for rank, (_, err) in sorted(got.items()) if err]
    assert not errors, "\n".join(errors)
    assert len(got) == world, f"ranks {sorted(set(range(world)) - set(got))} sent nothing in {timeout_s:.0f} s"
    return [got[rank][0] for rank in range(world)]
