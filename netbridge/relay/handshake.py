"""Pure: one connection's handshake, the challenge-response of netbridge.auth, as decisions it returns.

The relay's hello carries its nonce; the client's claim is collected (never more than the largest claim) and
checked against the relay token. `feed` returns what happened: nothing yet, a Refusal (no claim, or a MAC that
does not check), or the authenticated Claim; whether the claim is admitted is the server's to decide, and
`accept` gives the OK with the relay's own MAC (so the client knows it reached a relay holding the token).
The texts of the notices told to a session about a refused claim are here too.
"""
from __future__ import annotations

import ipaddress
from typing import NamedTuple

from netbridge import auth

ROLE_NAMES = {auth.ROLE_DATA: "data", auth.ROLE_STORE: "store", auth.ROLE_RDZV: "rendezvous", auth.ROLE_SERVICE: "service",
              auth.ROLE_BACKEND: "dial-back"}
STATUS_NAMES = {auth.TAKEN: "slot already taken", auth.FULL: "relay full (--max-connections authenticated connections open)",
                auth.MISMATCH: "node count differs", auth.UNKNOWN: "unknown store or dial-back", auth.REFUSED: "refused"}


class Claim(NamedTuple):
    """An authenticated claim; `rest`: the bytes after it (the client's first link frames)."""
    role: int
    rank: int
    world: int
    session: str
    client_nonce: bytes
    rest: bytes


class Refusal(NamedTuple):
    """No claim, or a claim whose MAC does not check; `session`: the session a well-formed claim named
    (unverified), whose waiting members are told, else None."""
    why: str
    session: str | None


class Handshake:
    def __init__(self, secret: bytes):
        self.secret = secret
        self.hello, self.nonce = auth.hello()
        self.buf = bytearray()

    def feed(self, data: bytes) -> Claim | Refusal | None:
        before = len(self.buf)
        self.buf += data[:auth.CLAIM_MAX - before]  # never more than the largest claim
        if len(self.buf) < auth.CLAIM_PREFIX.size:
            return None
        total = auth.claim_length(bytes(self.buf[:auth.CLAIM_PREFIX.size]))
        if total is None:
            return Refusal("not a Tandem claim (bad magic, version or session length)", None)
        if len(self.buf) < total:
            return None
        raw_claim = bytes(self.buf[:total])
        claim = auth.verify_claim(self.secret, self.nonce, raw_claim)
        self.buf = bytearray()
        if claim is None:
            return Refusal("wrong MAC (secret mismatch) or invalid claim fields", claimed_session(raw_claim))
        return Claim(*claim, bytes(data[total - before:]))

    def accept(self, claim: Claim) -> bytes:
        """The answer admitting `claim`: OK and the relay's MAC over both nonces and the claim's fields."""
        mac = auth.relay_mac(self.secret, self.nonce, claim.client_nonce, claim.role, claim.rank, claim.world, claim.session.encode())
        return bytes([auth.OK]) + mac


def source_of(address: str) -> str:
    """The key a connection's unfinished handshakes are counted under: its IPv4 address, or its IPv6 /64
    (one IPv6 host usually owns a whole /64, so counting single addresses would bound nothing)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def claimed_session(claim: bytes) -> str | None:
    """The session id a whole claim names, unverified, or None when it is not a well-formed id."""
    n = claim[auth.CLAIM_PREFIX.size - 1]
    raw = claim[auth.CLAIM_PREFIX.size:auth.CLAIM_PREFIX.size + n]
    return raw.decode() if auth.SESSION_RE.fullmatch(raw) else None


def wrong_token_notice(host: str, session: str) -> str:
    """The notice for a claim whose MAC did not check: nothing in it is proven, so it says "claiming"."""
    return (f"a connection from {host} claiming session {session!r} was refused "
            "at the relay for a wrong token: check TANDEM_RELAY_TOKEN_FILE (or "
            "transport.relay_token_file) on that node; it must hold the relay's token")


def refusal_notice(host: str, claim: Claim, status: int, waiting_world: str) -> str:
    """The notice for an authenticated claim the relay refused: which node, and what it must change.
    `waiting_world` names the node count the waiting rendezvous agents gave."""
    why = {
        auth.TAKEN: f"node rank {claim.rank} is taken already (give each node its own --rdzv_conf node_rank, or none)",
        auth.MISMATCH: f"it gave --nnodes={claim.world}, the nodes waiting gave {waiting_world}",
        auth.FULL: "the relay is full (--max-connections); restart it with a larger one",
    }.get(status, STATUS_NAMES.get(status, f"status {status}"))
    return f"a node from {host} was refused at the relay for session {claim.session!r}: {why}"
