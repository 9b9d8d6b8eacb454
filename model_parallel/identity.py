"""What identifies the weights a saved KV slice was computed with (kvcache.disk.SliceKey.model).

A rank's KV for layers [first, last) depends on the embeddings and every layer before `last`, i.e. on every
earlier rank's weights too, and a host may hold only its own shards. So each rank names what it loads
(`stage_identity`) and every rank keys its files by the identity of the whole pipeline (`pipeline_identity`
of all ranks' names, in rank order): a change anywhere makes every old file unreachable.

A rank's name: for a Hub folder, the commit and the digests the Hub lists for the files (model_parallel.hub's
source.json); for a local folder, config.json's bytes and, for each safetensors file the stage reads, its
name, size, modification time and header (every tensor's dtype, shape and offsets). Hashing the weights'
bytes would be exact but reads the whole checkpoint at every start; a file rewritten in place with the same
size, header and mtime is the one change this misses (cp and save_pretrained all change the mtime). A copy of
the folder elsewhere, or a touch, costs a cold cache, never a wrong one.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from model_parallel.hub import MAX_HEADER, source_of
from model_parallel.loader import checkpoint_index, stage_checkpoint_tensors


def stage_identity(folder: str | Path, first: int, last: int, embed: bool, head: bool, extra: dict | None = None) -> str:
    """A digest of what this rank loads for layers [first, last) (+ embeddings / head), and of `extra`:
    whatever else changes the numbers (e.g. the 4-bit settings)."""
    folder = Path(folder)
    digest = hashlib.sha256(json.dumps(extra or {}, sort_keys=True).encode())
    source = source_of(folder)
    if source is not None:
        digest.update(json.dumps({k: source.get(k) for k in ("repo_id", "commit", "digests")}, sort_keys=True).encode())
        return digest.hexdigest()
    digest.update((folder / "config.json").read_bytes())
    index = checkpoint_index(folder)
    for file in sorted({index[name] for name in stage_checkpoint_tensors(folder, first, last, embed, head)}):
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        digest.update(safetensors_header(file))
    return digest.hexdigest()


def safetensors_header(file: Path) -> bytes:
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return f.read(min(length, MAX_HEADER))


def numerics(**settings) -> dict:
    """`extra` for stage_identity: the settings given (dtype, 4-bit) and the library versions whose kernels
    computed the KV (an upgrade may change the last bits: a cold cache, never a file from other kernels)."""
    import torch
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__, **settings}
