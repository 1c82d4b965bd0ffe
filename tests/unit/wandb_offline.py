"""Read back what an offline W&B run logged, from its run-<id>.wandb file (tests only).

wandb 0.31 writes offline runs with its Go core and ships no Python reader for them. The file is
a 7-byte header (":W&B", magic, version) then a LevelDB-style log: 32 KiB blocks of chunks, each
a 7-byte header (crc32, little-endian length, type: 1 full, 2 first, 3 middle, 4 last) and its
payload; the joined payloads are `wandb_internal_pb2.Record` messages.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

_BLOCK = 32 * 1024
_CHUNK_HEADER = 7


def read_records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, records, pending = 7, [], b""
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        if pos + _CHUNK_HEADER + length > len(data):  # a chunk still being written
            break
        payload = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind == 0:
            continue
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(run_dir: str | Path, wait_s: float = 20.0) -> dict:
    """history (one dict per logged step), history_keys, summary and artifacts {name: files}.

    wandb's core may still be writing the file when `run.finish()` returns: wait (up to
    `wait_s`) for the run's closing `exit` record.
    """
    (path,) = Path(run_dir).glob("run-*.wandb")
    deadline = time.monotonic() + wait_s
    while True:
        records = read_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out = {"history": [], "history_keys": set(), "summary": {}, "artifacts": {}, "config": {}}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            step = {_key(i): json.loads(i.value_json) for i in record.history.item}
            out["history"].append(step)
            out["history_keys"].update(k for k in step if not k.startswith("_"))
        elif kind == "summary":
            out["summary"].update({_key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "artifact":
            out["artifacts"][record.artifact.name] = sorted(m.path for m in record.artifact.manifest.contents)
        elif kind == "run":
            out["config"].update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
    return out
