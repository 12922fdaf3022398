"""Read the records of an offline W&B run (its run-*.wandb file), to check what reached it.

The file is a LevelDB-style log (7-byte file header, 32 KiB blocks, records split into
FULL/FIRST/MIDDLE/LAST chunks with a 7-byte header) of wandb's protobuf Records; wandb no
longer ships a Python reader for it.
"""

from __future__ import annotations

import json
from pathlib import Path

BLOCK = 32768
HEADER = 7


def _payloads(data: bytes):
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:
            pos += left_in_block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):
            yield pending
            pending = b""


def read_run(run_dir: str | Path) -> dict:
    """{'history': [{key: value}...], 'config': {key: value}, 'exit_code': int or None (not finished)} of the
    offline run in `run_dir`."""
    from wandb.proto import wandb_internal_pb2 as pb

    (file,) = Path(run_dir).glob("run-*.wandb")
    history, config, exit_code = [], {}, None
    for payload in _payloads(file.read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return {"history": history, "config": config, "exit_code": exit_code}
