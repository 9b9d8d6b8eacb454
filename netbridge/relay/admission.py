"""Admission, as decisions: who may start a handshake, and whether an authenticated client fits.

The relay is public and an unauthenticated connection costs a stranger nothing, so the connections still
in the handshake are bounded in total (--max-pending) and per source address (--max-pending-per-source).
A full table sheds the oldest unfinished handshake of the busiest source instead of turning the newcomer
away: idle sockets can delay an honest client by one retry, never lock it out. Authenticated connections
are bounded apart (--max-connections), and one more is answered FULL.

The table holds connections as opaque keys (read for .source, .born and .name only); making room returns
the connections to shed, and the server tells them.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

log = logging.getLogger("tandem.relay")

MAX_PENDING_PER_SOURCE = 16  # default --max-pending-per-source: unfinished handshakes from one address at once
# An honest handshake is done one round trip after connecting; an unfinished one this old is stale and
# gives its slot to a newcomer from the same address (a flooder behind your NAT cannot lock you out)
STALE_HANDSHAKE_S = 1.0

Pending = Any  # a connection in the handshake


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

    def oldest_of(self, source: str) -> Pending:
        return next(iter(self.by_source[source]))

    def add(self, conn: Pending) -> None:
        self.by_source.setdefault(conn.source, OrderedDict())[conn] = None
        self.count += 1

    def remove(self, conn: Pending) -> None:
        conns = self.by_source.get(conn.source)
        if conns is None or conn not in conns:
            return
        del conns[conn]
        self.count -= 1
        if not conns:
            del self.by_source[conn.source]  # keeps memory bounded by the number of pending connections

    def victim(self) -> Pending | None:
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

    def __init__(self, max_connections: int, max_pending: int, max_pending_per_source: int):
        self.max_connections = max_connections
        self.handshakes = PendingHandshakes(max_pending, max_pending_per_source)
        self.counts = {"shed": 0, "turned_away": 0}
        self.shed_log, self.turned_away_log = RareLog(), RareLog()

    def make_room_for(self, conn: Pending) -> list[Pending] | None:
        """Take `conn` into the handshake table and return the connections to shed for it (out of the table
        already), or None when its source already has --max-pending-per-source handshakes open, all younger
        than STALE_HANDSHAKE_S (a burst: turned away without taking a slot).

        A full table, or a source at its bound whose oldest handshake is stale, sheds one (see
        PendingHandshakes.victim) instead of turning the newcomer away, so idle sockets can delay an
        honest client by a retry, not lock it out."""
        hs, shed = self.handshakes, []
        if hs.source_is_full(conn.source):
            oldest = hs.oldest_of(conn.source)
            if time.monotonic() - oldest.born < STALE_HANDSHAKE_S:
                self._turned_away(conn)
                return None
            shed.append(self._shed(oldest, f"{conn.source} has --max-pending-per-source ({hs.per_source}) handshakes open"))
        if len(hs) >= hs.limit:
            shed.append(self._shed(hs.victim(), f"--max-pending ({hs.limit}) handshakes are open"))
        hs.add(conn)
        return shed

    def forget(self, conn: Pending) -> None:
        """`conn` left the handshake table (answered, refused, shed or gone)."""
        self.handshakes.remove(conn)

    def is_full(self, open_connections: int) -> bool:
        """True when --max-connections authenticated connections are open (the handshake table is apart)."""
        return open_connections - len(self.handshakes) >= self.max_connections

    def _shed(self, conn: Pending, why: str) -> Pending:
        self.counts["shed"] += 1
        self.shed_log.warning("%s: unfinished handshake shed after %.1f s to admit a newer connection: %s; "
                              "a flood of unauthenticated connections?", conn.name, time.monotonic() - conn.born, why)
        self.handshakes.remove(conn)
        return conn

    def _turned_away(self, conn: Pending) -> None:
        self.counts["turned_away"] += 1
        self.turned_away_log.warning("%s: turned away: %d unfinished handshakes from %s already (--max-pending-per-source)",
                                     conn.name, self.handshakes.per_source, conn.source)
