"""`hetbench <command> [args]`: one entry point for every tool of the harness.

    hetbench run model=bert cluster=local_hetero2 method=hap     # = python -m bench.run ...
    hetbench compare cluster=local_hetero4                       # = python -m bench.compare ...
    hetbench plan model=vgg19 preset=paper cluster=paper_hetero method=hap
    hetbench <command> --help

Each command is the module of the same name (`python -m bench.<module>` works too); this only
dispatches, importing nothing but the chosen command's module.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, one line for the listing)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("bench.run", "run one case or a Hydra sweep (-m) and append its rows to the records"),
    "compare": ("bench.compare", "every method on one case, interleaved rounds, a ranked table"),
    "plan": ("bench.plan", "print a method's plan for one case (plans and simulates; no workers)"),
    "report": ("bench.report", "figures, CSVs and speedup tables from any records file or sweep"),
    "figures": ("bench.figures", "the paper's figures, simulated, with their CSVs"),
    "calibrate": ("bench.calibrate", "measured vs simulated iteration time on emulated clusters"),
    "profile": ("bench.profile", "profile this host: compute per op class, collectives per kind"),
    "regress": ("bench.regress", "throughput regression check against the committed baseline"),
    "noise": ("bench.noise", "the noise floor: one case run 10 times"),
    "dilation": ("bench.dilation", "how faithfully emulated devices keep their speed"),
    "planner-check": ("bench.planner_check", "hap with each part switched off; beam vs exact"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: hetbench <command> [args...]   (hetbench <command> --help for its options)", "", "commands:"]
    lines += [f"  {name:{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(
            f"error: unknown command {command!r}; use one of: {', '.join(COMMANDS)} (hetbench --help lists them)",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    if command == "run":
        # Hydra's main reads sys.argv itself (and exits on its own for its own errors).
        sys.argv = [f"hetbench {command}", *rest]
        return module.run_cli()
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
