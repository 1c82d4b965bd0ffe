"""The two errors a case can end with before any worker starts: bad input, or no plan.

Both are one line for the user; the runner records the case as failed (or as the status a
PlanningError carries) and never as ok.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input: the message names the field, the value and the fix."""


class PlanningError(ValueError):
    """A method cannot plan this case. The row records `status` and the message."""

    status = "failed"
