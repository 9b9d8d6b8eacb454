"""Sessions, as bookkeeping: who waits for whom. Data sessions pair rank 0 and rank 1 of one session id;
rendezvous groups gather the torchrun agents of one run until all have come.

A member waits (state "waiting" or "rdzv") until its session is complete; while it waits it hears of
refused claims for its session (notices). The relay keeps no other session state: when a data member
leaves, its peer's connection ends too, and both ranks re-dial and pair afresh (resume) under a session
id that is free at once.

The members are the server's connections, read here (.session, .rank, .world, .state, .is_open()) and
never written: each call returns what the server is to do with them.
"""
from __future__ import annotations

from typing import Any

from netbridge import auth

Member = Any  # a connection of the relay


def _still_open(conns) -> list[Member]:
    return [c for c in conns if c.is_open()]


class DataSessions:
    """The data sessions by id, each two slots (rank 0, rank 1)."""

    def __init__(self):
        self.slots: dict[str, list] = {}  # session -> [rank 0's connection | None, rank 1's | None]

    def holder(self, session: str, rank: int) -> Member | None:
        """Who holds `rank` of `session` now (a rank that re-dials may find its old connection still there)."""
        return self.slots.get(session, [None, None])[rank]

    def take(self, conn: Member) -> None:
        self.slots.setdefault(conn.session, [None, None])[conn.rank] = conn

    def partner(self, conn: Member) -> Member | None:
        """The other rank of `conn`'s session, if it is here: the two are to be paired."""
        return self.slots[conn.session][1 - conn.rank]

    def leave(self, conn: Member) -> Member | None:
        """A connection ended (any reason): free its slot and its peer's. Returns the peer, whose connection
        is to end too (so that both re-dial and pair afresh), or None."""
        slots = self.slots.get(conn.session)
        if slots is None or slots[conn.rank] is not conn:
            return None
        slots[conn.rank] = None
        peer = conn.peer
        if peer is not None and slots[peer.rank] is peer:
            slots[peer.rank] = None
        if slots == [None, None]:
            del self.slots[conn.session]
        return peer

    def waiting(self, session: str) -> list[Member]:
        return _still_open(c for c in self.slots.get(session, ()) if c is not None and c.state == "waiting")


class _Group:
    def __init__(self, world: int):
        self.world = world
        self.members: list[Member] = []


class Rendezvous:
    """The torchrun agents of each run, gathered until --nnodes have come."""

    def __init__(self):
        self.groups: dict[str, _Group] = {}  # run id -> the agents that came so far

    def admit(self, conn: Member) -> int:
        group = self.groups.setdefault(conn.session, _Group(conn.world))
        if group.world != conn.world:
            return auth.MISMATCH
        if conn.rank != auth.ANY_RANK and any(m.rank == conn.rank for m in group.members):
            return auth.TAKEN
        group.members.append(conn)
        return auth.OK

    def progress(self, session: str) -> tuple[int, int]:
        """(agents come, --nnodes) of a run still gathering."""
        group = self.groups[session]
        return len(group.members), group.world

    def complete(self, session: str) -> list[tuple[Member, int]] | None:
        """When every agent of the run has come: each with its node rank (the one it asked for, else a free one),
        and the run's group is gone; else None."""
        group = self.groups[session]
        if len(group.members) < group.world:
            return None
        del self.groups[session]
        taken = {m.rank for m in group.members if m.rank != auth.ANY_RANK}
        free = iter(r for r in range(group.world) if r not in taken)
        return [(m, m.rank if m.rank != auth.ANY_RANK else next(free)) for m in group.members]

    def leave(self, conn: Member) -> None:
        group = self.groups.get(conn.session)
        if group is not None and conn in group.members:
            group.members.remove(conn)
            if not group.members:
                del self.groups[conn.session]

    def waiting(self, session: str) -> list[Member]:
        group = self.groups.get(session)
        return _still_open(c for c in group.members if c.state == "rdzv") if group is not None else []

    def world_of(self, session: str) -> str:
        """The node count the agents waiting in `session` gave, for a refusal notice."""
        group = self.groups.get(session)
        return f"--nnodes={group.world}" if group is not None else "another"
