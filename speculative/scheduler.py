"""Rank 0's scheduler (serve.max_concurrent): which KV slot a new stream gets, and which streams' fresh blocks go
out together now. The Session carries out what it decides.

Slots: every cache (each stage's, the drafter's) keeps a slot's tokens after its stream ends. A new prompt gets
the free slot holding its longest prefix (the next turn of a conversation), else the one unused longest; every
cache of that slot then rewinds to the common prefix and only the rest is prefilled.

Batches: the streams with nothing on the way are drafted for together and sent as a batch (one forward on every
rank). A batch holds at most a 1/batches_on_the_way share of the live streams, so that that many batches take
turns through the pipe: while one is on the wire or at a later rank, rank 0 drafts for another. Replies come back
in the order the blocks went out, so the oldest batch's streams are the next drafted for: round-robin.
"""
from __future__ import annotations

import math
import time

from speculative.in_flight import FixedDepth


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Scheduler:
    def __init__(self, count: int, batches_on_the_way: int = 2, depth=None):
        self.count = count
        self.batches_on_the_way = batches_on_the_way
        self.in_flight = depth or FixedDepth(1)  # spec.in_flight: rounds of a lone stream on the way (speculative.in_flight)
        self.held: list[list[int]] = [[] for _ in range(count)]  # per slot: the tokens its caches hold, in order
        self.last_used = [0.0] * count  # per slot: when it was last given to a stream
        self.live: dict = {}  # slot -> its live stream

    def free(self) -> int:
        return self.count - len(self.live)

    def take(self, prompt_ids: list[int]) -> tuple[int, int]:
        """A free slot for `prompt_ids` and how many of its first tokens that slot's caches hold (at least the
        prompt's last token is fed again: its logits give the first new token). Unknown until `give_back`."""
        free = [slot for slot in range(self.count) if slot not in self.live]
        if not free:
            raise RuntimeError(f"all {self.count} slots are in use; wait for a stream to end (Session.free())")
        slot = max(free, key=lambda i: (common_prefix(self.held[i], prompt_ids[:-1]), -self.last_used[i]))
        reuse = common_prefix(self.held[slot], prompt_ids[:-1])
        self.held[slot], self.last_used[slot] = [], time.perf_counter()
        return slot, reuse

    def give_back(self, slot: int, holds: list[int] | None) -> None:
        """`slot` is free again; its caches hold `holds` (None: nothing known, after a failure)."""
        del self.live[slot]
        self.held[slot] = holds or []

    def forget(self) -> None:
        """Every slot's prompt prefilled again from scratch (benchmarks: every request as the first one)."""
        self.held = [[] for _ in range(self.count)]

    def batches(self, ready: list, waiting: int) -> list[list]:
        """The batches to send now of the `ready` streams (nothing on the way), `waiting` batches being on the way: a
        prompt's first round alone (it carries up to spec.prefill_chunk tokens); the others in batches of the
        share, each sent when full or when fewer than batches_on_the_way are on the way (the pipe would idle).
        The rest wait for the next reply, so streams that fell out of step (a first round, a newcomer) are batched
        again."""
        most = max(1, math.ceil(len(self.live) / self.batches_on_the_way))
        batches = [[s] for s in ready if s.prefilling]
        rest = [s for s in ready if not s.prefilling]
        while rest and (len(rest) >= most or waiting + len(batches) < self.batches_on_the_way):
            batches.append(rest[:most])
            rest = rest[most:]
        return batches

    def depth(self) -> int:
        """How many rounds of a stream may be on the way: spec.in_flight's while it is alone; one while several
        streams fill the pipe (their rounds, not bets, use the wait)."""
        return self.in_flight.now() if len(self.live) == 1 else 1

    def observe(self, record) -> None:
        """A lone stream's round: what spec.in_flight=auto learns its depth from."""
        if len(self.live) == 1:
            self.in_flight.observe(record)
