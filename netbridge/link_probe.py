"""What one link of the ring is and how fast it is, measured once at start-up (launch.handshake).

The rank at the sending end of a ring link (rank i of the link i -> i+1) probes it, its peer answers:

    probe_ping      -->                 PINGS times: the round trip of a small message (the least is kept)
                    <--  probe_pong
    probe_bulk (B)  -->                 B bytes out; the peer says so at once ...
                    <--  probe_got      ... then sends B bytes back, right behind:
                    <--  probe_back (B)
    probe_burst x M -->                 M small messages back to back, through the same send as a round's ...
                    <--  probe_burst_got  ... the peer answers once it has them all (BURSTS times: the least is kept)
    send: (got - sent) - rtt for B bytes; receive: back - got for B bytes;
    a message: (burst_got - first sent) - rtt - the burst's bytes' transfer, over the M - 1 messages after the first

A message costs its two ends CPU (serialization, the channel's send and receive path: a gloo pair on a busy
2-core host read 0.8-5 ms a small one; threads of one process, ~0.03). A lone message's is inside the round trip
already; one right behind another waits for it, so in a full pipe every message costs its ends that much more
(speculative.cost_model: LinkCost.message_ms).

B = BULK_BYTES: on a 20 Mbit/s link the whole probe takes about 0.2 s besides its round trips. Loopback moves
B in well under a millisecond, so its rates are rough (bounded by MIN_TRANSFER_S): what matters there is that
the link is local. The probe runs through the Channel, emulation included (transport.emulate_*).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from netbridge.channel import Channel, PeerError
from netbridge.frames import Message, encode

PINGS = 3
BULK_BYTES = 256 * 1024
MAX_PINGS = 16  # the answering end's bound on the pings it echoes before the bulk comes
MIN_TRANSFER_S = 1e-5  # a transfer faster than this (clock resolution, loopback) counts as this long
BURST = 16  # small messages back to back: what each costs beyond the first
BURSTS = 2  # bursts sent; the quickest is kept (a start-up on a busy host reads above the link, never below)
MAX_BURST = 256  # the answering end's bound on a burst's announced size
BURST_FLOATS = 64  # each burst message's tensor (a round carries hidden states: the tensor path is the real one)


@dataclass(frozen=True)
class LinkProbe:
    kind: str  # "local" (two ranks of one host), "relay" or "gloo": what carries the link
    rtt_ms: float  # the least round trip of a small message, as the round loop would see it (emulation included)
    send_mbps: float  # the sending end -> its peer, Mbit/s
    recv_mbps: float  # the peer -> the sending end, Mbit/s
    message_ms: float = 0.0  # what a small message right behind another costs its ends (CPU), beyond the wire

    def text(self) -> str:
        """For the start-up lines: `relay, RTT 81.2 ms, 19.8/20.1 Mbit/s, 0.92 ms a message`."""
        return (f"{self.kind}, RTT {self.rtt_ms:.1f} ms, {rate(self.send_mbps)}/{rate(self.recv_mbps)} Mbit/s, "
                f"{self.message_ms:.2f} ms a message")


def rate(mbps: float) -> str:
    return f"{mbps:.0f}" if mbps >= 100 else f"{mbps:.1f}"


def mbps(nbytes: int, seconds: float) -> float:
    """Mbit/s of `nbytes` moved in `seconds` (at least MIN_TRANSFER_S)."""
    return nbytes * 8 / 1e6 / max(seconds, MIN_TRANSFER_S)


def measure(kind: str, pings_s: list[float], nbytes: int, out_s: float, back_s: float, burst_s: float = 0.0,
            burst: int = BURST, burst_bytes: int = 0) -> LinkProbe:
    """The probe's figures from its clock readings: `pings_s` each ping's round trip, `out_s` from sending the
    bulk to the peer's "got" (a round trip plus the bulk's transfer), `back_s` from "got" to the bulk back,
    `burst_s` from sending the first of `burst` messages (`burst_bytes` in all) to the peer's answer (0: none)."""
    rtt_s = min(pings_s)
    send = mbps(nbytes, out_s - rtt_s)
    beyond_s = burst_s - rtt_s - burst_bytes * 8 / (send * 1e6)  # the first's path is in the round trip
    return LinkProbe(kind, rtt_s * 1000, send, mbps(nbytes, back_s), max(0.0, beyond_s) * 1000 / max(burst - 1, 1))


def probe_link(channel: Channel, pings: int = PINGS, nbytes: int = BULK_BYTES, burst: int = BURST) -> LinkProbe:
    """Measure `channel` from its sending end; the peer runs `answer_probe` at the same time."""
    pings_s = []
    for i in range(pings):
        t0 = time.perf_counter()
        channel.send("probe_ping", {"i": i})
        channel.recv("probe_pong")
        pings_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    channel.send("probe_bulk", {"back": nbytes}, bytes=torch.zeros(nbytes, dtype=torch.uint8))
    channel.recv("probe_got")
    t1 = time.perf_counter()
    channel.recv("probe_back")
    t2 = time.perf_counter()
    bursts = [probe_burst(channel, burst) for _ in range(BURSTS)]
    burst_s, burst_bytes = min(bursts)
    return measure(channel.kind, pings_s, nbytes, t1 - t0, t2 - t1, burst_s, burst, burst_bytes)


def probe_burst(channel: Channel, count: int) -> tuple[float, int]:
    """Send `count` small messages back to back; the seconds until the peer says it has them all, and their bytes."""
    tensor = torch.zeros(BURST_FLOATS)
    t0 = time.perf_counter()
    for i in range(count):
        channel.send("probe_burst", {"i": i, "of": count}, hidden=tensor)
    channel.recv("probe_burst_got")
    took = time.perf_counter() - t0
    return took, count * len(encode(Message("probe_burst", {"i": count, "of": count}, {"hidden": tensor})))


def answer_probe(channel: Channel) -> None:
    """The peer's side of probe_link: echo each ping; on the bulk, say so, then send as many bytes back; take the
    burst in, then say so."""
    for _ in range(MAX_PINGS + 1):
        msg = channel.recv(("probe_ping", "probe_bulk"))
        if msg.kind == "probe_bulk":
            back = msg.meta.get("back")
            if not isinstance(back, int) or not 0 < back <= 16 * BULK_BYTES:
                raise PeerError(f"{channel.peer_name} asked for a link probe of {back!r} bytes; is it the same Tandem version?")
            channel.send("probe_got")
            channel.send("probe_back", bytes=torch.zeros(back, dtype=torch.uint8))
            for _ in range(BURSTS):
                answer_burst(channel)
            return
        channel.send("probe_pong", {"i": msg.meta.get("i")})
    raise PeerError(f"{channel.peer_name} sent more than {MAX_PINGS} link probe pings; is it the same Tandem version?")


def answer_burst(channel: Channel) -> None:
    """Take in the burst its first message announces, then say so."""
    count = channel.recv("probe_burst").meta.get("of")
    if not isinstance(count, int) or not 0 < count <= MAX_BURST:
        raise PeerError(f"{channel.peer_name} announced a link probe burst of {count!r} messages (at most "
                        f"{MAX_BURST}); is it the same Tandem version?")
    for _ in range(count - 1):
        channel.recv("probe_burst")
    channel.send("probe_burst_got")


def probe_ring(prev: Channel, next: Channel, rank: int) -> LinkProbe:
    """This rank's probe of its link to the next rank, answering the rank before it's probe of theirs. Rank 0
    probes first and answers last; every other rank answers first: one probe at a time goes around the ring,
    so no two ranks wait on each other (with two ranks, each end probes the one channel in turn)."""
    if rank == 0:
        mine = probe_link(next)
        answer_probe(prev)
        return mine
    answer_probe(prev)
    return probe_link(next)
