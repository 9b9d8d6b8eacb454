"""Issue 16: the relay tells a closed connection from a silent one. A peer whose connection closes and
that does not re-dial within a short grace (netbridge.relay_channel.PEER_CLOSED_GRACE_S) is reported at
once, not after transport.reconnect_s; a silent peer keeps the whole reconnect_s window."""
from __future__ import annotations

import socket
import time

import pytest
import torch

from netbridge.channel import PeerError
from netbridge.relay_channel import PEER_CLOSED_GRACE_S
from tests.support.relay_harness import pair, relay_process

TIMEOUT_S = 3.0


def established(c0, c1):
    c0.send("ping", x=torch.ones(1))
    c1.recv("ping")


def rank0_error_after(relay, session: str, reconnect_s: float, killed: bool) -> tuple[str, float]:
    """(rank 0's error, seconds from its peer going to that error): rank 1 stops its heartbeats, and
    `killed` also closes its socket, as a dead process does (else it hangs on, frozen)."""
    c0, c1 = pair(relay, session, timeout_s=TIMEOUT_S, reconnect_s=reconnect_s)
    try:
        established(c0, c1)
        c1._closed.set()  # no more heartbeats, no re-dial, no goodbye
        if killed:
            c1.link.sock.shutdown(socket.SHUT_RDWR)
            c1.link.sock.close()
        t0 = time.monotonic()
        with pytest.raises(PeerError) as caught:
            c0.recv()
        return str(caught.value), time.monotonic() - t0
    finally:
        c0.close()


def test_a_killed_peer_is_reported_within_the_grace_not_reconnect_s(tmp_path):
    with relay_process(tmp_path, "--no-store") as relay:
        text, elapsed = rank0_error_after(relay, "killed", reconnect_s=60, killed=True)
    assert "rank 1 left session" in text and "did not re-dial" in text and "\n" not in text, text
    assert elapsed < PEER_CLOSED_GRACE_S + 2.5, elapsed  # was transport.reconnect_s (60 s)
    print(f"\nkilled rank reported through the relay after {elapsed:.2f} s")


@pytest.mark.slow  # a torchrun / multi-process case of several seconds: the default suite's 5 minutes (issue 39's wave)
def test_a_silent_peer_keeps_the_reconnect_window(tmp_path):
    with relay_process(tmp_path, "--no-store", "--idle-timeout-s", "1") as relay:  # the relay drops it as silent
        text, elapsed = rank0_error_after(relay, "silent", reconnect_s=5, killed=False)
    assert "could not resume within 5 s (transport.reconnect_s" in text, text
    assert elapsed > 5, elapsed
