"""Several ranks per host (issue 42): which ring links stay on a host, the direct loopback Channel, the link probe.

In-process and fast; the torchrun runs with two and three hosts are in tests/e2e/test_host_links.py (-m slow)."""
from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch

from launch.config import ConfigError, load_config
from launch.distributed import open_links
from launch.plan import drafter_place, ring_text
from launch.transport import HostPlace, host_place, local_peers
from netbridge.channel import LocalChannel, PeerError, local_pair
from netbridge.link_probe import (BULK_BYTES, BURST, LinkProbe, answer_burst, answer_probe, measure, probe_link,
                                  probe_ring)
from netbridge.loopback_channel import LoopbackChannel, LoopbackListener, loopback_pair
from tests.support.tiny_models import free_port


def places(*per_host: int) -> list[HostPlace]:
    """Each rank's HostPlace for hosts with these many ranks, numbered as torchrun's agent numbers them: a host's
    ranks one after another, in node-rank order."""
    return [HostPlace(local, n, len(per_host)) for n in per_host for local in range(n)]


def host_links(mode: str, ps: list[HostPlace]) -> list[bool]:
    """Which ring links cross between hosts (index i = the link rank i -> i+1), as rank i sees its next link."""
    n = len(ps)
    return [(r + 1) % n not in local_peers(mode, p, r, n) for r, p in enumerate(ps)]


# --- which links are local ----------------------------------------------------------------------------

@pytest.mark.parametrize("per_host,crossing", [
    ((2, 2), [False, True, False, True]),  # 0 -> 1 local, 1 -> 2 between hosts, 2 -> 3 local, 3 -> 0 between hosts
    ((2, 2, 2), [False, True] * 3),
    ((3, 1), [False, False, True, True]),
    ((1, 1), [True, True]),  # one rank per host: every link crosses
])
def test_n_hosts_make_n_crossings_whatever_the_ranks_per_host(per_host, crossing):
    assert host_links("auto", places(*per_host)) == crossing
    assert host_links("direct", places(*per_host)) == crossing
    assert sum(crossing) == len(per_host)
    assert host_links("transport", places(*per_host)) == [True] * len(crossing)


def test_one_host_with_the_relay_goes_through_it_unless_direct_is_asked():
    """One torchrun with --nproc_per_node=2 and kind=relay emulates two hosts: auto keeps it on the relay."""
    assert [(r + 1) % 4 not in local_peers("auto", p, r, 4, "relay") for r, p in enumerate(places(4))] == [True] * 4
    assert host_links("direct", places(4)) == [False] * 4  # the link from the last rank back to rank 0 too
    assert local_peers("direct", HostPlace(0, 2, 1), 0, 2) == {1}


def test_one_host_over_gloo_links_directly():
    """gloo between two ranks of one host costs each frame two rendezvous and its sender thread's wait for the GIL;
    a loopback socket does the same job for less (launch.transport), so auto links them directly."""
    assert host_links("auto", places(4)) == [False] * 4
    assert local_peers("auto", HostPlace(1, 2, 1), 1, 2, "gloo") == {0}


def test_both_ends_of_every_link_agree():
    for per_host in ((2, 2), (2, 3, 1), (1, 4), (3,)):
        ps = places(*per_host)
        n = len(ps)
        for mode in ("auto", "direct", "transport"):
            for r in range(n):
                nxt = (r + 1) % n
                assert (nxt in local_peers(mode, ps[r], r, n)) == (r in local_peers(mode, ps[nxt], nxt, n)), (per_host, mode, r)


def test_host_place_reads_torchruns_environment():
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "3"}
    assert host_place(6, env) == HostPlace(1, 2, 3)
    assert host_place(3, {}) == HostPlace(0, 3, 1)  # started without torchrun's node variables: one host


def test_local_links_is_checked_at_start():
    with pytest.raises(ConfigError, match="transport.local_links='sometimes' is not one of auto, direct, transport"):
        load_config(["prompt_ids=[1]", "transport.local_links=sometimes"])


# --- the loopback Channel -------------------------------------------------------------------------------

def test_loopback_channel_carries_messages_both_ways_and_a_big_frame():
    a, b = loopback_pair(timeout_s=5)
    try:
        a.send("x", {"n": 1}, t=torch.arange(6).reshape(2, 3))
        msg = b.recv("x")
        assert msg.meta == {"n": 1} and torch.equal(msg.tensors["t"], torch.arange(6).reshape(2, 3))
        big = torch.randn(3_000_000)  # 12 MB: more than a socket buffer holds, so the send waits for the reader
        got = []
        reader = threading.Thread(target=lambda: got.append(a.recv("big")), daemon=True)
        reader.start()
        b.send("big", h=big)
        reader.join(10)
        assert torch.equal(got[0].tensors["h"], big)
        assert a.kind == b.kind == "local"
    finally:
        a.close()
        b.close()


def test_a_closed_peer_and_a_silent_one_are_one_line_each():
    a, b = loopback_pair(timeout_s=0.3)
    b.peer_name = "rank 1"
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=r"^rank 1 sent nothing for 0.3 s \(transport.timeout_s\)"):
        b.recv()
    assert time.monotonic() - t0 < 2
    a.close()
    with pytest.raises(PeerError, match=r"^lost rank 1 on this host \(closed by the other end\): its process ended$"):
        b.recv()
    b.close()


def test_a_connection_without_the_token_is_turned_away():
    listener = LoopbackListener()
    stray = socket.create_connection(("127.0.0.1", listener.port))
    stray.sendall(b"\0" * 16)
    peer = LoopbackChannel.connect(listener.port, listener.token, 5)
    mine = listener.accept(5)
    peer.send("hi")
    assert mine.recv("hi").kind == "hi"
    assert stray.recv(1) == b""  # closed by the listener
    for s in (mine, peer):
        s.close()
    stray.close()
    nobody = LoopbackListener()
    with pytest.raises(PeerError, match="rank 3 did not connect to this rank's port 127.0.0.1:"):
        nobody.accept(0.2, "rank 3")


def test_direct_links_open_around_a_ring_of_four_through_the_store(monkeypatch):
    """Four ranks on one host with transport.local_links=direct, as threads: each finds its neighbours' ports in
    torchrun's store (a real TCPStore here), the ring opens in open_links' order, and a message goes around it."""
    port = free_port()
    master = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    cfg = load_config(["prompt_ids=[1]", "transport.kind=relay", "transport.relay=127.0.0.1:9", "transport.session=s",
                       f"transport.relay_token={'t' * 16}", f"transport.secret={'p' * 16}", "transport.local_links=direct",
                       "transport.timeout_s=10"])
    links, got = {}, {}

    def rank(r):
        links[r] = open_links(cfg, r, 4, HostPlace(r, 4, 1))  # never dials the relay: every link is on this host
        prev, next = links[r]
        if r == 0:
            next.send("token", {"path": [0]})
            got[0] = prev.recv("token").meta["path"]
        else:
            path = prev.recv("token").meta["path"]
            next.send("token", {"path": [*path, r]})
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (3, 1, 2, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert got == {0: [0, 1, 2, 3]}
    assert all(isinstance(c, LoopbackChannel) for pair in links.values() for c in pair)
    assert links[1][0].peer_name == "rank 0" and links[1][1].peer_name == "rank 2"
    for pair in links.values():
        for c in pair:
            c.close()
    del master


def test_one_host_over_gloo_carries_the_emulated_link_on_its_direct_links(monkeypatch):
    """Two ranks on one host, kind=gloo, transport.emulate_delay_ms=40: the direct link between them is the emulated
    WAN the run asked for (one host emulates two), so a message takes the 40 ms it would over gloo."""
    import launch.distributed
    port = free_port()
    master = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setattr(launch.distributed, "_init_gloo", lambda settings, rank: None)  # the links are what is tested
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    cfg = load_config(["prompt_ids=[1]", "transport.kind=gloo", "transport.emulate_delay_ms=40", "transport.timeout_s=10"])
    links = {}
    threads = [threading.Thread(target=lambda r=r: links.__setitem__(r, open_links(cfg, r, 2, HostPlace(r, 2, 1))),
                                daemon=True) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    (a, _), (b, _) = links[0], links[1]
    assert isinstance(a, LoopbackChannel) and isinstance(b, LoopbackChannel)
    t0 = time.perf_counter()
    a.send("ping")
    b.recv("ping")
    assert 0.035 <= time.perf_counter() - t0 < 1.0
    for c in (a, b):
        c.close()
    del master


# --- the link probe ----------------------------------------------------------------------------------------

def test_probe_arithmetic():
    p = measure("relay", [0.09, 0.08, 0.1], 250_000, out_s=0.08 + 0.1, back_s=0.2)
    assert p == LinkProbe("relay", pytest.approx(80.0), pytest.approx(20.0), pytest.approx(10.0))
    assert measure("local", [1e-4], 1000, 1e-4, 0.0).send_mbps == pytest.approx(800.0)  # no faster than MIN_TRANSFER_S
    assert p.text() == "relay, RTT 80.0 ms, 20.0/10.0 Mbit/s, 0.00 ms a message"
    # 16 messages of 25 kB in all: 10 ms on the wire at 20 Mbit/s; done 80 + 10 + 15 ms after the first went:
    # 15 ms beyond a lone one's round trip and the bytes, for the 15 behind the first
    burst = measure("relay", [0.08], 250_000, out_s=0.08 + 0.1, back_s=0.2, burst_s=0.08 + 0.01 + 0.015, burst=16,
                    burst_bytes=25_000)
    assert burst.message_ms == pytest.approx(1.0)
    assert burst.text() == "relay, RTT 80.0 ms, 20.0/10.0 Mbit/s, 1.00 ms a message"
    assert measure("relay", [0.08], 250_000, 0.18, 0.2, burst_s=0.07, burst=16).message_ms == 0.0  # never below


def test_probe_measures_an_emulated_wan_link():
    """40 ms one way and 20 Mbit/s each way: an 80 ms round trip and 20 Mbit/s, within 15%, in well under a second
    besides its round trips."""
    a, b = local_pair(timeout_s=10, emulate_delay_ms=40, emulate_mbps=20)
    answering = threading.Thread(target=answer_probe, args=(b,), daemon=True)
    t0 = time.monotonic()
    answering.start()
    p = probe_link(a)
    took = time.monotonic() - t0
    answering.join(5)
    assert p.rtt_ms == pytest.approx(80, rel=0.15), p
    assert p.send_mbps == pytest.approx(20, rel=0.15) and p.recv_mbps == pytest.approx(20, rel=0.15), p
    assert p.message_ms < 1.0, p  # the delay and the bandwidth are the wire's, not a message's cost
    assert took < 6 * 0.08 + 2 * BULK_BYTES * 8 / 20e6 + 0.25, took


class CostlyChannel(LocalChannel):
    """An in-process channel whose every send first costs its sender `cost_s` (as serialization and a channel's
    send path do), before the emulated wire."""

    cost_s = 0.01

    def send(self, kind, meta=None, **tensors):
        time.sleep(self.cost_s)
        super().send(kind, meta, **tensors)


def test_probe_measures_what_a_message_costs_besides_the_round_trip():
    """10 ms a message, 25 ms one way: a round trip of 70 ms, and a burst of 16 done 160 + 25 + 10 + 25 ms after
    the first went: 10 ms a message beyond the round trip (left in, 14.7 ms; no slack below)."""
    import queue
    up, down = queue.Queue(), queue.Queue()
    a = CostlyChannel(down, up, 10, emulate_delay_ms=25)
    b = CostlyChannel(up, down, 10, emulate_delay_ms=25)
    answering = threading.Thread(target=answer_probe, args=(b,), daemon=True)
    answering.start()
    p = probe_link(a)
    answering.join(5)
    assert p.rtt_ms == pytest.approx(70, rel=0.15), p
    assert 8.0 <= p.message_ms <= 16.0, p  # (a loaded host only adds: its scheduling, never less than the sleeps)
    assert not answering.is_alive()


def test_a_peer_announcing_a_bogus_burst_is_one_line():
    a, b = local_pair(timeout_s=5)
    for bogus in (10**6, "16", 0):
        a.send("probe_burst", {"i": 0, "of": bogus})
        with pytest.raises(PeerError, match=f"announced a link probe burst of {bogus!r} messages"):
            answer_burst(b)
    a.send("probe_ping", {"i": 0})  # something else where the burst belongs
    with pytest.raises(PeerError, match="expected probe_burst, got 'probe_ping'"):
        answer_burst(b)
    a.send("probe_burst", {"i": 0, "of": BURST})  # a burst cut short: the peer's silence, after the timeout
    b.timeout_s = 0.2
    with pytest.raises(PeerError, match="sent nothing"):
        answer_burst(b)


def test_every_rank_probes_its_next_link_once_around_a_ring():
    from netbridge.channel import local_ring
    ring = local_ring(3, timeout_s=10)
    probes = {}
    threads = [threading.Thread(target=lambda r=r: probes.__setitem__(r, probe_ring(*ring[r], r)), daemon=True)
               for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(probes) == [0, 1, 2] and all(p.kind == "local" for p in probes.values())


def test_start_up_lines_name_each_link_and_the_drafters_place():
    relay, local = LinkProbe("relay", 81.25, 20, 19.5), LinkProbe("local", 0.12, 900, 1200)
    assert ring_text((local, relay, local, relay)) == ("ring of 4 links: 2 between hosts (relay, RTT 81.2/81.2 ms), "
                                                       "2 on one host (direct, RTT 0.1/0.1 ms); a round crosses between hosts 2 times")
    # one torchrun: the links transport.kind carries stay on this host too
    assert ring_text((relay, relay), hosts=1) == "ring of 2 links, all on this host (relay, RTT 81.2/81.2 ms)"
    assert drafter_place("auto", "cuda:0", "cuda:0", 2).startswith("the drafter beside rank 0's layers on cuda:0")
    assert "where rank 1 of this host holds its layers" in drafter_place("cuda:1", "cuda:1", "cuda:0", 2)
    assert "memory of its own" in drafter_place("cuda:1", "cuda:1", "cuda:0", 1)


def test_telemetry_writes_each_links_kind_and_round_trip(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from launch.telemetry import Telemetry
    cfg = load_config(["prompt_ids=[1]", f"log.dir={tmp_path}"])
    links = (LinkProbe("local", 0.1, 900, 1000), LinkProbe("relay", 81.0, 20, 19))
    telemetry = Telemetry(cfg, [1], links=links)
    telemetry.close()
    events = EventAccumulator(str(telemetry.dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("link/rtt_ms")] == [(0, pytest.approx(0.1)), (1, 81.0)]
    assert [e.value for e in events.Scalars("link/between_hosts")] == [0, 1]
    text = events.Tensors("run/links/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "rank 0 -> rank 1: local, RTT 0.1 ms" in text and "rank 1 -> rank 0: relay, RTT 81.0 ms" in text
