"""Progress of long commands (sweeps, figures, calibration): a bar with an ETA on a terminal,
nothing in CI logs or pipes."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def interactive() -> bool:
    """Whether progress should be drawn: stderr is a terminal and this is not a CI job."""
    return sys.stderr.isatty() and not os.environ.get("CI")


def progress_bar(transient: bool = False):
    """A rich Progress with description, bar, count, elapsed and remaining time; disabled
    (prints nothing) when not interactive."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        transient=transient,
        disable=not interactive(),
    )


def track(items: Sequence[T] | Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate over `items` with a progress bar (see progress_bar)."""
    items = list(items)
    with progress_bar() as bar:
        task = bar.add_task(description, total=total if total is not None else len(items))
        for item in items:
            yield item
            bar.advance(task)
