"""The relay server: the listening socket (and --api-port's), the connections on them, and the parts that decide
for them (admission, sessions, rendezvous, services, notices). It is each connection's Host
(netbridge.relay.connection): the connections ask, the parts decide, and the server tells the connections what
was decided. The CLI that runs it is netbridge.relay.cli. No torch: the rendezvous store lives on node 0's agent."""
from __future__ import annotations

import asyncio
import logging
import secrets
import time

from netbridge import auth
from netbridge.link import HEADER, MAX_FRAME_BYTES, RDZV_BODY, RDZV_DONE, STORE_AT_NODE0
from netbridge.relay.admission import MAX_PENDING_PER_SOURCE, Admission, RareLog
from netbridge.relay.connection import ApiClient, Connection, Limits
from netbridge.relay.handshake import ROLE_NAMES, STATUS_NAMES, Claim, Refusal, refusal_notice, wrong_token_notice
from netbridge.relay.notices import RefusalNotices
from netbridge.relay.refusals import LOG_INTERVAL_S, MAX_REFUSAL_DELAY_S, RefusalsBySource
from netbridge.relay.services import DIAL_BACK_TIMEOUT_S, EXPECTED_STORE_S, Services, Splice, api_service, store_service
from netbridge.relay.sessions import DataSessions, Rendezvous

log = logging.getLogger("tandem.relay")


class Relay:
    """The relay: owns the connections and the parts that decide for them; `start` listens, `close` ends
    every connection.

    `api_port` (None: none) accepts the clients of a run's API (serve.via_relay) and splices each to the API
    service registered under `api_session` (None: the one run that registered one). At most
    `api_max_connections` API clients at once, counted apart from --max-connections: their dial-backs are not
    counted there either, so a flood of API clients never makes a rank link FULL."""

    def __init__(self, secret: bytes, host: str = "0.0.0.0", port: int = 29400, *, max_frame_bytes: int = MAX_FRAME_BYTES,
                 handshake_timeout_s: float = 10.0, idle_timeout_s: float = 30.0, max_connections: int = 1024,
                 max_pending: int = 128, max_pending_per_source: int = MAX_PENDING_PER_SOURCE, emulate_delay_ms: float = 0.0,
                 emulate_mbps: float = 0.0, max_refusal_delay_s: float = MAX_REFUSAL_DELAY_S,
                 refusal_log_interval_s: float = LOG_INTERVAL_S, api_port: int | None = None, api_host: str | None = None,
                 api_session: str | None = None, api_max_connections: int = 256, dial_back_timeout_s: float = DIAL_BACK_TIMEOUT_S):
        if not secret:
            raise ValueError("the relay needs a non-empty secret")
        self.secret, self.host, self.port = secret, host, port
        self.api_port, self.api_host, self.api_session = api_port, api_host or host, api_session
        self.api_max_connections, self.dial_back_timeout_s = api_max_connections, dial_back_timeout_s
        self.limits = Limits(max_frame_bytes, handshake_timeout_s, idle_timeout_s, emulate_delay_ms, emulate_mbps)
        self.counts = {"accepted": 0, "refused": 0, "dropped": 0, "sessions": 0, "bytes": 0, "api": 0, "api_refused": 0}
        self.conns: set[Connection] = set()  # every connection that took a handshake slot, until it ends
        self.api_clients: set[ApiClient] = set()
        self.backends = 0  # dial-backs among self.conns: not counted against --max-connections
        self.admission = Admission(max_connections, max_pending, max_pending_per_source)
        self.notices = RefusalNotices(self._waiting_members)
        self.refusals = RefusalsBySource(max_refusal_delay_s, refusal_log_interval_s)
        self.services = Services()
        self.sessions = DataSessions()
        self.rendezvous = Rendezvous()
        # API clients that have not sent a byte yet, in a table of their own that sheds like the handshakes' (the
        # oldest of the busiest source first), so a flood of idle sockets never locks an honest API client out; no
        # per-source bound of its own (browsers behind one office NAT keep idle connections open)
        self.api_idle = Admission(api_max_connections, api_max_connections, api_max_connections)
        self.api_full_log, self.api_none_log = RareLog(), RareLog()
        self._server = self._api_server = None
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
        self._server = await loop.create_server(lambda: Connection(self, self.limits), self.host, self.port,
                                                reuse_address=True, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.api_port is not None:
            self._api_server = await loop.create_server(lambda: ApiClient(self, self.limits), self.api_host, self.api_port,
                                                        reuse_address=True, backlog=1024)
            self.api_port = self._api_server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.create_task(self._sweep())

    async def close(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
        for server in (self._server, self._api_server):
            if server:
                server.close()
        for conn in [*self.conns, *self.api_clients]:
            conn.drop(None)
        self.refusals.summarize(time.monotonic())  # what the last interval refused is not lost

    async def _sweep(self) -> None:
        """The relay's only timer: handshake and idle timeouts, dial-backs that did not come, the notices' tables,
        and the refusals' counts (logged once an interval)."""
        tick = max(0.05, min(1.0, self.limits.handshake_timeout_s / 4, self.limits.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for conn in [*self.conns, *self.api_clients]:
                conn.check_timers(now)
            for splice in self.services.sweep(now):
                splice.client.drop(f"no dial-back from service {splice.service} within {self.dial_back_timeout_s:g} s "
                                   "(is its process behind the NAT alive?)")
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
        full = conn.role != auth.ROLE_BACKEND and self.admission.is_full(len(self.conns) - self.backends)
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
        if conn.role == auth.ROLE_RDZV:
            return self.rendezvous.admit(conn)
        if conn.role == auth.ROLE_STORE:
            return auth.OK if self.services.known(store_service(conn.session)) else auth.UNKNOWN
        if conn.role == auth.ROLE_SERVICE:
            return self._admit_service(conn)
        if conn.role == auth.ROLE_BACKEND:
            return self._admit_backend(conn)
        return auth.REFUSED

    def joined(self, conn: Connection) -> None:
        """After OK went out: pair data ranks, complete rendezvous, ask for a store pipe's dial-back, serve a
        registered service's dials."""
        if conn.role == auth.ROLE_DATA:
            self._join_data(conn)
        elif conn.role == auth.ROLE_RDZV:
            self._join_rendezvous(conn)
        elif conn.role == auth.ROLE_STORE:
            splice = Splice(conn, store_service(conn.session), time.monotonic() + self.dial_back_timeout_s)
            conn.splice_into(splice)  # bytes the client sends meanwhile wait for the dial-back
            self.services.call(splice)
        elif conn.role == auth.ROLE_SERVICE:
            conn.serve_dials()
            self.services.ask_waiting(conn)
        elif conn.role == auth.ROLE_BACKEND:
            conn.splice.join(conn)

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
        elif conn.role == auth.ROLE_SERVICE and conn.state == "service":
            self.services.leave(conn)
            log.info("service %s: its process left (%s)", conn.session, conn.name)
        elif conn.role == auth.ROLE_BACKEND and conn.splice is not None:
            self.backends -= 1
        if conn.role == auth.ROLE_STORE and conn.splice is not None:
            self.services.forget(conn.splice)

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

    def _admit_service(self, conn: Connection) -> int:
        """A process registers its service; one registered already under that name is replaced (its process
        re-dialed, or a restarted one took over), like a re-joining data rank."""
        old = self.services.register(conn)
        if old is not None:
            log.info("service %s: re-registered from %s; dropping its old control connection %s", conn.session, conn.name, old.name)
            old.state = "closed"  # its leaving must not unregister the newcomer
            old.drop(None)
        log.info("service %s: registered from %s", conn.session, conn.name)
        return auth.OK

    def _admit_backend(self, conn: Connection) -> int:
        """A dial-back: joined to the client it was asked for; one for no waiting call (too late, or made up)
        is UNKNOWN."""
        splice = self.services.answer(conn.session)
        if splice is None:
            return auth.UNKNOWN
        conn.splice_into(splice)  # joined once OK went out (joined()): the client's bytes must follow it
        self.backends += 1
        return auth.OK

    # ---- --api-port: clients of a run's API (ApiClient) -------------------------------------------
    def api_room(self, client: ApiClient) -> bool:
        """A place for a new API client: among the idle ones (netbridge.relay.admission's policy: per source, and
        the oldest of the busiest source shed when full), and under --api-max-connections in all."""
        shed = self.api_idle.make_room_for(client)
        if shed is None:
            self.counts["api_refused"] += 1
            return False
        for victim in shed:
            victim.drop(None)
        if len(self.api_clients) - len(shed) >= self.api_max_connections:
            self.api_idle.forget(client)
            self.counts["api_refused"] += 1
            self.api_full_log.warning("%s: API client closed: --api-max-connections (%d) API clients are open",
                                      client.name, self.api_max_connections)
            return False
        self.api_clients.add(client)
        self.counts["api"] += 1
        return True

    def api_call(self, client: ApiClient) -> Splice | None:
        """The Splice of an API client that sent its first bytes, asked of the API service; None (and the client
        closed with a log line) when no run serves its API here."""
        self.api_idle.forget(client)
        service = self._api_target()
        if service is None or service not in self.services.controls:
            self.api_none_log.warning("%s: API client closed: %s", client.name, self._no_api_reason(service))
            self.counts["api_refused"] += 1
            client.drop(None)
            return None
        splice = Splice(client, service, time.monotonic() + self.dial_back_timeout_s)
        self.services.call(splice)
        return splice

    def api_left(self, client: ApiClient) -> None:
        self.api_idle.forget(client)
        self.api_clients.discard(client)
        if client.splice is not None:
            self.services.forget(client.splice)

    def _api_target(self) -> str | None:
        if self.api_session is not None:
            return api_service(self.api_session)
        registered = self.services.api_services()
        return registered[0] if len(registered) == 1 else None

    def _no_api_reason(self, service: str | None) -> str:
        registered = self.services.api_services()
        if service is not None:
            return f"no process registered the API of run {service.removeprefix('api:')!r} (serve.via_relay=true on its rank 0)"
        if not registered:
            return "no run registered an API here (serve.via_relay=true on its rank 0)"
        return (f"{len(registered)} runs registered an API ({', '.join(r.removeprefix('api:') for r in registered)}): "
                "start the relay with --api-session RUN to say which one --api-port serves")

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
        token = secrets.token_hex(8)  # a fresh store per round: node 0's agent starts it and registers it
        self.services.expect(store_service(token), time.monotonic() + EXPECTED_STORE_S)
        for member, rank in ranks:
            member.finish_rendezvous(HEADER.pack(RDZV_DONE, RDZV_BODY.size) + RDZV_BODY.pack(rank, world, token.encode(), STORE_AT_NODE0))
        log.info("run %s: rendezvous of %d nodes complete, store %s on node 0", conn.session, world, token)

    def _waiting_members(self, session: str) -> list[Connection]:
        return self.sessions.waiting(session) + self.rendezvous.waiting(session)
