"""How many rounds of one stream are on the way at once (spec.in_flight).

Rank 0 sends a block prepared on a bet (every draft before it accepted, the target's next token the
drafter's guess) without waiting for the reply that settles the bet; a failed bet costs the later
ranks the work on the blocks sent after it, nothing else (their replies are dropped). `auto` picks the
depth from what the rounds measure, through the pipeline's cost model (speculative.cost_model.best_depth:
a chain of blocks leaves rank 0 one every max(r0, the slowest later rank, trip / D) ms and breaks at each
block with chance 1 - h, h how often a bet held; rank 0 also prepares the blocks thrown away at each break).
r0: preparing a block (drafting + stage 0); trip: send -> reply, the wire and the later ranks. D = 1 is
today's spec.overlap. Deeper only pays when bets often hold
(h near 1: a drafter that is often right, a repetitive stretch) and the trip is long against r0 (a WAN);
where rank 0's block costs about a round trip (the embedded pair on a CPU: ~550 ms of drafting against a
~620 ms trip) the wasted blocks cost more than the wire saves. The smallest D within 5% of the best is
chosen, so `auto` only leaves 1 for a clear gain. Any depth is lossless.
Where the run has a start-up cost model (`model`: cost_model.Predictor.best_depth), the depth is its best at the
acceptance and bets measured (each rank's work, the ranks sharing a host's cores in a full pipe: one model for K,
the depth and the batches); without one, the rounds' own costs lumped as above. Measured the same over 40 and
150 ms, within noise over 0 ms (bench/README.md).
"""
from __future__ import annotations

from speculative import cost_model
from speculative.k_choice import ema


class FixedDepth:
    def __init__(self, depth: int):
        self.depth = depth

    def now(self) -> int:
        return self.depth

    def observe(self, record) -> None:
        pass


class DepthFromCosts:
    def __init__(self, overlap: bool = True, most: int = cost_model.DEPTH_MAX, smoothing: float = 0.2, warmup: int = 4, start: int = 1,
                 model=None):
        self.overlap, self.most, self.smoothing, self.warmup = overlap, most, smoothing, warmup
        self.model = model  # (K, most) -> the start-up cost model's best depth now (None: the lumped costs below)
        self.hold: float | None = None  # how often a bet held
        self.prep_ms: float | None = None  # r0: drafting + stage 0 of one block
        self.trip_ms: float | None = None  # send -> reply less rank 0's work in the wait
        self.slowest_ms = 0.0  # the slowest later rank's work on a block
        self.seen = 0
        # until measured, the start-up model's depth: a chain deepened after a request's first token fills in
        # the open (its first reply a whole trip away), where one sent in the first round's wait fills unseen
        self.depth = start

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
        self.slowest_ms = ema(self.slowest_ms, max([r.last_ms, *r.middle_ms]), self.smoothing)
        if self.seen >= self.warmup and None not in (self.hold, self.prep_ms):
            if self.model is None:
                self.depth = self.best()
            elif r.drafted:  # (a round of K = 0 has no bet to send on: its stream keeps its depth)
                self.depth = self.model(r.drafted, self.most)

    def pipeline(self) -> cost_model.Pipeline:
        """The cost model of what was measured: rank 0 preparing a block, the slowest later rank, the rest of the
        trip as one link; a bet holds as often as measured (one draft a round stands for any K: the depth's
        choice weighs kept rounds, and a round's tokens are the same at every depth)."""
        wire = max(self.trip_ms - self.slowest_ms, 0.0)
        ranks = (cost_model.RankCost(self.prep_ms), cost_model.RankCost(self.slowest_ms))
        return cost_model.Pipeline(ranks, (cost_model.LinkCost(wire), cost_model.LinkCost()),
                                   acceptance=cost_model.Acceptance(hold=self.hold), overlap=self.overlap)

    def rate(self, depth: int) -> float:
        """Kept rounds per ms at this depth (cost_model.kept_rounds_per_ms)."""
        return cost_model.kept_rounds_per_ms(self.pipeline(), 1, depth)

    def best(self) -> int:
        return cost_model.best_depth(self.pipeline(), 1, self.most)


def in_flight_policy(setting: int | str, overlap: bool, start: int = 1, model=None):
    """spec.in_flight: a fixed depth, or "auto" (DepthFromCosts, from `start` until rounds are measured; `model`
    the start-up cost model's best depth, where there is one)."""
    if setting == "auto":
        return DepthFromCosts(overlap, start=start, model=model)
    return FixedDepth(int(setting))
