"""Refused dials are slowed and counted per source, and a node waiting at the relay says so (issue 39).

The relay runs in this process (its event loop in a thread), so its log lines reach caplog; 127.0.0.2 plays
a second client host (loopback accepts the whole 127/8). Every loop is bounded.
"""
from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from netbridge import auth
from netbridge.channel import PeerError
from netbridge.relay.refusals import LINES_PER_INTERVAL, RefusalsBySource
from netbridge.relay.server import Relay
from netbridge.relay_channel import RelayChannel
from tests.support.relay_harness import PAIRING, TOKEN, relay_in_thread

STRANGER = "127.0.0.2"


def bad_dial(relay: Relay, source: str = STRANGER) -> float:
    """One dial with a wrong relay token from `source`, waiting for the answer; returns its seconds."""
    t0 = time.monotonic()
    with pytest.raises(auth.HandshakeError, match="token does not match"):
        auth.dial(f"127.0.0.1:{relay.port}", b"not the relay token", "s", auth.ROLE_DATA, 0, 2, 10, source_address=source)
    return time.monotonic() - t0


def good_dial(relay: Relay, session: str) -> float:
    """Seconds until a node with the right token from 127.0.0.1 is admitted."""
    t0 = time.monotonic()
    sock = auth.dial(f"127.0.0.1:{relay.port}", TOKEN, session, auth.ROLE_DATA, 0, 2, 10)
    elapsed = time.monotonic() - t0
    sock.close()
    return elapsed


def test_refusals_in_a_row_from_one_source_are_answered_ever_later_up_to_the_bound():
    with relay_in_thread(max_refusal_delay_s=0.16) as relay:
        times = [bad_dial(relay) for _ in range(8)]
        deadline = time.monotonic() + 2
        while relay.conns and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not relay.conns  # no refused connection is held once answered
    # then 1/16 of the bound, doubling, up to it: 0.01 + 0.02 + 0.04 + 0.08 + 3 * 0.16 = 0.63 s at least
    assert sum(times) >= 0.625, times
    assert all(t < 0.16 + 0.3 for t in times), times  # never past the bound


def test_refusals_from_one_source_are_logged_once_an_interval_with_their_count(caplog):
    caplog.set_level(logging.WARNING, logger="tandem.relay")
    n = 30
    with relay_in_thread(max_refusal_delay_s=0.01, refusal_log_interval_s=0.5) as relay:
        for _ in range(n):
            bad_dial(relay)
        counted, deadline = 0, time.monotonic() + 3
        while counted < n - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
            counted = sum(int(m[1]) for m in re.finditer(r"^refused (\d+) dials from 127\.0\.0\.2 ", relog(caplog), re.M))
    lines = [line for line in relog(caplog).splitlines() if STRANGER in line]
    assert re.match(r"127\.0\.0\.2:\d+: handshake refused: wrong MAC", lines[0]), lines  # the first at once, in full
    counts = lines[1:]
    assert counted == n - 1 and len(counts) <= 2, lines  # the rest counted (the dials may straddle an interval)
    assert all(re.match(r"refused \d+ dials from 127\.0\.0\.2 in the last \d+ s: wrong MAC .*; is the relay token the "
                        r"same on every host\? .*TANDEM_RELAY_TOKEN_FILE", line) for line in counts), counts


def relog(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "tandem.relay")


def test_a_slowed_source_does_not_slow_a_node_from_another_address():
    stop = threading.Event()
    stranger_times: list[float] = []

    def flood(relay: Relay) -> None:
        for _ in range(100):  # bounded: 0.5 s each once slowed
            if stop.is_set():
                return
            stranger_times.append(bad_dial(relay))
    with relay_in_thread(max_refusal_delay_s=0.5) as relay:
        floods = [threading.Thread(target=flood, args=(relay,), daemon=True) for _ in range(4)]
        for t in floods:
            t.start()
        deadline = time.monotonic() + 5
        while not any(t > 0.45 for t in stranger_times) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any(t > 0.45 for t in stranger_times), stranger_times  # the stranger is slowed to the bound now
        good = [good_dial(relay, f"good{i}") for i in range(10)]
        stop.set()
        for t in floods:
            t.join(5)
    assert max(good) < 0.4, good  # a node from 127.0.0.1 is admitted at once meanwhile (the stranger waits 0.5 s)


def test_the_table_and_the_log_stay_bounded_when_many_sources_are_refused(caplog):
    caplog.set_level(logging.WARNING, logger="tandem.relay")
    refusals = RefusalsBySource(max_delay_s=2.0, interval_s=10.0, max_sources=100)
    refusals.sweep(0.0)  # the first interval starts
    # the first refusal of a run is answered at once (an honest node with the wrong token learns it without delay),
    # the next 1/16 of the bound later, doubling
    assert [refusals.refused("10.1.0.1", "10.1.0.1:1", "wrong MAC", 0.5) for _ in range(3)] == [0.0, 0.125, 0.25]
    # a flood's streak of thousands (the fuzz's, against --max-refusal-delay-s 0) stays at the bound, no overflow
    assert refusals.delay(5000) == 2.0 and RefusalsBySource(max_delay_s=0.0).delay(5000) == 0.0
    for i in range(1000):  # 1000 addresses, 3 wrong-token dials each
        for _ in range(3):
            refusals.refused(f"10.0.{i // 256}.{i % 256}", f"10.0.{i // 256}.{i % 256}:1234", "wrong MAC", 1 + i / 1000)
    assert len(refusals.table) == 100
    refusals.sweep(11.0)
    lines = relog(caplog).splitlines()
    assert len(lines) <= 2 * LINES_PER_INTERVAL + 1, lines
    told = len([line for line in lines if "handshake refused" in line])
    counted = sum(int(m[1]) for m in re.finditer(r"^refused (\d+) dials", "\n".join(lines), re.M))
    assert told + counted == 3003, lines  # every refusal is in a line, at once or in a count
    refusals.sweep(30.0)  # quiet past the window: forgotten
    assert not refusals.table


def test_a_rank_waiting_for_its_peer_says_so_every_interval(caplog, monkeypatch):
    monkeypatch.setattr("netbridge.link.WAITING_LINE_S", 0.2)
    caplog.set_level(logging.WARNING, logger="tandem.relay_channel")
    with relay_in_thread() as relay, pytest.raises(PeerError, match="rank 0 did not join session 'lonely'"):
        RelayChannel.connect(f"127.0.0.1:{relay.port}", "lonely", 1, TOKEN, PAIRING, timeout_s=10, heartbeat_s=0.2,
                             join_timeout_s=1.0)
    lines = [r.getMessage() for r in caplog.records if "waiting at the relay" in r.getMessage()]
    assert 3 <= len(lines) <= 6, lines  # one every 0.2 s of the 1 s wait
    assert all(re.fullmatch(r"rank 1 waiting at the relay 127\.0\.0\.1:\d+ for rank 0 of session 'lonely' \(\d s of 1 s\); "
                            r"is rank 0 started, with the same transport\.session and relay token\?", line) for line in lines), lines


def test_a_node_waiting_for_the_rendezvous_says_so_every_interval(caplog, monkeypatch, tmp_path):
    from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousTimeoutError

    from launch.torchrun.relay_rendezvous import RelayRendezvousHandler
    monkeypatch.setattr("netbridge.link.WAITING_LINE_S", 0.2)
    monkeypatch.setenv("TANDEM_RELAY", "unused")  # the handler sets it for its workers when unset
    caplog.set_level(logging.WARNING, logger="launch.torchrun.relay_rendezvous")
    secret_file = tmp_path / "token"
    secret_file.write_bytes(TOKEN)
    with relay_in_thread() as relay:
        params = RendezvousParameters("tandem-relay", f"127.0.0.1:{relay.port}", "job-w", 2, 2,
                                      relay_token_file=str(secret_file), join_timeout="1")
        with pytest.raises(RendezvousTimeoutError, match="not all 2 nodes of run 'job-w'"):
            RelayRendezvousHandler(params).next_rendezvous()
    lines = [r.getMessage() for r in caplog.records if "waiting at the relay" in r.getMessage()]
    assert 1 <= len(lines) <= 5, lines  # its heartbeat period (5 s) polls every 0.5 s
    assert all(re.fullmatch(r"tandem-relay rendezvous: node \? of run 'job-w' waiting at the relay 127\.0\.0\.1:\d+ for its "
                            r"other node\(s\) \(\d s of 1 s, --rdzv_conf join_timeout\); are they started with the same "
                            r"--rdzv_id, --nnodes and relay token\?", line) for line in lines), lines
