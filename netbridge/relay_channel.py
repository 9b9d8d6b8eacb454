"""The relay Channel: the two ranks exchange frames through netbridge.relay, both only dialing out.

    transport.kind=relay transport.relay=HOST:PORT transport.session=ID
    transport.relay_token_file=PATH (the relay's --secret-file: admission) transport.secret_file=PATH (pairing)

End to end: every message is sealed with per-direction keys from an X25519 exchange authenticated by
the pairing secret, which the relay never holds (netbridge.secure), so the relay forwards ciphertext it
cannot read; a frame that was altered, replayed, reordered or reflected on the way is refused (PeerError).

Resume: messages carry per-direction sequence numbers, and each side keeps the frames the other has
not acknowledged yet (in the request/response protocol one or two). When the link drops (relay
restart, reset, cut, the relay saying the other rank's link dropped, or nothing at all arriving for
3 heartbeats), the rank re-dials the relay with backoff for up to transport.reconnect_s; after
re-pairing both say which seq they received last and resend what the other lacks. Output is that of
an uninterrupted run; past reconnect_s the error names the relay and what to check.

Each rank sends heartbeats every `heartbeat_s` from a small thread, so the receiver tells apart
  - a peer that is alive but silent (heartbeats arrive, no message): PeerError after transport.timeout_s
  - a link that died (nothing arrives at all for 3 heartbeats): reconnect, as above
  - a peer that closed its channel on purpose (its CLOSE arrives): PeerError at once
A link that fails before the session is established (before the other rank's hello arrived) fails
at once as before: there is nothing to resume yet, and the join has its own timeout.

An idle link resumes too: on a ring of more than two ranks a rank sends on its link to the next rank and then
waits on another link, so a drop of the idle one (the relay closing it, a network reset) would be seen only at
its next send, which may wait on a message lost in the drop. The heartbeat thread therefore watches the
connection while neither send nor receive is using the channel, and re-dials as soon as it hangs up.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from contextlib import contextmanager

from netbridge.channel import Channel, PeerError, PeerSilent
from netbridge.link import DATA, HEARTBEAT, PEER_LEFT, LinkClosed, LinkGarbage, LinkSocket, LinkTimeout
from netbridge.relay_dial import DEFAULT_RECONNECT_S, Heartbeats, check_secrets, default_heartbeat, dialer, ring_link
from netbridge.secure_session import NotResumable, RefusedFrame, SecureSession

__all__ = ["DEFAULT_RECONNECT_S", "PEER_CLOSED_GRACE_S", "LinkSocket", "NotResumable", "RefusedFrame", "RelayChannel",
           "default_heartbeat", "ring_link"]

log = logging.getLogger("tandem.relay_channel")

_BACKOFF_S = (0.1, 2.0)  # first and longest pause between two dials while reconnecting
PEER_CLOSED_GRACE_S = 3.0  # the relay saw the peer's connection close: a live peer re-dials within this


class _LinkLost(Exception):
    """The link to the relay is gone (the text says how); a resumable session re-dials for up to window_s
    (None: transport.reconnect_s)."""

    def __init__(self, why: str, window_s: float | None = None):
        super().__init__(why)
        self.window_s = window_s


class RelayChannel(Channel):
    """The resuming link: a Channel over an authenticated relay connection (or, for benchmarks, any connected
    LinkSocket) carrying a SecureSession's envelopes; it re-dials, resynchronizes and heartbeats.
    `redial(seconds)` returns a fresh paired LinkSocket (RelayChannel.connect passes one); without it a lost
    link is final. `secret`: the pairing secret (the same on both ends; the relay must not have it).

    `rank` is this end's place in the two-member relay session (0 or 1: the wire, the keys); `ring`, with
    more than two ranks, is (this rank, the peer) on the pipeline's ring, the numbers the error lines name.
    """

    kind = "relay"

    def __init__(self, link: LinkSocket, rank: int, session: str, timeout_s: float, heartbeat_s: float | None = None, *,
                 secret: bytes = b"", redial=None, reconnect_s: float = 0.0, ring: tuple[int, int] | None = None,
                 **emulation):
        super().__init__(timeout_s, **emulation)
        self.link, self.session = link, session
        self.ring_rank, self.ring_peer = ring or (rank, 1 - rank)
        self.relay = link.name
        self.heartbeat_s = heartbeat_s or default_heartbeat(timeout_s)
        self.dead_after_s = 3 * self.heartbeat_s
        self.redial, self.reconnect_s = redial, reconnect_s
        self.secure = SecureSession(secret, session, rank, self.ring_peer, self.relay)  # survives reconnects
        self.resumes = 0
        self._closed = threading.Event()
        self._use = threading.Condition()  # guards _using / _idle_resume: the idle watch acts only when no call is inside
        self._using, self._idle_resume, self._idle_error = 0, False, None
        self._kept: list[bytes] = []  # messages the idle watch read, for the next receives
        self._hb = Heartbeats(lambda: getattr(self, "link", None), self.heartbeat_s, self._closed, f"relay-heartbeat-{rank}",
                              on_tick=self._watch_idle)
        self._start_link(link)

    @classmethod
    def connect(cls, relay: str, session: str, rank: int, token: bytes, secret: bytes, timeout_s: float = 120.0,
                heartbeat_s: float | None = None, join_timeout_s: float | None = None,
                reconnect_s: float = DEFAULT_RECONNECT_S, ring: tuple[int, int] | None = None,
                **emulation) -> RelayChannel:
        """Dial the relay with its `token`, as `rank` of `session`, and wait (up to join_timeout_s) for the other rank;
        the end-to-end keys are agreed with the pairing `secret`, which must not be the token (the relay holds that).
        `ring`: (this rank, the peer) on a ring of more than two ranks, for the error lines."""
        check_secrets(rank, token, secret)
        heartbeat_s = heartbeat_s or default_heartbeat(timeout_s)
        join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
        dial_and_pair = dialer(relay, session, rank, token, timeout_s, heartbeat_s, ring or (rank, 1 - rank))
        link = dial_and_pair(join_timeout_s, dial_s=30.0)
        return cls(link, rank, session, timeout_s, heartbeat_s, secret=secret, redial=dial_and_pair,
                   reconnect_s=reconnect_s, ring=ring, **emulation)

    # ---- Channel -------------------------------------------------------------------------------
    def send_frame(self, frame: bytes) -> None:
        with self._in_use():
            if self._closed.is_set():
                raise PeerError(f"the relay channel to rank {self.ring_peer} is closed")
            if self._idle_error is not None:
                raise self._idle_error
            self._await_hello(time.monotonic() + self.timeout_s)
            envelope = self.secure.seal(frame)
            try:
                self._send_data(envelope)
            except _LinkLost as lost:
                self._resume(str(lost), lost.window_s)  # resends this frame too

    def recv_frame(self) -> bytes:
        with self._in_use():
            if self._kept:  # what the idle watch read, before what ended it
                return self._kept.pop(0)
            if self._idle_error is not None:
                raise self._idle_error
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    frame = self._receive(deadline)  # a hello may resend, so receiving can lose the link too
                except _LinkLost as lost:
                    self._resume(str(lost), lost.window_s)
                    deadline = time.monotonic() + self.timeout_s  # the reconnect does not count against the peer
                    continue
                if frame is not None:
                    return frame

    # ---- the idle watch ------------------------------------------------------------------------
    @contextmanager
    def _in_use(self):
        """Around each send and receive: waits out a resume (or a read) the idle watch has begun."""
        with self._use:
            while self._idle_resume:
                self._use.wait()
            self._using += 1
        try:
            yield
        finally:
            with self._use:
                self._using -= 1

    def _watch_idle(self) -> None:
        """(heartbeat thread) With no call inside and the connection hung up, read what is left on it as a receive
        would: a message is kept for the next receive, the peer's CLOSE (or another PeerError) is raised by the
        next call, and a lost link is re-dialed and resumed now."""
        with self._use:
            if self._using or self._closed.is_set() or not self._hung_up():
                return
            self._idle_resume = True
        try:
            frame = self._receive(time.monotonic() + self.heartbeat_s)
            if frame is not None:
                self._kept.append(frame)
        except _LinkLost as lost:
            try:
                self._resume(str(lost), lost.window_s)
            except PeerError as e:
                self._idle_error = e
        except PeerError as e:
            self._idle_error = e
        finally:
            with self._use:
                self._idle_resume = False
                self._use.notify_all()

    def _hung_up(self) -> bool:
        """The other side of the connection closed or reset it (seen without reading what is still buffered)."""
        watch = select.poll()
        try:
            watch.register(self.link.sock, select.POLLRDHUP)
            return any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, events in watch.poll(0))
        except (OSError, ValueError):  # closed here already
            return True

    # ---- the link ------------------------------------------------------------------------------
    def _send_data(self, body: bytes) -> None:
        if self.link.sock.gettimeout() != self.timeout_s:  # callers may shorten timeout_s (a last "error" message)
            self.link.sock.settimeout(self.timeout_s)
        try:
            self.link.send(DATA, body)
        except socket.timeout:
            raise self._lost_or_fatal(
                f"could not hand a {len(body)}-byte frame to the relay at {self.relay} within {self.timeout_s:g} s "
                f"(transport.timeout_s): rank {self.ring_peer} is not reading, or the link is stalled") from None
        except OSError as e:
            raise self._lost_or_fatal(
                f"lost the connection to the relay at {self.relay} while sending ({e.strerror or type(e).__name__}): "
                f"the relay stopped, the network dropped, or rank {self.ring_peer} left (check the relay's log)") from None

    def _receive(self, deadline: float) -> bytes | None:
        """The next message from the peer, or None when a hello came instead (what it asked for is resent)."""
        message, resend = self.secure.open(self._next_data(deadline))
        for envelope in resend:
            self._send_data(envelope)
        return message

    def _next_data(self, deadline: float) -> bytes:
        """Body of the next DATA frame on the current link; heartbeats are skipped. _LinkLost when the link is gone."""
        try:
            while True:
                kind, body = self.link.recv(deadline, self._check_alive, tick=min(0.5, self.heartbeat_s), progress_s=self.timeout_s)
                if kind == DATA:
                    return body
                if kind == HEARTBEAT:
                    continue
                if kind == PEER_LEFT:  # its connection closed (a silent one is dropped without this): gone, unless it re-dials now
                    raise self._lost_or_fatal(f"rank {self.ring_peer} left session {self.session!r} at the relay {self.relay} "
                                              "(its process ended or its connection dropped)", PEER_CLOSED_GRACE_S)
                raise PeerError(f"the relay at {self.relay} sent frame type {kind} mid-session; is it the same Tandem version?")
        except LinkTimeout:
            raise PeerSilent(f"rank {self.ring_peer} is connected (its heartbeats arrive through the relay {self.relay}) but sent "
                            f"no message for {self.timeout_s:g} s (transport.timeout_s); is it stuck, or is the timeout "
                            "too short for its step?") from None
        except LinkGarbage as e:
            raise PeerError(str(e)) from None
        except LinkClosed as e:
            where = " in the middle of a frame" if e.mid_frame else ""
            raise self._lost_or_fatal(f"the relay at {self.relay} closed the connection{where} ({e.reason}): rank {self.ring_peer} "
                                      "left or was dropped, or the relay stopped (check the relay's log)") from None

    def _check_alive(self, now: float) -> None:
        if now - self.link.last_rx > self.dead_after_s:
            raise self._lost_or_fatal(
                f"nothing from rank {self.ring_peer} through the relay {self.relay} for {now - self.link.last_rx:.0f} s, "
                f"not even heartbeats (every {self.heartbeat_s:g} s): its host, the relay or the network is down")

    # ---- a new link: hello, resume -------------------------------------------------------------
    def _start_link(self, link: LinkSocket) -> None:
        """A freshly paired link: say who we are and what we received; the peer's hello is awaited before sending."""
        self.link = link
        self._send_data(self.secure.hello())

    def _await_hello(self, deadline: float) -> None:
        """Before sending on a new link: the peer's hello tells what it lacks, which goes out first."""
        if self.secure.awaiting_hello:
            try:
                self._read_hello(deadline)
            except _LinkLost as lost:
                self._resume(str(lost), lost.window_s)

    def _read_hello(self, deadline: float) -> None:
        """Read the peer's hello of the current link: the first thing it sends after pairing."""
        while self.secure.awaiting_hello:
            if self._receive(deadline) is not None:
                raise NotResumable(f"rank {self.ring_peer} sent a message before its hello through the relay {self.relay}; "
                                   "is it the same Tandem version?")

    def _lost_or_fatal(self, why: str, window_s: float | None = None) -> Exception:
        """What a broken link becomes: a reason to reconnect in an established session, else the error itself."""
        if self.secure.established and self.redial is not None and self.reconnect_s > 0 and not self._closed.is_set():
            return _LinkLost(why, window_s)
        return PeerError(why)

    def _resume(self, why: str, window_s: float | None = None) -> None:
        """Re-dial the relay with backoff until re-paired and resynchronized, or PeerError past the window
        (transport.reconnect_s, or less when the peer's connection closed)."""
        started = time.monotonic()
        peer_closed = window_s is not None
        window_s = self.reconnect_s if window_s is None else min(window_s, self.reconnect_s)
        deadline = started + window_s
        pause, last = _BACKOFF_S[0], "no attempt"
        self.link.close()
        while (left := deadline - time.monotonic()) > 0:
            last = self._try_resume(left, deadline)
            if last is None:
                self.resumes += 1
                log.warning("rank %d: resumed session %r through the relay %s after %.1f s (%s)", self.ring_rank, self.session,
                            self.relay, time.monotonic() - started, why)
                return
            self.link.close()
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, _BACKOFF_S[1])
        if peer_closed:
            raise PeerError(f"{why} and did not re-dial within {window_s:g} s")
        raise PeerError(f"{why}; could not resume within {self.reconnect_s:g} s (transport.reconnect_s; last try: "
                        f"{last}): is the relay at {self.relay} running and reachable from here, and is rank "
                        f"{self.ring_peer} still running?")

    def _try_resume(self, left: float, deadline: float) -> str | None:
        """One re-dial and resynchronization: None when resumed, else why not (worth another try)."""
        try:
            link = self.redial(left)
        except PeerError as e:  # the relay is not back yet, or the peer has not re-dialed yet
            return str(e)
        try:
            self._start_link(link)
            self._read_hello(min(deadline, time.monotonic() + self.timeout_s))
        except _LinkLost as e:  # lost again while resynchronizing; anything else is final
            return str(e)
        return None

    # ---- closing -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed.is_set():
            return
        with self._use:  # the idle watch starts nothing more, and what it began is given a moment to end
            self._using += 1
            self._use.wait_for(lambda: not self._idle_resume, timeout=min(2.0, self.timeout_s))
        if self.secure.awaiting_hello:  # the peer's hello is likely here already: with it, the CLOSE below can be sealed
            try:
                self._read_hello(time.monotonic() + min(1.0, self.timeout_s))
            except Exception:  # noqa: BLE001 - closing: the link may be gone, or the peer never said hello
                pass
        if self.secure.established and not self.secure.awaiting_hello:  # tell the peer this is on purpose, so it does not wait to resume
            try:
                self.link.sock.settimeout(min(self.timeout_s, 2.0))  # best effort: never hang on a dead link here
                self.link.send(DATA, self.secure.close_envelope())
            except OSError:
                pass
        self._closed.set()
        self._hb.join()
        self.link.close()
