"""How many drafts a round carries (K): fixed (spec.k), adaptive (spec.adaptive), or from costs (spec.k_from_costs).

spec.k_from_costs picks each round's K from what rounds have cost and how often drafts were kept.

A round with K drafts commits, on average, 1 + sum_{j=1..K} prod_{i<=j} a_i tokens, where a_i is the
measured chance that draft i is accepted once drafts 1..i-1 were. Rank 0 works r0 = K x the drafter's
cost per token + its slice over a block of K+1; the later ranks and the wire take r1 = its slice over that
block + the round trip. Sequential rounds take r0 + r1. With spec.overlap, rank 0 prepares the next
round during the wait: a round whose bet holds (every draft and the guess accepted, chance h) costs
max(r0, r1), another r0 + max(r0, r1); K=0 has nothing to bet on and stays r0 + r1.
Block costs are measured per block size and interpolated between the sizes seen (a block's cost is
not a line in its size: on a CPU it doubles from 1 to 2 tokens, then flattens).

The chosen K maximises tokens per millisecond, within 0..k_max. A long round trip makes the fixed part
large, so K rises with delay; a block that costs much more than one token keeps K low, down to K=0
where drafting cannot pay (bf16 on a CPU without bf16 instructions: a block of 5 costs 5 tokens).
It starts on K=1 and K=0 (cheap rounds that fix the cost of small blocks); every `explore_every`-th
round then tries the best K's neighbour (one more draft, or one where K=0 wins), so block sizes and
positions not yet measured get measured, and a change (a repetitive stretch, a faster link) is seen.
An acceptance rate with few samples leans on the pooled rate of all positions, not on a fixed prior.
Any K is lossless: this decides speed only.

Three policies share one small interface (`k_policy` picks one from the settings): `first()` is a
generation's K, `bet(k_now, drafted)` the K of the round prepared ahead on the bet that this one is fully
accepted, `after(k_now, record, decode)` the K after a round (`decode`: not a generation's first round, which
carries the prompt and says nothing about K).

One K for every drafter kind: K bounds the model's steps; draft.kind=hybrid lets a lookup propose past it (up to
draft.lookup_k, a copy costing no drafting), and every policy sees looked-up and model-drafted rounds alike (by
what was drafted and accepted). So a copied stretch (lookups fully accepted) raises K under spec.adaptive; under spec.k_from_costs the drafting cost per token is the mean over the mix (a looked-up
round costs about nothing, the model round after it also takes in what the lookups committed), which is what a
round of K costs on average while the mix lasts.
"""
from __future__ import annotations


def ema(old: float | None, new: float, smoothing: float) -> float:
    """An exponential moving average's next value (the first sample as it is)."""
    return new if old is None else old + smoothing * (new - old)


def _at(points: dict[int, float], n: int) -> float:
    """The cost of a block of n from the sizes measured: interpolated between them, extended beyond
    them along the slope of the two nearest (never downwards)."""
    if n in points:
        return points[n]
    sizes = sorted(points)
    if len(sizes) == 1:
        return points[sizes[0]]
    below, above = [s for s in sizes if s < n], [s for s in sizes if s > n]
    a, b = (below[-1], above[0]) if below and above else (sizes[-2], sizes[-1]) if below else (sizes[0], sizes[1])
    slope = max(0.0, (points[b] - points[a]) / (b - a))
    return max(0.0, points[a] + slope * (n - a))


class FixedK:
    """K drafts every round (spec.k)."""

    def __init__(self, k_max: int):
        self.k_max = k_max

    def first(self) -> int:
        return self.k_max

    def bet(self, k_now: int, drafted: int) -> int:
        return k_now

    def after(self, k_now: int, record, decode: bool) -> int:
        return k_now


def next_k(k: int, drafted: int, accepted: int, k_max: int) -> int:
    """Draft more after a full hit, less after a miss (transformers' assisted-generation schedule):
    a miss means the later drafts were wasted work. Any K is lossless; only speed depends on it."""
    if drafted == 0:
        return k
    return min(k + 2, k_max) if accepted == drafted else max(k - 1, 1)


class AdaptiveK(FixedK):
    """spec.adaptive: K follows acceptance within 1..k (next_k), from spec.k at each generation's start."""

    def bet(self, k_now: int, drafted: int) -> int:
        return next_k(k_now, drafted, drafted, self.k_max)

    def after(self, k_now: int, record, decode: bool) -> int:
        return next_k(k_now, record.drafted, record.accepted, self.k_max)


def k_policy(k_max: int, adaptive: bool, from_costs: bool, overlap: bool):
    """The K policy the settings name (from_costs wins over adaptive); KFromCosts's estimates carry over
    generations, so a session keeps one policy for its life."""
    if from_costs and k_max > 0:
        return KFromCosts(k_max, overlap)
    return AdaptiveK(k_max) if adaptive else FixedK(k_max)


class KFromCosts:
    def __init__(self, k_max: int, overlap: bool = False, smoothing: float = 0.2, explore_every: int = 8):
        self.k_max, self.overlap, self.smoothing, self.explore_every = k_max, overlap, smoothing, explore_every
        self.warmup = [1, 0]  # the block sizes to measure first
        self.tried = [0] * (k_max + 2)  # [i]: decode rounds in which draft i was verified
        self.kept = [0] * (k_max + 2)  # [i]: ... and accepted
        self.draft_ms: float | None = None  # per draft token
        self.wire_ms: float | None = None
        self.stage0_ms: dict[int, float] = {}  # block size -> rank 0's slice, ms
        self.later_ms: dict[int, float] = {}  # block size -> the later ranks' slices, head and verification, ms
        self.seen = 0
        self.chosen = 0  # rounds chosen from the rates since the warm-up
        self.after_undrafted = False  # the last round drafted nothing: the next one's drafting includes catch-up

    def observe(self, r) -> None:
        """A decode round's RoundRecord (not the prefill round: it says nothing about K)."""
        for i in range(1, r.drafted + 1):
            self.tried[i] += 1
            self.kept[i] += r.accepted >= i
        n = r.drafted + 1
        self.later_ms[n] = ema(self.later_ms.get(n), r.later_ms, self.smoothing)
        self.wire_ms = ema(self.wire_ms, r.network_ms, self.smoothing)
        self.seen += 1
        if not r.from_ahead:  # else its drafting and stage 0 ran in the last round's wait, unmeasured here
            self.stage0_ms[n] = ema(self.stage0_ms.get(n), r.stage0_ms, self.smoothing)
            if r.drafted and not self.after_undrafted:
                self.draft_ms = ema(self.draft_ms, r.draft_ms / r.drafted, self.smoothing)
        self.after_undrafted = r.drafted == 0

    def _acceptance(self, prior_weight: float = 4.0) -> list[float]:
        """a_i, each position's rate shrunk toward the pooled rate of all positions (itself toward 1/2)."""
        pooled = (sum(self.kept) + 1) / (sum(self.tried) + 2)
        return [0.0] + [(self.kept[i] + prior_weight * pooled) / (self.tried[i] + prior_weight)
                        for i in range(1, self.k_max + 2)]

    def round_ms(self, k: int, bet_holds: float) -> float:
        """Expected ms of a round of K drafts; `bet_holds`: the chance that every draft and the
        drafter's guess of the next token are accepted (what overlap bets on)."""
        r0 = k * self.draft_ms + _at(self.stage0_ms, k + 1)
        r1 = _at(self.later_ms, k + 1) + self.wire_ms
        if not self.overlap or k == 0:
            return r0 + r1
        return (1 - bet_holds) * r0 + max(r0, r1)

    def rates(self) -> list[float]:
        """Expected tokens per ms of a round at each K in 0..k_max."""
        a = self._acceptance()
        rates, tokens, p = [], 1.0, 1.0
        for k in range(self.k_max + 1):
            if k:
                p *= a[k]
                tokens += p
            rates.append(tokens / max(self.round_ms(k, p * a[k + 1]), 1e-6))
        return rates

    def choose(self) -> int:
        """The K with the most expected tokens per ms; first the warm-up sizes, each once."""
        if self.seen < len(self.warmup):
            return self.warmup[self.seen]
        if self.draft_ms is None:  # nothing was ever proposed (an n-gram drafter without a match)
            return self.k_max
        rates = self.rates()
        best = max(range(self.k_max + 1), key=rates.__getitem__)
        self.chosen += 1
        if self.chosen % self.explore_every == 0:
            return best + 1 if best < self.k_max else best - 1
        return best

    # --- the K policy interface (FixedK) ---------------------------------------------------------
    def first(self) -> int:
        return self.choose()

    def bet(self, k_now: int, drafted: int) -> int:
        return k_now

    def after(self, k_now: int, record, decode: bool) -> int:
        if not decode:
            return k_now
        self.observe(record)
        return self.choose()
