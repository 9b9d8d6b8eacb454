"""Reaching the other rank through the relay: dial, authenticate, wait until the relay pairs the two ends.

`dialer(...)` gives the function a RelayChannel calls to get a fresh paired link, the first time and on every
re-dial; `ring_link` names the two-member session of one link of a ring of more than two ranks.
"""
from __future__ import annotations

import logging
import threading
import time

from netbridge import auth
from netbridge.channel import PeerError
from netbridge.link import PAIRED, LinkClosed, LinkGarbage, LinkSocket, LinkTimeout, NoticeBoard, UnexpectedFrame, WaitingLine

log = logging.getLogger("tandem.relay_channel")

DEFAULT_RECONNECT_S = 60.0


def default_heartbeat(timeout_s: float) -> float:
    """Heartbeat period: 5 s, or faster when the per-op timeout is short, so death is seen well within it."""
    return max(0.05, min(5.0, timeout_s / 6))


def ring_link(session: str, rank: int, peer: int, ranks: int) -> tuple[str, int]:
    """(relay session id, this end's rank in it) of the ring link between neighbours `rank` and `peer`.
    Each link of the ring is its own two-member session, so the relay needs nothing new for N ranks:
    `<session>/ring<r>` carries rank r -> r+1, and `<session>/ring<N-1>` the replies from the last rank
    to rank 0. The lower ring rank is end 0; each link agrees its own keys with the pairing secret."""
    sender = rank if peer == (rank + 1) % ranks else peer
    return f"{session}/ring{sender}", int(rank > peer)


def check_secrets(rank: int, token: bytes, secret: bytes) -> None:
    """Refuse before dialing what could never work, or would hand the relay the keys."""
    if rank not in (0, 1):
        raise PeerError(f"relay sessions have ranks 0 and 1, not {rank}")
    if secret == token:
        raise PeerError("the pairing secret (transport.secret_file) is the relay's token (transport.relay_token_file): "
                        "the relay could then decrypt everything; make a second secret for the two nodes only, with "
                        "`python -c 'import secrets; print(secrets.token_hex(32))' > FILE`")


def dialer(relay: str, session: str, rank: int, token: bytes, timeout_s: float, heartbeat_s: float, ring: tuple[int, int]):
    """`dial_and_pair(wait_s, dial_s=5.0) -> LinkSocket`: dial the relay with its `token` as `rank` of `session` and
    wait up to wait_s for the other end; every failure is a PeerError. A short dial timeout while reconnecting:
    a SYN lost on a link that was down is retried by the next dial."""
    def dial_and_pair(wait_s: float, dial_s: float = 5.0) -> LinkSocket:
        try:
            sock = auth.dial(relay, token, session, auth.ROLE_DATA, rank, 2, max(0.5, min(wait_s, dial_s)))
        except auth.HandshakeError as e:
            raise PeerError(str(e)) from None
        link = LinkSocket(sock, relay, send_timeout_s=timeout_s)
        try:
            wait_for_peer(link, session, ring, wait_s, heartbeat_s)
        except BaseException:
            link.close()
            raise
        return link
    return dial_and_pair


def wait_for_peer(link: LinkSocket, session: str, ring: tuple[int, int], join_timeout_s: float, heartbeat_s: float) -> None:
    """Heartbeat until the relay says the other rank of `session` is there; every failure becomes a PeerError.
    A notice from the relay (a claim for this session refused, e.g. the other rank's wrong secret) is warned
    about once and named in the timeout's message; the wait goes on, since that rank may retry. Every
    WAITING_LINE_S (netbridge.link) a line says the wait goes on."""
    relay, (rank, peer) = link.name, ring
    notices = NoticeBoard(lambda text: log.warning("rank %d, waiting for rank %d of session %r: %s", rank, peer, session, text))
    waiting = WaitingLine(lambda waited_s: log.warning(
        "rank %d waiting at the relay %s for rank %d of session %r (%.0f s of %g s); is rank %d started, with the same "
        "transport.session and relay token?", rank, relay, peer, session, waited_s, join_timeout_s, peer))
    try:
        link.wait_for(PAIRED, time.monotonic() + join_timeout_s, heartbeat_s, on_notice=notices, still_waiting=waiting)
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


class Heartbeats:
    """A small thread that sends a heartbeat on the current link whenever nothing else went out for most of a
    period, so that the peer and the relay's idle timer tell a quiet, live rank from a dead link. It ends
    when `stop` is set. `on_tick()`, if given, runs after each look at the link (RelayChannel's idle watch)."""

    def __init__(self, current_link, period_s: float, stop: threading.Event, name: str, on_tick=None):
        self.current_link, self.period_s, self.stop, self.on_tick = current_link, period_s, stop, on_tick
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.period_s / 2):
            link = self.current_link()  # swapped on reconnect; a dead one just fails here
            if link is not None and time.monotonic() - link.last_tx >= self.period_s * 0.9:
                try:
                    link.try_heartbeat()
                except OSError:  # the link's owner finds out on its next send or receive, and reconnects
                    pass
            if self.on_tick is not None:
                self.on_tick()

    def join(self, timeout_s: float = 2.0) -> None:
        self.thread.join(timeout=timeout_s)
