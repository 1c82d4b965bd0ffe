"""What a run of the runner came to: each job returns its Outcome, and the command that called
Hydra adds them up into its exit status.

Hydra's `@hydra.main` discards what a job returns and makes its callbacks itself, so the
command opens a collection for the length of its call (`collecting`): the jobs run in this
process hand their Outcome back through the task function, and the sweep's callback adds the
rows that jobs run elsewhere (a submitit launcher's) recorded (bench.runner.sweep). Nothing
outlives the call: a second run in the same process starts from nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    """The cases of one job (or sweep) that did not end ok: "model/cluster/method", or "config"
    for a config that resolved to no case at all. Each has had its one error line already."""

    failed: tuple[str, ...] = ()

    @classmethod
    def of(cls, rows: Iterable, since: str | None = None) -> Outcome:
        """The outcome of rows this job recorded (RunRecords or their dicts). With `since` (an
        ISO time), rows older than it are left out: a case that resume=true skipped was recorded
        by an earlier run, which answered for it."""
        failed = []
        for row in rows:
            r = row if isinstance(row, dict) else vars(row)
            if r.get("status") != "ok" and (since is None or r.get("timestamp", "") >= since):
                failed.append(f"{r['model']}/{r['cluster']}/{r['method']}")
        return cls(tuple(failed))

    def __add__(self, other: Outcome) -> Outcome:
        return Outcome(self.failed + other.failed)

    @property
    def exit_status(self) -> int:
        """1 when a case did not end ok, else 0."""
        return 1 if self.failed else 0


class Outcomes:
    """The outcomes of one command's jobs and sweeps, added as they come back."""

    def __init__(self) -> None:
        self.total = Outcome()

    def add(self, outcome: Outcome | None) -> Outcome | None:
        if outcome is not None:
            self.total = self.total + outcome
        return outcome


_open: contextvars.ContextVar[Outcomes | None] = contextvars.ContextVar("hetbench_outcomes", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[Outcomes]:
    """A collection for the outcomes of the jobs and sweeps run inside the block."""
    outcomes = Outcomes()
    token = _open.set(outcomes)
    try:
        yield outcomes
    finally:
        _open.reset(token)


def add_outcome(outcome: Outcome) -> None:
    """Add a sweep's outcome to the open collection (none open: a caller that reads no exit status)."""
    outcomes = _open.get()
    if outcomes is not None:
        outcomes.add(outcome)
