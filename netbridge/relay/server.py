"""The relay server: one listening socket, the connections on it, and the parts that decide for them
(admission, sessions, rendezvous, stores, notices). The CLI that runs it is netbridge.relay.cli."""
from __future__ import annotations

import asyncio
import time

from netbridge import auth
from netbridge.link import MAX_FRAME_BYTES
from netbridge.relay.admission import MAX_PENDING_PER_SOURCE, Admission
from netbridge.relay.connection import Connection
from netbridge.relay.notices import RefusalNotices
from netbridge.relay.sessions import DataSessions, Rendezvous
from netbridge.relay.store import Stores


class Relay:
    """The relay: owns the connections and the parts that decide for them; `start` listens, `close` ends
    every connection and store."""

    def __init__(self, secret: bytes, host: str = "0.0.0.0", port: int = 29400, *, max_frame_bytes: int = MAX_FRAME_BYTES,
                 handshake_timeout_s: float = 10.0, idle_timeout_s: float = 30.0, max_connections: int = 1024,
                 max_pending: int = 128, max_pending_per_source: int = MAX_PENDING_PER_SOURCE, emulate_delay_ms: float = 0.0,
                 emulate_mbps: float = 0.0, store: bool = True):
        if not secret:
            raise ValueError("the relay needs a non-empty secret")
        self.secret, self.host, self.port = secret, host, port
        self.max_frame_bytes = max_frame_bytes
        self.handshake_timeout_s, self.idle_timeout_s = handshake_timeout_s, idle_timeout_s
        self.delay_s = emulate_delay_ms / 1000  # EMULATION (netbridge.relay.emulation)
        self.bytes_per_s = emulate_mbps * 1e6 / 8
        self.store_enabled = store
        self.stats = {"accepted": 0, "refused": 0, "dropped": 0, "sessions": 0, "bytes": 0, "shed": 0, "turned_away": 0}
        self.conns: set[Connection] = set()  # every connection that took a handshake slot, until it ends
        self.admission = Admission(max_connections, max_pending, max_pending_per_source, self.stats)
        self.notices = RefusalNotices(self._waiting_members)
        self.stores = Stores()
        self.sessions = DataSessions(self.notices, self.stats)
        self.rendezvous = Rendezvous(self.stores, self.notices)
        self._server = None
        self._sweeper = None

    @property
    def emulating(self) -> bool:
        return bool(self.delay_s or self.bytes_per_s)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.store_enabled:
            import torch.distributed  # noqa: F401  - fail at start, not at the first rendezvous
        self._server = await loop.create_server(lambda: Connection(self), self.host, self.port, reuse_address=True, backlog=1024)
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

    async def _sweep(self) -> None:
        """The relay's only timer: handshake and idle timeouts, idle stores, and the notices' tables."""
        tick = max(0.05, min(1.0, self.handshake_timeout_s / 4, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for conn in list(self.conns):
                conn.check_timers(now)
            self.stores.sweep(now)
            self.notices.sweep(now)

    # ---- an authenticated connection's claim, by role ------------------------------------------------
    def admit(self, conn: Connection) -> int:
        """Decide on an authenticated claim; returns a status from netbridge.auth."""
        if conn.role == auth.ROLE_DATA:
            return self.sessions.admit(conn)
        if conn.role in (auth.ROLE_RDZV, auth.ROLE_STORE) and not self.store_enabled:
            return auth.NO_STORE
        if conn.role == auth.ROLE_RDZV:
            return self.rendezvous.admit(conn)
        if conn.role == auth.ROLE_STORE:
            return self.stores.admit(conn)
        return auth.REFUSED

    def joined(self, conn: Connection) -> None:
        """Called after OK went out: pair data ranks, complete rendezvous, connect store pipes."""
        if conn.role == auth.ROLE_DATA:
            self.sessions.join(conn)
        elif conn.role == auth.ROLE_RDZV:
            self.rendezvous.join(conn)
        elif conn.role == auth.ROLE_STORE:
            self.stores.join(conn)

    def left(self, conn: Connection) -> None:
        """A connection ended (any reason): free what it held."""
        if conn.role == auth.ROLE_DATA:
            self.sessions.leave(conn)
        elif conn.role == auth.ROLE_RDZV:
            self.rendezvous.leave(conn)
        elif conn.role == auth.ROLE_STORE and conn.counted_store:
            self.stores.leave(conn)

    def _waiting_members(self, session: str) -> list[Connection]:
        return self.sessions.waiting(session) + self.rendezvous.waiting(session)
