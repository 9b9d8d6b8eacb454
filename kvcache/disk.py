"""One rank's slice of the KV cache for a token prefix, kept on disk across requests and restarts.

In a layer-split launch no rank holds the whole KV: each saves exactly its own layers' part. A prefix is
stored in blocks of `block_tokens` tokens, one file per block (a JSON header, then the raw tensors:
`pack`), named by a chained hash:

    t_k = sha256(t_{k-1} + the token ids of block k)      (t_-1 empty): block k's prefix hash
    file of block k: <k>-<sha256(key + t_k)>.kv
    key: the weights' identity, dtype, layer range, KV shape, device kind, role, block size

so block k's name stands for the key and every token before the block's end. The prefix hashes carry no key:
rank 0 computes them and sends them to the other ranks, which never see token ids. Why blocks rather than one
file per prompt: two requests that share a system prompt and differ after it share the system prompt's blocks,
and the longest saved prefix of any token list is found by walking its blocks from the first until a file is
missing (a stat each). Only whole blocks are saved; a prompt's last partial block is prefilled again.
256 tokens a block (the default) loses at most 255 tokens of reuse and keeps a 40k-token prompt at ~160 files.

What makes a stale file impossible to load: a changed key (another model, dtype, split, device) gives other
file names, and the header repeats the key, the block's prefix hash and a sha256 of its tensors, all checked on read.
A file that fails any check (corrupt, truncated, foreign) is refused in one warning line and removed; its
tokens are then prefilled like any others. So is a file that cannot be read at all (no permission, an I/O error,
a folder in its place): every OSError on the cache's files is a warning or nothing, never the end of a run.
Nothing is wrong because of the cache, at worst slower.

Writes never run on the round loop: `save` snapshots the new blocks (a copy on the cache's own device, which on
CPU is the host copy itself) and a background thread moves them to the host, checksums and writes them
(through a temporary file and an atomic rename, so a reader never sees half a file). The folder is bounded
by `max_bytes`: after each write the least recently used blocks go, a chain's later blocks before its earlier
ones (a chain's files share one timestamp, set on every read and save), since block k is useless without 0..k-1.
The bound is the folder's, whichever process writes there.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
import time
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvcache.static_cache import StaticKVCache

FORMAT = "tandem-kv/2"
BLOCK_TOKENS = 256
SUFFIX = ".kv"
MAX_HEADER = 1 << 20  # a block file's JSON header; more is not one of ours
STALE_TMP_S = 3600  # a temporary file this old was left by a writer that died mid-write


@dataclass(frozen=True)
class SliceKey:
    """What a slice's KV depends on besides its tokens. `model` must cover every weight the KV depends on:
    the embeddings and every layer before `last`, i.e. every earlier rank's weights too (pipeline_identity)."""
    model: str
    dtype: str  # "float32", "bfloat16", ...
    first: int  # the layers [first, last)
    last: int
    kv_heads: int
    head_dim: int
    device: str = "cpu"  # device kind: other kernels give other last bits, so fp32 parity would not hold
    role: str = "target"  # "target", or "drafter" for rank 0's drafter

    @classmethod
    def of_cache(cls, cache: StaticKVCache, model: str, role: str = "target") -> SliceKey:
        layers = sorted(cache.keys)
        if layers != list(range(layers[0], layers[-1] + 1)):
            raise ValueError(f"the cache's layers {layers} are not one contiguous range")
        _, heads, _, head_dim = cache.keys[layers[0]].shape
        return cls(model, str(cache.keys[layers[0]].dtype).removeprefix("torch."), layers[0], layers[-1] + 1, heads,
                   head_dim, cache.keys[layers[0]].device.type, role)

    def text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def tensor_names(self) -> list[str]:
        return sorted(f"{kind}.{layer}" for layer in range(self.first, self.last) for kind in "kv")


class BadBlock(Exception):
    """A block file that must not be used; the message says why."""


@dataclass
class SavedPrefix:
    """Blocks read and checked (host tensors), ready to be copied into a cache: the first `tokens` tokens."""
    block_tokens: int
    blocks: list[dict[str, torch.Tensor]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_tokens

    def load_into(self, cache: StaticKVCache, n: int, start: int = 0) -> None:
        """Write tokens [start, n) (n <= self.tokens; the ranks agree on it) at their positions; the cache then
        holds n tokens. `start`: what the cache already holds of the same prefix (the last request's)."""
        if not 0 <= start <= n <= self.tokens:
            raise ValueError(f"tokens [{start}, {n}) asked of a saved prefix of {self.tokens}")
        size = self.block_tokens
        for k in range(start // size, -(-n // size)):
            a, b = max(start, k * size), min(n, (k + 1) * size)
            for name, tensor in self.blocks[k].items():
                kind, layer = name.split(".")
                dest = (cache.keys if kind == "k" else cache.values)[int(layer)]
                dest[0, :, a:b].copy_(tensor[:, a - k * size:b - k * size], non_blocking=True)
        cache.rewind(n)


def prefix_hashes(tokens: list[int], block_tokens: int) -> list[str]:
    """t_0..t_m-1 for the m whole blocks of `tokens` (see the module's docstring)."""
    digest, hashes = b"", []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        digest = hashlib.sha256(digest + array("q", tokens[start:start + block_tokens]).tobytes()).digest()
        hashes.append(digest.hex())
    return hashes


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def block_index(path: Path) -> int:
    return int(path.name.split("-", 1)[0])


def read_block(path: Path, key: SliceKey, prefix: str, block_tokens: int) -> dict[str, torch.Tensor]:
    """The block's tensors, or BadBlock naming the first check it fails."""
    meta, tensors = unpack(path.read_bytes())
    expected = {"format": FORMAT, "key": key.text(), "prefix": prefix, "block_tokens": str(block_tokens)}
    wrong = [name for name, value in expected.items() if meta.get(name) != value]
    if wrong:
        raise BadBlock(f"its header's {wrong[0]} is not this cache's (a foreign or stale file)")
    if sorted(tensors) != key.tensor_names():
        raise BadBlock("it holds other layers than this rank's")
    shape, dtype = (key.kv_heads, block_tokens, key.head_dim), getattr(torch, key.dtype)
    odd = [n for n, t in tensors.items() if tuple(t.shape) != shape or t.dtype != dtype]
    if odd:
        raise BadBlock(f"tensor {odd[0]} is {tuple(tensors[odd[0]].shape)} {tensors[odd[0]].dtype}, not {shape} {dtype}")
    if tensors_digest(tensors) != meta.get("sha256"):
        raise BadBlock("its tensors do not match the checksum in its header (corrupt)")
    return tensors


def pack(tensors: dict[str, torch.Tensor], meta: dict) -> bytes:
    """A block file: 8 bytes of header length, a JSON header (`meta` and where each tensor lies), the tensors'
    bytes. Written with torch alone (kvcache needs nothing else), read back by `unpack`."""
    layout, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        raw = tensors[name].contiguous().view(torch.uint8).numpy().tobytes()
        layout[name] = {"dtype": str(tensors[name].dtype).removeprefix("torch."), "shape": list(tensors[name].shape),
                        "offset": offset, "nbytes": len(raw)}
        chunks.append(raw)
        offset += len(raw)
    header = json.dumps({"meta": meta, "tensors": layout}).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(chunks)


def unpack(data: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, tensors) of a block file, or BadBlock: a short, foreign or garbled file never reaches torch."""
    size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 < size <= min(MAX_HEADER, len(data) - 8):
        raise BadBlock("not a block file (its header length is missing or out of range)")
    try:
        header = json.loads(data[8:8 + size])
        meta, layout, body = header["meta"], header["tensors"], memoryview(data)[8 + size:]
        tensors = {}
        for name, t in layout.items():
            if not 0 <= t["offset"] <= t["offset"] + t["nbytes"] <= len(body):
                raise BadBlock(f"tensor {name} lies past the end of the file (truncated)")
            dtype = getattr(torch, str(t["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise BadBlock(f"tensor {name} has no dtype torch knows ({str(t['dtype'])[:40]!r})")
            raw = torch.frombuffer(bytearray(body[t["offset"]:t["offset"] + t["nbytes"]]), dtype=torch.uint8)
            tensors[name] = raw.view(dtype).reshape(t["shape"])
    except BadBlock:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise BadBlock(f"not a readable block file ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
    return meta, tensors


@dataclass
class WriteJob:
    paths: list[Path]  # the whole chain so far: each is stamped as just used
    new: dict[Path, tuple[str, dict[str, torch.Tensor]]]  # the blocks to write: prefix hash, device snapshots
    ready: torch.cuda.Event | None  # set once the snapshots are complete (CUDA)
    device: torch.device | None = None  # the snapshots' device (CUDA)


class KVDiskStore:
    """Saved prefixes of one slice (one rank's layers, or the drafter), in `folder`."""

    def __init__(self, folder: str | Path, key: SliceKey, max_bytes: int, block_tokens: int = BLOCK_TOKENS,
                 warn=None):
        if max_bytes <= 0 or block_tokens <= 0:
            raise ValueError(f"cache.max_bytes ({max_bytes}) and the block size ({block_tokens}) must be positive")
        self.folder, self.key, self.max_bytes, self.block_tokens = Path(folder), key, max_bytes, block_tokens
        self.warn = warn or (lambda line: print(f"warning: {line}", file=sys.stderr, flush=True))
        self.unreadable: set[Path] = set()  # files already warned about (a server would repeat it at every request)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # checked at start (launch.build): removed or locked since; reads find nothing
            self.warn(f"kv cache: {self.folder} cannot be made ({_named(e)}); prefixes are not restored nor saved")
        self.jobs: queue.Queue[WriteJob | None] = queue.Queue()
        self.pending: set[Path] = set()  # queued, not yet on disk (only the writer thread discards)
        self.writer: threading.Thread | None = None
        self.write_failed = False  # warn once, not at every block
        self.side_streams: dict = {}  # device -> the writer's CUDA stream there

    def paths(self, hashes: list[str]) -> list[Path]:
        """The files of the blocks whose prefix hashes (prefix_hashes) are `hashes`."""
        key = f"{self.key.text()}\0{self.block_tokens}\0"
        return [self.folder / f"{k}-{hashlib.sha256((key + h).encode()).hexdigest()}{SUFFIX}"
                for k, h in enumerate(hashes)]

    # --- reading ------------------------------------------------------------------------------
    def held(self, hashes: list[str]) -> int:
        """Leading blocks of `hashes` whose files exist (not yet read nor checked)."""
        paths = self.paths(hashes)
        return next((k for k, p in enumerate(paths) if not is_file(p)), len(paths))

    def read(self, hashes: list[str]) -> SavedPrefix:
        """The longest saved prefix of the blocks `hashes`, read and checked; a bad file ends it (one warning,
        the file removed)."""
        prefix = SavedPrefix(self.block_tokens)
        paths = self.paths(hashes)
        for path, h in zip(paths, hashes):
            try:
                prefix.blocks.append(read_block(path, self.key, h, self.block_tokens))
            except FileNotFoundError:
                break
            except BadBlock as e:
                self.warn(f"kv cache file {path} refused: {e}; its tokens are prefilled again and the file removed")
                remove(path)
                break
            except OSError as e:  # no permission, an I/O error, a folder in its place: the cache is optional
                if path not in self.unreadable:
                    self.warn(f"kv cache file {path} cannot be read ({_named(e)}); its tokens are prefilled again")
                self.unreadable.add(path)
                remove(path)  # when it can be: the next save writes it anew
                break
        stamp(paths[:len(prefix.blocks)])
        return prefix

    # --- writing (off the round loop) -----------------------------------------------------------
    def save(self, cache: StaticKVCache, hashes: list[str]) -> int:
        """Queue the blocks `hashes` (which `cache` holds at their positions) that are not on disk yet;
        returns how many. Costs the round loop a device copy of the new blocks, never a disk write."""
        if not hashes:
            return 0
        paths = self.paths(hashes)
        new = {}
        for k, (path, h) in enumerate(zip(paths, hashes)):
            if path in self.pending or is_file(path):
                continue
            a, b = k * self.block_tokens, (k + 1) * self.block_tokens
            new[path] = h, {f"{kind}.{layer}": store[layer][0, :, a:b].clone()
                            for kind, store in (("k", cache.keys), ("v", cache.values)) for layer in store}
        ready = None
        if cache.length.device.type == "cuda" and new:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(cache.length.device))
        self.pending.update(new)
        if self.writer is None:
            self.writer = threading.Thread(target=self.write_loop, name="kv-disk-writer", daemon=True)
            self.writer.start()
        self.jobs.put(WriteJob(paths, new, ready, cache.length.device))
        return len(new)

    def flush(self) -> None:
        """Wait until every queued block is on disk (a one-shot run calls this before it exits)."""
        if self.writer is not None:
            self.jobs.join()

    def close(self) -> None:
        if self.writer is not None:
            self.jobs.put(None)
            self.writer.join()
            self.writer = None

    def write_loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                self.write(job)
            except Exception as e:  # a full disk or a removed folder must not end the launch: the cache is optional
                if not self.write_failed:
                    self.warn(f"kv cache: writing to {self.folder} failed ({' '.join(str(e).split())}); "
                              "prefixes are not saved until it works again")
                self.write_failed = True
            finally:
                self.pending.difference_update(job.new)
                self.jobs.task_done()
        self.jobs.task_done()

    def write(self, job: WriteJob) -> None:
        for path, (prefix, snapshot) in job.new.items():
            if job.ready is not None:  # the copy to the host on a side stream of the cache's device: rounds keep theirs
                if job.device not in self.side_streams:
                    self.side_streams[job.device] = torch.cuda.Stream(device=job.device)
                side = self.side_streams[job.device]
                with torch.cuda.stream(side):
                    side.wait_event(job.ready)
                    snapshot = {name: t.to("cpu") for name, t in snapshot.items()}
            meta = {"format": FORMAT, "key": self.key.text(), "prefix": prefix,
                    "block_tokens": str(self.block_tokens), "sha256": tensors_digest(snapshot)}
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                tmp.write_bytes(pack(snapshot, meta))
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)  # half a file (a full disk) never stays behind
                raise
            self.write_failed = False
        stamp(job.paths)
        self.evict()

    def evict(self) -> None:
        """Remove least recently used blocks until the folder is within max_bytes."""
        files, now = [], time.time()
        with os.scandir(self.folder) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                    if entry.name.endswith(SUFFIX):
                        files.append((st.st_mtime_ns, -block_index(Path(entry.name)), st.st_size, entry.path))
                    elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                        os.unlink(entry.path)
                except (OSError, ValueError):  # removed meanwhile by another process, or not one of ours
                    continue
        total = sum(f[2] for f in files)
        for _, _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            remove(path)
            total -= size


def stamp(paths: list[Path]) -> None:
    """Mark a chain as just used: one timestamp for all its files (eviction then takes later blocks first)."""
    now = time.time_ns()
    for path in paths:
        try:
            os.utime(path, ns=(now, now))
        except OSError:  # removed meanwhile, or not ours to touch: its place in the eviction order is all it costs
            pass


def is_file(path: Path) -> bool:
    """Path.is_file, with a folder that cannot be searched (EACCES) read as "not there" instead of raised."""
    try:
        return path.is_file()
    except OSError:
        return False


def remove(path: Path) -> None:
    """Unlink `path` if it can be (a file another user owns, or a folder, stays, and is read as missing)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _named(error: OSError) -> str:
    """An OSError in one short line (kvcache imports only torch: not model_parallel's one_line)."""
    return " ".join(f"{type(error).__name__}: {error}".split())[:160]
