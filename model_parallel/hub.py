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
"""
from __future__ import annotations

import json
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from model_parallel.loader import ModelLoadError, one_line

# org/name[@revision]; a revision may hold slashes (refs/pr/1)
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
# The small files a rank needs besides weights (tokenizer* covers tokenizer.json, tokenizer_config.json, tokenizer.model).
SMALL_FILES = ["config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer*",
               "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
               "chat_template.json"]
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
RECORD_EVERY = 8 * 2 ** 20  # bytes between progress records while a range streams in: what a resume may redo


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


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


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
              "cache_dir": str(snapshot.parent.parent.parent)}
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


def source_of(folder: str | Path) -> dict | None:
    """The Hub id a loader folder stands for (written by `resolve`), or None for a local folder."""
    path = Path(folder) / "source.json"
    return json.loads(path.read_text()) if path.is_file() and (Path(folder) / "config.json").is_symlink() else None


def fetch_stage(folder: str | Path, first: int, last: int, embed: bool, head: bool, rank: int,
                progress: str | None = None) -> Fetched | None:
    """Fetch the byte ranges of the tensors this stage reads (None: a local folder, nothing to fetch)."""
    source = source_of(folder)
    if source is None:
        return None
    from model_parallel.loader import stage_checkpoint_tensors
    folder = Path(folder)
    names = stage_checkpoint_tensors(folder, first, last, embed, head)
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
        data = json.loads(index.read_text())
        return data["weight_map"], int((data.get("metadata") or {}).get("total_size") or 0)
    from model_parallel.loader import checkpoint_index
    return {name: SINGLE for name in checkpoint_index(folder)}, 0


class Shard:
    """One safetensors file of a Hub checkpoint as this host holds it: whole (a link into huggingface_hub's
    cache) or partial (a sparse file at full size plus the record of the byte ranges it holds)."""

    def __init__(self, folder: Path, file: str, source: dict, rank: int):
        self.folder, self.file, self.source, self.rank = folder, file, source, rank
        self.path = folder / file
        self.record_path = folder / f"{file}.ranges.json"
        self.size: int | None = None

    def fetch(self, tensors: list[str], bar=None) -> tuple[int, int]:
        """Make the header and `tensors` present. Returns (bytes fetched now, bytes that were present)."""
        whole = self.whole_in_standard_cache()
        if whole is not None:
            link(self.path, whole)
            self.record_path.unlink(missing_ok=True)
            self.size = os.path.getsize(whole)
            return 0, self.share(tensors)
        if self.path.is_symlink():  # a whole file once linked, since evicted from the standard cache
            self.path.unlink()
        from filelock import FileLock
        with FileLock(str(self.path) + ".lock"):  # ranks sharing one cache extend the same file in turn
            record = self.read_record()
            fetched = self.get_missing(record, [(0, 8)], bar)
            header_end = 8 + struct.unpack("<Q", self.read(0, 8))[0]
            fetched += self.get_missing(record, [(8, header_end)], bar)
            fetched += self.get_missing(record, self.tensor_ranges(tensors, header_end), bar)
            self.size = record["size"]
        share = self.share(tensors)
        return fetched, share - fetched

    def share(self, tensors: list[str]) -> int:
        header_end = 8 + struct.unpack("<Q", self.read(0, 8))[0]
        return header_end + sum(b - a for a, b in self.tensor_ranges(tensors, header_end))

    def tensor_ranges(self, tensors: list[str], header_end: int) -> list[tuple[int, int]]:
        """The byte ranges of `tensors` in the file, adjacent ones merged (one request each)."""
        header = json.loads(self.read(8, header_end - 8))
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

    # --- the partial file and its record ---------------------------------------------------------
    def read_record(self) -> dict:
        if self.record_path.exists() and self.path.exists():
            return json.loads(self.record_path.read_text())
        return {"size": None, "ranges": []}

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

    def ensure_size(self, record: dict, response) -> None:
        """The file at its full size (the total of Content-Range) before the first write: safetensors checks
        that the data covers every tensor of the header. Unwritten parts are holes, not disk."""
        size = int(response.headers["Content-Range"].rpartition("/")[2])
        if record["size"] not in (None, size):
            raise HubError(f"{self.path} was started from a file of {record['size']} bytes but {self.source['spec']} "
                           f"now serves {size}; delete {self.folder} and run again")
        if record["size"] is None or not self.path.exists():
            with open(self.path, "ab") as f:
                f.truncate(size)
            record.update(size=size, ranges=[])
            write_json(self.record_path, record)

    def add_range(self, record: dict, start: int, end: int) -> None:
        record["ranges"] = union(record["ranges"] + [[start, end]])
        write_json(self.record_path, record)


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
