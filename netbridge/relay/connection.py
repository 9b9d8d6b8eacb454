"""The per-connection protocol: one client's connection through its life.

    hello    the HMAC handshake (admission); then by role:
    waiting  a data rank whose peer has not come; only heartbeats may arrive
    paired   a data rank with its peer: link frames checked and forwarded cut-through both ways
    rdzv     a torchrun agent waiting for the rest of its run; only heartbeats
    store    a byte pipe to its run's store (store.StoreProxy), not framed
    done | closed

Link frames after the handshake: u8 type | u32 length | body (netbridge.link). The length is checked
against the bound before any body byte is read; a bad type, an oversized or empty DATA frame, or DATA
before the peer has joined closes that connection with one log line, and its session with it. When one
side of a pair leaves, the other gets PEER_LEFT at a frame boundary and is closed, so both re-dial and
resume through a fresh pairing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from netbridge import auth
from netbridge.link import DATA, HEADER, HEARTBEAT, PEER_LEFT
from netbridge.relay.admission import ROLE_NAMES, Handshake, source_of
from netbridge.relay.emulation import EmulatedLink

if TYPE_CHECKING:
    from netbridge.relay.server import Relay
    from netbridge.relay.store import StoreProxy

log = logging.getLogger("tandem.relay")

HIGH_WATER = 1024 * 1024  # bytes queued towards a receiver before the sender is paused


class LinkFrameScanner:
    """Follows one client's stream of link frames without ever holding a body: checks each header once it
    is complete, and says which byte ranges go on to the peer (a header only once complete and checked)."""

    def __init__(self, max_frame_bytes: int):
        self.max_frame_bytes = max_frame_bytes
        self.hdr = bytearray()  # header bytes seen so far
        self.body_left = 0  # body bytes of the current frame still to come
        self.fwd = False  # the current frame goes to the peer

    def scan(self, data: bytes, paired: bool) -> tuple[list, int, str | None]:
        """(pieces for the peer: (start, end) into data, or bytes; bytes of the frames begun; an error that
        ends the connection, or None). The pieces stop at the frame in error."""
        mv = memoryview(data)
        n, i = len(mv), 0
        out: list = []
        forwarded = 0
        while i < n:
            if self.body_left:
                k = min(self.body_left, n - i)
                if self.fwd:
                    out.append((i, i + k))
                self.body_left -= k
                i += k
                continue
            start, hdr_was = i, len(self.hdr)
            k = min(HEADER.size - hdr_was, n - i)
            self.hdr += mv[i:i + k]
            i += k
            if len(self.hdr) < HEADER.size:
                break
            kind, length = HEADER.unpack(self.hdr)
            whole_header = bytes(self.hdr)
            self.hdr.clear()
            error = self._check(kind, length, paired)
            if error:
                return out, forwarded, error
            self.fwd = paired
            if self.fwd:
                out.append((start, i) if hdr_was == 0 else whole_header)
                forwarded += length + HEADER.size
            self.body_left = length
        return out, forwarded, None

    def _check(self, kind: int, length: int, paired: bool) -> str | None:
        if kind == HEARTBEAT:
            return None if length == 0 else f"heartbeat with a {length}-byte body"
        if kind == DATA:
            if not paired:
                return "sent data before its peer joined"
            if not 0 < length <= self.max_frame_bytes:
                return f"frame of {length} bytes outside the bound (1..{self.max_frame_bytes})"
            return None
        return f"unknown frame type {kind}"

    def at_boundary(self) -> bool:
        """True when the bytes forwarded so far end at a frame boundary of the peer's stream."""
        return not (self.fwd and self.body_left)  # header bytes are forwarded only once complete


class Connection(asyncio.Protocol):
    """One client connection: the handshake, then link frames (data, rendezvous) or a store pipe."""

    def __init__(self, relay: Relay):
        self.relay = relay
        self.transport = None
        self.name = "?"
        self.source = "?"
        self.state = "hello"  # hello | waiting | paired | rdzv | done | store | closed
        self.role = self.rank = self.world = 0
        self.session = ""
        self.handshake: Handshake | None = None
        self.pending = False  # in the admission's handshake table
        self.peer: Connection | None = None
        self.frames = LinkFrameScanner(relay.max_frame_bytes)
        self.link = EmulatedLink(self, relay.delay_s, relay.bytes_per_s, HIGH_WATER) if relay.emulating else None
        self.store_proxy: StoreProxy | None = None
        self.counted_store = False  # holds one of its store's pipe counts
        self.paused: set[str] = set()  # why reading from this client is paused
        self.silent = False  # dropped for silence (see check_timers)
        now = time.monotonic()
        self.born = now
        self.deadline = now + relay.handshake_timeout_s
        self.last_rx = now

    @property
    def host(self) -> str:
        """The client's address without the port."""
        return self.name.rpartition(":")[0] or self.name

    # ---- asyncio callbacks ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.name = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.source = source_of(peer[0]) if peer else "?"
        relay = self.relay
        if not relay.admission.make_room_for(self):
            # no slot, no timer; a short greeting says why, so a client behind a crowded NAT learns what to raise
            self.state = "closed"
            _say_and_close(self.transport, auth.busy_greeting(auth.SOURCE_LIMIT))
            return
        self.pending = True
        relay.conns.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            auth.tune(sock)
        transport.set_write_buffer_limits(high=HIGH_WATER, low=HIGH_WATER // 4)
        self.handshake = Handshake(self, relay)
        transport.write(self.handshake.hello)

    def data_received(self, data: bytes) -> None:
        self.last_rx = time.monotonic()
        if self.state == "hello":
            self.handshake.feed(data)
        elif self.state == "store":
            self.store_proxy.from_client(data)
        elif self.state in ("waiting", "paired", "rdzv"):
            self._forward_frames(data)

    def eof_received(self):
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        self._finish()

    def pause_writing(self) -> None:  # our transport's buffer is full: stop reading from whoever feeds it
        if self.peer is not None:
            self.peer.throttle("receiver", True)
        elif self.store_proxy is not None:
            self.store_proxy.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer.throttle("receiver", False)
        elif self.store_proxy is not None:
            self.store_proxy.resume_reading()

    # ---- admission ----------------------------------------------------------------------------
    def end_pending(self) -> None:
        if self.pending:
            self.pending = False
            self.relay.admission.handshakes.remove(self)

    def shed(self) -> None:
        """Make room for a newer connection: this one is told SHED (an honest client retries) and its slot
        is free at once."""
        _say_and_close(self.transport, bytes([auth.SHED]))
        self._finish()

    # ---- link frames, towards the peer ---------------------------------------------------------
    def _forward_frames(self, data: bytes) -> None:
        """Check the link frames in `data`; forward the bytes of frames that go to the peer."""
        out, forwarded, error = self.frames.scan(data, self.state == "paired")
        self.relay.stats["bytes"] += forwarded
        self._send(out, data)
        if error:
            self.drop(error)

    def _send(self, out: list, data: bytes) -> None:
        if not out or self.peer is None:
            return
        if len(out) == 1 and out[0] == (0, len(data)):
            chunk = data
        else:
            chunk = b"".join(p if isinstance(p, bytes) else memoryview(data)[p[0]:p[1]] for p in out)
        self._to_peer(chunk)

    def _to_peer(self, chunk: bytes) -> None:
        if self.link is None:
            self.peer.transport.write(chunk)
        else:
            self.link.send(chunk)

    def forward_end(self) -> None:
        """This side left: tell the peer (after what is still on the emulated wire) and close it."""
        peer = self.peer
        if peer is None:
            return
        if self.frames.at_boundary() and not self.silent and peer.transport is not None \
                and not peer.transport.is_closing():
            self._to_peer(HEADER.pack(PEER_LEFT, 0))  # its connection closed: the peer gives it a short grace, not reconnect_s
        if self.link is not None and self.link.is_busy():
            self.link.close_receiver_after_queued()
        else:
            peer.close_soon()
        peer.peer = None
        peer.state = "closed"

    def throttle(self, reason: str, on: bool) -> None:
        """Pause reading from this client while any reason holds (a full receiver, a full emulated link, a
        store pipe not up yet); the idle timer does not run while paused."""
        was = bool(self.paused)
        (self.paused.add if on else self.paused.discard)(reason)
        if self.transport is None or self.transport.is_closing():
            return
        if self.paused and not was:
            self.transport.pause_reading()
        elif was and not self.paused:
            self.last_rx = time.monotonic()
            self.transport.resume_reading()

    # ---- ending --------------------------------------------------------------------------------
    def check_timers(self, now: float) -> None:
        if self.state == "hello" and now > self.deadline:
            self.drop(f"no complete handshake within {self.relay.handshake_timeout_s:.0f} s (slow or silent client)")
        elif self.state in ("waiting", "paired", "rdzv") and not self.paused and now - self.last_rx > self.relay.idle_timeout_s:
            self.silent = True  # its peer is not told it left: a silent node may still come back within reconnect_s
            self.drop(f"silent for {self.relay.idle_timeout_s:.0f} s, not even heartbeats (--idle-timeout-s)")

    def drop(self, why: str | None) -> None:
        """Close this connection now, with one log line."""
        if why:
            log.warning("%s (%s %s): %s; closing it", self.name, ROLE_NAMES.get(self.role, "client"), self.session or "-", why)
            self.relay.stats["dropped"] += 1
        if self.transport is not None:
            self.transport.abort()
        self._finish()

    def close_soon(self) -> None:
        """Flush what we wrote, then close; abort if the client does not read it within a few seconds."""
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.close()
        asyncio.get_running_loop().call_later(5.0, self.transport.abort)

    def _finish(self) -> None:
        if self in self.relay.conns:
            self.relay.conns.discard(self)
            self.end_pending()
            self.relay.left(self)
            if self.store_proxy is not None:
                self.store_proxy.close()
            self.state = "closed"


def _say_and_close(transport, data: bytes) -> None:
    """Write a few bytes and close: they fit the socket buffer at once, so the socket goes now; the
    abort is only for a peer whose buffer is somehow full."""
    transport.write(data)
    stuck = transport.get_write_buffer_size() > 0
    transport.close()
    if stuck:
        asyncio.get_running_loop().call_later(5.0, transport.abort)
