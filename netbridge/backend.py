"""The node side of the relay's dial-back: serve a local TCP port to the relay's clients without accepting a
single inbound connection.

    handle = serve_through_relay("relay.example.org:29400", token, "api:my-run", ("127.0.0.1", 8000))
    ...
    handle.close()

A thread keeps one authenticated control connection to the relay (role "service", session = the service
name) and sends heartbeats on it; the relay answers each, so a relay that is gone is noticed within
3 heartbeat periods, and the thread re-registers with backoff until closed. For each client of the service
the relay sends DIAL with a connection id; a thread dials a fresh authenticated connection back (role
"backend", session = that id), connects it to `target`, and pumps bytes both ways, verbatim, as each socket
read returns them (TCP_NODELAY on both sockets). At most MAX_DIALS dial-backs are in their handshake at
once, so a burst of clients never floods the relay's handshake table from this host.

Users: node 0's torchrun agent (the rendezvous store, launch/torchrun/relay_rendezvous.py) and rank 0's API
server (serve.via_relay, launch/serve/via_relay.py). Standard library and netbridge.auth/link only.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from netbridge import auth
from netbridge.link import DIAL, HEARTBEAT, LinkClosed, LinkGarbage, LinkSocket, LinkTimeout

log = logging.getLogger("tandem.backend")

HEARTBEAT_S = 5.0  # well inside the relay's --idle-timeout-s (30 s)
MAX_DIALS = 8  # dial-backs in their handshake at once: half the relay's default --max-pending-per-source
RETRY_S = (0.2, 5.0)  # re-registering: the first wait and the longest, doubling


def store_service(token: str) -> str:
    """The service name under which node 0's agent registers the rendezvous store of `token`."""
    return f"store:{token}"


def api_service(run: str) -> str:
    """The service name under which rank 0 registers a run's API (serve.via_relay)."""
    return f"api:{run}"


class Backend:
    """A registered service: `.registered` is set while the relay knows it; `.close()` ends the control
    connection and every connection it spliced."""

    def __init__(self, relay: str, token: bytes, service: str, target: tuple[str, int], dial_timeout_s: float = 10.0):
        auth.check_session(service)
        self.relay, self.token, self.service, self.target = relay, token, service, target
        self.dial_timeout_s = dial_timeout_s
        self.registered = threading.Event()
        self.spliced = 0  # connections dialed back, all time (for tests and logs)
        self._closed = threading.Event()
        self._dials = threading.BoundedSemaphore(MAX_DIALS)
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._control: LinkSocket | None = None
        self._thread = threading.Thread(target=self._run, name=f"tandem-backend {service}", daemon=True)
        self._thread.start()

    # ---- the control connection ----------------------------------------------------------------
    def _run(self) -> None:
        wait_s, last_error = RETRY_S[0], None
        while not self._closed.is_set():
            try:
                sock = auth.dial(self.relay, self.token, self.service, auth.ROLE_SERVICE, 0, 0, self.dial_timeout_s,
                                 what=f"service {self.service}")
            except auth.HandshakeError as e:
                if str(e) != last_error:  # one line per distinct failure, not one per retry
                    log.warning("tandem: cannot register %s at the relay (%s); retrying", self.service, e)
                    last_error = str(e)
                self._closed.wait(wait_s)
                wait_s = min(RETRY_S[1], wait_s * 2)
                continue
            wait_s, last_error = RETRY_S[0], None
            why = self._serve_dials(LinkSocket(sock, self.relay, send_timeout_s=self.dial_timeout_s))
            if not self._closed.is_set():
                log.warning("tandem: the relay %s lost service %s (%s); registering again", self.relay, self.service, why)

    def _serve_dials(self, link: LinkSocket) -> str:
        """DIAL frames until the link ends (returns why) or close()."""
        with self._lock:
            self._control = link
        self.registered.set()
        try:
            while not self._closed.is_set():
                kind, body = link.recv(link.last_rx + 3 * HEARTBEAT_S, self._keep_alive(link), tick=0.5)
                if kind == DIAL:
                    threading.Thread(target=self._dial_back, args=(body.decode("ascii", "replace"),), daemon=True).start()
                elif kind != HEARTBEAT:
                    return f"unexpected frame type {kind}"
        except LinkTimeout:
            return f"no answer to heartbeats for {3 * HEARTBEAT_S:g} s"
        except (LinkClosed, LinkGarbage) as e:
            return str(e) or "closed"
        except OSError as e:
            return e.strerror or type(e).__name__
        finally:
            self.registered.clear()
            with self._lock:
                self._control = None
            link.close()
        return "closed"

    def _keep_alive(self, link: LinkSocket):
        def on_wait(now: float) -> None:
            if self._closed.is_set():
                raise LinkClosed(False, "closed")
            if now - link.last_tx >= HEARTBEAT_S:
                link.try_heartbeat()
        return on_wait

    # ---- one client: dial back, connect the target, pump -----------------------------------------
    def _dial_back(self, conn_id: str) -> None:
        with self._dials:
            try:
                remote = auth.dial(self.relay, self.token, conn_id, auth.ROLE_BACKEND, 0, 0, self.dial_timeout_s,
                                   what=f"a dial-back of service {self.service}")
            except auth.HandshakeError as e:
                log.warning("tandem: dial-back for %s failed: %s", self.service, e)
                return
        try:
            local = socket.create_connection(self.target, timeout=self.dial_timeout_s)
        except OSError as e:
            log.warning("tandem: service %s: cannot connect to its target %s:%d (%s); the client is closed",
                        self.service, *self.target, e.strerror or type(e).__name__)
            remote.close()
            return
        for sock in (local, remote):
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self._closed.is_set():
                local.close()
                remote.close()
                return
            self._socks.update((local, remote))
            self.spliced += 1
        splice(local, remote, on_end=self._forget)

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            self._socks.difference_update(socks)

    def drain(self, timeout_s: float) -> None:
        """Wait, at most `timeout_s`, until every connection dialed back has ended (its client closed it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._socks:
                    return
            time.sleep(0.05)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            socks, control = list(self._socks), self._control
            self._socks.clear()
        if control is not None:
            shut(control.sock)  # its thread, blocked in poll, sees the end and closes it
        for sock in socks:
            shut(sock)
        self._thread.join(5)


def serve_through_relay(relay: str, token: bytes, service: str, target: tuple[str, int], dial_timeout_s: float = 10.0) -> Backend:
    """Register `service` at `relay` (HOST:PORT, with the relay `token`) and splice each of its clients to
    `target` (host, port) on this host, until the handle's `.close()`."""
    return Backend(relay, token, service, target, dial_timeout_s)


# ---- a splice of two sockets, one thread per direction ----------------------------------------------
def splice(a: socket.socket, b: socket.socket, on_end=None) -> None:
    """Pump bytes a -> b and b -> a, each read sent on as it came; when either side ends, both close."""
    done = threading.Barrier(2, action=(lambda: on_end(a, b)) if on_end else None)
    for src, dst in ((a, b), (b, a)):
        threading.Thread(target=_pump, args=(src, dst, done), name="tandem-splice", daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket, done: threading.Barrier | None = None) -> None:
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        shut(src)
        shut(dst)
        if done is not None:
            try:
                done.wait(30)
            except threading.BrokenBarrierError:
                pass
            src.close()


def shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
