"""The relay server: one listening socket, the connections on it, and the parts that decide for them
(admission, sessions, rendezvous, stores, notices). It is each connection's Host (netbridge.relay.connection):
the connections ask, the parts decide, and the server tells the connections what was decided. The CLI that
runs it is netbridge.relay.cli."""
from __future__ import annotations

import asyncio
import logging
import secrets
import time

from netbridge import auth
from netbridge.link import HEADER, MAX_FRAME_BYTES, RDZV_BODY, RDZV_DONE
from netbridge.relay.admission import MAX_PENDING_PER_SOURCE, Admission
from netbridge.relay.connection import Connection, Limits
from netbridge.relay.handshake import ROLE_NAMES, STATUS_NAMES, Claim, Refusal, refusal_notice, wrong_token_notice
from netbridge.relay.notices import RefusalNotices
from netbridge.relay.refusals import LOG_INTERVAL_S, MAX_REFUSAL_DELAY_S, RefusalsBySource
from netbridge.relay.sessions import DataSessions, Rendezvous
from netbridge.relay.store import Stores, StoreProxy

log = logging.getLogger("tandem.relay")


class Relay:
    """The relay: owns the connections and the parts that decide for them; `start` listens, `close` ends
    every connection and store."""

    def __init__(self, secret: bytes, host: str = "0.0.0.0", port: int = 29400, *, max_frame_bytes: int = MAX_FRAME_BYTES,
                 handshake_timeout_s: float = 10.0, idle_timeout_s: float = 30.0, max_connections: int = 1024,
                 max_pending: int = 128, max_pending_per_source: int = MAX_PENDING_PER_SOURCE, emulate_delay_ms: float = 0.0,
                 emulate_mbps: float = 0.0, store: bool = True, max_refusal_delay_s: float = MAX_REFUSAL_DELAY_S,
                 refusal_log_interval_s: float = LOG_INTERVAL_S):
        if not secret:
            raise ValueError("the relay needs a non-empty secret")
        self.secret, self.host, self.port = secret, host, port
        self.limits = Limits(max_frame_bytes, handshake_timeout_s, idle_timeout_s, emulate_delay_ms, emulate_mbps)
        self.store_enabled = store
        self.counts = {"accepted": 0, "refused": 0, "dropped": 0, "sessions": 0, "bytes": 0}
        self.conns: set[Connection] = set()  # every connection that took a handshake slot, until it ends
        self.admission = Admission(max_connections, max_pending, max_pending_per_source)
        self.notices = RefusalNotices(self._waiting_members)
        self.refusals = RefusalsBySource(max_refusal_delay_s, refusal_log_interval_s)
        self.stores = Stores()
        self.sessions = DataSessions()
        self.rendezvous = Rendezvous()
        self._server = None
        self._sweeper = None

    @property
    def stats(self) -> dict[str, int]:
        """Every counter: this server's and the admission's (shed, turned_away)."""
        return {**self.counts, **self.admission.counts}

    @property
    def emulating(self) -> bool:
        return bool(self.limits.emulate_delay_ms or self.limits.emulate_mbps)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.store_enabled:
            import torch.distributed  # noqa: F401  - fail at start, not at the first rendezvous
        self._server = await loop.create_server(lambda: Connection(self, self.limits), self.host, self.port,
                                                reuse_address=True, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.create_task(self._sweep())

    async def close(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
        if self._server:
            self._server.close()
        for conn in list(self.conns):
            conn.drop(None)
        self.stores.close()
        self.refusals.summarize(time.monotonic())  # what the last interval refused is not lost

    async def _sweep(self) -> None:
        """The relay's only timer: handshake and idle timeouts, idle stores, the notices' tables, and the
        refusals' counts (logged once an interval)."""
        tick = max(0.05, min(1.0, self.limits.handshake_timeout_s / 4, self.limits.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for conn in list(self.conns):
                conn.check_timers(now)
            self.stores.sweep(now)
            self.notices.sweep(now)
            self.refusals.sweep(now)

    # ---- Host: what a connection asks ----------------------------------------------------------------
    def count(self, stat: str, n: int = 1) -> None:
        self.counts[stat] += n

    def make_room_for(self, conn: Connection) -> bool:
        shed = self.admission.make_room_for(conn)
        if shed is None:
            return False
        for victim in shed:
            victim.shed()
        self.conns.add(conn)
        return True

    def handshake_over(self, conn: Connection) -> None:
        self.admission.forget(conn)

    def claim(self, conn: Connection, claim: Claim) -> int:
        """Decide on an authenticated claim (counted while still pending against --max-connections), by role;
        a refusal is logged and told to the members of its session that wait."""
        full = self.admission.is_full(len(self.conns))
        conn.end_pending()
        status = auth.FULL if full else self._admit(conn)
        if status == auth.OK:
            self.counts["accepted"] += 1
            return status
        log.warning("%s: %s of %s refused: %s", conn.name, ROLE_NAMES.get(conn.role), conn.session, STATUS_NAMES.get(status))
        self.counts["refused"] += 1
        self.notices.refused_claim(conn.session, refusal_notice(conn.host_name, claim, status,
                                                                self.rendezvous.world_of(conn.session)))
        return status

    def _admit(self, conn: Connection) -> int:
        if conn.role == auth.ROLE_DATA:
            return self._admit_data(conn)
        if conn.role in (auth.ROLE_RDZV, auth.ROLE_STORE) and not self.store_enabled:
            return auth.NO_STORE
        if conn.role == auth.ROLE_RDZV:
            return self.rendezvous.admit(conn)
        if conn.role == auth.ROLE_STORE:
            return self.stores.admit(conn)
        return auth.REFUSED

    def joined(self, conn: Connection) -> None:
        """After OK went out: pair data ranks, complete rendezvous, connect store pipes."""
        if conn.role == auth.ROLE_DATA:
            self._join_data(conn)
        elif conn.role == auth.ROLE_RDZV:
            self._join_rendezvous(conn)
        elif conn.role == auth.ROLE_STORE:
            proxy = StoreProxy(conn)
            conn.pipe_to(proxy)  # bytes the client sends meanwhile wait for the pipe
            asyncio.ensure_future(proxy.open(self.stores.port_of(conn.session)))

    def left(self, conn: Connection) -> None:
        """A connection ended (any reason): free what it held."""
        self.conns.discard(conn)
        if conn.role == auth.ROLE_DATA:
            peer = self.sessions.leave(conn)
            if peer is not None:
                log.info("session %s: rank %d left, closing rank %d (they may re-dial and resume)", conn.session, conn.rank, peer.rank)
                conn.forward_end()
        elif conn.role == auth.ROLE_RDZV:
            self.rendezvous.leave(conn)
        elif conn.role == auth.ROLE_STORE and conn.counted_store:
            self.stores.leave(conn)

    def refused(self, conn: Connection, refusal: Refusal) -> float:
        """No claim, or one whose MAC does not check: counted for its source (logged at once, or in that
        source's count), and if it named a session, its waiting members are told. Returns how long the
        answer waits (netbridge.relay.refusals)."""
        self.counts["refused"] += 1
        if refusal.session is not None:
            self.notices.refused_claim(refusal.session, wrong_token_notice(conn.host_name, refusal.session))
        return self.refusals.refused(conn.source, conn.name, refusal.why, time.monotonic())

    # ---- the decisions, told to the connections ------------------------------------------------------
    def _admit_data(self, conn: Connection) -> int:
        """A rank of a session joins. If that rank's old connection is still here (its link died without the
        relay noticing yet), the newcomer replaces it: it proved the secret, and a rank that re-dials has
        given up the old link. The old one is dropped like any leaver, which ends its peer's connection too
        (PEER_LEFT), so both ranks re-dial and pair afresh and no stale byte crosses into the new pairing."""
        old = self.sessions.holder(conn.session, conn.rank)
        if old is not None:
            log.info("session %s: rank %d re-joined from %s; dropping its old connection %s", conn.session, conn.rank,
                     conn.name, old.name)
            old.drop(None)
        self.sessions.take(conn)
        return auth.OK

    def _join_data(self, conn: Connection) -> None:
        """Pair it with its peer if that one is here, else it waits (and hears of a recent refusal)."""
        other = self.sessions.partner(conn)
        if other is None:
            conn.wait_for_peer()
            self.notices.tell_recent_refusal(conn)
            return
        conn.pair_with(other)
        self.counts["sessions"] += 1
        log.info("session %s: ranks paired (%s, %s)", conn.session, *(c.name for c in sorted((conn, other), key=lambda c: c.rank)))

    def _join_rendezvous(self, conn: Connection) -> None:
        conn.enter_rendezvous()
        came, world = self.rendezvous.progress(conn.session)
        log.info("run %s: node %s from %s joined the rendezvous (%d of %d)", conn.session,
                 "any" if conn.rank == auth.ANY_RANK else conn.rank, conn.name, came, world)
        ranks = self.rendezvous.complete(conn.session)
        if ranks is None:
            self.notices.tell_recent_refusal(conn)
            return
        token = secrets.token_hex(8)
        try:
            self.stores.make(token)
            has_store = 1
        except Exception as e:  # noqa: BLE001 - reported to the agents, which fail with this reason
            log.error("run %s: cannot start its rendezvous store (%s)", conn.session, e)
            has_store = 0
        for member, rank in ranks:
            member.finish_rendezvous(HEADER.pack(RDZV_DONE, RDZV_BODY.size) + RDZV_BODY.pack(rank, world, token.encode(), has_store))
        log.info("run %s: rendezvous of %d nodes complete, store %s", conn.session, world, token)

    def _waiting_members(self, session: str) -> list[Connection]:
        return self.sessions.waiting(session) + self.rendezvous.waiting(session)
