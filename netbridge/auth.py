"""The relay handshake: a challenge-response with HMAC-SHA256 over the relay token, bound to the session.

The relay token (the relay's --secret-file; transport.relay_token_file on a node) only admits nodes; it is
not the nodes' pairing secret, which keys the end-to-end encryption (netbridge.secure) and which the relay
never holds. Below, "secret" means the relay token.

    relay  -> client   HELLO  = b"TNDR" | u8 version | 32-byte relay nonce
    client -> relay    CLAIM  = b"TNDC" | u8 version | u8 role | u8 rank | u8 world | u8 len | session
                                | 32-byte client nonce | 32-byte HMAC(secret, "client", both nonces, claim fields)
    relay  -> client   u8 status; OK is followed by HMAC(secret, "relay", both nonces, claim fields)

Two answers concern load, not the claim, and come to anyone: a relay whose table of unfinished
handshakes is full sheds the oldest (of the busiest source address) with the status byte SHED, sent
right after HELLO; a source address with too many unfinished handshakes gets BUSY = b"TNDB" | u8 version
| u8 SOURCE_LIMIT instead of HELLO, then the connection closes. dial() retries both until its timeout.

A client without the secret cannot produce the MAC, so it gets the single byte REFUSED whatever it
sent: it learns nothing about which sessions exist. The relay's answer proves to the client that the
relay knows the secret too. Every field has a fixed bound, so the relay reads at most CLAIM_MAX bytes
before it has decided. The handshake authenticates who joins; it does not encrypt or sign the frames
that follow (see docs/relay.md).

No torch here: the relay imports this module and must run on a tiny host.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import random
import re
import secrets
import socket
import struct
import time

VERSION = 1
HELLO_MAGIC, CLAIM_MAGIC, BUSY_MAGIC = b"TNDR", b"TNDC", b"TNDB"
NONCE_BYTES = MAC_BYTES = 32
HELLO_BYTES = 4 + 1 + NONCE_BYTES
CLAIM_PREFIX = struct.Struct("!4sBBBBB")  # magic, version, role, rank, world, session length
MAX_SESSION_BYTES = 128
CLAIM_MAX = CLAIM_PREFIX.size + MAX_SESSION_BYTES + NONCE_BYTES + MAC_BYTES
SESSION_RE = re.compile(rb"[A-Za-z0-9._:@/+=-]{1,128}")

# roles: a rank's data connection, a proxied connection to a rendezvous store, a torchrun agent joining
ROLE_DATA, ROLE_STORE, ROLE_RDZV = 1, 2, 3
# the dial-back (netbridge.backend): a process behind the NAT registering a service (session = its name), and the
# connection it dials back for one client of that service (session = the connection id the relay gave)
ROLE_SERVICE, ROLE_BACKEND = 4, 5
ANY_RANK = 255  # ROLE_RDZV: "give me any free node rank"

# statuses; everything but REFUSED, SHED and SOURCE_LIMIT is only ever sent to a client whose MAC was right
OK, REFUSED, TAKEN, FULL, MISMATCH, UNKNOWN, NO_STORE = 0, 1, 2, 3, 4, 5, 6
SHED = 7  # after HELLO: this unfinished handshake was dropped to admit a newer connection (the relay is flooded); retry
SOURCE_LIMIT = 8  # in BUSY, instead of HELLO: too many unfinished handshakes from this address (--max-pending-per-source)
RETRY_STATUSES = (SHED, SOURCE_LIMIT)  # load, not a verdict on the claim: dial() tries again until its timeout


class HandshakeError(RuntimeError):
    """The relay could not be reached or did not let us in; the message says what to check."""


RELAY_TOKEN = "relay token"  # admits a node at the relay; the relay has it too (its --secret-file)
PAIRING_SECRET = "pairing secret"  # authenticates the nodes' end-to-end key exchange; never given to the relay
_HOW_TO_SET = {
    RELAY_TOKEN: "set transport.relay_token_file=PATH (the file the relay was started with as --secret-file), "
                 "or the TANDEM_RELAY_TOKEN_FILE environment variable",
    PAIRING_SECRET: "set transport.secret_file=PATH (a secret only the two nodes hold, never the relay's token), "
                    "or the TANDEM_SECRET_FILE environment variable",
}
_MAKE_ONE = "create one with `python -c 'import secrets; print(secrets.token_hex(32))' > FILE`"


def load_secret(secret: str | None = None, secret_file: str | None = None, what: str = RELAY_TOKEN) -> bytes:
    """A secret (`what`: RELAY_TOKEN or PAIRING_SECRET) from a file (preferred) or a string; surrounding
    whitespace is stripped."""
    if secret_file:
        try:
            with open(os.path.expanduser(secret_file), "rb") as f:
                value = f.read(65536).strip()
        except OSError as e:
            raise HandshakeError(f"cannot read the {what} file {secret_file} ({e.strerror}); {_MAKE_ONE}") from None
        if not value:
            raise HandshakeError(f"the {what} file {secret_file} is empty")
        return value
    if secret:
        return secret.encode()
    raise HandshakeError(f"no {what}: {_HOW_TO_SET[what]}")


def check_session(session: str) -> bytes:
    raw = session.encode()
    if not SESSION_RE.fullmatch(raw):
        raise HandshakeError(f"session id {session!r} must be 1-{MAX_SESSION_BYTES} characters of A-Z a-z 0-9 . _ : @ / + = -")
    return raw


def _fields(relay_nonce: bytes, client_nonce: bytes, role: int, rank: int, world: int, session: bytes) -> bytes:
    return relay_nonce + client_nonce + bytes([role, rank, world, len(session)]) + session


def client_mac(secret: bytes, relay_nonce, client_nonce, role, rank, world, session: bytes) -> bytes:
    return hmac.new(secret, b"tandem-relay-v1 client|" + _fields(relay_nonce, client_nonce, role, rank, world, session), hashlib.sha256).digest()


def relay_mac(secret: bytes, relay_nonce, client_nonce, role, rank, world, session: bytes) -> bytes:
    return hmac.new(secret, b"tandem-relay-v1 relay|" + _fields(relay_nonce, client_nonce, role, rank, world, session), hashlib.sha256).digest()


def hello() -> tuple[bytes, bytes]:
    nonce = secrets.token_bytes(NONCE_BYTES)
    return HELLO_MAGIC + bytes([VERSION]) + nonce, nonce


def busy_greeting(status: int) -> bytes:
    """What the relay sends instead of HELLO when it will not start a handshake at all."""
    return BUSY_MAGIC + bytes([VERSION, status])


def claim_length(prefix: bytes) -> int | None:
    """Total claim length from its fixed prefix, or None when the prefix is not a claim we accept."""
    magic, version, _role, _rank, _world, n = CLAIM_PREFIX.unpack(prefix)
    if magic != CLAIM_MAGIC or version != VERSION or not 1 <= n <= MAX_SESSION_BYTES:
        return None
    return CLAIM_PREFIX.size + n + NONCE_BYTES + MAC_BYTES


def verify_claim(secret: bytes, relay_nonce: bytes, claim: bytes):
    """(role, rank, world, session, client_nonce) when the MAC is right and the fields are sane, else None."""
    _magic, _v, role, rank, world, n = CLAIM_PREFIX.unpack(claim[:CLAIM_PREFIX.size])
    session = claim[CLAIM_PREFIX.size:CLAIM_PREFIX.size + n]
    client_nonce = claim[CLAIM_PREFIX.size + n:CLAIM_PREFIX.size + n + NONCE_BYTES]
    mac = claim[CLAIM_PREFIX.size + n + NONCE_BYTES:]
    expected = client_mac(secret, relay_nonce, client_nonce, role, rank, world, session)
    if not hmac.compare_digest(mac, expected):
        return None
    if not SESSION_RE.fullmatch(session) or not _sane(role, rank, world):
        return None
    return role, rank, world, session.decode(), client_nonce


def _sane(role: int, rank: int, world: int) -> bool:
    if role == ROLE_DATA:
        return world == 2 and rank < 2
    if role in (ROLE_STORE, ROLE_SERVICE, ROLE_BACKEND):
        return rank == 0 and world == 0
    if role == ROLE_RDZV:
        return 1 <= world <= 254 and (rank < world or rank == ANY_RANK)
    return False


def parse_endpoint(endpoint: str, default_port: int = 29400) -> tuple[str, int]:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep:
        host, port = endpoint.strip(), str(default_port)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise HandshakeError(f"relay address {endpoint!r} is not HOST:PORT")
    return host, int(port)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def dial(endpoint: str, secret: bytes, session: str, role: int, rank: int, world: int, timeout_s: float,
         what: str = "", source_address: str | None = None) -> socket.socket:
    """Connect to the relay, prove we know the secret, check that the relay does too; return the socket.

    A relay under a flood of unauthenticated connections may shed our handshake or turn our address away
    for a moment; that is retried with backoff until `timeout_s` has passed. Raises HandshakeError
    naming the relay and what to check. `what` names the caller in messages; `source_address` is the
    local address to dial from (tests use 127.0.0.2 to be a second client host).
    """
    host, port = parse_endpoint(endpoint)
    raw_session = check_session(session)
    who = what or f"rank {rank} of session {session!r}"
    deadline = time.monotonic() + timeout_s
    backoff_s = 0.02
    while True:
        sock, status = _dial_once(host, port, secret, raw_session, role, rank, world, timeout_s, who, source_address)
        if sock is not None:
            return sock
        wait_s = backoff_s * (0.5 + random.random())  # jitter: clients shed together must not come back together
        if status not in RETRY_STATUSES or time.monotonic() + wait_s >= deadline:
            raise HandshakeError(_refusal(status, host, port, who, session))
        time.sleep(wait_s)
        backoff_s = min(1.0, backoff_s * 2)
        timeout_s = max(0.05, deadline - time.monotonic())


def _dial_once(host: str, port: int, secret: bytes, raw_session: bytes, role: int, rank: int, world: int,
               timeout_s: float, who: str, source_address: str | None) -> tuple[socket.socket | None, int | None]:
    """One connection and handshake: (socket, None) when admitted, (None, status) when refused."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s,
                                        source_address=(source_address, 0) if source_address else None)
    except OSError as e:
        reason = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        raise HandshakeError(f"cannot reach the relay at {host}:{port} ({reason}); is `tandem-relay` running there, "
                             "and can this host open outgoing connections to that port?") from None
    try:
        tune(sock)
        hello_bytes = _recv_exact(sock, HELLO_BYTES)
        busy = _busy_status(hello_bytes)
        if busy is not None:
            sock.close()
            return None, busy
        if not hello_bytes:
            raise HandshakeError(f"{host}:{port} closed the connection before greeting {who}: a relay of an older Tandem "
                                 "version does that when it is at a connection limit; check the relay's log")
        if len(hello_bytes) != HELLO_BYTES or hello_bytes[:4] != HELLO_MAGIC or hello_bytes[4] != VERSION:
            raise HandshakeError(f"{host}:{port} did not greet like a Tandem relay (version {VERSION}); "
                                 "is that address the relay, and is it the same Tandem version?")
        relay_nonce, client_nonce = hello_bytes[5:], secrets.token_bytes(NONCE_BYTES)
        mac = client_mac(secret, relay_nonce, client_nonce, role, rank, world, raw_session)
        sock.sendall(CLAIM_PREFIX.pack(CLAIM_MAGIC, VERSION, role, rank, world, len(raw_session)) + raw_session + client_nonce + mac)
        status = _recv_exact(sock, 1)
        if status == bytes([OK]):
            proof = _recv_exact(sock, MAC_BYTES)
            if not hmac.compare_digest(proof, relay_mac(secret, relay_nonce, client_nonce, role, rank, world, raw_session)):
                raise HandshakeError(f"the server at {host}:{port} does not know our relay token: it is not our relay, "
                                     "or it was started with another --secret-file")
            return sock, None
        sock.close()
        return None, status[0] if status else None
    except OSError as e:
        sock.close()
        raise HandshakeError(f"the relay at {host}:{port} dropped the handshake of {who} ({e.strerror or type(e).__name__}); "
                             "check the relay's log") from None
    except HandshakeError:
        sock.close()
        raise


def _busy_status(greeting: bytes) -> int | None:
    """The status of a BUSY greeting (the relay would not start a handshake), else None."""
    if len(greeting) == len(BUSY_MAGIC) + 2 and greeting[:4] == BUSY_MAGIC and greeting[4] == VERSION:
        return greeting[5]
    return None


def _refusal(status: int | None, host: str, port: int, who: str, session: str) -> str:
    at = f"the relay at {host}:{port}"
    return {
        None: f"{at} closed the connection during the handshake of {who} without an answer; check its log (it drops "
              "handshakes that take longer than its --handshake-timeout-s)",
        REFUSED: f"{at} refused {who}: the relay token does not match. transport.relay_token_file (or "
                 "TANDEM_RELAY_TOKEN_FILE) must hold the same token as the relay's --secret-file",
        TAKEN: f"{at} already has {who} connected: another job uses the same session id (transport.session / "
               "torchrun --rdzv_id) or an earlier run of this rank is still alive",
        FULL: f"{at} is full: it already serves its --max-connections authenticated connections, so it cannot admit "
              f"{who}; try again when other runs have ended, or restart the relay with a larger --max-connections",
        SHED: f"{at} is flooded with unfinished handshakes (its --max-pending table stayed full) and kept shedding the "
              f"handshake of {who} until the timeout; check its log, and rate-limit new connections in front of it "
              "(e.g. iptables hashlimit)",
        SOURCE_LIMIT: f"{at} turned away {who}: this address already has --max-pending-per-source unfinished handshakes "
                      "at the relay, until the timeout. If many nodes share one public (NAT) address, raise that limit on "
                      "the relay; otherwise something on this network is flooding it (check the relay's log)",
        MISMATCH: f"{at}: another node joined session {session!r} with a different number of nodes (--nnodes)",
        UNKNOWN: f"{at} knows no {session!r} for {who}: a rendezvous store whose node 0 is gone, or a dial-back that "
                 "came too late; restart the torchruns",
        NO_STORE: f"{at} is an older Tandem relay that refuses rendezvous without its own store; restart it without "
                  "--no-store, or upgrade it",
    }.get(status, f"{at} answered the handshake of {who} with unknown status {status}; is it the same Tandem version?")


def tune(sock: socket.socket) -> None:
    """Low latency, and keepalive so a dead NAT mapping is noticed by the kernel too."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
