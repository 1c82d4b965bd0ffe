#!/usr/bin/env bash
# Create .venv with hetbench and its pinned dependencies. torch goes first and alone, and only
# when the venv has none: any unpinned request for torch would pull several GB of CUDA wheels.
#   HETBENCH_SYSTEM_SITE_PACKAGES=1  reuse the torch the system (container, module) provides:
#                                    the venv sees its site-packages and installs no torch.
#   PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR  no network: install from a folder of wheels (docs/gpu.md).
# Which torch build `torch==2.13.0` is depends on the index: PyPI serves the CUDA build on Linux
# x86-64; a CPU-only index serves the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if [ "${HETBENCH_SYSTEM_SITE_PACKAGES:-0}" = 1 ]; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
.venv/bin/python -m pip install --quiet --upgrade pip
if .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "keeping the torch already importable: $(.venv/bin/python -c 'import torch; print(torch.__version__, torch.__file__)')"
else
  .venv/bin/python -m pip install --quiet torch==2.13.0
fi
# DS_BUILD_OPS=0: DeepSpeed compiles its C++ ops on first use instead of at install time.
# pyproject asks torch>=2.4, so an importable torch is kept, never reinstalled.
DS_BUILD_OPS=0 .venv/bin/python -m pip install --quiet -e ".[deepspeed,metis,slurm,test,tracking,zoo]"
.venv/bin/python -c "import torch, hydra, bench; print('hetbench ready: torch', torch.__version__, '(CUDA', torch.version.cuda or 'none', ')')"
