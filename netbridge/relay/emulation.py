"""EMULATION: a WAN link between the two ranks of a session, on one host, for measuring (--emulate-delay-ms,
--emulate-mbps). Each direction is its own link: bytes serialize at the bandwidth, then propagate for the
delay, and arrive in order."""
from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from netbridge.delay import WireSchedule

if TYPE_CHECKING:
    from netbridge.relay.connection import Connection


class EmulatedLink:
    """The emulated link from one connection (the sender) to its peer."""

    def __init__(self, sender: Connection, delay_s: float, bytes_per_s: float, high_water: int):
        self.sender = sender
        self.wire = WireSchedule(delay_s * 1000, bytes_per_s * 8 / 1e6)  # the Channel's own emulation schedules alike
        self.high_water = high_water  # bytes on the line before the sender is paused, like a real socket's buffer
        self.line: deque = deque()  # (due time, bytes | None = close the receiver), in order
        self.line_bytes = 0
        self.timer = None

    def send(self, chunk: bytes) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        size = len(chunk)
        self.line.append((self.wire.arrival(now, size), chunk))
        self.line_bytes += size
        if self.line_bytes > self.high_water:
            self.sender.throttle("emulated-link", True)
        if self.timer is None:
            self.timer = loop.call_at(self.line[0][0], self._deliver)

    def is_busy(self) -> bool:
        return bool(self.line)

    def close_receiver_after_queued(self) -> None:
        """The sender left: the receiver is closed once what is on the wire has arrived."""
        self.line.append((self.line[-1][0], None))

    def _deliver(self) -> None:
        self.timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        peer = self.sender.peer
        while self.line and self.line[0][0] <= now:
            _, chunk = self.line.popleft()
            if chunk is None:
                if peer is not None:
                    peer.close_soon()
                continue
            self.line_bytes -= len(chunk)
            if peer is not None and peer.transport is not None and not peer.transport.is_closing():
                peer.transport.write(chunk)
        if self.line_bytes <= self.high_water // 4:
            self.sender.throttle("emulated-link", False)
        if self.line:
            self.timer = loop.call_at(self.line[0][0], self._deliver)
