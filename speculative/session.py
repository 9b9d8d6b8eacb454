"""Rank 0's round loop as an object: a Session owns the stage, the drafter, the links and the K policy,
and steps the streams being served (one request's generation each, in a KV slot of its own) round by round.

    stream = session.admit(prompt_ids, output, request)     # a free slot, the Request, the prompt's prefill
    while stream in session.live:
        ended = session.tick()       # blocks for the streams with nothing on the way, sent; one batch's replies

`generate` is that loop for one stream. A stream holds everything a request owns between rounds (its committed
tokens, the tokens the target has yet to see, its K, the rounds prepared ahead); the session holds what requests
share. The later ranks' side is speculative.rounds.

Several streams (serve.max_concurrent): every tick drafts for all the streams with nothing on the way in one
batched step, runs stage 0 over them as one forward, and sends their blocks as batches (a batch runs as one
forward on every later rank, each block verified by its own stream's settings). The batches are kept small enough
that several are on the way at once (`batches_on_the_way`): while one is on the wire or at a later rank, rank 0
drafts for the next. Replies come back in the order the blocks went out (the ring is one queue), so streams take
turns by themselves: the streams of the oldest batch are the next ones drafted for. With one stream live, that
stream may keep several rounds on the way (spec.in_flight, spec.overlap: bets on its own drafts).

Every cache (both stages, the drafter) is indexed by position in a slot, so the tokens of a slot's last request
are still there when the next one arrives. A new prompt is given the free slot holding its longest prefix (the next
turn of a conversation, the same document with another question), else the one unused longest; every cache of
that slot rewinds to the common prefix and only the rest is prefilled. In fp32 the output is what a fresh run
gives (tested), since a rewound cache holds what a fresh prefill of that prefix would have written; in bf16 the
prefix was computed in other blocks than a fresh prefill would use, so a near-tie can fall the other way.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from netbridge import protocol
from netbridge.protocol import Prefill, Reply, Request, Round
from speculative.drafters import Drafts
from speculative.in_flight import in_flight_policy
from speculative.k_choice import k_policy
from speculative.output import Output
from speculative.rounds import Generation, RoundRecord, middle_ms, padded


@dataclass(frozen=True)
class SpecSettings:
    """How rank 0 speculates (spec.* and model.prefill_chunk); no setting changes the output."""
    k: int = 4  # the most drafts per round
    adaptive: bool = False  # K follows acceptance (k_choice.AdaptiveK)
    overlap: bool = False  # while a round is in flight, prepare the next one (Session.draft_ahead)
    k_from_costs: bool = False  # K from measured acceptance and costs (k_choice.KFromCosts)
    prefill_chunk: int = 512  # a longer prompt crosses in Prefill messages of this many tokens
    in_flight: int | str = 1  # rounds of a stream on the way at once (1: one; "auto": speculative.in_flight)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


@dataclass
class Block:
    """A round rank 0 prepared: where it starts, its drafts and stage 0's output. A block prepared while
    the one before it was in flight is a bet (`guess`): that every draft before it is accepted and the
    target's next token is the drafter's own guess, the token this block begins with."""
    start: int
    fed: list[int]  # the tokens stage 0 ran over from `start`: the pending ones or the guess, then the drafts
    drafts: Drafts
    hidden: torch.Tensor | None  # stage 0's output, dropped once sent
    k: int  # the K this block was drafted at (the K policy's state on the bet)
    draft_ms: float = 0.0  # drafting and stage 0 while no round was in flight (0 for a bet); of its whole batch
    stage0_ms: float = 0.0
    guess: int | None = None  # on a bet: the token the target must give after the block before
    prepared_ms: float = 0.0  # on a bet: drafting + stage 0, in the wait of an earlier round
    sent_at: float | None = None  # perf_counter when its send began; None while held
    send_ms: float = 0.0
    stream: Stream | None = None  # whose block
    dropped: bool = False  # sent, then dropped (a failed bet, a stream that ended): its reply is thrown away
    batch: int = 1  # blocks in the forward it went out in

    def holds(self, reply: Reply, drafted: int) -> bool:
        """Whether the bet this block was prepared on held, given the reply to the block before it."""
        return reply.accepted == drafted and reply.token == self.guess


@dataclass
class Stream:
    """One request between rounds: what it has committed and what the target has yet to see."""
    output: Output
    request: Request
    gen: Generation
    committed: list[int]  # prompt + every token kept so far
    pending: list[int]  # the tail of `committed` the target has not seen: the prompt's rest, then the newest token
    k_now: int  # this stream's K for its next fresh round
    slot: int = 0  # its KV slot on every rank
    on_round: Callable | None = None  # on_round(record, reply) after each of its rounds
    cancelled: Callable[[], bool] = lambda: False  # asked every tick: a client that went away
    chain: deque = field(default_factory=deque)  # its blocks on the way (sent) and prepared ahead (held), in order
    t_start: float = field(default_factory=time.perf_counter)
    t_round: float = 0.0  # when its current round began
    ahead: tuple[float, int] = (0.0, 0)  # ms and blocks prepared ahead in its current round's wait
    ended: bool = False

    @property
    def start(self) -> int:
        """Where the next fresh block begins: every cache holds exactly the tokens before it."""
        return len(self.committed) - len(self.pending)

    @property
    def remaining(self) -> int:
        return self.output.max_new_tokens - len(self.output.tokens)

    @property
    def sent(self) -> int:
        return sum(b.sent_at is not None for b in self.chain)

    @property
    def promised(self) -> int:
        """The most tokens the blocks in the chain can still commit (each: its drafts + the target's token)."""
        return sum(len(b.drafts) + 1 for b in self.chain)

    @property
    def prefilling(self) -> bool:
        """Its next round is its first: it carries the prompt's tail and drafts nothing."""
        return len(self.committed) == len(self.gen.prompt_ids)


class Replies:
    """The replies from the last rank: one per block, in the order the blocks were sent (the ring is one queue),
    so the batches on the way are a queue too. A dropped block's reply is read and thrown away."""

    def __init__(self, channel):
        self.channel = channel
        self.waiting: deque[list[Block]] = deque()  # the batches sent and not answered, oldest first

    def expect(self, batch: list[Block]) -> None:
        self.waiting.append(batch)

    @property
    def on_the_way(self) -> int:
        return sum(len(batch) for batch in self.waiting)

    def next(self) -> tuple[list[tuple[Block, Reply]], float]:
        """The oldest batch's replies to the blocks that count (none when nothing counts is on the way); and the
        ms the later ranks spent on the dropped ones read before them (as they measured)."""
        wasted_ms = self.drain()
        if not self.waiting:
            return [], wasted_ms
        kept = []
        for block in self.waiting.popleft():
            reply = protocol.recv(self.channel, Reply)
            if block.dropped:
                wasted_ms += reply.stage1_ms + sum(middle_ms(reply))
            else:
                kept.append((block, reply))
        return kept, wasted_ms

    def drain(self) -> float:
        """Read the replies of the oldest batches while every block in them was dropped."""
        wasted_ms = 0.0
        while self.waiting and all(block.dropped for block in self.waiting[0]):
            for _ in self.waiting.popleft():
                reply = protocol.recv(self.channel, Reply)
                wasted_ms += reply.stage1_ms + sum(middle_ms(reply))
        return wasted_ms


class Session:
    def __init__(self, stage, drafter, channel, spec: SpecSettings = SpecSettings(), replies=None, prefixes=None,
                 slots: int = 1, batches_on_the_way: int = 2):
        self.stage, self.drafter, self.channel = stage, drafter, channel
        self.prefixes = prefixes  # cache.dir: rank 0's saved prefixes (speculative.prefixes.RankPrefixes), or None
        self.replies = Replies(replies or channel)  # from the last rank (with more than two ranks, its own link)
        self.spec = spec
        self.k_policy = k_policy(spec.k, spec.adaptive, spec.k_from_costs, spec.overlap)
        self.depth = in_flight_policy(spec.in_flight, spec.overlap)
        self.slots = slots  # how many streams may be live at once (serve.max_concurrent)
        # several streams: a batch holds at most a 1/batches_on_the_way share of them, so that while one batch is at
        # the later ranks or on the wire rank 0 works on another (the pipe of two ranks has two places to fill)
        self.batches_on_the_way = batches_on_the_way
        self.held: list[list[int]] = [[] for _ in range(slots)]  # per slot: the tokens its caches hold, in order
        self.last_used = [0.0] * slots  # per slot: when it was last given to a stream (the oldest is reused first)
        self.streams: dict[int, Stream] = {}  # the live streams, by slot
        self.ended: list[Stream] = []  # streams that ended outside a tick (settle), for the next tick to return

    @property
    def live(self) -> list[Stream]:
        return list(self.streams.values())

    def free(self) -> int:
        return self.slots - len(self.streams)

    def forget(self) -> None:
        """Every slot's prompt prefilled again from scratch (benchmarks: every request as the first one)."""
        self.held = [[] for _ in range(self.slots)]

    # --- a whole generation -------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], output: Output, request: Request = Request(), on_round=None,
                 cancelled=lambda: False) -> Generation:
        """One generation, alone. `cancelled()` is asked between rounds (a client that went away); the caches
        stay consistent whenever it stops. `on_round(record, reply)` after every round (telemetry)."""
        stream = self.admit(prompt_ids, output, request, on_round, cancelled)
        try:
            while not stream.ended:
                self.tick()
        finally:  # also on an error: a caller that keeps the session reads what is still on the way as dropped
            if not stream.ended:
                self.end(stream, clean=False)
        self.replies.drain()
        return stream.gen

    def admit(self, prompt_ids: list[int], output: Output, request: Request = Request(), on_round=None,
              cancelled=lambda: False) -> Stream:
        """A new stream in a free slot: the one whose caches hold the longest prefix of the prompt (at least the
        prompt's last token is fed again: its logits give the first new token), else the one unused longest."""
        free = [slot for slot in range(self.slots) if slot not in self.streams]
        if not free:
            raise RuntimeError(f"all {self.slots} slots are in use; wait for a stream to end (Session.free())")
        slot = max(free, key=lambda i: (common_prefix(self.held[i], prompt_ids[:-1]), -self.last_used[i]))
        reuse = common_prefix(self.held[slot], prompt_ids[:-1])
        self.held[slot] = []  # unknown until the stream ends cleanly (an exception leaves it so)
        self.last_used[slot] = time.perf_counter()
        stream = self.open(prompt_ids, output, request, reuse, slot)
        stream.on_round, stream.cancelled = on_round, cancelled
        self.streams[slot] = stream
        return stream

    def open(self, prompt_ids: list[int], output: Output, request: Request, reuse: int = 0, slot: int = 0) -> Stream:
        """Start a stream: the Request to the later ranks, the drafter's slot reset past `reuse` (prompt tokens every
        cache already holds), the prompt's new part prefilled but for the tail the first round carries."""
        self.replies.drain()  # a generation that stopped on an error may have left replies on the way
        stream = Stream(output, request, Generation(prompt_ids, output, reused=reuse), list(prompt_ids), [], 0, slot)
        stream.gen.t0_s = stream.t_start
        held = self.restore(stream.gen, reuse, slot)
        protocol.send(self.channel, dataclasses.replace(request, slot=slot))
        self.drafter.reset(reuse, request.temperature, request.seed + 1, slot=slot)  # a drafter may hold less
        if self.prefixes is not None and self.prefixes.drafter is not None:
            self.prefixes.restore_drafter(held, slot)
        stream.pending = self.prefill_chunks(prompt_ids, held, slot)
        stream.k_now = self.k_policy.first()
        return stream

    def restore(self, gen: Generation, reuse: int, slot: int) -> int:
        """cache.dir: the longest saved prefix of the prompt every rank holds, loaded on every rank when longer than
        the `reuse` tokens the caches hold (speculative.prefixes: a Lookup around the ring when rank 0 holds more,
        a Restore for every request). Returns what the caches hold."""
        if self.prefixes is None:
            return reuse
        answer = self.prefixes.lookup(gen.prompt_ids, reuse)
        if answer is not None:
            self.settle()  # the Lookup's answer comes back behind every reply on the way
            protocol.send(self.channel, answer)
            answer = protocol.recv(self.replies.channel, protocol.Lookup)
        restore = self.prefixes.restore(reuse, answer, slot)
        protocol.send(self.channel, restore)
        gen.reused, gen.reused_disk = restore.tokens, restore.tokens - reuse
        return restore.tokens

    def prefill_chunks(self, prompt_ids: list[int], reuse: int, slot: int = 0) -> list[int]:
        """Send all but the last `prefill_chunk` tokens of the prompt's new part as Prefill messages; returns
        the rest, which the first round carries. Each message's compute stays bounded (the later ranks'
        receives have a timeout), rank 1 runs its layers over one chunk while rank 0 runs its own over the
        next, and the drafter takes in each chunk meanwhile."""
        start, pending, chunk = reuse, prompt_ids[reuse:], self.spec.prefill_chunk
        while len(pending) > chunk:
            piece, pending = pending[:chunk], pending[chunk:]
            hidden = self.stage.run(start, torch.tensor([piece], device=self.stage.device), slot=slot)
            protocol.send(self.channel, Prefill(start, hidden, slot))
            start += len(piece)
            self.drafter.catch_up(prompt_ids[:start], slot=slot)
        return pending

    # --- one tick: what is ready sent, one batch's replies ------------------------------------
    def tick(self) -> list[Stream]:
        """Send a fresh block for every live stream with nothing on the way (their drafting batched), top up a lone
        stream's chain (spec.in_flight, spec.overlap), then commit the oldest batch's replies. Returns the streams
        that ended (done, or cancelled() true): their slots are free again."""
        ended, self.ended = self.ended, []
        ended += [self.end(s) for s in self.live if s.cancelled()]
        now = time.perf_counter()
        for s in self.live:
            if not s.chain or len(self.streams) == 1:
                s.t_round = now
        self.send_fresh([s for s in self.live if not s.chain])
        for s in self.live:
            self.send_held(s)
        if len(self.streams) == 1:
            (s,) = self.live
            s.ahead = self.use_the_wait(s)
        return ended + self.take_batch()

    def settle(self) -> None:
        """Commit every reply on the way (before a message whose answer comes back behind them)."""
        while self.replies.waiting:
            self.ended += self.take_batch()

    def send_fresh(self, ready: list[Stream]) -> None:
        """Fresh blocks for `ready` (streams with nothing on the way), in batches: a prompt's first round alone (it
        carries up to spec.prefill_chunk tokens); the others in batches of a 1/batches_on_the_way share of the live
        streams, so that that many batches take turns through the pipe. A batch goes when it is full, or when
        fewer batches than that are on the way (the pipe would idle); else its streams wait for the next reply, so
        streams that fell out of step (a prompt's first round, a newcomer) are batched again."""
        most = max(1, math.ceil(len(self.streams) / self.batches_on_the_way))
        for s in [s for s in ready if s.prefilling]:
            self.send_fresh_batch([s])
        rest = [s for s in ready if not s.prefilling]
        while rest and (len(rest) >= most or len(self.replies.waiting) < self.batches_on_the_way):
            batch, rest = rest[:most], rest[most:]
            self.send_fresh_batch(batch)

    def send_fresh_batch(self, streams: list[Stream]) -> None:
        blocks = self.fresh_blocks(streams)
        for s, block in zip(streams, blocks):
            s.chain.append(block)
        self.send_batch(blocks)

    def fresh_blocks(self, streams: list[Stream]) -> list[Block]:
        """Rank 0's half of a round for each stream from its committed tokens: its drafts (one batched drafting
        step for all), then stage 0 over [pending..., d1..dK] from each block's start, as one forward."""
        t0 = time.perf_counter()
        ks = [0 if s.prefilling else min(s.k_now, s.remaining - 1) for s in streams]  # never overshoot
        if len(streams) == 1:
            drafts = [self.drafter.propose(streams[0].committed, ks[0], slot=streams[0].slot)]
        else:
            drafts = self.drafter.propose_rows([s.committed for s in streams], ks, [s.slot for s in streams])
        draft_ms, t1 = _ms(t0), time.perf_counter()
        fed = [s.pending + d.tokens.tolist() for s, d in zip(streams, drafts)]
        hidden = self.stage_zero([s.start for s in streams], fed, [s.slot for s in streams])
        stage0_ms = _ms(t1)
        return [Block(s.start, f, d, h, s.k_now, draft_ms, stage0_ms, stream=s)
                for s, f, d, h in zip(streams, fed, drafts, hidden)]

    def stage_zero(self, starts: list[int], fed: list[list[int]], slots: list[int]) -> list[torch.Tensor]:
        """Stage 0 over each block's tokens from its start in its slot: one forward (rows padded on the right)."""
        device = self.stage.device
        if len(fed) == 1:
            return [self.stage.run(starts[0], torch.tensor(fed, device=device), slot=slots[0])]
        ids, ends = padded([torch.tensor([f])[..., None] for f in fed])
        out = self.stage.run_rows(starts, ids[..., 0].to(device), slots, ends)
        return [out[b:b + 1, :end] for b, end in enumerate(ends)]

    def send_batch(self, blocks: list[Block]) -> None:
        """`blocks` (of different streams) back to back, as one batch: one forward on every later rank."""
        for block in blocks:
            block.batch = len(blocks)
            block.sent_at = time.perf_counter()
            protocol.send(self.channel, Round(block.start, block.hidden, block.drafts.tokens, block.drafts.q_ids,
                                              block.drafts.q_probs, guess=block.guess, slot=block.stream.slot,
                                              batch=len(blocks)))
            block.send_ms, block.hidden = _ms(block.sent_at), None
        self.replies.expect(blocks)

    def send_held(self, s: Stream) -> None:
        """Send the chain's held blocks, oldest first, while fewer than the depth are on the way."""
        for block in s.chain:
            if block.sent_at is None and s.sent < self.depth_now():
                self.send_batch([block])

    def depth_now(self) -> int:
        """How many rounds of a stream may be on the way: spec.in_flight's while it is alone; one while several
        streams fill the pipe (their rounds, not bets, use the wait)."""
        return self.depth.now() if len(self.streams) == 1 else 1

    def use_the_wait(self, s: Stream) -> tuple[float, int]:
        """While rounds are in flight: prepare blocks on the bet, each sent at once while the depth allows,
        one more held back under spec.overlap; returns the ms spent preparing them and how many. When the next round will
        draft nothing, the drafter takes in the committed tokens now, not all at once when K rises again."""
        prepared_ms, prepared = 0.0, 0
        while s.chain and s.chain[-1].sent_at is not None:  # else one is held back already
            tip = s.chain[-1]
            k_next = min(self.k_policy.bet(tip.k, len(tip.drafts)), s.remaining - s.promised - 1)
            if k_next == 0:
                self.drafter.catch_up(s.committed, slot=s.slot)
            if k_next <= 0 or not (s.sent < self.depth_now() or self.spec.overlap):
                break
            block = self.bet_block(s, tip, k_next)
            if block is None:
                break
            s.chain.append(block)
            prepared_ms, prepared = prepared_ms + block.prepared_ms, prepared + 1
            if s.sent < self.depth_now():
                self.send_batch([block])
        return prepared_ms, prepared

    def bet_block(self, s: Stream, tip: Block, k_next: int) -> Block | None:
        """Draft the guess plus k_next tokens after the tip's drafts and run stage 0 over them: on a hit the
        caches are exactly where this block needs them. None when the drafter has nothing to propose."""
        t0 = time.perf_counter()
        context = s.committed[:s.chain[0].start] + [t for block in s.chain for t in block.fed]
        proposal = self.drafter.propose(context, k_next + 1, slot=s.slot)
        if len(proposal) < k_next + 1:  # a drafter with nothing to propose (n-gram miss, no drafter)
            return None
        guess, drafts = int(proposal.tokens[0]), proposal.after_first()
        fed = [guess] + drafts.tokens.tolist()
        hidden = self.stage.run(len(context), torch.tensor([fed], device=self.stage.device), slot=s.slot)
        return Block(len(context), fed, drafts, hidden, k_next, guess=guess, prepared_ms=_ms(t0), stream=s)

    # --- the replies --------------------------------------------------------------------------
    def take_batch(self) -> list[Stream]:
        """The oldest batch's replies, each committed to its stream (and its on_round called); the streams that
        ended."""
        on_the_way = self.replies.on_the_way
        replies, wasted_ms = self.replies.next()
        ended = []
        for block, reply in replies:
            s = block.stream
            record = self.commit_round(s, block, reply, wasted_ms, on_the_way)
            wasted_ms = 0.0
            if s.on_round is not None:
                s.on_round(record, reply)
            if s.output.done:
                ended.append(self.end(s))
        return ended

    def commit_round(self, s: Stream, block: Block, reply: Reply, wasted_ms: float, on_the_way: int) -> RoundRecord:
        """The oldest block of `s` answered: its tokens committed, a chain whose bet failed dropped, the record."""
        in_flight = s.sent
        s.chain.popleft()
        round_ms = _ms(block.sent_at)
        kept = self.commit(s, block, reply)
        if not s.gen.rounds:
            s.gen.ttft_s = time.perf_counter() - s.t_start
            if self.prefixes is not None:  # the prompt is in the cache: its new blocks to the writer thread
                self.prefixes.after_prefill(s.slot)
        bet = s.chain[0].holds(reply, len(block.drafts)) if s.chain else None
        lost = self.drop_chain(s) if bet is False or s.output.done else 0
        if not s.chain:  # else the drafter's cache runs ahead on the bets that held, exactly as it should
            self.drafter.commit(len(s.committed), slot=s.slot)
        (ahead_ms, prepared), s.ahead = s.ahead, (0.0, 0)
        record = RoundRecord(len(block.drafts), reply.accepted, kept, block.draft_ms, block.stage0_ms, round_ms,
                             reply.stage1_ms, s.t_round - s.t_start, block.send_ms, block.sent_at - s.t_start,
                             block.guess is not None, ahead_ms, middle_ms(reply),
                             in_flight, lost, bet, wasted_ms, prepared, s.slot, block.batch, len(self.streams),
                             on_the_way)
        s.gen.rounds.append(record)
        s.k_now = self.k_policy.after(s.k_now, record, decode=len(s.gen.rounds) > 1)
        if len(self.streams) == 1:
            self.depth.observe(record)
        return record

    def drop_chain(self, s: Stream) -> int:
        """The bet the chain was built on failed (or the stream ended): forget its blocks. The sent ones'
        replies will still come, in order: Replies throws them away. Returns how many."""
        lost = 0
        for block in s.chain:
            if block.sent_at is not None:
                block.dropped, lost = True, lost + 1
        s.chain.clear()
        return lost

    def commit(self, s: Stream, block: Block, reply: Reply) -> int:
        """The accepted drafts and the target's token, as far as the output keeps them; returns how many."""
        new_tokens = block.drafts.tokens[:reply.accepted].tolist() + [reply.token]
        kept = s.output.commit(new_tokens)
        if reply.logprobs is not None:  # the Request asked for them
            s.output.keep_logprobs(reply.logprobs[:kept], reply.top_ids[:kept], reply.top_logprobs[:kept])
        s.committed += new_tokens[:kept]
        s.pending = s.committed[-1:]
        return kept

    def end(self, s: Stream, clean: bool = True) -> Stream:
        """`s` is over (done, cancelled, or failed when not `clean`): its blocks dropped, its slot free at once. Its
        caches hold every committed token but the newest (the next round would feed it), or, when no round ran,
        just the reused prefix; after a failure, nothing known."""
        self.drop_chain(s)
        del self.streams[s.slot]
        s.ended = True
        s.gen.total_s = time.perf_counter() - s.t_start
        if clean:
            self.held[s.slot] = (s.gen.prompt_ids + s.output.tokens)[:-1] if s.gen.rounds else s.gen.prompt_ids[:s.gen.reused]
        if self.prefixes is not None:
            self.prefixes.after_generation(s.slot)
        return s

    # --- between requests ---------------------------------------------------------------------
    def idle(self) -> None:
        """Tell the other ranks the links are alive while no request is waiting (their receives have a timeout)."""
        protocol.send(self.channel, protocol.Idle())

    def close(self) -> None:
        protocol.send(self.channel, protocol.Bye())
        if self.prefixes is not None:
            self.prefixes.close()  # every saved block on disk before a one-shot run exits
