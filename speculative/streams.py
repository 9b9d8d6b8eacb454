"""What rank 0 keeps of the requests it is generating: a Stream per request (its committed tokens, its chain of
Blocks on the way), and the Replies queue (one reply per block sent, in the order sent)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from netbridge import protocol
from netbridge.protocol import Reply, SamplingParams
from speculative.drafters import Drafts
from speculative.output import Output
from speculative.rounds import Generation, middle_ms


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
    into_empty_pipe: bool = False  # nothing else was on the way when it went out: its round queued behind no other
    behind_no_prompt: bool = False  # ... nor a prompt's chunks, nor a first round in its batch (no prefill in its trip)

    def holds(self, reply: Reply, drafted: int) -> bool:
        """Whether the bet this block was prepared on held, given the reply to the block before it."""
        return reply.accepted == drafted and reply.token == self.guess


@dataclass
class Stream:
    """One request between rounds: what it has committed and what the target has yet to see."""
    output: Output
    params: SamplingParams
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
    newcomers: list = field(default_factory=list)  # the streams admitted after it while it was live (Session.held_s)
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

    def drop_chain(self) -> int:
        """The bet the chain was built on failed (or the stream ended): forget its blocks. The sent ones'
        replies will still come, in order: Replies throws them away. Returns how many."""
        lost = 0
        for block in self.chain:
            if block.sent_at is not None:
                block.dropped, lost = True, lost + 1
        self.chain.clear()
        return lost

    def commit(self, block: Block, reply: Reply) -> int:
        """The accepted drafts and the target's token, as far as the output keeps them; returns how many."""
        new_tokens = block.drafts.tokens[:reply.accepted].tolist() + [reply.token]
        kept = self.output.commit(new_tokens)
        if reply.logprobs is not None:  # the Request asked for them
            self.output.keep_logprobs(reply.logprobs[:kept], reply.top_ids[:kept], reply.top_logprobs[:kept])
        self.committed += new_tokens[:kept]
        self.pending = self.committed[-1:]
        return kept


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
                wasted_ms += reply.last_ms + sum(middle_ms(reply))
            else:
                kept.append((block, reply))
        return kept, wasted_ms

    def drain(self) -> float:
        """Read the replies of the oldest batches while every block in them was dropped."""
        wasted_ms = 0.0
        while self.waiting and all(block.dropped for block in self.waiting[0]):
            for _ in self.waiting.popleft():
                reply = protocol.recv(self.channel, Reply)
                wasted_ms += reply.last_ms + sum(middle_ms(reply))
        return wasted_ms
