"""CUDA MPS for an emulated cluster on one GPU: a private control daemon and each rank's SM share.

bench.runtime.launch starts the daemon around a case whose cluster says `device: cuda` and gives every
worker its share. Before any worker starts, one client process checks that the daemon serves
the GPU (a daemon can start and still refuse every client). It does not check that the shares
were achieved (the worker measures that).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from bench.core.cluster import ClusterSpec
from bench.core.errors import ConfigError

CONTROL = "nvidia-cuda-mps-control"
_CONTROL_TIMEOUT_S = 30
# A client that allocates on the GPU through the daemon, as a rank's first CUDA call does.
_CLIENT = "import torch; torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize()"
_CLIENT_TIMEOUT_S = 120  # importing torch and starting CUDA under MPS: seconds, not minutes


def control_binary() -> str:
    """The MPS control program's path, or one line that says how to get it."""
    path = shutil.which(CONTROL)
    if path is None:
        raise ConfigError(
            f"cluster.device=cuda shares one GPU between ranks under MPS, but {CONTROL} is not on "
            "PATH; install the NVIDIA driver's MPS utilities or add their folder to PATH (e.g. "
            "/usr/local/nvidia/bin), or use an emulated cluster with device: cpu"
        )
    return path


def thread_percentages(speeds: list[float]) -> list[int]:
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE per rank: its speed's share of the summed speeds,
    rounded down (at least 1).

    Shares of the sum, not speed x 100: the ranks compute at the same time, and if their shares
    added up to more than the GPU the ranks would contend for the same SMs and run at shares
    the scheduler picks (two unlimited ranks of unequal work can run at equal speed), not in the
    configured ratio. Rounding down keeps the sum at most 100. The speed-1 rank is then
    slower than a whole GPU; only the ratio is the configured one.
    """
    total = sum(speeds)
    return [max(1, math.floor(100 * s / total)) for s in speeds]


def worker_envs(cluster: ClusterSpec, pipe_dir: str, log_dir: str) -> list[dict[str, str]]:
    """The environment each rank's process sets before it touches CUDA."""
    shares = thread_percentages([d.speed for d in cluster.devices])
    return [
        {
            "CUDA_MPS_PIPE_DIRECTORY": pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": log_dir,
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(p),
        }
        for p in shares
    ]


@contextlib.contextmanager
def mps_daemon() -> Iterator[tuple[str, str]]:
    """Start a control daemon with its own pipe and log directories (so it meets no other MPS
    instance on the host); yield (pipe_dir, log_dir); stop it on the way out, whatever happened."""
    binary = control_binary()
    pipe_dir = tempfile.mkdtemp(prefix="hetbench-mps-pipe-")
    log_dir = tempfile.mkdtemp(prefix="hetbench-mps-log-")
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe_dir, "CUDA_MPS_LOG_DIRECTORY": log_dir}
    try:
        started = subprocess.run([binary, "-d"], env=env, capture_output=True, text=True, timeout=_CONTROL_TIMEOUT_S)
        if started.returncode != 0:
            reason = (started.stderr or started.stdout).strip().splitlines()
            raise ConfigError(
                f"cluster.device=cuda: `{CONTROL} -d` failed with code {started.returncode}"
                f"{' (' + reason[0] + ')' if reason else ''}; MPS needs the GPU in Default or "
                "Exclusive-process compute mode and, on many hosts, root; or use device: cpu"
            )
        try:
            check_client(env)
            yield pipe_dir, log_dir
        finally:
            # `quit` ends the control daemon and the server it started once its clients are
            # gone; the launcher has stopped every worker before this runs.
            subprocess.run(
                [binary], input="quit\n", env=env, capture_output=True, text=True, timeout=_CONTROL_TIMEOUT_S
            )
    finally:
        shutil.rmtree(pipe_dir, ignore_errors=True)
        shutil.rmtree(log_dir, ignore_errors=True)


def check_client(env: dict[str, str]) -> None:
    """One client of the daemon that `env` points at allocates on the GPU and finishes, or one
    line (ConfigError) with the client's last error line: a daemon that started but cannot
    serve (the GPU in another compute mode, a server that cannot start, no GPU visible) fails
    here rather than in every rank's traceback."""
    fix = (
        "check that nvidia-smi shows the GPU in compute mode Default or Exclusive-process with no other "
        "MPS server running and that torch sees it, or use device: cpu"
    )
    try:
        client = subprocess.run(
            [sys.executable, "-c", _CLIENT], env=env, capture_output=True, text=True, timeout=_CLIENT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"cluster.device=cuda: the MPS daemon started ({CONTROL} -d) but a client did not "
            f"get the GPU within {_CLIENT_TIMEOUT_S} s; {fix}"
        ) from None
    if client.returncode != 0:
        lines = [line.strip() for line in (client.stderr or client.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit code {client.returncode}"
        raise ConfigError(
            f"cluster.device=cuda: the MPS daemon started ({CONTROL} -d) but a client could not "
            f"use the GPU through it ({reason}); {fix}"
        )
