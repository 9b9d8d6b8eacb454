"""End-to-end sealing of the frames between the two ranks: the relay forwards ciphertext.

Every DATA link frame between the ranks carries one envelope:

    HELLO   u8 0xA1 | u8 rank | nonce(32) | peer nonce(32, zeros if unknown) | u64 last seq received | HMAC(32)
    SEALED  u8 0xA2 | u64 seq | u64 ack | AEAD(netbridge.frames message) + 16-byte tag
    CLOSE   u8 0xA3 | u64 seq | u64 ack | AEAD(empty) + tag: the sender closed its channel on purpose

Each rank draws a random 32-byte nonce once per process and sends HELLO right after every pairing
at the relay. The HELLO is MACed with the shared secret (bound to the session id), so the relay
cannot forge or alter one. The session key is

    HKDF-SHA256(secret, salt = nonce of rank 0 || nonce of rank 1, info = "tandem-e2e-v1|" + session)

fresh per pair of processes even though the secret is long-lived. SEALED/CLOSE use AES-256-GCM with
the 12-byte nonce = u32 sender rank || u64 seq and the 17-byte header as associated data: the seq
numbers of one direction count 1, 2, 3, ... and are never reused under one key (a resent frame is
the same ciphertext), so a frame the relay replays, reorders, reflects or alters is refused.
`ack` is the last seq the sender has received; it lets the other side forget frames it kept for a
resume. HELLO's `last seq received` tells the other side what to resend after a re-pairing.

Standard library and `cryptography` only (no torch): the relay tests and benchmarks import it.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

HELLO, SEALED, CLOSE = 0xA1, 0xA2, 0xA3
NONCE_BYTES = 32
TAG_BYTES = 16
_HELLO_FIELDS = struct.Struct("!BB32s32sQ")
HELLO_BYTES = _HELLO_FIELDS.size + 32
SEALED_HEADER = struct.Struct("!BQQ")  # type, seq, ack: authenticated as associated data
_AEAD_NONCE = struct.Struct("!IQ")  # sender rank, seq: unique per key because each direction counts up
NO_NONCE = bytes(NONCE_BYTES)


class SecureError(Exception):
    """An envelope that failed its check. `what` is a short phrase ("tampered with", "replayed", ...)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class Hello(NamedTuple):
    rank: int
    nonce: bytes
    peer_nonce: bytes  # NO_NONCE while the sender has not heard from the other rank
    last_rx: int  # the last seq the sender has received from the other rank


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _hello_mac(secret: bytes, session: str, fields: bytes) -> bytes:
    return hmac.new(secret, b"tandem-e2e-v1 hello|" + session.encode() + b"|" + fields, hashlib.sha256).digest()


def pack_hello(secret: bytes, session: str, hello: Hello) -> bytes:
    fields = _HELLO_FIELDS.pack(HELLO, hello.rank, hello.nonce, hello.peer_nonce, hello.last_rx)
    return fields + _hello_mac(secret, session, fields)


def open_hello(secret: bytes, session: str, body: bytes) -> Hello:
    if len(body) != HELLO_BYTES:
        raise SecureError(f"a {len(body)}-byte hello (expected {HELLO_BYTES})")
    fields, mac = body[:_HELLO_FIELDS.size], body[_HELLO_FIELDS.size:]
    if not hmac.compare_digest(mac, _hello_mac(secret, session, fields)):
        raise SecureError("a hello with a wrong MAC (tampered with, or another secret or session)")
    _, rank, nonce, peer_nonce, last_rx = _HELLO_FIELDS.unpack(fields)
    return Hello(rank, nonce, peer_nonce, last_rx)


def derive_key(secret: bytes, session: str, nonce0: bytes, nonce1: bytes) -> bytes:
    """The session key: both ranks compute it from the secret and the two nonces of this pair of processes."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=nonce0 + nonce1,
                info=b"tandem-e2e-v1|" + session.encode()).derive(secret)


def envelope_type(body) -> int:
    return body[0] if len(body) else -1


class Sealer:
    """AEAD for one session key; `rank` is this side's (it names the direction in the nonce)."""

    def __init__(self, key: bytes, rank: int):
        self.aead, self.rank = AESGCM(key), rank

    def seal(self, kind: int, seq: int, ack: int, plaintext) -> bytearray:
        header = SEALED_HEADER.pack(kind, seq, ack)
        out = bytearray(len(header) + len(plaintext) + TAG_BYTES)  # one buffer, no copy of a big frame
        out[:len(header)] = header
        self.aead.encrypt_into(_AEAD_NONCE.pack(self.rank, seq), plaintext, header, memoryview(out)[len(header):])
        return out

    def open(self, body, expect_seq: int) -> tuple[int, int, int, bytearray]:
        """(kind, seq, ack, plaintext) of the other rank's envelope, which must be the next one, `expect_seq`."""
        if len(body) < SEALED_HEADER.size + TAG_BYTES:
            raise SecureError(f"a {len(body)}-byte sealed frame, shorter than its header and tag")
        header = bytes(body[:SEALED_HEADER.size])
        kind, seq, ack = SEALED_HEADER.unpack(header)
        plaintext = bytearray(len(body) - SEALED_HEADER.size - TAG_BYTES)
        try:
            self.aead.decrypt_into(_AEAD_NONCE.pack(1 - self.rank, seq), memoryview(body)[SEALED_HEADER.size:], header, plaintext)
        except InvalidTag:
            raise SecureError("tampered with (its authentication tag does not match)") from None
        if seq < expect_seq:
            raise SecureError(f"replayed (seq {seq} again, expected {expect_seq})")
        if seq > expect_seq:
            raise SecureError(f"out of order (seq {seq}, expected {expect_seq})")
        return kind, seq, ack, plaintext
