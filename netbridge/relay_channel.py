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
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time

from netbridge import auth, secure
from netbridge.channel import Channel, PeerError
from netbridge.frames import FrameError
from netbridge.link import (DATA, HEARTBEAT, PAIRED, PEER_LEFT, LinkClosed, LinkGarbage, LinkSocket, LinkTimeout, NoticeBoard,
                            UnexpectedFrame)

log = logging.getLogger("tandem.relay_channel")

DEFAULT_RECONNECT_S = 60.0
_BACKOFF_S = (0.1, 2.0)  # first and longest pause between two dials while reconnecting


class RefusedFrame(PeerError, FrameError):
    """A frame that failed its end-to-end check: a PeerError for the round loop, and, like any other
    frame that is not a valid Tandem message, a FrameError. The channel's state is unchanged by it."""


PEER_CLOSED_GRACE_S = 3.0  # the relay saw the peer's connection close: a live peer re-dials within this


class _LinkLost(Exception):
    """The link to the relay is gone (the text says how); a resumable session re-dials for up to window_s
    (None: transport.reconnect_s)."""

    def __init__(self, why: str, window_s: float | None = None):
        super().__init__(why)
        self.window_s = window_s


class NotResumable(PeerError):
    """The other end is not the process this session started with, or the two disagree on what was sent."""


class RelayChannel(Channel):
    """Channel over an authenticated relay connection (or, for benchmarks, any connected LinkSocket).

    `redial(seconds)` returns a fresh paired LinkSocket (RelayChannel.connect passes one); without it
    a lost link is final. `secret` is the pairing secret that authenticates the end-to-end key exchange;
    both ends must use the same one, and the relay must not have it.

    `rank` is this end's place in the two-member relay session (0 or 1: the wire, the keys); `ring`, with
    more than two ranks, is (this rank, the peer) on the pipeline's ring, the numbers the error lines name.
    """

    def __init__(self, link: LinkSocket, rank: int, session: str, timeout_s: float, heartbeat_s: float | None = None, *,
                 secret: bytes = b"", redial=None, reconnect_s: float = 0.0, ring: tuple[int, int] | None = None,
                 **emulation):
        super().__init__(timeout_s, **emulation)
        self.link, self.rank, self.peer, self.session = link, rank, 1 - rank, session
        self.ring_rank, self.ring_peer = ring or (rank, 1 - rank)
        self.relay = link.name
        self.heartbeat_s = heartbeat_s or default_heartbeat(timeout_s)
        self.dead_after_s = 3 * self.heartbeat_s
        self.redial, self.reconnect_s = redial, reconnect_s
        # end-to-end state; it survives reconnects
        self.pairing = secure.pairing_keys(secret, session)
        self._private, self.public = secure.new_ephemeral()  # the private key is dropped once the keys are derived
        self.peer_public = secure.NO_KEY
        self.sealer: secure.Sealer | None = None
        self.tx_seq = 0  # the last seq this side sent
        self.rx_seq = 0  # the last seq this side received
        self.unacked: collections.deque[tuple[int, bytes]] = collections.deque()  # (seq, envelope) the peer may lack
        self.resumes = 0
        self._closed = threading.Event()
        self._hb = threading.Thread(target=self._heartbeats, name=f"relay-heartbeat-{rank}", daemon=True)
        self._hb.start()
        self._start_link(link)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def connect(cls, relay: str, session: str, rank: int, token: bytes, secret: bytes, timeout_s: float = 120.0,
                heartbeat_s: float | None = None, join_timeout_s: float | None = None,
                reconnect_s: float = DEFAULT_RECONNECT_S, ring: tuple[int, int] | None = None,
                **emulation) -> RelayChannel:
        """Dial the relay with its `token`, as `rank` of `session`, and wait (up to join_timeout_s) for the other rank;
        the end-to-end keys are agreed with the pairing `secret`, which must not be the token (the relay holds that).
        `ring`: (this rank, the peer) on a ring of more than two ranks, for the error lines."""
        if rank not in (0, 1):
            raise PeerError(f"relay sessions have ranks 0 and 1, not {rank}")
        if secret == token:
            raise PeerError("the pairing secret (transport.secret_file) is the relay's token (transport.relay_token_file): "
                            "the relay could then decrypt everything; make a second secret for the two nodes only, with "
                            "`python -c 'import secrets; print(secrets.token_hex(32))' > FILE`")
        heartbeat_s = heartbeat_s or default_heartbeat(timeout_s)
        join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s

        def dial_and_pair(wait_s: float, dial_s: float = 5.0) -> LinkSocket:
            # a short dial timeout while reconnecting: a SYN lost on a link that was down is retried by the next dial
            try:
                sock = auth.dial(relay, token, session, auth.ROLE_DATA, rank, 2, max(0.5, min(wait_s, dial_s)))
            except auth.HandshakeError as e:
                raise PeerError(str(e)) from None
            link = LinkSocket(sock, relay, send_timeout_s=timeout_s)
            try:
                _wait_for_peer(link, session, ring or (rank, 1 - rank), wait_s, heartbeat_s)
            except BaseException:
                link.close()
                raise
            return link
        link = dial_and_pair(join_timeout_s, dial_s=30.0)
        return cls(link, rank, session, timeout_s, heartbeat_s, secret=secret, redial=dial_and_pair,
                   reconnect_s=reconnect_s, ring=ring, **emulation)

    @classmethod
    def from_config(cls, cfg, rank: int, peer: int | None = None, ranks: int = 2, **emulation) -> RelayChannel:
        """transport.relay / session / relay_token(_file) / secret(_file) / reconnect_s; under torchrun
        --rdzv_backend=tandem-relay the relay address and session default to the rendezvous endpoint and --rdzv_id;
        the token file defaults to TANDEM_RELAY_TOKEN_FILE, the pairing secret's to TANDEM_SECRET_FILE.
        With more than two ranks, the link between ring ranks `rank` and `peer` (see ring_link)."""
        t = cfg.transport
        relay = t.relay or os.environ.get("TANDEM_RELAY")
        if not relay:
            raise PeerError("transport.kind=relay needs transport.relay=HOST:PORT, the address of `tandem-relay`")
        session = t.session or os.environ.get("TORCHELASTIC_RUN_ID")
        if not session:
            raise PeerError("transport.kind=relay needs transport.session=ID, the same on both ranks (or torchrun --rdzv_id)")
        try:
            token = auth.load_secret(t.relay_token, t.relay_token_file or os.environ.get("TANDEM_RELAY_TOKEN_FILE"),
                                     what=auth.RELAY_TOKEN)
            secret = auth.load_secret(t.secret, t.secret_file or os.environ.get("TANDEM_SECRET_FILE"), what=auth.PAIRING_SECRET)
        except auth.HandshakeError as e:
            raise PeerError(str(e)) from None
        reconnect_s = getattr(t, "reconnect_s", DEFAULT_RECONNECT_S)
        if ranks == 2:
            return cls.connect(relay, session, rank, token, secret, timeout_s=t.timeout_s, reconnect_s=reconnect_s, **emulation)
        link_session, end = ring_link(session, rank, peer, ranks)
        return cls.connect(relay, link_session, end, token, secret, timeout_s=t.timeout_s, reconnect_s=reconnect_s,
                           ring=(rank, peer), **emulation)

    # ---- Channel -------------------------------------------------------------------------------
    def send_frame(self, frame: bytes) -> None:
        self._sealed(secure.SEALED, frame)

    def recv_frame(self) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                frame = self._accept(self._next_data(deadline))  # a hello may resend, so _accept can lose the link too
            except _LinkLost as lost:
                self._resume(str(lost), lost.window_s)
                deadline = time.monotonic() + self.timeout_s  # the reconnect does not count against the peer
                continue
            if frame is not None:
                return frame

    @property
    def established(self) -> bool:
        """True once the other rank's hello arrived: there is a session key and something to resume."""
        return self.sealer is not None

    # ---- sending -------------------------------------------------------------------------------
    def _sealed(self, kind: int, plaintext: bytes) -> None:
        if self._closed.is_set():
            raise PeerError(f"the relay channel to rank {self.ring_peer} is closed")
        self._await_hello(time.monotonic() + self.timeout_s)
        self.tx_seq += 1
        envelope = self.sealer.seal(kind, self.tx_seq, self.rx_seq, plaintext)
        self.unacked.append((self.tx_seq, envelope))  # kept until the peer acknowledges it: a resume resends it
        try:
            self._send_data(envelope)
        except _LinkLost as lost:
            self._resume(str(lost), lost.window_s)  # resends this frame too

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

    # ---- receiving -----------------------------------------------------------------------------
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
            raise PeerError(f"rank {self.ring_peer} is connected (its heartbeats arrive through the relay {self.relay}) but sent "
                            f"no message for {self.timeout_s:g} s (transport.timeout_s); is it stuck, or is the timeout "
                            "too short for its step?") from None
        except LinkGarbage as e:
            raise PeerError(str(e)) from None
        except LinkClosed as e:
            where = " in the middle of a frame" if e.mid_frame else ""
            raise self._lost_or_fatal(f"the relay at {self.relay} closed the connection{where} ({e.reason}): rank {self.ring_peer} "
                                      "left or was dropped, or the relay stopped (check the relay's log)") from None

    def _accept(self, body: bytes) -> bytes | None:
        """The message in an envelope from the peer, or None for a hello (handled here). Refuses anything unsealed."""
        kind = secure.envelope_type(body)
        try:
            if kind == secure.HELLO:
                self._on_hello(secure.open_hello(self.pairing, body))
                return None
            if kind not in (secure.SEALED, secure.CLOSE):
                raise secure.SecureError(f"not a sealed Tandem frame (envelope type {kind})")
            if self.sealer is None:
                raise secure.SecureError("sealed before the session key was agreed (no hello yet)")
            kind, seq, ack, plaintext = self.sealer.open(body, self.rx_seq + 1)
        except secure.WrongPairingSecret:
            raise PeerError(f"rank {self.ring_peer}'s hello through the relay {self.relay} is not signed with this node's pairing "
                            "secret: transport.secret_file (or TANDEM_SECRET_FILE) must hold the same pairing secret on both "
                            "nodes (not the relay's token), or something on the path altered the hello") from None
        except secure.SecureError as e:
            raise RefusedFrame(f"refused a frame from rank {self.ring_peer} through the relay {self.relay}: {e.what}; someone on "
                               "the path altered, replayed, reordered or reflected it, or the other end is not this session's "
                               "rank (check the network path and who has the pairing secret)") from None
        self.rx_seq = seq
        self._forget_acked(ack)
        if kind == secure.CLOSE:
            raise PeerError(f"rank {self.ring_peer} left session {self.session!r} at the relay {self.relay} (it closed its channel)")
        return plaintext

    def _forget_acked(self, ack: int) -> None:
        while self.unacked and self.unacked[0][0] <= ack:
            self.unacked.popleft()

    def _check_alive(self, now: float) -> None:
        if now - self.link.last_rx > self.dead_after_s:
            raise self._lost_or_fatal(
                f"nothing from rank {self.ring_peer} through the relay {self.relay} for {now - self.link.last_rx:.0f} s, "
                f"not even heartbeats (every {self.heartbeat_s:g} s): its host, the relay or the network is down")

    # ---- the session: hello, resume ------------------------------------------------------------
    def _start_link(self, link: LinkSocket) -> None:
        """A freshly paired link: say who we are and what we received; the peer's hello is awaited before sending."""
        self.link, self._hello_pending = link, True
        hello = secure.Hello(self.rank, self.public, self.peer_public, self.rx_seq)
        self._send_data(secure.pack_hello(self.pairing, hello))

    def _await_hello(self, deadline: float) -> None:
        """Before sending on a new link: the peer's hello tells what it lacks, which goes out first."""
        if self._hello_pending:
            try:
                self._read_hello(deadline)
            except _LinkLost as lost:
                self._resume(str(lost), lost.window_s)

    def _read_hello(self, deadline: float) -> None:
        """Read the peer's hello of the current link: the first thing it sends after pairing."""
        while self._hello_pending:
            if self._accept(self._next_data(deadline)) is not None:
                raise NotResumable(f"rank {self.ring_peer} sent a message before its hello through the relay {self.relay}; "
                                   "is it the same Tandem version?")

    def _on_hello(self, hello: secure.Hello) -> None:
        if hello.rank != self.peer:
            raise secure.SecureError(f"a hello from rank {hello.rank}, not from rank {self.peer}")
        # the public keys name the processes: a resumed link must join the same two
        restarted = self.peer_public not in (secure.NO_KEY, hello.public) or hello.peer_public not in (secure.NO_KEY, self.public)
        if restarted:
            raise NotResumable(f"rank {self.ring_peer} of session {self.session!r} at the relay {self.relay} is not the process this "
                            "session started with (it restarted, or another job uses the same transport.session); "
                            "restart both ranks, each job with its own session id")
        if self.sealer is None:
            self.peer_public = hello.public
            keys = secure.traffic_keys(self.pairing, self.session, self._private, self.rank, hello.public)
            self.sealer = secure.Sealer(keys, self.rank)
            self._private = None  # forward secrecy: nothing left here re-derives the keys from recorded hellos
        self._hello_pending = False
        self._resend_after(hello.last_rx)

    def _resend_after(self, peer_rx: int) -> None:
        """Resend what the peer lacks: every kept frame after the last one it says it received."""
        self._forget_acked(peer_rx)
        oldest = self.unacked[0][0] if self.unacked else self.tx_seq + 1
        if not oldest - 1 <= peer_rx <= self.tx_seq:
            raise NotResumable(f"cannot resume session {self.session!r}: rank {self.ring_peer} received up to seq {peer_rx}, this rank "
                            f"sent {self.tx_seq} and kept {oldest}..; the ranks disagree (restart both)")
        for _, envelope in self.unacked:
            self._send_data(envelope)

    def _lost_or_fatal(self, why: str, window_s: float | None = None) -> Exception:
        """What a broken link becomes: a reason to reconnect in an established session, else the error itself."""
        if self.established and self.redial is not None and self.reconnect_s > 0 and not self._closed.is_set():
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
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if peer_closed:
                    raise PeerError(f"{why} and did not re-dial within {window_s:g} s")
                raise PeerError(f"{why}; could not resume within {self.reconnect_s:g} s (transport.reconnect_s; last try: "
                                f"{last}): is the relay at {self.relay} running and reachable from here, and is rank "
                                f"{self.ring_peer} still running?")
            try:
                link = self.redial(left)
            except PeerError as e:  # the relay is not back yet, or the peer has not re-dialed yet: try again
                last = str(e)
            else:
                try:
                    self._start_link(link)
                    self._read_hello(min(deadline, time.monotonic() + self.timeout_s))
                    self.resumes += 1
                    log.warning("rank %d: resumed session %r through the relay %s after %.1f s (%s)", self.ring_rank, self.session,
                                self.relay, time.monotonic() - started, why)
                    return
                except _LinkLost as e:  # lost again while resynchronizing; anything else is final
                    last = str(e)
            self.link.close()
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, _BACKOFF_S[1])

    # ---- heartbeats and closing ----------------------------------------------------------------
    def _heartbeats(self) -> None:
        while not self._closed.wait(self.heartbeat_s / 2):
            link = getattr(self, "link", None)  # swapped on reconnect; a dead one just fails here
            if link is not None and time.monotonic() - link.last_tx >= self.heartbeat_s * 0.9:
                try:
                    link.try_heartbeat()
                except OSError:  # the owner finds out on its next send or receive, and reconnects
                    pass

    def close(self) -> None:
        if self._closed.is_set():
            return
        if self._hello_pending:  # the peer's hello is likely here already: with it, the CLOSE below can be sealed
            try:
                self._read_hello(time.monotonic() + min(1.0, self.timeout_s))
            except Exception:  # noqa: BLE001 - closing: the link may be gone, or the peer never said hello
                pass
        if self.established and not self._hello_pending:  # tell the peer this is on purpose, so it does not wait to resume
            try:
                self.tx_seq += 1
                self.link.sock.settimeout(min(self.timeout_s, 2.0))  # best effort: never hang on a dead link here
                self.link.send(DATA, self.sealer.seal(secure.CLOSE, self.tx_seq, self.rx_seq, b""))
            except OSError:
                pass
        self._closed.set()
        self._hb.join(timeout=2)
        self.link.close()


def ring_link(session: str, rank: int, peer: int, ranks: int) -> tuple[str, int]:
    """(relay session id, this end's rank in it) of the ring link between neighbours `rank` and `peer`.
    Each link of the ring is its own two-member session, so the relay needs nothing new for N ranks:
    `<session>/ring<r>` carries rank r -> r+1, and `<session>/ring<N-1>` the replies from the last rank
    to rank 0. The lower ring rank is end 0; each link agrees its own keys with the pairing secret."""
    sender = rank if peer == (rank + 1) % ranks else peer
    return f"{session}/ring{sender}", int(rank > peer)


def _wait_for_peer(link: LinkSocket, session: str, ring: tuple[int, int], join_timeout_s: float, heartbeat_s: float) -> None:
    """Heartbeat until the relay says the other rank of `session` is there; every failure becomes a PeerError.
    A notice from the relay (a claim for this session refused, e.g. the other rank's wrong secret) is warned
    about once and named in the timeout's message; the wait goes on, since that rank may retry."""
    relay, (rank, peer) = link.name, ring
    notices = NoticeBoard(lambda text: log.warning("rank %d, waiting for rank %d of session %r: %s", rank, peer, session, text))
    try:
        link.wait_for(PAIRED, time.monotonic() + join_timeout_s, heartbeat_s, on_notice=notices)
    except UnexpectedFrame as e:
        raise PeerError(f"the relay at {relay} sent frame type {e.kind} before pairing; is it the same Tandem version?") from None
    except LinkTimeout:
        if notices.last:
            raise PeerError(f"rank {peer} did not join session {session!r} at the relay {relay} within "
                            f"{join_timeout_s:g} s{notices.suffix()}") from None
        raise PeerError(f"rank {peer} did not join session {session!r} at the relay {relay} within {join_timeout_s:g} s; "
                        "is it running, with the same transport.session and the relay's token? (a wrong token is "
                        "refused at the relay: check the relay's log)") from None
    except LinkClosed as e:
        raise PeerError(f"the relay at {relay} closed the connection while rank {rank} waited for rank {peer} "
                        f"({e.reason}); the relay stopped or dropped it (check its log and --idle-timeout-s)") from None
    except LinkGarbage as e:
        raise PeerError(str(e)) from None


def default_heartbeat(timeout_s: float) -> float:
    """Heartbeat period: 5 s, or faster when the per-op timeout is short, so death is seen well within it."""
    return max(0.05, min(5.0, timeout_s / 6))
