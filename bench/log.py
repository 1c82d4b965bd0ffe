"""Mirror a finished record to Weights & Biases (one run per case). The JSONL row is the truth.

wandb is imported here only, lazily; any W&B failure is logged and swallowed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict

from bench.records import RunRecord

log = logging.getLogger(__name__)
MODES = ("offline", "online", "disabled")


def mirror_to_wandb(record: RunRecord, mode: str, project: str, directory: str) -> None:
    if mode == "disabled":
        return
    os.environ.setdefault("WANDB_SILENT", "true")
    run = None
    try:
        import wandb

        run = wandb.init(
            mode=mode, project=project, dir=directory, config=record.config,
            name=f"{record.model}-{record.preset}/{record.cluster}/{record.method}/{record.mode}",
            group=record.case_key, job_type=record.mode,
            tags=[record.model, record.cluster, record.method, record.status],
        )
        for i, t in enumerate(record.iter_times_s or []):
            run.log({"time/iter_s": t}, step=i)
        summary = {k: v for k, v in asdict(record).items()
                   if k not in ("config", "iter_times_s", "plan") and v is not None}
        run.summary.update(summary)
    except Exception as exc:  # a W&B problem must never cost the row, which is already written
        log.warning("W&B mirror failed (%s: %s); the JSONL row is kept", type(exc).__name__, exc)
    finally:
        if run is not None:
            try:
                run.finish()
            except Exception as exc:
                log.warning("W&B finish failed: %s", exc)
