"""A JSON cache of Plans keyed by a hash of everything that decides them.

Any method may use it; the key fields are the caller's (model, preset, cluster, batch, method
options, code version). It stores and loads plans; it does not decide whether a plan is valid.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from bench.core.interfaces import Plan
from bench.core.program import Program

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the stored JSON changes shape


def plan_key(fields: dict[str, Any]) -> str:
    """sha256 (first 20 hex digits) of the canonical JSON of `fields`."""
    body = json.dumps({"cache_format": CACHE_FORMAT, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:20]


def plan_to_json(plan: Plan) -> dict:
    return {
        "method": plan.method,
        "batch_shares": list(plan.batch_shares),
        "details": plan.details,
        "program": plan.program.to_json() if plan.program is not None else None,
        "ratios": plan.ratios,
    }


def plan_from_json(d: dict) -> Plan:
    program = Program.from_json(d["program"]) if d.get("program") is not None else None
    return Plan(d["method"], list(d["batch_shares"]), dict(d.get("details", {})), program, d.get("ratios"))


def load_plan(cache_dir: str | os.PathLike, key: str) -> Plan | None:
    """The cached plan for `key`, or None (missing or unreadable files are a miss, logged)."""
    path = Path(cache_dir) / f"{key}.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return plan_from_json(data["plan"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("plan cache %s is unreadable (%s); planning again", path, exc)
        return None


def save_plan(cache_dir: str | os.PathLike, key: str, plan: Plan, fields: dict[str, Any]) -> Path:
    """Write the plan atomically (a temporary file renamed into place) and return its path."""
    directory = Path(cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    body = json.dumps({"key": key, "fields": fields, "plan": plan_to_json(plan)}, sort_keys=True, default=str)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(body)
    os.replace(tmp, path)
    return path
