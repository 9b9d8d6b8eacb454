"""tandem-relay: the one public address both ranks dial out to, for torchrun's rendezvous and for data.

    python -m netbridge.relay --host 0.0.0.0 --port 29400 --secret-file ~/.tandem/relay.token

The --secret-file is the relay token (admission, netbridge.auth); the nodes' pairing secret, which keys
their end-to-end encryption, never comes here (netbridge.secure), so the relay forwards what it cannot read.

Every connection starts with the HMAC handshake of netbridge.auth and then is one of:
  data   the two ranks of a session; the relay forwards their link frames verbatim, cut-through
         (a frame's bytes move on as they arrive, the relay never holds a whole frame)
  rdzv   torchrun agents of one run meeting (launch/relay_rendezvous.py); when all have come the
         relay gives each its node rank and the token of a fresh store
  store  a byte pipe to that run's c10d TCPStore, which listens on the relay's loopback only

Link frames after the handshake: u8 type | u32 length | body (netbridge.link). The length is checked
against the bound before any body byte is read; a bad type, an oversized or empty DATA frame, or DATA
before the peer has joined closes that connection with one log line, and its session with it.

Notices: when a claim for a session is refused (a wrong secret, a rank already taken, another --nnodes)
while members of that session wait (data ranks for their peer, agents for the rendezvous), they get a
NOTICE frame saying so, so a node does not wait out its timeout in silence; a member that starts waiting
within REFUSAL_MEMORY_S of such a refusal is told on joining (the refused node may well have come first).
A wrong-secret claim is unauthenticated, so its notice says "claiming"; notices are rate-limited per
session and bounded in length, and the refusals remembered are bounded in number.

No torch import unless the rendezvous store is enabled (then torch.distributed, CPU is enough).
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections import OrderedDict, deque

from netbridge import auth
from netbridge.link import DATA, HEADER, HEARTBEAT, MAX_FRAME_BYTES, PAIRED, PEER_LEFT, RDZV_BODY, RDZV_DONE, notice_frame

log = logging.getLogger("tandem.relay")

HIGH_WATER = 1024 * 1024  # bytes queued towards a receiver before the sender is paused
STORE_GRACE_S = 120.0  # a run's store lives this long after its last connection closed
MAX_PENDING_PER_SOURCE = 16  # default --max-pending-per-source: unfinished handshakes from one address at once
# An honest handshake is done one round trip after connecting; an unfinished one this old is stale and
# gives its slot to a newcomer from the same address (a flooder behind your NAT cannot lock you out)
STALE_HANDSHAKE_S = 1.0
# At most one notice per session this often: anyone who knows a session id can send bad claims for it,
# and must not be able to flood a waiting node's terminal
NOTICE_INTERVAL_S = 1.0
REFUSAL_MEMORY_S = 60.0  # a refusal is told to members that start waiting this long after it
MAX_REMEMBERED_REFUSALS = 256  # sessions whose last refusal is kept (strangers can invent session ids)


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


class _PendingHandshakes:
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

    def oldest_of(self, source: str) -> _Conn:
        return next(iter(self.by_source[source]))

    def add(self, conn: _Conn) -> None:
        self.by_source.setdefault(conn.source, OrderedDict())[conn] = None
        self.count += 1

    def remove(self, conn: _Conn) -> None:
        conns = self.by_source.get(conn.source)
        if conns is None or conn not in conns:
            return
        del conns[conn]
        self.count -= 1
        if not conns:
            del self.by_source[conn.source]  # keeps memory bounded by the number of pending connections

    def victim(self) -> _Conn | None:
        """Whom to shed for a newcomer: the oldest connection of the source holding the most slots, so a
        flood from a few addresses sheds its own connections before a lone client's."""
        busiest = max(self.by_source.values(), key=lambda conns: (len(conns), -next(iter(conns)).born), default=None)
        return next(iter(busiest)) if busiest else None


class _RareLog:
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


class _Rdzv:
    def __init__(self, world: int):
        self.world = world
        self.members: list[_Conn] = []


class _Store:
    def __init__(self, store, port: int):
        self.store, self.port = store, port
        self.conns = 0
        self.idle_since = time.monotonic()


class Relay:
    def __init__(self, secret: bytes, host: str = "0.0.0.0", port: int = 29400, *, max_frame_bytes: int = MAX_FRAME_BYTES,
                 handshake_timeout_s: float = 10.0, idle_timeout_s: float = 30.0, max_connections: int = 1024,
                 max_pending: int = 128, max_pending_per_source: int = MAX_PENDING_PER_SOURCE, emulate_delay_ms: float = 0.0,
                 emulate_mbps: float = 0.0, store: bool = True):
        if not secret:
            raise ValueError("the relay needs a non-empty secret")
        self.secret, self.host, self.port = secret, host, port
        self.max_frame_bytes = max_frame_bytes
        self.handshake_timeout_s, self.idle_timeout_s = handshake_timeout_s, idle_timeout_s
        self.max_connections, self.max_pending = max_connections, max_pending
        self.delay_s = emulate_delay_ms / 1000
        self.bytes_per_s = emulate_mbps * 1e6 / 8
        self.store_enabled = store
        self.conns: set[_Conn] = set()
        self.sessions: dict[str, list] = {}
        self.rdzv: dict[str, _Rdzv] = {}
        self.stores: dict[str, _Store] = {}
        self.notice_due: dict[str, float] = {}  # session -> when it may get its next notice (entries swept once due)
        self.last_refusal: OrderedDict[str, tuple[float, str]] = OrderedDict()  # session -> (when, notice), oldest first
        self.handshakes = _PendingHandshakes(max_pending, max_pending_per_source)
        self.shed_log, self.turned_away_log = _RareLog(), _RareLog()
        self.stats = {"accepted": 0, "refused": 0, "dropped": 0, "sessions": 0, "bytes": 0, "shed": 0, "turned_away": 0}
        self._server = None
        self._sweeper = None

    @property
    def emulating(self) -> bool:
        return bool(self.delay_s or self.bytes_per_s)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.store_enabled:
            import torch.distributed  # noqa: F401  - fail at start, not at the first rendezvous
        self._server = await loop.create_server(lambda: _Conn(self), self.host, self.port, reuse_address=True, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.create_task(self._sweep())

    async def close(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
        if self._server:
            self._server.close()
        for conn in list(self.conns):
            conn.drop(None)
        for token in list(self.stores):
            self._drop_store(token)

    async def _sweep(self) -> None:
        tick = max(0.05, min(1.0, self.handshake_timeout_s / 4, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for conn in list(self.conns):
                conn.check_timers(now)
            for token, st in list(self.stores.items()):
                if st.conns == 0 and now - st.idle_since > STORE_GRACE_S:
                    self._drop_store(token)
            for session, due in list(self.notice_due.items()):
                if due <= now:
                    del self.notice_due[session]
            while self.last_refusal and now - next(iter(self.last_refusal.values()))[0] > REFUSAL_MEMORY_S:
                self.last_refusal.popitem(last=False)

    # ---- admission: who may start a handshake, and whether an authenticated client fits -----------
    def make_room_for(self, conn: _Conn) -> bool:
        """Take `conn` into the handshake table; False when its source already has --max-pending-per-source
        handshakes open, all younger than STALE_HANDSHAKE_S (a burst: turned away without taking a slot).

        A full table, or a source at its bound whose oldest handshake is stale, sheds one (see
        _PendingHandshakes.victim) instead of turning the newcomer away, so idle sockets can delay an
        honest client by a retry, not lock it out."""
        hs = self.handshakes
        if hs.source_is_full(conn.source):
            oldest = hs.oldest_of(conn.source)
            if time.monotonic() - oldest.born < STALE_HANDSHAKE_S:
                return False
            oldest.shed(f"{conn.source} has --max-pending-per-source ({hs.per_source}) handshakes open")
        if len(hs) >= hs.limit:
            hs.victim().shed(f"--max-pending ({hs.limit}) handshakes are open")
        hs.add(conn)
        return True

    def is_full(self) -> bool:
        """True when --max-connections authenticated connections are open (the handshake table is apart)."""
        return len(self.conns) - len(self.handshakes) >= self.max_connections

    # ---- sessions ----------------------------------------------------------------------------
    def admit(self, conn: _Conn) -> int:
        """Decide on an authenticated claim; returns a status from netbridge.auth."""
        if conn.role == auth.ROLE_DATA:
            self._take_data_slot(conn)
            return auth.OK
        if conn.role == auth.ROLE_RDZV:
            if not self.store_enabled:
                return auth.NO_STORE
            group = self.rdzv.setdefault(conn.session, _Rdzv(conn.world))
            if group.world != conn.world:
                return auth.MISMATCH
            if conn.rank != auth.ANY_RANK and any(m.rank == conn.rank for m in group.members):
                return auth.TAKEN
            group.members.append(conn)
            return auth.OK
        if conn.role == auth.ROLE_STORE:
            if not self.store_enabled:
                return auth.NO_STORE
            st = self.stores.get(conn.session)
            if st is None:
                return auth.UNKNOWN
            st.conns += 1
            return auth.OK
        return auth.REFUSED

    def _take_data_slot(self, conn: _Conn) -> None:
        """A rank of a session joins. If that rank's old connection is still here (its link died without the
        relay noticing yet), the newcomer replaces it: it proved the secret, and a rank that re-dials has
        given up the old link. The old one is dropped like any leaver, which ends its peer's connection too
        (PEER_LEFT), so both ranks re-dial and pair afresh and no stale byte crosses into the new pairing."""
        old = self.sessions.get(conn.session, [None, None])[conn.rank]
        if old is not None:
            log.info("session %s: rank %d re-joined from %s; dropping its old connection %s", conn.session, conn.rank,
                     conn.name, old.name)
            old.drop(None)
        self.sessions.setdefault(conn.session, [None, None])[conn.rank] = conn

    def joined(self, conn: _Conn) -> None:
        """Called after OK went out: pair data ranks, complete rendezvous, connect store pipes."""
        if conn.role == auth.ROLE_DATA:
            slots = self.sessions[conn.session]
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
                self.tell_recent_refusal(conn)
        elif conn.role == auth.ROLE_RDZV:
            conn.state = "rdzv"
            group = self.rdzv[conn.session]
            log.info("run %s: node %s from %s joined the rendezvous (%d of %d)", conn.session,
                     "any" if conn.rank == auth.ANY_RANK else conn.rank, conn.name, len(group.members), group.world)
            if len(group.members) == group.world:
                self._complete_rdzv(conn.session, group)
            else:
                self.tell_recent_refusal(conn)
        elif conn.role == auth.ROLE_STORE:
            conn.state = "store"
            asyncio.ensure_future(conn.open_store_pipe(self.stores[conn.session].port))

    def _complete_rdzv(self, run_id: str, group: _Rdzv) -> None:
        del self.rdzv[run_id]
        taken = {m.rank for m in group.members if m.rank != auth.ANY_RANK}
        free = iter(r for r in range(group.world) if r not in taken)
        token = secrets.token_hex(8)
        try:
            self._make_store(token)
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

    def _make_store(self, token: str) -> None:
        from datetime import timedelta

        import torch.distributed as dist
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))  # loopback only: the world reaches it through the handshake
        listener.listen(64)
        port = listener.getsockname()[1]
        try:
            store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60),
                                  wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=True)
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the socket now and closes it when it goes
        self.stores[token] = _Store(store, port)

    def _drop_store(self, token: str) -> None:
        st = self.stores.pop(token, None)
        if st is not None:
            del st.store
            log.info("store %s: dropped", token)

    # ---- notices: a refused claim, told to whoever waits in that session ---------------------------
    def refused_claim(self, session: str, text: str) -> None:
        """A claim for `session` was refused: remember it for members yet to come, tell those waiting now."""
        self.last_refusal.pop(session, None)
        self.last_refusal[session] = (time.monotonic(), text)
        if len(self.last_refusal) > MAX_REMEMBERED_REFUSALS:
            self.last_refusal.popitem(last=False)
        self.notify_waiting(session, text)

    def tell_recent_refusal(self, conn: _Conn) -> None:
        """A member starts waiting: if a claim for its session was refused lately, it hears of it now."""
        when, text = self.last_refusal.get(conn.session, (None, ""))
        if when is not None and time.monotonic() - when <= REFUSAL_MEMORY_S:
            conn.transport.write(notice_frame(f"{text} ({time.monotonic() - when:.0f} s before this node came)"))

    def notify_waiting(self, session: str, text: str) -> None:
        """Send `text` as a NOTICE to the members of `session` that still wait (for their peer or for the
        rendezvous); at most once per NOTICE_INTERVAL_S per session. Paired connections get nothing: their
        stream carries the peer's frames, and a refused stranger is no news to a running session."""
        waiting = self._waiting_members(session)
        now = time.monotonic()
        if not waiting or now < self.notice_due.get(session, 0.0):
            return
        self.notice_due[session] = now + NOTICE_INTERVAL_S
        frame = notice_frame(text)
        for member in waiting:
            member.transport.write(frame)
        log.info("session %s: told %d waiting member(s): %s", session, len(waiting), text)

    def _waiting_members(self, session: str) -> list[_Conn]:
        data = [c for c in self.sessions.get(session, ()) if c is not None and c.state == "waiting"]
        group = self.rdzv.get(session)
        agents = [c for c in group.members if c.state == "rdzv"] if group is not None else []
        return [c for c in data + agents if c.transport is not None and not c.transport.is_closing()]

    def left(self, conn: _Conn) -> None:
        """A connection ended (any reason): free its slot, and end the peer's connection too (PEER_LEFT at a frame
        boundary). The relay keeps no other session state: ranks that resume re-dial and pair afresh, and
        the session id is free for them (or anyone with the secret) at once."""
        if conn.role == auth.ROLE_DATA and conn.session in self.sessions:
            slots = self.sessions[conn.session]
            if slots[conn.rank] is conn:
                slots[conn.rank] = None
                peer = conn.peer
                if peer is not None and slots[peer.rank] is peer:
                    slots[peer.rank] = None
                if slots == [None, None]:
                    del self.sessions[conn.session]
                if peer is not None:
                    log.info("session %s: rank %d left, closing rank %d (they may re-dial and resume)", conn.session, conn.rank, peer.rank)
                    conn.forward_end()
        elif conn.role == auth.ROLE_RDZV and conn.session in self.rdzv:
            group = self.rdzv[conn.session]
            if conn in group.members:
                group.members.remove(conn)
                if not group.members:
                    del self.rdzv[conn.session]
        elif conn.role == auth.ROLE_STORE and conn.counted_store:
            st = self.stores.get(conn.session)
            if st is not None:
                st.conns -= 1
                st.idle_since = time.monotonic()


class _Conn(asyncio.Protocol):
    """One client connection: handshake, then link-frame parsing and cut-through forwarding."""

    def __init__(self, relay: Relay):
        self.relay = relay
        self.transport = None
        self.name = "?"
        self.state = "hello"  # hello | waiting | paired | rdzv | done | store | closed
        self.role = self.rank = self.world = 0
        self.session = ""
        self.peer: _Conn | None = None
        self.counted_store = False
        self.buf = bytearray()
        self.nonce = b""
        now = time.monotonic()
        self.born = now
        self.deadline = now + relay.handshake_timeout_s
        self.last_rx = now
        self.source = "?"
        self.pending = False  # in relay.handshakes
        # link-frame parser: header bytes seen so far, body bytes still to come, is this frame forwarded
        self.hdr = bytearray()
        self.body_left = 0
        self.fwd = False
        # towards the peer (emulation): (due time, bytes | None = end) and bookkeeping
        self.line: deque = deque()
        self.line_bytes = 0
        self.line_timer = None
        self.wire_free_at = 0.0
        self.paused: set[str] = set()
        self.upstream = None
        self.store_backlog: list = []

    # ---- asyncio callbacks ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.name = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.source = source_of(peer[0]) if peer else "?"
        relay = self.relay
        if not relay.make_room_for(self):
            self._turn_away()
            return
        self.pending = True
        relay.conns.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            auth.tune(sock)
        transport.set_write_buffer_limits(high=HIGH_WATER, low=HIGH_WATER // 4)
        hello, self.nonce = auth.hello()
        transport.write(hello)

    def data_received(self, data: bytes) -> None:
        self.last_rx = time.monotonic()
        if self.state == "hello":
            self._handshake(data)
        elif self.state == "store":
            if self.upstream is not None:
                self.upstream.write(data)
            else:
                self.store_backlog.append(data)
                self._throttle("store-connect", True)
        elif self.state in ("waiting", "paired", "rdzv"):
            self._frames(data)

    def eof_received(self):
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        self._finish()

    def pause_writing(self) -> None:  # our transport's buffer is full: stop reading from whoever feeds it
        if self.peer is not None:
            self.peer._throttle("receiver", True)
        elif self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer._throttle("receiver", False)
        elif self.upstream is not None:
            self.upstream.resume_reading()

    # ---- handshake -----------------------------------------------------------------------------
    def _handshake(self, data: bytes) -> None:
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
            self._notify_wrong_secret(raw_claim)
            return
        self.role, self.rank, self.world, self.session, client_nonce = claim
        full = self.relay.is_full()  # counted while this one is still pending
        self._end_pending()
        status = auth.FULL if full else self.relay.admit(self)
        if status != auth.OK:
            log.warning("%s: %s of %s refused: %s", self.name, _ROLE_NAMES.get(self.role), self.session, _STATUS_NAMES.get(status))
            self.relay.stats["refused"] += 1
            self.state = "closed"
            self.transport.write(bytes([status]))
            self.close_soon()
            self.relay.refused_claim(self.session, self._refusal_notice(status))
            return
        self.counted_store = self.role == auth.ROLE_STORE
        self.relay.stats["accepted"] += 1
        raw = self.session.encode()
        self.transport.write(bytes([auth.OK]) + auth.relay_mac(self.relay.secret, self.nonce, client_nonce, self.role, self.rank, self.world, raw))
        self.relay.joined(self)
        if rest:
            self.data_received(bytes(rest))

    def _refuse(self, why: str) -> None:
        log.warning("%s: handshake refused: %s", self.name, why)
        self.relay.stats["refused"] += 1
        self._end_pending()
        self.state = "closed"
        self.transport.write(bytes([auth.REFUSED]))
        self.close_soon()

    @property
    def host(self) -> str:
        """The client's address without the port."""
        return self.name.rpartition(":")[0] or self.name

    def _notify_wrong_secret(self, raw_claim: bytes) -> None:
        """Tell the session this refused claim names (if its id is well-formed) who was turned away. Nothing
        in the claim is proven, so the notice says "claiming"."""
        session = claimed_session(raw_claim)
        if session is not None:
            self.relay.refused_claim(session, f"a connection from {self.host} claiming session {session!r} was refused "
                                               "at the relay for a wrong token: check TANDEM_RELAY_TOKEN_FILE (or "
                                               "transport.relay_token_file) on that node; it must hold the relay's token")

    def _refusal_notice(self, status: int) -> str:
        """The notice for an authenticated claim the relay refused: which node, and what it must change."""
        why = {
            auth.TAKEN: f"node rank {self.rank} is taken already (give each node its own --rdzv_conf node_rank, or none)",
            auth.MISMATCH: f"it gave --nnodes={self.world}, the nodes waiting gave {self._waiting_world()}",
            auth.FULL: "the relay is full (--max-connections); restart it with a larger one",
        }.get(status, _STATUS_NAMES.get(status, f"status {status}"))
        return f"a node from {self.host} was refused at the relay for session {self.session!r}: {why}"

    def _waiting_world(self) -> str:
        group = self.relay.rdzv.get(self.session)
        return f"--nnodes={group.world}" if group is not None else "another"

    def _end_pending(self) -> None:
        if self.pending:
            self.pending = False
            self.relay.handshakes.remove(self)

    def shed(self, why: str) -> None:
        """Make room for a newer connection: this one is told SHED (an honest client retries) and its slot
        is free at once."""
        relay = self.relay
        relay.stats["shed"] += 1
        relay.shed_log.warning("%s: unfinished handshake shed after %.1f s to admit a newer connection: %s; "
                               "a flood of unauthenticated connections?", self.name, time.monotonic() - self.born, why)
        self._say_and_close(bytes([auth.SHED]))
        self._finish()

    def _turn_away(self) -> None:
        """Refused before the handshake: its source has --max-pending-per-source handshakes open. No slot,
        no timer; a short greeting says why, so a client behind a crowded NAT learns what to raise."""
        relay = self.relay
        relay.stats["turned_away"] += 1
        relay.turned_away_log.warning("%s: turned away: %d unfinished handshakes from %s already (--max-pending-per-source)",
                                      self.name, relay.handshakes.per_source, self.source)
        self.state = "closed"
        self._say_and_close(auth.busy_greeting(auth.SOURCE_LIMIT))

    def _say_and_close(self, data: bytes) -> None:
        """Write a few bytes and close: they fit the socket buffer at once, so the socket goes now; the
        abort is only for a peer whose buffer is somehow full."""
        transport = self.transport
        transport.write(data)
        stuck = transport.get_write_buffer_size() > 0
        transport.close()
        if stuck:
            asyncio.get_running_loop().call_later(5.0, transport.abort)

    # ---- link frames ---------------------------------------------------------------------------
    def _frames(self, data: bytes) -> None:
        """Validate the link frames in `data`; forward the bytes of frames that go to the peer."""
        mv = memoryview(data)
        n, i = len(mv), 0
        out: list = []  # pieces for the peer: (start, end) into data, or bytes
        while i < n:
            if self.body_left:
                k = min(self.body_left, n - i)
                if self.fwd:
                    out.append((i, i + k))
                self.body_left -= k
                i += k
                continue
            start, hdr_was = i, len(self.hdr)
            k = min(HEADER.size - hdr_was, n - i)
            self.hdr += mv[i:i + k]
            i += k
            if len(self.hdr) < HEADER.size:
                break
            kind, length = HEADER.unpack(self.hdr)
            whole_header = bytes(self.hdr)
            self.hdr.clear()
            error = self._check_frame(kind, length)
            if error:
                self._send(out, data)
                self.drop(error)
                return
            self.fwd = self.state == "paired"
            if self.fwd:
                out.append((start, i) if hdr_was == 0 else whole_header)
                self.relay.stats["bytes"] += length + HEADER.size
            self.body_left = length
        self._send(out, data)

    def _check_frame(self, kind: int, length: int) -> str | None:
        if kind == HEARTBEAT:
            return None if length == 0 else f"heartbeat with a {length}-byte body"
        if kind == DATA:
            if self.state != "paired":
                return "sent data before its peer joined"
            if not 0 < length <= self.relay.max_frame_bytes:
                return f"frame of {length} bytes outside the bound (1..{self.relay.max_frame_bytes})"
            return None
        return f"unknown frame type {kind}"

    def _send(self, out: list, data: bytes) -> None:
        if not out or self.peer is None:
            return
        if len(out) == 1 and out[0] == (0, len(data)):
            chunk = data
        else:
            chunk = b"".join(p if isinstance(p, bytes) else memoryview(data)[p[0]:p[1]] for p in out)
        self._to_peer(chunk)

    def at_boundary(self) -> bool:
        """True when the bytes forwarded so far end at a frame boundary of the peer's stream."""
        return not (self.fwd and self.body_left)  # header bytes are forwarded only once complete

    # ---- towards the peer: direct, or through the emulated link ---------------------------------
    def _to_peer(self, chunk) -> None:
        relay = self.relay
        if not relay.emulating:
            self.peer.transport.write(chunk)
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        # EMULATION: a link that serializes at --emulate-mbps, then propagates for --emulate-delay-ms
        size = len(chunk) if chunk is not None else 0
        wire_done = max(now, self.wire_free_at) + (size / relay.bytes_per_s if relay.bytes_per_s else 0.0)
        self.wire_free_at = wire_done
        self.line.append((wire_done + relay.delay_s, chunk))
        self.line_bytes += size
        if self.line_bytes > HIGH_WATER:
            self._throttle("emulated-link", True)
        if self.line_timer is None:
            self.line_timer = loop.call_at(self.line[0][0], self._deliver)

    def _deliver(self) -> None:
        self.line_timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        peer = self.peer
        while self.line and self.line[0][0] <= now:
            _, chunk = self.line.popleft()
            if chunk is None:
                if peer is not None:
                    peer.close_soon()
                continue
            self.line_bytes -= len(chunk)
            if peer is not None and peer.transport is not None and not peer.transport.is_closing():
                peer.transport.write(chunk)
        if self.line_bytes <= HIGH_WATER // 4:
            self._throttle("emulated-link", False)
        if self.line:
            self.line_timer = loop.call_at(self.line[0][0], self._deliver)

    def forward_end(self) -> None:
        """This side left: tell the peer (after what is still on the emulated wire) and close it."""
        peer = self.peer
        if peer is None:
            return
        if self.at_boundary() and peer.transport is not None and not peer.transport.is_closing():
            end = HEADER.pack(PEER_LEFT, 0)
            if self.relay.emulating:
                self._to_peer(end)
            else:
                peer.transport.write(end)
        if self.relay.emulating and self.line:
            self.line.append((self.line[-1][0], None))
        else:
            peer.close_soon()
        peer.peer = None
        peer.state = "closed"

    def _throttle(self, reason: str, on: bool) -> None:
        was = bool(self.paused)
        (self.paused.add if on else self.paused.discard)(reason)
        if self.transport is None or self.transport.is_closing():
            return
        if self.paused and not was:
            self.transport.pause_reading()
        elif was and not self.paused:
            self.last_rx = time.monotonic()
            self.transport.resume_reading()

    # ---- the rendezvous store ------------------------------------------------------------------
    async def open_store_pipe(self, port: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_connection(lambda: _StorePipe(self), "127.0.0.1", port)
        except OSError as e:
            self.drop(f"cannot connect to store on 127.0.0.1:{port} ({e})")
            return
        if self.state != "store":
            transport.close()
            return
        self.upstream = transport
        for data in self.store_backlog:
            transport.write(data)
        self.store_backlog.clear()
        self._throttle("store-connect", False)

    # ---- ending --------------------------------------------------------------------------------
    def check_timers(self, now: float) -> None:
        if self.state == "hello" and now > self.deadline:
            self.drop(f"no complete handshake within {self.relay.handshake_timeout_s:.0f} s (slow or silent client)")
        elif self.state in ("waiting", "paired", "rdzv") and not self.paused and now - self.last_rx > self.relay.idle_timeout_s:
            self.drop(f"silent for {self.relay.idle_timeout_s:.0f} s, not even heartbeats (--idle-timeout-s)")

    def drop(self, why: str | None) -> None:
        """Close this connection now, with one log line."""
        if why:
            log.warning("%s (%s %s): %s; closing it", self.name, _ROLE_NAMES.get(self.role, "client"), self.session or "-", why)
            self.relay.stats["dropped"] += 1
        if self.transport is not None:
            self.transport.abort()
        self._finish()

    def close_soon(self) -> None:
        """Flush what we wrote, then close; abort if the client does not read it within a few seconds."""
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.close()
        asyncio.get_running_loop().call_later(5.0, self.transport.abort)

    def _finish(self) -> None:
        if self in self.relay.conns:
            self.relay.conns.discard(self)
            self._end_pending()
            self.relay.left(self)
            if self.upstream is not None:
                self.upstream.close()
            self.state = "closed"


class _StorePipe(asyncio.Protocol):
    """The relay's side of a store pipe: bytes from the TCPStore go back to the client."""

    def __init__(self, client: _Conn):
        self.client = client

    def data_received(self, data: bytes) -> None:
        if self.client.transport is not None and not self.client.transport.is_closing():
            self.client.transport.write(data)

    def connection_lost(self, exc) -> None:
        self.client.close_soon()


_ROLE_NAMES = {auth.ROLE_DATA: "data", auth.ROLE_STORE: "store", auth.ROLE_RDZV: "rendezvous"}
_STATUS_NAMES = {auth.TAKEN: "slot already taken", auth.FULL: "relay full (--max-connections authenticated connections open)",
                 auth.MISMATCH: "node count differs", auth.UNKNOWN: "unknown store", auth.NO_STORE: "store disabled (--no-store)",
                 auth.REFUSED: "refused"}


def claimed_session(claim: bytes) -> str | None:
    """The session id a whole claim names, unverified, or None when it is not a well-formed id."""
    n = claim[auth.CLAIM_PREFIX.size - 1]
    raw = claim[auth.CLAIM_PREFIX.size:auth.CLAIM_PREFIX.size + n]
    return raw.decode() if auth.SESSION_RE.fullmatch(raw) else None


def peak_rss_mb() -> float:
    """This process's peak resident set size (VmHWM), in MB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="tandem-relay", description="Relay both Tandem ranks dial out to (rendezvous + data).")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=29400, help="the one port both nodes dial (default 29400; 0 = any free)")
    p.add_argument("--secret-file", default=os.environ.get("TANDEM_RELAY_TOKEN_FILE"),
                   help="file holding the relay token that admits nodes (default: $TANDEM_RELAY_TOKEN_FILE); never the "
                        "nodes' pairing secret, which the relay must not have; there is no --secret on purpose")
    p.add_argument("--max-frame-bytes", type=int, default=MAX_FRAME_BYTES, help="bound of one frame")
    p.add_argument("--handshake-timeout-s", type=float, default=10.0,
                   help="a client must finish the handshake within this; the outer bound on an unfinished handshake "
                        "even when nobody needs its slot (default 10)")
    p.add_argument("--idle-timeout-s", type=float, default=30.0, help="drop a client silent this long (clients send heartbeats)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="authenticated connections at once; one more is answered 'full' (default 1024)")
    p.add_argument("--max-pending", type=int, default=128,
                   help="connections in the handshake at once; when full, the oldest unfinished handshake of the busiest "
                        "source address is shed to admit a newcomer, so idle sockets cannot lock clients out (default 128)")
    p.add_argument("--max-pending-per-source", type=int, default=MAX_PENDING_PER_SOURCE,
                   help="connections in the handshake at once from one IPv4 address or IPv6 /64; a newcomer beyond it "
                        f"takes the slot of that address's oldest handshake if that is over {STALE_HANDSHAKE_S:g} s old, "
                        "else it is turned away at once; raise it when many nodes share one NAT address "
                        f"(default {MAX_PENDING_PER_SOURCE})")
    p.add_argument("--emulate-delay-ms", type=float, default=0.0, help="EMULATION: one-way delay added to every forwarded byte")
    p.add_argument("--emulate-mbps", type=float, default=0.0, help="EMULATION: per-direction bandwidth cap, 0 = none")
    p.add_argument("--no-store", action="store_true", help="data only: no torchrun rendezvous, no torch import")
    p.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                   help="event loop: uvloop when installed (auto), else asyncio's own")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s tandem-relay %(levelname)s %(message)s", stream=sys.stderr)
    if not a.secret_file:
        p.error("--secret-file is required (or set TANDEM_RELAY_TOKEN_FILE)")
    try:
        secret = auth.load_secret(secret_file=a.secret_file)
    except auth.HandshakeError as e:
        p.error(str(e))
    relay = Relay(secret, a.host, a.port, max_frame_bytes=a.max_frame_bytes, handshake_timeout_s=a.handshake_timeout_s,
                  idle_timeout_s=a.idle_timeout_s, max_connections=a.max_connections, max_pending=a.max_pending,
                  max_pending_per_source=a.max_pending_per_source, emulate_delay_ms=a.emulate_delay_ms, emulate_mbps=a.emulate_mbps, store=not a.no_store)
    _raise_fd_limit(a.max_connections + a.max_pending + 64)
    with asyncio.Runner(loop_factory=_loop_factory(a.loop)) as runner:
        runner.run(_serve(relay, _loop_name(a.loop)))


def _raise_fd_limit(needed: int) -> None:
    """Every connection is a file descriptor; the usual soft limit (1024) is below the defaults' sum, and
    running out would refuse clients with EMFILE before the relay could answer 'full'."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed or soft == resource.RLIM_INFINITY:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning("only %d file descriptors allowed (hard limit), %d needed for --max-connections + --max-pending; "
                    "raise `ulimit -Hn` or lower those limits", target, needed)


def _loop_factory(choice: str):
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            sys.exit("tandem-relay: --loop uvloop, but uvloop is not installed (pip install uvloop)")
        return None
    return uvloop.new_event_loop


def _loop_name(choice: str) -> str:
    return "uvloop" if _loop_factory(choice) is not None else "asyncio"


async def _serve(relay: Relay, loop_name: str = "asyncio") -> None:
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    await relay.start()
    extras = []
    if relay.emulating:
        extras.append(f"EMULATING delay {relay.delay_s * 1000:g} ms, {relay.bytes_per_s * 8 / 1e6:g} Mbit/s per direction")
    extras.append("rendezvous store on" if relay.store_enabled else "no store")
    extras.append(loop_name)
    print(f"tandem-relay listening on {relay.host}:{relay.port} ({', '.join(extras)})", flush=True)
    await stop
    s = relay.stats
    log.info("stopping: %d accepted, %d refused, %d dropped, %d shed, %d turned away, %d sessions, %.1f MB forwarded, "
             "peak RSS %.0f MB", s["accepted"], s["refused"], s["dropped"], s["shed"], s["turned_away"], s["sessions"],
             s["bytes"] / 1e6, peak_rss_mb())
    print(f"tandem-relay peak RSS {peak_rss_mb():.1f} MB", flush=True)
    await relay.close()


if __name__ == "__main__":
    main()
