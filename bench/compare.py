"""The main job: run every implemented method as its own case and print the comparison.

    python -m bench.compare                          # tiny BERT on local_hetero2, all methods
    python -m bench.compare model=vit cluster=local_hetero4 method=dp_ev,dp_cp

Takes the runner's overrides; `method=a,b` picks a subset (default: every conf/method option).
"""

from __future__ import annotations

import sys
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from hydra.errors import HydraException

from bench.records import RunRecord
from bench.cluster import ConfigError
from bench.run import CONF_DIR, check_group_choices, group_options, run_case
from bench.table import BASELINE, print_table

def compare(overrides: list[str]) -> list[RunRecord]:
    check_group_choices(overrides)
    chosen = [o for o in overrides if o.startswith("method=")]
    rest = [o for o in overrides if not o.startswith("method=")]
    # Every implemented method, baseline first: the conf/method folder is the registry.
    known = sorted(group_options("method"), key=lambda m: (m != BASELINE, m))
    methods = chosen[-1].split("=", 1)[1].split(",") if chosen else known
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        configs = [compose("config", overrides=rest + [f"method={m}"]) for m in methods]
    if not chosen:  # by default, only the methods that can run in this mode
        runnable = []
        for cfg in configs:
            modes = getattr(instantiate(cfg.method), "modes", ("real",))
            if cfg.mode in modes:
                runnable.append(cfg)
            else:
                print(f"note: {cfg.method.name} skipped: it supports mode={','.join(modes)} only")
        configs = runnable
    return [run_case(cfg) for cfg in configs]


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
