"""The end-to-end session without a socket (netbridge.secure_session): hellos, seal/open, acknowledgements,
and what a new link resends, all as bytes handed from one end to the other."""
from __future__ import annotations

import pytest

from netbridge.secure_session import NotResumable, RefusedFrame, SecureSession

PAIRING = b"pairing-secret-for-the-test"


def agreed() -> tuple[SecureSession, SecureSession]:
    a, b = SecureSession(PAIRING, "s", 0, 1, "r:1"), SecureSession(PAIRING, "s", 1, 0, "r:1")
    hello_a, hello_b = a.hello(), b.hello()
    assert a.open(hello_b) == (None, []) and b.open(hello_a) == (None, [])
    return a, b


def test_messages_cross_once_in_order_and_acknowledged_ones_are_forgotten():
    a, b = agreed()
    assert a.established and b.established and not a.awaiting_hello
    envelopes = [a.seal(f"m{i}".encode()) for i in range(3)]
    assert [bytes(b.open(e)[0]) for e in envelopes] == [b"m0", b"m1", b"m2"]
    assert len(a.unacked) == 3  # nothing came back yet that acknowledges them
    a.open(b.seal(b"reply"))  # carries ack = 3
    assert not a.unacked


def test_a_new_link_resends_exactly_what_the_peer_lacks():
    a, b = agreed()
    first = a.seal(b"m1")
    b.open(first)
    a.seal(b"m2")  # lost with the link
    a.seal(b"m3")
    hello_a, hello_b = a.hello(), b.hello()  # the re-paired link: each says what it received
    _, resend = a.open(hello_b)
    assert b.open(hello_a) == (None, [])  # b sent nothing a lacks
    assert [bytes(b.open(e)[0]) for e in resend] == [b"m2", b"m3"]


def test_a_replayed_or_altered_envelope_is_refused_and_changes_nothing():
    a, b = agreed()
    e = a.seal(b"once")
    b.open(e)
    with pytest.raises(RefusedFrame, match="replayed"):
        b.open(e)
    altered = bytearray(a.seal(b"twice"))
    altered[-1] ^= 1
    with pytest.raises(RefusedFrame, match="tampered"):
        b.open(bytes(altered))
    assert b.rx_seq == 1


def test_a_restarted_peer_cannot_resume():
    a, _ = agreed()
    newcomer = SecureSession(PAIRING, "s", 1, 0, "r:1")  # rank 1 again, another process (new keys)
    with pytest.raises(NotResumable, match="not the process this session started with"):
        a.open(newcomer.hello())
