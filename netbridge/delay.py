"""EMULATION of a WAN link (this kernel has no netem): when a message arrives, as a network decides it.

One direction of a link is a `WireSchedule`: a message handed over at `sent` first waits for the wire to
be free (the messages before it are still serializing, in order), then serializes at the bandwidth, then
propagates for the delay. The sender is never held: it hands the message over and goes on; only the
receiver waits, and only until the message's arrival. Two messages sent back to back both arrive about
one delay after their sends (not the second after two delays); on a capped link the second arrives one
serialization time after the first.

Pure arithmetic: the Channel (netbridge.channel, on receive) and the relay (netbridge.relay.emulation,
per forwarded chunk) both schedule with it, so the two emulations agree.
"""
from __future__ import annotations


class WireSchedule:
    """Arrival times of the messages of one direction, in the order they were sent."""

    def __init__(self, delay_ms: float = 0.0, mbps: float = 0.0):
        self.delay_s = delay_ms / 1000
        self.bytes_per_s = mbps * 1e6 / 8
        self.free_at = float("-inf")  # when the last message scheduled has left the wire (serialized)

    @property
    def active(self) -> bool:
        return bool(self.delay_s or self.bytes_per_s)

    def serialization_s(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_s if self.bytes_per_s else 0.0

    def arrival(self, sent: float, nbytes: int) -> float:
        """When a message of `nbytes` handed over at `sent` (seconds, any clock) has arrived: after the
        ones before it have serialized, its own serialization, and the delay."""
        wire_done = max(sent, self.free_at) + self.serialization_s(nbytes)
        self.free_at = wire_done
        return wire_done + self.delay_s
