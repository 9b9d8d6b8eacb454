"""End-to-end sealing of the frames between the two ranks: keys the relay is not part of.

Two secrets, held by different parties (docs/relay.md has the threat model):
  - the relay token admits a node at the relay (netbridge.auth); the relay holds it too;
  - the pairing secret (transport.secret_file) is held by the two nodes only and never goes to the relay.

Every DATA link frame between the ranks carries one envelope:

    HELLO   u8 0xA1 | u8 rank | ephemeral X25519 public key(32) | the peer's (32, zeros if unknown)
            | u64 last seq received | HMAC(32)
    SEALED  u8 0xA2 | u64 seq | u64 ack | AEAD(netbridge.frames message) + 16-byte tag
    CLOSE   u8 0xA3 | u64 seq | u64 ack | AEAD(empty) + tag: the sender closed its channel on purpose

Each rank makes an ephemeral X25519 key pair once per process and sends HELLO right after every pairing
at the relay. The HELLO is MACed (HMAC-SHA256) with a key derived from the pairing secret and the
session id, so neither the relay nor anyone else without the pairing secret can forge or alter one, or
put its own public key in place of a rank's. On the first hello of the other rank, both compute

    shared   = X25519(own private key, the peer's public key)
    keys     = HKDF-SHA256(shared, salt = a key derived from the pairing secret,
                           info = "tandem-e2e-v2 keys|" session "|" public key of rank 0 || of rank 1)  (64 bytes)
    key 0->1 = keys[:32], key 1->0 = keys[32:]

and drop the private key: the traffic keys are fresh per pair of processes, one per direction, and a
pairing secret that leaks later does not open recorded traffic (forward secrecy). The keys live for the
session, across reconnects (a resumed link resends frames sealed under them); the hello of a resumed
link must carry the same public keys, else the other end is not the process the session started with.

SEALED/CLOSE use AES-256-GCM under the sender's direction key, the 12-byte nonce = u32 sender rank ||
u64 seq and the 17-byte header as associated data: the seq numbers of one direction count 1, 2, 3, ...
and are never reused under one key (a resent frame is the same ciphertext), so a frame the relay
replays, reorders, reflects or alters is refused. `ack` is the last seq the sender has received; it
lets the other side forget frames it kept for a resume. HELLO's `last seq received` tells the other
side what to resend after a re-pairing.

Standard library and `cryptography` only (no torch): the relay tests and benchmarks import it.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

HELLO, SEALED, CLOSE = 0xA1, 0xA2, 0xA3
PUBLIC_BYTES = 32
TAG_BYTES = 16
_HELLO_FIELDS = struct.Struct("!BB32s32sQ")
HELLO_BYTES = _HELLO_FIELDS.size + 32
SEALED_HEADER = struct.Struct("!BQQ")  # type, seq, ack: authenticated as associated data
_AEAD_NONCE = struct.Struct("!IQ")  # sender rank, seq: unique per key because each direction counts up
NO_KEY = bytes(PUBLIC_BYTES)


class SecureError(Exception):
    """An envelope that failed its check. `what` is a short phrase ("tampered with", "replayed", ...)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class WrongPairingSecret(SecureError):
    """The other rank's hello does not carry the MAC of our pairing secret."""


class Hello(NamedTuple):
    rank: int
    public: bytes  # the sender's ephemeral X25519 public key (the same in every hello of one process)
    peer_public: bytes  # NO_KEY while the sender has not heard from the other rank
    last_rx: int  # the last seq the sender has received from the other rank


class PairingKeys(NamedTuple):
    """What the pairing secret is used for, bound to one session id: MACing hellos, and salting the key derivation."""
    hello_mac: bytes
    kdf_salt: bytes


def pairing_keys(secret: bytes, session: str) -> PairingKeys:
    def derive(label: bytes) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                    info=b"tandem-e2e-v2 " + label + b"|" + session.encode()).derive(secret)
    return PairingKeys(derive(b"hello"), derive(b"salt"))


def new_ephemeral() -> tuple[X25519PrivateKey, bytes]:
    """A fresh X25519 key pair: (private key, raw public key)."""
    private = X25519PrivateKey.generate()
    return private, private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _hello_mac(keys: PairingKeys, fields: bytes) -> bytes:
    return hmac.new(keys.hello_mac, fields, hashlib.sha256).digest()


def pack_hello(keys: PairingKeys, hello: Hello) -> bytes:
    fields = _HELLO_FIELDS.pack(HELLO, hello.rank, hello.public, hello.peer_public, hello.last_rx)
    return fields + _hello_mac(keys, fields)


def open_hello(keys: PairingKeys, body) -> Hello:
    if len(body) != HELLO_BYTES:
        raise SecureError(f"a {len(body)}-byte hello (expected {HELLO_BYTES})")
    fields, mac = bytes(body[:_HELLO_FIELDS.size]), bytes(body[_HELLO_FIELDS.size:])
    if not hmac.compare_digest(mac, _hello_mac(keys, fields)):
        raise WrongPairingSecret("a hello without our pairing secret's MAC")
    _, rank, public, peer_public, last_rx = _HELLO_FIELDS.unpack(fields)
    return Hello(rank, public, peer_public, last_rx)


def traffic_keys(keys: PairingKeys, session: str, private: X25519PrivateKey, rank: int, peer_public: bytes) -> tuple[bytes, bytes]:
    """(key rank 0 -> rank 1, key rank 1 -> rank 0) from our private key (we are `rank`) and the peer's public key."""
    own = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:  # a low-order point: the exchange would give no secret at all
        raise SecureError("a hello with an unusable public key") from None
    publics = own + peer_public if rank == 0 else peer_public + own
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=keys.kdf_salt,
               info=b"tandem-e2e-v2 keys|" + session.encode() + b"|" + publics).derive(shared)
    return okm[:32], okm[32:]


def envelope_type(body) -> int:
    return body[0] if len(body) else -1


class Sealer:
    """AEAD for one session: this side's `rank` seals with its direction's key and opens with the other's."""

    def __init__(self, keys: tuple[bytes, bytes], rank: int):
        self.tx, self.rx = AESGCM(keys[rank]), AESGCM(keys[1 - rank])
        self.rank = rank

    def seal(self, kind: int, seq: int, ack: int, plaintext) -> bytearray:
        header = SEALED_HEADER.pack(kind, seq, ack)
        out = bytearray(len(header) + len(plaintext) + TAG_BYTES)  # one buffer, no copy of a big frame
        out[:len(header)] = header
        self.tx.encrypt_into(_AEAD_NONCE.pack(self.rank, seq), plaintext, header, memoryview(out)[len(header):])
        return out

    def open(self, body, expect_seq: int) -> tuple[int, int, int, bytearray]:
        """(kind, seq, ack, plaintext) of the other rank's envelope, which must be the next one, `expect_seq`."""
        if len(body) < SEALED_HEADER.size + TAG_BYTES:
            raise SecureError(f"a {len(body)}-byte sealed frame, shorter than its header and tag")
        header = bytes(body[:SEALED_HEADER.size])
        kind, seq, ack = SEALED_HEADER.unpack(header)
        plaintext = bytearray(len(body) - SEALED_HEADER.size - TAG_BYTES)
        try:
            self.rx.decrypt_into(_AEAD_NONCE.pack(1 - self.rank, seq), memoryview(body)[SEALED_HEADER.size:], header, plaintext)
        except InvalidTag:
            raise SecureError("tampered with (its authentication tag does not match)") from None
        if seq < expect_seq:
            raise SecureError(f"replayed (seq {seq} again, expected {expect_seq})")
        if seq > expect_seq:
            raise SecureError(f"out of order (seq {seq}, expected {expect_seq})")
        return kind, seq, ack, plaintext
