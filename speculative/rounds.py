"""The round, one function per rank, side by side.

    rank 0                                         rank 1
    drafts = drafter.propose(committed, k)
    h = stage0([pending..., d1..dK])
    send("round", hidden=h, drafts, [q])  ------>  logits = stage1(h)[-(K+1):]
                                                   accepted, next = verify(logits, drafts)
    a, next <------------------------------------  send("reply", accepted, next)
    rewind stage0, commit d1..da + next            rewind stage1 to the committed length

With N > 2 ranks the same round goes around a ring; a middle rank only runs its layers (run_middle):

    rank 0 --Round(h0)--> rank 1 --Round(h1)--> ... --> rank N-1 (run_rank1): verify --Reply--> rank 0

Every stage rewinds to the block's `start` (Stage.run: rank 0 is the authority on the committed length),
so the middle ranks need no reply; rank 0 drafts ahead (spec.overlap) while the block is anywhere in the pipe.
Rank 0's side is the round-loop object speculative.session.Session; this module holds the later ranks'
loops and the records both sides share.

`pending` is the prompt in the first round (the prefill) and the last committed token after that;
both caches then hold exactly the committed tokens but the newest, which the next round feeds.
A request may start with the first `reuse` tokens of its prompt already in every cache (the last
request's conversation): the prefill then feeds only the rest. Messages: netbridge.protocol.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from model_parallel.stage import Stage
from netbridge import protocol
from netbridge.channel import Channel
from speculative.prefixes import pass_on
from netbridge.protocol import Lookup, Prefill, Reply, Request, Restore, Round
from speculative.output import Output
from speculative.verify import token_logprobs, verify


@dataclass
class RoundRecord:
    drafted: int
    accepted: int
    committed: int  # tokens kept after stop criteria
    draft_ms: float
    stage0_ms: float
    round_ms: float  # send -> reply received: network + rank 1's compute (N > 2: every later rank's)
    stage1_ms: float  # rank 1's forward + verification, as it measured (N > 2: the last rank's)
    start_s: float = 0.0  # when the round started, seconds since generation started
    send_ms: float = 0.0  # the part of round_ms spent in channel.send (handing the frame over: the wire is in the wait)
    sent_s: float = 0.0  # when the send began, seconds since generation started (round_ms starts here)
    from_ahead: bool = False  # drafts and stage 0 were prepared while the previous round was in flight
    ahead_ms: float = 0.0  # of round_ms: preparing the next round while this one was in flight (spec.overlap)
    middle_ms: list[float] = field(default_factory=list)  # N > 2: each middle rank's forward, as it measured
    in_flight: int = 1  # rounds of this stream on the way when this reply came, itself included (spec.in_flight)
    bets_lost: int = 0  # rounds sent ahead on the bet this reply broke: their replies are dropped
    bet: bool | None = None  # whether the round prepared ahead on this one (if any) had its bet hold
    wasted_ms: float = 0.0  # the later ranks' work on dropped rounds whose replies came just before this one
    prepared: int = 0  # blocks prepared ahead in this round's wait (ahead_ms is their drafting + stage 0)

    @property
    def later_ms(self) -> float:
        """Every rank after rank 0: its layers (and the last one's head and verification)."""
        return self.stage1_ms + sum(self.middle_ms)

    @property
    def network_ms(self) -> float:
        """round_ms less every rank's compute: the wire, (de)serialization, an emulated delay. Under
        spec.overlap a reply may wait while rank 0 drafts ahead: then this is a lower bound."""
        return max(0.0, self.round_ms - self.ahead_ms - self.later_ms)


@dataclass
class Generation:
    prompt_ids: list[int]
    output: Output
    rounds: list[RoundRecord] = field(default_factory=list)
    ttft_s: float = 0.0
    total_s: float = 0.0
    t0_s: float = 0.0  # time.perf_counter() at the start: start_s + t0_s is a round's clock reading
    reused: int = 0  # prompt tokens found in the caches (not prefilled again)
    reused_disk: int = 0  # of them, those read from cache.dir (speculative.prefixes); the rest were in memory


class NonFiniteLogits(RuntimeError):
    """A forward produced NaN or Inf: no output from it can be trusted."""


def middle_ms(reply: Reply) -> list[float]:
    """N > 2: each middle rank's forward in the round of `reply`, as it measured (Round.marks come back in it)."""
    return [(m[2] - m[1]) * 1000 for m in reply.middle_marks or []]


def run_rank1(stage: Stage, channel: Channel, reply_to: Channel | None = None, prefixes=None, grammars=None) -> int:
    """Serve rounds until rank 0 says Bye; returns the number of rounds served. With more than two
    ranks this is the last one: `channel` comes from the rank before it, replies go to `reply_to` (rank 0).
    `prefixes`: this rank's cache.dir (speculative.prefixes.RankPrefixes), or None. `grammars`: what makes a
    Request's grammar (speculative.grammar.FolderGrammars), or None."""
    reply_to = reply_to or channel
    request, generator, grammar = Request(), torch.Generator(), None
    rounds, bet_holds_for = 0, None
    while True:
        t_wait = time.perf_counter()
        msg = protocol.recv(channel, Request, Lookup, Restore, Prefill, Round, protocol.Idle, protocol.Bye)
        if isinstance(msg, protocol.Bye):
            return rounds
        if isinstance(msg, (Lookup, Restore)):
            answer = pass_on(prefixes, msg)
            if isinstance(answer, Lookup):  # back to rank 0, which decides
                protocol.send(reply_to, answer)
            continue
        if isinstance(msg, Request):
            request = msg
            grammar = request_grammar(grammars, request)
        if isinstance(msg, Prefill):
            stage.run(msg.start, msg.hidden.to(stage.device), num_logits=1)
        if not isinstance(msg, Round):
            continue
        t0 = time.perf_counter()
        if msg.guess is not None and (msg.start, msg.guess) != bet_holds_for:  # rank 0 drops its reply: skip the work
            protocol.send(reply_to, Reply(-1, -1, 0.0, [t_wait, t0, t0, t0], msg.marks))
            continue
        decides = msg.start + msg.hidden.shape[1] - msg.drafts.numel()
        generator.manual_seed(round_seed(request.seed, decides))
        constrained = grammar if grammar is not None and grammar.at(decides) else None  # else a dropped round's
        accepted, token, t_forward, logprobs = verify_round(stage, msg, request, generator, constrained)
        t_send = time.perf_counter()
        protocol.send(reply_to, Reply(accepted, token, (t_send - t0) * 1000, [t_wait, t0, t_forward, t_send], msg.marks,
                                      *logprobs))
        rounds += 1
        bet_holds_for = (decides + accepted, token)  # the start and first token of a block sent on this round's full acceptance
        if prefixes is not None:  # after the reply: a prompt's first round filled the cache, save it
            prefixes.after_prefill()


def run_middle(stage: Stage, prev: Channel, next: Channel, prefixes=None) -> int:
    """A middle rank (N > 2): its layers over every Prefill's and Round's hidden states, passed on to
    the next rank; a Lookup or Restore (cache.dir) after its own part; every other message passed on as it
    came. Returns the number of rounds served."""
    rounds = 0
    while True:
        t_wait = time.perf_counter()
        msg = protocol.recv(prev, Request, Lookup, Restore, Prefill, Round, protocol.Idle, protocol.Bye)
        if isinstance(msg, (Lookup, Restore)):
            msg = pass_on(prefixes, msg)
        if isinstance(msg, (Prefill, Round)):
            t0 = time.perf_counter()
            msg.hidden = stage.run(msg.start, msg.hidden.to(stage.device))
            if isinstance(msg, Round):
                t_done = time.perf_counter()
                msg.marks = (msg.marks or []) + [[t_wait, t0, t_done, t_done]]  # as Reply.marks: wait, start, forward, send
                rounds += 1
        protocol.send(next, msg)
        if isinstance(msg, Round) and prefixes is not None:
            prefixes.after_prefill()
        if isinstance(msg, protocol.Bye):
            return rounds


def round_seed(seed: int, decides: int) -> int:
    """The last rank's seed for the round whose first decision is the token at position `decides` (the
    committed length the round was built on; how the prompt was split into chunks or reused does not
    change it). A round's randomness is a function of that, not of how many rounds came before: rounds
    rank 0 sent ahead on a bet that failed (spec.in_flight, spec.overlap) are verified and thrown away,
    and must not shift the draws of the rounds that are kept. Kept rounds decide strictly increasing
    positions, so their draws stay independent. A dropped round may decide a position a kept one later
    does and use the same draws: harmless, as whether it is dropped was settled by the round before it,
    never by those draws."""
    return (seed * 0x9E3779B97F4A7C15 + decides) % 2**63


def request_grammar(grammars, request: Request):
    """The Grammar a Request asks the last rank to mask by (structured outputs), or None."""
    if request.grammar is None:
        return None
    if grammars is None:
        raise ValueError("a request carries a grammar but this rank has no tokenizer to enforce it with")
    return grammars.from_source(request.grammar)


def verify_round(stage: Stage, msg: Round, request: Request, generator: torch.Generator, grammar=None):
    """Rank 1's half of a round: (accepted drafts, the next token, when the forward finished, and the committed
    tokens' log-probabilities as Reply's (logprobs, top_ids, top_logprobs), Nones unless the Request asks)."""
    k = msg.drafts.numel()
    logits = stage.run(msg.start, msg.hidden.to(stage.device), num_logits=k + 1)[0].cpu()
    t_forward = time.perf_counter()
    if not logits.sum().isfinite():  # argmax of NaNs is a valid-looking token; a sum is 30x cheaper than isfinite().all()
        raise NonFiniteLogits(f"the target's logits at positions {msg.start}..{msg.start + k} are not finite (NaN/Inf): "
                              "the weights are corrupt or model.dtype overflows (float16?); try model.dtype=bfloat16 or float32")
    accepted, token = verify(logits, msg.drafts, request.temperature, request.top_p, generator, msg.q_ids, msg.q_probs,
                             grammar)
    if request.logprobs is None:
        return accepted, token, t_forward, (None, None, None)
    lp = token_logprobs(logits, msg.drafts[:accepted].tolist() + [token], request.logprobs)
    return accepted, token, t_forward, (lp.chosen, lp.top_ids, lp.top)
