"""Rank 0's round loop as an object: a Session owns the stage, the drafter, the links and the K policy,
and steps the streams being served (one request's generation each, in a KV slot of its own) round by round.

    stream = session.admit(prompt_ids, output, params)      # a free slot, a Request with the params, the prefill
    while stream in session.live:
        ended = session.tick()       # blocks for the streams with nothing on the way, sent; one batch's replies

`generate` is that loop for one stream. A stream holds everything a request owns between rounds (its committed
tokens, the tokens the target has yet to see, its K, the rounds prepared ahead); the session holds what requests
share. The later ranks' side is speculative.rounds.

Several streams (serve.max_concurrent): every tick drafts for the streams with nothing on the way in one batched
step, runs stage 0 over them as one forward (speculative.blocks), and sends their blocks as the batches the
scheduler forms (speculative.scheduler); a batch runs as one forward on every later rank, each block verified by
its own stream's settings. Replies come back in the order the blocks went out (the ring is one queue; Replies in
speculative.streams), so the streams take turns. With one stream live, it may keep several rounds on the way
(spec.in_flight, spec.overlap: bets on its own drafts, speculative.blocks).

Every cache (both stages, the drafter) is indexed by position in a slot, so the tokens of a slot's last request
are still there when the next one arrives. A new prompt is given the free slot holding its longest prefix (the next
turn of a conversation, the same document with another question), else the one unused longest; every cache of
that slot rewinds to the common prefix and only the rest is prefilled. In fp32 the output is what a fresh run
gives (tested), since a rewound cache holds what a fresh prefill of that prefix would have written; in bf16 the
prefix was computed in other blocks than a fresh prefill would use, so a near-tie can fall the other way.
"""
from __future__ import annotations

from dataclasses import dataclass
import functools
import time

import torch

from netbridge import protocol
from netbridge.protocol import Prefill, Reply, Request, Round, SamplingParams
from speculative import cost_model
from speculative.blocks import BlockMaker
from speculative.grammar import GrammarFailure
from speculative.in_flight import in_flight_policy
from speculative.k_choice import in_step, k_policy
from speculative.output import Output
from speculative.rounds import Generation, RoundRecord, middle_ms
from speculative.scheduler import Scheduler, common_prefix
from speculative.streams import Block, Replies, Stream


@dataclass(frozen=True)
class SpecSettings:
    """How rank 0 speculates (spec.* and model.prefill_chunk); no setting changes the output."""
    k: int = 4  # the most drafts per round
    adaptive: bool = False  # K follows acceptance (k_choice.AdaptiveK)
    overlap: bool = False  # while a round is in flight, prepare the next one (BlockMaker.use_the_wait)
    k_from_costs: bool = False  # K from measured acceptance and costs (k_choice.KFromCosts)
    prefill_chunk: int = 512  # a longer prompt crosses in Prefill messages of this many tokens
    in_flight: int | str = 1  # rounds of a stream on the way at once (1: one; "auto": speculative.in_flight)


def unsent(streams: list[Stream]) -> list[Stream]:
    """The streams whose first round is not yet sent: admitted just before (a burst, Session.admit)."""
    return [o for o in streams if not o.gen.rounds and not o.chain]


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


class Session:
    def __init__(self, stage, drafter, channel, spec: SpecSettings = SpecSettings(), replies=None, prefixes=None,
                 slots: int = 1, batches_on_the_way: int | None = None, predictor=None, depth_at_start: int = 1):
        self.stage, self.drafter, self.channel = stage, drafter, channel
        self.prefixes = prefixes  # cache.dir: rank 0's saved prefixes (speculative.prefixes.RankPrefixes), or None
        self.replies = Replies(replies or channel)  # from the last rank (with more than two ranks, its own link)
        self.spec = spec
        # spec.k_from_costs: K from the start-up cost model where the run has one, a lone stream's at its best depth
        # spec.in_flight allows (jointly with the depth under auto: K from depth 1's rates and then the depth at that
        # K drafted K=1-2 for one client over 0 ms, where K=4 ran faster)
        model = None if predictor is None else functools.partial(predictor.rates,
                                                                 depths=cost_model.depths_allowed(spec.in_flight))
        self.k_policy = k_policy(spec.k, spec.adaptive, spec.k_from_costs, spec.overlap, model,
                                 *((None, None) if predictor is None else (predictor.intake_ms,
                                                                            predictor.admission_intake_ms)))
        self.maker = BlockMaker(stage, drafter, self.k_policy, spec.overlap)
        self.slots = slots  # how many streams may be live at once (serve.max_concurrent)
        # the slots, the live streams by slot, the batches (batches_on_the_way None: from measured costs); a
        # lone stream's depth (spec.in_flight=auto: from depth_at_start, the start-up model's, until measured)
        self.scheduler = Scheduler(slots, batches_on_the_way,
                                   in_flight_policy(spec.in_flight, spec.overlap, depth_at_start,
                                                    predictor.best_depth if predictor is not None else None),
                                   spec.prefill_chunk,
                                   predictor.start if predictor is not None else None)
        self.ended: list[Stream] = []  # streams that ended outside a tick (settle), for the next tick to return
        self.predictor = predictor  # the cost model's predictions beside what rounds measure (cost_model.Predictor)
        self.t_replied: float | None = None  # when the last reply came (rank 0's work per batch: take_batch)

    @property
    def live(self) -> list[Stream]:
        return list(self.scheduler.live.values())

    def free(self) -> int:
        return self.scheduler.free()

    # --- a whole generation -------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], output: Output, params: SamplingParams = SamplingParams(),
                 on_round=None, cancelled=lambda: False) -> Generation:
        """One generation, alone. `cancelled()` is asked between rounds (a client that went away); the caches
        stay consistent whenever it stops. `on_round(record, reply)` after every round (telemetry)."""
        stream = self.admit(prompt_ids, output, params, on_round, cancelled)
        try:
            while not stream.ended:
                self.tick()
        finally:  # also on an error: a caller that keeps the session reads what is still on the way as dropped
            if not stream.ended:
                self.end(stream, clean=False)
        self.replies.drain()
        if stream.gen.error is not None:
            raise GrammarFailure(stream.gen.error)
        return stream.gen

    def admit(self, prompt_ids: list[int], output: Output, params: SamplingParams = SamplingParams(), on_round=None,
              cancelled=lambda: False, coming: tuple[int, ...] = ()) -> Stream:
        """A new stream in a free slot (speculative.scheduler: the one holding the longest prefix of the prompt): the
        Request to the later ranks, the drafter's slot reset past what every cache holds of the prompt, the
        prompt's new part prefilled but for the tail the first round carries. `coming`: the prompts' lengths of the
        requests to be admitted right after it (a burst: the server gathered them together); its K is chosen for
        the streams live with it then, and against the drafter taking in every prompt of the burst (k_choice)."""
        slot, reuse = self.scheduler.take(prompt_ids)
        self.replies.drain()  # a generation that stopped on an error may have left replies on the way
        s = Stream(output, params, Generation(prompt_ids, output, reused=reuse), list(prompt_ids), [], 0, slot,
                   on_round, cancelled)
        s.gen.t0_s = s.t_start
        held = self.restore(s.gen, reuse, slot)
        source, shared = self.shared_prefix(prompt_ids, held)
        protocol.send(self.channel, Request(params, slot, source, shared))
        self.drafter.reset(reuse, params.temperature, params.seed + 1, slot=slot)  # a drafter may hold less
        if self.prefixes is not None and self.prefixes.drafter is not None:
            self.prefixes.restore_drafter(held, slot)
        if source is not None:  # as every later rank does on the Request
            self.stage.cache.copy_prefix(source, slot, shared)
            self.drafter.copy_prefix(source, slot, shared)
            held = s.gen.reused = shared
        burst = (*(len(o.gen.prompt_ids) - o.gen.reused for o in unsent(self.live)), *coming)
        streams = len(self.scheduler.live) + 1 + len(coming)
        s.k_now = self.k_policy.first(streams, len(prompt_ids), len(prompt_ids) - held, s.remaining, burst=burst)
        s.pending = self.prefill_chunks(prompt_ids, held, slot, drafts=s.k_now > 0)
        self.t_replied = None  # an admission is not a batch's work (BatchCount: rank 0's work per batch)
        if self.predictor is not None:
            self.predict_ttft(s, len(prompt_ids) - held)
        self.scheduler.live[slot] = s
        return s

    def shared_prefix(self, prompt_ids: list[int], held: int) -> tuple[int | None, int]:
        """The slot of the live stream whose caches hold the longest prefix of `prompt_ids` (its tokens before its
        next block: every rank has them), when longer than the `held` tokens the new slot holds, and how long;
        else (None, held). Prompts sharing a system prompt or a document, admitted together, prefill it once:
        the scheduler's choice of slot only sees the free ones, and the first of them took the one holding it."""
        source, shared = None, held
        for o in self.live:
            n = common_prefix(o.committed[:o.start], prompt_ids[:-1])  # the last is fed again: its logits are needed
            if n > shared:
                source, shared = o.slot, n
        return source, shared

    def predict_ttft(self, s: Stream, new_tokens: int) -> None:
        """The cost model's TTFT of a newcomer, from its admission, and again of the streams admitted before it whose
        first round is not yet sent (their prompts were prefilled just before its own, while it waited): their first
        rounds go behind its prefill, in the scheduler's batches, and rank 0 takes their replies only after its work
        in the wait (cost_model.first_tokens_s). Each prediction counts from its own admission. Alone, its first
        wait drafts its chain."""
        before = unsent(self.live)
        ahead = tuple(len(o.gen.prompt_ids) - o.gen.reused for o in before)
        ago_ms = tuple(1000 * (s.t_start - o.t_start) for o in before)
        depth = 0 if self.live else self.scheduler.in_flight.now()  # alone: its first wait drafts its chain
        intake = s.k_now > 0  # (admitted at K=0, the drafter leaves the prompt out: prefill_chunks)
        *firsts, s.gen.predicted_ttft_s = self.predictor.first_tokens_s(new_tokens, ahead, s.k_now, depth, intake,
                                                                          ago_ms)
        for o, first_s in zip(before, firsts):
            o.gen.predicted_ttft_s = s.t_start - o.t_start + first_s
        for o in self.live:  # its prefill holds back their decoding (held_s)
            o.newcomers.append(s)

    def held_s(self, s: Stream) -> float:
        """The cost model's wait of `s`'s decoding behind the prompts admitted after it (cost_model.held_s), each from
        its admission to its predicted first token as predicted last (a later burst's admission moves it), less the
        ring's latency."""
        prefills = [(n.t_start, n.t_start + n.gen.predicted_ttft_s) for n in s.newcomers]
        trip_s = sum(link.one_way_ms for link in self.predictor.start.links) / 1000
        return cost_model.held_s(s.t_start + s.gen.predicted_ttft_s, prefills, trip_s)

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

    def warm_up(self) -> None:
        """One prefill chunk of placeholder tokens through every rank's layers and the drafter, in slot 0, the way a
        long prompt's chunks go (prefill_chunks: each later rank runs it on the thread that serves), then forgotten
        (a block rewinds its slot to where it starts): else the first long prompt after the start-up pays for
        faulting in its activations' memory (the start-up's timing gave its heap back, and rank 0 serves from a
        thread of its own). The embedded pair over two ranks, one 2,000-token prompt after another: the first's first token 7.1 s, the next three's 5.9, 5.6
        and 5.5 (in a launch like it, the first took 27k page faults on rank 1 and 1.5 s of its time in the kernel,
        the later ones next to none: bench/README.md)."""
        drafter = getattr(self.drafter, "stage", None)  # (a model drafter's)
        rooms = [self.stage.cache.capacity, *([drafter.cache.capacity] if self.spec.k and drafter else [])]
        if self.spec.prefill_chunk < min(rooms):  # (else no prompt ever crosses in chunks)
            self.prefill_chunks([0] * (self.spec.prefill_chunk + 1), 0, slot=0, drafts=self.spec.k > 0)
            self.drafter.reset(0, 0.0, 0, slot=0)

    def prefill_chunks(self, prompt_ids: list[int], reuse: int, slot: int = 0, drafts: bool = True) -> list[int]:
        """Send all but the last `prefill_chunk` tokens of the prompt's new part as Prefill messages; returns
        the rest, which the first round carries. Each message's compute stays bounded (the later ranks'
        receives have a timeout), each later rank runs its layers over one chunk while rank 0 runs its own over the
        next, and the drafter takes in each chunk meanwhile where the stream's rounds will draft (`drafts`; else
        it takes the prompt in when they first do, if ever: a drafting step feeds whatever its slot lacks)."""
        start, pending, chunk = reuse, prompt_ids[reuse:], self.spec.prefill_chunk
        while len(pending) > chunk:
            piece, pending = pending[:chunk], pending[chunk:]
            hidden = self.stage.run(start, torch.tensor([piece], device=self.stage.device), slot=slot)
            protocol.send(self.channel, Prefill(start, hidden, slot))
            start += len(piece)
            if drafts:
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
            if not s.chain or len(self.scheduler.live) == 1:
                s.t_round = now
        decoding = sum(not all(block.stream.prefilling for block in batch) for batch in self.replies.waiting)
        for batch in self.scheduler.batches([s for s in self.live if not s.chain], decoding):
            self.send_fresh_batch(batch)
        for s in self.live:
            self.send_held(s)
        if len(self.scheduler.live) == 1:
            (s,) = self.live
            s.ahead = self.maker.use_the_wait(s, self.scheduler.depth(), self.send_batch)
        else:
            self.take_in_prompts()
        return ended + self.take_batch()

    def take_in_prompts(self) -> None:
        """Several streams: the drafter takes in each newcomer's prompt while its first round is on the way (rank 0
        waits for a reply then), so its second round drafts at once instead of prefilling the drafter first while
        the later ranks idle. (A lone stream's first wait drafts a bet, which takes the prompt in: use_the_wait.)"""
        for s in self.live:
            if s.prefilling and s.chain and s.k_now:  # (K=0: when its rounds first draft, if ever)
                self.drafter.catch_up(s.committed, slot=s.slot)
                self.t_replied = None  # not a batch's work: the next reply starts rank 0's count anew

    def settle(self) -> None:
        """Commit every reply on the way (before a message whose answer comes back behind them)."""
        while self.replies.waiting:
            self.ended += self.take_batch()

    def send_fresh_batch(self, streams: list[Stream]) -> None:
        blocks = self.maker.fresh(streams)
        for s, block in zip(streams, blocks):
            s.chain.append(block)
        self.send_batch(blocks)

    def send_batch(self, blocks: list[Block]) -> None:
        """`blocks` (of different streams) as one batch, in one frame: one forward on every later rank."""
        empty, sent_at = not self.replies.waiting, time.perf_counter()
        prompts = any(block.stream.prefilling for block in blocks)
        protocol.send_all(self.channel, [Round(block.start, block.hidden, block.drafts.tokens, block.drafts.q_ids,
                                               block.drafts.q_probs, guess=block.guess, slot=block.stream.slot,
                                               batch=len(blocks)) for block in blocks])
        for block in blocks:
            block.batch, block.into_empty_pipe = len(blocks), empty
            block.behind_no_prompt = empty and not prompts  # (a newcomer's chunks go just before its first round)
            block.sent_at, block.send_ms, block.hidden = sent_at, _ms(sent_at), None
        self.replies.expect(blocks)

    def send_held(self, s: Stream) -> None:
        """Send the chain's held blocks, oldest first, while fewer than the depth are on the way."""
        for block in s.chain:
            if block.sent_at is None and s.sent < self.scheduler.depth():
                self.send_batch([block])

    # --- the replies --------------------------------------------------------------------------
    def take_batch(self) -> list[Stream]:
        """The oldest batch's replies, each committed to its stream (and its on_round called); the streams that
        ended."""
        on_the_way, t_wait = self.replies.on_the_way, time.perf_counter()
        replies, wasted_ms = self.replies.next()
        replied, ended = time.perf_counter(), []
        waited_ms = (replied - t_wait) * 1000
        # rank 0's whole work for a batch (forwards, committing, sampling, answering clients, messages): the time
        # since the last reply came, less this wait
        busy_ms = None if self.t_replied is None else max((replied - self.t_replied) * 1000 - waited_ms, 0.0)
        self.t_replied = replied
        for i, (block, reply) in enumerate(replies):
            s = block.stream
            if reply.error is not None:  # its grammar failed on the last rank: it ends alone, nothing committed
                s.gen.error = reply.error
                ended.append(self.end(s, clean=False))
                continue
            record = self.commit_round(s, block, reply, wasted_ms, on_the_way, busy_ms if i == 0 else None)
            if i == 0:  # the batch's costs, once (scheduler: spec.in_flight=auto, how many batches), at its widest K
                self.scheduler.observe(record, waited_ms, decode=len(s.gen.rounds) > 1, alone=block.into_empty_pipe,
                                       busy_ms=busy_ms, k=max(len(b.drafts) for b, _ in replies))
            wasted_ms = 0.0
            if s.on_round is not None:
                s.on_round(record, reply)
            if s.output.done:
                ended.append(self.end(s))
        if not self.scheduler.live:  # rank 0 may idle until the next request: no batch's work
            self.t_replied = None
        return ended

    def commit_round(self, s: Stream, block: Block, reply: Reply, wasted_ms: float, on_the_way: int,
                     busy_ms: float | None = None) -> RoundRecord:
        """The oldest block of `s` answered: its tokens committed, a chain whose bet failed dropped, the record
        (`busy_ms`: rank 0's work since the reply before, for a batch's first)."""
        in_flight = s.sent
        s.chain.popleft()
        round_ms = _ms(block.sent_at)
        kept = s.commit(block, reply)
        if not s.gen.rounds:
            s.gen.ttft_s = time.perf_counter() - s.t_start
            if self.prefixes is not None:  # the prompt is in the cache: its new blocks to the writer thread
                self.prefixes.after_prefill(s.slot)
        bet = s.chain[0].holds(reply, len(block.drafts)) if s.chain else None
        lost = s.drop_chain() if bet is False or s.output.done else 0
        if not s.chain:  # else the drafter's cache runs ahead on the bets that held, exactly as it should
            self.drafter.commit(len(s.committed), slot=s.slot)
        (ahead_ms, prepared), s.ahead = s.ahead, (0.0, 0)
        record = RoundRecord(len(block.drafts), reply.accepted, kept, block.draft_ms, block.stage0_ms, round_ms,
                             reply.last_ms, s.t_round - s.t_start, block.send_ms, block.sent_at - s.t_start,
                             block.guess is not None, ahead_ms, middle_ms(reply),
                             in_flight, lost, bet, wasted_ms, prepared, s.slot, block.batch, len(self.scheduler.live),
                             on_the_way, block.drafts.looked_up, cut=block.drafts.cut, start=block.start,
                             busy_ms=busy_ms, alone=block.behind_no_prompt)
        s.gen.rounds.append(record)
        self.predict(s, record, decode=len(s.gen.rounds) > 1)
        lag = self.drafter.lacks(len(s.committed), s.slot)
        s.k_now = self.k_policy.after(s.k_now, record, decode=len(s.gen.rounds) > 1,
                                      context=len(s.gen.prompt_ids) + len(s.output.tokens), lag=lag,
                                      remaining=s.remaining, behind=self.behind(s, lag))
        return record

    def behind(self, s: Stream, lag: int) -> tuple[tuple[int, int], ...]:
        """(tokens lacking, tokens held) of each live stream but `s` whose drafter lacks a prompt (admitted at K=0),
        where `s`'s own drafter (`lag`) does too (else its K does not weigh an intake)."""
        if in_step(lag, self.k_policy.k_max):
            return ()
        lags = ((self.drafter.lacks(len(o.committed), o.slot), len(o.committed)) for o in self.live if o is not s)
        return tuple((lacking, n - lacking) for lacking, n in lags if not in_step(lacking, self.k_policy.k_max))

    def predict(self, s: Stream, record: RoundRecord, decode: bool) -> None:
        """The cost model's tokens/s beside the measured: its acceptance taken in (decode rounds), then the
        prediction at this round's K, depth and streams; measured, the stream's decode rate so far."""
        if self.predictor is None or not decode:
            return
        self.predictor.observe(record.drafted, record.accepted, record.bet)
        context = len(s.gen.prompt_ids) + len(s.output.tokens)
        record.predicted_tokens_per_s = self.predictor.tokens_per_s(record.drafted, self.scheduler.depth(), record.live,
                                                                    context, cost_model.batches_run(record))
        record.predicted_parts = self.predictor.parts_ms(record.drafted, record.batch, context)
        self.predictor.observe_parts(record)  # the next round's prediction at the pace this one ran
        decode_s = time.perf_counter() - s.t_start - s.gen.ttft_s
        record.measured_tokens_per_s = (len(s.output.tokens) - 1) / decode_s if decode_s > 0 else 0.0

    def end(self, s: Stream, clean: bool = True) -> Stream:
        """`s` is over (done, cancelled, or failed when not `clean`): its blocks dropped, its slot free at once. Its
        caches hold every committed token but the newest (the next round would feed it), or, when no round ran,
        just the reused prefix; after a failure, nothing known."""
        s.drop_chain()
        s.ended = True
        s.gen.total_s = time.perf_counter() - s.t_start
        decode = s.gen.rounds[1:]
        if self.predictor is not None and decode:  # the run's: at the acceptance and the pace it had
            streams = max(1, round(sum(r.live for r in decode) / len(decode)))
            start = len(s.gen.prompt_ids) + s.gen.rounds[0].committed
            s.gen.predicted_tokens_per_s = self.predictor.for_rounds(decode, streams, start, before=s.gen.rounds[0])
            s.gen.predicted_tokens_per_s_timed = self.predictor.for_rounds(decode, streams, start,
                                                                           before=s.gen.rounds[0], timed=True)
        if self.predictor is not None and s.gen.predicted_ttft_s:
            s.gen.predicted_held_s = self.held_s(s)
        s.newcomers = []
        holds = (s.gen.prompt_ids + s.output.tokens)[:-1] if s.gen.rounds else s.gen.prompt_ids[:s.gen.reused]
        self.scheduler.give_back(s.slot, holds if clean else None)
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
