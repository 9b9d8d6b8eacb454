"""What one link of the ring is and how fast it is, measured once at start-up (launch.handshake).

The rank at the sending end of a ring link (rank i of the link i -> i+1) probes it, its peer answers:

    probe_ping      -->                 PINGS times: the round trip of a small message (the least is kept)
                    <--  probe_pong
    probe_bulk (B)  -->                 B bytes out; the peer says so at once ...
                    <--  probe_got      ... then sends B bytes back, right behind:
                    <--  probe_back (B)
    send: (got - sent) - rtt for B bytes; receive: back - got for B bytes

B = BULK_BYTES: on a 20 Mbit/s link the whole probe takes about 0.2 s besides its round trips. Loopback moves
B in well under a millisecond, so its rates are rough (bounded by MIN_TRANSFER_S): what matters there is that
the link is local. The probe runs through the Channel, emulation included (transport.emulate_*).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from netbridge.channel import Channel, PeerError

PINGS = 3
BULK_BYTES = 256 * 1024
MAX_PINGS = 16  # the answering end's bound on the pings it echoes before the bulk comes
MIN_TRANSFER_S = 1e-5  # a transfer faster than this (clock resolution, loopback) counts as this long


@dataclass(frozen=True)
class LinkProbe:
    kind: str  # "local" (two ranks of one host), "relay" or "gloo": what carries the link
    rtt_ms: float  # the least round trip of a small message, as the round loop would see it (emulation included)
    send_mbps: float  # the sending end -> its peer, Mbit/s
    recv_mbps: float  # the peer -> the sending end, Mbit/s

    def text(self) -> str:
        """For the start-up lines: `relay, RTT 81.2 ms, 19.8/20.1 Mbit/s`."""
        return f"{self.kind}, RTT {self.rtt_ms:.1f} ms, {rate(self.send_mbps)}/{rate(self.recv_mbps)} Mbit/s"


def rate(mbps: float) -> str:
    return f"{mbps:.0f}" if mbps >= 100 else f"{mbps:.1f}"


def mbps(nbytes: int, seconds: float) -> float:
    """Mbit/s of `nbytes` moved in `seconds` (at least MIN_TRANSFER_S)."""
    return nbytes * 8 / 1e6 / max(seconds, MIN_TRANSFER_S)


def measure(kind: str, pings_s: list[float], nbytes: int, out_s: float, back_s: float) -> LinkProbe:
    """The probe's figures from its clock readings: `pings_s` each ping's round trip, `out_s` from sending the
    bulk to the peer's "got" (a round trip plus the bulk's transfer), `back_s` from "got" to the bulk back."""
    rtt_s = min(pings_s)
    return LinkProbe(kind, rtt_s * 1000, mbps(nbytes, out_s - rtt_s), mbps(nbytes, back_s))


def probe_link(channel: Channel, pings: int = PINGS, nbytes: int = BULK_BYTES) -> LinkProbe:
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
    return measure(channel.kind, pings_s, nbytes, t1 - t0, t2 - t1)


def answer_probe(channel: Channel) -> None:
    """The peer's side of probe_link: echo each ping; on the bulk, say so, then send as many bytes back."""
    for _ in range(MAX_PINGS + 1):
        msg = channel.recv(("probe_ping", "probe_bulk"))
        if msg.kind == "probe_bulk":
            back = msg.meta.get("back")
            if not isinstance(back, int) or not 0 < back <= 16 * BULK_BYTES:
                raise PeerError(f"{channel.peer_name} asked for a link probe of {back!r} bytes; is it the same Tandem version?")
            channel.send("probe_got")
            channel.send("probe_back", bytes=torch.zeros(back, dtype=torch.uint8))
            return
        channel.send("probe_pong", {"i": msg.meta.get("i")})
    raise PeerError(f"{channel.peer_name} sent more than {MAX_PINGS} link probe pings; is it the same Tandem version?")


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
