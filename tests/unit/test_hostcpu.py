"""bench.runtime.hostcpu: a process that times CPU compute keeps what a step frees (no page faults per
step), computes on one thread and flushes denormals."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch

from bench.runtime import hostcpu

# A fresh interpreter: steps of a tiny MLP's training, each allocating and freeing buffers of a
# few MB, counting the page faults of the steps after the first few.
_STEPS = r"""
import json, resource, sys
import torch
from bench.runtime import hostcpu
steady = hostcpu.steady_allocator() if sys.argv[1] == "steady" else None
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
opt = torch.optim.Adam(model.parameters())
x = torch.randn(512, 1024)
faults = []
for i in range(int(sys.argv[2]) if len(sys.argv) > 2 else 12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    opt.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    opt.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"steady": steady, "faults": faults[4:]}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode, "30"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
@pytest.mark.alone
def test_a_steady_allocator_faults_no_pages_once_steps_repeat():
    """Glibc's defaults fault ~500-7,000 pages in nearly every step of this loop; kept memory
    faults none, but for a rare step that grows the heap (its peak moves with the order of
    allocations)."""
    result = _faults("steady")
    assert result["steady"] is True
    faults = result["faults"]
    assert sorted(faults)[len(faults) // 2] == 0 and sum(f == 0 for f in faults) >= 0.8 * len(faults), result


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_allocator_is_set_without_starting_a_process(monkeypatch):
    """Every worker sets it right after installing its fatal-signal handlers: a child process
    then (ctypes.util.find_library runs `ldconfig -p`) holds those handlers until it execs, and a
    test looking for the workers once counted it as a third."""
    monkeypatch.setattr(hostcpu, "_steady", None)
    monkeypatch.setattr(subprocess.Popen, "__init__", lambda *a, **k: pytest.fail("it started a process"))
    assert hostcpu.steady_allocator() is True


def test_the_emulated_device_context_computes_on_one_thread_and_restores_the_count():
    threads = torch.get_num_threads()
    with hostcpu.emulated_device():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads


def test_host_cores_are_the_ones_this_process_may_use():
    assert 1 <= hostcpu.host_cores() <= (torch.multiprocessing.cpu_count())


# A fresh interpreter binds itself as local rank N, then starts a thread (as gloo does).
_PIN = r"""
import json, os, sys, threading
from bench.runtime import hostcpu
allowed = sorted(os.sched_getaffinity(0))
core = hostcpu.pin_to_core(int(sys.argv[1]))
later = []
t = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0))))
t.start(); t.join()
print(json.dumps({"allowed": allowed, "core": core, "now": sorted(os.sched_getaffinity(0)), "thread": later[0]}))
"""


@pytest.mark.parametrize("local_rank", [0, 1, 5])
def test_a_rank_is_bound_to_one_core_and_so_are_the_threads_it_starts(local_rank):
    out = json.loads(
        subprocess.run([sys.executable, "-c", _PIN, str(local_rank)], capture_output=True, text=True, check=True).stdout
    )
    assert out["core"] == out["allowed"][local_rank % len(out["allowed"])]
    assert out["now"] == out["thread"] == [out["core"]]


# A fresh interpreter with a one-rank gloo process group (its transport loop and worker threads):
# the policy and nice of every thread after realtime_comm_threads or gloo_workers_first,
# optionally with the host refusing.
_PRIORITY = r"""
import json, os, sys, tempfile, time
import torch.distributed as dist
from bench.runtime import hostcpu
what, mode = sys.argv[1:3]
if mode == "refuse":
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")
    os.sched_setscheduler = refuse
    os.setpriority = refuse
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
# gloo's threads name themselves when they first run (on a loaded host, after init returns):
# wait for its transport loop and its two workers (torch's default) to have theirs.
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    named = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            named += f.read().startswith(hostcpu.COMM_THREAD_PREFIXES)
    if named >= 3:
        break
    time.sleep(0.01)
call = hostcpu.realtime_comm_threads if what == "realtime" else hostcpu.gloo_workers_first
counts = [call(), call()]
threads = {}
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/comm") as f:
        threads[tid] = [f.read().strip(), os.sched_getscheduler(int(tid)) == os.SCHED_FIFO,
                        os.getpriority(os.PRIO_PROCESS, int(tid))]
print(json.dumps({"counts": counts, "main": str(os.getpid()), "threads": threads,
                  "nice": os.getpriority(os.PRIO_PROCESS, os.getpid())}))
dist.destroy_process_group()
"""


def _priority(what: str, mode: str) -> dict:
    return json.loads(
        subprocess.run([sys.executable, "-c", _PRIORITY, what, mode], capture_output=True, text=True, check=True).stdout
    )


def test_gloo_threads_and_only_they_run_at_real_time_priority_where_the_host_allows():
    out = _priority("realtime", "allow")
    gloo = {tid for tid, (name, _, _) in out["threads"].items() if name.startswith(("gloo", "pt_gloo"))}
    assert len(gloo) >= 2  # the transport's event loop and the process group's worker(s)
    fifo = {tid for tid, (_, rt, _) in out["threads"].items() if rt}
    if out["counts"][0] is None:  # this host refuses real-time priority: nothing changed
        assert out["counts"] == [None, None] and fifo == set()
    else:
        assert out["counts"] == [len(gloo), len(gloo)] and fifo == gloo and out["main"] not in fifo


def test_a_host_that_refuses_real_time_priority_gets_none():
    out = _priority("realtime", "refuse")
    assert out["counts"] == [None, None]
    assert not any(rt for _, rt, _ in out["threads"].values())


def test_gloo_workers_and_only_they_run_at_nice_minus_10_where_the_host_allows():
    """bench.runtime.hostcpu.gloo_workers_first: the process group's workers (pt_gloo_runloop), not its
    transport's event loop (gloo_tcp_loop) nor any other thread."""
    out = _priority("workers_first", "allow")
    workers = {tid for tid, (name, _, _) in out["threads"].items() if name.startswith("pt_gloo")}
    assert workers and any(name.startswith("gloo_tcp") for name, _, _ in out["threads"].values())
    raised = {tid for tid, (_, _, nice) in out["threads"].items() if nice != out["nice"]}  # pytest may run niced
    if out["counts"][0] is None:  # this host refuses a negative nice: nothing changed
        assert out["counts"] == [None, None] and raised == set()
    else:
        assert out["counts"] == [len(workers), len(workers)] and raised == workers
        assert {out["threads"][tid][2] for tid in workers} == {hostcpu.GLOO_WORKER_NICE}


def test_a_host_that_refuses_a_negative_nice_gets_none():
    out = _priority("workers_first", "refuse")
    assert out["counts"] == [None, None]
    assert all(nice == out["nice"] for _, _, nice in out["threads"].values())
