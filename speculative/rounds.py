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

Every stage rewinds to the block's `start` (rank 0 is the authority on the committed length), so the
middle ranks need no reply; rank 0 drafts ahead (spec.overlap) while the block is anywhere in the pipe.

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
from netbridge.protocol import Prefill, Reply, Request, Round
from speculative.drafters import Drafts
from speculative.output import Output
from speculative.verify import target_probs, verify_greedy, verify_sampled


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
    send_ms: float = 0.0  # the part of round_ms spent in channel.send (an emulated delay included)
    sent_s: float = 0.0  # when the send began, seconds since generation started (round_ms starts here)
    from_ahead: bool = False  # drafts and stage 0 were prepared while the previous round was in flight
    ahead_ms: float = 0.0  # of round_ms: preparing the next round while this one was in flight (spec.overlap)
    middle_ms: list[float] = field(default_factory=list)  # N > 2: each middle rank's forward, as it measured

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


class NonFiniteLogits(RuntimeError):
    """A forward produced NaN or Inf: no output from it can be trusted."""


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def next_k(k: int, drafted: int, accepted: int, k_max: int) -> int:
    """Draft more after a full hit, less after a miss (transformers' assisted-generation schedule):
    a miss means the later drafts were wasted work. Any K is lossless; only speed depends on it."""
    if drafted == 0:
        return k
    return min(k + 2, k_max) if accepted == drafted else max(k - 1, 1)


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


def draft_and_stage0(stage: Stage, drafter, committed: list[int], pending: list[int], k: int):
    """Rank 0's half of a round: K drafts, then its slice over [pending..., d1..dK] from `start`."""
    t0 = time.perf_counter()
    drafts = drafter.propose(committed, k)
    draft_ms, t1 = _ms(t0), time.perf_counter()
    start = len(committed) - len(pending)
    stage.cache.rewind(start)
    stage.cache.check_room(start + len(pending) + len(drafts))
    ids = torch.tensor([pending + drafts.tokens.tolist()], device=stage.device)
    hidden = stage(ids, live=start + ids.shape[1])
    return drafts, hidden, draft_ms, _ms(t1)


def draft_ahead(stage: Stage, drafter, context: list[int], k_next: int) -> Ahead | None:
    """Draft the guess plus k_next tokens after `context` (committed + this round's drafts) and run
    stage 0 over them; both caches are then exactly where the next round needs them on a hit."""
    t0 = time.perf_counter()
    proposal = drafter.propose(context, k_next + 1)
    if len(proposal) < k_next + 1:  # a drafter with nothing to propose (n-gram miss, no drafter)
        return None
    guess, drafts = int(proposal.tokens[0]), proposal.after_first()
    ids = torch.tensor([[guess] + drafts.tokens.tolist()], device=stage.device)
    hidden = stage(ids, live=len(context) + ids.shape[1])
    return Ahead(guess, drafts, hidden, _ms(t0))


def prefill_chunks(stage: Stage, drafter, channel: Channel, prompt_ids: list[int], reuse: int, chunk: int) -> list[int]:
    """Send all but the last `chunk` tokens of the prompt's new part as Prefill messages; returns the rest,
    which the first round carries. Each message's compute stays bounded (rank 1's receive has a timeout),
    rank 1 runs its layers over one chunk while rank 0 runs its own over the next, and the drafter
    takes in each chunk meanwhile."""
    start, pending = reuse, prompt_ids[reuse:]
    stage.cache.rewind(start)
    while len(pending) > chunk:
        piece, pending = pending[:chunk], pending[chunk:]
        hidden = stage(torch.tensor([piece], device=stage.device), live=start + len(piece))
        protocol.send(channel, Prefill(start, hidden))
        start += len(piece)
        drafter.catch_up(prompt_ids[:start])
    return pending


def run_rank0(stage: Stage, drafter, channel: Channel, prompt_ids: list[int], output: Output, k: int,
              on_round=None, adaptive: bool = False, request: Request = Request(), reuse: int = 0,
              cancelled=lambda: False, overlap: bool = False, prefill_chunk: int = 512, k_costs=None,
              replies: Channel | None = None) -> Generation:
    """One generation. `reuse`: prompt tokens every cache already holds. `cancelled()` is asked
    between rounds (a client that went away); the caches stay consistent whenever it stops.
    `overlap`: while a round is in flight, prepare the next one (draft_ahead). `k_costs`: a
    KFromCosts that picks K from measured costs (else `adaptive`'s +2/-1, else K fixed).
    `replies`: the last rank's link when there are more than two ranks (with two, `channel`)."""
    replies = replies or channel
    gen = Generation(prompt_ids, output, reused=reuse)
    t_start = gen.t0_s = time.perf_counter()
    protocol.send(channel, request)
    drafter.reset(reuse, request.temperature, request.seed + 1)
    committed = list(prompt_ids)
    pending = prefill_chunks(stage, drafter, channel, prompt_ids, reuse, prefill_chunk)  # tokens the target has not yet seen
    k_now, ahead = (k if k_costs is None else k_costs.choose()), None
    while not output.done and not cancelled():
        t_round = time.perf_counter()
        start = len(committed) - len(pending)
        if ahead is not None:  # prepared during the last round, which accepted everything and the guess
            drafts, hidden, draft_ms, stage0_ms = ahead.drafts, ahead.hidden, 0.0, 0.0
        else:
            remaining = output.max_new_tokens - len(output.tokens)
            k_round = 0 if len(committed) == len(prompt_ids) else min(k_now, remaining - 1)  # never overshoot
            drafts, hidden, draft_ms, stage0_ms = draft_and_stage0(stage, drafter, committed, pending, k_round)

        t0 = time.perf_counter()
        protocol.send(channel, Round(start, hidden, drafts.tokens, drafts.q_ids, drafts.q_probs))
        send_ms = _ms(t0)
        used_ahead, ahead = ahead is not None, None
        k_next = k_now if k_costs is not None or not adaptive else next_k(k_now, len(drafts), len(drafts), k)
        k_next = min(k_next, output.max_new_tokens - len(output.tokens) - len(drafts) - 2)
        if overlap and k_next > 0:
            ahead = draft_ahead(stage, drafter, committed + drafts.tokens.tolist(), k_next)
        elif k_next == 0:  # no drafting next round: the drafter takes in the committed tokens in this wait,
            drafter.catch_up(committed)  # not all at once when K rises again
        ahead_ms = ahead.ms if ahead is not None else 0.0
        reply = protocol.recv(replies, Reply)
        round_ms = _ms(t0)

        new_tokens = drafts.tokens[:reply.accepted].tolist() + [reply.token]
        kept = output.commit(new_tokens)
        committed += new_tokens[:kept]
        pending = committed[-1:]
        if ahead is not None and (output.done or not ahead.hit(reply, len(drafts))):
            ahead = None
        if ahead is None:  # on a hit the drafter's cache already runs ahead, exactly as it should
            drafter.commit(len(committed))
        if not gen.rounds:
            gen.ttft_s = time.perf_counter() - t_start
        record = RoundRecord(len(drafts), reply.accepted, kept, draft_ms, stage0_ms, round_ms, reply.stage1_ms,
                             t_round - t_start, send_ms, t0 - t_start, used_ahead, ahead_ms,
                             [(m[2] - m[1]) * 1000 for m in reply.middle_marks or []])
        gen.rounds.append(record)
        if adaptive:
            k_now = next_k(k_now, len(drafts), reply.accepted, k)
        if k_costs is not None and len(gen.rounds) > 1:
            k_costs.observe(record)
            k_now = k_costs.choose()
        if on_round is not None:
            on_round(record, reply)
    gen.total_s = time.perf_counter() - t_start
    return gen


def run_rank1(stage: Stage, channel: Channel, reply_to: Channel | None = None) -> int:
    """Serve rounds until rank 0 says Bye; returns the number of rounds served. With more than two
    ranks this is the last one: `channel` comes from the rank before it, replies go to `reply_to` (rank 0)."""
    reply_to = reply_to or channel
    request, generator = Request(), torch.Generator()
    rounds = 0
    while True:
        t_wait = time.perf_counter()
        msg = protocol.recv(channel, Request, Prefill, Round, protocol.Idle, protocol.Bye)
        if isinstance(msg, protocol.Bye):
            return rounds
        if isinstance(msg, Request):
            request = msg
            generator.manual_seed(request.seed)
        if isinstance(msg, Prefill):
            stage.cache.rewind(msg.start)
            stage.cache.check_room(msg.start + msg.hidden.shape[1])
            stage(msg.hidden.to(stage.device), num_logits=1, live=msg.start + msg.hidden.shape[1])
        if not isinstance(msg, Round):
            continue
        t0 = time.perf_counter()
        accepted, token, t_forward = verify_round(stage, msg, request, generator)
        t_send = time.perf_counter()
        protocol.send(reply_to, Reply(accepted, token, (t_send - t0) * 1000, [t_wait, t0, t_forward, t_send], msg.marks))
        rounds += 1


def run_middle(stage: Stage, prev: Channel, next: Channel) -> int:
    """A middle rank (N > 2): its layers over every Prefill's and Round's hidden states, passed on to
    the next rank; every other message passed on as it came. Returns the number of rounds served."""
    rounds = 0
    while True:
        t_wait = time.perf_counter()
        msg = protocol.recv(prev, Request, Prefill, Round, protocol.Idle, protocol.Bye)
        if isinstance(msg, (Prefill, Round)):
            t0 = time.perf_counter()
            live = msg.start + msg.hidden.shape[1]
            stage.cache.rewind(msg.start)  # rank 0 is the authority on the committed length
            stage.cache.check_room(live)
            msg.hidden = stage(msg.hidden.to(stage.device), live=live)
            if isinstance(msg, Round):
                t_done = time.perf_counter()
                msg.marks = (msg.marks or []) + [[t_wait, t0, t_done, t_done]]  # as Reply.marks: wait, start, forward, send
                rounds += 1
        protocol.send(next, msg)
        if isinstance(msg, protocol.Bye):
            return rounds


def verify_round(stage: Stage, msg: Round, request: Request, generator: torch.Generator) -> tuple[int, int, float]:
    """Rank 1's half of a round: (accepted drafts, the next token, when the forward finished)."""
    hidden, k = msg.hidden.to(stage.device), msg.drafts.numel()
    stage.cache.rewind(msg.start)  # rank 0 is the authority on the committed length
    stage.cache.check_room(msg.start + hidden.shape[1])
    logits = stage(hidden, num_logits=k + 1, live=msg.start + hidden.shape[1])[0].cpu()
    t_forward = time.perf_counter()
    if not logits.sum().isfinite():  # argmax of NaNs is a valid-looking token; a sum is 30x cheaper than isfinite().all()
        raise NonFiniteLogits(f"the target's logits at positions {msg.start}..{msg.start + k} are not finite (NaN/Inf): "
                              "the weights are corrupt or model.dtype overflows (float16?); try model.dtype=bfloat16 or float32")
    if request.temperature > 0:
        probs = target_probs(logits, request.temperature, request.top_p)
        return (*verify_sampled(probs, msg.drafts, msg.q_ids, msg.q_probs, generator), t_forward)
    return (*verify_greedy(logits, msg.drafts), t_forward)
