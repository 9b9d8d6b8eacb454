"""The end-to-end session between the two ends of a relay link, without a socket: seal, open, acknowledge, resend.

It holds what survives a reconnect: the keys (agreed on the first hellos, netbridge.secure), the sequence
numbers of both directions and the envelopes the peer has not acknowledged yet. It never touches a socket:
each call returns the bytes to send (a hello, a sealed message, the envelopes to resend), and the link
(netbridge.relay_channel) writes them. Every refusal is one PeerError line naming the peer and the relay.
"""
from __future__ import annotations

import collections

from netbridge import secure
from netbridge.channel import PeerError
from netbridge.frames import FrameError


class RefusedFrame(PeerError, FrameError):
    """A frame that failed its end-to-end check: a PeerError for the round loop, and, like any other
    frame that is not a valid Tandem message, a FrameError. The session's state is unchanged by it."""


class NotResumable(PeerError):
    """The other end is not the process this session started with, or the two disagree on what was sent."""


class SecureSession:
    """One link's end-to-end state. `rank` is this end of the two-member session (0 or 1: the wire, the keys);
    `ring_peer` and `relay` only name the peer and the path in error lines."""

    def __init__(self, secret: bytes, session: str, rank: int, ring_peer: int, relay: str):
        self.session, self.rank, self.peer = session, rank, 1 - rank
        self.ring_peer, self.relay = ring_peer, relay
        self.pairing = secure.pairing_keys(secret, session)
        self._private, self.public = secure.new_ephemeral()  # the private key is dropped once the keys are derived
        self.peer_public = secure.NO_KEY
        self.sealer: secure.Sealer | None = None
        self.tx_seq = 0  # the last seq this side sent
        self.rx_seq = 0  # the last seq this side received
        self.unacked: collections.deque[tuple[int, bytes]] = collections.deque()  # (seq, envelope) the peer may lack
        self.awaiting_hello = False  # a new link's hello went out; the peer's has not come yet

    @property
    def established(self) -> bool:
        """True once the other end's hello arrived: there is a session key and something to resume."""
        return self.sealer is not None

    # ---- what to send ----------------------------------------------------------------------------
    def hello(self) -> bytes:
        """The hello for a freshly paired link: who we are and what we received. The peer's is awaited before
        anything else is sent on that link (it says what to resend)."""
        self.awaiting_hello = True
        return secure.pack_hello(self.pairing, secure.Hello(self.rank, self.public, self.peer_public, self.rx_seq))

    def seal(self, plaintext: bytes) -> bytes:
        """The envelope of the next message; kept until the peer acknowledges it, since a resume resends it."""
        self.tx_seq += 1
        envelope = self.sealer.seal(secure.SEALED, self.tx_seq, self.rx_seq, plaintext)
        self.unacked.append((self.tx_seq, envelope))
        return envelope

    def close_envelope(self) -> bytes:
        """The CLOSE that tells the peer this end leaves on purpose (not kept: nothing resends it)."""
        self.tx_seq += 1
        return self.sealer.seal(secure.CLOSE, self.tx_seq, self.rx_seq, b"")

    # ---- what arrived ----------------------------------------------------------------------------
    def open(self, body) -> tuple[bytes | None, list[bytes]]:
        """(the message in the peer's envelope, or None for a hello; the envelopes to resend now, after a hello).
        Refuses anything unsealed, altered, replayed, reordered or reflected."""
        kind = secure.envelope_type(body)
        try:
            if kind == secure.HELLO:
                return None, self._on_hello(secure.open_hello(self.pairing, body))
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
        return plaintext, []

    def _on_hello(self, hello: secure.Hello) -> list[bytes]:
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
        self.awaiting_hello = False
        return self._resend_after(hello.last_rx)

    def _resend_after(self, peer_rx: int) -> list[bytes]:
        """What the peer lacks: every kept envelope after the last one it says it received."""
        self._forget_acked(peer_rx)
        oldest = self.unacked[0][0] if self.unacked else self.tx_seq + 1
        if not oldest - 1 <= peer_rx <= self.tx_seq:
            raise NotResumable(f"cannot resume session {self.session!r}: rank {self.ring_peer} received up to seq {peer_rx}, this rank "
                               f"sent {self.tx_seq} and kept {oldest}..; the ranks disagree (restart both)")
        return [envelope for _, envelope in self.unacked]

    def _forget_acked(self, ack: int) -> None:
        while self.unacked and self.unacked[0][0] <= ack:
            self.unacked.popleft()
