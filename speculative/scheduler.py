"""Rank 0's scheduler (serve.max_concurrent): which KV slot a new stream gets, and which streams' fresh blocks go
out together now. The Session carries out what it decides.

Slots: every cache (each stage's, the drafter's) keeps a slot's tokens after its stream ends. A new prompt gets
the free slot holding its longest prefix (the next turn of a conversation), else the one unused longest; every
cache of that slot then rewinds to the common prefix and only the rest is prefilled.

Batches: the streams with nothing on the way are drafted for together and sent as a batch (one forward on every
rank). A batch holds at most a 1/G share of the live streams, so that G batches take turns through the pipe: while
one is on the wire or at a later rank, rank 0 drafts for another. Replies come back in the order the blocks went
out, so the oldest batch's streams are the next drafted for: round-robin.

How many batches (G, `BatchCount`), from the pipeline's cost model (speculative.cost_model.best_batches): a batched
forward costs about as much as a lone one (weights read once for all rows), so splitting the streams into G batches
multiplies each rank's work per cycle by up to G (less where the rows cost compute: each rank's work is measured per
batch size), and pays only when it fills time the pipe would otherwise idle: G batches cycle in max(G x the busiest
resource, one batch's prep + trip). The most batches that do not lengthen the cycle are taken. On a CPU where a
bf16 drafter dominates that is 1; with an NF4 one, whose 8-row step costs ~1.8x one row's, 2 may pay; over a WAN
with fast GPUs, several.
"""
from __future__ import annotations

import math
import time
from collections import deque

from speculative import cost_model
from speculative.in_flight import FixedDepth
from speculative.k_choice import ema

TRIP_WINDOW = 8  # rounds into a full pipe whose least trip reading bounds the trip (BatchCount.observe)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class BatchCount:
    """G, the batches on the way (see above): given, or (None) from measured costs, 1 until there are some.

    Each rank's work per batch is measured at every batch size seen (a moving average per size and K) and read, at
    the K of the last round, as a line in the rows, fixed + row_ms x rows: a batched forward reads the weights once,
    but its compute grows with the rows (on a CPU a quantized drafter's step over 8 rows costs ~1.8x one row's), so
    G batches of 1/G of the streams each cost less than G whole ones. Sizes come and go as streams start and end;
    while one size is seen, a row more costs what the start-up model (`prior`) says it does at the K measured
    (without one: nothing, a flat line, with which the embedded pair's four streams, always one batch of 4 rows,
    never tried two batches of 2: 16.0 tokens/s where two measured 19.1; its drafting and rank 1's forward grow ~30
    and ~60 ms a row)."""

    def __init__(self, given: int | None = None, smoothing: float = 0.2, most: int = 8,
                 prior: cost_model.Pipeline | None = None):
        self.given, self.smoothing, self.most, self.prior = given, smoothing, most, prior
        self.k = 0  # the K of the last round measured: the costs read are those measured at it
        self.trip = None  # ms, moving average: the wire's part of a round
        self.queued_trips: deque[float] = deque(maxlen=TRIP_WINDOW)  # the last readings of rounds into a full pipe
        # (K, rows) -> rank 0's work per batch of that many rows of K drafts each (moving averages), and each later
        # rank's (middle ranks', the last's): a block of K + 1 tokens a row costs by its K as much as by its rows,
        # so sizes are compared at one K (spec.k_from_costs moving K between 3 and 0 over three ranks on two cores:
        # four-row batches at K=3 read 380 / 419 ms beside two-row batches at K=0's 155 / 190, a row "costing" 112
        # ms, and four batches of one row were taken, halving the streams' tokens/s)
        self.rank0: dict[tuple[int, int], float] = {}
        self.stages: dict[tuple[int, int], list[float]] = {}

    def pipeline(self) -> cost_model.Pipeline:
        """The cost model of what was measured at the current K: rank 0's work, each later rank's, the wire as one
        link."""
        rank0 = {rows: ms for (k, rows), ms in self.rank0.items() if k == self.k}
        stages = {rows: ms for (k, rows), ms in self.stages.items() if k == self.k}
        n = len(next(iter(stages.values())))
        row_ms = self.prior_row_ms(n + 1)
        ranks = (rows_line(rank0, row_ms[0]),
                 *(rows_line({b: ms[i] for b, ms in stages.items()}, row_ms[i + 1]) for i in range(n)))
        links = (cost_model.LinkCost(self.trip), *(cost_model.LinkCost() for _ in range(n)))
        # ranks that share a host's cores slow each other once several batches keep them all at work (the start-up
        # timing at once and alone): what one batch measured does not show it, and more batches were taken where
        # they cost (three ranks on two cores: two batches of two rows, 649 tokens/s, where one of four gave more)
        together = self.prior.together if self.prior is not None and len(self.prior.ranks) == n + 1 else ()
        return cost_model.Pipeline(ranks, links, acceptance=cost_model.Acceptance(), overlap=False, together=together)

    def prior_row_ms(self, ranks: int) -> list[float]:
        """What a row more adds to each rank's work per batch as the start-up model says, at the K measured (rank
        0: its drafting and its slice; a later rank: its slice); zeros without one, or for another ring."""
        p, k = self.prior, self.k
        if p is None or len(p.ranks) != ranks:
            return [0.0] * ranks
        prep = cost_model.round_parts(p, k, 2).prep_ms - cost_model.round_parts(p, k, 1).prep_ms
        return [prep, *(r.ms(2, k + 1) - r.ms(1, k + 1) for r in p.ranks[1:])]

    def now(self, streams: int | None = None) -> int:
        """G for `streams` live streams (None: as many as G may be)."""
        if self.given is not None:
            return self.given
        if self.trip is None or not self.rank0 or not self.stages:
            return 1
        return cost_model.best_batches(self.pipeline(), 0, streams or self.most, self.most)

    def observe(self, record, waited_ms: float, alone: bool = True, busy_ms: float | None = None,
                k: int | None = None) -> None:
        """A fresh block's round (not a first round, not a bet), its batch's costs filed under the batch's widest K
        (`k`; None: the record's own): every row drafts as many steps and runs as long a block as the widest, so a
        newcomer's K=0 row beside rows at K=4 costs what they do. Rank 0's work per batch is all it did since the
        last reply but wait (`busy_ms`): its forwards are the least of it with a small model (committing, sampling,
        answering clients, a frame each way: ~4 ms a one-row batch of the tiny model here, its forward
        ~1.7), and counting the forwards alone made 4 batches of one row look free (four streams at K=0 over 0 ms
        read 183 tokens/s, 248 counting it all: bench/README). The trip is read only from rounds whose reply
        rank 0 waited for: one read late (rank 0 busy with another batch) holds rank 0's work besides the trip;
        and only from rounds sent into an empty pipe (`alone`): one sent behind another batch may wait at a later
        rank busy with it, and that wait read as trip makes more batches look free, which lengthens the wait.
        Such a reading is never below the trip, though, so the least of the last TRIP_WINDOW bounds it: while
        several batches take turns no round goes into an empty pipe, and a trip read high before would stay, and
        with it the batches it made look free (three ranks on two cores, 0 ms: a decode round sent while the later
        ranks still took in three other prompts read 1,099 ms of wire; bench/README)."""
        if record.from_ahead:
            return
        s, self.k = self.smoothing, record.drafted if k is None else k
        key = (self.k, record.batch)
        work = max(record.draft_ms + record.stage0_ms, busy_ms or 0.0)
        self.rank0[key] = ema(self.rank0.get(key), work, s)
        stages = [*record.middle_ms, record.last_ms]
        if any(len(old) != len(stages) for old in self.stages.values()):
            self.stages = {}
        old = self.stages.get(key, stages)
        self.stages[key] = [ema(o, new, s) for o, new in zip(old, stages)]
        if waited_ms > 1.0 and alone:
            self.trip = ema(self.trip, record.network_ms, s)
        elif waited_ms > 1.0 and self.trip is not None:
            self.queued_trips.append(record.network_ms)
            self.trip = min(self.trip, min(self.queued_trips))


def rows_line(by_rows: dict[int, float], prior_row_ms: float = 0.0) -> cost_model.RankCost:
    """A resource's ms per batch as fixed + row_ms x rows, least squares through the sizes measured (never falling
    with the rows, never below zero); one size: through it, `prior_row_ms` a row."""
    if len(by_rows) == 1:
        ((rows, ms),) = by_rows.items()
        return cost_model.RankCost(max(0.0, ms - prior_row_ms * rows), row_ms=prior_row_ms)
    xs, ys = list(by_rows), list(by_rows.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    return cost_model.RankCost(max(0.0, my - slope * mx), row_ms=slope)


class Scheduler:
    def __init__(self, count: int, batches_on_the_way: int | None = None, depth=None, prefill_chunk: int = 512,
                 prior: cost_model.Pipeline | None = None):
        self.count = count
        self.prefill_chunk = prefill_chunk  # the most tokens a batch of first rounds carries, padding included
        self.batch_count = BatchCount(batches_on_the_way, prior=prior)  # prior: the start-up cost model
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
        """The batches to send now of the `ready` streams (nothing on the way), `waiting` batches of decode rounds
        being on the way: the newcomers' first rounds together (first_rounds); the others in batches of a 1/G
        share, each sent when full or when fewer than G decode batches are on the way (the pipe would idle). A
        batch of first rounds does not count: the running streams' next round goes out behind it (rank 0 drafts
        it while the later ranks prefill), so neither waits for the other. The rest wait for the next reply, so
        streams that fell out of step (a first round, a newcomer) are batched again."""
        on_the_way = self.batch_count.now(len(self.live))
        most = max(1, math.ceil(len(self.live) / on_the_way))
        firsts, batches = self.first_rounds([s for s in ready if s.prefilling]), []
        # by slot: a batch of consecutive slots reads every cache as a view (kvcache.static_cache: StaticKVCache.span)
        rest = sorted((s for s in ready if not s.prefilling), key=lambda s: s.slot)
        while rest and (len(rest) >= most or waiting + len(batches) < on_the_way):
            batches.append(rest[:most])
            rest = rest[most:]
        return firsts + batches

    def first_rounds(self, newcomers: list) -> list[list]:
        """The first rounds of streams admitted together (each carries its prompt's tail, up to spec.prefill_chunk
        tokens) in as few batches as hold at most prefill_chunk tokens each, padding included: one forward on every
        rank for them all reads the weights once, where one each in turn made every newcomer wait for the others'
        prefills. Shortest first; a row joins only rows at least 3/4 its length (a prefill's compute grows with
        its tokens: padding a short prompt to a long one costs more than its own forward saves). Never with decode
        rows (padded to a prompt)."""
        batches = cost_model.first_round_batches([len(s.pending) for s in newcomers], self.prefill_chunk)
        return [[newcomers[i] for i in batch] for batch in batches]

    def depth(self) -> int:
        """How many rounds of a stream may be on the way: spec.in_flight's while it is alone; one while several
        streams fill the pipe (their rounds, not bets, use the wait)."""
        return self.in_flight.now() if len(self.live) == 1 else 1

    def observe(self, record, waited_ms: float, decode: bool, alone: bool = True, busy_ms: float | None = None,
                k: int | None = None) -> None:
        """A round's costs: a lone stream's teach spec.in_flight=auto its depth, several streams' the batch count
        (`decode`: not a stream's first round, which carries its prompt; `alone`: sent into an empty pipe; `busy_ms`:
        rank 0's whole work for the batch, None when not known; `k`: the batch's widest K, None: the record's)."""
        if len(self.live) == 1:
            self.in_flight.observe(record)
        elif decode:
            self.batch_count.observe(record, waited_ms, alone, busy_ms, k)
