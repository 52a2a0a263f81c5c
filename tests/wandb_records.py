"""Read back an offline wandb run (``run-ID.wandb``): its records, its history rows. No tests here.

wandb >= 0.19 writes it from its Go core and ships no Python reader; the format is
LevelDB's log format after a 7-byte header (``:W&B``, magic 0xBEE1, version 0): 32 KiB
blocks of chunks, each ``crc32 (4) | length (2, LE) | type (1: full, 2: first, 3: middle,
4: last) | data``, a block's tail too short for a chunk header padded with zeros.
"""
import json
import struct
from pathlib import Path
from typing import Dict, Iterator, List

BLOCK, HEADER, CHUNK = 32768, 7, 7


def records(path: Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, path
    offset, pending = HEADER, b""
    while offset + CHUNK <= len(data):
        left = BLOCK - offset % BLOCK
        if left < CHUNK:
            offset += left
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + CHUNK])
        if kind == 0 and length == 0:  # the zero padding at a block's end
            offset += left
            continue
        chunk, offset = data[offset + CHUNK:offset + CHUNK + length], offset + CHUNK + length
        pending += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(path: Path) -> List[Dict]:
    """Each ``wandb.log`` row: ``{key: value}`` with its ``_step``."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def run_info(path: Path) -> Dict:
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            run = record.run
            return {"id": run.run_id, "name": run.display_name, "project": run.project, "notes": run.notes}
    return {}
