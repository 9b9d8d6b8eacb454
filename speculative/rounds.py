"""The later ranks' side of the round (run_middle, run_last) and the records both sides share; rank 0's side is
speculative.session.Session. The two, side by side (docs/design.md, "One round on one page", walks it through
the code):

    rank 0                                         the last rank (rank 1 of two: run_last)
    drafts = drafter.propose(committed, k)
    h = stage0([pending..., d1..dK])
    send("round", hidden=h, drafts, [q])  ------>  logits = last_stage(h)[-(K+1):]
                                                   accepted, next = verify(logits, drafts)
    a, next <------------------------------------  send("reply", accepted, next)
    rewind stage0, commit d1..da + next            rewind its stage to the committed length

With N > 2 ranks the same round goes around a ring; a middle rank only runs its layers (run_middle):

    rank 0 --Round(h0)--> rank 1 --Round(h1)--> ... --> rank N-1 (run_last): verify --Reply--> rank 0

Every stage rewinds to the block's `start` (Stage.run: rank 0 is the authority on the committed length),
so the middle ranks need no reply; rank 0 drafts ahead (spec.overlap) while the block is anywhere in the pipe.

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
from netbridge.protocol import Lookup, Prefill, Reply, Request, Restore, Round, SamplingParams
from speculative.grammar import GrammarFailure, first_line
from speculative.output import Output
from speculative.verify import token_logprobs, verify


@dataclass
class RoundRecord:
    drafted: int
    accepted: int
    committed: int  # tokens kept after stop criteria
    draft_ms: float
    stage0_ms: float
    round_ms: float  # send -> reply received: network + every later rank's compute
    last_ms: float  # the last rank's forward + verification, as it measured (stats' mean_ms.last)
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
    slot: int = 0  # the KV slot of its stream (serve.max_concurrent)
    batch: int = 1  # blocks in the forward it went out in (several streams' rounds run as one)
    live: int = 1  # streams live when its reply came
    on_the_way: int = 1  # blocks of every stream on the way when its reply was awaited, itself included
    looked_up: bool = False  # its drafts were found in the context, with no model step (draft.kind=hybrid, ngram)
    cut: bool = False  # looked up, cut where the model parts from the copy, its own drafts after (hybrid, greedy)
    predicted_tokens_per_s: float = 0.0  # the cost model's tokens/s for its stream at its K (speculative.cost_model)
    measured_tokens_per_s: float = 0.0  # its stream's tokens/s since its first token, this round's included
    start: int = 0  # the position its block began at: the tokens its stream had cached, which it attended over
    predicted_parts: object = None  # the cost model's draft_ms, stage0_ms, middle_ms, last_ms for it (cost_model.PartsMs)
    alone: bool = False  # went out into an empty ring, no prompt's chunks ahead of it nor a first round beside it
    busy_ms: float | None = None  # rank 0's whole work since the reply before (its wait for replies left out): a
    # batch's first record only; None after an admission or an idle spell (not a batch's work)

    @property
    def later_ms(self) -> float:
        """Every rank after rank 0: its layers (and the last one's head and verification)."""
        return self.last_ms + sum(self.middle_ms)

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
    error: str | None = None  # it ended because its grammar failed on the last rank (Reply.error): why
    predicted_ttft_s: float = 0.0  # the cost model's TTFT of its prompt's new part (0: no model)
    predicted_tokens_per_s: float = 0.0  # the cost model's decode tokens/s at its own acceptance (0: none; Session.end)
    predicted_tokens_per_s_timed: float = 0.0  # ... at the costs as the start-up timed them (not its rounds' pace)
    predicted_held_s: float = 0.0  # the cost model's wait of its decoding behind prompts admitted after it (held_s)


class NonFiniteLogits(RuntimeError):
    """A forward produced NaN or Inf: no output from it can be trusted."""


def middle_ms(reply: Reply) -> list[float]:
    """N > 2: each middle rank's forward in the round of `reply`, as it measured (Round.marks come back in it)."""
    return [(m[2] - m[1]) * 1000 for m in reply.middle_marks or []]


class SlotVerifier:
    """The last rank's state for the generation in one slot: its SamplingParams, its generator, its grammar, and
    which bet a block sent on its last round's full acceptance must carry (spec.in_flight). `failed`: why its
    grammar failed (speculative.grammar.GrammarFailure), once it has; every Round of the slot is then answered
    with it until the slot's next Request."""

    def __init__(self, params: SamplingParams = SamplingParams(), grammar=None, failed: str | None = None):
        self.params, self.grammar, self.failed = params, grammar, failed
        self.generator = torch.Generator()
        self.bet_holds_for: tuple[int, int] | None = None

    def skips(self, msg: Round) -> bool:
        """A block sent on a bet this rank already knows failed: rank 0 drops its reply, so skip the work."""
        return msg.guess is not None and (msg.start, msg.guess) != self.bet_holds_for


def run_last(stage: Stage, channel: Channel, reply_to: Channel | None = None, prefixes=None, grammars=None) -> int:
    """Serve rounds until rank 0 says Bye; returns the number of rounds served. With more than two
    ranks this is the last one: `channel` comes from the rank before it, replies go to `reply_to` (rank 0).
    `prefixes`: this rank's cache.dir (speculative.prefixes.RankPrefixes), or None. `grammars`: what makes a
    Request's grammar (speculative.grammar.FolderGrammars), or None. Every generation being served has a
    slot (Request.slot); a batch of Rounds of several slots runs as one forward, each verified by its own."""
    reply_to = reply_to or channel
    slots: dict[int, SlotVerifier] = {}
    rounds = 0
    while True:
        t_wait = time.perf_counter()
        msg = protocol.recv(channel, Request, Lookup, Restore, Prefill, Round, protocol.Idle, protocol.Bye)
        if isinstance(msg, protocol.Bye):
            return rounds
        if isinstance(msg, (Lookup, Restore)):
            answer = pass_on(prefixes, msg)
            if isinstance(answer, Lookup):  # back to rank 0, which decides
                protocol.send(reply_to, answer)
        elif isinstance(msg, Request):
            slots[msg.slot] = slot_verifier(grammars, msg)
            take_shared_prefix(stage, msg)
        elif isinstance(msg, Prefill):
            stage.run(msg.start, msg.hidden.to(stage.device), num_logits=None, slot=msg.slot)
        elif isinstance(msg, Round):
            batch = [msg] + [protocol.recv(channel, Round) for _ in range(msg.batch - 1)]
            replies = verify_batch(stage, batch, [slots.setdefault(m.slot, SlotVerifier()) for m in batch], t_wait)
            protocol.send_all(reply_to, replies)
            rounds += sum(reply.accepted >= 0 for reply in replies)
            if prefixes is not None:  # after the replies: a prompt's first round filled the cache, save it
                for m in batch:
                    prefixes.after_prefill(m.slot)


def take_shared_prefix(stage: Stage, request: Request) -> None:
    """A new request whose prompt begins as a live one's: its slot takes those tokens' keys and values from that
    one's slot (Session.shared_prefix) before its Prefill and first Round come."""
    if request.copy_from is not None:
        stage.cache.copy_prefix(request.copy_from, request.slot, request.copied)


def verify_batch(stage: Stage, batch: list[Round], verifiers: list[SlotVerifier], t_wait: float) -> list[Reply]:
    """One Reply per Round of `batch`, in order: the blocks that count run as one forward, each verified by its
    slot's verifier; a block whose bet failed gets a placeholder (accepted -1) without any work."""
    t0 = time.perf_counter()
    work = [(m, v) for m, v in zip(batch, verifiers) if not v.skips(m)]
    logits = batch_logits(stage, [m for m, _ in work])
    t_forward = time.perf_counter()
    verdicts = {id(m): verify_or_fail(m, rows, v) for (m, v), rows in zip(work, logits)}
    t_send = time.perf_counter()
    replies = []
    for m, v in zip(batch, verifiers):
        if id(m) not in verdicts:
            replies.append(Reply(-1, -1, 0.0, [t_wait, t0, t0, t0], m.marks))
            continue
        if verdicts[id(m)] is None:  # its grammar failed: rank 0 ends that request alone
            replies.append(Reply(-1, -1, (t_send - t0) * 1000, [t_wait, t0, t_forward, t_send], m.marks, error=v.failed))
            continue
        accepted, token, logprobs = verdicts[id(m)]
        replies.append(Reply(accepted, token, (t_send - t0) * 1000, [t_wait, t0, t_forward, t_send], m.marks, *logprobs))
        v.bet_holds_for = (decided(m) + accepted, token)  # the start and first token of a block sent on its full acceptance
    return replies


def batch_logits(stage: Stage, batch: list[Round]) -> list[torch.Tensor]:
    """The target's logits [K+1, V] at each block's drafts (and the position before them), one forward for all."""
    if not batch:
        return []
    if len(batch) == 1:  # one block: exactly the forward a lone request runs
        m = batch[0]
        return [stage.run(m.start, m.hidden.to(stage.device), num_logits=m.drafts.numel() + 1, slot=m.slot)[0].cpu()]
    x, ends = padded([m.hidden for m in batch])
    n = max(m.drafts.numel() for m in batch) + 1
    logits = stage.run_rows([m.start for m in batch], x.to(stage.device), [m.slot for m in batch], ends, num_logits=n)
    return [row[n - m.drafts.numel() - 1:].cpu() for row, m in zip(logits, batch)]


def padded(hidden: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Blocks [1, T_b, H] as one batch [B, T, H], each padded on the right (Stage.run_rows), and their lengths."""
    ends = [h.shape[1] for h in hidden]
    x = hidden[0].new_zeros((len(hidden), max(ends), hidden[0].shape[-1]))
    for b, h in enumerate(hidden):
        x[b, :ends[b]] = h[0]
    return x, ends


def decided(msg: Round) -> int:
    """The position of the first token a round decides: the committed length it was built on."""
    return msg.start + msg.hidden.shape[1] - msg.drafts.numel()


def run_middle(stage: Stage, prev: Channel, next: Channel, prefixes=None) -> int:
    """A middle rank (N > 2): its layers over every Prefill's and Round's hidden states (a batch of Rounds as one
    forward), passed on to the next rank; a Lookup or Restore (cache.dir) after its own part; every other
    message passed on as it came. Returns the number of rounds served."""
    rounds = 0
    while True:
        t_wait = time.perf_counter()
        msg = protocol.recv(prev, Request, Lookup, Restore, Prefill, Round, protocol.Idle, protocol.Bye)
        if isinstance(msg, (Lookup, Restore)):
            msg = pass_on(prefixes, msg)
        if isinstance(msg, Request):
            take_shared_prefix(stage, msg)
        if isinstance(msg, Prefill):
            msg.hidden = stage.run(msg.start, msg.hidden.to(stage.device), slot=msg.slot)
        if isinstance(msg, Round):
            batch = [msg] + [protocol.recv(prev, Round) for _ in range(msg.batch - 1)]
            forward_batch(stage, batch, t_wait)
            rounds += len(batch)
            protocol.send_all(next, batch)
            if prefixes is not None:
                for m in batch:
                    prefixes.after_prefill(m.slot)
        else:
            protocol.send(next, msg)
        if isinstance(msg, protocol.Bye):
            return rounds


def forward_batch(stage: Stage, batch: list[Round], t_wait: float) -> None:
    """A middle rank's layers over a batch of Rounds, as one forward: each Round's hidden states replaced by its
    own rows of the output, its clock marks added (as Reply.marks: wait, start, forward, send)."""
    t0 = time.perf_counter()
    if len(batch) == 1:
        batch[0].hidden = stage.run(batch[0].start, batch[0].hidden.to(stage.device), slot=batch[0].slot)
    else:
        x, ends = padded([m.hidden for m in batch])
        out = stage.run_rows([m.start for m in batch], x.to(stage.device), [m.slot for m in batch], ends)
        for b, m in enumerate(batch):
            m.hidden = out[b:b + 1, :ends[b]]
    t_done = time.perf_counter()
    for m in batch:
        m.marks = (m.marks or []) + [[t_wait, t0, t_done, t_done]]


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


def request_grammar(grammars, params: SamplingParams):
    """The Grammar a Request's params ask the last rank to mask by (structured outputs), or None."""
    if params.grammar is None:
        return None
    if grammars is None:
        raise ValueError("a request carries a grammar but this rank has no tokenizer to enforce it with")
    return grammars.from_source(params.grammar)


def slot_verifier(grammars, request: Request) -> SlotVerifier:
    """The verifier of a new generation; one whose grammar cannot be made is failed from the start (its Rounds are
    answered with the cause: that request ends, the others go on)."""
    try:
        return SlotVerifier(request.params, request_grammar(grammars, request.params))
    except ValueError as e:  # speculative.grammar.GrammarError, or no tokenizer on this rank
        return SlotVerifier(request.params, failed=str(e))


def verify_or_fail(msg: Round, logits: torch.Tensor, v: SlotVerifier):
    """verify_round, or None once the slot's grammar has failed (v.failed says why)."""
    if v.failed is None:
        try:
            return verify_round(msg, logits, v)
        except GrammarFailure as e:
            v.failed = str(e)
    return None


def verify_round(msg: Round, logits: torch.Tensor, v: SlotVerifier):
    """The last rank's half of a round over the target's `logits` [K+1, V] at its positions: (accepted drafts, the next
    token, and the committed tokens' log-probabilities as Reply's (logprobs, top_ids, top_logprobs), Nones unless
    the Request asks)."""
    k, params = msg.drafts.numel(), v.params
    if not logits.sum().isfinite():  # argmax of NaNs is a valid-looking token; a sum is 30x cheaper than isfinite().all()
        raise NonFiniteLogits(f"the target's logits at positions {msg.start}..{msg.start + k} are not finite (NaN/Inf): "
                              "the weights are corrupt or model.dtype overflows (float16?); try model.dtype=bfloat16 or float32")
    position = decided(msg)
    v.generator.manual_seed(round_seed(params.seed, position))
    try:
        grammar = v.grammar if v.grammar is not None and v.grammar.at(position) else None  # else a dropped round's
        accepted, token = verify(logits, msg.drafts, params.temperature, params.top_p, v.generator, msg.q_ids,
                                 msg.q_probs, grammar)
    except GrammarFailure:
        raise
    except Exception as e:  # noqa: BLE001 - with a grammar, whatever llguidance raised: this request's alone
        if v.grammar is None:
            raise
        raise GrammarFailure(f"{type(e).__name__}: {first_line(e)}") from e
    if params.logprobs is None:
        return accepted, token, (None, None, None)
    lp = token_logprobs(logits, msg.drafts[:accepted].tolist() + [token], params.logprobs)
    return accepted, token, (lp.chosen, lp.top_ids, lp.top)
