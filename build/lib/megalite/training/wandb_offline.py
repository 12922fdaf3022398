"""One offline W&B run directory per training run, however often it resumes.

W&B cannot resume an offline run: every start writes a new offline-run-<time>-<id> directory, and
`wandb sync` of several directories with one id keeps only one of them (wandb/wandb#3841). So a resumed
offline run reads the history of the earlier directories of its id (up to the step it resumes from),
logs it again into its own directory, and removes them once its own is finished: one directory, the
whole history, one `wandb sync`.

Reading: the run-*.wandb file is a LevelDB-style log (7-byte file header, 32 KiB blocks, records split
into FULL/FIRST/MIDDLE/LAST chunks with a 7-byte header) of wandb's protobuf Records; wandb no longer
ships a Python reader for it.
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
        if pos + HEADER + length > len(data):  # the last record of a part that was killed mid-write
            return
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):
            yield pending
            pending = b""


def read_run(run_dir: str | Path) -> dict:
    """{'history': [{key: value}...], 'config': {key: value}} of the offline run in `run_dir`."""
    from wandb.proto import wandb_internal_pb2 as pb

    (file,) = Path(run_dir).glob("run-*.wandb")
    history, config = [], {}
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
    return {"history": history, "config": config}


def earlier_parts(wandb_dir: Path, run_id: str) -> list[Path]:
    """The offline directories of run `run_id` under `wandb_dir` (W&B's `wandb/` folder), oldest first."""
    return sorted(p for p in wandb_dir.glob(f"offline-run-*-{run_id}") if list(p.glob("run-*.wandb")))


def history_until(parts: list[Path], step: int) -> list[tuple[dict, int]]:
    """(record, step) of every step up to `step` logged in `parts`, in step order; a later part's row for a step
    replaces an earlier one's (a killed part's steps after its checkpoint are logged again by the next)."""
    rows: dict[int, dict] = {}
    for part in parts:
        for row in read_run(part)["history"]:
            logged = row.get("_step")
            if logged is not None and logged <= step:
                rows[logged] = {k: v for k, v in row.items() if not k.startswith("_")}
    return [(rows[s], s) for s in sorted(rows)]
