"""Sessions: who waits for whom. Data sessions pair rank 0 and rank 1 of one session id; rendezvous groups
gather the torchrun agents of one run until all have come.

A member waits (state "waiting" or "rdzv") until its session is complete; while it waits it hears of
refused claims for its session (notices). The relay keeps no other session state: when a data member
leaves, its peer's connection ends too, and both ranks re-dial and pair afresh (resume) under a session
id that is free at once.
"""
from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

from netbridge import auth
from netbridge.link import HEADER, PAIRED, RDZV_BODY, RDZV_DONE
from netbridge.relay.notices import RefusalNotices

if TYPE_CHECKING:
    from netbridge.relay.connection import Connection
    from netbridge.relay.store import Stores

log = logging.getLogger("tandem.relay")


def _still_open(conns) -> list[Connection]:
    return [c for c in conns if c.transport is not None and not c.transport.is_closing()]


class DataSessions:
    """The data sessions by id, each two slots (rank 0, rank 1); when both are filled the two connections
    are each other's peer and the relay forwards between them (Connection)."""

    def __init__(self, notices: RefusalNotices, stats: dict):
        self.slots: dict[str, list] = {}  # session -> [rank 0's connection | None, rank 1's | None]
        self.notices = notices
        self.stats = stats

    def admit(self, conn: Connection) -> int:
        """A rank of a session joins. If that rank's old connection is still here (its link died without the
        relay noticing yet), the newcomer replaces it: it proved the secret, and a rank that re-dials has
        given up the old link. The old one is dropped like any leaver, which ends its peer's connection too
        (PEER_LEFT), so both ranks re-dial and pair afresh and no stale byte crosses into the new pairing."""
        old = self.slots.get(conn.session, [None, None])[conn.rank]
        if old is not None:
            log.info("session %s: rank %d re-joined from %s; dropping its old connection %s", conn.session, conn.rank,
                     conn.name, old.name)
            old.drop(None)
        self.slots.setdefault(conn.session, [None, None])[conn.rank] = conn
        return auth.OK

    def join(self, conn: Connection) -> None:
        """After OK went out: pair it with its peer if that one is here, else it waits."""
        slots = self.slots[conn.session]
        other = slots[1 - conn.rank]
        if other is not None:
            conn.peer, other.peer = other, conn
            for c in (other, conn):
                c.state = "paired"
                c.transport.write(HEADER.pack(PAIRED, 0))
            self.stats["sessions"] += 1
            log.info("session %s: ranks paired (%s, %s)", conn.session, slots[0].name, slots[1].name)
        else:
            conn.state = "waiting"
            self.notices.tell_recent_refusal(conn)

    def leave(self, conn: Connection) -> None:
        """A connection ended (any reason): free its slot, and end the peer's connection too (PEER_LEFT at a
        frame boundary), so that both re-dial and pair afresh."""
        slots = self.slots.get(conn.session)
        if slots is None or slots[conn.rank] is not conn:
            return
        slots[conn.rank] = None
        peer = conn.peer
        if peer is not None and slots[peer.rank] is peer:
            slots[peer.rank] = None
        if slots == [None, None]:
            del self.slots[conn.session]
        if peer is not None:
            log.info("session %s: rank %d left, closing rank %d (they may re-dial and resume)", conn.session, conn.rank, peer.rank)
            conn.forward_end()

    def waiting(self, session: str) -> list[Connection]:
        return _still_open(c for c in self.slots.get(session, ()) if c is not None and c.state == "waiting")


class _Group:
    def __init__(self, world: int):
        self.world = world
        self.members: list[Connection] = []


class Rendezvous:
    """The torchrun agents of each run, gathered until --nnodes have come; then each gets its node rank and
    the token of a fresh store (Stores), and its connection closes."""

    def __init__(self, stores: Stores, notices: RefusalNotices):
        self.groups: dict[str, _Group] = {}  # run id -> the agents that came so far
        self.stores = stores
        self.notices = notices

    def admit(self, conn: Connection) -> int:
        group = self.groups.setdefault(conn.session, _Group(conn.world))
        if group.world != conn.world:
            return auth.MISMATCH
        if conn.rank != auth.ANY_RANK and any(m.rank == conn.rank for m in group.members):
            return auth.TAKEN
        group.members.append(conn)
        return auth.OK

    def join(self, conn: Connection) -> None:
        conn.state = "rdzv"
        group = self.groups[conn.session]
        log.info("run %s: node %s from %s joined the rendezvous (%d of %d)", conn.session,
                 "any" if conn.rank == auth.ANY_RANK else conn.rank, conn.name, len(group.members), group.world)
        if len(group.members) == group.world:
            self._complete(conn.session, group)
        else:
            self.notices.tell_recent_refusal(conn)

    def _complete(self, run_id: str, group: _Group) -> None:
        """Give each agent its node rank (the one it asked for, else a free one) and the new store's token."""
        del self.groups[run_id]
        taken = {m.rank for m in group.members if m.rank != auth.ANY_RANK}
        free = iter(r for r in range(group.world) if r not in taken)
        token = secrets.token_hex(8)
        try:
            self.stores.make(token)
            has_store = 1
        except Exception as e:  # noqa: BLE001 - reported to the agents, which fail with this reason
            log.error("run %s: cannot start its rendezvous store (%s)", run_id, e)
            has_store = 0
        for m in group.members:
            rank = m.rank if m.rank != auth.ANY_RANK else next(free)
            m.state = "done"
            m.transport.write(HEADER.pack(RDZV_DONE, RDZV_BODY.size) + RDZV_BODY.pack(rank, group.world, token.encode(), has_store))
            m.close_soon()
        log.info("run %s: rendezvous of %d nodes complete, store %s", run_id, group.world, token)

    def leave(self, conn: Connection) -> None:
        group = self.groups.get(conn.session)
        if group is not None and conn in group.members:
            group.members.remove(conn)
            if not group.members:
                del self.groups[conn.session]

    def waiting(self, session: str) -> list[Connection]:
        group = self.groups.get(session)
        return _still_open(c for c in group.members if c.state == "rdzv") if group is not None else []

    def world_of(self, session: str) -> str:
        """The node count the agents waiting in `session` gave, for a refusal notice."""
        group = self.groups.get(session)
        return f"--nnodes={group.world}" if group is not None else "another"
