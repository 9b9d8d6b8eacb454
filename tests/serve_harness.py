"""The real server in this process: both ranks of train_free_infer as two threads over local_pair, rank 0
running launch.server.serve (uvicorn on a loopback port) exactly as under torchrun, but without the
launch (seconds, not a minute). Requests go over real HTTP with http.client."""
from __future__ import annotations

import http.client
import json
import threading
import time
from contextlib import contextmanager

import pytest

from tests.tiny_models import free_port


class Served:
    def __init__(self, port: int):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.uvicorn = None  # the uvicorn.Server serve() built
        self.outcome: dict[int, object] = {}

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = 30) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=body, headers=headers, encode_chunked="Transfer-Encoding" in headers)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, object]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, data = self.request("POST", path, raw, headers)
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data.decode("utf-8", "replace")

    def health(self) -> dict:
        status, data = self.request("GET", "/health", timeout=5)
        return json.loads(data) | {"http_status": status}


@contextmanager
def served(*overrides: str, timeout_s: float = 20.0):
    """Yield a Served for a pair of ranks started with these config overrides (serve.port is chosen here)."""
    import uvicorn

    import train_free_infer
    from launch.config import load_config
    from netbridge.channel import local_pair

    port = free_port()
    cfg = [load_config([*overrides, f"serve.port={port}", "output.stream=false"]) for _ in (0, 1)]
    channels = local_pair(timeout_s)
    s = Served(port)

    class Recorded(uvicorn.Server):
        def __init__(self, config):
            super().__init__(config)
            if s.uvicorn is None:  # (a harness nested in another subclasses the outer one's Recorded)
                s.uvicorn = self

    def run(rank: int) -> None:
        try:
            (train_free_infer.rank0 if rank == 0 else train_free_infer.rank1)(cfg[rank], channels[rank])
            s.outcome[rank] = None
        except BaseException as e:  # noqa: BLE001 - examined by the tests
            s.outcome[rank] = e
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(uvicorn, "Server", Recorded)
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while True:
            try:
                if s.health()["status"] == "ok":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and threads[0].is_alive(), f"the server did not come up: {s.outcome}"
            time.sleep(0.1)
        s.threads = threads
        try:
            yield s
        finally:
            if s.uvicorn is not None:
                s.uvicorn.should_exit = True  # what SIGINT/SIGTERM do
            for t in threads:
                t.join(30)
