"""One cost model of the pipeline: what a round costs, what it yields, and the settings that follow.

Plain numbers in, plain numbers out (no torch): every figure is measured (the placement's timing at start-up,
draft.quant=auto's draft steps, the handshake's link probe, the rounds themselves) or, before it is, a prior.

The pieces, for a ring of N ranks (rank 0 drafts and runs the first slice; link i carries rank i's output to
rank i+1, the last link the last rank's reply back to rank 0):

    RankCost    a stage's ms for a block of rows x tokens: fixed + per row + per token (rows x tokens)
    DraftCost   rank 0's drafter: ms per draft token at 1 row, more per extra row; ms per token taken in (prefill)
    LinkCost    one link: one-way latency (ms), bandwidth (Mbit/s; a block's bytes cross at that rate), and the
                CPU a message right behind another costs each of its two ends (ms)
    Acceptance  a_i, the chance draft i is kept once drafts 1..i-1 were (a prior until rounds are measured)
    Pipeline    all of them, plus the bytes a token's hidden state puts on a forward link

A round of K drafts for `rows` streams (round_parts):
    prep  = rank 0's work: K drafter steps + its slice over a block of K+1
    trip  = send -> reply: every forward link and later rank in turn, and the reply link
    busiest = the most any one resource (rank 0's prep, a later rank, a link's transfer) spends on it
A batch is one frame on each link, whatever its rows (its Rounds forward, its Replies back: Channel.send_all), and
a frame costs its two ends CPU (LinkCost.message_ms): each rank is busy its two links' message_ms more a round. A
lone frame's cost is inside the link's measured latency, so a round in turn pays nothing more; a full pipe (several
batches, a chain of bets) pays every frame.
A round commits tokens_per_round(K) = 1 + sum_j prod_{i<=j} a_i tokens per stream.

One stream with D rounds on the way (stream_tokens_per_s; spec.overlap, spec.in_flight): rank 0 sends blocks
prepared on a bet (every draft and the drafter's guess of the next token kept: chance h = bet_holds(K), counted
from the bets once rounds are sent on them, Predictor); a
chain of blocks leaves rank 0 every delta = max(prep, busiest later resource, trip / D) and breaks with chance
1 - h. A lost bet costs prep + max(trip, w prep), w the blocks thrown away at a lost bet (D under overlap, D - 1
without): rank 0 sends the fresh block and prepares w more on bets before it reads the reply (at 150 ms, the
embedded pair after a 2,000-token prompt at K=4, depth 3: 1,175 ms from the fresh block's send to its reply read,
where the trip is 663 and three blocks' preparing, every rank at once, 1,170). Kept rounds per ms the pipe
allows: 1 / (h delta + (1 - h) lost); rank 0 allows 1 / (prep (1 + (1 - h) w)). The rate is the smaller.
Without overlap and D = 1, or K = 0 (nothing to bet on), rounds run in turn: prep + trip.
A chain deepened while a request runs (spec.in_flight=auto) pays once for filling: the rounds added reply a trip
after they go, the old pace until then (deepening_ms).

B streams in G batches taking turns (aggregate_tokens_per_s; serve.max_concurrent, BatchCount): each batch
holds ceil(B / G) rows; G batches cycle in max(G x busiest, prep + trip), every stream committing one round's
tokens per cycle (no bets while several streams fill the pipe).

TTFT of a P-token prompt (ttft_s): the prompt crosses in chunks of `chunk` tokens, pipelined: rank 0 runs its
slice over chunk j+1 (and the drafter takes chunk j in) while chunk j crosses a link or a later rank; a link's
transfer occupies it, its latency does not; each chunk, a message, keeps the ranks at its two ends busy
LinkCost.message_ms more. The first token comes back on the reply link after the last chunk,
which the first round carries with no drafts (the token they would follow is not known yet).
A chunk after c cached tokens costs its block plus attention, attend_ms x tokens x (c + tokens / 2) (on a CPU
that is most of a 2k prompt's cost for a small model); the drafter takes every chunk in too. Prompts that came
together queue: the engine prefills each on admission, then sends the first rounds in the scheduler's batches
and takes their replies after its work in the wait (first_tokens_s: each one's first token, from the chunks of
every one admitted before, `ahead`, on). A stream already decoding when a prompt is admitted waits for it
(held_s): rank 0 prefills the newcomer on admission, and each later rank takes its chunks before the rounds sent
behind them, so the stream's next reply comes about when the newcomer's first token does.

A decode round after c cached tokens (Pipeline.context; None: as timed) costs each stage's block and each drafter
step more per row-token per cached token beyond those its cost was timed after (RankCost / DraftCost.context_ms;
eager steps attend over the live length, the batch's longest row; each row beyond the first its own context_row_ms,
timed over several rows: a step over four rows is no four steps of one): a request's rounds are priced at its own
context (Predictor.tokens_per_s, for_rounds).

Ranks that compute at once slow each other where they share a host (its cores, its memory bandwidth): each rank
times a layer at start-up with every rank at once and again alone (launch/handshake.py), and the ratio is its
slowdown s (Pipeline.together; about 1 on a host of its own). One stream's ranks take turns: the costs alone. A
full pipe has every rank at work at once, each slowed while the others work (shared_ms: w + (s - 1) x min(w, the
others' work), the others' counted whatever host they are on): G >= 2 batches cycle in G x the busiest so slowed,
and a chain of bets leaves rank 0 every max(prep, later rank) so slowed (trip / D unchanged: a wire shares nothing).
Ranks on one host whose CPU work asks for more cores than it has (three one-thread ranks on two cores) cannot all
compute at once, however briefly each timed itself: a full pipe's cycle, a chain's step and a prefill pipelined
across the ranks (TTFT) take at least what the host's cores spend on them, each rank's work weighted by its share of
them (Pipeline.cores; host_ms). A small model's timings end before another rank's begin, so the ratio above reads 1
there (the tiny model's three ranks over two cores: four streams at K=0 over 0 ms measured 1.3-1.6x slower than
predicted without this). A prefill's chunks are scheduled with the host's cores shared out among its ranks at work
at each moment, too (sharing_end): the bound counts the cores busy while the pipe fills and drains, when they idle.

Besides the forwards timed, each round costs the engine's own work (ENGINE_*: committing, sampling, verifying,
replying), more for each row of a batch (ENGINE_*_ROW_MS: each stream committed and answered, its messages read and
written), and a drafter step with more rows costs what the drafter's timing over rows says (DraftCost.row_ms).

In service each part runs at its own pace (Pace, PaceTally: what the ranks timed for it over what these costs
charge it), which on a host whose speed moves is not the pace it had at start-up: a request's prediction prices
its rounds at the pace they ran (for_rounds), the server's choices at its last rounds' (Predictor), and
`timed` gives the same at the costs as timed.

The choices (best_settings): K in 0..k_max and the depth in 1..depth_max that maximise one stream's tokens/s
(the smallest depth within DEPTH_MARGIN of the best: deeper only for a clear gain), and for B streams the
batch count in 1..batches_max that maximises the aggregate (ties go to more batches: a smaller batch's round
is never slower, and its per-row costs, unmeasured online, only favour it).
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field, replace

DEPTH_MAX = 4  # spec.in_flight=auto's deepest chain
DEPTH_MARGIN = 0.05  # a deeper pipe only for a clear gain: the smallest depth within 5% of the best
TIE = 1e-9  # relative: rates this close are equal (batch counts)
FRAME_BYTES = 256  # a message's header on the wire besides its tensors
REPLY_BYTES_PER_ROW = 128  # a reply per stream: the verdict and its token ids
# The engine's own work per round, which timing a stage's forward leaves out (measured in process, the tiny
# 8-layer model, where nothing else hides it): rank 0 commits, detokenizes and schedules, the last rank verifies
# and replies; each draft step samples its token besides the drafter's forward.
ENGINE_RANK0_MS, ENGINE_LAST_MS, ENGINE_STEP_MS = 0.8, 0.5, 0.3
# ... and a middle rank's (three ranks or more): reading the Round, running its slice, writing it on. Its process's
# CPU per round measured 1.21 ms where its three layers timed 0.6 (the tiny model over three ranks at K=0, one
# stream, 256 rounds: bench/rank_cpu.py; Intel Xeon, 2026-12-06), rank 0's 1.29 and the last rank's 1.33 within
# 0.1-0.2 ms of what the constants above give them.
ENGINE_MIDDLE_MS = 0.5
# ... and per row of a batch beyond the first (a traced run of the tiny model over two ranks at K=0, batches of 1
# and of 4 rows, 2026-12-05: rank 0 busy 1.61 -> 2.54 ms a batch, its forward 1.19 -> 1.64, so 0.16 ms a row
# besides it: committing, detokenizing and answering each stream; the last rank's verification 0.013 ms a row, and
# the round less the last rank's time 0.48 -> 0.66 ms: 0.06 a row, each row's Round and Reply read and written).
ENGINE_RANK0_ROW_MS, ENGINE_LATER_ROW_MS = 0.16, 0.07
PRIOR_ACCEPTANCE = 0.5  # a draft's chance to be kept before any is measured (pooled: (kept + 1) / (tried + 2))
SHARING_PASSES, SHARING_TOLERANCE = 12, 0.002  # first_tokens_s on crowded hosts: passes over the prefill, each
# timing a rank's work beside the other ranks' work as the pass before placed it (sharing_end), until each rank's
# last work ends within this share of where the pass before put it (eight or 64 chunks over three one-thread ranks
# on two cores: six passes more)
BET_PRIOR_WEIGHT = 1.0  # the bets measured lean on the position rates' product as on this many bets (Predictor)
PACE_PRIOR_ROUNDS = 4.0  # a part's pace leans on 1 (its start-up timing) as on this many rounds of it (PaceTally)
PACE_DECAY = 0.98  # a server's pace: each round's weight shrinks by this much a round after it (~50 rounds' memory)
PACE_BOUNDS = (0.25, 4.0)  # a pace beyond these is a broken timing, not the host


def _at(points: dict[int, float], n: int) -> float:
    """The value at n from the sizes measured: interpolated between them, extended beyond them along the
    slope of the two nearest (never downwards)."""
    if n in points:
        return points[n]
    sizes = sorted(points)
    if len(sizes) == 1:
        return points[sizes[0]]
    below, above = [s for s in sizes if s < n], [s for s in sizes if s > n]
    a, b = (below[-1], above[0]) if below and above else (sizes[-2], sizes[-1]) if below else (sizes[0], sizes[1])
    slope = max(0.0, (points[b] - points[a]) / (b - a))
    return max(0.0, points[a] + slope * (n - a))


def _beyond(context: int | None, timed: int) -> int:
    """Cached tokens beyond those a cost was timed after (negative: fewer; None: as timed)."""
    return 0 if context is None else context - timed


def _rows_context(first_ms: float, row_ms: float | None, rows: int) -> float:
    """`rows` rows' ms per cached token: the first row's, and each other's (None: the first's again). Timed, a
    row more costs another amount: the tiny model's layer over four rows of a 5-token block read 0.023-0.025 ms a
    row per 1,000 cached tokens a token, over one row 0.034-0.037 (its rows share each read of the weights;
    bench/draft_context.py --rows 4 --block 5, two runs); its drafter's step over four rows 0.033-0.035 a row, its
    real steps over one 0.026 (--rows 4, two runs)."""
    return first_ms + (rows - 1) * (first_ms if row_ms is None else row_ms)


def timed_chunk_ms(timed: dict[int, float], tokens: int, attend_ms: float, timed_context: int) -> float:
    """A chunk of `tokens` from chunks timed after `timed_context` cached tokens ({size: ms}), less the attention
    timed in them (over the cache and, causal, half the chunk): each size's less its own, interpolated between the
    sizes timed and extended beyond them (_at). Attention grows with the square of a chunk's tokens, the rest about
    linearly: the line through what is left holds beyond the largest size timed, where a line through the whole
    costs reads low (2,000 tokens at once against chunks timed up to 512)."""
    return _at({n: ms - attend_ms * n * (timed_context + n / 2) for n, ms in timed.items()}, tokens)


@dataclass(frozen=True)
class RankCost:
    """A stage's ms over a block of rows x tokens: fixed_ms + row_ms x rows + token_ms x rows x tokens.

    `by_tokens` ({block size: ms at one row}, measured per block size online) replaces the line at one row
    where given (a block's cost is no line in its size on a CPU: it doubles from 1 to 2 tokens, then
    flattens), interpolated between the sizes seen; each row beyond the first adds row_ms + token_ms x tokens."""
    fixed_ms: float
    token_ms: float = 0.0
    row_ms: float = 0.0
    by_tokens: dict[int, float] = field(default_factory=dict)
    attend_ms: float = 0.0  # ms per token per earlier token it attends to (a long prompt's chunks: not linear)
    context_ms: float = 0.0  # a decode block: ms per row-token per cached token beyond timed_context
    timed_context: int = 0  # the cached tokens the block above (and prefill_by_tokens' chunks) was timed after
    context_row_ms: float | None = None  # the same for each row beyond the first (None: as the first's)
    prefill_by_tokens: dict[int, float] = field(default_factory=dict)  # {chunk size: ms at one row after
    # timed_context cached tokens, its attention included}, timed alone: a prefill chunk's cost where given

    def ms(self, rows: int, tokens: int, context: int | None = None) -> float:
        """A block of rows x tokens; after `context` cached tokens (the batch's longest: every row attends over
        the live length), or, None, as timed."""
        one = _at(self.by_tokens, tokens) if self.by_tokens else self.fixed_ms + self.row_ms + self.token_ms * tokens
        block = one + (rows - 1) * (self.row_ms + self.token_ms * tokens)
        per_cached = _rows_context(self.context_ms, self.context_row_ms, rows)
        return max(block + tokens * per_cached * _beyond(context, self.timed_context), 0.0)

    def chunk_ms(self, tokens: int, context: int, rows: int = 1) -> float:
        """A prefill chunk of `tokens` after `context` cached ones (`rows` of them: first rounds sent as one
        batch): the block's cost, and attention over the cache and within the chunk (causal: half of it). Where
        chunks were timed (prefill_by_tokens), the block's at one row is theirs less the attention in them
        (timed_chunk_ms)."""
        attention = rows * self.attend_ms * tokens * (context + tokens / 2)
        if not self.prefill_by_tokens:
            return self.ms(rows, tokens) + attention
        timed = timed_chunk_ms(self.prefill_by_tokens, tokens, self.attend_ms, self.timed_context)
        return max(timed + (rows - 1) * (self.row_ms + self.token_ms * tokens) + attention, 0.0)


@dataclass(frozen=True)
class DraftCost:
    """Rank 0's drafter: step_ms per draft token at one row, row_ms more per extra row, and token_ms per prompt
    token taken in (prefill: the drafter catching up on each chunk). Zero: no drafter (a lookup costs nothing)."""
    step_ms: float = 0.0
    row_ms: float = 0.0
    token_ms: float = 0.0
    extra_steps: int = 0  # steps a drafting round takes besides its K (1: the guess of the next token, spec.overlap)
    attend_ms: float = 0.0  # prefill: ms per prompt token per earlier token (attention over its cache)
    context_ms: float = 0.0  # a step: ms per row per cached token beyond timed_context
    timed_context: int = 0
    context_row_ms: float | None = None  # the same for each row beyond the first (None: as the first's)
    prefill_by_tokens: dict[int, float] = field(default_factory=dict)  # {chunk size: ms taking in a chunk of them
    # after timed_context cached tokens}, timed alone: a prefill chunk's intake where given

    def round_ms(self, k: int, rows: int = 1, context: int | None = None) -> float:
        """A round of K drafts for `rows` streams (K = 0: no step), after `context` cached tokens (None: as timed)."""
        per_cached = _rows_context(self.context_ms, self.context_row_ms, rows)
        step = self.step_ms + (rows - 1) * self.row_ms + per_cached * _beyond(context, self.timed_context)
        return (k + self.extra_steps if k else 0) * max(step, 0.0)

    def prefill_ms(self, tokens: int, context: int = 0) -> float:
        """Taking in a chunk of `tokens` prompt tokens after `context` (the drafter's catch-up): one forward, a
        step's cost and each token's more. (Without the step, four 40-token prompts' first replies came 5-6 ms
        after their predicted TTFT at K=4 over 0 ms: the drafter takes each in in a call of its own.) Where chunks
        were timed (prefill_by_tokens), theirs less the attention in them (timed_chunk_ms; beyond the sizes timed too:
        a lagging drafter takes in all it lacks at once), and the attention of these tokens: no line
        through a step fits a quantized drafter, whose kernels change at a size (int8 over more than 16 rows
        dequantizes each weight: the embedded 0.5B drafter's layer over 40 tokens took 8.4 ms where the line through
        one token and 128 said 5.8)."""
        if tokens <= 0:
            return 0.0
        attention = self.attend_ms * tokens * (context + tokens / 2)
        if self.prefill_by_tokens:
            return timed_chunk_ms(self.prefill_by_tokens, tokens, self.attend_ms, self.timed_context) + attention
        return self.step_ms + tokens * self.token_ms + attention


@dataclass(frozen=True)
class LinkCost:
    """One link: one_way_ms latency, mbps bandwidth (Mbit/s; inf: unlimited), message_ms the CPU a frame costs
    each end beyond the first of several back to back (serialization, the channel's send and receive path: the
    link probe's burst; a lone frame's is in one_way_ms). A batch's rows travel as one frame."""
    one_way_ms: float = 0.0
    mbps: float = math.inf
    message_ms: float = 0.0

    def transfer_ms(self, nbytes: float) -> float:
        """The time `nbytes` occupy the link (its bandwidth), latency apart."""
        return 0.0 if math.isinf(self.mbps) else nbytes * 8 / (self.mbps * 1000)

    def ms(self, nbytes: float) -> float:
        return self.one_way_ms + self.transfer_ms(nbytes)


@dataclass(frozen=True)
class Acceptance:
    """a_i for draft positions 1.. (rates[i-1]); past the last measured, the last (or the prior). `hold`: the
    measured chance a bet holds at the current K, when measured directly (else the product of the rates)."""
    rates: tuple[float, ...] = ()
    prior: float = PRIOR_ACCEPTANCE
    hold: float | None = None

    def at(self, i: int) -> float:
        """a_i, i >= 1."""
        if not self.rates:
            return self.prior
        return self.rates[min(i, len(self.rates)) - 1]

    def bet_holds(self, k: int) -> float:
        """The chance every one of K drafts and the drafter's guess of the next token are kept."""
        if self.hold is not None:
            return self.hold
        return math.prod(self.at(i) for i in range(1, k + 2))

    @staticmethod
    def from_counts(tried: list[int], kept: list[int], prior_weight: float = 4.0) -> Acceptance:
        """From counts per position ([i]: rounds in which draft i was verified / kept; [0] unused): each rate
        shrunk toward the pooled rate of all positions (itself toward 1/2), so a position seldom tried leans
        on the others."""
        pooled = (sum(kept) + 1) / (sum(tried) + 2)
        return Acceptance(tuple((kept[i] + prior_weight * pooled) / (tried[i] + prior_weight)
                                for i in range(1, len(tried))), pooled)


def tally(tried: list[int], kept: list[int], drafted: int, accepted: int) -> None:
    """Count a round's verdict per position: draft i is verified only when drafts 1..i-1 were kept, so
    kept[i] / tried[i] is a_i given the ones before it (what tokens_per_round multiplies), not the chance that
    i drafts are kept (which would count each rejection again at every later position)."""
    for i in range(1, min(drafted, accepted + 1) + 1):
        tried[i] += 1
        kept[i] += accepted >= i


@dataclass(frozen=True)
class Pipeline:
    """A ring of N ranks: ranks[0] is rank 0's slice (its drafting is `draft`), links[i] rank i -> i+1 (links[-1]
    the reply to rank 0). hidden_bytes: one token's hidden state on a forward link (hidden_size x dtype bytes)."""
    ranks: tuple[RankCost, ...]
    links: tuple[LinkCost, ...]
    draft: DraftCost = DraftCost()
    acceptance: Acceptance = Acceptance()
    hidden_bytes: int = 0
    overlap: bool = True
    # per rank: how much slower its work runs while the other ranks compute at once (its start-up timing all at
    # once over the same timed alone: ranks sharing a host's cores or memory slow each other; ~1 on a host of its
    # own); () or a missing rank: 1. Only a full pipe pays it (several batches, rounds sent on a bet).
    together: tuple[float, ...] = ()
    context: int | None = None  # the cached tokens a decode round attends over (None: as timed; at_context)
    # per rank: its host (ranks of one host share its cores) and the share of that host's cores its work takes (its
    # threads over the cores; 0: it computes on a GPU); () or a missing rank: a host of its own, 0
    hosts: tuple[int, ...] = ()
    cores: tuple[float, ...] = ()

    def slowdown(self, r: int) -> float:
        return self.together[r] if r < len(self.together) else 1.0

    def link_bytes(self, i: int, rows: int, tokens: int) -> float:
        """The bytes a block of rows x tokens puts on link i."""
        if i == len(self.links) - 1:
            return FRAME_BYTES + rows * REPLY_BYTES_PER_ROW
        return FRAME_BYTES + rows * tokens * self.hidden_bytes


@dataclass(frozen=True)
class RoundParts:
    prep_ms: float  # rank 0: drafting + its slice
    trip_ms: float  # send -> reply: the links and the later ranks in turn
    busiest_ms: float  # the most one resource is busy with the round (rank 0's prep, a later rank, a link's
    # transfer; a rank's messages included)
    later_busiest_ms: float  # ... of the resources after rank 0
    full_prep_ms: float  # rank 0 busy with the round (its prep and messages) while every rank computes at once
    # (Pipeline.together)
    full_busiest_ms: float  # busiest_ms, every rank computing at once
    full_later_busiest_ms: float  # later_busiest_ms, every rank computing at once
    host_ms: float = 0.0  # the most one host's cores are busy with the round, every rank computing at once (host_ms)


@dataclass(frozen=True)
class Settings:
    k: int
    depth: int
    batches: int


@dataclass(frozen=True)
class Prediction:
    """What the start-up line and the telemetry say: one stream's tokens/s, the slots' aggregate, TTFT."""
    stream_tokens_per_s: float
    aggregate_tokens_per_s: float
    ttft_s: float
    prompt_tokens: int
    settings: Settings
    streams: int
    long_stream_tokens_per_s: float = 0.0  # the two rates once the prompt's tokens are cached (each round attends
    long_aggregate_tokens_per_s: float = 0.0  # over them: the rates above are at the context the costs were timed at)


def round_parts(p: Pipeline, k: int, rows: int = 1) -> RoundParts:
    """A round of K drafts for `rows` streams: rank 0's prep, the trip, the busiest resource."""
    tokens = k + 1
    prep = p.draft.round_ms(k, rows, p.context) + p.ranks[0].ms(rows, tokens, p.context)
    later = [r.ms(rows, tokens, p.context) for r in p.ranks[1:]]
    wires = [link.transfer_ms(p.link_bytes(i, rows, tokens)) for i, link in enumerate(p.links)]
    trip = sum(later) + sum(link.one_way_ms for link in p.links) + sum(wires)
    busy = [w + messages_ms(p, r) for r, w in enumerate([prep, *later])]  # a full pipe: every frame
    later_busiest = max([*busy[1:], *wires, 0.0])
    full = shared_ms(p, busy)
    full_prep, full_later = full[0], max([*full[1:], *wires, 0.0])
    host = host_ms(p, busy)
    return RoundParts(prep, trip, max(busy[0], later_busiest), later_busiest, full_prep,
                      max(full_prep, full_later, host), full_later, host)


def messages_ms(p: Pipeline, r: int) -> float:
    """What one frame on each of rank r's two links costs it: the one it receives on, the one it sends on
    (rank 0: the reply link, link 0; with two ranks both are the two directions of one channel)."""
    return p.links[r - 1].message_ms + p.links[r].message_ms


def shared_ms(p: Pipeline, works: list[float]) -> list[float]:
    """Each rank's work per round (alone) in a full pipe: slowed by its Pipeline.together while the others work
    too, which is at most as long as they do: work + (slowdown - 1) x min(work, the others' work)."""
    return [w + (p.slowdown(r) - 1) * min(w, sum(works) - w) for r, w in enumerate(works)]


def host_ms(p: Pipeline, works: list[float]) -> float:
    """The most one host's cores spend on the ranks' `works` (a round's, alone) when the ranks compute at once:
    the sum over its ranks of each one's work times its share of the host's cores (Pipeline.cores). Where the
    shares add to at most 1 (a core a rank, or GPUs) it is at most the busiest rank's work, and bounds nothing."""
    spent: dict[int, float] = {}
    for r, work in enumerate(works):
        host = p.hosts[r] if r < len(p.hosts) else -1 - r
        spent[host] = spent.get(host, 0.0) + work * (p.cores[r] if r < len(p.cores) else 0.0)
    return max(spent.values(), default=0.0)


def round_ms(p: Pipeline, k: int, rows: int = 1) -> float:
    """One round in turn: rank 0's prep, then send -> reply."""
    parts = round_parts(p, k, rows)
    return parts.prep_ms + parts.trip_ms


def tokens_per_round(acc: Acceptance, k: int) -> float:
    """Tokens one round of K drafts commits on average: 1 + sum_{j<=K} prod_{i<=j} a_i."""
    tokens, kept = 1.0, 1.0
    for i in range(1, k + 1):
        kept *= acc.at(i)
        tokens += kept
    return tokens


def kept_rounds_per_ms(p: Pipeline, k: int, depth: int) -> float:
    """One stream's rounds per ms with `depth` rounds on the way (the module's docstring)."""
    parts = round_parts(p, k, 1)
    prep, trip = parts.prep_ms, parts.trip_ms
    if k == 0 or (not p.overlap and depth == 1):
        return 1.0 / max(prep + trip, 1e-9)
    h = p.acceptance.bet_holds(k)
    delta = max(parts.full_prep_ms, parts.full_later_busiest_ms, parts.host_ms, trip / depth)  # they work at once
    thrown = depth if p.overlap else depth - 1
    # after a lost bet the fresh block goes, and rank 0 fills the chain again (blocks.use_the_wait) before it reads
    # the reply
    lost = prep + max(trip, thrown * parts.full_prep_ms)
    wire = 1.0 / max(h * delta + (1 - h) * lost, 1e-9)
    rank0 = 1.0 / max(parts.full_prep_ms * (1 + (1 - h) * thrown), 1e-9)
    return min(wire, rank0)


def chain_step_ms(p: Pipeline, k: int, depth: int) -> float:
    """How often a full chain of `depth` rounds replies while its bets hold: rank 0's prep, the busiest later rank
    (every rank at once), a host's cores or the trip / depth, whichever is slowest."""
    parts = round_parts(p, k, 1)
    return max(parts.full_prep_ms, parts.full_later_busiest_ms, parts.host_ms, parts.trip_ms / depth)


def deepening_ms(p: Pipeline, k: int, before: int, after: int) -> float:
    """What deepening a lone stream's chain from `before` rounds on the way to `after` costs beyond running at
    `after` all along: the rounds added go out at once, but their replies come a trip later, and until then the
    replies keep the old pace: trip x (1 - step(after) / step(before)). Depth 1 to D: the trip less one step."""
    if k == 0 or after <= before:
        return 0.0
    trip = round_parts(p, k, 1).trip_ms
    return trip * max(0.0, 1.0 - chain_step_ms(p, k, after) / chain_step_ms(p, k, before))


def drain_ms(p: Pipeline, k: int, rounds: int) -> float:
    """A lone stream's last `rounds` rounds, their blocks prepared before (nothing more is drafted once the
    answer's tokens are on the way): they reply a trip after the last of them went, one later-rank block apart,
    not one chain step each (at 0 ms a step is rank 0's prep, most of a round)."""
    parts = round_parts(p, k, 1)
    return max(parts.trip_ms, rounds * parts.later_busiest_ms) if rounds else 0.0


def stream_tokens_per_s(p: Pipeline, k: int, depth: int = 1) -> float:
    """One stream's tokens/s at K drafts a round and `depth` rounds on the way."""
    return 1000.0 * tokens_per_round(p.acceptance, k) * kept_rounds_per_ms(p, k, depth)


def aggregate_tokens_per_s(p: Pipeline, k: int, streams: int, batches: int = 1) -> float:
    """B streams' tokens/s together, in G batches taking turns (one stream: stream_tokens_per_s at depth 1)."""
    if streams <= 1:
        return stream_tokens_per_s(p, k, 1)
    batches = min(batches, streams)
    parts = round_parts(p, k, math.ceil(streams / batches))
    busiest = parts.full_busiest_ms if batches > 1 else parts.busiest_ms  # several batches: every rank at once
    cycle = max(batches * busiest, parts.prep_ms + parts.trip_ms)
    return 1000.0 * streams * tokens_per_round(p.acceptance, k) / max(cycle, 1e-9)


def chunks(prompt_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """A prompt's chunks as (tokens, context before them): all of `chunk` tokens but the last, which the first
    round carries."""
    count = max(1, math.ceil(prompt_tokens / chunk))
    return [(min(chunk, prompt_tokens - j * chunk), j * chunk) for j in range(count)]


def first_round_batches(lengths: list[int], chunk: int) -> list[list[int]]:
    """The first rounds of prompts admitted together, by index, in the batches the scheduler sends them in
    (Scheduler.first_rounds says why): shortest first, a row joining the last batch while the batch, padded to it,
    holds at most `chunk` tokens and its first row is at least 3/4 its length."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = lengths[i]
        if batches and (len(batches[-1]) + 1) * n <= chunk and 4 * lengths[batches[-1][0]] >= 3 * n:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def held_s(first_s: float, prefills: list[tuple[float, float]], trip_s: float = 0.0) -> float:
    """The time a stream whose first token comes at `first_s` waits behind the prompts admitted after it, each
    (admitted at, its first token at) on one clock: from its admission, or the stream's first token if later, to
    its first token less `trip_s`, the links' latency around the ring (the stream's own round crosses them too, as
    priced); prompts prefilled over the same time hold it once. (Four 2,000-token prompts admitted together over the
    embedded pair at K=4: their first tokens came over 7 s, and the first to have its token waited those 7 s for its
    next reply; priced as decode rounds, its tokens/s read 19% above the measured.)"""
    held, until = 0.0, first_s
    for admitted, first in sorted(prefills):
        start, end = max(admitted, until), first - trip_s
        if end > start:
            held, until = held + end - start, end
    return held


def ttft_s(p: Pipeline, prompt_tokens: int, chunk: int, ahead: tuple[int, ...] = (), k: int = 0,
           depth: int = 0, intake: bool = True) -> float:
    """Time to first token of a `prompt_tokens` prompt (nothing cached) crossing in chunks of `chunk`, pipelined
    across the ranks, counted from its admission (first_tokens_s: its own, after the `ahead`)."""
    return first_tokens_s(p, prompt_tokens, chunk, ahead, k, depth, intake)[-1]


def first_tokens_s(p: Pipeline, prompt_tokens: int, chunk: int, ahead: tuple[int, ...] = (), k: int = 0,
                   depth: int = 0, intake: bool = True, ago_ms: tuple[float, ...] = (),
                   after: tuple[int, ...] = ()) -> tuple[float, ...]:
    """When each of `ahead`, then this `prompt_tokens` prompt, then each of `after` has its first token, counted from
    this one's admission: each prompt crosses in chunks of `chunk` (nothing cached), pipelined across the ranks; the
    last chunk goes with the first round, whose reply carries the token (it drafts nothing at any K). A chunk's cost
    grows with the context it attends over. `after`: prompts admitted right behind it, before any first round goes
    (a burst the server gathered: rank 0 takes each in after this one).

    `ahead`: prompts admitted before it whose first rounds are not yet sent, `ago_ms` before this one (rank 0 took
    each in from then, and is free again at this admission; without `ago_ms`, rank 0's part done and the rest
    counted from this admission on: more than they have left). Their chunks may still hold the links and the later
    ranks; then every first round goes, in the scheduler's batches (first_round_batches: a batch's rows reply
    together), behind this one's chunks: an admission holds back the first rounds before it. Rank 0 takes a reply
    only after it has sent every first round and done its work in the wait: the drafter taking in each first
    round's chunk (so with it, every one of them replies together) and, for a lone stream (`depth` its rounds on the way, 0: not alone) drafting K under
    spec.overlap, its first `depth` blocks on the bet (use_the_wait): over a short trip, what the first token
    waits for. `intake` False: the drafter takes in none of the prompts (streams admitted at K=0 under
    spec.k_from_costs leave them out)."""
    out, spans = _first_tokens_pass(p, prompt_tokens, chunk, ahead, k, depth, intake, ago_ms, after, None)
    for _ in range(SHARING_PASSES if crowded(p) else 0):  # each rank's work beside the others' as the pass before
        before = spans  # placed it (processor sharing: sharing_end), until it holds still
        out, spans = _first_tokens_pass(p, prompt_tokens, chunk, ahead, k, depth, intake, ago_ms, after, spans)
        last = [max((b for _, b in mine), default=0.0) for mine in spans]
        moved = [abs(a - max((b for _, b in was), default=0.0)) for a, was in zip(last, before)]
        if max(moved) <= SHARING_TOLERANCE * max(max(last), 1e-9):
            break
    return out


def _first_tokens_pass(p: Pipeline, prompt_tokens: int, chunk: int, ahead: tuple[int, ...], k: int, depth: int,
                       intake: bool, ago_ms: tuple[float, ...], after: tuple[int, ...], spans):
    """One pass of first_tokens_s: (its answer, each rank's spans of CPU work), each rank's work slowed by its
    host's other ranks at work in `spans` (None: not at all)."""
    ends = sharing_end(p, spans)
    busy: list[list[tuple[float, float]]] = [[] for _ in p.ranks]
    since = [-ms for ms in ago_ms] if ago_ms else [None] * len(ahead)  # when rank 0 took each in (None: before)
    # (rows, tokens, context, the prompts whose first round it is, from when, after this admission)
    items = [(1, size, context, (), at, False)
             for n, at in zip(ahead, since) for size, context in chunks(n, chunk)[:-1]]
    items += [(1, size, context, (), 0.0, True)
              for n in (prompt_tokens, *after) for size, context in chunks(n, chunk)[:-1]]
    firsts, me = [chunks(n, chunk)[-1] for n in [*ahead, prompt_tokens, *after]], len(ahead)
    for batch in first_round_batches([size for size, _ in firsts], chunk):
        items.append((len(batch), max(firsts[i][0] for i in batch), max(firsts[i][1] for i in batch), batch, 0.0, True))
    free = [min([0.0, *(at for at in since if at is not None)])] * (2 * len(p.ranks))  # when each resource is next
    work = [0.0] * len(p.ranks)  # free (rank 0, link 0, rank 1, ...); each rank's work on them from this admission
    replies, mine, begun = [0.0] * len(firsts), work, False  # on (ranks sharing a host's cores: host_ms)
    for rows, size, context, first_of, at, now in items:
        ready = 0.0 if at is None else at
        if now and not begun:  # this admission: rank 0 is free again (it took in the ones before)
            free[0], begun = 0.0, True
        for r, rank in enumerate(p.ranks):
            sends = r < len(p.ranks) - 1 or bool(first_of)  # a Prefill message has no reply
            if r == 0 and at is None:  # rank 0 took it in and sent it before this admission: only its wire is left
                sent = 0.0
            else:
                # rank 0 sends a Prefill chunk before the drafter takes it in; a first round drafts nothing (its
                # token is not known yet) and goes at once: the drafter takes its chunk in later, in the wait
                drafting = p.draft.prefill_ms(size, context) if r == 0 and not first_of and intake else 0.0
                start = max(ready, free[2 * r])
                compute = rank.chunk_ms(size, context, rows)
                sent = ends(r, start, compute)
                messages = (p.links[r - 1].message_ms if r else 0.0) + (p.links[r].message_ms if sends else 0.0)
                free[2 * r] = ends(r, sent, drafting + messages)  # the next waits for them, this one not (latency)
                busy[r].append((start, free[2 * r]))
                work[r] += max(start + compute + drafting + messages, 0.0) - max(start, 0.0)
            if not sends:
                break
            link = p.links[r]
            wire = max(sent, free[2 * r + 1])
            free[2 * r + 1] = wire + link.transfer_ms(p.link_bytes(r, rows, size))
            ready = free[2 * r + 1] + link.one_way_ms
        for i in first_of:
            replies[i] = ready
        if me in first_of:
            mine = list(work)
    in_the_wait = sum(p.draft.prefill_ms(size, context) for size, context in firsts) if intake else 0.0
    if depth and k and p.overlap:
        in_the_wait += depth * (round_parts(p, k, 1).prep_ms + p.links[0].message_ms)
    mine[0] += in_the_wait
    taken = free[0] + in_the_wait  # rank 0 free to take the replies
    out = [max(reply, taken) for reply in replies]
    out[me] = max(out[me], host_ms(p, mine))
    return tuple(t / 1000.0 for t in out), busy


def crowded(p: Pipeline) -> bool:
    """Whether some host's ranks ask for more than its cores when they all compute (Pipeline.cores)."""
    return max(host_ms(p, [1.0] * len(p.ranks)), 0.0) > 1.0 + TIE


def sharing_end(p: Pipeline, spans):
    """ends(r, start, work): when rank r's `work` ms of CPU begun at `start` is done, while its host's other ranks
    compute in `spans` (each rank's (from, to) list; None: nobody slows it): whenever the shares of the host's cores
    at work add to more than 1, each runs that many times slower (processor sharing). Three one-thread ranks on two
    cores: each at 2/3 while all three compute (measured 1.55-1.62x slower, one 1.5B layer over 512 tokens each,
    2026-12-06), at full speed while two do. The pipe fills and drains around a prompt's chunks, so a bound by the
    cores' sum alone (host_ms) is short of it: eight chunks of 50 ms over three such ranks take 650 ms, the sum 600."""
    if spans is None:
        return lambda r, start, work: start + work
    host = [p.hosts[r] if r < len(p.hosts) else -1 - r for r in range(len(p.ranks))]
    share = [p.cores[r] if r < len(p.cores) else 0.0 for r in range(len(p.ranks))]
    loads = []  # per rank: [(time, the others' shares at work from then)]
    for r in range(len(p.ranks)):
        steps: dict[float, float] = {}
        for q, theirs in enumerate(spans):
            if q != r and host[q] == host[r]:
                for a, b in theirs:
                    steps[a], steps[b] = steps.get(a, 0.0) + share[q], steps.get(b, 0.0) - share[q]
        level, profile = 0.0, [(-math.inf, 0.0)]
        for t in sorted(steps):
            level += steps[t]
            profile.append((t, level))
        loads.append(profile)

    def ends(r: int, start: float, work: float) -> float:
        profile = loads[r]
        if share[r] <= 0 or len(profile) == 1:
            return start + work
        i = bisect.bisect_right(profile, (start, math.inf)) - 1
        t, left = start, work
        while True:
            rate = 1.0 / max(1.0, share[r] + profile[i][1])
            until = profile[i + 1][0] if i + 1 < len(profile) else math.inf
            if left <= (until - t) * rate:
                return t + left / rate
            left -= (until - t) * rate
            t, i = until, i + 1
    return ends


def depths_allowed(in_flight) -> tuple[int, ...]:
    """The depths spec.in_flight lets a lone stream run at: auto 1..DEPTH_MAX, else the one it names."""
    return tuple(range(1, DEPTH_MAX + 1)) if in_flight == "auto" else (int(in_flight),)


def stream_rates(p: Pipeline, k_max: int, depths=(1,)) -> list[float]:
    """One stream's tokens/s at each K in 0..k_max, each at its best of `depths` (spec.in_flight=auto: 1..DEPTH_MAX;
    a fixed depth: that one)."""
    return [max(stream_tokens_per_s(p, k, d) for d in depths) for k in range(k_max + 1)]


def best_k(p: Pipeline, k_max: int, depths=(1,)) -> int:
    """The K in 0..k_max with the most tokens/s for one stream at its best of `depths` (the smallest on a tie)."""
    rates = stream_rates(p, k_max, depths)
    return max(range(k_max + 1), key=rates.__getitem__)


def best_depth(p: Pipeline, k: int, depth_max: int = DEPTH_MAX) -> int:
    """The smallest depth in 1..depth_max within DEPTH_MARGIN of the best one-stream rate at K."""
    rates = [stream_tokens_per_s(p, k, d) for d in range(1, depth_max + 1)]
    return next(d for d, r in enumerate(rates, 1) if r >= (1 - DEPTH_MARGIN) * max(rates))


def best_batches(p: Pipeline, k: int, streams: int, batches_max: int = 8) -> int:
    """The batch count in 1..batches_max (at most one per stream) with the best aggregate; ties: the most."""
    most = max(1, min(batches_max, streams))
    rates = [aggregate_tokens_per_s(p, k, streams, g) for g in range(1, most + 1)]
    top = max(rates)
    return max(g for g, r in enumerate(rates, 1) if r >= top * (1 - TIE))


def best_settings(p: Pipeline, k_max: int, depth_max: int = DEPTH_MAX, streams: int = 1,
                  batches_max: int = 8) -> Settings:
    """K, depth and batches from the model: K and the depth for one stream (jointly; the depth the smallest
    within DEPTH_MARGIN at that K), the batch count for `streams` streams at that K."""
    k = best_k(p, k_max, range(1, depth_max + 1))
    return Settings(k, best_depth(p, k, depth_max), best_batches(p, k, streams, batches_max) if streams > 1 else 1)


@dataclass(frozen=True)
class Workload:
    """What a placement is planned for (workload.*): `streams` requests admitted at once, each a `prompt_tokens`
    prompt and an `answer_tokens` answer."""
    streams: int
    prompt_tokens: int
    answer_tokens: int


def workload_s(p: Pipeline, w: Workload, k: int, chunk: int, depths=(1,), batches_max: int = 8) -> float:
    """Seconds from a workload's admission to its answers' end at K drafts a round: the last prompt's first token
    (every prompt taken in on admission, its chunks pipelined; a stream that has its token first waits behind the
    later prompts' chunks, as held_s prices it), then the answer at the streams' rate halfway through it (one stream at its best
    of `depths`; several in their best batches). K = 0 takes no prompt into the drafter (spec.k_from_costs admits
    a stream at K=0 without it)."""
    halfway = at_context(p, w.prompt_tokens + w.answer_tokens // 2)
    if w.streams <= 1:
        depth = max(depths, key=lambda d: stream_tokens_per_s(halfway, k, d))
        rate = stream_tokens_per_s(halfway, k, depth)
    else:
        depth = 0
        batches = best_batches(halfway, k, w.streams, batches_max)
        rate = aggregate_tokens_per_s(halfway, k, w.streams, batches) / w.streams
    first = first_tokens_s(p, w.prompt_tokens, chunk, (), k, depth, k > 0, after=(w.prompt_tokens,) * (w.streams - 1))
    return max(first) + w.answer_tokens / max(rate, 1e-9)


def best_for_workload(p: Pipeline, w: Workload, ks, chunk: int, depths=(1,), batches_max: int = 8) -> tuple[float, int]:
    """(seconds, K): the K of `ks` that ends the workload soonest (workload_s), and when."""
    return min((workload_s(p, w, k, chunk, depths, batches_max), k) for k in ks)


def predict(p: Pipeline, settings: Settings, streams: int = 1, prompt_tokens: int = 2048,
            chunk: int = 512) -> Prediction:
    """The figures at `settings`: one stream, `streams` streams together (as timed, and after the prompt's tokens
    cached), TTFT of a `prompt_tokens` prompt."""
    long = at_context(p, prompt_tokens)
    return Prediction(stream_tokens_per_s(p, settings.k, settings.depth),
                      aggregate_tokens_per_s(p, settings.k, streams, settings.batches),
                      ttft_s(p, prompt_tokens, chunk, (), settings.k, settings.depth), prompt_tokens, settings, streams,
                      stream_tokens_per_s(long, settings.k, settings.depth),
                      aggregate_tokens_per_s(long, settings.k, streams, settings.batches))


def with_acceptance(p: Pipeline, acc: Acceptance) -> Pipeline:
    return replace(p, acceptance=acc)


def at_context(p: Pipeline, context: int | None) -> Pipeline:
    """`p` with its decode rounds after `context` cached tokens (None: as timed)."""
    return replace(p, context=context)


def rank_cost(layers: int, layer_ms: float, fixed_ms: float, block_tokens: int, layer_token_ms: float = 0.0,
              row_ms: float = 0.0, attend_ms: float = 0.0, context_ms: float = 0.0, timed_context: int = 0,
              context_row_ms: float | None = None, prefill_layer_ms=()) -> RankCost:
    """A stage of `layers` layers from the placement's timing (model_parallel.split.RankCosts): `layer_ms` one layer
    over a block of `block_tokens` (K+1), `fixed_ms` the rest of its work per round (drafting excluded),
    `layer_token_ms` one layer's ms per token more (0: not timed; a block then costs the same at any size), and
    `attend_ms` one layer's ms per token per earlier token (a long prompt's attention), `context_ms` one layer's
    ms per token of a decode block per cached token beyond `timed_context` (the context `layer_ms` was timed after),
    `context_row_ms` the same for each row of a batch beyond the first (None: as the first's), `prefill_layer_ms`
    [tokens, one layer's ms over a prefill chunk of them after `timed_context`] pairs (the rest of the rank's work as
    over a block: `fixed_ms`)."""
    token_ms = layers * layer_token_ms
    total = fixed_ms + layers * layer_ms
    return RankCost(max(total - row_ms - token_ms * block_tokens, 0.0), token_ms, row_ms, attend_ms=layers * attend_ms,
                    context_ms=layers * context_ms, timed_context=timed_context,
                    context_row_ms=None if context_row_ms is None else layers * context_row_ms,
                    prefill_by_tokens={int(n): fixed_ms + layers * ms for n, ms in prefill_layer_ms})


@dataclass(frozen=True)
class PartsMs:
    """A round's parts as the model charges them, beside what each rank times (RoundRecord's draft_ms, stage0_ms,
    middle_ms, last_ms): the drafter's steps, and each rank's whole work on the block, its forward and the engine's
    work besides it (ENGINE_*). A rank's own timing of its forward holds much of that work too (the tiny model at
    K=0 over 0 ms: rank 0's stage0_ms read 0.76-0.89x the whole charge; bench/README, the thirtieth session), but
    not rank 0's committing, which is timed outside stage0_ms."""
    draft_ms: float
    stage0_ms: float
    middle_ms: tuple[float, ...]
    last_ms: float
    wire_ms: float = 0.0  # the links' latency and transfer around the ring (RoundRecord.network_ms, measured)


def parts_ms(p: Pipeline, k: int, rows: int = 1) -> PartsMs:
    """A round of K drafts for `rows` streams, part by part (PartsMs), at the Pipeline's context."""
    blocks = [rank.ms(rows, k + 1, p.context) for rank in p.ranks]
    wire = sum(link.ms(p.link_bytes(i, rows, k + 1)) for i, link in enumerate(p.links))
    return PartsMs(p.draft.round_ms(k, rows, p.context), blocks[0], tuple(blocks[1:-1]), blocks[-1], wire)


def engine_ms(rank: int, ranks: int) -> float:
    """The engine's work per round on `rank` besides its forward (ENGINE_*)."""
    if 0 < rank < ranks - 1:
        return ENGINE_MIDDLE_MS
    return (ENGINE_RANK0_MS if rank == 0 else 0.0) + (ENGINE_LAST_MS if rank == ranks - 1 else 0.0)


def engine_row_ms(rank: int) -> float:
    """... and per row of a batch beyond the first (ENGINE_*_ROW_MS): rank 0 commits and answers each stream, a
    later rank reads and writes each row's messages."""
    return ENGINE_RANK0_ROW_MS if rank == 0 else ENGINE_LATER_ROW_MS


@dataclass(frozen=True)
class Pace:
    """Each part's cost in service over what the start-up timing charges it (PaceTally): `draft` the drafter's
    steps, `ranks[r]` rank r's stage (a missing rank: 1, as timed), `engine` rank 0's work besides its forwards
    and sends (committing, answering clients: engine_ms); `wire_ms` what a round's trip spends on the links beyond
    their latency and transfer as the probe measured them, added (a frame's serialization and the channels' paths
    at both ends: a ping's are in its RTT, a round's frames are larger)."""
    draft: float = 1.0
    ranks: tuple[float, ...] = ()
    engine: float = 1.0
    wire_ms: float = 0.0

    def at(self, r: int) -> float:
        return self.ranks[r] if r < len(self.ranks) else 1.0


def paced(p: Pipeline, pace: Pace) -> Pipeline:
    """`p` with each decode cost times its pace: a stage's block (the engine's work on it too) and the drafter's
    steps. A prompt's chunks stay as timed alone (prefill_by_tokens, attend_ms, the drafter's intake): the pace is
    measured on decode rounds only."""
    ranks = [_scaled_rank(c, pace.at(r)) for r, c in enumerate(p.ranks)]
    if ranks:  # rank 0's engine work (in its fixed and row costs) at its own pace, not its forward's
        shift = pace.engine - pace.at(0)
        more, more_row = engine_ms(0, len(ranks)) * shift, engine_row_ms(0) * shift
        c = ranks[0]
        ranks[0] = replace(c, fixed_ms=c.fixed_ms + more, row_ms=c.row_ms + more_row,
                           by_tokens={n: ms + more for n, ms in c.by_tokens.items()})
    ranks = tuple(ranks)
    links = tuple(replace(link, one_way_ms=max(link.one_way_ms + pace.wire_ms / len(p.links), 0.0))
                  for link in p.links)
    d, f = p.draft, pace.draft
    draft = replace(d, step_ms=d.step_ms * f, row_ms=d.row_ms * f, context_ms=d.context_ms * f,
                    context_row_ms=None if d.context_row_ms is None else d.context_row_ms * f)
    return replace(p, ranks=ranks, links=links, draft=draft)


def _scaled_rank(c: RankCost, f: float) -> RankCost:
    return replace(c, fixed_ms=c.fixed_ms * f, token_ms=c.token_ms * f, row_ms=c.row_ms * f,
                   by_tokens={n: ms * f for n, ms in c.by_tokens.items()}, context_ms=c.context_ms * f,
                   context_row_ms=None if c.context_row_ms is None else c.context_row_ms * f)


class PaceTally:
    """Each part's ms as the ranks timed it in service over what the model charged it (a decode round's draft_ms,
    stage0_ms, middle_ms and last_ms beside its predicted_parts, PartsMs at the start-up costs), summed over the
    rounds with weights that shrink by `decay` a round (1: a request's rounds alike), leaning on 1 as on
    PACE_PRIOR_ROUNDS rounds. Why: a host's pace moves, and a start-up timing reads it at one moment. On a KVM
    host with two vCPUs the same forward read 4.4 ms at best and 6.7 at the median over 20 s in one process
    (bench/host_pace.py: the tiny model's last rank over 2 rows of a K=4 block), and a start-up timing near its
    best: in service that rank ran at 1.7-1.9x it, the drafter at 1.3-2x (bench/README, the thirty-second and
    thirty-third sessions).
    A round prepared in an earlier round's wait (spec.overlap) has its drafting and stage 0 timed in that round's
    record, together (ahead_ms): their ratio counts for both parts. Left out: a looked-up round's drafting (no
    model step). Rank 0's committing, which its stage0_ms does not time, is a part of its own ("engine", against
    engine_ms): rank 0's whole work since the reply before (busy_ms) less its drafting, forward and send in it (a
    block prepared in that wait: ahead_ms; one sent as prepared before: none). Two ranks of the tiny model at K=0
    over 0 ms, one stream: 2.0 ms a round at the median from a reply to the next round's start where
    ENGINE_RANK0_MS charges 0.8 (the KVM host of bench/README's thirty-fourth session; py-spy put 0.2 ms of it in
    the engine thread's own code: the rest is its waiting for a core beside the server's thread and the other
    processes). And a batch's wire ("wire", an amount in ms: extra_ms): its network_ms (send -> reply less the
    later ranks' work) less the links' latency and transfer as charged, from batches alone in the ring, sent
    behind no prompt's chunks, with nothing sent or prepared in their wait (else network_ms holds a queue on the
    later ranks, or rank 0's work past the reply); the same run: 1.0 ms where the probe's RTT charged 0.2."""

    def __init__(self, decay: float = 1.0):
        self.decay = decay
        self.sums: dict = {}  # part ("draft", or a rank) -> [measured ms, charged ms, rounds], each weighted

    def observe(self, record) -> None:
        charged = getattr(record, "predicted_parts", None)
        if charged is None:
            return
        for sums in self.sums.values():
            sums[:] = [x * self.decay for x in sums]
        ranks = len(charged.middle_ms) + 2
        engine = engine_ms(0, ranks) + (record.batch - 1) * engine_row_ms(0)  # rank 0's charge besides its forward
        forward = charged.stage0_ms - engine
        if not record.from_ahead:
            if record.drafted and not record.looked_up:
                self._add("draft", record.draft_ms, charged.draft_ms)
            self._add(0, record.stage0_ms, forward)
        if record.prepared and record.drafted and not record.looked_up:
            # the blocks prepared in this round's wait (spec.overlap), drafting and stage 0 timed together: a lone
            # stream's every round at 0 ms is one, and its drafting most of rank 0's round
            for part in ("draft", 0):
                self._add(part, record.ahead_ms, record.prepared * (charged.draft_ms + forward))
        for r, (measured, charge) in enumerate(zip(record.middle_ms, charged.middle_ms), start=1):
            self._add(r, measured, charge)
        self._add(ranks - 1, record.last_ms, charged.last_ms)
        if record.busy_ms is not None:
            prepared = 0.0 if record.from_ahead else record.draft_ms + record.stage0_ms
            self._add("engine", record.busy_ms - prepared - record.ahead_ms - record.send_ms, engine)
        if record.alone and record.on_the_way == record.batch and not record.ahead_ms:  # (rank 0 idle meanwhile)
            self._add("wire", record.network_ms - charged.wire_ms, None)

    def _add(self, part, measured: float, charged: float | None) -> None:
        """A part's round (charged None: an amount in ms, not a ratio)."""
        if charged is None or charged > 0:
            sums = self.sums.setdefault(part, [0.0, 0.0, 0.0])
            sums[0], sums[1], sums[2] = sums[0] + measured, sums[1] + (charged or 0.0), sums[2] + 1

    def ratio(self, part) -> float:
        if part not in self.sums:
            return 1.0
        measured, charged, rounds = self.sums[part]
        prior = PACE_PRIOR_ROUNDS * charged / rounds  # PACE_PRIOR_ROUNDS rounds as charged
        return min(max((measured + prior) / (charged + prior), PACE_BOUNDS[0]), PACE_BOUNDS[1])

    def lend(self, part, other: PaceTally) -> None:
        """`other`'s sums of `part`, where this tally has none."""
        if part not in self.sums and part in other.sums:
            self.sums[part] = list(other.sums[part])

    def extra_ms(self, part) -> float:
        """An amount's mean, leaning on 0 as on PACE_PRIOR_ROUNDS rounds."""
        measured, _, rounds = self.sums.get(part, (0.0, 0.0, 0.0))
        return measured / (rounds + PACE_PRIOR_ROUNDS)

    def pace(self, ranks: int) -> Pace:
        return Pace(self.ratio("draft"), tuple(self.ratio(r) for r in range(ranks)), self.ratio("engine"),
                    self.extra_ms("wire"))


def from_rank_costs(costs, layer_counts: list[int], links: list[LinkCost], block_tokens: int, draft_steps: int = 0,
                    hidden_bytes: int = 0, overlap: bool = True, acceptance: Acceptance = Acceptance(),
                    timed_context: int = 0) -> Pipeline:
    """The Pipeline of a placement: `costs` every rank's model_parallel.split.RankCosts (layer_ms, fixed_ms,
    layer_token_ms, draft_step_ms: duck-typed), `layer_counts` its layers per rank, `links` one per rank (link i:
    rank i -> i+1, the last the reply), `block_tokens` the block timed (K+1), `draft_steps` the drafter's steps
    rank 0's fixed_ms holds (K+1 with a model drafter, else 0). Where a rank was also timed alone (alone_layer_ms,
    spec.overlap), its round's costs are the ones alone (one stream's ranks take turns) and the ratio of the two
    its slowdown in a full pipe (Pipeline.together); a prefill chunk costs what chunks of its size timed alone cost
    where they were (alone_prefill_ms: RankCost.prefill_by_tokens), and its slopes are as timed alone
    (alone_layer_token_ms, alone_attend_ms), else at once: a chunk runs at once with the others' only while the
    pipe is full, and then the host's cores bound them (first_tokens_s: host_ms), which at-once slopes would count
    twice (three ranks on two cores at 0 ms: a 2,000-token prompt's TTFT predicted 10.6-17.4 s, 5.5-6.2 measured). A
    decode block's cost per cached token (context_ms, draft_context_ms: beyond `timed_context`, the context the
    blocks were timed after; context_row_ms, draft_context_row_ms: each row more, 0 where not timed) is a block's
    cost like the rest: alone, the ratio applied in a full pipe. Each rank's
    host (`host_rank`, its place among its host's ranks) and its share of the host's cores (`core_share`) bound a
    full pipe by what the host's cores can do at once (host_ms)."""
    slow = [together_over_alone(c) for c in costs]
    step = getattr(costs[0], "draft_step_ms", 0.0)
    ranks = []
    for r, (c, n) in enumerate(zip(costs, layer_counts)):
        fixed = (c.fixed_ms - (draft_steps * step if r == 0 else 0.0)) / slow[r] + engine_ms(r, len(costs))
        token_ms = getattr(c, "alone_layer_token_ms", 0.0) or getattr(c, "layer_token_ms", 0.0)
        attend_ms = getattr(c, "alone_attend_ms", 0.0) or getattr(c, "attend_ms", 0.0)
        # a row more: its layers' and its head's share as timed over ROW_PROBE rows, less its tokens' (RankCost adds them)
        row = (n * getattr(c, "layer_row_ms", 0.0) + getattr(c, "head_row_ms", 0.0)) / slow[r]
        row = max(row - n * token_ms * block_tokens, 0.0) + engine_row_ms(r)
        ranks.append(rank_cost(n, c.layer_ms / slow[r], max(fixed, 0.0), block_tokens, token_ms,
                               row_ms=row, attend_ms=attend_ms,
                               context_ms=getattr(c, "context_ms", 0.0) / slow[r], timed_context=timed_context,
                               context_row_ms=_timed(getattr(c, "context_row_ms", 0.0), slow[r]),
                               prefill_layer_ms=getattr(c, "alone_prefill_ms", ())))
    draft = DraftCost()
    if draft_steps:
        token = getattr(costs[0], "draft_token_ms", 0.0)
        attend = getattr(costs[0], "draft_attend_ms", 0.0)
        # a row more in a step: as timed over ROW_PROBE rows (each row attends over its own slot); untimed, what
        # another token of a prompt costs (one more row of each matrix product), which is far below it
        row = getattr(costs[0], "draft_row_ms", 0.0) / slow[0] or token
        draft = DraftCost(step / slow[0] + ENGINE_STEP_MS, row, token, 1 if overlap else 0, attend,
                          getattr(costs[0], "draft_context_ms", 0.0) / slow[0], timed_context,
                          _timed(getattr(costs[0], "draft_context_row_ms", 0.0), slow[0]),
                          {int(n): ms for n, ms in getattr(costs[0], "alone_draft_prefill_ms", ())})
    return Pipeline(tuple(ranks), tuple(links), draft, acceptance, hidden_bytes, overlap, tuple(slow),
                    hosts=hosts_of([getattr(c, "host_rank", 0) for c in costs]),
                    cores=tuple(getattr(c, "core_share", 0.0) for c in costs))


def _timed(ms: float, slow: float) -> float | None:
    """A timing that is 0 where not timed, as the cost model takes it: None (untimed), or the ms alone."""
    return ms / slow if ms else None


def hosts_of(host_ranks: list[int]) -> tuple[int, ...]:
    """Each rank's host from its place among its host's ranks (torchrun's LOCAL_RANK): torchrun numbers the ranks
    host by host, so a host begins at every rank whose place is 0."""
    hosts, host = [], -1
    for place in host_ranks:
        host += place == 0 or host < 0
        hosts.append(host)
    return tuple(hosts)


def together_over_alone(costs) -> float:
    """A rank's layer timed with every rank computing at once over the same timed alone (at least 1; 1 when not
    timed alone): what sharing a host (cores, memory bandwidth) costs it in a full pipe. Rank 0's drafter step where
    it was timed alone too (alone_draft_step_ms): drafting is most of rank 0's round, and a small model's layer
    (0.2 ms) times too coarsely to tell."""
    step, alone_step = getattr(costs, "draft_step_ms", 0.0), getattr(costs, "alone_draft_step_ms", 0.0)
    if step > 0 and alone_step > 0:
        return max(1.0, step / alone_step)
    alone = getattr(costs, "alone_layer_ms", 0.0)
    return max(1.0, costs.layer_ms / alone) if alone > 0 else 1.0


class Predictor:
    """A run's predictions as it goes: the start-up Pipeline, its acceptance measured from the decode rounds
    (per position, leaning on the prior while few are measured), so the prediction beside each measured round
    follows what the drafter really achieves and what is left is the costs' drift.

    The chance a bet holds (spec.overlap, spec.in_flight) is counted from the bets themselves where rounds were
    sent on one: the product of K + 1 shrunk position rates reads far below a drafter that is always right (each
    rate leans toward the pooled one, itself toward 1/2: after six rounds of every draft kept, 0.985 a position
    and 0.93 for five), so it serves only as the prior, weighing BET_PRIOR_WEIGHT bets."""

    def __init__(self, pipeline: Pipeline, chunk: int = 512, batches_max: int = 8, pace_decay: float = PACE_DECAY):
        self.start, self.chunk, self.batches_max = pipeline, chunk, batches_max
        self.tried: list[int] = [0]
        self.kept: list[int] = [0]
        self.bets = self.bets_held = self.bet_k = 0  # rounds that settled a bet, those that held, their last K
        self.tally = PaceTally(pace_decay)  # the costs' pace in service (paced)

    def observe(self, drafted: int, accepted: int, bet: bool | None = None) -> None:
        """A decode round's drafts, how many were kept, and whether the block sent on a bet about it held
        (None: none was)."""
        while len(self.tried) < drafted + 1:
            self.tried.append(0)
            self.kept.append(0)
        tally(self.tried, self.kept, drafted, accepted)
        if bet is not None:  # (a first round's bet is on its token alone: K = 0)
            self.bets, self.bets_held, self.bet_k = self.bets + 1, self.bets_held + bool(bet), drafted

    def observe_parts(self, record) -> None:
        """A decode round's parts as its ranks timed them, beside its predicted_parts: the costs' pace."""
        self.tally.observe(record)

    def pace(self) -> Pace:
        return self.tally.pace(len(self.start.ranks))

    def pipeline(self, timed: bool = False) -> Pipeline:
        """The start-up Pipeline at the acceptance measured, its costs at the pace measured (`timed`: as timed)."""
        p = self.start if timed else paced(self.start, self.pace())
        if sum(self.tried) == 0:
            return p
        measured = Acceptance.from_counts(self.tried, self.kept)
        prior = self.start.acceptance.prior  # positions not yet tried: the pooled rate
        acc = replace(measured, prior=measured.prior if measured.rates else prior)
        if self.bets:
            guess = acc.bet_holds(self.bet_k)
            acc = replace(acc, hold=(self.bets_held + BET_PRIOR_WEIGHT * guess) / (self.bets + BET_PRIOR_WEIGHT))
        return with_acceptance(p, acc)

    def tokens_per_s(self, k: int, depth: int = 1, streams: int = 1, context: int | None = None,
                     batches: int | None = None, timed: bool = False) -> float:
        """One stream's tokens/s now: alone at `depth` rounds on the way, or its share of `streams` together in
        `batches` taking turns (None: the model's best count); its rounds after `context` cached tokens (None: as
        timed); its costs at the pace measured (`timed`: as timed)."""
        p = at_context(self.pipeline(timed), context)
        if streams <= 1:
            return stream_tokens_per_s(p, k, depth)
        batches = batches or best_batches(p, k, streams, self.batches_max)
        return aggregate_tokens_per_s(p, k, streams, batches) / streams

    def parts_ms(self, k: int, rows: int = 1, context: int | None = None) -> PartsMs:
        """A round's parts as the model gives them at the start-up costs (parts_ms), after `context` cached tokens
        (None: as timed): beside the measured parts, the drift; their ratio, the pace (observe_parts)."""
        return parts_ms(at_context(self.start, context), k, rows)

    def best_depth(self, k: int, depth_max: int = DEPTH_MAX) -> int:
        """A lone stream's depth now (spec.in_flight=auto): best_depth at the acceptance and bets measured."""
        return best_depth(self.pipeline(), k, depth_max)

    def rates(self, k_max: int, streams: int, context: int | None = None, depths=(1,)) -> list[float]:
        """spec.k_from_costs's rates now, at each K in 0..k_max: one stream's tokens/s at its best of `depths`, or
        `streams` streams' together (each K in its best batch count: their rounds fill the pipe, no chain), their
        rounds after `context` cached tokens."""
        p = at_context(self.pipeline(), context)
        if streams <= 1:
            return stream_rates(p, k_max, depths)
        return [aggregate_tokens_per_s(p, k, streams, best_batches(p, k, streams, self.batches_max))
                for k in range(k_max + 1)]

    def ttft_s(self, prompt_tokens: int, ahead: tuple[int, ...] = (), k: int = 0, depth: int = 0,
               intake: bool = True) -> float:
        return ttft_s(self.pipeline(), prompt_tokens, self.chunk, ahead, k, depth, intake)

    def first_tokens_s(self, prompt_tokens: int, ahead: tuple[int, ...] = (), k: int = 0, depth: int = 0,
                       intake: bool = True, ago_ms: tuple[float, ...] = ()) -> tuple[float, ...]:
        return first_tokens_s(self.pipeline(), prompt_tokens, self.chunk, ahead, k, depth, intake, ago_ms)

    def intake_ms(self, tokens: int, context: int = 0) -> float:
        """The drafter taking in `tokens` it lacks after the `context` it holds (a prompt skipped at K=0)."""
        return self.start.draft.prefill_ms(tokens, context)

    def admission_intake_ms(self, tokens: int, burst: tuple[int, ...] = ()) -> float:
        """What the drafter taking in a newcomer's `tokens`-token prompt, and those of the `burst` admitted with it,
        adds to the last of their first tokens: each chunk goes in while the later ranks work on it, but in a burst
        rank 0 takes in one prompt after another before any first round goes (first_tokens_s with the intake less
        without, the burst admitted right behind it)."""
        def last_s(intake: bool) -> float:
            return max(first_tokens_s(self.pipeline(), tokens, self.chunk, intake=intake, after=burst))
        return 1000 * (last_s(True) - last_s(False))

    def for_rounds(self, rounds, streams: int = 1, start: int | None = None, before=None, timed: bool = False) -> float:
        """One request's tokens/s as the model gives it at the acceptance its own decode rounds measured (and its
        bets): its tokens over the time the model gives each round at that round's K, rounds on the way and
        context (`start`: the tokens cached before the first of them, its prompt's and the first round's; each
        round after the tokens committed before it; None: every round as timed), and what deepening a lone stream's
        chain cost (deepening_ms: spec.in_flight=auto rising after the first token; `before`: the round before
        the first, the depth the chain had when they began); a lone stream's last rounds that drained its chain
        (drained) cost drain_ms together, not a chain step each, and leave out the acceptance and bets the others
        are priced at: each came of a bet that held (that is what drains), so counted they raised the hold rate of
        the rounds that lost theirs (the embedded pair over 150 ms at depth 3, a 2,000-token prompt: four bets lost
        in the first 13 rounds, none in the last 3). The rounds' own predictions lean on what earlier
        rounds measured (the prior at first), which on a short request of a prompt drafted far better or worse than
        the prior mostly measures the prior. Its costs at the pace its own rounds measured (PaceTally, every round
        alike; `timed`: as the start-up timing gave them)."""
        body = len(rounds) - (drained(rounds) if streams <= 1 else 0)
        mine = Predictor(self.start, self.chunk, self.batches_max, pace_decay=1.0)
        for r in rounds[:body]:
            mine.observe(r.drafted, r.accepted, r.bet)
        for r in rounds if not timed else ():
            mine.observe_parts(r)
        if not timed:  # none of its batches went alone: the ring's wire as the server measured it
            mine.tally.lend("wire", self.tally)
        contexts = [None] * len(rounds) if start is None else list(itertools.accumulate(
            (r.committed for r in rounds[:-1]), initial=start))
        depths = depths_sent(rounds)
        seconds = sum(r.committed / mine.tokens_per_s(r.drafted, depth, streams, context, batches_run(r), timed)
                      for r, depth, context in zip(rounds[:body], depths, contexts))
        if streams <= 1:  # (several streams fill the pipe with their rounds, not bets)
            p = mine.pipeline(timed)
            deepest = before.in_flight if before is not None else depths[0]  # the chain's depth so far
            for r, depth, context in zip(rounds, depths, contexts):
                seconds += deepening_ms(at_context(p, context), r.drafted, deepest, depth) / 1000
                deepest = max(deepest, depth)
            if body < len(rounds):
                last = at_context(p, contexts[body])
                seconds += drain_ms(last, max(r.drafted for r in rounds[body:]), len(rounds) - body) / 1000
        return sum(r.committed for r in rounds) / seconds if seconds > 0 else 0.0


def batches_run(r) -> int | None:
    """The batches a round's streams took turns in: its live streams over its batch's rows (the scheduler's
    BatchCount, from costs measured online, which may settle on another count than the start-up model's best); None
    where not recorded or alone. A prediction beside a measured round is at the settings the round ran: its K, its
    depth, its batches (four streams over two ranks at K=0 ran in one batch where the start-up model gave two:
    688 tokens/s predicted for two, 654 for one, 648 measured in one)."""
    live, rows = getattr(r, "live", 1), getattr(r, "batch", 0)
    return math.ceil(live / rows) if live > 1 and rows > 0 else None


def drained(rounds) -> int:
    """How many of a lone stream's last rounds drained its chain: their blocks were prepared in earlier waits and
    rank 0 prepared none in theirs (the answer's tokens were on the way). Not a fresh round after a lost bet (its
    prep came after the reply before it), nor rounds in turn (K = 0, no spec.overlap: nothing prepared ahead)."""
    n = 0
    while n < len(rounds) and rounds[-1 - n].from_ahead and not rounds[-1 - n].prepared:
        n += 1
    return n if n < len(rounds) else 0


def depths_sent(rounds) -> list[int]:
    """Each round's depth: the most rounds on the way (its own included) at any reply while it was on the way.
    A round's `in_flight` counts them at its own reply, which at a request's end falls to 1 as the chain drains
    (nothing more is sent once the answer's tokens are on the way); those last replies still come one chain step
    apart, not one whole round trip: counted at in_flight, a depth-3 request of 13 rounds read 140 tokens/s where
    its rounds ran at 169 (its last two charged a trip/2 and a whole trip)."""
    depths = [1] * len(rounds)
    for j, r in enumerate(rounds):  # reply j came with rounds j .. j + in_flight - 1 on the way
        for i in range(j, min(len(rounds), j + max(1, r.in_flight))):
            depths[i] = max(depths[i], r.in_flight)
    return depths
