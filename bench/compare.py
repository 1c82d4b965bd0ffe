"""The main job: run every implemented method as its own case and print the comparison.

    python -m bench.compare                          # tiny BERT on local_hetero2, all methods
    python -m bench.compare model=vit cluster=local_hetero4 method=dp_ev,dp_cp

Takes the runner's overrides; `method=a,b` picks a subset (default: every conf/method option).
"""

from __future__ import annotations

import sys

from hydra.errors import HydraException

from bench.cluster import ConfigError
from bench.records import RunRecord
from bench.run import (
    check_group_choices,
    compose_config,
    group_options,
    method_modes,
    run_case,
)
from bench.table import BASELINE, print_table


def compare(overrides: list[str]) -> list[RunRecord]:
    check_group_choices(overrides)
    chosen = [o for o in overrides if o.startswith("method=")]
    rest = [o for o in overrides if not o.startswith("method=")]
    if chosen:
        methods = chosen[-1].split("=", 1)[1].split(",")
    else:  # every implemented method that can run in this mode: conf/method is the registry
        mode = compose_config(*rest).mode
        methods = []
        for m in sorted(group_options("method"), key=lambda m: (m != BASELINE, m)):
            modes = method_modes(m)
            if mode in modes:
                methods.append(m)
            else:
                print(f"note: {m} skipped: it supports mode={','.join(modes)} only")
    return [run_case(compose_config(*rest, f"method={m}")) for m in methods]


def main(argv: list[str]) -> int:
    try:
        records = compare(argv)
    except (ConfigError, HydraException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = [r.__dict__ for r in records]
    print_table(rows, title=f"hetbench compare: {rows[0]['model']}-{rows[0]['preset']} on "
                            f"{rows[0]['cluster']} ({rows[0]['mode']})")
    return 0 if all(r.status == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
