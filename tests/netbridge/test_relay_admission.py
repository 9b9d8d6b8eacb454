"""Admission under a flood: idle sockets cannot lock honest clients out, one address cannot take every
handshake slot, and a relay truly full of authenticated connections says so.

Loopback only; every loop is bounded and stops by itself. 127.0.0.2 and 127.0.0.3 play other client
hosts (loopback accepts the whole 127/8).
"""
from __future__ import annotations

import socket
import threading
import time
from collections import deque
from contextlib import contextmanager

import pytest

from netbridge import auth
from tests.support.relay_harness import TOKEN, closed_by_peer, loops, pair, recv_exact, relay_process

HONEST_TRIES, PAIR_WITHIN_S = 10, 5.0


def idle_socket(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection that never sends a byte (and never reads): what a cheap flood is made of."""
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def read_to_end(sock: socket.socket, timeout_s: float = 3.0) -> bytes:
    sock.settimeout(timeout_s)
    out = bytearray()
    try:
        while chunk := sock.recv(4096):
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return bytes(out)


@contextmanager
def reopening_flood(port: int, burst: int, period_s: float, max_rounds: int = 200):
    """A thread that, every period_s, closes its `burst` oldest idle sockets and opens `burst` new ones."""
    stop = threading.Event()
    held: deque = deque()

    def run() -> None:
        for _ in range(max_rounds):
            if stop.is_set():
                return
            for _ in range(min(burst, len(held))):
                held.popleft().close()
            for _ in range(burst):
                try:
                    held.append(idle_socket(port))
                except OSError:
                    pass  # a refused or timed-out connect is part of the flood too
            stop.wait(period_s)
    t = threading.Thread(target=run, name="flood", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)
        for s in held:
            s.close()


def timed_pair(relay, session: str) -> float | None:
    """Seconds until both ranks of a fresh session were paired through the relay, or None on failure."""
    t0 = time.monotonic()
    try:
        c0, c1 = pair(relay, session, timeout_s=PAIR_WITHIN_S)
    except Exception:  # noqa: BLE001 - a failed try is what this counts
        return None
    elapsed = time.monotonic() - t0
    c0.close()
    c1.close()
    return elapsed


def test_an_idle_flood_cannot_keep_honest_clients_out(tmp_path):
    """Far more idle sockets than --max-pending, from one address, re-opened all the time: honest pairs
    still get in, because a full handshake table sheds its oldest entry instead of turning newcomers away."""
    with relay_process(tmp_path, "--no-store", "--max-pending", "32", "--max-pending-per-source", "100000",
                       "--log-level", "warning") as relay:
        idle = [idle_socket(relay.port) for _ in range(200)]
        try:
            with reopening_flood(relay.port, burst=40, period_s=0.2):
                times = []
                for i in range(HONEST_TRIES):  # spread over the flood's bursts, not all between two of them
                    time.sleep(0.15)
                    times.append(timed_pair(relay, f"honest-{i}"))
        finally:
            for s in idle:
                s.close()
        paired = [t for t in times if t is not None and t < PAIR_WITHIN_S]
        print(f"\nidle flood: {len(paired)}/{HONEST_TRIES} honest pairs within {PAIR_WITHIN_S:.0f} s, "
              f"times {['-' if t is None else f'{t:.3f}' for t in times]}; relay peak RSS {relay.rss_mb():.1f} MB")
        assert len(paired) >= HONEST_TRIES - 1, times
        assert relay.alive()
        assert "shed after" in relay.log()
        assert relay.rss_mb() < 100, "the relay's memory must stay bounded under the flood"


def test_one_source_is_bounded_and_another_source_still_gets_in(tmp_path):
    with relay_process(tmp_path, "--no-store", "--max-pending-per-source", "4", "--log-level", "warning") as relay:
        held = [idle_socket(relay.port) for _ in range(4)]
        try:
            for s in held:  # each was greeted: all four hold a handshake slot
                assert recv_exact(s, auth.HELLO_BYTES)[:4] == auth.HELLO_MAGIC
            t0 = time.monotonic()
            extra = idle_socket(relay.port)
            assert read_to_end(extra) == auth.busy_greeting(auth.SOURCE_LIMIT)  # told why, then closed
            extra.close()
            assert time.monotonic() - t0 < 1.0, "turned away at once, not after a timeout"

            with pytest.raises(auth.HandshakeError) as refused:  # retried for its whole timeout, then explained
                auth.dial(relay.addr, TOKEN, "crowded", auth.ROLE_DATA, 0, 2, 0.4)  # (the held ones are not stale yet)
            assert "--max-pending-per-source" in str(refused.value) and "did not greet" not in str(refused.value)

            other_host = auth.dial(relay.addr, TOKEN, "elsewhere", auth.ROLE_DATA, 0, 2, 3.0, source_address="127.0.0.2")
            other_host.close()

            # a neighbour of the flooder (same NAT address) gets in once the flood's handshakes are stale (> 1 s)
            neighbour = auth.dial(relay.addr, TOKEN, "neighbour", auth.ROLE_DATA, 0, 2, 3.0)
            neighbour.close()
            assert read_to_end(held[0]) == bytes([auth.SHED])  # it took the slot of that address's oldest
        finally:
            for s in held:
                s.close()
        log = relay.log()
        assert 1 <= log.count("turned away") <= 3, f"{log.count('turned away')} log lines for a burst of refusals: not rate-limited"
        assert "has --max-pending-per-source (4) handshakes open" in log


@pytest.mark.parametrize("loop", loops())
def test_a_full_table_sheds_the_oldest_of_the_busiest_source(tmp_path, loop):
    with relay_process(tmp_path, "--no-store", "--max-pending", "4", "--max-pending-per-source", "100",
                       "--log-level", "warning", "--loop", loop) as relay:
        busy = [idle_socket(relay.port, "127.0.0.2") for _ in range(3)]
        lone = idle_socket(relay.port, "127.0.0.3")
        try:
            for s in (*busy, lone):
                assert recv_exact(s, auth.HELLO_BYTES)[:4] == auth.HELLO_MAGIC
            newcomer = idle_socket(relay.port, "127.0.0.3")
            assert recv_exact(newcomer, auth.HELLO_BYTES)[:4] == auth.HELLO_MAGIC  # admitted, not turned away
            assert read_to_end(busy[0]) == bytes([auth.SHED])  # oldest of 127.0.0.2, which held the most slots
            assert not closed_by_peer(lone, timeout_s=0.5), "a lone client was shed before the busiest source's"
            newcomer.close()
        finally:
            for s in (*busy, lone):
                s.close()


def test_a_relay_full_of_authenticated_connections_answers_full(tmp_path):
    with relay_process(tmp_path, "--no-store", "--max-connections", "2", "--log-level", "warning") as relay:
        c0, c1 = pair(relay, "occupant")
        try:
            t0 = time.monotonic()
            with pytest.raises(auth.HandshakeError) as full:
                auth.dial(relay.addr, TOKEN, "latecomer", auth.ROLE_DATA, 0, 2, 3.0)
            message = str(full.value)
            assert "is full" in message and "--max-connections" in message and "did not greet" not in message, message
            assert time.monotonic() - t0 < 1.0, "FULL is an answer, not something to retry until the timeout"
            with pytest.raises(auth.HandshakeError, match="token does not match"):  # a stranger still learns nothing
                auth.dial(relay.addr, b"not-the-secret", "latecomer", auth.ROLE_DATA, 0, 2, 3.0)
        finally:
            c0.close()
            c1.close()
        deadline = time.monotonic() + 5
        while True:  # the relay notices the pair left within moments; then there is room again
            try:
                auth.dial(relay.addr, TOKEN, "latecomer", auth.ROLE_DATA, 0, 2, 3.0).close()
                break
            except auth.HandshakeError:
                assert time.monotonic() < deadline, "no room after the occupants left"
                time.sleep(0.1)
        assert "relay full" in relay.log()
