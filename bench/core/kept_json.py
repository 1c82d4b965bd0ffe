"""A JSON object kept in the user's cache folder (bench.core.paths.user_cache_dir) for later
processes: read whole once per process, and on save merged with what other processes kept
meanwhile and written whole (a temporary file renamed into place: a killed writer leaves the
old file). One file per torch version and version of the module whose results it keeps, so a
file from other code is never read. A file that does not load is a miss, made again and
rewritten; a folder that is not writable keeps nothing (a lost shortcut, never a failure)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from bench.core.paths import user_cache_dir

log = logging.getLogger(__name__)


class KeptJson:
    """`name`: the file's stem; `source`: the module whose results it keeps (its bytes version
    the file); `what`: how a warning names it."""

    def __init__(self, name: str, source: str, what: str):
        self.name, self.source, self.what = name, source, what
        self._read: dict | None = None

    def path(self) -> Path:
        code = hashlib.sha256(Path(self.source).read_bytes()).hexdigest()[:12]
        return user_cache_dir() / f"{self.name}-{torch.__version__}-{code}.json"

    def load(self) -> dict:
        """What processes kept (read once per process, then what this one saved added)."""
        if self._read is None:
            self._read = {}
            path = self.path()
            try:
                body = json.loads(path.read_text()) if path.is_file() else {}
                self._read = dict(body)
            except (OSError, ValueError, TypeError) as exc:
                log.warning("%s %s is unreadable (%s); made again", self.what, path, exc)
        return self._read

    def save(self, entries: dict) -> bool:
        """Keep `entries` beside what the file holds now; whether they were written."""
        if not entries:
            return True
        path = self.path()
        try:
            on_disk = json.loads(path.read_text()) if path.is_file() else {}
            on_disk = on_disk if isinstance(on_disk, dict) else {}
        except (OSError, ValueError):
            on_disk = {}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            # json.dumps, not json.dump: the same text, by the C encoder (dump's is Python's)
            text = json.dumps({**on_disk, **entries})
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("%s %s not written (%s)", self.what, path, exc)
            return False
        self.load().update(entries)
        return True
