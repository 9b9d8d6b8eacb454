"""The per-connection protocol: one client's connection through its life. The one module that writes a
connection's state and writes to the connections' transports; the server above decides (admission,
sessions, rendezvous, stores) and calls the methods here.

    hello    the HMAC handshake (netbridge.relay.handshake); a claim that does not authenticate is
             answered REFUSED at once, or after its source's delay (refusing: netbridge.relay.refusals);
             then by role:
    waiting  a data rank whose peer has not come; only heartbeats may arrive
    paired   a data rank with its peer: link frames checked and forwarded cut-through both ways
    rdzv     a torchrun agent waiting for the rest of its run; only heartbeats
    service  a registered service's control connection (netbridge.relay.services): heartbeats in, each
             answered with one; DIAL out
    spliced  one end of a Splice (a store pipe, or a service's dial-back): bytes verbatim, not framed
    done | closed

A client on --api-port (ApiClient, below) has no handshake: its first bytes make it a Splice's client.

Link frames after the handshake: u8 type | u32 length | body (netbridge.link). The length is checked
against the bound before any body byte is read; a bad type, an oversized or empty DATA frame, or DATA
before the peer has joined closes that connection with one log line, and its session with it. When one
side of a pair leaves, the other gets PEER_LEFT at a frame boundary and is closed, so both re-dial and
resume through a fresh pairing.

It imports only the pure parts below it; what it needs from the server is the `Host` protocol.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import NamedTuple, Protocol

from netbridge import auth
from netbridge.link import HEADER, HEARTBEAT, PAIRED, PEER_LEFT
from netbridge.relay.emulation import EmulatedLink
from netbridge.relay.handshake import ROLE_NAMES, Claim, Handshake, Refusal, source_of
from netbridge.relay.scanner import LinkFrameScanner

log = logging.getLogger("tandem.relay")

HIGH_WATER = 1024 * 1024  # bytes queued towards a receiver before the sender is paused


class Limits(NamedTuple):
    max_frame_bytes: int
    handshake_timeout_s: float
    idle_timeout_s: float
    emulate_delay_ms: float = 0.0  # EMULATION (netbridge.relay.emulation)
    emulate_mbps: float = 0.0


class Host(Protocol):
    """What a connection asks of the server that owns it."""
    secret: bytes

    def make_room_for(self, conn: Connection) -> bool: ...  # a handshake slot (False: turned away)
    def handshake_over(self, conn: Connection) -> None: ...  # out of the handshake table
    def claim(self, conn: Connection, claim: Claim) -> int: ...  # decide on an authenticated claim: a status of netbridge.auth
    def joined(self, conn: Connection) -> None: ...  # after OK went out
    def refused(self, conn: Connection, refusal: Refusal) -> float: ...  # a claim that did not authenticate: when to answer
    def left(self, conn: Connection) -> None: ...  # a counted connection ended
    def count(self, stat: str, n: int = 1) -> None: ...
    def api_room(self, client: ApiClient) -> bool: ...  # a place under --api-max-connections (False: closed)
    def api_call(self, client: ApiClient): ...  # the Splice of its first bytes, or None (no API registered: closed)
    def api_left(self, client: ApiClient) -> None: ...


class Accepted(asyncio.Protocol):
    """What every connection the relay accepts keeps of its transport: the socket and who is at its other end."""

    def is_open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def accepted(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.name = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.host_name = peer[0] if peer else "?"  # the client's address without the port
        self.source = source_of(peer[0]) if peer else "?"


class Connection(Accepted):
    """One client connection: the handshake, then link frames (data, rendezvous, a service's control) or one
    end of a Splice."""

    def __init__(self, host: Host, limits: Limits):
        self.host, self.limits = host, limits
        self.transport = None
        self.name = self.host_name = self.source = "?"
        self.state = "hello"  # hello | refusing | waiting | paired | rdzv | service | spliced | done | closed
        self.role = self.rank = self.world = 0
        self.session = ""
        self.handshake: Handshake | None = None
        self.counted = False  # holds a place among the server's connections, until it ends
        self.pending = False  # in the handshake table
        self.peer: Connection | None = None
        self.out = Forwarder(self, limits)  # this client's link frames towards its peer
        self.splice = None  # services.Splice, in state "spliced"
        self.paused: set[str] = set()  # why reading from this client is paused
        self.silent = False  # dropped for silence (see check_timers)
        self.refusal = None  # in state "refusing": the timer that answers REFUSED
        now = time.monotonic()
        self.born = now
        self.deadline = now + limits.handshake_timeout_s
        self.last_rx = now

    # ---- asyncio callbacks ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.accepted(transport)
        if not self.host.make_room_for(self):
            # no slot, no timer; a short greeting says why, so a client behind a crowded NAT learns what to raise
            self.state = "closed"
            _say_and_close(self.transport, auth.busy_greeting(auth.SOURCE_LIMIT))
            return
        self.counted = self.pending = True
        sock = transport.get_extra_info("socket")
        if sock is not None:
            auth.tune(sock)
        transport.set_write_buffer_limits(high=HIGH_WATER, low=HIGH_WATER // 4)
        self.handshake = Handshake(self.host.secret)
        transport.write(self.handshake.hello)

    def data_received(self, data: bytes) -> None:
        self.last_rx = time.monotonic()
        if self.state == "hello":
            self._handshake_step(self.handshake.feed(data))
        elif self.state == "spliced":
            self.host.count("bytes", len(data))
            self.splice.received(self, data)
        elif self.state in ("waiting", "paired", "rdzv", "service"):
            self._forward_frames(data)
            if self.state == "service":
                self.tell(HEADER.pack(HEARTBEAT, 0))  # so the process behind the NAT notices a relay that is gone

    def eof_received(self):
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        self._finish()

    def pause_writing(self) -> None:  # our transport's buffer is full: stop reading from whoever feeds it
        self._hold_feeder(True)

    def resume_writing(self) -> None:
        self._hold_feeder(False)

    def _hold_feeder(self, on: bool) -> None:
        if self.peer is not None:
            self.peer.throttle("receiver", on)
        elif self.splice is not None:
            self.splice.full(self, on)

    # ---- the handshake -------------------------------------------------------------------------
    def _handshake_step(self, outcome: Claim | Refusal | None) -> None:
        if isinstance(outcome, Refusal):
            self.refuse(self.host.refused(self, outcome))
        elif isinstance(outcome, Claim):
            self.role, self.rank, self.world, self.session = outcome.role, outcome.rank, outcome.world, outcome.session
            status = self.host.claim(self, outcome)
            if status != auth.OK:
                self._answer_and_close(status)
                return
            self.transport.write(self.handshake.accept(outcome))
            self.host.joined(self)
            if outcome.rest:
                self.data_received(outcome.rest)

    def _answer_and_close(self, status: int) -> None:
        self.state = "closed"
        self.transport.write(bytes([status]))
        self.close_soon()

    def refuse(self, delay_s: float) -> None:
        """REFUSED, now or after `delay_s` (repeated refusals from one source are slowed). Meanwhile the
        connection keeps its handshake slot, so its source's --max-pending-per-source bounds how many wait,
        and the table may shed it like any unfinished handshake; what the client sends is ignored."""
        if delay_s <= 0:
            self.end_pending()
            self._answer_and_close(auth.REFUSED)
            return
        self.state = "refusing"
        self.refusal = asyncio.get_running_loop().call_later(delay_s, self.refuse, 0.0)

    def end_pending(self) -> None:
        if self.pending:
            self.pending = False
            self.host.handshake_over(self)

    def shed(self) -> None:
        """Make room for a newer connection: told SHED (an honest client retries), its slot free at once."""
        _say_and_close(self.transport, bytes([auth.SHED]))
        self._finish()

    # ---- what the server decided ---------------------------------------------------------------
    def pair_with(self, other: Connection) -> None:
        """Both ranks of a session are here: each is the other's peer, and both are told PAIRED."""
        other._paired(self)
        self._paired(other)

    def _paired(self, peer: Connection) -> None:
        self.peer, self.state = peer, "paired"
        self.transport.write(HEADER.pack(PAIRED, 0))

    def wait_for_peer(self) -> None:
        self.state = "waiting"

    def enter_rendezvous(self) -> None:
        self.state = "rdzv"

    def finish_rendezvous(self, answer: bytes) -> None:
        """The run's rendezvous is complete: `answer` (its node rank, the store's token) and close."""
        self.state = "done"
        self.transport.write(answer)
        self.close_soon()

    def serve_dials(self) -> None:
        """A registered service's control connection: heartbeats in, DIAL out (through `tell`)."""
        self.state = "service"

    def splice_into(self, splice) -> None:
        """From now on this connection is one end of `splice` (services.Splice): bytes verbatim."""
        self.state = "spliced"
        self.splice = splice

    def tell(self, data: bytes) -> None:
        """Bytes to this client if still connected: a NOTICE, what crossed the emulated wire, a DIAL, what the
        other end of its Splice sent."""
        if self.is_open():
            self.transport.write(data)

    # ---- link frames, towards the peer ---------------------------------------------------------
    def _forward_frames(self, data: bytes) -> None:
        """Check the link frames in `data`; the bytes of frames that go to the peer go on."""
        forwarded, error = self.out.feed(data, self.state == "paired")
        self.host.count("bytes", forwarded)
        if error:
            self.drop(error)

    def forward_end(self) -> None:
        """This side left: tell the peer (after what is still on the emulated wire) and close it."""
        self.out.end(self.silent)

    def lose_peer(self) -> None:  # the peer left; this connection is being closed
        self.peer = None
        self.state = "closed"

    def throttle(self, reason: str, on: bool) -> None:
        """Pause reading from this client while any reason holds (a full receiver, a full emulated link, a
        dial-back not here yet); the idle timer does not run while paused."""
        was = bool(self.paused)
        (self.paused.add if on else self.paused.discard)(reason)
        if not self.is_open():
            return
        if self.paused and not was:
            self.transport.pause_reading()
        elif was and not self.paused:
            self.last_rx = time.monotonic()
            self.transport.resume_reading()

    # ---- ending --------------------------------------------------------------------------------
    def check_timers(self, now: float) -> None:
        if self.state == "hello" and now > self.deadline:
            self.drop(f"no complete handshake within {self.limits.handshake_timeout_s:.0f} s (slow or silent client)")
        elif self.state in ("waiting", "paired", "rdzv", "service") and not self.paused and now - self.last_rx > self.limits.idle_timeout_s:
            self.silent = True  # its peer is not told it left: a silent node may still come back within reconnect_s
            self.drop(f"silent for {self.limits.idle_timeout_s:.0f} s, not even heartbeats (--idle-timeout-s)")

    def drop(self, why: str | None) -> None:
        """Close this connection now, with one log line."""
        if why:
            log.warning("%s (%s %s): %s; closing it", self.name, ROLE_NAMES.get(self.role, "client"), self.session or "-", why)
            self.host.count("dropped")
        if self.transport is not None:
            self.transport.abort()
        self._finish()

    def close_soon(self) -> None:
        """Flush what we wrote, then close; abort if the client does not read it within a few seconds."""
        if not self.is_open():
            return
        self.transport.close()
        asyncio.get_running_loop().call_later(5.0, self.transport.abort)

    def _finish(self) -> None:
        if self.refusal is not None:
            self.refusal.cancel()  # a refusal waiting for its delay: nothing is left to answer
            self.refusal = None
        if self.counted:
            self.counted = False
            self.end_pending()
            self.host.left(self)
            if self.splice is not None:
                self.splice.end(self)
            self.state = "closed"


class ApiClient(Accepted):
    """A client connection on --api-port: no handshake here (the API's key and TLS are end to end, between the
    client and rank 0). Its first bytes ask the run's API service for a dial-back (an idle connection costs
    rank 0 nothing) and make it the client of a Splice: bytes verbatim both ways, never parsed. One that sends
    nothing within --handshake-timeout-s is closed."""

    def __init__(self, host: Host, limits: Limits):
        self.host, self.limits = host, limits
        self.transport = None
        self.name = self.source = "?"
        self.session = "api"
        self.born = time.monotonic()
        self.splice = None
        self.counted = False
        self.paused: set[str] = set()
        self.deadline = time.monotonic() + limits.handshake_timeout_s

    def connection_made(self, transport) -> None:
        self.accepted(transport)
        if not self.host.api_room(self):
            transport.abort()
            return
        self.counted = True
        sock = transport.get_extra_info("socket")
        if sock is not None:
            auth.tune(sock)
        transport.set_write_buffer_limits(high=HIGH_WATER, low=HIGH_WATER // 4)

    def data_received(self, data: bytes) -> None:
        if self.splice is None:
            self.splice = self.host.api_call(self)
            if self.splice is None:
                return  # closed: nobody serves the API
        self.host.count("bytes", len(data))
        self.splice.received(self, data)

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        if self.counted:
            self.counted = False
            self.host.api_left(self)
            if self.splice is not None:
                self.splice.end(self)

    def pause_writing(self) -> None:
        if self.splice is not None:
            self.splice.full(self, True)

    def resume_writing(self) -> None:
        if self.splice is not None:
            self.splice.full(self, False)

    def check_timers(self, now: float) -> None:
        if self.splice is None and now > self.deadline:
            self.drop(f"sent nothing within {self.limits.handshake_timeout_s:.0f} s (--handshake-timeout-s)")

    # the Splice's end
    def tell(self, data: bytes) -> None:
        if self.is_open():
            self.transport.write(data)

    def throttle(self, reason: str, on: bool) -> None:
        was = bool(self.paused)
        (self.paused.add if on else self.paused.discard)(reason)
        if not self.is_open():
            return
        if self.paused and not was:
            self.transport.pause_reading()
        elif was and not self.paused:
            self.transport.resume_reading()

    def close_soon(self) -> None:
        if self.is_open():
            self.transport.close()
            asyncio.get_running_loop().call_later(5.0, self.transport.abort)

    def drop(self, why: str | None) -> None:
        if why:
            log.warning("%s (API client): %s; closing it", self.name, why)
            self.host.count("dropped")
        if self.transport is not None:
            self.transport.abort()


class Forwarder:
    """One client's link frames towards its peer: checked as they stream in, without holding a body
    (LinkFrameScanner), and forwarded cut-through, through the emulated wire when emulating."""

    def __init__(self, conn: Connection, limits: Limits):
        self.conn = conn
        self.frames = LinkFrameScanner(limits.max_frame_bytes)
        emulating = limits.emulate_delay_ms or limits.emulate_mbps
        self.link = EmulatedLink(limits.emulate_delay_ms, limits.emulate_mbps, HIGH_WATER, self._arrived,
                                 lambda on: conn.throttle("emulated-link", on)) if emulating else None

    def feed(self, data: bytes, paired: bool) -> tuple[int, str | None]:
        """Forward what goes on of `data`; (bytes of the frames begun, an error that ends the connection or None)."""
        out, forwarded, error = self.frames.scan(data, paired)
        if out and self.conn.peer is not None:
            if len(out) == 1 and out[0] == (0, len(data)):
                chunk = data
            else:
                chunk = b"".join(p if isinstance(p, bytes) else memoryview(data)[p[0]:p[1]] for p in out)
            self._send(chunk)
        return forwarded, error

    def _send(self, chunk: bytes) -> None:
        if self.link is None:
            self.conn.peer.transport.write(chunk)
        else:
            self.link.send(chunk)

    def _arrived(self, chunk: bytes | None) -> None:
        """EMULATION: `chunk` crossed the emulated wire to the peer (None: the sender left, close the peer)."""
        peer = self.conn.peer
        if peer is None:
            return
        if chunk is None:
            peer.close_soon()
        else:
            peer.tell(chunk)

    def end(self, silent: bool) -> None:
        """The client left: PEER_LEFT to the peer at a frame boundary (not for a silent one: it may come back
        within reconnect_s), then the peer is closed, once what is on the emulated wire has arrived."""
        peer = self.conn.peer
        if peer is None:
            return
        if self.frames.at_boundary() and not silent and peer.is_open():
            self._send(HEADER.pack(PEER_LEFT, 0))  # its connection closed: the peer gives it a short grace, not reconnect_s
        if self.link is not None and self.link.is_busy():
            self.link.close_receiver_after_queued()
        else:
            peer.close_soon()
        peer.lose_peer()


def _say_and_close(transport, data: bytes) -> None:
    """Write a few bytes and close: they fit the socket buffer at once, so the socket goes now; the
    abort is only for a peer whose buffer is somehow full."""
    transport.write(data)
    stuck = transport.get_write_buffer_size() > 0
    transport.close()
    if stuck:
        asyncio.get_running_loop().call_later(5.0, transport.abort)
