"""What identifies the weights a saved KV slice was computed with (kvcache.disk.SliceKey.model).

A rank's KV for layers [first, last) depends on the embeddings and every layer before `last`, i.e. on every
earlier rank's weights too, and a host may hold only its own shards. So each rank names what it loads
(`stage_identity`) and every rank keys its files by the identity of the whole pipeline (`pipeline_identity`
of all ranks' names, in rank order): a change anywhere makes every old file unreachable.

A rank's name depends on the weights' bytes, never on names, sizes or times alone (two checkpoints of one
shape with equal mtimes are common: Nix stores, reproducible images, `touch -r`):
- a Hub folder: the commit and the sha256 the Hub lists for each file (model_parallel.hub's source.json). The
  bytes are tied to them on fetch: every range must come with that file's ETag (an LFS file's sha256) and the
  commit, and a file held whole is hashed against the listed sha256 before use.
- a local folder: config.json's bytes and, for each safetensors file the stage reads, its name and the sha256
  of its bytes (`content_digest`). Hashing reads each file once; the digest is remembered in `cache_dir`
  (cache.dir/weights-sha256/, one small record per file) under what identifies the file's version on disk:
  its path, size, mtime, ctime, inode and device. Any write, copy, rename over it or touch changes one of
  them (the kernel sets ctime; no one can set it back), so the file is hashed again, and a copy of the folder
  elsewhere costs one hashing, never a cold cache.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from pathlib import Path

from model_parallel.hub import file_digest, source_of
from model_parallel.loader import checkpoint_index, stage_checkpoint_tensors

MEMO = "weights-sha256"  # the digests' records, a folder inside cache.dir
RACY_NS = 2 * 10 ** 9  # a file changed this recently may change again within the same timestamp tick: not remembered


def stage_identity(folder: str | Path, first: int, last: int, embed: bool, head: bool, extra: dict | None = None,
                   cache_dir: str | Path | None = None) -> str:
    """A digest of what this rank loads for layers [first, last) (+ embeddings / head), and of `extra`:
    whatever else changes the numbers (e.g. the 4-bit settings). `cache_dir`: where the weights' digests are
    remembered (None: each file is hashed at every call)."""
    folder = Path(folder)
    digest = hashlib.sha256(json.dumps(extra or {}, sort_keys=True).encode())
    source = source_of(folder)
    if source is not None:
        digest.update(json.dumps({k: source.get(k) for k in ("repo_id", "commit", "digests")}, sort_keys=True).encode())
        return digest.hexdigest()
    digest.update((folder / "config.json").read_bytes())
    index = checkpoint_index(folder)
    memo = Path(cache_dir) / MEMO if cache_dir is not None else None
    for file in sorted({index[name] for name in stage_checkpoint_tensors(folder, first, last, embed, head)}):
        digest.update(f"{file.name}\0{content_digest(file, memo)}\0".encode())
    return digest.hexdigest()


def content_digest(file: Path, memo: Path | None) -> str:
    """The sha256 of the file's bytes: from `memo` when it holds a record of this very version of the file,
    else read in full (and recorded)."""
    version = file_version(file)
    record = memo / f"{hashlib.sha256(version['path'].encode()).hexdigest()[:32]}.json" if memo is not None else None
    remembered = read_record(record) if record is not None else None
    if remembered is not None and remembered.get("version") == version:
        return remembered["sha256"]
    sha256 = file_digest(file, "sha256")
    if record is not None and file_version(file) == version and time.time_ns() - version["changed_ns"] > RACY_NS:
        write_record(record, {"version": version, "sha256": sha256})
    return sha256


def file_version(file: Path) -> dict:
    """What changes whenever the file's bytes may have: where it is (links resolved) and its stat."""
    st = os.stat(file)
    return {"path": str(file.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino, "device": st.st_dev, "changed_ns": max(st.st_mtime_ns, st.st_ctime_ns)}


def read_record(record: Path) -> dict | None:
    try:
        value = json.loads(record.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: the file is hashed again
        return None
    return value if isinstance(value, dict) and isinstance(value.get("sha256"), str) else None


def write_record(record: Path, value: dict) -> None:
    """Through a temporary file and a rename: ranks sharing cache.dir may write the same record at once. A
    record that cannot be written costs a hashing at the next start, nothing else."""
    tmp = record.with_name(f".{record.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(value))
        os.replace(tmp, record)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def numerics(**settings) -> dict:
    """`extra` for stage_identity: the settings given (dtype, 4-bit) and the library versions whose kernels
    computed the KV (an upgrade may change the last bits: a cold cache, never a file from other kernels)."""
    import torch
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__, **settings}
