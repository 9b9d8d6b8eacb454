"""The relay Channel: the two ranks exchange frames through netbridge.relay, both only dialing out.

    transport.kind=relay transport.relay=HOST:PORT transport.session=ID transport.secret_file=PATH

Each rank sends heartbeats every `heartbeat_s` from a small thread, so the receiver tells apart
  - a peer that is alive but silent (heartbeats arrive, no message): PeerError after transport.timeout_s
  - a peer, host or link that is gone (nothing arrives at all): PeerError after 3 heartbeats
  - a peer that left (the relay says so, or closes): PeerError at once
and every error names the relay and what to check.
"""
from __future__ import annotations

import os
import socket
import threading
import time

from netbridge import auth
from netbridge.channel import Channel, PeerError
from netbridge.link import DATA, HEARTBEAT, PAIRED, PEER_LEFT, LinkClosed, LinkGarbage, LinkSocket, LinkTimeout, UnexpectedFrame


class RelayChannel(Channel):
    """Channel over an authenticated relay connection (or, for benchmarks, any connected LinkSocket)."""

    def __init__(self, link: LinkSocket, rank: int, session: str, timeout_s: float, heartbeat_s: float | None = None, **emulation):
        super().__init__(timeout_s, **emulation)
        self.link, self.rank, self.peer, self.session = link, rank, 1 - rank, session
        self.heartbeat_s = heartbeat_s or default_heartbeat(timeout_s)
        self.dead_after_s = 3 * self.heartbeat_s
        self._closed = threading.Event()
        self._hb_error: Exception | None = None
        self._hb = threading.Thread(target=self._heartbeats, name=f"relay-heartbeat-{rank}", daemon=True)
        self._hb.start()

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def connect(cls, relay: str, session: str, rank: int, secret: bytes, timeout_s: float = 120.0,
                heartbeat_s: float | None = None, join_timeout_s: float | None = None, **emulation) -> RelayChannel:
        """Dial the relay, authenticate as `rank` of `session`, and wait (up to join_timeout_s) for the other rank."""
        if rank not in (0, 1):
            raise PeerError(f"relay sessions have ranks 0 and 1, not {rank}")
        heartbeat_s = heartbeat_s or default_heartbeat(timeout_s)
        join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
        try:
            sock = auth.dial(relay, secret, session, auth.ROLE_DATA, rank, 2, min(join_timeout_s, 30.0))
        except auth.HandshakeError as e:
            raise PeerError(str(e)) from None
        link = LinkSocket(sock, relay, send_timeout_s=timeout_s)
        try:
            _wait_for_peer(link, session, rank, join_timeout_s, heartbeat_s)
        except BaseException:
            link.close()
            raise
        return cls(link, rank, session, timeout_s, heartbeat_s, **emulation)

    @classmethod
    def from_config(cls, cfg, rank: int, **emulation) -> RelayChannel:
        """transport.relay / session / secret(_file); under torchrun --rdzv_backend=tandem-relay the relay
        address and session default to the rendezvous endpoint and --rdzv_id, the secret file to TANDEM_SECRET_FILE."""
        t = cfg.transport
        relay = t.relay or os.environ.get("TANDEM_RELAY")
        if not relay:
            raise PeerError("transport.kind=relay needs transport.relay=HOST:PORT, the address of `tandem-relay`")
        session = t.session or os.environ.get("TORCHELASTIC_RUN_ID")
        if not session:
            raise PeerError("transport.kind=relay needs transport.session=ID, the same on both ranks (or torchrun --rdzv_id)")
        try:
            secret = auth.load_secret(t.secret, t.secret_file or os.environ.get("TANDEM_SECRET_FILE"))
        except auth.HandshakeError as e:
            raise PeerError(str(e)) from None
        return cls.connect(relay, session, rank, secret, timeout_s=t.timeout_s, **emulation)

    # ---- Channel -------------------------------------------------------------------------------
    def send_frame(self, frame: bytes) -> None:
        if self._closed.is_set():
            raise PeerError(f"the relay channel to rank {self.peer} is closed")
        if self.link.sock.gettimeout() != self.timeout_s:  # callers may shorten timeout_s (a last "error" message)
            self.link.sock.settimeout(self.timeout_s)
        try:
            self.link.send(DATA, frame)
        except socket.timeout:
            raise PeerError(f"could not hand a {len(frame)}-byte frame to the relay at {self.link.name} within {self.timeout_s:g} s "
                            f"(transport.timeout_s): rank {self.peer} is not reading, or the link is stalled") from None
        except OSError as e:
            raise PeerError(f"lost the connection to the relay at {self.link.name} while sending ({e.strerror or type(e).__name__}): "
                            f"the relay stopped, the network dropped, or rank {self.peer} left (check the relay's log)") from None

    def recv_frame(self) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                kind, body = self.link.recv(deadline, self._check_alive, tick=min(0.5, self.heartbeat_s), progress_s=self.timeout_s)
                if kind == DATA:
                    return body
                if kind == HEARTBEAT:
                    continue
                if kind == PEER_LEFT:
                    raise PeerError(f"rank {self.peer} left session {self.session!r} at the relay {self.link.name} "
                                    "(its process ended or its connection dropped)")
                raise PeerError(f"the relay at {self.link.name} sent frame type {kind} mid-session; is it the same Tandem version?")
        except LinkTimeout:
            raise PeerError(f"rank {self.peer} is connected (its heartbeats arrive through the relay {self.link.name}) but sent "
                            f"no message for {self.timeout_s:g} s (transport.timeout_s); is it stuck, or is the timeout "
                            "too short for its step?") from None
        except LinkGarbage as e:
            raise PeerError(str(e)) from None
        except LinkClosed as e:
            where = " in the middle of a frame" if e.mid_frame else ""
            raise PeerError(f"the relay at {self.link.name} closed the connection{where} ({e.reason}): rank {self.peer} left or "
                            "was dropped, or the relay stopped (check the relay's log)") from None

    def _check_alive(self, now: float) -> None:
        if now - self.link.last_rx > self.dead_after_s:
            raise PeerError(f"nothing from rank {self.peer} through the relay {self.link.name} for {now - self.link.last_rx:.0f} s, "
                            f"not even heartbeats (every {self.heartbeat_s:g} s): its host, the relay or the network is down")

    def _heartbeats(self) -> None:
        while not self._closed.wait(self.heartbeat_s / 2):
            if time.monotonic() - self.link.last_tx >= self.heartbeat_s * 0.9:
                try:
                    self.link.try_heartbeat()
                except OSError as e:  # the owner finds out on its next send or receive
                    self._hb_error = e
                    return

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._hb.join(timeout=2)
        self.link.close()


def _wait_for_peer(link: LinkSocket, session: str, rank: int, join_timeout_s: float, heartbeat_s: float) -> None:
    """Heartbeat until the relay says the other rank of `session` is there; every failure becomes a PeerError."""
    relay = link.name
    try:
        link.wait_for(PAIRED, time.monotonic() + join_timeout_s, heartbeat_s)
    except UnexpectedFrame as e:
        raise PeerError(f"the relay at {relay} sent frame type {e.kind} before pairing; is it the same Tandem version?") from None
    except LinkTimeout:
        raise PeerError(f"rank {1 - rank} did not join session {session!r} at the relay {relay} within {join_timeout_s:g} s; "
                        "is it running, with the same transport.session and the same secret? (a wrong secret is "
                        "refused at the relay: check the relay's log)") from None
    except LinkClosed as e:
        raise PeerError(f"the relay at {relay} closed the connection while rank {rank} waited for rank {1 - rank} "
                        f"({e.reason}); the relay stopped or dropped it (check its log and --idle-timeout-s)") from None
    except LinkGarbage as e:
        raise PeerError(str(e)) from None


def default_heartbeat(timeout_s: float) -> float:
    """Heartbeat period: 5 s, or faster when the per-op timeout is short, so death is seen well within it."""
    return max(0.05, min(5.0, timeout_s / 6))
