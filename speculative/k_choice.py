"""How many drafts a round carries (K): fixed (spec.k), adaptive (spec.adaptive), or from costs (spec.k_from_costs).

spec.k_from_costs picks each round's K from what rounds have cost and how often drafts were kept, through the
pipeline's cost model (speculative.cost_model): rank 0's drafting per draft token and its slice per block size,
the later ranks' slices per block size and the wire (one lumped link), per-position acceptance. The chosen K has
the most tokens/s of one stream (cost_model.stream_tokens_per_s at one round on the way: with spec.overlap a round
whose bet holds hides rank 0's work in the wait, K=0 has nothing to bet on), within 0..k_max. A long round trip
makes the fixed part large, so K rises with delay; a block that costs much more than one token keeps K low, down
to K=0 where drafting cannot pay (bf16 on a CPU without bf16 instructions: a block of 5 costs 5 tokens).
Block costs are measured per block size and interpolated between the sizes seen (a block's cost is not a line
in its size: on a CPU it doubles from 1 to 2 tokens, then flattens).

It starts on K=1 and K=0 (cheap rounds that fix the cost of small blocks); every `explore_every`-th
round of a stream then tries the best K's neighbour (one more draft, or one where K=0 wins), so block sizes and
positions not yet measured get measured, and a change (a repetitive stretch, a faster link) is seen. Counted per
stream (its KV slot): one count for all, with four streams taking turns, put every exploration on the same stream,
one round in two, and that stream ended a round after the rest (four clients at 150 ms: 0.94x a fixed K).
An acceptance rate with few samples leans on the pooled rate of all positions, not on a fixed prior.
Where the run has a start-up cost model (`model`: cost_model.Predictor.rates, every rank timed), K is that model's
best at the acceptance measured, and the rounds' own costs above serve only runs without one. A lone stream's K is
the best at its best depth spec.in_flight allows (auto: 1..DEPTH_MAX, jointly with the depth; from depth 1's rates
and then the depth at that K, one client over 0 ms drafted K=1-2 where K=4 ran faster); it still tries a neighbour
every explore_every-th round, and one draft before any is measured. While several streams are live (a round's
`live`), K is the one with the most tokens/s of them together: their rounds go out in batches with no bets to hide
drafting behind, each row of a draft step costs what the drafter's timing over rows says, and the measured block
costs above (each at whatever rows it ran) cannot tell a K=0 block of four rows from one of one: one stream's best
K=4 over 0 ms ran four 2,000-token streams at 0.61x the fixed K=0 (the K=0 so chosen still runs on the split placed
for spec.k: bench/README.md). A stream admitted at K=0 (first(streams, context)) leaves its prompt out of the
drafter; K > 0 for it again first takes in what its drafter lacks, so it is chosen only where the answer's tokens
left pay for that and for every other live stream's drafter lacking its prompt (pays_intake, the model's `intake`:
they choose alike), and so is a newcomer's first K over a prompt the drafter lacks, counting every prompt of its
burst (admitted with it: rank 0 takes each into the drafter before any first round goes, so each delays them all)
and the streams that will be live with it.
Any K is lossless: this decides speed only.

Three policies share one small interface (`k_policy` picks one from the settings): `first(streams, context, lag,
remaining)` is a generation's K (`streams` live with it, its prompt `context` tokens, `lag` of them not in the
drafter, its answer at most `remaining` tokens), `bet(k_tip, drafted, k_now)` the K of the
round prepared ahead on the bet that the chain's tip (a block of K = k_tip that drafted `drafted`) is fully
accepted, k_now the stream's K as its last reply left it, `after(k_now, record, decode, context, lag, remaining,
behind)` the K after a round (`decode`: not a generation's first round, which carries the prompt and says nothing
about K; `lag`: the tokens the stream's drafter lacks; `remaining`: the answer's tokens left; `behind`: the other
live streams' drafters lacking a prompt, Session.behind).

One K for every drafter kind: K bounds the model's steps; draft.kind=hybrid lets a lookup propose past it (up to
draft.lookup_k, a copy costing no drafting), and every policy sees looked-up and model-drafted rounds alike (by
what was drafted and accepted). So a copied stretch (lookups fully accepted) raises K under spec.adaptive; under spec.k_from_costs the drafting cost per token is the mean over the mix (a looked-up
round costs about nothing, the model round after it also takes in what the lookups committed), which is what a
round of K costs on average while the mix lasts.
"""
from __future__ import annotations

from speculative import cost_model


def ema(old: float | None, new: float, smoothing: float) -> float:
    """An exponential moving average's next value (the first sample as it is)."""
    return new if old is None else old + smoothing * (new - old)


class FixedK:
    """K drafts every round (spec.k)."""

    def __init__(self, k_max: int):
        self.k_max = k_max

    def first(self, streams: int = 1, context: int | None = None, lag: int = 0, remaining: int | None = None,
              burst: tuple[int, ...] = ()) -> int:
        """A generation's K, `streams` live with it (its own included), its prompt `context` tokens, `lag` of them
        not in the drafter's cache, its answer at most `remaining` tokens; `burst`: the new tokens of the prompts
        admitted with it (before it, their first rounds not yet sent, or right after)."""
        return self.k_max

    def bet(self, k_tip: int, drafted: int, k_now: int) -> int:
        return k_tip

    def after(self, k_now: int, record, decode: bool, context: int | None = None, lag: int = 0,
              remaining: int | None = None, behind: tuple[tuple[int, int], ...] = ()) -> int:
        """The K of the stream's next round; `context` the tokens its caches hold, `lag` how many of them the
        drafter has not taken in, `remaining` the tokens its answer may still take; `behind`: (tokens lacking,
        tokens held) of each other live stream whose drafter is behind by a prompt (not in_step)."""
        return k_now


def in_step(lag: int, k_max: int) -> bool:
    """Whether a drafter lacking `lag` tokens of its stream is in step (at most a round's tokens behind), not
    behind by a prompt it skipped at K=0."""
    return lag <= k_max + 1


def next_k(k: int, drafted: int, accepted: int, k_max: int) -> int:
    """Draft more after a full hit, less after a miss (transformers' assisted-generation schedule):
    a miss means the later drafts were wasted work. Any K is lossless; only speed depends on it."""
    if drafted == 0:
        return k
    return min(k + 2, k_max) if accepted == drafted else max(k - 1, 1)


class AdaptiveK(FixedK):
    """spec.adaptive: K follows acceptance within 1..k (next_k), from spec.k at each generation's start."""

    def bet(self, k_tip: int, drafted: int, k_now: int) -> int:
        return next_k(k_tip, drafted, drafted, self.k_max)

    def after(self, k_now: int, record, decode: bool, context: int | None = None, lag: int = 0,
              remaining: int | None = None, behind: tuple[tuple[int, int], ...] = ()) -> int:
        drafted, accepted = record.drafted, record.accepted
        if not record.looked_up:  # by the K it asked for: a batch drafts past it for free (blocks.widths), and a
            drafted, accepted = min(drafted, k_now), min(accepted, k_now)  # miss among those says nothing of its K
        return next_k(k_now, drafted, accepted, self.k_max)


def k_policy(k_max: int, adaptive: bool, from_costs: bool, overlap: bool, model=None, intake=None,
             admission_intake=None):
    """The K policy the settings name (from_costs wins over adaptive); KFromCosts's estimates carry over
    generations, so a session keeps one policy for its life. `model`, `intake`, `admission_intake`: KFromCosts's
    rates and the drafter's intake from the start-up cost model (cost_model.Predictor.rates, .intake_ms,
    .admission_intake_ms), where the run has one."""
    if from_costs and k_max > 0:
        return KFromCosts(k_max, overlap, model=model, intake=intake, admission_intake=admission_intake)
    return AdaptiveK(k_max) if adaptive else FixedK(k_max)


class KFromCosts:
    def __init__(self, k_max: int, overlap: bool = False, smoothing: float = 0.2, explore_every: int = 8,
                 model=None, intake=None, admission_intake=None):
        self.k_max, self.overlap, self.smoothing, self.explore_every = k_max, overlap, smoothing, explore_every
        # (k_max, streams, context) -> the start-up cost model's tokens/s at each K in 0..k_max: one stream's at its
        # best depth, or `streams` together (None: the rates of the rounds' own costs below, any number of streams)
        self.model = model
        self.intake = intake  # (tokens, context) -> the model's ms for the drafter to take in tokens it lacks
        # (tokens, the burst's other prompts) -> what taking a newcomer's tokens in then (and the burst's) adds to
        # the first tokens
        self.admission_intake = admission_intake
        self.warmup = [1, 0]  # the block sizes to measure first
        self.tried = [0] * (k_max + 2)  # [i]: decode rounds in which draft i was verified
        self.kept = [0] * (k_max + 2)  # [i]: ... and accepted
        self.draft_ms: float | None = None  # per drafter step (K drafts: K + 1 steps' worth, pipeline)
        self.wire_ms: float | None = None
        self.stage0_ms: dict[int, float] = {}  # block size -> rank 0's slice, ms
        self.later_ms: dict[int, float] = {}  # block size -> the later ranks' slices, head and verification, ms
        self.seen = 0
        self.chosen: dict[int, int] = {}  # per KV slot: its rounds' K chosen from the rates since the warm-up
        self.after_undrafted = False  # the last round drafted nothing: the next one's drafting includes catch-up
        # the model's K (k_modelled): the last one worked out, for which (streams, context // 1024), how many
        # rounds ago
        self.modelled_k, self.modelled_key, self.modelled_age = 0, None, 0
        self.modelled_rates: list[float] = []

    def observe(self, r) -> None:
        """A decode round's RoundRecord (not the prefill round: it says nothing about K)."""
        cost_model.tally(self.tried, self.kept, r.drafted, r.accepted)
        n = r.drafted + 1
        self.later_ms[n] = ema(self.later_ms.get(n), r.later_ms, self.smoothing)
        self.wire_ms = ema(self.wire_ms, r.network_ms, self.smoothing)
        self.seen += 1
        if not r.from_ahead:  # else its drafting and stage 0 ran in the last round's wait, unmeasured here
            self.stage0_ms[n] = ema(self.stage0_ms.get(n), r.stage0_ms, self.smoothing)
            if r.drafted and not self.after_undrafted:  # K drafts in K + 1 steps' worth (pipeline)
                self.draft_ms = ema(self.draft_ms, r.draft_ms / (r.drafted + 1), self.smoothing)
        self.after_undrafted = r.drafted == 0

    def _acceptance(self, prior_weight: float = 4.0) -> cost_model.Acceptance:
        """a_i, each position's rate shrunk toward the pooled rate of all positions (itself toward 1/2)."""
        return cost_model.Acceptance.from_counts(self.tried, self.kept, prior_weight)

    def pipeline(self) -> cost_model.Pipeline:
        """The cost model of what was measured: rank 0 (drafting, its slice per block size), the later ranks as
        one stage (their slices per block size), the wire as one link. K drafts cost K + 1 drafter steps' worth: a
        block on a bet drafts the guess of the next token too, and a fresh round's first step takes in the tokens the
        last reply committed (at 0 ms, the tiny model: 4.5-4.8 ms for one draft where a step in a chain is ~2.3).
        Counted as K steps, K=1 read 620 tokens/s at 0 ms where its rounds ran at ~290, against ~380 at K=4, and
        `auto` chose K=1."""
        ranks = (cost_model.RankCost(0.0, by_tokens=self.stage0_ms), cost_model.RankCost(0.0, by_tokens=self.later_ms))
        links = (cost_model.LinkCost(self.wire_ms), cost_model.LinkCost())
        draft = cost_model.DraftCost(self.draft_ms, extra_steps=1)
        return cost_model.Pipeline(ranks, links, draft, self._acceptance(), overlap=self.overlap)

    def rates(self) -> list[float]:
        """Expected tokens per ms of a round at each K in 0..k_max (one round on the way)."""
        p = self.pipeline()
        return [cost_model.stream_tokens_per_s(p, k, 1) / 1000 for k in range(self.k_max + 1)]

    def choose(self, slot: int | None = 0) -> int:
        """The K with the most expected tokens per ms for the next round of the stream in `slot` (every
        explore_every-th of its rounds: a neighbour; None: a stream's first K, never a neighbour); first the
        warm-up sizes, each once."""
        if self.seen < len(self.warmup):
            return self.warmup[self.seen]
        if self.draft_ms is None:  # nothing was ever proposed (an n-gram drafter without a match)
            return self.k_max
        rates = self.rates()
        return self.explored(max(range(self.k_max + 1), key=rates.__getitem__), slot)

    def explored(self, best: int, slot: int | None) -> int:
        """`best`, or on every explore_every-th round of the stream in `slot` its neighbour (None: never)."""
        if slot is None:
            return best
        self.chosen[slot] = self.chosen.get(slot, 0) + 1
        if self.chosen[slot] % self.explore_every == 0:
            return best + 1 if best < self.k_max else best - 1
        return best

    # --- the K policy interface (FixedK) ---------------------------------------------------------
    def first(self, streams: int = 1, context: int | None = None, lag: int = 0, remaining: int | None = None,
              burst: tuple[int, ...] = ()) -> int:
        """The model's K for the newcomer, or 0 where its answer is too short to pay for the drafter taking in the
        prompt: what that adds to the first tokens (admission_intake: the model's with the intake less without; the
        drafter takes each chunk in while the later ranks work on it, and in a `burst` rank 0 takes in every prompt
        of it before any first round goes) against the decoding its drafts save."""
        if self.model is None:
            return self.choose(None)
        best = self.k_modelled(streams, context)
        if best and not in_step(lag, self.k_max) and self.admission_intake is not None and not self.pays_intake(
                best, streams, remaining, self.admission_intake(lag, burst)):
            return 0
        return best

    def bet(self, k_tip: int, drafted: int, k_now: int) -> int:
        """The K chosen after the stream's last reply: a chain goes on while its bets hold, and the tip's K held
        every block of it at the K it began with (the embedded pair at K=1, its warm-up's, through a whole request
        whose rates said K=3 or 4: 5.4 tokens/s where the fixed K=4 measured 12.1)."""
        return k_now

    def after(self, k_now: int, record, decode: bool, context: int | None = None, lag: int = 0,
              remaining: int | None = None, behind: tuple[tuple[int, int], ...] = ()) -> int:
        """The K of the stream's next round (FixedK.after). A stream whose drafter lacks its prompt drafts again
        only where the answers left pay for every such stream's intake: the others live beside it choose alike, and
        rank 0 takes each prompt in while every stream waits (four 2,000-token prompts over 150 ms, each weighing
        its own 19 s against the four streams' gain turned to K > 0 and decoded at 0.25x the fixed K=4)."""
        if not decode:
            return k_now
        self.observe(record)
        if self.model is None:
            return self.choose(record.slot)
        best = self.k_modelled(record.live, context)
        if best and not in_step(lag, self.k_max) and self.intake is not None and not self.pays_intake(
                best, record.live, remaining, sum(self.intake(lacking, held) for lacking, held in (
                    (lag, max((context or lag) - lag, 0)), *behind))):
            return 0
        # (a lone stream still explores: a drafter never right at first may come right later)
        return self.explored(best, record.slot) if record.live == 1 else best

    def pays_intake(self, k: int, streams: int, remaining: int | None, intake_ms: float) -> bool:
        """Whether drafting K pays for first taking in the tokens the stream's drafter lacks (a prompt it skipped
        while its K was 0, or a newcomer's), which costs `intake_ms`: the answer's `remaining` tokens at K after
        the intake, against all of them at K=0. A stream left alone at the end of a batch's answers would take in
        its whole prompt for its last few rounds."""
        rates = self.modelled_rates
        if remaining is None or not rates or not rates[0] or not rates[k]:
            return True
        return remaining * streams / rates[k] + intake_ms / 1000 < remaining * streams / rates[0]

    def k_modelled(self, streams: int, context: int | None) -> int:
        """The model's best K for `streams` live (one: at its best depth), worked out again when their count or
        the context's thousand changes, or after explore_every rounds (the acceptance moves slowly): once for every
        stream's every round cost rank 0 ~0.18 ms each, ~15% of a four-row batch over 0 ms."""
        if not self.tried[1]:  # no draft measured yet: one, as the warm-up does (the model at the prior acceptance
            return 1  # may say K=0, which measures nothing until a neighbour is explored)
        key = (streams, None if context is None else context // 1024)
        self.modelled_age += 1
        if key != self.modelled_key or self.modelled_age > self.explore_every:
            rates = self.modelled_rates = self.model(self.k_max, streams, context)
            self.modelled_k = max(range(self.k_max + 1), key=rates.__getitem__)
            self.modelled_key, self.modelled_age = key, 1
        return self.modelled_k
