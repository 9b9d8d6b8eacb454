"""A stand-in for the Hugging Face Hub on loopback, for tests: the part of the protocol huggingface_hub
2.4 speaks to download (see /work/shared/reference/FACTS.md), reached through HF_ENDPOINT.

    GET  /api/models/{org}/{name}/revision/{rev}      model info: {"id", "sha", "siblings"}
    GET  /api/models/{org}/{name}/tree/{rev}          the file list: [{"type": "file", "path", "size", "oid"}],
                                                      *.safetensors as LFS files ("lfs": {"oid": sha256, ...})
    HEAD /{org}/{name}/resolve/{rev}/{file}           X-Repo-Commit, ETag, Content-Length (LFS: X-Linked-Etag
                                                      = the sha256, X-Linked-Size)
    GET  /{org}/{name}/resolve/{rev}/{file}           the file, or one byte range of it (Range: bytes=a-b)

Repositories are local folders, one per revision (a branch or tag name; its commit id answers too).
Every request is logged with what was sent, so a test asserts from the server's side which files and
bytes each client fetched. `Hostile` makes it lie: in what the files hold (served consistently: the
tree's sha256 is that of the hostile file), in what one range carries (flipped bytes, another ETag), or in
the digest it advertises.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

from tests.support.tiny_models import free_port


@dataclass
class Hostile:
    """What a hostile or broken Hub does. The file changes (header_length, bad_json_header, tensor_entries,
    weight_map) are the repository's content: tree, HEAD and every range agree on them. flip_data,
    flip_byte_at and etag_per_range lie in transit: the tree and HEAD describe the honest file."""
    flip_data: bool = False  # each range of tensor bytes (past the header) arrives with every 4th byte's top bit flipped
    etag_per_range: bool = False  # each GET of a .safetensors carries another ETag (bytes of another file behind one header)
    header_length: int | None = None  # the first 8 bytes of every .safetensors say this
    bad_json_header: bool = False  # every .safetensors header is not JSON (its length kept)
    tensor_entries: dict[str, dict] | None = None  # tensor name -> fields its header entry claims (dtype, shape, data_offsets)
    weight_map: dict[str, str] | None = None  # tensor name -> the file model.safetensors.index.json names for it
    # The tree and every ETag advertise each .safetensors file's sha256 with its last hex digit changed: honest
    # bytes under a digest that is not theirs, which a check of the digest's first digits takes for theirs
    digest_off_by_last_hex: bool = False
    flip_byte_at: int | None = None  # the .safetensors byte at this offset arrives flipped, in whatever range carries it

    def sha256(self, data: bytes) -> str:
        """The sha256 this Hub advertises for a .safetensors file (the tree's lfs oid, the ETag)."""
        sha = hashlib.sha256(data).hexdigest()
        return sha[:-1] + ("1" if sha[-1] == "0" else "0") if self.digest_off_by_last_hex else sha

    def content(self, name: str, data: bytes) -> bytes:
        """The file as this Hub stores it."""
        if name == "model.safetensors.index.json" and self.weight_map:
            index = json.loads(data)
            index["weight_map"].update(self.weight_map)
            return json.dumps(index).encode()
        if not name.endswith(".safetensors"):
            return data
        n = struct.unpack("<Q", data[:8])[0]
        header, rest = data[8:8 + n], data[8 + n:]
        if self.tensor_entries:
            parsed = json.loads(header)
            for tensor, fields in self.tensor_entries.items():
                if tensor in parsed:
                    parsed[tensor].update(fields)
            header = json.dumps(parsed).encode()
            header += b" " * (-len(header) % 8)
        if self.bad_json_header:
            header = b'{"model.norm.weight": {"dtype": "F32", ' + b" " * max(0, len(header) - 39)
        length = struct.pack("<Q", self.header_length if self.header_length is not None else len(header))
        return length + header + rest


@dataclass
class Logged:
    method: str
    repo: str
    revision: str
    file: str | None  # None for the API routes
    start: int  # the byte range sent: [start, end)
    end: int
    client: str  # "rank0", "rank1": from the User-Agent Tandem sends (huggingface_hub's user_agent), else ""

    @property
    def sent(self) -> int:
        return self.end - self.start


class StandInHub:
    def __init__(self, repos: dict[str, dict[str, Path]], fail_after_bytes: int | None = None, token: str | None = None,
                 hostile: Hostile | None = None):
        """repos: repo id -> {revision name: folder}. fail_after_bytes: drop the connection once this many
        file bytes were sent in all (an interrupted download), then serve normally again. token: every
        request must carry it (a gated model), else 401 GatedRepo as the Hub answers. hostile: how it lies."""
        self.token = token
        self.hostile = hostile or Hostile()
        self.gets = 0  # GETs of .safetensors so far: etag_per_range numbers its ETags with it
        self.repos = {repo: {rev: Path(folder) for rev, folder in revs.items()} for repo, revs in repos.items()}
        self.commits = {repo: {rev: commit_id(folder) for rev, folder in revs.items()} for repo, revs in self.repos.items()}
        self.log: list[Logged] = []
        self.fail_after_bytes = fail_after_bytes
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), self.handler())
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self) -> "StandInHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def folder(self, repo: str, revision: str) -> tuple[Path, str] | None:
        """(folder, commit) for a revision name or a commit id."""
        for rev, folder in self.repos.get(repo, {}).items():
            if revision in (rev, self.commits[repo][rev]):
                return folder, self.commits[repo][rev]
        return None

    def fetched(self, client: str = "", method: str = "GET") -> dict[str, int]:
        """file -> bytes of it sent to `client` (resolve GETs only)."""
        sent: dict[str, int] = {}
        for entry in self.log:
            if entry.file is not None and entry.method == method and entry.client == client:
                sent[entry.file] = sent.get(entry.file, 0) + entry.sent
        return sent

    def ranges(self, client: str, file: str) -> list[tuple[int, int]]:
        return [(e.start, e.end) for e in self.log if e.file == file and e.client == client and e.method == "GET"]

    def handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def client(self) -> str:
                found = re.search(r"rank/(\d+)", self.headers.get("User-Agent", ""))
                return f"rank{found[1]}" if found else ""

            def do_HEAD(self):
                self.route(head=True)

            def do_GET(self):
                self.route(head=False)

            def route(self, head: bool):
                path = unquote(urlparse(self.path).path)
                if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    hub.record(Logged("DENIED", "", "", path, 0, 0, self.client()))
                    return self.reply(401, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo",
                                                                  "X-Error-Message": "Access to this model is restricted."})
                api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/(.+?)(?:/)?", path)
                if api:
                    return self.api(*api.groups())
                resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if resolve:
                    return self.resolve(*resolve.groups(), head=head)
                self.reply(404, b'{"error": "not found"}', {"X-Error-Code": "EntryNotFound"})

            def api(self, repo: str, kind: str, revision: str):
                found = hub.folder(repo, revision)
                if found is None:
                    code = "RepoNotFound" if repo not in hub.repos else "RevisionNotFound"
                    return self.reply(404, json.dumps({"error": code}).encode(), {"X-Error-Code": code})
                folder, commit = found
                files = [hub.tree_entry(p) for p in sorted(folder.iterdir()) if p.is_file()]
                body = {"id": repo, "sha": commit, "siblings": [{"rfilename": f["path"]} for f in files]} \
                    if kind == "revision" else files
                hub.record(Logged("GET", repo, revision, None, 0, 0, self.client()))
                self.reply(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

            def resolve(self, repo: str, revision: str, file: str, head: bool):
                found = hub.folder(repo, revision)
                path = found[0] / file if found else None
                if path is None or not path.is_file():
                    code = "EntryNotFound" if found else "RevisionNotFound"
                    return self.reply(404, b"", {"X-Error-Code": code, "X-Repo-Commit": found[1] if found else ""})
                data = hub.hostile.content(file, path.read_bytes())
                start, end = 0, len(data)
                status = 200
                asked = self.headers.get("Range")
                if asked and not head:
                    a, _, b = asked.removeprefix("bytes=").partition("-")
                    start, end, status = int(a), min(len(data), int(b) + 1 if b else len(data)), 206
                headers = {"X-Repo-Commit": found[1], "ETag": f'"{git_blob_id(data)}"', "Accept-Ranges": "bytes"}
                if file.endswith(".safetensors"):  # an LFS file: the Hub's ETag for it is its sha256
                    etag = f'"{hub.hostile.sha256(data)}"'
                    if hub.hostile.etag_per_range and not head:
                        with hub.lock:
                            hub.gets += 1
                            etag = f'"{hashlib.sha256(data + bytes([hub.gets % 256])).hexdigest()}"'
                    headers.update({"X-Linked-Etag": etag, "X-Linked-Size": str(len(data)), "ETag": etag})
                if status == 206:
                    headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
                if head:
                    headers["Content-Length"] = str(len(data))
                    hub.record(Logged("HEAD", repo, revision, file, 0, 0, self.client()))
                    return self.reply(200, None, headers)
                body = data[start:end]
                if hub.hostile.flip_data and file.endswith(".safetensors") and start >= 8 + struct.unpack("<Q", data[:8])[0]:
                    flipped = bytearray(body)
                    for i in range(3, len(flipped), 4):  # the sign bit of each little-endian float32
                        flipped[i] ^= 0x80
                    body = bytes(flipped)
                at = hub.hostile.flip_byte_at
                if at is not None and file.endswith(".safetensors") and start <= at < end:
                    body = body[:at - start] + bytes([body[at - start] ^ 0x01]) + body[at - start + 1:]
                cut = hub.cut(len(body))
                hub.record(Logged("GET", repo, revision, file, start, start + (cut if cut is not None else len(body)),
                                  self.client()))
                if cut is not None:  # announce it all, send part, drop the connection
                    self.send_response(status)
                    for k, v in {**headers, "Content-Length": str(len(body))}.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.reply(status, body, headers)

            def reply(self, status: int, body: bytes | None, headers: dict):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if body is not None:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body:
                    self.wfile.write(body)

        return Handler

    def tree_entry(self, path: Path) -> dict:
        """The tree API's entry for a file: an LFS file's oid is its pointer's, the sha256 is under "lfs"."""
        data = self.hostile.content(path.name, path.read_bytes())
        if not path.name.endswith(".safetensors"):
            return {"type": "file", "path": path.name, "size": len(data), "oid": git_blob_id(data)}
        sha = self.hostile.sha256(data)
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()
        return {"type": "file", "path": path.name, "size": len(data), "oid": git_blob_id(pointer),
                "lfs": {"oid": sha, "size": len(data), "pointerSize": len(pointer)}}

    def record(self, entry: Logged) -> None:
        with self.lock:
            self.log.append(entry)

    def cut(self, size: int) -> int | None:
        """How much of a body of `size` to send before dropping the connection (None: all of it)."""
        with self.lock:
            if self.fail_after_bytes is None:
                return None
            sent = sum(e.sent for e in self.log if e.file is not None and e.method == "GET")
            if sent + size <= self.fail_after_bytes:
                return None
            cut = max(0, self.fail_after_bytes - sent)
            self.fail_after_bytes = None  # one failure, then normal service
            return cut


def commit_id(folder: Path) -> str:
    """A 40-hex commit id from the folder's content: another folder, another commit."""
    digest = hashlib.sha1()
    for p in sorted(Path(folder).iterdir()):
        if p.is_file():
            digest.update(p.name.encode() + hashlib.sha1(p.read_bytes()).digest())
    return digest.hexdigest()


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
