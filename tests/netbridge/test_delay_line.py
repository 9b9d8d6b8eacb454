"""The emulated delay line holds no sender (issues 28, 29): a message arrives transport.emulate_delay_ms after
it was sent, while the sender goes on at once; bandwidth is serialization time per direction, in order.
In-process (local_pair), so the Channel's own emulation is what is measured; once through the relay too,
since every transport inherits it from Channel."""
from __future__ import annotations

import threading
import time

import torch

from netbridge.channel import local_pair
from netbridge.delay import WireSchedule
from tests.support.relay_harness import pair, relay_process

DELAY_S = 0.15


def receive_times(channel, count: int) -> tuple[threading.Thread, list[float]]:
    """Receive `count` messages on a thread; the time each came out of recv."""
    times: list[float] = []

    def run():
        for _ in range(count):
            channel.recv("m")
            times.append(time.monotonic())
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, times


def assert_not_held_and_one_delay_each(a, b):
    t, arrived = receive_times(b, 2)
    sends = []
    for i in range(2):  # back to back
        t0 = time.monotonic()
        a.send("m", {"i": i}, x=torch.zeros(4))
        sends.append((t0, time.monotonic()))
    t.join(5)
    assert len(arrived) == 2
    for (started, returned), got in zip(sends, arrived):
        assert returned - started < DELAY_S / 5, "send waited out the delay: the sender is held"
        assert got - started >= DELAY_S - 0.005, "the message arrived before the emulated delay"
        assert got - started < 1.6 * DELAY_S, "the second message waited for the first one's delay too"


def test_the_sender_is_not_held_and_the_message_arrives_one_delay_after_its_send():
    assert_not_held_and_one_delay_each(*local_pair(timeout_s=10, emulate_delay_ms=DELAY_S * 1000))


def test_the_relay_channel_holds_no_sender_either(tmp_path):
    with relay_process(tmp_path, "--no-store") as relay:
        a, b = pair(relay, "delay-line", emulate_delay_ms=DELAY_S * 1000)
        try:
            assert_not_held_and_one_delay_each(a, b)
        finally:
            a.close()
            b.close()


def test_bandwidth_is_serialization_time_queued_in_order():
    """Two 200 kB messages at 16 Mbit/s (0.1 s each), back to back, 50 ms delay: arrivals at ~0.15 and
    ~0.25 s after the first send, and both sends return at once."""
    a, b = local_pair(timeout_s=10, emulate_delay_ms=50, emulate_mbps=16)
    payload = torch.zeros(50_000)  # 200 kB
    t, arrived = receive_times(b, 2)
    t0 = time.monotonic()
    a.send("m", x=payload)
    a.send("m", x=payload)
    sent_s = time.monotonic() - t0
    t.join(5)
    assert sent_s < 0.03, "the sender was held for the serialization time"
    first, second = (x - t0 for x in arrived)
    assert 0.14 <= first < 0.22 and 0.24 <= second < 0.33, (first, second)


def test_the_meta_stamp_never_reaches_the_caller_and_an_idle_link_adds_nothing():
    a, b = local_pair(timeout_s=10)
    a.send("m", {"k": 1})
    assert b.recv("m").meta == {"k": 1}
    a, b = local_pair(timeout_s=10, emulate_delay_ms=10)
    a.send("m", {"k": 1})
    assert b.recv("m").meta == {"k": 1}


def test_the_schedule_queues_serialization_and_adds_the_delay_once():
    wire = WireSchedule(delay_ms=100, mbps=8)  # 1 MB/s
    assert wire.arrival(0.0, 500_000) == 0.6  # 0.5 s on the wire, then 0.1 s of delay
    assert wire.arrival(0.0, 500_000) == 1.1  # waited for the first to leave the wire
    assert wire.arrival(5.0, 0) == 5.1  # an idle wire again
