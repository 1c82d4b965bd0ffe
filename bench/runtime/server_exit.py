"""Imported by the workers' server alone, first among the modules it preloads (bench.runtime.launch).

When the launcher that started the server exits, the server leaves through SystemExit, and the
interpreter would then tear down the torch (and DeepSpeed) it imported, which takes seconds, all
of it after the launcher itself had gone. The server holds the launcher's stdout and stderr, so
whoever reads them (a shell pipe, subprocess.run, CI) would wait that long too
(docs/runtime.md, "Workers"). The server writes nothing of its own and its
forked workers leave with os._exit already, so it ends the same way once every other exit
handler has run.
"""

import atexit
import os
import sys


def _leave() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


atexit.register(_leave)  # registered before the rest of the preloads': run after theirs
