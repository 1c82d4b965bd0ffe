"""Shared test helpers: compose the real conf/ with overrides, results in a temporary folder."""

from __future__ import annotations

import pytest
from hydra import compose

from bench.runner.configs import initialize_configs


def compose_config(*overrides: str, results_dir=None):
    """The runner's config as the CLI would build it (W&B off unless a test turns it on)."""
    extra = ["wandb.mode=disabled"] + ([f"results_dir={results_dir}"] if results_dir else [])
    with initialize_configs():
        return compose("config", overrides=extra + list(overrides))


@pytest.fixture
def cfg_factory(tmp_path):
    """compose_config with results under this test's tmp_path."""
    return lambda *overrides: compose_config(*overrides, results_dir=str(tmp_path / "runs"))


class InfeasibleMethod:
    """A method whose planner finds no feasible ratios (tests the row status mapping)."""

    modes = ("real", "sim")

    def __init__(self, name: str = "infeasible", **_):
        self.name = name

    def plan(self, workload, cluster):
        from bench.core.errors import PlanningError

        class Infeasible(PlanningError):
            status = "infeasible"

        raise Infeasible("no ratios fit device memory: cluster.machines[0].memory_gib=4 is too small")

    def setup(self, plan, model, ctx):
        raise AssertionError("never reached")


def pytest_collection_modifyitems(config, items):
    """gpu / multigpu tests skip, never fail, where torch sees too few CUDA devices (CPU-only CI)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if item.get_closest_marker("gpu") and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("multigpu") and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, this host has {gpus}"))
