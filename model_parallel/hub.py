"""model.target / draft.model given as a Hub id: `org/name` or `org/name@revision` (branch, tag or commit).

An existing local path always wins. For a Hub id, the small files (config, generation config, tokenizer,
the safetensors index) come through huggingface_hub's `snapshot_download` into its standard cache, so
HF_HOME / HF_HUB_CACHE, HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE=1 behave as they do for transformers.
The split is settled from those alone. Then each rank fetches only the bytes its stage reads: each shard's
safetensors header (its first 8 + n bytes) gives every tensor's offsets, and the Hub serves HTTP ranges
of the same resolve URLs huggingface_hub downloads from. Two ranks sharing a shard each fetch their part.

Cache layout, inside huggingface_hub's folder of the repo (so `hf cache delete` removes it with the rest):

    <HF_HUB_CACHE>/models--org--name/
        blobs/ refs/ snapshots/<commit>/         huggingface_hub's own: config.json, tokenizer files, index
        tandem/<commit>/                         the folder the loader reads (model.target becomes it)
            config.json -> ../../snapshots/<commit>/config.json      one link per small file
            source.json                           repo id, revision, commit: what this folder stands for
            model-00001-of-00004.safetensors      the shard at its full size, sparse: its header and the
                                                  tensors fetched so far at their own offsets, holes elsewhere
            model-00001-of-00004.safetensors.ranges.json   the byte ranges it holds

Partial shards never go into huggingface_hub's blobs/snapshots: a library reading the standard cache
would take a partial file for a whole one. A shard the standard cache already holds whole (e.g. after
from_pretrained) is linked instead of fetched. An interrupted fetch keeps what arrived (recorded every
few MiB) and resumes there; a second launch finds every range present and fetches nothing.

What is checked (nothing that arrives is trusted): every range response must name the commit and the file
version (ETag) the shard's first range named, or the ranges held are dropped; the header is bounded (100 MB,
safetensors' own limit) before it is fetched and every tensor's dtype, shape and offsets are checked
against it and the file's size before any tensor byte is asked for; a shard held whole (a link into
huggingface_hub's cache, or every range fetched) is checked against the digest the tree API lists for it
(an LFS file's sha256) before use. The bytes of a partial shard are not: no per-range digest is published.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from model_parallel.lines import human, one_line
from model_parallel.loader import ModelLoadError, read_weight_map

# org/name[@revision]; a revision may hold slashes (refs/pr/1)
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
# The small files a rank needs besides weights (tokenizer* covers tokenizer.json, tokenizer_config.json, tokenizer.model).
SMALL_FILES = ["config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer*",
               "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
               "chat_template.json"]
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
RECORD_EVERY = 8 * 2 ** 20  # bytes between progress records while a range streams in: what a resume may redo
MAX_HEADER = 100_000_000  # safetensors' own limit on a header's length (it refuses a longer one)
# Bits per element of each safetensors dtype (the format's list, sub-byte floats included).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E5M2FNUZ": 8, "F8_E4M3FNUZ": 8,
              "F8_E8M0": 8, "E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


class HubError(ModelLoadError):
    """A Hub id that cannot be used (not found, gated, offline and not cached, ...): one line."""


@dataclass
class Fetched:
    """What one stage's fetch did, in bytes."""
    fetched: int  # over the network now
    cached: int  # of the stage's share, already on disk
    whole: int  # the checkpoint's safetensors files, all of them

    def describe(self) -> str:
        share = self.fetched + self.cached
        return (f"fetched {human(self.fetched)} now, {human(self.cached)} already cached: {human(share)} = "
                f"{share / max(self.whole, 1):.0%} of the checkpoint's {human(self.whole)}")


def is_hub_id(spec: str) -> bool:
    """A Hub id, and not a path that exists here (a local folder always wins)."""
    return HUB_ID.fullmatch(spec) is not None and not Path(spec).expanduser().exists()


def resolve(spec: str, setting: str, cache_dir: str | None = None, rank: int = 0) -> tuple[str, str]:
    """(the folder to load from, the line that says which was used). For a Hub id: its small files into
    the cache and the loader's folder of links (see the module doc); no weight is fetched here but, for
    an unsharded checkpoint, the header of model.safetensors (it is that checkpoint's index)."""
    if not is_hub_id(spec):
        return spec, f"{setting}: local folder {spec}"
    match = HUB_ID.fullmatch(spec)
    repo_id, revision = match["repo"], match["revision"] or "main"
    snapshot = Path(download_small_files(spec, repo_id, revision, cache_dir, rank))
    commit = snapshot.name
    view = snapshot.parent.parent / "tandem" / commit
    view.mkdir(parents=True, exist_ok=True)
    for file in snapshot.iterdir():
        link(view / file.name, Path("..") / ".." / "snapshots" / commit / file.name)
    source = {"spec": spec, "repo_id": repo_id, "revision": revision, "commit": commit,
              "cache_dir": str(snapshot.parent.parent.parent),
              "digests": file_digests(spec, repo_id, commit, cache_dir, view / "source.json")}
    write_json(view / "source.json", source)
    if not (view / "config.json").exists():
        raise HubError(f"{spec} has no config.json at revision {revision}; is it a transformers model?")
    if not (view / INDEX).exists():
        Shard(view, SINGLE, source, rank).fetch([])  # its header only: the names of its tensors
    return str(view), f"{setting}: {spec} from the Hub (commit {commit[:12]}, cache {snapshot.parent.parent})"


def download_small_files(spec: str, repo_id: str, revision: str, cache_dir: str | None, rank: int) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, IncompleteSnapshotError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=SMALL_FILES,
                                 library_name="tandem", user_agent={"rank": str(rank)})
    except GatedRepoError as e:
        raise HubError(f"{spec} is gated: accept its terms on the Hub and set HF_TOKEN ({one_line(e, 120)})") from None
    except RepositoryNotFoundError:
        raise HubError(f"{spec} is neither a local folder nor a model on the Hub at {constants.ENDPOINT}; check the "
                       f"path or id (a private model needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"{spec}: {repo_id} has no revision {revision!r} (give a branch, tag or commit)") from None
    except IncompleteSnapshotError as e:
        missing = re.search(r"missing \((.*?)\)\.", str(e))
        raise HubError(f"offline: {missing[1] if missing else 'a file'} of {spec} is not in the cache "
                       f"({cache_dir or constants.HF_HUB_CACHE}); run once online, or unset HF_HUB_OFFLINE") from None
    except LocalEntryNotFoundError as e:
        where = f"{spec} is not in the cache ({cache_dir or constants.HF_HUB_CACHE}), so config.json cannot be read"
        if constants.is_offline_mode():
            raise HubError(f"offline: {where}; run once online, or unset HF_HUB_OFFLINE") from None
        cause = one_line(e.__cause__, 120) if e.__cause__ else "no answer"
        raise HubError(f"cannot reach {constants.ENDPOINT} ({cause}) and {where}; check the network or HF_ENDPOINT") from None
    except OSError as e:  # connection errors, HTTP errors the hub did not classify
        raise HubError(f"{spec}: cannot download from {constants.ENDPOINT} ({one_line(e, 160)}); check the network or "
                       f"HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to run from the cache") from None


def file_digests(spec: str, repo_id: str, commit: str, cache_dir: str | None, known: Path) -> dict[str, list[str]]:
    """file -> [kind, digest] from the Hub's tree API: an LFS file's sha256 ("sha256"), else its git blob
    id ("git-sha1"). What a whole shard is checked against. Offline: what an earlier run recorded."""
    from huggingface_hub import HfApi, constants
    if constants.is_offline_mode():
        return json.loads(known.read_text()).get("digests", {}) if known.is_file() else {}
    try:
        entries = list(HfApi().list_repo_tree(repo_id, revision=commit, expand=False))
    except Exception as e:  # noqa: BLE001 - the network or the Hub, in one line
        raise HubError(f"{spec}: cannot list its files at {constants.ENDPOINT} ({one_line(e, 160)}); check the network "
                       f"or HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to run from the cache") from None
    digests = {}
    for entry in entries:
        lfs = getattr(entry, "lfs", None)
        if lfs is not None:
            digests[entry.path] = ["sha256", lfs.sha256]
        elif getattr(entry, "blob_id", None):
            digests[entry.path] = ["git-sha1", entry.blob_id]
    return digests


def file_digest(path: Path, kind: str) -> str:
    """The file's sha256, or its git blob id (sha1 of "blob <size>\0" + content), read in 8 MiB pieces."""
    digest = hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        while piece := f.read(8 * 2 ** 20):
            digest.update(piece)
    return digest.hexdigest()


def source_of(folder: str | Path) -> dict | None:
    """The Hub id a loader folder stands for (written by `resolve`), or None for a local folder."""
    path = Path(folder) / "source.json"
    return json.loads(path.read_text()) if path.is_file() and (Path(folder) / "config.json").is_symlink() else None


def fetch_stage(model, first: int, last: int, embed: bool, head: bool, rank: int,
                progress: str | None = None) -> Fetched | None:
    """Fetch the byte ranges of the tensors this stage reads (None: a local folder, nothing to fetch).
    `model`: a folder or the loader.ModelSource the launch parsed."""
    folder = Path(getattr(model, "folder", model))
    source = source_of(folder)
    if source is None:
        return None
    from model_parallel.loader import stage_checkpoint_tensors
    names = stage_checkpoint_tensors(model, first, last, embed, head)
    weight_map, whole = checkpoint_files(folder)
    by_file: dict[str, list[str]] = {}
    for name in sorted(names):
        by_file.setdefault(weight_map[name], []).append(name)
    shards = [Shard(folder, file, source, rank) for file in sorted(by_file)]
    from tqdm import tqdm
    with tqdm(desc=progress, unit="B", unit_scale=True, disable=progress is None, leave=False) as bar:
        done = [shard.fetch(by_file[shard.file], bar) for shard in shards]
    fetched, cached = sum(d[0] for d in done), sum(d[1] for d in done)
    return Fetched(fetched, cached, whole or sum(s.size or 0 for s in shards))


def checkpoint_files(folder: Path) -> tuple[dict[str, str], int]:
    """(tensor name -> shard file, the checkpoint's size in bytes as its index states it, 0 if unknown)."""
    index = folder / INDEX
    if index.exists():
        weight_map = read_weight_map(index)  # checked names; a damaged file is one line there
        metadata = json.loads(index.read_text()).get("metadata")
        total = metadata.get("total_size") if isinstance(metadata, dict) else 0
        return weight_map, total if isinstance(total, int) and total > 0 else 0
    from model_parallel.loader import checkpoint_index
    return {name: SINGLE for name in checkpoint_index(folder)}, 0


class Shard:
    """One safetensors file of a Hub checkpoint as this host holds it: whole (a link into huggingface_hub's
    cache) or partial (a sparse file at full size plus the record of the byte ranges it holds)."""

    def __init__(self, folder: Path, file: str, source: dict, rank: int):
        self.folder, self.file, self.source = folder, file, source
        self.path = folder / file
        self.part = PartialFile(self.path, source, rank, self.expected_digest())
        self.size: int | None = None

    def fetch(self, tensors: list[str], bar=None) -> tuple[int, int]:
        """Make the header and `tensors` present. Returns (bytes fetched now, bytes that were present)."""
        whole = self.whole_in_standard_cache()
        if whole is not None:
            self.check_cached_whole(Path(whole))
            link(self.path, whole)
            self.part.record_path.unlink(missing_ok=True)
            self.size = os.path.getsize(whole)
            return 0, self.share(tensors)
        if self.path.is_symlink():  # a whole file once linked, since evicted from the standard cache
            self.path.unlink()
        from filelock import FileLock
        with FileLock(str(self.path) + ".lock"):  # ranks sharing one cache extend the same file in turn
            record = self.part.read_record()
            fetched = self.part.get_missing(record, [(0, 8)], bar)
            self.size = record["size"]
            header_end = self.header_end()  # bounded before any range of the header is asked for
            fetched += self.part.get_missing(record, [(8, header_end)], bar)
            fetched += self.part.get_missing(record, self.tensor_ranges(tensors), bar)
            if missing(record["ranges"], [(0, record["size"])]) == []:
                self.check_fetched_whole(record)
        share = self.share(tensors)
        return fetched, share - fetched

    def share(self, tensors: list[str]) -> int:
        return self.header_end() + sum(b - a for a, b in self.tensor_ranges(tensors))

    # --- the header: bounded and checked before a byte it points to is fetched ---------------------
    def broken(self, what: str) -> HubError:
        return HubError(f"{self.file} of {self.source['spec']} (commit {self.source['commit'][:12]}): {what}; the "
                        f"checkpoint itself is broken, not the network (running again cannot help): use another revision")

    def header_end(self) -> int:
        """8 + the header's length, which must be within safetensors' limit and the file."""
        length = struct.unpack("<Q", self.part.read(0, 8))[0]
        size = self.size if self.size is not None else os.path.getsize(self.path)
        if length > MAX_HEADER:
            raise self.broken(f"its safetensors header claims {length:,} bytes, over safetensors' limit of {MAX_HEADER:,}")
        if 8 + length > size:
            raise self.broken(f"its safetensors header claims {length:,} bytes, past the file's end ({size:,} bytes)")
        return 8 + length

    def header(self) -> dict[str, dict]:
        """tensor name -> its entry, each dtype, shape and data_offsets checked against the file's size."""
        header_end = self.header_end()
        size = self.size if self.size is not None else os.path.getsize(self.path)
        try:
            header = json.loads(self.part.read(8, header_end - 8))
        except ValueError as e:
            raise self.broken(f"its safetensors header is not valid JSON ({one_line(e, 100)})") from None
        if not isinstance(header, dict):
            raise self.broken(f"its safetensors header is a JSON {type(header).__name__}, not an object")
        header.pop("__metadata__", None)
        for name, entry in header.items():
            problem = tensor_entry_problem(entry, size - header_end)
            if problem:
                raise self.broken(f"tensor {name!r} in its header {problem}")
        return header

    def tensor_ranges(self, tensors: list[str]) -> list[tuple[int, int]]:
        """The byte ranges of `tensors` in the file, adjacent ones merged (one request each)."""
        header_end, header = self.header_end(), self.header()
        absent = [t for t in tensors if t not in header]
        if absent:
            raise self.broken(f"its header lacks tensor {absent[0]!r}, which model.safetensors.index.json places in it")
        spans = sorted((header_end + header[t]["data_offsets"][0], header_end + header[t]["data_offsets"][1])
                       for t in tensors)
        merged: list[tuple[int, int]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            else:
                merged.append((a, b))
        return merged

    def whole_in_standard_cache(self) -> str | None:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(self.source["repo_id"], self.file, cache_dir=self.source["cache_dir"],
                                       revision=self.source["commit"])
        return found if isinstance(found, str) else None

    # --- a whole shard: checked against the tree API's digest before use ---------------------------
    def expected_digest(self) -> tuple[str, str] | None:
        kind_digest = (self.source.get("digests") or {}).get(self.file)
        return tuple(kind_digest) if kind_digest else None

    def check_cached_whole(self, blob: Path) -> None:
        """huggingface_hub's copy, hashed once (a marker beside the view remembers the blob it checked)."""
        expected = self.expected_digest()
        if expected is None:
            return
        marker = self.folder / f"{self.file}.verified.json"
        stat = blob.stat()
        seen = {"blob": str(blob.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "digest": list(expected)}
        if marker.is_file() and json.loads(marker.read_text()) == seen:
            return
        actual = file_digest(blob, expected[0])
        if actual != expected[1]:
            raise HubError(f"{self.file} of {self.source['spec']} in huggingface_hub's cache ({blob.resolve()}) has "
                           f"{expected[0]} {actual[:16]}..., the Hub lists {expected[1][:16]}...: the cached copy is damaged; "
                           f"delete it (`hf cache delete`) and run again")
        write_json(marker, seen)

    def check_fetched_whole(self, record: dict) -> None:
        """Every range held: the file must be the one the Hub lists, else it is dropped."""
        expected = self.expected_digest()
        if expected is None or record.get("verified") == list(expected):
            return
        actual = file_digest(self.path, expected[0])
        if actual != expected[1]:
            self.part.discard()
            raise HubError(f"{self.file} of {self.source['spec']} arrived whole with {expected[0]} {actual[:16]}... but "
                           f"the Hub lists {expected[1][:16]}...: bytes were altered in transit (a proxy or a "
                           f"faulty mirror?); what was fetched is discarded: run again to fetch it anew")
        record["verified"] = list(expected)
        write_json(self.part.record_path, record)


class PartialFile:
    """A shard fetched in byte ranges: a sparse file at full size plus the record of the ranges it holds and of
    the file version they came from (the commit and ETag of the first range). `expected`: the tree API's digest
    (kind, hex), or None."""

    def __init__(self, path: Path, source: dict, rank: int, expected: tuple[str, str] | None):
        self.path, self.source, self.rank, self.expected = path, source, rank, expected
        self.folder, self.file = path.parent, path.name
        self.record_path = path.parent / f"{path.name}.ranges.json"

    def read_record(self) -> dict:
        """What is held, and what it was checked against (the commit and ETag of the first range). A record
        without them (older than the check) is not trusted: the shard is fetched anew."""
        if self.record_path.exists() and self.path.exists():
            record = json.loads(self.record_path.read_text())
            if record.get("etag") and record.get("commit"):
                return record
        return {"size": None, "ranges": []}

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
        self.record_path.unlink(missing_ok=True)

    def read(self, offset: int, length: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def get_missing(self, record: dict, wanted: list[tuple[int, int]], bar) -> int:
        """Fetch what of `wanted` the record lacks; returns the bytes fetched."""
        gaps = missing(record["ranges"], wanted)
        if gaps:
            from huggingface_hub.constants import is_offline_mode
            if is_offline_mode():
                raise HubError(f"offline (HF_HUB_OFFLINE=1): {self.file} of {self.source['spec']} is not in the cache "
                               f"(this stage needs {human(sum(b - a for a, b in gaps))} more of it, in {self.folder}); "
                               f"run once online, or unset HF_HUB_OFFLINE")
        if gaps and bar is not None:  # the total grows as each shard's header tells what it lacks
            bar.total = (bar.total or 0) + sum(b - a for a, b in gaps)
            bar.refresh()
        fetched = 0
        for a, b in gaps:
            fetched += self.get_range(record, a, b, bar)
        return fetched

    def get_range(self, record: dict, start: int, end: int, bar) -> int:
        """GET bytes [start, end) into the file at their offset, recording progress as it streams in."""
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session
        url = hf_hub_url(self.source["repo_id"], self.file, revision=self.source["commit"], endpoint=constants.ENDPOINT)
        headers = build_hf_headers(library_name="tandem", user_agent={"rank": str(self.rank)})
        headers.update({"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
        at = recorded = start
        try:
            with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=60) as response:
                self.check_response(response, start)
                self.check_identity(record, response)
                self.ensure_size(record, response)
                with open(self.path, "r+b") as f:
                    for chunk in response.iter_bytes():
                        chunk = chunk[:end - at]
                        f.seek(at)
                        f.write(chunk)
                        at += len(chunk)
                        if bar is not None:
                            bar.update(len(chunk))
                        if at - recorded >= RECORD_EVERY:
                            f.flush()
                            self.add_range(record, recorded, at)
                            recorded = at
                        if at >= end:
                            break
        except HubError:
            raise
        except Exception as e:  # noqa: BLE001 - the network, in any form: keep what arrived, say how to resume
            raise HubError(f"fetching {self.file} of {self.source['spec']} was interrupted after {human(at - start)} of "
                           f"{human(end - start)} ({one_line(e, 120)}); run again to resume where it stopped") from None
        finally:
            if at > recorded:
                self.add_range(record, recorded, at)
        if at < end:
            raise HubError(f"fetching {self.file} of {self.source['spec']}: the server sent {human(at - start)} of "
                           f"{human(end - start)}; run again to resume where it stopped")
        return end - start

    def check_response(self, response, start: int) -> None:
        from huggingface_hub.utils import hf_raise_for_status
        try:
            hf_raise_for_status(response)
        except Exception as e:  # noqa: BLE001 - the hub's own classification, in one line
            raise HubError(f"{self.file} of {self.source['spec']}: {one_line(e, 200)}") from None
        if response.status_code != 206 or not response.headers.get("Content-Range", "").startswith(f"bytes {start}-"):
            raise HubError(f"{self.source['spec']}: the server at {response.url.host} does not serve byte ranges of "
                           f"{self.file} (HTTP {response.status_code}); Tandem fetches only each rank's share")

    def check_identity(self, record: dict, response) -> None:
        """The range must come from the file version the shard's first range came from: the commit and ETag
        of the Hub's own answer (before any redirect to storage, whose URL the Hub signs for that version)."""
        hub = (list(response.history) or [response])[0]
        commit = hub.headers.get("X-Repo-Commit")
        etag = (hub.headers.get("X-Linked-Etag") or hub.headers.get("ETag") or "").removeprefix("W/").strip('"') or None
        if record.get("etag") is None:
            expected = self.expected
            if commit == self.source["commit"] and etag is not None and (expected is None or expected[0] != "sha256"
                                                                          or etag == expected[1]):
                record.update(commit=commit, etag=etag)
                return
            was = (self.source["commit"], expected[1] if expected and expected[0] == "sha256" else "as the tree lists")
        elif (commit, etag) == (record["commit"], record["etag"]):
            return
        else:
            was = (record["commit"], record["etag"])
        self.discard()
        raise HubError(f"{self.file} of {self.source['spec']} changed on the server while it was fetched (this range: "
                       f"commit {str(commit)[:12]}, ETag {str(etag)[:16]}; expected commit {was[0][:12]}, ETag {was[1][:16]}): "
                       f"the ranges held are discarded; fetch again")

    def ensure_size(self, record: dict, response) -> None:
        """The file at its full size (the total of Content-Range) before the first write: safetensors checks
        that the data covers every tensor of the header. Unwritten parts are holes, not disk."""
        size = int(response.headers["Content-Range"].rpartition("/")[2])
        if record["size"] not in (None, size):
            raise HubError(f"{self.path} was started from a file of {record['size']} bytes but {self.source['spec']} "
                           f"now serves {size}; delete {self.folder} and run again")
        if record["size"] is None or not self.path.exists():
            with open(self.path, "wb") as f:  # nothing of an earlier, untrusted file is kept
                f.truncate(size)
            record.update(size=size, ranges=[])
            write_json(self.record_path, record)

    def add_range(self, record: dict, start: int, end: int) -> None:
        record["ranges"] = union(record["ranges"] + [[start, end]])
        write_json(self.record_path, record)


def tensor_entry_problem(entry, data_size: int) -> str | None:
    """What is wrong with one tensor's header entry, given the data's size after the header (None: nothing)."""
    if not isinstance(entry, dict):
        return "is not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        return f"has dtype {dtype!r}, not one of safetensors'"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return f"has shape {shape!r}, not a list of non-negative integers"
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        return f"has data_offsets {offsets!r}, not two integers"
    start, end = offsets
    if not 0 <= start <= end <= data_size:
        return f"has data_offsets {offsets} outside the file's {data_size:,} bytes of data"
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or end - start != bits // 8:
        return f"has data_offsets {offsets} ({end - start:,} bytes) for {dtype} {shape} ({bits / 8:,.0f} bytes)"
    return None


def missing(have: list[list[int]], wanted: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `wanted` not covered by `have` (both lists of [start, end) byte ranges)."""
    gaps = []
    for a, b in wanted:
        for c, d in sorted(have):
            if d <= a or c >= b:
                continue
            if c > a:
                gaps.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            gaps.append((a, b))
    return gaps


def union(ranges: list[list[int]]) -> list[list[int]]:
    merged: list[list[int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def link(path: Path, target: str | Path) -> None:
    """`path` -> `target`, replacing whatever was there in one step (ranks of one host make the same links)."""
    if path.is_symlink() and os.readlink(path) == str(target):
        return
    tmp = path.with_name(path.name + f".link{os.getpid()}.{threading.get_ident()}")
    tmp.symlink_to(target)
    os.replace(tmp, path)


def write_json(path: Path, data: dict) -> None:
    """Atomically: a reader (or a crash) never sees half a record."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
