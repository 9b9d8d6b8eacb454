"""EMULATION: a WAN link between the two ranks of a session, on one host, for measuring (--emulate-delay-ms,
--emulate-mbps). Each direction is its own link: bytes serialize at the bandwidth, then propagate for the
delay, and arrive in order (netbridge.delay.WireSchedule, the Channel's own emulation schedules alike).

It knows no connection: chunks go out through the `deliver` callback its owner gives it, and `hold(True)`
asks the owner to stop reading from the sender while too much is on the line."""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable

from netbridge.delay import WireSchedule


class EmulatedLink:
    """One direction of an emulated link. `deliver(chunk)` at each chunk's arrival (None: close the receiver)."""

    def __init__(self, delay_ms: float, mbps: float, high_water: int, deliver: Callable[[bytes | None], None],
                 hold: Callable[[bool], None]):
        self.wire = WireSchedule(delay_ms, mbps)
        self.high_water = high_water  # bytes on the line before the sender is paused, like a real socket's buffer
        self.deliver, self.hold = deliver, hold
        self.line: deque = deque()  # (due time, bytes | None = close the receiver), in order
        self.line_bytes = 0
        self.timer = None

    def send(self, chunk: bytes) -> None:
        loop = asyncio.get_running_loop()
        self.line.append((self.wire.arrival(loop.time(), len(chunk)), chunk))
        self.line_bytes += len(chunk)
        if self.line_bytes > self.high_water:
            self.hold(True)
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
        while self.line and self.line[0][0] <= now:
            _, chunk = self.line.popleft()
            if chunk is not None:
                self.line_bytes -= len(chunk)
            self.deliver(chunk)
        if self.line_bytes <= self.high_water // 4:
            self.hold(False)
        if self.line:
            self.timer = loop.call_at(self.line[0][0], self._deliver)
