#!/usr/bin/env bash
# Create .venv with hetbench and its pinned dependencies. torch goes first and alone: any
# unpinned request for torch would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
# DS_BUILD_OPS=0: DeepSpeed compiles its C++ ops on first use instead of at install time.
DS_BUILD_OPS=0 .venv/bin/python -m pip install --quiet -e ".[deepspeed,slurm,test,tracking]"
.venv/bin/python -c "import torch, hydra, bench; print('hetbench ready: torch', torch.__version__)"
