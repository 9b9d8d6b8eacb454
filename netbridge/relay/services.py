"""The dial-back, as bookkeeping: services registered by processes behind a NAT, and the client connections
waiting for one of them to dial back (netbridge.backend is the other side).

A process registers a service (role "service", session = its name: `store:<token>` for a run's rendezvous
store, `api:<run>` for a run's API) over a control connection. A client connection for that service (a store
pipe, a connection on --api-port) becomes a Splice with a fresh connection id; the relay sends DIAL with that
id over the control connection, the process dials back (role "backend", session = the id), and the Splice
joins the two connections: bytes verbatim both ways, never parsed. A client whose dial-back has not come
within DIAL_BACK_TIMEOUT_S is closed with a log line.

No sockets here: the ends of a Splice are the relay's connections, which it calls through `.tell`,
`.throttle`, `.close_soon` and `.drop`.
"""
from __future__ import annotations

import secrets
from typing import Any

from netbridge.backend import api_service, store_service  # noqa: F401  - the names both sides use
from netbridge.link import DIAL, HEADER

End = Any  # a connection the relay owns: .tell(bytes), .throttle(reason, on), .close_soon(), .drop(why), .session, .name

DIAL_BACK_TIMEOUT_S = 10.0  # a client waits this long for its service's process to dial back
EXPECTED_STORE_S = 60.0  # a finished rendezvous's store: its pipes wait this long for node 0 to register it


class Splice:
    """One client connection and, once it has come, the dial-back for it: what either sends goes to the other as
    it arrived. Until the dial-back is here the client's bytes are kept and the client is not read further (one
    socket read at most), and either side's full buffer stops reading the other (backpressure)."""

    def __init__(self, client: End, service: str, deadline: float):
        self.client, self.service, self.deadline = client, service, deadline
        self.conn_id = secrets.token_hex(8)
        self.backend: End | None = None
        self.backlog: list[bytes] = []
        self.asked = False  # DIAL went to the service's control connection

    def received(self, side: End, data: bytes) -> None:
        if side is self.backend:
            self.client.tell(data)
        elif self.backend is not None:
            self.backend.tell(data)
        else:
            self.backlog.append(data)
            self.client.throttle("dial-back", True)

    def join(self, backend: End) -> None:
        self.backend = backend
        for data in self.backlog:
            backend.tell(data)
        self.backlog.clear()
        self.client.throttle("dial-back", False)

    def full(self, side: End, on: bool) -> None:
        """`side`'s outgoing buffer is full (or drained): stop (resume) reading the other side."""
        other = self.client if side is self.backend else self.backend
        if other is not None:
            other.throttle("receiver", on)

    def end(self, side: End) -> None:
        """`side` left: the other is closed once what it was sent has gone out."""
        other = self.client if side is self.backend else self.backend
        if other is not None:
            other.close_soon()


class Services:
    """The registered services (name -> control connection) and the Splices waiting for a dial-back."""

    def __init__(self):
        self.controls: dict[str, End] = {}
        self.expected: dict[str, float] = {}  # stores announced by a rendezvous, not registered yet -> until when
        self.calls: dict[str, Splice] = {}  # connection id -> the Splice waiting for that dial-back

    def register(self, control: End) -> End | None:
        """`control` serves its session's service now; returns the control connection it replaces (a process
        that re-registers has given up its old link), for the server to drop."""
        self.expected.pop(control.session, None)
        old = self.controls.get(control.session)
        self.controls[control.session] = control
        return old if old is not control else None

    def leave(self, control: End) -> None:
        if self.controls.get(control.session) is control:
            del self.controls[control.session]

    def expect(self, service: str, until: float) -> None:
        self.expected[service] = until

    def known(self, service: str) -> bool:
        return service in self.controls or service in self.expected

    def call(self, splice: Splice) -> None:
        """`splice` waits for a dial-back: asked now if its service is registered, else when it registers."""
        self.calls[splice.conn_id] = splice
        control = self.controls.get(splice.service)
        if control is not None:
            self._ask(control, splice)

    def ask_waiting(self, control: End) -> None:
        """A service registered: the calls that waited for it are asked now."""
        for splice in list(self.calls.values()):
            if splice.service == control.session and not splice.asked:
                self._ask(control, splice)

    @staticmethod
    def _ask(control: End, splice: Splice) -> None:
        splice.asked = True
        conn_id = splice.conn_id.encode()
        control.tell(HEADER.pack(DIAL, len(conn_id)) + conn_id)

    def answer(self, conn_id: str) -> Splice | None:
        """The Splice a dial-back with `conn_id` is for (then no longer waiting), or None."""
        return self.calls.pop(conn_id, None)

    def forget(self, splice: Splice) -> None:
        self.calls.pop(splice.conn_id, None)

    def sweep(self, now: float) -> list[Splice]:
        """The calls whose dial-back did not come in time (forgotten: the server closes their clients), and the
        expected stores past their time."""
        late = [s for s in self.calls.values() if now > s.deadline]
        for splice in late:
            del self.calls[splice.conn_id]
        for service, until in list(self.expected.items()):
            if now > until:
                del self.expected[service]
        return late

    def api_services(self) -> list[str]:
        return sorted(name for name in self.controls if name.startswith("api:"))
