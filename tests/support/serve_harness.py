"""The real server in this process: both ranks of train_free_infer as two threads over local_pair, rank 0
running launch.serve.server.serve (uvicorn on a loopback port) exactly as under torchrun, but without the
launch (seconds, not a minute). Requests go over real HTTP with http.client.

Also what the serving tests share: tiny models with a tokenizer and a chat template (chat_folder), the
overrides of the in-process server (served_args) and of one under torchrun (serve_args, wait_healthy;
relay_nodes: two torchruns meeting at a loopback relay),
and the shape of OpenAI's error JSON."""
from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest
from transformers import AutoTokenizer

from tests.support.tiny_models import REPO, free_port, kill_launch, save_tiny, save_tiny_tokenizer


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

    def stream(self, path: str, body: dict, timeout: float = 30, headers: dict | None = None):
        """A streamed request (stream=true): its connection (close it to go away) and its events' data as they come."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        assert response.status == 200, response.read()

        def events():
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    yield line[len("data: "):]
        return conn, events()

    def wait_for(self, ready, timeout_s: float = 20.0) -> dict:
        """Poll /health until ready(health) holds; returns that health."""
        deadline = time.monotonic() + timeout_s
        while not ready(health := self.health()):
            assert time.monotonic() < deadline, health
            time.sleep(0.005)
        return health


@contextmanager
def served(*overrides: str, timeout_s: float = 20.0):
    """Yield a Served for a pair of ranks started with these config overrides (serve.port is chosen here)."""
    import uvicorn

    import train_free_infer as entry
    from launch import ranks as lives
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
            (entry.rank_zero if rank == 0 else lives.last_rank)(cfg[rank], channels[rank])
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


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
MAX_LEN = 2048


def chat_folder(folder, seed: int, layers: int = 4):
    save_tiny(folder, "qwen2", seed=seed, layers=layers)
    save_tiny_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def serve_args(target, draft, port):
    return [f"model.target={target}", "model.dtype=float32", f"model.max_len={MAX_LEN}", "draft.kind=model",
            f"draft.model={draft}", "draft.dtype=float32", f"draft.max_len={MAX_LEN}", f"serve.port={port}",
            f"gen.max_new_tokens={MAX_LEN - 64}"]  # the disconnect tests ask for that much


def launch_served(target, draft, port: int, ranks: int, *extra: str, torchrun: tuple[str, ...] = ()) -> subprocess.Popen:
    """train_free_infer.py serving the tiny pair on `port` under torchrun with `ranks` ranks on this host
    (`torchrun`: more of its options), in a process group of its own (os.killpg ends every rank); stderr piped."""
    return launch_train_free_infer([*serve_args(target, draft, port), *extra], ranks, torchrun)


def launch_train_free_infer(overrides: list[str], ranks: int, torchrun: tuple[str, ...] = ()) -> subprocess.Popen:
    """train_free_infer.py with these config overrides, as launch_served starts it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *torchrun, str(REPO / "train_free_infer.py"), *overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)


@contextmanager
def relay_nodes(tmp_path, model_args, *extra: str, relay_args: tuple[str, ...] = (), max_restarts: int = 2):
    """(a function starting node `rank` of a served 2-node launch through a relay on loopback, its serve.port):
    one torchrun of one rank per node, meeting at the relay (tandem-relay rendezvous, transport.kind=relay,
    --max_restarts); `model_args(port)`: the overrides naming the model and serve.port (serve_args for the tiny
    pair). Every torchrun started is killed at the end, then the relay."""
    from tests.support.relay_harness import PAIRING, TOKEN, relay_process
    token, pairing = tmp_path / "token", tmp_path / "pairing"
    token.write_bytes(TOKEN)
    pairing.write_bytes(PAIRING)
    port, started = free_port(), []

    def node(rank: int):
        rdzv = ("--nnodes=2", "--rdzv_backend=tandem-relay", f"--rdzv_endpoint={relay.addr}", "--rdzv_id=serve-restarts",
                f"--rdzv_conf=node_rank={rank},join_timeout=120,relay_token_file={token}",
                f"--max_restarts={max_restarts}")
        relay_overrides = ["transport.kind=relay", f"transport.relay_token_file={token}", f"transport.secret_file={pairing}"]
        started.append(launch_train_free_infer([*model_args(port), *relay_overrides, *extra], 1, rdzv))
        return started[-1]
    with relay_process(tmp_path, *relay_args) as relay:
        try:
            yield node, port
        finally:
            for p in started:
                kill_launch(p)  # a stopped process (SIGSTOP) dies of SIGKILL too


def wait_healthy(url: str, proc, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n{proc.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if json.load(r)["status"] == "ok":
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("the server did not come up")


SERVED_MAX_NEW = 32


def served_args(target, draft, *extra):
    return [f"model.target={target}", "model.dtype=float32", "model.max_len=512", "draft.kind=model",
            f"draft.model={draft}", "draft.dtype=float32", "draft.max_len=512", f"gen.max_new_tokens={SERVED_MAX_NEW}",
            "transport.timeout_s=20", *extra]


def post_together(url: str, bodies: list[dict], path: str = "/v1/completions") -> tuple[list[tuple[int, dict]], int]:
    """POST every body at once, each from its own thread; the answers (status, JSON) in order, and the most
    requests /health saw live meanwhile."""
    answers, seen, done = [None] * len(bodies), [0], threading.Event()

    def post(i):
        request = urllib.request.Request(f"{url}{path}", data=json.dumps(bodies[i]).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                answers[i] = r.status, json.load(r)
        except urllib.error.HTTPError as e:
            answers[i] = e.code, json.load(e)

    def watch():
        while not done.is_set():
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                seen[0] = max(seen[0], json.load(r)["live"])
            time.sleep(0.003)
    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    done.set()
    watcher.join()
    return answers, seen[0]


EIGHT_PROMPTS = [([5, 6, 7], 20), ([9, 8, 7, 6, 5, 4], 12), ([11], 24), ([30, 31, 32, 33], 16), ([77, 78], 9),
                 ([100, 3, 100, 3, 100], 18), ([250, 251, 252, 253, 254, 255, 256], 14), ([42], 22)]  # (ids, max_tokens)


def is_openai_error(answer) -> bool:
    return isinstance(answer, dict) and set(answer.get("error", {})) == {"message", "type", "param", "code"} \
        and bool(answer["error"]["message"])


def rank_pid(proc: subprocess.Popen, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=`rank` now (None between attempts): torchrun's children, by their
    environment."""
    from pathlib import Path
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == proc.pid \
                    and f"RANK={rank}".encode() in (d / "environ").read_bytes().split(b"\0"):
                return int(d.name)
        except (OSError, IndexError, ValueError):
            continue
    return None
