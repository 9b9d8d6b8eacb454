"""spec.k_from_costs: each round's K from what rounds have cost and how often drafts were kept.

A round with K drafts commits, on average, 1 + sum_{j=1..K} prod_{i<=j} a_i tokens, where a_i is the
measured chance that draft i is accepted once drafts 1..i-1 were. It takes K x the drafter's cost per
token, plus both slices over a block of K+1 (a line fitted to the block sizes seen so far), plus the
wire. The chosen K maximises tokens per millisecond, within 1..k_max. A long round trip makes the
fixed part large, so K rises with delay; a block that costs much more than one token keeps K low.
Any K is lossless: this decides speed only.
"""
from __future__ import annotations


class KFromCosts:
    def __init__(self, k_max: int, warmup: int = 6, smoothing: float = 0.2):
        self.k_max, self.warmup, self.smoothing = k_max, warmup, smoothing
        self.tried = [0] * (k_max + 1)  # [i]: decode rounds in which draft i was verified
        self.kept = [0] * (k_max + 1)  # [i]: ... and accepted
        self.draft_ms: float | None = None  # per draft token
        self.wire_ms: float | None = None
        self.block_ms: dict[int, float] = {}  # block size -> both slices' ms
        self.seen = 0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def observe(self, r) -> None:
        """A decode round's RoundRecord (not the prefill round: it says nothing about K)."""
        for i in range(1, r.drafted + 1):
            self.tried[i] += 1
            self.kept[i] += r.accepted >= i
        if r.from_ahead:  # its drafting and stage 0 ran in the last round's wait
            return
        if r.drafted:
            self.draft_ms = self._ema(self.draft_ms, r.draft_ms / r.drafted)
        n = r.drafted + 1
        self.block_ms[n] = self._ema(self.block_ms.get(n), r.stage0_ms + r.stage1_ms)
        self.wire_ms = self._ema(self.wire_ms, max(0.0, r.round_ms - r.ahead_ms - r.stage1_ms))
        self.seen += 1

    def _acceptance(self) -> list[float]:
        a, last = [0.0], 0.5
        for i in range(1, self.k_max + 1):  # Laplace-smoothed; an untried position inherits the last one
            last = (self.kept[i] + 1) / (self.tried[i] + 2) if self.tried[i] else last
            a.append(last)
        return a

    def _block_line(self) -> tuple[float, float]:
        """(ms at 0, ms per token) of both slices, least squares over the block sizes seen."""
        points = list(self.block_ms.items())
        if len(points) == 1:
            return points[0][1], 0.0  # one size seen: assume flat, so a larger K gets tried and measured
        mean_n = sum(n for n, _ in points) / len(points)
        mean_ms = sum(ms for _, ms in points) / len(points)
        var = sum((n - mean_n) ** 2 for n, _ in points)
        slope = max(0.0, sum((n - mean_n) * (ms - mean_ms) for n, ms in points) / var)
        return mean_ms - slope * mean_n, slope

    def choose(self, fallback: int) -> int:
        """The K with the most expected tokens per ms; `fallback` until enough rounds were measured."""
        if self.seen < self.warmup or self.draft_ms is None:
            return fallback
        a, (base, per_token) = self._acceptance(), self._block_line()
        best_k, best_rate, tokens, p = 1, 0.0, 1.0, 1.0
        for k in range(1, self.k_max + 1):
            p *= a[k]
            tokens += p
            ms = k * self.draft_ms + base + per_token * (k + 1) + self.wire_ms
            if tokens / max(ms, 1e-6) > best_rate:
                best_k, best_rate = k, tokens / max(ms, 1e-6)
        return best_k
