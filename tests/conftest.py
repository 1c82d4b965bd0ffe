"""Shared test helpers: compose the real conf/ with overrides, results in a temporary folder."""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hydra import compose

from bench.runner.configs import initialize_configs
from bench.runner.settings import as_settings


@pytest.fixture(scope="session", autouse=True)
def hetbench_cache(tmp_path_factory):
    """Every test keeps hetbench's caches (host speeds, method probes, captured graphs, DTensor's
    derivations) in one folder of this test run's, shared by its pytest-xdist workers: never the
    user's (HETBENCH_CACHE_DIR; subprocesses inherit it)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / "hetbench-cache"
    folder.mkdir(exist_ok=True)
    before = os.environ.get("HETBENCH_CACHE_DIR")
    os.environ["HETBENCH_CACHE_DIR"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("HETBENCH_CACHE_DIR", None)
    else:
        os.environ["HETBENCH_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """Work that several tests read, done once per test run: `shared_run(name, make)` returns a
    folder that `make(folder)` filled, called by the first test (of any pytest-xdist worker) to
    ask; the others wait for it and read the same folder. `make` returns what the tests need
    of the work besides its files (JSON: a command's exit status and output), returned with the
    folder. Work that raised is not kept: the next test to ask does it again."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def run(name: str, make):
        folder, done = root / f"shared-{name}", root / f"shared-{name}.json"
        with open(root / f"shared-{name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not done.is_file():
                    shutil.rmtree(folder, ignore_errors=True)
                    folder.mkdir()
                    done.write_text(json.dumps(make(folder)))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return folder, json.loads(done.read_text())

    return run


@pytest.fixture(autouse=True)
def logging_as_it_was():
    """A test that runs a command in this process lets Hydra configure logging (handlers on the
    stderr pytest captured for that test, loggers disabled); the next test gets the logging it had."""
    root = logging.getLogger()
    before = (root.handlers[:], root.level)
    loggers = {
        name: (lg.handlers[:], lg.level, lg.disabled, lg.propagate)
        for name, lg in logging.Logger.manager.loggerDict.items()
        if isinstance(lg, logging.Logger)
    }
    yield
    root.handlers[:], root.level = before[0], before[1]
    for name, lg in list(logging.Logger.manager.loggerDict.items()):
        if not isinstance(lg, logging.Logger):
            continue
        if name in loggers:
            lg.handlers[:], lg.level, lg.disabled, lg.propagate = loggers[name]
        else:  # made by the test: as a new logger is
            lg.handlers[:], lg.disabled = [], False


@pytest.fixture(autouse=True)
def host_share(request, tmp_path_factory):
    """Under pytest-xdist, a test marked `alone` runs with no other test beside it: its
    assertions time what the host does. The others share the host. A test waiting to run alone
    holds the turnstile, so that no new shared test starts before it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    root = tmp_path_factory.getbasetemp().parent
    alone = request.node.get_closest_marker("alone") is not None
    with open(root / "turnstile.lock", "a") as turnstile, open(root / "host.lock", "a") as host:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(host, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(host, fcntl.LOCK_UN)


def compose_config(*overrides: str, results_dir=None):
    """The runner's config as the CLI would build it (W&B off unless a test turns it on)."""
    extra = ["wandb.mode=disabled"] + ([f"results_dir={results_dir}"] if results_dir else [])
    with initialize_configs():
        return compose("config", overrides=extra + list(overrides))


def compose_settings(*overrides: str, results_dir=None):
    """compose_config read into Settings, as the runner's functions take it."""
    return as_settings(compose_config(*overrides, results_dir=results_dir))


@pytest.fixture
def config_factory(tmp_path):
    """compose_config with results under this test's tmp_path: the config as composed, for what
    reads it into Settings itself (bench.runner.execute.run_config: a refused value is a row)."""
    return lambda *overrides: compose_config(*overrides, results_dir=str(tmp_path / "runs"))


@pytest.fixture
def cfg_factory(config_factory):
    """config_factory's config read into Settings, as the runner's functions take it."""
    return lambda *overrides: as_settings(config_factory(*overrides))


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
    """gpu tests skip, never fail, where torch sees no CUDA device (CPU-only CI). The e2e tests,
    the long ones, go first, so that the suite ends on short tests that even out the workers.
    Under pytest-xdist, a worker names the tests marked `alone` to the scheduler (AloneLast)."""
    import torch

    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)  # stable: in file order otherwise

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if item.get_closest_marker("gpu") and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    listing = os.environ.get(ALONE_LIST)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if listing and worker:
        part = Path(f"{listing}.{worker}")
        part.write_text("".join(f"{i.nodeid}\n" for i in items if i.get_closest_marker("alone")))
        part.replace(listing)  # whole, whichever worker writes it last: they collect the same tests


ALONE_LIST = "HETBENCH_TEST_ALONE_LIST"


def pytest_configure(config):
    """The xdist controller names the file its workers list the `alone` tests in. Every test
    process collects garbage less often than Python's default: it holds torch, captured graphs
    and cached plans, and at the default thresholds its full collections, each walking all of
    that, took about a seventh of the unit tests' CPU time."""
    gc.set_threshold(10_000, 20, 20)
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        fd, path = tempfile.mkstemp(prefix="hetbench-alone-")
        os.close(fd)
        os.environ[ALONE_LIST] = path
        config.add_cleanup(lambda: Path(path).unlink(missing_ok=True))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """The `alone` tests after the others (AloneLast), so that their turns never stop a worker
    halfway through the shared tests."""
    if config.getvalue("dist") == "worksteal":
        from xdist.scheduler.worksteal import WorkStealingScheduling

        return _alone_last(WorkStealingScheduling)(config, log)
    return None


def _alone_last(base):
    """pytest-xdist's work-stealing scheduler holding the tests marked `alone` back until every
    other test has been handed out and no worker has more than the one it runs left: then they
    go, to one worker (host_share still gives each the host to itself). Mixed in, each alone test
    stops the other worker from starting anything until it is through: the host idles for a
    worker's share of every such test and of the shared test it waits for."""
    from xdist.scheduler.worksteal import MIN_PENDING

    class AloneLast(base):
        held: list[int] = []

        def schedule(self):
            if self.collection is not None or not self.collection_is_completed:
                return super().schedule()
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return None
            self.collection = next(iter(self.node2collection.values()))
            listing = Path(os.environ.get(ALONE_LIST, ""))
            named = set(listing.read_text().splitlines()) if listing.is_file() else set()  # ids hold spaces
            self.held = [i for i, nodeid in enumerate(self.collection) if nodeid in named]
            self.pending[:] = [i for i, nodeid in enumerate(self.collection) if nodeid not in named]
            self.check_schedule()
            return None

        @property
        def tests_finished(self):
            return not self.held and super().tests_finished

        def check_schedule(self):
            if self.held and not self.pending and self.steal_requested_from_node is None:
                up = {n: p for n, p in self.node2pending.items() if not n.shutting_down}
                if up and all(len(p) < MIN_PENDING for p in up.values()):
                    self.pending[:], self.held = self.held, []
                    self._send_tests(min(up, key=lambda n: len(up[n])), len(self.pending))
            super().check_schedule()

    return AloneLast
