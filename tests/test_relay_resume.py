"""RelayChannel surviving the network, and its end-to-end sealing, on loopback.

- the relay killed and restarted on the same port mid-stream, and one rank's socket shut down
  mid-stream: a ping-pong of numbered messages arrives exactly once, in order, on both sides;
- past transport.reconnect_s: one PeerError line naming the relay;
- a relay stand-in that flips a ciphertext byte, or replays a frame: refused with one PeerError line;
- what crosses the relay does not contain the plaintext.
"""
from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
import torch

from netbridge.channel import PeerError
from netbridge.link import DATA, HEADER, LinkSocket
from netbridge.relay_channel import RelayChannel
from tests.test_relay import SECRET, _exact, pair, relay_process
from tests.tiny_models import free_port

MESSAGES = 120
TIMEOUT_S = 3.0  # heartbeats every 0.5 s: a silently dead link is noticed within 1.5 s


def ping_pong(c0: RelayChannel, c1: RelayChannel, fault_at: int, fault) -> tuple[list[int], list[int]]:
    """Rank 0 sends ping i and waits for pong i; rank 1 echoes. `fault()` runs (in its own thread) once rank 0 has sent
    ping `fault_at`. Returns the numbers each side received, in order."""
    got0, got1, errors = [], [], []

    def echo():
        try:
            for _ in range(MESSAGES):
                i = c1.recv("ping").meta["i"]
                got1.append(i)
                c1.send("pong", {"i": i}, x=torch.full((64,), float(i)))
        except Exception as e:  # noqa: BLE001 - reported by the test thread
            errors.append(f"rank 1: {e}")
    t = threading.Thread(target=echo, daemon=True)
    t.start()
    faults = []
    for i in range(MESSAGES):
        c0.send("ping", {"i": i}, x=torch.full((64,), float(i)))
        if i == fault_at:
            faults.append(threading.Thread(target=fault, daemon=True))
            faults[-1].start()
        msg = c0.recv("pong")
        assert torch.equal(msg.tensors["x"], torch.full((64,), float(msg.meta["i"])))
        got0.append(msg.meta["i"])
        time.sleep(0.005)
    t.join(30)
    for f in faults:
        f.join(30)
    assert not errors, errors
    return got0, got1


def test_relay_killed_and_restarted_mid_stream(tmp_path):
    port = free_port()
    args = ("--no-store", "--port", str(port))  # the later --port wins over relay_process's --port 0
    with relay_process(tmp_path, *args) as relay:
        c0, c1 = pair(relay, "restart", timeout_s=TIMEOUT_S, reconnect_s=30)
        restarted = {}

        def kill_and_restart():
            relay.proc.send_signal(signal.SIGKILL)
            relay.proc.wait(10)
            time.sleep(1.0)
            restarted["cm"] = relay_process(tmp_path, *args)
            restarted["relay"] = restarted["cm"].__enter__()
        try:
            t0 = time.monotonic()
            got0, got1 = ping_pong(c0, c1, MESSAGES // 3, kill_and_restart)
            elapsed = time.monotonic() - t0
        finally:
            c0.close()
            c1.close()
            if "cm" in restarted:
                restarted["cm"].__exit__(None, None, None)
    assert got0 == got1 == list(range(MESSAGES))
    assert c0.resumes >= 1 and c1.resumes >= 1
    print(f"\nrelay restart: {MESSAGES} round trips exactly once in order, {c0.resumes}+{c1.resumes} resumes, {elapsed:.1f} s")


def test_one_ranks_socket_shut_down_mid_stream(tmp_path):
    with relay_process(tmp_path, "--no-store") as relay:
        c0, c1 = pair(relay, "cut", timeout_s=TIMEOUT_S, reconnect_s=20)
        try:
            # rank 1 loses its socket; rank 0 then learns from the relay that rank 1's link dropped (PEER_LEFT)
            got0, got1 = ping_pong(c0, c1, MESSAGES // 2, lambda: c1.link.sock.shutdown(socket.SHUT_RDWR))
        finally:
            c0.close()
            c1.close()
        assert got0 == got1 == list(range(MESSAGES))
        assert c0.resumes >= 1 and c1.resumes >= 1
        assert "session cut: rank 1 left" in relay.log()


def test_past_reconnect_s_the_error_is_one_line_naming_the_relay(tmp_path):
    with relay_process(tmp_path, "--no-store") as relay:
        c0, c1 = pair(relay, "gone", timeout_s=TIMEOUT_S, reconnect_s=1.5)
        try:
            c0.send("ping", x=torch.ones(1))
            c1.recv("ping")
            relay.proc.send_signal(signal.SIGKILL)
            relay.proc.wait(10)
            t0 = time.monotonic()
            with pytest.raises(PeerError) as caught:
                c1.recv()
            elapsed = time.monotonic() - t0
        finally:
            c0.close()
            c1.close()
    text = str(caught.value)
    assert "\n" not in text and f"relay at {relay.addr}" in text and "could not resume within 1.5 s (transport.reconnect_s" in text
    assert 1.4 < elapsed < 6, elapsed


# ---- end to end: a relay stand-in that sees (and may alter) every link frame ------------------
class StandIn:
    """Two channels joined through two socketpairs and a forwarding thread per direction that parses link frames,
    records every byte that crosses, and hands each DATA body to `mutate(direction, index, body)`, which returns
    the bodies to forward instead (a list: [] drops, [b, b] replays)."""

    def __init__(self, mutate=None):
        self.mutate = mutate or (lambda direction, index, body: [body])
        self.seen = bytearray()
        self.lock = threading.Lock()
        a0, r0 = socket.socketpair()
        a1, r1 = socket.socketpair()
        self.raw = (r0, r1)
        for direction, (src, dst) in enumerate(((r0, r1), (r1, r0))):
            threading.Thread(target=self._forward, args=(direction, src, dst), daemon=True).start()
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("c1", RelayChannel(LinkSocket(a1, "stand-in", 5), 1, "e2e", 5, secret=SECRET)))
        t.start()
        self.c0 = RelayChannel(LinkSocket(a0, "stand-in", 5), 0, "e2e", 5, secret=SECRET)
        t.join(5)
        self.c1 = box["c1"]

    def _forward(self, direction: int, src: socket.socket, dst: socket.socket) -> None:
        index = 0
        try:
            while True:
                header = _exact(src, HEADER.size)
                if header is None:
                    return
                kind, n = HEADER.unpack(header)
                body = _exact(src, n) if n else b""
                with self.lock:
                    self.seen += header + body
                bodies = [body]
                if kind == DATA:
                    bodies = self.mutate(direction, index, body)
                    index += 1
                for b in bodies:
                    dst.sendall(HEADER.pack(kind, len(b)) + b)
        except OSError:
            return

    def close(self) -> None:
        self.c0.close()
        self.c1.close()
        for s in self.raw:
            s.close()


def flip_byte_of(target: int):
    """Flip one ciphertext byte of rank 0's DATA frame number `target` (0 is its hello)."""
    def mutate(direction, index, body):
        if direction == 0 and index == target:
            body = bytearray(body)
            body[len(body) // 2] ^= 0x01
            return [bytes(body)]
        return [body]
    return mutate


def replay(target: int):
    def mutate(direction, index, body):
        return [body, body] if direction == 0 and index == target else [body]
    return mutate


def test_a_flipped_ciphertext_byte_is_refused():
    s = StandIn(flip_byte_of(2))
    try:
        s.c0.send("ping", {"i": 0}, x=torch.arange(16))
        assert s.c1.recv("ping").meta["i"] == 0
        s.c0.send("ping", {"i": 1}, x=torch.arange(16))
        with pytest.raises(PeerError) as caught:
            s.c1.recv("ping")
    finally:
        s.close()
    text = str(caught.value)
    assert "\n" not in text and "relay stand-in" in text and "tampered with" in text, text


def test_a_replayed_frame_is_refused():
    s = StandIn(replay(1))
    try:
        s.c0.send("ping", {"i": 0}, x=torch.arange(16))
        assert s.c1.recv("ping").meta["i"] == 0  # the original
        with pytest.raises(PeerError) as caught:
            s.c1.recv("ping")  # its copy
    finally:
        s.close()
    text = str(caught.value)
    assert "\n" not in text and "relay stand-in" in text and "replayed (seq 1 again, expected 2)" in text, text


def test_the_relay_cannot_read_the_plaintext():
    s = StandIn()
    marker = torch.tensor([0x5EC12E7] * 64, dtype=torch.int32)  # 256 known bytes
    try:
        s.c0.send("confidential", {"note": "the-plaintext-header"}, x=marker)
        msg = s.c1.recv("confidential")
        assert torch.equal(msg.tensors["x"], marker) and msg.meta == {"note": "the-plaintext-header"}
        s.c1.send("answer", y=marker * 2)
        assert torch.equal(s.c0.recv("answer").tensors["y"], marker * 2)
    finally:
        s.close()
    with s.lock:
        seen = bytes(s.seen)
    for known in (marker.numpy().tobytes()[:16], (marker * 2).numpy().tobytes()[:16], b"the-plaintext-header",
                  b"confidential", b"TDM1"):
        assert known not in seen, f"{known!r} crossed the relay in the clear"
    assert len(seen) > 2 * 256  # the messages did cross, sealed
