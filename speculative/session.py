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
from dataclasses import dataclass, field

import torch

from netbridge import protocol
from netbridge.protocol import Prefill, Reply, Request, Round
from speculative.drafters import Drafts
from speculative.k_choice import k_policy
from speculative.output import Output
from speculative.rounds import Generation, RoundRecord


@dataclass(frozen=True)
class SpecSettings:
    """How rank 0 speculates (spec.* and model.prefill_chunk); no setting changes the output."""
    k: int = 4  # the most drafts per round
    adaptive: bool = False  # K follows acceptance (k_choice.AdaptiveK)
    overlap: bool = False  # while a round is in flight, prepare the next one (Session.draft_ahead)
    k_from_costs: bool = False  # K from measured acceptance and costs (k_choice.KFromCosts)
    prefill_chunk: int = 512  # a longer prompt crosses in Prefill messages of this many tokens


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
class Ahead:
    """The next round, prepared while this one was in flight, on the bet that every draft is accepted
    and the target's next token is the drafter's own guess. It is used only if the reply says so."""
    guess: int
    drafts: Drafts
    hidden: torch.Tensor
    ms: float

    def hit(self, reply: Reply, drafted: int) -> bool:
        return reply.accepted == drafted and reply.token == self.guess


@dataclass
class Stream:
    """One request between rounds: what it has committed and what the target has yet to see."""
    output: Output
    request: Request
    gen: Generation
    committed: list[int]  # prompt + every token kept so far
    pending: list[int]  # the tail of `committed` the target has not seen: the prompt's rest, then the newest token
    k_now: int  # this stream's K for its next round
    ahead: Ahead | None = None  # its next round, prepared during the last one (spec.overlap)
    t_start: float = field(default_factory=time.perf_counter)

    @property
    def start(self) -> int:
        """Where the next block begins: every cache holds exactly the tokens before it."""
        return len(self.committed) - len(self.pending)

    @property
    def remaining(self) -> int:
        return self.output.max_new_tokens - len(self.output.tokens)


class Session:
    def __init__(self, stage, drafter, channel, spec: SpecSettings = SpecSettings(), replies=None):
        self.stage, self.drafter, self.channel = stage, drafter, channel
        self.replies = replies or channel  # the last rank's link with more than two ranks
        self.spec = spec
        self.k_policy = k_policy(spec.k, spec.adaptive, spec.k_from_costs, spec.overlap)
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
        while not output.done and not cancelled():
            record, reply = self.step(stream)
            if on_round is not None:
                on_round(record, reply)
        gen = stream.gen
        gen.total_s = time.perf_counter() - stream.t_start
        # the caches hold every committed token but the newest (the next round feeds it), or, when no
        # round ran at all, just the reused prefix
        self.cached = (prompt_ids + output.tokens)[:-1] if gen.rounds else prompt_ids[:reuse]
        return gen

    def open(self, prompt_ids: list[int], output: Output, request: Request, reuse: int = 0) -> Stream:
        """Start a stream: the Request to the later ranks, the drafter reset past `reuse` (prompt tokens every
        cache already holds), the prompt's new part prefilled but for the tail the first round carries."""
        stream = Stream(output, request, Generation(prompt_ids, output, reused=reuse), list(prompt_ids), [], 0)
        stream.gen.t0_s = stream.t_start
        protocol.send(self.channel, request)
        self.drafter.reset(reuse, request.temperature, request.seed + 1)
        stream.pending = self.prefill_chunks(prompt_ids, reuse)
        stream.k_now = self.k_policy.first()
        return stream

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
        """One round of stream `s`: its block to the pipe, the reply back, the accepted tokens committed."""
        t_round = time.perf_counter()
        start, ahead = s.start, s.ahead
        if ahead is not None:  # prepared during the last round, which accepted everything and the guess
            drafts, hidden, draft_ms, stage0_ms = ahead.drafts, ahead.hidden, 0.0, 0.0
        else:
            drafts, hidden, draft_ms, stage0_ms = self.draft_and_stage0(s)
        t0 = time.perf_counter()
        protocol.send(self.channel, Round(start, hidden, drafts.tokens, drafts.q_ids, drafts.q_probs))
        send_ms = _ms(t0)
        s.ahead = self.use_the_wait(s, drafts)
        reply = protocol.recv(self.replies, Reply)
        round_ms = _ms(t0)
        kept = self.commit(s, drafts, reply)
        if not s.gen.rounds:
            s.gen.ttft_s = time.perf_counter() - s.t_start
        record = RoundRecord(len(drafts), reply.accepted, kept, draft_ms, stage0_ms, round_ms, reply.stage1_ms,
                             t_round - s.t_start, send_ms, t0 - s.t_start, ahead is not None,
                             s.ahead.ms if s.ahead is not None else 0.0,
                             [(m[2] - m[1]) * 1000 for m in reply.middle_marks or []])
        s.gen.rounds.append(record)
        s.k_now = self.k_policy.after(s.k_now, record, decode=len(s.gen.rounds) > 1)
        if s.ahead is not None and (s.output.done or not s.ahead.hit(reply, len(drafts))):
            s.ahead = None
        if s.ahead is None:  # on a hit the drafter's cache already runs ahead, exactly as it should
            self.drafter.commit(len(s.committed))
        return record, reply

    def draft_and_stage0(self, s: Stream):
        """Rank 0's half of a round: K drafts, then its slice over [pending..., d1..dK] from the block's start."""
        t0 = time.perf_counter()
        prefill_round = len(s.committed) == len(s.gen.prompt_ids)
        drafts = self.drafter.propose(s.committed, 0 if prefill_round else min(s.k_now, s.remaining - 1))  # never overshoot
        draft_ms, t1 = _ms(t0), time.perf_counter()
        ids = torch.tensor([s.pending + drafts.tokens.tolist()], device=self.stage.device)
        return drafts, self.stage.run(s.start, ids), draft_ms, _ms(t1)

    def use_the_wait(self, s: Stream, drafts: Drafts) -> Ahead | None:
        """While the round is in flight: with spec.overlap, prepare the next one on the bet that this one is
        fully accepted; a round that will draft nothing lets the drafter take in the committed tokens now,
        not all at once when K rises again."""
        k_next = min(self.k_policy.bet(s.k_now, len(drafts)), s.remaining - len(drafts) - 2)
        if self.spec.overlap and k_next > 0:
            return self.draft_ahead(s.committed + drafts.tokens.tolist(), k_next)
        if k_next == 0:
            self.drafter.catch_up(s.committed)
        return None

    def draft_ahead(self, context: list[int], k_next: int) -> Ahead | None:
        """Draft the guess plus k_next tokens after `context` (committed + this round's drafts) and run
        stage 0 over them; both caches are then exactly where the next round needs them on a hit."""
        t0 = time.perf_counter()
        proposal = self.drafter.propose(context, k_next + 1)
        if len(proposal) < k_next + 1:  # a drafter with nothing to propose (n-gram miss, no drafter)
            return None
        guess, drafts = int(proposal.tokens[0]), proposal.after_first()
        ids = torch.tensor([[guess] + drafts.tokens.tolist()], device=self.stage.device)
        return Ahead(guess, drafts, self.stage.run(len(context), ids), _ms(t0))

    def commit(self, s: Stream, drafts: Drafts, reply: Reply) -> int:
        """The accepted drafts and the target's token, as far as the output keeps them; returns how many."""
        new_tokens = drafts.tokens[:reply.accepted].tolist() + [reply.token]
        kept = s.output.commit(new_tokens)
        s.committed += new_tokens[:kept]
        s.pending = s.committed[-1:]
        return kept

    # --- between requests ---------------------------------------------------------------------
    def idle(self) -> None:
        """Tell the other ranks the links are alive while no request is waiting (their receives have a timeout)."""
        protocol.send(self.channel, protocol.Idle())

    def close(self) -> None:
        protocol.send(self.channel, protocol.Bye())
