"""How many rounds of one stream are on the way at once (spec.in_flight).

Rank 0 sends a block prepared on a bet (every draft before it accepted, the target's next token the
drafter's guess) without waiting for the reply that settles the bet; a failed bet costs the later
ranks the work on the blocks sent after it, nothing else (their replies are dropped). `auto` picks the
depth from what the rounds measure, with this model: a chain of blocks leaves rank 0 one every
delta = max(r0, trip / D) ms (r0: preparing a block; trip: send -> reply, the wire and the later ranks;
D rounds on the way at most), and breaks at each block with chance 1 - h (h: how often a bet held).
A chain of m + 1 kept rounds then lasts m * delta + trip + r0, so the rounds per ms the wire allows are

    wire(D) = 1 / (h * delta(D) + (1 - h) * (trip + r0))

and rank 0 itself prepares, per kept round, the round and, at each break (chance 1 - h), the blocks already
prepared beyond it, thrown away (D - 1 sent, and one held under spec.overlap: w(D) = D or D - 1):
rank0(D) = 1 / (r0 * (1 + (1 - h) * w(D))). The rate is the
smaller of the two. D = 1 is today's spec.overlap (delta = trip). Deeper only pays when bets often hold
(h near 1: a drafter that is often right, a repetitive stretch) and the trip is long against r0 (a WAN);
where rank 0's block costs about a round trip (the embedded pair on a CPU: ~550 ms of drafting against a
~620 ms trip) the wasted blocks cost more than the wire saves. The smallest D within 5% of the best is
chosen, so `auto` only leaves 1 for a clear gain. Any depth is lossless.
"""
from __future__ import annotations

from speculative.k_choice import ema


class FixedDepth:
    def __init__(self, depth: int):
        self.depth = depth

    def now(self) -> int:
        return self.depth

    def observe(self, record) -> None:
        pass


class DepthFromCosts:
    def __init__(self, overlap: bool = True, most: int = 4, smoothing: float = 0.2, warmup: int = 4):
        self.overlap, self.most, self.smoothing, self.warmup = overlap, most, smoothing, warmup
        self.hold: float | None = None  # how often a bet held
        self.prep_ms: float | None = None  # r0: drafting + stage 0 of one block
        self.trip_ms: float | None = None  # send -> reply less rank 0's work in the wait
        self.seen = 0
        self.depth = 1

    def now(self) -> int:
        return self.depth

    def observe(self, r) -> None:
        """A round's RoundRecord."""
        self.seen += 1
        if r.bet is not None:
            self.hold = ema(self.hold, float(r.bet), self.smoothing)
        if not r.from_ahead and r.drafted:
            self.prep_ms = ema(self.prep_ms, r.draft_ms + r.stage0_ms, self.smoothing)
        elif r.prepared:  # under spec.overlap nearly every block is prepared in a wait
            self.prep_ms = ema(self.prep_ms, r.ahead_ms / r.prepared, self.smoothing)
        self.trip_ms = ema(self.trip_ms, max(r.round_ms - r.ahead_ms, 0.0), self.smoothing)
        if self.seen >= self.warmup and None not in (self.hold, self.prep_ms):
            self.depth = self.best()

    def rate(self, depth: int) -> float:
        """Kept rounds per ms at this depth (the module's model)."""
        delta = max(self.prep_ms, self.trip_ms / depth)
        wire = 1.0 / max(self.hold * delta + (1 - self.hold) * (self.trip_ms + self.prep_ms), 1e-9)
        thrown = depth if self.overlap else depth - 1  # blocks prepared beyond a round whose bet fails
        rank0 = 1.0 / max(self.prep_ms * (1 + (1 - self.hold) * thrown), 1e-9)
        return min(wire, rank0)

    def best(self) -> int:
        rates = [self.rate(d) for d in range(1, self.most + 1)]
        return next(d for d, r in enumerate(rates, 1) if r >= 0.95 * max(rates))


def in_flight_policy(setting: int | str, overlap: bool):
    """spec.in_flight: a fixed depth, or "auto" (DepthFromCosts)."""
    if setting == "auto":
        return DepthFromCosts(overlap)
    return FixedDepth(int(setting))
