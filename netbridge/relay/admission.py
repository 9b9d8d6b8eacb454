"""Admission: who may start a handshake, the handshake itself, and whether an authenticated client fits.

The relay is public and an unauthenticated connection costs a stranger nothing, so the connections still
in the handshake are bounded in total (--max-pending) and per source address (--max-pending-per-source).
A full table sheds the oldest unfinished handshake of the busiest source instead of turning the newcomer
away: idle sockets can delay an honest client by one retry, never lock it out. Authenticated connections
are bounded apart (--max-connections), and one more is answered FULL.
"""
from __future__ import annotations

import ipaddress
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from netbridge import auth

if TYPE_CHECKING:
    from netbridge.relay.connection import Connection
    from netbridge.relay.server import Relay

log = logging.getLogger("tandem.relay")

MAX_PENDING_PER_SOURCE = 16  # default --max-pending-per-source: unfinished handshakes from one address at once
# An honest handshake is done one round trip after connecting; an unfinished one this old is stale and
# gives its slot to a newcomer from the same address (a flooder behind your NAT cannot lock you out)
STALE_HANDSHAKE_S = 1.0

ROLE_NAMES = {auth.ROLE_DATA: "data", auth.ROLE_STORE: "store", auth.ROLE_RDZV: "rendezvous"}
STATUS_NAMES = {auth.TAKEN: "slot already taken", auth.FULL: "relay full (--max-connections authenticated connections open)",
                auth.MISMATCH: "node count differs", auth.UNKNOWN: "unknown store", auth.NO_STORE: "store disabled (--no-store)",
                auth.REFUSED: "refused"}


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


class Handshake:
    """One connection's handshake, the challenge-response of netbridge.auth: the hello carrying the relay's
    nonce; the client's claim, collected (never more than the largest claim) and checked against the relay
    token; then the relay's answer: OK with the relay's own MAC (so the client knows it reached a relay that
    holds the token), or a status, with a notice to the session the claim named."""

    def __init__(self, conn: Connection, relay: Relay):
        self.conn, self.relay = conn, relay
        self.hello, self.nonce = auth.hello()
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        conn = self.conn
        before = len(self.buf)
        self.buf += data[:auth.CLAIM_MAX - before]  # never more than the largest claim
        if len(self.buf) < auth.CLAIM_PREFIX.size:
            return
        total = auth.claim_length(bytes(self.buf[:auth.CLAIM_PREFIX.size]))
        if total is None:
            return self._refuse("not a Tandem claim (bad magic, version or session length)")
        if len(self.buf) < total:
            return
        rest = data[total - before:]  # bytes after the claim: the client's first link frames
        raw_claim = bytes(self.buf[:total])
        claim = auth.verify_claim(self.relay.secret, self.nonce, raw_claim)
        self.buf = bytearray()
        if claim is None:
            self._refuse("wrong MAC (secret mismatch) or invalid claim fields")
            session = claimed_session(raw_claim)  # if well-formed, that session's waiting members are told
            if session is not None:
                self.relay.notices.refused_claim(session, wrong_token_notice(conn.host, session))
            return
        conn.role, conn.rank, conn.world, conn.session, client_nonce = claim
        if self._answer(client_nonce) and rest:
            conn.data_received(bytes(rest))

    def _refuse(self, why: str) -> None:
        """No claim, or one whose MAC does not check: REFUSED, and the connection closes."""
        conn = self.conn
        log.warning("%s: handshake refused: %s", conn.name, why)
        self.relay.stats["refused"] += 1
        conn.end_pending()
        conn.state = "closed"
        conn.transport.write(bytes([auth.REFUSED]))
        conn.close_soon()

    def _answer(self, client_nonce: bytes) -> bool:
        """Admit the authenticated claim or refuse it; True when admitted."""
        conn, relay = self.conn, self.relay
        full = relay.admission.is_full(len(relay.conns))  # counted while this one is still pending
        conn.end_pending()
        status = auth.FULL if full else relay.admit(conn)
        if status != auth.OK:
            log.warning("%s: %s of %s refused: %s", conn.name, ROLE_NAMES.get(conn.role), conn.session, STATUS_NAMES.get(status))
            relay.stats["refused"] += 1
            conn.state = "closed"
            conn.transport.write(bytes([status]))
            conn.close_soon()
            relay.notices.refused_claim(conn.session, refusal_notice(conn, status, relay.rendezvous.world_of(conn.session)))
            return False
        conn.counted_store = conn.role == auth.ROLE_STORE
        relay.stats["accepted"] += 1
        mac = auth.relay_mac(relay.secret, self.nonce, client_nonce, conn.role, conn.rank, conn.world, conn.session.encode())
        conn.transport.write(bytes([auth.OK]) + mac)
        relay.joined(conn)
        return True


def wrong_token_notice(host: str, session: str) -> str:
    """The notice for a claim whose MAC did not check: nothing in it is proven, so it says "claiming"."""
    return (f"a connection from {host} claiming session {session!r} was refused "
            "at the relay for a wrong token: check TANDEM_RELAY_TOKEN_FILE (or "
            "transport.relay_token_file) on that node; it must hold the relay's token")


def refusal_notice(conn: Connection, status: int, waiting_world: str) -> str:
    """The notice for an authenticated claim the relay refused: which node, and what it must change.
    `waiting_world` names the node count the waiting rendezvous agents gave."""
    why = {
        auth.TAKEN: f"node rank {conn.rank} is taken already (give each node its own --rdzv_conf node_rank, or none)",
        auth.MISMATCH: f"it gave --nnodes={conn.world}, the nodes waiting gave {waiting_world}",
        auth.FULL: "the relay is full (--max-connections); restart it with a larger one",
    }.get(status, STATUS_NAMES.get(status, f"status {status}"))
    return f"a node from {conn.host} was refused at the relay for session {conn.session!r}: {why}"


class PendingHandshakes:
    """The connections still in the handshake, by source and by age, so that making room is O(sources).

    Age is the signal a flood cannot fake: an honest client finishes its handshake one round trip after
    connecting, so the oldest unfinished handshake is the least likely to be honest. Having sent a few
    bytes proves nothing (a flooder can send one byte), so silent and talking connections are ranked alike.
    """

    def __init__(self, limit: int, per_source: int):
        self.limit, self.per_source = max(1, limit), max(1, per_source)
        self.by_source: dict[str, OrderedDict] = {}  # source -> its connections, oldest first
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def source_is_full(self, source: str) -> bool:
        return len(self.by_source.get(source, ())) >= self.per_source

    def oldest_of(self, source: str) -> Connection:
        return next(iter(self.by_source[source]))

    def add(self, conn: Connection) -> None:
        self.by_source.setdefault(conn.source, OrderedDict())[conn] = None
        self.count += 1

    def remove(self, conn: Connection) -> None:
        conns = self.by_source.get(conn.source)
        if conns is None or conn not in conns:
            return
        del conns[conn]
        self.count -= 1
        if not conns:
            del self.by_source[conn.source]  # keeps memory bounded by the number of pending connections

    def victim(self) -> Connection | None:
        """Whom to shed for a newcomer: the oldest connection of the source holding the most slots, so a
        flood from a few addresses sheds its own connections before a lone client's."""
        busiest = max(self.by_source.values(), key=lambda conns: (len(conns), -next(iter(conns)).born), default=None)
        return next(iter(busiest)) if busiest else None


class RareLog:
    """At most one log line per interval for one kind of event, counting the ones left out: a flood of
    connections must not become a flood of log lines."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.next_at = 0.0
        self.left_out = 0

    def warning(self, msg: str, *args) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.left_out += 1
            return
        if self.left_out:
            msg, args = msg + " (and %d more like it since the last such line)", (*args, self.left_out)
        log.warning(msg, *args)
        self.left_out, self.next_at = 0, now + self.interval_s


class Admission:
    """The relay's door: the table of unfinished handshakes, and the bound on authenticated connections."""

    def __init__(self, max_connections: int, max_pending: int, max_pending_per_source: int, stats: dict):
        self.max_connections = max_connections
        self.handshakes = PendingHandshakes(max_pending, max_pending_per_source)
        self.stats = stats  # the relay's counters
        self.shed_log, self.turned_away_log = RareLog(), RareLog()

    def make_room_for(self, conn: Connection) -> bool:
        """Take `conn` into the handshake table; False when its source already has --max-pending-per-source
        handshakes open, all younger than STALE_HANDSHAKE_S (a burst: turned away without taking a slot).

        A full table, or a source at its bound whose oldest handshake is stale, sheds one (see
        PendingHandshakes.victim) instead of turning the newcomer away, so idle sockets can delay an
        honest client by a retry, not lock it out."""
        hs = self.handshakes
        if hs.source_is_full(conn.source):
            oldest = hs.oldest_of(conn.source)
            if time.monotonic() - oldest.born < STALE_HANDSHAKE_S:
                self._turned_away(conn)
                return False
            self._shed(oldest, f"{conn.source} has --max-pending-per-source ({hs.per_source}) handshakes open")
        if len(hs) >= hs.limit:
            self._shed(hs.victim(), f"--max-pending ({hs.limit}) handshakes are open")
        hs.add(conn)
        return True

    def is_full(self, open_connections: int) -> bool:
        """True when --max-connections authenticated connections are open (the handshake table is apart)."""
        return open_connections - len(self.handshakes) >= self.max_connections

    def _shed(self, conn: Connection, why: str) -> None:
        self.stats["shed"] += 1
        self.shed_log.warning("%s: unfinished handshake shed after %.1f s to admit a newer connection: %s; "
                              "a flood of unauthenticated connections?", conn.name, time.monotonic() - conn.born, why)
        conn.shed()

    def _turned_away(self, conn: Connection) -> None:
        self.stats["turned_away"] += 1
        self.turned_away_log.warning("%s: turned away: %d unfinished handshakes from %s already (--max-pending-per-source)",
                                     conn.name, self.handshakes.per_source, conn.source)
