"""The relay harness shared by the relay tests: a relay subprocess, raw authenticated clients reading
link frames, a connected RelayChannel pair, and the event loops to run the relay under."""
from __future__ import annotations

import importlib.util
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from netbridge import auth
from netbridge.link import HEADER
from netbridge.relay_channel import RelayChannel
from tests.support.tiny_models import REPO

TOKEN = b"test-relay-token-" + secrets.token_hex(8).encode()  # the relay's --secret-file: admission only
PAIRING = b"test-pairing-" + secrets.token_hex(8).encode()  # the two ranks' pairing secret: the relay never has it


# ---- helpers shared by the relay tests ---------------------------------------------------------
class RelayProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path):
        self.proc, self.port, self.log_path = proc, port, log_path
        self.addr = f"127.0.0.1:{port}"

    def rss_mb(self, field: str = "VmHWM") -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
        raise AssertionError(f"{field} not in /proc/{self.proc.pid}/status")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None


@contextmanager
def relay_process(tmp_path: Path, *extra: str, secret: bytes = TOKEN, host: str = "127.0.0.1", netns: str | None = None,
                  command: list[str] | None = None):
    """`python -m netbridge.relay` (or `command`, e.g. tests/support/relay_without_torch.py's) on a free port; yields
    once it prints that it listens; SIGTERM at the end."""
    assert secret != PAIRING, "the relay is given its token, never the nodes' pairing secret"
    secret_file = tmp_path / f"relay-secret-{secrets.token_hex(4)}"
    secret_file.write_bytes(secret + b"\n")
    secret_file.chmod(0o600)
    log_path = tmp_path / f"relay-{secrets.token_hex(4)}.log"
    cmd = [*(command or [sys.executable, "-m", "netbridge.relay"]), "--host", host, "--port", "0", "--secret-file", str(secret_file), *extra]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=REPO)
    try:
        line = _readline(proc, 60)
        m = re.search(r"listening on \S+:(\d+)", line or "")
        assert m, f"relay did not start: {line!r}\n{log_path.read_text()}"
        yield RelayProcess(proc, int(m.group(1)), log_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _readline(proc: subprocess.Popen, timeout_s: float) -> str | None:
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    return got[0] if got else None


def dial_raw(relay: RelayProcess | str, session: str, rank: int, secret: bytes = TOKEN, timeout_s: float = 5.0) -> socket.socket:
    addr = relay if isinstance(relay, str) else relay.addr
    return auth.dial(addr, secret, session, auth.ROLE_DATA, rank, 2, timeout_s)


def read_link(sock: socket.socket, timeout_s: float = 5.0):
    """(type, body) of one link frame, or None at EOF / reset."""
    sock.settimeout(timeout_s)
    try:
        header = recv_exact(sock, HEADER.size)
        if header is None:
            return None
        kind, n = HEADER.unpack(header)
        body = recv_exact(sock, n) if n else b""
        return None if body is None else (kind, body)
    except (ConnectionResetError, BrokenPipeError):
        return None


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def closed_by_peer(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """True when the other end closes (EOF or reset) within the timeout; other bytes are skipped."""
    sock.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


def pair(relay: RelayProcess, session: str, timeout_s: float = 10.0, **kw) -> tuple[RelayChannel, RelayChannel]:
    """Both ranks of a session, connected through the relay (rank 1 dials from a thread)."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("c1", RelayChannel.connect(relay.addr, session, 1, TOKEN, PAIRING, timeout_s=timeout_s, **kw)))
    t.start()
    c0 = RelayChannel.connect(relay.addr, session, 0, TOKEN, PAIRING, timeout_s=timeout_s, **kw)
    t.join(timeout_s)
    assert "c1" in box, "rank 1 did not connect"
    return c0, box["c1"]


def run_in_thread(fn, *args):
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["error"] = e
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def loops() -> list:
    """The relay's event loops to test: asyncio always, uvloop where it is installed (the relay's --loop auto)."""
    has_uvloop = importlib.util.find_spec("uvloop") is not None
    return ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(not has_uvloop, reason="uvloop not installed"))]


def relay_ring(relay: RelayProcess, ranks: int, session: str = "ring", timeout_s: float = 30.0) -> list:
    """Each rank's (link from the rank before, link to the rank after) on the ring 0 -> 1 -> ... -> N-1 -> 0 through
    the relay, as netbridge.channel.local_ring gives them in process: one two-member session per two neighbours
    (the lower rank its rank 0), so with two ranks both links are one channel."""
    pairs: dict = {}
    for r in range(ranks):  # each two neighbours dialled once: with two ranks, r=0 and r=1 name one pair (dialled twice,
        # the first pair's channels were left open, and resuming when the relay replaced them they broke the second's)
        neighbours = frozenset((r, (r + 1) % ranks))
        if neighbours not in pairs:
            pairs[neighbours] = pair(relay, f"{session}/{min(neighbours)}-{max(neighbours)}", timeout_s)

    def end(rank: int, peer: int) -> RelayChannel:
        return pairs[frozenset((rank, peer))][0 if rank < peer else 1]
    return [(end(r, (r - 1) % ranks), end(r, (r + 1) % ranks)) for r in range(ranks)]


@contextmanager
def relay_in_thread(port: int = 0, **kw):
    """A netbridge.relay.Relay on loopback (`port` 0: a free one), in process, its event loop in a daemon thread;
    closed at the end. Keywords go to Relay (api_port=0: an API port too)."""
    import asyncio

    from netbridge.relay.server import Relay
    relay = Relay(TOKEN, "127.0.0.1", port, **{"handshake_timeout_s": 1.0, **kw})
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run() -> None:
        loop.run_until_complete(relay.start())
        started.set()
        loop.run_forever()
    thread = threading.Thread(target=run, name="relay-loop", daemon=True)
    thread.start()
    assert started.wait(10), "the relay did not start"
    relay.loop = loop
    try:
        yield relay
    finally:
        asyncio.run_coroutine_threadsafe(relay.close(), loop).result(10)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(10)  # the cancelled sweeper ends
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
