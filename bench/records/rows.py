"""Result rows: one JSON line per case, appended atomically; the JSONL is the record of truth.

Rows are written, never rewritten; the loggers (bench.records.tracking) only mirror them.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import logging
import os
import platform
import socket
import statistics
import subprocess
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "infeasible", "timeout", "failed")
# Keys of the resolved config that do not change what a case measures (left out of case_key).
_NON_CASE_KEYS = (
    "wandb",
    "logger",
    "resume",
    "results_dir",
    "results_file",
    "timeout_s",
    "test",
    "report",
    "config_dirs",
    "config_files",
)


@dataclass
class RunRecord:
    model: str
    preset: str
    cluster: str
    method: str
    mode: str  # real | sim
    status: str  # ok | oom | infeasible | timeout | failed
    error: str | None = None
    origin: str = "measured"  # measured (real mode) | simulated (sim mode)
    hardware: str = ""  # what ran it: e.g. "cpu x2 (emulated local_hetero2)"
    num_devices: int | None = None
    global_batch: int | None = None
    batch_shares: list[int] | None = None
    warmup_iters: int | None = None
    measured_iters: int | None = None
    iter_times_s: list[float] | None = None  # per measured iteration, max over ranks
    iter_time_s_mean: float | None = None
    iter_time_s_std: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    ideal_iter_time_s: float | None = None
    efficiency: float | None = None
    predicted_iter_time_s: float | None = None  # the simulator's, in both modes when available
    # A real run on an emulated CPU cluster: the prediction above is priced at the host speed
    # its ranks measured (bench.runtime.hostspeed.yardstick), run_host_*; planned_iter_time_s is the price
    # at the parent's probe (host_flops_per_s), what the planner planned with.
    planned_iter_time_s: float | None = None
    run_host_flops_per_s: float | None = None
    run_host_step_overhead_s: float | None = None
    # Its compute: per stage the slowest device's, summed, plus the slowest per-step part (the
    # rest of the prediction is communication not hidden behind compute)
    predicted_compute_s: float | None = None
    predicted_peak_mem_gib: list[float] | None = None  # per (virtual) device, per GPU
    predicted_oom: bool | None = None
    planner_time_s: float | None = None
    capture_time_s: float | None = None  # of planner_time_s: the model's capture (0 where it came from the cache)
    search_time_s: float | None = None  # of planner_time_s: the planner's search, LP included (hap, sfb, auto)
    # Wall seconds of the run's parts: prepare_s (validating and planning: a case's first run),
    # workers_s (the round on the workers, from start or the launcher's word to every result) and,
    # the most over the ranks, setup_s (joining, building, the method's set-up: the first round),
    # untimed_s (lazy set-up and pacing reference iterations: the first round) and iterations_s
    # (the warm-up and measured iterations).
    timings: dict | None = None
    worker_pids: list[int] | None = None  # the process of each rank (one set per case, kept for its rounds)
    peak_mem_gib: list[float] | None = None  # per rank
    # per CPU rank: the peak of its live tensor bytes in its last lazy set-up iteration, the
    # steady state the cost model predicts (bench.runtime.tensor_memory; CUDA's is peak_mem_gib_per_iter)
    tensor_peak_gib: list[float | None] | None = None
    loss_first: float | None = None  # mean loss per target, first and last iteration
    loss_last: float | None = None
    loss_per_iter: list[float] | None = None  # mean loss per target, per measured iteration
    peak_mem_gib_per_iter: list[float] | None = None  # per measured iteration: max over ranks of
    # each rank's peak (CUDA: max_memory_allocated during that iteration, the steady state a
    # cost model predicts; CPU: the RSS high-water mark so far, which cannot be reset)
    flops_per_iter: float | None = None
    host_flops_per_s: float | None = None  # measured speed of one emulated device of speed 1
    host_step_overhead_s: float | None = None  # and its per-step time that no batch share changes
    host_optimizer_s_per_byte: float | None = None  # of that, Adam's seconds per parameter byte held
    host_link_floor_s: dict | None = None  # per collective kind: the host transport's least seconds
    emulation: dict | None = None  # emulated clusters: headroom, per-rank achieved dilation, ok
    precision: dict | None = None  # precision, autocast dtype and TF32 flags in force (rank 0)
    rank_hardware: list[dict] | None = None  # per rank: GPU name, memory, driver, CUDA, NCCL; or CPU
    oom_rank: int | None = None  # status oom: the rank that ran out of memory
    plan: dict | None = None
    plan_hash: str | None = None  # sha256 of the plan's decisions (bench.runner.case.plan_hash)
    case_key: str = ""
    row_kind: str = "case"  # case (one run) | repeat (one of `repeats` runs) | aggregate (of them)
    repeat: int | None = None  # 0-based round of a repeated comparison
    repeats: int | None = None
    sweep_id: str | None = None  # the comparison or Hydra sweep (its directory) the row belongs to
    output_dir: str | None = None  # the Hydra job's output directory (it holds a copy of the row)
    aggregate: dict | None = None  # aggregate rows: bench.records.stats summaries over the repeats
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    timestamp: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    schema_version: int = SCHEMA_VERSION
    git_sha: str | None = None
    git_dirty: bool | None = None
    versions: dict = field(default_factory=dict)
    host: str = ""
    cluster_hash: str = ""
    config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status
        if self.status != "ok":  # failed cases carry no numbers, never 0 or -1
            for name in ("iter_time_s_mean", "iter_time_s_std", "samples_per_s", "tokens_per_s", "efficiency"):
                setattr(self, name, None)


def case_key(config: dict) -> str:
    """Identity of a case: a hash of the resolved config minus keys that don't affect it."""
    body = {k: v for k, v in config.items() if k not in _NON_CASE_KEYS}
    for key, default in (("precision", "fp32"), ("batch_norm", "local")):
        if body.get(key) == default:
            del body[key]  # a default is left out, so rows recorded without the key match
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def append_record(path: str | os.PathLike, record: RunRecord) -> None:
    """Append one line under an exclusive lock, in one write: concurrent cases never interleave.

    The lock is a POSIX record lock (fcntl.lockf), which network filesystems honour across
    hosts (NFS through its lock manager; Lustre and GPFS with their lock options on), so many
    writers of one sweep may share a results directory on a cluster filesystem.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(asdict(record), default=str) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        # A writer killed mid-line leaves a fragment with no newline; end it first, or this row
        # is glued onto it and lost with it. The fragment itself stays (rows are never rewritten).
        if _ends_mid_line(fd):
            os.write(fd, b"\n")
        os.write(fd, line)
        os.fsync(fd)
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        os.close(fd)


def _ends_mid_line(fd: int) -> bool:
    """Whether the file's last byte is not a newline (an empty file ends no line). Asked under
    the lock, so no other writer moves the end meanwhile."""
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


def load_records(path: str | os.PathLike, skipped: list[int] | None = None) -> list[dict]:
    """All rows (of a records.jsonl, or of its gzipped copy *.jsonl.gz); a line that is not one (cut short by a run killed mid-write, or not JSON at all)
    is skipped with a warning, so one bad line never costs the others. With `skipped`, the bad
    lines' numbers go there instead of a warning each."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    for i, line in enumerate(data.splitlines(), 1):  # bytes: bad UTF-8 is one bad line
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError; deep nesting
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif skipped is not None:
            skipped.append(i)
        else:
            log.warning("%s:%d is not a complete JSON row; skipped", path, i)
    return rows


def finished_case_keys(path: str | os.PathLike) -> set[str]:
    """Cases with a final answer (ok or oom): what resume=true skips. A repeated case is
    finished when its aggregate row is, not when one of its repeats is."""
    return {r.get("case_key") for r in load_records(path) if _is_final(r)}


def _is_final(row: dict) -> bool:
    return row.get("status") in ("ok", "oom") and row.get("row_kind", "case") != "repeat"


def finished_record(path: str | os.PathLike, key: str) -> RunRecord | None:
    """The last row that gives case `key` a final answer (see finished_case_keys), or None."""
    rows = [r for r in load_records(path) if r.get("case_key") == key and _is_final(r)]
    if not rows:
        return None
    return RunRecord(**{k: v for k, v in rows[-1].items() if k in RunRecord.__dataclass_fields__})


def summarize_times(per_rank_times: Iterable[list[float]], measured: int) -> tuple[list[float], float, float]:
    """Iteration time = max over ranks of each iteration; mean and sample std of the last
    `measured` iterations."""
    per_iter = [max(ts) for ts in zip(*per_rank_times)][-measured:]
    mean = statistics.fmean(per_iter)
    std = statistics.stdev(per_iter) if len(per_iter) > 1 else 0.0
    return per_iter, mean, std


def _git(*args: str, cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=cwd or Path(__file__).resolve().parent
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_dirty(cwd: Path | None = None) -> bool | None:
    """Whether a tracked file of the checkout (of this package, or the one `cwd` is in) differs
    from its commit, results/ left out: that is what runs write (figures, calibration files),
    and drawing one figure would otherwise mark the next one's rows dirty. None outside git."""
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)results", cwd=cwd)
    return None if status is None else bool(status)


def fingerprint() -> dict[str, Any]:
    """Where a row came from: commit, dirty flag, software versions, host."""
    versions = {"python": platform.python_version()}
    for pkg in ("torch", "deepspeed", "hydra-core", "pulp", "wandb", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    try:
        import torch

        versions["cuda"] = torch.version.cuda
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception as exc:  # fingerprinting must never fail a run
        log.debug("no torch version details: %s", exc)
    return {
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": code_dirty(),
        "versions": versions,
        "host": f"{socket.gethostname()} ({platform.machine()}, {os.cpu_count()} cpus)",
    }
