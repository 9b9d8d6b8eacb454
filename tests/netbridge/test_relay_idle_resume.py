"""RelayChannel re-dials an idle link (issue 42): on a ring of more than two ranks a rank sends on its link to the next
rank and then waits on another link, so when the idle link drops, its peer (receiving, so it sees the drop) waits
for it to re-dial. The heartbeat thread's idle watch does, within a heartbeat; without it the peer gives up after
its grace (PEER_CLOSED_GRACE_S) and the ring stops. -m slow: a relay subprocess and seconds of waiting."""
from __future__ import annotations

import socket
import time

import pytest
import torch

from tests.support.relay_harness import pair, relay_process, run_in_thread


@pytest.mark.slow
def test_an_idle_ends_dropped_link_is_redialed_before_its_peer_gives_up(tmp_path):
    with relay_process(tmp_path, "--no-store") as relay:
        c0, c1 = pair(relay, "idle", timeout_s=3.0, reconnect_s=10)  # heartbeats every 0.5 s
        try:
            c1.send("before", x=torch.arange(3))
            assert c0.recv("before").tensors["x"].tolist() == [0, 1, 2]
            receiving, box = run_in_thread(c0.recv, "after")  # rank 0 waits on the link, rank 1 is idle
            c1.link.sock.shutdown(socket.SHUT_RDWR)  # rank 1's connection drops while nothing uses it
            deadline = time.monotonic() + 8
            while c1.resumes == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c1.resumes == 1, "the idle end did not re-dial"
            c1.send("after", x=torch.arange(4))
            receiving.join(10)
            assert "error" not in box, box.get("error")
            assert box["value"].tensors["x"].tolist() == [0, 1, 2, 3] and c0.resumes == 1
        finally:
            c0.close()
            c1.close()
        assert "session idle: rank 1 left" in relay.log()
