"""Rank 0's round loop as an object: a Session owns the stage, the drafter, the links and the K policy,
and steps one stream (one request's generation) one round at a time.

    stream = session.open(prompt_ids, output, request)     # Request, prefill chunks; the prompt's tail waits
    while not output.done:
        record, reply = session.step(stream)                # draft, stage 0, send, (draft ahead), reply, commit

`generate` is that loop. A stream holds everything a request owns between rounds (its committed
tokens, the tokens the target has yet to see, its K, the round prepared ahead); the session holds
what requests share. The later ranks' side is speculative.rounds.

Every cache (both stages, the drafter) is indexed by position, so the tokens of the last request are
still there when the next one arrives. A new prompt that begins with them (the next turn of a
conversation, the same document with another question) rewinds every cache to the longest common
prefix and prefills only the rest. In fp32 the output is what a fresh run gives (tested), since a
rewound cache holds what a fresh prefill of that prefix would have written; in bf16 the prefix was
computed in other blocks than a fresh prefill would use, so a near-tie can fall the other way.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from netbridge import protocol
from netbridge.protocol import Prefill, Reply, Request, Round
from speculative.drafters import Drafts
from speculative.in_flight import in_flight_policy
from speculative.k_choice import k_policy
from speculative.output import Output
from speculative.rounds import Generation, RoundRecord, middle_ms


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
    draft_ms: float = 0.0  # drafting and stage 0 while no round was in flight (0 for a bet)
    stage0_ms: float = 0.0
    guess: int | None = None  # on a bet: the token the target must give after the block before
    prepared_ms: float = 0.0  # on a bet: drafting + stage 0, in the wait of an earlier round
    sent_at: float | None = None  # perf_counter when its send began; None while held
    send_ms: float = 0.0

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
    chain: deque = field(default_factory=deque)  # its blocks on the way (sent) and prepared ahead (held), in order
    t_start: float = field(default_factory=time.perf_counter)

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


class Replies:
    """The replies from the last rank, in the order their rounds were sent, less those of rounds dropped on a
    failed bet (`unanswered`: still to come, read and thrown away before the next one that counts)."""

    def __init__(self, channel):
        self.channel, self.unanswered = channel, 0

    def next(self) -> tuple[Reply, float]:
        """The reply to the oldest round that counts; and the ms the later ranks spent on the dropped ones
        before it (as they measured)."""
        wasted_ms = self.drain()
        return protocol.recv(self.channel, Reply), wasted_ms

    def drain(self) -> float:
        wasted_ms = 0.0
        while self.unanswered:
            reply = protocol.recv(self.channel, Reply)
            wasted_ms += reply.stage1_ms + sum(middle_ms(reply))
            self.unanswered -= 1
        return wasted_ms


class Session:
    def __init__(self, stage, drafter, channel, spec: SpecSettings = SpecSettings(), replies=None, prefixes=None):
        self.stage, self.drafter, self.channel = stage, drafter, channel
        self.prefixes = prefixes  # cache.dir: rank 0's saved prefixes (speculative.prefixes.RankPrefixes), or None
        self.replies = Replies(replies or channel)  # from the last rank (with more than two ranks, its own link)
        self.spec = spec
        self.k_policy = k_policy(spec.k, spec.adaptive, spec.k_from_costs, spec.overlap)
        self.depth = in_flight_policy(spec.in_flight, spec.overlap)
        self.cached: list[int] = []  # the tokens every cache holds, in order

    # --- a whole generation -------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], output: Output, request: Request = Request(), on_round=None,
                 cancelled=lambda: False) -> Generation:
        """One generation. `cancelled()` is asked between rounds (a client that went away); the caches
        stay consistent whenever it stops. `on_round(record, reply)` after every round (telemetry)."""
        # at least the prompt's last token is fed again: its logits give the first new token
        reuse = common_prefix(self.cached, prompt_ids[:-1])
        self.cached = []  # unknown until the generation ends cleanly (an exception leaves it so)
        stream = self.open(prompt_ids, output, request, reuse)
        try:
            while not output.done and not cancelled():
                record, reply = self.step(stream)
                if on_round is not None:
                    on_round(record, reply)
        finally:  # also on an error: a caller that keeps the session drains what is still on the way at the next open
            self.drop_chain(stream)
        self.replies.drain()
        gen = stream.gen
        gen.total_s = time.perf_counter() - stream.t_start
        # the caches hold every committed token but the newest (the next round feeds it), or, when no
        # round ran at all, just the reused prefix
        self.cached = (prompt_ids + output.tokens)[:-1] if gen.rounds else prompt_ids[:gen.reused]
        if self.prefixes is not None:
            self.prefixes.after_generation()
        return gen

    def open(self, prompt_ids: list[int], output: Output, request: Request, reuse: int = 0) -> Stream:
        """Start a stream: the Request to the later ranks, the drafter reset past `reuse` (prompt tokens every
        cache already holds), the prompt's new part prefilled but for the tail the first round carries."""
        self.replies.drain()  # a generation that stopped on an error may have left replies on the way
        stream = Stream(output, request, Generation(prompt_ids, output, reused=reuse), list(prompt_ids), [], 0)
        stream.gen.t0_s = stream.t_start
        held = self.restore(stream.gen, reuse)
        protocol.send(self.channel, request)
        self.drafter.reset(reuse, request.temperature, request.seed + 1)  # what memory holds: a drafter may hold less
        if self.prefixes is not None and self.prefixes.drafter is not None:
            self.prefixes.restore_drafter(held)
        stream.pending = self.prefill_chunks(prompt_ids, held)
        stream.k_now = self.k_policy.first()
        return stream

    def restore(self, gen: Generation, reuse: int) -> int:
        """cache.dir: the longest saved prefix of the prompt every rank holds, loaded on every rank when longer than
        the `reuse` tokens the caches hold (speculative.prefixes: a Lookup around the ring when rank 0 holds more,
        a Restore for every request). Returns what the caches hold."""
        if self.prefixes is None:
            return reuse
        answer = self.prefixes.lookup(gen.prompt_ids, reuse)
        if answer is not None:
            protocol.send(self.channel, answer)
            answer = protocol.recv(self.replies.channel, protocol.Lookup)
        restore = self.prefixes.restore(reuse, answer)
        protocol.send(self.channel, restore)
        gen.reused, gen.reused_disk = restore.tokens, restore.tokens - reuse
        return restore.tokens

    def prefill_chunks(self, prompt_ids: list[int], reuse: int) -> list[int]:
        """Send all but the last `prefill_chunk` tokens of the prompt's new part as Prefill messages; returns
        the rest, which the first round carries. Each message's compute stays bounded (the later ranks'
        receives have a timeout), rank 1 runs its layers over one chunk while rank 0 runs its own over the
        next, and the drafter takes in each chunk meanwhile."""
        start, pending, chunk = reuse, prompt_ids[reuse:], self.spec.prefill_chunk
        while len(pending) > chunk:
            piece, pending = pending[:chunk], pending[chunk:]
            hidden = self.stage.run(start, torch.tensor([piece], device=self.stage.device))
            protocol.send(self.channel, Prefill(start, hidden))
            start += len(piece)
            self.drafter.catch_up(prompt_ids[:start])
        return pending

    # --- one round ----------------------------------------------------------------------------
    def step(self, s: Stream) -> tuple[RoundRecord, Reply]:
        """One round of stream `s`: its oldest block's reply, the accepted tokens committed. Before waiting,
        the chain is topped up: a fresh block when nothing is on the way, then blocks prepared on the bet
        that every earlier one is fully accepted, sent while fewer than the depth (spec.in_flight) are on
        the way, and one more held back under spec.overlap."""
        t_round = time.perf_counter()
        if not s.chain:
            s.chain.append(self.fresh_block(s))
        self.send_held(s)
        ahead_ms, prepared = self.use_the_wait(s)
        in_flight = s.sent
        reply, wasted_ms = self.replies.next()
        block = s.chain.popleft()
        round_ms = _ms(block.sent_at)
        kept = self.commit(s, block, reply)
        if not s.gen.rounds:
            s.gen.ttft_s = time.perf_counter() - s.t_start
            if self.prefixes is not None:  # the prompt is in the cache: its new blocks to the writer thread
                self.prefixes.after_prefill()
        bet = s.chain[0].holds(reply, len(block.drafts)) if s.chain else None
        lost = self.drop_chain(s) if bet is False or s.output.done else 0
        if not s.chain:  # else the drafter's cache runs ahead on the bets that held, exactly as it should
            self.drafter.commit(len(s.committed))
        record = RoundRecord(len(block.drafts), reply.accepted, kept, block.draft_ms, block.stage0_ms, round_ms,
                             reply.stage1_ms, t_round - s.t_start, block.send_ms, block.sent_at - s.t_start,
                             block.guess is not None, ahead_ms, middle_ms(reply),
                             in_flight, lost, bet, wasted_ms, prepared)
        s.gen.rounds.append(record)
        s.k_now = self.k_policy.after(s.k_now, record, decode=len(s.gen.rounds) > 1)
        self.depth.observe(record)
        return record, reply

    def fresh_block(self, s: Stream) -> Block:
        """Rank 0's half of a round from the committed tokens: K drafts, then its slice over
        [pending..., d1..dK] from the block's start."""
        t0 = time.perf_counter()
        prefill_round = len(s.committed) == len(s.gen.prompt_ids)
        drafts = self.drafter.propose(s.committed, 0 if prefill_round else min(s.k_now, s.remaining - 1))  # never overshoot
        draft_ms, t1 = _ms(t0), time.perf_counter()
        fed = s.pending + drafts.tokens.tolist()
        hidden = self.stage.run(s.start, torch.tensor([fed], device=self.stage.device))
        return Block(s.start, fed, drafts, hidden, s.k_now, draft_ms, _ms(t1))

    def send_held(self, s: Stream) -> None:
        """Send the chain's held blocks, oldest first, while fewer than the depth are on the way."""
        for block in s.chain:
            if block.sent_at is None and s.sent < self.depth.now():
                self.send(block)

    def send(self, block: Block) -> None:
        block.sent_at = time.perf_counter()
        protocol.send(self.channel, Round(block.start, block.hidden, block.drafts.tokens, block.drafts.q_ids,
                                          block.drafts.q_probs, guess=block.guess))
        block.send_ms, block.hidden = _ms(block.sent_at), None

    def use_the_wait(self, s: Stream) -> tuple[float, int]:
        """While rounds are in flight: prepare blocks on the bet, each sent at once while the depth allows,
        one more held back under spec.overlap; returns the ms spent preparing them and how many. When the next round will
        draft nothing, the drafter takes in the committed tokens now, not all at once when K rises again."""
        prepared_ms, prepared = 0.0, 0
        while s.chain[-1].sent_at is not None:  # else one is held back already
            tip = s.chain[-1]
            k_next = min(self.k_policy.bet(tip.k, len(tip.drafts)), s.remaining - s.promised - 1)
            if k_next == 0:
                self.drafter.catch_up(s.committed)
            if k_next <= 0 or not (s.sent < self.depth.now() or self.spec.overlap):
                break
            block = self.bet_block(s, tip, k_next)
            if block is None:
                break
            s.chain.append(block)
            prepared_ms, prepared = prepared_ms + block.prepared_ms, prepared + 1
            if s.sent < self.depth.now():
                self.send(block)
        return prepared_ms, prepared

    def bet_block(self, s: Stream, tip: Block, k_next: int) -> Block | None:
        """Draft the guess plus k_next tokens after the tip's drafts and run stage 0 over them: on a hit the
        caches are exactly where this block needs them. None when the drafter has nothing to propose."""
        t0 = time.perf_counter()
        context = s.committed[:s.chain[0].start] + [t for block in s.chain for t in block.fed]
        proposal = self.drafter.propose(context, k_next + 1)
        if len(proposal) < k_next + 1:  # a drafter with nothing to propose (n-gram miss, no drafter)
            return None
        guess, drafts = int(proposal.tokens[0]), proposal.after_first()
        fed = [guess] + drafts.tokens.tolist()
        hidden = self.stage.run(len(context), torch.tensor([fed], device=self.stage.device))
        return Block(len(context), fed, drafts, hidden, k_next, guess=guess, prepared_ms=_ms(t0))

    def drop_chain(self, s: Stream) -> int:
        """The bet the chain was built on failed (or the stream ended): forget its blocks. The sent ones'
        replies will still come, in order, before any later round's: Replies drops them. Returns how many."""
        lost = s.sent
        self.replies.unanswered += lost
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

    # --- between requests ---------------------------------------------------------------------
    def idle(self) -> None:
        """Tell the other ranks the links are alive while no request is waiting (their receives have a timeout)."""
        protocol.send(self.channel, protocol.Idle())

    def close(self) -> None:
        protocol.send(self.channel, protocol.Bye())
        if self.prefixes is not None:
            self.prefixes.close()  # every saved block on disk before a one-shot run exits
